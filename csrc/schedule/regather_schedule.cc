#include "schedule/regather_schedule.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace dcr {
namespace {

struct Placement {
  std::vector<int64_t> anchors;     // non-movable nodes, in input order
  std::vector<int64_t> need;        // per node: anchor index of first (transitive) use
  std::vector<int64_t> earliest;    // per node: first anchor index its producers allow
  std::vector<int64_t> movable_in_order;
};

Placement Analyze(const MemoryGraph& g, Span<int64_t> input_order, Span<uint8_t> movable) {
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
  for (auto it = p.movable_in_order.rbegin(); it != p.movable_in_order.rend(); ++it) {
    const int64_t v = *it;
    for (int64_t u : users[v]) p.need[v] = std::min(p.need[v], movable[u] ? p.need[u] : anchor_index[u]);
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
  return p;
}

std::vector<int64_t> BuildOrder(const Placement& p, Span<uint8_t> is_gather, int64_t distance,
                                std::vector<int64_t>* slot_of) {
  const int64_t num_anchors = static_cast<int64_t>(p.anchors.size());
  std::vector<std::vector<int64_t>> before(num_anchors + 1);
  slot_of->assign(slot_of->size(), -1);
  // Gathers first (they may move earlier), then their aliases: an alias goes at its own need,
  // but never before the slot of what it reads.
  for (int64_t v : p.movable_in_order) {
    int64_t slot = p.need[v];
    if (is_gather[v]) slot = std::max(p.earliest[v], slot - distance);
    (*slot_of)[v] = slot;
  }
  for (int64_t v : p.movable_in_order) before[(*slot_of)[v]].push_back(v);  // input order kept
  std::vector<int64_t> order;
  order.reserve(p.anchors.size() + p.movable_in_order.size());
  for (int64_t i = 0; i <= num_anchors; ++i) {
    for (int64_t v : before[i]) order.push_back(v);
    if (i < num_anchors) order.push_back(p.anchors[i]);
  }
  return order;
}

}  // namespace

RegatherSchedule ScheduleRegathers(const MemoryGraph& g, Span<int64_t> input_order,
                                   Span<uint8_t> movable, Span<uint8_t> is_gather,
                                   const ScheduleOptions& options) {
  if (movable.size != static_cast<size_t>(g.num_nodes) ||
      is_gather.size != static_cast<size_t>(g.num_nodes)) {
    throw std::invalid_argument("movable and is_gather must have num_nodes entries");
  }
  for (int64_t v = 0; v < g.num_nodes; ++v) {
    if (is_gather[v] && !movable[v])
      throw std::invalid_argument("is_gather[" + std::to_string(v) + "] set but movable is not");
  }
  RegatherSchedule s;
  s.peak_bytes_input_order = SimulateMemory(g, input_order).peak_bytes;
  const Placement p = Analyze(g, input_order, movable);
  std::vector<int64_t> slot_of(g.num_nodes, -1);
  s.order = BuildOrder(p, is_gather, 0, &slot_of);
  s.peak_bytes_no_prefetch = s.peak_bytes = SimulateMemory(g, s.order).peak_bytes;
  const double budget = options.budget_bytes < 0 ? s.peak_bytes_no_prefetch : options.budget_bytes;
  for (int64_t d = 1; d <= options.max_prefetch; ++d) {
    std::vector<int64_t> order = BuildOrder(p, is_gather, d, &slot_of);
    const double peak = SimulateMemory(g, order).peak_bytes;
    if (peak > budget) break;  // peaks only grow with d: gathers only move earlier
    s.order = std::move(order);
    s.peak_bytes = peak;
    s.prefetch_distance = d;
  }
  BuildOrder(p, is_gather, s.prefetch_distance, &slot_of);
  // Buckets: small gathers that share an insertion point.
  s.bucket_of.assign(g.num_nodes, -1);
  if (options.bucket_bytes > 0) {
    int64_t next_bucket = 0, open_slot = -2, open_bucket = -1;
    for (int64_t v : s.order) {
      if (!is_gather[v] || g.bytes[v] > options.bucket_bytes) continue;
      if (slot_of[v] != open_slot) open_slot = slot_of[v], open_bucket = next_bucket++;
      s.bucket_of[v] = open_bucket;
    }
  }
  return s;
}

}  // namespace dcr
