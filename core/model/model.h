// Model weights as views into storage the Model owns (memory maps or converted buffers).
#pragma once

#include <array>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "core/base/status.h"
#include "core/model/model_config.h"

namespace specontext {

// A row-major matrix [rows, cols] (rows = output features, cols = input features, i.e. the
// PyTorch nn.Linear layout). Data may live in a memory map; dtype is f32, f16 or bf16, or a block
// type (is_block_dtype: each row ceil(cols / block) ggml blocks, as GGUF stores them).
struct WeightMatrix {
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  const void* data = nullptr;
  bool empty() const { return data == nullptr; }
  size_t row_bytes() const { return dtype_row_bytes(dtype, cols); }
  size_t bytes() const { return rows <= 0 ? 0 : static_cast<size_t>(rows) * row_bytes(); }
};

// Small vectors (norm weights, biases) are always converted to f32 at load.
using Vec = std::vector<float>;

struct LayerWeights {
  Vec attn_norm;          // [dim]
  WeightMatrix wq;        // [n_heads*head_dim, dim]
  WeightMatrix wk;        // [n_kv_heads*head_dim, dim]
  WeightMatrix wv;        // [n_kv_heads*head_dim, dim]
  WeightMatrix wo;        // [dim, n_heads*head_dim]
  Vec bq, bk, bv;         // Qwen2 attention bias; empty otherwise
  Vec q_norm, k_norm;     // Qwen3 [head_dim]; empty otherwise
  Vec ffn_norm;           // [dim]
  WeightMatrix w_gate;    // [hidden_dim, dim]  (llama2.c w1)
  WeightMatrix w_up;      // [hidden_dim, dim]  (llama2.c w3)
  WeightMatrix w_down;    // [dim, hidden_dim]  (llama2.c w2)

  // The seven big matrices, for code that treats them alike (placement, byte counts).
  std::array<const WeightMatrix*, 7> matrices() const { return {&wq, &wk, &wv, &wo, &w_gate, &w_up, &w_down}; }
  std::array<WeightMatrix*, 7> matrices() { return {&wq, &wk, &wv, &wo, &w_gate, &w_up, &w_down}; }
};

struct Model {
  ModelConfig config;
  WeightMatrix tok_embeddings;  // [vocab, dim]
  std::vector<LayerWeights> layers;
  Vec final_norm;               // [dim]
  WeightMatrix lm_head;         // [vocab, dim]; equals tok_embeddings when tied
  std::string source;           // path it was loaded from
  std::string format;           // "llama2c", "safetensors", "gguf", "synthetic"
  // dtype of the big matrices that are not block types (f32 or bf16); block-type matrices
  // (LoadOptions::keep_quantized) keep their own dtype, counted by held_types().
  DType weight_dtype = DType::kF32;
  // GGUF: how many big matrices the file stores in each ggml type ({"Q4_K": 96, "Q6_K": 33}).
  // Without LoadOptions::keep_quantized block types are dequantised on load, so this is the
  // file's content, not the memory's (held_types() is that).
  std::map<std::string, int64_t> stored_types;

  // Keeps memory maps and converted buffers alive for the views above.
  std::vector<std::shared_ptr<const void>> storage;

  int64_t parameter_count() const;
  // The big matrices as held in memory, tied embeddings once: how many of each dtype, and their
  // bytes plus the f32 vectors' (what decode reads per token, the LM head included).
  std::map<DType, int64_t> held_types() const;
  size_t weight_bytes() const;
  // "3.1 MiB (q4_k 22, q6_k 5, f32 1)": weight_bytes() and held_types(), most common first.
  std::string weights_held_text() const;
  // The big matrices, tied embeddings once (tok_embeddings, lm_head when untied, then each
  // layer's seven).
  std::vector<const WeightMatrix*> matrices() const;
  // Checks every tensor's presence and shape against config; names the offending tensor.
  Status validate() const;
};

}  // namespace specontext
