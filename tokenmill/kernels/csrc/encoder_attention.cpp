// Bidirectional attention over a step's packed variable-length sequences (an encoder's:
// BERT, XLM-RoBERTa), in one call over every sequence and head, with no padding and no mask.
// The padded-bucket path it replaces (SDPA per bucket of similar lengths, gathers in and
// out) spent ~17% of bge-small's forward on attention whose products are ~7% of its FLOPs:
// head_dim 32 is too narrow for SDPA's kernel, and padding and copies added the rest.
// Work is split by (sequence, head), costliest first, over the project's thread pool; the
// body (encoder_attention_body.h) is compiled for AVX-512, AVX2 and portable C++.
#include <cmath>
#include <vector>

#include "cpu_common.h"
#include "thread_pool.h"

namespace tokenmill {
namespace {

constexpr int64_t kEncoderQueryBlock = 64;  // query rows whose scores are held at once

struct EncoderAttentionArgs {
  const void* query;  // [tokens, heads, d], rows q_stride elements apart
  const void* key;    // [tokens, kv_heads, d], rows k_stride apart
  const void* value;  // [tokens, kv_heads, d], rows v_stride apart
  void* out;          // [tokens, heads, d], rows out_stride apart
  int64_t q_stride, k_stride, v_stride, out_stride;
  int64_t heads, kv_heads, d;
  const int32_t* cu_seqlens;  // [seqs + 1]: sequence s is tokens [cu[s], cu[s + 1])
  float scale;
};

struct EncoderAttentionTask {
  int32_t seq, head, q_begin, q_end;  // q_*: offsets inside the sequence
};

namespace portable {
using VF = float;
constexpr int64_t W = 1;
constexpr int kScoreRows = 4, kScoreVecs = 4, kOutRows = 4, kOutVecs = 4;
inline VF vzero() { return 0.0f; }
inline VF vload(const float* p) { return *p; }
inline void vstore(float* p, VF v) { *p = v; }
inline VF vset1(float x) { return x; }
inline VF vfma(VF a, VF b, VF c) { return a * b + c; }
inline VF vmul(VF a, VF b) { return a * b; }
inline VF vadd(VF a, VF b) { return a + b; }
inline VF vsub(VF a, VF b) { return a - b; }
inline VF vmax(VF a, VF b) { return std::max(a, b); }
inline VF vexp(VF x) { return exp_approx(x); }
inline float reduce_max(VF v) { return v; }
inline float reduce_add(VF v) { return v; }
#include "encoder_attention_body.h"
}  // namespace portable

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using VF = __m256;
constexpr int64_t W = 8;
// 16 registers: 4 x 3 accumulators + 3 key vectors + 1 broadcast; 3 x 4 + 4 + 1 for P.V.
constexpr int kScoreRows = 4, kScoreVecs = 3, kOutRows = 3, kOutVecs = 4;
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF vset1(float x) { return _mm256_set1_ps(x); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
// exp_approx on 8 lanes (its scalar loops did not vectorize here: 8x the softmax's time).
inline VF vexp(VF x) {
  x = _mm256_min_ps(_mm256_max_ps(x, vset1(-87.0f)), vset1(88.0f));
  const VF n = _mm256_round_ps(_mm256_mul_ps(x, vset1(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VF r = _mm256_fnmadd_ps(n, vset1(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, vset1(-2.12194440e-4f), r);
  VF p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vadd(vfma(_mm256_mul_ps(p, r), r, r), vset1(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));  // n in [-126, 127]: one scale
}
inline float reduce_max(VF v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + 8);
}
inline float reduce_add(VF v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  return total;
}
#include "encoder_attention_body.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace avx512 {
using VF = __m512;
constexpr int64_t W = 16;
// 32 registers: 6 x 4 accumulators + 4 + 1; 6 x 4 + 4 + 1 for P.V.
constexpr int kScoreRows = 6, kScoreVecs = 4, kOutRows = 6, kOutVecs = 4;
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF vset1(float x) { return _mm512_set1_ps(x); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
inline VF vexp(VF x) {  // as AVX2's
  x = _mm512_min_ps(_mm512_max_ps(x, vset1(-87.0f)), vset1(88.0f));
  const VF n = _mm512_roundscale_ps(_mm512_mul_ps(x, vset1(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VF r = _mm512_fnmadd_ps(n, vset1(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, vset1(-2.12194440e-4f), r);
  VF p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vadd(vfma(_mm512_mul_ps(p, r), r, r), vset1(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
inline float reduce_max(VF v) { return _mm512_reduce_max_ps(v); }
inline float reduce_add(VF v) { return _mm512_reduce_add_ps(v); }
#include "encoder_attention_body.h"
}  // namespace avx512
#pragma GCC pop_options

template <typename C>
void attend(const EncoderAttentionArgs& a, const EncoderAttentionTask& t, float* s, int isa) {
  if (isa >= kAvx512 && a.d % 16 == 0) avx512::attend_sequence<C>(a, t, s);
  else if (isa >= kAvx2 && a.d % 8 == 0) avx2::attend_sequence<C>(a, t, s);
  else portable::attend_sequence<C>(a, t, s);
}

// Every (sequence, head), costliest first; a sequence's queries split in blocks only where
// there are too few tasks to keep `threads` threads busy.
std::vector<EncoderAttentionTask> encoder_tasks(const int32_t* cu, int64_t seqs, int64_t heads,
                                                int threads) {
  const bool split = seqs * heads < 4 * threads;
  std::vector<std::pair<int64_t, EncoderAttentionTask>> costed;
  for (int64_t s = 0; s < seqs; ++s) {
    const int32_t len = cu[s + 1] - cu[s];
    const int32_t step = split ? static_cast<int32_t>(kEncoderQueryBlock) : std::max(len, 1);
    for (int64_t h = 0; h < heads; ++h)
      for (int32_t q = 0; q < len; q += step)
        costed.push_back({static_cast<int64_t>(len) * std::min(step, len - q),
                          EncoderAttentionTask{static_cast<int32_t>(s), static_cast<int32_t>(h),
                                               q, std::min(len, q + step)}});
  }
  std::stable_sort(costed.begin(), costed.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<EncoderAttentionTask> tasks;
  tasks.reserve(costed.size());
  for (const auto& entry : costed) tasks.push_back(entry.second);
  return tasks;
}

}  // namespace

void encoder_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& cu_seqlens, double scale, at::Tensor& out) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &key, &value, &out}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "encoder_attention: [tokens, heads, d] with contiguous heads expected");
    TORCH_CHECK(t->scalar_type() == query.scalar_type() &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                "encoder_attention: float32 or bfloat16, one dtype for all");
  }
  TORCH_CHECK(out.sizes() == query.sizes(), "encoder_attention: out is query's shape");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) &&
                  key.size(2) == query.size(2) && query.size(1) % key.size(1) == 0,
              "encoder_attention: key and value [tokens, kv_heads, d], heads a multiple");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.is_contiguous() &&
                  cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1,
              "encoder_attention: cu_seqlens int32 [seqs + 1]");
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t seqs = cu_seqlens.size(0) - 1;
  TORCH_CHECK(cu[0] == 0 && cu[seqs] == query.size(0), "encoder_attention: cu_seqlens bounds");
  int64_t longest = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], "encoder_attention: cu_seqlens must not decrease");
    longest = std::max<int64_t>(longest, cu[s + 1] - cu[s]);
  }
  const EncoderAttentionArgs args{query.data_ptr(), key.data_ptr(),  value.data_ptr(),
                                  out.data_ptr(),   query.stride(0), key.stride(0),
                                  value.stride(0),  out.stride(0),   query.size(1),
                                  key.size(1),      query.size(2),   cu,
                                  static_cast<float>(scale)};
  const int threads = team_size();
  const std::vector<EncoderAttentionTask> tasks = encoder_tasks(cu, seqs, args.heads, threads);
  const int isa = current_isa();
  const int64_t cols = (longest + 15) / 16 * 16;  // the widest lanes' padding covers all
  const int64_t d = args.d, block = kEncoderQueryBlock;
  const int64_t scratch_floats = d * cols + longest * d + 2 * block * d + block * cols + block;
  std::vector<float> scratch(scratch_floats * threads);
  const bool bf16_data = query.scalar_type() == at::kBFloat16;
  parallel_chunks(
      static_cast<int64_t>(tasks.size()),
      [&](int64_t i, int participant) {
        float* own = scratch.data() + participant * scratch_floats;
        if (bf16_data) attend<bf16>(args, tasks[i], own, isa);
        else attend<float>(args, tasks[i], own, isa);
      },
      threads);
}

}  // namespace tokenmill
