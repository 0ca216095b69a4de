// The routed experts of an MoE block (moe.h): group the (token, choice) pairs by expert with a
// counting sort, then per active expert gather its rows, gate/up product (+ bias), the
// activation (SiLU(gate) * up, or gpt-oss's clamped SwiGLU), down product (+ bias), and add the
// rows back weighted. The products are the experts' own formats' (PackedLinear's weight, run
// through packed_gemm / quant_gemm), all active experts' blocks in one phase of one pool job
// (llama.cpp's mul_mat_id does the same: one dispatch per phase, not one per expert); the
// elementwise phases below are compiled for three ISA levels.
#include "moe.h"

#include <c10/util/Optional.h>

#include <utility>


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

namespace {

// The (token, choice) pairs grouped by expert (a stable counting sort: tokens in order).
struct Routing {
  std::vector<int64_t> start;     // [experts + 1]: expert e's pairs are [start[e], start[e + 1])
  std::vector<int64_t> token_of;  // [pairs]: each grouped pair's token
  std::vector<float> scale;       // [pairs]: its routing weight
};

Routing group_by_expert(const int64_t* id, const float* weight, int64_t pairs, int64_t top_k,
                        int64_t num_experts) {
  Routing r;
  r.start.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "MoEExperts: expert id ", id[p],
                " out of range");
    ++r.start[id[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) r.start[e + 1] += r.start[e];
  std::vector<int64_t> next(r.start.begin(), r.start.end() - 1);
  r.token_of.resize(pairs);
  r.scale.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t slot = next[id[p]]++;
    r.token_of[slot] = p / top_k;
    r.scale[slot] = weight[p];
  }
  return r;
}

inline int64_t round_up(int64_t value, int64_t to) { return (value + to - 1) / to * to; }

}  // namespace

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
  TORCH_CHECK(x.size(1) == gate_up_[0].weight().k, "MoEExperts: x has ", x.size(1),
              " columns, the experts take ", gate_up_[0].weight().k);
  const bool one_job = !per_expert_ && one_job_reads(is_bf16);
  if (one_job) return forward_one_job(x, weights, ids);
  const Routing routing =
      group_by_expert(ids.data_ptr<int64_t>(), weights.data_ptr<float>(), ids.numel(),
                      ids.size(1), static_cast<int64_t>(gate_up_.size()));
  return forward_per_expert(x, routing.start, routing.token_of, routing.scale);
}

// A dense weight reads rows of its own dtype: other inputs take the per-product path, which
// converts them.
bool MoEExperts::one_job_reads(bool is_bf16) const {
  for (size_t e = 0; e < gate_up_.size(); ++e)
    for (const PackedLinear* linear : {&gate_up_[e], &down_[e]})
      if (!linear->weight().quantized() && linear->weight().is_bf16 != is_bf16) return false;
  return true;
}

at::Tensor MoEExperts::forward_per_expert(const at::Tensor& x, const std::vector<int64_t>& start,
                                          const std::vector<int64_t>& token_of,
                                          const std::vector<float>& scale) const {
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t num_experts = static_cast<int64_t>(gate_up_.size());
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
    activate(isa, gate_up.data_ptr<float>(), act.data_ptr(), is_bf16, intermediate_, rows);
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

void MoEExperts::activate(int isa, const float* gate_up, void* act, bool is_bf16,
                          int64_t ld_act, int64_t rows) const {
  // Row by row when the rows are further apart than the activation's width.
  const int64_t step = ld_act == intermediate_ ? rows : 1;
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    const float* gu = gate_up + r0 * 2 * intermediate_;
    const int64_t n = std::min(step, rows - r0);
    if (is_bf16) {
      bf16* out = static_cast<bf16*>(act) + r0 * ld_act;
      if (activation_ == kMoEClampedSwiglu) clamped_swiglu(isa, gu, intermediate_, out, n, alpha_, limit_);
      else silu_mul(isa, gu, intermediate_, out, n);
    } else {
      float* out = static_cast<float*>(act) + r0 * ld_act;
      if (activation_ == kMoEClampedSwiglu) clamped_swiglu(isa, gu, intermediate_, out, n, alpha_, limit_);
      else silu_mul(isa, gu, intermediate_, out, n);
    }
  }
}

void MoEExperts::plan(MoEPlan& p, const int64_t* ids, const float* weights, int64_t tokens,
                      int64_t top_k, bool is_bf16, int isa) const {
  const int64_t pairs = tokens * top_k;
  Routing routing = group_by_expert(ids, weights, pairs, top_k, num_experts());
  p.tokens = tokens;
  p.top_k = top_k;
  p.start = std::move(routing.start);
  p.token_of = std::move(routing.token_of);
  p.scale = std::move(routing.scale);
  p.active.clear();
  for (int64_t e = 0; e < num_experts(); ++e)
    if (p.start[e + 1] > p.start[e]) p.active.push_back(e);
  // Each token's grouped pairs in expert order: the sum adds them in the order the
  // per-expert path does.
  p.token_slots.assign(pairs, 0);
  std::vector<int64_t> filled(tokens, 0);
  for (int64_t slot = 0; slot < pairs; ++slot) {
    const int64_t t = p.token_of[slot];
    p.token_slots[t * top_k + filled[t]++] = slot;
  }
  // Rows of the gathered inputs and of the activations, zero-padded to a bf16 weight's k_pad
  // (kept between calls: nothing writes the padding).
  const int64_t ld_x = round_up(hidden(), 32), ld_act = round_up(intermediate_, 32);
  const auto dtype = is_bf16 ? at::kBFloat16 : at::kFloat;
  if (!p.xs.defined() || p.xs.size(0) < pairs || p.ld_x != ld_x || p.ld_act != ld_act ||
      p.xs.scalar_type() != dtype) {
    const int64_t rows = std::max<int64_t>(pairs, 8);
    const auto options = at::TensorOptions().dtype(dtype);
    p.xs = at::zeros({rows, ld_x}, options);
    p.act = at::zeros({rows, ld_act}, options);
    p.gate_up = at::empty({rows, 2 * intermediate_}, options.dtype(at::kFloat));
    p.y = at::empty({rows, hidden()}, options.dtype(at::kFloat));
    p.ld_x = ld_x;
    p.ld_act = ld_act;
  }
  const int64_t n_active = static_cast<int64_t>(p.active.size());
  if (p.scratch.size() < static_cast<size_t>(2 * n_active)) p.scratch.resize(2 * n_active);
  p.gu_in.assign(n_active, QuantInput{});
  p.down_in.assign(n_active, QuantInput{});
  for (int64_t a = 0; a < n_active; ++a) {
    const int64_t e = p.active[a], rows = p.start[e + 1] - p.start[e];
    const PackedWeight& wg = gate_up_[e].weight();
    const PackedWeight& wd = down_[e].weight();
    if (wg.quantized()) p.gu_in[a] = p.scratch[2 * a].view(wg, rows, isa);
    if (wd.quantized()) p.down_in[a] = p.scratch[2 * a + 1].view(wd, rows, isa);
  }
}

void MoEExperts::add_phases(PhasedJob& job, const MoEPlan& p, const void* x, int64_t ldx,
                            bool is_bf16, int64_t tokens, int64_t max_active, void* out,
                            bool out_bf16, int64_t ld_out, int threads, int isa) const {
  const int64_t hidden = this->hidden(), width = intermediate_;
  const int64_t elem = is_bf16 ? sizeof(bf16) : sizeof(float);
  // Every expert's products have the same blocks: the same chunks each (a few per thread).
  const PackedWeight& wg0 = gate_up_[0].weight();
  const PackedWeight& wd0 = down_[0].weight();
  const int64_t gu_per = gemm_chunk_blocks(wg0, 1, threads);
  const int64_t down_per = gemm_chunk_blocks(wd0, 1, threads);
  const int64_t gu_chunks = (wg0.blocks() + gu_per - 1) / gu_per;
  const int64_t down_chunks = (wd0.blocks() + down_per - 1) / down_per;
  const char* x_bytes = static_cast<const char*>(x);
  // 1. Each active expert's rows gathered (and prepared for a quantized gate/up).
  job.add_phase(max_active, [=, &p](int64_t a, int) {
    if (a >= static_cast<int64_t>(p.active.size())) return;
    const int64_t e = p.active[a], first = p.start[e], rows = p.start[e + 1] - first;
    char* xs = static_cast<char*>(p.xs.data_ptr());
    for (int64_t r = first; r < first + rows; ++r)
      std::memcpy(xs + r * p.ld_x * elem, x_bytes + p.token_of[r] * ldx * elem, hidden * elem);
    const PackedWeight& w = gate_up_[e].weight();
    if (w.quantized())
      prepare_quant_rows(w, xs + first * p.ld_x * elem, is_bf16, p.ld_x, p.gu_in[a], 0, rows);
  }, "moe gather");
  // 2. gate/up: every active expert's output blocks, one pool of chunks.
  job.add_phase(max_active * gu_chunks, [=, &p](int64_t c, int) {
    const int64_t a = c / gu_chunks, chunk = c % gu_chunks;
    if (a >= static_cast<int64_t>(p.active.size())) return;
    const int64_t e = p.active[a], first = p.start[e], rows = p.start[e + 1] - first;
    const PackedWeight& w = gate_up_[e].weight();
    const GemmOut o{p.gate_up.data_ptr<float>() + first * 2 * width, 2 * width, false,
                    gate_up_bias_.empty() ? nullptr : gate_up_bias_[e].data_ptr<float>(),
                    2 * width};
    const int64_t b0 = chunk * gu_per, b1 = std::min(w.blocks(), b0 + gu_per);
    if (w.quantized()) quant_gemm(w, p.gu_in[a], o, b0, b1, isa);
    else packed_gemm(w, static_cast<char*>(p.xs.data_ptr()) + first * p.ld_x * elem, p.ld_x,
                     rows, o, b0, b1, isa);
  }, "moe linear gate_up", max_active * wg0.bytes());
  // 3. The activation (and the down product's prepared input).
  job.add_phase(max_active, [=, &p](int64_t a, int) {
    if (a >= static_cast<int64_t>(p.active.size())) return;
    const int64_t e = p.active[a], first = p.start[e], rows = p.start[e + 1] - first;
    char* rows_act = static_cast<char*>(p.act.data_ptr()) + first * p.ld_act * elem;
    activate(isa, p.gate_up.data_ptr<float>() + first * 2 * width, rows_act, is_bf16, p.ld_act,
             rows);
    const PackedWeight& w = down_[e].weight();
    if (w.quantized()) prepare_quant_rows(w, rows_act, is_bf16, p.ld_act, p.down_in[a], 0, rows);
  }, "moe activation");
  // 4. down: every active expert's output blocks.
  job.add_phase(max_active * down_chunks, [=, &p](int64_t c, int) {
    const int64_t a = c / down_chunks, chunk = c % down_chunks;
    if (a >= static_cast<int64_t>(p.active.size())) return;
    const int64_t e = p.active[a], first = p.start[e], rows = p.start[e + 1] - first;
    const PackedWeight& w = down_[e].weight();
    const GemmOut o{p.y.data_ptr<float>() + first * hidden, hidden, false,
                    down_bias_.empty() ? nullptr : down_bias_[e].data_ptr<float>(), hidden};
    const int64_t b0 = chunk * down_per, b1 = std::min(w.blocks(), b0 + down_per);
    if (w.quantized()) quant_gemm(w, p.down_in[a], o, b0, b1, isa);
    else packed_gemm(w, static_cast<char*>(p.act.data_ptr()) + first * p.ld_act * elem,
                     p.ld_act, rows, o, b0, b1, isa);
  }, "moe linear down", max_active * wd0.bytes());
  // 5. Each token's weighted sum, into `out`.
  const int64_t per_chunk = std::max<int64_t>(1, (tokens + 4 * threads - 1) / (4 * threads));
  job.add_phase((tokens + per_chunk - 1) / per_chunk, [=, &p](int64_t c, int) {
    thread_local std::vector<float> sum;
    sum.resize(hidden);
    const int64_t zero = 0;
    const float* ys = p.y.data_ptr<float>();
    for (int64_t t = c * per_chunk; t < std::min(tokens, (c + 1) * per_chunk); ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t j = 0; j < p.top_k; ++j) {
        const int64_t slot = p.token_slots[t * p.top_k + j];
        add_weighted_rows(isa, ys + slot * hidden, hidden, 1, &zero, &p.scale[slot], sum.data());
      }
      if (out_bf16) {
        bf16* dst = static_cast<bf16*>(out) + t * ld_out;
        for (int64_t i = 0; i < hidden; ++i) store_float(dst + i, sum[i]);
      } else {
        std::memcpy(static_cast<float*>(out) + t * ld_out, sum.data(), hidden * sizeof(float));
      }
    }
  }, "moe weighted sum");
}

at::Tensor MoEExperts::forward_one_job(const at::Tensor& x, const at::Tensor& weights,
                                       const at::Tensor& ids) const {
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = ids.size(1);
  const int isa = current_isa();
  if (isa >= kAmx) amx_permitted();
  thread_local MoEPlan plan;
  this->plan(plan, ids.data_ptr<int64_t>(), weights.data_ptr<float>(), tokens, top_k, is_bf16,
             isa);
  const int64_t n_active = static_cast<int64_t>(plan.active.size());
  if (n_active == 0) return at::zeros({tokens, hidden}, x.options());
  // Tiny products on the calling thread.
  const PackedWeight& w0 = gate_up_[plan.active[0]].weight();
  const int threads = w0.n_pad * w0.k_pad * std::max<int64_t>(tokens * top_k, 4) * 2 < (1 << 16)
                          ? 1
                          : team_size();
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  PhasedJob job;
  add_phases(job, plan, x.data_ptr(), hidden, is_bf16, tokens, n_active, out.data_ptr(), is_bf16,
             hidden, threads, isa);
  WorkerPool::instance().run(job, threads);
  return out;
}

}  // namespace tokenmill
