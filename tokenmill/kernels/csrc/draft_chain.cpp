// A draft model's greedy chain in one call: k - 1 decode steps of embedding, the fused decoder
// stack, the LM head and the row argmax, each step's token the next one's input, without a
// return to Python between them (spec_decode/draft_model.py). Per chain step that removes the
// module calls, the step layout's updates and the `tolist` around a ~0.05 ms stack forward of
// the demo draft, which were most of a draft token's cost.
#include "decoder_stack.h"
#include "linear.h"

namespace tokenmill {

at::Tensor argmax_rows(const at::Tensor& logits);  // argmax.cpp

// `first_tokens` [B]: each sequence's first drafted token (the input of chain step 0).
// `positions` [B] int64: chain step 0's positions; they, `slot_mapping` [B] int64 and
// `seq_lens` [B] int32 (one query a sequence, `query_start_loc` = 0..B) are written here in
// place, step by step; `block_tables` [B, W] must hold a slot for every position of the chain. Returns the
// drafted tokens [steps, B] (step s: the token after step s's input).
at::Tensor draft_chain(DecoderStack& stack, const at::Tensor& embedding,
                       const PackedLinear& lm_head, const at::Tensor& first_tokens,
                       at::Tensor& positions, at::Tensor& slot_mapping,
                       const at::Tensor& query_start_loc, at::Tensor& seq_lens,
                       const at::Tensor& block_tables, const std::vector<at::Tensor>& kv_caches,
                       int64_t block_size, int64_t steps) {
  const int64_t count = first_tokens.numel();
  TORCH_CHECK(embedding.dim() == 2 && embedding.is_contiguous(), "draft_chain: embedding [V, H]");
  TORCH_CHECK(first_tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slot_mapping.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kLong,
              "draft_chain: int64 tokens, positions, slots, tables; int32 seq_lens");
  TORCH_CHECK(positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  seq_lens.is_contiguous() && block_tables.is_contiguous() &&
                  positions.numel() == count && slot_mapping.numel() == count &&
                  seq_lens.numel() == count && block_tables.dim() == 2 &&
                  block_tables.size(0) == count && query_start_loc.numel() == count + 1,
              "draft_chain: one query a sequence");
  TORCH_CHECK(block_size > 0 && steps >= 0, "draft_chain: block_size > 0, steps >= 0");
  const int64_t width = block_tables.size(1);
  int64_t* position = positions.data_ptr<int64_t>();
  int64_t* slot = slot_mapping.data_ptr<int64_t>();
  int32_t* length = seq_lens.data_ptr<int32_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK((position[i] + steps - 1) / block_size < width,
                "draft_chain: a sequence's block table ends within the chain");
  at::Tensor out = at::empty({steps, count}, first_tokens.options());
  int64_t* drafted = out.data_ptr<int64_t>();
  at::Tensor ids = first_tokens.contiguous();
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t p = s > 0 ? ++position[i] : position[i];
      length[i] = static_cast<int32_t>(p + 1);
      slot[i] = table[i * width + p / block_size] * block_size + p % block_size;
    }
    const at::Tensor hidden = embedding.index_select(0, ids);
    const at::Tensor states = stack.forward(hidden, positions, kv_caches, slot_mapping,
                                            query_start_loc, seq_lens, block_tables);
    ids = argmax_rows(lm_head.forward(states, c10::nullopt, true));
    std::copy_n(ids.data_ptr<int64_t>(), count, drafted + s * count);
  }
  return out;
}

// A whole proposal in one call: the catch-up forward over each sequence's tokens the draft has
// no KV for (`catch_up_*`: ids, positions and slots [T], query_start_loc [B + 1] and seq_lens [B];
// each sequence's rows end at its last token), the first drafts the argmax at each sequence's
// last row, then `steps` chain steps as `draft_chain` (its arguments after `block_tables`, which
// both share: it covers the chain's positions, the catch-up's are before them). At batch 1 the
// catch-up was a second native call with its step layout, embedding, LM head and argmax from
// Python around a forward of one or two rows. Returns the drafts [steps + 1, B].
at::Tensor draft_proposal(DecoderStack& stack, const at::Tensor& embedding,
                          const PackedLinear& lm_head, const at::Tensor& catch_up_ids,
                          const at::Tensor& catch_up_positions, const at::Tensor& catch_up_slots,
                          const at::Tensor& catch_up_query_start_loc,
                          const at::Tensor& catch_up_seq_lens, at::Tensor& positions,
                          at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                          at::Tensor& seq_lens, const at::Tensor& block_tables,
                          const std::vector<at::Tensor>& kv_caches, int64_t block_size,
                          int64_t steps) {
  const int64_t count = positions.numel();
  TORCH_CHECK(catch_up_ids.scalar_type() == at::kLong && catch_up_ids.dim() == 1 &&
                  catch_up_query_start_loc.scalar_type() == at::kInt &&
                  catch_up_query_start_loc.is_contiguous() &&
                  catch_up_query_start_loc.numel() == count + 1 &&
                  catch_up_seq_lens.numel() == count,
              "draft_proposal: int64 catch-up ids, int32 query_start_loc [B + 1], seq_lens [B]");
  const int32_t* starts = catch_up_query_start_loc.data_ptr<int32_t>();
  at::Tensor rows = at::empty({count}, catch_up_ids.options());
  int64_t* last = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(starts[i + 1] > starts[i], "draft_proposal: a sequence without catch-up rows");
    last[i] = starts[i + 1] - 1;
  }
  const at::Tensor hidden = embedding.index_select(0, catch_up_ids);
  const at::Tensor states =
      stack.forward(hidden, catch_up_positions, kv_caches, catch_up_slots,
                    catch_up_query_start_loc, catch_up_seq_lens, block_tables);
  const at::Tensor first =
      argmax_rows(lm_head.forward(states.index_select(0, rows), c10::nullopt, true));
  const at::Tensor chain = draft_chain(stack, embedding, lm_head, first, positions, slot_mapping,
                                       query_start_loc, seq_lens, block_tables, kv_caches,
                                       block_size, steps);
  at::Tensor out = at::empty({steps + 1, count}, catch_up_ids.options());
  int64_t* drafted = out.data_ptr<int64_t>();
  std::copy_n(first.data_ptr<int64_t>(), count, drafted);
  std::copy_n(chain.data_ptr<int64_t>(), steps * count, drafted + count);
  return out;
}

}  // namespace tokenmill
