// Architecture-level description of a decoder-only transformer, independent of file format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/base/status.h"

namespace specontext {

enum class Architecture { kLlama, kMistral, kQwen2, kQwen3 };
std::string_view architecture_name(Architecture a);

// How RoPE pairs dimensions. llama2.c and GGUF store q/k so that (2i, 2i+1) rotate together;
// Hugging Face stores them so that (i, i + head_dim/2) rotate together (rotate_half).
enum class RopeStyle { kInterleaved, kHalf };

enum class RopeScalingType { kNone, kLinear, kLlama3, kYarn };

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;
  // llama3
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;
  // yarn
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double attention_factor = 0.0;  // 0 = derive (0.1·ln(factor) + 1)
};

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  int64_t dim = 0;          // hidden size
  int64_t hidden_dim = 0;   // MLP intermediate size
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;     // usually dim / n_heads; Qwen3 sets it explicitly
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;
  double rope_theta = 10000.0;
  RopeStyle rope_style = RopeStyle::kHalf;
  RopeScaling rope_scaling;
  // Per-frequency divisors of the RoPE inverse frequencies (head_dim / 2 of them), applied after
  // rope_scaling: GGUF's rope_freqs.weight, where llama.cpp's converter bakes Llama 3.1+'s llama3
  // scaling. Empty = none.
  std::vector<float> rope_freq_factors;
  float norm_eps = 1e-5f;
  bool tie_embeddings = false;
  bool attention_bias = false;  // Qwen2: q/k/v have biases
  bool qk_norm = false;         // Qwen3: per-head RMSNorm on q and k before RoPE
  int32_t bos_token_id = 1;
  int32_t eos_token_id = 2;

  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  // KV bytes per token for a given element size: 2 · layers · kv_heads · head_dim · bytes.
  int64_t kv_bytes_per_token(int64_t elem_bytes) const { return 2 * n_layers * kv_dim() * elem_bytes; }
  // Checks internal consistency; `source` names the file for error messages.
  Status validate(std::string_view source) const;
};

}  // namespace specontext
