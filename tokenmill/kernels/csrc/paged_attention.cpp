// Paged attention over the cache's blocks in place, with an online softmax (one pass over the
// keys). A task is up to `kQueryTile` queries of one sequence with the query heads of a range
// of KV heads (all of them where there are tasks enough: a block's rows are then read
// contiguously): each key and value row is widened to float32 once per task and used by all
// of the task's rows (queries x heads). Decode attention is bound by reading the cache
// (software prefetch of the next run only moved the stall: measured, removed). Query i of a
// sequence with n queries and seq_len tokens sits at position seq_len - n + i and sees keys
// (position - window, position].
#include "paged_attention.h"

#include "thread_pool.h"

#include <algorithm>
#include <cmath>

namespace tokenmill {
namespace {

constexpr int64_t kQueryTile = 8;

// What head `head`'s attention sink adds to a row's softmax denominator (whose scores are
// relative to `row_max`): exp(sink - row_max), 0 without sinks.
inline float sink_weight(const AttentionArgs& a, int64_t head, float row_max) {
  return a.sinks == nullptr ? 0.0f : std::exp(a.sinks[head] - row_max);
}

// A score soft-capped (Gemma 2): cap * tanh(score / cap); as it is without a cap.
inline float capped(const AttentionArgs& a, float score) {
  return a.softcap > 0.0f ? a.softcap * std::tanh(score / a.softcap) : score;
}

template <typename C>
__attribute__((always_inline)) inline void widen_rows(const C* src, int64_t stride, int64_t rows,
                                                      int64_t d, float* dst) {
  for (int64_t t = 0; t < rows; ++t) {
    const C* s = src + t * stride;
    float* o = dst + t * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) o[j] = load_float(s + j);
  }
}

// A task's query rows (row = query * heads + head, `heads` from first_head), scaled, as float32.
__attribute__((always_inline)) inline void scaled_queries(const AttentionArgs& a,
                                                          const AttentionTask& task,
                                                          int64_t first_head, int64_t heads,
                                                          float* qf) {
  const int64_t d = a.d;
  for (int64_t i = 0; i < task.q_end - task.q_begin; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t offset = (task.q_begin + i) * a.q_stride + (first_head + h) * d;
      float* q = qf + (i * heads + h) * d;
      if (a.query_bf16) {
        const bf16* src = static_cast<const bf16*>(a.query) + offset;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) q[j] = load_float(src + j) * a.scale;
      } else {
        const float* src = static_cast<const float*>(a.query) + offset;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) q[j] = src[j] * a.scale;
      }
    }
}

// Each row's accumulated values over its softmax denominator (sinks included), into `out`.
__attribute__((always_inline)) inline void write_rows(const AttentionArgs& a,
                                                      const AttentionTask& task,
                                                      int64_t first_head, int64_t heads,
                                                      const float* acc, const float* row_max,
                                                      const float* row_sum) {
  const int64_t d = a.d;
  for (int64_t i = 0; i < task.q_end - task.q_begin; ++i) {
    const int64_t token = task.q_begin + i;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = i * heads + h;
      const float sum = row_sum[row] + sink_weight(a, first_head + h, row_max[row]);
      const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
      const float* o = acc + row * d;
      if (a.out_bf16) {
        bf16* dst = static_cast<bf16*>(a.out) + token * a.out_stride + (first_head + h) * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) store_float(dst + j, o[j] * inverse);
      } else {
        float* dst = static_cast<float*>(a.out) + token * a.out_stride + (first_head + h) * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) dst[j] = o[j] * inverse;
      }
    }
  }
}

template <typename C>
__attribute__((always_inline)) inline void attend_head(const AttentionArgs& a,
                                                       const AttentionTask& task, int64_t kv_head,
                                                       float* scratch) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, bs = a.block_size;
  const int64_t seq_len = a.seq_lens[task.seq];
  const int64_t first_query = a.query_start_loc[task.seq];
  const int64_t num_queries = a.query_start_loc[task.seq + 1] - first_query;
  const int64_t tile = task.q_end - task.q_begin, rows = tile * group;
  float* qf = scratch;                // [rows, d]
  float* acc = qf + rows * d;         // [rows, d]
  float* row_max = acc + rows * d;    // [rows]
  float* row_sum = row_max + rows;    // [rows]
  float* scores = row_sum + rows;     // [bs]
  float* keys = scores + bs;          // [bs, d]
  float* values = keys + bs * d;      // [bs, d]
  const C* cache = static_cast<const C*>(a.cache);
  const int64_t slot = a.kv_heads * d;
  const int64_t value_offset = a.num_blocks * bs * slot;
  const int64_t* table = a.block_tables + task.seq * a.max_blocks;
  auto position = [&](int64_t token) { return seq_len - num_queries + (token - first_query); };

  scaled_queries(a, task, kv_head * group, group, qf);
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(row_max, row_max + rows, -INFINITY);
  std::fill(row_sum, row_sum + rows, 0.0f);

  const int64_t hi = position(task.q_end - 1) + 1;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, position(task.q_begin) + 1 - a.window) : 0;
  for (int64_t block_start = lo / bs * bs; block_start < hi; block_start += bs) {
    const int64_t t0 = std::max(lo, block_start), t1 = std::min(hi, block_start + bs);
    const int64_t base = (table[block_start / bs] * bs + (t0 - block_start)) * slot + kv_head * d;
    widen_rows(cache + base, slot, t1 - t0, d, keys);
    widen_rows(cache + value_offset + base, slot, t1 - t0, d, values);
    for (int64_t i = 0; i < tile; ++i) {
      const int64_t pos = position(task.q_begin + i);
      const int64_t first = a.window > 0 ? std::max(t0, pos + 1 - a.window) : t0;
      const int64_t last = std::min(t1, pos + 1);  // keys [first, last) of this block
      if (first >= last) continue;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = i * group + g;
        const float* q = qf + row * d;
        float block_max = -INFINITY;
        for (int64_t t = first; t < last; ++t) {
          const float* k = keys + (t - t0) * d;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < d; ++j) dot += q[j] * k[j];
          dot = capped(a, dot);
          scores[t - t0] = dot;
          block_max = std::max(block_max, dot);
        }
        const float new_max = std::max(row_max[row], block_max);
        const float correction = exp_approx(row_max[row] - new_max);
        row_max[row] = new_max;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = first - t0; t < last - t0; ++t) {
          scores[t] = exp_approx(scores[t] - new_max);
          total += scores[t];
        }
        row_sum[row] = row_sum[row] * correction + total;
        float* o = acc + row * d;
        if (correction != 1.0f) {
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) o[j] *= correction;
        }
        for (int64_t t = first - t0; t < last - t0; ++t) {
          const float p = scores[t];
          const float* v = values + t * d;
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) o[j] += p * v[j];
        }
      }
    }
  }
  write_rows(a, task, kv_head * group, group, acc, row_max, row_sum);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 for head sizes of 16 * kChunks: keys in runs of up to 16, the 16 dot products of a
// row reduced into one vector of scores at once, the softmax on that vector, the row's
// accumulator in registers while the run's values are added.

// r[i] = sum of v[i]'s lanes, for 16 vectors.
TM_AVX512 inline __m512 sum_lanes16(__m512* v) {
  __m512 w[8], z[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xDD));
  for (int j = 0; j < 4; ++j)
    z[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], 0xDD));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x44),
                                   _mm512_shuffle_f32x4(z[0], z[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x44),
                                   _mm512_shuffle_f32x4(z[2], z[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

TM_AVX512 inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
TM_AVX512 inline __m512 widen16(const bf16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename C, int kChunks>
TM_AVX512 void attend_task_avx512(const AttentionArgs& a, const AttentionTask& task,
                                  float* scratch) {
  constexpr int64_t d = kChunks * 16;
  const int64_t group = a.heads / a.kv_heads, bs = a.block_size;
  const int64_t seq_len = a.seq_lens[task.seq];
  const int64_t first_query = a.query_start_loc[task.seq];
  const int64_t num_queries = a.query_start_loc[task.seq + 1] - first_query;
  const int64_t tile = task.q_end - task.q_begin, kv = task.kv_end - task.kv_begin;
  const int64_t heads = kv * group, rows = tile * heads;  // row = query * heads + head
  float* qf = scratch;                // [rows, d]
  float* acc = qf + rows * d;         // [rows, d]
  float* row_max = acc + rows * d;    // [rows]
  float* row_sum = row_max + rows;    // [rows]
  float* probs = row_sum + rows;      // [16]
  float* keys = probs + 16;           // [16, kv, d]
  float* values = keys + 16 * kv * d; // [16, kv, d]
  const C* cache = static_cast<const C*>(a.cache);
  const int64_t slot = a.kv_heads * d;
  const int64_t value_offset = a.num_blocks * bs * slot;
  const int64_t* table = a.block_tables + task.seq * a.max_blocks;
  const int64_t first_head = task.kv_begin * group;
  auto position = [&](int64_t token) { return seq_len - num_queries + (token - first_query); };

  scaled_queries(a, task, first_head, heads, qf);
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(row_max, row_max + rows, -INFINITY);
  std::fill(row_sum, row_sum + rows, 0.0f);

  // The cache rows of keys [t, t + n) of this task's heads (contiguous within a block).
  auto key_row = [&](int64_t t) {
    return cache + (table[t / bs] * bs + t % bs) * slot + task.kv_begin * d;
  };
  const int64_t hi = position(task.q_end - 1) + 1;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, position(task.q_begin) + 1 - a.window) : 0;
  for (int64_t run_start = lo; run_start < hi;) {
    // A run: up to 16 consecutive keys inside one cache block.
    const int64_t t0 = run_start;
    const int64_t t1 = std::min({hi, t0 + 16, t0 - t0 % bs + bs});
    run_start = t1;
    const int64_t n = t1 - t0;
    const C* key_rows = key_row(t0);
    const C* value_rows = key_rows + value_offset;
    // Widened once for all query heads of their KV head.
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < kv; ++h)
        for (int c = 0; c < kChunks; ++c) {
          const int64_t at = (t * kv + h) * d + c * 16;
          _mm512_storeu_ps(keys + at, widen16(key_rows + t * slot + h * d + c * 16));
          _mm512_storeu_ps(values + at, widen16(value_rows + t * slot + h * d + c * 16));
        }
    for (int64_t i = 0; i < tile; ++i) {
      const int64_t pos = position(task.q_begin + i);
      const int64_t first = a.window > 0 ? std::max(t0, pos + 1 - a.window) : t0;
      const int64_t last = std::min(t1, pos + 1);
      if (first >= last) continue;
      // Lanes of the run this query sees.
      const __mmask16 visible =
          static_cast<__mmask16>(((1u << (last - t0)) - 1) & ~((1u << (first - t0)) - 1));
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = i * heads + h, kv_local = h / group;
        const float* q = qf + row * d;
        __m512 qv[kChunks];
        for (int c = 0; c < kChunks; ++c) qv[c] = _mm512_loadu_ps(q + c * 16);
        __m512 dots[16];
        for (int64_t t = 0; t < 16; ++t) {
          if (t >= n) {
            dots[t] = _mm512_setzero_ps();
            continue;
          }
          const float* k = keys + (t * kv + kv_local) * d;
          __m512 sum = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
          for (int c = 1; c < kChunks; ++c)
            sum = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * 16), sum);
          dots[t] = sum;
        }
        __m512 raw = sum_lanes16(dots);
        if (a.softcap > 0.0f) {
          _mm512_storeu_ps(probs, raw);
          for (int t = 0; t < 16; ++t) probs[t] = capped(a, probs[t]);
          raw = _mm512_loadu_ps(probs);
        }
        const __m512 scores = _mm512_mask_blend_ps(visible, _mm512_set1_ps(-INFINITY), raw);
        const float new_max = std::max(row_max[row], _mm512_reduce_max_ps(scores));
        const float correction = exp_approx(row_max[row] - new_max);
        row_max[row] = new_max;
        _mm512_storeu_ps(probs, _mm512_sub_ps(scores, _mm512_set1_ps(new_max)));
#pragma omp simd
        for (int t = 0; t < 16; ++t) probs[t] = exp_approx(probs[t]);
        const __m512 p = _mm512_maskz_loadu_ps(visible, probs);
        row_sum[row] = row_sum[row] * correction + _mm512_reduce_add_ps(p);
        _mm512_storeu_ps(probs, p);
        float* o = acc + row * d;
        __m512 out[kChunks];
        const __m512 corr = _mm512_set1_ps(correction);
        for (int c = 0; c < kChunks; ++c) out[c] = _mm512_mul_ps(_mm512_loadu_ps(o + c * 16), corr);
        for (int64_t t = first - t0; t < last - t0; ++t) {
          const __m512 pt = _mm512_set1_ps(probs[t]);
          const float* v = values + (t * kv + kv_local) * d;
          for (int c = 0; c < kChunks; ++c)
            out[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + c * 16), out[c]);
        }
        for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(o + c * 16, out[c]);
      }
    }
  }
  write_rows(a, task, first_head, heads, acc, row_max, row_sum);
}

// ---------------------------------------------------------------------------------------------
// AVX2 for head sizes of 8 * kChunks: as the AVX-512 kernel, with runs of up to 8 keys (one
// vector of scores). The run's 8 dot products of a row accumulate side by side, one q chunk at
// a time, and the row's accumulator is updated 8 chunks at a time (16 registers).

// r[i] = sum of v[i]'s lanes, for 8 vectors.
TM_AVX2 inline __m256 sum_lanes8(const __m256* v) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

TM_AVX2 inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
TM_AVX2 inline __m256 widen8(const bf16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

TM_AVX2 inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

TM_AVX2 inline float reduce_add8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

template <typename C, int kChunks>
TM_AVX2 void attend_task_avx2(const AttentionArgs& a, const AttentionTask& task, float* scratch) {
  constexpr int64_t d = kChunks * 8;
  const int64_t group = a.heads / a.kv_heads, bs = a.block_size;
  const int64_t seq_len = a.seq_lens[task.seq];
  const int64_t first_query = a.query_start_loc[task.seq];
  const int64_t num_queries = a.query_start_loc[task.seq + 1] - first_query;
  const int64_t tile = task.q_end - task.q_begin, kv = task.kv_end - task.kv_begin;
  const int64_t heads = kv * group, rows = tile * heads;  // row = query * heads + head
  float* qf = scratch;                // [rows, d]
  float* acc = qf + rows * d;         // [rows, d]
  float* row_max = acc + rows * d;    // [rows]
  float* row_sum = row_max + rows;    // [rows]
  float* probs = row_sum + rows;      // [8]
  float* keys = probs + 16;           // [8, kv, d]
  float* values = keys + 8 * kv * d;  // [8, kv, d]
  const C* cache = static_cast<const C*>(a.cache);
  const int64_t slot = a.kv_heads * d;
  const int64_t value_offset = a.num_blocks * bs * slot;
  const int64_t* table = a.block_tables + task.seq * a.max_blocks;
  const int64_t first_head = task.kv_begin * group;
  auto position = [&](int64_t token) { return seq_len - num_queries + (token - first_query); };

  scaled_queries(a, task, first_head, heads, qf);
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(row_max, row_max + rows, -INFINITY);
  std::fill(row_sum, row_sum + rows, 0.0f);

  auto key_row = [&](int64_t t) {
    return cache + (table[t / bs] * bs + t % bs) * slot + task.kv_begin * d;
  };
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t hi = position(task.q_end - 1) + 1;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, position(task.q_begin) + 1 - a.window) : 0;
  for (int64_t run_start = lo; run_start < hi;) {
    // A run: up to 8 consecutive keys inside one cache block.
    const int64_t t0 = run_start;
    const int64_t t1 = std::min({hi, t0 + 8, t0 - t0 % bs + bs});
    run_start = t1;
    const int64_t n = t1 - t0;
    const C* key_rows = key_row(t0);
    const C* value_rows = key_rows + value_offset;
    for (int64_t t = 0; t < n; ++t)  // widened once for all query heads of their KV head
      for (int64_t h = 0; h < kv; ++h)
        for (int c = 0; c < kChunks; ++c) {
          const int64_t at = (t * kv + h) * d + c * 8;
          _mm256_storeu_ps(keys + at, widen8(key_rows + t * slot + h * d + c * 8));
          _mm256_storeu_ps(values + at, widen8(value_rows + t * slot + h * d + c * 8));
        }
    for (int64_t i = 0; i < tile; ++i) {
      const int64_t pos = position(task.q_begin + i);
      const int64_t first = a.window > 0 ? std::max(t0, pos + 1 - a.window) : t0;
      const int64_t last = std::min(t1, pos + 1);
      if (first >= last) continue;
      // Lanes of the run this query sees: [first - t0, last - t0).
      const __m256 visible = _mm256_castsi256_ps(_mm256_andnot_si256(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(first - t0)), lane),
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(last - t0)), lane)));
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = i * heads + h, kv_local = h / group;
        const float* q = qf + row * d;
        // All 8 lanes, past n too (earlier runs' finite keys, or zeros): masked out below.
        __m256 dots[8];
        for (int t = 0; t < 8; ++t) dots[t] = _mm256_setzero_ps();
        for (int c = 0; c < kChunks; ++c) {
          const __m256 qc = _mm256_loadu_ps(q + c * 8);
          for (int t = 0; t < 8; ++t)
            dots[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + (t * kv + kv_local) * d + c * 8),
                                      dots[t]);
        }
        __m256 raw = sum_lanes8(dots);
        if (a.softcap > 0.0f) {
          _mm256_storeu_ps(probs, raw);
          for (int t = 0; t < 8; ++t) probs[t] = capped(a, probs[t]);
          raw = _mm256_loadu_ps(probs);
        }
        const __m256 scores = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), raw, visible);
        const float new_max = std::max(row_max[row], reduce_max8(scores));
        const float correction = exp_approx(row_max[row] - new_max);
        row_max[row] = new_max;
        _mm256_storeu_ps(probs, _mm256_sub_ps(scores, _mm256_set1_ps(new_max)));
#pragma omp simd
        for (int t = 0; t < 8; ++t) probs[t] = exp_approx(probs[t]);
        const __m256 p = _mm256_and_ps(_mm256_loadu_ps(probs), visible);
        row_sum[row] = row_sum[row] * correction + reduce_add8(p);
        _mm256_storeu_ps(probs, p);
        float* o = acc + row * d;
        const __m256 corr = _mm256_set1_ps(correction);
        for (int c0 = 0; c0 < kChunks; c0 += 8) {  // 8 chunks of the accumulator at a time
          constexpr int kWidth = kChunks < 8 ? kChunks : 8;
          __m256 out[kWidth];
          for (int c = 0; c < kWidth; ++c)
            if (c0 + c < kChunks) out[c] = _mm256_mul_ps(_mm256_loadu_ps(o + (c0 + c) * 8), corr);
          for (int64_t t = first - t0; t < last - t0; ++t) {
            const __m256 pt = _mm256_set1_ps(probs[t]);
            const float* v = values + (t * kv + kv_local) * d + c0 * 8;
            for (int c = 0; c < kWidth; ++c)
              if (c0 + c < kChunks)
                out[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + c * 8), out[c]);
          }
          for (int c = 0; c < kWidth; ++c)
            if (c0 + c < kChunks) _mm256_storeu_ps(o + (c0 + c) * 8, out[c]);
        }
      }
    }
  }
  write_rows(a, task, first_head, heads, acc, row_max, row_sum);
}

template <typename C>
void attend_portable(const AttentionArgs& a, const AttentionTask& t, float* s) {
  for (int64_t h = t.kv_begin; h < t.kv_end; ++h) attend_head<C>(a, t, h, s);
}
template <typename C>
TM_AVX2 void attend_avx2(const AttentionArgs& a, const AttentionTask& t, float* s) {
  for (int64_t h = t.kv_begin; h < t.kv_end; ++h) attend_head<C>(a, t, h, s);
}
template <typename C>
TM_AVX512 void attend_avx512(const AttentionArgs& a, const AttentionTask& t, float* s) {
  for (int64_t h = t.kv_begin; h < t.kv_end; ++h) attend_head<C>(a, t, h, s);
}

template <typename C>
void attend_isa(const AttentionArgs& a, const AttentionTask& t, float* s, int isa) {
  if (isa >= kAvx512 && a.d == 64) attend_task_avx512<C, 4>(a, t, s);
  else if (isa >= kAvx512 && a.d == 128) attend_task_avx512<C, 8>(a, t, s);
  else if (isa >= kAvx512) attend_avx512<C>(a, t, s);
  else if (isa >= kAvx2 && a.d == 64) attend_task_avx2<C, 8>(a, t, s);
  else if (isa >= kAvx2 && a.d == 80) attend_task_avx2<C, 10>(a, t, s);
  else if (isa >= kAvx2 && a.d == 96) attend_task_avx2<C, 12>(a, t, s);
  else if (isa >= kAvx2 && a.d == 128) attend_task_avx2<C, 16>(a, t, s);
  else if (isa >= kAvx2 && a.d == 256) attend_task_avx2<C, 32>(a, t, s);
  else if (isa >= kAvx2) attend_avx2<C>(a, t, s);
  else attend_portable<C>(a, t, s);
}

}  // namespace

std::vector<AttentionTask> attention_tasks(const int32_t* query_start_loc, const int32_t* seq_lens,
                                           int64_t num_seqs, int64_t kv_heads, int threads) {
  int64_t tiles = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    tiles += (query_start_loc[s + 1] - query_start_loc[s] + kQueryTile - 1) / kQueryTile;
  const int64_t heads_per_task = tiles >= 4 * threads ? kv_heads : 1;
  std::vector<std::pair<int64_t, AttentionTask>> costed;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t begin = query_start_loc[s], end = query_start_loc[s + 1];
    for (int32_t q = begin; q < end; q += kQueryTile) {
      const int32_t q_end = std::min<int32_t>(end, q + kQueryTile);
      const int64_t keys = seq_lens[s] - (end - q_end);  // the tile's last query sees these
      for (int64_t h = 0; h < kv_heads; h += heads_per_task) {
        const int64_t h_end = std::min(kv_heads, h + heads_per_task);
        costed.push_back({keys * (q_end - q) * (h_end - h),
                          AttentionTask{static_cast<int32_t>(s), static_cast<int32_t>(h),
                                        static_cast<int32_t>(h_end), q, q_end}});
      }
    }
  }
  std::stable_sort(costed.begin(), costed.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<AttentionTask> tasks;
  tasks.reserve(costed.size());
  for (const auto& entry : costed) tasks.push_back(entry.second);
  return tasks;
}

int64_t attention_scratch_floats(const AttentionArgs& a) {
  const int64_t rows = kQueryTile * a.heads;
  const int64_t keys = std::max<int64_t>(a.block_size, 16);
  return 2 * rows * a.d + 2 * rows + keys + 2 * keys * a.kv_heads * a.d + 16;
}

void attend(const AttentionArgs& a, const AttentionTask& task, float* scratch, int isa) {
  if (a.cache_bf16) attend_isa<bf16>(a, task, scratch, isa);
  else attend_isa<float>(a, task, scratch, isa);
}

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, int64_t window, double scale, at::Tensor& out,
                     const at::Tensor& sinks, double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_attention: query [tokens, heads, d] with contiguous heads expected");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2,
              "paged_attention: cache [2, blocks, block_size, kv_heads, d] expected");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &kv_cache, &out})
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16,
                "paged_attention: float32 or bfloat16 only");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "paged_attention: out");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "paged_attention: block_tables int64");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "paged_attention: query_start_loc and seq_lens int32");
  const int64_t num_seqs = seq_lens.size(0), kv_heads = kv_cache.size(3);
  TORCH_CHECK(query.size(1) % kv_heads == 0 && kv_cache.size(4) == query.size(2),
              "paged_attention: heads and head size");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "paged_attention: one block table and query start per sequence");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                                     sinks.numel() == query.size(1)),
              "paged_attention: sinks float32 [heads] (or empty: none)");
  TORCH_CHECK(softcap >= 0.0, "paged_attention: softcap >= 0 (0: none)");
  AttentionArgs args{query.data_ptr(),
                           query.scalar_type() == at::kBFloat16,
                           query.stride(0),
                           kv_cache.data_ptr(),
                           kv_cache.scalar_type() == at::kBFloat16,
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
                           out.data_ptr(),
                           out.scalar_type() == at::kBFloat16,
                           out.size(1) * out.size(2),
                           sinks.numel() == 0 ? nullptr : sinks.data_ptr<float>()};
  args.softcap = static_cast<float>(softcap);
  const int threads = team_size();
  const std::vector<AttentionTask> tasks =
      attention_tasks(args.query_start_loc, args.seq_lens, num_seqs, kv_heads, threads);
  const int isa = current_isa();
  const int64_t scratch_floats = attention_scratch_floats(args);
  std::vector<float> scratch(scratch_floats * threads);
  parallel_chunks(static_cast<int64_t>(tasks.size()), [&](int64_t i, int participant) {
    attend(args, tasks[i], scratch.data() + participant * scratch_floats, isa);
  }, threads, "attention");
}

}  // namespace tokenmill
