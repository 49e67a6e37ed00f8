// Prefix offloading: a sequence's whole pages out of the KV cache into host memory and back
// (PrefixSnapshot). The scheduler keeps evicted cached prefixes this way (serving/scheduler.h).
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "core/engine/engine.h"

namespace specontext {
namespace {

class Fnv1a {
 public:
  void add_bytes(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) hash_ = (hash_ ^ p[i]) * 0x100000001b3ULL;
  }
  template <typename T>
  void add(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    add_bytes(&v, sizeof(T));
  }
  void add(const std::vector<float>& v) {
    add(v.size());
    add_bytes(v.data(), v.size() * sizeof(float));
  }
  // Shape, dtype and kPieces evenly spaced pieces of the data (a matrix of a big model is
  // hundreds of MB: hashing all of them would take seconds at start-up).
  void add(const WeightMatrix& m) {
    add(m.dtype);
    add(m.rows);
    add(m.cols);
    if (m.empty()) return;
    constexpr size_t kPieces = 8, kPiece = 256;
    const size_t n = m.bytes();
    const auto* data = static_cast<const std::byte*>(m.data);
    if (n <= kPieces * kPiece) {
      add_bytes(data, n);
      return;
    }
    for (size_t i = 0; i < kPieces; ++i) add_bytes(data + (n - kPiece) * i / (kPieces - 1), kPiece);
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 0xcbf29ce484222325ULL;
};

void add_rope_scaling(Fnv1a& h, const RopeScaling& r) {
  h.add(r.type);
  h.add(r.factor);
  h.add(r.low_freq_factor);
  h.add(r.high_freq_factor);
  h.add(r.original_max_position_embeddings);
  h.add(r.beta_fast);
  h.add(r.beta_slow);
  h.add(r.attention_factor);
}

}  // namespace

uint64_t Engine::kv_identity() const {
  Fnv1a h;
  const ModelConfig& c = model_->config;
  for (int64_t v : {static_cast<int64_t>(c.arch), c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                    c.head_dim, c.vocab_size, c.max_seq_len, static_cast<int64_t>(c.rope_style)}) {
    h.add(v);
  }
  h.add(c.rope_theta);
  add_rope_scaling(h, c.rope_scaling);
  h.add(c.rope_freq_factors);
  h.add(c.norm_eps);
  for (bool b : {c.tie_embeddings, c.attention_bias, c.qk_norm}) h.add(b);
  h.add(model_->tok_embeddings);
  for (const LayerWeights& l : model_->layers) {
    for (const WeightMatrix* m : l.matrices()) h.add(*m);
    for (const Vec* v : {&l.attn_norm, &l.bq, &l.bk, &l.bv, &l.q_norm, &l.k_norm, &l.ffn_norm}) h.add(*v);
  }
  h.add(model_->final_norm);
  h.add(model_->lm_head);
  h.add(max_context_);
  h.add(options_.page_size);
  h.add(options_.kv_dtype);
  h.add(options_.sparse.method);
  h.add(options_.prefix_sharing);
  if (const RetrievalHead* head = options_.retrieval_head.get()) {
    const RetrievalHeadConfig& rc = head->config;
    for (int64_t v : {rc.hidden, rc.n_heads, rc.n_kv_heads, rc.head_dim, rc.trained_context,
                      rc.fused_layers[0], rc.fused_layers[1], rc.fused_layers[2]}) {
      h.add(v);
    }
    h.add(rc.rope_theta);
    add_rope_scaling(h, rc.rope_scaling);
    h.add(rc.norm_eps);
    h.add(head->fc);
    h.add(head->input_norm);
    h.add(head->hidden_norm);
    h.add(head->wq);
    h.add(head->wk);
  }
  if (options_.communicator != nullptr) {
    h.add(options_.communicator->rank());
    h.add(options_.communicator->world_size());
  }
  return h.value();
}

uint64_t PrefixSnapshot::bytes() const {
  uint64_t n = kv.size() + head_keys.size() * sizeof(float);
  for (const auto& f : boundary_fused) n += f.size() * sizeof(float);
  for (const auto& b : quest_min) n += b.size() * sizeof(float);
  for (const auto& b : quest_max) n += b.size() * sizeof(float);
  return n;
}

Status Engine::read_block(TierId tier, uint64_t offset, void* host, uint64_t bytes) {
  if (tier == TierId(0) && backend_->memory_kind() != MemoryKind::kHost) {
    return backend_->download(host, kv_->address(tier, offset), bytes);
  }
  if (host_visible(tier)) {
    std::memcpy(host, kv_->address(tier, offset), bytes);
    return Status::ok();
  }
  return through_bounce(tier, offset, host, bytes, CopyDirection::kLoad);
}

Result<PrefixSnapshot> Engine::export_prefix(SeqId seq, int64_t tokens) {
  const auto it = sequences_.find(seq);
  if (it == sequences_.end()) return invalid_argument("export_prefix: unknown sequence " + std::to_string(seq.value()));
  const Sequence& s = it->second;
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
    const uint64_t block = head_block_bytes();
    const auto blocks = static_cast<size_t>((tokens + head_block_tokens_ - 1) / head_block_tokens_);
    snap.head_keys.resize(blocks * block / sizeof(float));
    for (size_t b = 0; b < blocks; ++b) {
      SPX_RETURN_IF_ERROR_CTX(read_block(s.head_tier, s.head_blocks[b], snap.head_keys.data() + b * block / sizeof(float), block),
                              "export_prefix");
    }
    const size_t fused_row = static_cast<size_t>(3 * config().dim);
    snap.boundary_fused.resize(pages);
    for (size_t p = 0; p < pages; ++p) {
      if (!s.boundary_fused[p]) continue;
      snap.boundary_fused[p].resize(fused_row);
      SPX_RETURN_IF_ERROR(backend_->download(snap.boundary_fused[p].data(), s.boundary_fused[p].get(), fused_row * sizeof(float)));
    }
  } else if (method == SparseMethod::kQuest) {
    if (s.layers.size() != static_cast<size_t>(snap.layers)) {
      return invalid_argument("export_prefix: sequence " + std::to_string(seq.value()) + " has no Quest bounds");
    }
    const auto bounds = static_cast<std::ptrdiff_t>(quest_bound_elements(tokens));
    for (const LayerSparseState& ls : s.layers) {
      snap.quest_min.emplace_back(ls.page_min.begin(), ls.page_min.begin() + bounds);
      snap.quest_max.emplace_back(ls.page_max.begin(), ls.page_max.begin() + bounds);
    }
  }
  return snap;
}

Result<SeqId> Engine::import_prefix(const PrefixSnapshot& snap, int64_t final_length) {
  const auto mismatch = [](const std::string& field, int64_t got, int64_t want) {
    return invalid_argument("import_prefix: snapshot field '" + field + "' is " + std::to_string(got) +
                            ", this engine needs " + std::to_string(want));
  };
  const SparseMethod method = options_.sparse.method;
  if (snap.page_size != kv_->page_size()) return mismatch("page_size", snap.page_size, kv_->page_size());
  if (snap.layers != kv_->n_layers()) return mismatch("layers", snap.layers, kv_->n_layers());
  if (snap.page_bytes != kv_->page_bytes()) {
    return mismatch("page_bytes", static_cast<int64_t>(snap.page_bytes), static_cast<int64_t>(kv_->page_bytes()));
  }
  if (snap.kv_dtype != kv_->dtype()) {
    return invalid_argument("import_prefix: snapshot field 'kv_dtype' is " + std::string(dtype_name(snap.kv_dtype)) +
                            ", this engine stores " + std::string(dtype_name(kv_->dtype())));
  }
  if (snap.method != method) {
    return mismatch("method", static_cast<int64_t>(snap.method), static_cast<int64_t>(method));
  }
  const int64_t unit = fork_granularity();
  if (snap.tokens <= 0 || snap.tokens % unit != 0 || snap.tokens > max_context_) {
    return invalid_argument("import_prefix: snapshot field 'tokens' is " + std::to_string(snap.tokens) +
                            ": it must be a positive multiple of " + std::to_string(unit) + " up to " +
                            std::to_string(max_context_));
  }
  const auto pages = static_cast<size_t>(snap.tokens / kv_->page_size());
  if (snap.kv.size() != static_cast<size_t>(snap.layers) * pages * snap.page_bytes) {
    return mismatch("kv", static_cast<int64_t>(snap.kv.size()),
                    static_cast<int64_t>(static_cast<size_t>(snap.layers) * pages * snap.page_bytes));
  }
  const size_t fused_row = static_cast<size_t>(3 * config().dim);
  if (method == SparseMethod::kSpeContext) {
    if (!options_.prefix_sharing) {
      return invalid_argument("import_prefix: SpeContext needs EngineOptions::prefix_sharing");
    }
    const auto blocks = static_cast<size_t>((snap.tokens + head_block_tokens_ - 1) / head_block_tokens_);
    if (snap.head_keys.size() != blocks * head_block_bytes() / sizeof(float)) {
      return mismatch("head_keys", static_cast<int64_t>(snap.head_keys.size()),
                      static_cast<int64_t>(blocks * head_block_bytes() / sizeof(float)));
    }
    if (snap.boundary_fused.size() != pages) {
      return mismatch("boundary_fused", static_cast<int64_t>(snap.boundary_fused.size()), static_cast<int64_t>(pages));
    }
    for (const auto& f : snap.boundary_fused) {
      if (!f.empty() && f.size() != fused_row) {
        return mismatch("boundary_fused", static_cast<int64_t>(f.size()), static_cast<int64_t>(fused_row));
      }
    }
    if (snap.boundary_fused.back().empty()) {
      return invalid_argument("import_prefix: snapshot field 'boundary_fused' has no features at its last token");
    }
  } else if (method == SparseMethod::kQuest) {
    const size_t bounds = quest_bound_elements(snap.tokens);
    if (snap.quest_min.size() != static_cast<size_t>(snap.layers) || snap.quest_max.size() != snap.quest_min.size()) {
      return mismatch("quest_min", static_cast<int64_t>(snap.quest_min.size()), snap.layers);
    }
    for (size_t l = 0; l < snap.quest_min.size(); ++l) {
      if (snap.quest_min[l].size() != bounds || snap.quest_max[l].size() != bounds) {
        return mismatch("quest_min", static_cast<int64_t>(snap.quest_min[l].size()), static_cast<int64_t>(bounds));
      }
    }
  }

  if (options_.tiering.policy) {
    // As fill_synthetic: the placement for the length the new sequence has at once.
    std::vector<int64_t> lens;
    for (const auto& [id, other] : sequences_) lens.push_back(other.length);
    lens.push_back(snap.tokens);
    SPX_RETURN_IF_ERROR_CTX(rebalance_for(lens), "import_prefix");
  }
  SPX_ASSIGN_OR_RETURN(const SeqId id, add_sequence(final_length));
  Sequence& s = sequences_.at(id);
  auto undo = [&](const Status& st) -> Status {
    (void)remove_sequence(id);
    return st.with_context("import_prefix");
  };
  std::vector<PageId> fresh;
  if (Status st = reserve_pages(s, snap.tokens, fresh); !st.is_ok()) return undo(st);
  const std::byte* in = snap.kv.data();
  for (int64_t l = 0; l < snap.layers; ++l) {
    for (size_t p = 0; p < pages; ++p, in += snap.page_bytes) {
      const PageLocation loc = kv_->locate(LayerId(static_cast<int32_t>(l)), s.pages[p]);
      if (Status st = write_block(loc.tier, loc.offset, in, snap.page_bytes); !st.is_ok()) return undo(st);
    }
  }
  if (method == SparseMethod::kSpeContext) {
    if (Status st = ensure_head_capacity(s, snap.tokens); !st.is_ok()) return undo(st);
    const uint64_t block = head_block_bytes();
    for (size_t b = 0; b * block < snap.head_keys.size() * sizeof(float); ++b) {
      const float* keys = snap.head_keys.data() + b * block / sizeof(float);
      if (Status st = write_block(s.head_tier, s.head_blocks[b], keys, block); !st.is_ok()) return undo(st);
    }
    s.boundary_fused.resize(pages);
    for (size_t p = 0; p < pages; ++p) {
      if (snap.boundary_fused[p].empty()) continue;
      auto mem = backend_->allocate(fused_row * sizeof(float));
      if (!mem.is_ok()) return undo(mem.status());
      if (Status st = backend_->upload(mem->get(), snap.boundary_fused[p].data(), fused_row * sizeof(float)); !st.is_ok()) {
        return undo(st);
      }
      s.boundary_fused[p] = *mem;
    }
    if (Status st = resume_fused_at(s, s.boundary_fused.back()); !st.is_ok()) return undo(st);
  } else if (method == SparseMethod::kQuest) {
    if (Status st = ensure_sparse_state(s); !st.is_ok()) return undo(st);
    for (size_t l = 0; l < s.layers.size(); ++l) {
      s.layers[l].page_min = snap.quest_min[l];
      s.layers[l].page_max = snap.quest_max[l];
    }
  }
  s.length = snap.tokens;
  return id;
}

}  // namespace specontext
