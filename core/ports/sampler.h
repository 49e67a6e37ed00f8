// Token sampling: greedy, temperature, top-k, top-p, repetition penalty, seeded.
// With top_k = 0 and repetition_penalty = 1 the random stream and the top-p procedure are those
// of llama2.c run.c (xorshift* generator, cutoff pre-filter), so seeded runs reproduce its output.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_set>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"

namespace specontext {

struct SamplingParams {
  float temperature = 0.0f;         // 0 = greedy
  float top_p = 1.0f;               // 1 = off
  int32_t top_k = 0;                // 0 = off
  float repetition_penalty = 1.0f;  // 1 = off; CTRL-style: divide positive logits, multiply negative
  uint64_t seed = 0;                // 0 = derived from time
  Status validate() const;
};

// Everything one sampling decision needs besides the logits, so that the decision can run where
// the logits are (Backend::sample_rows on the device): the parameters, the coin the sequence's
// generator drew for this step (0 when greedy: greedy draws none) and the distinct previous
// tokens the repetition penalty applies to (empty when the penalty is off).
struct TokenDraw {
  SamplingParams params;
  float coin = 0.0f;                // in [0, 1)
  std::vector<TokenId> penalized;   // distinct, any order; ids outside the vocabulary are ignored
};

// The sampling procedure with the randomness taken out: penalty, then greedy argmax, or
// softmax(logits / T), top-k (ties: the lower index), then llama2.c's top-p or the full CDF, with
// `draw.coin`. `logits` is modified in place. `scratch` is reusable memory (may be empty).
TokenId sample_with_coin(std::span<float> logits, const TokenDraw& draw,
                         std::vector<std::pair<float, int32_t>>& scratch);

// The distinct tokens of a history that only grows, kept as it grows: what the repetition penalty
// applies to, without rebuilding a set of the whole context every step.
class DistinctTokens {
 public:
  void add(TokenId t) {
    if (seen_.insert(t).second) ids_.push_back(t);
  }
  void add(std::span<const TokenId> tokens) {
    for (TokenId t : tokens) add(t);
  }
  std::span<const TokenId> ids() const { return ids_; }

 private:
  std::unordered_set<TokenId> seen_;
  std::vector<TokenId> ids_;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Samples from logits (modified in place). `history` holds previous tokens for the penalty.
  // Equals sample_with_coin(logits, next_draw(history), ...).
  TokenId sample(std::span<float> logits, std::span<const TokenId> history);
  // Advances the random stream exactly as sample() would and returns the decision's inputs.
  TokenDraw next_draw(std::span<const TokenId> history);
  // The same with the history's distinct tokens kept by the caller.
  TokenDraw next_draw(const DistinctTokens& history);
  const SamplingParams& params() const { return params_; }
  // The random stream's position, and going back to one (a draw whose step failed is redrawn).
  uint64_t stream_state() const { return rng_state_; }
  void restore_stream(uint64_t state) { rng_state_ = state; }

 private:
  uint32_t random_u32();
  float random_f32();
  SamplingParams params_;
  uint64_t rng_state_;
  std::vector<std::pair<float, int32_t>> candidates_;  // reused scratch
};

int32_t argmax(std::span<const float> values);

// Log-probabilities as the OpenAI API reports them: log_softmax of the model's raw logits, before
// the repetition penalty, temperature and top-k/top-p (vLLM's default "raw_logprobs"), so they
// describe the model, not the sampling settings.
inline constexpr int32_t kMaxLogprobs = 20;  // most alternatives per token (vLLM's default limit)
struct TokenLogprob {
  TokenId token = -1;
  float logprob = 0.0f;
};
struct TokenLogprobs {
  TokenLogprob chosen;
  int32_t chosen_rank = 1;        // 1 + the tokens strictly more likely than the chosen one (vLLM's rank)
  std::vector<TokenLogprob> top;  // the top_n most likely tokens, most likely first (ties: lower id)
};
// `chosen` must index `logits`; top_n in [0, kMaxLogprobs], capped at the vocabulary.
TokenLogprobs token_logprobs(std::span<const float> logits, TokenId chosen, int32_t top_n);

}  // namespace specontext
