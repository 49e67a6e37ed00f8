// KvMemory (kv_memory.h): sequences' page tables, forks, truncation, sparse working sets and the
// retrieval head's key cache, prefix snapshots, and reads and writes of any tier's blocks.
#include "core/engine/kv_memory.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <unordered_set>

namespace specontext {

uint64_t PrefixSnapshot::bytes() const {
  uint64_t n = kv.size() + head_keys.size() * sizeof(float);
  for (const auto& f : boundary_fused) n += f.size() * sizeof(float);
  for (const auto& b : quest_min) n += b.size() * sizeof(float);
  for (const auto& b : quest_max) n += b.size() * sizeof(float);
  return n;
}

KvMemory::KvMemory(std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend,
                   const EngineOptions& options, int64_t max_context, int64_t head_block_tokens,
                   std::unique_ptr<KvStore> store, std::shared_ptr<void> bounce, TierId bounce_tier)
    : model_(std::move(model)),
      backend_(std::move(backend)),
      options_(options),
      max_context_(max_context),
      head_block_tokens_(head_block_tokens),
      kv_(std::move(store)),
      bounce_(std::move(bounce)),
      bounce_tier_(bounce_tier) {
  placement_.layer_home.assign(static_cast<size_t>(config().n_layers), TierId(0));
  placement_.head_cache_home = TierId(0);
}

Result<SeqId> KvMemory::add_sequence(int64_t final_length) {
  if (live_sequences() >= options_.max_sequences) {
    return resource_exhausted("all " + std::to_string(options_.max_sequences) + " sequence slots are in use");
  }
  const SeqId id(next_seq_id_++);
  KvSequence s;
  s.admitted_length = final_length;
  sequences_.emplace(id, std::move(s));
  return id;
}

int64_t KvMemory::fork_granularity() const {
  const int64_t ps = kv_->page_size();
  return options_.sparse.method == SparseMethod::kQuest ? std::lcm(ps, options_.sparse.quest_page_size) : ps;
}

Status KvMemory::check_prefix(SeqId seq, const KvSequence& s, int64_t tokens, std::string_view what) const {
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

Status KvMemory::resume_fused_at(KvSequence& s, const std::shared_ptr<const void>& boundary) {
  const size_t fused_row = static_cast<size_t>(3 * config().dim) * sizeof(float);
  if (!s.last_fused) {
    SPX_ASSIGN_OR_RETURN(s.last_fused, backend_->allocate(fused_row));
  }
  SPX_RETURN_IF_ERROR(
      backend_->copy_rows(s.last_fused.get(), fused_row, boundary.get(), fused_row, fused_row, 1));
  return backend_->synchronize();
}

size_t KvMemory::quest_bound_elements(int64_t tokens) const {
  return static_cast<size_t>(tokens / options_.sparse.quest_page_size * config().kv_dim());
}

Result<SeqId> KvMemory::fork_sequence(SeqId source, int64_t prefix_tokens, int64_t final_length) {
  const auto src_it = sequences_.find(source);
  if (src_it == sequences_.end()) {
    return invalid_argument("fork_sequence: unknown sequence " + std::to_string(source.value()));
  }
  SPX_RETURN_IF_ERROR(check_prefix(source, src_it->second, prefix_tokens, "fork_sequence"));
  const int64_t n_pages = prefix_tokens / kv_->page_size();
  const bool head = options_.sparse.method == SparseMethod::kSpeContext;
  SPX_ASSIGN_OR_RETURN(const SeqId id, add_sequence(final_length));
  KvSequence& s = sequences_.at(id);
  const KvSequence& src = sequences_.at(source);  // unordered_map references survive the insertion
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
    ensure_layers(s);
    const size_t bounds = quest_bound_elements(prefix_tokens);
    for (size_t l = 0; l < s.layers.size(); ++l) {
      const KvLayerSparseState& from = src.layers[l];
      s.layers[l].page_min.assign(from.page_min.begin(),
                                  from.page_min.begin() + static_cast<std::ptrdiff_t>(bounds));
      s.layers[l].page_max.assign(from.page_max.begin(),
                                  from.page_max.begin() + static_cast<std::ptrdiff_t>(bounds));
    }
  }
  return id;
}

Status KvMemory::truncate_sequence(SeqId seq, int64_t length, int64_t final_length) {
  const auto it = sequences_.find(seq);
  if (it == sequences_.end())
    return invalid_argument("truncate_sequence: unknown sequence " + std::to_string(seq.value()));
  KvSequence& s = it->second;
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
    for (KvLayerSparseState& ls : s.layers) {
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

Status KvMemory::remove_sequence(SeqId seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return invalid_argument("unknown sequence " + std::to_string(seq.value()));
  for (PageId p : it->second.pages) kv_->free_page(p);
  drop_sparse_state(it->second);
  release_head_cache(it->second);
  if (options_.tiering.candidate_filter) options_.tiering.candidate_filter->drop(seq);
  sequences_.erase(it);
  return Status::ok();
}

int64_t KvMemory::sequence_length(SeqId seq) const {
  auto it = sequences_.find(seq);
  return it == sequences_.end() ? 0 : it->second.length;
}

int64_t KvMemory::kv_bytes_in_use() const {
  return kv_->used_pages() * static_cast<int64_t>(kv_->page_bytes()) * kv_->n_layers();
}

Status KvMemory::reserve_pages(KvSequence& seq, int64_t new_length, std::vector<PageId>& newly_allocated) {
  const int64_t need = (new_length + kv_->page_size() - 1) / kv_->page_size();
  while (static_cast<int64_t>(seq.pages.size()) < need) {
    auto page = kv_->allocate_page();
    if (!page.is_ok()) return page.status();
    seq.pages.push_back(*page);
    newly_allocated.push_back(*page);
  }
  return Status::ok();
}

bool KvMemory::host_visible(TierId tier) const {
  const TierMemory& t = kv_->tiers()[static_cast<size_t>(tier.value())];
  return t.base != nullptr &&
         (t.desc.memory == MemoryKind::kHost || t.desc.memory == MemoryKind::kPinnedHost);
}

bool KvMemory::backend_reads(TierId tier) const {
  const TierMemory& t = kv_->tiers()[static_cast<size_t>(tier.value())];
  return t.base != nullptr && (tier == TierId(0) || backend_->addressable(t.desc.memory));
}

Status KvMemory::check_invariants() const {
  SPX_RETURN_IF_ERROR(kv_->check_invariants());
  std::unordered_map<PageId, int32_t> holders;
  for (const auto& [id, s] : sequences_) {
    const int64_t need = (s.length + kv_->page_size() - 1) / kv_->page_size();
    if (static_cast<int64_t>(s.pages.size()) < need) {
      return internal_error("sequence " + std::to_string(id.value()) + " holds " +
                            std::to_string(s.pages.size()) + " pages for " + std::to_string(s.length) +
                            " tokens");
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

void KvMemory::give_back_pages(const std::vector<PageId>& newly_allocated) {
  std::unordered_set<PageId> fresh(newly_allocated.begin(), newly_allocated.end());
  for (auto& [id, seq] : sequences_) {
    while (!seq.pages.empty() && fresh.count(seq.pages.back())) seq.pages.pop_back();
  }
  for (PageId p : newly_allocated) kv_->free_page(p);
}

uint64_t KvMemory::working_set_bytes_in_use() const {
  uint64_t bytes = 0;
  for (const auto& [id, s] : sequences_) {
    for (const KvLayerSparseState& ls : s.layers) bytes += ls.ws_k.bytes + ls.ws_v.bytes;
  }
  return bytes;
}

void KvMemory::release_slices(std::vector<KvLayerSparseState>& layers) {
  for (auto& ls : layers) {
    if (ls.ws_k.valid()) (void)kv_->release(ls.ws_k.tier, ls.ws_k.offset);
    if (ls.ws_v.valid()) (void)kv_->release(ls.ws_v.tier, ls.ws_v.offset);
    ls.ws_k = ls.ws_v = KvSlice{};
    ls.ws_fresh = false;
    ls.ws.clear();
  }
}

void KvMemory::ensure_layers(KvSequence& s) {
  if (s.layers.empty()) s.layers.resize(static_cast<size_t>(config().n_layers));
}

Status KvMemory::ensure_sparse_state(KvSequence& s) {
  const ModelConfig& c = config();
  const int64_t slots = options_.sparse.selection.budget;
  const uint64_t bytes = working_set_bytes();
  const bool shared = shares_selection(options_.sparse.method);
  ensure_layers(s);
  const TierId device(0);
  // Slot maps (host bookkeeping: the elastic diff, and what an offloaded layer's working set holds).
  if (shared && s.shared_ws.slots() != slots) s.shared_ws = ElasticWorkingSet(c.n_kv_heads, slots);
  for (size_t l = 0; l < s.layers.size(); ++l) {
    KvLayerSparseState& ls = s.layers[l];
    if (!shared && ls.ws.slots() != slots) ls.ws = ElasticWorkingSet(c.n_kv_heads, slots);
    // A layer homed on the device is attended in place by index (Backend::attention_indexed):
    // no working set. Every other layer loads its selection elastic into one on the device.
    const bool wanted = kv_->home(LayerId(static_cast<int32_t>(l))) != device;
    if (!wanted) {
      if (ls.ws_k.valid()) (void)kv_->release(ls.ws_k.tier, ls.ws_k.offset);
      if (ls.ws_v.valid()) (void)kv_->release(ls.ws_v.tier, ls.ws_v.offset);
      ls.ws_k = ls.ws_v = KvSlice{};
      ls.ws_fresh = false;
      continue;
    }
    if (ls.ws_k.valid()) continue;
    auto k = kv_->allocate(device, bytes);
    if (!k.is_ok()) return k.status().with_context("working sets of a sparse sequence");
    auto v = kv_->allocate(device, bytes);
    if (!v.is_ok()) {
      (void)kv_->release(device, *k);
      return v.status().with_context("working sets of a sparse sequence");
    }
    ls.ws_k = KvSlice{device, *k, bytes};
    ls.ws_v = KvSlice{device, *v, bytes};
    ls.ws_fresh = true;
  }
  return Status::ok();
}

Status KvMemory::release_working_sets(SeqId seq) {
  const auto it = sequences_.find(seq);
  if (it == sequences_.end())
    return invalid_argument("release_working_sets: unknown sequence " + std::to_string(seq.value()));
  KvSequence& s = it->second;
  if (options_.sparse.method != SparseMethod::kQuest) {
    drop_sparse_state(s);
  } else {  // Quest's bounds stay: forks copy them
    release_slices(s.layers);
    s.shared_ws.clear();
  }
  return Status::ok();
}

void KvMemory::drop_sparse_state(KvSequence& s) {
  release_slices(s.layers);
  s.layers.clear();
  s.shared_ws.clear();
}

void KvMemory::invalidate_working_sets(KvSequence& s) {
  s.shared_ws.clear();
  for (auto& ls : s.layers) ls.ws.clear();
}

uint64_t KvMemory::working_set_bytes() const {
  const ModelConfig& c = config();
  return static_cast<uint64_t>(c.n_kv_heads * options_.sparse.selection.budget * c.head_dim) *
         dtype_size(options_.kv_dtype);
}

size_t KvMemory::head_row_elements() const {
  const auto& hc = options_.retrieval_head->config;
  return static_cast<size_t>(hc.n_kv_heads * hc.head_dim);
}

size_t KvMemory::head_row_bytes() const { return head_row_elements() * dtype_size(options_.kv_dtype); }

uint64_t KvMemory::head_block_bytes() const {
  return static_cast<uint64_t>(head_block_tokens_) * head_row_bytes();
}

void* KvMemory::head_row(const KvSequence& s, int64_t token) const {
  auto* block = static_cast<std::byte*>(
      kv_->address(s.head_tier, s.head_blocks[static_cast<size_t>(token / head_block_tokens_)]));
  return block + static_cast<size_t>(token % head_block_tokens_) * head_row_bytes();
}

const void* const* KvMemory::head_block_table(const KvSequence& s) {
  head_table_.resize(s.head_blocks.size());
  for (size_t b = 0; b < s.head_blocks.size(); ++b) {
    head_table_[b] = kv_->address(s.head_tier, s.head_blocks[b]);
  }
  return head_table_.data();
}

void KvMemory::release_head_cache(KvSequence& s) {
  for (uint64_t off : s.head_blocks) (void)kv_->release(s.head_tier, off);
  s.head_blocks.clear();
}

Status KvMemory::ensure_head_capacity(KvSequence& s, int64_t tokens) {
  if (s.head_blocks.empty()) s.head_tier = placement_.head_cache_home;
  while (head_capacity(s) < tokens) {
    SPX_ASSIGN_OR_RETURN(uint64_t off, kv_->allocate(s.head_tier, head_block_bytes()));
    s.head_blocks.push_back(off);
  }
  return Status::ok();
}

Status KvMemory::read_block(TierId tier, uint64_t offset, void* host, uint64_t bytes) {
  if (tier == TierId(0) && backend_->memory_kind() != MemoryKind::kHost) {
    return backend_->download(host, kv_->address(tier, offset), bytes);
  }
  if (host_visible(tier)) {
    std::memcpy(host, kv_->address(tier, offset), bytes);
    return Status::ok();
  }
  return through_bounce(tier, offset, host, bytes, CopyDirection::kLoad);
}

Result<PrefixSnapshot> KvMemory::export_prefix(SeqId seq, int64_t tokens) {
  const auto it = sequences_.find(seq);
  if (it == sequences_.end())
    return invalid_argument("export_prefix: unknown sequence " + std::to_string(seq.value()));
  const KvSequence& s = it->second;
  SPX_RETURN_IF_ERROR(check_prefix(seq, s, tokens, "export_prefix"));
  const SparseMethod method = options_.sparse.method;
  PrefixSnapshot snap;
  snap.tokens = tokens;
  snap.page_size = kv_->page_size();
  snap.layers = kv_->n_layers();
  snap.page_bytes = kv_->page_bytes();
  snap.kv_dtype = kv_->dtype();
  snap.method = method;
  const auto pages = static_cast<size_t>(tokens / kv_->page_size());
  snap.kv.resize(static_cast<size_t>(snap.layers) * pages * snap.page_bytes);
  std::byte* out = snap.kv.data();
  for (int64_t l = 0; l < snap.layers; ++l) {
    for (size_t p = 0; p < pages; ++p, out += snap.page_bytes) {
      const PageLocation loc = kv_->locate(LayerId(static_cast<int32_t>(l)), s.pages[p]);
      SPX_RETURN_IF_ERROR_CTX(read_block(loc.tier, loc.offset, out, snap.page_bytes), "export_prefix");
    }
  }
  if (method == SparseMethod::kSpeContext) {
    // Widened to f32 block by block (the snapshot's format does not depend on the KV dtype).
    const uint64_t block = head_block_bytes();
    const size_t block_elems = static_cast<size_t>(block / dtype_size(options_.kv_dtype));
    const auto blocks = static_cast<size_t>((tokens + head_block_tokens_ - 1) / head_block_tokens_);
    snap.head_keys.resize(blocks * block_elems);
    std::vector<std::byte> stored(options_.kv_dtype == DType::kF32 ? 0 : block);
    for (size_t b = 0; b < blocks; ++b) {
      float* keys = snap.head_keys.data() + b * block_elems;
      void* into = stored.empty() ? static_cast<void*>(keys) : stored.data();
      SPX_RETURN_IF_ERROR_CTX(read_block(s.head_tier, s.head_blocks[b], into, block), "export_prefix");
      if (!stored.empty()) convert_to_f32(options_.kv_dtype, stored.data(), keys, block_elems);
    }
    const size_t fused_row = static_cast<size_t>(3 * config().dim);
    snap.boundary_fused.resize(pages);
    for (size_t p = 0; p < pages; ++p) {
      if (!s.boundary_fused[p]) continue;
      snap.boundary_fused[p].resize(fused_row);
      SPX_RETURN_IF_ERROR(backend_->download(snap.boundary_fused[p].data(), s.boundary_fused[p].get(),
                                             fused_row * sizeof(float)));
    }
  } else if (method == SparseMethod::kQuest) {
    if (s.layers.size() != static_cast<size_t>(snap.layers)) {
      return invalid_argument("export_prefix: sequence " + std::to_string(seq.value()) +
                              " has no Quest bounds");
    }
    const auto bounds = static_cast<std::ptrdiff_t>(quest_bound_elements(tokens));
    for (const KvLayerSparseState& ls : s.layers) {
      snap.quest_min.emplace_back(ls.page_min.begin(), ls.page_min.begin() + bounds);
      snap.quest_max.emplace_back(ls.page_max.begin(), ls.page_max.begin() + bounds);
    }
  }
  return snap;
}

namespace {

// What import_prefix and import_prefix_after check a snapshot against: the memory's layout, the
// room its tokens must fit in and the sizes of the sparse method's state for its tokens.
struct SnapshotFit {
  std::string what;  // the function, named in the errors
  int64_t page_size = 0;
  int64_t layers = 0;
  uint64_t page_bytes = 0;
  DType kv_dtype = DType::kF32;
  SparseMethod method = SparseMethod::kDense;
  int64_t unit = 0;  // the tokens: a positive multiple of it that fits in max_context after `after`
  int64_t max_context = 0;
  int64_t after = 0;
  bool appended = false;     // import_prefix_after: the errors name the tokens the snapshot's follow
  bool sharing_off = false;  // import_prefix: SpeContext without EngineOptions::prefix_sharing (refused)
  size_t head_keys = 0;      // SpeContext: floats of head keys the tokens need
  size_t fused_row = 0;      // SpeContext: floats of a boundary_fused row
  size_t quest_bounds = 0;   // Quest: bound elements per layer the tokens need
};

SnapshotFit layout_fit(const KvStore& kv, SparseMethod method, int64_t unit, std::string what) {
  SnapshotFit fit;
  fit.what = std::move(what);
  fit.page_size = kv.page_size();
  fit.layers = kv.n_layers();
  fit.page_bytes = kv.page_bytes();
  fit.kv_dtype = kv.dtype();
  fit.method = method;
  fit.unit = unit;
  return fit;
}

// kInvalidArgument naming the first field of the snapshot that does not fit.
Status check_snapshot(const PrefixSnapshot& snap, const SnapshotFit& fit) {
  const auto mismatch = [&](const std::string& field, int64_t got, int64_t want) {
    return invalid_argument(fit.what + ": snapshot field '" + field + "' is " + std::to_string(got) +
                            ", this engine needs " + std::to_string(want));
  };
  if (snap.page_size != fit.page_size) return mismatch("page_size", snap.page_size, fit.page_size);
  if (snap.layers != fit.layers) return mismatch("layers", snap.layers, fit.layers);
  if (snap.page_bytes != fit.page_bytes) {
    return mismatch("page_bytes", static_cast<int64_t>(snap.page_bytes),
                    static_cast<int64_t>(fit.page_bytes));
  }
  if (snap.kv_dtype != fit.kv_dtype) {
    return invalid_argument(fit.what + ": snapshot field 'kv_dtype' is " +
                            std::string(dtype_name(snap.kv_dtype)) + ", this engine stores " +
                            std::string(dtype_name(fit.kv_dtype)));
  }
  if (snap.method != fit.method) {
    return mismatch("method", static_cast<int64_t>(snap.method), static_cast<int64_t>(fit.method));
  }
  if (snap.tokens <= 0 || snap.tokens % fit.unit != 0 || fit.after > fit.max_context - snap.tokens) {
    return invalid_argument(fit.what + ": snapshot field 'tokens' is " + std::to_string(snap.tokens) +
                            ": it must be a positive multiple of " + std::to_string(fit.unit) + " up to " +
                            std::to_string(fit.max_context - fit.after) +
                            (fit.appended ? " after " + std::to_string(fit.after) + " tokens" : ""));
  }
  const auto pages = static_cast<size_t>(snap.tokens / snap.page_size);
  const size_t kv_bytes = static_cast<size_t>(snap.layers) * pages * snap.page_bytes;
  if (snap.kv.size() != kv_bytes) {
    return mismatch("kv", static_cast<int64_t>(snap.kv.size()), static_cast<int64_t>(kv_bytes));
  }
  if (fit.method == SparseMethod::kSpeContext) {
    if (fit.sharing_off) {
      return invalid_argument(fit.what + ": SpeContext needs EngineOptions::prefix_sharing");
    }
    if (snap.head_keys.size() != fit.head_keys) {
      return mismatch("head_keys", static_cast<int64_t>(snap.head_keys.size()),
                      static_cast<int64_t>(fit.head_keys));
    }
    if (snap.boundary_fused.size() != pages) {
      return mismatch("boundary_fused", static_cast<int64_t>(snap.boundary_fused.size()),
                      static_cast<int64_t>(pages));
    }
    for (const auto& f : snap.boundary_fused) {
      if (!f.empty() && f.size() != fit.fused_row) {
        return mismatch("boundary_fused", static_cast<int64_t>(f.size()),
                        static_cast<int64_t>(fit.fused_row));
      }
    }
    if (snap.boundary_fused.back().empty()) {
      return invalid_argument(fit.what +
                              ": snapshot field 'boundary_fused' has no features at its last token");
    }
  } else if (fit.method == SparseMethod::kQuest) {
    if (snap.quest_min.size() != static_cast<size_t>(snap.layers) ||
        snap.quest_max.size() != snap.quest_min.size()) {
      return mismatch("quest_min", static_cast<int64_t>(snap.quest_min.size()), snap.layers);
    }
    for (size_t l = 0; l < snap.quest_min.size(); ++l) {
      if (snap.quest_min[l].size() != fit.quest_bounds || snap.quest_max[l].size() != fit.quest_bounds) {
        return mismatch("quest_min", static_cast<int64_t>(snap.quest_min[l].size()),
                        static_cast<int64_t>(fit.quest_bounds));
      }
    }
  }
  return Status::ok();
}

// Writes a checked snapshot's KV ([layers][pages]) into its pages' places, the first `pages` (one
// a snapshot page), with `write` (KvMemory::write_block).
template <class Write>
Status write_snapshot_kv(const PrefixSnapshot& snap, const KvStore& kv, std::span<const PageId> pages,
                         Write&& write) {
  const auto n = static_cast<size_t>(snap.tokens / snap.page_size);
  const std::byte* in = snap.kv.data();
  for (int64_t l = 0; l < snap.layers; ++l) {
    for (size_t p = 0; p < n; ++p, in += snap.page_bytes) {
      const PageLocation loc = kv.locate(LayerId(static_cast<int32_t>(l)), pages[p]);
      SPX_RETURN_IF_ERROR(write(loc.tier, loc.offset, in, snap.page_bytes));
    }
  }
  return Status::ok();
}

// A checked snapshot's boundary_fused rows (`row` floats each) in backend memory, as entries
// `first` on of `out` (resized to end with them); empty rows stay null.
Status upload_boundary_fused(Backend& backend, const PrefixSnapshot& snap, size_t row, size_t first,
                             std::vector<std::shared_ptr<const void>>& out) {
  out.resize(first + snap.boundary_fused.size());
  for (size_t p = 0; p < snap.boundary_fused.size(); ++p) {
    if (snap.boundary_fused[p].empty()) continue;
    SPX_ASSIGN_OR_RETURN(std::shared_ptr<void> mem, backend.allocate(row * sizeof(float)));
    SPX_RETURN_IF_ERROR(backend.upload(mem.get(), snap.boundary_fused[p].data(), row * sizeof(float)));
    out[first + p] = std::move(mem);
  }
  return Status::ok();
}

// Before a sequence appears at `length` at once: the re-planner (if any) given the live sequences'
// lengths plus that one.
Status replan_with(const KvMemory::Replan& replan, const std::unordered_map<SeqId, KvSequence>& live,
                   int64_t length) {
  if (!replan) return Status::ok();
  std::vector<int64_t> lens;
  for (const auto& [id, other] : live) lens.push_back(other.length);
  lens.push_back(length);
  return replan(lens);
}

}  // namespace

Result<SeqId> KvMemory::import_prefix(const PrefixSnapshot& snap, int64_t final_length) {
  const SparseMethod method = options_.sparse.method;
  SnapshotFit fit = layout_fit(*kv_, method, fork_granularity(), "import_prefix");
  fit.max_context = max_context_;
  fit.sharing_off = !options_.prefix_sharing;
  fit.fused_row = static_cast<size_t>(3 * config().dim);
  if (method == SparseMethod::kSpeContext) {  // whole blocks of head keys
    const auto blocks = static_cast<size_t>((snap.tokens + head_block_tokens_ - 1) / head_block_tokens_);
    fit.head_keys = blocks * static_cast<size_t>(head_block_tokens_) * head_row_elements();
  } else if (method == SparseMethod::kQuest) {
    fit.quest_bounds = quest_bound_elements(snap.tokens);
  }
  SPX_RETURN_IF_ERROR(check_snapshot(snap, fit));
  // As fill_synthetic: the placement for the length the new sequence has at once.
  SPX_RETURN_IF_ERROR_CTX(replan_with(replan_, sequences_, snap.tokens), "import_prefix");
  SPX_ASSIGN_OR_RETURN(const SeqId id, add_sequence(final_length));
  KvSequence& s = sequences_.at(id);
  auto undo = [&](const Status& st) -> Status {
    (void)remove_sequence(id);
    return st.with_context("import_prefix");
  };
  const auto write = [this](TierId tier, uint64_t offset, const void* host, uint64_t bytes) {
    return write_block(tier, offset, host, bytes);
  };
  std::vector<PageId> fresh;
  if (Status st = reserve_pages(s, snap.tokens, fresh); !st.is_ok()) return undo(st);
  if (Status st = write_snapshot_kv(snap, *kv_, s.pages, write); !st.is_ok()) return undo(st);
  if (method == SparseMethod::kSpeContext) {
    if (Status st = ensure_head_capacity(s, snap.tokens); !st.is_ok()) return undo(st);
    // The snapshot's f32 keys rounded to the KV dtype block by block, as store_head_keys rounds them.
    const uint64_t block = head_block_bytes();
    const size_t block_elems = static_cast<size_t>(block / dtype_size(options_.kv_dtype));
    std::vector<std::byte> stored(options_.kv_dtype == DType::kF32 ? 0 : block);
    for (size_t b = 0; b * block_elems < snap.head_keys.size(); ++b) {
      const float* keys = snap.head_keys.data() + b * block_elems;
      const void* from = keys;
      if (!stored.empty()) {
        convert_from_f32(options_.kv_dtype, keys, stored.data(), block_elems);
        from = stored.data();
      }
      if (Status st = write_block(s.head_tier, s.head_blocks[b], from, block); !st.is_ok()) return undo(st);
    }
    if (Status st = upload_boundary_fused(*backend_, snap, fit.fused_row, 0, s.boundary_fused); !st.is_ok()) {
      return undo(st);
    }
    if (Status st = resume_fused_at(s, s.boundary_fused.back()); !st.is_ok()) return undo(st);
  } else if (method == SparseMethod::kQuest) {
    ensure_layers(s);
    for (size_t l = 0; l < s.layers.size(); ++l) {
      s.layers[l].page_min = snap.quest_min[l];
      s.layers[l].page_max = snap.quest_max[l];
    }
  }
  s.length = snap.tokens;
  return id;
}

Result<SeqId> KvMemory::import_prefix_after(SeqId source, int64_t prefix_tokens, const PrefixSnapshot& rest,
                                            int64_t final_length) {
  const SparseMethod method = options_.sparse.method;
  SnapshotFit fit = layout_fit(*kv_, method, fork_granularity(), "import_prefix_after");
  fit.max_context = max_context_;
  fit.after = prefix_tokens;
  fit.appended = true;
  fit.fused_row = static_cast<size_t>(3 * config().dim);
  if (method == SparseMethod::kSpeContext) {  // the tokens' rows only
    fit.head_keys = head_row_elements() * static_cast<size_t>(rest.tokens);
  } else if (method == SparseMethod::kQuest) {
    fit.quest_bounds = quest_bound_elements(rest.tokens);
  }
  SPX_RETURN_IF_ERROR(check_snapshot(rest, fit));
  const int64_t length = prefix_tokens + rest.tokens;
  // The source and its prefix are checked by fork_sequence (nothing made when it refuses).
  if (const auto src = sequences_.find(source); src != sequences_.end()) {
    SPX_RETURN_IF_ERROR(check_prefix(source, src->second, prefix_tokens, "import_prefix_after"));
  }
  SPX_RETURN_IF_ERROR_CTX(replan_with(replan_, sequences_, length), "import_prefix_after");
  SPX_ASSIGN_OR_RETURN(const SeqId id, fork_sequence(source, prefix_tokens, final_length));
  KvSequence& s = sequences_.at(id);
  auto undo = [&](const Status& st) -> Status {
    (void)remove_sequence(id);
    return st.with_context("import_prefix_after");
  };
  const auto write = [this](TierId tier, uint64_t offset, const void* host, uint64_t bytes) {
    return write_block(tier, offset, host, bytes);
  };
  const size_t first = s.pages.size();  // prefix_tokens / page_size: the fork's shared pages
  std::vector<PageId> fresh;
  if (Status st = reserve_pages(s, length, fresh); !st.is_ok()) return undo(st);
  if (Status st = write_snapshot_kv(rest, *kv_, std::span<const PageId>(s.pages).subspan(first), write);
      !st.is_ok()) {
    return undo(st);
  }
  if (method == SparseMethod::kSpeContext) {
    if (Status st = ensure_head_capacity(s, length); !st.is_ok()) return undo(st);
    // Row t of the sequence is row t % T of block t / T: the rows from prefix_tokens on, a run
    // per block (the first may start inside the fork's last block).
    // The snapshot's f32 rows rounded to the KV dtype, a run at a time.
    const uint64_t row_bytes = head_row_bytes();
    std::vector<std::byte> stored(options_.kv_dtype == DType::kF32 ? 0 : head_block_bytes());
    for (int64_t t = prefix_tokens; t < length;) {
      const int64_t in_block = t % head_block_tokens_;
      const int64_t rows = std::min(head_block_tokens_ - in_block, length - t);
      const float* keys = rest.head_keys.data() + static_cast<size_t>(t - prefix_tokens) * head_row_elements();
      const void* from = keys;
      if (!stored.empty()) {
        convert_from_f32(options_.kv_dtype, keys, stored.data(), static_cast<size_t>(rows) * head_row_elements());
        from = stored.data();
      }
      if (Status st = write_block(s.head_tier, s.head_blocks[static_cast<size_t>(t / head_block_tokens_)] +
                                                   static_cast<uint64_t>(in_block) * row_bytes,
                                  from, static_cast<uint64_t>(rows) * row_bytes);
          !st.is_ok()) {
        return undo(st);
      }
      t += rows;
    }
    if (Status st = upload_boundary_fused(*backend_, rest, fit.fused_row, first, s.boundary_fused);
        !st.is_ok()) {
      return undo(st);
    }
    if (Status st = resume_fused_at(s, s.boundary_fused.back()); !st.is_ok()) return undo(st);
  } else if (method == SparseMethod::kQuest) {
    for (size_t l = 0; l < s.layers.size(); ++l) {  // the fork's bounds of its prefix, then rest's
      s.layers[l].page_min.insert(s.layers[l].page_min.end(), rest.quest_min[l].begin(),
                                  rest.quest_min[l].end());
      s.layers[l].page_max.insert(s.layers[l].page_max.end(), rest.quest_max[l].begin(),
                                  rest.quest_max[l].end());
    }
  }
  s.length = length;
  return id;
}

Status KvMemory::write_block(TierId tier, uint64_t offset, const void* host, uint64_t bytes) {
  if (tier == TierId(0) && backend_->memory_kind() != MemoryKind::kHost) {
    return backend_->upload(kv_->address(tier, offset), host, bytes);
  }
  if (host_visible(tier)) {
    std::memcpy(kv_->address(tier, offset), host, bytes);
    return Status::ok();
  }
  return through_bounce(tier, offset, const_cast<void*>(host), bytes, CopyDirection::kStore);
}

Status KvMemory::through_bounce(TierId tier, uint64_t offset, void* host, uint64_t bytes,
                                CopyDirection direction) {
  // A remote tier: through the bounce buffer and the copy engine, whose single copy thread runs
  // each transfer after every one submitted before it (a read sees the stores before it).
  CopyQueue* copies = options_.tiering.copies.get();
  const bool store = direction == CopyDirection::kStore;
  if (copies == nullptr || !bounce_) {
    return internal_error(std::string("no path to ") + (store ? "write" : "read") + " tier " +
                          std::to_string(tier.value()));
  }
  constexpr uint64_t kBounceBytes = uint64_t{4} << 20;
  auto* at = static_cast<std::byte*>(host);
  for (uint64_t done = 0; done < bytes; done += kBounceBytes) {
    const uint64_t n = std::min(kBounceBytes, bytes - done);
    if (store) std::memcpy(bounce_.get(), at + done, n);
    const TransferRequest r = store ? TransferRequest{bounce_tier_, 0, tier, offset + done, n}
                                    : TransferRequest{tier, offset + done, bounce_tier_, 0, n};
    SPX_ASSIGN_OR_RETURN(CopyTicket t, copies->submit(LayerId(0), direction, {r}));
    SPX_RETURN_IF_ERROR(copies->wait(t));
    if (!store) std::memcpy(at + done, bounce_.get(), n);
  }
  return Status::ok();
}

}  // namespace specontext
