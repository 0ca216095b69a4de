// Multi-LoRA's segmented shrink/expand (Punica's SGMV on the CPU): rows of a step grouped in
// segments that share one adapter slot, each getting y += (x A^T) B after the base product.
#pragma once

#include "cpu_common.h"

namespace tokenmill {

// y [rows, out] += per segment (first, end, slot): (x[first:end] @ a[slot]^T) @ bt[slot]
// with x [rows, in], a [slots, width, in], bt [slots, width, out] (B transposed, scaling folded
// in), segments [n, 3] int64; all float32, contiguous.
void lora_shrink_expand(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                        const at::Tensor& bt, const at::Tensor& segments);

}  // namespace tokenmill
