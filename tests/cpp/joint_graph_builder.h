// Test helper: a joint graph built node by node (ids follow insertion order, so topological),
// owning the arrays that JointGraphView points into.
#pragma once

#include <cstdint>
#include <vector>

#include "graph/joint_graph.h"

namespace dcr::test_support {

struct JointGraphArrays {
  std::vector<double> bytes;
  std::vector<uint8_t> op_class;
  std::vector<uint32_t> flags;
  std::vector<int8_t> recompute;
  std::vector<int64_t> ac_graph_id, tails, heads, fwd_outputs, bwd_outputs;

  // Appends a node reading `inputs`; returns its id.
  int64_t AddNode(OpClass c, const std::vector<int64_t>& inputs, double size, uint32_t f,
                  RecomputeTag tag = RecomputeTag::kNone, int64_t ac_id = -1) {
    const int64_t v = static_cast<int64_t>(bytes.size());
    bytes.push_back(size);
    op_class.push_back(static_cast<uint8_t>(c));
    flags.push_back(f);
    recompute.push_back(static_cast<int8_t>(tag));
    ac_graph_id.push_back(ac_id);
    for (int64_t u : inputs) tails.push_back(u), heads.push_back(v);
    return v;
  }

  JointGraphView View() const {
    JointGraphView g;
    g.num_nodes = static_cast<int64_t>(bytes.size());
    g.bytes = bytes;
    g.op_class = op_class;
    g.flags = flags;
    g.recompute = recompute;
    g.ac_graph_id = ac_graph_id;
    g.edge_tails = tails;
    g.edge_heads = heads;
    g.fwd_outputs = fwd_outputs;
    g.bwd_outputs = bwd_outputs;
    return g;
  }
};

}  // namespace dcr::test_support
