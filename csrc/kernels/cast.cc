#include "kernels/cast.h"

#include "kernels/cast_bits.h"

namespace dcr {
namespace {

using castbits::FloatBits;
using castbits::kNanCanonical;
using castbits::kNanQuiet;

template <uint32_t kMode>
void Bf16Loop(const float* __restrict src, uint16_t* __restrict dst, size_t n, uint16_t nan) {
  for (size_t i = 0; i < n; ++i) dst[i] = castbits::Bf16<kMode>(FloatBits(src[i]), nan);
}

template <uint32_t kMode>
void Fp16Loop(const float* __restrict src, uint16_t* __restrict dst, size_t n, uint16_t nan) {
  for (size_t i = 0; i < n; ++i) dst[i] = castbits::Fp16<kMode>(FloatBits(src[i]), nan);
}

}  // namespace

CastOptions DefaultCastOptions(HalfType type) {
  if (type == HalfType::kBFloat16) return CastOptions{NanMode::kCanonical, 0x7FC0};
  return CastOptions{NanMode::kQuiet, 0x7E00};
}

uint16_t Fp32BitsToBf16(uint32_t bits, CastOptions o) {
  return o.nan_mode == NanMode::kQuiet ? castbits::Bf16<kNanQuiet>(bits, o.canonical_nan)
                                       : castbits::Bf16<kNanCanonical>(bits, o.canonical_nan);
}

uint16_t Fp32BitsToFp16(uint32_t bits, CastOptions o) {
  return o.nan_mode == NanMode::kQuiet ? castbits::Fp16<kNanQuiet>(bits, o.canonical_nan)
                                       : castbits::Fp16<kNanCanonical>(bits, o.canonical_nan);
}

void CastFp32ToBf16(const float* src, uint16_t* dst, size_t n, CastOptions o) {
  if (o.nan_mode == NanMode::kQuiet) {
    Bf16Loop<kNanQuiet>(src, dst, n, o.canonical_nan);
  } else {
    Bf16Loop<kNanCanonical>(src, dst, n, o.canonical_nan);
  }
}

void CastFp32ToFp16(const float* src, uint16_t* dst, size_t n, CastOptions o) {
  if (o.nan_mode == NanMode::kQuiet) {
    Fp16Loop<kNanQuiet>(src, dst, n, o.canonical_nan);
  } else {
    Fp16Loop<kNanCanonical>(src, dst, n, o.canonical_nan);
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
