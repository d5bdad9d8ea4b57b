// The memory-budget sweep (partition/budget_cut.h): budgets respected, monotone decisions,
// the hull checked against brute force over every legal cut of small random graphs, nested
// parametric cuts, determinism, and the ZeRO-3 / RNG constraints at every budget.
#include "partition/budget_cut.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "joint_graph_builder.h"

namespace dcr {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct GraphBuilder : test_support::JointGraphArrays {
  std::vector<double> cost;

  int64_t Add(OpClass c, std::vector<int64_t> inputs, double size = 16, double price = 0,
              uint32_t f = 0) {
    cost.push_back(price);
    return AddNode(c, inputs, size, f);
  }
  int64_t Primal(double size = 16) { return Add(OpClass::kPlaceholder, {}, size, 0, kPrimal); }
  int64_t Parameter(double size = 16) {
    return Add(OpClass::kPlaceholder, {}, size, 0, kPrimal | kStaticInput | kParameter);
  }
  int64_t Tangent(double size = 16) { return Add(OpClass::kPlaceholder, {}, size, 0, kBackwardInput); }

  BudgetSolver Solver(RematPolicy policy = RematPolicy::kConservative) const {
    PartitionOptions o;
    o.policy = policy;
    return BudgetSolver(View(), cost, o);
  }
};

// A random joint graph: primals and parameters (with view aliases), a forward DAG of mixed op
// classes with integer sizes and prices, and a backward that reads a random subset of forward
// values into a chain of gradient nodes.
GraphBuilder RandomGraph(std::mt19937& rng, int num_forward, bool with_random_ops = false) {
  GraphBuilder g;
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<int64_t> fwd = {g.Primal(uni(1, 8))};
  const int64_t w = g.Parameter(uni(1, 8));
  fwd.push_back(g.Add(OpClass::kView, {w}, 0));
  const OpClass classes[] = {OpClass::kPointwise, OpClass::kComputeIntensive, OpClass::kOther,
                             OpClass::kPointwise, OpClass::kReduction, OpClass::kRandom};
  for (int i = 0; i < num_forward; ++i) {
    OpClass c = classes[uni(0, with_random_ops ? 5 : 4)];
    std::vector<int64_t> in = {fwd[uni(0, static_cast<int>(fwd.size()) - 1)]};
    if (uni(0, 1)) in.push_back(fwd[uni(0, static_cast<int>(fwd.size()) - 1)]);
    std::sort(in.begin(), in.end());
    in.erase(std::unique(in.begin(), in.end()), in.end());
    fwd.push_back(g.Add(c, in, uni(1, 12), uni(1, 9)));
  }
  g.fwd_outputs = {fwd.back()};
  int64_t grad = g.Tangent();
  for (int64_t v : fwd)
    if (uni(0, 2) == 0) grad = g.Add(OpClass::kPointwise, {grad, v}, 8);
  grad = g.Add(OpClass::kComputeIntensive, {grad, fwd[1]}, 8);  // reads the parameter alias
  g.bwd_outputs = {grad};
  return g;
}

// The test's own walk (independent of BudgetSolver::Evaluate): legal?, bytes, cost.
struct Point {
  bool legal;
  double bytes, cost;
};
Point Brute(const GraphBuilder& g, const BudgetSolver& s, const std::vector<uint8_t>& saved) {
  const int64_t n = static_cast<int64_t>(g.bytes.size());
  const auto& info = s.node_info();
  Point p{true, 0, 0};
  for (int64_t v = 0; v < n; ++v)
    if (saved[v]) p.legal &= std::isfinite(s.save_bytes()[v]), p.bytes += s.save_bytes()[v];
  std::vector<uint8_t> need(n, 0);
  for (size_t k = 0; k < g.tails.size(); ++k)
    if (info[g.heads[k]] & kTangentClosure) need[g.tails[k]] = 1;
  for (int64_t v = 0; v < n; ++v)
    if (info[v] & kRequiredBackward) need[v] = 1;
  for (int64_t v = n - 1; v >= 0; --v) {  // reverse topological
    if (!need[v] || saved[v] || (info[v] & kTangentClosure)) continue;
    p.legal &= std::isfinite(s.recompute_price()[v]);
    p.cost += s.recompute_price()[v];
    for (size_t k = 0; k < g.tails.size(); ++k)
      if (g.heads[k] == v) need[g.tails[k]] = 1;
  }
  return p;
}

std::vector<Point> AllLegalCuts(const GraphBuilder& g, const BudgetSolver& s) {
  const int64_t n = static_cast<int64_t>(g.bytes.size());
  std::vector<int64_t> cand;
  for (int64_t v = 0; v < n; ++v)
    if (std::isfinite(s.save_bytes()[v]) && !(s.node_info()[v] & kTangentClosure)) cand.push_back(v);
  EXPECT_LE(cand.size(), 16u);
  std::vector<Point> out;
  for (uint32_t mask = 0; mask < (1u << cand.size()); ++mask) {
    std::vector<uint8_t> saved(n, 0);
    for (size_t i = 0; i < cand.size(); ++i) saved[cand[i]] = (mask >> i) & 1;
    const Point p = Brute(g, s, saved);
    if (p.legal) out.push_back(p);
  }
  return out;
}

double HullAt(const BudgetHull& h, double b) {
  const auto& V = h.vertices;
  if (b >= V.back().saved_bytes) return V.back().recompute_cost;
  size_t i = 0;
  while (V[i + 1].saved_bytes <= b) ++i;
  return V[i].recompute_cost + (V[i + 1].recompute_cost - V[i].recompute_cost) *
                                   (b - V[i].saved_bytes) / (V[i + 1].saved_bytes - V[i].saved_bytes);
}

// Checks a hull: ascending bytes, descending cost, strictly convex, and its endpoints.
void ExpectWellFormed(const BudgetHull& h) {
  const auto& V = h.vertices;
  ASSERT_FALSE(V.empty());
  ASSERT_EQ(h.edge_lambda.size() + 1, V.size());
  for (size_t i = 0; i + 1 < V.size(); ++i) {
    EXPECT_LT(V[i].saved_bytes, V[i + 1].saved_bytes);
    EXPECT_GT(V[i].recompute_cost, V[i + 1].recompute_cost);
    if (i + 2 < V.size()) {  // slopes strictly increasing (toward 0): real vertices
      const double s1 = (V[i + 1].recompute_cost - V[i].recompute_cost) / (V[i + 1].saved_bytes - V[i].saved_bytes);
      const double s2 = (V[i + 2].recompute_cost - V[i + 1].recompute_cost) / (V[i + 2].saved_bytes - V[i + 1].saved_bytes);
      EXPECT_LT(s1, s2);
    }
  }
}

TEST(BudgetCut, HullMatchesBruteForceOnRandomGraphs) {
  std::mt19937 rng(7);
  int checked = 0, multi_vertex = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const GraphBuilder g = RandomGraph(rng, 5 + trial % 8, trial % 3 == 0);
    for (RematPolicy policy : {RematPolicy::kConservative, RematPolicy::kAggressive}) {
      BudgetSolver s = g.Solver(policy);
      const BudgetHull* h;
      try {
        h = &s.Hull();
      } catch (const PartitionConflictError&) {
        continue;  // the correctness constraints alone conflict (a random op the backward needs)
      }
      ExpectWellFormed(*h);
      const std::vector<Point> all = AllLegalCuts(g, s);
      ASSERT_FALSE(all.empty());
      const auto& V = h->vertices;
      double min_bytes = kInf, min_cost = kInf;
      for (const Point& p : all) min_bytes = std::min(min_bytes, p.bytes), min_cost = std::min(min_cost, p.cost);
      EXPECT_EQ(V.front().saved_bytes, min_bytes) << trial;
      EXPECT_EQ(V.back().recompute_cost, min_cost) << trial;
      for (const CutPoint& v : V) {  // each vertex is a legal cut, by the brute-force walk
        std::vector<uint8_t> saved(g.bytes.size(), 0);
        for (int64_t x : v.saved_nodes) saved[x] = 1;
        const Point p = Brute(g, s, saved);
        EXPECT_TRUE(p.legal);
        EXPECT_EQ(p.bytes, v.saved_bytes);
        EXPECT_EQ(p.cost, v.recompute_cost);
      }
      for (const Point& p : all) {  // no legal cut lies strictly below the hull
        if (p.bytes == min_bytes) EXPECT_GE(p.cost, V.front().recompute_cost) << trial;
        if (p.cost == min_cost) EXPECT_GE(p.bytes, V.back().saved_bytes) << trial;
        if (p.bytes >= min_bytes) EXPECT_GE(p.cost, HullAt(*h, p.bytes) - 1e-9) << trial;
      }
      // Budget decisions: feasible, within the stated gap of the brute-force optimum, monotone.
      double prev_bytes = kInf, prev_cost = -kInf;
      for (double b = V.back().saved_bytes + 2; b >= min_bytes; b -= 1) {
        const BudgetDecision d = s.Choose(b);
        double opt = kInf;
        for (const Point& p : all)
          if (p.bytes <= b) opt = std::min(opt, p.cost);
        EXPECT_LE(d.point.saved_bytes, b);
        EXPECT_GE(d.point.recompute_cost, opt);
        EXPECT_LE(d.hull_cost_at_budget, opt + 1e-9);
        EXPECT_LE(d.point.recompute_cost - opt, d.optimality_gap + 1e-9);
        EXPECT_LE(d.point.saved_bytes, prev_bytes);
        EXPECT_GE(d.point.recompute_cost, prev_cost);
        prev_bytes = d.point.saved_bytes, prev_cost = d.point.recompute_cost;
      }
      ++checked;
      multi_vertex += V.size() > 2;
    }
  }
  EXPECT_GT(checked, 200);
  EXPECT_GT(multi_vertex, 20);  // the sweep is exercised, not only its two ends
}

// n identical layers h_i = relu(h_{i-1} @ W_i); the backward reads every h_i.
GraphBuilder Chain(int n, double act = 64, double flops = 100);

TEST(BudgetCut, ImpossibleBudgetNamesTheSmallestFeasible) {
  const GraphBuilder g = Chain(8);
  BudgetSolver s = g.Solver();
  const double min_bytes = s.Hull().vertices.front().saved_bytes;
  ASSERT_GT(min_bytes, 0);
  try {
    s.Choose(min_bytes - 1);
    FAIL() << "expected BudgetInfeasibleError";
  } catch (const BudgetInfeasibleError& e) {
    EXPECT_EQ(e.min_bytes(), min_bytes);
    EXPECT_NE(std::string(e.what()).find(std::to_string(static_cast<long long>(min_bytes))),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(s.Choose(-1), std::invalid_argument);
  EXPECT_NO_THROW(s.Choose(min_bytes));
}

TEST(BudgetCut, SourceMinimalCutsAreNestedInLambda) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    const GraphBuilder g = RandomGraph(rng, 14);
    BudgetSolver s = g.Solver(trial % 2 ? RematPolicy::kAggressive : RematPolicy::kConservative);
    std::vector<double> lambdas = {0.0, kInf};
    for (double l : s.Hull().edge_lambda) lambdas.insert(lambdas.end(), {l * 0.5, l, l * 2});
    for (double l = 1.0 / 64; l < 64; l *= 2) lambdas.push_back(l);
    std::sort(lambdas.begin(), lambdas.end());
    std::vector<uint8_t> prev, side;
    double prev_cost = kInf;
    for (double l : lambdas) {
      const CutPoint p = s.SolveAt(l, &side);
      EXPECT_LE(p.recompute_cost, prev_cost);
      if (!prev.empty())
        for (size_t v = 0; v < side.size(); ++v) EXPECT_LE(prev[v], side[v]) << "lambda " << l;
      prev = side, prev_cost = p.recompute_cost;
    }
  }
}

GraphBuilder Chain(int n, double act, double flops) {
  GraphBuilder g;
  int64_t h = g.Primal(act);
  std::vector<int64_t> hs = {h}, ts;
  for (int i = 0; i < n; ++i) {
    const int64_t w = g.Parameter(32);
    const int64_t t = g.Add(OpClass::kView, {w}, 0);
    const int64_t mm = g.Add(OpClass::kComputeIntensive, {h, t}, act, flops);
    h = g.Add(OpClass::kPointwise, {mm}, act, 1);
    hs.push_back(h), ts.push_back(t);
  }
  g.fwd_outputs = {h};
  int64_t grad = g.Tangent(act);
  for (int i = n; i >= 1; --i) {
    const int64_t gr = g.Add(OpClass::kPointwise, {grad, hs[i]}, act);        // relu backward
    g.bwd_outputs.push_back(g.Add(OpClass::kComputeIntensive, {gr, hs[i - 1]}, 32));  // dW
    grad = g.Add(OpClass::kComputeIntensive, {gr, ts[i - 1]}, act);           // dh
  }
  return g;
}

TEST(BudgetCut, ChainBudgetsSpreadCheckpointsEvenly) {
  const int n = 16;
  const GraphBuilder g = Chain(n);
  BudgetSolver s = g.Solver();
  const BudgetHull& h = s.Hull();
  ExpectWellFormed(h);
  EXPECT_EQ(h.vertices.back().recompute_cost, 0);
  EXPECT_EQ(h.vertices.front().recompute_cost, s.one_forward_cost() - 0);  // one full forward
  double prev = kInf;
  for (double b = h.vertices.back().saved_bytes; b >= h.vertices.front().saved_bytes; b -= 64) {
    const BudgetDecision d = s.Choose(b);
    EXPECT_LE(d.point.saved_bytes, b);
    EXPECT_LE(d.point.saved_bytes, prev);
    EXPECT_LE(d.optimality_gap, 100 + 1e-9);  // one layer's recompute at most
    prev = d.point.saved_bytes;
  }
  // Four checkpoints' worth of budget over the minimum: spread out, not the first four layers.
  const BudgetDecision d = s.Choose(h.vertices.front().saved_bytes + 4 * 64);
  std::vector<int64_t> saved_acts;
  for (int64_t v : d.point.saved_nodes)
    if (g.bytes[v] == 64 && g.op_class[v] != static_cast<uint8_t>(OpClass::kPlaceholder)) saved_acts.push_back(v);
  ASSERT_EQ(saved_acts.size(), 4u);
  EXPECT_GT(saved_acts.back() - saved_acts.front(), static_cast<int64_t>(g.bytes.size()) / 3);
}

TEST(BudgetCut, ParameterAliasesNeverSavedRandomOpsNeverRecomputed) {
  std::mt19937 rng(5);
  int checked = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const GraphBuilder g = RandomGraph(rng, 12, /*with_random_ops=*/true);
    BudgetSolver s = g.Solver(RematPolicy::kAggressive);
    const BudgetHull* h;
    try {
      h = &s.Hull();
    } catch (const PartitionConflictError&) {
      continue;
    }
    for (double b = h->vertices.front().saved_bytes; b <= h->vertices.back().saved_bytes + 1; b += 1) {
      const BudgetDecision d = s.Choose(b);
      for (int64_t v : d.point.saved_nodes) {
        EXPECT_FALSE(s.node_info()[v] & kParameterAlias);
        EXPECT_NE(g.op_class[v], static_cast<uint8_t>(OpClass::kView));
      }
      for (int64_t v : d.point.recomputed_nodes) {  // a random op the forward runs never runs twice
        if (s.node_info()[v] & kRequiredForward)
          EXPECT_NE(g.op_class[v], static_cast<uint8_t>(OpClass::kRandom));
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 20);
}

// With the ZeRO-3 marking off, a gathered weight may be kept for the backward. What bans
// re-gathering it is the collective's time, so the sweep prices it: its low end re-gathers the
// parameter's weight (saves nothing of it), its high end keeps it. A gather of an activation
// (not a parameter) is never run twice, at any budget.
TEST(BudgetCut, ParameterGathersArePricedWithTheMarkingOff) {
  GraphBuilder g;
  const int64_t x = g.Primal(4);
  const int64_t w = g.Parameter(4);
  const int64_t full = g.Add(OpClass::kGather, {w}, 64, /*price=*/1000);
  const int64_t y = g.Add(OpClass::kComputeIntensive, {x, full}, 8, 50);
  const int64_t act = g.Add(OpClass::kGather, {y}, 32, 5);  // a collective on an activation
  const int64_t z = g.Add(OpClass::kComputeIntensive, {act, full}, 8, 50);
  g.fwd_outputs = {z};
  const int64_t t = g.Tangent(8);
  const int64_t gx = g.Add(OpClass::kComputeIntensive, {t, full, act}, 8);
  g.bwd_outputs = {gx};
  PartitionOptions o;
  o.mark_parameter_aliases = false;
  BudgetSolver s(g.View(), g.cost, o);
  const BudgetHull& h = s.Hull();
  ASSERT_EQ(h.vertices.size(), 2u);
  const CutPoint& low = h.vertices.front();
  const CutPoint& high = h.vertices.back();
  auto has = [](const std::vector<int64_t>& ids, int64_t v) {
    return std::find(ids.begin(), ids.end(), v) != ids.end();
  };
  EXPECT_TRUE(has(low.recomputed_nodes, full));   // re-gathered in the backward
  EXPECT_FALSE(has(low.saved_nodes, full));
  EXPECT_EQ(low.recompute_cost, 1000);
  EXPECT_TRUE(has(high.saved_nodes, full));       // kept from the forward
  EXPECT_EQ(high.recompute_cost, 0);
  for (const CutPoint& p : h.vertices) {
    EXPECT_TRUE(has(p.saved_nodes, act));
    EXPECT_FALSE(has(p.recomputed_nodes, act));
  }
  // The default cut (no sweep) still keeps the gathered weight: the marking is off.
  const PartitionResult cut = PartitionJointGraph(g.View(), o);
  EXPECT_TRUE(has(cut.saved_nodes, full));
}

TEST(BudgetCut, DeterministicAndIndependentOfEdgeOrder) {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 40; ++trial) {
    GraphBuilder g = RandomGraph(rng, 14);
    BudgetSolver a = g.Solver(), b = g.Solver();
    const BudgetHull &ha = a.Hull(), &hb = b.Hull();
    ASSERT_EQ(ha.vertices.size(), hb.vertices.size());
    for (size_t i = 0; i < ha.vertices.size(); ++i)
      EXPECT_EQ(ha.vertices[i].saved_nodes, hb.vertices[i].saved_nodes);
    const double mid = (ha.vertices.front().saved_bytes + ha.vertices.back().saved_bytes) / 2;
    EXPECT_EQ(a.Choose(mid).point.saved_nodes, b.Choose(mid).point.saved_nodes);
    // Shuffled edge list: the same hull values (ties may pick other sets of equal value).
    std::vector<size_t> perm(g.tails.size());
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    GraphBuilder p = g;
    for (size_t k = 0; k < perm.size(); ++k) p.tails[k] = g.tails[perm[k]], p.heads[k] = g.heads[perm[k]];
    BudgetSolver c = p.Solver();
    const BudgetHull& hc = c.Hull();
    ASSERT_EQ(ha.vertices.size(), hc.vertices.size());
    for (size_t i = 0; i < ha.vertices.size(); ++i) {
      EXPECT_EQ(ha.vertices[i].saved_bytes, hc.vertices[i].saved_bytes);
      EXPECT_EQ(ha.vertices[i].recompute_cost, hc.vertices[i].recompute_cost);
    }
  }
}

TEST(BudgetCut, RejectsBadRecomputeCosts) {
  GraphBuilder g = Chain(2);
  g.cost[3] = -1;
  EXPECT_THROW(g.Solver(), std::invalid_argument);
  g.cost[3] = std::nan("");
  EXPECT_THROW(g.Solver(), std::invalid_argument);
  g.cost.pop_back();
  EXPECT_THROW(g.Solver(), std::invalid_argument);
}

}  // namespace
}  // namespace dcr
