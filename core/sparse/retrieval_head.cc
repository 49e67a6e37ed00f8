// The SpeContext retrieval head: EAGLE-3 checkpoint loading and pruning, the q/k computation,
// the softmax scores that feed select_tokens, a writer and a random head for synthetic runs.
#include "core/sparse/retrieval_head.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/base/host_math.h"
#include "core/base/mapped_file.h"
#include "core/model/loader_internal.h"
#include "core/model/safetensors.h"
#include "core/model/torch_zip.h"

namespace specontext {

namespace {

constexpr const char* kFc = "fc.weight";
constexpr const char* kInputNorm = "midlayer.input_layernorm.weight";
constexpr const char* kHiddenNorm = "midlayer.hidden_norm.weight";
constexpr const char* kQProj = "midlayer.self_attn.q_proj.weight";
constexpr const char* kKProj = "midlayer.self_attn.k_proj.weight";
constexpr const char* kFormat = "specontext-retrieval-head";
constexpr double kEagleDefaultRopeTheta = 10000.0;

// Tensors of a full EAGLE-3 draft that the head does not need: counted, then dropped.
bool is_dropped_draft_tensor(const std::string& name) {
  static const char* const kNames[] = {
      "midlayer.self_attn.v_proj.weight",
      "midlayer.self_attn.o_proj.weight",
      "midlayer.mlp.gate_proj.weight",
      "midlayer.mlp.up_proj.weight",
      "midlayer.mlp.down_proj.weight",
      "midlayer.post_attention_layernorm.weight",
      "norm.weight",
      "lm_head.weight",
  };
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  return false;
}

// Everything else (d2t/t2d vocabulary maps, a copy of the target's embedding, rotary buffers)
// is ignored and not counted: d2t/t2d are index buffers, and the header defines
// draft_parameters without the embedding.

bool is_float(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

// An f32 copy of a tensor owned by head->storage.
WeightMatrix f32_matrix(RetrievalHead* head, const SafetensorsTensor& t, int64_t rows, int64_t cols) {
  auto buf = std::make_shared<std::vector<float>>(static_cast<size_t>(rows * cols));
  convert_to_f32(t.dtype, t.data, buf->data(), buf->size());
  head->storage.push_back(buf);
  WeightMatrix w;
  w.dtype = DType::kF32;
  w.rows = rows;
  w.cols = cols;
  w.data = buf->data();
  return w;
}

// Reads an integer / float field of config.json or of the safetensors metadata.
struct ConfigSource {
  const nlohmann::json* json = nullptr;                      // config.json (may be null)
  const std::map<std::string, std::string>* meta = nullptr;  // our own "__metadata__"

  bool get_int(const char* json_key, const char* meta_key, int64_t* out) const {
    if (json && json->is_object()) {
      auto it = json->find(json_key);
      if (it != json->end() && it->is_number_integer()) {
        *out = it->get<int64_t>();
        return true;
      }
    }
    if (meta) {
      auto it = meta->find(meta_key);
      if (it != meta->end()) {
        char* end = nullptr;
        const long long v = std::strtoll(it->second.c_str(), &end, 10);
        if (end && *end == '\0' && !it->second.empty()) {
          *out = v;
          return true;
        }
      }
    }
    return false;
  }
  bool get_double(const char* json_key, const char* meta_key, double* out) const {
    if (json && json->is_object()) {
      auto it = json->find(json_key);
      if (it != json->end() && it->is_number()) {
        *out = it->get<double>();
        return true;
      }
    }
    if (meta) {
      auto it = meta->find(meta_key);
      if (it != meta->end()) {
        char* end = nullptr;
        const double v = std::strtod(it->second.c_str(), &end);
        if (end && *end == '\0' && !it->second.empty()) {
          *out = v;
          return true;
        }
      }
    }
    return false;
  }
};

std::string human_count(int64_t n) {
  char buf[32];
  const double v = static_cast<double>(n);
  if (v >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.1fB", v / 1e9);
  } else if (v >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.1fM", v / 1e6);
  } else if (v >= 1e3) {
    std::snprintf(buf, sizeof buf, "%.1fK", v / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  }
  return buf;
}

// splitmix64: a portable generator, so random heads are identical on every platform.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double normal() {  // Box–Muller
    const double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

std::vector<float>* new_buffer(RetrievalHead* head, int64_t n) {
  auto buf = std::make_shared<std::vector<float>>(static_cast<size_t>(n), 0.0f);
  std::vector<float>* raw = buf.get();
  head->storage.push_back(std::move(buf));
  return raw;
}

WeightMatrix view(const std::vector<float>& buf, int64_t rows, int64_t cols) {
  WeightMatrix w;
  w.dtype = DType::kF32;
  w.rows = rows;
  w.cols = cols;
  w.data = buf.data();
  return w;
}

// A draft's tensors from either format it ships in: safetensors, or PyTorch's zip checkpoint
// (`pytorch_model.bin`, as official EAGLE-3 drafts are published), told apart by their first
// bytes. Both give SafetensorsTensor views into one memory map, so the rest of the loader is shared.
struct DraftFile {
  std::shared_ptr<MappedFile> map;
  std::shared_ptr<SafetensorsFile> safetensors;
  std::shared_ptr<TorchZipFile> torch;

  const std::vector<SafetensorsTensor>& tensors() const {
    return safetensors ? safetensors->tensors() : torch->tensors();
  }
  const SafetensorsTensor* find(const std::string& name) const {
    return safetensors ? safetensors->find(name) : torch->find(name);
  }
  // A torch checkpoint has no metadata of ours; config.json describes it.
  const std::map<std::string, std::string>& metadata() const {
    static const std::map<std::string, std::string> kNone;
    return safetensors ? safetensors->metadata() : kNone;
  }
};

Result<DraftFile> open_draft(const std::string& path) {
  DraftFile f;
  SPX_ASSIGN_OR_RETURN(f.map, MappedFile::open(path));
  const uint8_t* data = f.map->data();
  const size_t size = f.map->size();
  if (is_zip_magic(data, size) || is_legacy_torch_magic(data, size)) {
    SPX_ASSIGN_OR_RETURN(f.torch, TorchZipFile::parse(data, size, path));
  } else {
    SPX_ASSIGN_OR_RETURN(f.safetensors, SafetensorsFile::parse(data, size, path));
  }
  return f;
}

// The weights file of a draft directory: model.safetensors, else pytorch_model.bin.
Result<std::string> draft_weights_in(const std::string& dir) {
  for (const char* name : {"/model.safetensors", "/pytorch_model.bin"}) {
    if (loader_internal::is_regular_file(dir + name)) return dir + name;
  }
  return not_found(dir +
                   ": holds neither model.safetensors nor pytorch_model.bin (sharded checkpoints "
                   "are not read: merge the shards into one file)");
}

}  // namespace

std::array<int64_t, 3> eagle3_fused_layers(int64_t n_layers) {
  const int64_t last = std::max<int64_t>(n_layers - 1, 0);
  auto clamp = [last](int64_t i) { return std::clamp<int64_t>(i, 0, last); };
  return {clamp(2), clamp(n_layers / 2), clamp(n_layers - 3)};
}

RopeParams make_head_rope_params(const RetrievalHeadConfig& c, int64_t target_context) {
  ModelConfig m;
  m.head_dim = c.head_dim;
  m.rope_theta = c.rope_theta;
  m.rope_style = RopeStyle::kHalf;  // EAGLE-3 drafts are HF modules: rotate_half pairing
  m.max_seq_len = std::max(target_context, c.trained_context);
  if (c.trained_context > 0 && target_context > c.trained_context) {
    // Training-free extension beyond the draft's window (SpeContext §4.3 uses YaRN).
    m.rope_scaling.type = RopeScalingType::kYarn;
    m.rope_scaling.factor = static_cast<double>(target_context) / static_cast<double>(c.trained_context);
    m.rope_scaling.original_max_position_embeddings = c.trained_context;
    m.rope_scaling.beta_fast = 32.0;
    m.rope_scaling.beta_slow = 1.0;
  }
  return make_rope_params(m);
}

Status retrieval_inputs(Backend& backend, const RetrievalHead& head, const WeightMatrix& target_embeddings,
                        const TokenId* tokens, const float* fused_prev, int64_t n, float* x) {
  const RetrievalHeadConfig& c = head.config;
  const int64_t d = c.hidden;
  if (d <= 0 || head.fc.rows != d || head.fc.cols != 3 * d ||
      static_cast<int64_t>(head.input_norm.size()) != d ||
      static_cast<int64_t>(head.hidden_norm.size()) != d) {
    return invalid_argument("retrieval head: fc / norms do not match hidden size " + std::to_string(d));
  }
  if (target_embeddings.cols != d) {
    return invalid_argument("retrieval head: target embeddings have " +
                            std::to_string(target_embeddings.cols) + " columns, head hidden is " +
                            std::to_string(d));
  }
  if (n < 0) return invalid_argument("retrieval head: negative token count");
  if (n == 0) return Status::ok();
  std::vector<float> e(static_cast<size_t>(n * d)), h(static_cast<size_t>(n * d));
  SPX_RETURN_IF_ERROR(backend.embed(tokens, n, target_embeddings, e.data()));
  SPX_RETURN_IF_ERROR(backend.rmsnorm(e.data(), head.input_norm.data(), n, d, c.norm_eps, e.data()));
  SPX_RETURN_IF_ERROR(backend.matmul(fused_prev, n, head.fc, nullptr, h.data()));
  SPX_RETURN_IF_ERROR(backend.rmsnorm(h.data(), head.hidden_norm.data(), n, d, c.norm_eps, h.data()));
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(e.data() + i * d, d, x + i * 2 * d);
    std::copy_n(h.data() + i * d, d, x + i * 2 * d + d);
  }
  return Status::ok();
}

Status retrieval_qk(Backend& backend, const RetrievalHead& head, const RopeParams& rope,
                    const WeightMatrix& target_embeddings, const TokenId* tokens, const float* fused_prev,
                    const int64_t* positions, int64_t n, float* q, float* k) {
  const RetrievalHeadConfig& c = head.config;
  const int64_t d = c.hidden;
  if (head.wq.rows != c.n_heads * c.head_dim || head.wq.cols != 2 * d ||
      head.wk.rows != c.n_kv_heads * c.head_dim || head.wk.cols != 2 * d) {
    return invalid_argument("retrieval head: q/k projections do not match the head config");
  }
  if (rope.head_dim != c.head_dim) {
    return invalid_argument("retrieval head: RoPE head_dim " + std::to_string(rope.head_dim) +
                            " differs from the head's " + std::to_string(c.head_dim));
  }
  if (n == 0) return Status::ok();
  std::vector<float> x(static_cast<size_t>(std::max<int64_t>(n, 0) * 2 * d));
  SPX_RETURN_IF_ERROR(retrieval_inputs(backend, head, target_embeddings, tokens, fused_prev, n, x.data()));
  SPX_RETURN_IF_ERROR(backend.matmul(x.data(), n, head.wq, nullptr, q));
  SPX_RETURN_IF_ERROR(backend.matmul(x.data(), n, head.wk, nullptr, k));
  SPX_RETURN_IF_ERROR(backend.rope(q, n, c.n_heads, positions, rope));
  SPX_RETURN_IF_ERROR(backend.rope(k, n, c.n_kv_heads, positions, rope));
  return Status::ok();
}

void retrieval_scores(const RetrievalHead& head, const float* q, const float* k_cache, int64_t length,
                      float* scores) {
  const RetrievalHeadConfig& c = head.config;
  const int64_t hd = c.head_dim, nh = c.n_heads, nkv = c.n_kv_heads;
  if (length <= 0 || nh <= 0 || nkv <= 0) return;
  const void* table[1] = {k_cache};
  head_logits(q, table, DType::kF32, length, 0, length, length, nh, nkv, hd, scores);
  softmax_rows(scores, nh, length);
}

Result<std::shared_ptr<RetrievalHead>> load_eagle3_head(const std::string& path, const ModelConfig& target) {
  std::error_code ec;
  std::string weights_path = path;
  nlohmann::json config_json;
  bool have_config = false;
  std::string config_path;
  if (std::filesystem::is_directory(path, ec)) {
    SPX_ASSIGN_OR_RETURN(weights_path, draft_weights_in(path));
    config_path = path + "/config.json";
    if (loader_internal::is_regular_file(config_path)) {
      SPX_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> cf, MappedFile::open(config_path));
      SPX_ASSIGN_OR_RETURN(
          config_json,
          loader_internal::parse_json(std::string_view(reinterpret_cast<const char*>(cf->data()), cf->size()),
                                      config_path));
      if (!config_json.is_object()) return invalid_argument(config_path + ": not a JSON object");
      have_config = true;
    }
  }
  SPX_ASSIGN_OR_RETURN(const DraftFile draft_file, open_draft(weights_path));
  const DraftFile* file = &draft_file;
  const std::string& src = weights_path;

  auto head = std::make_shared<RetrievalHead>();
  RetrievalHeadConfig& c = head->config;
  // Only our own writer's metadata is read as a head config; other files' metadata is free-form.
  const auto fmt = file->metadata().find("format");
  const bool ours = fmt != file->metadata().end() && fmt->second == kFormat;
  const ConfigSource cfg{have_config ? &config_json : nullptr, ours ? &file->metadata() : nullptr};
  const std::string cfg_name = have_config ? config_path : src + " __metadata__";

  // ---- required tensors ----
  auto require = [&](const char* name) -> Result<const SafetensorsTensor*> {
    const SafetensorsTensor* t = file->find(name);
    if (t == nullptr) {
      return not_found(src + ": EAGLE-3 tensor '" + std::string(name) + "' is missing");
    }
    if (!t->supported || !is_float(t->dtype)) {
      return unimplemented(src + ": tensor '" + std::string(name) + "' has dtype " + t->dtype_name +
                           " (F32, F16 or BF16 expected)");
    }
    if (t->shape.size() != 2 && t->shape.size() != 1) {
      return invalid_argument(src + ": tensor '" + std::string(name) + "' has shape " +
                              loader_internal::shape_string(t->shape));
    }
    return t;
  };
  SPX_ASSIGN_OR_RETURN(const SafetensorsTensor* fc, require(kFc));
  SPX_ASSIGN_OR_RETURN(const SafetensorsTensor* in_norm, require(kInputNorm));
  SPX_ASSIGN_OR_RETURN(const SafetensorsTensor* hid_norm, require(kHiddenNorm));
  SPX_ASSIGN_OR_RETURN(const SafetensorsTensor* wq, require(kQProj));
  SPX_ASSIGN_OR_RETURN(const SafetensorsTensor* wk, require(kKProj));

  // ---- hidden size: the fused features and the embedding are the target's ----
  const int64_t d = target.dim;
  if (d <= 0) return invalid_argument(src + ": the target model has no hidden size");
  int64_t cfg_hidden = 0;
  if (cfg.get_int("hidden_size", "hidden", &cfg_hidden) && cfg_hidden != d) {
    return invalid_argument(cfg_name + ": hidden_size " + std::to_string(cfg_hidden) +
                            " differs from the target's hidden size " + std::to_string(d));
  }
  if (fc->shape != std::vector<int64_t>{d, 3 * d}) {
    return invalid_argument(src + ": " + kFc + " has shape " + loader_internal::shape_string(fc->shape) +
                            ", expected [" + std::to_string(d) + ", " + std::to_string(3 * d) +
                            "] for a target of hidden size " + std::to_string(d));
  }
  for (const SafetensorsTensor* t : {in_norm, hid_norm}) {
    if (t->shape != std::vector<int64_t>{d}) {
      return invalid_argument(src + ": " + t->name + " has shape " + loader_internal::shape_string(t->shape) +
                              ", expected [" + std::to_string(d) + "]");
    }
  }
  for (const SafetensorsTensor* t : {wq, wk}) {
    if (t->shape.size() != 2 || t->shape[1] != 2 * d || t->shape[0] <= 0) {
      return invalid_argument(src + ": " + t->name + " has shape " + loader_internal::shape_string(t->shape) +
                              ", expected [rows, " + std::to_string(2 * d) +
                              "] (input is embedding ⊕ fused hidden)");
    }
  }

  // ---- head geometry ----
  const int64_t q_rows = wq->shape[0], k_rows = wk->shape[0];
  int64_t head_dim = 0, n_heads_cfg = 0;
  const bool have_heads = cfg.get_int("num_attention_heads", "n_heads", &n_heads_cfg);
  if (!cfg.get_int("head_dim", "head_dim", &head_dim)) {
    if (have_heads && n_heads_cfg > 0) {
      int64_t hidden_cfg = d;
      cfg.get_int("hidden_size", "hidden", &hidden_cfg);
      head_dim = hidden_cfg / n_heads_cfg;
    } else if (target.n_heads > 0) {
      head_dim = q_rows / target.n_heads;
    }
  }
  if (head_dim <= 0 || head_dim % 2 != 0 || q_rows % head_dim != 0 || k_rows % head_dim != 0) {
    return invalid_argument(src + ": cannot infer an even head_dim from " + kQProj + " " +
                            loader_internal::shape_string(wq->shape) + " and " + kKProj + " " +
                            loader_internal::shape_string(wk->shape) + " (head_dim " +
                            std::to_string(head_dim) + ")");
  }
  c.hidden = d;
  c.head_dim = head_dim;
  c.n_heads = q_rows / head_dim;
  c.n_kv_heads = k_rows / head_dim;
  if (have_heads && n_heads_cfg != c.n_heads) {
    return invalid_argument(cfg_name + ": num_attention_heads " + std::to_string(n_heads_cfg) +
                            " does not match " + kQProj + " rows " + std::to_string(q_rows) + " / head_dim " +
                            std::to_string(head_dim));
  }
  if (c.n_kv_heads != target.n_kv_heads) {
    return invalid_argument(src + ": " + kKProj + " gives num_key_value_heads " +
                            std::to_string(c.n_kv_heads) + " but the target has " +
                            std::to_string(target.n_kv_heads) +
                            " KV heads (selection is per target KV head, they must match)");
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return invalid_argument(src + ": " + std::to_string(c.n_heads) + " query heads are not a multiple of " +
                            std::to_string(c.n_kv_heads) + " KV heads");
  }
  int64_t kv_cfg = 0;
  if (cfg.get_int("num_key_value_heads", "n_kv_heads", &kv_cfg) && kv_cfg != c.n_kv_heads) {
    return invalid_argument(cfg_name + ": num_key_value_heads " + std::to_string(kv_cfg) + " but " + kKProj +
                            " holds " + std::to_string(c.n_kv_heads) + " heads of " +
                            std::to_string(head_dim));
  }
  // EAGLE builds its rotary embedding with base 10000 when the draft's config names no rope_theta
  // (whatever the target's base is), so the head's keys were trained with it.
  c.rope_theta = kEagleDefaultRopeTheta;
  if (!cfg.get_double("rope_theta", "rope_theta", &c.rope_theta) && target.rope_theta != kEagleDefaultRopeTheta) {
    char note[200];
    std::snprintf(note, sizeof note,
                  "the draft names no rope_theta: its RoPE base is 10000, EAGLE's default, not the target's %.9g",
                  target.rope_theta);
    head->load_note = note;
  }
  c.trained_context = 2048;
  cfg.get_int("max_position_embeddings", "trained_context", &c.trained_context);
  double eps = target.norm_eps;
  cfg.get_double("rms_norm_eps", "norm_eps", &eps);
  c.norm_eps = static_cast<float>(eps);
  c.fused_layers = eagle3_fused_layers(target.n_layers);
  if (ours) {
    const auto sg = file->metadata().find("select_group");
    if (sg != file->metadata().end()) {
      if (sg->second == "turns") {
        c.select_group = GroupReduce::kTurns;
      } else if (sg->second != "max") {
        return invalid_argument(cfg_name + ": select_group is \"" + sg->second + "\"; expected \"max\" or \"turns\"");
      }
    }
  }
  if (c.rope_theta <= 0 || c.trained_context <= 0) {
    return invalid_argument(cfg_name + ": rope_theta and max_position_embeddings must be positive");
  }

  // ---- weights (f32 copies: heads are small) ----
  head->fc = f32_matrix(head.get(), *fc, d, 3 * d);
  head->wq = f32_matrix(head.get(), *wq, q_rows, 2 * d);
  head->wk = f32_matrix(head.get(), *wk, k_rows, 2 * d);
  head->input_norm = loader_internal::to_f32_vec(in_norm->dtype, in_norm->data, static_cast<size_t>(d));
  head->hidden_norm = loader_internal::to_f32_vec(hid_norm->dtype, hid_norm->data, static_cast<size_t>(d));

  // ---- parameter counts ----
  head->kept_parameters = fc->numel() + in_norm->numel() + hid_norm->numel() + wq->numel() + wk->numel();
  int64_t draft = head->kept_parameters;
  for (const SafetensorsTensor& t : file->tensors()) {
    if (is_dropped_draft_tensor(t.name)) draft += t.numel();
  }
  // A head written by write_retrieval_head no longer holds the dropped tensors: it records
  // the draft's size in its metadata.
  int64_t recorded = 0;
  const ConfigSource meta_only{nullptr, ours ? &file->metadata() : nullptr};
  if (meta_only.get_int("", "draft_parameters", &recorded)) draft = std::max(draft, recorded);
  head->draft_parameters = draft;
  return head;
}

Status select_by_turns(Backend& backend, const RetrievalHeadConfig& c, const float* hq,
                       const void* const* k_blocks, DType k_dtype, int64_t block_tokens, int64_t length,
                       const SelectionOptions& options, float* scratch, Selection& out) {
  const int64_t group = c.n_heads / c.n_kv_heads, hd = c.head_dim;
  const size_t s_bytes = static_cast<size_t>(c.n_kv_heads * length) * sizeof(float);
  float* sj = scratch;                          // [n_kv_heads][length]: one query head of each group
  float* qj = scratch + c.n_kv_heads * length;  // [n_kv_heads][head_dim]: its rows of hq
  std::vector<float> per_head(static_cast<size_t>(c.n_heads * length)), part(static_cast<size_t>(c.n_kv_heads * length));
  for (int64_t j = 0; j < group; ++j) {
    // Query head j of every group: rows g·group + j of hq, one per KV head.
    SPX_RETURN_IF_ERROR(backend.copy_rows(qj, static_cast<size_t>(hd) * sizeof(float), hq + j * hd,
                                          static_cast<size_t>(group * hd) * sizeof(float),
                                          static_cast<size_t>(hd) * sizeof(float), c.n_kv_heads));
    SPX_RETURN_IF_ERROR(
        backend.retrieval_group_scores(qj, k_blocks, k_dtype, block_tokens, length, c.n_kv_heads, c.n_kv_heads, hd, sj));
    SPX_RETURN_IF_ERROR(backend.download(part.data(), sj, s_bytes));
    for (int64_t g = 0; g < c.n_kv_heads; ++g) {
      std::copy_n(part.data() + g * length, length, per_head.data() + (g * group + j) * length);
    }
  }
  std::vector<float> group_scores;
  reduce_group_scores(per_head, c.n_heads, c.n_kv_heads, length, options, c.select_group, group_scores);
  select_from_group_scores(group_scores, c.n_kv_heads, length, options, out);
  return Status::ok();
}

int64_t select_by_turns_scratch_floats(const RetrievalHeadConfig& c, int64_t length) {
  return c.n_kv_heads * (length + c.head_dim);
}

Status write_retrieval_head(const std::string& path, const RetrievalHead& head) {
  const RetrievalHeadConfig& c = head.config;
  const int64_t d = c.hidden;
  if (head.fc.empty() || head.wq.empty() || head.wk.empty() ||
      static_cast<int64_t>(head.input_norm.size()) != d ||
      static_cast<int64_t>(head.hidden_norm.size()) != d) {
    return invalid_argument(path + ": retrieval head is incomplete, nothing written");
  }
  std::vector<NamedTensor> tensors = {
      {kFc, head.fc.dtype, {head.fc.rows, head.fc.cols}, head.fc.data},
      {kInputNorm, DType::kF32, {d}, head.input_norm.data()},
      {kHiddenNorm, DType::kF32, {d}, head.hidden_norm.data()},
      {kQProj, head.wq.dtype, {head.wq.rows, head.wq.cols}, head.wq.data},
      {kKProj, head.wk.dtype, {head.wk.rows, head.wk.cols}, head.wk.data},
  };
  char eps[32], theta[32];
  std::snprintf(eps, sizeof eps, "%.9g", static_cast<double>(c.norm_eps));
  std::snprintf(theta, sizeof theta, "%.17g", c.rope_theta);
  std::map<std::string, std::string> meta = {
      {"format", kFormat},
      {"hidden", std::to_string(c.hidden)},
      {"n_heads", std::to_string(c.n_heads)},
      {"n_kv_heads", std::to_string(c.n_kv_heads)},
      {"head_dim", std::to_string(c.head_dim)},
      {"rope_theta", theta},
      {"trained_context", std::to_string(c.trained_context)},
      {"norm_eps", eps},
      {"fused_layers", std::to_string(c.fused_layers[0]) + "," + std::to_string(c.fused_layers[1]) + "," +
                           std::to_string(c.fused_layers[2])},
      {"draft_parameters", std::to_string(head.draft_parameters)},
      {"kept_parameters", std::to_string(head.kept_parameters)},
      {"select_group", c.select_group == GroupReduce::kTurns ? "turns" : "max"},
  };
  return write_safetensors(path, tensors, meta);
}

Result<std::shared_ptr<RetrievalHead>> make_random_head(const ModelConfig& target, uint64_t seed) {
  const int64_t d = target.dim;
  if (d <= 0 || target.n_heads <= 0 || target.n_kv_heads <= 0 || target.head_dim <= 0 ||
      target.head_dim % 2 != 0 || target.n_heads % target.n_kv_heads != 0) {
    return invalid_argument("make_random_head: the target config has no usable attention shape");
  }
  auto head = std::make_shared<RetrievalHead>();
  RetrievalHeadConfig& c = head->config;
  c.hidden = d;
  c.n_heads = target.n_heads;
  c.n_kv_heads = target.n_kv_heads;
  c.head_dim = target.head_dim;
  c.rope_theta = target.rope_theta;
  c.trained_context = 2048;
  c.norm_eps = target.norm_eps;
  c.fused_layers = eagle3_fused_layers(target.n_layers);

  Rng rng{seed * 0x2545f4914f6cdd1dull + 0x1234567ull};
  // fc starts as the mean of the three tapped hidden states, plus a little noise.
  std::vector<float>* fc = new_buffer(head.get(), d * 3 * d);
  for (int64_t r = 0; r < d; ++r) {
    for (int64_t col = 0; col < 3 * d; ++col) {
      float v = static_cast<float>(1e-3 * rng.normal());
      if (col % d == r) v += 1.0f / 3.0f;
      (*fc)[static_cast<size_t>(r * 3 * d + col)] = v;
    }
  }
  head->fc = view(*fc, d, 3 * d);
  head->input_norm.assign(static_cast<size_t>(d), 1.0f);
  head->hidden_norm.assign(static_cast<size_t>(d), 1.0f);
  const double scale = 1.0 / std::sqrt(2.0 * static_cast<double>(d));
  const int64_t qd = c.n_heads * c.head_dim, kd = c.n_kv_heads * c.head_dim;
  std::vector<float>* wq = new_buffer(head.get(), qd * 2 * d);
  for (float& v : *wq) v = static_cast<float>(scale * rng.normal());
  std::vector<float>* wk = new_buffer(head.get(), kd * 2 * d);
  for (float& v : *wk) v = static_cast<float>(scale * rng.normal());
  head->wq = view(*wq, qd, 2 * d);
  head->wk = view(*wk, kd, 2 * d);

  head->kept_parameters = 3 * d * d + 2 * d + qd * 2 * d + kd * 2 * d;
  // What a full EAGLE-3 draft of this shape holds (embedding excluded): q, k, v, o, the MLP at
  // the target's intermediate size, fc, four norms and an LM head over the target vocabulary.
  const int64_t draft = qd * 2 * d + kd * 2 * d + kd * 2 * d + d * qd + 3 * d * target.hidden_dim +
                        3 * d * d + 4 * d + target.vocab_size * d;
  head->draft_parameters = draft;
  return head;
}

std::string pruning_report(const RetrievalHead& head) {
  const double pruned = head.draft_parameters > 0
                            ? 100.0 * (1.0 - static_cast<double>(head.kept_parameters) /
                                                 static_cast<double>(head.draft_parameters))
                            : 0.0;
  char pct[32];
  std::snprintf(pct, sizeof pct, "%.1f%%", pruned);
  return "retrieval head keeps " + human_count(head.kept_parameters) + " of " +
         human_count(head.draft_parameters) + " draft parameters (" + pct + " pruned)";
}

}  // namespace specontext
