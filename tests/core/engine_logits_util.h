// Helpers of the tests that compare a quantized model kept as stored with its dequantised f32 load:
// a small model shape for random files, the model loaded either way, and one sequence's logits through an Engine (every position of a
// prompt, then one decode step per id).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/model/model_loader.h"

namespace specontext::testing {

// A small Llama whose every matrix holds whole 256-element ggml blocks (dim 256, 4 / 2 heads of 64,
// SwiGLU 512, vocabulary 96), `layers` deep, its output tied to the embedding or not.
inline ModelConfig small_block_config(int64_t layers, bool tied) {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.dim = 256;
  c.hidden_dim = 512;
  c.n_layers = layers;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.vocab_size = 96;
  c.max_seq_len = 256;
  c.tie_embeddings = tied;
  return c;
}

// The model at `path`, its ggml blocks kept as stored (keep) or dequantised on load; null on error.
inline std::shared_ptr<const Model> load_kept_or_dequantised(const std::string& path, bool keep) {
  auto m = load_model(path, LoadOptions{.keep_quantized = keep});
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  return m.is_ok() ? std::shared_ptr<const Model>(*m) : nullptr;
}

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
