#include "core/engine.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <unordered_set>

namespace specontext {

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
  if (options.page_size <= 0) return invalid_argument("page_size must be positive");
  std::unique_ptr<Engine> e(new Engine());
  e->model_ = std::move(model);
  e->backend_ = std::move(backend);
  SPX_RETURN_IF_ERROR(e->backend_->place_weights(*e->model_));
  e->options_ = options;
  e->max_context_ = options.max_context > 0 ? options.max_context : c.max_seq_len;
  if (e->max_context_ <= 0) return invalid_argument("model has no max_seq_len; set max_context");
  const int64_t pages_per_seq = (e->max_context_ + options.page_size - 1) / options.page_size;
  const int64_t n_pages = options.kv_pages > 0 ? options.kv_pages : pages_per_seq * options.max_sequences;
  SPX_ASSIGN_OR_RETURN(e->kv_, KvCache::create(c, *e->backend_, options.page_size, n_pages));
  e->rope_ = make_rope_params(c);
  e->fused_layers_ = eagle3_fused_layers(c.n_layers);
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
  return e;
}

Result<SeqId> Engine::add_sequence() {
  if (live_sequences() >= options_.max_sequences) {
    return resource_exhausted("all " + std::to_string(options_.max_sequences) +
                              " sequence slots are in use");
  }
  const SeqId id(next_seq_id_++);
  sequences_.emplace(id, Sequence{});
  return id;
}

Status Engine::remove_sequence(SeqId seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return invalid_argument("unknown sequence " + std::to_string(seq.value()));
  for (PageId p : it->second.pages) kv_->free_page(p);
  sequences_.erase(it);
  return Status::ok();
}

int64_t Engine::sequence_length(SeqId seq) const {
  auto it = sequences_.find(seq);
  return it == sequences_.end() ? 0 : it->second.length;
}

int64_t Engine::kv_bytes_in_use() const { return kv_->used_pages() * kv_->page_bytes_all_layers(); }

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

Result<StepOutput> Engine::forward(std::span<const StepRequest> requests) {
  const ModelConfig& c = config();
  const Model& m = *model_;
  Backend& be = *backend_;

  // ---- validate everything before touching state ----
  if (requests.empty()) return invalid_argument("forward: empty batch");
  int64_t total = 0;
  std::unordered_set<SeqId> seen;
  for (const StepRequest& r : requests) {
    auto it = sequences_.find(r.seq);
    if (it == sequences_.end()) return invalid_argument("forward: unknown sequence " + std::to_string(r.seq.value()));
    if (!seen.insert(r.seq).second) {
      return invalid_argument("forward: sequence " + std::to_string(r.seq.value()) + " appears twice in one batch");
    }
    if (r.tokens.empty()) return invalid_argument("forward: request without tokens");
    for (TokenId t : r.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return invalid_argument("forward: token id " + std::to_string(t) + " outside the vocabulary [0, " +
                                std::to_string(c.vocab_size) + ")");
      }
    }
    const int64_t new_len = it->second.length + static_cast<int64_t>(r.tokens.size());
    if (new_len > max_context_) {
      return out_of_range("sequence " + std::to_string(r.seq.value()) + " would hold " + std::to_string(new_len) +
                          " tokens, beyond the context limit of " + std::to_string(max_context_));
    }
    total += static_cast<int64_t>(r.tokens.size());
  }

  // ---- reserve pages (all or nothing) ----
  std::vector<PageId> newly_allocated;
  for (const StepRequest& r : requests) {
    Sequence& s = sequences_[r.seq];
    Status st = reserve_pages(s, s.length + static_cast<int64_t>(r.tokens.size()), newly_allocated);
    if (!st.is_ok()) {
      // Roll back: pages taken in this call go back to the pool.
      std::unordered_set<PageId> fresh(newly_allocated.begin(), newly_allocated.end());
      for (auto& [id, seq] : sequences_) {
        while (!seq.pages.empty() && fresh.count(seq.pages.back())) seq.pages.pop_back();
      }
      for (PageId p : newly_allocated) kv_->free_page(p);
      return st;
    }
  }

  // ---- gather tokens and positions ----
  const int64_t dim = c.dim, qd = c.q_dim(), kvd = c.kv_dim(), hd = c.hidden_dim;
  ids_.resize(static_cast<size_t>(total));
  positions_.resize(static_cast<size_t>(total));
  items_.resize(requests.size());
  k_ptrs_.resize(requests.size());
  v_ptrs_.resize(requests.size());
  std::vector<Sequence*> seqs(requests.size());
  std::vector<bool> sparse(requests.size());
  int64_t row = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const StepRequest& r = requests[i];
    seqs[i] = &sequences_[r.seq];
    const int64_t start = seqs[i]->length;
    items_[i].token_offset = row;
    items_[i].n_tokens = static_cast<int64_t>(r.tokens.size());
    items_[i].start_pos = start;
    sparse[i] = decodes_sparse(*seqs[i], items_[i].n_tokens);
    for (size_t j = 0; j < r.tokens.size(); ++j) {
      ids_[static_cast<size_t>(row)] = r.tokens[j];
      positions_[static_cast<size_t>(row)] = start + static_cast<int64_t>(j);
      ++row;
    }
  }
  auto fit = [](std::vector<float>& v, int64_t n) { v.resize(static_cast<size_t>(n)); return v.data(); };
  float* x = fit(x_, total * dim);
  float* xb = fit(xb_, total * dim);
  float* q = fit(q_, total * qd);
  float* k = fit(k_, total * kvd);
  float* v = fit(v_, total * kvd);
  float* att = fit(att_, total * qd);
  float* tmp = fit(tmp_, total * dim);
  float* gate = fit(gate_, total * hd);
  float* up = fit(up_, total * hd);
  const bool capture_fused = wants_fused();
  float* fused = capture_fused ? fit(fused_, total * 3 * dim) : nullptr;

  // ---- sparse decode: selections that serve every layer, made before layer 0 ----
  const SparseMethod method = options_.sparse.method;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (!sparse[i]) continue;
    Sequence& s = *seqs[i];
    SPX_RETURN_IF_ERROR(ensure_sparse_state(s));
    const int64_t length = items_[i].start_pos + 1;  // the current token is attended too
    if (method == SparseMethod::kSpeContext) {
      const RetrievalHead& head = *options_.retrieval_head;
      float* hq = fit(head_q_, head.config.n_heads * head.config.head_dim);
      SPX_RETURN_IF_ERROR(run_head(s, &ids_[static_cast<size_t>(items_[i].token_offset)], s.last_fused.data(),
                                   items_[i].start_pos, 1, hq));
      float* sc = fit(scores_, head.config.n_heads * length);
      retrieval_scores(head, hq, s.head_k.data(), length, sc);
      select_tokens(std::span<const float>(sc, static_cast<size_t>(head.config.n_heads * length)),
                    head.config.n_heads, c.n_kv_heads, length, options_.sparse.selection, s.shared_selection);
    } else if (method == SparseMethod::kStreaming) {
      select_streaming(c.n_kv_heads, length, options_.sparse.selection, s.shared_selection);
    }
    if (shares_selection(method)) {
      s.shared_loads.clear();
      s.shared_stats = s.shared_ws.update(s.shared_selection, s.shared_loads);
    }
  }

  // ---- layers ----
  Communicator* comm = options_.communicator.get();
  SPX_RETURN_IF_ERROR(be.embed(ids_.data(), total, m.tok_embeddings, x));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layers[static_cast<size_t>(l)];
    const LayerId layer(static_cast<int32_t>(l));
    if (capture_fused) {
      for (int slot = 0; slot < 3; ++slot) {
        if (fused_layers_[static_cast<size_t>(slot)] != l) continue;
        for (int64_t r = 0; r < total; ++r) std::copy_n(x + r * dim, dim, fused + (r * 3 + slot) * dim);
      }
    }
    SPX_RETURN_IF_ERROR(be.rmsnorm(x, w.attn_norm.data(), total, dim, c.norm_eps, xb));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.wq, w.bq.empty() ? nullptr : w.bq.data(), q));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.wk, w.bk.empty() ? nullptr : w.bk.data(), k));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.wv, w.bv.empty() ? nullptr : w.bv.data(), v));
    if (c.qk_norm) {
      SPX_RETURN_IF_ERROR(be.rmsnorm(q, w.q_norm.data(), total * c.n_heads, c.head_dim, c.norm_eps, q));
      SPX_RETURN_IF_ERROR(be.rmsnorm(k, w.k_norm.data(), total * c.n_kv_heads, c.head_dim, c.norm_eps, k));
    }
    SPX_RETURN_IF_ERROR(be.rope(q, total, c.n_heads, positions_.data(), rope_));
    SPX_RETURN_IF_ERROR(be.rope(k, total, c.n_kv_heads, positions_.data(), rope_));
    dense_items_.clear();
    sparse_items_.clear();
    sparse_index_.clear();
    for (size_t i = 0; i < requests.size(); ++i) {
      items_[i].kv = kv_->view(layer, seqs[i]->pages, k_ptrs_[i], v_ptrs_[i]);
      const int64_t off = items_[i].token_offset;
      SPX_RETURN_IF_ERROR(be.kv_append(k + off * kvd, v + off * kvd, items_[i].n_tokens,
                                       items_[i].start_pos, items_[i].kv));
      if (method == SparseMethod::kQuest) {
        update_quest_bounds(*seqs[i], layer, k + off * kvd, items_[i].start_pos, items_[i].n_tokens);
      }
      if (!sparse[i]) dense_items_.push_back(items_[i]);
    }
    if (observer_ != nullptr) observer_->on_attention(layer, q, items_);
    if (!dense_items_.empty()) {
      SPX_RETURN_IF_ERROR(be.attention(q, dense_items_.data(), static_cast<int64_t>(dense_items_.size()),
                                       c.n_heads, att));
    }
    selections_.clear();
    for (size_t i = 0; i < requests.size(); ++i) {
      if (!sparse[i]) continue;
      Sequence& s = *seqs[i];
      LayerSparseState& ls = s.layers[static_cast<size_t>(l)];
      const Selection* sel = nullptr;
      SPX_RETURN_IF_ERROR(select_for_layer(s, layer, items_[i], q + items_[i].token_offset * qd, &sel));
      selections_.push_back(sel);
      const bool shared = shares_selection(method);
      const ElasticWorkingSet& ws = shared ? s.shared_ws : ls.ws;
      const std::vector<GatherEntry>& loads = shared ? s.shared_loads : loads_;
      ElasticStats es = s.shared_stats;
      if (!shared) {
        loads_.clear();
        es = ls.ws.update(*sel, loads_);
      }
      WorkingSetView wsv;
      wsv.k = static_cast<float*>(ls.ws_k.get());
      wsv.v = static_cast<float*>(ls.ws_v.get());
      wsv.kv_heads = c.n_kv_heads;
      wsv.slots = ws.slots();
      wsv.head_dim = c.head_dim;
      wsv.counts = ws.counts().data();
      if (!loads.empty()) {
        SPX_RETURN_IF_ERROR(be.kv_gather(items_[i].kv, loads.data(), static_cast<int64_t>(loads.size()), wsv));
      }
      const int64_t token_bytes = 2 * c.head_dim * 4;
      sparse_stats_.tokens_selected += es.tokens_selected;
      sparse_stats_.tokens_loaded += es.tokens_loaded;
      sparse_stats_.tokens_kept += es.tokens_kept;
      sparse_stats_.bytes_loaded += es.tokens_loaded * token_bytes;
      sparse_stats_.bytes_full_reload += es.tokens_selected * token_bytes;
      SparseAttentionItem si;
      si.token_offset = items_[i].token_offset;
      si.n_tokens = items_[i].n_tokens;
      si.ws = wsv;
      sparse_items_.push_back(si);
      sparse_index_.push_back(i);
    }
    if (!sparse_items_.empty()) {
      if (observer_ != nullptr) {
        std::vector<AttentionItem> sparse_attention_items;
        for (size_t idx : sparse_index_) sparse_attention_items.push_back(items_[idx]);
        observer_->on_sparse_selection(layer, sparse_attention_items, selections_);
      }
      SPX_RETURN_IF_ERROR(be.attention_sparse(q, sparse_items_.data(), static_cast<int64_t>(sparse_items_.size()),
                                              c.n_heads, att));
    }
    SPX_RETURN_IF_ERROR(be.matmul(att, total, w.wo, nullptr, tmp));
    if (comm != nullptr) SPX_RETURN_IF_ERROR(comm->all_reduce_sum(tmp, total * dim));
    SPX_RETURN_IF_ERROR(be.add(x, tmp, total * dim));
    SPX_RETURN_IF_ERROR(be.rmsnorm(x, w.ffn_norm.data(), total, dim, c.norm_eps, xb));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.w_gate, nullptr, gate));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.w_up, nullptr, up));
    SPX_RETURN_IF_ERROR(be.swiglu(gate, up, total * hd, gate));
    SPX_RETURN_IF_ERROR(be.matmul(gate, total, w.w_down, nullptr, tmp));
    if (comm != nullptr) SPX_RETURN_IF_ERROR(comm->all_reduce_sum(tmp, total * dim));
    SPX_RETURN_IF_ERROR(be.add(x, tmp, total * dim));
  }
  for (size_t i = 0; i < requests.size(); ++i) sparse_stats_.sparse_steps += sparse[i] ? 1 : 0;

  // ---- retrieval head keys of the tokens not yet fed to it; fused state for the next step ----
  if (capture_fused) {
    if (observer_ != nullptr) observer_->on_fused_hidden(fused, total, items_);
    const int64_t fd = 3 * dim;
    for (size_t i = 0; i < requests.size(); ++i) {
      Sequence& s = *seqs[i];
      const AttentionItem& it = items_[i];
      if (method == SparseMethod::kSpeContext && !sparse[i]) {
        // fused(p−1) of each row: the stored last one for the first row, this forward's rows after.
        std::vector<float> prev(static_cast<size_t>(it.n_tokens * fd));
        std::copy(s.last_fused.begin(), s.last_fused.end(), prev.begin());
        if (it.n_tokens > 1) {
          std::copy_n(fused + it.token_offset * fd, (it.n_tokens - 1) * fd, prev.begin() + fd);
        }
        const auto& hc = options_.retrieval_head->config;
        std::vector<float> hq(static_cast<size_t>(it.n_tokens * hc.n_heads * hc.head_dim));
        SPX_RETURN_IF_ERROR(run_head(s, &ids_[static_cast<size_t>(it.token_offset)], prev.data(), it.start_pos,
                                     it.n_tokens, hq.data()));
      }
      s.last_fused.assign(fused + (it.token_offset + it.n_tokens - 1) * fd,
                          fused + (it.token_offset + it.n_tokens) * fd);
    }
  }

  // ---- logits for the rows asked for ----
  StepOutput out;
  out.vocab = c.vocab_size;
  out.first_row.assign(requests.size(), -1);
  out.n_rows.assign(requests.size(), 0);
  int64_t n_out = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const int64_t n = requests[i].logits == LogitsMode::kAll ? items_[i].n_tokens
                      : requests[i].logits == LogitsMode::kLast ? 1 : 0;
    if (n > 0) out.first_row[i] = n_out;
    out.n_rows[i] = n;
    n_out += n;
  }
  if (n_out > 0) {
    float* rows = fit(rows_, n_out * dim);
    int64_t r = 0;
    for (size_t i = 0; i < requests.size(); ++i) {
      const int64_t first = items_[i].token_offset + items_[i].n_tokens - out.n_rows[i];
      std::copy_n(x + first * dim, out.n_rows[i] * dim, rows + r * dim);
      r += out.n_rows[i];
    }
    SPX_RETURN_IF_ERROR(be.rmsnorm(rows, m.final_norm.data(), n_out, dim, c.norm_eps, rows));
    out.logits.resize(static_cast<size_t>(n_out * c.vocab_size));
    SPX_RETURN_IF_ERROR(be.matmul(rows, n_out, m.lm_head, nullptr, out.logits.data()));
  }
  for (size_t i = 0; i < requests.size(); ++i) seqs[i]->length += items_[i].n_tokens;
  return out;
}

bool Engine::shares_selection(SparseMethod m) {
  return m == SparseMethod::kSpeContext || m == SparseMethod::kStreaming;
}

bool Engine::wants_fused() const {
  return observer_ != nullptr || options_.sparse.method == SparseMethod::kSpeContext;
}

bool Engine::decodes_sparse(const Sequence& s, int64_t n_tokens) const {
  return options_.sparse.method != SparseMethod::kDense && n_tokens == 1 &&
         s.length + 1 > options_.sparse.selection.budget;
}

Status Engine::ensure_sparse_state(Sequence& s) {
  if (!s.layers.empty()) return Status::ok();
  const ModelConfig& c = config();
  const int64_t slots = options_.sparse.selection.budget;
  const size_t bytes = static_cast<size_t>(c.n_kv_heads * slots * c.head_dim) * sizeof(float);
  std::vector<LayerSparseState> layers(static_cast<size_t>(c.n_layers));
  if (shares_selection(options_.sparse.method)) s.shared_ws = ElasticWorkingSet(c.n_kv_heads, slots);
  for (auto& ls : layers) {
    if (!shares_selection(options_.sparse.method)) ls.ws = ElasticWorkingSet(c.n_kv_heads, slots);
    SPX_ASSIGN_OR_RETURN(ls.ws_k, backend_->allocate(bytes));
    SPX_ASSIGN_OR_RETURN(ls.ws_v, backend_->allocate(bytes));
  }
  s.layers = std::move(layers);
  return Status::ok();
}

Status Engine::run_head(Sequence& s, const TokenId* tokens, const float* fused_prev, int64_t start_pos,
                        int64_t n, float* q_out) {
  const RetrievalHead& head = *options_.retrieval_head;
  const int64_t kd = head.config.n_kv_heads * head.config.head_dim;
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) pos[static_cast<size_t>(j)] = start_pos + j;
  // The head cache holds one row per cached token; a sequence's rows are appended in order.
  if (static_cast<int64_t>(s.head_k.size()) != start_pos * kd) {
    return internal_error("retrieval head cache holds " + std::to_string(s.head_k.size() / kd) +
                          " tokens, expected " + std::to_string(start_pos));
  }
  s.head_k.resize(static_cast<size_t>((start_pos + n) * kd));
  return retrieval_qk(*backend_, head, head_rope_, model_->tok_embeddings, tokens, fused_prev, pos.data(), n, q_out,
                      s.head_k.data() + start_pos * kd);
}

void Engine::update_quest_bounds(Sequence& s, LayerId layer, const float* k_rows, int64_t start_pos, int64_t n) {
  const ModelConfig& c = config();
  if (s.layers.empty()) {
    if (!ensure_sparse_state(s).is_ok()) return;  // allocation failure surfaces at the sparse step
  }
  LayerSparseState& ls = s.layers[static_cast<size_t>(layer.value())];
  const int64_t ps = options_.sparse.quest_page_size, kvd = c.kv_dim();
  const int64_t pages = (start_pos + n + ps - 1) / ps;
  if (static_cast<int64_t>(ls.page_min.size()) < pages * kvd) {
    ls.page_min.resize(static_cast<size_t>(pages * kvd), INFINITY);
    ls.page_max.resize(static_cast<size_t>(pages * kvd), -INFINITY);
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t page = (start_pos + j) / ps;
    for (int64_t e = 0; e < kvd; ++e) {
      float& mn = ls.page_min[static_cast<size_t>(page * kvd + e)];
      float& mx = ls.page_max[static_cast<size_t>(page * kvd + e)];
      mn = std::min(mn, k_rows[j * kvd + e]);
      mx = std::max(mx, k_rows[j * kvd + e]);
    }
  }
}

Status Engine::select_for_layer(Sequence& s, LayerId layer, const AttentionItem& item, const float* q,
                                const Selection** selection) {
  const ModelConfig& c = config();
  const int64_t length = item.start_pos + 1;
  LayerSparseState& ls = s.layers[static_cast<size_t>(layer.value())];
  switch (options_.sparse.method) {
    case SparseMethod::kSpeContext:
    case SparseMethod::kStreaming:
      *selection = &s.shared_selection;
      return Status::ok();
    case SparseMethod::kQuest:
      select_quest(q, c.n_heads, c.n_kv_heads, c.head_dim, ls.page_min.data(), ls.page_max.data(),
                   options_.sparse.quest_page_size, length, options_.sparse.selection, ls.selection);
      *selection = &ls.selection;
      return Status::ok();
    case SparseMethod::kOracle: {
      // The layer's true attention weights of this token: softmax(q·Kᵀ/√d) over the whole cache.
      std::vector<float> sc(static_cast<size_t>(c.n_heads * length));
      const int64_t group = c.n_heads / c.n_kv_heads;
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      for (int64_t h = 0; h < c.n_heads; ++h) {
        const int64_t kvh = h / group;
        float* row = sc.data() + h * length;
        float mx = -INFINITY;
        for (int64_t t = 0; t < length; ++t) {
          const float* kr = item.kv.k_pages[t / item.kv.page_size] +
                            (kvh * item.kv.page_size + t % item.kv.page_size) * c.head_dim;
          float d = 0.0f;
          for (int64_t i = 0; i < c.head_dim; ++i) d += q[h * c.head_dim + i] * kr[i];
          row[t] = d * scale;
          mx = std::max(mx, row[t]);
        }
        float sum = 0.0f;
        for (int64_t t = 0; t < length; ++t) sum += (row[t] = std::exp(row[t] - mx));
        for (int64_t t = 0; t < length; ++t) row[t] /= sum;
      }
      select_tokens(sc, c.n_heads, c.n_kv_heads, length, options_.sparse.selection, ls.selection);
      *selection = &ls.selection;
      return Status::ok();
    }
    case SparseMethod::kDense:
      break;
  }
  return internal_error("select_for_layer called for a dense step");
}

Status Engine::fill_synthetic(SeqId seq, int64_t n_tokens, uint64_t seed) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return invalid_argument("fill_synthetic: unknown sequence");
  Sequence& s = it->second;
  if (s.length != 0) return invalid_argument("fill_synthetic: sequence is not empty");
  if (n_tokens <= 0 || n_tokens > max_context_) {
    return out_of_range("fill_synthetic: " + std::to_string(n_tokens) + " tokens outside (0, " +
                        std::to_string(max_context_) + "]");
  }
  std::vector<PageId> fresh;
  Status st = reserve_pages(s, n_tokens, fresh);
  if (!st.is_ok()) {
    for (PageId p : fresh) kv_->free_page(p);
    s.pages.clear();
    return st;
  }
  // Values in [-1, 1): keys of unit-ish scale give a spread-out softmax, like real caches.
  const int64_t layers = kv_->n_layers();
  auto fill_layer = [&](int64_t l) {
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(l) + 1;
    for (PageId p : s.pages) {
      for (float* block : {kv_->k_page(LayerId(static_cast<int32_t>(l)), p),
                           kv_->v_page(LayerId(static_cast<int32_t>(l)), p)}) {
        for (int64_t i = 0; i < kv_->page_floats(); ++i) {
          state ^= state >> 12; state ^= state << 25; state ^= state >> 27;
          const uint32_t r = static_cast<uint32_t>((state * 0x2545F4914F6CDD1Dull) >> 40);
          block[i] = static_cast<float>(r) / 8388608.0f - 1.0f;
        }
      }
    }
  };
  // Filling gigabytes single-threaded takes long; one thread per layer group.
  const unsigned n_threads = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(),
                                                             static_cast<unsigned>(layers)));
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < n_threads; ++t) {
    threads.emplace_back([&, t] {
      for (int64_t l = t; l < layers; l += n_threads) fill_layer(l);
    });
  }
  for (auto& th : threads) th.join();
  // Sparse methods keep state derived from the cache: the head's keys, the fused features of
  // the last position, Quest's page bounds.
  const ModelConfig& c = config();
  if (options_.sparse.method == SparseMethod::kSpeContext) {
    const auto& hc = options_.retrieval_head->config;
    uint64_t state = seed * 0xD1B54A32D192ED03ull + 7;
    auto next = [&state] {
      state ^= state >> 12; state ^= state << 25; state ^= state >> 27;
      return static_cast<float>(static_cast<uint32_t>((state * 0x2545F4914F6CDD1Dull) >> 40)) / 8388608.0f - 1.0f;
    };
    s.head_k.resize(static_cast<size_t>(n_tokens * hc.n_kv_heads * hc.head_dim));
    for (auto& x : s.head_k) x = next();
    s.last_fused.resize(static_cast<size_t>(3 * c.dim));
    for (auto& x : s.last_fused) x = next();
  } else if (options_.sparse.method == SparseMethod::kQuest) {
    std::vector<float> rows(static_cast<size_t>(c.kv_dim()));
    for (int64_t l = 0; l < layers; ++l) {
      const LayerId layer(static_cast<int32_t>(l));
      for (int64_t t = 0; t < n_tokens; ++t) {
        const float* block = kv_->k_page(layer, s.pages[static_cast<size_t>(t / kv_->page_size())]);
        for (int64_t h = 0; h < c.n_kv_heads; ++h) {
          std::copy_n(block + (h * kv_->page_size() + t % kv_->page_size()) * c.head_dim, c.head_dim,
                      rows.data() + h * c.head_dim);
        }
        update_quest_bounds(s, layer, rows.data(), t, 1);
      }
    }
  }
  s.length = n_tokens;
  return Status::ok();
}

}  // namespace specontext
