// Data across the boundary by name. Two helpers, used by every binding file:
//
//   ArrayStruct<View>  binds a C++ struct of borrowed arrays (JointGraphView, MemoryGraph: Span
//                      fields plus num_nodes) as a Python class built by keyword and read by
//                      attribute. Each field is one Field(name, &View::member) line; the class
//                      holds the numpy arrays, so the spans stay valid as long as it lives.
//   DefArray           binds a std::vector field of a C++ result struct as a read-only numpy
//                      array viewing it (no copy; the array keeps the result alive).
//
// Conversion only: an argument is taken as the field's dtype when numpy can convert it safely
// (a list of ints, an int32 array for an int64 field; never a float array into an int field),
// else TypeError naming the field. Every rule on the values stays in C++: the constructor calls
// View::Validate() (std::invalid_argument -> ValueError, naming the array and index), and the
// C++ entry points validate again, since a caller may still write to the arrays it passed in.
// Cost: building a graph converts each array once (no copy where the dtype and layout already
// match) and validates in O(n + m); reading an array back returns a view, never a copy.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/span.h"
#include "python/numpy_span.h"

namespace dcr::python {

// A read-only numpy view of `v`, which `owner` (a bound C++ object) holds.
template <typename T>
pybind11::array_t<T> ReadOnlyView(const std::vector<T>& v, pybind11::handle owner) {
  pybind11::array_t<T> a(static_cast<pybind11::ssize_t>(v.size()), v.data(), owner);
  a.attr("setflags")(pybind11::arg("write") = false);
  return a;
}

// Binds `member` of C (a std::vector<T>) as the read-only numpy property `name`.
template <typename C, typename... Extra, typename T>
void DefArray(pybind11::class_<C, Extra...>& cls, const char* name, std::vector<T> C::*member,
              const char* doc) {
  cls.def_property_readonly(
      name,
      [member](pybind11::object self) {
        return ReadOnlyView(self.cast<const C&>().*member, self);
      },
      doc);
}

// What a bound ArrayStruct<View> instance holds: the arrays, in field order, and the view of
// them that the C++ entry points read.
template <typename View>
struct HeldArrays {
  View view;
  std::vector<pybind11::array> arrays;
};

// View: a struct of Span<T> fields with num_nodes = len(bytes) and a Validate() method.
template <typename View>
class ArrayStruct {
 public:
  using Held = HeldArrays<View>;

  ArrayStruct(pybind11::module_& m, const char* name, const char* doc)
      : cls_(m, name, doc), fields_(std::make_shared<std::vector<FieldInfo>>()) {
    namespace py = pybind11;
    auto fields = fields_;
    std::string cls_name = name;
    cls_.def(py::init([fields, cls_name](const py::kwargs& kwargs) {
               return std::make_unique<Held>(Build(*fields, cls_name, kwargs));
             }),
             "Every array by keyword (see the class docstring); validated as the C++ "
             "Validate() says.");
    cls_.def_property_readonly(
        "num_nodes", [](const Held& h) { return h.view.num_nodes; }, "len(bytes).");
    cls_.def("__repr__", [cls_name](const Held& h) {
      return cls_name + "(num_nodes=" + std::to_string(h.view.num_nodes) + ", " +
             std::to_string(h.view.edge_tails.size) + " edges)";
    });
  }

  // One array of the struct: keyword and attribute `name`, C++ field `member`.
  template <typename T>
  ArrayStruct& Field(const char* name, Span<T> View::*member, const char* doc) {
    namespace py = pybind11;
    const size_t index = fields_->size();
    const std::string field = name;
    fields_->push_back(FieldInfo{
        field, [member, field](View& view, const py::object& value, const std::string& cls) {
          auto a = py::array_t<T, py::array::c_style>::ensure(value);
          if (!a || a.ndim() != 1) {
            throw py::type_error(cls + ": " + field + " must be a 1-D array of " +
                                 py::str(py::dtype::of<T>()).cast<std::string>() +
                                 " or convertible to one without loss, got " +
                                 Describe(value));
          }
          view.*member = AsSpan(a);
          // Read back through a read-only view: the struct is not edited through attributes.
          py::array held = a.attr("view")();
          held.attr("setflags")(py::arg("write") = false);
          return held;
        }});
    cls_.def_property_readonly(
        name, [index](const Held& h) { return h.arrays[index]; }, doc);
    return *this;
  }

  pybind11::class_<Held>& cls() { return cls_; }

 private:
  using Setter = std::function<pybind11::array(View&, const pybind11::object&, const std::string&)>;
  struct FieldInfo {
    std::string name;
    Setter set;
  };

  static std::string Describe(const pybind11::object& value) {
    namespace py = pybind11;
    if (py::isinstance<py::array>(value)) {
      py::array a = py::reinterpret_borrow<py::array>(value);
      return "an array of " + py::str(a.dtype()).cast<std::string>() + " with " +
             std::to_string(a.ndim()) + " dimension(s)";
    }
    return py::str(py::type::handle_of(value).attr("__name__")).cast<std::string>();
  }

  static Held Build(const std::vector<FieldInfo>& fields, const std::string& cls,
                    const pybind11::kwargs& kwargs) {
    namespace py = pybind11;
    std::string expected;
    for (const FieldInfo& f : fields) expected += (expected.empty() ? "" : ", ") + f.name;
    for (const auto& item : kwargs) {
      const std::string key = py::str(item.first).cast<std::string>();
      bool known = false;
      for (const FieldInfo& f : fields) known = known || f.name == key;
      if (!known) {
        throw py::type_error(cls + "() got an unexpected keyword argument '" + key +
                             "' (its arrays: " + expected + ")");
      }
    }
    Held h;
    for (const FieldInfo& f : fields) {
      if (!kwargs.contains(f.name.c_str())) {
        throw py::type_error(cls + "() missing keyword argument '" + f.name + "' (its arrays: " +
                             expected + ")");
      }
      h.arrays.push_back(f.set(h.view, kwargs[f.name.c_str()], cls));
    }
    h.view.num_nodes = static_cast<int64_t>(h.view.bytes.size);
    {
      py::gil_scoped_release release;
      h.view.Validate();
    }
    return h;
  }

  pybind11::class_<Held> cls_;
  std::shared_ptr<std::vector<FieldInfo>> fields_;
};

}  // namespace dcr::python
