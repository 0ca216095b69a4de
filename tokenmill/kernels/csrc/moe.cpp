// The routed experts of an MoE block (moe.h): group the (token, choice) pairs by expert with a
// counting sort, then per active expert gather its rows, gate/up product (+ bias), the
// activation (SiLU(gate) * up, or gpt-oss's clamped SwiGLU), down product (+ bias), and add the
// rows back weighted. The products are the experts' own formats'
// (PackedLinear), parallel on the worker pool; the elementwise phases below are compiled for
// three ISA levels.
#include "moe.h"

#include <c10/util/Optional.h>

namespace tokenmill {

namespace {

// act[r] = silu(gate) * up of gate_up's row r ([2 * size] float32), for rows [0, rows).
template <typename Act>
__attribute__((always_inline)) inline void silu_mul_rows(const float* gate_up, int64_t size,
                                                         Act* act, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * size;
    const float* up = gate + size;
    Act* out = act + r * size;
#pragma omp simd
    for (int64_t j = 0; j < size; ++j)
      store_float(out + j, gate[j] / (1.0f + exp_approx(-gate[j])) * up[j]);
  }
}

// out[token_of[r]] += scale[r] * y[r] for rows [0, rows) of y ([rows, hidden] float32).
__attribute__((always_inline)) inline void add_rows(const float* y, int64_t hidden, int64_t rows,
                                                    const int64_t* token_of, const float* scale,
                                                    float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = y + r * hidden;
    float* dst = out + token_of[r] * hidden;
    const float s = scale[r];
#pragma omp simd
    for (int64_t j = 0; j < hidden; ++j) dst[j] += s * src[j];
  }
}

// act[r] = gpt-oss's clamped SwiGLU of gate_up's row r, its gate and up columns interleaved.
template <typename Act>
__attribute__((always_inline)) inline void clamped_swiglu_rows(const float* gate_up, int64_t size,
                                                               Act* act, int64_t rows,
                                                               float alpha, float limit) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* pair = gate_up + r * 2 * size;
    Act* out = act + r * size;
#pragma omp simd
    for (int64_t j = 0; j < size; ++j) {
      const float gate = std::min(pair[2 * j], limit);
      const float up = std::min(std::max(pair[2 * j + 1], -limit), limit);
      store_float(out + j, (up + 1.0f) * gate / (1.0f + exp_approx(-alpha * gate)));
    }
  }
}

#define TM_MOE_VARIANTS(NAME, ATTR)                                                       \
  template <typename Act>                                                                 \
  ATTR void silu_mul_##NAME(const float* gate_up, int64_t size, Act* act, int64_t rows) { \
    silu_mul_rows(gate_up, size, act, rows);                                              \
  }                                                                                       \
  template <typename Act>                                                                 \
  ATTR void swiglu_##NAME(const float* gate_up, int64_t size, Act* act, int64_t rows,     \
                          float alpha, float limit) {                                     \
    clamped_swiglu_rows(gate_up, size, act, rows, alpha, limit);                          \
  }                                                                                       \
  ATTR void add_rows_##NAME(const float* y, int64_t hidden, int64_t rows,                 \
                            const int64_t* token_of, const float* scale, float* out) {    \
    add_rows(y, hidden, rows, token_of, scale, out);                                      \
  }

TM_MOE_VARIANTS(portable, )
TM_MOE_VARIANTS(avx2, TM_AVX2)
TM_MOE_VARIANTS(avx512, TM_AVX512)

template <typename Act>
void silu_mul(int isa, const float* gate_up, int64_t size, Act* act, int64_t rows) {
  if (isa >= kAvx512) silu_mul_avx512(gate_up, size, act, rows);
  else if (isa >= kAvx2) silu_mul_avx2(gate_up, size, act, rows);
  else silu_mul_portable(gate_up, size, act, rows);
}

template <typename Act>
void clamped_swiglu(int isa, const float* gate_up, int64_t size, Act* act, int64_t rows,
                    float alpha, float limit) {
  if (isa >= kAvx512) swiglu_avx512(gate_up, size, act, rows, alpha, limit);
  else if (isa >= kAvx2) swiglu_avx2(gate_up, size, act, rows, alpha, limit);
  else swiglu_portable(gate_up, size, act, rows, alpha, limit);
}

c10::optional<at::Tensor> bias_of(const std::vector<at::Tensor>& biases, int64_t e) {
  if (biases.empty()) return c10::nullopt;
  return biases[e];
}

void add_weighted_rows(int isa, const float* y, int64_t hidden, int64_t rows,
                       const int64_t* token_of, const float* scale, float* out) {
  if (isa >= kAvx512) add_rows_avx512(y, hidden, rows, token_of, scale, out);
  else if (isa >= kAvx2) add_rows_avx2(y, hidden, rows, token_of, scale, out);
  else add_rows_portable(y, hidden, rows, token_of, scale, out);
}

// Per-expert biases as float32 of `size` values each, checked (empty stays empty).
std::vector<at::Tensor> float_biases(const std::vector<at::Tensor>& biases, size_t experts,
                                     int64_t size, const char* name) {
  TORCH_CHECK(biases.empty() || biases.size() == experts, "MoEExperts: ", name,
              " biases: one per expert or none");
  std::vector<at::Tensor> out;
  for (const at::Tensor& bias : biases) {
    TORCH_CHECK(bias.numel() == size, "MoEExperts: a ", name, " bias has ", bias.numel(),
                " values, not ", size);
    out.push_back(bias.to(at::kFloat).contiguous().view({size}));
  }
  return out;
}

}  // namespace

MoEExperts::MoEExperts(std::vector<PackedLinear> gate_up, std::vector<PackedLinear> down,
                       int64_t intermediate_size, std::vector<at::Tensor> gate_up_bias,
                       std::vector<at::Tensor> down_bias, int64_t activation, double alpha,
                       double limit)
    : gate_up_(std::move(gate_up)),
      down_(std::move(down)),
      intermediate_(intermediate_size),
      activation_(activation),
      alpha_(static_cast<float>(alpha)),
      limit_(static_cast<float>(limit)) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(),
              "MoEExperts: one gate/up and one down linear per expert");
  TORCH_CHECK(activation == kMoESilu || activation == kMoEClampedSwiglu,
              "MoEExperts: activation ", activation, " is not 0 (silu) or 1 (clamped swiglu)");
  gate_up_bias_ = float_biases(gate_up_bias, gate_up_.size(), 2 * intermediate_size, "gate/up");
  down_bias_ = float_biases(down_bias, down_.size(), gate_up_[0].weight().k, "down");
  for (size_t e = 0; e < gate_up_.size(); ++e) {
    TORCH_CHECK(gate_up_[e].weight().n == 2 * intermediate_size &&
                    down_[e].weight().k == intermediate_size &&
                    down_[e].weight().n == gate_up_[e].weight().k,
                "MoEExperts: expert ", e, "'s linears do not fit together");
  }
}

at::Tensor MoEExperts::forward(const at::Tensor& x, const at::Tensor& weights,
                               const at::Tensor& ids) const {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "MoEExperts: x must be contiguous [T, H]");
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(is_bf16 || x.scalar_type() == at::kFloat, "MoEExperts: x float32 or bfloat16");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                  ids.size(0) == x.size(0),
              "MoEExperts: ids must be contiguous int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(),
              "MoEExperts: weights must be contiguous float32 [T, k]");
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = ids.size(1);
  const int64_t num_experts = static_cast<int64_t>(gate_up_.size());
  TORCH_CHECK(hidden == gate_up_[0].weight().k, "MoEExperts: x has ", hidden,
              " columns, the experts take ", gate_up_[0].weight().k);
  const int64_t pairs = tokens * top_k;
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* weight = weights.data_ptr<float>();

  // Counting sort of the (token, choice) pairs by expert, stable (tokens in order).
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "MoEExperts: expert id ", id[p],
                " out of range");
    ++start[id[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1), token_of(pairs);
  std::vector<float> scale(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t slot = next[id[p]]++;
    token_of[slot] = p / top_k;
    scale[slot] = weight[p];
  }

  const int isa = current_isa();
  at::Tensor out = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  float* out_data = out.data_ptr<float>();
  const size_t row_bytes = hidden * x.element_size();
  const char* x_bytes = static_cast<const char*>(x.data_ptr());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    const int64_t* rows_token = token_of.data() + start[e];
    at::Tensor xe = at::empty({rows, hidden}, x.options());
    char* xe_bytes = static_cast<char*>(xe.data_ptr());
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(xe_bytes + r * row_bytes, x_bytes + rows_token[r] * row_bytes, row_bytes);
    const at::Tensor gate_up = gate_up_[e].forward(xe, bias_of(gate_up_bias_, e), true);
    at::Tensor act = at::empty({rows, intermediate_}, x.options());
    const float* gu = gate_up.data_ptr<float>();
    if (activation_ == kMoEClampedSwiglu && is_bf16)
      clamped_swiglu(isa, gu, intermediate_, act.data_ptr<bf16>(), rows, alpha_, limit_);
    else if (activation_ == kMoEClampedSwiglu)
      clamped_swiglu(isa, gu, intermediate_, act.data_ptr<float>(), rows, alpha_, limit_);
    else if (is_bf16)
      silu_mul(isa, gu, intermediate_, act.data_ptr<bf16>(), rows);
    else
      silu_mul(isa, gu, intermediate_, act.data_ptr<float>(), rows);
    const at::Tensor y = down_[e].forward(act, bias_of(down_bias_, e), /*float32_out=*/true);
    add_weighted_rows(isa, y.data_ptr<float>(), hidden, rows, rows_token,
                      scale.data() + start[e], out_data);
  }
  if (!is_bf16) return out;
  at::Tensor rounded = at::empty({tokens, hidden}, x.options());
  bf16* dst = rounded.data_ptr<bf16>();
  for (int64_t i = 0; i < tokens * hidden; ++i) store_float(dst + i, out_data[i]);
  return rounded;
}

}  // namespace tokenmill
