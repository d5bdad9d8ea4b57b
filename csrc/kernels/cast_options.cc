#include "kernels/cast_options.h"

#include <stdexcept>

namespace dcr {

HalfType ParseHalfType(const std::string& dtype) {
  if (dtype == "bfloat16") return HalfType::kBFloat16;
  if (dtype == "float16") return HalfType::kFloat16;
  throw std::invalid_argument("dtype must be 'bfloat16' or 'float16', got '" + dtype + "'");
}

CastOptions ParseCastOptions(HalfType type, const std::string& nan_mode,
                             std::optional<int64_t> canonical_nan) {
  CastOptions o = DefaultCastOptions(type);
  if (nan_mode == "quiet") {
    o.nan_mode = NanMode::kQuiet;
  } else if (nan_mode == "canonical") {
    o.nan_mode = NanMode::kCanonical;
  } else if (nan_mode != "default") {
    throw std::invalid_argument("nan_mode must be 'default', 'quiet' or 'canonical', got '" +
                                nan_mode + "'");
  }
  if (canonical_nan.has_value()) {
    if (*canonical_nan < 0 || *canonical_nan > 0xFFFF) {
      throw std::invalid_argument("canonical_nan must fit in 16 bits");
    }
    o.canonical_nan = static_cast<uint16_t>(*canonical_nan);
  }
  const uint16_t exp_mask = type == HalfType::kBFloat16 ? 0x7F80 : 0x7C00;
  const uint16_t mant_mask = type == HalfType::kBFloat16 ? 0x007F : 0x03FF;
  if (o.nan_mode == NanMode::kCanonical &&
      ((o.canonical_nan & exp_mask) != exp_mask || (o.canonical_nan & mant_mask) == 0)) {
    throw std::invalid_argument("canonical_nan is not a NaN pattern of the target dtype");
  }
  return o;
}

ShardSlot MakeShardSlot(Fp32Buffer shard, HalfBuffer output, int64_t slot_offset) {
  if (slot_offset < 0 || static_cast<size_t>(slot_offset) > output.size ||
      shard.size > output.size - static_cast<size_t>(slot_offset)) {
    throw std::invalid_argument("slot [offset, offset + len(src)) lies outside dst");
  }
  ShardSlot s;
  s.shard = shard.data;
  s.n = shard.size;
  s.full_output = output.data;
  s.slot_offset = static_cast<size_t>(slot_offset);
  return s;
}

void CheckOneEntryPerShard(size_t srcs, size_t dsts, size_t third, const std::string& lists) {
  if (srcs != dsts || srcs != third) {
    throw std::invalid_argument(lists + " must have the same length");
  }
}

std::vector<ShardSlot> MakeShardSlots(Span<Fp32Buffer> shards, Span<HalfBuffer> outputs,
                                      Span<int64_t> slot_offsets) {
  CheckOneEntryPerShard(shards.size, outputs.size, slot_offsets.size, "srcs, dsts and offsets");
  std::vector<ShardSlot> slots;
  slots.reserve(shards.size);
  for (size_t i = 0; i < shards.size; ++i) {
    slots.push_back(MakeShardSlot(shards[i], outputs[i], slot_offsets[i]));
  }
  return slots;
}

}  // namespace dcr
