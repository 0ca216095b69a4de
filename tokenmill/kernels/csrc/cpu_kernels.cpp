// tokenmill's CPU kernels: few-row dense linears at the memory roof and paged attention that
// reads the KV cache's blocks in place. One translation unit, each hot loop compiled for
// several instruction sets (GCC target attributes) and picked at run time (`set_isa`).
//
// ISA levels: 0 = portable C++, 1 = AVX2 + FMA, 2 = AVX-512 (F, BW, VL, DQ), 3 = AVX-512 with
// BF16 dot products (vdpbf16ps). Python (tokenmill/kernels/native.py) sets the level: the
// CPU's best, or lower through TOKENMILL_CPU_ISA so that tests run every path on one machine.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

int g_isa = 0;

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return __builtin_cpu_supports("avx512bf16") ? 3 : 2;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

inline float bf16_bits_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline float load_float(const float* p) { return *p; }
inline float load_float(const bf16* p) { return bf16_bits_to_float(p->x); }
inline void store_float(float* p, float v) { *p = v; }
inline void store_float(bf16* p, float v) { *p = bf16(v); }  // round to nearest even

// ---------------------------------------------------------------------------------------------
// Dense linear, out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]), for a few rows r.
//
// Each thread streams a contiguous run of weight rows once; the few activation rows stay in L1.
// Activations for the non-bf16-dot paths are widened to float32 once per call (`xf`).

struct LinearArgs {
  const void* x;    // [rows, k], x's dtype (only for the bf16-dot path)
  const float* xf;  // [rows, k] float32 copy of x
  const void* w;    // [n, k]
  const void* bias; // [n] or null
  void* out;        // [rows, n]
  int64_t rows, k, n;
};

template <typename W>
inline float dot_portable(const float* x, const W* w, int64_t k) {
  float partial[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16)
    for (int j = 0; j < 16; ++j) partial[j] += x[i + j] * load_float(w + i + j);
  float sum = 0;
  for (int j = 0; j < 16; ++j) sum += partial[j];
  for (; i < k; ++i) sum += x[i] * load_float(w + i);
  return sum;
}

__attribute__((target("avx2,fma"))) inline __m256 load8_avx2(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma"))) inline __m256 load8_avx2(const bf16* p) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

template <typename W>
__attribute__((target("avx2,fma"))) float dot_avx2(const float* x, const W* w, int64_t k) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8_avx2(w + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), load8_avx2(w + i + 8), acc1);
  }
  for (; i + 8 <= k; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8_avx2(w + i), acc0);
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  float sum = _mm_cvtss_f32(half);
  for (; i < k; ++i) sum += x[i] * load_float(w + i);
  return sum;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) inline __m512 load16_avx512(
    const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) inline __m512 load16_avx512(
    const bf16* p, __mmask16 mask) {
  __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename W>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) float dot_avx512(
    const float* x, const W* w, int64_t k) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load16_avx512(w + i, 0xFFFF), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), load16_avx512(w + i + 16, 0xFFFF), acc1);
  }
  for (; i < k; i += 16) {
    __mmask16 mask = k - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k - i)) - 1);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + i), load16_avx512(w + i, mask), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) float dot_avx512bf16(
    const bf16* x, const bf16* w, int64_t k) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(x + i),
                            (__m512bh)_mm512_loadu_si512(w + i));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(x + i + 32),
                            (__m512bh)_mm512_loadu_si512(w + i + 32));
  }
  for (; i < k; i += 32) {
    int64_t left = std::min<int64_t>(k - i, 32);
    __mmask32 mask = left == 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << left) - 1);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i),
                            (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// Four activation rows against one weight row: each weight vector loaded once for all four.
template <typename W>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void dot4_avx512(
    const float* x, int64_t ldx, const W* w, int64_t k, float* sums) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  __m512 acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    __mmask16 mask = k - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k - i)) - 1);
    __m512 wv = load16_avx512(w + i, mask);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + i), wv, acc0);
    acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + ldx + i), wv, acc1);
    acc2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + 2 * ldx + i), wv, acc2);
    acc3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + 3 * ldx + i), wv, acc3);
  }
  sums[0] = _mm512_reduce_add_ps(acc0);
  sums[1] = _mm512_reduce_add_ps(acc1);
  sums[2] = _mm512_reduce_add_ps(acc2);
  sums[3] = _mm512_reduce_add_ps(acc3);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void dot4_avx512bf16(
    const bf16* x, int64_t ldx, const bf16* w, int64_t k, float* sums) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  __m512 acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    int64_t left = std::min<int64_t>(k - i, 32);
    __mmask32 mask = left == 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << left) - 1);
    __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i), wv);
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + ldx + i), wv);
    acc2 = _mm512_dpbf16_ps(acc2, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + 2 * ldx + i), wv);
    acc3 = _mm512_dpbf16_ps(acc3, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + 3 * ldx + i), wv);
  }
  sums[0] = _mm512_reduce_add_ps(acc0);
  sums[1] = _mm512_reduce_add_ps(acc1);
  sums[2] = _mm512_reduce_add_ps(acc2);
  sums[3] = _mm512_reduce_add_ps(acc3);
}

template <typename T>
void linear_rows(const LinearArgs& a, int64_t n_begin, int64_t n_end, int isa) {
  const T* w = static_cast<const T*>(a.w);
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const T* w_row = w + n * a.k;
    float b = bias ? load_float(bias + n) : 0.0f;
    int64_t r = 0;
    if (isa >= 2) {
      for (; r + 4 <= a.rows; r += 4) {
        float sums[4];
        if constexpr (std::is_same_v<T, bf16>) {
          if (isa >= 3) dot4_avx512bf16(static_cast<const bf16*>(a.x) + r * a.k, a.k, w_row, a.k, sums);
          else dot4_avx512(a.xf + r * a.k, a.k, w_row, a.k, sums);
        } else {
          dot4_avx512(a.xf + r * a.k, a.k, w_row, a.k, sums);
        }
        for (int j = 0; j < 4; ++j) store_float(out + (r + j) * a.n + n, sums[j] + b);
      }
    }
    for (; r < a.rows; ++r) {
      float sum;
      if constexpr (std::is_same_v<T, bf16>) {
        if (isa >= 3) {
          sum = dot_avx512bf16(static_cast<const bf16*>(a.x) + r * a.k, w_row, a.k);
          store_float(out + r * a.n + n, sum + b);
          continue;
        }
      }
      const float* x_row = a.xf + r * a.k;
      if (isa >= 2) sum = dot_avx512(x_row, w_row, a.k);
      else if (isa == 1) sum = dot_avx2(x_row, w_row, a.k);
      else sum = dot_portable(x_row, w_row, a.k);
      store_float(out + r * a.n + n, sum + b);
    }
  }
}

at::Tensor few_row_linear(const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_row_linear: x [rows, k] and weight [n, k] expected");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "few_row_linear: x and weight dtypes differ");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "few_row_linear: float32 or bfloat16 only");
  TORCH_CHECK(weight.is_contiguous(), "few_row_linear: weight must be contiguous");
  at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), n = weight.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(x.scalar_type()).contiguous();
    TORCH_CHECK(b.numel() == n, "few_row_linear: bias size");
  }
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const int isa = g_isa;
  at::Tensor xf = (is_bf16 && isa < 3) ? xc.to(at::kFloat) : xc;
  LinearArgs args{xc.data_ptr(),
                  is_bf16 && isa >= 3 ? nullptr : xf.data_ptr<float>(),
                  weight.data_ptr(),
                  b.defined() ? b.data_ptr() : nullptr,
                  out.data_ptr(),
                  rows, k, n};
  // Chunks of whole weight rows, at least ~64 KB each so tiny weights stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (k * weight.element_size()));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    if (is_bf16) linear_rows<bf16>(args, begin, end, isa);
    else linear_rows<float>(args, begin, end, isa);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Paged attention for groups of short queries (decodes, speculative verification, short chunks).
//
// Sequence s has queries [query_start_loc[s], query_start_loc[s + 1]) of the flat tokens, the
// last ones of its seq_lens[s] tokens; query i (position p) sees keys at positions
// (p - window, p] (window 0: all up to p). Keys and values are read where they lie, block by
// block through the block table. One task per (sequence, KV head) attends all of that head's
// query heads (GQA): each key row is read once for all of them.

struct AttentionArgs {
  const void* query;  // [tokens, heads, d], token stride q_stride
  int64_t q_stride;
  const void* cache;  // [2, blocks, block_size, kv_heads, d]
  int64_t num_blocks, block_size, kv_heads, d, heads;
  const int64_t* block_tables;  // [seqs, max_blocks]
  int64_t max_blocks;
  const int32_t* query_start_loc;  // [seqs + 1]
  const int32_t* seq_lens;         // [seqs]
  int64_t window;
  float scale;
  void* out;  // [tokens, heads, d] contiguous
};

// `omp simd` lets the compiler reassociate the sum (vector partial sums, one horizontal add).
template <typename T>
__attribute__((always_inline)) inline float dot_row(const float* q, const T* k, int64_t d) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += q[i] * load_float(k + i);
  return sum;
}

template <typename T>
__attribute__((always_inline)) inline void axpy_row(float* acc, float p, const T* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * load_float(v + i);
}

template <typename T>
__attribute__((always_inline)) inline void attend_task(const AttentionArgs& a, int64_t seq,
                                                       int64_t kv_head, std::vector<float>& buf) {
  const T* cache = static_cast<const T*>(a.cache);
  const T* query = static_cast<const T*>(a.query);
  T* out = static_cast<T*>(a.out);
  const int64_t group = a.heads / a.kv_heads, d = a.d;
  const int64_t q_begin = a.query_start_loc[seq], q_end = a.query_start_loc[seq + 1];
  const int64_t seq_len = a.seq_lens[seq], num_queries = q_end - q_begin;
  const int64_t row = a.kv_heads * d;  // elements per cache slot
  const int64_t value_offset = a.num_blocks * a.block_size * row;
  const int64_t* table = a.block_tables + seq * a.max_blocks;
  buf.resize(static_cast<size_t>(group * (d + d + seq_len)));
  float* qf = buf.data();            // [group, d]
  float* acc = qf + group * d;       // [group, d]
  float* scores = acc + group * d;   // [group, seq_len]
  for (int64_t i = 0; i < num_queries; ++i) {
    const int64_t token = q_begin + i, position = seq_len - num_queries + i;
    const int64_t hi = position + 1;
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, hi - a.window) : 0;
    const int64_t span = hi - lo;
    for (int64_t g = 0; g < group; ++g) {
      const T* q = query + token * a.q_stride + (kv_head * group + g) * d;
      for (int64_t j = 0; j < d; ++j) qf[g * d + j] = load_float(q + j) * a.scale;
    }
    // Keys block by block: one table lookup per block, then consecutive slots.
    for (int64_t pos = lo; pos < hi;) {
      const int64_t offset = pos % a.block_size, run = std::min(a.block_size - offset, hi - pos);
      const T* key = cache + (table[pos / a.block_size] * a.block_size + offset) * row + kv_head * d;
      for (int64_t t = 0; t < run; ++t, key += row)
        for (int64_t g = 0; g < group; ++g)
          scores[g * seq_len + pos - lo + t] = dot_row(qf + g * d, key, d);
      pos += run;
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * seq_len;
      float max_score = -INFINITY;
      for (int64_t j = 0; j < span; ++j) max_score = std::max(max_score, s[j]);
      float total = 0;
      for (int64_t j = 0; j < span; ++j) {
        s[j] = std::exp(s[j] - max_score);
        total += s[j];
      }
      const float inverse = 1.0f / total;
      for (int64_t j = 0; j < span; ++j) s[j] *= inverse;
    }
    std::fill(acc, acc + group * d, 0.0f);
    for (int64_t pos = lo; pos < hi;) {
      const int64_t offset = pos % a.block_size, run = std::min(a.block_size - offset, hi - pos);
      const T* value = cache + value_offset +
                       (table[pos / a.block_size] * a.block_size + offset) * row + kv_head * d;
      for (int64_t t = 0; t < run; ++t, value += row)
        for (int64_t g = 0; g < group; ++g)
          axpy_row(acc + g * d, scores[g * seq_len + pos - lo + t], value, d);
      pos += run;
    }
    for (int64_t g = 0; g < group; ++g) {
      T* o = out + (token * a.heads + kv_head * group + g) * d;
      for (int64_t j = 0; j < d; ++j) store_float(o + j, acc[g * d + j]);
    }
  }
}

template <typename T>
void attend_portable(const AttentionArgs& a, int64_t s, int64_t h, std::vector<float>& buf) {
  attend_task<T>(a, s, h, buf);
}
template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(const AttentionArgs& a, int64_t s, int64_t h,
                                                     std::vector<float>& buf) {
  attend_task<T>(a, s, h, buf);
}
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void attend_avx512(
    const AttentionArgs& a, int64_t s, int64_t h, std::vector<float>& buf) {
  attend_task<T>(a, s, h, buf);
}

template <typename T>
void attend(const AttentionArgs& a, int64_t seq, int64_t kv_head, std::vector<float>& buf, int isa) {
  if (isa >= 2) attend_avx512<T>(a, seq, kv_head, buf);
  else if (isa == 1) attend_avx2<T>(a, seq, kv_head, buf);
  else attend_portable<T>(a, seq, kv_head, buf);
}

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, int64_t window, double scale,
                     at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_attention: query [tokens, heads, d] with contiguous heads expected");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2,
              "paged_attention: cache [2, blocks, block_size, kv_heads, d] expected");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "paged_attention: query, cache and out dtypes differ");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_attention: float32 or bfloat16 only");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "paged_attention: out");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "paged_attention: block_tables int64");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_attention: query_start_loc and seq_lens int32");
  const int64_t num_seqs = seq_lens.size(0), kv_heads = kv_cache.size(3);
  TORCH_CHECK(query.size(1) % kv_heads == 0 && kv_cache.size(4) == query.size(2),
              "paged_attention: heads and head size");
  AttentionArgs args{query.data_ptr(),
                     query.stride(0),
                     kv_cache.data_ptr(),
                     kv_cache.size(1),
                     kv_cache.size(2),
                     kv_heads,
                     query.size(2),
                     query.size(1),
                     block_tables.data_ptr<int64_t>(),
                     block_tables.size(1),
                     query_start_loc.data_ptr<int32_t>(),
                     seq_lens.data_ptr<int32_t>(),
                     window,
                     static_cast<float>(scale),
                     out.data_ptr()};
  const bool is_bf16 = query.scalar_type() == at::kBFloat16;
  const int isa = g_isa;
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      if (is_bf16) attend<bf16>(args, task / kv_heads, task % kv_heads, buf, isa);
      else attend<float>(args, task / kv_heads, task % kv_heads, buf, isa);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("detect_isa", &detect_isa, "best ISA level of this CPU (0-3)");
  m.def("set_isa", [](int level) { g_isa = std::max(0, std::min(level, detect_isa())); return g_isa; });
  m.def("get_isa", []() { return g_isa; });
  m.def("few_row_linear", &few_row_linear, "x @ weight.T + bias for a few rows");
  m.def("paged_attention", &paged_attention, "paged attention of short queries, in place");
}
