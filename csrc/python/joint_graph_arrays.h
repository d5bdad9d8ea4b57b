// The joint graph as the arrays deepcompile_remat/fx_arrays.py writes (in this order), viewed
// without a copy: what partition_joint_graph and BudgetSolver both take. The arrays must
// outlive the view; JointGraphView's Validate() checks them before any algorithm reads them.
#pragma once

#include "graph/joint_graph.h"
#include "python/numpy_span.h"

namespace dcr::python {

inline JointGraphView ViewOfJointGraph(const F64Array& bytes, const U8Array& op_class,
                                       const U32Array& flags, const I8Array& recompute,
                                       const I64Array& ac_graph_id, const I64Array& edge_tails,
                                       const I64Array& edge_heads, const I64Array& fwd_outputs,
                                       const I64Array& bwd_outputs) {
  JointGraphView g;
  g.num_nodes = static_cast<int64_t>(bytes.size());
  g.bytes = AsSpan(bytes);
  g.op_class = AsSpan(op_class);
  g.flags = AsSpan(flags);
  g.recompute = AsSpan(recompute);
  g.ac_graph_id = AsSpan(ac_graph_id);
  g.edge_tails = AsSpan(edge_tails);
  g.edge_heads = AsSpan(edge_heads);
  g.fwd_outputs = AsSpan(fwd_outputs);
  g.bwd_outputs = AsSpan(bwd_outputs);
  return g;
}

}  // namespace dcr::python
