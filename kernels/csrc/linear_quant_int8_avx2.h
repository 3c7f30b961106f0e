// The AVX2 variant of the int8-activation quantized linear kernel
// (linear_quant_int8_tile.h): 8 output columns per tile (2 groups), one per ymm lane;
// byte products summed with vpmaddubsw and vpmaddwd (Zen3 and the like have no VNNI).
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

#include "linear_quant_blocks.h"
#include "linear_quant_int8_activations.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace specdec::quant::int8::avx2 {

constexpr int kTileGroups = 2, kLanes = 8;
// 16 ymm registers: the decoded pieces stay in L1 (each is read once per row), a
// block's scales, and per row a float accumulator and an integer one. Six rows take a
// 1 + 5 verify in one pass over the weights (the default model's LM head at 6 rows:
// 11 -> 7 ms against 4 + 2).
constexpr int kMaxRows = 6;

using Ints = __m256i;
using Floats = __m256;

// Lanes (a0, b0, a2, b2, a1, b1, a3, b3) for columns 0-3 of group a and 0-3 of group b
// (the transposes below): output columns 0-3 and 4-7.
constexpr int kColumnOfLane[kLanes] = {0, 4, 2, 6, 1, 5, 3, 7};

inline Floats zero_floats() { return _mm256_setzero_ps(); }
inline Floats broadcast(float v) { return _mm256_set1_ps(v); }
inline Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline Floats fma(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats to_float(Ints v) { return _mm256_cvtepi32_ps(v); }
inline void store(float* p, Floats v) { _mm256_store_ps(p, v); }

inline Ints add(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline Ints subtract(Ints a, int32_t v) { return _mm256_sub_epi32(a, _mm256_set1_epi32(v)); }
inline Ints times16(Ints v) { return _mm256_slli_epi32(v, 4); }
inline Ints merge(Ints a, Ints b) { return _mm256_or_si256(a, b); }
inline Ints and_mask(Ints v, int32_t mask) { return _mm256_and_si256(v, _mm256_set1_epi32(mask)); }
inline Ints shift_left(Ints v, int bits) { return _mm256_slli_epi32(v, bits); }
inline Ints shift_right(Ints v, int bits) { return _mm256_srli_epi32(v, bits); }
inline Ints mul32(Ints v, int32_t factor) { return _mm256_mullo_epi32(v, _mm256_set1_epi32(factor)); }
inline Ints flip_signs(Ints v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline Ints low_nibbles(Ints v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline Ints high_nibbles(Ints v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline int64_t load8(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Bytes kOffset .. kOffset + 15 of two consecutive columns whose quants begin at q
// (kStride bytes each), one per 128-bit lane.
template <int64_t kStride, int64_t kOffset>
inline Ints two_columns(const uint8_t* q) {
  if constexpr (kStride == 16 && kOffset == 0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  } else {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(load16(q + kOffset)), load16(q + kStride + kOffset), 1);
  }
}

// pieces[s] in lane order: bytes kOffset + 4 s .. + 3 of each column of groups a and b,
// whose steps' quants begin `quants` bytes into steps[0] and steps[1].
template <int64_t kStride, int64_t kOffset>
inline void pieces_of(const uint8_t* const* steps, int64_t quants, Ints* pieces) {
  const uint8_t *a = steps[0] + quants, *b = steps[1] + quants;
  const Ints a01 = two_columns<kStride, kOffset>(a), a23 = two_columns<kStride, kOffset>(a + 2 * kStride);
  const Ints b01 = two_columns<kStride, kOffset>(b), b23 = two_columns<kStride, kOffset>(b + 2 * kStride);
  // Per 128-bit lane: (a, b, a, b) of pieces 0 and 1, then of 2 and 3; then by 64 bits.
  const Ints u0 = _mm256_unpacklo_epi32(a01, b01), u1 = _mm256_unpacklo_epi32(a23, b23);
  const Ints u2 = _mm256_unpackhi_epi32(a01, b01), u3 = _mm256_unpackhi_epi32(a23, b23);
  pieces[0] = _mm256_unpacklo_epi64(u0, u1);
  pieces[1] = _mm256_unpackhi_epi64(u0, u1);
  pieces[2] = _mm256_unpacklo_epi64(u2, u3);
  pieces[3] = _mm256_unpackhi_epi64(u2, u3);
}

// The fp16 scale of each column (4 per step, first in the step), in lane order.
inline Floats singles(const uint8_t* const* steps) {
  const __m256 natural = _mm256_cvtph_ps(_mm_set_epi64x(load8(steps[1]), load8(steps[0])));
  return _mm256_permutevar8x32_ps(natural, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kColumnOfLane)));
}

// The (first, second) pair of each column from group a's 8 floats and group b's (column
// c's pair at 2 c), in lane order.
inline void split_pairs(Floats a, Floats b, Floats& first, Floats& second) {
  const __m256i at = _mm256_setr_epi32(0, 0, 4, 4, 2, 2, 6, 6), next = _mm256_add_epi32(at, _mm256_set1_epi32(1));
  first = _mm256_blend_ps(_mm256_permutevar8x32_ps(a, at), _mm256_permutevar8x32_ps(b, at), 0xAA);
  second = _mm256_blend_ps(_mm256_permutevar8x32_ps(a, next), _mm256_permutevar8x32_ps(b, next), 0xAA);
}

// Each column's fp16 (d, m) (4 pairs per step, first in the step), in lane order.
inline void half_pairs(const uint8_t* const* steps, Floats& first, Floats& second) {
  split_pairs(_mm256_cvtph_ps(load16(steps[0])), _mm256_cvtph_ps(load16(steps[1])), first, second);
}

// Each column's fp32 pair (4 pairs per step, first in the step), in lane order.
inline void float_pairs(const uint8_t* const* steps, Floats& first, Floats& second) {
  split_pairs(_mm256_loadu_ps(reinterpret_cast<const float*>(steps[0])),
              _mm256_loadu_ps(reinterpret_cast<const float*>(steps[1])), first, second);
}

// vpmaddubsw adds two u8 x s8 products per int16 without overflow for u <= 255 and
// |q| <= 127, and `depth` of them (each piece's pairs) can be summed in int16 while
// 2 * depth * max u * 127 <= 32767; then vpmaddwd widens to int32.
struct Maddubs {
  static constexpr bool kByteQuants = false;  // no u above 15 with depth 8: Q8_0 in two nibble planes
  static constexpr int depth(int max_u) { return max_u <= 15 ? 8 : max_u <= 31 ? 4 : 2; }

  // Piece by piece, each piece (in a register) used by every row in turn.
  template <int R, int kDepth>
  static void dot(const Ints* w, int k0, int k1, const int8_t* const* x, Ints* out) {
    const Ints ones = _mm256_set1_epi16(1);
    Ints sums[R];
    for (int r = 0; r < R; ++r) out[r] = _mm256_setzero_si256();
    for (int k = k0; k < k1; ++k) {
      for (int r = 0; r < R; ++r) {
        int32_t q;
        std::memcpy(&q, x[r] + 4 * k, sizeof q);
        const Ints products = _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(q));
        sums[r] = (k - k0) % kDepth == 0 ? products : _mm256_add_epi16(sums[r], products);
        // Keeps GCC from reassociating the sums into all products first, which spills
        // most of them with 16 registers.
        __asm__("" : "+x"(sums[r]));
      }
      if ((k - k0) % kDepth == kDepth - 1)
        for (int r = 0; r < R; ++r) out[r] = _mm256_add_epi32(out[r], _mm256_madd_epi16(sums[r], ones));
    }
  }
};

using Dot = Maddubs;

#include "linear_quant_int8_tile.h"

}  // namespace specdec::quant::int8::avx2

#pragma GCC pop_options
