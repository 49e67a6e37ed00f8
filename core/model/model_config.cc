#include "core/model/model_config.h"

#include <cmath>

namespace specontext {

std::string_view architecture_name(Architecture a) {
  switch (a) {
    case Architecture::kLlama: return "llama";
    case Architecture::kMistral: return "mistral";
    case Architecture::kQwen2: return "qwen2";
    case Architecture::kQwen3: return "qwen3";
  }
  return "unknown";
}

namespace {

// Bounds keep every product the engine forms (q_dim, kv bytes, vocab·dim) far from int64 overflow
// while staying well above any real model.
constexpr int64_t kMaxDim = int64_t{1} << 20;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxSeq = int64_t{1} << 26;

Status check_range(std::string_view source, const char* field, int64_t v, int64_t max) {
  if (v <= 0 || v > max) {
    return invalid_argument(std::string(source) + ": " + field + " = " + std::to_string(v) +
                            " is out of range (expected 1.." + std::to_string(max) + ")");
  }
  return Status::ok();
}

Status check_positive(std::string_view source, const char* field, double v) {
  if (!(v > 0.0) || !std::isfinite(v)) {
    return invalid_argument(std::string(source) + ": " + field + " = " + std::to_string(v) +
                            " must be a positive finite number");
  }
  return Status::ok();
}

}  // namespace

Status ModelConfig::validate(std::string_view source) const {
  SPX_RETURN_IF_ERROR(check_range(source, "dim", dim, kMaxDim));
  SPX_RETURN_IF_ERROR(check_range(source, "hidden_dim", hidden_dim, kMaxDim * 8));
  SPX_RETURN_IF_ERROR(check_range(source, "n_layers", n_layers, kMaxLayers));
  SPX_RETURN_IF_ERROR(check_range(source, "n_heads", n_heads, kMaxDim));
  SPX_RETURN_IF_ERROR(check_range(source, "n_kv_heads", n_kv_heads, kMaxDim));
  SPX_RETURN_IF_ERROR(check_range(source, "head_dim", head_dim, kMaxDim));
  SPX_RETURN_IF_ERROR(check_range(source, "vocab_size", vocab_size, kMaxVocab));
  SPX_RETURN_IF_ERROR(check_range(source, "max_seq_len", max_seq_len, kMaxSeq));
  const std::string src(source);
  if (n_heads % n_kv_heads != 0) {
    return invalid_argument(src + ": n_heads = " + std::to_string(n_heads) +
                            " is not a multiple of n_kv_heads = " + std::to_string(n_kv_heads));
  }
  if (head_dim % 2 != 0) {  // RoPE rotates pairs of dimensions
    return invalid_argument(src + ": head_dim = " + std::to_string(head_dim) + " must be even");
  }
  if (q_dim() > kMaxDim * 8) {
    return invalid_argument(src + ": n_heads * head_dim = " + std::to_string(q_dim()) +
                            " is out of range");
  }
  SPX_RETURN_IF_ERROR(check_positive(source, "rope_theta", rope_theta));
  SPX_RETURN_IF_ERROR(check_positive(source, "norm_eps", norm_eps));
  if (bos_token_id >= vocab_size || eos_token_id >= vocab_size) {
    return invalid_argument(src + ": bos_token_id = " + std::to_string(bos_token_id) +
                            " / eos_token_id = " + std::to_string(eos_token_id) +
                            " must be below vocab_size = " + std::to_string(vocab_size));
  }
  const RopeScaling& s = rope_scaling;
  switch (s.type) {
    case RopeScalingType::kNone: break;
    case RopeScalingType::kLinear:
      SPX_RETURN_IF_ERROR(check_positive(source, "rope_scaling.factor", s.factor));
      break;
    case RopeScalingType::kLlama3:
      SPX_RETURN_IF_ERROR(check_positive(source, "rope_scaling.factor", s.factor));
      SPX_RETURN_IF_ERROR(
          check_positive(source, "rope_scaling.low_freq_factor", s.low_freq_factor));
      SPX_RETURN_IF_ERROR(
          check_positive(source, "rope_scaling.high_freq_factor", s.high_freq_factor));
      if (!(s.high_freq_factor > s.low_freq_factor)) {
        return invalid_argument(src +
                                ": rope_scaling.high_freq_factor must exceed low_freq_factor");
      }
      SPX_RETURN_IF_ERROR(check_range(source, "rope_scaling.original_max_position_embeddings",
                                      s.original_max_position_embeddings, kMaxSeq));
      break;
    case RopeScalingType::kYarn:
      SPX_RETURN_IF_ERROR(check_positive(source, "rope_scaling.factor", s.factor));
      SPX_RETURN_IF_ERROR(check_positive(source, "rope_scaling.beta_fast", s.beta_fast));
      SPX_RETURN_IF_ERROR(check_positive(source, "rope_scaling.beta_slow", s.beta_slow));
      if (s.original_max_position_embeddings < 0 || s.original_max_position_embeddings > kMaxSeq) {
        return invalid_argument(src + ": rope_scaling.original_max_position_embeddings = " +
                                std::to_string(s.original_max_position_embeddings) +
                                " is out of range");
      }
      if (s.attention_factor < 0.0 || !std::isfinite(s.attention_factor)) {
        return invalid_argument(src + ": rope_scaling.attention_factor must be >= 0");
      }
      break;
  }
  if (!rope_freq_factors.empty()) {
    if (static_cast<int64_t>(rope_freq_factors.size()) != head_dim / 2) {
      return invalid_argument(src + ": rope_freq_factors has " +
                              std::to_string(rope_freq_factors.size()) + " entries, expected head_dim / 2 = " +
                              std::to_string(head_dim / 2));
    }
    for (size_t i = 0; i < rope_freq_factors.size(); ++i) {
      if (!(rope_freq_factors[i] > 0.0f) || !std::isfinite(rope_freq_factors[i])) {
        return invalid_argument(src + ": rope_freq_factors[" + std::to_string(i) +
                                "] = " + std::to_string(rope_freq_factors[i]) + " must be positive and finite");
      }
    }
  }
  return Status::ok();
}

}  // namespace specontext
