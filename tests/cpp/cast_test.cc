// Tests of csrc/kernels/cast: the vectorized loops against a reference written here in a
// different way (exact double arithmetic + std::nearbyint at the target's quantum, then
// re-encoding), over a strided sweep of all fp32 bit patterns, every boundary class, and hand
// cases whose bits are known from the formats' definitions.
#include <gtest/gtest.h>

#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cast.h"

namespace dcr {
namespace {

float F(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

bool IsNanBits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// Reference: round |x| to a multiple of the target's quantum (a power of two) with
// nearbyint (ties to even in the default rounding mode), then encode sign/exponent/mantissa.
uint16_t RefNan(uint32_t u, HalfType t, CastOptions o) {
  if (o.nan_mode == NanMode::kCanonical) return o.canonical_nan;
  const uint16_t sign = (u >> 31) ? 0x8000 : 0;
  if (t == HalfType::kBFloat16) return static_cast<uint16_t>(sign | 0x7FC0 | ((u >> 16) & 0x3F));
  return static_cast<uint16_t>(sign | 0x7E00 | ((u >> 13) & 0x1FF));
}

uint16_t RefFp16(uint32_t u, CastOptions o) {
  if (IsNanBits(u)) return RefNan(u, HalfType::kFloat16, o);
  const uint16_t sign = (u >> 31) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(F(u)));
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): unit in the last place is 2^(e - 11)
  const int ulp_exp = std::max(e - 11, -24);
  const double r = std::ldexp(std::nearbyint(std::ldexp(a, -ulp_exp)), ulp_exp);
  if (r > 65504.0) return sign | 0x7C00;
  if (r < std::ldexp(1.0, -14)) return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::ldexp(r, 24)));
  int re;
  const double rm = std::frexp(r, &re);  // r = rm * 2^re
  const uint16_t exp_field = static_cast<uint16_t>(re - 1 + 15);
  const uint16_t mant = static_cast<uint16_t>((rm * 2 - 1) * 1024);
  return static_cast<uint16_t>(sign | (exp_field << 10) | mant);
}

uint16_t RefBf16(uint32_t u, CastOptions o) {
  if (IsNanBits(u)) return RefNan(u, HalfType::kBFloat16, o);
  const uint16_t sign = (u >> 31) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(F(u)));
  if (std::isinf(a)) return sign | 0x7F80;
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);
  const int ulp_exp = std::max(e - 8, -133);  // bf16: 8 significant bits, min exponent -126
  const double r = std::ldexp(std::nearbyint(std::ldexp(a, -ulp_exp)), ulp_exp);
  if (r >= std::ldexp(1.0, 128)) return sign | 0x7F80;
  uint32_t bits;
  const float rf = static_cast<float>(r);  // exact: 8 significant bits, in fp32's range
  std::memcpy(&bits, &rf, 4);
  return static_cast<uint16_t>(sign | ((bits >> 16) & 0x7FFF));
}

uint16_t Ref(uint32_t u, HalfType t, CastOptions o) {
  return t == HalfType::kBFloat16 ? RefBf16(u, o) : RefFp16(u, o);
}

struct Case {
  HalfType type;
  CastOptions options;
};

std::vector<Case> AllCases() {
  return {{HalfType::kBFloat16, {NanMode::kCanonical, 0x7FC0}},
          {HalfType::kBFloat16, {NanMode::kCanonical, 0xFFFF}},
          {HalfType::kBFloat16, {NanMode::kQuiet, 0}},
          {HalfType::kFloat16, {NanMode::kQuiet, 0}},
          {HalfType::kFloat16, {NanMode::kCanonical, 0x7FFF}}};
}

// Casts `bits` with the vectorized loop and checks each result against the reference and the
// scalar entry point. Returns the number of mismatches (reports the first few).
size_t CheckBatch(const std::vector<uint32_t>& bits, const Case& c) {
  std::vector<float> src(bits.size());
  std::memcpy(src.data(), bits.data(), bits.size() * 4);
  std::vector<uint16_t> dst(bits.size(), 0xABCD);
  CastFp32ToHalf(src.data(), dst.data(), src.size(), c.type, c.options);
  size_t bad = 0;
  for (size_t i = 0; i < bits.size(); ++i) {
    const uint16_t want = Ref(bits[i], c.type, c.options);
    const uint16_t scalar = c.type == HalfType::kBFloat16 ? Fp32BitsToBf16(bits[i], c.options)
                                                          : Fp32BitsToFp16(bits[i], c.options);
    if (dst[i] != want || scalar != want) {
      if (++bad <= 5) {
        ADD_FAILURE() << std::hex << "input 0x" << bits[i] << " type "
                      << static_cast<int>(c.type) << " want 0x" << want << " loop 0x" << dst[i]
                      << " scalar 0x" << scalar;
      }
    }
  }
  return bad;
}

TEST(CastTest, ReferenceRoundingModeIsNearestEven) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  EXPECT_EQ(std::nearbyint(2.5), 2.0);
  EXPECT_EQ(std::nearbyint(3.5), 4.0);
}

// Every 11th fp32 pattern (odd stride, so every residue of the low 16 and 13 dropped bits is
// hit many times, in every exponent). ~390M patterns per case, ~10 s per case in Release.
TEST(CastTest, StridedSweepOfAllFp32Patterns) {
  constexpr uint64_t kStride = 11;
  constexpr size_t kBatch = 1 << 16;
  for (const Case& c : {Case{HalfType::kBFloat16, {NanMode::kCanonical, 0x7FC0}},
                        Case{HalfType::kFloat16, {NanMode::kQuiet, 0}}}) {
    std::vector<uint32_t> bits;
    bits.reserve(kBatch);
    size_t bad = 0;
    for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += kStride) {
      bits.push_back(static_cast<uint32_t>(u));
      if (bits.size() == kBatch) {
        bad += CheckBatch(bits, c);
        bits.clear();
        if (bad > 0) break;
      }
    }
    if (bad == 0) bad += CheckBatch(bits, c);
    EXPECT_EQ(bad, 0u);
  }
}

// Every sign x exponent with the mantissa at and around each rounding boundary of both targets,
// plus every NaN payload class; all NaN options.
TEST(CastTest, BoundaryClassesEveryExponent) {
  std::vector<uint32_t> bits;
  const uint32_t lows[] = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000,
                           0x7FFF, 0x8000, 0x8001, 0xFFFF};
  const uint32_t highs[] = {0x00, 0x01, 0x02, 0x03, 0x3F, 0x40, 0x7E, 0x7F};
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t exp = 0; exp < 256; ++exp) {
      for (uint32_t hi : highs) {
        for (uint32_t lo : lows) {
          bits.push_back((sign << 31) | (exp << 23) | (hi << 16) | lo);
          // the fp16 rounding point sits 13 bits down: vary bits 13..22 too
          bits.push_back((sign << 31) | (exp << 23) | ((hi << 16) & 0x7FE000) | (lo & 0x1FFF) |
                         ((lo & 1) << 13));
        }
      }
    }
  }
  for (const Case& c : AllCases()) EXPECT_EQ(CheckBatch(bits, c), 0u);
}

TEST(CastTest, HandCasesBf16) {
  const CastOptions o{NanMode::kCanonical, 0x7FC0};
  EXPECT_EQ(Fp32BitsToBf16(0x3F800000, o), 0x3F80);  // 1.0
  EXPECT_EQ(Fp32BitsToBf16(0x80000000, o), 0x8000);  // -0
  EXPECT_EQ(Fp32BitsToBf16(0x3F808000, o), 0x3F80);  // tie, even stays
  EXPECT_EQ(Fp32BitsToBf16(0x3F818000, o), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(Fp32BitsToBf16(0x3F808001, o), 0x3F81);  // just above the tie
  EXPECT_EQ(Fp32BitsToBf16(0x7F7F7FFF, o), 0x7F7F);  // below max-finite midpoint
  EXPECT_EQ(Fp32BitsToBf16(0x7F7F8000, o), 0x7F80);  // tie at the top, odd: to inf
  EXPECT_EQ(Fp32BitsToBf16(0x7F7FFFFF, o), 0x7F80);  // FLT_MAX -> inf
  EXPECT_EQ(Fp32BitsToBf16(0xFF800000, o), 0xFF80);  // -inf
  EXPECT_EQ(Fp32BitsToBf16(0x00000001, o), 0x0000);  // smallest fp32 subnormal
  EXPECT_EQ(Fp32BitsToBf16(0x00008000, o), 0x0000);  // tie, even
  EXPECT_EQ(Fp32BitsToBf16(0x00018000, o), 0x0002);  // tie, odd
  EXPECT_EQ(Fp32BitsToBf16(0x007FFFFF, o), 0x0080);  // largest subnormal -> smallest normal
  EXPECT_EQ(Fp32BitsToBf16(0x7F800001, o), 0x7FC0);  // signalling NaN, payload 1
  EXPECT_EQ(Fp32BitsToBf16(0xFFC00000, o), 0x7FC0);  // negative NaN, canonical
  const CastOptions quiet{NanMode::kQuiet, 0};
  EXPECT_EQ(Fp32BitsToBf16(0x7F800001, quiet), 0x7FC0);  // low payload lost, still NaN
  EXPECT_EQ(Fp32BitsToBf16(0xFFA50000, quiet), 0xFFE5);
  EXPECT_EQ(Fp32BitsToBf16(0x7FFFFFFF, quiet), 0x7FFF);  // no rounding carry into the sign
}

TEST(CastTest, HandCasesFp16) {
  const CastOptions o{NanMode::kQuiet, 0};
  EXPECT_EQ(Fp32BitsToFp16(0x3F800000, o), 0x3C00);  // 1.0
  EXPECT_EQ(Fp32BitsToFp16(0x80000000, o), 0x8000);  // -0
  EXPECT_EQ(Fp32BitsToFp16(0x3F801000, o), 0x3C00);  // 1 + 2^-11: tie, even stays
  EXPECT_EQ(Fp32BitsToFp16(0x3F803000, o), 0x3C02);  // 1 + 3*2^-11: tie, odd rounds up
  EXPECT_EQ(Fp32BitsToFp16(0x477FE000, o), 0x7BFF);  // 65504 = max finite
  EXPECT_EQ(Fp32BitsToFp16(0x477FEFFF, o), 0x7BFF);  // just below 65520
  EXPECT_EQ(Fp32BitsToFp16(0x477FF000, o), 0x7C00);  // 65520 -> inf
  EXPECT_EQ(Fp32BitsToFp16(0xC7800000, o), 0xFC00);  // -65536 -> -inf
  EXPECT_EQ(Fp32BitsToFp16(0x7F800000, o), 0x7C00);  // inf
  EXPECT_EQ(Fp32BitsToFp16(0x33800000, o), 0x0001);  // 2^-24, smallest subnormal
  EXPECT_EQ(Fp32BitsToFp16(0x33000000, o), 0x0000);  // 2^-25: tie, to even zero
  EXPECT_EQ(Fp32BitsToFp16(0x33000001, o), 0x0001);  // just above: up
  EXPECT_EQ(Fp32BitsToFp16(0xB3000000, o), 0x8000);  // -2^-25 -> -0
  EXPECT_EQ(Fp32BitsToFp16(0x33C00000, o), 0x0002);  // 1.5 * 2^-24: tie, odd up
  EXPECT_EQ(Fp32BitsToFp16(0x38800000, o), 0x0400);  // 2^-14, smallest normal
  EXPECT_EQ(Fp32BitsToFp16(0x387FC000, o), 0x03FF);  // 1023 * 2^-24, largest subnormal
  EXPECT_EQ(Fp32BitsToFp16(0x387FDFFF, o), 0x03FF);  // just below the tie
  EXPECT_EQ(Fp32BitsToFp16(0x387FE000, o), 0x0400);  // tie between it and 2^-14: even
  EXPECT_EQ(Fp32BitsToFp16(0x00000001, o), 0x0000);  // fp32 subnormal
  EXPECT_EQ(Fp32BitsToFp16(0x7F800001, o), 0x7E00);  // F16C: quiet, low payload lost
  EXPECT_EQ(Fp32BitsToFp16(0xFF800001, o), 0xFE00);
  EXPECT_EQ(Fp32BitsToFp16(0x7FA00000, o), 0x7F00);
  EXPECT_EQ(Fp32BitsToFp16(0x7FFFFFFF, o), 0x7FFF);
  EXPECT_EQ(Fp32BitsToFp16(0xFFC00000, CastOptions{NanMode::kCanonical, 0x7FFF}), 0x7FFF);
}

TEST(CastTest, DefaultOptionsMatchC10Scalar) {
  EXPECT_EQ(Fp32BitsToBf16(0xFF800001, DefaultCastOptions(HalfType::kBFloat16)), 0x7FC0);
  EXPECT_EQ(Fp32BitsToFp16(0xFFC00000, DefaultCastOptions(HalfType::kFloat16)), 0xFE00);
}

// Odd lengths and unaligned starts exercise the vector loop's head/tail handling.
TEST(CastTest, UnalignedAndOddLengths) {
  std::vector<float> src(1031);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) * 1.0009765625f - 300;
  for (HalfType t : {HalfType::kBFloat16, HalfType::kFloat16}) {
    const CastOptions o = DefaultCastOptions(t);
    for (size_t start : {0, 1, 3}) {
      for (size_t n : {0, 1, 7, 15, 16, 17, 1000}) {
        std::vector<uint16_t> dst(n + 2, 0x5A5A);
        CastFp32ToHalf(src.data() + start, dst.data() + 1, n, t, o);
        EXPECT_EQ(dst[0], 0x5A5A);
        EXPECT_EQ(dst[n + 1], 0x5A5A) << "wrote past the end";
        for (size_t i = 0; i < n; ++i) {
          uint32_t u;
          std::memcpy(&u, &src[start + i], 4);
          ASSERT_EQ(dst[i + 1], Ref(u, t, o)) << "start " << start << " i " << i;
        }
      }
    }
  }
}

TEST(CastTest, ShardsLandInTheirSlots) {
  // Two parameters, padded shard lengths 5 and 3, world 4, this rank 2.
  const size_t world = 4, rank = 2;
  std::vector<float> a = {1.f, 2.f, 3.f, 4.f, 5.f}, b = {-1.f, 0.5f, 65504.f};
  std::vector<uint16_t> out_a(world * a.size(), 0xEEEE), out_b(world * b.size(), 0xEEEE);
  std::vector<ShardSlot> slots = {{a.data(), a.size(), out_a.data(), rank * a.size()},
                                  {b.data(), b.size(), out_b.data(), rank * b.size()}};
  CastShardsIntoSlots(slots, HalfType::kFloat16, DefaultCastOptions(HalfType::kFloat16));
  const std::vector<uint16_t> want_a = {0x3C00, 0x4000, 0x4200, 0x4400, 0x4500};
  const std::vector<uint16_t> want_b = {0xBC00, 0x3800, 0x7BFF};
  for (size_t i = 0; i < out_a.size(); ++i) {
    const bool in_slot = i / a.size() == rank;
    EXPECT_EQ(out_a[i], in_slot ? want_a[i % a.size()] : 0xEEEE) << i;
  }
  for (size_t i = 0; i < out_b.size(); ++i) {
    const bool in_slot = i / b.size() == rank;
    EXPECT_EQ(out_b[i], in_slot ? want_b[i % b.size()] : 0xEEEE) << i;
  }
}

}  // namespace
}  // namespace dcr
