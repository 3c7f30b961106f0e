// The int8-activation quantized linear kernel's block formats and loops, written once
// over an ISA's lanes: linear_quant_int8_avx2.h and linear_quant_int8_avx512.h include
// this file at the end of each of their namespaces and target regions, after defining
// `Ints` and `Floats` (kLanes int32 / float32 lanes, one output column each), the column
// of each lane (kColumnOfLane), tiles of kTileGroups weight groups (kLanes columns),
// kMaxRows, the lane operations used below, and `Dot`, the integer dot product.
// No include guard on purpose.
//
// Weights: the group layout of linear_quant_blocks.h, unchanged. For one block index, a
// tile decodes each of its columns' 32 quants to unsigned bytes u, in eight 4-byte
// pieces: piece k of every column side by side (`Ints w[8]`, byte i of lane l: u[4k + i]
// of lane l's column). Activations: linear_quant_int8_activations.h (q, d per block).
//
// Each output (r, n) is one float32 lane; per block b, in increasing b, with the block's
// exact integer dot product p = sum_j u[j] q[j] (minus an integer offset times the
// block's activation sum where u is offset from the weight's integer):
//   Q8_0, Q4_0:   acc = fma(d_w * d_x, p, acc)
//   Q4_1, Q4X, Q5X: acc = fma(d_w * d_x, p, acc); acc = fma(m_w, d_x * sum q, acc)
//   Q6X:          acc = fma(d0_w * d_x, p_0-15, acc); acc = fma(d1_w * d_x, p_16-31, acc)
// then out = acc (+ bias). The integer sums are exact whatever the ISA adds first, and the
// float steps are per lane and fixed, so a row's result depends on nothing but its own
// activations (batch invariant, any thread count) and the ISAs agree bit for bit.

// How far ahead of its reads a tile requests its weights from memory.
constexpr int64_t kInt8AheadBytes = 4096;

// A group step's blocks, read by a tile from kTileGroups groups (a zero step stands in
// for groups past the matrix's last).
using Steps = const uint8_t* const*;

alignas(64) inline const uint8_t kZeroStep[256] = {};

// The 4-bit quants u[4k + i] of a step's columns (their 16 bytes of nibbles at `quants`
// plus c * kStride), from the transposed 4-byte pieces of those 16 bytes.
template <int64_t kStride>
inline void nibbles(Steps steps, int64_t quants, Ints* w) {
  Ints pieces[4];
  pieces_of<kStride, 0>(steps, quants, pieces);
  for (int k = 0; k < 4; ++k) {
    w[k] = low_nibbles(pieces[k]);
    w[k + 4] = high_nibbles(pieces[k]);
  }
}

// The integer dot products of `w` (pieces k0 .. k1 - 1) with the block of each of R rows.
template <int R, int kDepth>
inline void dots(const Ints* w, int k0, int k1, const Activations& a, int64_t m0, int64_t b, Ints* out) {
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.row(m0 + r) + b * kBlock;
  Dot::template dot<R, kDepth>(w, k0, k1, x, out);
}

inline int64_t at(const Activations& a, int64_t r, int64_t b) { return r * a.blocks + b; }

struct Q8_0 {
  static constexpr int64_t kBytes = block_bytes(kQ8_0), kHeader = header_bytes(kQ8_0), kQuants = kBytes - kHeader;
  // u = q + 128; with byte products that must stay in int16, u = 16 high + low.
  static constexpr int kPlanes = Dot::kByteQuants ? 1 : 2;
  Floats d;
  Ints w[kPlanes][8];
  explicit Q8_0(Steps steps) : d(singles(steps)) {
    Ints pieces[8];
    pieces_of<kQuants, 0>(steps, kGroup * kHeader, pieces);
    pieces_of<kQuants, 16>(steps, kGroup * kHeader, pieces + 4);
    for (int k = 0; k < 8; ++k) {
      const Ints u = flip_signs(pieces[k]);
      if constexpr (kPlanes == 1) {
        w[0][k] = u;
      } else {
        w[0][k] = low_nibbles(u);
        w[1][k] = high_nibbles(u);
      }
    }
  }
  template <int R>
  void accumulate(Floats* acc, const Activations& a, int64_t m0, int64_t b) const {
    Ints p[R];
    dots<R, 8>(w[0], 0, 8, a, m0, b, p);
    if constexpr (kPlanes == 2) {
      Ints high[R];
      dots<R, 8>(w[1], 0, 8, a, m0, b, high);
      for (int r = 0; r < R; ++r) p[r] = add(p[r], times16(high[r]));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = at(a, m0 + r, b);
      const Ints exact = subtract(p[r], 128 * (a.sums[2 * i] + a.sums[2 * i + 1]));
      acc[r] = fma(mul(d, broadcast(a.scales[i])), to_float(exact), acc[r]);
    }
  }
};

struct Q4_0 {
  static constexpr int64_t kBytes = block_bytes(kQ4_0), kHeader = header_bytes(kQ4_0), kQuants = kBytes - kHeader;
  Floats d;
  Ints w[8];
  explicit Q4_0(Steps steps) : d(singles(steps)) { nibbles<kQuants>(steps, kGroup * kHeader, w); }
  template <int R>
  void accumulate(Floats* acc, const Activations& a, int64_t m0, int64_t b) const {
    Ints p[R];
    dots<R, 8>(w, 0, 8, a, m0, b, p);
    for (int r = 0; r < R; ++r) {
      const int64_t i = at(a, m0 + r, b);
      const Ints exact = subtract(p[r], 8 * (a.sums[2 * i] + a.sums[2 * i + 1]));
      acc[r] = fma(mul(d, broadcast(a.scales[i])), to_float(exact), acc[r]);
    }
  }
};

// A block with a scale and a min per column (Q4_1, Q4X, Q5X); its quants go up to kMax.
template <int kMax>
struct ScaleMin {
  Floats d, m;
  Ints w[8];
  template <int R>
  void accumulate(Floats* acc, const Activations& a, int64_t m0, int64_t b) const {
    Ints p[R];
    dots<R, Dot::depth(kMax)>(w, 0, 8, a, m0, b, p);
    for (int r = 0; r < R; ++r) {
      const int64_t i = at(a, m0 + r, b);
      acc[r] = fma(mul(d, broadcast(a.scales[i])), to_float(p[r]), acc[r]);
      acc[r] = fma(m, broadcast(a.scaled_sums[i]), acc[r]);
    }
  }
};

struct Q4_1 : ScaleMin<15> {
  static constexpr int64_t kBytes = block_bytes(kQ4_1), kHeader = header_bytes(kQ4_1), kQuants = kBytes - kHeader;
  explicit Q4_1(Steps steps) {
    half_pairs(steps, d, m);
    nibbles<kQuants>(steps, kGroup * kHeader, w);
  }
};

struct Q4X : ScaleMin<15> {
  static constexpr int64_t kBytes = block_bytes(kQ4X), kHeader = header_bytes(kQ4X), kQuants = kBytes - kHeader;
  explicit Q4X(Steps steps) {
    float_pairs(steps, d, m);
    nibbles<kQuants>(steps, kGroup * kHeader, w);
  }
};

struct Q5X : ScaleMin<31> {
  static constexpr int64_t kBytes = block_bytes(kQ5X), kHeader = header_bytes(kQ5X), kQuants = kBytes - kHeader;
  explicit Q5X(Steps steps) {
    float_pairs(steps, d, m);
    nibbles<kQuants>(steps, kGroup * kHeader, w);
    Ints tail[4];  // bytes 4-19 of each column: piece 3 is its u32 of high bits
    pieces_of<kQuants, 4>(steps, kGroup * kHeader, tail);
    // Bit 4k + i of the high bits goes to bit 4 of byte i of piece k: one multiply
    // places the four bits 7 apart, which lands bit i at 8 i (no two terms overlap).
    for (int k = 0; k < 8; ++k) w[k] = merge(w[k], and_mask(mul32(and_mask(shift_right(tail[3], 4 * k), 15),
                                                                  0x02040810), 0x10101010));
  }
};

struct Q6X {
  static constexpr int64_t kBytes = block_bytes(kQ6X), kHeader = header_bytes(kQ6X), kQuants = kBytes - kHeader;
  Floats d0, d1;
  Ints w[8];
  explicit Q6X(Steps steps) {
    float_pairs(steps, d0, d1);
    nibbles<kQuants>(steps, kGroup * kHeader, w);
    Ints tail[4];  // bytes 8-23 of each column: pieces 2 and 3 are its two u32 of high bits
    pieces_of<kQuants, 8>(steps, kGroup * kHeader, tail);
    // The 2-bit field 4 (k % 4) + i of high bits k / 4 goes to bits 4-5 of byte i of piece k.
    for (int k = 0; k < 8; ++k) {
      const Ints fields = shift_right(tail[2 + k / 4], 8 * (k % 4));
      const Ints spread = merge(merge(shift_left(and_mask(fields, 0x03), 4), shift_left(and_mask(fields, 0x0C), 10)),
                                merge(shift_left(and_mask(fields, 0x30), 16), shift_left(and_mask(fields, 0xC0), 22)));
      w[k] = merge(w[k], spread);
    }
  }
  template <int R>
  void accumulate(Floats* acc, const Activations& a, int64_t m0, int64_t b) const {
    Ints low[R], high[R];
    dots<R, Dot::depth(63)>(w, 0, 4, a, m0, b, low);
    dots<R, Dot::depth(63)>(w, 4, 8, a, m0, b, high);
    for (int r = 0; r < R; ++r) {
      const int64_t i = at(a, m0 + r, b);
      const Floats scale = broadcast(a.scales[i]);
      acc[r] = fma(mul(d0, scale), to_float(subtract(low[r], 32 * a.sums[2 * i])), acc[r]);
      acc[r] = fma(mul(d1, scale), to_float(subtract(high[r], 32 * a.sums[2 * i + 1])), acc[r]);
    }
  }
};

using TileFn = void (*)(const Activations&, int64_t, Steps, const int64_t*, float*, int64_t, const float*, int64_t);

// out[r * ldo + c] = row m0 + r of the activations times column c of the tile (+ bias[c])
// for R rows and the tile's kLanes columns, of which those c < cols are stored: groups[g]
// is group g's first step, strides[g] the bytes to its next.
template <class Format, int R>
void tile(const Activations& a, int64_t m0, Steps groups, const int64_t* strides, float* out, int64_t ldo,
          const float* bias, int64_t cols) {
  Floats acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero_floats();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* steps[kTileGroups];
    for (int g = 0; g < kTileGroups; ++g) {
      steps[g] = groups[g] + b * strides[g];
      // Past a group's end: the next group, which this thread reads next (never faults).
      for (int64_t offset = 0; offset < kGroup * Format::kBytes; offset += 64)
        __builtin_prefetch(steps[g] + kInt8AheadBytes + offset);
    }
    const Format block(steps);
    block.template accumulate<R>(acc, a, m0, b);
  }
  alignas(64) float lanes[kLanes];
  for (int r = 0; r < R; ++r) {
    store(lanes, acc[r]);
    for (int l = 0; l < kLanes; ++l) {
      const int c = kColumnOfLane[l];
      if (c < cols) out[r * ldo + c] = bias ? lanes[l] + bias[c] : lanes[l];
    }
  }
}

template <class Format, int R = 1>
TileFn pick(int64_t rows) {
  if constexpr (R < kMaxRows) {
    if (rows > R) return pick<Format, R + 1>(rows);
  }
  return tile<Format, R>;
}

// out[M, N] (row stride ldo) = the quantized activations @ W^T (+ bias), W in the group
// layout of linear_quant_blocks.h. Each thread takes a run of tiles and runs the rows in
// as few row groups as the registers allow, one row group at a time over all its tiles
// (each decoded block shared by the row group's rows).
template <class Format>
void run(const Activations& a, int64_t M, const uint8_t* w, int64_t N, const float* bias, float* out, int64_t ldo,
         int32_t num_threads) {
  const int64_t step = kGroup * Format::kBytes, group_bytes = a.blocks * step;
  const int64_t groups = (N + kGroup - 1) / kGroup, tiles = (groups + kTileGroups - 1) / kTileGroups;
  const int64_t row_groups = (M + kMaxRows - 1) / kMaxRows, R = (M + row_groups - 1) / row_groups;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t begin = tiles * id / threads, end = tiles * (id + 1) / threads;
    for (int64_t m0 = 0; m0 < M; m0 += R) {
      const int64_t rows = M - m0 < R ? M - m0 : R;
      const TileFn run_tile = pick<Format>(rows);
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* first[kTileGroups];
        int64_t strides[kTileGroups];
        for (int g = 0; g < kTileGroups; ++g) {
          const int64_t group = t * kTileGroups + g;
          first[g] = group < groups ? w + group * group_bytes : kZeroStep;
          strides[g] = group < groups ? step : 0;
        }
        const int64_t n0 = t * kLanes;
        run_tile(a, m0, first, strides, out + m0 * ldo + n0, ldo, bias ? bias + n0 : nullptr, N - n0);
      }
    }
  }
}
