// Bindings of the memory simulator, the ZeRO-3 re-gather schedule and the bucketer
// (csrc/memsim, csrc/schedule). Thin: arrays in as spans, C++ validates and decides (with the
// GIL released), results out as numpy arrays or a read-only RegatherSchedule.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "memsim/memory_sim.h"
#include "python/numpy_span.h"
#include "schedule/buckets.h"
#include "schedule/collective_waits.h"
#include "schedule/regather_schedule.h"

namespace py = pybind11;

namespace dcr::python {

namespace {
MemoryGraph MakeMemoryGraph(const F64Array& bytes, const I64Array& alias_of, const U8Array& is_input,
                            const U8Array& persistent, const U8Array& keep, const I64Array& tails,
                            const I64Array& heads) {
  MemoryGraph g;
  g.num_nodes = static_cast<int64_t>(bytes.size());
  g.bytes = AsSpan(bytes), g.alias_of = AsSpan(alias_of), g.is_input = AsSpan(is_input);
  g.persistent = AsSpan(persistent), g.keep = AsSpan(keep);
  g.edge_tails = AsSpan(tails), g.edge_heads = AsSpan(heads);
  return g;  // checked by MemoryGraph::Validate in the C++ entry points
}
}  // namespace

void BindSchedule(py::module_& m) {
  m.def(
      "simulate_memory",
      [](const F64Array& bytes, const I64Array& alias_of, const U8Array& is_input,
         const U8Array& persistent, const U8Array& keep, const I64Array& tails,
         const I64Array& heads, const I64Array& order) {
        const MemoryGraph g = MakeMemoryGraph(bytes, alias_of, is_input, persistent, keep, tails, heads);
        MemoryTimeline t;
        {
          py::gil_scoped_release release;
          t = SimulateMemory(g, AsSpan(order));
        }
        return py::make_tuple(t.peak_bytes, t.peak_step, ToNumpy(t.live_after));
      },
      py::arg("bytes"), py::arg("alias_of"), py::arg("is_input"), py::arg("persistent"),
      py::arg("keep"), py::arg("edge_tails"), py::arg("edge_heads"), py::arg("order"),
      "Memory timeline of an order: (peak_bytes, peak_step, live_after float64[len(order)]).");

  py::class_<RegatherSchedule>(m, "RegatherSchedule",
                               "What schedule_regathers decided (schedule/regather_schedule.h).")
      .def_property_readonly(
          "order", [](const RegatherSchedule& s) { return ToNumpy(s.order); },
          "Every non-input node, in the scheduled order (int64).")
      .def_readonly("prefetch_distance", &RegatherSchedule::prefetch_distance)
      .def_readonly("peak_bytes", &RegatherSchedule::peak_bytes)
      .def_readonly("peak_bytes_no_prefetch", &RegatherSchedule::peak_bytes_no_prefetch)
      .def_readonly("peak_bytes_input_order", &RegatherSchedule::peak_bytes_input_order)
      .def_property_readonly(
          "bucket_of", [](const RegatherSchedule& s) { return ToNumpy(s.bucket_of); },
          "Per node: its gather bucket, -1 when not a gather or alone (int64).")
      .def_readonly("num_buckets", &RegatherSchedule::num_buckets);

  m.def(
      "schedule_regathers",
      [](const F64Array& bytes, const I64Array& alias_of, const U8Array& is_input,
         const U8Array& persistent, const U8Array& keep, const I64Array& tails,
         const I64Array& heads, const I64Array& input_order, const U8Array& movable,
         const U8Array& is_gather, const I64Array& gather_key, int64_t max_prefetch,
         double budget_bytes, double bucket_bytes) {
        const MemoryGraph g = MakeMemoryGraph(bytes, alias_of, is_input, persistent, keep, tails, heads);
        const ScheduleOptions options(max_prefetch, budget_bytes, bucket_bytes);
        py::gil_scoped_release release;
        return ScheduleRegathers(g, AsSpan(input_order), AsSpan(movable), AsSpan(is_gather),
                                 AsSpan(gather_key), options);
      },
      py::arg("bytes"), py::arg("alias_of"), py::arg("is_input"), py::arg("persistent"),
      py::arg("keep"), py::arg("edge_tails"), py::arg("edge_heads"), py::arg("input_order"),
      py::arg("movable"), py::arg("is_gather"), py::arg("gather_key"), py::arg("max_prefetch"),
      py::arg("budget_bytes"), py::arg("bucket_bytes"),
      "Re-gather placement, prefetch distance and gather buckets: a RegatherSchedule "
      "(schedule/regather_schedule.h).");

  m.def(
      "bucket_reduce_scatters",
      [](int64_t num_nodes, const I64Array& tails, const I64Array& heads,
         const I64Array& candidates, const F64Array& bytes, const I64Array& keys,
         double budget_bytes) {
        std::vector<int64_t> bucket_of;
        {
          py::gil_scoped_release release;
          bucket_of = BucketReduceScatters(num_nodes, AsSpan(tails), AsSpan(heads),
                                           AsSpan(candidates), AsSpan(bytes), AsSpan(keys),
                                           budget_bytes);
        }
        return ToNumpy(bucket_of);
      },
      py::arg("num_nodes"), py::arg("edge_tails"), py::arg("edge_heads"), py::arg("candidates"),
      py::arg("bytes"), py::arg("keys"), py::arg("budget_bytes"),
      "Gradient reduce-scatter buckets (schedule/buckets.h): bucket id per candidate, -1 alone.");

  py::class_<WaitPlacement>(m, "WaitPlacement",
                            "What place_collective_waits decided (schedule/collective_waits.h).")
      .def_property_readonly(
          "order", [](const WaitPlacement& p) { return ToNumpy(p.order); },
          "Every non-input node, waits placed (int64).")
      .def_readonly("distance", &WaitPlacement::distance)
      .def_readonly("peak_bytes", &WaitPlacement::peak_bytes)
      .def_readonly("peak_bytes_synchronous", &WaitPlacement::peak_bytes_synchronous)
      .def_readonly("max_in_flight", &WaitPlacement::max_in_flight);

  m.def(
      "place_collective_waits",
      [](const F64Array& bytes, const I64Array& alias_of, const U8Array& is_input,
         const U8Array& persistent, const U8Array& keep, const I64Array& tails,
         const I64Array& heads, const I64Array& order, const I64Array& starts,
         const I64Array& waits, double budget_bytes, int64_t max_in_flight) {
        const MemoryGraph g = MakeMemoryGraph(bytes, alias_of, is_input, persistent, keep, tails, heads);
        py::gil_scoped_release release;
        return PlaceCollectiveWaits(g, AsSpan(order), AsSpan(starts), AsSpan(waits), budget_bytes,
                                    max_in_flight);
      },
      py::arg("bytes"), py::arg("alias_of"), py::arg("is_input"), py::arg("persistent"),
      py::arg("keep"), py::arg("edge_tails"), py::arg("edge_heads"), py::arg("order"),
      py::arg("starts"), py::arg("waits"), py::arg("budget_bytes"), py::arg("max_in_flight"),
      "Where each asynchronous collective is waited on, within the memory budget: a "
      "WaitPlacement (schedule/collective_waits.h).");
}

}  // namespace dcr::python
