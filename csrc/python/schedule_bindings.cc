// Bindings of the memory simulator and the ZeRO-3 re-gather schedule (csrc/memsim, csrc/schedule).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "memsim/memory_sim.h"
#include "python/numpy_span.h"
#include "schedule/regather_schedule.h"

namespace py = pybind11;

namespace dcr::python {

namespace {
MemoryGraph MakeMemoryGraph(const F64Array& bytes, const I64Array& alias_of, const U8Array& is_input,
                            const U8Array& persistent, const U8Array& keep, const I64Array& tails,
                            const I64Array& heads) {
  const size_t n = static_cast<size_t>(bytes.size());
  for (const auto* a : {&is_input, &persistent, &keep}) {
    if (static_cast<size_t>(a->size()) != n)
      throw std::invalid_argument("every per-node array must have len(bytes) entries");
  }
  if (static_cast<size_t>(alias_of.size()) != n)
    throw std::invalid_argument("alias_of must have len(bytes) entries");
  if (tails.size() != heads.size()) throw std::invalid_argument("edge_tails/edge_heads lengths differ");
  for (py::ssize_t i = 0; i < tails.size(); ++i) {
    if (tails.data()[i] < 0 || static_cast<size_t>(tails.data()[i]) >= n ||
        heads.data()[i] < 0 || static_cast<size_t>(heads.data()[i]) >= n)
      throw std::invalid_argument("edge " + std::to_string(i) + " has a node id out of range");
  }
  for (size_t v = 0; v < n; ++v) {
    const int64_t a = alias_of.data()[v];
    if (a >= static_cast<int64_t>(v) || a < -1)
      throw std::invalid_argument("alias_of[" + std::to_string(v) + "] must be an earlier node or -1");
  }
  MemoryGraph g;
  g.num_nodes = static_cast<int64_t>(n);
  g.bytes = AsSpan(bytes), g.alias_of = AsSpan(alias_of), g.is_input = AsSpan(is_input);
  g.persistent = AsSpan(persistent), g.keep = AsSpan(keep);
  g.edge_tails = AsSpan(tails), g.edge_heads = AsSpan(heads);
  return g;
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
      "Memory timeline of an order: (peak_bytes, peak_step, live_after float64[len(order)]).");

  m.def(
      "schedule_regathers",
      [](const F64Array& bytes, const I64Array& alias_of, const U8Array& is_input,
         const U8Array& persistent, const U8Array& keep, const I64Array& tails,
         const I64Array& heads, const I64Array& input_order, const U8Array& movable,
         const U8Array& is_gather, int64_t max_prefetch, double budget_bytes, double bucket_bytes) {
        const MemoryGraph g = MakeMemoryGraph(bytes, alias_of, is_input, persistent, keep, tails, heads);
        ScheduleOptions o;
        o.max_prefetch = max_prefetch, o.budget_bytes = budget_bytes, o.bucket_bytes = bucket_bytes;
        RegatherSchedule s;
        {
          py::gil_scoped_release release;
          s = ScheduleRegathers(g, AsSpan(input_order), AsSpan(movable), AsSpan(is_gather), o);
        }
        py::dict out;
        out["order"] = ToNumpy(s.order);
        out["prefetch_distance"] = s.prefetch_distance;
        out["peak_bytes"] = s.peak_bytes;
        out["peak_bytes_no_prefetch"] = s.peak_bytes_no_prefetch;
        out["peak_bytes_input_order"] = s.peak_bytes_input_order;
        out["bucket_of"] = ToNumpy(s.bucket_of);
        return out;
      },
      "Re-gather placement, prefetch distance and buckets (see schedule/regather_schedule.h).");
}

}  // namespace dcr::python
