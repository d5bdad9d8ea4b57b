// Binding of the rematerialization partition (csrc/partition) and the enums of its arrays
// (csrc/graph/joint_graph.h, NodeInfoBit): Python uses these, never copies of their values. The
// Python fx bridge (deepcompile_remat/fx_arrays.py, partition/fx_export.py) exports the joint
// graph as these arrays.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "partition/remat_partition.h"
#include "python/error_types.h"
#include "python/joint_graph_arrays.h"
#include "python/numpy_span.h"

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
      .value("RNG_REPLAYABLE", kRngReplayable);

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

  m.def(
      "partition_joint_graph",
      [](const F64Array& bytes, const U8Array& op_class, const U32Array& flags,
         const I8Array& recompute, const I64Array& ac_graph_id, const I64Array& edge_tails,
         const I64Array& edge_heads, const I64Array& fwd_outputs, const I64Array& bwd_outputs,
         RematPolicy policy, bool mark_parameter_aliases) {
        const JointGraphView g =
            ViewOfJointGraph(bytes, op_class, flags, recompute, ac_graph_id, edge_tails,
                             edge_heads, fwd_outputs, bwd_outputs);
        const PartitionOptions options{policy, mark_parameter_aliases};
        PartitionResult r;
        {
          py::gil_scoped_release release;
          r = PartitionJointGraph(g, options);
        }
        return py::make_tuple(ToNumpy(r.saved_nodes), r.cut_cost, ToNumpy(r.node_info));
      },
      py::arg("bytes"), py::arg("op_class"), py::arg("flags"), py::arg("recompute"),
      py::arg("ac_graph_id"), py::arg("edge_tails"), py::arg("edge_heads"),
      py::arg("fwd_outputs"), py::arg("bwd_outputs"), py::arg("policy"),
      py::arg("mark_parameter_aliases"),
      "Min-cut rematerialization: returns (saved_nodes int64[k], cut_cost, node_info uint8[n]).");
}

}  // namespace dcr::python
