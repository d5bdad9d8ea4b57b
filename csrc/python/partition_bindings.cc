// Binding of the rematerialization partition (csrc/partition) and the enums of its arrays
// (csrc/graph/joint_graph.h, NodeInfoBit): Python uses these, never copies of their values. The
// Python fx bridge (deepcompile_remat/fx_arrays.py, partition/fx_export.py) builds the joint
// graph (_C.JointGraph, graph_bindings.cc) from them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "partition/remat_partition.h"
#include "python/error_types.h"
#include "python/bound_graphs.h"

namespace py = pybind11;

namespace dcr::python {

void BindPartition(py::module_& m) {
  // PartitionConflictError(ValueError) carries `.nodes` (graph node ids along the conflicting
  // chain) and `.reasons` (one string per node); the Python layer maps ids to FX node names.
  BindValueError<PartitionConflictError>(
      m, "PartitionConflictError", [](const PartitionConflictError& e, py::object& err) {
        err.attr("nodes") = py::cast(e.nodes());
        err.attr("reasons") = py::cast(e.reasons());
      });

  py::enum_<RematPolicy>(m, "RematPolicy")
      .value("conservative", RematPolicy::kConservative)
      .value("aggressive", RematPolicy::kAggressive);

  py::enum_<OpClass>(m, "OpClass", py::arithmetic(), "What kind of op produces a node.")
      .value("PLACEHOLDER", OpClass::kPlaceholder)
      .value("VIEW", OpClass::kView)
      .value("CAST", OpClass::kCast)
      .value("POINTWISE", OpClass::kPointwise)
      .value("REDUCTION", OpClass::kReduction)
      .value("COMPUTE_INTENSIVE", OpClass::kComputeIntensive)
      .value("RANDOM", OpClass::kRandom)
      .value("GATHER", OpClass::kGather)
      .value("GETITEM", OpClass::kGetItem)
      .value("OTHER", OpClass::kOther);

  py::enum_<NodeFlag>(m, "NodeFlag", py::arithmetic(), "Per-node flag bits (or'ed).")
      .value("PRIMAL", kPrimal)
      .value("BACKWARD_INPUT", kBackwardInput)
      .value("FORWARD_SEED", kForwardSeed)
      .value("STATIC_INPUT", kStaticInput)
      .value("PARAMETER", kParameter)
      .value("NON_TENSOR", kNonTensor)
      .value("SYM_INT", kSymInt)
      .value("SYM_FLOAT", kSymFloat)
      .value("MUST_BE_IN_BACKWARD", kMustBeInBackward)
      .value("RNG_REPLAYABLE", kRngReplayable)
      .value("PINNED_TO_FORWARD", kPinnedToForward)
      .value("COPIED_WHEN_SAVED", kCopiedWhenSaved);

  py::enum_<RecomputeTag>(m, "RecomputeTag", py::arithmetic(),
                          "A node's CheckpointPolicy tag (node.meta['recompute']).")
      .value("NONE", RecomputeTag::kNone)
      .value("MUST_SAVE", RecomputeTag::kMustSave)
      .value("PREFER_SAVE", RecomputeTag::kPreferSave)
      .value("MUST_RECOMPUTE", RecomputeTag::kMustRecompute)
      .value("PREFER_RECOMPUTE", RecomputeTag::kPreferRecompute);

  py::enum_<NodeInfoBit>(m, "NodeInfoBit", py::arithmetic(),
                         "Bits of partition_joint_graph's node_info (or'ed).")
      .value("REQUIRED_FORWARD", kRequiredForward)
      .value("TANGENT_CLOSURE", kTangentClosure)
      .value("REQUIRED_BACKWARD", kRequiredBackward)
      .value("MUST_RECOMPUTE", kMustRecompute)
      .value("BANNED", kBanned)
      .value("PARAMETER_ALIAS", kParameterAlias)
      .value("RECOMPUTE_REQUESTED", kRecomputeRequested);

  py::class_<PartitionResult> result(m, "PartitionResult",
                                     "What partition_joint_graph decided (remat_partition.h).");
  DefArray(result, "saved_nodes", &PartitionResult::saved_nodes,
           "int64, ascending: the values the forward hands over.");
  result.def_readonly("cut_cost", &PartitionResult::cut_cost,
                      "Sum of the saved nodes' costs (penalties included).");
  result.def_readonly("request_penalty", &PartitionResult::request_penalty,
                      "P: the cost added for saving a PREFER_RECOMPUTE node.");
  DefArray(result, "node_info", &PartitionResult::node_info, "uint8[n]: NodeInfoBit per node.");

  m.def(
      "partition_joint_graph",
      [](const BoundJointGraph& graph, RematPolicy policy, bool mark_parameter_aliases) {
        const PartitionOptions options{policy, mark_parameter_aliases};
        py::gil_scoped_release release;
        return PartitionJointGraph(graph.view, options);
      },
      py::arg("graph"), py::arg("policy"), py::arg("mark_parameter_aliases"),
      "Min-cut rematerialization of a JointGraph: a PartitionResult.");
}

}  // namespace dcr::python
