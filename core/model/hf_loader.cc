// Hugging Face model directories: config.json + model.safetensors, or a sharded
// model.safetensors.index.json whose weight_map names the shard holding each tensor.
#include <map>
#include <set>

#include "core/model/loader_internal.h"
#include "core/model/model_loader.h"
#include "core/model/safetensors.h"

namespace specontext {

namespace {

using loader_internal::shape_string;

struct Located {
  const SafetensorsFile* file = nullptr;
  const SafetensorsTensor* tensor = nullptr;
};

// All tensors of a checkpoint, wherever they live.
struct WeightSet {
  std::vector<std::shared_ptr<SafetensorsFile>> files;
  std::map<std::string, Located> by_name;
  std::string description;  // for "missing tensor" errors: the file(s) searched
};

Result<std::string> read_small_file(const std::string& path) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> f, MappedFile::open(path));
  return std::string(reinterpret_cast<const char*>(f->data()), f->size());
}

// Shard names come from the index file; keep them inside the model directory.
bool safe_relative_name(const std::string& name) {
  if (name.empty() || name.front() == '/') return false;
  size_t start = 0;
  while (start <= name.size()) {
    const size_t slash = name.find('/', start);
    const std::string part =
        name.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    if (part == "..") return false;
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return true;
}

Result<WeightSet> open_weights(const std::string& dir) {
  WeightSet w;
  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  if (loader_internal::is_regular_file(single)) {
    SPX_ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> f, SafetensorsFile::open(single));
    for (const SafetensorsTensor& t : f->tensors()) w.by_name[t.name] = {f.get(), &t};
    w.files.push_back(std::move(f));
    w.description = single;
    return w;
  }
  if (!loader_internal::is_regular_file(index)) {
    return not_found(dir + ": no model.safetensors or model.safetensors.index.json");
  }
  SPX_ASSIGN_OR_RETURN(std::string text, read_small_file(index));
  SPX_ASSIGN_OR_RETURN(nlohmann::json j, loader_internal::parse_json(text, index));
  auto wm = j.is_object() ? j.find("weight_map") : j.end();
  if (!j.is_object() || wm == j.end() || !wm->is_object()) {
    return invalid_argument(index + ": field \"weight_map\" missing or not an object");
  }
  std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it->is_string() || !safe_relative_name(it->get<std::string>())) {
      return invalid_argument(index + ": field \"weight_map\".\"" + it.key() +
                              "\" must name a shard file inside the model directory");
    }
    const std::string shard = it->get<std::string>();
    auto s = shards.find(shard);
    if (s == shards.end()) {
      SPX_ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> f,
                           SafetensorsFile::open(dir + "/" + shard));
      s = shards.emplace(shard, std::move(f)).first;
      w.files.push_back(s->second);
    }
    const SafetensorsTensor* t = s->second->find(it.key());
    if (t == nullptr) {
      return data_loss(s->second->source() + ": tensor \"" + it.key() + "\" listed in " + index +
                       " is missing from the shard");
    }
    w.by_name[it.key()] = {s->second.get(), t};
  }
  w.description = index;
  return w;
}

class HfBuilder {
 public:
  HfBuilder(const WeightSet& w, Model* model, const LoadOptions& opts)
      : w_(w), model_(model), opts_(opts) {}

  bool has(const std::string& name) const { return w_.by_name.count(name) != 0; }

  Result<Located> find(const std::string& name) const {
    auto it = w_.by_name.find(name);
    if (it == w_.by_name.end()) {
      return not_found(w_.description + ": missing tensor \"" + name + "\"");
    }
    return it->second;
  }

  Status check(const Located& l, const std::vector<int64_t>& shape) const {
    const SafetensorsTensor& t = *l.tensor;
    const std::string what = l.file->source() + ": tensor \"" + t.name + "\"";
    if (!t.supported ||
        (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16)) {
      return unimplemented(what + ": dtype " + t.dtype_name +
                           " is not supported (expected F32, F16 or BF16)");
    }
    if (t.shape != shape) {
      return invalid_argument(what + ": expected shape " + shape_string(shape) + ", got " +
                              shape_string(t.shape));
    }
    return Status::ok();
  }

  Status matrix(const std::string& name, int64_t rows, int64_t cols, WeightMatrix* out) {
    SPX_ASSIGN_OR_RETURN(Located l, find(name));
    SPX_RETURN_IF_ERROR(check(l, {rows, cols}));
    SPX_ASSIGN_OR_RETURN(
        *out, loader_internal::make_matrix(model_, l.tensor->dtype, l.tensor->data, rows, cols,
                                           opts_, l.file->source() + ": tensor \"" + name + "\""));
    return Status::ok();
  }

  Status vec(const std::string& name, int64_t n, Vec* out) {
    SPX_ASSIGN_OR_RETURN(Located l, find(name));
    SPX_RETURN_IF_ERROR(check(l, {n}));
    *out = loader_internal::to_f32_vec(l.tensor->dtype, l.tensor->data, static_cast<size_t>(n));
    return Status::ok();
  }

 private:
  const WeightSet& w_;
  Model* model_;
  LoadOptions opts_;
};

}  // namespace

const loader_internal::LayerTensorNames kHfLayerNames = {
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"};

Result<std::shared_ptr<Model>> load_hf_model(const std::string& dir, const LoadOptions& opts) {
  const std::string config_path = dir + "/config.json";
  SPX_ASSIGN_OR_RETURN(std::string config_text, read_small_file(config_path));
  SPX_ASSIGN_OR_RETURN(ModelConfig config, parse_hf_config(config_text, config_path));
  SPX_ASSIGN_OR_RETURN(WeightSet weights, open_weights(dir));

  auto model = std::make_shared<Model>();
  model->source = dir;
  model->format = "safetensors";
  for (const auto& f : weights.files) model->storage.push_back(f);  // keeps the maps alive
  ModelConfig& c = config;
  HfBuilder b(weights, model.get(), opts);

  SPX_RETURN_IF_ERROR(
      b.matrix("model.embed_tokens.weight", c.vocab_size, c.dim, &model->tok_embeddings));
  model->layers.resize(static_cast<size_t>(c.n_layers));
  for (int64_t i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = model->layers[static_cast<size_t>(i)];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    SPX_RETURN_IF_ERROR(loader_internal::load_layer(b, p, kHfLayerNames, c, l));
  }
  SPX_RETURN_IF_ERROR(b.vec("model.norm.weight", c.dim, &model->final_norm));
  // transformers ties the head to the embeddings when the config says so (any lm_head.weight in
  // the file is then ignored); a checkpoint without lm_head.weight can only mean tied.
  if (c.tie_embeddings || !b.has("lm_head.weight")) {
    c.tie_embeddings = true;
    model->lm_head = model->tok_embeddings;
  } else {
    SPX_RETURN_IF_ERROR(b.matrix("lm_head.weight", c.vocab_size, c.dim, &model->lm_head));
  }
  model->config = c;
  loader_internal::unify_weight_dtype(model.get());
  SPX_RETURN_IF_ERROR(model->validate());
  return model;
}

}  // namespace specontext
