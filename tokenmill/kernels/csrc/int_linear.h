// Quantized linears: int8 / int4 codes in linear.h's 16-row blocks with float16 scales
// (and offsets) per group of k; `out = x @ W.T + bias`, W = code * scale + offset. The codes'
// layout is tokenmill/kernels/int_linear.py's (which packs them at load time).
//
// A product first prepares its input rows (a phase of its own: each row once, not once per
// chunk of output blocks), then runs over blocks of 16 output rows. Which kernel runs (`path`):
// - float activations (ISA levels 0 and 2): codes widened to float, times float rows;
// - int8 activations (levels 1 and 3-4: AVX2's vpmaddubsw, VNNI's vpdpbusd): rows quantized per
//   token and block of 32 columns (a float scale each: W8A8 dynamic, as llama.cpp's q8_0
//   activations), integer dot products;
// - AMX (level 4, `kQuantAmxMinRows` rows or more): each chunk of blocks dequantized into the
//   dense bf16 packed layout in a per-thread scratch (L2-sized), multiplied by packed_gemm's
//   AMX tiles with bf16 rows; the weight is never dequantized whole.
//
// Scales are float16 per group, or (factored: GGUF's K-quants and IQ4_XS as stored) an int8
// per group [blocks, groups, 16] times a float16 per super-block of kSuperCols columns
// [blocks, k_pad / kSuperCols, 16]: the bytes of the file's scales, not 16 bits a group.
#pragma once

#include "linear.h"

namespace tokenmill {

// The `bits` of a weight whose 4-bit codes are indices into llama.cpp's IQ4_NL table (GGUF's
// IQ4_NL / IQ4_XS blocks as stored): nibbles as int4's, each looked up in `kIq4NlValues`.
constexpr int kIq4NlBits = 14;
constexpr int8_t kIq4NlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// Columns per factored scale's float16 part (a K-quant's super-block).
constexpr int64_t kSuperCols = 256;

// Rows from which a quantized product runs on AMX tiles where the CPU has them.
constexpr int64_t kQuantAmxMinRows = 32;

enum class QuantPath : int { kFloat = 0, kInt8 = 1, kAmx = 2 };
QuantPath quant_path(int64_t rows, int isa);

// Tuning (benchmarks): software prefetch `bytes` ahead of the codes a VNNI product reads
// (0: none), into L1 (hint 0) or L2 (hint 1).
void set_quant_prefetch(int64_t bytes, int64_t hint);

// A product's input rows as its kernels read them (pointers into a QuantScratch).
struct QuantInput {
  QuantPath path;
  int64_t rows, kp, groups, group;
  int8_t* q;          // kInt8: codes [rows, kp]
  float* qscale;      // kInt8: [rows, kp / 32]
  int32_t* qsum;      // kInt8: sums of each 16 codes [rows, kp / 16]
  float* xf;          // kFloat: rows widened and zero-padded [rows, kp]
  float* group_sum;   // kFloat, kInt8: each group's sum of the (rounded) activations
  bf16* xb;           // kAmx: bf16 rows, zero-padded [rows, kp]
};

// Buffers for prepared inputs, grown to the largest product seen. A view points into them:
// growing (`reserve`, or `view` of a larger product) invalidates earlier views, so a caller
// that holds several (the stack's job) reserves for all of them first.
class QuantScratch {
 public:
  void reserve(const PackedWeight& w, int64_t rows, int isa);
  QuantInput view(const PackedWeight& w, int64_t rows, int isa);

 private:
  at::Tensor bytes_;
};

// Rows [r0, r1) of `x` (k columns, `ldx` apart, float32 or bf16) into `in`.
void prepare_quant_rows(const PackedWeight& w, const void* x, bool x_bf16, int64_t ldx,
                        const QuantInput& in, int64_t r0, int64_t r1);

// out[r, c] for rows [0, in.rows) and the columns of blocks [b0, b1), on the calling thread.
void quant_gemm(const PackedWeight& w, const QuantInput& in, const GemmOut& out, int64_t b0,
                int64_t b1, int isa);

// `scales` float16, or int8 with `super_scales` (factored scales).
PackedWeight quant_view(const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, int64_t bits, int64_t group,
                        int64_t n, int64_t k,
                        const c10::optional<at::Tensor>& super_scales = c10::nullopt);

// x @ W.T + bias on the worker pool, in x's dtype or float32.
// The float32 rows `rows` (int64 output-row indices: an embedding's tokens) of a quantized
// weight, [len(rows), k]: an embedding lookup from a quantized table.
at::Tensor quant_rows(const PackedWeight& w, const at::Tensor& rows);

at::Tensor quant_linear(const at::Tensor& x, const PackedWeight& w,
                        const c10::optional<at::Tensor>& bias, bool float32_out);

// This format's PackedLinear (Python: `PackedLinear.quantized`): packed codes of `bits` (8, 6,
// 5, 4 or kIq4NlBits) with float16 scales (and offsets) per group of `group` k, viewed and kept alive.
PackedLinear int_codes_linear(const at::Tensor& codes, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& offsets, int64_t bits,
                              int64_t group, int64_t n, int64_t k,
                              const c10::optional<at::Tensor>& super_scales);

}  // namespace tokenmill
