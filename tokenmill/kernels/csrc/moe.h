// The routed experts of a mixture-of-experts block in one call (moe.cpp).
#pragma once

#include <vector>

#include "linear.h"

namespace tokenmill {

// The experts' activation of gate/up's row ([2 * size] float32) into [size].
enum MoEActivation : int64_t {
  // silu(gate) * up, gate the first `size` columns and up the rest (Mixtral, Qwen).
  kMoESilu = 0,
  // gpt-oss's clamped SwiGLU on interleaved columns (gate even, up odd): g = min(gate, limit),
  // (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g).
  kMoEClampedSwiglu = 1,
};

// A block's experts, each a gate/up and a down `PackedLinear` of any weight format (dense
// float32/bf16, int8, int4, 5-bit: the layer's LinearMethod chose at load time), optionally
// a bias per expert on each product ([2 * intermediate] and [hidden]; empty: none).
class MoEExperts {
 public:
  MoEExperts(std::vector<PackedLinear> gate_up, std::vector<PackedLinear> down,
             int64_t intermediate_size, std::vector<at::Tensor> gate_up_bias = {},
             std::vector<at::Tensor> down_bias = {}, int64_t activation = kMoESilu,
             double alpha = 1.702, double limit = 7.0);

  // out[t] = sum_j weights[t, j] * down_e(act(gate_up_e(x[t]))), e = ids[t, j]:
  // tokens grouped by expert, each active expert's two products once over its rows (a token
  // batch of one reads only its k experts' weights), the sum in float32. x [T, H] float32 or
  // bfloat16, weights [T, k] float32, ids [T, k] int64; the result in x's dtype.
  // One pool job of five phases (gather, every active expert's gate/up blocks, activation,
  // every active expert's down blocks, each token's sum): at a token batch of one, the k
  // experts' products share the threads instead of taking turns (two dispatches for the block,
  // not 2k). Dense weights of another dtype than x run `per_expert`, which converts.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) const;

  // Whether forward runs each active expert's two products in turn on the pool, through the
  // formats' own `PackedLinear::forward` (the reference the one job equals bit for bit; tests
  // and benchmarks compare the two).
  void set_per_expert(bool per_expert) { per_expert_ = per_expert; }

 private:
  at::Tensor forward_per_expert(const at::Tensor& x, const std::vector<int64_t>& start,
                                const std::vector<int64_t>& token_of,
                                const std::vector<float>& scale) const;
  at::Tensor forward_one_job(const at::Tensor& x, const std::vector<int64_t>& start,
                             const std::vector<int64_t>& token_of, const std::vector<float>& scale,
                             int64_t top_k) const;
  // act (rows `ld_act` elements apart, x's dtype) = the activation of gate/up's float32 rows.
  void activate(int isa, const float* gate_up, void* act, bool is_bf16, int64_t ld_act,
                int64_t rows) const;

  std::vector<PackedLinear> gate_up_, down_;
  std::vector<at::Tensor> gate_up_bias_, down_bias_;  // float32, or empty
  int64_t intermediate_;
  int64_t activation_;
  float alpha_, limit_;
  bool per_expert_ = false;
};

}  // namespace tokenmill
