#include "core/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <unordered_set>

#include "core/model/model_loader.h"

namespace specontext {

namespace {

std::string tier_name(TierKind kind, int32_t index) {
  return kind == TierKind::kDevice ? std::string("device") : std::string(tier_kind_name(kind)) + std::to_string(index);
}

}  // namespace

std::string_view sparse_method_name(SparseMethod m) {
  switch (m) {
    case SparseMethod::kDense: return "dense";
    case SparseMethod::kSpeContext: return "specontext";
    case SparseMethod::kStreaming: return "streaming";
    case SparseMethod::kQuest: return "quest";
    case SparseMethod::kOracle: return "oracle";
  }
  return "?";
}

Result<SparseMethod> parse_sparse_method(std::string_view name) {
  for (SparseMethod m : {SparseMethod::kDense, SparseMethod::kSpeContext, SparseMethod::kStreaming,
                         SparseMethod::kQuest, SparseMethod::kOracle}) {
    if (name == sparse_method_name(m)) return m;
  }
  return invalid_argument("unknown sparse method '" + std::string(name) +
                          "' (dense, specontext, streaming, quest, oracle)");
}

TierTraffic& TierTraffic::operator+=(const TierTraffic& o) {
  bytes_in += o.bytes_in;
  bytes_out += o.bytes_out;
  tokens_loaded += o.tokens_loaded;
  tokens_hit += o.tokens_hit;
  return *this;
}

Result<std::shared_ptr<const Model>> fit_weights_to_backend(std::shared_ptr<const Model> model,
                                                            const Backend& backend) {
  auto runs = [&](DType t) {
    return backend.supports(BackendOp::kEmbed, t) && backend.supports(BackendOp::kMatmul, t);
  };
  const DType to = model->weight_dtype;
  SPX_ASSIGN_OR_RETURN(model, dequantize_block_matrices(std::move(model), to, runs));
  for (const auto& [dtype, count] : model->held_types()) {
    if (!runs(dtype)) {
      return unimplemented("backend " + std::string(backend.name()) + " does not support " +
                           std::string(dtype_name(dtype)) + " weights");
    }
  }
  return model;
}

Result<std::unique_ptr<Engine>> Engine::create(std::shared_ptr<const Model> model,
                                               std::shared_ptr<Backend> backend,
                                               const EngineOptions& options) {
  if (!model || !backend) return invalid_argument("Engine::create: model and backend are required");
  SPX_RETURN_IF_ERROR(model->validate());
  SPX_ASSIGN_OR_RETURN(model, fit_weights_to_backend(std::move(model), *backend));
  const ModelConfig& c = model->config;
  if (options.max_sequences <= 0) return invalid_argument("max_sequences must be positive");
  if (options.max_running < 0 || options.max_running > options.max_sequences) {
    return invalid_argument("max_running must be in [0, max_sequences]");
  }
  if (options.page_size <= 0) return invalid_argument("page_size must be positive");
  if (!is_kv_dtype(options.kv_dtype)) {
    return invalid_argument("kv_dtype must be f32, f16 or bf16, got " + std::string(dtype_name(options.kv_dtype)));
  }
  std::unique_ptr<Engine> e(new Engine());
  e->model_ = std::move(model);
  e->backend_ = std::move(backend);
  e->options_ = options;
  e->max_context_ = options.max_context > 0 ? options.max_context : c.max_seq_len;
  if (e->max_context_ <= 0) return invalid_argument("model has no max_seq_len; set max_context");
  e->rope_ = make_rope_params(c);
  e->fused_layers_ = eagle3_fused_layers(c.n_layers);
  if (options.tiering.staging_layers < 1) {
    return invalid_argument("tiering.staging_layers must be at least 1, got " +
                            std::to_string(options.tiering.staging_layers));
  }
  const SparseOptions& sp = options.sparse;
  if (sp.method != SparseMethod::kDense) {
    if (sp.selection.budget < 1) return invalid_argument("sparse budget must be at least 1");
    if (sp.selection.window < 1) {
      return invalid_argument("sparse window must be at least 1 (the current token attends to itself)");
    }
    if (sp.selection.sinks < 0) return invalid_argument("sparse sinks must be >= 0");
    if (sp.quest_page_size < 1) return invalid_argument("quest page size must be positive");
    for (BackendOp op : {BackendOp::kKvGather, BackendOp::kAttentionSparse, BackendOp::kAttentionIndexed}) {
      if (!e->backend_->supports(op, e->model_->weight_dtype)) {
        return unimplemented("backend " + std::string(e->backend_->name()) + " has no sparse decode ops");
      }
    }
    if (sp.method == SparseMethod::kOracle && e->backend_->memory_kind() != MemoryKind::kHost) {
      return unimplemented("sparse method oracle reads the KV cache on the host; backend " +
                           std::string(e->backend_->name()) + " keeps it in device memory");
    }
  }
  if (sp.method == SparseMethod::kSpeContext) {
    const auto& head = options.retrieval_head;
    if (!head) return invalid_argument("sparse method specontext needs a retrieval head");
    if (head->config.hidden != c.dim || head->config.n_kv_heads != c.n_kv_heads) {
      return invalid_argument("retrieval head (hidden " + std::to_string(head->config.hidden) + ", kv heads " +
                              std::to_string(head->config.n_kv_heads) + ") does not fit the model (hidden " +
                              std::to_string(c.dim) + ", kv heads " + std::to_string(c.n_kv_heads) + ")");
    }
    e->fused_layers_ = head->config.fused_layers;
    e->head_rope_ = make_head_rope_params(head->config, e->max_context_);
  }
  SPX_RETURN_IF_ERROR(e->backend_->place_weights(*e->model_));
  SPX_RETURN_IF_ERROR(e->import_weights());
  SPX_RETURN_IF_ERROR(e->setup_tiers());
  return e;
}

Status Engine::import_weights() {
  Backend& be = *backend_;
  auto matrix = [&](const WeightMatrix& w) -> Result<WeightMatrix> {
    WeightMatrix d = w;
    if (!w.empty()) {
      SPX_ASSIGN_OR_RETURN(d.data, be.import_weights(w.data, w.bytes()));
    }
    return d;
  };
  auto vec = [&](const Vec& v) -> Result<const float*> {
    if (v.empty()) return static_cast<const float*>(nullptr);
    SPX_ASSIGN_OR_RETURN(const void* p, be.import_weights(v.data(), v.size() * sizeof(float)));
    return static_cast<const float*>(p);
  };
  const Model& m = *model_;
  SPX_ASSIGN_OR_RETURN(tok_embeddings_, matrix(m.tok_embeddings));
  SPX_ASSIGN_OR_RETURN(lm_head_, matrix(m.lm_head));
  SPX_ASSIGN_OR_RETURN(final_norm_, vec(m.final_norm));
  layer_ptrs_.resize(m.layers.size());
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const LayerWeights& w = m.layers[l];
    LayerPtrs& p = layer_ptrs_[l];
    SPX_ASSIGN_OR_RETURN(p.attn_norm, vec(w.attn_norm));
    SPX_ASSIGN_OR_RETURN(p.ffn_norm, vec(w.ffn_norm));
    SPX_ASSIGN_OR_RETURN(p.bq, vec(w.bq));
    SPX_ASSIGN_OR_RETURN(p.bk, vec(w.bk));
    SPX_ASSIGN_OR_RETURN(p.bv, vec(w.bv));
    SPX_ASSIGN_OR_RETURN(p.q_norm, vec(w.q_norm));
    SPX_ASSIGN_OR_RETURN(p.k_norm, vec(w.k_norm));
    SPX_ASSIGN_OR_RETURN(p.wq, matrix(w.wq));
    SPX_ASSIGN_OR_RETURN(p.wk, matrix(w.wk));
    SPX_ASSIGN_OR_RETURN(p.wv, matrix(w.wv));
    SPX_ASSIGN_OR_RETURN(p.wo, matrix(w.wo));
    SPX_ASSIGN_OR_RETURN(p.w_gate, matrix(w.w_gate));
    SPX_ASSIGN_OR_RETURN(p.w_up, matrix(w.w_up));
    SPX_ASSIGN_OR_RETURN(p.w_down, matrix(w.w_down));
  }
  if (options_.sparse.method == SparseMethod::kSpeContext) {
    const RetrievalHead& h = *options_.retrieval_head;
    SPX_ASSIGN_OR_RETURN(head_fc_, matrix(h.fc));
    SPX_ASSIGN_OR_RETURN(head_wq_, matrix(h.wq));
    SPX_ASSIGN_OR_RETURN(head_wk_, matrix(h.wk));
    SPX_ASSIGN_OR_RETURN(head_input_norm_, vec(h.input_norm));
    SPX_ASSIGN_OR_RETURN(head_hidden_norm_, vec(h.hidden_norm));
  }
  return Status::ok();
}

uint64_t Engine::all_device_bytes(const ModelConfig& c, const EngineOptions& o) {
  const int64_t max_context = o.max_context > 0 ? o.max_context : c.max_seq_len;
  const int64_t pages_per_seq = (max_context + o.page_size - 1) / o.page_size;
  const int64_t running = o.running_slots(), waiting = o.max_sequences - running;
  const int64_t n_pages = o.kv_pages > 0 ? o.kv_pages : pages_per_seq * running;
  const uint64_t page_bytes = 2 * static_cast<uint64_t>(o.page_size * c.kv_dim()) * dtype_size(o.kv_dtype);
  const uint64_t chunk_pages = static_cast<uint64_t>(
      o.kv_chunk_pages > 0 ? std::min(o.kv_chunk_pages, n_pages) : KvStore::default_chunk_pages(page_bytes, n_pages));
  const uint64_t chunks = (static_cast<uint64_t>(n_pages) + chunk_pages - 1) / chunk_pages;
  uint64_t bytes = static_cast<uint64_t>(c.n_layers) * chunks * chunk_pages * page_bytes;
  uint64_t allocations = static_cast<uint64_t>(c.n_layers) * chunks;
  const int64_t budget = o.sparse.selection.budget;
  if (o.sparse.method != SparseMethod::kDense) {
    const uint64_t ws = static_cast<uint64_t>(c.n_kv_heads * budget * c.head_dim) * dtype_size(o.kv_dtype);
    bytes += static_cast<uint64_t>(running * c.n_layers) * 2 * ws;
    allocations += static_cast<uint64_t>(running * c.n_layers) * 2;
  }
  if (o.sparse.method == SparseMethod::kSpeContext && o.retrieval_head) {
    // The head's key blocks: `budget` tokens each, in the KV dtype (head_block_bytes).
    const auto& hc = o.retrieval_head->config;
    // Waiting sequences hold tokens of the same pool: a partly filled block each beyond it.
    const int64_t blocks = running * ((max_context + budget - 1) / budget) + waiting;
    bytes += static_cast<uint64_t>(blocks) * static_cast<uint64_t>(budget * hc.n_kv_heads * hc.head_dim) *
             dtype_size(o.kv_dtype);
    allocations += static_cast<uint64_t>(blocks);
  }
  return bytes + allocations * 256 + (uint64_t{1} << 20);  // alignment slack per allocation
}

Status Engine::setup_tiers() {
  const ModelConfig& c = config();
  const TieringOptions& t = options_.tiering;
  const int64_t pages_per_seq = (max_context_ + options_.page_size - 1) / options_.page_size;
  const int64_t n_pages =
      options_.kv_pages > 0 ? options_.kv_pages : pages_per_seq * options_.running_slots();
  const bool tiered = !t.host.empty() || !t.remote.empty();
  if (tiered && (t.transport == nullptr || !t.copies)) {
    return invalid_argument("KV tiers: host or remote tiers need a transport and a copy queue");
  }
  if (!tiered && t.policy) return invalid_argument("KV tiers: a placement policy needs host or remote tiers");

  // The device tier: KV pages, working sets, staging and the head's keys. By default enough for
  // every sequence at max_context (what an all-device engine needs).
  const uint64_t device_bytes = t.device_bytes > 0 ? t.device_bytes : all_device_bytes(c, options_);
  SPX_ASSIGN_OR_RETURN(device_region_, backend_->allocate(device_bytes));

  std::vector<TierMemory> tiers;
  TierMemory dev;
  dev.desc.id = TierId(0);
  dev.desc.kind = TierKind::kDevice;
  dev.desc.name = "device";
  dev.desc.memory = backend_->memory_kind();
  dev.desc.capacity_bytes = device_bytes;
  dev.base = device_region_.get();
  dev.owner = device_region_;
  tiers.push_back(dev);
  auto add = [&](const TierMemory& m, TierKind kind) -> Status {
    TierMemory tm = m;
    tm.desc.id = TierId(static_cast<int32_t>(tiers.size()));
    tm.desc.kind = kind;
    if (tm.desc.name.empty()) tm.desc.name = tier_name(kind, tm.desc.index);
    if (kind == TierKind::kRemote) {
      tm.desc.memory = MemoryKind::kRemote;
      tm.base = nullptr;
    } else if (tm.base == nullptr || (tm.desc.memory != MemoryKind::kHost && tm.desc.memory != MemoryKind::kPinnedHost)) {
      return invalid_argument("KV tiers: host pool " + tm.desc.name + " needs host memory (kHost or kPinnedHost)");
    }
    if (tm.desc.capacity_bytes == 0) return invalid_argument("KV tiers: tier " + tm.desc.name + " has no capacity");
    tiers.push_back(std::move(tm));
    return Status::ok();
  };
  for (const TierMemory& h : t.host) SPX_RETURN_IF_ERROR(add(h, TierKind::kHost));
  for (const TierMemory& r : t.remote) SPX_RETURN_IF_ERROR(add(r, TierKind::kRemote));
  std::shared_ptr<void> bounce;
  TierId bounce_tier;
  if (tiered) {
    for (const TierMemory& tm : tiers) {
      SPX_RETURN_IF_ERROR_CTX(t.transport->register_tier(tm.desc.id, tm.desc.memory, tm.base, tm.desc.capacity_bytes),
                              "KV tiers: registering " + tm.desc.name + " with " + std::string(t.transport->name()));
    }
    if (!t.remote.empty()) {
      // Writes into remote tiers from the host (synthetic fills) go through this bounce buffer.
      constexpr uint64_t kBounceBytes = uint64_t{4} << 20;
      bounce = std::shared_ptr<void>(std::aligned_alloc(4096, kBounceBytes), [](void* p) { std::free(p); });
      if (!bounce) return resource_exhausted("KV tiers: cannot allocate the host bounce buffer");
      bounce_tier = TierId(static_cast<int32_t>(tiers.size()));
      SPX_RETURN_IF_ERROR_CTX(
          t.transport->register_tier(bounce_tier, MemoryKind::kHost, bounce.get(), kBounceBytes),
          "KV tiers: registering the bounce buffer");
    }
  }
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<KvStore> store,
                       KvStore::create(c, options_.page_size, n_pages, std::move(tiers),
                                       options_.kv_chunk_pages, options_.kv_dtype));
  // Head key blocks of B tokens: with equal head and target head_dim a block is exactly one
  // working-set slice, so the top of the device tier holds a single allocation size.
  const int64_t head_block_tokens =
      options_.sparse.method == SparseMethod::kSpeContext ? options_.sparse.selection.budget : 0;
  memory_ = std::make_unique<KvMemory>(model_, backend_, options_, max_context_, head_block_tokens,
                                       std::move(store), std::move(bounce), bounce_tier);
  kv_ = memory_->kv_.get();
  memory_->replan_ = [this](const std::vector<int64_t>& lengths) {
    return options_.tiering.policy ? rebalance_for(lengths) : Status::ok();
  };
  step_traffic_.assign(static_cast<size_t>(kv_->n_tiers()), TierTraffic{});
  total_traffic_ = step_traffic_;
  peak_used_.assign(step_traffic_.size(), 0);
  return Status::ok();
}

Result<void*> Engine::fit(Workspace& w, size_t bytes) {
  if (w.bytes < bytes) {
    const size_t grown = std::max(bytes, w.bytes + w.bytes / 2);
    SPX_ASSIGN_OR_RETURN(w.mem, backend_->allocate(grown));
    w.bytes = grown;
  }
  return w.mem.get();
}

Status Engine::admit(int64_t final_length, bool alone, SeqId taken_over) const {
  if (final_length > max_context_) {
    return out_of_range("a sequence of " + std::to_string(final_length) + " tokens is beyond the context limit of " +
                        std::to_string(max_context_));
  }
  if (options_.tiering.policy) {
    std::vector<int64_t> lens;
    if (!alone) {
      for (const auto& [id, s] : memory_->sequences_) {
        if (id != taken_over) lens.push_back(std::max(s.length, s.admitted_length));
      }
    }
    PlacementInput in = placement_input(lens);
    if (alone) in.device_other_bytes = 0;
    const int64_t final_lengths[] = {final_length};
    in.device_other_bytes += new_sequence_reserve() + staging_reserve(final_lengths);
    return with_lost_tiers(options_.tiering.policy->admit(in, final_length, alone));
  }
  const int64_t need = (final_length + kv_->page_size() - 1) / kv_->page_size();
  int64_t available = kv_->total_pages();
  if (!alone) {
    // A live sequence holds the pages of its length and is owed those of its admitted length.
    for (const auto& [id, s] : memory_->sequences_) {
      if (id == taken_over) continue;
      available -= (std::max(s.length, s.admitted_length) + kv_->page_size() - 1) / kv_->page_size();
    }
  }
  if (need > available) {
    return resource_exhausted("a sequence of " + std::to_string(final_length) + " tokens needs " + std::to_string(need) +
                              " KV pages; " + std::to_string(available) + " of " + std::to_string(kv_->total_pages()) +
                              (alone ? " exist" : " are free"));
  }
  return Status::ok();
}

Status Engine::fits(std::span<const int64_t> grown, int64_t new_length) const {
  if (grown.size() != memory_->sequences_.size()) {
    return invalid_argument("fits: " + std::to_string(grown.size()) + " lengths for " +
                            std::to_string(memory_->sequences_.size()) + " live sequences");
  }
  if (new_length > max_context_) return admit(new_length, /*alone=*/true);  // the same kOutOfRange
  if (options_.tiering.policy) {
    std::vector<int64_t> lens(grown.begin(), grown.end());
    int64_t asked = new_length;
    if (asked <= 0) {
      if (lens.empty()) return Status::ok();
      // The policy answers "one more beside these": ask it for the longest live one beside the
      // rest. placement_input's growth terms already count every live sequence, so nothing is
      // reserved for a new one.
      auto longest = std::max_element(lens.begin(), lens.end());
      asked = *longest;
      lens.erase(longest);
      PlacementInput in = placement_input(lens);
      const int64_t asked_lengths[] = {asked};
      in.device_other_bytes += staging_reserve(asked_lengths);
      return with_lost_tiers(options_.tiering.policy->admit(in, asked, /*alone=*/false));
    }
    PlacementInput in = placement_input(lens);
    const int64_t asked_lengths[] = {asked};
    in.device_other_bytes += new_sequence_reserve() + staging_reserve(asked_lengths);
    return with_lost_tiers(options_.tiering.policy->admit(in, asked, /*alone=*/false));
  }
  const int64_t ps = kv_->page_size();
  int64_t need = new_length > 0 ? (new_length + ps - 1) / ps : 0;
  for (int64_t g : grown) need += (g + ps - 1) / ps;
  if (need > kv_->total_pages()) {
    return resource_exhausted(std::to_string(grown.size()) + " sequences" +
                              (new_length > 0 ? " and one of " + std::to_string(new_length) + " tokens" : "") +
                              " need " + std::to_string(need) + " KV pages; " +
                              std::to_string(kv_->total_pages()) + " exist");
  }
  return Status::ok();
}

uint64_t Engine::new_sequence_reserve() const {
  // placement_input's growth terms, for one more sequence.
  const ModelConfig& c = config();
  // (Working sets are the planner's staging term, counted for every running slot.)
  uint64_t r = static_cast<uint64_t>(c.n_layers) * kv_->chunk_bytes();
  if (options_.sparse.method == SparseMethod::kSpeContext) r += memory_->head_block_bytes();
  return r;
}

}  // namespace specontext
