// The tokenizer that belongs to a model.
#pragma once

#include <memory>
#include <string>

#include "core/model/model.h"
#include "core/tokenizer/tokenizer.h"

namespace specontext {

// Finds the tokenizer for a model when none is given: tokenizer.json in an HF directory,
// the vocabulary inside a GGUF, or tokenizer.bin / tok*.bin next to a llama2.c checkpoint.
Result<std::unique_ptr<Tokenizer>> load_tokenizer_for(const Model& model, const std::string& explicit_path);

}  // namespace specontext
