// Checked construction of the cast kernels' arguments (kernels/cast.h) from what a caller
// names: the target dtype and NaN handling as strings, a slot as an offset into a buffer of
// known size. Every rule lives here, not in the bindings, so GoogleTest drives it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cast.h"

namespace dcr {

// "bfloat16" or "float16"; std::invalid_argument otherwise.
HalfType ParseHalfType(const std::string& dtype);

// The options for `type` named by nan_mode:
//   "default"    DefaultCastOptions(type) (torch's scalar c10 path);
//   "quiet"      sign and top payload bits kept, quiet bit set;
//   "canonical"  every NaN becomes the canonical pattern.
// canonical_nan, when given, replaces the canonical pattern; it must fit in 16 bits, and with
// "canonical" (or a default that is canonical) it must itself be a NaN of `type` (all exponent
// bits set, mantissa non-zero). std::invalid_argument otherwise.
CastOptions ParseCastOptions(HalfType type, const std::string& nan_mode,
                             std::optional<int64_t> canonical_nan);

// Host buffers as a caller hands them over (pointer and element count).
struct Fp32Buffer {
  const float* data = nullptr;
  size_t size = 0;
};
struct HalfBuffer {
  uint16_t* data = nullptr;
  size_t size = 0;
};

// The whole of `shard` cast into output[slot_offset, slot_offset + shard.size);
// std::invalid_argument if that slot does not lie inside `output`.
ShardSlot MakeShardSlot(Fp32Buffer shard, HalfBuffer output, int64_t slot_offset);

// std::invalid_argument unless a bucket call's three per-shard lists (sources, destinations and
// one more: offsets or counts) have equal length; `lists` names them for the message.
void CheckOneEntryPerShard(size_t srcs, size_t dsts, size_t third, const std::string& lists);

// One slot per shard (MakeShardSlot); std::invalid_argument unless the three have equal length.
std::vector<ShardSlot> MakeShardSlots(Span<Fp32Buffer> shards, Span<HalfBuffer> outputs,
                                      Span<int64_t> slot_offsets);

}  // namespace dcr
