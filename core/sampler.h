// Token sampling: greedy, temperature, top-k, top-p, repetition penalty, seeded.
// With top_k = 0 and repetition_penalty = 1 the random stream and the top-p procedure are those
// of llama2.c run.c (xorshift* generator, cutoff pre-filter), so seeded runs reproduce its output.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/ids.h"
#include "core/status.h"

namespace specontext {

struct SamplingParams {
  float temperature = 0.0f;         // 0 = greedy
  float top_p = 1.0f;               // 1 = off
  int32_t top_k = 0;                // 0 = off
  float repetition_penalty = 1.0f;  // 1 = off; CTRL-style: divide positive logits, multiply negative
  uint64_t seed = 0;                // 0 = derived from time
  Status validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Samples from logits (modified in place). `history` holds previous tokens for the penalty.
  TokenId sample(std::span<float> logits, std::span<const TokenId> history);
  const SamplingParams& params() const { return params_; }

 private:
  uint32_t random_u32();
  float random_f32();
  SamplingParams params_;
  uint64_t rng_state_;
  std::vector<std::pair<float, int32_t>> candidates_;  // reused scratch
};

int32_t argmax(std::span<const float> values);

}  // namespace specontext
