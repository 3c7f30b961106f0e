// Writes a step's keys and values into the paged cache on the CPU, converted to the
// cache's dtype: one call per layer where the torch backend (kernels/attention_torch.py,
// store_kv_torch) takes a cast and an index_copy_ for each of K and V, ~20 us of Python
// and dispatch per layer at one token. Conversions round to nearest even, as torch's
// casts do, so the cache holds the same bits either way (tests/kernels/test_store_kv_cpu.py).
#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace {

enum CacheDtype : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline uint16_t to_half(float x) {
  // F16C's conversion under round-to-nearest-even, the rounding torch's cast uses.
  return static_cast<uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT), 0));
}

inline uint16_t to_bfloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN, as torch writes it
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// One row of `width` floats into a cache row of `dtype`.
void store_row(const float* src, int64_t width, int32_t dtype, void* dst) {
  if (dtype == kFloat32) return static_cast<void>(std::memcpy(dst, src, width * sizeof(float)));
  uint16_t* out = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  if (dtype == kFloat16)
    for (; i + 8 <= width; i += 8) {
      const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), half);
    }
  for (; i < width; ++i) out[i] = dtype == kFloat16 ? to_half(src[i]) : to_bfloat16(src[i]);
}

int64_t element_size(int32_t dtype) { return dtype == kFloat32 ? 4 : 2; }

}  // namespace

extern "C" {

// key, value: [T, width] float32 rows `key_stride` / `value_stride` floats apart (width =
// Hkv * D contiguous inside a row); k_cache, v_cache: [num_slots, width] in `dtype`;
// slots: [T] int64 flat slot of each row, each below num_slots. Returns the first row whose
// slot is out of range (writing nothing), or -1 when all were stored.
int64_t specdec_store_kv(const float* key, int64_t key_stride, const float* value, int64_t value_stride,
                         void* k_cache, void* v_cache, int32_t dtype, const int64_t* slots, int64_t tokens,
                         int64_t width, int64_t num_slots, int32_t num_threads) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return t;
  const int64_t row_bytes = width * element_size(dtype);
  // Threads only pay off on prefill-sized batches.
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * width >= (1 << 16))
  for (int64_t t = 0; t < tokens; ++t) {
    store_row(key + t * key_stride, width, dtype, static_cast<char*>(k_cache) + slots[t] * row_bytes);
    store_row(value + t * value_stride, width, dtype, static_cast<char*>(v_cache) + slots[t] * row_bytes);
  }
  return -1;
}

}  // extern "C"
