// Binding of the memory-budget sweep (csrc/partition/budget_cut.h). Thin: the arrays are those
// partition_joint_graph takes (fx_export.py) plus a per-node recompute cost.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "partition/budget_cut.h"
#include "python/error_types.h"
#include "python/joint_graph_arrays.h"
#include "python/numpy_span.h"

namespace py = pybind11;

namespace dcr::python {
namespace {

py::tuple PointTuple(const CutPoint& p) {
  return py::make_tuple(p.saved_bytes, p.recompute_cost, ToNumpy(p.saved_nodes),
                        ToNumpy(p.recomputed_nodes));
}

}  // namespace

void BindBudget(py::module_& m) {
  // BudgetInfeasibleError(ValueError) carries `.min_bytes`: the smallest feasible budget.
  BindValueError<BudgetInfeasibleError>(
      m, "BudgetInfeasibleError", [](const BudgetInfeasibleError& e, py::object& err) {
        err.attr("min_bytes") = e.min_bytes();
      });

  py::class_<BudgetSolver>(m, "BudgetSolver",
                           "Parametric min-cut over one joint graph (budget_cut.h).")
      .def(py::init([](const F64Array& bytes, const U8Array& op_class, const U32Array& flags,
                       const I8Array& recompute, const I64Array& ac_graph_id,
                       const I64Array& edge_tails, const I64Array& edge_heads,
                       const I64Array& fwd_outputs, const I64Array& bwd_outputs,
                       const F64Array& recompute_cost, RematPolicy policy,
                       bool mark_parameter_aliases) {
             const JointGraphView g =
                 ViewOfJointGraph(bytes, op_class, flags, recompute, ac_graph_id, edge_tails,
                                  edge_heads, fwd_outputs, bwd_outputs);
             const PartitionOptions options{policy, mark_parameter_aliases};
             py::gil_scoped_release release;
             return std::make_unique<BudgetSolver>(g, AsSpan(recompute_cost), options);
           }),
           py::arg("bytes"), py::arg("op_class"), py::arg("flags"), py::arg("recompute"),
           py::arg("ac_graph_id"), py::arg("edge_tails"), py::arg("edge_heads"),
           py::arg("fwd_outputs"), py::arg("bwd_outputs"), py::arg("recompute_cost"),
           py::arg("policy"), py::arg("mark_parameter_aliases"))
      .def(
          "hull",
          [](BudgetSolver& s) {
            const BudgetHull* h = nullptr;  // the solver's cached hull, not a copy
            {
              py::gil_scoped_release release;
              h = &s.Hull();
            }
            py::list vertices;
            for (const CutPoint& p : h->vertices) vertices.append(PointTuple(p));
            return py::make_tuple(vertices, ToNumpy(h->edge_lambda));
          },
          "Lower convex hull: ([(bytes, cost, saved int64[k], recomputed int64[r])...], "
          "edge_lambda float64[v-1]); bytes ascending.")
      .def(
          "choose",
          [](BudgetSolver& s, double budget_bytes) {
            BudgetDecision d;
            {
              py::gil_scoped_release release;
              d = s.Choose(budget_bytes);
            }
            return py::make_tuple(PointTuple(d.point), d.vertex, d.edge, d.hull_cost_at_budget,
                                  d.optimality_gap);
          },
          py::arg("budget_bytes"),
          "Least-cost cut within the budget: ((bytes, cost, saved, recomputed), vertex, edge, "
          "hull_cost_at_budget, optimality_gap). Raises BudgetInfeasibleError below the "
          "smallest feasible budget (its .min_bytes).")
      .def(
          "solve_at",
          [](BudgetSolver& s, double lambda) {
            CutPoint p;
            std::vector<uint8_t> side;
            {
              py::gil_scoped_release release;
              p = s.SolveAt(lambda, &side);
            }
            return py::make_tuple(PointTuple(p), ToNumpy(side));
          },
          py::arg("lambda_"),
          "Source-minimal min cut of bytes + lambda * cost: ((bytes, cost, saved, recomputed), "
          "forward_side uint8[n]).")
      .def_property_readonly("save_bytes", [](const BudgetSolver& s) { return ToNumpy(s.save_bytes()); })
      .def_property_readonly("recompute_price",
                             [](const BudgetSolver& s) { return ToNumpy(s.recompute_price()); })
      .def_property_readonly("node_info", [](const BudgetSolver& s) { return ToNumpy(s.node_info()); })
      .def_property_readonly("one_forward_cost", &BudgetSolver::one_forward_cost);
}

}  // namespace dcr::python
