// Paged attention that reads the KV cache's blocks where they lie (no gather, no mask tensor),
// for any mix of decodes, verified drafts and prefill chunks in one step.
#pragma once

#include <vector>

#include "cpu_common.h"

namespace tokenmill {

struct AttentionArgs {
  const void* query;  // [tokens, heads, d] rows `q_stride` elements apart
  bool query_bf16;
  int64_t q_stride;
  const void* cache;  // [2, blocks, block_size, kv_heads, d], contiguous
  bool cache_bf16;
  int64_t num_blocks, block_size, kv_heads, d, heads;
  const int64_t* block_tables;  // [seqs, max_blocks]
  int64_t max_blocks;
  const int32_t* query_start_loc;  // [seqs + 1]
  const int32_t* seq_lens;         // [seqs]
  int64_t window;                  // 0: none
  float scale;
  void* out;  // [tokens, heads * d] rows `out_stride` elements apart
  bool out_bf16;
  int64_t out_stride;
  // [heads] float32: each head's learned logit that joins the softmax's denominator and
  // attends to nothing (gpt-oss's attention sinks); nullptr: none.
  const float* sinks = nullptr;
  // Scores (scaled) soft-capped as softcap * tanh(score / softcap) before the softmax
  // (Gemma 2's attn_logit_softcapping); 0: none.
  float softcap = 0.0f;
};

// One unit of work: queries [q_begin, q_end) (flat token indices) of sequence `seq`, for all
// query heads of KV heads [kv_begin, kv_end).
struct AttentionTask {
  int32_t seq, kv_begin, kv_end, q_begin, q_end;
};

// Tasks for a step, costliest first (so that threads taking them in turn end together): all
// KV heads of a sequence in one task (its cache rows are contiguous) unless there are too few
// tasks for `threads` threads.
std::vector<AttentionTask> attention_tasks(const int32_t* query_start_loc, const int32_t* seq_lens,
                                           int64_t num_seqs, int64_t kv_heads, int threads);

// Scratch floats one thread needs for any task of `args`.
int64_t attention_scratch_floats(const AttentionArgs& args);

void attend(const AttentionArgs& args, const AttentionTask& task, float* scratch, int isa);

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, int64_t window, double scale, at::Tensor& out,
                     const at::Tensor& sinks, double softcap);

}  // namespace tokenmill
