#include "core/model/model.h"

namespace specontext {

namespace {

int64_t numel(const WeightMatrix& m) { return m.empty() ? 0 : m.rows * m.cols; }

// Built with append: GCC 12 -O3 warns (-Wrestrict, a known false positive) on "[" + to_string().
std::string pair_string(int64_t a, int64_t b) {
  std::string s = "[";
  s.append(std::to_string(a)).append(", ").append(std::to_string(b)).append("]");
  return s;
}

Status check_matrix(const std::string& source, const std::string& name, const WeightMatrix& m,
                    int64_t rows, int64_t cols) {
  if (m.empty()) return not_found(source + ": " + name + ": missing");
  if (m.dtype != DType::kF32 && m.dtype != DType::kF16 && m.dtype != DType::kBF16) {
    return invalid_argument(source + ": " + name + ": dtype " + std::string(dtype_name(m.dtype)) +
                            " is not a matrix dtype (expected f32, f16 or bf16)");
  }
  if (m.rows != rows || m.cols != cols) {
    return invalid_argument(source + ": " + name + ": expected " + pair_string(rows, cols) +
                            ", got " + pair_string(m.rows, m.cols));
  }
  return Status::ok();
}

Status check_vec(const std::string& source, const std::string& name, const Vec& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) != n) {
    return invalid_argument(source + ": " + name + ": expected [" + std::to_string(n) + "], got [" +
                            std::to_string(v.size()) + "]");
  }
  return Status::ok();
}

}  // namespace

int64_t Model::parameter_count() const {
  int64_t n = numel(tok_embeddings) + static_cast<int64_t>(final_norm.size());
  if (lm_head.data != tok_embeddings.data) n += numel(lm_head);  // tied weights count once
  for (const LayerWeights& l : layers) {
    n += numel(l.wq) + numel(l.wk) + numel(l.wv) + numel(l.wo);
    n += numel(l.w_gate) + numel(l.w_up) + numel(l.w_down);
    n += static_cast<int64_t>(l.attn_norm.size() + l.ffn_norm.size() + l.bq.size() + l.bk.size() +
                              l.bv.size() + l.q_norm.size() + l.k_norm.size());
  }
  return n;
}

Status Model::validate() const {
  const std::string src = source.empty() ? std::string("model") : source;
  SPX_RETURN_IF_ERROR(config.validate(src));
  const ModelConfig& c = config;
  SPX_RETURN_IF_ERROR(check_matrix(src, "tok_embeddings", tok_embeddings, c.vocab_size, c.dim));
  SPX_RETURN_IF_ERROR(check_matrix(src, "lm_head", lm_head, c.vocab_size, c.dim));
  SPX_RETURN_IF_ERROR(check_vec(src, "final_norm", final_norm, c.dim));
  if (c.tie_embeddings && lm_head.data != tok_embeddings.data) {
    return invalid_argument(src +
                            ": lm_head: config says tied embeddings but lm_head has its own data");
  }
  if (static_cast<int64_t>(layers.size()) != c.n_layers) {
    return invalid_argument(src + ": layers: expected " + std::to_string(c.n_layers) + ", got " +
                            std::to_string(layers.size()));
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerWeights& l = layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    SPX_RETURN_IF_ERROR(check_vec(src, p + "attn_norm", l.attn_norm, c.dim));
    SPX_RETURN_IF_ERROR(check_matrix(src, p + "wq", l.wq, c.q_dim(), c.dim));
    SPX_RETURN_IF_ERROR(check_matrix(src, p + "wk", l.wk, c.kv_dim(), c.dim));
    SPX_RETURN_IF_ERROR(check_matrix(src, p + "wv", l.wv, c.kv_dim(), c.dim));
    SPX_RETURN_IF_ERROR(check_matrix(src, p + "wo", l.wo, c.dim, c.q_dim()));
    SPX_RETURN_IF_ERROR(check_vec(src, p + "bq", l.bq, c.attention_bias ? c.q_dim() : 0));
    SPX_RETURN_IF_ERROR(check_vec(src, p + "bk", l.bk, c.attention_bias ? c.kv_dim() : 0));
    SPX_RETURN_IF_ERROR(check_vec(src, p + "bv", l.bv, c.attention_bias ? c.kv_dim() : 0));
    SPX_RETURN_IF_ERROR(check_vec(src, p + "q_norm", l.q_norm, c.qk_norm ? c.head_dim : 0));
    SPX_RETURN_IF_ERROR(check_vec(src, p + "k_norm", l.k_norm, c.qk_norm ? c.head_dim : 0));
    SPX_RETURN_IF_ERROR(check_vec(src, p + "ffn_norm", l.ffn_norm, c.dim));
    SPX_RETURN_IF_ERROR(check_matrix(src, p + "w_gate", l.w_gate, c.hidden_dim, c.dim));
    SPX_RETURN_IF_ERROR(check_matrix(src, p + "w_up", l.w_up, c.hidden_dim, c.dim));
    SPX_RETURN_IF_ERROR(check_matrix(src, p + "w_down", l.w_down, c.dim, c.hidden_dim));
  }
  return Status::ok();
}

}  // namespace specontext
