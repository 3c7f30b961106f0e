// y = x W^T (+ b) with fp32 activations and fp16 weights on the CPU: the "cpp-fp16"
// linear backend (kernels/linear_cpu.py).
//
// The weight is packed once into tiles of kLanes output columns (16 with AVX-512, else
// 8), k-major inside a tile ([ceil(N / kLanes), K, kLanes] fp16, zero-padded), so a tile
// streams through memory in one pass and each k step widens one row of it to a register. A block of R rows
// and C tiles keeps R * C accumulators in registers and broadcasts x[r][k] into them.
// Every output element is one chain of fused multiply-adds in k order, started from
// zero, with the bias added last: a row's result never depends on the other rows, on
// the blocking or on the thread count (batch invariant), which lossless speculation
// needs of a verify over 1 + k rows.
#include <cstdint>
#include <cstring>

#include "lanes.h"

namespace {

using specdec::Half;
using specdec::kLanes;
using specdec::Lanes;
using specdec::load;

// Blocks of up to kMaxRows rows with one or two tiles, or of up to kFewRows rows with
// three or four (more weight streams in flight when there are few rows to share them):
// R * C accumulators leave room for the C weight rows and a broadcast.
#if defined(__AVX512F__)
constexpr int64_t kMaxRows = 12, kFewRows = 4;  // <= 24 of the 32 vector registers
#else
constexpr int64_t kMaxRows = 6, kFewRows = 3;  // <= 12 of the 16 vector registers
#endif
constexpr int64_t kAheadK = 128;  // weight rows requested this many k steps ahead

// Columns [0, cols) of one output row's tile (cols < kLanes only in the last tile).
inline void store_tile(float* out, Lanes v, const float* bias, int64_t cols) {
  if (cols == kLanes) return specdec::store(out, bias ? v + load(bias) : v);
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof v);
  for (int64_t l = 0; l < cols; ++l) out[l] = bias ? lanes[l] + bias[l] : lanes[l];
}

// out[r][c * 16 + l] = sum_k x[r][k] * w[c][k][l] (+ bias) for R rows and C tiles.
template <int R, int C>
void block(const float* x, int64_t K, const Half* w, float* out, int64_t N, const float* bias, int64_t cols) {
  Lanes acc[R][C] = {};
  for (int64_t k = 0; k < K; ++k) {
    Lanes weight[C];
    for (int c = 0; c < C; ++c) {
      const Half* row = w + (c * K + k) * kLanes;
      // Past the end of this panel, the same tile of the next one (never faults).
      specdec::prefetch(row + (k + kAheadK < K ? kAheadK : kAheadK + (C - 1) * K) * kLanes, kLanes * sizeof(Half));
      weight[c] = load(row);
    }
    for (int r = 0; r < R; ++r) {
      const float a = x[r * K + k];
      for (int c = 0; c < C; ++c) acc[r][c] += a * weight[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t width = cols - c * kLanes < kLanes ? cols - c * kLanes : kLanes;
      store_tile(out + r * N + c * kLanes, acc[r][c], bias ? bias + c * kLanes : nullptr, width);
    }
}

using BlockFn = void (*)(const float*, int64_t, const Half*, float*, int64_t, const float*, int64_t);

template <int C, int R = 1>
BlockFn block_fn(int64_t rows) {
  if constexpr (R < (C > 2 ? kFewRows : kMaxRows)) {
    if (rows > R) return block_fn<C, R + 1>(rows);
  }
  return block<R, C>;
}

BlockFn pick(int64_t tiles, int64_t rows) {
  switch (tiles) {
    case 4: return block_fn<4>(rows);
    case 3: return block_fn<3>(rows);
    case 2: return block_fn<2>(rows);
    default: return block_fn<1>(rows);
  }
}

// Tiles per block: four for up to kFewRows rows, else two; fewer when that leaves under
// eight blocks per thread to balance.
int64_t tiles_per_block(int64_t M, int64_t tiles, int64_t row_blocks, int32_t threads) {
  int64_t C = M <= kFewRows ? 4 : 2;
  while (C > 1 && (tiles + C - 1) / C * row_blocks < 8 * threads) C /= 2;
  return C;
}

}  // namespace

extern "C" {

// Output columns per packed weight tile.
int64_t specdec_linear_tile() { return kLanes; }

// x: [M, K] float32 contiguous; w: [ceil(N / kLanes), K, kLanes] fp16 (packed); bias: [N] float32
// or null; out: [M, N] float32 contiguous.
void specdec_linear_fp16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias,
                         float* out, int32_t num_threads) {
  const Half* weight = reinterpret_cast<const Half*>(w);
  const int64_t tiles = (N + kLanes - 1) / kLanes;
  const int64_t row_blocks = (M + kMaxRows - 1) / kMaxRows, rows_per = (M + row_blocks - 1) / row_blocks;
  const int64_t C = tiles_per_block(M, tiles, row_blocks, num_threads), col_blocks = (tiles + C - 1) / C;
  // Column blocks outermost: a thread's consecutive blocks reuse one weight panel.
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
  for (int64_t cb = 0; cb < col_blocks; ++cb)
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t t0 = cb * C, c = tiles - t0 < C ? tiles - t0 : C;
      const int64_t m0 = rb * rows_per, r = M - m0 < rows_per ? M - m0 : rows_per;
      pick(c, r)(x + m0 * K, K, weight + t0 * K * kLanes, out + m0 * N + t0 * kLanes, N,
                 bias ? bias + t0 * kLanes : nullptr, N - t0 * kLanes);
    }
}

}  // extern "C"
