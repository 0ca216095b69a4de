// The fused decoder stack's multi-LoRA weights (decoder_stack.h's `set_lora`): each layer's
// linears' stacked adapter slots, checked against the layer's shapes and the model's dtype
// once; the stack's forward adds their deltas (lora.h) beside its own products.
#include "decoder_stack.h"

namespace tokenmill {

void DecoderStack::set_lora(const std::vector<std::vector<c10::optional<at::Tensor>>>& layers) {
  TORCH_CHECK(layers.size() == layers_.size(), "DecoderStack.set_lora: one entry per layer");
  const int64_t q_size = shape_.num_heads * shape_.head_dim;
  const int64_t kv_size = shape_.num_kv_heads * shape_.head_dim;
  const int64_t qkv = q_size + 2 * kv_size;
  const int64_t hidden = shape_.hidden, inter = shape_.intermediate;
  const std::array<std::array<int64_t, 2>, 4> shapes = {
      {{hidden, qkv}, {q_size, hidden}, {hidden, 2 * inter}, {inter, hidden}}};  // in, out
  std::vector<std::array<LoRAStack, 4>> stacks(layers.size());
  std::vector<at::Tensor> tensors;
  int64_t slots = -1, width = 0;
  for (size_t li = 0; li < layers.size(); ++li) {
    TORCH_CHECK(layers[li].size() == 8, "DecoderStack.set_lora: (a, bt) for qkv, o, gate_up, down");
    for (size_t linear = 0; linear < 4; ++linear) {
      const auto& a = layers[li][2 * linear];
      const auto& bt = layers[li][2 * linear + 1];
      if (!a.has_value() || !bt.has_value()) continue;
      LoRAStack stack = lora_stack_of(*a, *bt);
      TORCH_CHECK(stack.bf16 == is_bf16_, "DecoderStack.set_lora: adapters in the model's dtype");
      TORCH_CHECK(stack.in == shapes[linear][0] && stack.out == shapes[linear][1],
                  "DecoderStack.set_lora: an adapter's shape is not its linear's");
      // q/k/v and gate/up are fused of parts, in that order, each max-rank widths wide
      // (lora/layer.py): the expand skips the parts whose columns miss its block.
      if (linear == 0) stack.set_parts({q_size, kv_size, kv_size});
      if (linear == 2) stack.set_parts({inter, inter});
      TORCH_CHECK(slots < 0 || stack.slots == slots, "DecoderStack.set_lora: slot counts differ");
      slots = stack.slots;
      width = std::max(width, stack.width);
      stacks[li][linear] = stack;
      tensors.push_back(*a);
      tensors.push_back(*bt);
    }
  }
  lora_ = slots < 0 ? std::vector<std::array<LoRAStack, 4>>() : std::move(stacks);
  lora_tensors_ = std::move(tensors);
  lora_slots_ = std::max<int64_t>(slots, 0);
  lora_width_ = width;
}

}  // namespace tokenmill
