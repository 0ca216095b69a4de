// The shared decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) run layer after layer in
// one call:
// the whole stack of a step is one phased job on the worker pool (thread_pool.h), its phases
// the norms, the packed linears, RoPE with the cache write, attention and SiLU-mul. What it
// replaces is ~100 torch ops and ~10 thread wake-ups per layer from Python.
//
// Numbers: the residual stream and every linear's output are float32; a linear's input is in
// the weights' dtype (bf16 rounding only where a bf16 product needs it). In float32 this is
// the arithmetic of transformers' Llama (summation orders aside).
#include "decoder_stack.h"

#include "thread_pool.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <utility>

namespace tokenmill {
namespace {

template <typename T>
__attribute__((always_inline)) inline void rms_norm_row(const float* x, const float* weight,
                                                        int64_t size, float eps, T* out) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < size; ++j) squares += x[j] * x[j];
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(size) + eps);
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t j = 0; j < size; ++j) out[j] = weight[j] * (x[j] * inverse);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < size; ++j) store_float(out + j, weight[j] * (x[j] * inverse));
  }
}

// residual (+)= delta (first normed by delta_norm, if given: Gemma's sandwich);
// out = rms_norm(residual) * weight, for rows [r0, r1).
template <typename Act>
__attribute__((always_inline)) inline void add_norm_rows(float* residual, float* delta,
                                                         const float* delta_norm,
                                                         const float* weight, int64_t hidden,
                                                         float eps, Act* out, int64_t ld_out,
                                                         int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    float* x = residual + r * hidden;
    if (delta != nullptr) {
      float* dx = delta + r * hidden;
      if (delta_norm != nullptr) rms_norm_row(dx, delta_norm, hidden, eps, dx);
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j) x[j] += dx[j];
    }
    if (weight == nullptr) {  // no norm: the sum as it is (a pipeline stage's output)
      Act* o = out + r * ld_out;
      for (int64_t j = 0; j < hidden; ++j) store_float(o + j, x[j]);
    } else {
      rms_norm_row(x, weight, hidden, eps, out + r * ld_out);
    }
  }
}

// silu(gate) * up, or gelu_tanh(gate) * up, of a [rows, 2 * size] gate/up row pair -> out.
template <typename Act>
__attribute__((always_inline)) inline void act_mul_rows(const float* gate_up, int64_t ld,
                                                        int64_t size, bool gelu_tanh, Act* out,
                                                        int64_t ld_out, int64_t r0, int64_t r1) {
  // torch's tanh approximation, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3),
  // is x * sigmoid(2u): silu's form (one exp, vectorized) at 2u.
  constexpr float kTwoBeta = 2.0f * 0.7978845608028654f, kKappa = 0.044715f;
  for (int64_t r = r0; r < r1; ++r) {
    const float* gate = gate_up + r * ld;
    const float* up = gate + size;
    Act* o = out + r * ld_out;
    if (gelu_tanh) {
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) {
        const float x = gate[j];
        const float two_u = kTwoBeta * (x + kKappa * x * x * x);
        store_float(o + j, x / (1.0f + exp_approx(-two_u)) * up[j]);
      }
      continue;
    }
#pragma omp simd
    for (int64_t j = 0; j < size; ++j)
      store_float(o + j, gate[j] / (1.0f + exp_approx(-gate[j])) * up[j]);
  }
}

// One head of one token in the QKV output: (q/k norm), RoPE, and for a key head the write of
// its key and value into the cache.
template <typename C>
__attribute__((always_inline)) inline void rope_head(const StackShape& s, float* head,
                                                     const float* norm_weight, const float* cos,
                                                     const float* sin, float* rotated) {
  const int64_t d = s.rotary_dim, half = d / 2;  // the rest of the head passes unrotated
  if (norm_weight != nullptr) rms_norm_row(head, norm_weight, s.head_dim, s.eps, head);
  for (int64_t j = 0; j < d; ++j)
    rotated[j] = head[j] * cos[j] + head[j < half ? j + half : j - half] * sin[j];
  std::memcpy(head, rotated, d * sizeof(float));
}

template <typename C>
__attribute__((always_inline)) inline void rope_and_cache(const StackShape& s, const StepArgs& step,
                                                          const LayerWeights& layer, float* qkv,
                                                          int64_t ld_qkv, C* cache,
                                                          int64_t num_cache_blocks, int64_t u0,
                                                          int64_t u1) {
  const int64_t d = s.head_dim, heads_per_token = s.num_heads + s.num_kv_heads;
  const int64_t cache_block = s.block_size * s.num_kv_heads * d;
  const int64_t value_offset = num_cache_blocks * cache_block;
  float rotated[512];
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t token = u / heads_per_token, h = u % heads_per_token;
    float* row = qkv + token * ld_qkv;
    const int64_t pos = step.positions[token];
    const float* cos = layer.cos + pos * s.rotary_dim;
    const float* sin = layer.sin + pos * s.rotary_dim;
    const bool is_key = h >= s.num_heads;
    rope_head<C>(s, row + h * d, is_key ? layer.k_norm : layer.q_norm, cos, sin, rotated);
    if (!is_key) continue;
    const int64_t slot = step.slot_mapping[token];
    if (slot < 0) continue;
    const int64_t kv_head = h - s.num_heads;
    C* key = cache + (slot * s.num_kv_heads + kv_head) * d;
    C* value = key + value_offset;
    const float* k = row + h * d;
    const float* v = row + (s.num_heads + s.num_kv_heads + kv_head) * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
      store_float(key + j, k[j]);
      store_float(value + j, v[j]);
    }
  }
}

// An MoE layer's router logits, logits[r, e] = router[e] . x[r] (float32 [experts, hidden]),
// for row r and experts [e0, e1): a phase's chunk (a row's experts split across threads where
// the rows are fewer than the threads: one row's 128 x 2048 router is 1 MB to read).
template <typename Act>
__attribute__((always_inline)) inline void router_logits_row(const float* router, int64_t experts,
                                                             int64_t hidden, const Act* x,
                                                             int64_t ld, int64_t r, int64_t e0,
                                                             int64_t e1, float* logits) {
  thread_local std::vector<float> row;
  row.resize(hidden);
  for (int64_t j = 0; j < hidden; ++j) row[j] = load_float(x + r * ld + j);
  for (int64_t e = e0; e < e1; ++e) {
    const float* w = router + e * hidden;
    const float* in = row.data();
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < hidden; ++j) dot += w[j] * in[j];
    logits[r * experts + e] = dot;
  }
}

// Rows [r0, r1)'s routing from their logits: softmax, the top k (ties: the lower expert
// first), optionally renormalized to sum to one (layers/fused_moe.py's `route`).
void top_k_rows(const float* logits, int64_t experts, int64_t top_k, bool renormalize,
                int64_t* ids, float* weights, int64_t r0, int64_t r1) {
  thread_local std::vector<float> probs;
  thread_local std::vector<int64_t> order;
  probs.resize(experts);
  order.resize(experts);
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = logits + r * experts;
    const float top = *std::max_element(row, row + experts);
    float total = 0.0f;
    for (int64_t e = 0; e < experts; ++e) total += probs[e] = std::exp(row[e] - top);
    for (int64_t e = 0; e < experts; ++e) probs[e] /= total;
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
      return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    });
    float chosen = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) chosen += probs[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      ids[r * top_k + j] = order[j];
      weights[r * top_k + j] = renormalize ? probs[order[j]] / chosen : probs[order[j]];
    }
  }
}

// The elementwise phases, each compiled for three ISA levels.
#define TM_ELEMENTWISE_VARIANTS(NAME, ATTR)                                                      \
  template <typename Act>                                                                        \
  ATTR void add_norm_##NAME(float* residual, float* delta, const float* delta_norm,              \
                            const float* weight, int64_t hidden, float eps, Act* out, int64_t ld, \
                            int64_t r0, int64_t r1) {                                            \
    add_norm_rows(residual, delta, delta_norm, weight, hidden, eps, out, ld, r0, r1);            \
  }                                                                                              \
  template <typename Act>                                                                        \
  ATTR void act_mul_##NAME(const float* gate_up, int64_t ld, int64_t size, bool gelu_tanh,       \
                           Act* out, int64_t ld_out, int64_t r0, int64_t r1) {                   \
    act_mul_rows(gate_up, ld, size, gelu_tanh, out, ld_out, r0, r1);                             \
  }                                                                                              \
  template <typename Act>                                                                        \
  ATTR void router_logits_##NAME(const float* router, int64_t experts, int64_t hidden,          \
                                 const Act* x, int64_t ld, int64_t r, int64_t e0, int64_t e1,    \
                                 float* logits) {                                                \
    router_logits_row(router, experts, hidden, x, ld, r, e0, e1, logits);                       \
  }                                                                                              \
  template <typename C>                                                                          \
  ATTR void rope_cache_##NAME(const StackShape& s, const StepArgs& step, const LayerWeights& l,  \
                              float* qkv, int64_t ld, C* cache, int64_t blocks, int64_t u0,      \
                              int64_t u1) {                                                      \
    rope_and_cache(s, step, l, qkv, ld, cache, blocks, u0, u1);                                  \
  }

TM_ELEMENTWISE_VARIANTS(portable, )
TM_ELEMENTWISE_VARIANTS(avx2, TM_AVX2)
TM_ELEMENTWISE_VARIANTS(avx512, TM_AVX512)

template <typename Act>
void add_norm(int isa, float* residual, float* delta, const float* delta_norm, const float* weight,
              int64_t hidden, float eps, Act* out, int64_t ld, int64_t r0, int64_t r1) {
  if (isa >= kAvx512)
    add_norm_avx512(residual, delta, delta_norm, weight, hidden, eps, out, ld, r0, r1);
  else if (isa >= kAvx2)
    add_norm_avx2(residual, delta, delta_norm, weight, hidden, eps, out, ld, r0, r1);
  else add_norm_portable(residual, delta, delta_norm, weight, hidden, eps, out, ld, r0, r1);
}

template <typename Act>
void act_mul(int isa, const float* gate_up, int64_t ld, int64_t size, bool gelu_tanh, Act* out,
             int64_t ld_out, int64_t r0, int64_t r1) {
  if (isa >= kAvx512) act_mul_avx512(gate_up, ld, size, gelu_tanh, out, ld_out, r0, r1);
  else if (isa >= kAvx2) act_mul_avx2(gate_up, ld, size, gelu_tanh, out, ld_out, r0, r1);
  else act_mul_portable(gate_up, ld, size, gelu_tanh, out, ld_out, r0, r1);
}

template <typename Act>
void router_logits(int isa, const float* router, int64_t experts, int64_t hidden, const Act* x,
                   int64_t ld, int64_t r, int64_t e0, int64_t e1, float* logits) {
  if (isa >= kAvx512) router_logits_avx512(router, experts, hidden, x, ld, r, e0, e1, logits);
  else if (isa >= kAvx2) router_logits_avx2(router, experts, hidden, x, ld, r, e0, e1, logits);
  else router_logits_portable(router, experts, hidden, x, ld, r, e0, e1, logits);
}

template <typename C>
void rope_cache(int isa, const StackShape& s, const StepArgs& step, const LayerWeights& l,
                float* qkv, int64_t ld, C* cache, int64_t blocks, int64_t u0, int64_t u1) {
  if (isa >= kAvx512) rope_cache_avx512(s, step, l, qkv, ld, cache, blocks, u0, u1);
  else if (isa >= kAvx2) rope_cache_avx2(s, step, l, qkv, ld, cache, blocks, u0, u1);
  else rope_cache_portable(s, step, l, qkv, ld, cache, blocks, u0, u1);
}

const float* optional_data(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

at::Tensor float_copy(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  return t->detach().to(at::kFloat).contiguous();
}

}  // namespace

DecoderStack::DecoderStack(const std::vector<std::vector<c10::optional<at::Tensor>>>& layers,
                           const std::vector<std::vector<std::vector<PackedLinear>>>& linears,
                           const at::Tensor& final_norm, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t intermediate_size, double eps,
                           int64_t sliding_window) {
  TORCH_CHECK(!layers.empty() && linears.size() == layers.size(), "DecoderStack: layers");
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 512, "DecoderStack: head_dim");
  shape_.num_heads = num_heads;
  shape_.num_kv_heads = num_kv_heads;
  shape_.head_dim = head_dim;
  shape_.hidden = final_norm.size(0);
  shape_.intermediate = intermediate_size;
  shape_.eps = static_cast<float>(eps);
  shape_.window = sliding_window;
  final_norm_ = final_norm.detach().to(at::kFloat).contiguous();
  cos_ = cos.detach().to(at::kFloat).contiguous();
  sin_ = sin.detach().to(at::kFloat).contiguous();
  TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) <= head_dim && cos_.size(1) % 2 == 0 &&
                  sin_.sizes() == cos_.sizes(),
              "DecoderStack: cos/sin [positions, rotary_dim <= head_dim]");
  shape_.cos = cos_.data_ptr<float>();
  shape_.sin = sin_.data_ptr<float>();
  shape_.max_position = cos_.size(0);
  shape_.rotary_dim = cos_.size(1);
  shape_.attention_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t hidden = shape_.hidden;
  // The activations' dtype: the model's (its norms'); dense weights must be in it.
  is_bf16_ = final_norm.scalar_type() == at::kBFloat16;
  // Per layer: input_norm, qkv_bias, q_norm, k_norm, o_bias, post_norm, gate_up_bias,
  // down_bias; and the linears qkv, o, gate_up, down.
  for (size_t li = 0; li < layers.size(); ++li) {
    TORCH_CHECK((layers[li].size() == 8 || layers[li].size() == 10) && linears[li].size() == 4,
                "DecoderStack: 8 (or 10) tensors and 4 linears per layer");
    Layer layer;
    for (const auto& tensor : layers[li]) layer.tensors.push_back(float_copy(tensor));
    // No gate_up and no down: an MoE layer (set_moe).
    const bool moe = linears[li][2].empty() && linears[li][3].empty();
    for (size_t slot = 0; slot < 4; ++slot) {
      TORCH_CHECK(!linears[li][slot].empty() || (moe && slot >= 2),
                  "DecoderStack: a linear of no parts");
      for (const PackedLinear& part : linears[li][slot]) {
        layer.linears.push_back(part);
        layer.parts[slot].push_back(part.weight());
      }
    }
    const auto& t = layer.tensors;
    const bool sandwich = t.size() == 10;
    layer.weights = LayerWeights{optional_data(t[0]),
                                 optional_data(t[1]),
                                 optional_data(t[2]),
                                 optional_data(t[3]),
                                 optional_data(t[4]),
                                 optional_data(t[5]),
                                 optional_data(t[6]),
                                 optional_data(t[7]),
                                 sandwich ? optional_data(t[8]) : nullptr,
                                 sandwich ? optional_data(t[9]) : nullptr,
                                 shape_.cos,
                                 shape_.sin,
                                 sliding_window};
    TORCH_CHECK(layer.weights.input_norm && layer.weights.post_norm, "DecoderStack: norms");
    const std::array<int64_t, 2> shapes[] = {{q_size + 2 * kv_size, hidden},
                                             {hidden, q_size},
                                             {2 * intermediate_size, hidden},
                                             {hidden, intermediate_size}};
    for (size_t slot = 0; slot < (moe ? 2 : 4); ++slot) {
      int64_t rows = 0;
      for (const PackedWeight& w : layer.parts[slot]) {
        TORCH_CHECK(w.k == shapes[slot][1], "DecoderStack: a linear's shape");
        TORCH_CHECK(w.quantized() || w.is_bf16 == is_bf16_,
                    "DecoderStack: dense weights in the model's dtype");
        rows += w.n;
      }
      TORCH_CHECK(rows == shapes[slot][0], "DecoderStack: a linear's shape");
    }
    layers_.push_back(std::move(layer));
  }
}

void DecoderStack::set_final_norm(bool apply) { apply_final_norm_ = apply; }

void DecoderStack::set_moe(int64_t layer, const MoEExperts& experts, const at::Tensor& router,
                           int64_t top_k, bool renormalize) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "DecoderStack: layer");
  Layer& l = layers_[layer];
  TORCH_CHECK(l.parts[2].empty() && l.parts[3].empty(),
              "DecoderStack: an MoE layer has no gate_up / down linears");
  TORCH_CHECK(experts.hidden() == shape_.hidden && experts.one_job_reads(is_bf16_),
              "DecoderStack: the experts take the model's width and activations");
  TORCH_CHECK(router.dim() == 2 && router.size(0) == experts.num_experts() &&
                  router.size(1) == shape_.hidden,
              "DecoderStack: router [experts, hidden]");
  TORCH_CHECK(top_k >= 1 && top_k <= experts.num_experts(), "DecoderStack: top_k");
  l.moe = std::make_shared<MoEExperts>(experts);
  l.router = router.detach().to(at::kFloat).contiguous();
  l.top_k = top_k;
  l.renormalize = renormalize;
}

void DecoderStack::set_family_options(const at::Tensor& local_cos, const at::Tensor& local_sin,
                                      const std::vector<bool>& layer_is_local,
                                      const std::vector<int64_t>& layer_windows,
                                      double attention_scale, bool gelu_tanh) {
  TORCH_CHECK(layer_is_local.size() == layers_.size() && layer_windows.size() == layers_.size(),
              "DecoderStack: one option per layer");
  const bool any_local =
      std::any_of(layer_is_local.begin(), layer_is_local.end(), [](bool b) { return b; });
  if (any_local) {
    local_cos_ = local_cos.detach().to(at::kFloat).contiguous();
    local_sin_ = local_sin.detach().to(at::kFloat).contiguous();
    TORCH_CHECK(local_cos_.sizes() == cos_.sizes() && local_sin_.sizes() == cos_.sizes(),
                "DecoderStack: local cos/sin as the model's");
  }
  for (size_t li = 0; li < layers_.size(); ++li) {
    LayerWeights& w = layers_[li].weights;
    w.cos = layer_is_local[li] ? local_cos_.data_ptr<float>() : shape_.cos;
    w.sin = layer_is_local[li] ? local_sin_.data_ptr<float>() : shape_.sin;
    TORCH_CHECK(layer_windows[li] >= 0, "DecoderStack: a window");
    w.window = layer_windows[li] > 0 ? layer_windows[li] : shape_.window;
  }
  shape_.attention_scale = static_cast<float>(attention_scale);
  shape_.gelu_tanh = gelu_tanh;
}

void DecoderStack::set_attention_softcap(double softcap) {
  TORCH_CHECK(softcap >= 0.0, "DecoderStack: softcap >= 0 (0: none)");
  shape_.attention_softcap = static_cast<float>(softcap);
}

void DecoderStack::set_kv_groups(const std::vector<int64_t>& layer_groups) {
  TORCH_CHECK(layer_groups.empty() || layer_groups.size() == layers_.size(),
              "DecoderStack: one KV group per layer");
  layer_groups_ = layer_groups;
}

at::Tensor DecoderStack::forward(const at::Tensor& hidden_in, const at::Tensor& positions,
                                 const std::vector<at::Tensor>& kv_caches,
                                 const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                                 const at::Tensor& seq_lens, const at::Tensor& block_tables,
                                 const c10::optional<at::Tensor>& lora_segments) {
  const StackShape& s = shape_;
  const int64_t tokens = hidden_in.size(0), hidden = s.hidden;
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.size(1) == hidden, "DecoderStack: hidden [T, H]");
  TORCH_CHECK(kv_caches.size() == layers_.size(), "DecoderStack: one cache per layer");
  // A hybrid cache: one slot mapping and one block table per KV group.
  const int64_t num_groups = block_tables.dim() == 3 ? block_tables.size(0) : 1;
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.numel() == tokens && slot_mapping.numel() == tokens * num_groups,
              "DecoderStack: positions and slot_mapping int64 [T] (or [G, T])");
  for (int64_t g : layer_groups_)
    TORCH_CHECK(g >= 0 && g < num_groups, "DecoderStack: a layer's KV group out of range");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "DecoderStack: attention metadata dtypes");
  TORCH_CHECK(tokens > 0 && query_start_loc[-1].item<int32_t>() == tokens,
              "DecoderStack: query_start_loc must cover every token");
  TORCH_CHECK(positions.max().item<int64_t>() < s.max_position, "DecoderStack: position range");
  const at::Tensor& cache0 = kv_caches[0];
  const bool cache_bf16 = cache0.scalar_type() == at::kBFloat16;
  TORCH_CHECK(cache_bf16 || cache0.scalar_type() == at::kFloat, "DecoderStack: cache dtype");
  for (const auto& cache : kv_caches)
    TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && cache.size(3) == s.num_kv_heads &&
                    cache.size(4) == s.head_dim && cache.scalar_type() == cache0.scalar_type() &&
                    cache.sizes() == cache0.sizes(),
                "DecoderStack: caches [2, blocks, block_size, kv_heads, head_dim]");
  StackShape shape = s;
  shape.block_size = cache0.size(2);
  const int64_t num_cache_blocks = cache0.size(1);

  const auto act_type = is_bf16_ ? at::kBFloat16 : at::kFloat;
  // Linear inputs: as wide as the widest padding any layer's format reads.
  int64_t ld_x = 0, ld_attn = 0, ld_act = 0;
  int64_t ld_qkv = 0, ld_gate_up = 0;
  for (const Layer& layer : layers_) {
    for (size_t slot = 0; slot < 4; ++slot) {
      int64_t& ld_in = slot == 1 ? ld_attn : slot == 3 ? ld_act : ld_x;
      int64_t rows = 0;
      if (layer.parts[slot].empty()) {
        TORCH_CHECK(layer.moe, "DecoderStack: an MoE layer's experts were not set");
        continue;
      }
      for (const PackedWeight& w : layer.parts[slot]) {
        ld_in = std::max(ld_in, w.k_pad);
        rows += w.n;
      }
      // The last part's padding rows fit inside the row stride (its products may write them).
      const int64_t padded = rows - layer.parts[slot].back().n + layer.parts[slot].back().n_pad;
      if (slot == 0) ld_qkv = std::max(ld_qkv, padded);
      if (slot == 2) ld_gate_up = std::max(ld_gate_up, padded);
    }
  }
  Buffers& b = buffers_;
  b.ensure(tokens, hidden, ld_x, ld_qkv, ld_attn, ld_gate_up, ld_act, act_type);
  at::Tensor out = at::empty({tokens, hidden}, hidden_in.options());
  b.residual.narrow(0, 0, tokens).copy_(hidden_in);

  std::vector<StepArgs> steps;
  for (int64_t g = 0; g < num_groups; ++g)
    steps.push_back({positions.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>() + g * tokens});
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t table_width = block_tables.size(-1);
  const std::vector<AttentionTask> tasks =
      attention_tasks(query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), num_seqs,
                      s.num_kv_heads, team_size());
  AttentionArgs attention{b.qkv.data_ptr(), false, ld_qkv, nullptr, cache_bf16, num_cache_blocks,
                          shape.block_size, s.num_kv_heads, s.head_dim, s.num_heads,
                          block_tables.data_ptr<int64_t>(), table_width,
                          query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                          s.window, s.attention_scale,
                          b.attn.data_ptr(), is_bf16_, ld_attn};
  attention.softcap = s.attention_softcap;
  const int64_t scratch_floats = attention_scratch_floats(attention);
  const int isa = current_isa();
  if (isa >= kAmx) amx_permitted();
  const int threads = team_size();
  for (const Layer& layer : layers_)  // before any view: growing moves the buffers
    for (const auto& slot : layer.parts)
      for (const PackedWeight& w : slot)
        if (w.quantized()) b.quant.reserve(w, tokens, isa);
  std::vector<float> scratch(scratch_floats * threads);
  int64_t max_top_k = 0;
  for (const Layer& layer : layers_) max_top_k = std::max(max_top_k, layer.top_k);
  int64_t max_experts = 0;
  for (const Layer& layer : layers_)
    if (layer.moe) max_experts = std::max(max_experts, layer.moe->num_experts());
  std::vector<float> route_logits(tokens * max_experts);
  std::vector<int64_t> route_ids(tokens * max_top_k);
  std::vector<float> route_weights(tokens * max_top_k);
  float* residual = b.residual.data_ptr<float>();
  float* delta = b.delta.data_ptr<float>();
  float* qkv = b.qkv.data_ptr<float>();
  float* gate_up = b.gate_up.data_ptr<float>();
  void* x = b.x.data_ptr();
  void* attn = b.attn.data_ptr();
  void* act = b.act.data_ptr();
  const int64_t units = tokens * (s.num_heads + s.num_kv_heads);
  const int64_t rows_per_chunk = (tokens + 4 * threads - 1) / (4 * threads);
  const int64_t units_per_chunk = (units + 4 * threads - 1) / (4 * threads);
  const int64_t row_chunks = (tokens + rows_per_chunk - 1) / rows_per_chunk;
  const bool bf16_act = is_bf16_;

  PhasedJob job;
  auto rows_of = [=](int64_t chunk, int64_t& r0, int64_t& r1) {
    r0 = chunk * rows_per_chunk;
    r1 = std::min(tokens, r0 + rows_per_chunk);
  };
  auto add_norm_phase = [&](float* add, const float* add_norm_weight, const float* weight,
                            void* dst, int64_t ld, bool to_bf16) {
    job.add_phase(row_chunks, [=, &s](int64_t chunk, int) {
      int64_t r0, r1;
      rows_of(chunk, r0, r1);
      if (to_bf16) {
        add_norm(isa, residual, add, add_norm_weight, weight, s.hidden, s.eps,
                 static_cast<bf16*>(dst), ld, r0, r1);
      } else {
        add_norm(isa, residual, add, add_norm_weight, weight, s.hidden, s.eps,
                 static_cast<float*>(dst), ld, r0, r1);
      }
    }, "add + norm");
  };
  // Multi-LoRA: the step's adapter rows, grouped by adapter; each linear's shrink tasks run
  // beside its products (in their phase: both only read the input), its expand tasks in a phase
  // of their own after them.
  LoRARows lora_rows;
  if (lora_segments.has_value() && lora_segments->defined() && !lora_.empty())
    lora_rows = lora_rows_of(*lora_segments, tokens, lora_slots_);
  const int64_t lora_n = lora_rows.size();
  std::vector<float> lora_shrunk(lora_n * lora_width_);
  struct LoRAShrink {
    int64_t tasks = 0;
    std::function<void(int64_t)> run;
  };
  auto lora_shrink = [&](const LoRAStack* w, const void* input, int64_t ld_in) {
    LoRAShrink shrink;
    if (w != nullptr && !w->empty() && lora_n > 0) {
      shrink.tasks = lora_rows.shrink_tasks(*w);
      shrink.run = [=, &lora_rows, &lora_shrunk](int64_t task) {
        lora_shrink_task(*w, lora_rows, input, ld_in, lora_shrunk.data(), task, isa);
      };
    }
    return shrink;
  };
  auto lora_expand_phase = [&](const LoRAStack* w, float* output, int64_t ld_out) {
    if (w == nullptr || w->empty() || lora_n == 0) return;
    job.add_phase(lora_rows.expand_tasks(*w), [=, &lora_rows, &lora_shrunk](int64_t task, int) {
      lora_expand_task(*w, lora_rows, lora_shrunk.data(), output, ld_out, task, isa);
    }, "lora expand");
  };
  // `extra`: more chunks of the products' phase (a LoRA shrink's tasks).
  const LoRAShrink no_extra;
  auto gemm_phase = [&](const PackedWeight& w, const void* input, int64_t ld_in, float* output,
                        int64_t ld_out, const float* bias, bool prepare, const LoRAShrink& extra,
                        const char* label) {
    const int64_t per = gemm_chunk_blocks(w, tokens, threads);
    const int64_t products = (w.blocks() + per - 1) / per;
    const int64_t extra_chunks = extra.tasks;
    const std::function<void(int64_t)> extra_run = extra.run;
    const GemmOut o{output, ld_out, false, bias, w.n};  // n: no column past the real ones
    if (w.quantized()) {  // its input rows prepared (quantized or widened) once, then products
      const QuantInput in = b.quant.view(w, tokens, isa);
      if (prepare)
        job.add_phase(row_chunks, [=, &w](int64_t chunk, int) {
          int64_t r0, r1;
          rows_of(chunk, r0, r1);
          prepare_quant_rows(w, input, bf16_act, ld_in, in, r0, r1);
        }, "prepare rows");
      job.add_phase(products + extra_chunks, [=, &w](int64_t chunk, int) {
        if (chunk >= products) return extra_run(chunk - products);
        quant_gemm(w, in, o, chunk * per, std::min(w.blocks(), (chunk + 1) * per), isa);
      }, label, w.bytes());
      return;
    }
    job.add_phase(products + extra_chunks, [=, &w](int64_t chunk, int) {
      if (chunk >= products) return extra_run(chunk - products);
      packed_gemm(w, input, ld_in, tokens, o, chunk * per, std::min(w.blocks(), (chunk + 1) * per),
                  isa);
    }, label, w.bytes());
  };
  // A linear held in parts (each its own format): each part's product into its columns.
  auto gemm_parts = [&](const char* label, const std::vector<PackedWeight>& parts,
                        const void* input, int64_t ld_in, float* output, int64_t ld_out,
                        const float* bias, const LoRAStack* lora = nullptr) {
    const LoRAShrink shrink = lora_shrink(lora, input, ld_in);
    // A part after a quantized one reuses its prepared input where it reads the same: the
    // input rows and their group sums depend on k, k_pad and the group only.
    int64_t column = 0;
    const PackedWeight* prepared = nullptr;
    for (const PackedWeight& w : parts) {
      const bool same_input = prepared && w.quantized() && w.k == prepared->k &&
                              w.k_pad == prepared->k_pad && w.group == prepared->group;
      const bool last = &w == &parts.back();
      gemm_phase(w, input, ld_in, output + column, ld_out, bias ? bias + column : nullptr,
                 !same_input, last ? shrink : no_extra, label);
      if (!same_input) prepared = w.quantized() ? &w : nullptr;
      column += w.n;
    }
    lora_expand_phase(lora, output, ld_out);
  };
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& layer = layers_[li];
    const LayerWeights& lw = layer.weights;
    const LoRAStack* lora = lora_n > 0 ? lora_[li].data() : nullptr;  // qkv, o, gate_up, down
    void* cache = kv_caches[li].data_ptr();
    const int64_t group = layer_groups_.empty() ? 0 : layer_groups_[li];
    const StepArgs* step = &steps[group];  // the vector outlives the job
    const int64_t* group_table = block_tables.data_ptr<int64_t>() + group * num_seqs * table_width;
    const float* previous_out_norm = li == 0 ? nullptr : layers_[li - 1].weights.mlp_out_norm;
    add_norm_phase(li == 0 ? nullptr : delta, previous_out_norm, lw.input_norm, x, ld_x, bf16_act);
    gemm_parts("linear qkv", layer.parts[0], x, ld_x, qkv, ld_qkv, lw.qkv_bias, lora);
    job.add_phase((units + units_per_chunk - 1) / units_per_chunk, [=, &shape, &lw](int64_t chunk, int) {
      const int64_t u0 = chunk * units_per_chunk, u1 = std::min(units, u0 + units_per_chunk);
      if (cache_bf16) {
        rope_cache(isa, shape, *step, lw, qkv, ld_qkv, static_cast<bf16*>(cache), num_cache_blocks,
                   u0, u1);
      } else {
        rope_cache(isa, shape, *step, lw, qkv, ld_qkv, static_cast<float*>(cache), num_cache_blocks,
                   u0, u1);
      }
    }, "rope + cache write");
    job.add_phase(static_cast<int64_t>(tasks.size()),
                  [=, &attention, &tasks, &scratch, &lw](int64_t i, int participant) {
                    AttentionArgs a = attention;
                    a.cache = cache;
                    a.block_tables = group_table;
                    a.window = lw.window;
                    attend(a, tasks[i], scratch.data() + participant * scratch_floats, isa);
                  }, "attention");
    gemm_parts("linear o", layer.parts[1], attn, ld_attn, delta, hidden, lw.o_bias, lora ? lora + 1 : nullptr);
    add_norm_phase(delta, lw.attn_out_norm, lw.post_norm, x, ld_x, bf16_act);
    if (layer.moe) {  // routing, then the experts' phases, their sum into delta
      const MoEExperts* moe = layer.moe.get();
      const float* router = layer.router.data_ptr<float>();
      const int64_t experts = moe->num_experts(), top_k = layer.top_k;
      const bool renormalize = layer.renormalize;
      int64_t* ids = route_ids.data();
      float* weights = route_weights.data();
      // Logits: each row's experts in a few chunks where rows are fewer than the threads.
      const int64_t splits = std::min<int64_t>(
          std::max<int64_t>(1, experts / 16), (4 * threads + tokens - 1) / tokens);
      const int64_t per_split = (experts + splits - 1) / splits;
      float* logits = route_logits.data();
      job.add_phase(tokens * splits, [=, &s](int64_t chunk, int) {
        const int64_t r = chunk / splits, e0 = (chunk % splits) * per_split;
        const int64_t e1 = std::min(experts, e0 + per_split);
        if (bf16_act)
          router_logits(isa, router, experts, s.hidden, static_cast<const bf16*>(x), ld_x, r, e0,
                        e1, logits);
        else
          router_logits(isa, router, experts, s.hidden, static_cast<const float*>(x), ld_x, r, e0,
                        e1, logits);
      }, "moe router");
      job.add_phase(row_chunks, [=](int64_t chunk, int) {
        int64_t r0, r1;
        rows_of(chunk, r0, r1);
        top_k_rows(logits, experts, top_k, renormalize, ids, weights, r0, r1);
      }, "moe top-k");
      MoEPlan* plan = &b.moe;
      job.add_phase(1, [=](int64_t, int) {
        moe->plan(*plan, ids, weights, tokens, top_k, bf16_act, isa);
      }, "moe plan");
      moe->add_phases(job, b.moe, x, ld_x, bf16_act, tokens, std::min(experts, tokens * top_k),
                      delta, false, hidden, threads, isa);
      continue;
    }
    gemm_parts("linear gate_up", layer.parts[2], x, ld_x, gate_up, ld_gate_up, lw.gate_up_bias,
               lora ? lora + 2 : nullptr);
    job.add_phase(row_chunks, [=, &s](int64_t chunk, int) {
      int64_t r0, r1;
      rows_of(chunk, r0, r1);
      if (bf16_act) {
        act_mul(isa, gate_up, ld_gate_up, s.intermediate, s.gelu_tanh, static_cast<bf16*>(act),
                ld_act, r0, r1);
      } else {
        act_mul(isa, gate_up, ld_gate_up, s.intermediate, s.gelu_tanh, static_cast<float*>(act),
                ld_act, r0, r1);
      }
    }, "activation");
    gemm_parts("linear down", layer.parts[3], act, ld_act, delta, hidden, lw.down_bias,
               lora ? lora + 3 : nullptr);
  }
  // The final norm, into the output's dtype.
  add_norm_phase(delta, layers_.back().weights.mlp_out_norm,
                 apply_final_norm_ ? final_norm_.data_ptr<float>() : nullptr,
                 out.data_ptr(), hidden, out.scalar_type() == at::kBFloat16);
  WorkerPool::instance().run(job, threads);
  return out;
}

void DecoderStack::Buffers::ensure(int64_t tokens, int64_t hidden, int64_t ld_x, int64_t ld_qkv,
                                   int64_t ld_attn, int64_t ld_gate_up, int64_t ld_act,
                                   at::ScalarType act_type) {
  if (tokens <= rows) return;
  rows = std::max<int64_t>(tokens, 16);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto act_options = at::TensorOptions().dtype(act_type);
  residual = at::empty({rows, hidden}, f32);
  delta = at::empty({rows, hidden}, f32);
  qkv = at::empty({rows, ld_qkv}, f32);
  gate_up = at::empty({rows, ld_gate_up}, f32);
  // Inputs of the linears: zero past each row's k (products read up to k_pad).
  x = at::zeros({rows, ld_x}, act_options);
  attn = at::zeros({rows, ld_attn}, act_options);
  act = at::zeros({rows, ld_act}, act_options);
}

}  // namespace tokenmill
