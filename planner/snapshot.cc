#include "planner/snapshot.h"

#include <string>

namespace specontext::planner {

int64_t model_parameter_count(const ModelConfig& c) {
  const int64_t d = c.dim;
  int64_t n = c.vocab_size * d + d;                 // embeddings + final norm
  if (!c.tie_embeddings) n += c.vocab_size * d;     // lm_head
  int64_t layer = d * c.q_dim() + 2 * d * c.kv_dim() + c.q_dim() * d  // q, k, v, o
                  + 3 * d * c.hidden_dim                               // gate, up, down
                  + 2 * d;                                             // attn/ffn norms
  if (c.attention_bias) layer += c.q_dim() + 2 * c.kv_dim();
  if (c.qk_norm) layer += 2 * c.head_dim;
  return n + c.n_layers * layer;
}

int64_t retrieval_head_parameter_count(const ModelConfig& c) {
  const int64_t d = c.dim;
  return 2 * d * c.q_dim()   // q_proj: [embed ; fused hidden] → q heads
         + 2 * d * c.kv_dim()  // k_proj → kv heads
         + 3 * d * d           // fc: three target hidden states → d
         + 2 * d;              // input norm + hidden norm
}

Result<ModelShape> shape_from_config(const ModelConfig& c) {
  if (c.n_layers <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 || c.n_heads <= 0) {
    return invalid_argument("model config: layers, heads, kv_heads and head_dim must be positive");
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return invalid_argument("model config: n_heads = " + std::to_string(c.n_heads) +
                            " is not a multiple of n_kv_heads = " + std::to_string(c.n_kv_heads));
  }
  return ModelShape{c.n_layers, c.n_kv_heads, c.head_dim, c.n_heads, c.n_kv_heads};
}

namespace {
Status positive(std::string_view field, int64_t v) {
  if (v > 0) return Status::ok();
  return invalid_argument("planner snapshot: " + std::string(field) + " must be positive, got " +
                          std::to_string(v));
}
Status non_negative(std::string_view field, double v) {
  if (v >= 0) return Status::ok();
  return invalid_argument("planner snapshot: " + std::string(field) + " must not be negative");
}
}  // namespace

Status validate_snapshot(const PlannerSnapshot& s) {
  const ModelShape& m = s.model;
  SPX_RETURN_IF_ERROR(positive("model.layers", m.layers));
  SPX_RETURN_IF_ERROR(positive("model.kv_heads", m.kv_heads));
  SPX_RETURN_IF_ERROR(positive("model.head_dim", m.head_dim));
  SPX_RETURN_IF_ERROR(positive("model.q_heads", m.q_heads));
  SPX_RETURN_IF_ERROR(non_negative("model.head_kv_heads", static_cast<double>(m.head_kv_heads)));
  // Bounds keep every product below 2^63 (a 4096-layer, 2^20-token plan still fits comfortably).
  if (m.layers > 4096 || m.kv_heads > 4096 || m.head_dim > 4096 || m.q_heads > 65536) {
    return invalid_argument("planner snapshot: model shape out of range");
  }
  if (m.q_heads % m.kv_heads != 0) {
    return invalid_argument("planner snapshot: model.q_heads = " + std::to_string(m.q_heads) +
                            " is not a multiple of model.kv_heads = " + std::to_string(m.kv_heads));
  }
  if (s.kv_elem_bytes != 1 && s.kv_elem_bytes != 2 && s.kv_elem_bytes != 4) {
    return invalid_argument("planner snapshot: kv_elem_bytes must be 1, 2 or 4, got " +
                            std::to_string(s.kv_elem_bytes));
  }
  SPX_RETURN_IF_ERROR(non_negative("model_bytes", static_cast<double>(s.model_bytes)));
  SPX_RETURN_IF_ERROR(non_negative("head_bytes", static_cast<double>(s.head_bytes)));
  if (!(s.runtime_factor >= 1.0 && s.runtime_factor <= 10.0)) {
    return invalid_argument("planner snapshot: runtime_factor must be in [1, 10]");
  }
  SPX_RETURN_IF_ERROR(positive("budget", s.budget));
  SPX_RETURN_IF_ERROR(positive("requests", s.requests));
  SPX_RETURN_IF_ERROR(positive("device_bytes", s.device_bytes));
  if (s.requests > (int64_t{1} << 20) || s.budget > (int64_t{1} << 26)) {
    return invalid_argument("planner snapshot: requests or budget out of range");
  }
  SPX_RETURN_IF_ERROR(non_negative("filter_shortlist_tokens", static_cast<double>(s.filter_shortlist_tokens)));
  SPX_RETURN_IF_ERROR(non_negative("retrieval_bytes_per_token", static_cast<double>(s.retrieval_bytes_per_token)));
  SPX_RETURN_IF_ERROR(non_negative("layer_slack_bytes", static_cast<double>(s.layer_slack_bytes)));
  SPX_RETURN_IF_ERROR(non_negative("head_cache_slack_bytes", static_cast<double>(s.head_cache_slack_bytes)));
  if (s.layer_slack_bytes > (int64_t{1} << 50) || s.head_cache_slack_bytes > (int64_t{1} << 50)) {
    return invalid_argument("planner snapshot: layer_slack_bytes or head_cache_slack_bytes out of range");
  }
  SPX_RETURN_IF_ERROR(non_negative("host_to_host_bandwidth_bps", s.host_to_host_bandwidth_bps));
  for (size_t i = 0; i < s.host.size(); ++i) {
    const std::string f = "host[" + std::to_string(i) + "].";
    SPX_RETURN_IF_ERROR(non_negative(f + "capacity_bytes", static_cast<double>(s.host[i].capacity_bytes)));
    SPX_RETURN_IF_ERROR(non_negative(f + "device_bandwidth_bps", s.host[i].device_bandwidth_bps));
  }
  for (size_t i = 0; i < s.remote.size(); ++i) {
    const std::string f = "remote[" + std::to_string(i) + "].";
    SPX_RETURN_IF_ERROR(non_negative(f + "capacity_bytes", static_cast<double>(s.remote[i].capacity_bytes)));
    SPX_RETURN_IF_ERROR(non_negative(f + "bandwidth_bps", s.remote[i].bandwidth_bps));
  }
  if (static_cast<int64_t>(s.seq_lens.size()) > s.requests) {
    return invalid_argument("planner snapshot: " + std::to_string(s.seq_lens.size()) +
                            " live sequences but the plan is sized for requests = " +
                            std::to_string(s.requests));
  }
  for (int64_t len : s.seq_lens) {
    if (len < 0 || len > (int64_t{1} << 26)) {
      return invalid_argument("planner snapshot: sequence length " + std::to_string(len) + " out of range");
    }
  }
  return Status::ok();
}

int64_t total_tokens(const PlannerSnapshot& s) {
  int64_t t = 0;
  for (int64_t len : s.seq_lens) t += len;
  return t;
}

int64_t effective_seq_len(const PlannerSnapshot& s) {
  const int64_t t = total_tokens(s);
  return s.requests > 0 ? (t + s.requests - 1) / s.requests : 0;
}

}  // namespace specontext::planner
