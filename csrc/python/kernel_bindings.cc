// Bindings of the CPU kernels (csrc/kernels). Thin: validate the numpy arrays (dtype, C order,
// writable destination, bounds), then call the kernel on their data pointers with the GIL
// released. Arrays are never converted or copied: a silent copy of the destination would lose
// the result, so anything but the exact layout is a TypeError/ValueError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "kernels/cast.h"

namespace py = pybind11;

namespace dcr::python {
namespace {

HalfType ParseHalfType(const std::string& dtype) {
  if (dtype == "bfloat16") return HalfType::kBFloat16;
  if (dtype == "float16") return HalfType::kFloat16;
  throw py::value_error("dtype must be 'bfloat16' or 'float16', got '" + dtype + "'");
}

CastOptions ParseOptions(HalfType type, const std::string& nan_mode, py::object canonical_nan) {
  CastOptions o = DefaultCastOptions(type);
  if (nan_mode == "quiet") {
    o.nan_mode = NanMode::kQuiet;
  } else if (nan_mode == "canonical") {
    o.nan_mode = NanMode::kCanonical;
  } else if (nan_mode != "default") {
    throw py::value_error("nan_mode must be 'default', 'quiet' or 'canonical'");
  }
  if (!canonical_nan.is_none()) {
    const int64_t v = canonical_nan.cast<int64_t>();
    if (v < 0 || v > 0xFFFF) throw py::value_error("canonical_nan must fit in 16 bits");
    o.canonical_nan = static_cast<uint16_t>(v);
  }
  const uint16_t exp_mask = type == HalfType::kBFloat16 ? 0x7F80 : 0x7C00;
  const uint16_t mant_mask = type == HalfType::kBFloat16 ? 0x007F : 0x03FF;
  if (o.nan_mode == NanMode::kCanonical &&
      ((o.canonical_nan & exp_mask) != exp_mask || (o.canonical_nan & mant_mask) == 0)) {
    throw py::value_error("canonical_nan is not a NaN pattern of the target dtype");
  }
  return o;
}

py::array CheckedArray(const py::object& obj, const char* what) {
  if (!py::isinstance<py::array>(obj)) {
    throw py::type_error(std::string(what) + " must be a numpy array");
  }
  py::array a = py::reinterpret_borrow<py::array>(obj);
  if (a.ndim() > 1 || !(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(what) + " must be 1-D and C-contiguous");
  }
  return a;
}

const float* SourcePointer(const py::object& obj) {
  py::array a = CheckedArray(obj, "src");
  if (!a.dtype().is(py::dtype::of<float>())) throw py::type_error("src must be float32");
  return static_cast<const float*>(a.data());
}

uint16_t* DestinationPointer(const py::object& obj, size_t* size) {
  py::array a = CheckedArray(obj, "dst");
  if (!a.dtype().is(py::dtype::of<uint16_t>()) && !a.dtype().is(py::dtype::of<int16_t>())) {
    throw py::type_error("dst must be uint16 or int16 (the 16-bit pattern of the output)");
  }
  if (!a.writeable()) throw py::value_error("dst must be writable");
  *size = static_cast<size_t>(a.size());
  return static_cast<uint16_t*>(a.mutable_data());
}

ShardSlot MakeSlot(const py::object& src, const py::object& dst, int64_t offset) {
  ShardSlot s;
  s.shard = SourcePointer(src);
  s.n = static_cast<size_t>(py::reinterpret_borrow<py::array>(src).size());
  size_t dst_size = 0;
  s.full_output = DestinationPointer(dst, &dst_size);
  if (offset < 0 || static_cast<size_t>(offset) > dst_size || s.n > dst_size - offset) {
    throw py::value_error("slot [offset, offset + len(src)) lies outside dst");
  }
  s.slot_offset = static_cast<size_t>(offset);
  return s;
}

}  // namespace

void BindKernels(py::module_& m) {
  m.def(
      "cast_fp32_into",
      [](const py::object& src, const py::object& dst, int64_t offset, const std::string& dtype,
         const std::string& nan_mode, py::object canonical_nan) {
        const HalfType type = ParseHalfType(dtype);
        const CastOptions options = ParseOptions(type, nan_mode, canonical_nan);
        const ShardSlot slot = MakeSlot(src, dst, offset);
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
         const std::string& nan_mode, py::object canonical_nan) {
        if (srcs.size() != dsts.size() || srcs.size() != offsets.size()) {
          throw py::value_error("srcs, dsts and offsets must have the same length");
        }
        const HalfType type = ParseHalfType(dtype);
        const CastOptions options = ParseOptions(type, nan_mode, canonical_nan);
        std::vector<ShardSlot> slots;
        slots.reserve(srcs.size());
        for (size_t i = 0; i < srcs.size(); ++i) {
          slots.push_back(MakeSlot(srcs[i], dsts[i], offsets[i]));
        }
        py::gil_scoped_release release;
        CastShardsIntoSlots(Span<ShardSlot>(slots), type, options);
      },
      py::arg("srcs"), py::arg("dsts"), py::arg("offsets"), py::arg("dtype"),
      py::arg("nan_mode") = "default", py::arg("canonical_nan") = py::none(),
      "Bucket form of cast_fp32_into: srcs[i] cast into dsts[i][offsets[i]:...], one call, "
      "GIL released once.");
}

}  // namespace dcr::python
