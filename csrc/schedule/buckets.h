// Which collectives share one call: the one bucketing rule for parameter gathers (used by
// schedule/regather_schedule.h) and gradient reduce-scatters.
//
// Why: a collective costs a fixed latency whatever its size, and layer norms and biases make
// most of the calls and few of the bytes. So small collectives of one kind (equal `key`: same
// group, dtypes, device) are packed, in graph order, into buckets of at most `bucket_bytes` in
// all. A bucket is issued at one position (its site: where its first member stood for gathers,
// which may run early; where its last member stood for reduce-scatters, which may wait), so a
// member may join only if it can run there: no earlier than its inputs exist (`ready`) and no
// later than its result is first read (`deadline`).
//
// Rule (PackBuckets): candidates are visited in order. One bucket per key is open. A candidate
// larger than the budget stays alone. Otherwise it joins its key's open bucket, unless the
// bucket's bytes would pass the budget or some member (the candidate included) could not run
// at the bucket's site; then that bucket closes and the candidate opens a new one.
//
// Ids: buckets of one member are dropped (-1: "alone"); the rest are numbered from `first_id`,
// closed buckets in the order they closed, then the still-open ones in the order their keys
// first appeared. Every rank runs this on the same arrays, so buckets (and collectives) line
// up. Complexity O(k log K) for k candidates and K keys. Deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "common/span.h"

namespace dcr {

// Where a bucket stands: at its first member (a gather issued early) or its last (a
// reduce-scatter issued once every gradient exists).
enum class BucketSite : uint8_t { kFirstMember = 0, kLastMember = 1 };

struct BucketCandidate {
  int64_t position = 0;  // in the order; strictly increasing over the candidates
  double bytes = 0;      // what it moves (the full, unsharded tensor)
  int64_t key = 0;       // only candidates with equal keys share a bucket
  int64_t ready = 0;     // earliest position it may run at (its inputs exist)
  int64_t deadline = 0;  // latest position it may run at (before its result is read)
};

// Bucket id per candidate (-1: alone). bucket_bytes <= 0: no buckets at all. Throws
// std::invalid_argument if the positions are not strictly increasing.
std::vector<int64_t> PackBuckets(Span<BucketCandidate> candidates, double bucket_bytes,
                                 BucketSite site, int64_t first_id = 0);

// Gradient reduce-scatters of a graph in its own (topological) order, so a node's id is its
// position: candidates[i] is a reduce-scatter node, bytes[i] its full gradient's size and
// keys[i] its kind. A bucket stands at its last member; a member's deadline is its first user
// (edges: producer -> consumer; a node without users has none). Returns the bucket id per
// candidate (PackBuckets, site kLastMember). Throws std::invalid_argument on arrays of unequal
// length, ids out of range or candidates not in increasing order.
std::vector<int64_t> BucketReduceScatters(int64_t num_nodes, Span<int64_t> edge_tails,
                                          Span<int64_t> edge_heads, Span<int64_t> candidates,
                                          Span<double> bytes, Span<int64_t> keys,
                                          double bucket_bytes);

}  // namespace dcr
