// Hugging Face config.json → ModelConfig for the Llama family (Llama, Mistral, Qwen2, Qwen3).
#include <cmath>
#include <limits>

#include "core/model/loader_internal.h"
#include "core/model/model_loader.h"

namespace specontext {

namespace {

using nlohmann::json;

class ConfigReader {
 public:
  ConfigReader(const json& obj, std::string source, std::string prefix = "")
      : obj_(obj), source_(std::move(source)), prefix_(std::move(prefix)) {}

  // Present and not null.
  bool has(const char* key) const {
    auto it = obj_.find(key);
    return it != obj_.end() && !it->is_null();
  }

  Status bad(const char* key, const std::string& why) const {
    return invalid_argument(source_ + ": field \"" + prefix_ + key + "\" " + why);
  }

  Result<int64_t> get_int(const char* key) const {
    if (!has(key)) return not_found(source_ + ": missing field \"" + prefix_ + key + "\"");
    const json& v = obj_.at(key);
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() &&
          v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return bad(key, "is too large");
      }
      return v.get<int64_t>();
    }
    // Some exporters write integral values as floats (e.g. 4096.0).
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
        return static_cast<int64_t>(d);
      }
    }
    return bad(key, "must be an integer, got " + v.dump());
  }

  Result<int64_t> get_int_or(const char* key, int64_t def) const {
    if (!has(key)) return def;
    return get_int(key);
  }

  Result<double> get_double_or(const char* key, double def) const {
    if (!has(key)) return def;
    const json& v = obj_.at(key);
    if (!v.is_number()) return bad(key, "must be a number, got " + v.dump());
    return v.get<double>();
  }

  Result<bool> get_bool_or(const char* key, bool def) const {
    if (!has(key)) return def;
    const json& v = obj_.at(key);
    if (!v.is_boolean()) return bad(key, "must be true or false, got " + v.dump());
    return v.get<bool>();
  }

  Result<std::string> get_string_or(const char* key, const std::string& def) const {
    if (!has(key)) return def;
    const json& v = obj_.at(key);
    if (!v.is_string()) return bad(key, "must be a string, got " + v.dump());
    return v.get<std::string>();
  }

  // bos/eos: an id, a list of ids (the first one is the primary), or null (none).
  Result<int32_t> get_token_id_or(const char* key, int32_t def) const {
    auto it = obj_.find(key);
    if (it == obj_.end()) return def;
    const json* v = &*it;
    if (v->is_null()) return int32_t{-1};
    if (v->is_array()) {
      if (v->empty()) return int32_t{-1};
      v = &(*v)[0];
    }
    if (!v->is_number_integer() || v->get<int64_t>() < -1 ||
        v->get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return bad(key, "must be a token id or a list of ids, got " + it->dump());
    }
    return static_cast<int32_t>(v->get<int64_t>());
  }

 private:
  const json& obj_;
  std::string source_;
  std::string prefix_;
};

struct ArchName {
  const char* hf_class;
  const char* model_type;
  Architecture arch;
};
constexpr ArchName kArchs[] = {
    {"LlamaForCausalLM", "llama", Architecture::kLlama},
    {"MistralForCausalLM", "mistral", Architecture::kMistral},
    {"Qwen2ForCausalLM", "qwen2", Architecture::kQwen2},
    {"Qwen3ForCausalLM", "qwen3", Architecture::kQwen3},
};

Result<Architecture> parse_architecture(const json& j, const std::string& source) {
  const std::string supported =
      "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";
  auto it = j.find("architectures");
  if (it != j.end() && !it->is_null()) {
    if (!it->is_array()) {
      return invalid_argument(source + ": field \"architectures\" must be a list of class names");
    }
    for (const json& a : *it) {
      if (!a.is_string()) continue;
      for (const ArchName& n : kArchs) {
        if (a.get<std::string>() == n.hf_class) return n.arch;
      }
    }
    return unimplemented(source + ": unsupported \"architectures\" " + it->dump() + " (" +
                         supported + ")");
  }
  // Older exports omit "architectures"; model_type identifies the family just as well.
  auto mt = j.find("model_type");
  if (mt != j.end() && mt->is_string()) {
    for (const ArchName& n : kArchs) {
      if (mt->get<std::string>() == n.model_type) return n.arch;
    }
    return unimplemented(source + ": no \"architectures\" field and unsupported \"model_type\" " +
                         mt->dump() + " (" + supported + ")");
  }
  return invalid_argument(source + ": missing field \"architectures\" (" + supported + ")");
}

Status parse_rope_scaling(const json& j, ModelConfig* c, const std::string& source) {
  auto it = j.find("rope_scaling");
  if (it == j.end() || it->is_null()) return Status::ok();
  if (!it->is_object()) {
    return invalid_argument(source + ": field \"rope_scaling\" must be an object or null");
  }
  const ConfigReader r(*it, source, "rope_scaling.");
  // transformers renamed "type" to "rope_type"; accept both.
  std::string type;
  if (r.has("rope_type")) {
    SPX_ASSIGN_OR_RETURN(type, r.get_string_or("rope_type", ""));
  } else {
    SPX_ASSIGN_OR_RETURN(type, r.get_string_or("type", ""));
  }
  RopeScaling& s = c->rope_scaling;
  if (type.empty() || type == "default") {
    s.type = RopeScalingType::kNone;
    return Status::ok();
  }
  SPX_ASSIGN_OR_RETURN(s.factor, r.get_double_or("factor", 1.0));
  if (type == "linear") {
    s.type = RopeScalingType::kLinear;
  } else if (type == "llama3") {
    s.type = RopeScalingType::kLlama3;
    SPX_ASSIGN_OR_RETURN(s.low_freq_factor, r.get_double_or("low_freq_factor", 1.0));
    SPX_ASSIGN_OR_RETURN(s.high_freq_factor, r.get_double_or("high_freq_factor", 4.0));
    SPX_ASSIGN_OR_RETURN(s.original_max_position_embeddings,
                         r.get_int("original_max_position_embeddings"));
  } else if (type == "yarn") {
    s.type = RopeScalingType::kYarn;
    SPX_ASSIGN_OR_RETURN(s.beta_fast, r.get_double_or("beta_fast", 32.0));
    SPX_ASSIGN_OR_RETURN(s.beta_slow, r.get_double_or("beta_slow", 1.0));
    SPX_ASSIGN_OR_RETURN(s.attention_factor, r.get_double_or("attention_factor", 0.0));
    // transformers falls back to max_position_embeddings when the original length is absent.
    SPX_ASSIGN_OR_RETURN(s.original_max_position_embeddings,
                         r.get_int_or("original_max_position_embeddings", c->max_seq_len));
  } else {
    return unimplemented(source + ": field \"rope_scaling.rope_type\" = \"" + type +
                         "\" is not supported (supported: linear, llama3, yarn)");
  }
  return Status::ok();
}

Result<ModelConfig> parse_config_object(const json& j, const std::string& source) {
  if (!j.is_object()) return invalid_argument(source + ": top level is not a JSON object");
  ModelConfig c;
  SPX_ASSIGN_OR_RETURN(c.arch, parse_architecture(j, source));
  const ConfigReader r(j, source);
  SPX_ASSIGN_OR_RETURN(c.dim, r.get_int("hidden_size"));
  SPX_ASSIGN_OR_RETURN(c.hidden_dim, r.get_int("intermediate_size"));
  SPX_ASSIGN_OR_RETURN(c.n_layers, r.get_int("num_hidden_layers"));
  SPX_ASSIGN_OR_RETURN(c.n_heads, r.get_int("num_attention_heads"));
  SPX_ASSIGN_OR_RETURN(c.n_kv_heads, r.get_int_or("num_key_value_heads", c.n_heads));
  SPX_ASSIGN_OR_RETURN(c.vocab_size, r.get_int("vocab_size"));
  SPX_ASSIGN_OR_RETURN(c.max_seq_len, r.get_int("max_position_embeddings"));
  // Name the HF field for the common mistakes; validate() below covers the rest.
  for (auto [key, v] : {std::pair<const char*, int64_t>{"hidden_size", c.dim},
                        {"intermediate_size", c.hidden_dim},
                        {"num_hidden_layers", c.n_layers},
                        {"num_attention_heads", c.n_heads},
                        {"vocab_size", c.vocab_size},
                        {"max_position_embeddings", c.max_seq_len}}) {
    if (v <= 0) return r.bad(key, "= " + std::to_string(v) + " must be positive");
  }
  if (c.dim % c.n_heads != 0 && !r.has("head_dim")) {
    return r.bad("hidden_size", "= " + std::to_string(c.dim) +
                                    " is not a multiple of num_attention_heads = " +
                                    std::to_string(c.n_heads) + " and no head_dim is given");
  }
  if (c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0) {
    return r.bad("num_key_value_heads", "= " + std::to_string(c.n_kv_heads) +
                                            " must be positive and divide num_attention_heads = " +
                                            std::to_string(c.n_heads));
  }
  SPX_ASSIGN_OR_RETURN(c.head_dim, r.get_int_or("head_dim", c.dim / c.n_heads));
  if (c.head_dim <= 0 || c.head_dim % 2 != 0) {
    return r.bad("head_dim", "= " + std::to_string(c.head_dim) + " must be positive and even");
  }
  SPX_ASSIGN_OR_RETURN(c.rope_theta, r.get_double_or("rope_theta", 10000.0));
  double eps = 1e-6;  // the transformers default for all four families
  SPX_ASSIGN_OR_RETURN(eps, r.get_double_or("rms_norm_eps", eps));
  c.norm_eps = static_cast<float>(eps);
  SPX_ASSIGN_OR_RETURN(c.tie_embeddings, r.get_bool_or("tie_word_embeddings", false));
  SPX_ASSIGN_OR_RETURN(c.bos_token_id, r.get_token_id_or("bos_token_id", c.bos_token_id));
  SPX_ASSIGN_OR_RETURN(c.eos_token_id, r.get_token_id_or("eos_token_id", c.eos_token_id));
  c.rope_style = RopeStyle::kHalf;  // HF q/k layout pairs (i, i + head_dim/2)

  SPX_ASSIGN_OR_RETURN(std::string act, r.get_string_or("hidden_act", "silu"));
  if (act != "silu" && act != "swish") {
    return unimplemented(source + ": field \"hidden_act\" = \"" + act +
                         "\" is not supported (only silu)");
  }
  // Qwen2 always has q/k/v biases (no config switch); Llama/Mistral/Qwen3 can opt into biases
  // via attention_bias, which then also covers o_proj, which the engine has no slot for.
  SPX_ASSIGN_OR_RETURN(bool attention_bias, r.get_bool_or("attention_bias", false));
  if (c.arch == Architecture::kQwen2) {
    c.attention_bias = true;
  } else if (attention_bias) {
    return unimplemented(source + ": field \"attention_bias\" = true (o_proj bias) is not " +
                         "supported for " + std::string(architecture_name(c.arch)));
  }
  if (r.has("mlp_bias")) {
    SPX_ASSIGN_OR_RETURN(bool mlp_bias, r.get_bool_or("mlp_bias", false));
    if (mlp_bias) return unimplemented(source + ": field \"mlp_bias\" = true is not supported");
  }
  c.qk_norm = c.arch == Architecture::kQwen3;
  SPX_RETURN_IF_ERROR(parse_rope_scaling(j, &c, source));
  SPX_RETURN_IF_ERROR(c.validate(source));
  return c;
}

}  // namespace

Result<ModelConfig> parse_hf_config(std::string_view json_text, const std::string& source) {
  SPX_ASSIGN_OR_RETURN(json j, loader_internal::parse_json(json_text, source));
  try {
    return parse_config_object(j, source);
  } catch (const std::exception& e) {  // accessors are guarded; this is a last line of defence
    return invalid_argument(source + ": malformed config: " + e.what());
  }
}

}  // namespace specontext
