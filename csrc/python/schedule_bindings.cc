// Bindings of the memory simulator, the ZeRO-3 re-gather schedule and the bucketer
// (csrc/memsim, csrc/schedule). Thin: a MemoryGraph (graph_bindings.cc) and arrays in, C++
// validates and decides (with the GIL released), results out as bound classes read by
// attribute (MemoryTimeline, RegatherSchedule) or one numpy array.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "memsim/memory_sim.h"
#include "python/bound_graphs.h"
#include "python/numpy_span.h"
#include "schedule/buckets.h"
#include "schedule/collective_waits.h"
#include "schedule/regather_schedule.h"

namespace py = pybind11;

namespace dcr::python {

void BindSchedule(py::module_& m) {
  py::class_<MemoryTimeline> timeline(m, "MemoryTimeline",
                                      "What simulate_memory found (memsim/memory_sim.h).");
  timeline.def_readonly("peak_bytes", &MemoryTimeline::peak_bytes)
      .def_readonly("peak_step", &MemoryTimeline::peak_step,
                    "Index into the order; -1 if the peak is before step 0.");
  DefArray(timeline, "live_after", &MemoryTimeline::live_after,
           "float64[len(order)]: live bytes after each step.");

  m.def(
      "simulate_memory",
      [](const BoundMemoryGraph& graph, const I64Array& order) {
        py::gil_scoped_release release;
        return SimulateMemory(graph.view, AsSpan(order));
      },
      py::arg("graph"), py::arg("order"), "Memory timeline of an order: a MemoryTimeline.");

  py::class_<RegatherSchedule> schedule(
      m, "RegatherSchedule", "What schedule_regathers decided (schedule/regather_schedule.h).");
  DefArray(schedule, "order", &RegatherSchedule::order,
           "Every non-input node, in the scheduled order (int64).");
  schedule.def_readonly("prefetch_distance", &RegatherSchedule::prefetch_distance)
      .def_readonly("peak_bytes", &RegatherSchedule::peak_bytes)
      .def_readonly("peak_bytes_no_prefetch", &RegatherSchedule::peak_bytes_no_prefetch)
      .def_readonly("peak_bytes_input_order", &RegatherSchedule::peak_bytes_input_order);
  DefArray(schedule, "bucket_of", &RegatherSchedule::bucket_of,
           "Per node: its gather bucket, -1 when not a gather or alone (int64).");
  schedule.def_readonly("num_buckets", &RegatherSchedule::num_buckets);

  m.def(
      "schedule_regathers",
      [](const BoundMemoryGraph& graph, const I64Array& input_order, const U8Array& movable,
         const U8Array& is_gather, const I64Array& gather_key, int64_t max_prefetch,
         double prefetch_budget_bytes, double bucket_bytes) {
        const ScheduleOptions options(max_prefetch, prefetch_budget_bytes, bucket_bytes);
        py::gil_scoped_release release;
        return ScheduleRegathers(graph.view, AsSpan(input_order), AsSpan(movable),
                                 AsSpan(is_gather), AsSpan(gather_key), options);
      },
      py::arg("graph"), py::arg("input_order"), py::arg("movable"), py::arg("is_gather"),
      py::arg("gather_key"), py::arg("max_prefetch"), py::arg("prefetch_budget_bytes"),
      py::arg("bucket_bytes"),
      "Re-gather placement, prefetch distance and gather buckets: a RegatherSchedule "
      "(schedule/regather_schedule.h).");

  m.def(
      "bucket_reduce_scatters",
      [](int64_t num_nodes, const I64Array& tails, const I64Array& heads,
         const I64Array& candidates, const F64Array& bytes, const I64Array& keys,
         double bucket_bytes) {
        std::vector<int64_t> bucket_of;
        {
          py::gil_scoped_release release;
          bucket_of = BucketReduceScatters(num_nodes, AsSpan(tails), AsSpan(heads),
                                           AsSpan(candidates), AsSpan(bytes), AsSpan(keys),
                                           bucket_bytes);
        }
        return ToNumpy(bucket_of);
      },
      py::arg("num_nodes"), py::arg("edge_tails"), py::arg("edge_heads"), py::arg("candidates"),
      py::arg("bytes"), py::arg("keys"), py::arg("bucket_bytes"),
      "Gradient reduce-scatters of a graph (schedule/buckets.h), every argument by keyword: "
      "bucket id per candidate (int64), -1 alone.");

  py::class_<WaitPlacement> placement(
      m, "WaitPlacement", "What place_collective_waits decided (schedule/collective_waits.h).");
  DefArray(placement, "order", &WaitPlacement::order,
           "Every non-input node, waits placed (int64).");
  placement.def_readonly("distance", &WaitPlacement::distance)
      .def_readonly("peak_bytes", &WaitPlacement::peak_bytes)
      .def_readonly("peak_bytes_synchronous", &WaitPlacement::peak_bytes_synchronous)
      .def_readonly("max_in_flight", &WaitPlacement::max_in_flight);

  m.def(
      "place_collective_waits",
      [](const BoundMemoryGraph& graph, const I64Array& order, const I64Array& starts,
         const I64Array& waits, double prefetch_budget_bytes, int64_t max_in_flight) {
        py::gil_scoped_release release;
        return PlaceCollectiveWaits(graph.view, AsSpan(order), AsSpan(starts), AsSpan(waits),
                                    prefetch_budget_bytes, max_in_flight);
      },
      py::arg("graph"), py::arg("order"), py::arg("starts"), py::arg("waits"),
      py::arg("prefetch_budget_bytes"), py::arg("max_in_flight"),
      "Where each asynchronous collective is waited on, within the memory budget: a "
      "WaitPlacement (schedule/collective_waits.h).");
}

}  // namespace dcr::python
