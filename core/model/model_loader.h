// Loading models from disk in any supported format (their tokenizer: core/tokenizer/tokenizer_resolve.h).
#pragma once

#include <memory>
#include <string>

#include "core/model/model.h"

namespace specontext {

struct LoadOptions {
  // Convert bf16 weights to f32 at load (the CPU reference path wants f32). Without either flag,
  // f32 and bf16 matrices are used as stored and everything else (f16, GGUF block types) is
  // converted to f32, since the GEMMs take f32 or bf16 weights.
  bool force_f32 = false;
  // Hold every big matrix in bf16 instead: f32 and f16 matrices are converted (rounded to
  // nearest even) and block types dequantised to bf16 (2 bytes a parameter: an 8B Q4_K_M file
  // takes 16 GB, not 32). Not with force_f32.
  bool force_bf16 = false;
};

// Detects the format: a directory with config.json (HF safetensors, single or sharded),
// a *.gguf file, or a llama2.c checkpoint (*.bin).
Result<std::shared_ptr<Model>> load_model(const std::string& path, const LoadOptions& opts = {});

Result<std::shared_ptr<Model>> load_llama2c_model(const std::string& path, const LoadOptions& opts = {});
Result<std::shared_ptr<Model>> load_hf_model(const std::string& dir, const LoadOptions& opts = {});
Result<std::shared_ptr<Model>> load_gguf_model(const std::string& path, const LoadOptions& opts = {});

// Parses an HF config.json text into a ModelConfig (architecture, GQA, rope scaling, ...).
// `source` names the file in error messages.
Result<ModelConfig> parse_hf_config(std::string_view json_text, const std::string& source);

}  // namespace specontext
