// Multi-LoRA's grouped shrink/expand (lora.h). A step's adapter rows are grouped by slot and cut
// into tiles of at most kLoRARowTile rows; each task reads its slot's A (the shrink: a block of
// widths) or B^T (the expand: a block of output columns) once for all of its tile's rows, in
// register tiles of up to four rows, as a small GEMM. Widths are small (adapter parts x
// --max-lora-rank, 8-48): the shrink is dot products of the input's length, summed
// horizontally at the end; the expand FMAs over contiguous outputs (B stored transposed).
// float32 or bf16 weights (and the input in the weights' dtype), one template for both: a bf16
// pair loads as two float vectors (the dot product's order is free, so the shrink splits
// even/odd elements of both operands alike; the expand widens in order). The sums are float32.
#include "lora.h"

#include <algorithm>
#include <type_traits>

#include "thread_pool.h"

namespace tokenmill {
namespace {

using u16 = uint16_t;

inline float to_float(float v) { return v; }
inline float to_float(u16 v) { return bf16_bits_to_float(v); }

template <typename T>
float dot_tail(const T* x, const T* a, int64_t k0, int64_t n) {
  float sum = 0.0f;
  for (int64_t k = k0; k < n; ++k) sum += to_float(x[k]) * to_float(a[k]);
  return sum;
}

// The tile kernels. Shrink: out[r * ld_out + w] = x[r] . a[w * in] for r < rows, w < nw.
// Expand: y[r][0:n] += sum over k < nw of t[r * ld_t + ws[k]] * b[ws[k] * ld_b + 0:n].
template <typename T>
using ShrinkTile = void (*)(const T* const* x, int64_t rows, const T* a, int64_t nw, int64_t in,
                            float* out, int64_t ld_out);
template <typename T>
using ExpandTile = void (*)(float* const* y, int64_t rows, const float* t, int64_t ld_t,
                            const T* b, int64_t ld_b, const int64_t* ws, int64_t nw, int64_t n);

template <typename T>
void shrink_tile_portable(const T* const* x, int64_t rows, const T* a, int64_t nw, int64_t in,
                          float* out, int64_t ld_out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t w = 0; w < nw; ++w) out[r * ld_out + w] = dot_tail(x[r], a + w * in, 0, in);
}

template <typename T>
void expand_tile_portable(float* const* y, int64_t rows, const float* t, int64_t ld_t,
                          const T* b, int64_t ld_b, const int64_t* ws, int64_t nw, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < nw; ++k) {
      const float scale = t[r * ld_t + ws[k]];
      const T* row = b + ws[k] * ld_b;
      for (int64_t j = 0; j < n; ++j) y[r][j] += scale * to_float(row[j]);
    }
}

// Four rows by two widths at a time (`Micro<T, R, W>::run`, R in 1..4, W in 1..2): each A
// vector is loaded once for the four rows, each x vector once for the two widths.
template <template <typename, int, int> class Micro, typename T>
void shrink_tiles(const T* const* x, int64_t rows, const T* a, int64_t nw, int64_t in,
                  float* out, int64_t ld_out) {
  using Fn = void (*)(const T* const*, const T*, int64_t, float*, int64_t);
  static constexpr Fn table[4][2] = {
      {Micro<T, 1, 1>::run, Micro<T, 1, 2>::run}, {Micro<T, 2, 1>::run, Micro<T, 2, 2>::run},
      {Micro<T, 3, 1>::run, Micro<T, 3, 2>::run}, {Micro<T, 4, 1>::run, Micro<T, 4, 2>::run}};
  for (int64_t r = 0; r < rows; r += 4) {
    const int64_t nr = std::min<int64_t>(4, rows - r);
    for (int64_t w = 0; w < nw; w += 2)
      table[nr - 1][std::min<int64_t>(2, nw - w) - 1](x + r, a + w * in, in, out + r * ld_out + w,
                                                      ld_out);
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2: 16 elements a step as two 8-lane halves.

TM_AVX2 inline void load16_avx2(const float* p, __m256& v0, __m256& v1) {
  v0 = _mm256_loadu_ps(p);
  v1 = _mm256_loadu_ps(p + 8);
}
TM_AVX2 inline void load16_avx2(const u16* p, __m256& v0, __m256& v1) {  // even, odd elements
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  v0 = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
  v1 = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF0000)));
}
TM_AVX2 inline __m256 load8_avx2(const float* p) { return _mm256_loadu_ps(p); }
TM_AVX2 inline __m256 load8_avx2(const u16* p) {  // in order
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

TM_AVX2 inline float hsum_avx2(__m256 acc) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

template <typename T, int R, int W>
struct ShrinkAvx2 {
  TM_AVX2 static void run(const T* const* x, const T* a, int64_t in, float* out, int64_t ld_out) {
    __m256 acc[R][W];
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= in; k += 16) {
      __m256 a0[W], a1[W];
      for (int w = 0; w < W; ++w) load16_avx2(a + w * in + k, a0[w], a1[w]);
      for (int r = 0; r < R; ++r) {
        __m256 x0, x1;
        load16_avx2(x[r] + k, x0, x1);
        for (int w = 0; w < W; ++w)
          acc[r][w] = _mm256_fmadd_ps(x1, a1[w], _mm256_fmadd_ps(x0, a0[w], acc[r][w]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w)
        out[r * ld_out + w] = hsum_avx2(acc[r][w]) + dot_tail(x[r], a + w * in, k, in);
  }
};

template <typename T>
void shrink_tile_avx2(const T* const* x, int64_t rows, const T* a, int64_t nw, int64_t in,
                      float* out, int64_t ld_out) {
  shrink_tiles<ShrinkAvx2, T>(x, rows, a, nw, in, out, ld_out);
}

// Up to four rows by 16 outputs in registers while every width adds to them: each B vector is
// loaded (and widened) once for the four rows.
template <typename T, int R>
TM_AVX2 void expand_rows_avx2(float* const* y, const float* t, int64_t ld_t, const T* b,
                              int64_t ld_b, const int64_t* ws, int64_t nw, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_loadu_ps(y[r] + j);
      acc[r][1] = _mm256_loadu_ps(y[r] + j + 8);
    }
    for (int64_t k = 0; k < nw; ++k) {
      const T* row = b + ws[k] * ld_b + j;
      const __m256 b0 = load8_avx2(row), b1 = load8_avx2(row + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_set1_ps(t[r * ld_t + ws[k]]);
        acc[r][0] = _mm256_fmadd_ps(scale, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(scale, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y[r] + j, acc[r][0]);
      _mm256_storeu_ps(y[r] + j + 8, acc[r][1]);
    }
  }
  float* tail[R];
  for (int r = 0; r < R; ++r) tail[r] = y[r] + j;
  if (j < n) expand_tile_portable<T>(tail, R, t, ld_t, b + j, ld_b, ws, nw, n - j);
}

template <typename T>
void expand_tile_avx2(float* const* y, int64_t rows, const float* t, int64_t ld_t, const T* b,
                      int64_t ld_b, const int64_t* ws, int64_t nw, int64_t n) {
  using Fn = void (*)(float* const*, const float*, int64_t, const T*, int64_t, const int64_t*,
                      int64_t, int64_t);
  static constexpr Fn by_rows[4] = {expand_rows_avx2<T, 1>, expand_rows_avx2<T, 2>,
                                    expand_rows_avx2<T, 3>, expand_rows_avx2<T, 4>};
  for (int64_t r = 0; r < rows; r += 4)
    by_rows[std::min<int64_t>(4, rows - r) - 1](y + r, t + r * ld_t, ld_t, b, ld_b, ws, nw, n);
}

// ---------------------------------------------------------------------------------------------
// AVX-512: 32 elements a step as two 16-lane halves (the tails masked in the expand).

TM_AVX512 inline void load32_avx512(const float* p, __m512& v0, __m512& v1) {
  v0 = _mm512_loadu_ps(p);
  v1 = _mm512_loadu_ps(p + 16);
}
TM_AVX512 inline void load32_avx512(const u16* p, __m512& v0, __m512& v1) {  // even, odd
  const __m512i words = _mm512_loadu_si512(p);
  v0 = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  v1 = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(0xFFFF0000)));
}
TM_AVX512 inline __m512 load16_avx512(const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
TM_AVX512 inline __m512 load16_avx512(const u16* p, __mmask16 mask) {  // in order
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename T, int R, int W>
struct ShrinkAvx512 {
  TM_AVX512 static void run(const T* const* x, const T* a, int64_t in, float* out, int64_t ld_out) {
    __m512 acc[R][W];
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= in; k += 32) {
      __m512 a0[W], a1[W];
      for (int w = 0; w < W; ++w) load32_avx512(a + w * in + k, a0[w], a1[w]);
      for (int r = 0; r < R; ++r) {
        __m512 x0, x1;
        load32_avx512(x[r] + k, x0, x1);
        for (int w = 0; w < W; ++w)
          acc[r][w] = _mm512_fmadd_ps(x1, a1[w], _mm512_fmadd_ps(x0, a0[w], acc[r][w]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w)
        out[r * ld_out + w] = _mm512_reduce_add_ps(acc[r][w]) + dot_tail(x[r], a + w * in, k, in);
  }
};

template <typename T>
void shrink_tile_avx512(const T* const* x, int64_t rows, const T* a, int64_t nw, int64_t in,
                        float* out, int64_t ld_out) {
  shrink_tiles<ShrinkAvx512, T>(x, rows, a, nw, in, out, ld_out);
}

// AVX-512 BF16 (bf16 weights and input): vdpbf16ps takes 32 bf16 of A and of x as they lie
// (pairs of neighbours, products exact in float32, summed in float32), no widening; up to four
// rows by four widths in registers. The tail is a masked load (zeros add nothing).
template <int R, int W>
struct ShrinkBf16 {
  TM_AVX512BF16 static void run(const u16* const* x, const u16* a, int64_t in, float* out,
                                int64_t ld_out) {
    __m512 acc[R][W];
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
      const __mmask32 mask =
          in - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (in - k)) - 1);
      __m512bh av[W];
      for (int w = 0; w < W; ++w) av[w] = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + w * in + k);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[r] + k);
        for (int w = 0; w < W; ++w) acc[r][w] = _mm512_dpbf16_ps(acc[r][w], xv, av[w]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) out[r * ld_out + w] = _mm512_reduce_add_ps(acc[r][w]);
  }
};

void shrink_tile_bf16(const u16* const* x, int64_t rows, const u16* a, int64_t nw, int64_t in,
                      float* out, int64_t ld_out) {
  using Fn = void (*)(const u16* const*, const u16*, int64_t, float*, int64_t);
  static constexpr Fn table[4][4] = {
      {ShrinkBf16<1, 1>::run, ShrinkBf16<1, 2>::run, ShrinkBf16<1, 3>::run, ShrinkBf16<1, 4>::run},
      {ShrinkBf16<2, 1>::run, ShrinkBf16<2, 2>::run, ShrinkBf16<2, 3>::run, ShrinkBf16<2, 4>::run},
      {ShrinkBf16<3, 1>::run, ShrinkBf16<3, 2>::run, ShrinkBf16<3, 3>::run, ShrinkBf16<3, 4>::run},
      {ShrinkBf16<4, 1>::run, ShrinkBf16<4, 2>::run, ShrinkBf16<4, 3>::run, ShrinkBf16<4, 4>::run}};
  for (int64_t r = 0; r < rows; r += 4) {
    const int64_t nr = std::min<int64_t>(4, rows - r);
    for (int64_t w = 0; w < nw; w += 4)
      table[nr - 1][std::min<int64_t>(4, nw - w) - 1](x + r, a + w * in, in, out + r * ld_out + w,
                                                      ld_out);
  }
}

template <typename T, int R>
TM_AVX512 void expand_rows_avx512(float* const* y, const float* t, int64_t ld_t, const T* b,
                                  int64_t ld_b, const int64_t* ws, int64_t nw, int64_t n) {
  for (int64_t j = 0; j < n; j += 32) {
    const int64_t left = std::min<int64_t>(32, n - j);
    const __mmask16 m0 = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 m1 = left >= 32   ? 0xFFFF
                         : left <= 16 ? 0
                                      : static_cast<__mmask16>((1u << (left - 16)) - 1);
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_maskz_loadu_ps(m0, y[r] + j);
      acc[r][1] = _mm512_maskz_loadu_ps(m1, y[r] + j + 16);
    }
    for (int64_t k = 0; k < nw; ++k) {
      const T* row = b + ws[k] * ld_b + j;
      const __m512 b0 = load16_avx512(row, m0), b1 = load16_avx512(row + 16, m1);
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_set1_ps(t[r * ld_t + ws[k]]);
        acc[r][0] = _mm512_fmadd_ps(scale, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(scale, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(y[r] + j, m0, acc[r][0]);
      _mm512_mask_storeu_ps(y[r] + j + 16, m1, acc[r][1]);
    }
  }
}

template <typename T>
void expand_tile_avx512(float* const* y, int64_t rows, const float* t, int64_t ld_t, const T* b,
                        int64_t ld_b, const int64_t* ws, int64_t nw, int64_t n) {
  using Fn = void (*)(float* const*, const float*, int64_t, const T*, int64_t, const int64_t*,
                      int64_t, int64_t);
  static constexpr Fn by_rows[4] = {expand_rows_avx512<T, 1>, expand_rows_avx512<T, 2>,
                                    expand_rows_avx512<T, 3>, expand_rows_avx512<T, 4>};
  for (int64_t r = 0; r < rows; r += 4)
    by_rows[std::min<int64_t>(4, rows - r) - 1](y + r, t + r * ld_t, ld_t, b, ld_b, ws, nw, n);
}

// ---------------------------------------------------------------------------------------------
// Tasks: a tile of one slot's rows, and a block of widths (shrink) or outputs (expand).

template <typename T>
struct Kernels {
  ShrinkTile<T> shrink;
  ExpandTile<T> expand;
};

template <typename T>
Kernels<T> kernels_for(int isa) {
  if constexpr (std::is_same_v<T, u16>)
    if (isa >= kAvx512Bf16) return {shrink_tile_bf16, expand_tile_avx512<T>};
  if (isa >= kAvx512) return {shrink_tile_avx512<T>, expand_tile_avx512<T>};
  if (isa >= kAvx2) return {shrink_tile_avx2<T>, expand_tile_avx2<T>};
  return {shrink_tile_portable<T>, expand_tile_portable<T>};
}

int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

template <typename T>
void shrink_task(const LoRAStack& s, const LoRARows& rows, const void* x, int64_t ld_x,
                 float* shrunk, int64_t task, int isa) {
  const int64_t blocks = blocks_of(s.width, kLoRAWidthBlock);
  const LoRATile& tile = rows.tiles[task / blocks];
  const int64_t w0 = (task % blocks) * kLoRAWidthBlock;
  const int64_t w1 = std::min(s.width, w0 + kLoRAWidthBlock);
  const T* xs[kLoRARowTile];
  for (int64_t i = tile.first; i < tile.end; ++i)
    xs[i - tile.first] = static_cast<const T*>(x) + rows.row[i] * ld_x;
  const T* a = static_cast<const T*>(s.a) + (tile.slot * s.width + w0) * s.in;
  kernels_for<T>(isa).shrink(xs, tile.end - tile.first, a, w1 - w0, s.in,
                             shrunk + tile.first * s.width + w0, s.width);
}

template <typename T>
void expand_task(const LoRAStack& s, const LoRARows& rows, const float* shrunk, float* y,
                 int64_t ld_y, int64_t task, int isa) {
  const int64_t blocks = blocks_of(s.out, kLoRAOutBlock);
  const LoRATile& tile = rows.tiles[task / blocks];
  const int64_t c0 = (task % blocks) * kLoRAOutBlock;
  const int64_t c1 = std::min(s.out, c0 + kLoRAOutBlock);
  const int64_t n = tile.end - tile.first;
  float* ys[kLoRARowTile];
  for (int64_t i = tile.first; i < tile.end; ++i) ys[i - tile.first] = y + rows.row[i] * ld_y + c0;
  const float* t = shrunk + tile.first * s.width;
  // The widths any of the tile's rows uses (ranks below the width shrink to zeros) whose part
  // has columns in the block (a fused linear's other parts' B is zeros there).
  thread_local std::vector<int64_t> ws;
  ws.clear();
  const int64_t per_part = s.width / s.parts;
  for (int64_t w = 0; w < s.width; ++w) {
    const int64_t part = w / per_part;
    if (s.part_end[part] <= c0 || (part > 0 && s.part_end[part - 1] >= c1)) {
      w = (part + 1) * per_part - 1;  // the rest of this part's widths
      continue;
    }
    for (int64_t r = 0; r < n; ++r)
      if (t[r * s.width + w] != 0.0f) {
        ws.push_back(w);
        break;
      }
  }
  if (ws.empty()) return;
  const T* bt = static_cast<const T*>(s.bt) + tile.slot * s.width * s.out + c0;
  kernels_for<T>(isa).expand(ys, n, t, s.width, bt, s.out, ws.data(),
                             static_cast<int64_t>(ws.size()), c1 - c0);
}

}  // namespace

int64_t LoRARows::shrink_tasks(const LoRAStack& w) const {
  return static_cast<int64_t>(tiles.size()) * blocks_of(w.width, kLoRAWidthBlock);
}

int64_t LoRARows::expand_tasks(const LoRAStack& w) const {
  return static_cast<int64_t>(tiles.size()) * blocks_of(w.out, kLoRAOutBlock);
}

LoRAStack lora_stack_of(const at::Tensor& a, const at::Tensor& bt) {
  const auto type = a.scalar_type();
  TORCH_CHECK((type == at::kFloat || type == at::kBFloat16) && bt.scalar_type() == type,
              "LoRA weights: float32 or bfloat16, A and B alike");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.dim() == 3 && bt.dim() == 3 &&
                  a.size(0) == bt.size(0) && a.size(1) == bt.size(1),
              "LoRA weights: contiguous a [slots, width, in] and bt [slots, width, out]");
  LoRAStack stack{a.data_ptr(), bt.data_ptr(), a.size(0), a.size(1), a.size(2), bt.size(2),
                  type == at::kBFloat16};
  stack.part_end[0] = stack.out;
  return stack;
}

void LoRAStack::set_parts(const std::vector<int64_t>& sizes) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(n >= 1 && n <= static_cast<int64_t>(part_end.size()) && width % n == 0,
              "LoRA weights: a fused linear's widths split evenly over its parts");
  int64_t end = 0;
  for (int64_t p = 0; p < n; ++p) part_end[p] = end += sizes[p];
  TORCH_CHECK(end == out, "LoRA weights: the parts' outputs make up the linear's");
  parts = n;
}

LoRARows lora_rows_of(const at::Tensor& segments, int64_t rows, int64_t slots) {
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.is_contiguous(),
              "lora: segments [n, 3] int64 expected");
  const int64_t* seg = segments.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> by_slot(slots);
  int64_t previous_end = 0;
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t first = seg[3 * s], end = seg[3 * s + 1], slot = seg[3 * s + 2];
    TORCH_CHECK(previous_end <= first && first <= end && end <= rows && 0 <= slot && slot < slots,
                "lora: segment out of range");
    for (int64_t r = first; r < end; ++r) by_slot[slot].push_back(r);
    previous_end = end;
  }
  LoRARows out;
  for (int64_t slot = 0; slot < slots; ++slot) {  // even tiles of at most kLoRARowTile rows
    const auto& members = by_slot[slot];
    const int64_t n = static_cast<int64_t>(members.size());
    if (n == 0) continue;
    const int64_t per = blocks_of(n, blocks_of(n, kLoRARowTile));
    const int64_t first = out.size();
    out.row.insert(out.row.end(), members.begin(), members.end());
    for (int64_t i = 0; i < n; i += per)
      out.tiles.push_back({first + i, first + std::min(n, i + per), slot});
  }
  return out;
}

void lora_shrink_task(const LoRAStack& w, const LoRARows& rows, const void* x, int64_t ld_x,
                      float* shrunk, int64_t task, int isa) {
  if (w.bf16) shrink_task<u16>(w, rows, x, ld_x, shrunk, task, isa);
  else shrink_task<float>(w, rows, x, ld_x, shrunk, task, isa);
}

void lora_expand_task(const LoRAStack& w, const LoRARows& rows, const float* shrunk, float* y,
                      int64_t ld_y, int64_t task, int isa) {
  if (w.bf16) expand_task<u16>(w, rows, shrunk, y, ld_y, task, isa);
  else expand_task<float>(w, rows, shrunk, y, ld_y, task, isa);
}

void lora_shrink_expand(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                        const at::Tensor& bt, const at::Tensor& segments) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == a.scalar_type(),
              "lora_shrink_expand: y float32, x in the weights' dtype");
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
  PhasedJob job;
  job.add_phase(rows.shrink_tasks(stack), [&](int64_t task, int) {
    lora_shrink_task(stack, rows, xs, ld_x, shrunk.data(), task, isa);
  });
  job.add_phase(rows.expand_tasks(stack), [&](int64_t task, int) {
    lora_expand_task(stack, rows, shrunk.data(), ys, out, task, isa);
  });
  const int64_t flops = n * width * (stack.in + out);
  WorkerPool::instance().run(job, flops >= (1 << 16) ? team_size() : 1);
}

}  // namespace tokenmill
