#include "cast_kernel.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cast_bits.h"

namespace dcr::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocksX = 1024;     // per descriptor; the grid-stride loop covers the rest

struct DescriptorBatch {
  CastDescriptor d[kDescriptorsPerLaunch];
};

template <uint32_t kNan, bool kBf16>
__device__ __forceinline__ uint32_t Convert(float x, uint16_t canonical_nan) {
  const uint32_t u = castbits::FloatBits(x);
  return kBf16 ? castbits::Bf16<kNan>(u, canonical_nan) : castbits::Fp16<kNan>(u, canonical_nan);
}

// blockIdx.y picks the descriptor; blocks along x grid-stride over its elements. Head: scalar
// until src is 16-byte aligned; body: float4 loads and 4 x 16-bit (8-byte) stores when dst is
// then 8-byte aligned too (else everything is scalar); tail: scalar.
template <uint32_t kNan, bool kBf16>
__global__ void CastIntoSlotsKernel(const __grid_constant__ DescriptorBatch batch,
                                    uint16_t canonical_nan) {
  const CastDescriptor d = batch.d[blockIdx.y];
  const float* __restrict__ src = d.src;
  uint16_t* __restrict__ dst = d.dst;
  const int64_t n = d.n;

  const uintptr_t src_addr = reinterpret_cast<uintptr_t>(src);
  int64_t head = static_cast<int64_t>(((16 - (src_addr & 15)) & 15) / 4);
  head = head < n ? head : n;
  const bool vector_ok = (reinterpret_cast<uintptr_t>(dst + head) & 7) == 0;
  const int64_t nvec = vector_ok ? (n - head) / 4 : 0;
  const int64_t scalar_head = vector_ok ? head : n;

  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;

  for (int64_t i = tid; i < scalar_head; i += stride) {
    dst[i] = static_cast<uint16_t>(Convert<kNan, kBf16>(src[i], canonical_nan));
  }
  const float4* __restrict__ src4 = reinterpret_cast<const float4*>(src + head);
  uint2* __restrict__ dst4 = reinterpret_cast<uint2*>(dst + head);
  for (int64_t i = tid; i < nvec; i += stride) {
    const float4 v = src4[i];
    uint2 o;
    o.x = Convert<kNan, kBf16>(v.x, canonical_nan) | (Convert<kNan, kBf16>(v.y, canonical_nan) << 16);
    o.y = Convert<kNan, kBf16>(v.z, canonical_nan) | (Convert<kNan, kBf16>(v.w, canonical_nan) << 16);
    dst4[i] = o;
  }
  for (int64_t i = scalar_head + nvec * 4 + tid; i < n; i += stride) {
    dst[i] = static_cast<uint16_t>(Convert<kNan, kBf16>(src[i], canonical_nan));
  }
}

template <uint32_t kNan, bool kBf16>
void LaunchTyped(const std::vector<CastDescriptor>& descs, uint16_t nan, cudaStream_t stream) {
  for (size_t first = 0; first < descs.size(); first += kDescriptorsPerLaunch) {
    const size_t count = std::min<size_t>(descs.size() - first, kDescriptorsPerLaunch);
    DescriptorBatch batch{};
    int64_t max_n = 0;
    for (size_t i = 0; i < count; ++i) {
      batch.d[i] = descs[first + i];
      max_n = std::max(max_n, descs[first + i].n);
    }
    if (max_n == 0) continue;
    const int64_t blocks = (max_n / 4 + kThreads - 1) / kThreads;
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, kMaxBlocksX))),
                    static_cast<unsigned>(count));
    CastIntoSlotsKernel<kNan, kBf16><<<grid, kThreads, 0, stream>>>(batch, nan);
    CheckCuda(cudaGetLastError(), "cast kernel launch");
  }
}

}  // namespace

void CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

void CastIntoSlots(const std::vector<CastDescriptor>& descs, HalfType target,
                   CastOptions options, cudaStream_t stream) {
  const bool bf16 = target == HalfType::kBFloat16;
  const bool quiet = options.nan_mode == NanMode::kQuiet;
  const uint16_t nan = options.canonical_nan;
  if (bf16 && quiet) LaunchTyped<castbits::kNanQuiet, true>(descs, nan, stream);
  if (bf16 && !quiet) LaunchTyped<castbits::kNanCanonical, true>(descs, nan, stream);
  if (!bf16 && quiet) LaunchTyped<castbits::kNanQuiet, false>(descs, nan, stream);
  if (!bf16 && !quiet) LaunchTyped<castbits::kNanCanonical, false>(descs, nan, stream);
}

}  // namespace dcr::cuda
