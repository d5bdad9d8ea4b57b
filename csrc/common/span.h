// A read-only view of a contiguous array (C++17 has no std::span).
#pragma once

#include <cstddef>
#include <vector>

namespace dcr {

template <typename T>
struct Span {
  const T* data = nullptr;
  size_t size = 0;

  Span() = default;
  Span(const T* d, size_t n) : data(d), size(n) {}
  Span(const std::vector<T>& v) : data(v.data()), size(v.size()) {}  // NOLINT: implicit on purpose

  const T& operator[](size_t i) const { return data[i]; }
  const T* begin() const { return data; }
  const T* end() const { return data + size; }
};

}  // namespace dcr
