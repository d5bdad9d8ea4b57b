// fp32 -> bf16 / fp16 conversion on the CPU, round-to-nearest-even, written into 16-bit slots.
//
// Why: ZeRO-3 gathers each parameter before use. Casting the local fp32 shard to bf16/fp16
// *before* the allgather halves the bytes on the wire and means no full-size fp32 copy of the
// weight ever exists. Each rank casts its shard straight into its own slot of the full-size
// 16-bit output (slot = rank * padded shard length); the allgather then runs in place.
//
// Contract (every input bit pattern, both targets):
//   - finite values round to nearest, ties to even (the IEEE default, what torch does);
//   - bf16 keeps fp32's exponent range: fp32 subnormals map to bf16 subnormals; values at or
//     past the midpoint between bf16's max finite (0x7F7F) and 2^128 become inf;
//   - fp16: |x| >= 65520 becomes inf, |x| < 2^-14 becomes an fp16 subnormal, and values at or
//     below half the smallest subnormal (2^-25) round to (signed) zero; -0 stays -0;
//   - +-inf stays +-inf;
//   - NaN: torch itself is not consistent across CPU capabilities and devices (c10's scalar
//     bf16 conversion gives 0x7FC0, its AVX2/AVX512 vector path 0xFFFF, CUDA 0x7FFF; x86 F16C
//     keeps the fp16 NaN payload, c10's scalar fp16 path does not). So NaN handling is an
//     explicit option: kQuiet keeps sign and the top payload bits and sets the quiet bit (IEEE,
//     F16C), kCanonical writes one fixed pattern for every NaN. The Python layer probes which
//     one torch uses in the running process, so results are bit-identical to `tensor.to(dtype)`.
//   Output is never NaN for a non-NaN input, and always NaN for a NaN input.
//
// Speed: the element loops are branch-free selects over uint32 bit patterns so the compiler
// vectorizes them (no intrinsics, no -march flags: the binary runs on any x86-64/aarch64).
// src and dst must not overlap; there is no alignment requirement.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/span.h"

namespace dcr {

enum class HalfType : uint8_t { kBFloat16, kFloat16 };

enum class NanMode : uint8_t {
  kQuiet,      // sign + top payload bits kept, quiet bit set
  kCanonical,  // every NaN becomes CastOptions::canonical_nan
};

struct CastOptions {
  NanMode nan_mode = NanMode::kQuiet;
  uint16_t canonical_nan = 0x7FC0;  // used only with kCanonical; must itself be a NaN pattern
};

// Options that reproduce torch's CPU cast when torch uses its scalar (c10) code path.
CastOptions DefaultCastOptions(HalfType type);

// dst[i] = cast(src[i]) for i in [0, n).
void CastFp32ToBf16(const float* src, uint16_t* dst, size_t n, CastOptions options);
void CastFp32ToFp16(const float* src, uint16_t* dst, size_t n, CastOptions options);
void CastFp32ToHalf(const float* src, uint16_t* dst, size_t n, HalfType type,
                    CastOptions options);

// Single-element versions of the same functions (identical results; for tests and tails).
uint16_t Fp32BitsToBf16(uint32_t bits, CastOptions options);
uint16_t Fp32BitsToFp16(uint32_t bits, CastOptions options);

// One shard of a bucket: `n` fp32 values cast into full_output[slot_offset, slot_offset + n).
// slot_offset is rank * padded_shard_len for the parameter this shard belongs to.
struct ShardSlot {
  const float* shard = nullptr;
  size_t n = 0;
  uint16_t* full_output = nullptr;
  size_t slot_offset = 0;
};

// Casts every shard of a bucket into its slot. Slots must not overlap each other or any shard.
void CastShardsIntoSlots(Span<ShardSlot> shards, HalfType type, CastOptions options);

}  // namespace dcr
