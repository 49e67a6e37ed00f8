#include "core/model/model.h"

#include <algorithm>
#include <cstdio>
#include <utility>

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
  if (m.dtype != DType::kF32 && m.dtype != DType::kF16 && m.dtype != DType::kBF16 && !is_block_dtype(m.dtype)) {
    return invalid_argument(source + ": " + name + ": dtype " + std::string(dtype_name(m.dtype)) +
                            " is not a matrix dtype (expected f32, f16, bf16 or a block type)");
  }
  if (is_block_dtype(m.dtype) && m.cols % dtype_block_elements(m.dtype) != 0) {
    return invalid_argument(source + ": " + name + ": " + std::string(dtype_name(m.dtype)) + " rows need a multiple of " +
                            std::to_string(dtype_block_elements(m.dtype)) + " columns, got " + std::to_string(m.cols));
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

std::vector<const WeightMatrix*> Model::matrices() const {
  std::vector<const WeightMatrix*> out;
  if (!tok_embeddings.empty()) out.push_back(&tok_embeddings);
  if (!lm_head.empty() && lm_head.data != tok_embeddings.data) out.push_back(&lm_head);
  for (const LayerWeights& l : layers) {
    for (const WeightMatrix* w : l.matrices()) {
      if (!w->empty()) out.push_back(w);
    }
  }
  return out;
}

std::map<DType, int64_t> Model::held_types() const {
  std::map<DType, int64_t> out;
  for (const WeightMatrix* w : matrices()) ++out[w->dtype];
  return out;
}

size_t Model::weight_bytes() const {
  size_t n = 0;
  for (const WeightMatrix* w : matrices()) n += w->bytes();
  size_t floats = final_norm.size();
  for (const LayerWeights& l : layers) {
    for (const Vec* v : {&l.attn_norm, &l.ffn_norm, &l.bq, &l.bk, &l.bv, &l.q_norm, &l.k_norm}) floats += v->size();
  }
  return n + floats * sizeof(float);
}

std::string Model::weights_held_text() const {
  const std::map<DType, int64_t> held = held_types();
  std::vector<std::pair<DType, int64_t>> types(held.begin(), held.end());
  std::stable_sort(types.begin(), types.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.1f MiB", static_cast<double>(weight_bytes()) / (1024.0 * 1024.0));
  std::string s = mib;
  for (size_t i = 0; i < types.size(); ++i) {
    s.append(i == 0 ? " (" : ", ").append(dtype_name(types[i].first)).append(" ").append(std::to_string(types[i].second));
  }
  return types.empty() ? s : s + ")";
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
