// Multi-LoRA's segmented shrink/expand (lora.h). The shrink: each adapter row's `width` dot
// products with its slot's A rows, into a scratch [rows, width]; the expand: each row's output
// columns, in blocks, += scratch row x its slot's B^T, read in order (B is stored transposed so
// that the inner loop is an FMA over contiguous outputs). Widths are small (adapter parts x
// --max-lora-rank, 8-48), so the shrink is a few dot products of the hidden size per row and
// the expand a few axpys of the output size. float32 or bf16 weights (bf16: vdpbf16ps dot
// products on AVX-512 BF16, widened to float32 below it); the sums are float32.
#include "lora.h"

#include <algorithm>

#include "thread_pool.h"

namespace tokenmill {
namespace {

using u16 = uint16_t;

float dot_portable(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

float dot_bf16_portable(const u16* a, const u16* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += bf16_bits_to_float(a[i]) * bf16_bits_to_float(b[i]);
  return sum;
}

void axpy_portable(float* y, const float* x, float alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void axpy_bf16_portable(float* y, const u16* x, float alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * bf16_bits_to_float(x[i]);
}

TM_AVX2 float hsum_avx2(__m256 acc) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

TM_AVX2 __m256 widen8_avx2(const u16* p) {  // 8 bf16 -> float32
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
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
  float sum = hsum_avx2(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

TM_AVX2 float dot_bf16_avx2(const u16* a, const u16* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(widen8_avx2(a + i), widen8_avx2(b + i), acc0);
    acc1 = _mm256_fmadd_ps(widen8_avx2(a + i + 8), widen8_avx2(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(widen8_avx2(a + i), widen8_avx2(b + i), acc0);
  float sum = hsum_avx2(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += bf16_bits_to_float(a[i]) * bf16_bits_to_float(b[i]);
  return sum;
}

TM_AVX2 void axpy_avx2(float* y, const float* x, float alpha, int64_t n) {
  const __m256 scale = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

TM_AVX2 void axpy_bf16_avx2(float* y, const u16* x, float alpha, int64_t n) {
  const __m256 scale = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, widen8_avx2(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * bf16_bits_to_float(x[i]);
}

TM_AVX512 __m512 widen16_avx512(const u16* p, __mmask16 mask = 0xFFFF) {  // 16 bf16 -> float32
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
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

TM_AVX512 float dot_bf16_avx512(const u16* a, const u16* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(widen16_avx512(a + i), widen16_avx512(b + i), acc0);
    acc1 = _mm512_fmadd_ps(widen16_avx512(a + i + 16), widen16_avx512(b + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16)
    acc0 = _mm512_fmadd_ps(widen16_avx512(a + i), widen16_avx512(b + i), acc0);
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc1 = _mm512_fmadd_ps(widen16_avx512(a + i, mask), widen16_avx512(b + i, mask), acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

TM_AVX512BF16 float dot_bf16_avx512bf16(const u16* a, const u16* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i),
                            (__m512bh)_mm512_loadu_si512(b + i));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + i + 32),
                            (__m512bh)_mm512_loadu_si512(b + i + 32));
  }
  for (; i < n; i += 32) {  // 32 at a time, the tail masked (zeros add nothing)
    const int64_t left = std::min<int64_t>(32, n - i);
    const __mmask32 mask = left == 32 ? ~0u : static_cast<__mmask32>((1u << left) - 1);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(mask, a + i),
                            (__m512bh)_mm512_maskz_loadu_epi16(mask, b + i));
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

TM_AVX512 void axpy_bf16_avx512(float* y, const u16* x, float alpha, int64_t n) {
  const __m512 scale = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(scale, widen16_avx512(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 sum =
        _mm512_fmadd_ps(scale, widen16_avx512(x + i, mask), _mm512_maskz_loadu_ps(mask, y + i));
    _mm512_mask_storeu_ps(y + i, mask, sum);
  }
}

TM_AVX512 __m512 load16_avx512(const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
TM_AVX512 __m512 load16_avx512(const u16* p, __mmask16 mask) { return widen16_avx512(p, mask); }

// y[0:n] += sum over k of t[k] * b[w[k] * ld + 0:n]: 64 outputs at a time held in registers
// while every w adds to them (y read and written once, one load per FMA).
template <typename T>
TM_AVX512 void expand_avx512(float* y, const T* b, int64_t ld, const float* t, const int64_t* w,
                             int64_t nw, int64_t n) {
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    __m512 acc[4];
    for (int q = 0; q < 4; ++q) acc[q] = _mm512_loadu_ps(y + j + 16 * q);
    for (int64_t k = 0; k < nw; ++k) {
      const __m512 scale = _mm512_set1_ps(t[k]);
      const T* row = b + w[k] * ld + j;
      for (int q = 0; q < 4; ++q)
        acc[q] = _mm512_fmadd_ps(scale, load16_avx512(row + 16 * q, 0xFFFF), acc[q]);
    }
    for (int q = 0; q < 4; ++q) _mm512_storeu_ps(y + j + 16 * q, acc[q]);
  }
  for (; j < n; j += 16) {
    const int64_t left = std::min<int64_t>(16, n - j);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
    __m512 acc = _mm512_maskz_loadu_ps(mask, y + j);
    for (int64_t k = 0; k < nw; ++k)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(t[k]), load16_avx512(b + w[k] * ld + j, mask), acc);
    _mm512_mask_storeu_ps(y + j, mask, acc);
  }
}

template <typename T>
struct Kernels {
  float (*dot)(const T*, const T*, int64_t);
  void (*axpy)(float*, const T*, float, int64_t);
  // As expand_avx512; null: an axpy per w.
  void (*expand)(float*, const T*, int64_t, const float*, const int64_t*, int64_t, int64_t);
};

Kernels<float> float_kernels(int isa) {
  if (isa >= kAvx512) return {dot_avx512, axpy_avx512, expand_avx512<float>};
  if (isa >= kAvx2) return {dot_avx2, axpy_avx2, nullptr};
  return {dot_portable, axpy_portable, nullptr};
}

Kernels<u16> bf16_kernels(int isa) {
  if (isa >= kAvx512Bf16) return {dot_bf16_avx512bf16, axpy_bf16_avx512, expand_avx512<u16>};
  if (isa >= kAvx512) return {dot_bf16_avx512, axpy_bf16_avx512, expand_avx512<u16>};
  if (isa >= kAvx2) return {dot_bf16_avx2, axpy_bf16_avx2, nullptr};
  return {dot_bf16_portable, axpy_bf16_portable, nullptr};
}

template <typename T>
void shrink_row(const Kernels<T>& k, const LoRAStack& s, const LoRARows& rows, const void* x,
                int64_t ld_x, float* shrunk, int64_t i) {
  const T* a = static_cast<const T*>(s.a) + rows.slot[i] * s.width * s.in;
  const T* xr = static_cast<const T*>(x) + rows.row[i] * ld_x;
  for (int64_t w = 0; w < s.width; ++w) shrunk[i * s.width + w] = k.dot(a + w * s.in, xr, s.in);
}

template <typename T>
void expand_row(const Kernels<T>& k, const LoRAStack& s, const LoRARows& rows,
                const float* shrunk, float* y, int64_t ld_y, int64_t i, int64_t c0, int64_t c1) {
  const T* bt = static_cast<const T*>(s.bt) + rows.slot[i] * s.width * s.out + c0;
  float* yr = y + rows.row[i] * ld_y + c0;
  const float* t = shrunk + i * s.width;
  constexpr int64_t kMaxWidth = 256;
  if (k.expand != nullptr && s.width <= kMaxWidth) {
    float values[kMaxWidth];
    int64_t ws[kMaxWidth], nw = 0;
    for (int64_t w = 0; w < s.width; ++w)
      if (t[w] != 0.0f) values[nw] = t[w], ws[nw++] = w;  // ranks below the width: zeros
    k.expand(yr, bt, s.out, values, ws, nw, c1 - c0);
    return;
  }
  for (int64_t w = 0; w < s.width; ++w)
    if (t[w] != 0.0f) k.axpy(yr, bt + w * s.out, t[w], c1 - c0);
}

}  // namespace

LoRAStack lora_stack_of(const at::Tensor& a, const at::Tensor& bt) {
  const auto type = a.scalar_type();
  TORCH_CHECK((type == at::kFloat || type == at::kBFloat16) && bt.scalar_type() == type,
              "LoRA weights: float32 or bfloat16, A and B alike");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.dim() == 3 && bt.dim() == 3 &&
                  a.size(0) == bt.size(0) && a.size(1) == bt.size(1),
              "LoRA weights: contiguous a [slots, width, in] and bt [slots, width, out]");
  return LoRAStack{a.data_ptr(), bt.data_ptr(), a.size(0), a.size(1), a.size(2), bt.size(2),
                   type == at::kBFloat16};
}

LoRARows lora_rows_of(const at::Tensor& segments, int64_t rows, int64_t slots) {
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.is_contiguous(),
              "lora: segments [n, 3] int64 expected");
  const int64_t* seg = segments.data_ptr<int64_t>();
  LoRARows out;
  int64_t previous_end = 0;
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t first = seg[3 * s], end = seg[3 * s + 1], slot = seg[3 * s + 2];
    TORCH_CHECK(previous_end <= first && first <= end && end <= rows && 0 <= slot && slot < slots,
                "lora: segment out of range");
    for (int64_t r = first; r < end; ++r) {
      out.row.push_back(r);
      out.slot.push_back(slot);
    }
    previous_end = end;
  }
  return out;
}

void lora_shrink_row(const LoRAStack& w, const LoRARows& rows, const void* x, int64_t ld_x,
                     float* shrunk, int64_t i, int isa) {
  if (w.bf16) shrink_row(bf16_kernels(isa), w, rows, x, ld_x, shrunk, i);
  else shrink_row(float_kernels(isa), w, rows, x, ld_x, shrunk, i);
}

void lora_expand_row(const LoRAStack& w, const LoRARows& rows, const float* shrunk, float* y,
                     int64_t ld_y, int64_t i, int64_t c0, int64_t c1, int isa) {
  if (w.bf16) expand_row(bf16_kernels(isa), w, rows, shrunk, y, ld_y, i, c0, c1);
  else expand_row(float_kernels(isa), w, rows, shrunk, y, ld_y, i, c0, c1);
}

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
  const LoRAStack stack = lora_stack_of(a, bt);
  const LoRARows rows = lora_rows_of(segments, x.size(0), stack.slots);
  const int64_t n = rows.size(), width = stack.width, out = stack.out;
  if (n == 0 || width == 0) return;
  std::vector<float> shrunk(n * width);
  const void* xs = x.data_ptr();
  float* ys = y.data_ptr<float>();
  const int64_t ld_x = x.size(1);
  const int isa = current_isa();
  const int64_t out_blocks = (out + kLoRAOutBlock - 1) / kLoRAOutBlock;
  PhasedJob job;
  job.add_phase(n, [&](int64_t i, int) {
    lora_shrink_row(stack, rows, xs, ld_x, shrunk.data(), i, isa);
  });
  job.add_phase(n * out_blocks, [&](int64_t chunk, int) {
    const int64_t i = chunk / out_blocks, c0 = (chunk % out_blocks) * kLoRAOutBlock;
    lora_expand_row(stack, rows, shrunk.data(), ys, out, i, c0, std::min(out, c0 + kLoRAOutBlock),
                    isa);
  });
  const int64_t flops = n * width * (stack.in + out);
  WorkerPool::instance().run(job, flops >= (1 << 16) ? team_size() : 1);
}

}  // namespace tokenmill
