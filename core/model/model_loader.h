// Loading models from disk in any supported format (their tokenizer: core/tokenizer/tokenizer_resolve.h).
#pragma once

#include <functional>
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
  // GGUF matrices in Q8_0, Q4_0, Q4_K, Q5_K or Q6_K stay as stored: views into the memory map
  // whose dtype is the block type (memory ≈ the file's size); other block types are still
  // dequantised. Only for backends that run block types (Backend::supports); Engine::create
  // dequantises, with dequantize_block_matrices, what its backend cannot run.
  bool keep_quantized = false;
};

// Detects the format: a directory with config.json (HF safetensors, single or sharded),
// a *.gguf file, or a llama2.c checkpoint (*.bin).
Result<std::shared_ptr<Model>> load_model(const std::string& path, const LoadOptions& opts = {});

Result<std::shared_ptr<Model>> load_llama2c_model(const std::string& path, const LoadOptions& opts = {});
Result<std::shared_ptr<Model>> load_hf_model(const std::string& dir, const LoadOptions& opts = {});
Result<std::shared_ptr<Model>> load_gguf_model(const std::string& path, const LoadOptions& opts = {});

// `model` with every block-type matrix (is_block_dtype) for which keep(dtype) is false decoded to
// `to` (f32 or bf16) into new buffers: a new Model that holds `model` and shares its other
// views (tied embeddings stay tied), or `model` itself when nothing needs decoding.
Result<std::shared_ptr<const Model>> dequantize_block_matrices(std::shared_ptr<const Model> model, DType to,
                                                               const std::function<bool(DType)>& keep);

// Parses an HF config.json text into a ModelConfig (architecture, GQA, rope scaling, ...).
// `source` names the file in error messages.
Result<ModelConfig> parse_hf_config(std::string_view json_text, const std::string& source);

}  // namespace specontext
