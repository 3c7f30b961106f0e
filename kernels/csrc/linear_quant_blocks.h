// GGUF block formats as linear_quant.cpp reads them, shared by its ISA variants: which
// formats there are, their sizes, and the plain scalar dequantization of one block
// (embedding lookups; the oracle of the vector code is kernels/reference.py).
//
// Every format stores blocks of kBlock = 32 consecutive weights of one output row:
//   Q8_0 (34 bytes): fp16 d, int8 q[32];                    w[j] = d * q[j]
//   Q4_0 (18 bytes): fp16 d, uint8 qs[16];                  w[j] = d * (q[j] - 8)
//   Q4_1 (20 bytes): fp16 d, fp16 m, uint8 qs[16];          w[j] = d * q[j] + m
//   Q4X (24 bytes): fp32 d, fp32 m, uint8 qs[16];           w[j] = d * q[j] + m
//   Q5X (28 bytes): fp32 d, fp32 m, uint8 qs[16], u32 qh;   w[j] = d * (q[j] + 16 bit j of qh) + m
//   Q6X (32 bytes): fp32 d[2], uint8 qs[16], u32 qh[2];     w[j] = d[j / 16] * (q[j] + 16 h[j] - 32)
// where for the 4-bit quants q[j] = qs[j] & 15 and q[j + 16] = qs[j] >> 4, and Q6X's
// h[j] = (qh[j / 16] >> 2 (j % 16)) & 3. The first three are GGUF's own; Q4X, Q5X and Q6X
// are GGUF's Q4_K, Q5_K and Q6_K repacked (kernels/gguf_blocks.py) into 32-weight blocks
// whose scale is the super-block's d times the sub-block's integer scale (exact in float32)
// and whose m is minus dmin times the sub-block's integer min (Q6_K's two 16-weight
// sub-blocks keep a scale each); the float32 kernel also reads Q4_1 as Q4X, its fp16 d
// and m widened (its unit then broadcasts them from memory, no shuffles). Each weight is
// then the one real number d * q + m (m = -8 d for Q4_0, -32 d for Q6X) rounded once to
// float32: d * q is exact in float32 (at most 24 significant bits), so a fused
// multiply-add of d, q and m gives exactly gguf's dequantized value.
//
// The kernels read a matrix W of N rows (output columns) in groups of kGroup consecutive
// rows, the last group padded with zero blocks (kernels/linear_quant.py lays GGUF rows
// out so). Group g holds, for each block index b in turn, one step: the headers (d, or d
// and m) of block b of rows 4g .. 4g + 3, then their quants. A thread so streams through
// its groups in one pass (rows of a few hundred bytes, read side by side, are streams too
// short for the hardware prefetchers), and one conversion decodes the four headers.
#pragma once

#include <cstdint>
#include <cstring>

namespace specdec::quant {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 4;

enum Format : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4X = 3, kQ5X = 4, kQ6X = 5, kNumFormats = 6 };

// Bytes of one block of `format` (0 for an unknown format), and of its header.
constexpr int64_t block_bytes(int32_t format) {
  switch (format) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ4X: return 24;
    case kQ5X: return 28;
    case kQ6X: return 32;
    default: return 0;
  }
}

constexpr int64_t header_bytes(int32_t format) { return format <= kQ4_0 ? 2 : format == kQ4_1 ? 4 : 8; }

inline float half_to_float(const uint8_t* p) {
  _Float16 h;
  std::memcpy(&h, p, sizeof h);
  return static_cast<float>(h);
}

inline float read_float(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

inline uint32_t read_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Element j's 4-bit quant of the 16 bytes at qs.
inline int nibble(const uint8_t* qs, int j) { return j < 16 ? qs[j] & 15 : qs[j - 16] >> 4; }

inline void dequantize_4bit(const uint8_t* qs, float d, float m, float* out) {
  for (int j = 0; j < kBlock; ++j) out[j] = __builtin_fmaf(d, static_cast<float>(nibble(qs, j)), m);
}

// The kBlock weights of one block of `format` with its header and quants at `header` and
// `quants`, each exactly as gguf dequantizes it.
inline void dequantize_block(int32_t format, const uint8_t* header, const uint8_t* quants, float* out) {
  switch (format) {
    case kQ8_0: {
      const float d = half_to_float(header);
      for (int j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(quants[j]));
      return;
    }
    case kQ4_0: {
      const float d = half_to_float(header);
      return dequantize_4bit(quants, d, -8.0f * d, out);
    }
    case kQ4_1: return dequantize_4bit(quants, half_to_float(header), half_to_float(header + 2), out);
    case kQ4X: return dequantize_4bit(quants, read_float(header), read_float(header + 4), out);
    case kQ5X: {
      const float d = read_float(header), m = read_float(header + 4);
      const uint32_t high = read_u32(quants + 16);
      for (int j = 0; j < kBlock; ++j)
        out[j] = __builtin_fmaf(d, static_cast<float>(nibble(quants, j) + 16 * ((high >> j) & 1)), m);
      return;
    }
    case kQ6X:
      for (int j = 0; j < kBlock; ++j) {
        const float d = read_float(header + 4 * (j / 16));
        const uint32_t high = (read_u32(quants + 16 + 4 * (j / 16)) >> (2 * (j % 16))) & 3;
        out[j] = __builtin_fmaf(d, static_cast<float>(nibble(quants, j) + 16 * static_cast<int>(high)), -32.0f * d);
      }
      return;
    default: return;
  }
}

// Row n's K weights from W in the group layout above, dequantized exactly.
inline void dequantize_row(int32_t format, const uint8_t* w, int64_t K, int64_t n, float* out) {
  const int64_t header = header_bytes(format), quants = block_bytes(format) - header, blocks = K / kBlock;
  const uint8_t* group = w + n / kGroup * blocks * kGroup * block_bytes(format);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* step = group + b * kGroup * block_bytes(format);
    dequantize_block(format, step + n % kGroup * header, step + kGroup * header + n % kGroup * quants,
                     out + b * kBlock);
  }
}

}  // namespace specdec::quant
