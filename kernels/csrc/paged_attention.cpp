// Paged attention for every query row (prefill chunks, decodes, verify rows, tree nodes)
// on the CPU.
//
// Each query row reads its keys straight from the paged cache through its request's
// block table: no gathered copy of K/V, no padding. A row's keys are the first
// `prefix` positions of its request's context followed by `extra` positions (a tree
// node's ancestors among the query tokens). Rows of one request form groups that read
// each tile of their common keys once. Every (row, head) is computed start to finish by
// one thread with a fixed order of operations, so a row's result depends only on its
// query and its key sequence: a verify row reproduces the decode of the same context bit
// for bit, whatever else is in the batch, however the rows are grouped and however many
// threads run. Built by specdec/kernels/cpu_build.py (g++ -O3 -march=native -fopenmp)
// and called through ctypes from attention_cpu.py; kernels/reference.py is the reference
// it is tested against.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "lanes.h"

namespace {

using specdec::BFloat16;
using specdec::Half;
using specdec::exp_nonpositive;
using specdec::kLanes;
using specdec::Lanes;
using specdec::load;
using specdec::store;

enum CacheDtype : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFp8E4M3 = 3 };

// Keys this far ahead of the one in use are requested from memory: the paged cache's
// blocks are scattered, so the hardware prefetchers alone leave the loads waiting.
constexpr int64_t kAhead = 32;

template <typename T, int64_t kChunks>
inline void prefetch_head(const T* p) {
  specdec::prefetch(p, kChunks * kLanes * static_cast<int64_t>(sizeof(T)));
}

// Sums keep kLanes partial sums, combined in a fixed order, never an `omp simd
// reduction`: a compiler-chosen reduction may start at an alignment boundary, so its
// rounding would depend on where a buffer happens to sit in memory.
//
// Lane l += lane l + kLanes / 2, then ... + 2, + 1, in registers (a store and scalar
// reloads would stall on store forwarding, once per key and head).
inline float sum_lanes(Lanes v) {
#if defined(__AVX512F__)
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
#else
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0);
#endif
  return v[0];
}

// sum_lanes of four vectors at once, in lanes 0, kLanes / 4, kLanes / 2 and 3 kLanes / 4:
// the same additions in the same order as sum_lanes (so a key's score never depends on
// its neighbours), with the shuffles of the first two steps shared.
inline Lanes sum_lanes4(Lanes a, Lanes b, Lanes c, Lanes d) {
#if defined(__AVX512F__)
  const Lanes ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const Lanes cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  Lanes v = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  const Lanes ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  const Lanes cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  Lanes v = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
            __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
  return v;
}

// row[0:n] = exp(row - top); returns their sum.
float exponentiate(float* row, int64_t n, float top) {
  Lanes total = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes e = exp_nonpositive(load(row + j) - top);
    store(row + j, e);
    total += e;
  }
  if (j < n) {  // the tail through the same vector code, so every element rounds alike
    float tail[kLanes] = {};
    std::memcpy(tail, row + j, (n - j) * sizeof(float));
    const Lanes e = exp_nonpositive(load(tail) - top);
    for (int64_t l = 0; l < n - j; ++l) {
      total[l] += e[l];
      row[j + l] = e[l];
    }
  }
  return sum_lanes(total);
}

inline float fp8_e4m3_to_float(uint8_t bits) {
  // e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities.
  const int exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
  float magnitude = exponent == 0 ? mantissa * (1.0f / 512.0f)  // subnormal: m / 8 * 2^-6
                                  : (8 + mantissa) * (1.0f / 8.0f) * static_cast<float>(1 << exponent) / 128.0f;
  if (exponent == 0xF && mantissa == 0x7) magnitude = __builtin_nanf("");
  return (bits & 0x80) ? -magnitude : magnitude;
}

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) value[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
  }
};
const Fp8Table kFp8;

// Head vector `index` of an fp8 [*, D] cache view in float32, times its scale.
void convert_fp8_head(const void* cache, const float* scales, int64_t index, int64_t d, float* out) {
  const uint8_t* src = static_cast<const uint8_t*>(cache) + index * d;
  for (int64_t i = 0; i < d; ++i) out[i] = kFp8.value[src[i]] * scales[index];
}

struct Layout {
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  float scale;
};

struct Cache {
  const void* k;
  const void* v;
  const float* k_scale;  // fp8 only, else null
  const float* v_scale;
  int32_t dtype;
};

constexpr int64_t kTile = 32;  // shared keys per tile: a K or V tile stays in L1 across a group's rows

// The keys of one kv head: (slot, kv head) indices and pointers to their K, V of element
// type T: into the cache itself, or (fp8, T = float) into buffers converted once per item.
template <typename T>
struct Keys {
  std::vector<int64_t> heads;
  std::vector<const T*> k, v;
  std::vector<float> k_buffer, v_buffer;

  void resolve(const Cache& c, int64_t d) {
    const int64_t n = static_cast<int64_t>(heads.size());
    k.resize(n);
    v.resize(n);
    if (c.dtype == kFp8E4M3) return resolve_fp8(c, d);
    for (int64_t j = 0; j < n; ++j) {
      k[j] = static_cast<const T*>(c.k) + heads[j] * d;
      v[j] = static_cast<const T*>(c.v) + heads[j] * d;
    }
  }

  void resolve_fp8(const Cache& c, int64_t d) {
    const int64_t n = static_cast<int64_t>(heads.size());
    k_buffer.resize(n * d);
    v_buffer.resize(n * d);
    for (int64_t j = 0; j < n; ++j) {
      convert_fp8_head(c.k, c.k_scale, heads[j], d, k_buffer.data() + j * d);
      convert_fp8_head(c.v, c.v_scale, heads[j], d, v_buffer.data() + j * d);
      k[j] = reinterpret_cast<const T*>(k_buffer.data() + j * d);
      v[j] = reinterpret_cast<const T*>(v_buffer.data() + j * d);
    }
  }
};

inline int64_t head_of(const int32_t* table, int64_t position, int64_t g, const Layout& l) {
  const int64_t slot = static_cast<int64_t>(table[position / l.block_size]) * l.block_size + position % l.block_size;
  return slot * l.num_kv_heads + g;
}

// Indices of positions [begin, end), walking the block table block by block.
void append_range(const int32_t* table, int64_t begin, int64_t end, int64_t g, const Layout& l,
                  std::vector<int64_t>& heads) {
  for (int64_t position = begin; position < end;) {
    const int64_t first = static_cast<int64_t>(table[position / l.block_size]) * l.block_size;
    for (int64_t offset = position % l.block_size; offset < l.block_size && position < end; ++offset, ++position)
      heads.push_back((first + offset) * l.num_kv_heads + g);
  }
}

// A group: query rows of one request, row i seeing the request's first prefix[i]
// positions (a prefix of the shared keys, each tile read once for every row that sees
// it), then its own further keys (a tree node's ancestors).
template <typename T>
struct Group {
  std::vector<int64_t> prefix;      // [R]
  Keys<T> shared;                   // positions [0, max prefix)
  std::vector<Keys<T>> own;         // [R]
  std::vector<const float*> query;  // [R] the row's heads for this kv head: [G, D]
  std::vector<float*> out;          // [R]
  std::vector<int64_t> offset;      // [R + 1] start of each row's scores: [G, n_r]
  std::vector<float> scores, acc;   // softmax weights; [R, G, D] accumulators
  std::vector<float> inverse;       // [R, G] 1 / sum of each row and head's weights
  std::vector<float*> pair_weights;        // [R * G] each (row, head)'s softmax weights
  std::vector<float*> pair_acc;            // [R * G] and its accumulator
  std::vector<float*> own_weights;         // [G] one row's weights of its own keys
};

template <typename T>
inline float* weights(Group<T>& grp, int64_t i, int64_t h, int64_t group) {
  return grp.scores.data() + grp.offset[i] + h * (grp.offset[i + 1] - grp.offset[i]) / group;
}

struct RowSpec {
  const int64_t* rows;
  const int64_t* prefixes;
  const int64_t* extra_start;
  const int64_t* extra;
};

// Fill `grp` for rows [first, last) (of one request) and kv head g.
template <typename T>
void gather_group(const RowSpec& spec, int64_t first, int64_t last, const int32_t* table, int64_t g,
                  const float* query, float* out, const Cache& c, const Layout& l, Group<T>& grp) {
  const int64_t num_rows = last - first, group = l.num_heads / l.num_kv_heads, d = l.head_dim;
  grp.prefix.assign(spec.prefixes + first, spec.prefixes + last);
  int64_t longest = 0;
  for (int64_t n : grp.prefix) longest = n > longest ? n : longest;
  grp.shared.heads.clear();
  append_range(table, 0, longest, g, l, grp.shared.heads);
  grp.shared.resolve(c, d);
  grp.own.resize(num_rows);
  grp.query.resize(num_rows);
  grp.out.resize(num_rows);
  grp.offset.assign(1, 0);
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t r = first + i;
    Keys<T>& own = grp.own[i];
    own.heads.clear();
    for (int64_t e = spec.extra_start[r]; e < spec.extra_start[r + 1]; ++e)
      own.heads.push_back(head_of(table, spec.extra[e], g, l));
    own.resolve(c, d);
    grp.query[i] = query + (spec.rows[r] * l.num_heads + g * group) * d;
    grp.out[i] = out + (spec.rows[r] * l.num_heads + g * group) * d;
    grp.offset.push_back(grp.offset.back() + group * (grp.prefix[i] + static_cast<int64_t>(own.heads.size())));
  }
  grp.scores.resize(grp.offset.back());
  grp.acc.assign(num_rows * group * d, 0.0f);
  grp.pair_weights.resize(num_rows * group);
  grp.pair_acc.resize(num_rows * group);
  for (int64_t i = 0; i < num_rows; ++i)
    for (int64_t h = 0; h < group; ++h) {
      grp.pair_weights[i * group + h] = weights(grp, i, h, group);
      grp.pair_acc[i * group + h] = grp.acc.data() + (i * group + h) * d;
    }
}

// scores[h][j] = scale * q[h] . k[j] for j in [begin, end) and kHeads heads at once
// (q: [kHeads, kChunks * kLanes], in registers): each key is loaded, and widened, once for
// all of them, and each (key, head) dot product takes the same steps it would alone.
// Keys [j + kAhead, limit) are prefetched as j advances.
template <int64_t kChunks, int64_t kHeads, typename T>
void score_keys(const float* q, const T* const* k, int64_t begin, int64_t end, float scale, float* const* scores,
                int64_t limit) {
  Lanes query[kHeads][kChunks];
  for (int64_t h = 0; h < kHeads; ++h)
    for (int64_t c = 0; c < kChunks; ++c) query[h][c] = load(q + (h * kChunks + c) * kLanes);
  auto dots = [&](int64_t j, Lanes* out) {  // out[h]: head h's lane sums for key j
    Lanes key[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) key[c] = load(k[j] + c * kLanes);
    for (int64_t h = 0; h < kHeads; ++h) {
      out[h] = query[h][0] * key[0];
      for (int64_t c = 1; c < kChunks; ++c) out[h] += query[h][c] * key[c];
    }
  };
  int64_t j = begin;
  for (; j + 4 <= end; j += 4) {
    for (int64_t a = j + kAhead; a < j + kAhead + 4 && a < limit; ++a) prefetch_head<T, kChunks>(k[a]);
    Lanes four[4][kHeads];
    for (int64_t i = 0; i < 4; ++i) dots(j + i, four[i]);
    for (int64_t h = 0; h < kHeads; ++h) {
      const Lanes sums = sum_lanes4(four[0][h], four[1][h], four[2][h], four[3][h]);
      for (int64_t i = 0; i < 4; ++i) scores[h][j + i] = sums[kLanes / 4 * i] * scale;
    }
  }
  for (; j < end; ++j) {
    Lanes one[kHeads];
    dots(j, one);
    for (int64_t h = 0; h < kHeads; ++h) scores[h][j] = sum_lanes(one[h]) * scale;
  }
}

// f(n, first, limit) for [0, count) in batches of kMost, then the rest as one batch: n is
// the batch size as a std::integral_constant (the kernels size register arrays by it), and
// only the first batch is passed `limit` (it does the prefetching).
template <int64_t kMost, typename F>
void in_batches(int64_t count, int64_t limit, F f) {
  int64_t first = 0;
  for (; first + kMost <= count; first += kMost, limit = 0)
    f(std::integral_constant<int64_t, kMost>{}, first, limit);
  if constexpr (kMost > 1) {
    if (first < count)
      in_batches<kMost - 1>(count - first, limit, [&](auto n, int64_t i, int64_t l) { f(n, first + i, l); });
  }
}

// score_keys for `count` heads (q: [count, kChunks * kLanes]), as many at a time as the
// registers hold (with AVX2's 16, three anyway: the FMAs read the queries from L1, which
// costs less than widening each key once more per head; 10% on 16 decode rows of
// head dim 64); the first batch of heads prefetches up to `limit`.
template <int64_t kChunks, typename T>
void score_heads(const float* q, const T* const* k, int64_t begin, int64_t end, float scale, float* const* scores,
                 int64_t count, int64_t limit) {
  constexpr int64_t kMost = kLanes == 8 ? 3 : (kChunks >= 8 ? 1 : (kChunks >= 5 ? 2 : 3));
  in_batches<kMost>(count, limit, [&](auto n, int64_t h, int64_t l) {
    score_keys<kChunks, decltype(n)::value, T>(q + h * kChunks * kLanes, k, begin, end, scale, scores + h, l);
  });
}

// acc[p] += sum_j weights[p][j] * v[j] for j in [begin, end) and kHeads (row, head)
// pairs at once, in key order, accumulators in registers: each value vector is loaded
// once for all of them, and their kHeads * kChunks addition chains run side by side.
// Values [j + kAhead, limit) are prefetched as j advances.
template <int64_t kChunks, int64_t kHeads, typename T>
void mix_keys(const float* const* weights, const T* const* v, int64_t begin, int64_t end, float* const* acc,
              int64_t limit) {
  Lanes sum[kHeads][kChunks];
  for (int64_t p = 0; p < kHeads; ++p)
    for (int64_t c = 0; c < kChunks; ++c) sum[p][c] = load(acc[p] + c * kLanes);
  for (int64_t j = begin; j < end; ++j) {
    if (j + kAhead < limit) prefetch_head<T, kChunks>(v[j + kAhead]);
    for (int64_t c = 0; c < kChunks; ++c) {
      const Lanes value = load(v[j] + c * kLanes);
      for (int64_t p = 0; p < kHeads; ++p) sum[p][c] += weights[p][j] * value;
    }
  }
  for (int64_t p = 0; p < kHeads; ++p)
    for (int64_t c = 0; c < kChunks; ++c) store(acc[p] + c * kLanes, sum[p][c]);
}

// mix_keys over `count` (row, head) pairs, as many at a time as 16 accumulators allow;
// the first batch of pairs prefetches up to `limit`.
template <int64_t kChunks, typename T>
void mix_pairs(const float* const* weights, const T* const* v, int64_t begin, int64_t end, float* const* acc,
               int64_t count, int64_t limit) {
  constexpr int64_t kMost = kChunks >= 8 ? 2 : (kChunks >= 5 ? 3 : 4);
  in_batches<kMost>(count, limit, [&](auto n, int64_t p, int64_t l) {
    mix_keys<kChunks, decltype(n)::value, T>(weights + p, v, begin, end, acc + p, l);
  });
}

// Scores of shared keys [t, t_end) for every row and head of the group; each row's first
// head prefetches the keys ahead.
template <int64_t kChunks, typename T>
void score_shared(Group<T>& grp, int64_t t, int64_t t_end, int64_t group, float scale) {
  for (size_t i = 0; i < grp.own.size(); ++i) {
    const int64_t end = t_end < grp.prefix[i] ? t_end : grp.prefix[i];
    if (t < end)
      score_heads<kChunks, T>(grp.query[i], grp.shared.k.data(), t, end, scale, grp.pair_weights.data() + i * group,
                              group, grp.prefix[i]);
  }
}

// Scores of each row's own keys, then softmax weights; grp.inverse gets 1 / their sums.
template <int64_t kChunks, typename T>
void softmax(Group<T>& grp, int64_t group, float scale) {
  grp.inverse.resize(grp.own.size() * group);
  for (size_t i = 0; i < grp.own.size(); ++i) {
    const int64_t own = static_cast<int64_t>(grp.own[i].k.size()), n = grp.prefix[i] + own;
    grp.own_weights.resize(group);
    for (int64_t h = 0; h < group; ++h) grp.own_weights[h] = weights(grp, i, h, group) + grp.prefix[i];
    score_heads<kChunks, T>(grp.query[i], grp.own[i].k.data(), 0, own, scale, grp.own_weights.data(), group, 0);
    for (int64_t h = 0; h < group; ++h) {
      float* w = weights(grp, i, h, group);
      float top = w[0];
      for (int64_t j = 1; j < n; ++j) top = w[j] > top ? w[j] : top;
      grp.inverse[i * group + h] = 1.0f / exponentiate(w, n, top);
    }
  }
}

// Weighted values of shared keys [t, t_end) into every row and head's accumulators.
template <int64_t kChunks, typename T>
void mix_shared(Group<T>& grp, int64_t t, int64_t t_end, int64_t group) {
  for (size_t i = 0; i < grp.own.size(); ++i) {
    const int64_t end = t_end < grp.prefix[i] ? t_end : grp.prefix[i];
    if (t < end)
      mix_pairs<kChunks, T>(grp.pair_weights.data() + i * group, grp.shared.v.data(), t, end,
                            grp.pair_acc.data() + i * group, group, grp.prefix[i]);
  }
}

// Each row's own values (its heads together), then the normalised outputs.
template <int64_t kChunks, typename T>
void finish(Group<T>& grp, int64_t group) {
  for (size_t i = 0; i < grp.own.size(); ++i) {
    grp.own_weights.resize(group);
    for (int64_t h = 0; h < group; ++h) grp.own_weights[h] = weights(grp, i, h, group) + grp.prefix[i];
    mix_pairs<kChunks, T>(grp.own_weights.data(), grp.own[i].v.data(), 0, static_cast<int64_t>(grp.own[i].v.size()),
                          grp.pair_acc.data() + i * group, group, 0);
    for (int64_t h = 0; h < group; ++h) {
      const float* acc = grp.pair_acc[i * group + h];
      for (int64_t c = 0; c < kChunks; ++c)
        store(grp.out[i] + h * kChunks * kLanes + c * kLanes, load(acc + c * kLanes) * grp.inverse[i * group + h]);
    }
  }
}

// softmax(scale * q . K) V for every row and head of some groups (the same rows, one kv
// head each). Each (row, head) sees the same operations in the same key order as it
// would alone; tiles only interleave rows and kv heads, so that a tile's K and V are read
// from memory once and in address order (kv heads sit side by side in a slot).
template <int64_t kChunks, typename T>
void attend_groups(std::vector<Group<T>>& grps, int64_t group, float scale) {
  const int64_t longest = static_cast<int64_t>(grps[0].shared.k.size());
  for (int64_t t = 0; t < longest; t += kTile)
    for (Group<T>& grp : grps)
      score_shared<kChunks, T>(grp, t, t + kTile < longest ? t + kTile : longest, group, scale);
  for (Group<T>& grp : grps) softmax<kChunks, T>(grp, group, scale);
  for (int64_t t = 0; t < longest; t += kTile)
    for (Group<T>& grp : grps) mix_shared<kChunks, T>(grp, t, t + kTile < longest ? t + kTile : longest, group);
  for (Group<T>& grp : grps) finish<kChunks, T>(grp, group);
}

// One call's rows, as specdec_paged_attention_rows describes them.
struct Step {
  const float* query;
  float* out;
  Cache cache;
  Layout layout;
  RowSpec spec;
  const int32_t* block_tables;
  const int64_t* group_start;
  const int64_t* group_requests;
  int64_t num_groups, max_blocks, head_splits;
  int32_t num_threads;
};

// Every work item of the step; T is the cache's element type as the kernel reads it.
template <int64_t kChunks, typename T>
void run(const Step& s) {
  const Layout& l = s.layout;
  const int64_t items = s.num_groups * s.head_splits, heads_per_item = (l.num_kv_heads + s.head_splits - 1) / s.head_splits;
#pragma omp parallel num_threads(s.num_threads)
  {
    std::vector<Group<T>> grps;
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t i = item / s.head_splits, first = item % s.head_splits * heads_per_item;
      const int64_t last = first + heads_per_item < l.num_kv_heads ? first + heads_per_item : l.num_kv_heads;
      if (first >= last) continue;
      grps.resize(last - first);
      for (int64_t g = first; g < last; ++g)
        gather_group(s.spec, s.group_start[i], s.group_start[i + 1], s.block_tables + s.group_requests[i] * s.max_blocks,
                     g, s.query, s.out, s.cache, l, grps[g - first]);
      attend_groups<kChunks, T>(grps, l.num_heads / l.num_kv_heads, l.scale);
    }
  }
}

using RunFn = void (*)(const Step&);

template <int64_t kChunks>
RunFn run_for(int32_t dtype) {
  switch (dtype) {
    case kFloat16: return run<kChunks, Half>;
    case kBFloat16: return run<kChunks, BFloat16>;
    default: return run<kChunks, float>;  // fp32, and fp8 converted to float32 buffers
  }
}

// Head dims the kernel is instantiated for (multiples of kLanes); others use the reference.
RunFn run_fn(int64_t head_dim, int32_t dtype) {
  switch (head_dim) {
    case 32: return run_for<32 / kLanes>(dtype);
    case 64: return run_for<64 / kLanes>(dtype);
    case 80: return run_for<80 / kLanes>(dtype);
    case 96: return run_for<96 / kLanes>(dtype);
    case 128: return run_for<128 / kLanes>(dtype);
    default: return nullptr;
  }
}

}  // namespace

extern "C" {

// Whether specdec_paged_attention_rows handles this head dim.
int32_t specdec_paged_attention_supports(int64_t head_dim) { return run_fn(head_dim, kFloat32) != nullptr; }

// query, out: [T, Hq, D] float32 contiguous; k, v: [num_blocks, block_size, Hkv, D] in
// `dtype`; k_scale, v_scale: [num_blocks, block_size, Hkv] float32 (fp8) or null;
// block_tables: [B, max_blocks] int32. Row r (of R) is query row rows[r]; it sees its
// request's positions 0..prefixes[r]-1, then extra[extra_start[r]:extra_start[r + 1]].
// Rows come in groups of one request each: group i is rows group_start[i]..group_start[i + 1]-1
// of request group_requests[i]. A work item is a group's kv heads, or a share of them
// (head_splits shares) when there are too few groups to keep the threads busy.
void specdec_paged_attention_rows(const float* query, float* out, const void* k, const void* v,
                                  const float* k_scale, const float* v_scale, int32_t dtype,
                                  const int32_t* block_tables, const int64_t* rows, const int64_t* prefixes,
                                  const int64_t* extra_start, const int64_t* extra, const int64_t* group_start,
                                  const int64_t* group_requests, int64_t num_groups, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                  float scale, int32_t num_threads, int64_t head_splits) {
  const Step step{query,       out,         Cache{k, v, k_scale, v_scale, dtype},
                  Layout{num_heads, num_kv_heads, head_dim, block_size, scale},
                  RowSpec{rows, prefixes, extra_start, extra},
                  block_tables, group_start, group_requests, num_groups, max_blocks, head_splits, num_threads};
  run_fn(head_dim, dtype)(step);
}

}  // extern "C"
