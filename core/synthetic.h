// Models with random weights and the shapes of named real models, built in memory, so decode
// speed at long context can be measured without downloading anything. They say nothing about
// output quality.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/model.h"
#include "core/tokenizer.h"

namespace specontext {

// Known names: llama-3.2-1b, llama-3.1-8b, qwen3-8b, and the tiny "toy" shape for tests.
std::vector<std::string> synthetic_model_names();
Result<ModelConfig> synthetic_config(const std::string& name);
// layers > 0 cuts the depth; dtype is f32 or bf16.
Result<std::shared_ptr<Model>> make_synthetic_model(const std::string& name, int64_t layers,
                                                    DType dtype, uint64_t seed);
// Random weights for any config (tests use it with hand-written configs).
Result<std::shared_ptr<Model>> make_random_model(const ModelConfig& config, DType dtype, uint64_t seed);

// A stand-in tokenizer for synthetic models (which have none), so that servers and benchmarks can
// run them: token i decodes to " i", and text encodes as whitespace-separated ids ("5 17 3").
// No BOS, no stop ids. Anything else in the text is an InvalidArgument naming the word.
std::unique_ptr<Tokenizer> make_synthetic_tokenizer(int32_t vocab_size);

}  // namespace specontext
