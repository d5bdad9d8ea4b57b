// Liveness and memory timeline of a node order: which values are alive after each step and the
// peak. The ZeRO-3 schedule (schedule/regather_schedule.h) compares candidate orders with it.
//
// Model. Executing order[k] allocates bytes[v] for its result. A value is freed right after
// the last step that reads it or any of its aliases (views share their base's storage, so
// alias_of[v] = base; aliases allocate nothing). Graph inputs are alive from the start and freed
// at their last use unless `persistent` (e.g. parameter shards: the module holds them); values
// marked `keep` (graph outputs) are never freed. This is how FX- and inductor-generated code
// releases buffers, so the simulated peak tracks the allocator's peak up to fragmentation.
// An op's scratch (`workspace`: what it allocates and frees inside its own call, as a library
// convolution's reordered weight) counts at its own step only, on top of the live values.
//
// Complexity O(n + m). Deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "common/span.h"

namespace dcr {

struct MemoryGraph {
  int64_t num_nodes = 0;
  Span<double> bytes;
  Span<int64_t> alias_of;    // base node or -1
  Span<uint8_t> is_input;    // alive before step 0
  Span<uint8_t> persistent;  // never freed (inputs held elsewhere)
  Span<uint8_t> keep;        // never freed (graph outputs)
  Span<double> workspace;    // bytes alive only while the node runs; empty: none anywhere
  Span<int64_t> edge_tails;  // producer
  Span<int64_t> edge_heads;  // consumer

  // Throws std::invalid_argument naming the array (and index) at fault unless: every per-node
  // array has num_nodes entries (workspace: num_nodes or none), edge_tails and edge_heads
  // have equal lengths and hold node ids in range, and alias_of[v] is -1 or an earlier node
  // (so alias chains end). O(n + m).
  void Validate() const;
};

struct MemoryTimeline {
  double peak_bytes = 0.0;
  int64_t peak_step = -1;            // index into order; -1 if the peak is before step 0
  std::vector<double> live_after;    // live bytes after each step
};

// Validates `g` (MemoryGraph::Validate). `order` must list every non-input node exactly once,
// producers before consumers (std::invalid_argument otherwise, naming the step).
MemoryTimeline SimulateMemory(const MemoryGraph& g, Span<int64_t> order);

// Throws std::invalid_argument unless edge_tails and edge_heads have equal lengths ("edge_tails
// and edge_heads have different lengths") and hold node ids in [0, num_nodes) ("edge i has a
// node id out of range"). The one edge-array check of MemoryGraph::Validate and
// BucketReduceScatters (schedule/buckets.h). O(m).
void ValidateEdges(int64_t num_nodes, Span<int64_t> edge_tails, Span<int64_t> edge_heads);

namespace memsim_internal {

// SimulateMemory without g.Validate(), for a caller that has validated g once and simulates
// many orders of it (ScheduleRegathers). `order` is still checked, with the same errors.
MemoryTimeline SimulateMemoryUnchecked(const MemoryGraph& g, Span<int64_t> order);

}  // namespace memsim_internal

}  // namespace dcr
