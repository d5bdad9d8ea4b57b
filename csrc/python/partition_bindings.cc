// Bindings of the partition layer (csrc/partition); filled in by the partitioner work.
#include <pybind11/pybind11.h>

namespace dcr::python {
void BindPartition(pybind11::module_&) {}
}  // namespace dcr::python
