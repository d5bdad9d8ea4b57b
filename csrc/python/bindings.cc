// The _C module: thin pybind11 bindings over dcr_core. Data crosses by name: graphs are classes
// built by keyword (graph_bindings.cc), results are bound C++ structs read by attribute, their
// arrays numpy (array_struct.h). Lambdas only convert and release the GIL around the C++ work.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "maxflow/max_flow.h"
#include "maxflow/node_split.h"
#include "python/array_struct.h"
#include "python/error_types.h"
#include "python/numpy_span.h"

namespace py = pybind11;

namespace dcr::python {
void BindGraphs(py::module_& m);     // graph_bindings.cc
void BindPartition(py::module_& m);  // partition_bindings.cc
void BindKernels(py::module_& m);    // kernel_bindings.cc
void BindSchedule(py::module_& m);   // schedule_bindings.cc
void BindBudget(py::module_& m);     // budget_bindings.cc
}  // namespace dcr::python

PYBIND11_MODULE(_C, m) {
  using namespace dcr;
  using dcr::python::AsSpan;
  using dcr::python::BindValueError;
  using dcr::python::DefArray;
  m.doc() = "deepcompile_remat native core (no torch)";
  m.attr("__version__") = DCR_VERSION;

  // UnboundedCutError(ValueError) carries the offending path as `.path`.
  BindValueError<UnboundedCutError>(m, "UnboundedCutError",
                                    [](const UnboundedCutError& e, py::object& err) {
                                      err.attr("path") = py::cast(e.path());
                                    });

  py::enum_<MaxFlowAlgorithm>(m, "MaxFlowAlgorithm")
      .value("boykov_kolmogorov", MaxFlowAlgorithm::kBoykovKolmogorov)
      .value("dinic", MaxFlowAlgorithm::kDinic);

  py::class_<MinCutResult> cut(m, "MinCutResult", "What min_st_cut found (max_flow.h).");
  cut.def_readonly("value", &MinCutResult::value, "Capacity of the cut.")
      .def_readonly("flow_value", &MinCutResult::flow_value, "Value of the maximum flow.");
  DefArray(cut, "source_side", &MinCutResult::source_side,
           "uint8[n]: 1 iff reachable from the source in the final residual graph.");
  DefArray(cut, "cut_arcs", &MinCutResult::cut_arcs,
           "int64, ascending: arcs from the source side to the sink side.");

  m.def(
      "min_st_cut",
      [](int64_t num_nodes, const I64Array& tails, const I64Array& heads, const F64Array& caps,
         int64_t source, int64_t sink, MaxFlowAlgorithm algorithm) {
        py::gil_scoped_release release;
        return MinStCut(num_nodes, AsSpan(tails), AsSpan(heads), AsSpan(caps), source, sink,
                        algorithm);
      },
      py::arg("num_nodes"), py::arg("tails"), py::arg("heads"), py::arg("capacities"),
      py::arg("source"), py::arg("sink"),
      py::arg("algorithm") = MaxFlowAlgorithm::kDinic, "Minimum s-t cut: a MinCutResult.");

  py::class_<SplitNetwork> net(m, "SplitNetwork", "Node-split flow network (node_split.h).");
  net.def_readonly("num_nodes", &SplitNetwork::num_nodes)
      .def_readonly("source", &SplitNetwork::source)
      .def_readonly("sink", &SplitNetwork::sink);
  DefArray(net, "tails", &SplitNetwork::tails, "int64: arc tails.");
  DefArray(net, "heads", &SplitNetwork::heads, "int64: arc heads.");
  DefArray(net, "capacities", &SplitNetwork::capacities, "float64: arc capacities.");

  m.def(
      "split_network",
      [](const F64Array& node_costs, const I64Array& edge_tails, const I64Array& edge_heads,
         const I64Array& source_nodes, const I64Array& sink_nodes) {
        py::gil_scoped_release release;
        return BuildSplitNetwork(AsSpan(node_costs), AsSpan(edge_tails), AsSpan(edge_heads),
                                 AsSpan(source_nodes), AsSpan(sink_nodes));
      },
      py::arg("node_costs"), py::arg("edge_tails"), py::arg("edge_heads"),
      py::arg("source_nodes"), py::arg("sink_nodes"), "Node-split flow network: a SplitNetwork.");

  dcr::python::BindGraphs(m);
  dcr::python::BindPartition(m);
  dcr::python::BindKernels(m);
  dcr::python::BindSchedule(m);
  dcr::python::BindBudget(m);
}
