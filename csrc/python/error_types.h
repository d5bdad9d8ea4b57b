// C++ errors that reach Python as ValueError subclasses carrying the error's data as attributes
// (a conflict's chain of nodes, an unbounded cut's path, a budget's smallest feasible value).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>

namespace dcr::python {

// Registers `name` in `m` as a subclass of ValueError for C++ exception E; a thrown E becomes
// an instance with E's message on which attach(e, error) has set the attributes.
template <typename E, typename Attach>
void BindValueError(pybind11::module_& m, const char* name, Attach attach) {
  namespace py = pybind11;
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> type_of_e;
  type_of_e.call_once_and_store_result(
      [&m, name]() { return py::object(py::exception<E>(m, name, PyExc_ValueError)); });
  // A translator is a plain function pointer: it reaches `attach` through a static, one per
  // instantiation (one per error type).
  static const Attach attach_to_error = attach;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const E& e) {
      py::object type = type_of_e.get_stored();
      py::object err = type(e.what());
      attach_to_error(e, err);
      PyErr_SetObject(type.ptr(), err.ptr());
    }
  });
}

}  // namespace dcr::python
