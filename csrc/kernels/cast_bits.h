// The fp32 -> bf16 / fp16 element formulas, shared by the CPU loops (cast.cc) and the CUDA
// kernel (ops/cast_kernel.cu) so both produce the same bits by construction. Contract: see
// kernels/cast.h. Branch-free selects over uint32 bit patterns: the CPU loops vectorize and
// the GPU warps never diverge.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DCR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DCR_HOST_DEVICE inline
#endif

namespace dcr::castbits {

// NaN policy as plain values so this header needs nothing from cast.h (nvcc includes it alone).
constexpr uint32_t kNanQuiet = 0;      // sign + top payload bits, quiet bit set
constexpr uint32_t kNanCanonical = 1;  // one fixed pattern

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32Inf = 0x7F800000u;

DCR_HOST_DEVICE uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

DCR_HOST_DEVICE float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// An IEEE round-to-nearest-even single add, never flushed or fused (subnormal trick below).
DCR_HOST_DEVICE float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// bf16 is the top half of fp32: add 0x7FFF plus the lowest kept bit, then truncate. A carry out
// of the mantissa bumps the exponent, which is exactly right (up to inf at the top).
template <uint32_t kNanMode>
DCR_HOST_DEVICE uint16_t Bf16(uint32_t u, uint16_t canonical_nan) {
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  const uint32_t nan = kNanMode == kNanQuiet ? quiet_nan : uint32_t{canonical_nan};
  const uint32_t is_nan = 0u - static_cast<uint32_t>((u & kAbsMask) > kF32Inf);
  return static_cast<uint16_t>((nan & is_nan) | (rounded & ~is_nan));
}

// fp16 from |x| in three ranges, all computed, one selected by masks (plain ?: lets GCC keep
// the float add in a branch and then it does not vectorize):
//   |x| >= 2^16 (incl. inf/NaN): inf, or NaN;
//   |x| <  2^-14: fp16 subnormal or zero; adding 0.5f puts the value's 2^-24 units into the low
//                 mantissa bits of a float with a fixed exponent, and the FPU's own
//                 round-to-nearest-even does the rounding;
//   otherwise:    rebias the exponent and round the 13 dropped mantissa bits to even; a carry
//                 into exponent 31 gives inf, which is right for |x| >= 65520.
template <uint32_t kNanMode>
DCR_HOST_DEVICE uint16_t Fp16(uint32_t u, uint16_t canonical_nan) {
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & kAbsMask;

  constexpr uint32_t kDenormMagic = ((127 - 15) + (23 - 10) + 1) << 23;  // 0.5f
  const uint32_t sub = FloatBits(AddRn(BitsFloat(a), BitsFloat(kDenormMagic))) - kDenormMagic;

  const uint32_t odd = (a >> 13) & 1u;
  const uint32_t normal = (a + (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + odd) >> 13;

  const uint32_t quiet_nan = sign | 0x7E00u | ((a >> 13) & 0x3FFu);
  const uint32_t nan = kNanMode == kNanQuiet ? quiet_nan : uint32_t{canonical_nan};

  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < 0x38800000u);   // 2^-14
  const uint32_t is_big = 0u - static_cast<uint32_t>(a >= 0x47800000u);  // 2^16
  const uint32_t is_nan = 0u - static_cast<uint32_t>(a > kF32Inf);
  uint32_t out = (sub & is_sub) | (normal & ~is_sub);
  out = (0x7C00u & is_big) | (out & ~is_big);
  out |= sign;
  out = (nan & is_nan) | (out & ~is_nan);
  return static_cast<uint16_t>(out);
}

}  // namespace dcr::castbits
