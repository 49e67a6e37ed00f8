// Models with random weights and the shapes of named real models, built in memory, so decode
// speed at long context can be measured without downloading anything. They say nothing about
// output quality. Their tokenizer is core/tokenizer/synthetic_tokenizer.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/model/model.h"

namespace specontext {

// Known names: llama-3.2-1b, llama-3.1-8b, qwen3-8b, and the tiny "toy" shape for tests.
std::vector<std::string> synthetic_model_names();
Result<ModelConfig> synthetic_config(const std::string& name);
// layers > 0 cuts the depth; dtype is f32 or bf16.
Result<std::shared_ptr<Model>> make_synthetic_model(const std::string& name, int64_t layers,
                                                    DType dtype, uint64_t seed);
// Random weights for any config (tests use it with hand-written configs).
Result<std::shared_ptr<Model>> make_random_model(const ModelConfig& config, DType dtype, uint64_t seed);

// Writes a GGUF file (architecture "llama"; no tokenizer inside) with `config`'s shapes and random
// weights: every big matrix (token_embd, output when untied, the layers' seven) of `matrix_type`,
// f32 or a block type (is_block_dtype: random codes and sub-block scales, block scales drawn so
// that the weights spread about as make_random_model's, ±1/sqrt(cols)); norms are 1. Block types
// need dim, q_dim and hidden_dim to be whole blocks. For loading tests and decode benchmarks
// on quantised files; says nothing about quality.
Status write_random_gguf(const std::string& path, const ModelConfig& config, DType matrix_type, uint64_t seed);

}  // namespace specontext
