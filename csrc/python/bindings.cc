// The _C module: thin pybind11 bindings over dcr_core. Lambdas only turn C++ results into
// numpy arrays / tuples and release the GIL around the C++ work.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "maxflow/max_flow.h"
#include "maxflow/node_split.h"
#include "python/error_types.h"
#include "python/numpy_span.h"

namespace py = pybind11;

namespace dcr::python {
void BindPartition(py::module_& m);  // partition_bindings.cc
void BindKernels(py::module_& m);    // kernel_bindings.cc
void BindSchedule(py::module_& m);   // schedule_bindings.cc
void BindBudget(py::module_& m);     // budget_bindings.cc
}  // namespace dcr::python

PYBIND11_MODULE(_C, m) {
  using namespace dcr;
  using dcr::python::AsSpan;
  using dcr::python::BindValueError;
  using dcr::python::ToNumpy;
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

  m.def(
      "min_st_cut",
      [](int64_t num_nodes, const I64Array& tails, const I64Array& heads, const F64Array& caps,
         int64_t source, int64_t sink, MaxFlowAlgorithm algorithm) {
        MinCutResult r;
        {
          py::gil_scoped_release release;
          r = MinStCut(num_nodes, AsSpan(tails), AsSpan(heads), AsSpan(caps), source, sink,
                       algorithm);
        }
        return py::make_tuple(r.value, r.flow_value, ToNumpy(r.source_side),
                              ToNumpy(r.cut_arcs));
      },
      py::arg("num_nodes"), py::arg("tails"), py::arg("heads"), py::arg("capacities"),
      py::arg("source"), py::arg("sink"),
      py::arg("algorithm") = MaxFlowAlgorithm::kDinic,
      "Minimum s-t cut; returns (value, flow_value, source_side uint8[n], cut_arcs int64[k]).");

  m.def(
      "split_network",
      [](const F64Array& node_costs, const I64Array& edge_tails, const I64Array& edge_heads,
         const I64Array& source_nodes, const I64Array& sink_nodes) {
        SplitNetwork net;
        {
          py::gil_scoped_release release;
          net = BuildSplitNetwork(AsSpan(node_costs), AsSpan(edge_tails), AsSpan(edge_heads),
                                  AsSpan(source_nodes), AsSpan(sink_nodes));
        }
        return py::make_tuple(net.num_nodes, ToNumpy(net.tails), ToNumpy(net.heads),
                              ToNumpy(net.capacities), net.source, net.sink);
      },
      py::arg("node_costs"), py::arg("edge_tails"), py::arg("edge_heads"),
      py::arg("source_nodes"), py::arg("sink_nodes"),
      "Node-split flow network: (num_nodes, tails, heads, capacities, source, sink).");

  dcr::python::BindPartition(m);
  dcr::python::BindKernels(m);
  dcr::python::BindSchedule(m);
  dcr::python::BindBudget(m);
}
