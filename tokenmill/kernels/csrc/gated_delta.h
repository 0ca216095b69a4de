// The gated delta rule's per-(row, value head) step, shared by the decode and prefill kernels
// (gated_delta.cpp) and the fused gated DeltaNet decode (gated_deltanet_decode.cpp).
#pragma once

#include <cstdint>

namespace tokenmill {

struct HeadJob {
  const float* q;  // [k_dim], normalised and scaled
  const float* k;  // [k_dim], normalised
  const float* v;  // [v_dim]
  float decay;     // exp(g)
  float beta;
  float* state;  // [k_dim, v_dim]
  float* out;    // [v_dim]
  int64_t k_dim, v_dim;
};

// S *= decay; d = beta * (v - k^T S); S += k d^T; out = q^T S, at the ISA level `isa`.
void run_head(int isa, const HeadJob& j);

// x * rsqrt(sum(x^2) + 1e-6) * scale, into out (FLA's and transformers' l2norm).
void l2_normalize(const float* x, float* out, int64_t n, float scale);

}  // namespace tokenmill
