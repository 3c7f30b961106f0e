// A machine register of float32 lanes as a GCC vector (16 lanes with AVX-512, else 8),
// and loads that widen fp16 and bf16 elements into them exactly: shared by the C++ CPU
// kernels. The width must be the register's: GCC has no register mode for a 64-byte
// vector without AVX-512, so it keeps one in memory and every operation goes through the
// stack (30x slower). cpu_build.py keys its cache on this header too.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace specdec {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }

// fp16 and bf16 elements as stored (bit patterns): read at their own width and widened
// in registers.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline Lanes load(const Half* p) {
#if defined(__AVX512F__)
  __m256i h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<Lanes>(_mm512_cvtph_ps(h));
#elif defined(__F16C__)
  __m128i h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<Lanes>(_mm256_cvtph_ps(h));
#else
  Lanes v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(reinterpret_cast<const _Float16*>(p)[l]);
  return v;
#endif
}

typedef uint16_t ShortLanes __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t WordLanes __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline Lanes load(const BFloat16* p) {
  ShortLanes bits;
  std::memcpy(&bits, p, sizeof bits);
  return reinterpret_cast<Lanes>(__builtin_convertvector(bits, WordLanes) << 16);
}

// exp(x) for x <= 0, Cephes' polynomial: about 1 ulp (x below -87 is taken as -87).
inline Lanes exp_nonpositive(Lanes x) {
  const Lanes low = Lanes{} - 87.0f;
  x = x < low ? low : x;
  const Lanes t = x * 1.44269504088896341f + 0.5f;
  IntLanes n = __builtin_convertvector(t, IntLanes);  // truncates toward zero
  n += (__builtin_convertvector(n, Lanes) > t);       // to floor: true lanes are -1
  const Lanes nf = __builtin_convertvector(n, Lanes);
  const Lanes r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  Lanes p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<Lanes>((n + 127) << 23);
}

// Asks for the cache lines of `bytes` bytes from p ahead of use (never faults).
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(static_cast<const char*>(p) + offset);
}

}  // namespace specdec
