// The _cuda module: pybind11 over ops/ (the cast kernel into gather slots). Thin: convert the
// arguments, hand the dtype and NaN option to the checked constructors of
// kernels/cast_options.h (the same rules as the CPU binding, GoogleTest'd in tests/cpp), call
// the kernel. Pointers and streams arrive as Python ints (tensor.data_ptr(),
// torch.cuda.Stream.cuda_stream); the Python layer (deepcompile_remat/comm) checks dtypes,
// devices, sizes and keeps tensors alive. The gathers themselves run through torch's process
// group, not here. Nothing here blocks the host (one asynchronous launch on the caller's
// stream), so the GIL is kept.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "cast_kernel.h"
#include "kernels/cast_options.h"

namespace py = pybind11;

namespace dcr::cuda {
namespace {

// The descriptors of one bucket call; the lengths are checked first (cast_options.h).
std::vector<CastDescriptor> Descriptors(const std::vector<uintptr_t>& srcs,
                                        const std::vector<uintptr_t>& dsts,
                                        const std::vector<int64_t>& counts) {
  CheckOneEntryPerShard(srcs.size(), dsts.size(), counts.size(), "srcs, dsts and counts");
  std::vector<CastDescriptor> descs;
  descs.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    descs.push_back({reinterpret_cast<const float*>(srcs[i]),
                     reinterpret_cast<uint16_t*>(dsts[i]), counts[i]});
  }
  return descs;
}

}  // namespace
}  // namespace dcr::cuda

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "deepcompile_remat CUDA cast kernel (no torch at the C++ level)";

  m.def(
      "cast_into_slots",
      [](const std::vector<uintptr_t>& srcs, const std::vector<uintptr_t>& dsts,
         const std::vector<int64_t>& counts, const std::string& dtype,
         const std::string& nan_mode, std::optional<int64_t> canonical_nan, uintptr_t stream) {
        const dcr::HalfType type = dcr::ParseHalfType(dtype);
        const dcr::CastOptions options = dcr::ParseCastOptions(type, nan_mode, canonical_nan);
        dcr::cuda::CastIntoSlots(dcr::cuda::Descriptors(srcs, dsts, counts), type, options,
                                 reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("srcs"), py::arg("dsts"), py::arg("counts"), py::arg("dtype"),
      py::arg("nan_mode"), py::arg("canonical_nan"), py::arg("stream"),
      "One multi-tensor launch on `stream`: srcs[i] (fp32 device pointer) cast into dsts[i] "
      "(16-bit slot pointer), counts[i] elements each. dtype 'bfloat16'/'float16'; nan_mode "
      "'default', 'quiet' or 'canonical' with canonical_nan (None: the default pattern), as "
      "for _C.cast_fp32_into. ValueError when an argument breaks those rules.");
}
