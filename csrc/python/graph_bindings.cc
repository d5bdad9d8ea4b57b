// The joint graph (csrc/graph/joint_graph.h) and the memory graph (csrc/memsim/memory_sim.h) as
// Python classes built by keyword and read by attribute (array_struct.h). A new array is its
// C++ field plus one Field line here; deepcompile_remat/fx_arrays.py passes it by name.
#include <pybind11/pybind11.h>

#include "python/bound_graphs.h"

namespace py = pybind11;

namespace dcr::python {

void BindGraphs(py::module_& m) {
  ArrayStruct<JointGraphView>(
      m, "JointGraph",
      "An AOTAutograd joint graph as csrc/graph/joint_graph.h's arrays, by keyword: nodes are "
      "ids in FX order (num_nodes = len(bytes)), edges producer -> consumer. Validated on "
      "construction (JointGraphView::Validate: ValueError naming the array and index).")
      .Field("bytes", &JointGraphView::bytes, "float64[n]: bytes of each value (may be inf).")
      .Field("op_class", &JointGraphView::op_class, "uint8[n]: OpClass of each node.")
      .Field("flags", &JointGraphView::flags, "uint32[n]: NodeFlag bits of each node.")
      .Field("recompute", &JointGraphView::recompute, "int8[n]: RecomputeTag of each node.")
      .Field("ac_graph_id", &JointGraphView::ac_graph_id,
             "int64[n]: checkpoint region of a tagged node, -1 where none.")
      .Field("edge_tails", &JointGraphView::edge_tails, "int64[m]: producer of each edge.")
      .Field("edge_heads", &JointGraphView::edge_heads, "int64[m]: consumer of each edge.")
      .Field("fwd_outputs", &JointGraphView::fwd_outputs, "int64: the forward's outputs.")
      .Field("bwd_outputs", &JointGraphView::bwd_outputs, "int64: the backward's outputs.");

  ArrayStruct<MemoryGraph>(
      m, "MemoryGraph",
      "A graph as csrc/memsim/memory_sim.h's MemoryGraph, by keyword (num_nodes = "
      "len(bytes)). Validated on construction (MemoryGraph::Validate: ValueError naming the "
      "array and index).")
      .Field("bytes", &MemoryGraph::bytes, "float64[n]: bytes each node allocates.")
      .Field("alias_of", &MemoryGraph::alias_of, "int64[n]: the base node of an alias, or -1.")
      .Field("is_input", &MemoryGraph::is_input, "uint8[n]: alive before step 0.")
      .Field("persistent", &MemoryGraph::persistent, "uint8[n]: an input never freed.")
      .Field("keep", &MemoryGraph::keep, "uint8[n]: never freed (graph outputs).")
      .Field("workspace", &MemoryGraph::workspace,
             "float64[n] or float64[0]: scratch bytes alive only while each node runs.")
      .Field("edge_tails", &MemoryGraph::edge_tails, "int64[m]: producer of each edge.")
      .Field("edge_heads", &MemoryGraph::edge_heads, "int64[m]: consumer of each edge.");
}

}  // namespace dcr::python
