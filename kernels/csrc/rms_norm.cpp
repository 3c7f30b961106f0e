// RMSNorm of float32 rows on the CPU: out = x * (1 / sqrt(mean(x^2) + eps)) * weight,
// the order Hugging Face's LlamaRMSNorm uses. One call replaces the eight small ops
// torch's CPU rms_norm dispatches, which cost more than the arithmetic on a decode step.
// Each row's sum of squares keeps kLanes partial sums combined in a fixed order, so a
// row's result never depends on the other rows (batch invariant).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "lanes.h"

namespace {

using specdec::kLanes;
using specdec::Lanes;
using specdec::load;

// Lanes of x[0:n] (zeros past n).
inline Lanes load_part(const float* x, int64_t n) {
  float part[kLanes] = {};
  std::memcpy(part, x, n * sizeof(float));
  return load(part);
}

float inverse_rms(const float* x, int64_t dim, float eps) {
  Lanes squares = {};
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes) squares += load(x + i) * load(x + i);
  if (i < dim) squares += load_part(x + i, dim - i) * load_part(x + i, dim - i);
  float total = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) total += squares[l];
  return 1.0f / std::sqrt(total / static_cast<float>(dim) + eps);
}

void normalize_row(const float* x, const float* weight, int64_t dim, float eps, float* out) {
  const float inverse = inverse_rms(x, dim, eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * inverse * weight[i];
}

}  // namespace

extern "C" {

// x, out: [rows, dim] float32 contiguous (out may be x); weight: [dim] float32.
void specdec_rms_norm(const float* x, const float* weight, float eps, float* out, int64_t rows, int64_t dim,
                      int32_t num_threads) {
  // Threads only pay off on prefill-sized batches.
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) normalize_row(x + r * dim, weight, dim, eps, out + r * dim);
}

}  // extern "C"
