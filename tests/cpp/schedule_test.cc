// Memory simulation and the ZeRO-3 re-gather schedule on hand-built graphs.
#include <gtest/gtest.h>

#include <vector>

#include "memsim/memory_sim.h"
#include "schedule/regather_schedule.h"

namespace dcr {
namespace {

struct Graph {
  std::vector<double> bytes;
  std::vector<int64_t> alias_of, tails, heads;
  std::vector<uint8_t> is_input, persistent, keep, movable, is_gather;

  int64_t Add(double b, std::vector<int64_t> in, bool input = false, int64_t alias = -1) {
    const int64_t v = static_cast<int64_t>(bytes.size());
    bytes.push_back(alias >= 0 ? 0 : b);
    alias_of.push_back(alias);
    is_input.push_back(input), persistent.push_back(0), keep.push_back(0);
    movable.push_back(0), is_gather.push_back(0);
    for (int64_t u : in) tails.push_back(u), heads.push_back(v);
    return v;
  }
  MemoryGraph View() const {
    MemoryGraph g;
    g.num_nodes = static_cast<int64_t>(bytes.size());
    g.bytes = bytes, g.alias_of = alias_of, g.is_input = is_input;
    g.persistent = persistent, g.keep = keep, g.edge_tails = tails, g.edge_heads = heads;
    return g;
  }
};

TEST(MemorySim, FreesAtLastUseAndFollowsAliases) {
  Graph g;
  const int64_t x = g.Add(100, {}, true);
  const int64_t a = g.Add(10, {x});        // x dies here
  const int64_t v = g.Add(0, {a}, false, a);  // view of a keeps a alive
  const int64_t b = g.Add(1, {v});
  g.keep[b] = 1;
  const std::vector<int64_t> order = {a, v, b};
  const MemoryTimeline t = SimulateMemory(g.View(), order);
  EXPECT_DOUBLE_EQ(t.peak_bytes, 110);  // x and a
  EXPECT_EQ(t.peak_step, 0);
  EXPECT_DOUBLE_EQ(t.live_after[0], 10);  // x freed after its last use
  EXPECT_DOUBLE_EQ(t.live_after[1], 10);
  EXPECT_DOUBLE_EQ(t.live_after[2], 1);   // a freed after the view's last use; b kept
}

TEST(MemorySim, RejectsOrdersThatBreakDependencies) {
  Graph g;
  const int64_t x = g.Add(1, {}, true);
  const int64_t a = g.Add(1, {x});
  const int64_t b = g.Add(1, {a});
  const std::vector<int64_t> bad = {b, a};
  EXPECT_THROW(SimulateMemory(g.View(), bad), std::invalid_argument);
  const std::vector<int64_t> missing = {a};
  EXPECT_THROW(SimulateMemory(g.View(), missing), std::invalid_argument);
}

// Backward of three layers: each needs its re-gathered weight (100 bytes). Gathered up front
// (as an unscheduled graph may have them) all three weights are alive at once; just before
// use only one is.
struct ThreeLayers {
  Graph g;
  std::vector<int64_t> gathers, order;
  ThreeLayers() {
    std::vector<int64_t> shards;
    for (int i = 0; i < 3; ++i) {
      shards.push_back(g.Add(50, {}, true));
      g.persistent[shards.back()] = 1;
    }
    int64_t h = g.Add(1, {}, true);
    for (int i = 0; i < 3; ++i) {
      const int64_t w = g.Add(100, {shards[i]});
      g.movable[w] = g.is_gather[w] = 1;
      gathers.push_back(w);
    }
    std::vector<int64_t> work;
    for (int i = 0; i < 3; ++i) {
      h = g.Add(1, {h, gathers[i]});
      work.push_back(h);
    }
    g.keep[h] = 1;
    order = gathers;
    order.insert(order.end(), work.begin(), work.end());
  }
};

TEST(RegatherSchedule, PlacesEachGatherJustBeforeItsUse) {
  ThreeLayers m;
  ScheduleOptions o;
  o.max_prefetch = 0;
  const RegatherSchedule s = ScheduleRegathers(m.g.View(), m.order, m.g.movable, m.g.is_gather, o);
  EXPECT_DOUBLE_EQ(s.peak_bytes_input_order, 150 + 1 + 300 + 1);
  EXPECT_DOUBLE_EQ(s.peak_bytes, 150 + 1 + 100 + 1);
  const std::vector<int64_t> expected = {m.gathers[0], 7, m.gathers[1], 8, m.gathers[2], 9};
  EXPECT_EQ(s.order, expected);
  EXPECT_EQ(s.prefetch_distance, 0);
}

TEST(RegatherSchedule, PrefetchDistanceRespectsTheBudget) {
  ThreeLayers m;
  ScheduleOptions o;
  o.max_prefetch = 3;
  o.budget_bytes = 150 + 1 + 200 + 1;  // room for one extra weight in flight
  RegatherSchedule s = ScheduleRegathers(m.g.View(), m.order, m.g.movable, m.g.is_gather, o);
  EXPECT_EQ(s.prefetch_distance, 1);
  EXPECT_LE(s.peak_bytes, o.budget_bytes);
  const std::vector<int64_t> expected = {m.gathers[0], m.gathers[1], 7, m.gathers[2], 8, 9};
  EXPECT_EQ(s.order, expected);
  o.budget_bytes = -1;  // no more than without prefetch
  s = ScheduleRegathers(m.g.View(), m.order, m.g.movable, m.g.is_gather, o);
  EXPECT_EQ(s.prefetch_distance, 0);
}

TEST(RegatherSchedule, BucketsSmallGathersAtOneSlot) {
  Graph g;
  const int64_t s0 = g.Add(1, {}, true), s1 = g.Add(1, {}, true), s2 = g.Add(1, {}, true);
  const int64_t w0 = g.Add(8, {s0}), w1 = g.Add(8, {s1}), w2 = g.Add(1000, {s2});
  for (int64_t w : {w0, w1, w2}) g.movable[w] = g.is_gather[w] = 1;
  const int64_t y = g.Add(1, {w0, w1, w2});
  g.keep[y] = 1;
  const std::vector<int64_t> order = {w0, w1, w2, y};
  ScheduleOptions o;
  o.bucket_bytes = 64;
  const RegatherSchedule s = ScheduleRegathers(g.View(), order, g.movable, g.is_gather, o);
  EXPECT_EQ(s.bucket_of[w0], s.bucket_of[w1]);
  EXPECT_GE(s.bucket_of[w0], 0);
  EXPECT_EQ(s.bucket_of[w2], -1);
}

TEST(RegatherSchedule, Deterministic) {
  ThreeLayers m;
  ScheduleOptions o;
  const RegatherSchedule a = ScheduleRegathers(m.g.View(), m.order, m.g.movable, m.g.is_gather, o);
  const RegatherSchedule b = ScheduleRegathers(m.g.View(), m.order, m.g.movable, m.g.is_gather, o);
  EXPECT_EQ(a.order, b.order);
}

}  // namespace
}  // namespace dcr
