// Dense linears on packed weights (layout in linear.h), one kernel per ISA level:
// portable C++, AVX2, AVX-512 (float32 FMA; bf16 weights widened), AVX-512 BF16 (vdpbf16ps)
// and AMX tiles for bf16 products of `kAmxMinRows` rows or more.
#include "linear.h"

#include "thread_pool.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

namespace tokenmill {
namespace {

// Rows from which bf16 products go to AMX tiles where the CPU has them (below: vdpbf16ps, each
// weight vector loaded once for up to four rows).
constexpr int64_t kAmxMinRows = 5;
// Blocks of 16 output columns whose weights AMX keeps in L2 while it walks all row groups.
constexpr int64_t kAmxBlocksPerChunk = 16;
// Weight tiles (1 KB each) AMX prefetches ahead of the one it loads.
constexpr int64_t kPrefetchSteps = 4;

inline int64_t block_elements(const PackedWeight& w) {
  return w.is_bf16 ? w.k_pad * 16 : w.k * 16;
}

// ---------------------------------------------------------------------------------------------
// Epilogues: 16 accumulated columns -> bias, dtype, masked at n.

inline void store16_portable(const float* values, const GemmOut& o, int64_t row, int64_t col) {
  const int64_t valid = std::min<int64_t>(16, o.n - col);
  for (int64_t i = 0; i < valid; ++i) {
    const float v = values[i] + (o.bias ? o.bias[col + i] : 0.0f);
    if (o.is_bf16) {
      store_float(static_cast<bf16*>(o.data) + row * o.ld + col + i, v);
    } else {
      static_cast<float*>(o.data)[row * o.ld + col + i] = v;
    }
  }
}

TM_AVX512 inline __m256i float_to_bf16_avx512(__m512 v) {
  // Round to nearest even; NaNs stay quiet NaNs.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

TM_AVX512 inline void store16_avx512(__m512 v, const GemmOut& o, int64_t row, int64_t col) {
  const int64_t valid = std::min<int64_t>(16, o.n - col);
  const __mmask16 mask = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + col));
  if (o.is_bf16) {
    _mm256_mask_storeu_epi16(static_cast<bf16*>(o.data) + row * o.ld + col, mask,
                             float_to_bf16_avx512(v));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(o.data) + row * o.ld + col, mask, v);
  }
}

// ---------------------------------------------------------------------------------------------
// Portable: any weight dtype, scalar.

template <typename W, typename X>
void gemm_portable(const PackedWeight& w, const X* x, int64_t ldx, int64_t m, const GemmOut& o,
                   int64_t b0, int64_t b1) {
  const W* data = static_cast<const W*>(w.data);
  const int64_t per_block = block_elements(w);
  float acc[16];
  for (int64_t b = b0; b < b1; ++b) {
    const W* block = data + b * per_block;
    for (int64_t r = 0; r < m; ++r) {
      const X* xr = x + r * ldx;
      std::fill(acc, acc + 16, 0.0f);
      if constexpr (std::is_same_v<W, bf16>) {
        for (int64_t p = 0; p < w.k_pad / 2; ++p) {
          const float x0 = load_float(xr + 2 * p), x1 = load_float(xr + 2 * p + 1);
          const W* row = block + p * 32;
          for (int i = 0; i < 16; ++i)
            acc[i] += x0 * load_float(row + 2 * i) + x1 * load_float(row + 2 * i + 1);
        }
      } else {
        for (int64_t kk = 0; kk < w.k; ++kk) {
          const float xv = load_float(xr + kk);
          const W* row = block + kk * 16;
          for (int i = 0; i < 16; ++i) acc[i] += xv * load_float(row + i);
        }
      }
      store16_portable(acc, o, r, b * 16);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2: a 16-column block is two 8-lane halves; up to four rows per weight load.

TM_AVX2 inline void bf16_pair_halves_avx2(const bf16* p, __m256& even, __m256& odd) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF0000)));
}

// NR rows x NB consecutive blocks, each weight vector loaded and widened once for NR rows.
// Every output lane accumulates its k in one fixed order whatever NR and NB, so a row's bits do
// not depend on the row count or the tiling; NB > 1 gives one or two rows 4NB independent FMA
// chains, where one block's two (bf16: a chain of two FMAs a pair of k) left the pass bound by
// FMA latency at a quarter of the FMA rate.
template <int NR, int NB, typename X>
TM_AVX2 void rows_avx2(const PackedWeight& w, const X* x, int64_t ldx, int64_t r,
                       const GemmOut& o, int64_t b) {
  __m256 acc[NR][NB][2];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const int64_t per_block = block_elements(w);
  if (w.is_bf16) {
    const bf16* blocks = static_cast<const bf16*>(w.data) + b * per_block;
    for (int64_t p = 0; p < w.k_pad / 2; ++p) {
      for (int j = 0; j < NB; ++j) {
        const bf16* pair = blocks + j * per_block + p * 32;
        __m256 even0, odd0, even1, odd1;
        bf16_pair_halves_avx2(pair, even0, odd0);
        bf16_pair_halves_avx2(pair + 16, even1, odd1);
        for (int i = 0; i < NR; ++i) {
          const X* xr = x + (r + i) * ldx + 2 * p;
          const __m256 x0 = _mm256_set1_ps(load_float(xr)), x1 = _mm256_set1_ps(load_float(xr + 1));
          acc[i][j][0] = _mm256_fmadd_ps(x1, odd0, _mm256_fmadd_ps(x0, even0, acc[i][j][0]));
          acc[i][j][1] = _mm256_fmadd_ps(x1, odd1, _mm256_fmadd_ps(x0, even1, acc[i][j][1]));
        }
      }
    }
  } else {
    const float* blocks = static_cast<const float*>(w.data) + b * per_block;
    for (int64_t kk = 0; kk < w.k; ++kk) {
      for (int j = 0; j < NB; ++j) {
        const float* row = blocks + j * per_block + kk * 16;
        const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
        for (int i = 0; i < NR; ++i) {
          const __m256 xv = _mm256_set1_ps(load_float(x + (r + i) * ldx + kk));
          acc[i][j][0] = _mm256_fmadd_ps(xv, w0, acc[i][j][0]);
          acc[i][j][1] = _mm256_fmadd_ps(xv, w1, acc[i][j][1]);
        }
      }
    }
  }
  alignas(32) float values[16];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) {
      const int64_t col = (b + j) * 16;
      if (!o.is_bf16 && col + 16 <= o.n) {  // float32, a whole block: two vector stores
        __m256 lo = acc[i][j][0], hi = acc[i][j][1];
        if (o.bias) {
          lo = _mm256_add_ps(lo, _mm256_loadu_ps(o.bias + col));
          hi = _mm256_add_ps(hi, _mm256_loadu_ps(o.bias + col + 8));
        }
        float* out = static_cast<float*>(o.data) + (r + i) * o.ld + col;
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
        continue;
      }
      _mm256_store_ps(values, acc[i][j][0]);
      _mm256_store_ps(values + 8, acc[i][j][1]);
      store16_portable(values, o, r + i, col);
    }
}

// One or two rows over blocks [b0, b1): NB = 4 / 2 blocks a pass (8 accumulators), then singles.
template <int NR, typename X>
TM_AVX2 void few_rows_avx2(const PackedWeight& w, const X* x, int64_t ldx, int64_t r,
                           const GemmOut& o, int64_t b0, int64_t b1) {
  constexpr int kBlocks = NR == 1 ? 4 : 2;
  int64_t b = b0;
  for (; b + kBlocks <= b1; b += kBlocks) rows_avx2<NR, kBlocks>(w, x, ldx, r, o, b);
  if constexpr (kBlocks == 4)
    for (; b + 2 <= b1; b += 2) rows_avx2<NR, 2>(w, x, ldx, r, o, b);
  for (; b < b1; ++b) rows_avx2<NR, 1>(w, x, ldx, r, o, b);
}

// bf16 rows widened to float32 once per call (exact), so the kernel broadcasts each input
// from memory (one load) instead of a scalar load, shift, move and broadcast per row and pair
// of k: that made a 4-row pass issue-bound above its 16 FMAs a step. `ld` = k_pad.
TM_AVX2 inline const float* widen_rows_avx2(const bf16* x, int64_t ldx, int64_t m, int64_t k) {
  thread_local std::vector<float> widened;
  if (static_cast<int64_t>(widened.size()) < m * k) widened.resize(m * k);
  float* out = widened.data();
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* in = reinterpret_cast<const uint16_t*>(x + r * ldx);
    float* row = out + r * k;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
      const __m256i words = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
      _mm256_storeu_ps(row + i, _mm256_castsi256_ps(words));
    }
    for (; i < k; ++i) row[i] = bf16_bits_to_float(in[i]);
  }
  return out;
}

template <typename X>
TM_AVX2 void gemm_avx2(const PackedWeight& w, const X* x, int64_t ldx, int64_t m,
                       const GemmOut& o, int64_t b0, int64_t b1) {
  if constexpr (std::is_same_v<X, bf16>) {
    // bf16 inputs come with bf16 weights only (k_pad even): widen them, then the float path.
    const int64_t k = w.is_bf16 ? w.k_pad : w.k;
    return gemm_avx2<float>(w, widen_rows_avx2(x, ldx, m, k), k, m, o, b0, b1);
  }
  // Block by block, rows in fours (five at the end: 10 accumulators and 4 weight halves fill
  // the 16 registers, so a verification of k + 1 = 5 tokens reads and widens each weight once)
  // and a last three; a last one or two rows then over the blocks a few at a time.
  const int64_t tail = m % 4 == 1 && m >= 5 ? 0 : m % 4 == 3 ? 0 : m % 4;
  const int64_t grouped = m - tail;
  for (int64_t b = b0; b < b1 && grouped > 0; ++b) {
    int64_t r = 0;
    for (; r + 4 <= grouped; r += grouped - r == 5 ? 5 : 4) {
      if (grouped - r == 5) rows_avx2<5, 1>(w, x, ldx, r, o, b);
      else rows_avx2<4, 1>(w, x, ldx, r, o, b);
    }
    if (grouped - r == 3) rows_avx2<3, 1>(w, x, ldx, r, o, b);
  }
  if (tail == 2) few_rows_avx2<2>(w, x, ldx, grouped, o, b0, b1);
  if (tail == 1) few_rows_avx2<1>(w, x, ldx, grouped, o, b0, b1);
}

// ---------------------------------------------------------------------------------------------
// AVX-512: NR rows x NB blocks of accumulators, each weight vector loaded once for NR rows.

template <int NR, int NB, typename X>
TM_AVX512 void tile_avx512(const PackedWeight& w, const X* x, int64_t ldx, int64_t r,
                           const GemmOut& o, int64_t b) {
  __m512 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t per_block = block_elements(w);
  if (w.is_bf16) {
    const bf16* block = static_cast<const bf16*>(w.data) + b * per_block;
    for (int64_t p = 0; p < w.k_pad / 2; ++p) {
      __m512 even[NB], odd[NB];
      for (int j = 0; j < NB; ++j) {
        const __m512i words = _mm512_loadu_si512(block + j * per_block + p * 32);
        even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
        odd[j] = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(0xFFFF0000)));
      }
      for (int i = 0; i < NR; ++i) {
        const X* xr = x + (r + i) * ldx + 2 * p;
        const __m512 x0 = _mm512_set1_ps(load_float(xr)), x1 = _mm512_set1_ps(load_float(xr + 1));
        for (int j = 0; j < NB; ++j)
          acc[i][j] = _mm512_fmadd_ps(x1, odd[j], _mm512_fmadd_ps(x0, even[j], acc[i][j]));
      }
    }
  } else {
    const float* block = static_cast<const float*>(w.data) + b * per_block;
    for (int64_t kk = 0; kk < w.k; ++kk) {
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(block + j * per_block + kk * 16);
      for (int i = 0; i < NR; ++i) {
        const __m512 xv = _mm512_set1_ps(load_float(x + (r + i) * ldx + kk));
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) store16_avx512(acc[i][j], o, r + i, (b + j) * 16);
}

// AVX-512 BF16: bf16 weights and activations, vdpbf16ps on a broadcast pair of x.
template <int NR, int NB>
TM_AVX512BF16 void tile_avx512bf16(const PackedWeight& w, const bf16* x, int64_t ldx, int64_t r,
                                   const GemmOut& o, int64_t b) {
  __m512 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t per_block = block_elements(w);
  const bf16* block = static_cast<const bf16*>(w.data) + b * per_block;
  const int32_t* rows[NR];
  for (int i = 0; i < NR; ++i) rows[i] = reinterpret_cast<const int32_t*>(x + (r + i) * ldx);
  for (int64_t p = 0; p < w.k_pad / 2; ++p) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(block + j * per_block + p * 32);
    for (int i = 0; i < NR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(rows[i][p]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) store16_avx512(acc[i][j], o, r + i, (b + j) * 16);
}

// Rows in fours, blocks in fours (single rows: four independent weight streams).
template <int NB, typename Tile>
inline void rows_by_four(int64_t m, Tile tile) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) tile(std::integral_constant<int, 4>{}, r);
  switch (m - r) {
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

template <typename X>
void gemm_avx512(const PackedWeight& w, const X* x, int64_t ldx, int64_t m, const GemmOut& o,
                 int64_t b0, int64_t b1) {
  int64_t b = b0;
  for (; b + 4 <= b1; b += 4)
    rows_by_four<4>(m, [&](auto nr, int64_t r) { tile_avx512<decltype(nr)::value, 4>(w, x, ldx, r, o, b); });
  for (; b < b1; ++b)
    rows_by_four<1>(m, [&](auto nr, int64_t r) { tile_avx512<decltype(nr)::value, 1>(w, x, ldx, r, o, b); });
}

// Rows in fours, the last 5 or 6 in one pass (24 accumulators, 4 weight vectors and the
// broadcast fit the 32 registers): a k = 4 verification's 5 rows at batch 1 read each weight
// once, not in a pass of 4 and a latency-bound pass of 1 (9 rows: 4 + 5).
template <typename Tile>
inline void rows_by_four_to_six(int64_t m, Tile tile) {
  int64_t r = 0;
  for (; m - r > 6; r += 4) tile(std::integral_constant<int, 4>{}, r);
  switch (m - r) {
    case 6: tile(std::integral_constant<int, 6>{}, r); break;
    case 5: tile(std::integral_constant<int, 5>{}, r); break;
    case 4: tile(std::integral_constant<int, 4>{}, r); break;
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

void gemm_avx512bf16(const PackedWeight& w, const bf16* x, int64_t ldx, int64_t m,
                     const GemmOut& o, int64_t b0, int64_t b1) {
  int64_t b = b0;
  for (; b + 4 <= b1; b += 4)
    rows_by_four_to_six(m, [&](auto nr, int64_t r) { tile_avx512bf16<decltype(nr)::value, 4>(w, x, ldx, r, o, b); });
  for (; b < b1; ++b)
    rows_by_four_to_six(m, [&](auto nr, int64_t r) { tile_avx512bf16<decltype(nr)::value, 1>(w, x, ldx, r, o, b); });
}

// ---------------------------------------------------------------------------------------------
// AMX: C[rows, 16 columns] += A (16 rows of x, 32 k) x B (a packed 16 x 32 block), for up to
// four row blocks per sweep, so that each weight tile is read from memory once and used four
// times (two row blocks by two column blocks read every other tile twice: 41 ms against 27 ms
// for 16 rows over the 30 layers' weights, one thread). Tiles: 0..3 = C, 4 = B, 5 and 6 =
// A of full row blocks (alternating), 7 = A of the group's last row block, whose rows (and
// its C tile's) may be fewer than 16.

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

TM_AMX void configure_tiles(int blocks, int last_rows) {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  config.rows[blocks - 1] = config.rows[7] = static_cast<uint8_t>(last_rows);
  _tile_loadconfig(&config);
}

TM_AMX void store_tile_rows(const float* tile, int rows, const GemmOut& o, int64_t row,
                            int64_t col) {
  for (int i = 0; i < rows; ++i) store16_avx512(_mm512_load_ps(tile + i * 16), o, row + i, col);
}

// Row blocks [r / 16, r / 16 + kBlocks) by column block b over all of k.
template <int kBlocks>
TM_AMX void amx_sweep(const PackedWeight& w, const bf16* x, int64_t ldx, int64_t r, int last_rows,
                      const GemmOut& o, int64_t b, float* scratch) {
  const int64_t steps = w.k_pad / 32;
  const bf16* weights = static_cast<const bf16*>(w.data) + b * block_elements(w);
  const bf16* a = x + r * ldx;
  const int64_t stride = ldx * static_cast<int64_t>(sizeof(bf16));
  _tile_zero(0);
  if (kBlocks > 1) _tile_zero(1);
  if (kBlocks > 2) _tile_zero(2);
  if (kBlocks > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    // The weight stream, kPrefetchSteps tiles ahead (past this block: the next block's start).
    const char* ahead = reinterpret_cast<const char*>(weights + (s + kPrefetchSteps) * 512);
    for (int line = 0; line < 1024; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(4, weights + s * 512, 64);
    const bf16* a_step = a + s * 32;
    if (kBlocks == 1) {
      _tile_loadd(7, a_step, stride);
      _tile_dpbf16ps(0, 7, 4);
    } else if (kBlocks == 2) {
      _tile_loadd(5, a_step, stride);
      _tile_loadd(7, a_step + 16 * ldx, stride);
      _tile_dpbf16ps(0, 5, 4);
      _tile_dpbf16ps(1, 7, 4);
    } else if (kBlocks == 3) {
      _tile_loadd(5, a_step, stride);
      _tile_loadd(6, a_step + 16 * ldx, stride);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(7, a_step + 32 * ldx, stride);
      _tile_dpbf16ps(1, 6, 4);
      _tile_dpbf16ps(2, 7, 4);
    } else {
      _tile_loadd(5, a_step, stride);
      _tile_loadd(6, a_step + 16 * ldx, stride);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(5, a_step + 32 * ldx, stride);
      _tile_dpbf16ps(1, 6, 4);
      _tile_loadd(7, a_step + 48 * ldx, stride);
      _tile_dpbf16ps(2, 5, 4);
      _tile_dpbf16ps(3, 7, 4);
    }
  }
  // Full float32 tiles without a bias go straight to the output; others through `scratch`.
  const bool direct = !o.is_bf16 && o.bias == nullptr && (b + 1) * 16 <= o.n;
  float* out = direct ? static_cast<float*>(o.data) + r * o.ld + b * 16 : nullptr;
  const int64_t out_stride = o.ld * static_cast<int64_t>(sizeof(float));
  auto rows_of = [&](int block) { return block == kBlocks - 1 ? last_rows : 16; };
#define TM_STORE_TILE(T)                                                      \
  if (direct) {                                                             \
    _tile_stored(T, out + 16 * (T)*o.ld, out_stride);                       \
  } else {                                                                  \
    _tile_stored(T, scratch, 64);                                           \
    store_tile_rows(scratch, rows_of(T), o, r + 16 * (T), b * 16);          \
  }
  TM_STORE_TILE(0)
  if (kBlocks > 1) {
    TM_STORE_TILE(1)
  }
  if (kBlocks > 2) {
    TM_STORE_TILE(2)
  }
  if (kBlocks > 3) {
    TM_STORE_TILE(3)
  }
#undef TM_STORE_TILE
}

TM_AMX void gemm_amx(const PackedWeight& w, const bf16* x, int64_t ldx, int64_t m,
                     const GemmOut& o, int64_t b0, int64_t b1) {
  alignas(64) float scratch[16 * 16];
  const int64_t row_blocks = (m + 15) / 16;
  const int tail = static_cast<int>(m - (row_blocks - 1) * 16);  // rows of the last block
  for (int64_t chunk = b0; chunk < b1; chunk += kAmxBlocksPerChunk) {
    const int64_t chunk_end = std::min(b1, chunk + kAmxBlocksPerChunk);
    for (int64_t group = 0; group < row_blocks; group += 4) {
      const int blocks = static_cast<int>(std::min<int64_t>(4, row_blocks - group));
      const int last_rows = group + blocks == row_blocks ? tail : 16;
      configure_tiles(blocks, last_rows);
      const int64_t r = group * 16;
      for (int64_t b = chunk; b < chunk_end; ++b) {
        switch (blocks) {
          case 1: amx_sweep<1>(w, x, ldx, r, last_rows, o, b, scratch); break;
          case 2: amx_sweep<2>(w, x, ldx, r, last_rows, o, b, scratch); break;
          case 3: amx_sweep<3>(w, x, ldx, r, last_rows, o, b, scratch); break;
          default: amx_sweep<4>(w, x, ldx, r, last_rows, o, b, scratch); break;
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

void packed_gemm(const PackedWeight& w, const void* x, int64_t ldx, int64_t m, const GemmOut& o,
                 int64_t b0, int64_t b1, int isa) {
  if (b0 >= b1 || m == 0) return;
  if (w.is_bf16) {
    const bf16* xb = static_cast<const bf16*>(x);
    if (isa >= kAmx && m >= kAmxMinRows && w.k_pad % 32 == 0) return gemm_amx(w, xb, ldx, m, o, b0, b1);
    if (isa >= kAvx512Bf16) return gemm_avx512bf16(w, xb, ldx, m, o, b0, b1);
    if (isa >= kAvx512) return gemm_avx512(w, xb, ldx, m, o, b0, b1);
    if (isa >= kAvx2) return gemm_avx2(w, xb, ldx, m, o, b0, b1);
    return gemm_portable<bf16>(w, xb, ldx, m, o, b0, b1);
  }
  const float* xf = static_cast<const float*>(x);
  if (isa >= kAvx512) return gemm_avx512(w, xf, ldx, m, o, b0, b1);
  if (isa >= kAvx2) return gemm_avx2(w, xf, ldx, m, o, b0, b1);
  gemm_portable<float>(w, xf, ldx, m, o, b0, b1);
}

int64_t gemm_chunk_blocks(const PackedWeight& w, int64_t m, int threads) {
  const int64_t blocks = w.blocks();
  if (threads <= 1) return blocks;
  int64_t per = (blocks + 4 * threads - 1) / (4 * threads);
  if (m >= kAmxMinRows) per = std::min(kAmxBlocksPerChunk, per);
  // AVX2 takes one or two dense rows over 4 (2) blocks a pass (few_rows_avx2): whole passes.
  if (m <= 2 && !w.quantized() && current_isa() < kAvx512) per = (per + 3) / 4 * 4;
  return std::max<int64_t>(per, 1);
}

PackedWeight packed_view(const at::Tensor& packed, int64_t n, int64_t k) {
  const bool is_bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(is_bf16 || packed.scalar_type() == at::kFloat, "packed weight: float32 or bfloat16");
  TORCH_CHECK(packed.is_contiguous() && packed.size(-1) == (is_bf16 ? 2 : 16),
              "packed weight: not a packed layout");
  const int64_t n_pad = packed.size(0) * 16;
  const int64_t k_pad = is_bf16 ? packed.size(1) * 2 : packed.size(1);
  TORCH_CHECK(n <= n_pad && n > n_pad - 16 && k <= k_pad, "packed weight: shape");
  return PackedWeight{packed.data_ptr(), n, k, n_pad, k_pad, is_bf16};
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: [n, k] expected");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_linear_weight: float32 or bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1), n_pad = (n + 15) / 16 * 16;
  const bool is_bf16 = weight.scalar_type() == at::kBFloat16;
  const int64_t k_pad = is_bf16 ? (k + 31) / 32 * 32 : k;
  at::Tensor padded = at::constant_pad_nd(weight, {0, k_pad - k, 0, n_pad - n});
  if (is_bf16)
    return padded.view({n_pad / 16, 16, k_pad / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  return padded.view({n_pad / 16, 16, k}).permute({0, 2, 1}).contiguous();
}

at::Tensor unpack_linear_weight(const at::Tensor& packed, int64_t n, int64_t k) {
  const PackedWeight w = packed_view(packed, n, k);
  at::Tensor plain = w.is_bf16 ? packed.permute({0, 2, 1, 3}).reshape({w.n_pad, w.k_pad})
                               : packed.permute({0, 2, 1}).reshape({w.n_pad, w.k});
  return plain.narrow(0, 0, n).narrow(1, 0, k).contiguous();
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias, bool float32_out) {
  TORCH_CHECK(x.dim() == 2, "packed_linear: x [rows, k] expected");
  const int64_t m = x.size(0), k = x.size(1);
  const PackedWeight w = packed_view(packed, n, k);
  const auto weight_dtype = packed.scalar_type();
  at::Tensor xin = x.to(weight_dtype).contiguous();
  if (w.is_bf16 && w.k_pad != k) xin = at::constant_pad_nd(xin, {0, w.k_pad - k});
  at::Tensor out = at::empty({m, n}, float32_out ? x.options().dtype(at::kFloat) : x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "packed_linear: bias size");
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "packed_linear: float32 or bfloat16 activations");
  const GemmOut o{out.data_ptr(), n, out.scalar_type() == at::kBFloat16,
                  b.defined() ? b.data_ptr<float>() : nullptr, n};
  const int isa = current_isa();
  if (isa >= kAmx && w.is_bf16) amx_permitted();
  // Tiny products stay on the calling thread.
  const int threads = w.n_pad * w.k_pad * std::max<int64_t>(m, 4) < (1 << 16) ? 1 : team_size();
  const int64_t per = gemm_chunk_blocks(w, m, threads);
  const void* input = xin.data_ptr();
  parallel_chunks((w.blocks() + per - 1) / per, [&](int64_t chunk, int) {
    packed_gemm(w, input, w.k_pad, m, o, chunk * per, std::min(w.blocks(), (chunk + 1) * per), isa);
  }, threads, "linear (own call)", w.bytes());
  return out;
}

PackedLinear PackedLinear::dense(const at::Tensor& packed, int64_t n, int64_t k) {
  const auto product = [](const at::Tensor& x, const PackedWeight& w,
                          const std::vector<at::Tensor>& tensors,
                          const c10::optional<at::Tensor>& bias, bool float32_out) {
    return packed_linear(x, tensors[0], w.n, bias, float32_out);
  };
  return PackedLinear(packed_view(packed, n, k), {packed}, product);
}

}  // namespace tokenmill
