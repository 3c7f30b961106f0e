// The AVX2 variant of the quantized linear kernel (linear_quant.cpp): a Unit of 16
// float32 weights is two ymm registers, lanes 0-7 and 8-15, so each of its lanes
// accumulates the same products in the same order as the AVX-512 variant's.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

#include "linear_quant_blocks.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace specdec::quant::avx2 {

#include "linear_quant_common.h"

struct Unit {
  __m256 low, high;
};

inline Unit zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Unit load(const float* x) { return {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)}; }
inline Unit fma(Unit x, Unit w, Unit acc) {
  return {_mm256_fmadd_ps(x.low, w.low, acc.low), _mm256_fmadd_ps(x.high, w.high, acc.high)};
}

// 16 ymm registers. One or three rows: a Unit accumulator is two of them, plus one decoded
// unit and the step's scales (activations are read as the multiply-adds' memory operands),
// so a tile keeps one decoded unit live (kOneUnitLive); one row takes four columns a tile
// and two or three rows two, eight or twelve accumulator chains to hide the multiply-add
// latency (on Zen3: 10% faster than two columns for one row, 17% faster than one column
// for two rows). Four to six rows (kHalfPassRows): a tile makes two passes over its
// blocks, lanes 0-7 of every unit and then lanes 8-15 (half_tile), so that six rows by two
// columns need twelve accumulators and each activation load serves both columns; each lane
// takes the same products in the same order as in one pass. Six rows (a 1 + 5 verify):
// 6-12% faster than six rows by one column in one pass (the default model's four
// projections of every layer and its LM head, interleaved runs), which was itself 25-30%
// faster than 4 + 2 rows (each block decoded twice).
constexpr int max_rows(int columns) { return columns >= 4 ? 1 : 6; }
inline int64_t columns_per_tile(int64_t rows) { return rows == 1 ? 4 : 2; }
constexpr bool kOneUnitLive = true;
constexpr int kHalfPassRows = 4;

// The 16 lanes summed as (l, l + 8), then as reduce8 does.
inline float reduce(Unit acc) { return reduce8(_mm256_add_ps(acc.low, acc.high)); }

// Lane i of v in every lane.
inline __m256 lane(__m256 v, int64_t i) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(static_cast<int>(i))); }

// The fp16 headers at p as float32 lanes: 4 (lanes 0-3) or 8.
inline __m256 halves4(const uint8_t* p) {
  return _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m128i bytes8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

// The 4-bit quants of the 8 bytes at p: their low nibbles (u = 0) or high ones.
inline __m256i quants4(const uint8_t* p, int u) {
  const __m256i q = _mm256_cvtepu8_epi32(bytes8(p));
  return u == 0 ? _mm256_and_si256(q, _mm256_set1_epi32(15)) : _mm256_srli_epi32(q, 4);
}

// Lane l: the `width`-bit field of `bits` at bit width * (first + l), times 16 (a quant's
// high bits above its nibble).
inline __m256i high_bits(uint32_t bits, int first, int width) {
  const __m256i at = _mm256_mullo_epi32(_mm256_add_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0),
                                                         _mm256_set1_epi32(first)), _mm256_set1_epi32(width));
  const __m256i field = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits)), at),
                                         _mm256_set1_epi32((1 << width) - 1));
  return _mm256_slli_epi32(field, 4);
}

inline __m256 weights(__m256i q, __m256 d, __m256 m) { return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m); }

// Unit u of a 4-bit block: the low nibbles of its 16 bytes for u = 0, the high ones for 1.
inline Unit nibbles(const uint8_t* qs, __m256 d, __m256 m, int u) {
  return {weights(quants4(qs, u), d, m), weights(quants4(qs + 8, u), d, m)};
}

inline __m256 broadcast(const uint8_t* p) { return _mm256_set1_ps(read_float(p)); }

// Unit u of a block as its two halves, lanes 0-7 (h = 0) and 8-15: each block below
// decodes one half at a time (`half(c, u, h)`), and `unit(c, u)` is both.
template <class Block>
struct Halves {
  Unit unit(int64_t c, int u) const {
    const Block& block = static_cast<const Block&>(*this);
    return {block.half(c, u, 0), block.half(c, u, 1)};
  }
};

// One step of a group (linear_quant_blocks.h): `half(c, u, h)` is half h of unit u of row
// c's block.
struct Q8_0 : Halves<Q8_0> {
  static constexpr int64_t kBytes = block_bytes(kQ8_0), kQuants = kBytes - header_bytes(kQ8_0);
  __m256 d;
  const uint8_t* quants;
  explicit Q8_0(const uint8_t* step) : d(halves4(step)), quants(step + kGroup * header_bytes(kQ8_0)) {}
  __m256 half(int64_t c, int u, int h) const {
    const __m128i q = bytes8(quants + c * kQuants + 16 * u + 8 * h);
    return _mm256_mul_ps(lane(d, c), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
  }
};

struct Q4_0 : Halves<Q4_0> {
  static constexpr int64_t kBytes = block_bytes(kQ4_0), kQuants = kBytes - header_bytes(kQ4_0);
  __m256 d;
  const uint8_t* quants;
  explicit Q4_0(const uint8_t* step) : d(halves4(step)), quants(step + kGroup * header_bytes(kQ4_0)) {}
  __m256 half(int64_t c, int u, int h) const {
    const __m256 scale = lane(d, c);
    return weights(quants4(quants + c * kQuants + 8 * h, u), scale, _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f)));
  }
};

struct Q4_1 : Halves<Q4_1> {
  static constexpr int64_t kBytes = block_bytes(kQ4_1), kQuants = kBytes - header_bytes(kQ4_1);
  __m256 dm;  // d, m of row 0, then of row 1, ...
  const uint8_t* quants;
  explicit Q4_1(const uint8_t* step) : dm(halves8(step)), quants(step + kGroup * header_bytes(kQ4_1)) {}
  __m256 half(int64_t c, int u, int h) const {
    return weights(quants4(quants + c * kQuants + 8 * h, u), lane(dm, 2 * c), lane(dm, 2 * c + 1));
  }
};

// The repacked K-quants (fp32 headers: broadcast straight from memory).
struct Q4X : Halves<Q4X> {
  static constexpr int64_t kBytes = block_bytes(kQ4X), kHeader = header_bytes(kQ4X), kQuants = kBytes - kHeader;
  const uint8_t *headers, *quants;
  explicit Q4X(const uint8_t* step) : headers(step), quants(step + kGroup * kHeader) {}
  __m256 half(int64_t c, int u, int h) const {
    return weights(quants4(quants + c * kQuants + 8 * h, u), broadcast(headers + c * kHeader),
                   broadcast(headers + c * kHeader + 4));
  }
};

struct Q5X : Halves<Q5X> {
  static constexpr int64_t kBytes = block_bytes(kQ5X), kHeader = header_bytes(kQ5X), kQuants = kBytes - kHeader;
  const uint8_t *headers, *quants;
  explicit Q5X(const uint8_t* step) : headers(step), quants(step + kGroup * kHeader) {}
  __m256 half(int64_t c, int u, int h) const {
    const uint8_t* q = quants + c * kQuants;
    const __m256i high = high_bits(read_u32(q + 16), 16 * u + 8 * h, 1);
    return weights(_mm256_or_si256(quants4(q + 8 * h, u), high), broadcast(headers + c * kHeader),
                   broadcast(headers + c * kHeader + 4));
  }
};

struct Q6X : Halves<Q6X> {
  static constexpr int64_t kBytes = block_bytes(kQ6X), kHeader = header_bytes(kQ6X), kQuants = kBytes - kHeader;
  const uint8_t *headers, *quants;
  explicit Q6X(const uint8_t* step) : headers(step), quants(step + kGroup * kHeader) {}
  __m256 half(int64_t c, int u, int h) const {
    const uint8_t* q = quants + c * kQuants;
    const __m256i high = high_bits(read_u32(q + 16 + 4 * u), 8 * h, 2);
    const __m256 d = broadcast(headers + c * kHeader + 4 * u);
    return weights(_mm256_or_si256(quants4(q + 8 * h, u), high), d, _mm256_mul_ps(d, _mm256_set1_ps(-32.0f)));
  }
};

// What one_pass_tile() (linear_quant_tile.h) computes, for R >= kHalfPassRows rows: lanes 0-7 of every unit over
// all blocks, then lanes 8-15, and the two halves summed as reduce() sums a Unit's.
template <class Block, int R, int C>
void half_tile(const float* x, int64_t ldx, int64_t blocks, const uint8_t* w, int64_t first, float* out,
               int64_t ldo, const float* bias, int64_t cols) {
  constexpr int64_t kStep = kGroup * Block::kBytes;
  __m256 sums[2][R][C];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* step = w + b * kStep;
      if (h == 0)  // the second pass finds the tile's blocks in L1
        for (int64_t offset = 0; offset < kStep; offset += 64) __builtin_prefetch(step + kAheadBytes + offset);
      const Block block(step);
      for (int u = 0; u < 2; ++u) {
        // Decoded here, not hoisted beside the previous unit's multiply-adds: GCC otherwise
        // decodes both units first and spills four accumulators.
        __asm__ volatile("" ::: "memory");
        __m256 weights[C];
        for (int c = 0; c < C; ++c) weights[c] = block.half(first + c, u, h);
        for (int r = 0; r < R; ++r) {
          __m256 xs = _mm256_loadu_ps(x + r * ldx + b * kBlock + 16 * u + 8 * h);
          __asm__("" : "+x"(xs));  // one register for both columns, not a memory operand each
          for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xs, weights[c], acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[h][r][c] = acc[r][c];
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C && c < cols; ++c) {
      const float sum = reduce8(_mm256_add_ps(sums[0][r][c], sums[1][r][c]));
      out[r * ldo + c] = bias ? sum + bias[c] : sum;
    }
}

#include "linear_quant_tile.h"

}  // namespace specdec::quant::avx2

#pragma GCC pop_options
