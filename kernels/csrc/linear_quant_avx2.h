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

// 16 ymm registers: two per accumulator, two per decoded unit, and the step's scales and
// a few constants (activations are read as the multiply-adds' memory operands), so a tile
// keeps one decoded unit live (kOneUnitLive). Six rows take a 1 + 5 verify in one pass
// over the weights: 25-30% less time than 4 + 2, which decodes every block twice. One row
// takes four columns a tile and two or three rows two: eight or twelve accumulator chains
// hide the multiply-add latency (on Zen3: 10% faster than two columns for one row, 17%
// faster than one column for two rows).
constexpr int max_rows(int columns) { return columns >= 4 ? 1 : columns == 2 ? 3 : 6; }
inline int64_t columns_per_tile(int64_t rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }
constexpr bool kOneUnitLive = true;

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

// One step of a group (linear_quant_blocks.h): `unit(c, u)` is unit u of row c's block.
struct Q8_0 {
  static constexpr int64_t kBytes = block_bytes(kQ8_0), kQuants = kBytes - header_bytes(kQ8_0);
  __m256 d;
  const uint8_t* quants;
  explicit Q8_0(const uint8_t* step) : d(halves4(step)), quants(step + kGroup * header_bytes(kQ8_0)) {}
  Unit unit(int64_t c, int u) const {
    const uint8_t* q = quants + c * kQuants + 16 * u;
    const __m256 scale = lane(d, c);
    return {_mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(q)))),
            _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(q + 8))))};
  }
};

struct Q4_0 {
  static constexpr int64_t kBytes = block_bytes(kQ4_0), kQuants = kBytes - header_bytes(kQ4_0);
  __m256 d;
  const uint8_t* quants;
  explicit Q4_0(const uint8_t* step) : d(halves4(step)), quants(step + kGroup * header_bytes(kQ4_0)) {}
  Unit unit(int64_t c, int u) const {
    const __m256 scale = lane(d, c);
    return nibbles(quants + c * kQuants, scale, _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f)), u);
  }
};

struct Q4_1 {
  static constexpr int64_t kBytes = block_bytes(kQ4_1), kQuants = kBytes - header_bytes(kQ4_1);
  __m256 dm;  // d, m of row 0, then of row 1, ...
  const uint8_t* quants;
  explicit Q4_1(const uint8_t* step) : dm(halves8(step)), quants(step + kGroup * header_bytes(kQ4_1)) {}
  Unit unit(int64_t c, int u) const { return nibbles(quants + c * kQuants, lane(dm, 2 * c), lane(dm, 2 * c + 1), u); }
};

// The repacked K-quants (fp32 headers: broadcast straight from memory).
struct Q4X {
  static constexpr int64_t kBytes = block_bytes(kQ4X), kHeader = header_bytes(kQ4X), kQuants = kBytes - kHeader;
  const uint8_t *headers, *quants;
  explicit Q4X(const uint8_t* step) : headers(step), quants(step + kGroup * kHeader) {}
  Unit unit(int64_t c, int u) const {
    return nibbles(quants + c * kQuants, broadcast(headers + c * kHeader), broadcast(headers + c * kHeader + 4), u);
  }
};

struct Q5X {
  static constexpr int64_t kBytes = block_bytes(kQ5X), kHeader = header_bytes(kQ5X), kQuants = kBytes - kHeader;
  const uint8_t *headers, *quants;
  explicit Q5X(const uint8_t* step) : headers(step), quants(step + kGroup * kHeader) {}
  Unit unit(int64_t c, int u) const {
    const uint8_t* q = quants + c * kQuants;
    const uint32_t high = read_u32(q + 16);
    const __m256 d = broadcast(headers + c * kHeader), m = broadcast(headers + c * kHeader + 4);
    return {weights(_mm256_or_si256(quants4(q, u), high_bits(high, 16 * u, 1)), d, m),
            weights(_mm256_or_si256(quants4(q + 8, u), high_bits(high, 16 * u + 8, 1)), d, m)};
  }
};

struct Q6X {
  static constexpr int64_t kBytes = block_bytes(kQ6X), kHeader = header_bytes(kQ6X), kQuants = kBytes - kHeader;
  const uint8_t *headers, *quants;
  explicit Q6X(const uint8_t* step) : headers(step), quants(step + kGroup * kHeader) {}
  Unit unit(int64_t c, int u) const {
    const uint8_t* q = quants + c * kQuants;
    const uint32_t high = read_u32(q + 16 + 4 * u);
    const __m256 d = broadcast(headers + c * kHeader + 4 * u), m = _mm256_mul_ps(d, _mm256_set1_ps(-32.0f));
    return {weights(_mm256_or_si256(quants4(q, u), high_bits(high, 0, 2)), d, m),
            weights(_mm256_or_si256(quants4(q + 8, u), high_bits(high, 8, 2)), d, m)};
  }
};

#include "linear_quant_tile.h"

}  // namespace specdec::quant::avx2

#pragma GCC pop_options
