// Where the backward (or forward) re-gathers its ZeRO-3 parameters.
//
// Nodes are `anchors` (the graph's own work, kept in their given order) or `movable` (a
// parameter gather, the views/casts that only reshape its result, and the copies that only
// feed it: a host shard's cast and copy to the accelerator under offload_param). Each movable
// node is placed just before the first anchor that needs it (as late as possible: a gathered
// weight lives only as long as its use), then every gather is moved `d` anchors earlier
// (prefetch: its communication can overlap the preceding compute), with what feeds it, but
// never ahead of a gather issued before it. d is max_prefetch unless a budget is given
// (budget >= 0): then the largest d <= max_prefetch whose simulated peak (memsim/memory_sim.h)
// stays within it. Each d is simulated as the runtime runs it, bucketed: a bucket's members
// gathered together at its first member, its collective holding a packed buffer as large as
// its members for the length of its call; the peaks reported are those (and the peak at
// d = 0 beside them).
//
// Collective order (invariant): the calls a graph issues, on each of its groups, must be the
// same on every rank, and ranks whose batches differ in size compile graphs of other sizes.
//   - The gathers are issued by first use, ties in input order, and bucketed by first use, at
//     every d: wherever a bucket's members read graph inputs (as every parameter shard does),
//     the gather calls depend only on the anchors' input order, the gathers' bytes and keys,
//     and bucket_bytes.
//   - d itself decides where the gathers fall among the graph's other collectives (a
//     backward's reduce-scatters, which are anchors), so d must not depend on sizes either.
//     Without a budget it does not. A budget compares simulated bytes, which are this rank's
//     sizes: ranks compiled at other sizes may then choose other distances, whose
//     collectives would meet out of order, so the planning layer has the ranks agree on one
//     rank's distances and schedules again with them as max_prefetch and no budget
//     (planning/agreement.py).
//
// Bucketing (bucket_of), the one place that decides which gathers share a collective, for the
// runtime to issue each bucket as one grouped gather where its first member stands. Only
// gathers of at most bucket_bytes with equal gather_key (same group, dtypes, device: what one
// buffer can hold) share a bucket, in two passes:
//   1. gathers with one first use, the same earliest slot and one key form a group: they
//      would run back to back anyway (a linear's weight and bias, read by one op).
//   2. groups of at most bucket_bytes in all, single gathers included (a layer norm's weight,
//      each at its own first use), are packed as units in the scheduled order by PackBuckets
//      (schedule/buckets.h: at most bucket_bytes in all, issued at the first member, a member
//      only where its shard exists). A larger group, or one pass 2 leaves alone, is a bucket
//      of its own when it has several members.
// Packing groups, not only single gathers, matters: with pass 1's buckets final, a model with
// biases issued one collective per projection (Qwen2: 3 more per layer than Llama).
// Ids: pass 2's buckets, then the other groups of several members in order; buckets of one
// member are dropped (-1).
//
// Complexity O(max_prefetch * (n + m + g log g)) for g gathers. Deterministic: ties keep the
// input order.
#pragma once

#include <cstdint>
#include <vector>

#include "memsim/memory_sim.h"

namespace dcr {

// No defaults: every field comes from the caller (the Python side builds it from RematConfig,
// the single source of truth).
struct ScheduleOptions {
  ScheduleOptions(int64_t max_prefetch, double prefetch_budget_bytes, double bucket_bytes)
      : max_prefetch(max_prefetch),
        prefetch_budget_bytes(prefetch_budget_bytes),
        bucket_bytes(bucket_bytes) {}

  int64_t max_prefetch;  // in anchors; >= 0
  double prefetch_budget_bytes;  // < 0: none (d = max_prefetch)
  double bucket_bytes;   // <= 0: no bucketing
};

struct RegatherSchedule {
  std::vector<int64_t> order;       // every non-input node, bucketed: a bucket's members
                                    // consecutive at its first, feeders just before
  int64_t prefetch_distance = 0;
  double peak_bytes = 0;            // simulated, bucketed, with the chosen distance
  double peak_bytes_no_prefetch = 0;  // bucketed, at d = 0
  double peak_bytes_input_order = 0;  // the order before scheduling (no buckets)
  std::vector<int64_t> bucket_of;   // per node: its gather bucket, -1 (not a gather, or alone)
  int64_t num_buckets = 0;          // bucket ids are 0 .. num_buckets - 1
};

// `input_order` lists the non-input nodes in a valid order; movable[v] marks gathers and their
// alias chains, is_gather[v] the gathers themselves (a subset of movable), gather_key[v] a
// gather's compatibility class (read for gathers only). Throws std::invalid_argument on an
// invalid graph (MemoryGraph::Validate) or order, per-node arrays of another length, a gather
// that is not movable, or max_prefetch < 0.
RegatherSchedule ScheduleRegathers(const MemoryGraph& g, Span<int64_t> input_order,
                                   Span<uint8_t> movable, Span<uint8_t> is_gather,
                                   Span<int64_t> gather_key, const ScheduleOptions& options);

}  // namespace dcr
