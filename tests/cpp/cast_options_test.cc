// The checked construction of cast arguments (kernels/cast_options.h): every rule the Python
// bindings relied on, driven here.
#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>
#include <vector>

#include "kernels/cast_options.h"

namespace dcr {
namespace {

TEST(CastOptions, ParsesTheTwoTargets) {
  EXPECT_EQ(ParseHalfType("bfloat16"), HalfType::kBFloat16);
  EXPECT_EQ(ParseHalfType("float16"), HalfType::kFloat16);
  EXPECT_THROW(ParseHalfType("float8"), std::invalid_argument);
  EXPECT_THROW(ParseHalfType("BFloat16"), std::invalid_argument);
}

TEST(CastOptions, DefaultIsTorchsScalarPath) {
  for (HalfType t : {HalfType::kBFloat16, HalfType::kFloat16}) {
    const CastOptions o = ParseCastOptions(t, "default", std::nullopt);
    const CastOptions want = DefaultCastOptions(t);
    EXPECT_EQ(o.nan_mode, want.nan_mode);
    EXPECT_EQ(o.canonical_nan, want.canonical_nan);
  }
}

TEST(CastOptions, NanModes) {
  EXPECT_EQ(ParseCastOptions(HalfType::kBFloat16, "quiet", std::nullopt).nan_mode,
            NanMode::kQuiet);
  const CastOptions c = ParseCastOptions(HalfType::kBFloat16, "canonical", 0x7FFF);
  EXPECT_EQ(c.nan_mode, NanMode::kCanonical);
  EXPECT_EQ(c.canonical_nan, 0x7FFF);
  EXPECT_EQ(ParseCastOptions(HalfType::kFloat16, "canonical", 0xFE00).canonical_nan, 0xFE00);
  EXPECT_THROW(ParseCastOptions(HalfType::kBFloat16, "signalling", std::nullopt),
               std::invalid_argument);
}

TEST(CastOptions, CanonicalNanMustFitAndBeANan) {
  EXPECT_THROW(ParseCastOptions(HalfType::kBFloat16, "canonical", -1), std::invalid_argument);
  EXPECT_THROW(ParseCastOptions(HalfType::kBFloat16, "canonical", 0x10000),
               std::invalid_argument);
  // 0x1234: not all exponent bits set; 0x7F80: bf16 +inf (no mantissa bits).
  EXPECT_THROW(ParseCastOptions(HalfType::kBFloat16, "canonical", 0x1234), std::invalid_argument);
  EXPECT_THROW(ParseCastOptions(HalfType::kBFloat16, "canonical", 0x7F80), std::invalid_argument);
  EXPECT_THROW(ParseCastOptions(HalfType::kFloat16, "canonical", 0x7C00), std::invalid_argument);
  // bf16's default is canonical: a replacement pattern is checked there too.
  EXPECT_THROW(ParseCastOptions(HalfType::kBFloat16, "default", 0x1234), std::invalid_argument);
  // With quiet NaNs the pattern is unused, so it is not checked.
  EXPECT_NO_THROW(ParseCastOptions(HalfType::kBFloat16, "quiet", 0x1234));
}

TEST(CastOptions, SlotsMustLieInsideTheOutput) {
  std::vector<float> src(3);
  std::vector<uint16_t> dst(5);
  const Fp32Buffer s{src.data(), src.size()};
  const HalfBuffer d{dst.data(), dst.size()};
  const ShardSlot slot = MakeShardSlot(s, d, 2);
  EXPECT_EQ(slot.slot_offset, 2u);
  EXPECT_EQ(slot.n, 3u);
  EXPECT_EQ(slot.full_output, dst.data());
  EXPECT_THROW(MakeShardSlot(s, d, 3), std::invalid_argument);   // one past the end
  EXPECT_THROW(MakeShardSlot(s, d, -1), std::invalid_argument);
  EXPECT_THROW(MakeShardSlot(s, d, 6), std::invalid_argument);
  const HalfBuffer small{dst.data(), 2};
  EXPECT_THROW(MakeShardSlot(s, small, 0), std::invalid_argument);
}

TEST(CastOptions, BucketArgumentsHaveOneSlotPerShard) {
  std::vector<float> src(2);
  std::vector<uint16_t> dst(4);
  const std::vector<Fp32Buffer> shards = {{src.data(), 2}, {src.data(), 2}};
  const std::vector<HalfBuffer> outs = {{dst.data(), 4}, {dst.data(), 4}};
  const std::vector<int64_t> offsets = {0, 2};
  EXPECT_EQ(MakeShardSlots(shards, outs, offsets).size(), 2u);
  const std::vector<int64_t> one_offset = {0};
  EXPECT_THROW(MakeShardSlots(shards, outs, one_offset), std::invalid_argument);
  const std::vector<int64_t> outside = {0, 3};
  EXPECT_THROW(MakeShardSlots(shards, outs, outside), std::invalid_argument);
}

TEST(CastOptions, PerShardListsMustHaveEqualLength) {
  EXPECT_NO_THROW(CheckOneEntryPerShard(3, 3, 3, "srcs, dsts and counts"));
  EXPECT_THROW(CheckOneEntryPerShard(3, 2, 3, "srcs, dsts and counts"), std::invalid_argument);
  EXPECT_THROW(CheckOneEntryPerShard(3, 3, 0, "srcs, dsts and counts"), std::invalid_argument);
  try {
    CheckOneEntryPerShard(1, 2, 1, "srcs, dsts and counts");
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "srcs, dsts and counts must have the same length");
  }
}

}  // namespace
}  // namespace dcr
