// Multi-LoRA's segmented shrink/expand (lora.h). Two phases on the worker pool: the shrink
// (each row's `width` dot products with its slot's A rows, into a scratch [rows, width]), then
// the expand (each row's output columns, in blocks, += scratch row x its slot's B^T, read in
// order: B is stored transposed so that the inner loop is an FMA over contiguous outputs).
// Widths are small (adapter parts x --max-lora-rank, 8-48), so the shrink is a few dot
// products of the hidden size per row and the expand a few axpys of the output size.
#include "lora.h"

#include <vector>

#include "thread_pool.h"

namespace tokenmill {
namespace {

constexpr int64_t kOutBlock = 512;  // output columns per expand chunk

float dot_portable(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpy_portable(float* y, const float* x, float alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

TM_AVX2 float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  float sum = _mm_cvtss_f32(half);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

TM_AVX2 void axpy_avx2(float* y, const float* x, float alpha, int64_t n) {
  const __m256 scale = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

TM_AVX512 float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16)
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  if (i < n) {  // the tail, masked
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + i), _mm512_maskz_loadu_ps(mask, b + i),
                           acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

TM_AVX512 void axpy_avx512(float* y, const float* x, float alpha, int64_t n) {
  const __m512 scale = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(scale, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 xs = _mm512_maskz_loadu_ps(mask, x + i);
    const __m512 sum = _mm512_fmadd_ps(scale, xs, _mm512_maskz_loadu_ps(mask, y + i));
    _mm512_mask_storeu_ps(y + i, mask, sum);
  }
}

struct Kernels {
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float*, const float*, float, int64_t);
};

Kernels kernels_for(int isa) {
  if (isa >= kAvx512) return {dot_avx512, axpy_avx512};
  if (isa >= kAvx2) return {dot_avx2, axpy_avx2};
  return {dot_portable, axpy_portable};
}

}  // namespace

void lora_shrink_expand(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                        const at::Tensor& bt, const at::Tensor& segments) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat,
              "lora_shrink_expand: float32 tensors expected");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && a.is_contiguous() && bt.is_contiguous(),
              "lora_shrink_expand: contiguous tensors expected");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && bt.dim() == 3 &&
                  x.size(0) == y.size(0) && a.size(2) == x.size(1) && bt.size(2) == y.size(1) &&
                  a.size(0) == bt.size(0) && a.size(1) == bt.size(1),
              "lora_shrink_expand: shapes disagree");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.is_contiguous(),
              "lora_shrink_expand: segments [n, 3] int64 expected");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t slots = a.size(0), width = a.size(1);
  const int64_t* seg = segments.data_ptr<int64_t>();
  const int64_t num_segments = segments.size(0);
  // Each row's slot (-1: no adapter), checked once.
  std::vector<int64_t> slot_of(rows, -1);
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t first = seg[3 * s], end = seg[3 * s + 1], slot = seg[3 * s + 2];
    TORCH_CHECK(0 <= first && first <= end && end <= rows && 0 <= slot && slot < slots,
                "lora_shrink_expand: segment out of range");
    for (int64_t r = first; r < end; ++r) slot_of[r] = slot;
  }
  std::vector<int64_t> lora_rows;
  for (int64_t r = 0; r < rows; ++r)
    if (slot_of[r] >= 0) lora_rows.push_back(r);
  const int64_t n = static_cast<int64_t>(lora_rows.size());
  if (n == 0 || width == 0) return;
  std::vector<float> shrunk(n * width);
  const float* xs = x.data_ptr<float>();
  const float* as = a.data_ptr<float>();
  const float* bts = bt.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const Kernels k = kernels_for(current_isa());
  const int64_t out_blocks = (out + kOutBlock - 1) / kOutBlock;
  PhasedJob job;
  job.add_phase(n, [&](int64_t i, int) {
    const int64_t r = lora_rows[i];
    const float* a_slot = as + slot_of[r] * width * in;
    for (int64_t w = 0; w < width; ++w)
      shrunk[i * width + w] = k.dot(a_slot + w * in, xs + r * in, in);
  });
  job.add_phase(n * out_blocks, [&](int64_t chunk, int) {
    const int64_t i = chunk / out_blocks, block = chunk % out_blocks;
    const int64_t r = lora_rows[i];
    const int64_t start = block * kOutBlock, count = std::min(kOutBlock, out - start);
    const float* b_slot = bts + slot_of[r] * width * out + start;
    float* y_row = ys + r * out + start;
    for (int64_t w = 0; w < width; ++w) {
      const float t = shrunk[i * width + w];
      if (t != 0.0f) k.axpy(y_row, b_slot + w * out, t, count);
    }
  });
  const int64_t flops = n * width * (in + out);
  WorkerPool::instance().run(job, flops >= (1 << 16) ? team_size() : 1);
}

}  // namespace tokenmill
