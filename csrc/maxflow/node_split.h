// Node splitting: turns costs on nodes into capacities on arcs, so an s-t edge cut selects
// nodes (the classical vertex-cut reduction; see the min-cut recomputation posts in the seeds).
//
// Graph node v becomes v_in = 2v and v_out = 2v + 1 with the arc v_in -> v_out of capacity
// cost(v); a data edge u -> v becomes u_out -> v_in of capacity +inf, so no data edge is ever
// cut. The super source is 2n, the super sink 2n + 1: source -> v_in (+inf) for every node in
// `source_nodes`, v_in -> sink (+inf) for every node in `sink_nodes`. A minimum cut therefore
// consists of node arcs only, and the nodes whose arc is cut are the chosen set.
#pragma once

#include <cstdint>
#include <vector>

#include "common/span.h"
#include "maxflow/max_flow.h"

namespace dcr {

struct SplitNetwork {
  int64_t num_nodes = 0;  // 2n + 2
  int64_t source = 0;     // 2n
  int64_t sink = 0;       // 2n + 1
  std::vector<int64_t> tails, heads;
  std::vector<double> capacities;
  // Arc i < n is node i's v_in -> v_out arc; the rest are edges and terminal arcs.
};

inline int64_t SplitIn(int64_t v) { return 2 * v; }
inline int64_t SplitOut(int64_t v) { return 2 * v + 1; }

// Preconditions (std::invalid_argument otherwise): node_costs.size == n, costs >= 0 and not NaN
// (+inf allowed: that node can never be cut), edge endpoints and terminal nodes in [0, n).
SplitNetwork BuildSplitNetwork(Span<double> node_costs, Span<int64_t> edge_tails,
                               Span<int64_t> edge_heads, Span<int64_t> source_nodes,
                               Span<int64_t> sink_nodes);

// The nodes whose v_in -> v_out arc is in the cut, ascending.
std::vector<int64_t> CutNodes(const MinCutResult& cut, int64_t num_graph_nodes);

}  // namespace dcr
