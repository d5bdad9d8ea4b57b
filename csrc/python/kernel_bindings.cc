// Bindings of the CPU kernels (csrc/kernels). Thin: check that each numpy array has the exact
// layout (dtype, C order, writable destination), hand its pointer and size to the checked
// constructors of kernels/cast_options.h (every other rule lives there), and call the kernel
// with the GIL released. Arrays are never converted or copied: a silent copy of the destination
// would lose the result, so anything but the exact layout is a TypeError/ValueError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "kernels/cast.h"
#include "kernels/cast_options.h"

namespace py = pybind11;

namespace dcr::python {
namespace {

py::array LayoutChecked(const py::object& obj, const char* what) {
  if (!py::isinstance<py::array>(obj)) {
    throw py::type_error(std::string(what) + " must be a numpy array");
  }
  py::array a = py::reinterpret_borrow<py::array>(obj);
  if (a.ndim() > 1 || !(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(what) + " must be 1-D and C-contiguous");
  }
  return a;
}

Fp32Buffer SourceBuffer(const py::object& obj) {
  py::array a = LayoutChecked(obj, "src");
  if (!a.dtype().is(py::dtype::of<float>())) throw py::type_error("src must be float32");
  return Fp32Buffer{static_cast<const float*>(a.data()), static_cast<size_t>(a.size())};
}

HalfBuffer DestinationBuffer(const py::object& obj) {
  py::array a = LayoutChecked(obj, "dst");
  if (!a.dtype().is(py::dtype::of<uint16_t>()) && !a.dtype().is(py::dtype::of<int16_t>())) {
    throw py::type_error("dst must be uint16 or int16 (the 16-bit pattern of the output)");
  }
  if (!a.writeable()) throw py::value_error("dst must be writable");
  return HalfBuffer{static_cast<uint16_t*>(a.mutable_data()), static_cast<size_t>(a.size())};
}

}  // namespace

void BindKernels(py::module_& m) {
  m.def(
      "cast_fp32_into",
      [](const py::object& src, const py::object& dst, int64_t offset, const std::string& dtype,
         const std::string& nan_mode, std::optional<int64_t> canonical_nan) {
        const HalfType type = ParseHalfType(dtype);
        const CastOptions options = ParseCastOptions(type, nan_mode, canonical_nan);
        const ShardSlot slot = MakeShardSlot(SourceBuffer(src), DestinationBuffer(dst), offset);
        py::gil_scoped_release release;
        CastShardsIntoSlots(Span<ShardSlot>(&slot, 1), type, options);
      },
      py::arg("src"), py::arg("dst"), py::arg("offset"), py::arg("dtype"),
      py::arg("nan_mode") = "default", py::arg("canonical_nan") = py::none(),
      "Casts float32 `src` into dst[offset:offset+len(src)] as bfloat16/float16 bits (dst is "
      "a uint16/int16 view). Round-to-nearest-even. nan_mode 'default' (c10 scalar: bf16 "
      "0x7FC0, fp16 sign+payload), 'quiet' (sign + top payload bits) or 'canonical' (every "
      "NaN -> canonical_nan).");

  m.def(
      "cast_shards_into_slots",
      [](const std::vector<py::object>& srcs, const std::vector<py::object>& dsts,
         const std::vector<int64_t>& offsets, const std::string& dtype,
         const std::string& nan_mode, std::optional<int64_t> canonical_nan) {
        const HalfType type = ParseHalfType(dtype);
        const CastOptions options = ParseCastOptions(type, nan_mode, canonical_nan);
        std::vector<Fp32Buffer> shards;
        std::vector<HalfBuffer> outputs;
        for (const py::object& s : srcs) shards.push_back(SourceBuffer(s));
        for (const py::object& d : dsts) outputs.push_back(DestinationBuffer(d));
        const std::vector<ShardSlot> slots = MakeShardSlots(shards, outputs, offsets);
        py::gil_scoped_release release;
        CastShardsIntoSlots(Span<ShardSlot>(slots), type, options);
      },
      py::arg("srcs"), py::arg("dsts"), py::arg("offsets"), py::arg("dtype"),
      py::arg("nan_mode") = "default", py::arg("canonical_nan") = py::none(),
      "Bucket form of cast_fp32_into: srcs[i] cast into dsts[i][offsets[i]:...], one call, "
      "GIL released once.");
}

}  // namespace dcr::python
