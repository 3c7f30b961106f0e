// The AVX-512 lanes of the int8-activation quantized linear kernel: 16 output columns
// per tile (4 groups), one per zmm lane. linear_quant_int8_avx512.h includes this file in
// each of its two namespaces (with and without VNNI) and target regions, so no include
// guard on purpose.

constexpr int kTileGroups = 4, kLanes = 16;
// 32 zmm registers: 8 decoded pieces, a block's scales, and per row a float accumulator
// and an integer one.
constexpr int kMaxRows = 10;

using Ints = __m512i;
using Floats = __m512;

// Lane 4 c + g holds column c of group g (the transposes below), output column 4 g + c.
constexpr int kColumnOfLane[kLanes] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

inline Floats zero_floats() { return _mm512_setzero_ps(); }
inline Floats broadcast(float v) { return _mm512_set1_ps(v); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats fma(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats to_float(Ints v) { return _mm512_cvtepi32_ps(v); }
inline void store(float* p, Floats v) { _mm512_store_ps(p, v); }

inline Ints add(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
inline Ints subtract(Ints a, int32_t v) { return _mm512_sub_epi32(a, _mm512_set1_epi32(v)); }
inline Ints times16(Ints v) { return _mm512_slli_epi32(v, 4); }
inline Ints merge(Ints a, Ints b) { return _mm512_or_si512(a, b); }
inline Ints and_mask(Ints v, int32_t mask) { return _mm512_and_si512(v, _mm512_set1_epi32(mask)); }
inline Ints shift_left(Ints v, unsigned bits) { return _mm512_slli_epi32(v, bits); }
inline Ints shift_right(Ints v, unsigned bits) { return _mm512_srli_epi32(v, bits); }
inline Ints mul32(Ints v, int32_t factor) { return _mm512_mullo_epi32(v, _mm512_set1_epi32(factor)); }
inline Ints flip_signs(Ints v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline Ints low_nibbles(Ints v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline Ints high_nibbles(Ints v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline int64_t load8(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Bytes kOffset .. kOffset + 15 of the four columns of a group step whose quants begin
// at q (kStride bytes each): column c in 128-bit lane c.
template <int64_t kStride, int64_t kOffset>
inline Ints columns(const uint8_t* q) {
  if constexpr (kStride == 16 && kOffset == 0) {
    return _mm512_loadu_si512(q);
  } else {
    const __m512i low = _mm512_castsi128_si512(load16(q + kOffset));
    const __m512i two = _mm512_inserti32x4(low, load16(q + kStride + kOffset), 1);
    const __m512i three = _mm512_inserti32x4(two, load16(q + 2 * kStride + kOffset), 2);
    return _mm512_inserti32x4(three, load16(q + 3 * kStride + kOffset), 3);
  }
}

// pieces[s], lane 4 c + g: bytes kOffset + 4 s .. + 3 of column c of group g, whose step's
// quants begin `quants` bytes into steps[g].
template <int64_t kStride, int64_t kOffset>
inline void pieces_of(const uint8_t* const* steps, int64_t quants, Ints* pieces) {
  Ints g[4];
  for (int i = 0; i < 4; ++i) g[i] = columns<kStride, kOffset>(steps[i] + quants);
  // Per 128-bit lane c: (g0, g1, g0, g1) of pieces 0 and 1, then of 2 and 3; then by 64 bits.
  const Ints u0 = _mm512_unpacklo_epi32(g[0], g[1]), u1 = _mm512_unpacklo_epi32(g[2], g[3]);
  const Ints u2 = _mm512_unpackhi_epi32(g[0], g[1]), u3 = _mm512_unpackhi_epi32(g[2], g[3]);
  pieces[0] = _mm512_unpacklo_epi64(u0, u1);
  pieces[1] = _mm512_unpackhi_epi64(u0, u1);
  pieces[2] = _mm512_unpacklo_epi64(u2, u3);
  pieces[3] = _mm512_unpackhi_epi64(u2, u3);
}

// The fp16 scale of each column (4 per step, first in the step), in lane order.
inline Floats singles(const uint8_t* const* steps) {
  const __m256i halves = _mm256_setr_epi64x(load8(steps[0]), load8(steps[1]), load8(steps[2]), load8(steps[3]));
  return _mm512_permutexvar_ps(_mm512_loadu_si512(kColumnOfLane), _mm512_cvtph_ps(halves));
}

// The (first, second) pair of each column from 16 floats per two groups: column c of
// group g at 8 g + 2 c of (low, high) (the high's g counting on from 2).
inline void split_pairs(Floats low, Floats high, Floats& first, Floats& second) {
  const __m512i at = _mm512_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26, 4, 12, 20, 28, 6, 14, 22, 30);
  first = _mm512_permutex2var_ps(low, at, high);
  second = _mm512_permutex2var_ps(low, _mm512_add_epi32(at, _mm512_set1_epi32(1)), high);
}

// Each column's fp16 (d, m) (4 pairs per step, first in the step), in lane order.
inline void half_pairs(const uint8_t* const* steps, Floats& first, Floats& second) {
  const __m256i low = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(steps[0])), load16(steps[1]), 1);
  const __m256i high = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(steps[2])), load16(steps[3]), 1);
  split_pairs(_mm512_cvtph_ps(low), _mm512_cvtph_ps(high), first, second);
}

// Each column's fp32 pair (4 pairs per step, first in the step), in lane order.
inline void float_pairs(const uint8_t* const* steps, Floats& first, Floats& second) {
  const auto pair = [](const uint8_t* a, const uint8_t* b) {
    const __m256 low = _mm256_loadu_ps(reinterpret_cast<const float*>(a));
    return _mm512_insertf32x8(_mm512_castps256_ps512(low), _mm256_loadu_ps(reinterpret_cast<const float*>(b)), 1);
  };
  split_pairs(pair(steps[0], steps[1]), pair(steps[2], steps[3]), first, second);
}

// Byte products in int16 (AVX-512BW): vpmaddubsw adds two u8 x s8 products per int16
// without overflow for u <= 255 and |q| <= 127, and `depth` of them (each piece's pairs)
// can be summed in int16 while 2 * depth * max u * 127 <= 32767; then vpmaddwd widens.
struct Maddubs {
  static constexpr bool kByteQuants = false;  // no u above 15 with depth 8: Q8_0 in two nibble planes
  static constexpr int depth(int max_u) { return max_u <= 15 ? 8 : max_u <= 31 ? 4 : 2; }

  // Piece by piece, each piece (in a register) used by every row in turn.
  template <int R, int kDepth>
  static void dot(const Ints* w, int k0, int k1, const int8_t* const* x, Ints* out) {
    const Ints ones = _mm512_set1_epi16(1);
    Ints sums[R];
    for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_si512();
    for (int k = k0; k < k1; ++k) {
      for (int r = 0; r < R; ++r) {
        int32_t q;
        std::memcpy(&q, x[r] + 4 * k, sizeof q);
        const Ints products = _mm512_maddubs_epi16(w[k], _mm512_set1_epi32(q));
        sums[r] = (k - k0) % kDepth == 0 ? products : _mm512_add_epi16(sums[r], products);
      }
      if ((k - k0) % kDepth == kDepth - 1)
        for (int r = 0; r < R; ++r) out[r] = _mm512_add_epi32(out[r], _mm512_madd_epi16(sums[r], ones));
    }
  }
};
