// Multi-LoRA's segmented shrink/expand (Punica's SGMV on the CPU): rows of a step grouped in
// segments that share one adapter slot, each getting y += (x A^T) B after the base product.
// The pieces (one row's shrink, one row's expand over a block of outputs) are what the fused
// decoder stack runs inside its own phases; `lora_shrink_expand` runs them as one job.
#pragma once

#include <vector>

#include "cpu_common.h"

namespace tokenmill {

// Output columns per expand chunk.
constexpr int64_t kLoRAOutBlock = 512;

// One linear's adapters, every slot stacked: a [slots, width, in], bt [slots, width, out]
// (B transposed, the scaling folded in); both float32, or both bf16 (then so is the input).
struct LoRAStack {
  const void* a = nullptr;
  const void* bt = nullptr;
  int64_t slots = 0, width = 0, in = 0, out = 0;
  bool bf16 = false;
  bool empty() const { return a == nullptr || width == 0; }
};

// The stack of `a` and `bt` (checked: shapes, contiguous, one dtype of float32 or bf16).
LoRAStack lora_stack_of(const at::Tensor& a, const at::Tensor& bt);

// A step's rows with an adapter, in order, each with its slot; from segments [n, 3] int64
// (first, end, slot), checked against `rows` and `slots`.
struct LoRARows {
  std::vector<int64_t> row, slot;
  int64_t size() const { return static_cast<int64_t>(row.size()); }
};
LoRARows lora_rows_of(const at::Tensor& segments, int64_t rows, int64_t slots);

// shrunk[i * width + w] = x[row i] . a[slot i][w] for the `i`th adapter row (x row stride
// ld_x, in the stack's dtype).
void lora_shrink_row(const LoRAStack& w, const LoRARows& rows, const void* x, int64_t ld_x,
                     float* shrunk, int64_t i, int isa);
// y[row i][c0:c1] += shrunk[i] @ bt[slot i][:, c0:c1] (y float32, row stride ld_y).
void lora_expand_row(const LoRAStack& w, const LoRARows& rows, const float* shrunk, float* y,
                     int64_t ld_y, int64_t i, int64_t c0, int64_t c1, int isa);

// y [rows, out] += per segment (first, end, slot): (x[first:end] @ a[slot]^T) @ bt[slot]
// with x [rows, in], a [slots, width, in], bt [slots, width, out] (B transposed, scaling folded
// in), segments [n, 3] int64; all float32, contiguous.
void lora_shrink_expand(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                        const at::Tensor& bt, const at::Tensor& segments);

}  // namespace tokenmill
