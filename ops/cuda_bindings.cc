// The _cuda module: pybind11 over ops/ (the cast kernel into gather slots). Pointers and
// streams arrive as Python ints (tensor.data_ptr(), torch.cuda.Stream.cuda_stream); the Python
// layer (deepcompile_remat/comm) checks dtypes, devices, sizes and keeps tensors alive. The
// gathers themselves run through torch's process group, not here. Nothing here blocks the host
// (one asynchronous launch on the caller's stream), so the GIL is kept.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "cast_kernel.h"
#include "kernels/cast_bits.h"

namespace py = pybind11;
using namespace dcr::cuda;

namespace {

cudaStream_t AsStream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

CudaCastOptions ParseNan(const std::string& nan_mode, int canonical_nan) {
  CudaCastOptions o;
  if (nan_mode == "quiet") {
    o.nan_mode = dcr::castbits::kNanQuiet;
  } else if (nan_mode == "canonical") {
    o.nan_mode = dcr::castbits::kNanCanonical;
  } else {
    throw py::value_error("nan_mode must be 'quiet' or 'canonical'");
  }
  o.canonical_nan = static_cast<uint16_t>(canonical_nan);
  return o;
}

CastTarget ParseTarget(const std::string& dtype) {
  if (dtype == "bfloat16") return CastTarget::kBFloat16;
  if (dtype == "float16") return CastTarget::kFloat16;
  throw py::value_error("dtype must be 'bfloat16' or 'float16'");
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "deepcompile_remat CUDA cast kernel (no torch at the C++ level)";

  m.def(
      "cast_into_slots",
      [](const std::vector<uintptr_t>& srcs, const std::vector<uintptr_t>& dsts,
         const std::vector<int64_t>& counts, const std::string& dtype,
         const std::string& nan_mode, int canonical_nan, uintptr_t stream) {
        if (srcs.size() != dsts.size() || srcs.size() != counts.size()) {
          throw py::value_error("srcs, dsts and counts must have the same length");
        }
        std::vector<CastDescriptor> descs;
        for (size_t i = 0; i < srcs.size(); ++i) {
          descs.push_back({reinterpret_cast<const float*>(srcs[i]),
                           reinterpret_cast<uint16_t*>(dsts[i]), counts[i]});
        }
        CastIntoSlots(descs, ParseTarget(dtype), ParseNan(nan_mode, canonical_nan),
                      AsStream(stream));
      },
      py::arg("srcs"), py::arg("dsts"), py::arg("counts"), py::arg("dtype"),
      py::arg("nan_mode"), py::arg("canonical_nan"), py::arg("stream"),
      "One multi-tensor launch on `stream`: srcs[i] (fp32 device pointer) cast into dsts[i] "
      "(16-bit slot pointer), counts[i] elements each.");
}
