// CPU candidate filtering (an extension beyond the paper; planner/README.md "Beyond S^T_L").
// When even the retrieval head's K cache cannot stay on the device (very long trajectories),
// CPU workers keep per-page summaries of each sequence's head keys (element-wise min and max per
// KV head, the Quest bound) and shortlist, per KV head, the pages whose bound is highest for the
// head's query; the head then scores only those candidate tokens (select_among_candidates).
//
// Threads: a filter is driven by one thread at a time (the engine loop); implementations
// parallelise inside calls on their own workers (cpu::CpuCandidateFilter: a oneTBB arena pinned
// to the NUMA node that holds the keys).
#pragma once

#include <cstdint>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/ports/selection.h"

namespace specontext {

// Per KV head, candidate token positions in ascending order (CSR layout), drawn from the first
// `length` tokens of a sequence.
struct Candidates {
  int64_t kv_heads = 0;
  // The sequence length shortlisted: positions are < length, and select_among_candidates keeps
  // the window [length − window, length).
  int64_t length = 0;
  std::vector<int64_t> offsets;  // [kv_heads + 1]; head h owns tokens[offsets[h], offsets[h+1])
  std::vector<int32_t> tokens;
  int64_t count(int64_t h) const {
    return offsets[static_cast<size_t>(h + 1)] - offsets[static_cast<size_t>(h)];
  }
};

struct CandidateFilterOptions {
  int64_t page_size = 16;  // tokens per summary page
  int64_t n_heads = 0;     // the retrieval head's query heads
  int64_t n_kv_heads = 0;  // its KV heads (= the target's)
  int64_t head_dim = 0;
};

class CandidateFilter {
 public:
  virtual ~CandidateFilter() = default;

  // The head's keys of positions [start, start + n) of `seq`, token-major
  // [n][n_kv_heads · head_dim] in host memory; updates the summaries of the pages they touch.
  // Positions extend the sequence in order (start == tokens seen so far; an unknown sequence
  // starts at 0), else kInvalidArgument; so are non-finite keys and a null `keys` with n > 0.
  // Nothing changes on error.
  virtual Status append_keys(SeqId seq, const float* keys, int64_t start, int64_t n) = 0;

  // Forgets a sequence (no-op for unknown ids).
  virtual void drop(SeqId seq) = 0;

  // Candidates among the first `length` tokens for the head's query q [n_heads · head_dim]
  // (after RoPE), per KV head:
  //  1. the pages holding the sinks and the window of `selection`, whole (the sinks and window
  //     shrunk to the budget as select_from_group_scores does: sinks' = min(sinks, budget),
  //     window' = min(window, budget − sinks'));
  //  2. then the other pages in decreasing order of their bound
  //     max_{h in group} Σ_i max(q_h,i · min_i, q_h,i · max_i) (equal bounds: the older page
  //     first) until `shortlist_tokens` tokens are reached. The last page taken is trimmed to
  //     its oldest tokens, so a head has exactly max(shortlist_tokens, tokens of step 1)
  //     candidates (never more than length).
  // length <= shortlist_tokens gives every token. A page's summary covers every key appended to
  // it, also those at positions >= length (still an upper bound for the tokens below length).
  // Errors (kInvalidArgument): unknown sequence, length < 0 or beyond the tokens appended,
  // shortlist_tokens < 1, selection budget < 1 or sinks/window < 0, a null or non-finite q.
  // `out` is overwritten (its buffers are reused).
  virtual Status shortlist(SeqId seq, const float* q, int64_t length, int64_t shortlist_tokens,
                           const SelectionOptions& selection, Candidates& out) = 0;
};

}  // namespace specontext
