// Boykov-Kolmogorov and Dinic max-flow over a static residual graph; see max_flow.h.
#include "maxflow/max_flow.h"

#include <cmath>
#include <limits>
#include <cstdio>

namespace dcr {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Residual graph in CSR form. Invariants:
//   - the residual arcs of node v are [first[v], first[v + 1]), in input-arc order;
//   - sister[sister[a]] == a, and head[sister[a]] is the tail of a;
//   - residual[a] >= 0 at all times; residual[a] + residual[sister[a]] == c(input arc)
//     (up to rounding) for every input arc, and forward arcs carry input_arc[a] >= 0.
struct ResidualGraph {
  int32_t num_nodes = 0;
  std::vector<int32_t> first;
  std::vector<int32_t> head;
  std::vector<int32_t> sister;
  std::vector<double> residual;
  std::vector<int32_t> reverse_of_input;  // per input arc: its reverse residual arc, -1 on loops

  ResidualGraph(int64_t n, Span<int64_t> tails, Span<int64_t> heads, Span<double> caps)
      : num_nodes(static_cast<int32_t>(n)), first(n + 1, 0) {
    // Counting sort of 2m residual arcs by tail; self-loops never carry flow nor cross a cut.
    for (size_t i = 0; i < tails.size; ++i) {
      if (tails[i] == heads[i]) continue;
      ++first[tails[i] + 1];
      ++first[heads[i] + 1];
    }
    for (int64_t v = 0; v < n; ++v) first[v + 1] += first[v];
    const int32_t num_arcs = first[n];
    head.resize(num_arcs);
    sister.resize(num_arcs);
    residual.resize(num_arcs);
    std::vector<int32_t> next(first.begin(), first.end() - 1);
    reverse_of_input.assign(tails.size, -1);
    for (size_t i = 0; i < tails.size; ++i) {
      const int64_t u = tails[i], v = heads[i];
      if (u == v) continue;
      const int32_t fwd = next[u]++, rev = next[v]++;
      reverse_of_input[i] = rev;
      head[fwd] = static_cast<int32_t>(v);
      head[rev] = static_cast<int32_t>(u);
      sister[fwd] = rev;
      sister[rev] = fwd;
      residual[fwd] = caps[i];
      residual[rev] = 0.0;
    }
  }

  // Nodes reachable from `root` over arcs with positive residual capacity or, with
  // `backwards`, the nodes that reach it (the arc u -> v is the sister of v's arc to u).
  std::vector<uint8_t> Closure(int32_t root, bool backwards) const {
    std::vector<uint8_t> seen(num_nodes, 0);
    std::vector<int32_t> queue{root};
    seen[root] = 1;
    for (size_t qi = 0; qi < queue.size(); ++qi) {
      const int32_t v = queue[qi];
      for (int32_t a = first[v]; a < first[v + 1]; ++a) {
        if (residual[backwards ? sister[a] : a] > 0.0 && !seen[head[a]]) {
          seen[head[a]] = 1;
          queue.push_back(head[a]);
        }
      }
    }
    return seen;
  }
};

// ---------------------------------------------------------------------------------------------
// Boykov-Kolmogorov. Node state invariants:
//   tree[v] in {kFree, kSourceTree, kSinkTree}; s is the root of the source tree, t of the sink
//   tree, both with parent kTerminal.
//   For a tree node v != root, parent[v] is a residual arc at v whose head is v's parent, or
//   kOrphan while v waits for adoption. Source tree: residual[sister[parent[v]]] > 0 (flow can
//   go parent -> v); sink tree: residual[parent[v]] > 0 (v -> parent).
//   dist[v] is an upper bound on v's depth that was exact at time stamp ts[v] (heuristics of
//   the paper, used to prefer shallow parents).
class BoykovKolmogorov {
 public:
  BoykovKolmogorov(ResidualGraph& g, int32_t s, int32_t t)
      : g_(g), s_(s), t_(t), tree_(g.num_nodes, kFree), parent_(g.num_nodes, kNone),
        ts_(g.num_nodes, 0), dist_(g.num_nodes, 0), in_queue_(g.num_nodes, 0) {}

  double Solve() {
    tree_[s_] = kSourceTree;
    tree_[t_] = kSinkTree;
    parent_[s_] = parent_[t_] = kTerminal;
    dist_[s_] = dist_[t_] = 1;
    Activate(s_);
    Activate(t_);
    int32_t current = -1;  // node kept active after an augmentation through it
    while (true) {
      int32_t p = current;
      if (p < 0 || tree_[p] == kFree) p = NextActive();
      if (p < 0) break;
      const int32_t middle = GrowTrees(p);
      ++time_;
      if (middle < 0) {
        current = -1;
        continue;
      }
      current = p;
      Augment(middle);
      Adopt();
    }
    return flow_;
  }

 private:
  static constexpr int8_t kFree = 0, kSourceTree = 1, kSinkTree = 2;
  static constexpr int32_t kNone = -1, kTerminal = -2, kOrphan = -3;

  void Activate(int32_t v) {
    if (!in_queue_[v]) {
      in_queue_[v] = 1;
      queue_.push_back(v);
    }
  }

  int32_t NextActive() {
    while (queue_head_ < queue_.size()) {
      const int32_t v = queue_[queue_head_++];
      in_queue_[v] = 0;
      if (tree_[v] != kFree) return v;
    }
    queue_.clear();
    queue_head_ = 0;
    return -1;
  }

  // Grows the tree of p by its non-saturated arcs. Returns the residual arc (source tree ->
  // sink tree) where the trees touch, or -1 when p is exhausted.
  int32_t GrowTrees(int32_t p) {
    const bool in_source = tree_[p] == kSourceTree;
    for (int32_t a = g_.first[p]; a < g_.first[p + 1]; ++a) {
      const int32_t q = g_.head[a];
      // The arc that carries flow away from the root: p -> q in the source tree, q -> p in the
      // sink tree.
      const int32_t flow_arc = in_source ? a : g_.sister[a];
      if (!(g_.residual[flow_arc] > 0.0)) continue;
      if (tree_[q] == kFree) {
        tree_[q] = tree_[p];
        parent_[q] = g_.sister[a];  // arc at q pointing back to p
        ts_[q] = ts_[p];
        dist_[q] = dist_[p] + 1;
        Activate(q);
      } else if (tree_[q] != tree_[p]) {
        return flow_arc;
      } else if (ts_[q] <= ts_[p] && dist_[q] > dist_[p]) {
        // q is reachable through p by a shorter path: reparent (paper, section 3.2).
        parent_[q] = g_.sister[a];
        ts_[q] = ts_[p];
        dist_[q] = dist_[p] + 1;
      }
    }
    return -1;
  }

  // Pushes the bottleneck along s ~> tail(middle) -> head(middle) ~> t.
  void Augment(int32_t middle) {
    const int32_t p = g_.head[g_.sister[middle]];  // in the source tree
    const int32_t q = g_.head[middle];             // in the sink tree
    double bottleneck = g_.residual[middle];
    for (int32_t v = p; parent_[v] != kTerminal; v = g_.head[parent_[v]]) {
      bottleneck = std::min(bottleneck, g_.residual[g_.sister[parent_[v]]]);
    }
    for (int32_t v = q; parent_[v] != kTerminal; v = g_.head[parent_[v]]) {
      bottleneck = std::min(bottleneck, g_.residual[parent_[v]]);
    }
    // Finite: s and t are not joined by +inf arcs alone (checked before solving).
    Push(middle, bottleneck);
    for (int32_t v = p; parent_[v] != kTerminal;) {
      const int32_t up = parent_[v];
      const int32_t down = g_.sister[up];  // parent -> v
      Push(down, bottleneck);
      const int32_t next = g_.head[up];
      if (g_.residual[down] == 0.0) MakeOrphan(v);
      v = next;
    }
    for (int32_t v = q; parent_[v] != kTerminal;) {
      const int32_t up = parent_[v];  // v -> parent
      Push(up, bottleneck);
      const int32_t next = g_.head[up];
      if (g_.residual[up] == 0.0) MakeOrphan(v);
      v = next;
    }
    flow_ += bottleneck;
  }

  void Push(int32_t arc, double amount) {
    g_.residual[arc] -= amount;
    g_.residual[g_.sister[arc]] += amount;
  }

  void MakeOrphan(int32_t v) {
    parent_[v] = kOrphan;
    orphans_.push_back(v);
  }

  // Depth of v's root path, or -1 if it leads to an orphan. Caches depths with time stamps.
  int32_t RootDistance(int32_t v) {
    int32_t d = 0;
    int32_t j = v;
    while (true) {
      if (ts_[j] == time_) {
        d += dist_[j];
        break;
      }
      const int32_t a = parent_[j];
      ++d;
      if (a == kTerminal) {
        ts_[j] = time_;
        dist_[j] = 1;
        break;
      }
      if (a == kOrphan) return -1;
      j = g_.head[a];
    }
    // Stamp the path so later searches stop early.
    int32_t dd = d;
    for (j = v; ts_[j] != time_; j = g_.head[parent_[j]]) {
      ts_[j] = time_;
      dist_[j] = dd--;
    }
    return d;
  }

  void Adopt() {
    for (size_t oi = 0; oi < orphans_.size(); ++oi) {
      const int32_t v = orphans_[oi];
      const bool in_source = tree_[v] == kSourceTree;
      int32_t best_arc = kNone;
      int32_t best_dist = std::numeric_limits<int32_t>::max();
      for (int32_t a = g_.first[v]; a < g_.first[v + 1]; ++a) {
        const int32_t q = g_.head[a];
        if (tree_[q] != tree_[v]) continue;
        const int32_t flow_arc = in_source ? g_.sister[a] : a;  // q -> v or v -> q
        if (!(g_.residual[flow_arc] > 0.0)) continue;
        const int32_t d = RootDistance(q);
        if (d >= 0 && d < best_dist) {
          best_dist = d;
          best_arc = a;
        }
      }
      if (best_arc != kNone) {
        parent_[v] = best_arc;
        ts_[v] = time_;
        dist_[v] = best_dist + 1;
        continue;
      }
      // No valid parent: v leaves its tree; neighbours that could reach it become active and
      // its children become orphans.
      for (int32_t a = g_.first[v]; a < g_.first[v + 1]; ++a) {
        const int32_t q = g_.head[a];
        if (tree_[q] != tree_[v]) continue;
        const int32_t flow_arc = in_source ? g_.sister[a] : a;
        if (g_.residual[flow_arc] > 0.0) Activate(q);
        const int32_t qa = parent_[q];
        if (qa >= 0 && g_.head[qa] == v) MakeOrphan(q);
      }
      tree_[v] = kFree;
    }
    orphans_.clear();
  }

  ResidualGraph& g_;
  const int32_t s_, t_;
  std::vector<int8_t> tree_;
  std::vector<int32_t> parent_;
  std::vector<int64_t> ts_;
  std::vector<int32_t> dist_;
  std::vector<uint8_t> in_queue_;
  std::vector<int32_t> queue_;
  size_t queue_head_ = 0;
  std::vector<int32_t> orphans_;
  int64_t time_ = 1;
  double flow_ = 0.0;
};

// ---------------------------------------------------------------------------------------------
// Dinic: blocking flows on the BFS level graph, iterative DFS with current-arc pointers.
double SolveDinic(ResidualGraph& g, int32_t s, int32_t t) {
  const int32_t n = g.num_nodes;
  std::vector<int32_t> level(n), current(n), queue, path;
  queue.reserve(n);
  double flow = 0.0;
  while (true) {
    std::fill(level.begin(), level.end(), -1);
    queue.assign(1, s);
    level[s] = 0;
    for (size_t qi = 0; qi < queue.size() && level[t] < 0; ++qi) {
      const int32_t v = queue[qi];
      for (int32_t a = g.first[v]; a < g.first[v + 1]; ++a) {
        if (g.residual[a] > 0.0 && level[g.head[a]] < 0) {
          level[g.head[a]] = level[v] + 1;
          queue.push_back(g.head[a]);
        }
      }
    }
    if (level[t] < 0) break;
    std::copy(g.first.begin(), g.first.end() - 1, current.begin());
    path.clear();
    int32_t v = s;
    while (true) {
      if (v == t) {
        double bottleneck = kInf;
        for (int32_t a : path) bottleneck = std::min(bottleneck, g.residual[a]);
        size_t keep = path.size();
        for (size_t i = 0; i < path.size(); ++i) {
          const int32_t a = path[i];
          g.residual[a] -= bottleneck;
          g.residual[g.sister[a]] += bottleneck;
          if (g.residual[a] == 0.0 && i < keep) keep = i;
        }
        flow += bottleneck;
        path.resize(keep);  // retreat to the tail of the first saturated arc
        v = path.empty() ? s : g.head[path.back()];
        continue;
      }
      bool advanced = false;
      for (int32_t& a = current[v]; a < g.first[v + 1]; ++a) {
        const int32_t w = g.head[a];
        if (g.residual[a] > 0.0 && level[w] == level[v] + 1) {
          path.push_back(a);
          v = w;
          advanced = true;
          break;
        }
      }
      if (advanced) continue;
      if (v == s) break;
      level[v] = -1;  // dead end for this phase
      const int32_t a = path.back();
      path.pop_back();
      v = g.head[g.sister[a]];
      ++current[v];
    }
  }
  return flow;
}

// Messages are built with std::to_string / snprintf, never iostreams: next to some torch
// builds in one process, libstdc++'s stream and locale code crashed (seen with torch 2.11+cu130).
std::string ArcName(const char* what, size_t i) {
  return std::string(what) + "[" + std::to_string(i) + "]";
}

std::string FormatDouble(double x) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", x);
  return buf;
}

}  // namespace

void ValidateFlowInput(int64_t num_nodes, Span<int64_t> tails, Span<int64_t> heads,
                       Span<double> capacities, int64_t source, int64_t sink) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (num_nodes < 2) fail("num_nodes must be >= 2, got " + std::to_string(num_nodes));
  if (num_nodes >= std::numeric_limits<int32_t>::max())
    fail("num_nodes = " + std::to_string(num_nodes) + " exceeds the solver's 2^31 - 1 limit");
  if (tails.size != heads.size || tails.size != capacities.size) {
    fail("tails, heads and capacities must have one length; got " + std::to_string(tails.size) +
         ", " + std::to_string(heads.size) + " and " + std::to_string(capacities.size));
  }
  if (2 * tails.size >= static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    fail("too many arcs (" + std::to_string(tails.size) + ") for the solver's 2^30 limit");
  auto check_node = [&](const std::string& name, int64_t v) {
    if (v < 0 || v >= num_nodes) {
      fail(name + " = " + std::to_string(v) + " is out of range [0, " +
           std::to_string(num_nodes) + ")");
    }
  };
  check_node("source", source);
  check_node("sink", sink);
  if (source == sink) fail("source and sink must differ; both are " + std::to_string(source));
  for (size_t i = 0; i < tails.size; ++i) {
    // Names are built only on failure: this loop runs over every arc of every solve.
    if (tails[i] < 0 || tails[i] >= num_nodes) check_node(ArcName("tails", i), tails[i]);
    if (heads[i] < 0 || heads[i] >= num_nodes) check_node(ArcName("heads", i), heads[i]);
    const double c = capacities[i];
    if (std::isnan(c)) fail(ArcName("capacities", i) + " is NaN");
    if (c < 0.0) fail(ArcName("capacities", i) + " = " + FormatDouble(c) + " is negative");
  }
}

std::vector<int64_t> FindInfinitePath(int64_t num_nodes, Span<int64_t> tails,
                                      Span<int64_t> heads, Span<double> capacities,
                                      int64_t source, int64_t sink) {
  std::vector<int64_t> first(num_nodes + 1, 0);
  for (size_t i = 0; i < tails.size; ++i)
    if (std::isinf(capacities[i])) ++first[tails[i] + 1];
  for (int64_t v = 0; v < num_nodes; ++v) first[v + 1] += first[v];
  std::vector<int64_t> adj(first[num_nodes]);
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (size_t i = 0; i < tails.size; ++i)
    if (std::isinf(capacities[i])) adj[next[tails[i]]++] = heads[i];
  std::vector<int64_t> pred(num_nodes, -1);
  std::vector<int64_t> queue{source};
  pred[source] = source;
  for (size_t qi = 0; qi < queue.size() && pred[sink] < 0; ++qi) {
    const int64_t v = queue[qi];
    for (int64_t k = first[v]; k < first[v + 1]; ++k) {
      if (pred[adj[k]] < 0) {
        pred[adj[k]] = v;
        queue.push_back(adj[k]);
      }
    }
  }
  std::vector<int64_t> path;
  if (pred[sink] < 0) return path;
  for (int64_t v = sink; v != source; v = pred[v]) path.push_back(v);
  path.push_back(source);
  return {path.rbegin(), path.rend()};
}

MinCutResult MinStCut(int64_t num_nodes, Span<int64_t> tails, Span<int64_t> heads,
                      Span<double> capacities, int64_t source, int64_t sink,
                      MaxFlowAlgorithm algorithm, CutSide side) {
  ValidateFlowInput(num_nodes, tails, heads, capacities, source, sink);
  std::vector<int64_t> inf_path =
      FindInfinitePath(num_nodes, tails, heads, capacities, source, sink);
  if (!inf_path.empty()) {
    std::string msg = "the cut is unbounded: source " + std::to_string(source) + " reaches sink " +
                      std::to_string(sink) + " through arcs of infinite capacity only, along ";
    for (size_t i = 0; i < inf_path.size(); ++i) msg += (i ? " -> " : "") + std::to_string(inf_path[i]);
    throw UnboundedCutError(msg, std::move(inf_path));
  }

  ResidualGraph g(num_nodes, tails, heads, capacities);
  const int32_t s = static_cast<int32_t>(source), t = static_cast<int32_t>(sink);
  MinCutResult result;
  if (algorithm == MaxFlowAlgorithm::kDinic) {
    result.flow_value = SolveDinic(g, s, t);
  } else {
    result.flow_value = BoykovKolmogorov(g, s, t).Solve();
  }

  if (side == CutSide::kSourceMinimal) {
    result.source_side = g.Closure(s, /*backwards=*/false);
  } else {
    result.source_side = g.Closure(t, /*backwards=*/true);
    for (uint8_t& v : result.source_side) v = !v;
  }
  result.arc_flow.assign(tails.size, 0.0);
  for (size_t i = 0; i < tails.size; ++i)
    if (g.reverse_of_input[i] >= 0) result.arc_flow[i] = g.residual[g.reverse_of_input[i]];
  double finite_total = 0.0;
  for (size_t i = 0; i < tails.size; ++i) {
    if (!std::isinf(capacities[i])) finite_total += capacities[i];
    if (result.source_side[tails[i]] && !result.source_side[heads[i]]) {
      result.cut_arcs.push_back(static_cast<int64_t>(i));
      result.value += capacities[i];
    }
  }
  // Self-check (cheap next to the solve): a maximum flow leaves t unreachable, and the cut it
  // induces has the flow's value.
  if (result.source_side[t] || !result.source_side[s])
    throw std::logic_error("max-flow internal error: s and t not separated after the solve");
  if (std::isinf(result.value) ||
      std::abs(result.value - result.flow_value) > 1e-9 * std::max(1.0, finite_total)) {
    throw std::logic_error("max-flow internal error: cut value " + FormatDouble(result.value) +
                           " != flow value " + FormatDouble(result.flow_value));
  }
  return result;
}

}  // namespace dcr
