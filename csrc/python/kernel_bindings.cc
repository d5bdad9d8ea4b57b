// Bindings of the CPU kernels (csrc/kernels); filled in by the cast-kernel work.
#include <pybind11/pybind11.h>

namespace dcr::python {
void BindKernels(pybind11::module_&) {}
}  // namespace dcr::python
