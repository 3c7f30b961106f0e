// The AVX-512 variant of the quantized linear kernel (linear_quant.cpp): a Unit of 16
// float32 weights is one zmm register. Compiled for AVX-512 whatever the build flags, and
// run only where the CPU has it.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

#include "linear_quant_blocks.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")

namespace specdec::quant::avx512 {

#include "linear_quant_common.h"

using Unit = __m512;

inline Unit zero() { return _mm512_setzero_ps(); }
inline Unit load(const float* x) { return _mm512_loadu_ps(x); }
inline Unit fma(Unit x, Unit w, Unit acc) { return _mm512_fmadd_ps(x, w, acc); }

// 32 zmm registers: R * C accumulators plus C decoded units and their blocks' scales.
constexpr int max_rows(int columns) { return columns >= 3 ? 2 : columns == 2 ? 6 : 12; }
inline int64_t columns_per_tile(int64_t rows) { return rows <= 2 ? 4 : rows <= 6 ? 2 : 1; }
constexpr bool kOneUnitLive = false;  // 32 registers: every column's unit decoded before the rows
// A unit is one register: no half passes (half_tile is declared for linear_quant_tile.h's
// `if constexpr` and never instantiated).
constexpr int kHalfPassRows = 1 << 30;
template <class Block, int R, int C>
void half_tile(const float* x, int64_t ldx, int64_t blocks, const uint8_t* w, int64_t first, float* out,
               int64_t ldo, const float* bias, int64_t cols);

// The 16 lanes summed as (l, l + 8), then as reduce8 does.
inline float reduce(Unit acc) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
  return reduce8(_mm256_add_ps(_mm512_castps512_ps256(acc), high));
}

// Lane i of v in every lane.
inline Unit lane(Unit v, int64_t i) { return _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(i)), v); }

// The fp16 headers at p as float32 lanes: 4 (lanes 0-3) or 8 (lanes 0-7).
inline Unit halves4(const uint8_t* p) {
  return _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Unit halves8(const uint8_t* p) {
  return _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Unit u's 4-bit quants: the low nibbles of the 16 bytes at qs for u = 0, the high ones for 1.
inline __m512i quants4(const uint8_t* qs, int u) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return u == 0 ? _mm512_and_si512(q, _mm512_set1_epi32(15)) : _mm512_srli_epi32(q, 4);
}

// Lane l: the `width`-bit field of `bits` at bit width * (first + l), times 16 (a quant's
// high bits above its nibble).
inline __m512i high_bits(uint32_t bits, int first, int width) {
  const __m512i at = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                                                          3, 2, 1, 0), _mm512_set1_epi32(first)),
                                        _mm512_set1_epi32(width));
  const __m512i field = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits)), at),
                                         _mm512_set1_epi32((1 << width) - 1));
  return _mm512_slli_epi32(field, 4);
}

inline Unit weights(__m512i q, Unit d, Unit m) { return _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), m); }

inline Unit nibbles(const uint8_t* qs, Unit d, Unit m, int u) { return weights(quants4(qs, u), d, m); }

inline Unit broadcast(const uint8_t* p) { return _mm512_set1_ps(read_float(p)); }

// One step of a group (linear_quant_blocks.h): `unit(c, u)` is unit u of row c's block.
struct Q8_0 {
  static constexpr int64_t kBytes = block_bytes(kQ8_0), kQuants = kBytes - header_bytes(kQ8_0);
  Unit d;
  const uint8_t* quants;
  explicit Q8_0(const uint8_t* step) : d(halves4(step)), quants(step + kGroup * header_bytes(kQ8_0)) {}
  Unit unit(int64_t c, int u) const {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants + c * kQuants + 16 * u));
    return _mm512_mul_ps(lane(d, c), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
};

struct Q4_0 {
  static constexpr int64_t kBytes = block_bytes(kQ4_0), kQuants = kBytes - header_bytes(kQ4_0);
  Unit d;
  const uint8_t* quants;
  explicit Q4_0(const uint8_t* step) : d(halves4(step)), quants(step + kGroup * header_bytes(kQ4_0)) {}
  Unit unit(int64_t c, int u) const {
    const Unit scale = lane(d, c);
    return nibbles(quants + c * kQuants, scale, _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f)), u);
  }
};

struct Q4_1 {
  static constexpr int64_t kBytes = block_bytes(kQ4_1), kQuants = kBytes - header_bytes(kQ4_1);
  Unit dm;  // d, m of row 0, then of row 1, ...
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
    const __m512i full = _mm512_or_si512(quants4(q, u), high_bits(read_u32(q + 16), 16 * u, 1));
    return weights(full, broadcast(headers + c * kHeader), broadcast(headers + c * kHeader + 4));
  }
};

struct Q6X {
  static constexpr int64_t kBytes = block_bytes(kQ6X), kHeader = header_bytes(kQ6X), kQuants = kBytes - kHeader;
  const uint8_t *headers, *quants;
  explicit Q6X(const uint8_t* step) : headers(step), quants(step + kGroup * kHeader) {}
  Unit unit(int64_t c, int u) const {
    const uint8_t* q = quants + c * kQuants;
    const __m512i full = _mm512_or_si512(quants4(q, u), high_bits(read_u32(q + 16 + 4 * u), 0, 2));
    const Unit d = broadcast(headers + c * kHeader + 4 * u);
    return weights(full, d, _mm512_mul_ps(d, _mm512_set1_ps(-32.0f)));
  }
};

#include "linear_quant_tile.h"

}  // namespace specdec::quant::avx512

#pragma GCC pop_options
