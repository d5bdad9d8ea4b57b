#include "schedule/regather_schedule.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "schedule/buckets.h"

namespace dcr {
namespace {

using memsim_internal::SimulateMemoryUnchecked;

struct Placement {
  std::vector<int64_t> anchors;     // non-movable nodes, in input order
  std::vector<int64_t> need;        // per node: anchor index of first (transitive) use
  std::vector<int64_t> earliest;    // per node: first anchor index its producers allow
  std::vector<int64_t> movable_in_order;
  // The gathers by first use (need), ties in input order: the order every distance issues
  // them in (the header's "collective order").
  std::vector<int64_t> gathers_in_issue_order;
  // per node: a movable non-gather whose users are all movable and lead to a gather (a host
  // shard's copy to the accelerator): it moves with the gathers it feeds
  std::vector<uint8_t> feeds_gather;
  std::vector<std::vector<int64_t>> users, producers;
};

Placement Analyze(const MemoryGraph& g, Span<int64_t> input_order, Span<uint8_t> movable,
                  Span<uint8_t> is_gather) {
  const int64_t n = g.num_nodes;
  Placement p;
  std::vector<int64_t> anchor_index(n, -1), pos(n, -1);
  for (size_t k = 0; k < input_order.size; ++k) {
    const int64_t v = input_order[k];
    pos[v] = static_cast<int64_t>(k);
    if (movable[v]) {
      p.movable_in_order.push_back(v);
    } else {
      anchor_index[v] = static_cast<int64_t>(p.anchors.size());
      p.anchors.push_back(v);
    }
  }
  std::vector<std::vector<int64_t>> users(n), producers(n);
  for (size_t i = 0; i < g.edge_tails.size; ++i) {
    users[g.edge_tails[i]].push_back(g.edge_heads[i]);
    producers[g.edge_heads[i]].push_back(g.edge_tails[i]);
  }
  const int64_t end = static_cast<int64_t>(p.anchors.size());
  p.need.assign(n, end);
  p.feeds_gather.assign(n, 0);
  for (auto it = p.movable_in_order.rbegin(); it != p.movable_in_order.rend(); ++it) {
    const int64_t v = *it;
    bool feeds = !is_gather[v] && !users[v].empty();
    for (int64_t u : users[v]) {
      p.need[v] = std::min(p.need[v], movable[u] ? p.need[u] : anchor_index[u]);
      feeds = feeds && movable[u] && (is_gather[u] || p.feeds_gather[u]);
    }
    p.feeds_gather[v] = feeds;
  }
  p.earliest.assign(n, 0);
  for (int64_t v : p.movable_in_order) {
    for (int64_t q : producers[v]) {
      if (g.is_input[q]) continue;
      if (!movable[q]) {
        p.earliest[v] = std::max(p.earliest[v], anchor_index[q] + 1);
      } else {
        p.earliest[v] = std::max(p.earliest[v], p.earliest[q]);
      }
    }
    if (p.earliest[v] > p.need[v]) {
      throw std::invalid_argument("movable node " + std::to_string(v) +
                                  " is needed before its inputs exist; the input order is invalid");
    }
  }
  for (int64_t v : p.movable_in_order) {
    if (is_gather[v]) p.gathers_in_issue_order.push_back(v);
  }
  std::stable_sort(p.gathers_in_issue_order.begin(), p.gathers_in_issue_order.end(),
                   [&](int64_t a, int64_t b) { return p.need[a] < p.need[b]; });
  p.users = std::move(users);
  p.producers = std::move(producers);
  return p;
}

std::vector<int64_t> BuildOrder(const Placement& p, Span<uint8_t> is_gather, int64_t distance) {
  const int64_t num_anchors = static_cast<int64_t>(p.anchors.size());
  std::vector<int64_t> slot(p.need.size(), -1);
  // Gathers first, in issue order: each moves `distance` anchors earlier, no earlier than its
  // inputs exist and no earlier than the gather issued before it (so the issue order holds
  // at every distance). An alias goes at its own need, never before the slot of what it
  // reads. What feeds a gather goes with the earliest of its readers (users come later in
  // the input order: a reverse pass).
  for (int64_t v : p.movable_in_order) slot[v] = p.need[v];
  int64_t floor = 0;
  for (int64_t v : p.gathers_in_issue_order) {
    floor = std::max({floor, p.earliest[v], p.need[v] - distance});
    slot[v] = floor;
  }
  for (auto it = p.movable_in_order.rbegin(); it != p.movable_in_order.rend(); ++it) {
    if (!p.feeds_gather[*it]) continue;
    for (int64_t u : p.users[*it]) slot[*it] = std::min(slot[*it], slot[u]);
  }
  // Within a slot: feeders (input order), then gathers (issue order), then aliases (input
  // order). Each reads only inputs, anchors before the slot, or what comes before it here.
  std::vector<std::vector<int64_t>> before(num_anchors + 1);
  for (int64_t v : p.movable_in_order) {
    if (p.feeds_gather[v]) before[slot[v]].push_back(v);
  }
  for (int64_t v : p.gathers_in_issue_order) before[slot[v]].push_back(v);
  for (int64_t v : p.movable_in_order) {
    if (!p.feeds_gather[v] && !is_gather[v]) before[slot[v]].push_back(v);
  }
  std::vector<int64_t> order;
  order.reserve(p.anchors.size() + p.movable_in_order.size());
  for (int64_t i = 0; i <= num_anchors; ++i) {
    for (int64_t v : before[i]) order.push_back(v);
    if (i < num_anchors) order.push_back(p.anchors[i]);
  }
  return order;
}

// Pass 1 and 2 of the header's bucketing, over the final order. Returns the number of buckets.
int64_t AssignBuckets(const MemoryGraph& g, const Placement& p, Span<int64_t> order,
                      Span<uint8_t> is_gather, Span<int64_t> gather_key, double bucket_bytes,
                      std::vector<int64_t>* bucket_of) {
  bucket_of->assign(g.num_nodes, -1);
  if (bucket_bytes <= 0) return 0;
  auto small_gather = [&](int64_t v) { return is_gather[v] && g.bytes[v] <= bucket_bytes; };
  std::vector<int64_t> position(g.num_nodes, -1);
  for (size_t k = 0; k < order.size; ++k) position[order[k]] = static_cast<int64_t>(k);
  // A gather may run no earlier than its producers (graph inputs exist before step 0: -1),
  // looking through what feeds it: that moves with it (Bucketed).
  std::vector<int64_t> ready(g.num_nodes, -1);
  for (int64_t v : order) {
    for (int64_t q : p.producers[v])
      ready[v] = std::max(ready[v], p.feeds_gather[q] ? ready[q] : position[q]);
  }
  // Pass 1: one group per (first use, earliest slot, key), its members in order; groups in
  // order of their first member. Grouped by first use rather than by slot, so that the
  // groups, like the issue order, are the same at every distance.
  struct Group {
    std::vector<int64_t> members;
    double bytes = 0;
    int64_t ready = -1;
  };
  std::map<std::tuple<int64_t, int64_t, int64_t>, size_t> group_at;
  std::vector<Group> groups;
  for (size_t k = 0; k < order.size; ++k) {
    const int64_t v = order[k];
    if (!small_gather(v)) continue;
    auto [it, fresh] =
        group_at.try_emplace({p.need[v], p.earliest[v], gather_key[v]}, groups.size());
    if (fresh) groups.emplace_back();
    Group& group = groups[it->second];
    group.members.push_back(v);
    group.bytes += g.bytes[v];
    group.ready = std::max(group.ready, ready[v]);
  }
  // Pass 2: groups within the budget are packed as units (a weight and its bias, used by one
  // op, move together into the layer's bucket).
  std::vector<BucketCandidate> units;
  std::vector<size_t> unit_group;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i].bytes > bucket_bytes) continue;
    const Group& group = groups[i];
    // Its users come after it, so the deadline never binds for a bucket at its first member.
    units.push_back(BucketCandidate{position[group.members.front()], group.bytes,
                                    gather_key[group.members.front()], group.ready,
                                    static_cast<int64_t>(order.size)});
    unit_group.push_back(i);
  }
  const std::vector<int64_t> packed = PackBuckets(units, bucket_bytes, BucketSite::kFirstMember);
  std::vector<int64_t> group_bucket(groups.size(), -1);
  int64_t next = 0;
  for (size_t u = 0; u < packed.size(); ++u) {
    group_bucket[unit_group[u]] = packed[u];
    next = std::max(next, packed[u] + 1);
  }
  // A group pass 2 left alone (or over the budget) is still one collective when it has
  // several members.
  for (size_t i = 0; i < groups.size(); ++i) {
    if (group_bucket[i] < 0 && groups[i].members.size() > 1) group_bucket[i] = next++;
    for (int64_t v : groups[i].members) (*bucket_of)[v] = group_bucket[i];
  }
  return next;
}

// `order` as the runtime runs it once bucketed (zero3/schedule.py): a bucket's members
// together where its first member stands, and what feeds a gather (a host shard's copy) just
// before the gather or bucket that reads it.
std::vector<int64_t> Bucketed(const Placement& p, const std::vector<int64_t>& order,
                              const std::vector<int64_t>& bucket_of, int64_t num_buckets) {
  std::vector<std::vector<int64_t>> members(num_buckets);
  for (int64_t v : order) {
    if (bucket_of[v] >= 0) members[bucket_of[v]].push_back(v);
  }
  std::vector<uint8_t> placed(p.feeds_gather.size(), 0);
  std::vector<int64_t> out;
  out.reserve(order.size());
  // A feeder's own feeders first (post-order): its producers are graph inputs or feeders.
  auto place_feeders = [&](int64_t v, auto&& self) -> void {
    for (int64_t q : p.producers[v]) {
      if (p.feeds_gather[q] && !placed[q]) self(q, self), placed[q] = 1, out.push_back(q);
    }
  };
  for (int64_t v : order) {
    if (p.feeds_gather[v]) continue;  // placed with the gather it feeds
    const int64_t b = bucket_of[v];
    if (b < 0) {
      place_feeders(v, place_feeders);
      out.push_back(v);
    } else if (members[b].front() == v) {
      for (int64_t m : members[b]) place_feeders(m, place_feeders);
      for (int64_t m : members[b]) out.push_back(m);
    }  // any other member went with the first
  }
  return out;
}

// The simulated peak of a Bucketed order: each bucket's collective holds a packed buffer as
// large as its members inside its call (zero3/scratch.py), counted at its last member's step,
// where the simulator has all of its outputs alive.
double BucketedPeak(const MemoryGraph& g, const std::vector<int64_t>& order,
                    const std::vector<int64_t>& bucket_of, int64_t num_buckets) {
  if (num_buckets == 0) return SimulateMemoryUnchecked(g, order).peak_bytes;
  std::vector<double> packed(num_buckets, 0.0);
  std::vector<int64_t> last(num_buckets, -1);
  for (int64_t v : order) {
    if (bucket_of[v] >= 0) packed[bucket_of[v]] += g.bytes[v], last[bucket_of[v]] = v;
  }
  std::vector<double> workspace(g.num_nodes, 0.0);
  for (size_t v = 0; v < g.workspace.size; ++v) workspace[v] = g.workspace[v];
  for (int64_t b = 0; b < num_buckets; ++b) workspace[last[b]] += packed[b];
  MemoryGraph with_buffers = g;
  with_buffers.workspace = workspace;
  return SimulateMemoryUnchecked(with_buffers, order).peak_bytes;
}

// The order, buckets and bucketed peak of prefetch distance `distance`.
struct Candidate {
  std::vector<int64_t> order, bucket_of;
  int64_t num_buckets = 0;
  double peak_bytes = 0;
};

Candidate Plan(const MemoryGraph& g, const Placement& p, Span<uint8_t> is_gather,
               Span<int64_t> gather_key, int64_t distance, double bucket_bytes) {
  Candidate c;
  const std::vector<int64_t> order = BuildOrder(p, is_gather, distance);
  c.num_buckets = AssignBuckets(g, p, order, is_gather, gather_key, bucket_bytes,
                                &c.bucket_of);
  c.order = Bucketed(p, order, c.bucket_of, c.num_buckets);
  c.peak_bytes = BucketedPeak(g, c.order, c.bucket_of, c.num_buckets);
  return c;
}

}  // namespace

RegatherSchedule ScheduleRegathers(const MemoryGraph& g, Span<int64_t> input_order,
                                   Span<uint8_t> movable, Span<uint8_t> is_gather,
                                   Span<int64_t> gather_key, const ScheduleOptions& options) {
  g.Validate();  // once: the simulations below reuse it (SimulateMemoryUnchecked)
  const size_t n = static_cast<size_t>(g.num_nodes);
  if (movable.size != n || is_gather.size != n || gather_key.size != n) {
    throw std::invalid_argument("movable, is_gather and gather_key must have num_nodes entries");
  }
  if (options.max_prefetch < 0) throw std::invalid_argument("max_prefetch must be >= 0");
  for (int64_t v = 0; v < g.num_nodes; ++v) {
    if (is_gather[v] && !movable[v])
      throw std::invalid_argument("is_gather[" + std::to_string(v) + "] set but movable is not");
  }
  RegatherSchedule s;
  s.peak_bytes_input_order = SimulateMemoryUnchecked(g, input_order).peak_bytes;
  const Placement p = Analyze(g, input_order, movable, is_gather);
  Candidate best = Plan(g, p, is_gather, gather_key, 0, options.bucket_bytes);
  s.peak_bytes_no_prefetch = best.peak_bytes;
  if (options.prefetch_budget_bytes < 0) {  // the header: max_prefetch, whatever the sizes
    if (options.max_prefetch > 0) {
      best = Plan(g, p, is_gather, gather_key, options.max_prefetch, options.bucket_bytes);
    }
    s.prefetch_distance = options.max_prefetch;
  } else {
    for (int64_t d = 1; d <= options.max_prefetch; ++d) {
      Candidate next = Plan(g, p, is_gather, gather_key, d, options.bucket_bytes);
      if (next.peak_bytes > options.prefetch_budget_bytes) break;  // gathers only move earlier
      best = std::move(next);
      s.prefetch_distance = d;
    }
  }
  s.order = std::move(best.order);
  s.bucket_of = std::move(best.bucket_of);
  s.num_buckets = best.num_buckets;
  s.peak_bytes = best.peak_bytes;
  return s;
}

}  // namespace dcr
