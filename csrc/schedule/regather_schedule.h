// Where the backward (or forward) re-gathers its ZeRO-3 parameters.
//
// Nodes are `anchors` (the graph's own work, kept in their given order) or `movable` (a
// parameter gather and the views/casts that only reshape its result). Each movable node is
// placed just before the first anchor that needs it (as late as possible: a gathered weight
// lives only as long as its use), then every gather is moved `d` anchors earlier (prefetch:
// its communication can overlap the preceding compute). d is chosen with the memory simulator
// (memsim/memory_sim.h): the largest d <= max_prefetch whose simulated peak stays within the
// budget; budget < 0 means "no higher than the peak at d = 0" (prefetch for free).
//
// Bucketing: consecutive gathers at one insertion point whose results are all smaller than
// bucket_bytes are reported as one bucket (bucket_of), for the runtime to issue as one grouped
// gather.
//
// Complexity O(max_prefetch * (n + m)). Deterministic: ties keep the input order.
#pragma once

#include <cstdint>
#include <vector>

#include "memsim/memory_sim.h"

namespace dcr {

struct ScheduleOptions {
  int64_t max_prefetch = 4;   // in anchors
  double budget_bytes = -1;   // < 0: the peak without prefetch
  double bucket_bytes = 0;    // <= 0: no bucketing
};

struct RegatherSchedule {
  std::vector<int64_t> order;       // every non-input node
  int64_t prefetch_distance = 0;
  double peak_bytes = 0;            // simulated, with the chosen distance
  double peak_bytes_no_prefetch = 0;
  double peak_bytes_input_order = 0;  // the order before scheduling
  std::vector<int64_t> bucket_of;   // per node: bucket id for gathers, -1 otherwise
};

// `input_order` lists the non-input nodes in a valid order; movable[v] marks gathers and their
// alias chains, is_gather[v] the gathers themselves (a subset of movable).
RegatherSchedule ScheduleRegathers(const MemoryGraph& g, Span<int64_t> input_order,
                                   Span<uint8_t> movable, Span<uint8_t> is_gather,
                                   const ScheduleOptions& options);

}  // namespace dcr
