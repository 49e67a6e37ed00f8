// Helpers shared by the model loaders (llama2.c, safetensors/HF, GGUF). Not a public API.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/dtype.h"
#include "core/base/status.h"
#include "core/model/model.h"
#include "core/model/model_loader.h"

namespace specontext::loader_internal {

// Parses JSON without letting exceptions escape; rejects nesting deeper than `max_depth`
// up front so hostile input cannot exhaust the stack. `source` names the file in errors.
[[nodiscard]] Result<nlohmann::json> parse_json(std::string_view text, const std::string& source,
                                                int max_depth = 64);

// "[3, 4]" for error messages.
std::string shape_string(const std::vector<int64_t>& shape);

// a*b, false on int64 overflow or negative operands.
[[nodiscard]] bool checked_mul(int64_t a, int64_t b, int64_t* out);

// Converts `n` elements of a float dtype to an f32 vector (norm weights, biases).
Vec to_f32_vec(DType t, const void* src, size_t n);

// Builds a matrix view over `src` ([rows, cols] of dtype `t`) following the load policy:
// f32 and bf16 stay in place (bf16 converted when opts.force_f32, f32 when opts.force_bf16),
// f16 is converted to f32 (bf16 with force_bf16), q8_0 dequantised as make_dequantized_matrix
// does. A converted or realigned copy is kept alive in model->storage. `what` names the
// tensor for errors.
[[nodiscard]] Result<WeightMatrix> make_matrix(Model* model, DType t, const void* src, int64_t rows,
                                               int64_t cols, const LoadOptions& opts,
                                               const std::string& what);

// A matrix stored in ggml block type `ggml_type` (Q4_0 ... IQ4_XS, see core/model/ggml_quants.h),
// decoded to f32 (bf16 with opts.force_bf16) into a buffer kept alive in model->storage. `cols`
// must be a whole number of blocks. `what` names the tensor for errors.
[[nodiscard]] Result<WeightMatrix> make_dequantized_matrix(Model* model, uint32_t ggml_type,
                                                           const void* src, int64_t rows,
                                                           int64_t cols, const LoadOptions& opts,
                                                           const std::string& what);

// A view of `src` as a matrix of block type `t` (is_block_dtype), as stored: nothing is copied.
// `cols` must be a whole number of blocks. `what` names the tensor for errors.
[[nodiscard]] Result<WeightMatrix> make_block_matrix(DType t, const void* src, int64_t rows, int64_t cols,
                                                     const std::string& what);

// One file format's names for a decoder layer's tensors (after the layer's prefix).
struct LayerTensorNames {
  const char *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *q_norm, *k_norm, *ffn_norm, *gate, *up, *down;
};

// Loads layer `l` through a format's builder (b.matrix(name, rows, cols, &out), b.vec(name, n,
// &out)): the shapes come from `c`, biases when c.attention_bias, q/k norms when c.qk_norm.
template <typename Builder>
Status load_layer(Builder& b, const std::string& prefix, const LayerTensorNames& n, const ModelConfig& c,
                  LayerWeights& l) {
  SPX_RETURN_IF_ERROR(b.vec(prefix + n.attn_norm, c.dim, &l.attn_norm));
  SPX_RETURN_IF_ERROR(b.matrix(prefix + n.wq, c.q_dim(), c.dim, &l.wq));
  SPX_RETURN_IF_ERROR(b.matrix(prefix + n.wk, c.kv_dim(), c.dim, &l.wk));
  SPX_RETURN_IF_ERROR(b.matrix(prefix + n.wv, c.kv_dim(), c.dim, &l.wv));
  SPX_RETURN_IF_ERROR(b.matrix(prefix + n.wo, c.dim, c.q_dim(), &l.wo));
  if (c.attention_bias) {
    SPX_RETURN_IF_ERROR(b.vec(prefix + n.bq, c.q_dim(), &l.bq));
    SPX_RETURN_IF_ERROR(b.vec(prefix + n.bk, c.kv_dim(), &l.bk));
    SPX_RETURN_IF_ERROR(b.vec(prefix + n.bv, c.kv_dim(), &l.bv));
  }
  if (c.qk_norm) {
    SPX_RETURN_IF_ERROR(b.vec(prefix + n.q_norm, c.head_dim, &l.q_norm));
    SPX_RETURN_IF_ERROR(b.vec(prefix + n.k_norm, c.head_dim, &l.k_norm));
  }
  SPX_RETURN_IF_ERROR(b.vec(prefix + n.ffn_norm, c.dim, &l.ffn_norm));
  SPX_RETURN_IF_ERROR(b.matrix(prefix + n.gate, c.hidden_dim, c.dim, &l.w_gate));
  SPX_RETURN_IF_ERROR(b.matrix(prefix + n.up, c.hidden_dim, c.dim, &l.w_up));
  return b.matrix(prefix + n.down, c.dim, c.hidden_dim, &l.w_down);
}

// Makes every big matrix the same dtype (a bf16 file with a few f32 matrices ends up all f32)
// and sets model->weight_dtype, so backends can trust that one field.
void unify_weight_dtype(Model* model);

// True when `path` names an existing regular file.
bool is_regular_file(const std::string& path);

}  // namespace specontext::loader_internal
