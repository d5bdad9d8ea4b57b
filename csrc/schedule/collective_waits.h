// Where an asynchronous collective is waited on: as late as the memory budget allows.
//
// A collective split into a start and a wait (a gradient reduce-scatter: its send buffer, the
// full gradient, and its output stay allocated until the wait) runs under whatever the graph
// computes between the two. Waiting later overlaps more and holds the buffers longer. The
// graph states what a collective holds by its edges: the wait reads the start's output and the
// send buffer, so the memory simulator (memsim/memory_sim.h) keeps both alive until the wait
// with no model of its own; the buffers in flight are exactly the ones a later wait keeps.
//
// Rule (PlaceCollectiveWaits). The waits are taken out of `order`; the remaining nodes keep
// their order (positions 0 .. m-1, m: the end of the graph). With distance D, wait i goes
// before the node at position clamp(p_i + 1 + D, earliest_i, latest_i), where p_i is its
// start's position, earliest_i is one past the last of its producers (it may run only once
// they exist) and latest_i the first reader of the start's output (or of an alias of it: a
// bucket's items; the aliases themselves read nothing) or of the wait's own output (nothing
// reads a collective's result before it is waited on), tightened by the
// in-flight limit: wait i comes before the start of the collective `max_in_flight` starts
// later. Waits at one position keep their starts' order. D is the largest in [0, m] whose
// simulated peak stays within prefetch_budget_bytes (< 0: no higher than with every wait right after
// its start, D = 0: overlap for free). Peaks only grow with D (waits only move later, so
// buffers only live longer): a binary search finds it.
//
// Complexity O((n + m) log n) for n nodes and m edges. Deterministic: a pure function of the
// arrays.
#pragma once

#include <cstdint>
#include <vector>

#include "memsim/memory_sim.h"

namespace dcr {

struct WaitPlacement {
  std::vector<int64_t> order;         // every non-input node, waits placed
  int64_t distance = 0;               // the chosen D
  double peak_bytes = 0;              // simulated, at D
  double peak_bytes_synchronous = 0;  // simulated, at D = 0
  int64_t max_in_flight = 0;          // most collectives started and not yet waited on
};

// `order`: every non-input node of g in a valid order (SimulateMemory's rules); starts[i] and
// waits[i]: collective i's start and wait nodes (distinct, not inputs; the wait reads the
// start). max_in_flight <= 0: no limit. Throws std::invalid_argument naming the fault: an
// invalid graph or order, arrays of unequal length, ids out of range or repeated, a wait that
// reads neither its start nor an alias of it, one that reads another wait, or one whose producers come after
// its first reader.
WaitPlacement PlaceCollectiveWaits(const MemoryGraph& g, Span<int64_t> order,
                                   Span<int64_t> starts, Span<int64_t> waits, double prefetch_budget_bytes,
                                   int64_t max_in_flight);

}  // namespace dcr
