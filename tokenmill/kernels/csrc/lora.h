// Multi-LoRA's grouped shrink/expand (Punica's SGMV on the CPU): a step's adapter rows grouped
// by adapter slot (as vLLM's kernels sort tokens by LoRA id), so that each adapter's A and B are
// read once per tile of its rows rather than once per row; each row gets y += (x A^T) B after
// the base product. The pieces (one tile's shrink over a block of widths, one tile's expand over
// a block of outputs) are what the fused decoder stack runs inside its own phases;
// `lora_shrink_expand` runs them as one job.
#pragma once

#include <array>
#include <vector>

#include "cpu_common.h"

namespace tokenmill {

// Output columns per expand task; adapter widths per shrink task; rows per tile.
constexpr int64_t kLoRAOutBlock = 256;
constexpr int64_t kLoRAWidthBlock = 16;
constexpr int64_t kLoRARowTile = 16;

// One linear's adapters, every slot stacked: a [slots, width, in], bt [slots, width, out]
// (B transposed, the scaling folded in); both float32, or both bf16 (then so is the input).
// A fused linear's parts (q/k/v, gate/up) each take width / parts of the widths and their B
// only its own columns: `part_end[p]` is part p's last output column + 1, so the expand skips
// the widths of parts whose columns miss its block (their B is zeros there).
struct LoRAStack {
  const void* a = nullptr;
  const void* bt = nullptr;
  int64_t slots = 0, width = 0, in = 0, out = 0;
  bool bf16 = false;
  int64_t parts = 1;
  std::array<int64_t, 4> part_end{};
  bool empty() const { return a == nullptr || width == 0; }
  // Split into parts of these output sizes (summing to `out`, width a multiple of their count).
  void set_parts(const std::vector<int64_t>& sizes);
};

// The stack of `a` and `bt` (checked: shapes, contiguous, one dtype of float32 or bf16).
LoRAStack lora_stack_of(const at::Tensor& a, const at::Tensor& bt);

// A step's rows with an adapter, grouped by slot (in step order within a slot): `row[i]` is the
// step row of the `i`th, and `tiles` cut each slot's run into at most kLoRARowTile of them.
struct LoRATile {
  int64_t first, end, slot;  // [first, end) indexes `row`
};
struct LoRARows {
  std::vector<int64_t> row;
  std::vector<LoRATile> tiles;
  int64_t size() const { return static_cast<int64_t>(row.size()); }
  int64_t shrink_tasks(const LoRAStack& w) const;  // tiles x width blocks
  int64_t expand_tasks(const LoRAStack& w) const;  // tiles x output blocks
};
// From segments [n, 3] int64 (first, end, slot), checked against `rows` and `slots`.
LoRARows lora_rows_of(const at::Tensor& segments, int64_t rows, int64_t slots);

// Shrink task `task`: shrunk[i * width + w] = x[row i] . a[slot][w] for its tile's rows and
// block of widths (x row stride ld_x, in the stack's dtype).
void lora_shrink_task(const LoRAStack& w, const LoRARows& rows, const void* x, int64_t ld_x,
                      float* shrunk, int64_t task, int isa);
// Expand task `task`: y[row i][block] += shrunk[i] @ bt[slot][:, block] for its tile's rows
// (y float32, row stride ld_y).
void lora_expand_task(const LoRAStack& w, const LoRARows& rows, const float* shrunk, float* y,
                      int64_t ld_y, int64_t task, int isa);

// y [rows, out] += per segment (first, end, slot): (x[first:end] @ a[slot]^T) @ bt[slot]
// with x [rows, in], a [slots, width, in], bt [slots, width, out] (B transposed, scaling folded
// in), segments [n, 3] int64; y float32, x, a and bt float32 or all bf16; contiguous.
void lora_shrink_expand(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                        const at::Tensor& bt, const at::Tensor& segments);

}  // namespace tokenmill
