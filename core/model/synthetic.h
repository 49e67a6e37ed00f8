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

}  // namespace specontext
