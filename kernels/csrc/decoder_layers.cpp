// Every decoder layer of a Llama-family model in one call on the CPU (kernels/decoder_cpu.py).
//
// A 135M model's decode step runs 30 layers of about twelve small operations each; driven
// from Python, their dispatch costs as much as the matrix products. Here one call runs
// them all, from the embedding lookup to the final norm. It does no arithmetic of its own
// beyond RoPE, SiLU and the residual adds: the embedding rows, projections, norms, K/V
// stores and attention are the other kernels' C functions, handed over as pointers, so
// each computes exactly what it computes when Python calls it.
//
// Every operation is row-wise or row-invariant, so a token's result does not depend on
// the other tokens of the step: speculation's verify rows equal plain decoding's.
#include <cstdint>
#include <cstring>
#include <vector>

#include "lanes.h"

namespace {

using specdec::exp_nonpositive;
using specdec::kLanes;
using specdec::Lanes;
using specdec::load;
using specdec::store;

using LinearQuantFn = int32_t (*)(int32_t, int32_t, const float*, int64_t, int64_t, const uint8_t*, int64_t,
                                  const float*, float*, int64_t, int32_t);
using LinearFp16Fn = void (*)(const float*, int64_t, int64_t, const uint16_t*, int64_t, const float*, float*,
                              int32_t);
using RmsNormFn = void (*)(const float*, const float*, float, float*, int64_t, int64_t, int32_t);
using StoreKvFn = int64_t (*)(const float*, int64_t, const float*, int64_t, void*, void*, int32_t, const int64_t*,
                              int64_t, int64_t, int64_t, int32_t);
using DequantizeRowsFn = int32_t (*)(int32_t, const uint8_t*, int64_t, const int64_t*, int64_t, float*);
using AttentionFn = void (*)(const float*, float*, const void*, const void*, const float*, const float*, int32_t,
                             const int32_t*, const int64_t*, const int64_t*, const int64_t*, const int64_t*,
                             const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             float, int32_t, int64_t);

}  // namespace

extern "C" {

// The other kernels' entry points (linear_quant.cpp, linear_fp16.cpp, rms_norm.cpp,
// store_kv.cpp, paged_attention.cpp).
struct Kernels {
  LinearQuantFn linear_quant, linear_quant_int8;
  DequantizeRowsFn dequantize_rows;
  LinearFp16Fn linear_fp16;
  RmsNormFn rms_norm;
  StoreKvFn store_kv;
  AttentionFn attention;
};

enum ProjectionKind : int32_t { kBlocks = 0, kBlocksInt8 = 1, kFp16 = 2 };

// One projection: GGUF blocks in linear_quant's layout (kinds 0 and 1: float32 or int8
// activations) or fp16 tiles in linear_fp16's (kind 2).
struct Projection {
  int32_t kind, format;
  const void* weight;
  const float* bias;  // [rows] or null
  int64_t rows;  // output features
};

struct Layer {
  const float *input_norm, *post_norm;  // [hidden]
  Projection qkv, o, gate_up, down;
  void *k_cache, *v_cache;  // [num_slots, Hkv * D] in the step's cache dtype
};

// The token embedding table: float32 rows (format kFloatRows) or GGUF blocks in
// linear_quant's layout (a linear_quant format id), `rows` rows of `hidden` values.
constexpr int32_t kFloatRows = -1;
struct Embedding {
  int32_t format;
  const void* table;
  int64_t rows;
};

struct Step {
  const int64_t* token_ids;  // [tokens]
  Embedding embedding;
  int64_t tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, scale;
  const float *cos, *sin;  // [max_positions, D]: rope_cache's tables (sin signed)
  const int64_t* positions;  // [tokens]
  const int64_t* slots;  // [tokens] flat cache slot of each token
  int64_t num_slots;
  int32_t cache_dtype;
  int64_t block_size, max_blocks;
  const int32_t* block_tables;  // [B, max_blocks]
  // The attention kernel's rows (kernels/attention_cpu.py's CppRows).
  const int64_t *rows, *prefixes, *extra_start, *extra, *group_start, *group_requests;
  int64_t num_groups, head_splits;
  int32_t num_threads;
  const float* final_norm;  // [hidden]: the model's final norm, applied after the last layer
  // EAGLE-3's target features, or null: before layer capture_layers[k] runs, each token's
  // hidden row is copied to columns [k * hidden, (k + 1) * hidden) of its capture row.
  float* capture;  // [tokens, num_captures * hidden]
  const int64_t* capture_layers;  // [num_captures] layer ids (repeats allowed)
  int64_t num_captures;
};

}  // extern "C"

namespace {

struct Buffers {
  std::vector<float> normed, qkv, q, k, attended, out, gate_up, act;
};

constexpr int64_t kKeptTokens = 128;  // steps up to this many tokens keep their buffers

int32_t project(const Kernels& kernels, const Projection& p, const float* x, int64_t tokens, int64_t features,
                float* out, int32_t threads) {
  if (p.kind == kFp16) {
    kernels.linear_fp16(x, tokens, features, static_cast<const uint16_t*>(p.weight), p.rows, p.bias, out, threads);
    return 0;
  }
  const LinearQuantFn run = p.kind == kBlocks ? kernels.linear_quant : kernels.linear_quant_int8;
  return run(p.format, 0, x, tokens, features, static_cast<const uint8_t*>(p.weight), p.rows, p.bias, out, p.rows,
             threads);
}

// dst[h] = rope(src[h]) for `heads` heads of D floats: x * cos + roll(x, D / 2) * sin, as
// specdec/models/llama.py's apply_rope.
void rope(const float* src, int64_t heads, int64_t d, const float* cos, const float* sin, float* dst) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h, src += d, dst += d)
    for (int64_t i = 0; i < d; ++i) {
      const float rolled = src[i < half ? i + half : i - half];
      const float a = src[i] * cos[i], b = rolled * sin[i];
      dst[i] = a + b;
    }
}

// silu(g) * u = g / (1 + exp(-g)) * u, from e = exp(-|g|), which never overflows:
// g / (1 + e) for g >= 0, g e / (1 + e) below.
inline Lanes silu_mul(Lanes g, Lanes u) {
  const Lanes e = exp_nonpositive(g < 0 ? g : -g);
  const Lanes one = Lanes{} + 1.0f;
  return g * (g < 0 ? e : one) / (one + e) * u;
}

// out[t] = silu(gate[t]) * up[t], gate and up the halves of each row of gate_up. In
// lanes: a scalar loop of libm's expf took ~4% of a decode step.
void silu_mul(const float* gate_up, int64_t tokens, int64_t width, float* out) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float *gate = gate_up + t * 2 * width, *up = gate + width;
    float* row = out + t * width;
    int64_t i = 0;
    for (; i + kLanes <= width; i += kLanes) store(row + i, silu_mul(load(gate + i), load(up + i)));
    if (i < width) {  // the tail through the same vector code, so every element rounds alike
      float g[kLanes] = {}, u[kLanes] = {}, r[kLanes];
      std::memcpy(g, gate + i, (width - i) * sizeof(float));
      std::memcpy(u, up + i, (width - i) * sizeof(float));
      store(r, silu_mul(load(g), load(u)));
      std::memcpy(row + i, r, (width - i) * sizeof(float));
    }
  }
}

void add(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// hidden += attention(norm(hidden)), K and V stored on the way.
int32_t attend(const Kernels& kernels, const Layer& layer, const Step& s, float* hidden, Buffers& b) {
  const int64_t T = s.tokens, D = s.head_dim, q_width = s.num_heads * D, kv_width = s.num_kv_heads * D;
  const int64_t qkv_width = q_width + 2 * kv_width;
  kernels.rms_norm(hidden, layer.input_norm, s.eps, b.normed.data(), T, s.hidden, s.num_threads);
  if (project(kernels, layer.qkv, b.normed.data(), T, s.hidden, b.qkv.data(), s.num_threads) != 0) return 1;
  for (int64_t t = 0; t < T; ++t) {
    const float *row = b.qkv.data() + t * qkv_width, *cos = s.cos + s.positions[t] * D, *sin = s.sin + s.positions[t] * D;
    rope(row, s.num_heads, D, cos, sin, b.q.data() + t * q_width);
    rope(row + q_width, s.num_kv_heads, D, cos, sin, b.k.data() + t * kv_width);
  }
  if (kernels.store_kv(b.k.data(), kv_width, b.qkv.data() + q_width + kv_width, qkv_width, layer.k_cache,
                       layer.v_cache, s.cache_dtype, s.slots, T, kv_width, s.num_slots, s.num_threads) >= 0)
    return 2;
  kernels.attention(b.q.data(), b.attended.data(), layer.k_cache, layer.v_cache, nullptr, nullptr, s.cache_dtype,
                    s.block_tables, s.rows, s.prefixes, s.extra_start, s.extra, s.group_start, s.group_requests,
                    s.num_groups, s.num_heads, s.num_kv_heads, D, s.block_size, s.max_blocks, s.scale,
                    s.num_threads, s.head_splits);
  if (project(kernels, layer.o, b.attended.data(), T, q_width, b.out.data(), s.num_threads) != 0) return 1;
  add(hidden, b.out.data(), T * s.hidden);
  return 0;
}

// hidden += mlp(norm(hidden)).
int32_t mlp(const Kernels& kernels, const Layer& layer, const Step& s, float* hidden, Buffers& b) {
  const int64_t T = s.tokens, I = s.intermediate;
  kernels.rms_norm(hidden, layer.post_norm, s.eps, b.normed.data(), T, s.hidden, s.num_threads);
  if (project(kernels, layer.gate_up, b.normed.data(), T, s.hidden, b.gate_up.data(), s.num_threads) != 0) return 1;
  silu_mul(b.gate_up.data(), T, I, b.act.data());
  if (project(kernels, layer.down, b.act.data(), T, I, b.out.data(), s.num_threads) != 0) return 1;
  add(hidden, b.out.data(), T * s.hidden);
  return 0;
}

// hidden[t] = the embedding of token_ids[t] (exact dequantized values). Returns false if
// an id is outside the table (nothing written).
// The residual stream entering layer `layer`, into its columns of the capture buffer.
void capture(const Step& s, int64_t layer, const float* hidden) {
  if (s.capture == nullptr) return;
  const int64_t width = s.num_captures * s.hidden;
  for (int64_t k = 0; k < s.num_captures; ++k)
    if (s.capture_layers[k] == layer)
      for (int64_t t = 0; t < s.tokens; ++t)
        std::memcpy(s.capture + t * width + k * s.hidden, hidden + t * s.hidden, s.hidden * sizeof(float));
}

bool embed(const Kernels& kernels, const Step& s, float* hidden) {
  for (int64_t t = 0; t < s.tokens; ++t)
    if (s.token_ids[t] < 0 || s.token_ids[t] >= s.embedding.rows) return false;
  const Embedding& e = s.embedding;
  if (e.format != kFloatRows) return kernels.dequantize_rows(e.format, static_cast<const uint8_t*>(e.table), s.hidden,
                                                             s.token_ids, s.tokens, hidden) == 0;
  for (int64_t t = 0; t < s.tokens; ++t)
    std::memcpy(hidden + t * s.hidden, static_cast<const float*>(e.table) + s.token_ids[t] * s.hidden,
                s.hidden * sizeof(float));
  return true;
}

}  // namespace

extern "C" {

// hidden: [tokens, hidden] float32, written: the embeddings of the step's tokens, run
// through every layer and the final norm (looked up and normed here because each of
// Python's own calls cost ~0.15-0.25 ms a decode step, its code cold after the weights
// streamed through the caches). Returns 0; 1 if a projection's kernel refused its format
// or this CPU; 2 if a slot is outside the cache (nothing of that layer's K/V written); 3
// if a token id is outside the embedding table (nothing run).
int32_t specdec_decoder_layers(const Kernels* kernels, const Layer* layers, int64_t num_layers, const Step* step,
                               float* hidden) {
  const Step& s = *step;
  const int64_t T = s.tokens, D = s.head_dim;
  if (T == 0) return 0;  // the kernels' row blocking divides by the row count
  thread_local Buffers b;  // kept between calls: no allocation per step
  b.normed.resize(T * s.hidden);
  b.qkv.resize(T * (s.num_heads + 2 * s.num_kv_heads) * D);
  b.q.resize(T * s.num_heads * D);
  b.k.resize(T * s.num_kv_heads * D);
  b.attended.resize(T * s.num_heads * D);
  b.out.resize(T * s.hidden);
  b.gate_up.resize(T * 2 * s.intermediate);
  b.act.resize(T * s.intermediate);
  if (!embed(*kernels, s, hidden)) return 3;
  int32_t status = 0;
  for (int64_t i = 0; i < num_layers && status == 0; ++i) {
    capture(s, i, hidden);
    status = attend(*kernels, layers[i], s, hidden, b);
    if (status == 0) status = mlp(*kernels, layers[i], s, hidden, b);
  }
  if (status == 0) kernels->rms_norm(hidden, s.final_norm, s.eps, hidden, T, s.hidden, s.num_threads);
  // A prefill chunk's buffers (32 KB a token on the default model) are given back, so a
  // long prompt does not leave an idle server holding them; decode and verify steps keep theirs.
  if (T > kKeptTokens) b = Buffers{};
  return status;
}

}  // extern "C"
