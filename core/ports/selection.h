// Head-level token selection (SpeContext §1.5): per KV head, the max over its group's query heads
// of the attention weights, then the top tokens, with attention sinks and a recent window always
// kept. One Selection serves every layer of a decode step.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace specontext {

// Defaults measured with `specontext eval` on stories260K (context 512, 64 positions, distilled
// head): at B = 32, sinks 0/1/4/16 gave recall .838/.839/.831/.779 and KL .069/.064/.079/.140;
// windows 1/4/16 changed recall by < .003 (32 cost .04 at B = 32). So one sink (BOS; the
// authors' prototype also always keeps position 0) and a small window, which must be >= 1 so
// the current token attends to itself.
struct SelectionOptions {
  int64_t budget = 256;  // tokens attended per KV head, sinks and window included
  int64_t sinks = 1;     // first tokens always kept (attention sinks)
  int64_t window = 4;    // most recent tokens always kept (the current token among them)
};

// Per KV head, the selected token positions in ascending order.
struct Selection {
  int64_t kv_heads = 0;
  int64_t budget = 0;
  std::vector<int32_t> indices;  // [kv_heads][budget]; head h uses the first counts[h]
  std::vector<int32_t> counts;   // [kv_heads]
  std::span<const int32_t> head(int64_t h) const {
    return {indices.data() + h * budget, static_cast<size_t>(counts[static_cast<size_t>(h)])};
  }
};

// scores: [n_q_heads][length] attention weights (each row a softmax over the `length` tokens).
// Query head q belongs to KV head q / (n_q_heads / n_kv_heads). When length <= budget every
// token is selected. Ties prefer the older token, so the result is deterministic.
void select_tokens(std::span<const float> scores, int64_t n_q_heads, int64_t n_kv_heads,
                   int64_t length, const SelectionOptions& options, Selection& out);

// The same from scores already reduced over each GQA group: group_scores [n_kv_heads][length].
// select_tokens is the group max followed by this.
void select_from_group_scores(std::span<const float> group_scores, int64_t n_kv_heads, int64_t length,
                              const SelectionOptions& options, Selection& out);

// How a head's query heads of one KV group combine into the group's scores.
//   kMax:   the max of their attention weights (the paper's rule; select_tokens).
//   kTurns: the heads take turns: each query head ranks the middle tokens (past the sinks, before
//           the window, as select_from_group_scores shrinks them to the budget) by its weights,
//           and a token scores minus its best rank over the group (ranks past the budget's free
//           slots, which cannot be selected, all score minus that count), so the top-k is the union of
//           every head's best ranks (at the last rank reached, the older tokens first). A head
//           whose query heads each learned one target layer's attention keeps every layer's best.
enum class GroupReduce : uint8_t { kMax, kTurns };

// group_scores [n_kv_heads][length] for select_from_group_scores from per-query-head scores
// [n_q_heads][length] by `reduce`; query head q belongs to KV head q / (n_q_heads / n_kv_heads).
void reduce_group_scores(std::span<const float> scores, int64_t n_q_heads, int64_t n_kv_heads, int64_t length,
                         const SelectionOptions& options, GroupReduce reduce, std::vector<float>& group_scores);

// The kTurns rule on one KV group, over any index space: `middle` lists the indices that compete
// (ascending: a smaller index is an older token); query head j of the group weighs index i at
// weights[j·stride + i]. Each head ranks `middle` by its weights (equal weights: the smaller index
// first), only its first `take` ranks count, and score[i] becomes minus i's best rank over the
// group, -take where no head ranks it that high. Entries of `score` outside `middle` are not touched.
// reduce_group_scores(kTurns) applies it to tokens, select_among_candidates to a head's candidates.
void score_group_by_turns(const float* weights, int64_t stride, int64_t group, int64_t take,
                          std::span<const int32_t> middle, float* score);

// Sinks and window only (StreamingLLM), same output shape.
void select_streaming(int64_t n_kv_heads, int64_t length, const SelectionOptions& options,
                      Selection& out);

}  // namespace specontext

namespace specontext {

// Quest (Tang et al. 2024): pages of `page_size` tokens ranked per KV head by the upper bound
// Σ_i max(q_i·min_i, q_i·max_i) of the page's keys (max over the group's query heads); pages fill
// the budget left after sinks and window. q: [n_q_heads][head_dim] (after RoPE);
// page_min/page_max: [n_pages][n_kv_heads][head_dim] element-wise key bounds.
void select_quest(const float* q, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                  const float* page_min, const float* page_max, int64_t page_size, int64_t length,
                  const SelectionOptions& options, Selection& out);

}  // namespace specontext
