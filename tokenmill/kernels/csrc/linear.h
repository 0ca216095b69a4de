// Dense linears on weights packed once at load time in blocks of 16 output rows:
//   bfloat16: [n_pad / 16, k_pad / 2, 16, 2]  (k_pad = k rounded up to 32; pairs of k per row)
//   float32:  [n_pad / 16, k, 16]
// Within a block the layout is k-major, so that one 64-byte load gives 16 outputs' weights for
// one k (two for bf16): one row of activations is a broadcast times that vector, with no
// horizontal sums (the GEMV), and a 16 x 32 bf16 block is exactly an AMX B tile (the GEMM).
// One layout serves every row count; the plain [n, k] weight is not kept.
//
// Quantized weights (int_linear.h) are the same idea with narrower elements: blocks of 16
// output rows, k-major, each row's 32-bit lane holding consecutive k (bf16: 2, int8: 4, int4:
// 8 nibbles), so that one 64-byte load is 16 rows' lanes: what vpdpbusd and an AMX B tile read.
#pragma once

#include <c10/util/Half.h>

#include <utility>
#include <vector>

#include "cpu_common.h"

namespace tokenmill {

struct PackedWeight {
  const void* data;
  int64_t n, k, n_pad, k_pad;
  bool is_bf16;
  // Quantized codes (bits 8, 6, 5 or 4; 0: a dense weight) with float16 scales, and optionally
  // offsets, per group of `group` k: [blocks, k_pad / group, 16] (int_linear.h).
  int bits = 0;
  const c10::Half* scales = nullptr;
  const c10::Half* offsets = nullptr;
  int64_t group = 0;
  // Scales as GGUF's K-quants store them (int_linear.h): int8 per group times a float16 per
  // `super_groups` groups (256 columns); `scales` is then null.
  const int8_t* sub_scales = nullptr;
  const c10::Half* super_scales = nullptr;
  int64_t super_groups = 0;
  bool quantized() const { return bits != 0; }
  int64_t blocks() const { return n_pad / 16; }
  // Bytes a product reads of it: codes (or elements) and scales (PhaseProfile's rates).
  int64_t bytes() const {
    if (!quantized()) return n_pad * k_pad * (is_bf16 ? 2 : 4);
    const int64_t groups = n_pad * (k_pad / group);
    const int64_t scale_bytes = sub_scales ? groups + 2 * (n_pad * k_pad / 256) : 2 * groups;
    return n_pad * k_pad * bits / 8 + scale_bytes * (offsets || sub_scales ? 2 : 1);
  }
};

// Where a GEMM writes: columns [0, n) of `ld`-strided rows, as float32 or bfloat16, plus a
// float32 bias (or null).
struct GemmOut {
  void* data;
  int64_t ld;
  bool is_bf16;
  const float* bias;
  int64_t n;
};

// out[r, c] = sum_k x[r, k] * w[c, k] (+ bias[c]) for rows [0, m) and the columns of 16-row
// blocks [block_begin, block_end). `x` rows are `ldx` elements apart: bfloat16 for bf16
// weights (zero from k up to k_pad), float32 for float32 weights. Runs on the calling thread.
void packed_gemm(const PackedWeight& w, const void* x, int64_t ldx, int64_t m, const GemmOut& out,
                 int64_t block_begin, int64_t block_end, int isa);

// Blocks per chunk when `threads` threads share a product of `m` rows: a few chunks per thread
// (claimed in turn, so a descheduled thread leaves its share to the others); one chunk on one
// thread.
int64_t gemm_chunk_blocks(const PackedWeight& w, int64_t m, int threads);

PackedWeight packed_view(const at::Tensor& packed, int64_t n, int64_t k);
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor unpack_linear_weight(const at::Tensor& packed, int64_t n, int64_t k);
// x @ W.T + bias, in x's dtype or float32.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias, bool float32_out);

// A linear's packed weight, dense or of any quantized format, as Python's LinearMethod hands
// it to the fused decoder stack (and a quantized layer calls it): the tensors it views, kept
// alive, and its format's product. Each format makes its own in its header's factory (dense:
// `dense` here; integer codes: int_linear.h's `int_codes_linear`), so this file knows none.
class PackedLinear {
 public:
  // x @ W.T + bias on `weight`, in x's dtype or float32: one format's product.
  using Product = at::Tensor (*)(const at::Tensor& x, const PackedWeight& weight,
                                 const std::vector<at::Tensor>& tensors,
                                 const c10::optional<at::Tensor>& bias, bool float32_out);

  PackedLinear(const PackedWeight& weight, std::vector<at::Tensor> tensors, Product product)
      : tensors_(std::move(tensors)), weight_(weight), product_(product) {}
  static PackedLinear dense(const at::Tensor& packed, int64_t n, int64_t k);
  const PackedWeight& weight() const { return weight_; }
  // x @ W.T + bias, in x's dtype or float32.
  at::Tensor forward(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                     bool float32_out) const {
    return product_(x, weight_, tensors_, bias, float32_out);
  }

 private:
  std::vector<at::Tensor> tensors_;
  PackedWeight weight_{};
  Product product_ = nullptr;
};

}  // namespace tokenmill
