// Pieces shared by the two evaluation protocols (research/eval.cc, research/eval_tasks.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/sparse/retrieval_head.h"
#include "core/tokenizer/tokenizer.h"

namespace specontext::eval_internal {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Prefills `prompt` into sequence `seq` in chunks of at most `chunk` tokens; the last chunk's
// last logits row when want_logits (else empty).
Result<std::vector<float>> prefill(Engine& e, SeqId seq, std::span<const TokenId> prompt, int64_t chunk,
                                   bool want_logits);

// The text of `ids` as it continues after token ctx_tok.
std::string decode_inline(const Tokenizer& tok, const std::vector<TokenId>& ids, TokenId ctx_tok);

// An engine for one evaluation configuration: one sequence of the model's whole context.
Result<std::unique_ptr<Engine>> make_eval_engine(std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend,
                                                 const SparseOptions& sparse, int64_t page_size,
                                                 std::shared_ptr<const RetrievalHead> head);

// One sparse configuration of a sweep.
struct SweepPoint {
  SparseMethod method = SparseMethod::kDense;
  int64_t budget = 0;
  SparseOptions options;
};

// Every method of `methods` but dense × every budget, in order. SpeContext needs a head: without
// one it is left out and `skip_note` added to notes.
std::vector<SweepPoint> sparse_sweep(const std::vector<SparseMethod>& methods, const std::vector<int64_t>& budgets,
                                     int64_t sinks, int64_t window, int64_t quest_page_size, bool have_head,
                                     const std::string& skip_note, std::vector<std::string>& notes);

}  // namespace specontext::eval_internal
