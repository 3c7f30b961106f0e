// Scalar helpers of the quantized linear kernel that every ISA variant compiles for
// itself: linear_quant_avx2.h and linear_quant_avx512.h include this file at the start of
// their own namespace and target region (no include guard on purpose).

// The sum of 8 lanes: (l, l + 4), then (l, l + 2), then the last two.
inline float reduce8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// The fp16 number stored (little-endian) at p.
inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

// How far ahead of its reads a tile requests its weights from memory.
constexpr int64_t kAheadBytes = 4096;
