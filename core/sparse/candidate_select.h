// Scoring among CPU-filtered candidates (select_among_candidates) and the naive reference
// CandidateFilter that cpu::CpuCandidateFilter is tested against (core/ports/candidate_filter.h).
//
// Threads: free functions are re-entrant; a ReferenceCandidateFilter is driven by one thread at
// a time and never starts threads. Nothing here throws: allocation failure is ResourceExhausted.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/base/dtype.h"
#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/ports/candidate_filter.h"
#include "core/ports/selection.h"

namespace specontext {

// Selection among candidates, by the rules of select_from_group_scores (core/ports/selection.h):
// per query head h of KV head g, softmax over g's candidates of q_h·k_t/√head_dim — the
// normaliser covers the candidates only, not the whole sequence — then the max over the group,
// then per KV head the sinks' and window' (shrunk to the budget as there) always, and the best
// other candidates by group score (ties prefer the older token) up to the budget, ascending.
// A head with <= budget candidates keeps all of them. With every token [0, length) a candidate
// the result equals select_tokens on the full scores exactly (the scores are computed with the
// arithmetic of Backend::retrieval_group_scores' host default, bit for bit).
//
// q [n_heads · head_dim] (after RoPE); k_cache token-major [cand.length][n_kv_heads · head_dim]
// in host memory (at least cand.length rows; not checked). Single-threaded.
// Errors (kInvalidArgument, naming the field): head counts (n_heads % n_kv_heads, <= 0),
// cand.kv_heads != n_kv_heads, malformed CSR (offsets size/monotonicity, positions not strictly
// ascending or outside [0, cand.length)), a sink' or window' token missing from a head's
// candidates when that head has more candidates than the budget, options out of range
// (budget < 1, sinks/window < 0), null pointers, non-finite scores (NaN/inf in q or keys).
// `reduce` combines a group's query heads as reduce_group_scores does (core/ports/selection.h):
// kMax, the group score is the max of their weights; kTurns, each query head ranks the middle
// candidates by its weights and a candidate scores minus its best rank (ranks past the free slots
// all minus that count). With every token a candidate, kTurns equals reduce_group_scores(kTurns)
// + select_from_group_scores on the full per-head scores, exactly.
Status select_among_candidates(const float* q, const float* k_cache, int64_t n_heads, int64_t n_kv_heads,
                               int64_t head_dim, const Candidates& cand, const SelectionOptions& opts,
                               Selection& out, GroupReduce reduce = GroupReduce::kMax);
// The same over a paged K cache (the engine's): block b of the host table holds tokens
// [b·block_tokens, (b+1)·block_tokens), token-major, elements of k_dtype (f32, f16 or bf16, widened
// on load inside the dot products as Backend::retrieval_group_scores' default does).
Status select_among_candidates(const float* q, const void* const* k_blocks, DType k_dtype, int64_t block_tokens,
                               int64_t n_heads,
                               int64_t n_kv_heads, int64_t head_dim, const Candidates& cand,
                               const SelectionOptions& opts, Selection& out,
                               GroupReduce reduce = GroupReduce::kMax);

// The Quest bound of one page for one query head: Σ_i max(q_i·min_i, q_i·max_i), accumulated in
// 16 lanes and reduced in a fixed order. Both filters call this one function, so their page
// rankings agree bit for bit (a reimplementation with another summation order would break ties
// differently); tests check it against a double-precision loop.
float quest_page_bound(const float* q, const float* page_min, const float* page_max, int64_t head_dim);

// Shared argument checks of the CandidateFilter implementations (so both report the same
// errors). `who` prefixes messages, e.g. "CpuCandidateFilter".
Status check_candidate_filter_options(const CandidateFilterOptions& o, std::string_view who);
Status check_selection_options(const SelectionOptions& o, std::string_view who);
// append_keys(seq, keys, start, n) of a sequence holding `seen` tokens: order, null, int32 range,
// and with check_values finiteness (reads every key; the first bad one is named).
Status check_append(std::string_view who, SeqId seq, const float* keys, int64_t start, int64_t n,
                    int64_t seen, const CandidateFilterOptions& o, bool check_values = true);
// shortlist() of a sequence holding `seen` tokens (known sequence).
Status check_shortlist(std::string_view who, SeqId seq, const float* q, int64_t length, int64_t seen,
                       int64_t shortlist_tokens, const SelectionOptions& selection,
                       const CandidateFilterOptions& o);

// Sinks and window as select_from_group_scores applies them: shrunk to the budget.
struct FixedTokens {
  int64_t sinks = 0;   // [0, min(sinks, length)) always kept
  int64_t window = 0;  // [max(sinks, length − window), length) always kept
};
FixedTokens fixed_tokens(const SelectionOptions& o);

// Every token [0, length) a candidate of every head.
void all_candidates(int64_t n_kv_heads, int64_t length, Candidates& out);

// The oracle: keeps a copy of every appended key and recomputes each page's min/max from them
// on every shortlist (so it also checks the incremental summaries of the optimised filter),
// ranks pages with one stable sort per head and marks tokens one by one. O(length · kv_dim) per
// call and memory for every key: for tests and small benchmarks, not for serving.
class ReferenceCandidateFilter final : public CandidateFilter {
 public:
  static Result<std::unique_ptr<ReferenceCandidateFilter>> create(const CandidateFilterOptions& options);

  Status append_keys(SeqId seq, const float* keys, int64_t start, int64_t n) override;
  void drop(SeqId seq) override;
  Status shortlist(SeqId seq, const float* q, int64_t length, int64_t shortlist_tokens,
                   const SelectionOptions& selection, Candidates& out) override;

  // Tokens appended to `seq` (0 for an unknown sequence).
  int64_t length(SeqId seq) const;
  const CandidateFilterOptions& options() const { return options_; }

 private:
  explicit ReferenceCandidateFilter(const CandidateFilterOptions& o) : options_(o) {}
  CandidateFilterOptions options_;
  std::unordered_map<SeqId, std::vector<float>> keys_;  // per sequence [tokens][kv_heads · head_dim]
};

}  // namespace specontext
