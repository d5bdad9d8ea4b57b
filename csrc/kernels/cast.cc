#include "kernels/cast.h"

#include <cstring>

namespace dcr {
namespace {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32Inf = 0x7F800000u;

// bf16 is the top half of fp32: add 0x7FFF plus the lowest kept bit, then truncate. A carry out
// of the mantissa bumps the exponent, which is exactly right (up to inf at the top).
template <NanMode kMode>
inline uint16_t Bf16(uint32_t u, uint16_t canonical_nan) {
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  const uint32_t nan = kMode == NanMode::kQuiet ? quiet_nan : uint32_t{canonical_nan};
  const bool is_nan = (u & kAbsMask) > kF32Inf;
  return static_cast<uint16_t>(is_nan ? nan : rounded);
}

// fp16 from |x| in three ranges, all computed, one selected (branch-free so loops vectorize):
//   |x| >= 2^16 (incl. inf/NaN): inf, or NaN;
//   |x| <  2^-14: fp16 subnormal or zero; adding 0.5f puts the value's 2^-24 units into the low
//                 mantissa bits of a float with a fixed exponent, and the FPU's own
//                 round-to-nearest-even does the rounding;
//   otherwise:    rebias the exponent and round the 13 dropped mantissa bits to even; a carry
//                 into exponent 31 gives inf, which is right for |x| >= 65520.
template <NanMode kMode>
inline uint16_t Fp16(uint32_t u, uint16_t canonical_nan) {
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & kAbsMask;

  constexpr uint32_t kDenormMagic = ((127 - 15) + (23 - 10) + 1) << 23;  // 0.5f
  const uint32_t sub = FloatBits(BitsFloat(a) + BitsFloat(kDenormMagic)) - kDenormMagic;

  const uint32_t odd = (a >> 13) & 1u;
  const uint32_t normal = (a + (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + odd) >> 13;

  const uint32_t quiet_nan = sign | 0x7E00u | ((a >> 13) & 0x3FFu);
  const uint32_t nan = kMode == NanMode::kQuiet ? quiet_nan : uint32_t{canonical_nan};

  // Mask selects rather than ?: so GCC if-converts the loop (it keeps the FP add in a branch).
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < 0x38800000u);   // 2^-14
  const uint32_t is_big = 0u - static_cast<uint32_t>(a >= 0x47800000u);  // 2^16
  const uint32_t is_nan = 0u - static_cast<uint32_t>(a > kF32Inf);
  uint32_t out = (sub & is_sub) | (normal & ~is_sub);
  out = (0x7C00u & is_big) | (out & ~is_big);
  out |= sign;
  out = (nan & is_nan) | (out & ~is_nan);
  return static_cast<uint16_t>(out);
}

template <NanMode kMode>
void Bf16Loop(const float* __restrict src, uint16_t* __restrict dst, size_t n, uint16_t nan) {
  for (size_t i = 0; i < n; ++i) dst[i] = Bf16<kMode>(FloatBits(src[i]), nan);
}

template <NanMode kMode>
void Fp16Loop(const float* __restrict src, uint16_t* __restrict dst, size_t n, uint16_t nan) {
  for (size_t i = 0; i < n; ++i) dst[i] = Fp16<kMode>(FloatBits(src[i]), nan);
}

}  // namespace

CastOptions DefaultCastOptions(HalfType type) {
  if (type == HalfType::kBFloat16) return CastOptions{NanMode::kCanonical, 0x7FC0};
  return CastOptions{NanMode::kQuiet, 0x7E00};
}

uint16_t Fp32BitsToBf16(uint32_t bits, CastOptions o) {
  return o.nan_mode == NanMode::kQuiet ? Bf16<NanMode::kQuiet>(bits, o.canonical_nan)
                                       : Bf16<NanMode::kCanonical>(bits, o.canonical_nan);
}

uint16_t Fp32BitsToFp16(uint32_t bits, CastOptions o) {
  return o.nan_mode == NanMode::kQuiet ? Fp16<NanMode::kQuiet>(bits, o.canonical_nan)
                                       : Fp16<NanMode::kCanonical>(bits, o.canonical_nan);
}

void CastFp32ToBf16(const float* src, uint16_t* dst, size_t n, CastOptions o) {
  if (o.nan_mode == NanMode::kQuiet) {
    Bf16Loop<NanMode::kQuiet>(src, dst, n, o.canonical_nan);
  } else {
    Bf16Loop<NanMode::kCanonical>(src, dst, n, o.canonical_nan);
  }
}

void CastFp32ToFp16(const float* src, uint16_t* dst, size_t n, CastOptions o) {
  if (o.nan_mode == NanMode::kQuiet) {
    Fp16Loop<NanMode::kQuiet>(src, dst, n, o.canonical_nan);
  } else {
    Fp16Loop<NanMode::kCanonical>(src, dst, n, o.canonical_nan);
  }
}

void CastFp32ToHalf(const float* src, uint16_t* dst, size_t n, HalfType type, CastOptions o) {
  if (type == HalfType::kBFloat16) {
    CastFp32ToBf16(src, dst, n, o);
  } else {
    CastFp32ToFp16(src, dst, n, o);
  }
}

void CastShardsIntoSlots(Span<ShardSlot> shards, HalfType type, CastOptions options) {
  for (const ShardSlot& s : shards) {
    CastFp32ToHalf(s.shard, s.full_output + s.slot_offset, s.n, type, options);
  }
}

}  // namespace dcr
