// The gated delta rule (gated DeltaNet: Qwen3.5, Qwen3-Next). The decode step: one token of
// each row advances its sequence's recurrent state, read and written in place in its slot of
// the pool. The prefill: one sequence's prompt chunk, token by token, each value head's state
// kept hot in cache across the chunk's tokens (a job per value head). Per (row, value head), with S the [k_dim, v_dim] state:
//   S *= exp(g);  d = beta * (v - k^T S);  S += k d^T;  o = q^T S
// in two passes over S (decay + prediction, then update + read), vectorised along v_dim. q and
// k arrive raw: l2-normalised here (eps 1e-6, as FLA and transformers), q scaled by
// k_dim^-0.5. tokenmill/layers/gated_delta_rule.py is the torch reference.
#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "gated_delta.h"
#include "thread_pool.h"

namespace tokenmill {
namespace {

// The prediction d of a head, on the stack up to this v_dim (a heap vector per head and layer
// was one malloc per job: 16 heads x 18 layers a decode step).
constexpr int64_t kStackVDim = 512;

// Scratch of v_dim floats: the stack buffer, or `heap` sized where v_dim is larger.
inline float* scratch(float* stack, std::vector<float>& heap, int64_t v_dim) {
  if (v_dim <= kStackVDim) return stack;
  heap.assign(v_dim, 0.f);
  return heap.data();
}

void head_portable(const HeadJob& j) {
  float stack[kStackVDim];
  std::vector<float> heap;
  float* delta = scratch(stack, heap, j.v_dim);
  std::fill(delta, delta + j.v_dim, 0.f);
  for (int64_t i = 0; i < j.k_dim; ++i) {
    float* row = j.state + i * j.v_dim;
    for (int64_t c = 0; c < j.v_dim; ++c) {
      row[c] *= j.decay;
      delta[c] += j.k[i] * row[c];
    }
  }
  for (int64_t c = 0; c < j.v_dim; ++c) {
    delta[c] = (j.v[c] - delta[c]) * j.beta;
    j.out[c] = 0.f;
  }
  for (int64_t i = 0; i < j.k_dim; ++i) {
    float* row = j.state + i * j.v_dim;
    for (int64_t c = 0; c < j.v_dim; ++c) {
      row[c] += j.k[i] * delta[c];
      j.out[c] += j.q[i] * row[c];
    }
  }
}

TM_AVX2 void head_avx2(const HeadJob& j) {
  if (j.v_dim % 8) return head_portable(j);
  float stack[kStackVDim];
  std::vector<float> heap;
  float* delta = scratch(stack, heap, j.v_dim);
  std::fill(delta, delta + j.v_dim, 0.f);
  const __m256 decay = _mm256_set1_ps(j.decay);
  for (int64_t i = 0; i < j.k_dim; ++i) {
    float* row = j.state + i * j.v_dim;
    const __m256 ki = _mm256_set1_ps(j.k[i]);
    for (int64_t c = 0; c < j.v_dim; c += 8) {
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + c), decay);
      _mm256_storeu_ps(row + c, s);
      _mm256_storeu_ps(delta + c, _mm256_fmadd_ps(ki, s, _mm256_loadu_ps(delta + c)));
    }
  }
  const __m256 beta = _mm256_set1_ps(j.beta);
  for (int64_t c = 0; c < j.v_dim; c += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(j.v + c), _mm256_loadu_ps(delta + c));
    _mm256_storeu_ps(delta + c, _mm256_mul_ps(d, beta));
    _mm256_storeu_ps(j.out + c, _mm256_setzero_ps());
  }
  for (int64_t i = 0; i < j.k_dim; ++i) {
    float* row = j.state + i * j.v_dim;
    const __m256 ki = _mm256_set1_ps(j.k[i]), qi = _mm256_set1_ps(j.q[i]);
    for (int64_t c = 0; c < j.v_dim; c += 8) {
      const __m256 s = _mm256_fmadd_ps(ki, _mm256_loadu_ps(delta + c), _mm256_loadu_ps(row + c));
      _mm256_storeu_ps(row + c, s);
      _mm256_storeu_ps(j.out + c, _mm256_fmadd_ps(qi, s, _mm256_loadu_ps(j.out + c)));
    }
  }
}

TM_AVX512 void head_avx512(const HeadJob& j) {
  if (j.v_dim % 16) return head_avx2(j);
  float stack[kStackVDim];
  std::vector<float> heap;
  float* delta = scratch(stack, heap, j.v_dim);
  std::fill(delta, delta + j.v_dim, 0.f);
  const __m512 decay = _mm512_set1_ps(j.decay);
  for (int64_t i = 0; i < j.k_dim; ++i) {
    float* row = j.state + i * j.v_dim;
    const __m512 ki = _mm512_set1_ps(j.k[i]);
    for (int64_t c = 0; c < j.v_dim; c += 16) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(row + c), decay);
      _mm512_storeu_ps(row + c, s);
      _mm512_storeu_ps(delta + c, _mm512_fmadd_ps(ki, s, _mm512_loadu_ps(delta + c)));
    }
  }
  const __m512 beta = _mm512_set1_ps(j.beta);
  for (int64_t c = 0; c < j.v_dim; c += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(j.v + c), _mm512_loadu_ps(delta + c));
    _mm512_storeu_ps(delta + c, _mm512_mul_ps(d, beta));
    _mm512_storeu_ps(j.out + c, _mm512_setzero_ps());
  }
  for (int64_t i = 0; i < j.k_dim; ++i) {
    float* row = j.state + i * j.v_dim;
    const __m512 ki = _mm512_set1_ps(j.k[i]), qi = _mm512_set1_ps(j.q[i]);
    for (int64_t c = 0; c < j.v_dim; c += 16) {
      const __m512 s = _mm512_fmadd_ps(ki, _mm512_loadu_ps(delta + c), _mm512_loadu_ps(row + c));
      _mm512_storeu_ps(row + c, s);
      _mm512_storeu_ps(j.out + c, _mm512_fmadd_ps(qi, s, _mm512_loadu_ps(j.out + c)));
    }
  }
}

}  // namespace

void l2_normalize(const float* x, float* out, int64_t n, float scale) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = scale / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
}

void run_head(int isa, const HeadJob& j) {
  if (isa >= kAvx512) {
    head_avx512(j);
  } else if (isa >= kAvx2) {
    head_avx2(j);
  } else {
    head_portable(j);
  }
}

namespace {

// Normalised q (scaled by k_dim^-0.5) and k, once per (token or row, key head).
std::pair<at::Tensor, at::Tensor> normalized_qk(const at::Tensor& query, const at::Tensor& key) {
  const int64_t k_dim = query.size(2), n = query.size(0) * query.size(1);
  at::Tensor qn = at::empty(query.sizes(), query.options());
  at::Tensor kn = at::empty(key.sizes(), key.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(k_dim));
  for (int64_t i = 0; i < n; ++i) {
    l2_normalize(query.data_ptr<float>() + i * k_dim, qn.data_ptr<float>() + i * k_dim, k_dim,
                 scale);
    l2_normalize(key.data_ptr<float>() + i * k_dim, kn.data_ptr<float>() + i * k_dim, k_dim, 1.f);
  }
  return {qn, kn};
}

void check_inputs(const char* name, const at::Tensor& query, const at::Tensor& key,
                  const at::Tensor& value, const at::Tensor& decay, const at::Tensor& beta,
                  const at::Tensor& state) {
  TORCH_CHECK(query.dim() == 3 && key.sizes() == query.sizes() && value.dim() == 3, name,
              ": q, k [rows, k_heads, k_dim], v [rows, v_heads, v_dim]");
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&query, &key, &value, &decay, &beta, &state}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), name,
                ": contiguous float32 tensors expected");
  }
  const int64_t rows = query.size(0), v_heads = value.size(1);
  TORCH_CHECK(value.size(0) == rows && v_heads % query.size(1) == 0, name, ": heads");
  TORCH_CHECK(decay.sizes() == at::IntArrayRef({rows, v_heads}) && beta.sizes() == decay.sizes(),
              name, ": decay, beta [rows, v_heads]");
}

}  // namespace

at::Tensor gated_delta_prefill(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const at::Tensor& decay,
                               const at::Tensor& beta, at::Tensor& state) {
  check_inputs("gated_delta_prefill", query, key, value, decay, beta, state);
  const int64_t tokens = query.size(0), k_heads = query.size(1), k_dim = query.size(2);
  const int64_t v_heads = value.size(1), v_dim = value.size(2);
  TORCH_CHECK(state.dim() == 3 && state.size(0) == v_heads && state.size(1) == k_dim &&
                  state.size(2) == v_dim,
              "gated_delta_prefill: state [v_heads, k_dim, v_dim]");
  auto [qn, kn] = normalized_qk(query, key);
  at::Tensor out = at::empty({tokens, v_heads, v_dim}, value.options());
  const int64_t group = v_heads / k_heads;
  const int isa = current_isa();
  const float* qp = qn.data_ptr<float>();
  const float* kp = kn.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const float* gp = decay.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_chunks(v_heads, [&](int64_t h, int) {
    const int64_t kh = h / group;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t row = t * v_heads + h;
      run_head(isa, HeadJob{qp + (t * k_heads + kh) * k_dim, kp + (t * k_heads + kh) * k_dim,
                            vp + row * v_dim, std::exp(gp[row]), bp[row],
                            sp + h * k_dim * v_dim, op + row * v_dim, k_dim, v_dim});
    }
  }, tokens * v_heads * k_dim * v_dim >= (1 << 15) ? team_size() : 1);
  return out;
}

at::Tensor gated_delta_decode(const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& decay,
                              const at::Tensor& beta, at::Tensor& state_pool,
                              const at::Tensor& slots) {
  check_inputs("gated_delta_decode", query, key, value, decay, beta, state_pool);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "gated_delta_decode: slots int64");
  const int64_t rows = query.size(0), k_heads = query.size(1), k_dim = query.size(2);
  const int64_t v_heads = value.size(1), v_dim = value.size(2);
  TORCH_CHECK(state_pool.dim() == 4 && state_pool.size(1) == v_heads &&
                  state_pool.size(2) == k_dim && state_pool.size(3) == v_dim,
              "gated_delta_decode: state pool [slots, v_heads, k_dim, v_dim]");
  TORCH_CHECK(slots.numel() == rows, "gated_delta_decode: one slot per row");
  const int64_t num_slots = state_pool.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < num_slots, "gated_delta_decode: slot out of range");
  }
  auto [qn, kn] = normalized_qk(query, key);
  at::Tensor out = at::empty({rows, v_heads, v_dim}, value.options());
  const int64_t group = v_heads / k_heads;
  const int isa = current_isa();
  const float* qp = qn.data_ptr<float>();
  const float* kp = kn.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const float* gp = decay.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* sp = state_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t jobs = rows * v_heads;
  parallel_chunks(jobs, [&](int64_t job, int) {
    const int64_t r = job / v_heads, h = job % v_heads, kh = h / group;
    const HeadJob j{qp + (r * k_heads + kh) * k_dim,
                    kp + (r * k_heads + kh) * k_dim,
                    vp + job * v_dim,
                    std::exp(gp[job]),
                    bp[job],
                    sp + (slot[r] * v_heads + h) * k_dim * v_dim,
                    op + job * v_dim,
                    k_dim,
                    v_dim};
    run_head(isa, j);
  }, jobs * k_dim * v_dim >= (1 << 15) ? team_size() : 1);
  return out;
}

}  // namespace tokenmill
