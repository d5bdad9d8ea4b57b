// Memory simulation and the ZeRO-3 re-gather schedule on hand-built graphs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "memory_graph_builder.h"
#include "memsim/memory_sim.h"
#include "schedule/buckets.h"
#include "schedule/regather_schedule.h"

namespace dcr {
namespace {

struct Graph : test_support::MemoryGraphArrays {
  std::vector<uint8_t> movable, is_gather;
  std::vector<int64_t> gather_key;

  int64_t Add(double b, const std::vector<int64_t>& in, bool input = false, int64_t alias = -1) {
    movable.push_back(0), is_gather.push_back(0), gather_key.push_back(0);
    return MemoryGraphArrays::Add(b, in, input, alias);
  }
  RegatherSchedule Schedule(const std::vector<int64_t>& order, const ScheduleOptions& o) const {
    return ScheduleRegathers(View(), order, movable, is_gather, gather_key, o);
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

TEST(MemorySim, AnOpsWorkspaceCountsAtItsStepOnly) {
  Graph g;
  const int64_t x = g.Add(100, {}, true);
  const int64_t a = g.Add(10, {x});  // x dies here
  const int64_t b = g.Add(1, {a});   // a dies here
  g.keep[b] = 1;
  const std::vector<double> scratch = {0, 0, 150};  // b's op allocates and frees 150 inside
  MemoryGraph with = g.View();
  with.workspace = scratch;
  const std::vector<int64_t> order = {a, b};
  const MemoryTimeline t = SimulateMemory(with, order);
  EXPECT_DOUBLE_EQ(t.peak_bytes, 161);  // a, b and b's scratch; x freed after step 0
  EXPECT_EQ(t.peak_step, 1);
  EXPECT_DOUBLE_EQ(t.live_after[1], 1);  // the scratch is gone after its step
  EXPECT_DOUBLE_EQ(SimulateMemory(g.View(), order).peak_bytes, 110);  // none: x and a
  const std::vector<double> short_scratch = {0, 0};
  with.workspace = short_scratch;
  EXPECT_THROW(with.Validate(), std::invalid_argument);
}

TEST(MemorySim, ValidateNamesTheArrayAtFault) {
  Graph g;
  const int64_t x = g.Add(1, {}, true);
  const int64_t a = g.Add(1, {x});
  g.Add(1, {a});
  EXPECT_NO_THROW(g.View().Validate());
  auto fails = [](const MemoryGraph& bad, const std::string& what) {
    try {
      bad.Validate();
      ADD_FAILURE() << "no error for " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  MemoryGraph bad = g.View();
  bad.keep.size = 2;  // a per-node array of the wrong length
  fails(bad, "keep has 2 entries");
  bad = g.View();
  bad.alias_of.size = 1;
  fails(bad, "alias_of has 1 entries");
  bad = g.View();
  bad.edge_heads.size = 1;
  fails(bad, "different lengths");
  Graph out_of_range = g;
  out_of_range.heads[0] = 7;
  fails(out_of_range.View(), "edge 0 has a node id out of range");
  Graph later_alias = g;
  later_alias.alias_of[a] = 2;  // an alias of a later node: chains could loop
  fails(later_alias.View(), "alias_of[1] must be an earlier node or -1");
  Graph self_alias = g;
  self_alias.alias_of[a] = a;
  fails(self_alias.View(), "alias_of[1]");
  const std::vector<int64_t> order = {1, 2};
  EXPECT_THROW(SimulateMemory(later_alias.View(), order), std::invalid_argument);
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
  const RegatherSchedule s = m.g.Schedule(m.order, ScheduleOptions(0, -1, 0));
  EXPECT_DOUBLE_EQ(s.peak_bytes_input_order, 150 + 1 + 300 + 1);
  EXPECT_DOUBLE_EQ(s.peak_bytes, 150 + 1 + 100 + 1);
  const std::vector<int64_t> expected = {m.gathers[0], 7, m.gathers[1], 8, m.gathers[2], 9};
  EXPECT_EQ(s.order, expected);
  EXPECT_EQ(s.prefetch_distance, 0);
}

TEST(RegatherSchedule, PrefetchDistanceRespectsTheBudget) {
  ThreeLayers m;
  ScheduleOptions o(3, 150 + 1 + 200 + 1, 0);  // room for one extra weight in flight
  RegatherSchedule s = m.g.Schedule(m.order, o);
  EXPECT_EQ(s.prefetch_distance, 1);
  EXPECT_LE(s.peak_bytes, o.prefetch_budget_bytes);
  const std::vector<int64_t> expected = {m.gathers[0], m.gathers[1], 7, m.gathers[2], 8, 9};
  EXPECT_EQ(s.order, expected);
  // No budget: max_prefetch, whatever the sizes (the header's collective order: a distance
  // read from this rank's sizes could differ between ranks).
  o.prefetch_budget_bytes = -1;
  s = m.g.Schedule(m.order, o);
  EXPECT_EQ(s.prefetch_distance, 3);
  EXPECT_DOUBLE_EQ(s.peak_bytes, 150 + 1 + 300 + 1);  // every weight in flight at once
  EXPECT_DOUBLE_EQ(s.peak_bytes_no_prefetch, 150 + 1 + 100 + 1);
}

TEST(RegatherSchedule, BucketsSmallGathersAtOneSlot) {
  Graph g;
  const int64_t s0 = g.Add(1, {}, true), s1 = g.Add(1, {}, true), s2 = g.Add(1, {}, true);
  const int64_t w0 = g.Add(8, {s0}), w1 = g.Add(8, {s1}), w2 = g.Add(1000, {s2});
  for (int64_t w : {w0, w1, w2}) g.movable[w] = g.is_gather[w] = 1;
  const int64_t y = g.Add(1, {w0, w1, w2});
  g.keep[y] = 1;
  const std::vector<int64_t> order = {w0, w1, w2, y};
  const RegatherSchedule s = g.Schedule(order, ScheduleOptions(4, -1, 64));
  EXPECT_EQ(s.bucket_of[w0], s.bucket_of[w1]);
  EXPECT_EQ(s.bucket_of[w0], 0);
  EXPECT_EQ(s.bucket_of[w2], -1);
  EXPECT_EQ(s.num_buckets, 1);
  // Another key (another dtype or group) never shares a bucket, even at one slot.
  Graph keyed = g;
  keyed.gather_key[w1] = 1;
  EXPECT_EQ(keyed.Schedule(order, ScheduleOptions(4, -1, 64)).num_buckets, 0);
  // No bucket budget: no buckets.
  EXPECT_EQ(g.Schedule(order, ScheduleOptions(4, -1, 0)).num_buckets, 0);
}

// Small gathers at different slots (each just before its own use) are packed in order within
// the byte budget, a bucket standing at its first member; a gather whose shard is computed
// after that point starts a new bucket. Mirrors the Python test of the same name.
TEST(RegatherSchedule, PacksSmallGathersLeftAlone) {
  Graph g;
  int64_t h = g.Add(8, {}, true);
  std::vector<int64_t> shards;
  for (int i = 0; i < 4; ++i) shards.push_back(g.Add(1, {}, true));
  std::vector<int64_t> order, gathers;
  const double sizes[] = {32, 64, 8192, 32};
  int64_t late = -1;
  for (int i = 0; i < 5; ++i) {
    const int64_t shard = i < 4 ? shards[i] : late;
    const int64_t w = g.Add(i < 4 ? sizes[i] : 32, {shard});
    g.movable[w] = g.is_gather[w] = 1;
    gathers.push_back(w);
    order.push_back(w);
    h = g.Add(8, {h, w});
    order.push_back(h);
    if (late < 0) late = g.Add(4, {shards[0]}), order.push_back(late);  // after the first use
  }
  g.keep[h] = 1;
  RegatherSchedule s = g.Schedule(order, ScheduleOptions(0, -1, 1000));
  // 32 + 64 + 32 fit in 1000; 8 KB stays alone; the last one's shard (`late`) is computed
  // after the first gather, so it cannot join that bucket and is left alone.
  EXPECT_EQ(s.num_buckets, 1);
  EXPECT_EQ(s.bucket_of[gathers[0]], 0);
  EXPECT_EQ(s.bucket_of[gathers[1]], 0);
  EXPECT_EQ(s.bucket_of[gathers[2]], -1);
  EXPECT_EQ(s.bucket_of[gathers[3]], 0);
  EXPECT_EQ(s.bucket_of[gathers[4]], -1);
  s = g.Schedule(order, ScheduleOptions(0, -1, 96));  // 32 + 64, then 32 + 32 (late is ready)
  EXPECT_EQ(s.num_buckets, 2);
  EXPECT_EQ(s.bucket_of[gathers[0]], 0);
  EXPECT_EQ(s.bucket_of[gathers[1]], 0);
  EXPECT_EQ(s.bucket_of[gathers[3]], 1);
  EXPECT_EQ(s.bucket_of[gathers[4]], 1);
}

// A weight and its bias are read by one op, so they share a slot; pass 2 still packs such
// pairs of one layer into one bucket within the budget (it used to leave every pair a bucket of
// its own: one collective per projection). A pair over the budget stays one bucket of its own.
TEST(RegatherSchedule, PacksGroupsAtOneSlotAsUnits) {
  Graph g;
  int64_t h = g.Add(8, {}, true);
  std::vector<int64_t> order, weights, biases;
  for (int i = 0; i < 3; ++i) {
    const int64_t ws = g.Add(1, {}, true), bs = g.Add(1, {}, true);
    const int64_t w = g.Add(64, {ws}), b = g.Add(8, {bs});
    for (int64_t v : {w, b}) g.movable[v] = g.is_gather[v] = 1;
    weights.push_back(w);
    biases.push_back(b);
    h = g.Add(8, {h, w, b});
    order.insert(order.end(), {w, b, h});
  }
  g.keep[h] = 1;
  RegatherSchedule s = g.Schedule(order, ScheduleOptions(0, -1, 1000));
  EXPECT_EQ(s.num_buckets, 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s.bucket_of[weights[i]], 0);
    EXPECT_EQ(s.bucket_of[biases[i]], 0);
  }
  s = g.Schedule(order, ScheduleOptions(0, -1, 150));  // two pairs fit (144), the third alone
  EXPECT_EQ(s.num_buckets, 2);
  EXPECT_EQ(s.bucket_of[weights[0]], s.bucket_of[biases[1]]);
  EXPECT_EQ(s.bucket_of[weights[2]], s.bucket_of[biases[2]]);
  EXPECT_NE(s.bucket_of[weights[0]], s.bucket_of[weights[2]]);
  s = g.Schedule(order, ScheduleOptions(0, -1, 70));  // each pair (72) over the budget
  EXPECT_EQ(s.num_buckets, 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(s.bucket_of[weights[i]], s.bucket_of[biases[i]]);
}

// The peaks are those of the bucketed graph the runtime runs: a bucket's members are gathered
// together at its first member, and its collective holds a packed buffer as large as its
// members inside its call (zero3/scratch.py). Unbucketed, each 8-byte weight lives alone.
TEST(RegatherSchedule, PeaksCountTheBucketAndItsPackedBuffer) {
  Graph g;
  const int64_t s0 = g.Add(1, {}, true), s1 = g.Add(1, {}, true);
  const int64_t w0 = g.Add(8, {s0}), w1 = g.Add(8, {s1});
  for (int64_t w : {w0, w1}) g.movable[w] = g.is_gather[w] = 1;
  const int64_t y0 = g.Add(1, {w0});
  const int64_t y1 = g.Add(1, {y0, w1});
  g.keep[y1] = 1;
  const std::vector<int64_t> order = {w0, y0, w1, y1};
  const RegatherSchedule alone = g.Schedule(order, ScheduleOptions(0, -1, 0));
  const RegatherSchedule bucketed = g.Schedule(order, ScheduleOptions(0, -1, 64));
  ASSERT_EQ(bucketed.num_buckets, 1);
  EXPECT_EQ(alone.order, order);
  const std::vector<int64_t> together = {w0, w1, y0, y1};  // the bucket at its first member
  EXPECT_EQ(bucketed.order, together);
  // Both inputs and one weight at most, unbucketed: 1 + 1 + 8.
  EXPECT_DOUBLE_EQ(alone.peak_bytes, 10);
  // At the bucket: s1 (s0 was freed after its gather), both weights and their packed copy.
  EXPECT_DOUBLE_EQ(bucketed.peak_bytes, 1 + 8 + 8 + 16);
  EXPECT_DOUBLE_EQ(bucketed.peak_bytes_no_prefetch, bucketed.peak_bytes);
}

// offload_param: a host shard's copy to the accelerator feeds only its gather. It moves with
// the gather when the gather is prefetched (before, it stayed where it was and held the
// gather there), and with the bucket when the gather joins one at an earlier member.
TEST(RegatherSchedule, WhatFeedsAGatherMovesWithIt) {
  Graph g;
  const int64_t x = g.Add(1, {}, true);
  const int64_t s0 = g.Add(1, {}, true), s1 = g.Add(1, {}, true);
  const int64_t w0 = g.Add(8, {s0});
  const int64_t copy = g.Add(1, {s1});  // the host shard on the accelerator
  const int64_t w1 = g.Add(8, {copy});
  g.movable[copy] = 1;
  for (int64_t w : {w0, w1}) g.movable[w] = g.is_gather[w] = 1;
  const int64_t y0 = g.Add(1, {x, w0});
  const int64_t y1 = g.Add(1, {y0, w1});
  g.keep[y1] = 1;
  const std::vector<int64_t> order = {w0, y0, copy, w1, y1};
  RegatherSchedule s = g.Schedule(order, ScheduleOptions(1, 1e9, 0));
  EXPECT_EQ(s.prefetch_distance, 1);
  const std::vector<int64_t> prefetched = {w0, copy, w1, y0, y1};
  EXPECT_EQ(s.order, prefetched);
  s = g.Schedule(order, ScheduleOptions(0, -1, 64));  // no prefetch; one bucket at w0
  ASSERT_EQ(s.num_buckets, 1);
  EXPECT_EQ(s.bucket_of[w1], s.bucket_of[w0]);
  const std::vector<int64_t> bucketed = {copy, w0, w1, y0, y1};
  EXPECT_EQ(s.order, bucketed);
}

// The collectives a schedule issues, in order: each a gather alone or a bucket's members.
std::vector<std::vector<int64_t>> CollectiveCalls(const RegatherSchedule& s,
                                                  const std::vector<uint8_t>& is_gather) {
  std::vector<std::vector<int64_t>> calls;
  std::vector<int64_t> call_of_bucket(s.num_buckets, -1);
  for (int64_t v : s.order) {
    if (!is_gather[v]) continue;
    const int64_t b = s.bucket_of[v];
    if (b < 0) {
      calls.push_back({v});
    } else if (call_of_bucket[b] < 0) {
      call_of_bucket[b] = static_cast<int64_t>(calls.size());
      calls.push_back({v});
    } else {
      calls[call_of_bucket[b]].push_back(v);
    }
  }
  return calls;
}

// Ranks whose batches differ in size simulate different peaks and may choose different
// prefetch distances; their collectives must still be the same calls in the same order. Here
// the gathers' input order is not their use order, and at distance 2 all four would land at
// the first slot: they used to be issued there in input order and bucketed as one slot's
// group (one call at d = 2, and other calls at d = 0).
TEST(RegatherSchedule, EveryDistanceIssuesTheSameCollectives) {
  Graph g;
  int64_t h = g.Add(8, {}, true);
  std::vector<int64_t> gathers;
  for (int i = 0; i < 4; ++i) {
    const int64_t shard = g.Add(1, {}, true);
    gathers.push_back(g.Add(40, {shard}));
    g.movable[gathers.back()] = g.is_gather[gathers.back()] = 1;
  }
  std::vector<int64_t> order = {gathers[3], gathers[2], gathers[1], gathers[0]};
  std::vector<int64_t> work;
  for (int i = 0; i < 4; ++i) {  // layer i reads gather i
    h = g.Add(8, {h, gathers[i]});
    work.push_back(h);
    order.push_back(h);
  }
  g.keep[h] = 1;
  const std::vector<std::vector<int64_t>> by_use = {
      {gathers[0]}, {gathers[1]}, {gathers[2]}, {gathers[3]}};
  for (double bucket_bytes : {0.0, 64.0, 100.0}) {
    std::vector<std::vector<int64_t>> first;
    for (int64_t d = 0; d <= 3; ++d) {
      const RegatherSchedule s = g.Schedule(order, ScheduleOptions(d, 1e9, bucket_bytes));
      ASSERT_EQ(s.prefetch_distance, d);
      const auto calls = CollectiveCalls(s, g.is_gather);
      if (d == 0) first = calls;
      EXPECT_EQ(calls, first) << "distance " << d << ", bucket_bytes " << bucket_bytes;
    }
    if (bucket_bytes == 0) EXPECT_EQ(first, by_use);
    if (bucket_bytes == 100) {  // two gathers of 40 per call, by use
      const std::vector<std::vector<int64_t>> pairs = {{gathers[0], gathers[1]},
                                                       {gathers[2], gathers[3]}};
      EXPECT_EQ(first, pairs);
    }
  }
  // Prefetched, each gather still comes no later than `d` anchors before its use.
  const RegatherSchedule s = g.Schedule(order, ScheduleOptions(2, 1e9, 0));
  std::vector<int64_t> position(g.bytes.size(), -1);
  for (size_t k = 0; k < s.order.size(); ++k) position[s.order[k]] = static_cast<int64_t>(k);
  for (int i = 2; i < 4; ++i) EXPECT_LT(position[gathers[i]], position[work[i - 2]]);
}

TEST(RegatherSchedule, RejectsBadArguments) {
  ThreeLayers m;
  EXPECT_THROW(m.g.Schedule(m.order, ScheduleOptions(-1, -1, 0)), std::invalid_argument);
  Graph short_key = m.g;
  short_key.gather_key.pop_back();
  EXPECT_THROW(short_key.Schedule(m.order, ScheduleOptions(2, -1, 0)), std::invalid_argument);
  Graph unmovable = m.g;
  unmovable.movable[m.gathers[0]] = 0;
  EXPECT_THROW(unmovable.Schedule(m.order, ScheduleOptions(2, -1, 0)), std::invalid_argument);
  Graph bad_alias = m.g;
  bad_alias.alias_of[0] = 5;
  EXPECT_THROW(bad_alias.Schedule(m.order, ScheduleOptions(2, -1, 0)), std::invalid_argument);
}

std::vector<BucketCandidate> Candidates(std::vector<double> bytes) {
  std::vector<BucketCandidate> out;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int64_t p = static_cast<int64_t>(10 * i);
    out.push_back(BucketCandidate{p, bytes[i], 0, -1, 1000});  // inputs exist from the start
  }
  return out;
}

TEST(PackBuckets, GreedyInOrderWithinTheBudget) {
  const auto c = Candidates({32, 32, 64, 4096, 16});
  EXPECT_EQ(PackBuckets(c, 128, BucketSite::kFirstMember),
            (std::vector<int64_t>{0, 0, 0, -1, -1}));  // 128 full: 16 opens a bucket of one
  EXPECT_EQ(PackBuckets(c, 64, BucketSite::kFirstMember),
            (std::vector<int64_t>{0, 0, -1, -1, -1}));
  EXPECT_EQ(PackBuckets(c, 0, BucketSite::kFirstMember),
            (std::vector<int64_t>{-1, -1, -1, -1, -1}));
  EXPECT_EQ(PackBuckets(c, 4096 + 256, BucketSite::kFirstMember, 5),
            (std::vector<int64_t>{5, 5, 5, 5, 5}));  // ids start at first_id
}

TEST(PackBuckets, KeysNeverMixAndIdsFollowClosingOrder) {
  auto c = Candidates({8, 8, 8, 8, 8});
  c[1].key = c[3].key = 7;
  // key 0: {0, 2} closes at 4 (budget 16), {4} alone; key 7: {1, 3} still open at the end.
  EXPECT_EQ(PackBuckets(c, 16, BucketSite::kFirstMember),
            (std::vector<int64_t>{0, 1, 0, 1, -1}));
  c[0].key = 7;  // key 7 first: {0, 1} closes at 3; key 0: {2, 4} open; key 7: {3} alone
  EXPECT_EQ(PackBuckets(c, 16, BucketSite::kFirstMember),
            (std::vector<int64_t>{0, 0, 1, -1, 1}));
}

TEST(PackBuckets, MembersMustBeAbleToRunAtTheSite) {
  auto c = Candidates({8, 8, 8});
  c[2].ready = 15;  // its input exists only after candidate 1 (position 10)
  EXPECT_EQ(PackBuckets(c, 100, BucketSite::kFirstMember),
            (std::vector<int64_t>{0, 0, -1}));  // cannot run at position 0
  EXPECT_EQ(PackBuckets(c, 100, BucketSite::kLastMember),
            (std::vector<int64_t>{0, 0, 0}));  // runs at 20: fine
  c = Candidates({8, 8, 8});
  c[0].deadline = 15;  // read before candidate 2 (position 20)
  EXPECT_EQ(PackBuckets(c, 100, BucketSite::kLastMember),
            (std::vector<int64_t>{0, 0, -1}));
  EXPECT_EQ(PackBuckets(c, 100, BucketSite::kFirstMember),
            (std::vector<int64_t>{0, 0, 0}));
  c[2].position = 10;
  EXPECT_THROW(PackBuckets(c, 100, BucketSite::kFirstMember), std::invalid_argument);
}

// Mirrors the Python test test_reduce_scatter_buckets_respect_uses_and_budget: gradients of
// 32, 32, 64 and 16384 bytes; a bucket stands at its last member.
TEST(BucketReduceScatters, RespectUsesAndBudget) {
  // nodes: 0..3 full gradients (inputs), 4..7 their reduce-scatters, 8 a use of node 4.
  const std::vector<int64_t> candidates = {4, 5, 6, 7};
  const std::vector<double> bytes = {32, 32, 64, 16384};
  const std::vector<int64_t> keys = {0, 0, 0, 0};
  std::vector<int64_t> tails = {0, 1, 2, 3}, heads = {4, 5, 6, 7};
  EXPECT_EQ(BucketReduceScatters(8, tails, heads, candidates, bytes, keys, 128),
            (std::vector<int64_t>{0, 0, 0, -1}));
  EXPECT_EQ(BucketReduceScatters(8, tails, heads, candidates, bytes, keys, 64),
            (std::vector<int64_t>{0, 0, -1, -1}));
  EXPECT_EQ(BucketReduceScatters(8, tails, heads, candidates, bytes, keys, 0),
            (std::vector<int64_t>{-1, -1, -1, -1}));
  // rs0's shard is read (node 5) before rs1 runs: rs0 cannot wait for a bucket at rs1.
  // nodes: 0..3 inputs, 4 rs0, 5 neg(rs0), 6 rs1, 7 rs2, 8 rs3.
  const std::vector<int64_t> later = {4, 6, 7, 8};
  tails = {0, 4, 1, 2, 3}, heads = {4, 5, 6, 7, 8};
  EXPECT_EQ(BucketReduceScatters(9, tails, heads, later, bytes, keys, 128),
            (std::vector<int64_t>{-1, 0, 0, -1}));
}

TEST(BucketReduceScatters, RejectsBadArguments) {
  const std::vector<int64_t> tails = {0}, heads = {1}, one = {1}, keys = {0};
  const std::vector<double> bytes = {8};
  const std::vector<int64_t> none;
  const std::vector<double> no_bytes;
  EXPECT_THROW(BucketReduceScatters(2, tails, none, one, bytes, keys, 64), std::invalid_argument);
  EXPECT_THROW(BucketReduceScatters(2, tails, heads, one, no_bytes, keys, 64),
               std::invalid_argument);
  EXPECT_THROW(BucketReduceScatters(1, tails, heads, one, bytes, keys, 64),
               std::invalid_argument);  // edge head out of range
  const std::vector<int64_t> out = {5};
  EXPECT_THROW(BucketReduceScatters(2, tails, heads, out, bytes, keys, 64),
               std::invalid_argument);
}

TEST(RegatherSchedule, Deterministic) {
  ThreeLayers m;
  const ScheduleOptions o(4, -1, 0);
  const RegatherSchedule a = m.g.Schedule(m.order, o);
  const RegatherSchedule b = m.g.Schedule(m.order, o);
  EXPECT_EQ(a.order, b.order);
}

}  // namespace
}  // namespace dcr
