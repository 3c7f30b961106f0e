// The AVX-512 variants of the int8-activation quantized linear kernel
// (linear_quant_int8_tile.h on linear_quant_int8_avx512_lanes.h): `avx512vnni` sums byte
// products with vpdpbusd (AVX512-VNNI), `avx512bw` with vpmaddubsw and vpmaddwd where the
// CPU has no VNNI. Each is its own target region, so nothing VNNI leaks into the other.
// Compiled whatever the build flags; run only where the CPU has them.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

#include "linear_quant_blocks.h"
#include "linear_quant_int8_activations.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")

namespace specdec::quant::int8::avx512bw {

#include "linear_quant_int8_avx512_lanes.h"

using Dot = Maddubs;

#include "linear_quant_int8_tile.h"

}  // namespace specdec::quant::int8::avx512bw

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")

namespace specdec::quant::int8::avx512vnni {

#include "linear_quant_int8_avx512_lanes.h"

// Byte products summed straight into int32 (no int16 step, any u8 quant).
struct Vnni {
  static constexpr bool kByteQuants = true;
  static constexpr int depth(int) { return 8; }

  template <int R, int kDepth>
  static void dot(const Ints* w, int k0, int k1, const int8_t* const* x, Ints* out) {
    for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_si512();
    for (int k = k0; k < k1; ++k)
      for (int r = 0; r < R; ++r) {
        int32_t q;
        std::memcpy(&q, x[r] + 4 * k, sizeof q);
        out[r] = _mm512_dpbusd_epi32(out[r], w[k], _mm512_set1_epi32(q));
      }
  }
};

using Dot = Vnni;

#include "linear_quant_int8_tile.h"

}  // namespace specdec::quant::int8::avx512vnni

#pragma GCC pop_options
