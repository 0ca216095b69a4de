// Quantized linears on packed int8 / int4 weights (layout and paths: int_linear.h).
//
// Layout, as tokenmill/kernels/int_linear.py packs it: output rows in blocks of 16; within a block
// the codes of four consecutive input columns of each of the 16 rows lie in one 32-bit lane,
// so that 64 bytes hold 16 rows x 4 columns (int8) or 16 rows x 8 columns (int4: byte j of a
// lane holds column j in its low nibble and column 4 + j in its high one). A block streams
// once, front to back, and one vector load feeds one VNNI dot product for all 16 rows. Codes
// are stored unsigned: an int8 code c as c + 128, an int4 code as c + 8 (`center`). Scales and
// offsets are float16, [blocks, groups, 16].
//
// 5-bit codes (GGUF's Q5_0 / Q5_K, kept at their width) are the int4 layout of their low four
// bits followed, in the same block, by their high bits: for each 64-byte chunk of nibbles (8
// columns), one 16-byte pair of bit masks, the first 8 bytes for the chunk's low nibbles and
// the next 8 for its high ones, bit b of a mask belonging to byte b of the chunk
// (`split_chunk_avx512` adds them back with masked byte adds). Codes are stored plus 16.
// 6-bit codes (GGUF's Q6_K) are the int4 layout of their low four bits followed by their two
// high bits in the 2-bit codes' layout below (64 bytes per 16 columns, at the place the masks
// of its first chunk would be): a shift and a mask per 8 columns put them beside the nibbles,
// where masks cost AVX2 (no mask registers) ~10 instructions a vector. Stored plus 32.
//
// 2- and 3-bit codes (GGUF's Q2_K / Q3_K at their width) are bit pairs instead of nibbles:
// each 64-byte chunk holds 16 columns, byte j of a row's lane column j in bits 0-1, 4 + j in
// bits 2-3, 8 + j in 4-5 and 12 + j in 6-7; a 3-bit code's high bit follows as 5- and 6-bit
// codes' do (one pair of masks per 8 columns). Split per 8 columns like the nibbles.
//
// IQ4 codes (kIq4NlBits: GGUF's IQ4_NL / IQ4_XS) are int4's layout of indices into llama.cpp's
// non-linear table; splitting a chunk looks each nibble up (one byte shuffle) as its value plus
// 128, so every path after the split is int8's arithmetic with center 128.
#include "int_linear.h"

#include "thread_pool.h"

#include <ATen/ops/empty.h>

#include <array>
#include <atomic>
#include <cmath>
#include <vector>

namespace tokenmill {
namespace {

using half = c10::Half;

constexpr int64_t kBlockRows = 16;
constexpr int64_t kActBlock = 32;  // columns per activation scale
constexpr int kMaxTile = 8;        // tokens per pass over a weight block

// IQ4 codes split into their table's values plus 128.
constexpr int center_of(int bits) { return bits == kIq4NlBits ? 128 : 1 << (bits - 1); }
// Bits a code takes in the packed layout.
constexpr int stored_bits(int bits) { return bits == kIq4NlBits ? 4 : bits; }
// Bits of a code in its chunk's base layout: nibbles, or bit pairs for 2- and 3-bit codes.
constexpr int base_bits(int bits) { return bits < 4 ? 2 : 4; }
// Whether codes carry high bits after their base (3-, 5- and 6-bit codes), and whether as bit
// pairs (6-bit) rather than masks.
constexpr bool has_high_bits(int bits) { return bits == 5 || bits == 6 || bits == 3; }
constexpr bool paired_high_bits(int bits) { return bits == 6; }
// Columns per 64-byte load of codes: 4 int8 codes per 32-bit lane, else 8 nibbles.
constexpr int lane_cols(int bits) { return bits == 8 ? 4 : 8; }
// llama.cpp's IQ4_NL values plus 128, as one 16-byte shuffle table.
alignas(16) constexpr std::array<uint8_t, 16> kIq4Unsigned = [] {
  std::array<uint8_t, 16> table{};
  for (int i = 0; i < 16; ++i) table[i] = static_cast<uint8_t>(kIq4NlValues[i] + 128);
  return table;
}();

std::atomic<int64_t> g_quant_prefetch{0};
std::atomic<int> g_quant_prefetch_hint{0};

// A packed weight as the kernels read it.
struct Problem {
  const uint8_t* codes;  // [blocks, block_bytes]
  const half* scales;    // [blocks, groups, 16], or null where factored:
  const half* offsets;   // like scales, or null
  int64_t n, k, kp;      // output rows, input columns, input columns padded (multiple of 32)
  int64_t group, groups; // columns per scale, kp / group
  int bits;              // 8, 6, 5, 4 or kIq4NlBits
  const int8_t* sub_scales = nullptr;   // factored scales: [blocks, groups, 16]
  const half* super_scales = nullptr;   // times [blocks, groups / super_groups, 16]
  int64_t super_groups = 0;
  int64_t prefetch = 0;  // bytes ahead of the codes read to prefetch (0: none)
  // Where group g's 16 scales of block nb are: (its own, its super-block's).
  int64_t scale_at(int64_t nb, int64_t g) const { return (nb * groups + g) * kBlockRows; }
  // super_groups is kSuperCols / group (checked at packing): shifts here, not the two 64-bit
  // divisions a runtime divisor costs in every group of the kernels' inner loops.
  int64_t super_at(int64_t nb, int64_t g) const {
    return (nb * (kp / kSuperCols) + g * group / kSuperCols) * kBlockRows;
  }
  float scale(int64_t nb, int64_t g, int64_t lane) const {
    if (scales) return static_cast<float>(scales[scale_at(nb, g) + lane]);
    return static_cast<float>(sub_scales[scale_at(nb, g) + lane]) *
           static_cast<float>(super_scales[super_at(nb, g) + lane]);
  }
  int64_t block_bytes() const { return kBlockRows * kp * stored_bits(bits) / 8; }
  // 3-, 5- and 6-bit codes: the high bits of a block's 8-column `chunk` (after its base); for
  // 6-bit codes, of the 16 columns from an even `chunk` (its bit pairs). The kernels name their
  // width (BITS): the offsets are then constants, not ~10 instructions on `bits` a chunk.
  template <int BITS = 0>
  const uint8_t* high_bits(const uint8_t* block, int64_t chunk) const {
    const int width = BITS ? BITS : bits;
    return block + kBlockRows * kp * base_bits(width) / 8 + chunk * 16 * (width - base_bits(width));
  }
};

Problem problem_of(const PackedWeight& w) {
  Problem p{static_cast<const uint8_t*>(w.data), w.scales, w.offsets, w.n, w.k, w.k_pad,
            w.group, w.k_pad / w.group, w.bits};
  p.sub_scales = w.sub_scales;
  p.super_scales = w.super_scales;
  p.super_groups = w.super_groups;
  p.prefetch = g_quant_prefetch.load(std::memory_order_relaxed);
  return p;
}

// The scales of group g for the 16 rows of block nb (AVX-512) or 8 of them from `lane0`.
TM_AVX512 inline __m512 scales16(const Problem& p, int64_t nb, int64_t g) {
  if (p.scales)
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scales + p.scale_at(nb, g))));
  const __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.sub_scales + p.scale_at(nb, g)))));
  return _mm512_mul_ps(sub, _mm512_cvtph_ps(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(p.super_scales + p.super_at(nb, g)))));
}

TM_AVX2 inline __m256 scales8(const Problem& p, int64_t nb, int64_t g, int64_t lane0) {
  if (p.scales)
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scales + p.scale_at(nb, g) + lane0)));
  const __m256 sub = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.sub_scales + p.scale_at(nb, g) + lane0))));
  return _mm256_mul_ps(sub, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                p.super_scales + p.super_at(nb, g) + lane0))));
}

// ---------------------------------------------------------------------------------------------
// Input preparation.

template <typename T>
void widen_row(const T* x, int64_t k, int64_t kp, float* out) {
  for (int64_t i = 0; i < k; ++i) out[i] = load_float(x + i);
  for (int64_t i = k; i < kp; ++i) out[i] = 0.0f;
}

// widen_row of bf16 16 at a time (the scalar loop was ~a third of a batch-1 product's
// preparation); exact, as the scalar widening is.
TM_AVX512 void widen_row_avx512(const bf16* x, int64_t k, int64_t kp, float* out) {
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
  for (; i < k; ++i) out[i] = load_float(x + i);
  for (; i < kp; ++i) out[i] = 0.0f;
}

// One row to int8 per block of 32: scale = max|x| / 127, code = round(x / scale) (to nearest
// even: the rounding mode the vector conversion uses; tests emulate it with torch.round).
void quantize_row_portable(const float* x, int64_t kp, int8_t* q, float* scale, int32_t* sum16) {
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

TM_AVX512BF16 void quantize_row_avx512(const float* x, int64_t kp, int8_t* q, float* scale,
                                       int32_t* sum16) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < kp / kActBlock; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * kActBlock);
    const __m512 hi = _mm512_loadu_ps(x + b * kActBlock + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    scale[b] = amax / 127.0f;
    const __m512 factor = _mm512_set1_ps(inverse);
    const __m512i min = _mm512_set1_epi32(-127), max = _mm512_set1_epi32(127);
    const __m512i q_lo =
        _mm512_min_epi32(max, _mm512_max_epi32(min, _mm512_cvtps_epi32(_mm512_mul_ps(lo, factor))));
    const __m512i q_hi =
        _mm512_min_epi32(max, _mm512_max_epi32(min, _mm512_cvtps_epi32(_mm512_mul_ps(hi, factor))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kActBlock), _mm512_cvtepi32_epi8(q_lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kActBlock + 16),
                     _mm512_cvtepi32_epi8(q_hi));
    sum16[b * 2] = _mm512_reduce_add_epi32(q_lo);
    sum16[b * 2 + 1] = _mm512_reduce_add_epi32(q_hi);
  }
}

TM_AVX2 inline int32_t sum_epi32_avx2(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// quantize_row_portable with AVX2 (cvtps rounds to nearest even, as nearbyint does).
TM_AVX2 void quantize_row_avx2(const float* x, int64_t kp, int8_t* q, float* scale,
                               int32_t* sum16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i min = _mm256_set1_epi32(-127), max = _mm256_set1_epi32(127);
  for (int64_t b = 0; b < kp / kActBlock; ++b) {
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + b * kActBlock + 8 * j);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    scale[b] = amax / 127.0f;
    const __m256 factor = _mm256_set1_ps(inverse);
    __m256i qi[4];
    for (int j = 0; j < 4; ++j)
      qi[j] = _mm256_min_epi32(
          max, _mm256_max_epi32(min, _mm256_cvtps_epi32(_mm256_mul_ps(v[j], factor))));
    sum16[b * 2] = sum_epi32_avx2(_mm256_add_epi32(qi[0], qi[1]));
    sum16[b * 2 + 1] = sum_epi32_avx2(_mm256_add_epi32(qi[2], qi[3]));
    // Packing interleaves 128-bit lanes; the permute puts the 32 codes back in order.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                              _mm256_packs_epi32(qi[2], qi[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kActBlock),
                        _mm256_permutevar8x32_epi32(packed, order));
  }
}

// Sum of each group's activations: from the int8 codes where the product is integer (so the
// offsets meet the same activations the codes do), else from the floats.
void group_sums(const QuantInput& a, int64_t row, float* out) {
  const bool quantized = a.path == QuantPath::kInt8;
  for (int64_t g = 0; g < a.groups; ++g) {
    float total = 0.0f;
    for (int64_t k = g * a.group; k < (g + 1) * a.group; k += 16) {
      if (quantized) {
        total += a.qscale[row * (a.kp / kActBlock) + k / kActBlock] *
                 static_cast<float>(a.qsum[row * (a.kp / 16) + k / 16]);
      } else {
        const float* x = a.xf + row * a.kp + k;
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
  const int64_t within = col % 8, at = lane * 4 + within % 4;
  const int base = base_bits(p.bits);
  int code;
  if (base == 2) {
    const uint8_t byte = block[(col / 16) * 64 + at];
    code = (byte >> (2 * ((col % 16) / 4))) & 3;
  } else {
    const uint8_t byte = block[(col / 8) * 64 + at];
    code = within < 4 ? byte & 0x0F : byte >> 4;
  }
  if (p.bits == kIq4NlBits) return kIq4NlValues[code];
  if (paired_high_bits(p.bits)) {
    const uint8_t pairs = p.high_bits(block, (col / 16) * 2)[at];
    return (code | ((pairs >> (2 * ((col % 16) / 4))) & 3) << base) - center_of(p.bits);
  }
  const uint8_t* high = has_high_bits(p.bits) ? p.high_bits(block, col / 8) : nullptr;
  for (int h = 0; h < p.bits - base; ++h) {
    const uint8_t* mask = high + 16 * h + (within < 4 ? 0 : 8);
    code |= ((mask[at / 8] >> (at % 8)) & 1) << (base + h);
  }
  return code - center_of(p.bits);
}

void block_portable(const Problem& p, const QuantInput& a, int64_t nb, int64_t m0, int tile,
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
        total += p.scale(nb, g, lane) * dot;
        if (p.offsets) total += static_cast<float>(p.offsets[at]) * sums[g];
      }
      out[r * kBlockRows + lane] = total;
    }
  }
}

// `kIq4Unsigned` in a vector. A namespace constant, not a function-local static: the static's
// guard check in every chunk kept GCC from unrolling the VNNI segment loop, whose accumulators
// then lived on the stack (IQ4_XS products ran at ~40 % of Q4_K's speed hot in cache).
TM_AVX2 inline __m128i iq4_table_sse() {
  return _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Unsigned.data()));
}

// ---------------------------------------------------------------------------------------------
// AVX2: a block as two halves of 8 rows (bytes 0-31 / 32-63 of each 64).

// Half a chunk of 2- to 6-bit codes (8 rows x 8 columns) as unsigned bytes: `lo` byte j
// of row r's lane is column j, `hi`'s column 4 + j.
template <int BITS>
TM_AVX2 inline void split_half_avx2(const Problem& p, const uint8_t* block, int64_t chunk,
                                    int half_index, __m256i& lo, __m256i& hi) {
  if constexpr (base_bits(BITS) == 2) {
    // Bit pairs: this 8-column chunk is half (chunk % 2) of a 16-column byte chunk.
    const __m256i raw = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(block + (chunk / 2) * 64 + 32 * half_index));
    const __m256i pair = _mm256_set1_epi8(0x03);
    const int shift = 4 * static_cast<int>(chunk % 2);
    lo = _mm256_and_si256(_mm256_srli_epi16(raw, shift), pair);
    hi = _mm256_and_si256(_mm256_srli_epi16(raw, shift + 2), pair);
  } else {
    const __m256i raw = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(block + chunk * 64 + 32 * half_index));
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(raw, low_nibbles);
    hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles);
  }
  if constexpr (paired_high_bits(BITS)) {
    // The 16 columns' pairs: bits 0-1 / 2-3 of a byte for an even chunk, 4-5 / 6-7 for an odd.
    __m256i pairs = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p.high_bits<BITS>(block, chunk & ~int64_t{1}) + 32 * half_index));
    if (chunk % 2 == 0) pairs = _mm256_slli_epi16(pairs, 4);
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    lo = _mm256_or_si256(lo, _mm256_and_si256(pairs, bits45));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(pairs, 2), bits45));
  } else if constexpr (has_high_bits(BITS)) {
    const uint8_t* high = p.high_bits<BITS>(block, chunk);
    // Byte i of the half's lo takes bit i % 8 of mask byte 4 x half + i / 8; hi's, 8 bytes on.
    const __m256i pick = _mm256_add_epi8(
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                         3, 3, 3, 3, 3, 3, 3, 3),
        _mm256_set1_epi8(static_cast<char>(4 * half_index)));
    const __m256i pick_hi = _mm256_add_epi8(pick, _mm256_set1_epi8(8));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    for (int h = 0; h < BITS - base_bits(BITS); ++h) {
      const __m256i masks = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(high + 16 * h)));
      const __m256i add = _mm256_set1_epi8(static_cast<char>((1 << base_bits(BITS)) << h));
      const __m256i lo_set =
          _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(masks, pick), bit), bit);
      const __m256i hi_set =
          _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(masks, pick_hi), bit), bit);
      lo = _mm256_add_epi8(lo, _mm256_and_si256(lo_set, add));
      hi = _mm256_add_epi8(hi, _mm256_and_si256(hi_set, add));
    }
  }
}

// Tokens m0 .. m0 + R of a prepared int8 input, as the int8 kernels read them.
template <int R>
struct Int8Rows {
  const int8_t* q[R];
  const float* scale[R];
  const int32_t* qsum[R];
  const float* group_sum[R];
  Int8Rows(const Problem& p, const QuantInput& a, int64_t m0) {
    for (int r = 0; r < R; ++r) {
      q[r] = a.q + (m0 + r) * p.kp;
      scale[r] = a.qscale + (m0 + r) * (p.kp / kActBlock);
      qsum[r] = a.qsum + (m0 + r) * (p.kp / 16);
      group_sum[r] = a.group_sum + (m0 + r) * p.groups;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// AVX2 int8 activations (no VNNI): vpmaddubsw (unsigned codes x signed activation codes, pairs
// summed into int16) then vpmaddwd by ones (int32 per row lane, 4 columns each), as llama.cpp's
// AVX2 dot products do. Half a block (8 rows) at a time, like the float path. 8-bit and IQ4
// codes are taken signed (unsigned 255 x 127 pairs would saturate int16): |w| times x with w's
// sign (vpsignb), as llama.cpp's q8_0. Narrower codes stay unsigned (plus center): a segment's
// int32 sum starts at -center x its activation codes' sum (qsum), which takes that off exactly.
// |a pair| <= 2 x 63 x 127 for 6-bit codes, so a chunk's two halves add in int16 (<= 32004).

// Codes the AVX2 int8 path reads as signed (center 0 there).
constexpr bool signed_on_avx2(int bits) { return bits == 8 || bits == kIq4NlBits; }
// Chunks of unsigned codes whose int16 pair sums add without saturating: a chunk's two
// vpmaddubsw (lo, hi) reach 4 x the largest code x 127 per int16 (4-bit: 4 chunks, 6-bit: 1).
constexpr int chunks_per_madd(int bits) { return 32767 / (4 * ((1 << bits) - 1) * 127); }

TM_AVX2 inline __m256i broadcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

// Signed codes `w` (|w| in `w_abs`) times 4 activation codes `x` per row lane, into int32.
TM_AVX2 inline __m256i dot_signed_avx2(__m256i w_abs, __m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)),
                           _mm256_set1_epi16(1));
}

// One segment (SEG columns from `col`) of half a block against R tokens: acc[r], the int32
// dot products of the codes less center x the segment's activation codes. SCALED (unsigned
// codes, a factored weight's group): the products of the stored codes (center not taken off)
// times each row's sub-scale `sub16` (int16 pairs), which the vpmaddwd that sums the pairs
// applies at no cost (the caller takes center x the group's sum off in float).
template <int BITS, int R, int SEG, bool SCALED = false>
TM_AVX2 inline void segment_int8_avx2(const Problem& p, const uint8_t* block, int half,
                                      const Int8Rows<R>& x, int64_t col, __m256i* acc,
                                      __m256i sub16 = _mm256_set1_epi16(1)) {
  static_assert(!SCALED || !signed_on_avx2(BITS));
  constexpr int32_t center = signed_on_avx2(BITS) || SCALED ? 0 : center_of(BITS);
  const int8_t* const* xq = x.q;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if constexpr (center == 0) {
      acc[r] = _mm256_setzero_si256();
    } else {
      int32_t codes_sum = x.qsum[r][col / 16];
      if constexpr (SEG == 32) codes_sum += x.qsum[r][col / 16 + 1];
      acc[r] = _mm256_set1_epi32(-center * codes_sum);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < SEG / lane_cols(BITS); ++c) {
    if constexpr (BITS == 8) {
      const __m256i w = _mm256_xor_si256(
          _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(block + (col / 4 + c) * 64 + 32 * half)),
          _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i w_abs = _mm256_abs_epi8(w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_add_epi32(acc[r],
                                  dot_signed_avx2(w_abs, w, broadcast4(xq[r] + col + 4 * c)));
    } else if constexpr (BITS == kIq4NlBits) {
      const __m256i raw = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(block + (col / 8 + c) * 64 + 32 * half));
      const __m256i table = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues)));
      const __m256i nibble = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, nibble));
      const __m256i hi =
          _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble));
      const __m256i lo_abs = _mm256_abs_epi8(lo), hi_abs = _mm256_abs_epi8(hi);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq[r] + col + 8 * c;
        acc[r] = _mm256_add_epi32(
            acc[r], _mm256_add_epi32(dot_signed_avx2(lo_abs, lo, broadcast4(x)),
                                     dot_signed_avx2(hi_abs, hi, broadcast4(x + 4))));
      }
    } else {
      // Unsigned codes: int16 pair sums of kPerMadd chunks at a time, then one vpmaddwd.
      constexpr int kPerMadd = std::min(chunks_per_madd(BITS), SEG / lane_cols(BITS));
      if (c % kPerMadd) continue;
      __m256i pairs[R];
#pragma GCC unroll 4
      for (int k = 0; k < kPerMadd; ++k) {
        __m256i lo, hi;
        split_half_avx2<BITS>(p, block, col / 8 + c + k, half, lo, hi);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xq[r] + col + 8 * (c + k);
          const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(x)),
                                               _mm256_maddubs_epi16(hi, broadcast4(x + 4)));
          pairs[r] = k == 0 ? sum : _mm256_add_epi16(pairs[r], sum);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs[r], sub16));
    }
  }
}

// HALVES halves of a block (rows 8 x half ..., from `first`) against R tokens, in one pass
// over the groups: with both, each 64-byte line of codes is used whole while it is in L1
// (a half at a time read every line twice: 1.15-1.25x at one token on Zen 3). FACTORED
// (K-quant scales, SEG = the group of 16 or 32): each group's int32 sum times its int8
// sub-scale, summed over an activation block, one conversion times the activation scale and
// the super-block's scale. Else per group: per segment to float times the activation scale,
// times the group's scale.
template <int BITS, int R, int SEG, bool FACTORED, int HALVES = 1>
TM_AVX2 void half_block_int8_avx2(const Problem& p, const QuantInput& a, int64_t nb, int64_t m0,
                                  int first, float* out) {
  const uint8_t* block = p.codes + nb * p.block_bytes();
  const Int8Rows<R> x(p, a, m0);
  const float* const* x_scale = x.scale;
  const float* const* x_group_sum = x.group_sum;
  __m256 totals[HALVES][R];
  __m256i scaleds[HALVES][R];
#pragma GCC unroll 8
  for (int r = 0; r < HALVES * R; ++r) {
    totals[r / R][r % R] = _mm256_setzero_ps();
    scaleds[r / R][r % R] = _mm256_setzero_si256();
  }
  for (int64_t g = 0; g < p.groups; ++g) {
#pragma GCC unroll 2
    for (int h = 0; h < HALVES; ++h) {
      const int half = first + h;
      __m256* total = totals[h];
      __m256i* scaled = scaleds[h];
      const int64_t at = p.scale_at(nb, g) + 8 * half;
      if constexpr (FACTORED && !signed_on_avx2(BITS)) {
        // Sub-scales in the pair sums' vpmaddwd (|a pair sum| <= 32767, x |sub| <= 128, twice:
        // within int32); center x sub x super x each row's group sum (its codes' sum times
        // its activation scale) taken off in float with the offset.
        const int64_t col = g * SEG;
        const __m256i sub = _mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.sub_scales + at)));
        const __m256i sub16 = _mm256_blend_epi16(sub, _mm256_slli_epi32(sub, 16), 0xAA);
        __m256i acc[R];
        segment_int8_avx2<BITS, R, SEG, true>(p, block, half, x, col, acc, sub16);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) scaled[r] = _mm256_add_epi32(scaled[r], acc[r]);
        const __m256 super = _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(p.super_scales + p.super_at(nb, g) + 8 * half)));
        __m256 coefficient = _mm256_mul_ps(
            _mm256_cvtepi32_ps(sub),
            _mm256_mul_ps(super, _mm256_set1_ps(-static_cast<float>(center_of(BITS)))));
        if (p.offsets)
          coefficient = _mm256_add_ps(
              coefficient,
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.offsets + at))));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          total[r] = _mm256_fmadd_ps(coefficient, _mm256_set1_ps(x_group_sum[r][g]), total[r]);
        if ((col + SEG) % kActBlock == 0) {
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256 factor = _mm256_mul_ps(super, _mm256_set1_ps(x_scale[r][col / kActBlock]));
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled[r]), factor, total[r]);
            scaled[r] = _mm256_setzero_si256();
          }
        }
        continue;
      } else if constexpr (FACTORED) {
        const int64_t col = g * SEG;
        __m256i acc[R];
        segment_int8_avx2<BITS, R, SEG>(p, block, half, x, col, acc);
        const __m256i sub = _mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.sub_scales + at)));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          scaled[r] = _mm256_add_epi32(scaled[r], _mm256_mullo_epi32(acc[r], sub));
        if ((col + SEG) % kActBlock == 0) {
          const __m256 super = _mm256_cvtph_ps(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(p.super_scales + p.super_at(nb, g) + 8 * half)));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256 factor = _mm256_mul_ps(super, _mm256_set1_ps(x_scale[r][col / kActBlock]));
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled[r]), factor, total[r]);
            scaled[r] = _mm256_setzero_si256();
          }
        }
      } else {
        __m256 dot[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_ps();
        for (int64_t col = g * p.group; col < (g + 1) * p.group; col += SEG) {
          __m256i acc[R];
          segment_int8_avx2<BITS, R, SEG>(p, block, half, x, col, acc);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            dot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                                     _mm256_set1_ps(x_scale[r][col / kActBlock]), dot[r]);
        }
        const __m256 scale = scales8(p, nb, g, 8 * half);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(scale, dot[r], total[r]);
      }
      if (p.offsets) {
        const __m256 offset =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.offsets + at)));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          total[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x_group_sum[r][g]), total[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < HALVES * R; ++r)
    _mm256_storeu_ps(out + (r % R) * kBlockRows + 8 * (first + r / R), totals[r / R][r % R]);
}

// Tokens per pass of the AVX2 int8 kernel: its 3 x R accumulators stay in 16 ymm registers.
constexpr int kAvx2Tile = 4;
// Tokens up to which both halves of a block run in one pass (their 2 x 3 x R accumulators
// still fit the 16 ymm registers).
constexpr int kAvx2BothHalves = 1;

template <int BITS, int R, int HALVES>
void half_int8_avx2(const Problem& p, const QuantInput& a, int64_t nb, int64_t m0, int first,
                    float* out) {
  if constexpr (BITS != 8) {
    if (p.sub_scales && p.group == 16)
      return half_block_int8_avx2<BITS, R, 16, true, HALVES>(p, a, nb, m0, first, out);
    if (p.sub_scales && p.group == 32)
      return half_block_int8_avx2<BITS, R, 32, true, HALVES>(p, a, nb, m0, first, out);
  }
  if (p.group == 16) half_block_int8_avx2<BITS, R, 16, false, HALVES>(p, a, nb, m0, first, out);
  else half_block_int8_avx2<BITS, R, 32, false, HALVES>(p, a, nb, m0, first, out);
}

template <int BITS, int R>
void tile_int8_avx2(const Problem& p, const QuantInput& a, int64_t nb, int64_t m0, float* out) {
  if constexpr (R > kAvx2Tile) {
    tile_int8_avx2<BITS, kAvx2Tile>(p, a, nb, m0, out);
    tile_int8_avx2<BITS, R - kAvx2Tile>(p, a, nb, m0 + kAvx2Tile, out + kAvx2Tile * kBlockRows);
  } else if constexpr (R <= kAvx2BothHalves) {
    half_int8_avx2<BITS, R, 2>(p, a, nb, m0, 0, out);
  } else {
    half_int8_avx2<BITS, R, 1>(p, a, nb, m0, 0, out);
    half_int8_avx2<BITS, R, 1>(p, a, nb, m0, 1, out);
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 (float activations): one zmm per 16 rows.

// A 64-bit mask register loaded straight from memory (kmovq k, m64): GCC moves a memcpy'd
// mask through a general register (kmovq k, r64, one more uop on the port the byte adds and
// the VNNI products need); 4 of them per 8 columns of 6-bit codes.
TM_AVX512 inline __mmask64 load_mask64(const uint8_t* at) {
  __mmask64 mask;
  asm("kmovq %1, %0" : "=k"(mask) : "m"(*reinterpret_cast<const uint64_t*>(at)));
  return mask;
}

// A chunk of 4-, 5- or 6-bit codes (16 rows x 8 columns) as unsigned bytes: `lo` byte j of
// row r's lane is column j, `hi`'s column 4 + j (the high bits added under their masks).
template <int BITS>
TM_AVX512 inline void split_chunk_avx512(const Problem& p, const uint8_t* block, int64_t chunk,
                                         __m512i& lo, __m512i& hi) {
  if constexpr (base_bits(BITS) == 2) {
    // Bit pairs: this 8-column chunk is half (chunk % 2) of a 16-column byte chunk.
    const __m512i raw = _mm512_loadu_si512(block + (chunk / 2) * 64);
    const __m512i pair = _mm512_set1_epi8(0x03);
    const unsigned shift = 4 * static_cast<unsigned>(chunk % 2);
    lo = _mm512_and_si512(_mm512_srli_epi16(raw, shift), pair);
    hi = _mm512_and_si512(_mm512_srli_epi16(raw, shift + 2), pair);
  } else {
    const __m512i raw = _mm512_loadu_si512(block + chunk * 64);
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(raw, low_nibbles);
    hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles);
  }
  if constexpr (BITS == kIq4NlBits) {
    const __m512i table = _mm512_broadcast_i32x4(iq4_table_sse());
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
  }
  if constexpr (paired_high_bits(BITS)) {
    // As split_half_avx2's: bits 0-1 / 2-3 of a byte for an even chunk, 4-5 / 6-7 for an odd.
    __m512i pairs = _mm512_loadu_si512(p.high_bits<BITS>(block, chunk & ~int64_t{1}));
    if (chunk % 2 == 0) pairs = _mm512_slli_epi16(pairs, 4);
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    lo = _mm512_or_si512(lo, _mm512_and_si512(pairs, bits45));
    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(pairs, 2), bits45));
  } else if constexpr (has_high_bits(BITS)) {
    const uint8_t* high = p.high_bits<BITS>(block, chunk);
#pragma GCC unroll 2
    for (int h = 0; h < BITS - base_bits(BITS); ++h) {
      const __m512i add = _mm512_set1_epi8(static_cast<char>((1 << base_bits(BITS)) << h));
      lo = _mm512_mask_add_epi8(lo, load_mask64(high + 16 * h), lo, add);
      hi = _mm512_mask_add_epi8(hi, load_mask64(high + 16 * h + 8), hi, add);
    }
  }
}

// The codes `p.prefetch` bytes after chunk `chunk`'s (and its high bits as far ahead).
template <int BITS>
inline void prefetch_codes(const Problem& p, const uint8_t* block, int64_t chunk) {
  const char* at = reinterpret_cast<const char*>(block + chunk * 64 * base_bits(BITS) / 4) + p.prefetch;
  if (g_quant_prefetch_hint.load(std::memory_order_relaxed)) _mm_prefetch(at, _MM_HINT_T1);
  else _mm_prefetch(at, _MM_HINT_T0);
  if constexpr (has_high_bits(BITS)) {
    if (chunk % 2 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(p.high_bits<BITS>(block, chunk)) + p.prefetch * (BITS - base_bits(BITS)) / 4, _MM_HINT_T0);
  }
}

template <int BITS, int R>
TM_AVX512 void block_avx512(const Problem& p, const QuantInput& a, int64_t nb, int64_t m0,
                            float* out) {
  const uint8_t* block = p.codes + nb * p.block_bytes();
  const __m512i low_byte = _mm512_set1_epi32(0xFF);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
    const int64_t col_end = (g + 1) * p.group;
    for (int64_t col = g * p.group; col < col_end; col += lane_cols(BITS)) {
      if constexpr (BITS == 8) {
        __m512i raw = _mm512_loadu_si512(block + (col / 4) * 64);
        raw = _mm512_xor_si512(raw, _mm512_set1_epi8(static_cast<char>(0x80)));
        for (int j = 0; j < 4; ++j) {
          __m512i v = j == 3 ? raw : _mm512_slli_epi32(raw, 24 - 8 * j);
          __m512 w = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
          for (int r = 0; r < R; ++r)
            dot[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(a.xf[(m0 + r) * p.kp + col + j]), dot[r]);
        }
      } else {
        __m512i lo, hi;
        split_chunk_avx512<BITS>(p, block, col / 8, lo, hi);
        for (int j = 0; j < 8; ++j) {
          const __m512i bytes = j < 4 ? lo : hi;
          __m512 w = _mm512_cvtepi32_ps(
              _mm512_and_si512(_mm512_srli_epi32(bytes, 8 * (j % 4)), low_byte));
          for (int r = 0; r < R; ++r)
            dot[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(a.xf[(m0 + r) * p.kp + col + j]), dot[r]);
        }
      }
    }
    const int64_t at = (nb * p.groups + g) * kBlockRows;
    __m512 scale = scales16(p, nb, g);
    __m512 offset = p.offsets ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(p.offsets + at)))
                              : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 sum = _mm512_set1_ps(a.group_sum[(m0 + r) * p.groups + g]);
      if constexpr (BITS != 8)
        dot[r] = _mm512_fnmadd_ps(_mm512_set1_ps(center_of(BITS)), sum, dot[r]);
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

// Independent int32 accumulators per token in a segment: vpdpbusd's latency (~5 cycles) makes
// one accumulator a chain of 8 dependent products per 32 columns of 4-bit codes; at a token
// or two nothing else hides it (the batch-1 step: ~2x the instructions' own time). Split over
// the chunk's two halves and alternating chunks, the chains are 2 long; summed at the end.
template <int R>
constexpr int segment_chains() {
  return R == 1 ? 4 : R == 2 ? 2 : 1;
}

// One segment (SEG = 16 or 32 columns from column `col`, one activation scale) of R tokens
// against a block's 16 rows: the int32 dot products of the codes added to `acc[r]`.
template <int BITS, int R, int SEG>
TM_AVX512BF16 inline void segment_vnni(const Problem& p, const uint8_t* block,
                                       const int8_t* const* xq, int64_t col, __m512i* acc) {
  constexpr int kChains = segment_chains<R>();
  // Segments start at multiples of 16 columns, so chunk col / 8 + c has c's parity: 6-bit
  // codes' pair shifts are then constants, not a branch a chunk.
  if ((col / 8) % 2 != 0) __builtin_unreachable();
  __m512i part[R][kChains];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    part[r][0] = acc[r];
#pragma GCC unroll 4
    for (int j = 1; j < kChains; ++j) part[r][j] = _mm512_setzero_si512();
  }
#pragma GCC unroll 8
  for (int c = 0; c < SEG / lane_cols(BITS); ++c) {
    if constexpr (BITS == 8) {
      const __m512i raw = _mm512_loadu_si512(block + (col / 4 + c) * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq[r] + col + 4 * c, 4);
        __m512i& into = part[r][c % kChains];
        into = _mm512_dpbusd_epi32(into, raw, _mm512_set1_epi32(x4));
      }
    } else {
      if (p.prefetch) prefetch_codes<BITS>(p, block, col / 8 + c);
      __m512i lo, hi;
      split_chunk_avx512<BITS>(p, block, col / 8 + c, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x_lo, x_hi;
        std::memcpy(&x_lo, xq[r] + col + 8 * c, 4);
        std::memcpy(&x_hi, xq[r] + col + 8 * c + 4, 4);
        __m512i& into_lo = part[r][(2 * c) % kChains];
        into_lo = _mm512_dpbusd_epi32(into_lo, lo, _mm512_set1_epi32(x_lo));
        __m512i& into_hi = part[r][(2 * c + 1) % kChains];
        into_hi = _mm512_dpbusd_epi32(into_hi, hi, _mm512_set1_epi32(x_hi));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if constexpr (kChains == 4)
      acc[r] = _mm512_add_epi32(_mm512_add_epi32(part[r][0], part[r][1]),
                                _mm512_add_epi32(part[r][2], part[r][3]));
    else if constexpr (kChains == 2)
      acc[r] = _mm512_add_epi32(part[r][0], part[r][1]);
    else
      acc[r] = part[r][0];
  }
}

template <int BITS, int R, int SEG>
TM_AVX512BF16 void block_vnni(const Problem& p, const QuantInput& a, int64_t nb, int64_t m0,
                        float* out) {
  constexpr float center = center_of(BITS);
  const uint8_t* block = p.codes + nb * p.block_bytes();
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
  const half* offsets = p.offsets ? p.offsets + nb * p.groups * kBlockRows : nullptr;
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 dot[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
    const int64_t group_end = (g + 1) * p.group;
    for (int64_t col = g * p.group; col < group_end; col += SEG) {
      __m512i acc[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
      segment_vnni<BITS, R, SEG>(p, block, xq, col, acc);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        dot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]),
                                 _mm512_set1_ps(x_scale[r][col / kActBlock]), dot[r]);
    }
    // The codes were stored plus `center`: their dot products carry center x the group's
    // activation sum, which the offset term takes back off (offset - center x scale).
    __m512 scale = scales16(p, nb, g);
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


// K-quant scales held factored (int8 sub-scales of 16 or 32 columns times a float16 scale per
// 256): the per-group work in integers. Each group's dot product starts at -center x the sum
// of its activation codes (`qsum`, per 16 columns), so the codes' center comes off exactly;
// times the group's int8 sub-scale (vpmulld), summed over an activation block of 32 columns,
// one conversion to float times the activation scale; one multiply by the super-block's
// scale per 256 columns. block_vnni converts and scales every group in float instead: for
// Q6_K's groups of 16 that was as many instructions as the group's dot products.
// |sum| <= 32 columns x 128 x 127 x 128 (an activation block) < 2^27.
template <int BITS, int R, int GROUP>
TM_AVX512BF16 void block_vnni_factored(const Problem& p, const QuantInput& a, int64_t nb,
                                       int64_t m0, float* out) {
  static_assert(GROUP == 16 || GROUP == 32);
  constexpr int32_t center = center_of(BITS);
  constexpr int kGroupsPerAct = kActBlock / GROUP;
  const uint8_t* block = p.codes + nb * p.block_bytes();
  const Int8Rows<R> x(p, a, m0);
  const int8_t* const* xq = x.q;
  const float* const* x_scale = x.scale;
  const int32_t* const* x_qsum = x.qsum;
  const float* const* x_group_sum = x.group_sum;
  __m512 total[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const half* offsets = p.offsets ? p.offsets + nb * p.groups * kBlockRows : nullptr;
  const int64_t supers = p.kp / kSuperCols;  // a shift, not a 64-bit division a block
  for (int64_t s = 0; s < supers; ++s) {
    __m512 dot[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
    const int64_t g_end = (s + 1) * p.super_groups;
    for (int64_t g0 = s * p.super_groups; g0 < g_end; g0 += kGroupsPerAct) {
      __m512i scaled[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) scaled[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int gi = 0; gi < kGroupsPerAct; ++gi) {
        const int64_t g = g0 + gi, col = g * GROUP;
        __m512i acc[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t codes_sum = x_qsum[r][col / 16];
          if constexpr (GROUP == 32) codes_sum += x_qsum[r][col / 16 + 1];
          acc[r] = _mm512_set1_epi32(-center * codes_sum);
        }
        if (p.prefetch) {
          // 16 sub-scale and 32 offset bytes a group per 8 x GROUP bytes of nibbles.
          const int64_t ahead = p.prefetch * 2 / GROUP;
          _mm_prefetch(reinterpret_cast<const char*>(p.sub_scales + p.scale_at(nb, g)) + ahead, _MM_HINT_T0);
          if (offsets)
            _mm_prefetch(reinterpret_cast<const char*>(offsets + g * kBlockRows) + 2 * ahead, _MM_HINT_T0);
        }
        segment_vnni<BITS, R, GROUP>(p, block, xq, col, acc);
        const __m512i sub = _mm512_cvtepi8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(p.sub_scales + p.scale_at(nb, g))));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          scaled[r] = _mm512_add_epi32(scaled[r], _mm512_mullo_epi32(acc[r], sub));
      }
      const int64_t act = g0 * GROUP / kActBlock;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        dot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled[r]), _mm512_set1_ps(x_scale[r][act]),
                                 dot[r]);
    }
    const __m512 super = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p.super_scales + p.super_at(nb, s * p.super_groups))));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) total[r] = _mm512_fmadd_ps(super, dot[r], total[r]);
    if (offsets) {
      for (int64_t g = s * p.super_groups; g < g_end; ++g) {
        const __m512 offset = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets + g * kBlockRows)));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_group_sum[r][g]), total[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlockRows, total[r]);
}


// ---------------------------------------------------------------------------------------------
// Dispatch: a tile of up to kMaxTile tokens against one 16-row block.

template <int BITS, int R>
void run_tile(const Problem& p, const QuantInput& a, int64_t nb, int64_t m0, float* out,
              int isa) {
  if (a.path == QuantPath::kInt8 && isa < kAvx512Bf16) {
    tile_int8_avx2<BITS, R>(p, a, nb, m0, out);
  } else if (a.path == QuantPath::kInt8) {
    if constexpr (BITS != 8) {
      if (p.sub_scales && p.group == 16) return block_vnni_factored<BITS, R, 16>(p, a, nb, m0, out);
      if (p.sub_scales && p.group == 32) return block_vnni_factored<BITS, R, 32>(p, a, nb, m0, out);
    }
    if (p.group == 16) block_vnni<BITS, R, 16>(p, a, nb, m0, out);
    else block_vnni<BITS, R, 32>(p, a, nb, m0, out);
  } else if (isa >= kAvx512) {
    block_avx512<BITS, R>(p, a, nb, m0, out);
  } else {
    block_portable(p, a, nb, m0, R, out);
  }
}

template <int BITS>
void tile_dispatch(const Problem& p, const QuantInput& a, int64_t nb, int64_t m0, int tile,
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

// A tile's 16 columns of `tile` rows (+ bias) into the output, masked at its n.
void store_tile(const float* tile_out, int tile, int64_t nb, int64_t m0, const GemmOut& o) {
  const int64_t c0 = nb * kBlockRows, cols = std::min<int64_t>(kBlockRows, o.n - c0);
  for (int r = 0; r < tile; ++r) {
    const float* values = tile_out + r * kBlockRows;
    const int64_t at = (m0 + r) * o.ld + c0;
    for (int64_t i = 0; i < cols; ++i) {
      const float v = values[i] + (o.bias ? o.bias[c0 + i] : 0.0f);
      if (o.is_bf16) store_float(static_cast<bf16*>(o.data) + at + i, v);
      else static_cast<float*>(o.data)[at + i] = v;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AMX: a 16-row block dequantized into the dense bf16 packed layout ([k_pad / 2, 16, 2]: each
// row's 32-bit lane a pair of consecutive k), for packed_gemm's tiles.

// float -> bf16 bits in the high half, rounded to nearest even (no NaNs here).
TM_AVX512 inline __m512i rounded(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}

template <int BITS>
TM_AVX512 void dequantize_block_pairs(const Problem& p, int64_t nb, uint32_t* out) {
  const uint8_t* block = p.codes + nb * p.block_bytes();
  const __m512i code_mask = _mm512_set1_epi32(0xFF);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t at = (nb * p.groups + g) * kBlockRows;
    const __m512 scale = scales16(p, nb, g);
    __m512 offset = p.offsets ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(p.offsets + at)))
                              : _mm512_setzero_ps();
    offset = _mm512_fnmadd_ps(_mm512_set1_ps(center_of(BITS)), scale, offset);  // unsigned codes
    for (int64_t col = g * p.group; col < (g + 1) * p.group; col += lane_cols(BITS)) {
      // Byte j of each row's lane is column j (of 4 for int8; of 8 in `lo` then `hi` else).
      __m512i bytes[2];
      if constexpr (BITS == 8) bytes[0] = _mm512_loadu_si512(block + (col / 4) * 64);
      else split_chunk_avx512<BITS>(p, block, col / 8, bytes[0], bytes[1]);
      for (int pair = 0; pair < lane_cols(BITS) / 2; ++pair) {
        const __m512i raw = bytes[pair / 2];
        const int shift = 16 * (pair % 2);
        const __m512 even = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(raw, shift), code_mask)),
            scale, offset);
        const __m512 odd = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(raw, shift + 8), code_mask)),
            scale, offset);
        const __m512i lanes = _mm512_or_si512(_mm512_and_si512(rounded(odd), high_half),
                                              _mm512_srli_epi32(rounded(even), 16));
        _mm512_storeu_si512(out + ((col + 2 * pair) / 2) * kBlockRows, lanes);
      }
    }
  }
}

void quant_gemm_amx(const PackedWeight& w, const QuantInput& in, const GemmOut& o, int64_t b0,
                    int64_t b1, int isa) {
  constexpr int64_t kChunkBlocks = 16;  // 16 x 16 x k_pad bf16: L2-sized for k up to ~4K
  thread_local std::vector<uint32_t> scratch;
  const Problem p = problem_of(w);
  const size_t out_size = o.is_bf16 ? sizeof(bf16) : sizeof(float);
  for (int64_t c = b0; c < b1; c += kChunkBlocks) {
    const int64_t blocks = std::min(b1, c + kChunkBlocks) - c;
    const int64_t block_lanes = kBlockRows * w.k_pad / 2;
    scratch.resize(blocks * block_lanes);
    for (int64_t b = 0; b < blocks; ++b) {
      uint32_t* into = scratch.data() + b * block_lanes;
      switch (w.bits) {
        case 8: dequantize_block_pairs<8>(p, c + b, into); break;
        case kIq4NlBits: dequantize_block_pairs<kIq4NlBits>(p, c + b, into); break;
        case 6: dequantize_block_pairs<6>(p, c + b, into); break;
        case 5: dequantize_block_pairs<5>(p, c + b, into); break;
        case 3: dequantize_block_pairs<3>(p, c + b, into); break;
        case 2: dequantize_block_pairs<2>(p, c + b, into); break;
        default: dequantize_block_pairs<4>(p, c + b, into);
      }
    }
    const PackedWeight dense{scratch.data(), blocks * kBlockRows, w.k, blocks * kBlockRows,
                             w.k_pad, true};
    GemmOut part = o;
    part.data = static_cast<char*>(o.data) + c * kBlockRows * out_size;
    part.bias = o.bias ? o.bias + c * kBlockRows : nullptr;
    part.n = o.n - c * kBlockRows;
    packed_gemm(dense, in.xb, in.kp, in.rows, part, 0, blocks, isa);
  }
}

size_t aligned(size_t bytes) { return (bytes + 63) / 64 * 64; }

// Bytes of each buffer a path prepares: q, qscale, qsum, xf, group_sum, xb.
std::array<size_t, 6> input_bytes(QuantPath path, int64_t rows, int64_t kp, int64_t groups) {
  std::array<size_t, 6> bytes{};
  if (path == QuantPath::kAmx) {
    bytes[5] = aligned(rows * kp * sizeof(bf16));
    return bytes;
  }
  if (path == QuantPath::kInt8) {
    bytes[0] = aligned(rows * kp);
    bytes[1] = aligned(rows * (kp / kActBlock) * sizeof(float));
    bytes[2] = aligned(rows * (kp / 16) * sizeof(int32_t));
  } else {
    bytes[3] = aligned(rows * kp * sizeof(float));
  }
  bytes[4] = aligned(rows * groups * sizeof(float));
  return bytes;
}

}  // namespace

void set_quant_prefetch(int64_t bytes, int64_t hint) {
  g_quant_prefetch.store(bytes);
  g_quant_prefetch_hint.store(static_cast<int>(hint));
}

QuantPath quant_path(int64_t rows, int isa) {
  if (isa >= kAmx && rows >= kQuantAmxMinRows) return QuantPath::kAmx;
  // AVX2 too (vpmaddubsw): its float path widened every code to float, ~4x the instructions.
  return isa >= kAvx512Bf16 || isa == kAvx2 ? QuantPath::kInt8 : QuantPath::kFloat;
}

void QuantScratch::reserve(const PackedWeight& w, int64_t rows, int isa) {
  const auto bytes = input_bytes(quant_path(rows, isa), rows, w.k_pad, w.k_pad / w.group);
  size_t total = 64;  // slack to align the start
  for (size_t b : bytes) total += b;
  if (!bytes_.defined() || bytes_.numel() < static_cast<int64_t>(total))
    bytes_ = at::empty({static_cast<int64_t>(total)}, at::TensorOptions().dtype(at::kByte));
}

QuantInput QuantScratch::view(const PackedWeight& w, int64_t rows, int isa) {
  reserve(w, rows, isa);
  QuantInput in{};
  in.path = quant_path(rows, isa);
  in.rows = rows;
  in.kp = w.k_pad;
  in.group = w.group;
  in.groups = w.k_pad / w.group;
  const auto bytes = input_bytes(in.path, rows, in.kp, in.groups);
  char* at = reinterpret_cast<char*>(aligned(reinterpret_cast<size_t>(bytes_.data_ptr())));
  auto take = [&](size_t size) {
    char* start = size ? at : nullptr;
    at += size;
    return start;
  };
  in.q = reinterpret_cast<int8_t*>(take(bytes[0]));
  in.qscale = reinterpret_cast<float*>(take(bytes[1]));
  in.qsum = reinterpret_cast<int32_t*>(take(bytes[2]));
  in.xf = reinterpret_cast<float*>(take(bytes[3]));
  in.group_sum = reinterpret_cast<float*>(take(bytes[4]));
  in.xb = reinterpret_cast<bf16*>(take(bytes[5]));
  return in;
}

void prepare_quant_rows(const PackedWeight& w, const void* x, bool x_bf16, int64_t ldx,
                        const QuantInput& in, int64_t r0, int64_t r1) {
  thread_local std::vector<float> widened;
  const int isa = current_isa();
  for (int64_t m = r0; m < r1; ++m) {
    if (in.path == QuantPath::kAmx) {
      bf16* row = in.xb + m * in.kp;
      if (x_bf16) {
        std::memcpy(row, static_cast<const bf16*>(x) + m * ldx, w.k * sizeof(bf16));
      } else {
        const float* xr = static_cast<const float*>(x) + m * ldx;
        for (int64_t i = 0; i < w.k; ++i) store_float(row + i, xr[i]);
      }
      std::fill(row + w.k, row + in.kp, bf16(0.0f));
      continue;
    }
    float* row = in.xf ? in.xf + m * in.kp : nullptr;
    if (row == nullptr) {
      widened.resize(in.kp);
      row = widened.data();
    }
    if (x_bf16 && isa >= kAvx512) widen_row_avx512(static_cast<const bf16*>(x) + m * ldx, w.k, in.kp, row);
    else if (x_bf16) widen_row(static_cast<const bf16*>(x) + m * ldx, w.k, in.kp, row);
    else widen_row(static_cast<const float*>(x) + m * ldx, w.k, in.kp, row);
    if (in.path == QuantPath::kInt8) {
      int8_t* q = in.q + m * in.kp;
      float* scale = in.qscale + m * (in.kp / kActBlock);
      int32_t* sum16 = in.qsum + m * (in.kp / 16);
      if (isa >= kAvx512Bf16) quantize_row_avx512(row, in.kp, q, scale, sum16);
      else if (isa == kAvx2) quantize_row_avx2(row, in.kp, q, scale, sum16);
      else quantize_row_portable(row, in.kp, q, scale, sum16);
    }
    group_sums(in, m, in.group_sum + m * in.groups);
  }
}

void quant_gemm(const PackedWeight& w, const QuantInput& in, const GemmOut& out, int64_t b0,
                int64_t b1, int isa) {
  if (in.path == QuantPath::kAmx) return quant_gemm_amx(w, in, out, b0, b1, isa);
  const Problem p = problem_of(w);
  alignas(64) float tile_out[kMaxTile * kBlockRows];
  for (int64_t nb = b0; nb < b1; ++nb) {
    for (int64_t m0 = 0; m0 < in.rows; m0 += kMaxTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kMaxTile, in.rows - m0));
      switch (p.bits) {
        case 8: tile_dispatch<8>(p, in, nb, m0, tile, tile_out, isa); break;
        case kIq4NlBits: tile_dispatch<kIq4NlBits>(p, in, nb, m0, tile, tile_out, isa); break;
        case 6: tile_dispatch<6>(p, in, nb, m0, tile, tile_out, isa); break;
        case 5: tile_dispatch<5>(p, in, nb, m0, tile, tile_out, isa); break;
        case 3: tile_dispatch<3>(p, in, nb, m0, tile, tile_out, isa); break;
        case 2: tile_dispatch<2>(p, in, nb, m0, tile, tile_out, isa); break;
        default: tile_dispatch<4>(p, in, nb, m0, tile, tile_out, isa);
      }
      store_tile(tile_out, tile, nb, m0, out);
    }
  }
}

PackedWeight quant_view(const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, int64_t bits, int64_t group,
                        int64_t n, int64_t k, const c10::optional<at::Tensor>& super_scales) {
  TORCH_CHECK(bits == 8 || bits == 6 || bits == 5 || bits == 4 || bits == 3 || bits == 2 ||
                  bits == kIq4NlBits,
              "quantized weight: bits must be 8, 6, 5, 4, 3, 2 or ", kIq4NlBits, " (IQ4 codes)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2,
              "quantized weight: codes must be contiguous uint8 [blocks, block bytes]");
  const bool factored = super_scales.has_value() && super_scales->defined();
  TORCH_CHECK(scales.scalar_type() == (factored ? at::kChar : at::kHalf) &&
                  scales.is_contiguous() && scales.dim() == 3,
              "quantized weight: scales must be contiguous float16 [blocks, groups, 16] (int8 "
              "with super_scales)");
  const int64_t blocks = codes.size(0), groups = scales.size(1), kp = groups * group;
  TORCH_CHECK(group % 16 == 0 && kp % kActBlock == 0 && kp >= k && kp - k < kActBlock + group,
              "quantized weight: group size and padded width do not fit its in_features");
  TORCH_CHECK(codes.size(1) == kBlockRows * kp * stored_bits(static_cast<int>(bits)) / 8 &&
                  scales.size(0) == blocks &&
                  scales.size(2) == kBlockRows && blocks * kBlockRows >= n &&
                  (blocks - 1) * kBlockRows < n,
              "quantized weight: codes and scales do not fit the shape");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  if (has_offsets)
    TORCH_CHECK(offsets->scalar_type() == at::kHalf && offsets->is_contiguous() &&
                    offsets->sizes() == scales.sizes(),
                "quantized weight: offsets must be like scales");
  PackedWeight w{codes.data_ptr(), n, k, blocks * kBlockRows, kp, false};
  w.bits = static_cast<int>(bits);
  if (factored) {
    const int64_t super_groups = kSuperCols / group;
    TORCH_CHECK(kSuperCols % group == 0 && groups % super_groups == 0 &&
                    super_scales->scalar_type() == at::kHalf && super_scales->is_contiguous() &&
                    super_scales->dim() == 3 && super_scales->size(0) == blocks &&
                    super_scales->size(1) == groups / super_groups &&
                    super_scales->size(2) == kBlockRows,
                "quantized weight: super_scales must be float16 [blocks, k_pad / ", kSuperCols,
                ", 16] with groups dividing ", kSuperCols);
    w.sub_scales = scales.data_ptr<int8_t>();
    w.super_scales = super_scales->data_ptr<at::Half>();
    w.super_groups = super_groups;
  } else {
    w.scales = scales.data_ptr<at::Half>();
  }
  w.offsets = has_offsets ? offsets->data_ptr<at::Half>() : nullptr;
  w.group = group;
  return w;
}

at::Tensor quant_rows(const PackedWeight& w, const at::Tensor& rows) {
  TORCH_CHECK(w.quantized(), "quant_rows: a quantized weight");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "quant_rows: int64 [n] rows");
  const at::Tensor index = rows.contiguous();
  const int64_t n = index.size(0), k = w.k;
  const int64_t* picked = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(picked[i] >= 0 && picked[i] < w.n, "quant_rows: row ", picked[i], " out of range");
  at::Tensor out = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const Problem p = problem_of(w);
  parallel_chunks(n, [&](int64_t i, int) {
    const int64_t nb = picked[i] / kBlockRows, lane = picked[i] % kBlockRows;
    const uint8_t* block = p.codes + nb * p.block_bytes();
    for (int64_t g = 0; g * p.group < k; ++g) {
      const float scale = p.scale(nb, g, lane);
      const float offset =
          p.offsets ? static_cast<float>(p.offsets[p.scale_at(nb, g) + lane]) : 0.0f;
      for (int64_t col = g * p.group; col < std::min(k, (g + 1) * p.group); ++col)
        dst[i * k + col] = static_cast<float>(code_at(p, block, lane, col)) * scale + offset;
    }
  }, n * k >= (1 << 16) ? team_size() : 1, "embedding rows");
  return out;
}

PackedLinear int_codes_linear(const at::Tensor& codes, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& offsets, int64_t bits,
                              int64_t group, int64_t n, int64_t k,
                              const c10::optional<at::Tensor>& super_scales) {
  std::vector<at::Tensor> tensors = {codes, scales};
  if (offsets.has_value() && offsets->defined()) tensors.push_back(*offsets);
  if (super_scales.has_value() && super_scales->defined()) tensors.push_back(*super_scales);
  const auto product = [](const at::Tensor& x, const PackedWeight& w,
                          const std::vector<at::Tensor>&, const c10::optional<at::Tensor>& bias,
                          bool float32_out) { return quant_linear(x, w, bias, float32_out); };
  return PackedLinear(quant_view(codes, scales, offsets, bits, group, n, k, super_scales),
                      std::move(tensors),
                      product);
}

at::Tensor quant_linear(const at::Tensor& x, const PackedWeight& w,
                        const c10::optional<at::Tensor>& bias, bool float32_out) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == w.k, "quant_linear: x has ", x.size(1), " columns, the weight ", w.k);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == w.n, "quant_linear: bias size");
  }
  const int64_t rows = x.size(0);
  at::Tensor out =
      at::empty({rows, w.n}, float32_out ? x.options().dtype(at::kFloat) : x.options());
  if (rows == 0) return out;
  const at::Tensor xc = x.contiguous();
  const int isa = current_isa();
  QuantScratch scratch;
  const QuantInput in = scratch.view(w, rows, isa);
  if (in.path == QuantPath::kAmx) amx_permitted();
  const GemmOut o{out.data_ptr(), w.n, out.scalar_type() == at::kBFloat16,
                  bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, w.n};
  // Tiny products stay on the calling thread (as packed_linear's).
  const int threads = w.n_pad * w.k_pad * std::max<int64_t>(rows, 4) < (1 << 16) ? 1 : team_size();
  const int64_t rows_per_chunk = (rows + 4 * threads - 1) / (4 * threads);
  const int64_t per = gemm_chunk_blocks(w, rows, threads);
  const void* input = xc.data_ptr();
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  PhasedJob job;
  job.add_phase((rows + rows_per_chunk - 1) / rows_per_chunk, [&](int64_t chunk, int) {
    const int64_t r0 = chunk * rows_per_chunk;
    prepare_quant_rows(w, input, x_bf16, w.k, in, r0, std::min(rows, r0 + rows_per_chunk));
  }, "prepare rows");
  job.add_phase((w.blocks() + per - 1) / per, [&](int64_t chunk, int) {
    quant_gemm(w, in, o, chunk * per, std::min(w.blocks(), (chunk + 1) * per), isa);
  }, "linear (own call)", w.bytes());
  WorkerPool::instance().run(job, threads);
  return out;
}

}  // namespace tokenmill
