// Logits of one sequence through an Engine, for tests that compare two engines (a quantized model
// against its dequantised f32 load): every position of a prompt, then one decode step per id.
#pragma once

#include <gtest/gtest.h>

#include <span>
#include <vector>

#include "core/engine/engine.h"

namespace specontext::testing {

struct PromptLogits {
  std::vector<float> prefill;  // [prompt, vocab]
  std::vector<float> decode;   // [decode_ids, vocab]
};

// A new sequence fed `prompt` (logits of every position), then each of `decode_ids` in turn.
inline PromptLogits prompt_then_decode_logits(Engine& e, const std::vector<TokenId>& prompt,
                                              const std::vector<TokenId>& decode_ids) {
  PromptLogits out;
  auto seq = e.memory().add_sequence();
  EXPECT_TRUE(seq.is_ok());
  if (!seq.is_ok()) return out;
  StepRequest r{*seq, std::span<const TokenId>(prompt), LogitsMode::kAll};
  auto p = e.forward(std::span<const StepRequest>(&r, 1));
  EXPECT_TRUE(p.is_ok()) << p.status().to_string();
  if (p.is_ok()) out.prefill = p->logits;
  for (const TokenId& id : decode_ids) {
    StepRequest d{*seq, std::span<const TokenId>(&id, 1), LogitsMode::kLast};
    auto s = e.forward(std::span<const StepRequest>(&d, 1));
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    if (s.is_ok()) out.decode.insert(out.decode.end(), s->logits.begin(), s->logits.end());
  }
  return out;
}

}  // namespace specontext::testing
