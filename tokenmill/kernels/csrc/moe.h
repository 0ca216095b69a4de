// The routed experts of a mixture-of-experts block in one call (moe.cpp).
#pragma once

#include <vector>

#include "int_linear.h"
#include "linear.h"
#include "thread_pool.h"

namespace tokenmill {

// One call's (token, choice) pairs grouped by expert, and the buffers the one-job phases use:
// made by `MoEExperts::plan` before the job, or inside it (the decoder stack routes in a phase
// of its own, so the phases read it at run time). Kept between calls (buffers grow).
struct MoEPlan {
  int64_t tokens = 0, top_k = 0, ld_x = 0, ld_act = 0;
  std::vector<int64_t> start;        // [experts + 1]: expert e's pairs [start[e], start[e + 1])
  std::vector<int64_t> token_of;     // [pairs]: each grouped pair's token
  std::vector<float> scale;          // [pairs]: its routing weight
  std::vector<int64_t> token_slots;  // [tokens, top_k]: each token's pairs in expert order
  std::vector<int64_t> active;       // the experts with pairs, in order
  std::vector<QuantInput> gu_in, down_in;
  std::vector<QuantScratch> scratch;  // two per active expert (views invalidate each other)
  at::Tensor xs, act, gate_up, y;     // gathered rows, activations (zero-padded), products
};

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

  // `plan` the pairs of `ids` / `weights` ([tokens, top_k]) for inputs of `is_bf16`.
  void plan(MoEPlan& plan, const int64_t* ids, const float* weights, int64_t tokens,
            int64_t top_k, bool is_bf16, int isa) const;
  // The one-job path's five phases onto `job`, reading `plan` when they run: x [tokens, ldx]
  // (x's dtype `is_bf16`), the weighted sums into `out` (rows `ld_out` apart, bf16 or float32).
  // `max_active`: at most this many experts have pairs (the products' phases have that many
  // experts' chunks; those past the plan's active experts do nothing).
  void add_phases(PhasedJob& job, const MoEPlan& plan, const void* x, int64_t ldx, bool is_bf16,
                  int64_t tokens, int64_t max_active, void* out, bool out_bf16, int64_t ld_out,
                  int threads, int isa) const;
  int64_t num_experts() const { return static_cast<int64_t>(gate_up_.size()); }
  int64_t hidden() const { return gate_up_[0].weight().k; }
  // Whether the one-job path reads inputs of this dtype (dense experts only their own).
  bool one_job_reads(bool is_bf16) const;
  const PackedWeight& gate_up_weight(int64_t e) const { return gate_up_[e].weight(); }

  // Whether forward runs each active expert's two products in turn on the pool, through the
  // formats' own `PackedLinear::forward` (the reference the one job equals bit for bit; tests
  // and benchmarks compare the two).
  void set_per_expert(bool per_expert) { per_expert_ = per_expert; }

 private:
  at::Tensor forward_per_expert(const at::Tensor& x, const std::vector<int64_t>& start,
                                const std::vector<int64_t>& token_of,
                                const std::vector<float>& scale) const;
  at::Tensor forward_one_job(const at::Tensor& x, const at::Tensor& weights,
                             const at::Tensor& ids) const;
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
