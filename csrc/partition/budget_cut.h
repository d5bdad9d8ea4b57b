// Memory-budget mode of the rematerialization cut: the least recompute cost whose saved bytes
// fit a budget, over the same constraints as the default cut (remat_partition.h).
//
// Problem. A cut is a legal saved set S (the values the forward hands to the backward); the
// backward recomputes R(S), the forward nodes it needs that S does not cover. For each cut
//   bytes(S) = sum of bytes(v) over S  (1x: the budget is about memory held, not traffic;
//                                       static inputs count 0, they are alive anyway)
//   cost(S)  = sum of price(v) over R(S)
// where price(v) = recompute_cost[v] (from Python: a flops estimate) for a forward node that the
// policy bans from recomputation only to save compute (a compute-intensive op; a non-fusible op
// under the conservative policy), 0 for a node the policy recomputes freely (recompute_cost is
// ignored there), and +inf for a correctness ban (inputs, seeds, MUST/PREFER_SAVE tags, random
// and effectful ops outside an RNG-replayable checkpoint region, collectives). Every other
// constraint is the default cut's, unchanged: ZeRO-3 parameter aliases, views, MUST_RECOMPUTE
// nodes, SymFloats and non-tensors are never saved; checkpoint region boundaries are saved.
// Given a budget B: minimize cost(S) subject to bytes(S) <= B.
// One difference from the default cut: a PREFER_RECOMPUTE request carries no penalty here. The
// tagged node is recomputed freely (price 0), and the budget, the user's explicit memory
// request, decides whether saving it is worth its bytes.
//
// Method (parametric min-cut). The default cut's node-split network, with the node arc v_in ->
// v_out of capacity alpha * bytes(v) and, for each priced node, an arc source -> v_in of
// capacity beta * price(v) (cut iff v is recomputed). A minimum cut minimizes
// alpha * bytes + beta * cost, i.e. bytes + lambda * cost with lambda = beta / alpha. The sweep
// (Eisner-Severance, "Newton" breakpoint search) finds every vertex of the lower convex hull of
// the legal points (bytes, cost):
//   low end   lambda = 0:  fewest bytes; among those the least cost (the sink-minimal minimum
//                          cut: the fewest nodes recomputed, prices >= 0). Exact, one solve;
//   high end  lambda = +inf: priced arcs +inf (price 0 arcs stay 0): the fewest bytes among
//                          the cuts that recompute nothing priced, the policy's own decision
//                          structure with 1x bytes. If no such cut exists (the default cut would
//                          report a conflict), lambda = sum(bytes) + 1 instead: lexicographic
//                          (least cost, then fewest bytes) when costs are integers (flops are);
//   split     for neighbouring points P1 = (B1, C1), P2 = (B2, C2), B1 < B2, C1 > C2: solve at
//             alpha = C1 - C2, beta = B2 - B1 (reduced by their gcd when integral) and take the
//             source-minimal minimum cut P. All minimum cuts at one lambda lie on the hull's
//             face of that slope, and the source-minimal one has the largest cost among them,
//             so P is a vertex. If alpha B + beta C < alpha B1 + beta C1 (compared exactly for
//             integers below 2^62, else in long double), P splits the segment; else P1 P2 is a
//             hull edge with breakpoint lambda = beta / alpha.
// Nesting (Gallo-Grigoriadis-Tarjan): only source arcs grow with lambda, so the source-minimal
// minimum cuts' source sets are nested: lambda1 < lambda2 => S(lambda1) subset of S(lambda2).
//
// Choice for a budget B (Choose):
//   B < bytes of the low end       BudgetInfeasibleError (std::invalid_argument) naming it;
//   B >= bytes of the high end     the high end (exact: the least cost of all);
//   else, on the edge P_i P_{i+1}  with B_i <= B < B_{i+1}: any cut with bytes <= B costs at
//       least hull(B) = C_i + (C_{i+1} - C_i) (B - B_i) / (B_{i+1} - B_i). All minimum cuts at
//       the edge's lambda are the closures of the final residual graph (source side containing
//       reach(s), closed under residual arcs, away from the nodes that reach t), and all lie
//       on the edge. The walk contracts the free nodes' strongly connected components, orders
//       them by their first graph node (FX order: the forward's order), and adds them in
//       bit-reversal order of that list, each with the closure it needs (first fit: one
//       that would overshoot B is skipped and the walk goes on), so the cuts it passes
//       through are min cuts spread evenly along the graph (evenly spaced checkpoints on a
//       chain, as in Chen et al.'s sqrt(n) schedule), not a prefix of it. Its (bytes, cost)
//       lies on the edge; optimality_gap = its cost - hull(B) >= 0 is returned with it: at
//       most the smallest step the walk could not take, and 0 at a vertex. A cut strictly
//       inside the hull (better than every hull point, not a min cut for any lambda) can beat
//       it by at most that gap.
// Monotone in B: along an edge every candidate is a min cut, so its cost falls exactly as its
// bytes rise; two budgets B1 < B2 walk alike up to the first component only B2 takes, and from
// there B2's bytes already exceed B1 >= B1's final bytes (a step never lowers bytes). Across
// edges the vertices are in byte order. So a smaller budget never saves more bytes and never
// recomputes less.
//
// Exactness. Reported (bytes, cost) of every point are computed from its saved set (Evaluate),
// never from a flow value. The flows are exact while the capacities alpha * bytes and
// beta * price and their sums are integers below 2^53 (byte counts and flop counts are
// integers; alpha and beta are differences of such sums, gcd-reduced); beyond that the cuts
// are exact up to float64 rounding, and a rounding slip can only drop a hull vertex (the result
// stays a legal cut, checked with Evaluate). The residual graph is read with "residual > 0",
// exact in the integer regime.
//
// Complexity. Build O(n + m). The sweep: one max-flow per hull vertex plus one per edge, plus
// the two ends (the vertex count is at most the number of distinct costs; small in practice).
// Choose: one max-flow on the edge, an SCC pass O(n + m), and the walk O(n + m) amortized
// (each network node joins the source side once).
// Determinism: a pure function of the arrays; no hashing, no threads, arcs visited in input
// order. Every rank computes the same hull and the same decision.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/span.h"
#include "graph/joint_graph.h"
#include "partition/remat_network.h"
#include "partition/remat_partition.h"

namespace dcr {

// A legal cut, as the backward sees it.
struct CutPoint {
  double saved_bytes = 0.0;
  double recompute_cost = 0.0;
  std::vector<int64_t> saved_nodes;       // ascending: the values the forward hands over
  std::vector<int64_t> recomputed_nodes;  // ascending: forward nodes the backward recomputes
};

// The lower convex hull of (saved bytes, recompute cost) over the legal cuts.
struct BudgetHull {
  std::vector<CutPoint> vertices;   // bytes strictly ascending, cost strictly descending
  std::vector<double> edge_lambda;  // size vertices - 1: edge i's slope (bytes per unit cost)
};

struct BudgetDecision {
  CutPoint point;
  int64_t edge = -1;                 // hull edge walked (vertex edge..edge+1), -1 at a vertex
  int64_t vertex = -1;               // the hull vertex chosen, -1 when on an edge
  double saved_bytes_budget = 0.0;
  double hull_cost_at_budget = 0.0;  // lower bound: no cut with bytes <= budget costs less
  double optimality_gap = 0.0;       // point.recompute_cost - hull_cost_at_budget >= 0
};

// The budget is below the fewest saved bytes any legal cut reaches.
class BudgetInfeasibleError : public std::invalid_argument {
 public:
  BudgetInfeasibleError(const std::string& msg, double min_bytes)
      : std::invalid_argument(msg), min_bytes_(min_bytes) {}
  double min_bytes() const { return min_bytes_; }

 private:
  double min_bytes_;
};

// The parametric network of one joint graph, built once; every query reuses it.
// Not thread-safe (queries rewrite the capacities); make one per thread.
class BudgetSolver {
 public:
  // Validates `graph` and `recompute_cost` (size num_nodes, finite, >= 0; std::invalid_argument
  // naming the index) and builds the network. Copies what it needs: the arrays may go away.
  BudgetSolver(const JointGraphView& graph, Span<double> recompute_cost,
               const PartitionOptions& options);

  // Every vertex of the lower convex hull (computed on the first call, then cached).
  // Throws PartitionConflictError when the correctness constraints alone conflict.
  const BudgetHull& Hull();

  // The least-cost cut with saved bytes <= saved_bytes_budget, as described above.
  // Throws BudgetInfeasibleError below the hull's first vertex.
  BudgetDecision Choose(double saved_bytes_budget);

  // The source-minimal minimum cut of bytes + lambda * cost (lambda in [0, +inf]); with
  // forward_side (size num_nodes) set to 1 where v_in is on the source side.
  CutPoint SolveAt(double lambda, std::vector<uint8_t>* forward_side = nullptr);

  // Bytes and cost of a saved set, computed from the graph: R(S) is found by walking back from
  // what the backward needs, stopping at saved nodes. *legal is false when S holds a node that
  // may not be saved or R(S) one that may not be recomputed.
  CutPoint Evaluate(const std::vector<int64_t>& saved_nodes, bool* legal) const;

  // Per node: the bytes saving it costs (+inf: may not be saved), and its recompute price
  // (+inf: may not be recomputed; only nodes outside the tangent closure are ever recomputed).
  const std::vector<double>& save_bytes() const { return save_bytes_; }
  const std::vector<double>& recompute_price() const { return price_; }
  const std::vector<uint8_t>& node_info() const { return info_; }
  // Sum of the prices of the priced forward nodes: the cost of recomputing one whole forward.
  double one_forward_cost() const { return one_forward_cost_; }

 private:
  struct Solved;  // one solve's cut (and, on request, its residual graph): budget_cut.cc
  // Solves alpha * bytes + beta * cost; sink_minimal picks the sink-minimal minimum cut (else
  // the source-minimal one); keep_residual also returns the final residual graph.
  Solved Solve(double alpha, double beta, bool sink_minimal, bool keep_residual = false);
  CutPoint PointOf(const std::vector<uint8_t>& side) const;
  // Appends the hull vertices strictly between lo and hi (by value: `out` may reallocate).
  void Split(CutPoint lo, CutPoint hi, int depth, std::vector<CutPoint>& out,
             std::vector<double>& lambdas);

  int64_t n_ = 0;
  std::vector<uint8_t> info_;
  std::vector<double> save_bytes_, price_;
  std::vector<int64_t> producer_first_, producers_;  // Evaluate walks producers
  remat_internal::RematNetwork net_;
  double one_forward_cost_ = 0.0;
  bool hull_done_ = false;
  BudgetHull hull_;
};

}  // namespace dcr
