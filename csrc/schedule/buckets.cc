#include "schedule/buckets.h"

#include <algorithm>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>

#include "memsim/memory_sim.h"

namespace dcr {
namespace {

struct OpenBucket {
  std::vector<size_t> members;  // candidate indices
  double bytes = 0;
  int64_t ready = std::numeric_limits<int64_t>::min();     // max over members
  int64_t deadline = std::numeric_limits<int64_t>::max();  // min over members
};

// Whether `c` may join `b`: the bucket stays within budget and every member can run at the
// bucket's site once `c` is in.
bool CanJoin(const OpenBucket& b, const BucketCandidate& c, int64_t first_position,
             double bucket_bytes, BucketSite site) {
  if (b.bytes + c.bytes > bucket_bytes) return false;
  const int64_t at = site == BucketSite::kFirstMember ? first_position : c.position;
  return std::max(b.ready, c.ready) <= at && at <= std::min(b.deadline, c.deadline);
}

}  // namespace

std::vector<int64_t> PackBuckets(Span<BucketCandidate> candidates, double bucket_bytes,
                                 BucketSite site, int64_t first_id) {
  std::vector<int64_t> bucket_of(candidates.size, -1);
  for (size_t i = 1; i < candidates.size; ++i) {
    if (candidates[i].position <= candidates[i - 1].position) {
      throw std::invalid_argument("bucket candidate " + std::to_string(i) +
                                  " does not come after the one before it");
    }
  }
  if (bucket_bytes <= 0) return bucket_of;
  std::map<int64_t, OpenBucket> open;  // by key
  std::vector<int64_t> key_order;      // keys in order of first appearance
  std::vector<std::vector<size_t>> done;
  for (size_t i = 0; i < candidates.size; ++i) {
    const BucketCandidate& c = candidates[i];
    if (c.bytes > bucket_bytes) continue;
    auto [it, fresh] = open.try_emplace(c.key);
    if (fresh) key_order.push_back(c.key);
    OpenBucket& b = it->second;
    if (!b.members.empty() &&
        !CanJoin(b, c, candidates[b.members.front()].position, bucket_bytes, site)) {
      done.push_back(std::move(b.members));
      b = OpenBucket();
    }
    b.members.push_back(i);
    b.bytes += c.bytes;
    b.ready = std::max(b.ready, c.ready);
    b.deadline = std::min(b.deadline, c.deadline);
  }
  for (int64_t key : key_order) done.push_back(std::move(open[key].members));
  int64_t next = first_id;
  for (const auto& members : done) {
    if (members.size() < 2) continue;
    for (size_t i : members) bucket_of[i] = next;
    ++next;
  }
  return bucket_of;
}

std::vector<int64_t> BucketReduceScatters(int64_t num_nodes, Span<int64_t> edge_tails,
                                          Span<int64_t> edge_heads, Span<int64_t> candidates,
                                          Span<double> bytes, Span<int64_t> keys,
                                          double bucket_bytes) {
  ValidateEdges(num_nodes, edge_tails, edge_heads);
  if (bytes.size != candidates.size || keys.size != candidates.size) {
    throw std::invalid_argument("candidates, bytes and keys must have the same length");
  }
  auto in_range = [num_nodes](int64_t v) { return v >= 0 && v < num_nodes; };
  std::vector<int64_t> first_user(std::max<int64_t>(num_nodes, 0),
                                  std::numeric_limits<int64_t>::max());
  for (size_t i = 0; i < edge_tails.size; ++i) {
    first_user[edge_tails[i]] = std::min(first_user[edge_tails[i]], edge_heads[i]);
  }
  std::vector<BucketCandidate> packed(candidates.size);
  for (size_t i = 0; i < candidates.size; ++i) {
    const int64_t v = candidates[i];
    if (!in_range(v)) {
      throw std::invalid_argument("candidate " + std::to_string(i) + " is not a node id");
    }
    // Issued at or after its own position: its inputs exist there.
    packed[i] = BucketCandidate{v, bytes[i], keys[i], v, first_user[v]};
  }
  return PackBuckets(packed, bucket_bytes, BucketSite::kLastMember);
}

}  // namespace dcr
