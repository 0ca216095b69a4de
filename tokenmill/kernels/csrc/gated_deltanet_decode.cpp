// A gated DeltaNet layer's decode rows in one call (models/gated_deltanet.py's decode path,
// which in torch is ~40 small ops a layer: on 2 cores each op costs more than its arithmetic).
// Per row, from its slot: the causal depthwise conv over (conv state, the row's q|k|v) with
// SiLU, the conv state shifted by the row; q and k l2-normalised (q scaled by k_dim^-0.5);
// beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); the gated delta rule in the slot's
// recurrent state (gated_delta.h); the output RMS-normed per head, times the norm's weight and
// SiLU(z). Values are rounded to the model's dtype where the torch path rounds them (the conv
// output, the rule's output, the normed row), so a bfloat16 model gets the torch path's numbers.
#include <cmath>
#include <initializer_list>
#include <vector>

#include "cpu_common.h"
#include "gated_delta.h"
#include "thread_pool.h"

namespace tokenmill {
namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

template <typename T>
inline float rounded(float x) {  // x stored as T and read back
  T stored;
  store_float(&stored, x);
  return load_float(&stored);
}

struct Shape {
  int64_t rows, conv_dim, kernel, k_heads, k_dim, v_heads, v_dim;
  float eps;
};

struct Weights {
  const float* a_log;    // [v_heads]
  const float* dt_bias;  // [v_heads]
  const int64_t* slot;   // [rows]
};

// The conv of row r's q|k|v (SiLU, rounded to T) into y, its slot's conv state shifted.
template <typename T>
void conv_row(const Shape& s, const T* x, const T* weight, T* state, float* y) {
  const int64_t history = s.kernel - 1;
  for (int64_t c = 0; c < s.conv_dim; ++c) {
    T* past = state + c * history;
    const T* w = weight + c * s.kernel;
    float acc = 0.f;
    for (int64_t t = 0; t < history; ++t) acc += load_float(past + t) * load_float(w + t);
    acc += load_float(x + c) * load_float(w + history);
    y[c] = rounded<T>(silu(acc));
    for (int64_t t = 0; t + 1 < history; ++t) past[t] = past[t + 1];
    if (history > 0) past[history - 1] = x[c];
  }
}

// out = (rms_norm(round(o)) rounded, times the weight, rounded) * silu(z), as GatedRMSNorm.
template <typename T>
void gated_norm(const Shape& s, float* o, const T* norm_weight, const T* z, T* out) {
  float sum = 0.f;
  for (int64_t c = 0; c < s.v_dim; ++c) {
    o[c] = rounded<T>(o[c]);
    sum += o[c] * o[c];
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(s.v_dim) + s.eps);
  for (int64_t c = 0; c < s.v_dim; ++c) {
    const float normed = rounded<T>(rounded<T>(o[c] * inv) * load_float(norm_weight + c));
    store_float(out + c, normed * silu(load_float(z + c)));
  }
}

template <typename T>
void decode_rows(const Shape& s, const Weights& p, const T* mixed, const T* z, const T* b,
                 const T* a, const T* conv_weight, T* conv_states, float* state_pool,
                 const T* norm_weight, T* out) {
  const int64_t key_size = s.k_heads * s.k_dim, history = s.kernel - 1;
  std::vector<float> qkv(s.rows * s.conv_dim), qk(s.rows * 2 * key_size);
  const float scale = 1.f / std::sqrt(static_cast<float>(s.k_dim));
  const int threads = team_size();
  parallel_chunks(s.rows, [&](int64_t r, int) {
    float* y = qkv.data() + r * s.conv_dim;
    conv_row<T>(s, mixed + r * s.conv_dim, conv_weight,
                conv_states + p.slot[r] * s.conv_dim * history, y);
    float* normed = qk.data() + r * 2 * key_size;
    for (int64_t h = 0; h < 2 * s.k_heads; ++h) {
      l2_normalize(y + h * s.k_dim, normed + h * s.k_dim, s.k_dim, h < s.k_heads ? scale : 1.f);
    }
  }, s.rows * s.conv_dim >= (1 << 14) ? threads : 1);
  const int64_t jobs = s.rows * s.v_heads, group = s.v_heads / s.k_heads;
  const int isa = current_isa();
  parallel_chunks(jobs, [&](int64_t job, int) {
    const int64_t r = job / s.v_heads, h = job % s.v_heads, kh = h / group;
    const float g = -std::exp(p.a_log[h]) * softplus(load_float(a + job) + p.dt_bias[h]);
    const float* normed = qk.data() + r * 2 * key_size;
    float stack[512];
    std::vector<float> heap;
    if (s.v_dim > 512) heap.resize(s.v_dim);
    float* o = s.v_dim > 512 ? heap.data() : stack;
    run_head(isa, HeadJob{normed + kh * s.k_dim, normed + key_size + kh * s.k_dim,
                          qkv.data() + r * s.conv_dim + 2 * key_size + h * s.v_dim,
                          std::exp(g), 1.f / (1.f + std::exp(-load_float(b + job))),
                          state_pool + (p.slot[r] * s.v_heads + h) * s.k_dim * s.v_dim,
                          o, s.k_dim, s.v_dim});
    gated_norm<T>(s, o, norm_weight, z + job * s.v_dim, out + job * s.v_dim);
  }, jobs * s.k_dim * s.v_dim >= (1 << 15) ? threads : 1);
}

}  // namespace

at::Tensor gated_deltanet_decode(const at::Tensor& mixed, const at::Tensor& z,
                                 const at::Tensor& b, const at::Tensor& a,
                                 const at::Tensor& a_log, const at::Tensor& dt_bias,
                                 const at::Tensor& conv_weight, at::Tensor& conv_states,
                                 at::Tensor& state_pool, const at::Tensor& slots,
                                 const at::Tensor& norm_weight, int64_t k_heads, double eps) {
  const auto dtype = mixed.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "gated_deltanet_decode: float32 or bfloat16 activations");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
           &mixed, &z, &b, &a, &conv_weight, &conv_states, &norm_weight}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous(),
                "gated_deltanet_decode: contiguous tensors of the activations' dtype");
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&a_log, &dt_bias, &state_pool}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "gated_deltanet_decode: A_log, dt_bias and the states float32");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && state_pool.dim() == 4,
              "gated_deltanet_decode: slots int64, state pool [slots, v_heads, k_dim, v_dim]");
  const Shape s{mixed.size(0),      mixed.size(1),      conv_weight.size(1), k_heads,
                state_pool.size(2), state_pool.size(1), state_pool.size(3),  static_cast<float>(eps)};
  TORCH_CHECK(s.k_heads > 0 && s.v_heads % s.k_heads == 0 &&
                  s.conv_dim == 2 * s.k_heads * s.k_dim + s.v_heads * s.v_dim &&
                  conv_weight.size(0) == s.conv_dim && conv_states.dim() == 3 &&
                  conv_states.size(1) == s.conv_dim && conv_states.size(2) == s.kernel - 1 &&
                  z.numel() == s.rows * s.v_heads * s.v_dim && b.numel() == s.rows * s.v_heads &&
                  a.numel() == b.numel() && a_log.numel() == s.v_heads &&
                  dt_bias.numel() == s.v_heads && norm_weight.numel() == s.v_dim &&
                  slots.numel() == s.rows,
              "gated_deltanet_decode: shapes");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < s.rows; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < state_pool.size(0) && slot[r] < conv_states.size(0),
                "gated_deltanet_decode: slot out of range");
  }
  at::Tensor out = at::empty({s.rows, s.v_heads * s.v_dim}, mixed.options());
  const Weights p{a_log.data_ptr<float>(), dt_bias.data_ptr<float>(), slot};
  float* states = state_pool.data_ptr<float>();
  if (dtype == at::kFloat) {
    decode_rows<float>(s, p, mixed.data_ptr<float>(), z.data_ptr<float>(), b.data_ptr<float>(),
                       a.data_ptr<float>(), conv_weight.data_ptr<float>(),
                       conv_states.data_ptr<float>(), states, norm_weight.data_ptr<float>(),
                       out.data_ptr<float>());
  } else {
    decode_rows<bf16>(s, p, mixed.data_ptr<bf16>(), z.data_ptr<bf16>(), b.data_ptr<bf16>(),
                      a.data_ptr<bf16>(), conv_weight.data_ptr<bf16>(),
                      conv_states.data_ptr<bf16>(), states, norm_weight.data_ptr<bf16>(),
                      out.data_ptr<bf16>());
  }
  return out;
}

}  // namespace tokenmill
