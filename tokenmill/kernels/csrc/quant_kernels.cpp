// tokenmill's quantized linear kernels: int8 and int4 weights with a scale (and optionally an
// offset) per group of input columns, `out = x @ W.T + bias`, W = code * scale + offset.
//
// Layout (made at load time by tokenmill/kernels/quant.py, "interleaved rows"): output rows in
// blocks of 16; within a block the codes of four consecutive input columns of each of the 16
// rows lie in one 32-bit lane, so that 64 bytes hold 16 rows x 4 columns (int8) or 16 rows x 8
// columns (int4: byte j of a lane holds column j in its low nibble and column 4 + j in its
// high one). A block is streamed once, front to back, and one vector load feeds one VNNI dot
// product for all 16 rows; the same 64-byte rows are what an AMX tile loads. Codes are stored
// unsigned: an int8 code c as c + 128, an int4 code as c + 8 (so `center` is 128 or 8).
// Scales and offsets are float16, [blocks, groups, 16].
//
// Activations: where the CPU has AVX-512 VNNI (level 3) they are quantized at run time to int8
// per token and block of 32 columns (a float scale each: W8A8 dynamic, as llama.cpp's q8_0
// activations), and the products are integer; elsewhere they stay float and the codes are
// widened to float (levels 0-2). Levels as in cpu_kernels.cpp: 0 portable C++, 1 AVX2 + FMA +
// F16C, 2 AVX-512, 3 AVX-512 with VNNI; `quant_set_isa` picks one (never above the CPU's).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using bf16 = c10::BFloat16;
using half = c10::Half;

constexpr int64_t kBlockRows = 16;
constexpr int64_t kActBlock = 32;  // columns per activation scale
constexpr int kMaxTile = 8;        // tokens per pass over a weight block

int g_quant_isa = 0;

#define TM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define TM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

int detect_quant_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return __builtin_cpu_supports("avx512vnni") ? 3 : 2;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return static_cast<float>(v); }

// A packed weight and what one call multiplies it with.
struct Problem {
  const uint8_t* codes;  // [blocks, block_bytes]
  const half* scales;    // [blocks, groups, 16]
  const half* offsets;   // same, or null
  int64_t n, k, kp;      // output rows, input columns, input columns padded (multiple of 32)
  int64_t group, groups; // columns per scale, kp / group
  int bits;              // 8 or 4
  int64_t block_bytes() const { return kBlockRows * kp * bits / 8; }
  int center() const { return bits == 8 ? 128 : 8; }
};

// Activations, prepared once per call: int8 per 32-column block (VNNI) or float (others).
struct Activations {
  int64_t rows;
  const int8_t* q;       // [rows, kp] (VNNI)
  const float* qscale;   // [rows, kp / 32]
  const int32_t* qsum;   // [rows, kp / 16]: sums of each 16 codes
  const float* xf;       // [rows, kp] (float paths)
  const float* group_sum;// [rows, groups]: sum of each group's (dequantized) activations
};

// ---------------------------------------------------------------------------------------------
// Activation preparation.

template <typename T>
void widen_row(const T* x, int64_t k, int64_t kp, float* out) {
  for (int64_t i = 0; i < k; ++i) out[i] = to_float(x[i]);
  for (int64_t i = k; i < kp; ++i) out[i] = 0.0f;
}

// One row to int8 per block of 32: scale = max|x| / 127, code = round(x / scale) (to nearest
// even: the rounding mode the vector conversion uses; tests emulate it with torch.round).
void quantize_row(const float* x, int64_t kp, int8_t* q, float* scale, int32_t* sum16) {
  for (int64_t b = 0; b < kp / kActBlock; ++b) {
    const float* xb = x + b * kActBlock;
    float amax = 0.0f;
    for (int i = 0; i < kActBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    scale[b] = amax / 127.0f;
    for (int half_block = 0; half_block < 2; ++half_block) {
      int32_t total = 0;
      for (int i = half_block * 16; i < half_block * 16 + 16; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inverse));
        q[b * kActBlock + i] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
        total += q[b * kActBlock + i];
      }
      sum16[b * 2 + half_block] = total;
    }
  }
}

// Sum of each group's activations: from the int8 codes where the product is integer (so the
// offsets meet the same activations the codes do), else from the floats.
void group_sums(const Problem& p, const Activations& a, int64_t row, bool quantized, float* out) {
  for (int64_t g = 0; g < p.groups; ++g) {
    float total = 0.0f;
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += 16) {
      if (quantized) {
        total += a.qscale[row * (p.kp / kActBlock) + k / kActBlock] *
                 static_cast<float>(a.qsum[row * (p.kp / 16) + k / 16]);
      } else {
        const float* x = a.xf + row * p.kp + k;
        for (int i = 0; i < 16; ++i) total += x[i];
      }
    }
    out[g] = total;
  }
}

// ---------------------------------------------------------------------------------------------
// Portable: one scalar loop over the same layout (the reference level; slow).

inline int code_at(const Problem& p, const uint8_t* block, int64_t lane, int64_t col) {
  if (p.bits == 8) return block[(col / 4) * 64 + lane * 4 + col % 4] - 128;
  const int64_t within = col % 8;
  const uint8_t byte = block[(col / 8) * 64 + lane * 4 + within % 4];
  return (within < 4 ? byte & 0x0F : byte >> 4) - 8;
}

void block_portable(const Problem& p, const Activations& a, int64_t nb, int64_t m0, int tile,
                    float* out) {
  const uint8_t* block = p.codes + nb * p.block_bytes();
  for (int r = 0; r < tile; ++r) {
    const float* x = a.xf + (m0 + r) * p.kp;
    const float* sums = a.group_sum + (m0 + r) * p.groups;
    for (int64_t lane = 0; lane < kBlockRows; ++lane) {
      float total = 0.0f;
      for (int64_t g = 0; g < p.groups; ++g) {
        float dot = 0.0f;
        for (int64_t col = g * p.group; col < (g + 1) * p.group; ++col)
          dot += static_cast<float>(code_at(p, block, lane, col)) * x[col];
        const int64_t at = (nb * p.groups + g) * kBlockRows + lane;
        total += static_cast<float>(p.scales[at]) * dot;
        if (p.offsets) total += static_cast<float>(p.offsets[at]) * sums[g];
      }
      out[r * kBlockRows + lane] = total;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2 (float activations): a block as two halves of 8 rows (bytes 0-31 / 32-63 of each 64).

template <int BITS, int R>
TM_AVX2 void half_block_avx2(const Problem& p, const Activations& a, int64_t nb, int64_t m0,
                             int half_index, float* out) {
  const uint8_t* block = p.codes + nb * p.block_bytes() + 32 * half_index;
  const __m256i low_nibbles = _mm256_set1_epi32(0x0F);
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256 dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_ps();
    const int64_t col_end = (g + 1) * p.group;
    for (int64_t col = g * p.group; col < col_end; col += BITS == 8 ? 4 : 8) {
      // One 32-byte load: 8 rows x 4 columns (int8) or 8 rows x 8 columns (int4).
      const uint8_t* at = block + (BITS == 8 ? col / 4 : col / 8) * 64;
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      if constexpr (BITS == 8) {
        raw = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));  // signed codes
        for (int j = 0; j < 4; ++j) {
          __m256i v = j == 3 ? raw : _mm256_slli_epi32(raw, 24 - 8 * j);
          __m256 w = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
          for (int r = 0; r < R; ++r)
            dot[r] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(a.xf + (m0 + r) * p.kp + col + j),
                                     dot[r]);
        }
      } else {
        for (int nibble = 0; nibble < 8; ++nibble) {
          __m256i v = _mm256_and_si256(_mm256_srli_epi32(raw, 4 * nibble), low_nibbles);
          __m256 w = _mm256_cvtepi32_ps(v);
          const int64_t c = col + (nibble & 1) * 4 + nibble / 2;
          for (int r = 0; r < R; ++r)
            dot[r] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(a.xf + (m0 + r) * p.kp + c), dot[r]);
        }
      }
    }
    const int64_t at = (nb * p.groups + g) * kBlockRows + 8 * half_index;
    __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scales + at)));
    __m256 offset = p.offsets ? _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(p.offsets + at)))
                              : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m256 sum = _mm256_set1_ps(a.group_sum[(m0 + r) * p.groups + g]);
      // int4 codes were widened unsigned (code + 8): take 8 x the group's sum back off.
      if constexpr (BITS == 4) dot[r] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), sum, dot[r]);
      total[r] = _mm256_fmadd_ps(scale, dot[r], total[r]);
      if (p.offsets) total[r] = _mm256_fmadd_ps(offset, sum, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kBlockRows + 8 * half_index, total[r]);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 (float activations): one zmm per 16 rows.

template <int BITS, int R>
TM_AVX512 void block_avx512(const Problem& p, const Activations& a, int64_t nb, int64_t m0,
                            float* out) {
  const uint8_t* block = p.codes + nb * p.block_bytes();
  const __m512i low_nibbles = _mm512_set1_epi32(0x0F);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
    const int64_t col_end = (g + 1) * p.group;
    for (int64_t col = g * p.group; col < col_end; col += BITS == 8 ? 4 : 8) {
      const uint8_t* at = block + (BITS == 8 ? col / 4 : col / 8) * 64;
      __m512i raw = _mm512_loadu_si512(at);
      if constexpr (BITS == 8) {
        raw = _mm512_xor_si512(raw, _mm512_set1_epi8(static_cast<char>(0x80)));
        for (int j = 0; j < 4; ++j) {
          __m512i v = j == 3 ? raw : _mm512_slli_epi32(raw, 24 - 8 * j);
          __m512 w = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
          for (int r = 0; r < R; ++r)
            dot[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(a.xf[(m0 + r) * p.kp + col + j]), dot[r]);
        }
      } else {
        for (int nibble = 0; nibble < 8; ++nibble) {
          __m512i v = _mm512_and_si512(_mm512_srli_epi32(raw, 4 * nibble), low_nibbles);
          __m512 w = _mm512_cvtepi32_ps(v);
          const int64_t c = col + (nibble & 1) * 4 + nibble / 2;
          for (int r = 0; r < R; ++r)
            dot[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(a.xf[(m0 + r) * p.kp + c]), dot[r]);
        }
      }
    }
    const int64_t at = (nb * p.groups + g) * kBlockRows;
    __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scales + at)));
    __m512 offset = p.offsets ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(p.offsets + at)))
                              : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 sum = _mm512_set1_ps(a.group_sum[(m0 + r) * p.groups + g]);
      if constexpr (BITS == 4) dot[r] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sum, dot[r]);
      total[r] = _mm512_fmadd_ps(scale, dot[r], total[r]);
      if (p.offsets) total[r] = _mm512_fmadd_ps(offset, sum, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlockRows, total[r]);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI (int8 activations): vpdpbusd multiplies the unsigned weight codes by the signed
// activation codes, four columns per 32-bit lane, into int32 per (row, token). Per segment of
// up to 32 columns (one activation scale): subtract center x the activations' sum (the codes
// are stored plus center), to float, times the activation scale; per group: times the weight
// scale, plus the offset times the group's activation sum.

// One segment (SEG = 16 or 32 columns, one activation scale) of R tokens against a block's 16
// rows: the int32 dot products of the codes, `acc[r]`.
template <int BITS, int R, int SEG>
TM_VNNI inline void segment_vnni(const uint8_t* w, const int8_t* const* xq, int64_t col,
                                 __m512i* acc) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 8
  for (int c = 0; c < SEG / (BITS == 8 ? 4 : 8); ++c) {
    __m512i raw = _mm512_loadu_si512(w + 64 * c);
    if constexpr (BITS == 8) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq[r] + col + 4 * c, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], raw, _mm512_set1_epi32(x4));
      }
    } else {
      __m512i lo = _mm512_and_si512(raw, low_nibbles);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x_lo, x_hi;
        std::memcpy(&x_lo, xq[r] + col + 8 * c, 4);
        std::memcpy(&x_hi, xq[r] + col + 8 * c + 4, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(x_lo));
        acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(x_hi));
      }
    }
  }
}

template <int BITS, int R, int SEG>
TM_VNNI void block_vnni(const Problem& p, const Activations& a, int64_t nb, int64_t m0,
                        float* out) {
  constexpr float center = BITS == 8 ? 128.0f : 8.0f;
  constexpr int64_t segment_bytes = SEG * kBlockRows * BITS / 8;
  const uint8_t* w = p.codes + nb * p.block_bytes();
  const int64_t scale_stride = p.kp / kActBlock;
  const int8_t* xq[R];
  const float* x_scale[R];
  const float* x_group_sum[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q + (m0 + r) * p.kp;
    x_scale[r] = a.qscale + (m0 + r) * scale_stride;
    x_group_sum[r] = a.group_sum + (m0 + r) * p.groups;
  }
  __m512 total[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const half* scales = p.scales + nb * p.groups * kBlockRows;
  const half* offsets = p.offsets ? p.offsets + nb * p.groups * kBlockRows : nullptr;
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 dot[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
    const int64_t group_end = (g + 1) * p.group;
    for (int64_t col = g * p.group; col < group_end; col += SEG, w += segment_bytes) {
      __m512i acc[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
      segment_vnni<BITS, R, SEG>(w, xq, col, acc);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        dot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]),
                                 _mm512_set1_ps(x_scale[r][col / kActBlock]), dot[r]);
    }
    // The codes were stored plus `center`: their dot products carry center x the group's
    // activation sum, which the offset term takes back off (offset - center x scale).
    __m512 scale = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kBlockRows)));
    __m512 offset = offsets ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(offsets + g * kBlockRows)))
                            : _mm512_setzero_ps();
    offset = _mm512_fnmadd_ps(_mm512_set1_ps(center), scale, offset);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      total[r] = _mm512_fmadd_ps(scale, dot[r], total[r]);
      total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_group_sum[r][g]), total[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlockRows, total[r]);
}

// ---------------------------------------------------------------------------------------------
// Dispatch: a tile of up to kMaxTile tokens against one 16-row block.

template <int BITS, int R>
void run_tile(const Problem& p, const Activations& a, int64_t nb, int64_t m0, float* out, int isa) {
  if (isa >= 3) {
    if (p.group == 16) block_vnni<BITS, R, 16>(p, a, nb, m0, out);
    else block_vnni<BITS, R, 32>(p, a, nb, m0, out);
  }
  else if (isa == 2) block_avx512<BITS, R>(p, a, nb, m0, out);
  else if (isa == 1) {
    half_block_avx2<BITS, R>(p, a, nb, m0, 0, out);
    half_block_avx2<BITS, R>(p, a, nb, m0, 1, out);
  } else block_portable(p, a, nb, m0, R, out);
}

template <int BITS>
void tile_dispatch(const Problem& p, const Activations& a, int64_t nb, int64_t m0, int tile,
                   float* out, int isa) {
  switch (tile) {
    case 1: return run_tile<BITS, 1>(p, a, nb, m0, out, isa);
    case 2: return run_tile<BITS, 2>(p, a, nb, m0, out, isa);
    case 3: return run_tile<BITS, 3>(p, a, nb, m0, out, isa);
    case 4: return run_tile<BITS, 4>(p, a, nb, m0, out, isa);
    case 5: return run_tile<BITS, 5>(p, a, nb, m0, out, isa);
    case 6: return run_tile<BITS, 6>(p, a, nb, m0, out, isa);
    case 7: return run_tile<BITS, 7>(p, a, nb, m0, out, isa);
    default: return run_tile<BITS, 8>(p, a, nb, m0, out, isa);
  }
}

template <typename T>
void store_tile(const float* tile_out, int tile, int64_t nb, int64_t m0, const Problem& p,
                const float* bias, T* out) {
  const int64_t n0 = nb * kBlockRows, rows = std::min(kBlockRows, p.n - n0);
  for (int r = 0; r < tile; ++r) {
    T* row = out + (m0 + r) * p.n + n0;
    for (int64_t i = 0; i < rows; ++i)
      row[i] = static_cast<T>(tile_out[r * kBlockRows + i] + (bias ? bias[n0 + i] : 0.0f));
  }
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets,
                        const c10::optional<at::Tensor>& bias, int64_t bits, int64_t group,
                        int64_t out_features) {
  TORCH_CHECK(bits == 8 || bits == 4, "quant_linear: bits must be 8 or 4");
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2,
              "quant_linear: codes must be contiguous uint8 [blocks, block bytes]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3,
              "quant_linear: scales must be contiguous float16 [blocks, groups, 16]");
  const int64_t blocks = codes.size(0), groups = scales.size(1), k = x.size(1);
  const int64_t kp = groups * group;
  TORCH_CHECK(group % 16 == 0 && kp % kActBlock == 0 && kp >= k && kp - k < kActBlock + group,
              "quant_linear: group size and padded width do not fit x");
  TORCH_CHECK(codes.size(1) == kBlockRows * kp * bits / 8 && scales.size(0) == blocks &&
                  scales.size(2) == kBlockRows && blocks * kBlockRows >= out_features &&
                  (blocks - 1) * kBlockRows < out_features,
              "quant_linear: codes and scales do not fit the shape");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  if (has_offsets)
    TORCH_CHECK(offsets->scalar_type() == at::kHalf && offsets->is_contiguous() &&
                    offsets->sizes() == scales.sizes(),
                "quant_linear: offsets must be like scales");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == out_features, "quant_linear: bias size");
  }

  Problem p{codes.data_ptr<uint8_t>(),
            reinterpret_cast<const half*>(scales.data_ptr<at::Half>()),
            has_offsets ? reinterpret_cast<const half*>(offsets->data_ptr<at::Half>()) : nullptr,
            out_features, k, kp, group, groups, static_cast<int>(bits)};
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const int isa = g_quant_isa;
  const bool quantized = isa >= 3;

  // Activations: float (padded) always; int8 codes, scales and sums where VNNI multiplies.
  at::Tensor xc = x.contiguous();
  at::Tensor xf = at::empty({rows, kp}, x.options().dtype(at::kFloat));
  at::Tensor xq, qscale, qsum;
  if (quantized) {
    xq = at::empty({rows, kp}, x.options().dtype(at::kChar));
    qscale = at::empty({rows, kp / kActBlock}, x.options().dtype(at::kFloat));
    qsum = at::empty({rows, kp / 16}, x.options().dtype(at::kInt));
  }
  at::Tensor group_sum = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  Activations a{rows,
                quantized ? xq.data_ptr<int8_t>() : nullptr,
                quantized ? qscale.data_ptr<float>() : nullptr,
                quantized ? qsum.data_ptr<int32_t>() : nullptr,
                xf.data_ptr<float>(),
                group_sum.data_ptr<float>()};
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  auto prepare = [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = xf.data_ptr<float>() + m * kp;
      if (is_bf16) widen_row(xc.data_ptr<bf16>() + m * k, k, kp, row);
      else widen_row(xc.data_ptr<float>() + m * k, k, kp, row);
      if (quantized)
        quantize_row(row, kp, xq.data_ptr<int8_t>() + m * kp,
                     qscale.data_ptr<float>() + m * (kp / kActBlock),
                     qsum.data_ptr<int32_t>() + m * (kp / 16));
      group_sums(p, a, m, quantized, group_sum.data_ptr<float>() + m * groups);
    }
  };
  if (rows * kp >= (1 << 16)) at::parallel_for(0, rows, 1, prepare);
  else prepare(0, rows);

  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  // Chunks of whole blocks: at least ~64 KB of weight work each, so that a small product stays
  // on one thread (waking another costs more than it saves).
  const int64_t work = p.block_bytes() * std::min<int64_t>(rows, kMaxTile);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / work);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float tile_out[kMaxTile * kBlockRows];
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kMaxTile, rows - m0));
        if (bits == 8) tile_dispatch<8>(p, a, nb, m0, tile, tile_out, isa);
        else tile_dispatch<4>(p, a, nb, m0, tile, tile_out, isa);
        if (is_bf16) store_tile(tile_out, tile, nb, m0, p, bias_ptr, out.data_ptr<bf16>());
        else store_tile(tile_out, tile, nb, m0, p, bias_ptr, out.data_ptr<float>());
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Dequantization into a transposed bfloat16 weight `[in, out]`, for products of many rows: a
// dense bfloat16 GEMM (oneDNN, AMX tiles where the CPU has them) on it beats the dot-product
// kernels above once there are enough rows to pay for the conversion. Each 16-row block's codes
// of one column are 16 consecutive values of a row of the transposed weight: one vector store.

template <int BITS>
TM_AVX512 void dequantize_block_avx512(const Problem& p, int64_t nb, bf16* out) {
  const uint8_t* block = p.codes + nb * p.block_bytes();
  const int64_t rows = std::min(kBlockRows, p.n - nb * kBlockRows);
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  const __m512i low_nibbles = _mm512_set1_epi32(0x0F);
  constexpr float center = BITS == 8 ? 128.0f : 8.0f;
  bf16* column0 = out + nb * kBlockRows;
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t at = (nb * p.groups + g) * kBlockRows;
    __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scales + at)));
    __m512 offset = p.offsets ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(p.offsets + at)))
                              : _mm512_setzero_ps();
    offset = _mm512_fnmadd_ps(_mm512_set1_ps(center), scale, offset);  // unsigned codes
    for (int64_t col = g * p.group; col < (g + 1) * p.group; col += BITS == 8 ? 4 : 8) {
      __m512i raw = _mm512_loadu_si512(block + (BITS == 8 ? col / 4 : col / 8) * 64);
      for (int i = 0; i < (BITS == 8 ? 4 : 8); ++i) {
        __m512i code = BITS == 8 ? _mm512_and_si512(_mm512_srli_epi32(raw, 8 * i), _mm512_set1_epi32(0xFF))
                                 : _mm512_and_si512(_mm512_srli_epi32(raw, 4 * i), low_nibbles);
        const int64_t c = BITS == 8 ? col + i : col + (i & 1) * 4 + i / 2;
        if (c >= p.k) continue;  // padding columns
        __m512i w = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_cvtepi32_ps(code), scale, offset));
        // To bfloat16, rounding to nearest even (as c10::BFloat16 does; no NaNs here).
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(w, 16), _mm512_set1_epi32(1));
        w = _mm512_add_epi32(w, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
        __m256i packed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16));
        _mm256_mask_storeu_epi16(column0 + c * p.n, mask, packed);
      }
    }
  }
}

void dequantize_block_portable(const Problem& p, int64_t nb, bf16* out) {
  const uint8_t* block = p.codes + nb * p.block_bytes();
  const int64_t rows = std::min(kBlockRows, p.n - nb * kBlockRows);
  for (int64_t lane = 0; lane < rows; ++lane) {
    for (int64_t col = 0; col < p.k; ++col) {
      const int64_t at = (nb * p.groups + col / p.group) * kBlockRows + lane;
      float w = static_cast<float>(code_at(p, block, lane, col)) * static_cast<float>(p.scales[at]);
      if (p.offsets) w += static_cast<float>(p.offsets[at]);
      out[col * p.n + nb * kBlockRows + lane] = bf16(w);
    }
  }
}

at::Tensor quant_dequantize_t(const at::Tensor& codes, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& offsets, int64_t bits,
                              int64_t group, int64_t out_features, int64_t in_features) {
  TORCH_CHECK(bits == 8 || bits == 4, "quant_dequantize_t: bits must be 8 or 4");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3,
              "quant_dequantize_t: packed codes and scales expected");
  const int64_t blocks = codes.size(0), groups = scales.size(1), kp = groups * group;
  TORCH_CHECK(codes.size(1) == kBlockRows * kp * bits / 8 && kp >= in_features &&
                  blocks * kBlockRows >= out_features,
              "quant_dequantize_t: codes and scales do not fit the shape");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  Problem p{codes.data_ptr<uint8_t>(),
            reinterpret_cast<const half*>(scales.data_ptr<at::Half>()),
            has_offsets ? reinterpret_cast<const half*>(offsets->data_ptr<at::Half>()) : nullptr,
            out_features, in_features, kp, group, groups, static_cast<int>(bits)};
  at::Tensor out = at::empty({in_features, out_features}, codes.options().dtype(at::kBFloat16));
  bf16* data = out.data_ptr<bf16>();
  const int isa = g_quant_isa;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      if (isa >= 2 && bits == 8) dequantize_block_avx512<8>(p, nb, data);
      else if (isa >= 2) dequantize_block_avx512<4>(p, nb, data);
      else dequantize_block_portable(p, nb, data);
    }
  });
  return out;
}

int64_t quant_set_isa(int64_t level) {
  g_quant_isa = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(level, detect_quant_isa())));
  return g_quant_isa;
}

int64_t quant_detect_isa() { return detect_quant_isa(); }
int64_t quant_get_isa() { return g_quant_isa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, Tensor? bias, "
        "int bits, int group, int out_features) -> Tensor");
  m.def("quant_dequantize_t(Tensor codes, Tensor scales, Tensor? offsets, int bits, int group, "
        "int out_features, int in_features) -> Tensor");
  m.def("quant_set_isa(int level) -> int", &quant_set_isa);
  m.def("quant_detect_isa() -> int", &quant_detect_isa);
  m.def("quant_get_isa() -> int", &quant_get_isa);
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize_t", &quant_dequantize_t);
}
