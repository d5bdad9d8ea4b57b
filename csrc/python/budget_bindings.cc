// Binding of the memory-budget sweep (csrc/partition/budget_cut.h). Thin: the solver takes the
// JointGraph partition_joint_graph takes plus a per-node recompute cost; its results are bound
// classes read by attribute.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <vector>

#include "partition/budget_cut.h"
#include "python/bound_graphs.h"
#include "python/error_types.h"
#include "python/numpy_span.h"

namespace py = pybind11;

namespace dcr::python {
namespace {

// What solve_at returns: the cut and, per node, whether v_in is on the source side.
struct ForwardSideCut {
  CutPoint point;
  std::vector<uint8_t> forward_side;
};

}  // namespace

void BindBudget(py::module_& m) {
  // BudgetInfeasibleError(ValueError) carries `.min_bytes`: the smallest feasible budget.
  BindValueError<BudgetInfeasibleError>(
      m, "BudgetInfeasibleError", [](const BudgetInfeasibleError& e, py::object& err) {
        err.attr("min_bytes") = e.min_bytes();
      });

  py::class_<CutPoint> point(m, "CutPoint", "A legal cut, as the backward sees it.");
  point.def_readonly("saved_bytes", &CutPoint::saved_bytes)
      .def_readonly("recompute_cost", &CutPoint::recompute_cost);
  DefArray(point, "saved_nodes", &CutPoint::saved_nodes,
           "int64, ascending: the values the forward hands over.");
  DefArray(point, "recomputed_nodes", &CutPoint::recomputed_nodes,
           "int64, ascending: forward nodes the backward recomputes.");

  py::class_<BudgetHull> hull(m, "BudgetHull",
                              "Lower convex hull of (saved bytes, recompute cost).");
  hull.def_readonly("vertices", &BudgetHull::vertices,
                    "CutPoints, bytes strictly ascending, cost strictly descending.");
  DefArray(hull, "edge_lambda", &BudgetHull::edge_lambda,
           "float64[len(vertices) - 1]: each edge's slope (bytes per unit cost).");

  py::class_<BudgetDecision>(m, "BudgetDecision", "What BudgetSolver.choose decided.")
      .def_readonly("point", &BudgetDecision::point)
      .def_readonly("edge", &BudgetDecision::edge, "Hull edge walked, -1 at a vertex.")
      .def_readonly("vertex", &BudgetDecision::vertex, "Hull vertex chosen, -1 on an edge.")
      .def_readonly("saved_bytes_budget", &BudgetDecision::saved_bytes_budget)
      .def_readonly("hull_cost_at_budget", &BudgetDecision::hull_cost_at_budget,
                    "Lower bound: no cut within the budget costs less.")
      .def_readonly("optimality_gap", &BudgetDecision::optimality_gap,
                    "point.recompute_cost - hull_cost_at_budget >= 0.");

  py::class_<ForwardSideCut> side_cut(m, "ForwardSideCut", "What BudgetSolver.solve_at found.");
  side_cut.def_readonly("point", &ForwardSideCut::point);
  DefArray(side_cut, "forward_side", &ForwardSideCut::forward_side,
           "uint8[n]: 1 where v_in is on the source side.");

  py::class_<BudgetSolver>(m, "BudgetSolver",
                           "Parametric min-cut over one joint graph (budget_cut.h).")
      .def(py::init([](const BoundJointGraph& graph, const F64Array& recompute_cost,
                       RematPolicy policy, bool mark_parameter_aliases) {
             const PartitionOptions options{policy, mark_parameter_aliases};
             py::gil_scoped_release release;
             return std::make_unique<BudgetSolver>(graph.view, AsSpan(recompute_cost), options);
           }),
           py::arg("graph"), py::arg("recompute_cost"), py::arg("policy"),
           py::arg("mark_parameter_aliases"))
      .def(
          "hull",
          [](BudgetSolver& s) -> const BudgetHull& {
            py::gil_scoped_release release;
            return s.Hull();  // the solver's cached hull, not a copy
          },
          py::return_value_policy::reference_internal,
          "Lower convex hull: a BudgetHull (computed once, then cached).")
      .def(
          "choose",
          [](BudgetSolver& s, double saved_bytes_budget) {
            py::gil_scoped_release release;
            return s.Choose(saved_bytes_budget);
          },
          py::arg("saved_bytes_budget"),
          "Least-cost cut within the budget: a BudgetDecision. Raises BudgetInfeasibleError "
          "below the smallest feasible budget (its .min_bytes).")
      .def(
          "solve_at",
          [](BudgetSolver& s, double lambda) {
            ForwardSideCut cut;
            py::gil_scoped_release release;
            cut.point = s.SolveAt(lambda, &cut.forward_side);
            return cut;
          },
          py::arg("lambda_"),
          "Source-minimal min cut of bytes + lambda * cost: a ForwardSideCut.")
      .def(
          "evaluate",
          [](const BudgetSolver& s, const I64Array& saved_nodes) {
            const std::vector<int64_t> saved(saved_nodes.data(),
                                             saved_nodes.data() + saved_nodes.size());
            bool legal = false;
            CutPoint point;
            {
              py::gil_scoped_release release;
              point = s.Evaluate(saved, &legal);
            }
            if (!legal)
              throw std::invalid_argument(
                  "evaluate: the saved set holds a node that may not be saved, or leaves one "
                  "to the backward that may not be recomputed");
            return point;
          },
          py::arg("saved_nodes"),
          "Saved bytes, recomputed nodes and cost of a legal saved set: a CutPoint. Raises "
          "ValueError for an illegal one.")
      .def_property_readonly("save_bytes",
                             [](const BudgetSolver& s) { return ToNumpy(s.save_bytes()); })
      .def_property_readonly("recompute_price",
                             [](const BudgetSolver& s) { return ToNumpy(s.recompute_price()); })
      .def_property_readonly("node_info",
                             [](const BudgetSolver& s) { return ToNumpy(s.node_info()); })
      .def_property_readonly("one_forward_cost", &BudgetSolver::one_forward_cost);
}

}  // namespace dcr::python
