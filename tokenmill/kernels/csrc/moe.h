// The routed experts of a mixture-of-experts block in one call (moe.cpp).
#pragma once

#include <vector>

#include "linear.h"

namespace tokenmill {

// A block's experts, each a gate/up and a down `PackedLinear` of any weight format (dense
// float32/bf16, int8, int4: the layer's LinearMethod chose at load time).
class MoEExperts {
 public:
  MoEExperts(std::vector<PackedLinear> gate_up, std::vector<PackedLinear> down,
             int64_t intermediate_size);

  // out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j]:
  // tokens grouped by expert, each active expert's two products once over its rows (a token
  // batch of one reads only its k experts' weights), the sum in float32. x [T, H] float32 or
  // bfloat16, weights [T, k] float32, ids [T, k] int64; the result in x's dtype.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) const;

 private:
  std::vector<PackedLinear> gate_up_, down_;
  int64_t intermediate_;
};

}  // namespace tokenmill
