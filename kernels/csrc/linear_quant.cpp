// y = x W^T (+ b) with W in GGUF blocks (Q8_0, Q4_0, Q4_1, and Q4_K, Q5_K, Q6_K repacked;
// see linear_quant_blocks.h): the quantized linear backends of kernels/linear_gguf.py.
//
// The exact kernel (specdec_linear_quant) takes float32 activations. Each weight is
// decoded in registers to exactly the value gguf dequantizes it to, and multiplied in
// float32 with fused multiply-adds in a fixed order (linear_quant_tile.h), so the result
// is the float32 product with the dequantized matrix up to summation order.
//
// The int8 kernel (specdec_linear_quant_int8, opt-in and lossy) first quantizes each
// activation row to int8 per 32-value block (linear_quant_int8_activations.h) and sums
// byte products in integer SIMD, block by block, before one float32 step per block
// (linear_quant_int8_tile.h): extra rows cost a fraction of what they do in float32.
//
// Both are batch invariant (a row's result does not depend on the other rows or the
// thread count), and their AVX2 and AVX-512 variants agree bit for bit. Every variant is
// compiled into every build (GCC target regions) and one is picked per call.
#include <cstdint>

#include "linear_quant_avx2.h"
#include "linear_quant_avx512.h"
#include "linear_quant_blocks.h"
#include "linear_quant_int8_activations.h"
#include "linear_quant_int8_avx2.h"
#include "linear_quant_int8_avx512.h"

namespace {

using specdec::quant::kNumFormats;

// kAvx512Bw: AVX-512 without VNNI (the int8 kernel's fallback, to be asked for in tests);
// the exact kernel runs its AVX-512 variant for it.
enum Isa : int32_t { kAuto = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bw = 3 };

using RunFn = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t,
                       int32_t);

namespace avx2 = specdec::quant::avx2;
namespace avx512 = specdec::quant::avx512;

// Indexed by specdec::quant::Format.
constexpr RunFn kAvx2Runs[kNumFormats] = {avx2::run<avx2::Q8_0>, avx2::run<avx2::Q4_0>, avx2::run<avx2::Q4_1>,
                                          avx2::run<avx2::Q4X>,  avx2::run<avx2::Q5X>,  avx2::run<avx2::Q6X>};
constexpr RunFn kAvx512Runs[kNumFormats] = {avx512::run<avx512::Q8_0>, avx512::run<avx512::Q4_0>,
                                            avx512::run<avx512::Q4_1>, avx512::run<avx512::Q4X>,
                                            avx512::run<avx512::Q5X>,  avx512::run<avx512::Q6X>};

namespace int8 = specdec::quant::int8;

using Int8RunFn = void (*)(const int8::Activations&, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t,
                           int32_t);

namespace i8avx2 = int8::avx2;
namespace i8bw = int8::avx512bw;
namespace i8vnni = int8::avx512vnni;

// Indexed by specdec::quant::Format.
constexpr Int8RunFn kInt8Avx2Runs[kNumFormats] = {
    i8avx2::run<i8avx2::Q8_0>, i8avx2::run<i8avx2::Q4_0>, i8avx2::run<i8avx2::Q4_1>,
    i8avx2::run<i8avx2::Q4X>,  i8avx2::run<i8avx2::Q5X>,  i8avx2::run<i8avx2::Q6X>};
constexpr Int8RunFn kInt8Avx512BwRuns[kNumFormats] = {i8bw::run<i8bw::Q8_0>, i8bw::run<i8bw::Q4_0>,
                                                      i8bw::run<i8bw::Q4_1>, i8bw::run<i8bw::Q4X>,
                                                      i8bw::run<i8bw::Q5X>,  i8bw::run<i8bw::Q6X>};
constexpr Int8RunFn kInt8Avx512VnniRuns[kNumFormats] = {i8vnni::run<i8vnni::Q8_0>, i8vnni::run<i8vnni::Q4_0>,
                                                        i8vnni::run<i8vnni::Q4_1>, i8vnni::run<i8vnni::Q4X>,
                                                        i8vnni::run<i8vnni::Q5X>,  i8vnni::run<i8vnni::Q6X>};

bool cpu_has(int32_t isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == kAvx2) return avx2;
  return (isa == kAvx512 || isa == kAvx512Bw) && avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return cpu_has(kAvx512) && __builtin_cpu_supports("avx512vnni");
}

}  // namespace

extern "C" {

// The variant a call with isa 0 (auto) runs: AVX-512 (2) where both the CPU and the build
// flags have it (so SPECDEC_CXXFLAGS=-mno-avx512f picks AVX2 on an AVX-512 machine), else
// AVX2 (1) where the CPU has it, else 0: none runs here.
int32_t specdec_quant_auto_isa() {
#if defined(__AVX512F__)
  if (cpu_has(kAvx512)) return kAvx512;
#endif
  return cpu_has(kAvx2) ? kAvx2 : 0;
}

// Whether this CPU runs variant `isa` (1: AVX2, 2: AVX-512, 3: AVX-512 without VNNI).
int32_t specdec_quant_cpu_has(int32_t isa) { return cpu_has(isa) ? 1 : 0; }

// Bytes of one block of `format` (0 for an unknown format).
int64_t specdec_quant_block_bytes(int32_t format) { return specdec::quant::block_bytes(format); }

// x: [M, K] float32 contiguous, K a multiple of 32; w: N rows of K / 32 blocks of
// `format` in groups (linear_quant_blocks.h); bias: [N] float32 or null; out: [M, ldo]
// float32, columns [0, N) written. Returns 0, or -1 for an unknown format or an ISA this
// CPU does not run.
int32_t specdec_linear_quant(int32_t format, int32_t isa, const float* x, int64_t M, int64_t K, const uint8_t* w,
                             int64_t N, const float* bias, float* out, int64_t ldo, int32_t num_threads) {
  if (isa == kAuto) isa = specdec_quant_auto_isa();
  if (format < 0 || format >= kNumFormats || !cpu_has(isa) || K % specdec::quant::kBlock != 0) return -1;
  const RunFn run = isa == kAvx2 ? kAvx2Runs[format] : kAvx512Runs[format];
  run(x, M, K, w, N, bias, out, ldo, num_threads);
  return 0;
}

// Whether the int8 kernel's AVX-512 variant (isa 2) sums with VNNI here (else AVX-512BW).
int32_t specdec_quant_int8_vnni() { return cpu_has_vnni() ? 1 : 0; }

// As specdec_linear_quant, with x quantized to int8 per 32-value block first (lossy).
int32_t specdec_linear_quant_int8(int32_t format, int32_t isa, const float* x, int64_t M, int64_t K,
                                  const uint8_t* w, int64_t N, const float* bias, float* out, int64_t ldo,
                                  int32_t num_threads) {
  if (isa == kAuto) isa = specdec_quant_auto_isa();
  if (format < 0 || format >= kNumFormats || !cpu_has(isa) || K % specdec::quant::kBlock != 0) return -1;
  thread_local int8::Activations activations;  // kept between calls: no allocation per call
  int8::quantize_rows(x, M, K, activations);
  const Int8RunFn* runs = isa == kAvx2 ? kInt8Avx2Runs : isa == kAvx512 && cpu_has_vnni() ? kInt8Avx512VnniRuns
                                                                                          : kInt8Avx512BwRuns;
  runs[format](activations, M, w, N, bias, out, ldo, num_threads);
  return 0;
}

// out[i, :] = the K weights of row rows[i] of w (as specdec_linear_quant reads it),
// dequantized exactly: embedding lookups in a quantized table.
int32_t specdec_quant_dequantize_rows(int32_t format, const uint8_t* w, int64_t K, const int64_t* rows,
                                      int64_t count, float* out) {
  if (format < 0 || format >= kNumFormats || K % specdec::quant::kBlock != 0) return -1;
  for (int64_t i = 0; i < count; ++i) specdec::quant::dequantize_row(format, w, K, rows[i], out + i * K);
  return 0;
}

}  // extern "C"
