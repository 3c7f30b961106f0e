// The activations of the int8 quantized linear kernel (linear_quant_int8_tile.h): each
// row cut into blocks of kBlock = 32 values, each block quantized to int8 with one float32
// scale, as ggml quantizes activations for its Q8_0 / Q8_1 dot products:
//   d = max_j |x[j]| / 127,  q[j] = x[j] * (1 / d) rounded to nearest, ties to even
// (d = 0 and q = 0 for a block of zeros), so |q| <= 127. Every step is one IEEE float32
// operation, so kernels/reference.py's quantize_activations_int8 gets the same bytes.
// Compiled for AVX2 only: the AVX-512 variant runs it too (it is a small part of a call).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "linear_quant_blocks.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace specdec::quant::int8 {

// M rows of K activations quantized block by block, with what the kernel needs of each
// block besides its quants.
struct Activations {
  int64_t K = 0, blocks = 0;
  std::vector<int8_t> quants;      // [M, K]
  std::vector<float> scales;       // [M, blocks]: d
  std::vector<float> scaled_sums;  // [M, blocks]: d * (sum of the block's quants), for a weight block's min
  std::vector<int32_t> sums;       // [M, blocks, 2]: sums of the quants 0-15 and 16-31, for an offset

  const int8_t* row(int64_t r) const { return quants.data() + r * K; }
};

inline int32_t sum8(__m256i v) {
  const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
  return _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
}

inline float max8(__m256 v) {
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// Block `b` of row `r` of x (32 floats at x) into `a`.
inline void quantize_block(const float* x, Activations& a, int64_t r, int64_t b) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  const float d = max8(amax) / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
  const int32_t low = sum8(_mm256_add_epi32(q[0], q[1])), high = sum8(_mm256_add_epi32(q[2], q[3]));
  // The packs interleave 128-bit lanes (q0 q1 q2 q3 of lane 0, then of lane 1): put them back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.quants.data() + r * a.K + b * kBlock), ordered);
  const int64_t i = r * a.blocks + b;
  a.scales[i] = d;
  a.scaled_sums[i] = d * static_cast<float>(low + high);
  a.sums[2 * i] = low;
  a.sums[2 * i + 1] = high;
}

// x: [M, K] float32 (row stride K, K a multiple of kBlock) quantized into `a`.
inline void quantize_rows(const float* x, int64_t M, int64_t K, Activations& a) {
  a.K = K;
  a.blocks = K / kBlock;
  a.quants.resize(M * K);
  a.scales.resize(M * a.blocks);
  a.scaled_sums.resize(M * a.blocks);
  a.sums.resize(2 * M * a.blocks);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < a.blocks; ++b) quantize_block(x + r * K + b * kBlock, a, r, b);
}

}  // namespace specdec::quant::int8

#pragma GCC pop_options
