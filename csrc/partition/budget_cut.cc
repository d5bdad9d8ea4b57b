#include "partition/budget_cut.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "maxflow/max_flow.h"
#include "maxflow/node_split.h"

namespace dcr {
namespace {

using remat_internal::RematNetwork;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kExactLimit = 4611686018427387904.0;  // 2^62: products fit in __int128

bool Integral(double x) { return std::isfinite(x) && std::floor(x) == x && std::abs(x) < kExactLimit; }

// alpha * b + beta * c  <  alpha * b1 + beta * c1, exactly for integers below 2^62.
bool ObjectiveLess(double alpha, double beta, const CutPoint& p, const CutPoint& q) {
  const double xs[] = {alpha, beta, p.saved_bytes, p.recompute_cost, q.saved_bytes,
                       q.recompute_cost};
  if (std::all_of(std::begin(xs), std::end(xs), Integral)) {
    auto i = [](double x) { return static_cast<__int128>(static_cast<int64_t>(x)); };
    return i(alpha) * i(p.saved_bytes) + i(beta) * i(p.recompute_cost) <
           i(alpha) * i(q.saved_bytes) + i(beta) * i(q.recompute_cost);
  }
  using LD = long double;
  const LD lhs = LD(alpha) * p.saved_bytes + LD(beta) * p.recompute_cost;
  const LD rhs = LD(alpha) * q.saved_bytes + LD(beta) * q.recompute_cost;
  return lhs < rhs - 1e-15L * std::max(std::abs(lhs), std::abs(rhs));
}

// Divides integral weights by their gcd, keeping the capacities as small as they can be.
void ReduceWeights(double& alpha, double& beta) {
  if (!Integral(alpha) || !Integral(beta) || alpha <= 0 || beta <= 0) return;
  const uint64_t g = std::gcd(static_cast<uint64_t>(alpha), static_cast<uint64_t>(beta));
  alpha /= static_cast<double>(g);
  beta /= static_cast<double>(g);
}

// A digraph in CSR form (arcs in input order per tail).
struct Digraph {
  std::vector<int64_t> first, head;
  Digraph() = default;
  Digraph(int64_t n, const std::vector<int64_t>& tails, const std::vector<int64_t>& heads)
      : first(n + 1, 0), head(tails.size()) {
    for (int64_t t : tails) ++first[t + 1];
    for (int64_t v = 0; v < n; ++v) first[v + 1] += first[v];
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (size_t k = 0; k < tails.size(); ++k) head[next[tails[k]]++] = heads[k];
  }
};

// The final residual graph of a maximum flow: u -> v where arc (u, v) has capacity left,
// v -> u where it carries flow.
Digraph Residual(const RematNetwork& net, const std::vector<double>& caps,
                 const std::vector<double>& flow) {
  std::vector<int64_t> tails, heads;
  for (size_t k = 0; k < caps.size(); ++k) {
    if (caps[k] - flow[k] > 0.0) tails.push_back(net.tails[k]), heads.push_back(net.heads[k]);
    if (flow[k] > 0.0) tails.push_back(net.heads[k]), heads.push_back(net.tails[k]);
  }
  return Digraph(net.num_nodes, tails, heads);
}

std::vector<uint8_t> Reach(const Digraph& g, int64_t from) {
  std::vector<uint8_t> seen(g.first.size() - 1, 0);
  std::vector<int64_t> stack = {from};
  seen[from] = 1;
  while (!stack.empty()) {
    const int64_t v = stack.back();
    stack.pop_back();
    for (int64_t k = g.first[v]; k < g.first[v + 1]; ++k)
      if (!seen[g.head[k]]) seen[g.head[k]] = 1, stack.push_back(g.head[k]);
  }
  return seen;
}

Digraph Reverse(const Digraph& g) {
  std::vector<int64_t> tails, heads;
  for (int64_t v = 0; v + 1 < static_cast<int64_t>(g.first.size()); ++v)
    for (int64_t k = g.first[v]; k < g.first[v + 1]; ++k) tails.push_back(g.head[k]), heads.push_back(v);
  return Digraph(static_cast<int64_t>(g.first.size()) - 1, tails, heads);
}

// Strongly connected components of the subgraph on `member` nodes (iterative Tarjan).
// comp[v] = component id or -1; returns the number of components.
int64_t StrongComponents(const Digraph& g, const std::vector<uint8_t>& member,
                         std::vector<int64_t>& comp) {
  const int64_t n = static_cast<int64_t>(member.size());
  comp.assign(n, -1);
  std::vector<int64_t> index(n, -1), low(n, 0), stack, call, arc(n, 0);
  std::vector<uint8_t> on_stack(n, 0);
  int64_t counter = 0, num = 0;
  for (int64_t root = 0; root < n; ++root) {
    if (!member[root] || index[root] >= 0) continue;
    call.push_back(root);
    index[root] = low[root] = counter++;
    arc[root] = g.first[root];
    stack.push_back(root), on_stack[root] = 1;
    while (!call.empty()) {
      const int64_t v = call.back();
      if (arc[v] < g.first[v + 1]) {
        const int64_t w = g.head[arc[v]++];
        if (!member[w]) continue;
        if (index[w] < 0) {
          index[w] = low[w] = counter++;
          arc[w] = g.first[w];
          stack.push_back(w), on_stack[w] = 1;
          call.push_back(w);
        } else if (on_stack[w]) {
          low[v] = std::min(low[v], index[w]);
        }
        continue;
      }
      call.pop_back();
      if (!call.empty()) low[call.back()] = std::min(low[call.back()], low[v]);
      if (low[v] == index[v]) {
        int64_t w;
        do {
          w = stack.back();
          stack.pop_back(), on_stack[w] = 0;
          comp[w] = num;
        } while (w != v);
        ++num;
      }
    }
  }
  return num;
}

// 0 .. k-1 in bit-reversal order: every prefix is spread evenly over the range.
std::vector<int64_t> BitReversalOrder(int64_t k) {
  int bits = 0;
  while ((int64_t{1} << bits) < k) ++bits;
  std::vector<int64_t> order;
  order.reserve(k);
  for (int64_t r = 0; r < (int64_t{1} << bits); ++r) {
    int64_t x = 0;
    for (int b = 0; b < bits; ++b)
      if (r & (int64_t{1} << b)) x |= int64_t{1} << (bits - 1 - b);
    if (x < k) order.push_back(x);
  }
  return order;
}

std::string FormatBytes(double x) {
  return std::isfinite(x) ? std::to_string(static_cast<long long>(std::llround(x))) : "inf";
}

}  // namespace

struct BudgetSolver::Solved {
  MinCutResult cut;
  std::vector<uint8_t> side;          // the chosen minimum cut's source side (network nodes)
  Digraph residual;                   // sink_minimal or keep_residual: the final residual graph
  std::vector<uint8_t> reaches_sink;  // with it: the network nodes that reach t in it
};

BudgetSolver::BudgetSolver(const JointGraphView& g, Span<double> recompute_cost,
                           const PartitionOptions& options) {
  using namespace remat_internal;
  // Validates g first (as before); the later phases never throw on a valid graph, so the
  // recompute_cost checks after it report the same errors they did ahead of them.
  Prepared prepared =
      Prepare(g, options, NetworkCosts{/*bytes_only=*/true, /*price_cost_bans=*/true});
  n_ = g.num_nodes;
  if (static_cast<int64_t>(recompute_cost.size) != n_)
    throw std::invalid_argument("recompute_cost has " + std::to_string(recompute_cost.size) +
                                " entries, expected num_nodes = " + std::to_string(n_));
  for (int64_t v = 0; v < n_; ++v)
    if (!(recompute_cost[v] >= 0.0) || !std::isfinite(recompute_cost[v]))
      throw std::invalid_argument("recompute_cost[" + std::to_string(v) +
                                  "] must be finite and >= 0");
  producer_first_ = std::move(prepared.adj.producer_first);
  producers_ = std::move(prepared.adj.producers);
  info_ = std::move(prepared.info);
  net_ = std::move(prepared.net);
  save_bytes_ = net_.node_cost;
  price_.assign(n_, 0.0);
  for (int64_t v = 0; v < n_; ++v) {
    if (info_[v] & kBanned) price_[v] = kInf;
    if (net_.priced_arc[v] >= 0) {
      price_[v] = recompute_cost[v];
      one_forward_cost_ += recompute_cost[v];
    }
  }
}

BudgetSolver::Solved BudgetSolver::Solve(double alpha, double beta, bool sink_minimal,
                                         bool keep_residual) {
  std::vector<double> caps = net_.capacities;
  for (int64_t v = 0; v < n_; ++v) caps[v] = net_.node_cost[v] == 0.0 ? 0.0 : alpha * net_.node_cost[v];
  for (int64_t v = 0; v < n_; ++v) {
    const int64_t a = net_.priced_arc[v];
    if (a < 0) continue;
    caps[a] = price_[v] == 0.0 ? 0.0 : (std::isinf(beta) ? kInf : beta * price_[v]);
  }
  Solved s;
  s.cut = MinStCut(net_.num_nodes, net_.tails, net_.heads, caps, net_.source, net_.sink);
  s.side = s.cut.source_side;
  if (sink_minimal || keep_residual) {
    s.residual = Residual(net_, caps, s.cut.arc_flow);
    s.reaches_sink = Reach(Reverse(s.residual), net_.sink);
  }
  if (sink_minimal)
    for (int64_t x = 0; x < net_.num_nodes; ++x) s.side[x] = !s.reaches_sink[x];
  return s;
}

CutPoint BudgetSolver::PointOf(const std::vector<uint8_t>& side) const {
  MinCutResult cut;
  cut.source_side = side;
  for (int64_t v = 0; v < n_; ++v)
    if (side[SplitIn(v)] && !side[SplitOut(v)]) cut.cut_arcs.push_back(v);
  bool legal = false;
  CutPoint p = Evaluate(remat_internal::UsedCutNodes(net_, cut), &legal);
  if (!legal) throw std::logic_error("budget cut internal error: a minimum cut is not legal");
  return p;
}

CutPoint BudgetSolver::Evaluate(const std::vector<int64_t>& saved_nodes, bool* legal) const {
  *legal = true;
  CutPoint p;
  std::vector<uint8_t> saved(n_, 0), seen(n_, 0);
  for (int64_t v : saved_nodes) {
    if (v < 0 || v >= n_) throw std::invalid_argument("saved node " + std::to_string(v) + " out of range");
    saved[v] = 1;
  }
  for (int64_t v = 0; v < n_; ++v) {
    if (!saved[v]) continue;
    p.saved_nodes.push_back(v);
    if (std::isinf(save_bytes_[v])) *legal = false;
    p.saved_bytes += save_bytes_[v];
  }
  std::vector<int64_t> stack;
  auto need = [&](int64_t u) {
    if (!saved[u] && !seen[u] && !(info_[u] & kTangentClosure)) seen[u] = 1, stack.push_back(u);
  };
  for (int64_t v = 0; v < n_; ++v) {
    if (info_[v] & kTangentClosure) {
      for (int64_t k = producer_first_[v]; k < producer_first_[v + 1]; ++k) need(producers_[k]);
    } else if (info_[v] & kRequiredBackward) {
      need(v);
    }
  }
  while (!stack.empty()) {
    const int64_t v = stack.back();
    stack.pop_back();
    for (int64_t k = producer_first_[v]; k < producer_first_[v + 1]; ++k) need(producers_[k]);
  }
  for (int64_t v = 0; v < n_; ++v) {
    if (!seen[v]) continue;
    p.recomputed_nodes.push_back(v);
    if (std::isinf(price_[v])) *legal = false;
    p.recompute_cost += price_[v];
  }
  return p;
}

CutPoint BudgetSolver::SolveAt(double lambda, std::vector<uint8_t>* forward_side) {
  if (!(lambda >= 0.0)) throw std::invalid_argument("lambda must be >= 0");
  Solved s;
  try {
    s = Solve(1.0, lambda, /*sink_minimal=*/false);
  } catch (const UnboundedCutError& e) {
    remat_internal::ThrowConflict(net_, e.path());
  }
  if (forward_side) {
    forward_side->assign(n_, 0);
    for (int64_t v = 0; v < n_; ++v) (*forward_side)[v] = s.side[SplitIn(v)];
  }
  return PointOf(s.side);
}

void BudgetSolver::Split(CutPoint lo, CutPoint hi, int depth,
                         std::vector<CutPoint>& out, std::vector<double>& lambdas) {
  // lo: fewer bytes, more cost. Both are hull vertices; find one strictly below their segment.
  double alpha = lo.recompute_cost - hi.recompute_cost, beta = hi.saved_bytes - lo.saved_bytes;
  ReduceWeights(alpha, beta);
  CutPoint p = PointOf(Solve(alpha, beta, /*sink_minimal=*/false).side);
  const bool inside = p.saved_bytes > lo.saved_bytes && p.saved_bytes < hi.saved_bytes &&
                      p.recompute_cost < lo.recompute_cost && p.recompute_cost > hi.recompute_cost;
  if (inside && depth < 4096 && ObjectiveLess(alpha, beta, p, lo)) {
    Split(lo, p, depth + 1, out, lambdas);
    out.push_back(p);
    Split(std::move(p), std::move(hi), depth + 1, out, lambdas);
    return;
  }
  lambdas.push_back((hi.saved_bytes - lo.saved_bytes) / (lo.recompute_cost - hi.recompute_cost));
}

const BudgetHull& BudgetSolver::Hull() {
  if (hull_done_) return hull_;
  hull_ = BudgetHull{};
  if (n_ == 0) {
    hull_.vertices.push_back(CutPoint{});
    hull_done_ = true;
    return hull_;
  }
  CutPoint lo, hi;
  try {
    lo = PointOf(Solve(1.0, 0.0, /*sink_minimal=*/true).side);
  } catch (const UnboundedCutError& e) {
    remat_internal::ThrowConflict(net_, e.path());
  }
  try {
    hi = PointOf(Solve(1.0, kInf, false).side);
  } catch (const UnboundedCutError&) {
    // Every cut recomputes something priced: weigh cost above all bytes (lexicographic for
    // integer costs).
    double total = 1.0;
    for (double b : save_bytes_)
      if (std::isfinite(b)) total += b;
    hi = PointOf(Solve(1.0, total, false).side);
  }
  hull_.vertices.push_back(lo);
  if (hi.saved_bytes > lo.saved_bytes && hi.recompute_cost < lo.recompute_cost) {
    Split(lo, hi, 0, hull_.vertices, hull_.edge_lambda);
    hull_.vertices.push_back(hi);
  }
  hull_done_ = true;
  return hull_;
}

BudgetDecision BudgetSolver::Choose(double saved_bytes_budget) {
  if (std::isnan(saved_bytes_budget)) throw std::invalid_argument("saved_bytes_budget is NaN");
  const BudgetHull& hull = Hull();
  const std::vector<CutPoint>& V = hull.vertices;
  BudgetDecision d;
  d.saved_bytes_budget = saved_bytes_budget;
  if (saved_bytes_budget < V.front().saved_bytes) {
    throw BudgetInfeasibleError(
        "memory budget of " + FormatBytes(saved_bytes_budget) +
            " bytes is below the fewest saved bytes any legal cut reaches: " +
            FormatBytes(V.front().saved_bytes) +
            " bytes (recomputing everything the constraints allow); the smallest feasible "
            "budget is " + FormatBytes(V.front().saved_bytes) + " bytes",
        V.front().saved_bytes);
  }
  int64_t i = 0;
  while (i + 1 < static_cast<int64_t>(V.size()) && V[i + 1].saved_bytes <= saved_bytes_budget) ++i;
  d.vertex = i;
  d.point = V[i];
  d.hull_cost_at_budget = V[i].recompute_cost;
  if (i + 1 == static_cast<int64_t>(V.size()) || V[i].saved_bytes == saved_bytes_budget) return d;

  const CutPoint &a = V[i], &b = V[i + 1];
  d.hull_cost_at_budget = a.recompute_cost + (b.recompute_cost - a.recompute_cost) *
                                                 (saved_bytes_budget - a.saved_bytes) /
                                                 (b.saved_bytes - a.saved_bytes);
  // Walk the minimum cuts of the edge's slope, from a's end toward b's.
  double alpha = a.recompute_cost - b.recompute_cost, beta = b.saved_bytes - a.saved_bytes;
  ReduceWeights(alpha, beta);
  const Solved s = Solve(alpha, beta, /*sink_minimal=*/false, /*keep_residual=*/true);
  const Digraph& residual = s.residual;
  std::vector<uint8_t> in_s = s.side, free(net_.num_nodes, 0);
  for (int64_t x = 0; x < net_.num_nodes; ++x) free[x] = !in_s[x] && !s.reaches_sink[x];
  std::vector<int64_t> comp;
  const int64_t num_comps = StrongComponents(residual, free, comp);
  // Components in FX order of their first node.
  std::vector<int64_t> first_node(num_comps, std::numeric_limits<int64_t>::max());
  for (int64_t x = 0; x < net_.num_nodes; ++x)
    if (comp[x] >= 0) first_node[comp[x]] = std::min(first_node[comp[x]], x);
  std::vector<int64_t> by_position(num_comps);
  std::iota(by_position.begin(), by_position.end(), 0);
  std::sort(by_position.begin(), by_position.end(),
            [&](int64_t p, int64_t q) { return first_node[p] < first_node[q]; });
  std::vector<std::vector<int64_t>> members(num_comps);
  for (int64_t x = 0; x < net_.num_nodes; ++x)
    if (comp[x] >= 0) members[comp[x]].push_back(x);

  auto contribution = [&](int64_t v) {
    return in_s[SplitIn(v)] && !in_s[SplitOut(v)] ? save_bytes_[v] : 0.0;
  };
  double bytes = 0.0;
  for (int64_t v = 0; v < n_; ++v) bytes += contribution(v);
  std::vector<uint8_t> pending(net_.num_nodes, 0);
  for (int64_t pos : BitReversalOrder(num_comps)) {
    const int64_t c = by_position[pos];
    if (in_s[members[c].front()]) continue;
    // The closure this component needs: every free node it reaches in the residual graph.
    std::vector<int64_t> added;
    for (int64_t x : members[c]) pending[x] = 1, added.push_back(x);
    for (size_t q = 0; q < added.size(); ++q) {
      const int64_t x = added[q];
      for (int64_t k = residual.first[x]; k < residual.first[x + 1]; ++k) {
        const int64_t y = residual.head[k];
        if (free[y] && !in_s[y] && !pending[y]) pending[y] = 1, added.push_back(y);
      }
    }
    std::vector<int64_t> touched;
    for (int64_t x : added) touched.push_back(x / 2);
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    double delta = 0.0;
    for (int64_t v : touched) delta -= contribution(v);
    for (int64_t x : added) in_s[x] = 1;
    for (int64_t v : touched) delta += contribution(v);
    for (int64_t x : added) pending[x] = 0;
    if (bytes + delta > saved_bytes_budget) {
      // Does not fit: skip it and try the later ones (first fit). Still monotone in the
      // budget: two budgets walk alike up to the first component only the larger one takes,
      // and from there the larger one's bytes already exceed the smaller budget.
      for (int64_t x : added) in_s[x] = 0;
      continue;
    }
    bytes += delta;
  }
  CutPoint p = PointOf(in_s);
  if (p.saved_bytes <= saved_bytes_budget && p.recompute_cost <= a.recompute_cost &&
      p.saved_bytes > a.saved_bytes) {
    d.point = std::move(p);
    d.vertex = -1;
    d.edge = i;
  }
  d.optimality_gap = std::max(0.0, d.point.recompute_cost - d.hull_cost_at_budget);
  return d;
}

}  // namespace dcr
