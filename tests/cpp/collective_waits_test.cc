// Where asynchronous collectives are waited on (schedule/collective_waits.h): the buffers a
// collective holds in flight are counted until its wait, and the budget bounds how late it is.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "memory_graph_builder.h"
#include "memsim/memory_sim.h"
#include "schedule/collective_waits.h"

namespace dcr {
namespace {

struct Graph : test_support::MemoryGraphArrays {
  WaitPlacement Place(const std::vector<int64_t>& order, const std::vector<int64_t>& starts,
                      const std::vector<int64_t>& waits, double budget, int64_t limit = 0) const {
    return PlaceCollectiveWaits(View(), order, starts, waits, budget, limit);
  }
};

// A backward step: `a` makes the full gradient `f`, whose reduce-scatter starts at `s` (its
// output, the shard's gradient, is a graph output) and is waited on at `w`, which reads the
// send buffer `f` too; `b` and `c` are the rest of the backward.
struct Backward {
  Graph g;
  int64_t x, a, f, s, b, c, w;
  Backward() {
    x = g.Add(100, {}, true);
    a = g.Add(50, {x});
    f = g.Add(40, {a});
    s = g.Add(20, {f});
    b = g.Add(30, {a});
    c = g.Add(70, {b});
    w = g.Add(0, {s, f});
    g.keep[s] = g.keep[c] = 1;
  }
  std::vector<int64_t> Order() const { return {a, f, s, b, c, w}; }
};

TEST(CollectiveWaits, SendBufferLivesUntilTheWait) {
  Backward t;
  // Waited right after its start, f is freed there; waited at the end, it is alive beside c.
  const MemoryTimeline early = SimulateMemory(t.g.View(), std::vector<int64_t>{t.a, t.f, t.s, t.w, t.b, t.c});
  const MemoryTimeline late = SimulateMemory(t.g.View(), t.Order());
  EXPECT_DOUBLE_EQ(early.live_after[3], 70);  // a + s: f released by the wait
  EXPECT_DOUBLE_EQ(late.live_after[3], 90);   // f still in flight beside s and b
  EXPECT_DOUBLE_EQ(early.peak_bytes, 150);    // x and a, before the collective
  EXPECT_DOUBLE_EQ(late.peak_bytes, 160);     // f + s + b + c
}

TEST(CollectiveWaits, BudgetBoundsHowLateTheWaitIs) {
  Backward t;
  // Free overlap (budget < 0: the synchronous peak, 150): the wait may pass b but not c.
  WaitPlacement p = t.g.Place(t.Order(), {t.s}, {t.w}, -1);
  EXPECT_EQ(p.order, (std::vector<int64_t>{t.a, t.f, t.s, t.b, t.w, t.c}));
  EXPECT_EQ(p.distance, 1);
  EXPECT_DOUBLE_EQ(p.peak_bytes_synchronous, 150);
  EXPECT_DOUBLE_EQ(p.peak_bytes, 150);
  EXPECT_EQ(p.max_in_flight, 1);
  // A budget that holds everything: waited at the end of the graph.
  p = t.g.Place(t.Order(), {t.s}, {t.w}, 1e9);
  EXPECT_EQ(p.order, t.Order());
  EXPECT_DOUBLE_EQ(p.peak_bytes, 160);
  // A budget below even the synchronous peak: the synchronous placement.
  p = t.g.Place(t.Order(), {t.s}, {t.w}, 10);
  EXPECT_EQ(p.order, (std::vector<int64_t>{t.a, t.f, t.s, t.w, t.b, t.c}));
  EXPECT_EQ(p.distance, 0);
}

TEST(CollectiveWaits, NeverAfterTheFirstReadOfTheResult) {
  Backward t;
  const int64_t r = t.g.Add(1, {t.s});  // reads the shard's gradient: the wait must precede it
  t.g.keep[r] = 1;
  const WaitPlacement p = t.g.Place({t.a, t.f, t.s, t.b, r, t.c, t.w}, {t.s}, {t.w}, 1e9);
  EXPECT_EQ(p.order, (std::vector<int64_t>{t.a, t.f, t.s, t.b, t.w, r, t.c}));
}

TEST(CollectiveWaits, NeverBeforeItsOwnProducers) {
  // A bucket: the start makes (output, send rows) and the wait reads both items, made after it.
  Graph g;
  const int64_t x = g.Add(8, {}, true);
  const int64_t s = g.Add(16, {x});
  const int64_t c = g.Add(1, {x});
  const int64_t mine = g.Add(0, {s}, false, s);
  const int64_t rows = g.Add(0, {s}, false, s);
  const int64_t w = g.Add(4, {mine, rows});
  const int64_t item = g.Add(0, {w}, false, w);
  g.keep[item] = g.keep[c] = 1;
  const std::vector<int64_t> order = {s, c, mine, rows, w, item};
  // Synchronous (a budget below every peak) would want the wait right after the start, before
  // c; it goes after the items it reads. Late (any budget), it still precedes its reader.
  EXPECT_EQ(g.Place(order, {s}, {w}, 1).order, order);
  EXPECT_EQ(g.Place(order, {s}, {w}, 1e9).order, order);
}

TEST(CollectiveWaits, InFlightLimit) {
  // Three collectives started one after another, each on its own gradient, waited at the end.
  Graph g;
  const int64_t x = g.Add(1, {}, true);
  std::vector<int64_t> starts, waits, order;
  for (int i = 0; i < 3; ++i) {
    const int64_t f = g.Add(4, {x});
    const int64_t s = g.Add(2, {f});
    g.keep[s] = 1;
    order.push_back(f), order.push_back(s), starts.push_back(s);
  }
  for (int i = 0; i < 3; ++i) {
    waits.push_back(g.Add(0, {starts[i], starts[i] - 1}));
    order.push_back(waits.back());
  }
  EXPECT_EQ(g.Place(order, starts, waits, 1e9).max_in_flight, 3);
  const WaitPlacement one = g.Place(order, starts, waits, 1e9, 1);
  EXPECT_EQ(one.max_in_flight, 1);
  EXPECT_EQ(one.order, (std::vector<int64_t>{1, 2, 3, waits[0], 4, 5, waits[1], 6, waits[2]}));
  EXPECT_EQ(g.Place(order, starts, waits, 1e9, 2).max_in_flight, 2);
}

TEST(CollectiveWaits, RejectsBadArguments) {
  Backward t;
  auto fails = [&](const std::vector<int64_t>& order, const std::vector<int64_t>& starts,
                   const std::vector<int64_t>& waits, const std::string& what) {
    try {
      t.g.Place(order, starts, waits, -1);
      ADD_FAILURE() << "no error, expected: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  fails(t.Order(), {t.s}, {}, "one entry per collective");
  fails(t.Order(), {t.s}, {99}, "waits[0] is out of range");
  fails(t.Order(), {t.x}, {t.w}, "starts[0] is a graph input");
  fails(t.Order(), {t.s}, {t.s}, "waits[0] repeats a node");
  fails(t.Order(), {t.b}, {t.w}, "waits[0] does not read its start");
  fails({t.a, t.f, t.w, t.s, t.b, t.c}, {t.s}, {t.w}, "before its input");  // the order itself
}

TEST(CollectiveWaits, Deterministic) {
  Backward t;
  const WaitPlacement p = t.g.Place(t.Order(), {t.s}, {t.w}, -1);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(t.g.Place(t.Order(), {t.s}, {t.w}, -1).order, p.order);
}

}  // namespace
}  // namespace dcr
