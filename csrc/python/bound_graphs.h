// The graphs Python hands the C++ core, as bound classes (graph_bindings.cc): the numpy arrays,
// held, and the view over them that the entry points read.
#pragma once

#include "graph/joint_graph.h"
#include "memsim/memory_sim.h"
#include "python/array_struct.h"

namespace dcr::python {

using BoundJointGraph = HeldArrays<JointGraphView>;  // _C.JointGraph
using BoundMemoryGraph = HeldArrays<MemoryGraph>;    // _C.MemoryGraph

}  // namespace dcr::python
