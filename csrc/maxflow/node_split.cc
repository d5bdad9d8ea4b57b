#include "maxflow/node_split.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace dcr {

SplitNetwork BuildSplitNetwork(Span<double> node_costs, Span<int64_t> edge_tails,
                               Span<int64_t> edge_heads, Span<int64_t> source_nodes,
                               Span<int64_t> sink_nodes) {
  const int64_t n = static_cast<int64_t>(node_costs.size);
  auto check = [n](const char* what, size_t i, int64_t v) {
    if (v < 0 || v >= n) {
      throw std::invalid_argument(std::string(what) + "[" + std::to_string(i) + "] = " +
                                  std::to_string(v) + " is out of range [0, " +
                                  std::to_string(n) + ")");
    }
  };
  if (edge_tails.size != edge_heads.size) {
    throw std::invalid_argument("edge_tails and edge_heads must have one length; got " +
                                std::to_string(edge_tails.size) + " and " +
                                std::to_string(edge_heads.size));
  }
  constexpr double kInf = std::numeric_limits<double>::infinity();
  SplitNetwork net;
  net.num_nodes = 2 * n + 2;
  net.source = 2 * n;
  net.sink = 2 * n + 1;
  const size_t m = n + edge_tails.size + source_nodes.size + sink_nodes.size;
  net.tails.reserve(m);
  net.heads.reserve(m);
  net.capacities.reserve(m);
  auto add = [&net](int64_t u, int64_t v, double c) {
    net.tails.push_back(u);
    net.heads.push_back(v);
    net.capacities.push_back(c);
  };
  for (int64_t v = 0; v < n; ++v) {
    const double c = node_costs[v];
    if (std::isnan(c) || c < 0.0) {
      throw std::invalid_argument("node_costs[" + std::to_string(v) + "] = " +
                                  std::to_string(c) + " must be >= 0 (inf allowed)");
    }
    add(SplitIn(v), SplitOut(v), c);
  }
  for (size_t i = 0; i < edge_tails.size; ++i) {
    check("edge_tails", i, edge_tails[i]);
    check("edge_heads", i, edge_heads[i]);
    add(SplitOut(edge_tails[i]), SplitIn(edge_heads[i]), kInf);
  }
  for (size_t i = 0; i < source_nodes.size; ++i) {
    check("source_nodes", i, source_nodes[i]);
    add(net.source, SplitIn(source_nodes[i]), kInf);
  }
  for (size_t i = 0; i < sink_nodes.size; ++i) {
    check("sink_nodes", i, sink_nodes[i]);
    add(SplitIn(sink_nodes[i]), net.sink, kInf);
  }
  return net;
}

std::vector<int64_t> CutNodes(const MinCutResult& cut, int64_t num_graph_nodes) {
  std::vector<int64_t> nodes;
  for (int64_t a : cut.cut_arcs) {
    if (a < num_graph_nodes) nodes.push_back(a);  // arcs are ascending, so nodes are too
  }
  return nodes;
}

}  // namespace dcr
