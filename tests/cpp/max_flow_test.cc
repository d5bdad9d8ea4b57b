// Tests of the exact min-cut solver (maxflow/max_flow.h) and node splitting (node_split.h):
// hand-built cases, input validation, brute force over every cut of small random graphs, and
// Boykov-Kolmogorov vs Dinic on larger random DAGs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "maxflow/max_flow.h"
#include "maxflow/node_split.h"

namespace dcr {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
const MaxFlowAlgorithm kAlgorithms[] = {MaxFlowAlgorithm::kBoykovKolmogorov,
                                        MaxFlowAlgorithm::kDinic};

struct Graph {
  int64_t num_nodes = 0;
  std::vector<int64_t> tails, heads;
  std::vector<double> capacities;

  void Add(int64_t u, int64_t v, double c) {
    tails.push_back(u);
    heads.push_back(v);
    capacities.push_back(c);
  }
};

MinCutResult Solve(const Graph& g, int64_t s, int64_t t,
                   MaxFlowAlgorithm algorithm = MaxFlowAlgorithm::kBoykovKolmogorov,
                   CutSide side = CutSide::kSourceMinimal) {
  return MinStCut(g.num_nodes, g.tails, g.heads, g.capacities, s, t, algorithm, side);
}

// Capacity of the cut whose source side is `side` (arcs leaving it), +inf if any is infinite.
double CutCapacity(const Graph& g, const std::vector<uint8_t>& side) {
  double total = 0.0;
  for (size_t i = 0; i < g.tails.size(); ++i) {
    if (side[g.tails[i]] && !side[g.heads[i]]) total += g.capacities[i];
  }
  return total;
}

std::vector<int64_t> ArcsLeaving(const Graph& g, const std::vector<uint8_t>& side) {
  std::vector<int64_t> arcs;
  for (size_t i = 0; i < g.tails.size(); ++i) {
    if (side[g.tails[i]] && !side[g.heads[i]]) arcs.push_back(static_cast<int64_t>(i));
  }
  return arcs;
}

// Checks the invariants every returned cut must satisfy, whatever the graph.
void ExpectValidCut(const Graph& g, int64_t s, int64_t t, const MinCutResult& cut) {
  ASSERT_EQ(cut.source_side.size(), static_cast<size_t>(g.num_nodes));
  EXPECT_EQ(cut.source_side[s], 1);
  EXPECT_EQ(cut.source_side[t], 0);
  EXPECT_EQ(CutCapacity(g, cut.source_side), cut.value);
  EXPECT_EQ(ArcsLeaving(g, cut.source_side), cut.cut_arcs);
  EXPECT_EQ(cut.flow_value, cut.value);  // integer capacities: exact
}

// ---------------------------------------------------------------------------------------------
// Hand cases.

TEST(MaxFlow, SingleArc) {
  Graph g{2};
  g.Add(0, 1, 7.0);
  for (MaxFlowAlgorithm alg : kAlgorithms) {
    MinCutResult cut = Solve(g, 0, 1, alg);
    EXPECT_EQ(cut.value, 7.0);
    EXPECT_EQ(cut.cut_arcs, std::vector<int64_t>{0});
    ExpectValidCut(g, 0, 1, cut);
  }
}

// A chain of equal arcs: every arc is a minimum cut; the two ends of the lattice are its first
// and its last arc.
TEST(MaxFlow, CutSidePicksAnEndOfTheChain) {
  Graph g{4};
  g.Add(0, 1, 3.0);
  g.Add(1, 2, 3.0);
  g.Add(2, 3, 3.0);
  for (MaxFlowAlgorithm alg : kAlgorithms) {
    const MinCutResult near = Solve(g, 0, 3, alg, CutSide::kSourceMinimal);
    const MinCutResult far = Solve(g, 0, 3, alg, CutSide::kSinkMinimal);
    ExpectValidCut(g, 0, 3, near);
    ExpectValidCut(g, 0, 3, far);
    EXPECT_EQ(near.cut_arcs, std::vector<int64_t>{0});
    EXPECT_EQ(far.cut_arcs, std::vector<int64_t>{2});
    EXPECT_EQ(far.source_side, (std::vector<uint8_t>{1, 1, 1, 0}));
    EXPECT_EQ(near.value, far.value);
  }
}

TEST(MaxFlow, ParallelPathsAddUp) {
  // Three disjoint s-t paths with bottlenecks 2, 5 and 1, plus a parallel duplicate arc.
  Graph g{5};
  g.Add(0, 1, 9.0);
  g.Add(1, 4, 2.0);  // path 1 bottleneck
  g.Add(0, 2, 5.0);  // path 2 bottleneck
  g.Add(2, 4, 8.0);
  g.Add(0, 3, 1.0);  // path 3 bottleneck (split over two parallel arcs below)
  g.Add(3, 4, 0.5);
  g.Add(3, 4, 0.5);
  for (MaxFlowAlgorithm alg : kAlgorithms) {
    MinCutResult cut = Solve(g, 0, 4, alg);
    EXPECT_EQ(cut.value, 8.0);
    ExpectValidCut(g, 0, 4, cut);
    // Source-minimal cut: only 0->1 keeps residual capacity, so S = {0, 1}.
    EXPECT_EQ(cut.source_side, (std::vector<uint8_t>{1, 1, 0, 0, 0}));
    EXPECT_EQ(cut.cut_arcs, (std::vector<int64_t>{1, 2, 4}));
  }
}

TEST(MaxFlow, ZeroCapacitiesNeverCarryFlow) {
  Graph g{4};
  g.Add(0, 1, 0.0);
  g.Add(1, 3, 10.0);
  g.Add(0, 2, 3.0);
  g.Add(2, 3, 0.0);
  g.Add(2, 1, 2.0);
  for (MaxFlowAlgorithm alg : kAlgorithms) {
    MinCutResult cut = Solve(g, 0, 3, alg);
    EXPECT_EQ(cut.value, 2.0);
    ExpectValidCut(g, 0, 3, cut);
    // The saturated arc is 2 -> 1; zero arcs 0->1 and 2->3 cross the cut at no cost.
    EXPECT_EQ(cut.source_side, (std::vector<uint8_t>{1, 0, 1, 0}));
    EXPECT_EQ(cut.cut_arcs, (std::vector<int64_t>{0, 3, 4}));
  }
}

TEST(MaxFlow, InfiniteArcsMixedWithFinite) {
  // No s-t path is all +inf, but the +inf arcs constrain the cut: s -inf-> a keeps a on the
  // source side, b -inf-> t keeps b on the sink side, and c -inf-> b then keeps c there too.
  Graph g{6};  // s=0, a=1, b=2, c=3, d=4, t=5
  g.Add(0, 1, kInf);
  g.Add(1, 2, 3.0);
  g.Add(2, 5, kInf);
  g.Add(0, 3, 4.0);
  g.Add(3, 2, kInf);
  g.Add(3, 4, kInf);
  g.Add(4, 5, 1.0);
  g.Add(1, 3, 6.0);
  // So S = {s, a} (+ optionally d, which only adds d->t): a->b + s->c + a->c = 3 + 4 + 6.
  for (MaxFlowAlgorithm alg : kAlgorithms) {
    MinCutResult cut = Solve(g, 0, 5, alg);
    EXPECT_EQ(cut.value, 13.0);
    EXPECT_FALSE(std::isinf(cut.flow_value));
    ExpectValidCut(g, 0, 5, cut);
    EXPECT_EQ(cut.source_side, (std::vector<uint8_t>{1, 1, 0, 0, 0, 0}));
  }
}

TEST(MaxFlow, InfiniteArcsAroundAFiniteBottleneck) {
  // s -inf-> 1 -inf-> 2 -5-> 3 -inf-> t, plus 1 -inf-> 4 -2-> 3: flow 7 through two finite arcs.
  Graph g{6};
  g.Add(0, 1, kInf);
  g.Add(1, 2, kInf);
  g.Add(2, 3, 5.0);
  g.Add(3, 5, kInf);
  g.Add(1, 4, kInf);
  g.Add(4, 3, 2.0);
  for (MaxFlowAlgorithm alg : kAlgorithms) {
    MinCutResult cut = Solve(g, 0, 5, alg);
    EXPECT_EQ(cut.value, 7.0);
    EXPECT_EQ(cut.cut_arcs, (std::vector<int64_t>{2, 5}));
    ExpectValidCut(g, 0, 5, cut);
  }
}

TEST(MaxFlow, SinkUnreachableGivesZero) {
  Graph g{5};
  g.Add(0, 1, 4.0);
  g.Add(1, 2, kInf);
  g.Add(3, 4, 6.0);  // t = 4 is only reachable from 3, which s cannot reach
  g.Add(4, 0, 1.0);
  for (MaxFlowAlgorithm alg : kAlgorithms) {
    MinCutResult cut = Solve(g, 0, 4, alg);
    EXPECT_EQ(cut.value, 0.0);
    EXPECT_EQ(cut.flow_value, 0.0);
    EXPECT_TRUE(cut.cut_arcs.empty());
    EXPECT_EQ(cut.source_side, (std::vector<uint8_t>{1, 1, 1, 0, 0}));
  }
}

TEST(MaxFlow, NoArcsAtAll) {
  Graph g{3};
  MinCutResult cut = Solve(g, 2, 0);
  EXPECT_EQ(cut.value, 0.0);
  EXPECT_EQ(cut.source_side, (std::vector<uint8_t>{0, 0, 1}));
}

TEST(MaxFlow, SelfLoopsAreIgnored) {
  Graph g{3};
  g.Add(0, 0, 5.0);
  g.Add(0, 1, 2.0);
  g.Add(1, 1, kInf);
  g.Add(1, 2, 3.0);
  MinCutResult cut = Solve(g, 0, 2);
  EXPECT_EQ(cut.value, 2.0);
  ExpectValidCut(g, 0, 2, cut);
}

// ---------------------------------------------------------------------------------------------
// The seeds' example: y = cos(cos(a + b + c + d)). Forward: inputs a, b, c, d (primal), sum,
// cos1 = cos(sum), cos2 = cos(cos1). Backward of cos2 needs its input cos1, backward of cos1
// needs its input sum. With the fusible cost model (materialized values cost their bytes,
// values consumed only by fusible pointwise ops cost 2x), saving the single sum tensor and
// recomputing cos1 from it in the backward is cheapest: cheaper than saving a..d (4 tensors)
// or both sum and cos1.
TEST(NodeSplit, CosCosSumSavesOnlyTheSum) {
  enum : int64_t { a, b, c, d, sum, cos1, cos2, tangent, grad_cos1, grad_sum, kNumNodes };
  const double bytes = 4096.0;
  std::vector<double> costs(kNumNodes, bytes);
  costs[sum] = costs[cos1] = costs[cos2] = 2 * bytes;  // pointwise: fusible, 2x
  std::vector<int64_t> tails, heads;
  auto edge = [&](int64_t u, int64_t v) {
    tails.push_back(u);
    heads.push_back(v);
  };
  for (int64_t in : {a, b, c, d}) edge(in, sum);
  edge(sum, cos1);
  edge(cos1, cos2);
  edge(cos1, grad_cos1);  // d cos2 / d cos1 = -sin(cos1)
  edge(tangent, grad_cos1);
  edge(sum, grad_sum);  // d cos1 / d sum = -sin(sum)
  edge(grad_cos1, grad_sum);
  const std::vector<int64_t> primals = {a, b, c, d};
  const std::vector<int64_t> backward = {tangent, grad_cos1, grad_sum};

  SplitNetwork net = BuildSplitNetwork(costs, tails, heads, primals, backward);
  EXPECT_EQ(net.num_nodes, 2 * kNumNodes + 2);
  EXPECT_EQ(net.source, 2 * kNumNodes);
  EXPECT_EQ(net.sink, 2 * kNumNodes + 1);
  ASSERT_EQ(net.tails.size(), kNumNodes + tails.size() + primals.size() + backward.size());
  for (int64_t v = 0; v < kNumNodes; ++v) {
    EXPECT_EQ(net.tails[v], SplitIn(v));
    EXPECT_EQ(net.heads[v], SplitOut(v));
    EXPECT_EQ(net.capacities[v], costs[v]);
  }
  for (size_t i = kNumNodes; i < net.capacities.size(); ++i) EXPECT_TRUE(std::isinf(net.capacities[i]));

  for (MaxFlowAlgorithm alg : kAlgorithms) {
    MinCutResult cut = MinStCut(net.num_nodes, net.tails, net.heads, net.capacities,
                                net.source, net.sink, alg);
    EXPECT_EQ(CutNodes(cut, kNumNodes), std::vector<int64_t>{sum});
    EXPECT_EQ(cut.value, 2 * bytes);
  }
}

TEST(NodeSplit, RejectsBadInput) {
  const std::vector<double> costs = {1.0, 1.0};
  const std::vector<int64_t> zero = {0}, one = {1}, two = {2}, none;
  EXPECT_THROW(BuildSplitNetwork(costs, zero, two, zero, one), std::invalid_argument);
  EXPECT_THROW(BuildSplitNetwork(costs, zero, none, zero, one), std::invalid_argument);
  EXPECT_THROW(BuildSplitNetwork(costs, zero, one, two, one), std::invalid_argument);
  EXPECT_THROW(BuildSplitNetwork(costs, zero, one, zero, two), std::invalid_argument);
  const std::vector<double> negative = {1.0, -1.0}, nan = {std::nan(""), 1.0};
  EXPECT_THROW(BuildSplitNetwork(negative, zero, one, zero, one), std::invalid_argument);
  EXPECT_THROW(BuildSplitNetwork(nan, zero, one, zero, one), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Unbounded cuts and bad input.

void ExpectInfinitePath(const Graph& g, int64_t s, int64_t t, const std::vector<int64_t>& path) {
  ASSERT_GE(path.size(), 2u);
  EXPECT_EQ(path.front(), s);
  EXPECT_EQ(path.back(), t);
  for (size_t k = 0; k + 1 < path.size(); ++k) {
    bool found = false;
    for (size_t i = 0; i < g.tails.size(); ++i) {
      found |= g.tails[i] == path[k] && g.heads[i] == path[k + 1] && std::isinf(g.capacities[i]);
    }
    EXPECT_TRUE(found) << "no +inf arc " << path[k] << " -> " << path[k + 1];
  }
}

TEST(MaxFlow, UnboundedCutThrowsWithPath) {
  Graph g{6};
  g.Add(0, 1, kInf);
  g.Add(1, 2, 5.0);  // finite, so 0-1-2-5 is not an infinite path
  g.Add(2, 5, kInf);
  g.Add(1, 3, kInf);
  g.Add(3, 4, kInf);
  g.Add(4, 2, kInf);
  for (MaxFlowAlgorithm alg : kAlgorithms) {
    try {
      Solve(g, 0, 5, alg);
      FAIL() << "expected UnboundedCutError";
    } catch (const UnboundedCutError& e) {
      EXPECT_EQ(e.path(), (std::vector<int64_t>{0, 1, 3, 4, 2, 5}));
      ExpectInfinitePath(g, 0, 5, e.path());
      EXPECT_NE(std::string(e.what()).find("0 -> 1 -> 3 -> 4 -> 2 -> 5"), std::string::npos);
    }
  }
}

TEST(MaxFlow, DirectInfiniteArcIsUnbounded) {
  Graph g{2};
  g.Add(0, 1, kInf);
  EXPECT_THROW(Solve(g, 0, 1), UnboundedCutError);
  // The reverse direction is fine: nothing leaves the source.
  EXPECT_EQ(Solve(g, 1, 0).value, 0.0);
}

void ExpectInvalid(const Graph& g, int64_t s, int64_t t, const std::string& fragment) {
  try {
    Solve(g, s, t);
    ADD_FAILURE() << "expected std::invalid_argument mentioning " << fragment;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message: " << e.what();
  }
}

TEST(MaxFlow, RejectsBadInput) {
  Graph ok{3};
  ok.Add(0, 1, 1.0);
  ok.Add(1, 2, 2.0);
  ok.Add(0, 2, 3.0);

  Graph negative = ok;
  negative.capacities[2] = -1.0;
  ExpectInvalid(negative, 0, 2, "capacities[2]");
  Graph nan = ok;
  nan.capacities[1] = std::nan("");
  ExpectInvalid(nan, 0, 2, "capacities[1] is NaN");
  Graph negative_inf = ok;
  negative_inf.capacities[0] = -kInf;
  ExpectInvalid(negative_inf, 0, 2, "capacities[0]");
  Graph bad_tail = ok;
  bad_tail.tails[1] = 3;
  ExpectInvalid(bad_tail, 0, 2, "tails[1] = 3 is out of range");
  Graph bad_head = ok;
  bad_head.heads[2] = -1;
  ExpectInvalid(bad_head, 0, 2, "heads[2] = -1 is out of range");
  ExpectInvalid(ok, 1, 1, "source and sink must differ");
  ExpectInvalid(ok, 3, 1, "source = 3");
  ExpectInvalid(ok, 0, -1, "sink = -1");
  Graph short_heads = ok;
  short_heads.heads.pop_back();
  ExpectInvalid(short_heads, 0, 2, "one length");
  Graph short_caps = ok;
  short_caps.capacities.pop_back();
  ExpectInvalid(short_caps, 0, 2, "one length");
  Graph one_node{1};
  ExpectInvalid(one_node, 0, 1, "num_nodes");
}

// ---------------------------------------------------------------------------------------------
// Random graphs against brute force.

// Small integer capacities, inf_percent % of them +inf and 10% zero; portable (raw mt19937_64
// output, no std distributions, so every platform draws the same graphs).
Graph RandomGraph(std::mt19937_64& rng, int64_t n, size_t m, uint64_t inf_percent) {
  Graph g{n};
  for (size_t i = 0; i < m; ++i) {
    const int64_t u = static_cast<int64_t>(rng() % n), v = static_cast<int64_t>(rng() % n);
    const uint64_t kind = rng() % 100;
    const double c = kind < inf_percent         ? kInf
                     : kind < inf_percent + 10 ? 0.0
                                               : static_cast<double>(1 + rng() % 9);
    g.Add(u, v, c);
  }
  return g;
}

struct BruteForce {
  double value = kInf;
  // Intersection of the source sides of all minimum cuts: the source-minimal minimum cut,
  // which is exactly the set reachable from s in the residual graph of any maximum flow.
  std::vector<uint8_t> minimal_side;
  // Union of the source sides of all minimum cuts: the sink-minimal minimum cut, the
  // complement of the set that reaches t in the residual graph of any maximum flow.
  std::vector<uint8_t> maximal_side;
};

BruteForce EnumerateCuts(const Graph& g, int64_t s, int64_t t) {
  const int64_t n = g.num_nodes;
  std::vector<int64_t> free_nodes;
  for (int64_t v = 0; v < n; ++v)
    if (v != s && v != t) free_nodes.push_back(v);
  BruteForce best;
  std::vector<uint8_t> side(n);
  for (uint64_t mask = 0; mask < (uint64_t{1} << free_nodes.size()); ++mask) {
    std::fill(side.begin(), side.end(), 0);
    side[s] = 1;
    for (size_t k = 0; k < free_nodes.size(); ++k) side[free_nodes[k]] = (mask >> k) & 1;
    const double value = CutCapacity(g, side);
    if (value < best.value) {
      best.value = value;
      best.minimal_side = side;
      best.maximal_side = side;
    } else if (value == best.value && !std::isinf(value)) {
      for (int64_t v = 0; v < n; ++v) best.minimal_side[v] &= side[v];
      for (int64_t v = 0; v < n; ++v) best.maximal_side[v] |= side[v];
    }
  }
  return best;
}

TEST(MaxFlowRandom, MatchesBruteForceOnSmallGraphs) {
  int bounded = 0, unbounded = 0;
  for (uint64_t seed = 1; seed <= 1000; ++seed) {
    std::mt19937_64 rng(seed);
    const int64_t n = 2 + static_cast<int64_t>(rng() % 13);  // 2..14 nodes
    const size_t m = static_cast<size_t>(rng() % (3 * n + 1));
    const Graph g = RandomGraph(rng, n, m, 20);
    const int64_t s = static_cast<int64_t>(rng() % n);
    const int64_t t = (s + 1 + static_cast<int64_t>(rng() % (n - 1))) % n;
    SCOPED_TRACE("seed " + std::to_string(seed) + ", n " + std::to_string(n));
    const BruteForce expected = EnumerateCuts(g, s, t);
    for (MaxFlowAlgorithm alg : kAlgorithms) {
      if (std::isinf(expected.value)) {
        try {
          Solve(g, s, t, alg);
          ADD_FAILURE() << "every cut is infinite, expected UnboundedCutError";
        } catch (const UnboundedCutError& e) {
          ExpectInfinitePath(g, s, t, e.path());
        }
        continue;
      }
      const MinCutResult cut = Solve(g, s, t, alg);
      EXPECT_EQ(cut.value, expected.value);
      ExpectValidCut(g, s, t, cut);
      EXPECT_EQ(cut.source_side, expected.minimal_side);
      const MinCutResult far = Solve(g, s, t, alg, CutSide::kSinkMinimal);
      EXPECT_EQ(far.value, expected.value);
      ExpectValidCut(g, s, t, far);
      EXPECT_EQ(far.source_side, expected.maximal_side);
    }
    (std::isinf(expected.value) ? unbounded : bounded)++;
  }
  // The generator must exercise both outcomes, or the test proves little.
  EXPECT_GT(bounded, 500);
  EXPECT_GT(unbounded, 50);
}

TEST(MaxFlowRandom, SolvingTwiceIsIdentical) {
  int solved = 0;
  for (uint64_t seed = 1000; seed < 1020; ++seed) {
    std::mt19937_64 rng(seed);
    const Graph g = RandomGraph(rng, 300, 1500, 2);
    for (MaxFlowAlgorithm alg : kAlgorithms) {
      MinCutResult first, second;
      try {
        first = Solve(g, 0, 299, alg);
      } catch (const UnboundedCutError&) {
        continue;
      }
      second = Solve(g, 0, 299, alg);
      EXPECT_EQ(first.source_side, second.source_side);
      EXPECT_EQ(first.cut_arcs, second.cut_arcs);
      EXPECT_EQ(first.value, second.value);
      ++solved;
    }
  }
  EXPECT_GT(solved, 20);
}

// Random DAG: arcs go from lower to higher ids, mostly to near neighbours (deep and locally
// wide, like joint graphs) with a few long jumps; 5% of arcs are +inf and 5% are 0, too few
// for an all-+inf path across thousands of nodes (the fixed seeds below have none).
Graph RandomDag(std::mt19937_64& rng, int64_t n, int64_t out_degree) {
  Graph g{n};
  for (int64_t u = 0; u + 1 < n; ++u) {
    for (int64_t k = 0; k < out_degree; ++k) {
      const int64_t span = rng() % 8 == 0 ? n - u - 1 : std::min<int64_t>(16, n - u - 1);
      const int64_t v = u + 1 + static_cast<int64_t>(rng() % span);
      const uint64_t kind = rng() % 20;
      const double c = kind == 0 ? kInf : kind == 1 ? 0.0 : static_cast<double>(1 + rng() % 1000);
      g.Add(u, v, c);
    }
  }
  return g;
}

TEST(MaxFlowRandom, BoykovKolmogorovAndDinicAgreeOnLargerDags) {
  int solved = 0;
  for (uint64_t seed = 7; seed < 17; ++seed) {
    std::mt19937_64 rng(seed);
    const int64_t n = 2000 + static_cast<int64_t>(rng() % 3000);
    const Graph g = RandomDag(rng, n, 3);
    SCOPED_TRACE("seed " + std::to_string(seed));
    const MinCutResult bk = Solve(g, 0, n - 1, MaxFlowAlgorithm::kBoykovKolmogorov);
    const MinCutResult dinic = Solve(g, 0, n - 1, MaxFlowAlgorithm::kDinic);
    EXPECT_GT(bk.value, 0.0);
    EXPECT_EQ(bk.value, dinic.value);
    // The residual-reachable set is the same for every maximum flow.
    EXPECT_EQ(bk.source_side, dinic.source_side);
    EXPECT_EQ(bk.cut_arcs, dinic.cut_arcs);
    ExpectValidCut(g, 0, n - 1, bk);
    ++solved;
  }
  EXPECT_EQ(solved, 10);
}

}  // namespace
}  // namespace dcr
