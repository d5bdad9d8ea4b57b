// Multi-tensor fp32 -> bf16/fp16 cast on the GPU: one launch casts every shard of a bucket
// straight into its slot of the bucket's full-size 16-bit outputs. Same element formulas as
// the CPU kernel (csrc/kernels/cast_bits.h), so results are bit-identical to it and, with the
// NaN options Python probes from torch, to torch's own CUDA cast.
//
// Plain C++ interface (no torch, no pybind11): raw device pointers and a cudaStream_t. The
// target and NaN options are the CPU kernel's own types (kernels/cast.h), built and checked by
// kernels/cast_options.h, so both kernels take one set of rules.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/cast.h"

namespace dcr::cuda {

// One shard: n fp32 values at src cast into n 16-bit values at dst (dst is the slot itself,
// i.e. full_output + rank * padded_shard_len). src must be 4-byte aligned (any float tensor
// is); dst 2-byte aligned. Vector loads/stores are used where both line up, scalar elsewhere.
struct CastDescriptor {
  const float* src;
  uint16_t* dst;
  int64_t n;
};

// Casts every descriptor's shard into its slot, all on `stream`. Descriptors travel as a
// kernel parameter (a by-value array in the constant bank, up to kDescriptorsPerLaunch per
// launch; larger buckets take ceil(count / kDescriptorsPerLaunch) launches). A device array
// would need a host->device copy per bucket through a pinned buffer that cannot be reused until
// the copy ran, i.e. a host stall behind the compute stream; a parameter has neither.
// Throws std::runtime_error on a launch error.
constexpr int kDescriptorsPerLaunch = 128;  // 3 KiB of parameters: under the classic 4 KiB
void CastIntoSlots(const std::vector<CastDescriptor>& descs, HalfType target,
                   CastOptions options, cudaStream_t stream);

// Throws std::runtime_error naming `what` when err != cudaSuccess.
void CheckCuda(cudaError_t err, const char* what);

}  // namespace dcr::cuda
