// numpy <-> Span/vector conversions shared by the binding files.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <vector>

#include "common/span.h"

namespace dcr {

// C-contiguous arrays of the exact dtype; as arguments, pybind11 converts what numpy converts
// without loss (safe casting) and refuses the rest with a TypeError.
using I64Array = pybind11::array_t<int64_t, pybind11::array::c_style>;
using F64Array = pybind11::array_t<double, pybind11::array::c_style>;
using U8Array = pybind11::array_t<uint8_t, pybind11::array::c_style>;
using I32Array = pybind11::array_t<int32_t, pybind11::array::c_style>;
using U32Array = pybind11::array_t<uint32_t, pybind11::array::c_style>;
using I8Array = pybind11::array_t<int8_t, pybind11::array::c_style>;

namespace python {

template <typename T>
Span<T> AsSpan(const pybind11::array_t<T, pybind11::array::c_style>& a) {
  return Span<T>(a.data(), static_cast<size_t>(a.size()));
}

template <typename T>
pybind11::array_t<T> ToNumpy(const std::vector<T>& v) {
  pybind11::array_t<T> out(static_cast<pybind11::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

}  // namespace python
}  // namespace dcr
