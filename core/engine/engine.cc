#include "core/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <unordered_set>

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

Result<std::unique_ptr<Engine>> Engine::create(std::shared_ptr<const Model> model,
                                               std::shared_ptr<Backend> backend,
                                               const EngineOptions& options) {
  if (!model || !backend) return invalid_argument("Engine::create: model and backend are required");
  SPX_RETURN_IF_ERROR(model->validate());
  const ModelConfig& c = model->config;
  for (BackendOp op : {BackendOp::kEmbed, BackendOp::kMatmul}) {
    if (!backend->supports(op, model->weight_dtype)) {
      return unimplemented("backend " + std::string(backend->name()) + " does not support " +
                           std::string(dtype_name(model->weight_dtype)) + " weights");
    }
  }
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
    for (BackendOp op : {BackendOp::kKvGather, BackendOp::kAttentionSparse}) {
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
    // Head key blocks of B tokens: with equal head and target head_dim a block is exactly one
    // working-set slice, so the top of the device tier holds a single allocation size.
    e->head_block_tokens_ = sp.selection.budget;
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
    // The head's key blocks: `budget` tokens each, f32 (head_block_bytes).
    const auto& hc = o.retrieval_head->config;
    // Waiting sequences hold tokens of the same pool: a partly filled block each beyond it.
    const int64_t blocks = running * ((max_context + budget - 1) / budget) + waiting;
    bytes += static_cast<uint64_t>(blocks) * static_cast<uint64_t>(budget * hc.n_kv_heads * hc.head_dim) *
             sizeof(float);
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
  if (tiered) {
    for (const TierMemory& tm : tiers) {
      SPX_RETURN_IF_ERROR_CTX(t.transport->register_tier(tm.desc.id, tm.desc.memory, tm.base, tm.desc.capacity_bytes),
                              "KV tiers: registering " + tm.desc.name + " with " + std::string(t.transport->name()));
    }
    if (!t.remote.empty()) {
      // Writes into remote tiers from the host (synthetic fills) go through this bounce buffer.
      constexpr uint64_t kBounceBytes = uint64_t{4} << 20;
      bounce_ = std::shared_ptr<void>(std::aligned_alloc(4096, kBounceBytes), [](void* p) { std::free(p); });
      if (!bounce_) return resource_exhausted("KV tiers: cannot allocate the host bounce buffer");
      bounce_tier_ = TierId(static_cast<int32_t>(tiers.size()));
      SPX_RETURN_IF_ERROR_CTX(t.transport->register_tier(bounce_tier_, MemoryKind::kHost, bounce_.get(), kBounceBytes),
                              "KV tiers: registering the bounce buffer");
    }
  }
  SPX_ASSIGN_OR_RETURN(kv_, KvStore::create(c, options_.page_size, n_pages, std::move(tiers), options_.kv_chunk_pages,
                                               options_.kv_dtype));
  placement_.layer_home.assign(static_cast<size_t>(c.n_layers), TierId(0));
  placement_.head_cache_home = TierId(0);
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

Result<SeqId> Engine::add_sequence(int64_t final_length) {
  if (live_sequences() >= options_.max_sequences) {
    return resource_exhausted("all " + std::to_string(options_.max_sequences) +
                              " sequence slots are in use");
  }
  const SeqId id(next_seq_id_++);
  Sequence s;
  s.admitted_length = final_length;
  sequences_.emplace(id, std::move(s));
  return id;
}

int64_t Engine::fork_granularity() const {
  const int64_t ps = kv_->page_size();
  return options_.sparse.method == SparseMethod::kQuest ? std::lcm(ps, options_.sparse.quest_page_size) : ps;
}

Status Engine::check_prefix(SeqId seq, const Sequence& s, int64_t tokens, std::string_view what) const {
  const int64_t granularity = fork_granularity();
  if (tokens <= 0 || tokens % granularity != 0 || tokens > s.length) {
    return invalid_argument(std::string(what) + ": a prefix of " + std::to_string(tokens) +
                            " tokens of sequence " + std::to_string(seq.value()) + " (" +
                            std::to_string(s.length) + " tokens): it must be a positive multiple of " +
                            std::to_string(granularity) + " up to the sequence's length");
  }
  const auto pages = static_cast<size_t>(tokens / kv_->page_size());
  if (options_.sparse.method == SparseMethod::kSpeContext &&
      (s.boundary_fused.size() < pages || !s.boundary_fused[pages - 1])) {
    return invalid_argument(std::string(what) + ": sequence " + std::to_string(seq.value()) +
                            " has no fused features at token " + std::to_string(tokens - 1) +
                            (options_.prefix_sharing ? "" : " (EngineOptions::prefix_sharing is off)"));
  }
  return Status::ok();
}

Status Engine::resume_fused_at(Sequence& s, const std::shared_ptr<const void>& boundary) {
  const size_t fused_row = static_cast<size_t>(3 * config().dim) * sizeof(float);
  if (!s.last_fused) {
    SPX_ASSIGN_OR_RETURN(s.last_fused, backend_->allocate(fused_row));
  }
  SPX_RETURN_IF_ERROR(
      backend_->copy_rows(s.last_fused.get(), fused_row, boundary.get(), fused_row, fused_row, 1));
  return backend_->synchronize();
}

size_t Engine::quest_bound_elements(int64_t tokens) const {
  return static_cast<size_t>(tokens / options_.sparse.quest_page_size * config().kv_dim());
}

Result<SeqId> Engine::fork_sequence(SeqId source, int64_t prefix_tokens, int64_t final_length) {
  const auto src_it = sequences_.find(source);
  if (src_it == sequences_.end()) {
    return invalid_argument("fork_sequence: unknown sequence " + std::to_string(source.value()));
  }
  SPX_RETURN_IF_ERROR(check_prefix(source, src_it->second, prefix_tokens, "fork_sequence"));
  const int64_t n_pages = prefix_tokens / kv_->page_size();
  const bool head = options_.sparse.method == SparseMethod::kSpeContext;
  SPX_ASSIGN_OR_RETURN(const SeqId id, add_sequence(final_length));
  Sequence& s = sequences_.at(id);
  const Sequence& src = sequences_.at(source);  // unordered_map references survive the insertion
  s.pages.assign(src.pages.begin(), src.pages.begin() + n_pages);
  for (PageId p : s.pages) kv_->share_page(p);
  s.length = prefix_tokens;
  auto undo = [&](const Status& st) -> Status {
    (void)remove_sequence(id);
    return st.with_context("fork_sequence");
  };
  if (head) {
    if (Status st = ensure_head_capacity(s, prefix_tokens); !st.is_ok()) return undo(st);
    const uint64_t bytes = head_block_bytes();
    const size_t blocks = static_cast<size_t>((prefix_tokens + head_block_tokens_ - 1) / head_block_tokens_);
    for (size_t b = 0; b < blocks; ++b) {
      void* dst = kv_->address(s.head_tier, s.head_blocks[b]);
      const void* from = kv_->address(src.head_tier, src.head_blocks[b]);
      if (backend_reads(s.head_tier) && backend_reads(src.head_tier)) {
        if (Status st = backend_->copy_rows(dst, bytes, from, bytes, bytes, 1); !st.is_ok()) return undo(st);
      } else if (host_visible(s.head_tier) && host_visible(src.head_tier)) {
        std::memcpy(dst, from, bytes);
      } else {
        return undo(unimplemented("the retrieval head's keys are in a tier the engine cannot copy within"));
      }
    }
    if (Status st = resume_fused_at(s, src.boundary_fused[static_cast<size_t>(n_pages - 1)]); !st.is_ok()) {
      return undo(st);
    }
    s.boundary_fused.assign(src.boundary_fused.begin(), src.boundary_fused.begin() + n_pages);
  } else if (options_.sparse.method == SparseMethod::kQuest) {
    if (Status st = ensure_sparse_state(s); !st.is_ok()) return undo(st);
    const size_t bounds = quest_bound_elements(prefix_tokens);
    for (size_t l = 0; l < s.layers.size(); ++l) {
      const LayerSparseState& from = src.layers[l];
      s.layers[l].page_min.assign(from.page_min.begin(),
                                  from.page_min.begin() + static_cast<std::ptrdiff_t>(bounds));
      s.layers[l].page_max.assign(from.page_max.begin(),
                                  from.page_max.begin() + static_cast<std::ptrdiff_t>(bounds));
    }
  }
  return id;
}

Status Engine::truncate_sequence(SeqId seq, int64_t length, int64_t final_length) {
  const auto it = sequences_.find(seq);
  if (it == sequences_.end())
    return invalid_argument("truncate_sequence: unknown sequence " + std::to_string(seq.value()));
  Sequence& s = it->second;
  if (length != s.length) SPX_RETURN_IF_ERROR(check_prefix(seq, s, length, "truncate_sequence"));
  s.admitted_length = final_length;
  if (length == s.length) return Status::ok();
  const auto pages = static_cast<size_t>(length / kv_->page_size());
  if (options_.sparse.method == SparseMethod::kSpeContext) {
    SPX_RETURN_IF_ERROR(resume_fused_at(s, s.boundary_fused[pages - 1]));
    s.boundary_fused.resize(pages);
  }
  // Nothing can fail from here on.
  for (size_t p = pages; p < s.pages.size(); ++p) kv_->free_page(s.pages[p]);
  s.pages.resize(pages);
  s.length = length;
  if (options_.sparse.method == SparseMethod::kQuest) {
    const size_t bounds = quest_bound_elements(length);
    for (LayerSparseState& ls : s.layers) {
      if (ls.page_min.size() > bounds) ls.page_min.resize(bounds), ls.page_max.resize(bounds);
    }
  }
  invalidate_working_sets(s);  // their slot maps name tokens that are gone
  if (s.filter_tokens > length && options_.tiering.candidate_filter) {
    options_.tiering.candidate_filter->drop(seq);
    s.filter_tokens = 0;
  }
  return Status::ok();
}

Status Engine::remove_sequence(SeqId seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return invalid_argument("unknown sequence " + std::to_string(seq.value()));
  for (PageId p : it->second.pages) kv_->free_page(p);
  drop_sparse_state(it->second);
  release_head_cache(it->second);
  if (options_.tiering.candidate_filter) options_.tiering.candidate_filter->drop(seq);
  sequences_.erase(it);
  return Status::ok();
}

int64_t Engine::sequence_length(SeqId seq) const {
  auto it = sequences_.find(seq);
  return it == sequences_.end() ? 0 : it->second.length;
}

int64_t Engine::kv_bytes_in_use() const {
  return kv_->used_pages() * static_cast<int64_t>(kv_->page_bytes()) * kv_->n_layers();
}

Status Engine::admit(int64_t final_length, bool alone, SeqId taken_over) const {
  if (final_length > max_context_) {
    return out_of_range("a sequence of " + std::to_string(final_length) + " tokens is beyond the context limit of " +
                        std::to_string(max_context_));
  }
  if (options_.tiering.policy) {
    std::vector<int64_t> lens;
    if (!alone) {
      for (const auto& [id, s] : sequences_) {
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
    for (const auto& [id, s] : sequences_) {
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
  if (grown.size() != sequences_.size()) {
    return invalid_argument("fits: " + std::to_string(grown.size()) + " lengths for " +
                            std::to_string(sequences_.size()) + " live sequences");
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
  uint64_t r = static_cast<uint64_t>(c.n_layers) * kv_->chunk_bytes();
  if (options_.sparse.method != SparseMethod::kDense) {
    r += static_cast<uint64_t>(c.n_layers) * 2 * working_set_bytes();
  }
  if (options_.sparse.method == SparseMethod::kSpeContext) r += head_block_bytes();
  return r;
}

Status Engine::reserve_pages(Sequence& seq, int64_t new_length, std::vector<PageId>& newly_allocated) {
  const int64_t need = (new_length + kv_->page_size() - 1) / kv_->page_size();
  while (static_cast<int64_t>(seq.pages.size()) < need) {
    auto page = kv_->allocate_page();
    if (!page.is_ok()) return page.status();
    seq.pages.push_back(*page);
    newly_allocated.push_back(*page);
  }
  return Status::ok();
}

bool Engine::host_visible(TierId tier) const {
  const TierMemory& t = kv_->tiers()[static_cast<size_t>(tier.value())];
  return t.base != nullptr && (t.desc.memory == MemoryKind::kHost || t.desc.memory == MemoryKind::kPinnedHost);
}

bool Engine::backend_reads(TierId tier) const {
  const TierMemory& t = kv_->tiers()[static_cast<size_t>(tier.value())];
  return t.base != nullptr && (tier == TierId(0) || backend_->addressable(t.desc.memory));
}

Status Engine::check_invariants() const {
  SPX_RETURN_IF_ERROR(kv_->check_invariants());
  std::unordered_map<PageId, int32_t> holders;
  for (const auto& [id, s] : sequences_) {
    const int64_t need = (s.length + kv_->page_size() - 1) / kv_->page_size();
    if (static_cast<int64_t>(s.pages.size()) < need) {
      return internal_error("sequence " + std::to_string(id.value()) + " holds " + std::to_string(s.pages.size()) +
                            " pages for " + std::to_string(s.length) + " tokens");
    }
    std::unordered_set<PageId> own;
    for (PageId p : s.pages) {
      if (!own.insert(p).second) {
        return internal_error("sequence " + std::to_string(id.value()) + " holds page " +
                              std::to_string(p.value()) + " twice");
      }
      ++holders[p];
    }
  }
  if (static_cast<int64_t>(holders.size()) != kv_->used_pages()) {
    return internal_error(std::to_string(kv_->used_pages()) + " pages in use but sequences hold " +
                          std::to_string(holders.size()));
  }
  for (const auto& [p, n] : holders) {
    if (kv_->page_references(p) != n) {
      return internal_error("page " + std::to_string(p.value()) + " has " +
                            std::to_string(kv_->page_references(p)) + " references but " + std::to_string(n) +
                            " holders");
    }
  }
  for (int64_t l = 0; l < kv_->n_layers(); ++l) {
    if (kv_->home(LayerId(static_cast<int32_t>(l))) != placement_.layer_home[static_cast<size_t>(l)]) {
      return internal_error("layer " + std::to_string(l) + " is not where the placement says");
    }
  }
  return Status::ok();
}

}  // namespace specontext
