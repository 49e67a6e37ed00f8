// GGUF models with general.architecture = "llama" (Llama, Mistral and llama2.c conversions),
// "qwen2" or "qwen3", as llama.cpp's convert_hf_to_gguf.py writes them, with weights in F32,
// F16, BF16 or any block type of core/model/ggml_quants.h (dequantised on load).
#include <map>
#include <optional>

#include "core/model/ggml_quants.h"
#include "core/model/gguf.h"
#include "core/model/loader_internal.h"
#include "core/model/model_loader.h"

namespace specontext {

namespace {

using loader_internal::shape_string;

// The plain float types the backends use as they are (F32, BF16) or convert (F16); nullopt for
// the rest, which matrix() dequantises when it can.
std::optional<DType> plain_float_dtype(uint32_t ggml_type) {
  switch (ggml_type) {
    case 0: return DType::kF32;
    case 1: return DType::kF16;
    case 30: return DType::kBF16;
    default: return std::nullopt;
  }
}

std::string ggml_type_name(uint32_t ggml_type) {
  const GgmlTypeInfo* info = ggml_type_info(ggml_type);
  return info != nullptr ? std::string(info->name) : std::to_string(ggml_type);
}

class GgufBuilder {
 public:
  GgufBuilder(const GgufFile& g, Model* model, const LoadOptions& opts)
      : g_(g), model_(model), opts_(opts) {}

  Result<const GgufTensorInfo*> find(const std::string& name) const {
    const GgufTensorInfo* t = g_.find_tensor(name);
    if (t == nullptr) return not_found(g_.source() + ": missing tensor \"" + name + "\"");
    return t;
  }

  // GGUF lists dims fastest-varying first, so a row-major [rows, cols] matrix has dims
  // [cols, rows].
  Status matrix(const std::string& name, int64_t rows, int64_t cols, WeightMatrix* out) {
    SPX_ASSIGN_OR_RETURN(const GgufTensorInfo* t, find(name));
    const std::vector<int64_t> want = {cols, rows};
    if (t->dims != want) {
      return invalid_argument(g_.source() + ": tensor \"" + name + "\": expected dims " +
                              shape_string(want) + " (row-major [" + std::to_string(rows) + ", " +
                              std::to_string(cols) + "]), got " + shape_string(t->dims));
    }
    const std::string what = g_.source() + ": tensor \"" + name + "\"";
    const std::optional<DType> block = ggml_block_dtype(t->ggml_type);
    if (const std::optional<DType> dt = plain_float_dtype(t->ggml_type)) {
      SPX_ASSIGN_OR_RETURN(*out, loader_internal::make_matrix(model_, *dt, t->data, rows, cols, opts_, what));
    } else if (block && opts_.keep_quantized) {
      SPX_ASSIGN_OR_RETURN(*out, loader_internal::make_block_matrix(*block, t->data, rows, cols, what));
    } else {
      SPX_ASSIGN_OR_RETURN(*out, loader_internal::make_dequantized_matrix(model_, t->ggml_type, t->data,
                                                                         rows, cols, opts_, what));
    }
    ++tensor_types_[ggml_type_name(t->ggml_type)];
    return Status::ok();
  }

  Status vec(const std::string& name, int64_t n, Vec* out) {
    SPX_ASSIGN_OR_RETURN(const GgufTensorInfo* t, find(name));
    if (t->dims != std::vector<int64_t>{n}) {
      return invalid_argument(g_.source() + ": tensor \"" + name + "\": expected dims [" +
                              std::to_string(n) + "], got " + shape_string(t->dims));
    }
    const std::optional<DType> dt = plain_float_dtype(t->ggml_type);
    if (!dt) {
      return unimplemented(g_.source() + ": tensor \"" + name + "\": ggml type " +
                           ggml_type_name(t->ggml_type) +
                           " is not supported for vectors (supported: F32, F16, BF16)");
    }
    *out = loader_internal::to_f32_vec(*dt, t->data, static_cast<size_t>(n));
    return Status::ok();
  }

  // How many matrices came in each ggml type, e.g. {"Q4_K": 96, "Q6_K": 33}.
  const std::map<std::string, int64_t>& tensor_types() const { return tensor_types_; }

 private:
  const GgufFile& g_;
  Model* model_;
  LoadOptions opts_;
  std::map<std::string, int64_t> tensor_types_;
};

Result<int64_t> int_or(const GgufFile& g, const std::string& key, int64_t def) {
  if (!g.has(key)) return def;
  return g.get_int(key);
}

Result<double> float_or(const GgufFile& g, const std::string& key, double def) {
  if (!g.has(key)) return def;
  return g.get_float(key);
}

// Token ids stored as uint32 use 0xFFFFFFFF for "none".
Result<int32_t> token_id_or(const GgufFile& g, const std::string& key, int32_t def) {
  if (!g.has(key)) return def;
  SPX_ASSIGN_OR_RETURN(int64_t v, g.get_int(key));
  if (v < 0 || v > INT32_MAX) return int32_t{-1};
  return static_cast<int32_t>(v);
}

Status parse_rope_scaling(const GgufFile& g, const std::string& a, ModelConfig* c) {
  const std::string type_key = a + ".rope.scaling.type";
  if (!g.has(type_key)) return Status::ok();
  SPX_ASSIGN_OR_RETURN(std::string type, g.get_string(type_key));
  RopeScaling& s = c->rope_scaling;
  if (type == "none") return Status::ok();
  SPX_ASSIGN_OR_RETURN(s.factor, float_or(g, a + ".rope.scaling.factor", 1.0));
  if (type == "linear") {
    s.type = RopeScalingType::kLinear;
  } else if (type == "yarn") {
    s.type = RopeScalingType::kYarn;
    SPX_ASSIGN_OR_RETURN(s.original_max_position_embeddings,
                         int_or(g, a + ".rope.scaling.original_context_length", c->max_seq_len));
    SPX_ASSIGN_OR_RETURN(s.attention_factor, float_or(g, a + ".rope.scaling.attn_factor", 0.0));
    SPX_ASSIGN_OR_RETURN(s.beta_fast, float_or(g, a + ".rope.scaling.yarn_beta_fast", s.beta_fast));
    SPX_ASSIGN_OR_RETURN(s.beta_slow, float_or(g, a + ".rope.scaling.yarn_beta_slow", s.beta_slow));
  } else {
    return unimplemented(g.source() + ": key \"" + type_key + "\" = \"" + type +
                         "\" is not supported (supported: none, linear, yarn)");
  }
  return Status::ok();
}

// What differs between the GGUF architectures we load; everything else (key names under the
// architecture's prefix, tensor names) is common to llama.cpp's llama, qwen2 and qwen3.
struct GgufArch {
  std::string_view name;
  Architecture arch;
  // llama.cpp's converter permutes a llama's q/k rows to (2i, 2i+1) pairs (LLAMA_ROPE_TYPE_NORM);
  // qwen2/qwen3 keep Hugging Face's rotate_half layout (LLAMA_ROPE_TYPE_NEOX).
  RopeStyle rope_style;
  bool qk_norm;  // blk.N.attn_q_norm / attn_k_norm (qwen3)
};

constexpr GgufArch kGgufArchs[] = {
    {"llama", Architecture::kLlama, RopeStyle::kInterleaved, false},
    {"qwen2", Architecture::kQwen2, RopeStyle::kHalf, false},
    {"qwen3", Architecture::kQwen3, RopeStyle::kHalf, true},
};

// Llama 3.1+ conversions store llama3 RoPE scaling as per-frequency divisors.
Status read_rope_freqs(const GgufFile& g, ModelConfig* c) {
  const GgufTensorInfo* t = g.find_tensor("rope_freqs.weight");
  if (t == nullptr) return Status::ok();
  const int64_t half = c->head_dim / 2;
  if (t->dims != std::vector<int64_t>{half}) {
    return invalid_argument(g.source() + ": tensor \"rope_freqs.weight\": expected dims [" +
                            std::to_string(half) + "] (head_dim / 2), got " + shape_string(t->dims));
  }
  const std::optional<DType> dt = plain_float_dtype(t->ggml_type);
  if (!dt) {
    return unimplemented(g.source() + ": tensor \"rope_freqs.weight\": ggml type " +
                         ggml_type_name(t->ggml_type) + " is not supported (supported: F32, F16, BF16)");
  }
  c->rope_freq_factors = loader_internal::to_f32_vec(*dt, t->data, static_cast<size_t>(half));
  return Status::ok();
}

}  // namespace

const loader_internal::LayerTensorNames kGgufLayerNames = {
    "attn_norm.weight",   "attn_q.weight",      "attn_k.weight",   "attn_v.weight", "attn_output.weight",
    "attn_q.bias",        "attn_k.bias",        "attn_v.bias",     "attn_q_norm.weight",
    "attn_k_norm.weight", "ffn_norm.weight",    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"};

Result<std::shared_ptr<Model>> load_gguf_model(const std::string& path, const LoadOptions& opts) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<GgufFile> g, GgufFile::open(path));
  SPX_ASSIGN_OR_RETURN(std::string arch_name, g->get_string("general.architecture"));
  const GgufArch* arch = nullptr;
  for (const GgufArch& candidate : kGgufArchs) {
    if (candidate.name == arch_name) arch = &candidate;
  }
  if (arch == nullptr) {
    return unimplemented(path + ": key \"general.architecture\" = \"" + arch_name +
                         "\" is not supported (supported: llama, qwen2, qwen3)");
  }
  const std::string a = arch_name;
  ModelConfig c;
  c.arch = arch->arch;
  c.rope_style = arch->rope_style;
  c.qk_norm = arch->qk_norm;
  SPX_ASSIGN_OR_RETURN(c.dim, g->get_int(a + ".embedding_length"));
  SPX_ASSIGN_OR_RETURN(c.hidden_dim, g->get_int(a + ".feed_forward_length"));
  SPX_ASSIGN_OR_RETURN(c.n_layers, g->get_int(a + ".block_count"));
  SPX_ASSIGN_OR_RETURN(c.n_heads, g->get_int(a + ".attention.head_count"));
  SPX_ASSIGN_OR_RETURN(c.n_kv_heads, int_or(*g, a + ".attention.head_count_kv", c.n_heads));
  SPX_ASSIGN_OR_RETURN(c.max_seq_len, g->get_int(a + ".context_length"));
  SPX_ASSIGN_OR_RETURN(c.rope_theta, float_or(*g, a + ".rope.freq_base", 10000.0));
  double eps = 1e-5;
  SPX_ASSIGN_OR_RETURN(eps, float_or(*g, a + ".attention.layer_norm_rms_epsilon", eps));
  c.norm_eps = static_cast<float>(eps);
  if (c.n_heads <= 0 || c.dim <= 0) {
    return invalid_argument(path + ": keys \"" + a + ".embedding_length\" / \"" + a +
                            ".attention.head_count\" must be positive");
  }
  SPX_ASSIGN_OR_RETURN(c.head_dim, int_or(*g, a + ".attention.key_length", c.dim / c.n_heads));
  SPX_ASSIGN_OR_RETURN(int64_t value_dim, int_or(*g, a + ".attention.value_length", c.head_dim));
  if (value_dim != c.head_dim) {
    return unimplemented(path + ": key \"" + a + ".attention.value_length\" = " +
                         std::to_string(value_dim) + " differs from the key length " +
                         std::to_string(c.head_dim));
  }
  SPX_ASSIGN_OR_RETURN(int64_t rot, int_or(*g, a + ".rope.dimension_count", c.head_dim));
  if (rot != c.head_dim) {
    return unimplemented(path + ": key \"" + a +
                         ".rope.dimension_count\" = " + std::to_string(rot) +
                         " (partial rotary) differs from head_dim " + std::to_string(c.head_dim));
  }
  SPX_RETURN_IF_ERROR(parse_rope_scaling(*g, a, &c));
  SPX_RETURN_IF_ERROR(read_rope_freqs(*g, &c));
  // Biases on q/k/v: always in qwen2 files, in a llama file only when its model had them.
  c.attention_bias = g->find_tensor("blk.0.attn_q.bias") != nullptr;
  if (g->find_tensor("blk.0.attn_output.bias") != nullptr) {
    return unimplemented(path + ": tensor \"blk.0.attn_output.bias\" (an output projection bias) "
                         "is not supported");
  }

  // The vocabulary size is the embedding's row count (dims [dim, vocab]).
  const GgufTensorInfo* emb = g->find_tensor("token_embd.weight");
  if (emb == nullptr) return not_found(path + ": missing tensor \"token_embd.weight\"");
  if (emb->dims.size() == 2) {
    c.vocab_size = emb->dims[1];
  } else if (g->has("tokenizer.ggml.tokens")) {
    SPX_ASSIGN_OR_RETURN(auto toks, g->get_string_array("tokenizer.ggml.tokens"));
    c.vocab_size = static_cast<int64_t>(toks.size());
  }
  SPX_ASSIGN_OR_RETURN(c.bos_token_id, token_id_or(*g, "tokenizer.ggml.bos_token_id", 1));
  SPX_ASSIGN_OR_RETURN(c.eos_token_id, token_id_or(*g, "tokenizer.ggml.eos_token_id", 2));
  c.tie_embeddings = g->find_tensor("output.weight") == nullptr;
  SPX_RETURN_IF_ERROR(c.validate(path));

  auto model = std::make_shared<Model>();
  model->config = c;
  model->source = path;
  model->format = "gguf";
  model->storage.push_back(g);  // owns the memory map
  GgufBuilder b(*g, model.get(), opts);
  SPX_RETURN_IF_ERROR(b.matrix("token_embd.weight", c.vocab_size, c.dim, &model->tok_embeddings));
  model->layers.resize(static_cast<size_t>(c.n_layers));
  for (int64_t i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = model->layers[static_cast<size_t>(i)];
    const std::string p = "blk." + std::to_string(i) + ".";
    SPX_RETURN_IF_ERROR(loader_internal::load_layer(b, p, kGgufLayerNames, c, l));
  }
  SPX_RETURN_IF_ERROR(b.vec("output_norm.weight", c.dim, &model->final_norm));
  if (c.tie_embeddings) {
    model->lm_head = model->tok_embeddings;
  } else {
    SPX_RETURN_IF_ERROR(b.matrix("output.weight", c.vocab_size, c.dim, &model->lm_head));
  }
  model->stored_types = b.tensor_types();
  loader_internal::unify_weight_dtype(model.get());
  SPX_RETURN_IF_ERROR(model->validate());
  return model;
}

}  // namespace specontext
