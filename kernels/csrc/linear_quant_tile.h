// The loops of the quantized linear kernel, written once over an ISA's 16-float `Unit`
// and its block decoders: linear_quant_avx2.h and linear_quant_avx512.h each include
// this file at the end of their own namespace and target region, so it is compiled once
// per ISA (no include guard on purpose).
//
// Accumulation order, the same for every ISA, row count, blocking and thread count (so
// results are batch invariant, and AVX2 and AVX-512 agree bit for bit): output (r, n)
// keeps 16 float32 lanes; lane l takes the fused multiply-adds x[r][k] * w[n][k] for the
// k with k % 16 == l, in increasing k, from zero; then the 16 lanes are summed as
// (l, l + 8), those as (l, l + 4), (l, l + 2) and the last two, and the bias added.

using TileFn = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, const float*,
                       int64_t);

// out[r * ldo + c] = sum_k x[r * ldx + k] * w_{first + c}[k] (+ bias[c]) for R rows and C
// output columns: rows first .. first + C - 1 of the group of W at w
// (linear_quant_blocks.h); only columns c < cols are stored. Each block is decoded once,
// a unit (16 weights) at a time, and used by every row of the tile.
template <class Block, int R, int C>
void one_pass_tile(const float* x, int64_t ldx, int64_t blocks, const uint8_t* w, int64_t first, float* out,
                   int64_t ldo, const float* bias, int64_t cols) {
  constexpr int64_t kStep = kGroup * Block::kBytes;  // bytes from one block of a row to its next
  Unit acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* step = w + b * kStep;
    // Past the group's end: the next group, which this thread reads next (never faults).
    for (int64_t offset = 0; offset < kStep; offset += 64) __builtin_prefetch(step + kAheadBytes + offset);
    const Block block(step);
    if constexpr (R == 1 || kOneUnitLive) {
      // Each unit is used by every row as soon as it is decoded, so only one is live; the
      // compiler then keeps all R * C accumulators in registers (decoding a unit of every
      // column first spilled them on AVX2).
      for (int c = 0; c < C; ++c)
        for (int u = 0; u < 2; ++u) {
          const Unit w = block.unit(first + c, u);
          for (int r = 0; r < R; ++r) acc[r][c] = fma(load(x + r * ldx + b * kBlock + 16 * u), w, acc[r][c]);
        }
    } else {
      for (int u = 0; u < 2; ++u) {
        Unit weights[C];
        for (int c = 0; c < C; ++c) weights[c] = block.unit(first + c, u);
        for (int r = 0; r < R; ++r) {
          const Unit xs = load(x + r * ldx + b * kBlock + 16 * u);
          for (int c = 0; c < C; ++c) acc[r][c] = fma(xs, weights[c], acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C && c < cols; ++c) {
      const float sum = reduce(acc[r][c]);
      out[r * ldo + c] = bias ? sum + bias[c] : sum;
    }
}

// The tile function for R rows: one_pass_tile, or on an ISA whose unit spans two registers
// half_tile for R >= kHalfPassRows (half a unit at a time); only the one picked is compiled.
template <class Block, int C, int R = 1>
TileFn pick(int64_t rows) {
  if constexpr (R < max_rows(C)) {
    if (rows > R) return pick<Block, C, R + 1>(rows);
  }
  if constexpr (R >= kHalfPassRows) {
    return half_tile<Block, R, C>;
  } else {
    return one_pass_tile<Block, R, C>;
  }
}

// out[M, N] (row stride ldo) = x[M, K] @ W^T (+ bias) with tiles of C columns. Each
// thread takes a run of tiles, a group's tiles together; it runs the rows in as few row
// groups as the registers allow (all rows of a row group sharing each decoded block),
// one row group at a time over all its tiles, so that group's activations stay in L1
// while the weights stream past.
template <class Block, int C>
void run_tiles(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* out,
               int64_t ldo, int32_t num_threads) {
  constexpr int64_t kPerGroup = kGroup / C;
  const int64_t blocks = K / kBlock, group_bytes = blocks * kGroup * Block::kBytes;
  const int64_t row_groups = (M + max_rows(C) - 1) / max_rows(C), R = (M + row_groups - 1) / row_groups;
  const int64_t tiles = (N + kGroup - 1) / kGroup * kPerGroup;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t begin = tiles * id / threads, end = tiles * (id + 1) / threads;
    for (int64_t m0 = 0; m0 < M; m0 += R) {
      const int64_t rows = M - m0 < R ? M - m0 : R;
      const TileFn run_tile = pick<Block, C>(rows);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t g = t / kPerGroup, first = (t % kPerGroup) * C, n0 = g * kGroup + first;
        if (n0 < N)
          run_tile(x + m0 * K, K, blocks, w + g * group_bytes, first, out + m0 * ldo + n0, ldo,
                   bias ? bias + n0 : nullptr, N - n0);
      }
    }
  }
}

// out[M, N] (row stride ldo) = x[M, K] @ W^T (+ bias), W in the group layout of
// linear_quant_blocks.h with K / kBlock blocks per row.
template <class Block>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* out,
         int64_t ldo, int32_t num_threads) {
  switch (columns_per_tile(M)) {
    case 4: return run_tiles<Block, 4>(x, M, K, w, N, bias, out, ldo, num_threads);
    case 2: return run_tiles<Block, 2>(x, M, K, w, N, bias, out, ldo, num_threads);
    default: return run_tiles<Block, 1>(x, M, K, w, N, bias, out, ldo, num_threads);
  }
}
