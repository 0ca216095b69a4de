// The fused decoder stack of a model of the shared decoder's families (decoder_stack.cpp).
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "cpu_common.h"
#include "int_linear.h"
#include "linear.h"
#include "lora.h"
#include "moe.h"
#include "paged_attention.h"

namespace tokenmill {

struct StackShape {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, hidden = 0, intermediate = 0;
  float eps = 1e-6f;
  int64_t window = 0;  // sliding window, 0: none
  const float* cos = nullptr;  // [max_position, rotary_dim]
  const float* sin = nullptr;  // the same, first half negated (x * cos + swap_halves(x) * sin)
  int64_t max_position = 0;
  int64_t rotary_dim = 0;  // the leading dimensions of a head RoPE rotates (<= head_dim)
  float attention_scale = 0.0f;
  float attention_softcap = 0.0f;  // the attention's scores soft-capped (Gemma 2), 0: none
  bool gelu_tanh = false;  // the MLP's activation: gelu_tanh(gate) * up, else silu(gate) * up
  int64_t block_size = 0;  // of the KV cache, per call
};

struct StepArgs {
  const int64_t* positions;
  const int64_t* slot_mapping;
};

// float32 copies of a layer's small tensors (null where the architecture has none).
struct LayerWeights {
  const float* input_norm;
  const float* qkv_bias;
  const float* q_norm;
  const float* k_norm;
  const float* o_bias;
  const float* post_norm;
  const float* gate_up_bias;
  const float* down_bias;
  // Gemma's sandwich norms of the attention's and the MLP's outputs (null: none).
  const float* attn_out_norm;
  const float* mlp_out_norm;
  // The layer's RoPE tables (the model's, or the local ones) and its window (0: the model's).
  const float* cos;
  const float* sin;
  int64_t window;
};

class DecoderStack {
 public:
  // `layers[i]`: input_norm, qkv_bias, q_norm, k_norm, o_bias, post_norm, gate_up_bias,
  // down_bias, and optionally attn_out_norm, mlp_out_norm (Gemma); None where absent. `linears[i]`: qkv, o, gate_up, down, each dense or quantized, each a list of
  // parts (row ranges in order; one unless the parts' formats differ)
  // (the layer's LinearMethod chose, at load time).
  DecoderStack(const std::vector<std::vector<c10::optional<at::Tensor>>>& layers,
               const std::vector<std::vector<std::vector<PackedLinear>>>& linears,
               const at::Tensor& final_norm, const at::Tensor& cos, const at::Tensor& sin,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               int64_t intermediate_size, double eps, int64_t sliding_window);

  // What other families need, set once after construction: the local layers' RoPE tables
  // (`layer_is_local[i]`: layer i uses them; may be undefined when none does), each layer's
  // sliding window (0: the model's), the attention's scale and the MLP's activation.
  void set_family_options(const at::Tensor& local_cos, const at::Tensor& local_sin,
                          const std::vector<bool>& layer_is_local,
                          const std::vector<int64_t>& layer_windows, double attention_scale,
                          bool gelu_tanh);

  // The final-normed hidden states of `hidden_in` (the embeddings, [T, H]) after every layer;
  // each layer's keys and values go to its cache at `slot_mapping`. Sequence i's queries are
  // tokens [query_start_loc[i], query_start_loc[i + 1]), the last of its seq_lens[i].
  // Each layer's KV group, for a hybrid cache (layers/kv_groups.py); empty: one group.
  void set_kv_groups(const std::vector<int64_t>& layer_groups);
  // Every layer's attention scores soft-capped at `softcap` (Gemma 2); 0: none.
  void set_attention_softcap(double softcap);
  // Whether forward applies the final norm (false: a pipeline stage before the last, whose
  // output is the last layer's sum; `final_norm` then only gives the width and dtype).
  void set_final_norm(bool apply);
  // Multi-LoRA: each layer's adapters on qkv, o, gate_up and down as (a, bt) pairs (8 per
  // layer, None where a linear has none), the `LoRALinear`s' stacked slots, read in place
  // (written between steps as adapters come and go; lora.h). A step's `lora_segments`
  // ([n, 3] int64: first, end, slot) add each adapter row's delta after the base products,
  // inside the stack's own phases.
  void set_lora(const std::vector<std::vector<c10::optional<at::Tensor>>>& layers);
  // Layer `layer`'s MLP is this mixture-of-experts block (built with no gate_up / down
  // linears): `router` float32 [experts, hidden], softmax then the top `top_k`, `renormalize`d
  // (Qwen's norm_topk_prob, Mixtral), the experts' one-job phases inside the stack's job.
  void set_moe(int64_t layer, const MoEExperts& experts, const at::Tensor& router, int64_t top_k,
               bool renormalize);
  at::Tensor forward(const at::Tensor& hidden_in, const at::Tensor& positions,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables,
                     const c10::optional<at::Tensor>& lora_segments = c10::nullopt);

 private:
  struct Layer {
    std::vector<at::Tensor> tensors;  // owns what the views below point into
    std::vector<PackedLinear> linears;  // owns the tensors the parts view
    // qkv, o, gate_up, down: each one or more row ranges of its own format, in row order.
    std::array<std::vector<PackedWeight>, 4> parts;
    LayerWeights weights{};
    // An MoE MLP (set_moe) instead of gate_up / down.
    std::shared_ptr<MoEExperts> moe;
    at::Tensor router;
    int64_t top_k = 0;
    bool renormalize = false;
  };
  // Activations, kept between calls and grown to the largest step seen.
  struct Buffers {
    int64_t rows = 0;
    at::Tensor residual, delta, qkv, gate_up, x, attn, act;
    QuantScratch quant;  // quantized linears' prepared inputs
    MoEPlan moe;         // an MoE layer's routed pairs (one layer at a time)
    void ensure(int64_t tokens, int64_t hidden, int64_t ld_x, int64_t ld_qkv, int64_t ld_attn,
                int64_t ld_gate_up, int64_t ld_act, at::ScalarType act_type);
  };

  StackShape shape_;
  std::vector<Layer> layers_;
  // Each layer's KV group (a hybrid cache: slot_mapping [G, T], block_tables [G, S, M]).
  std::vector<int64_t> layer_groups_;
  at::Tensor final_norm_, cos_, sin_, local_cos_, local_sin_;
  bool is_bf16_ = false;
  bool apply_final_norm_ = true;
  Buffers buffers_;
  std::vector<std::array<LoRAStack, 4>> lora_;  // empty: no adapters
  std::vector<at::Tensor> lora_tensors_;        // what lora_ points into
  int64_t lora_slots_ = 0, lora_width_ = 0;     // the widest of any linear
};

}  // namespace tokenmill
