// Engine::forward: one batched forward over device memory, with the SpeContext selection made
// before layer 0 and the loads of offloaded layers posted up front (core/README.md "One step").
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <unordered_set>

#include "core/engine/engine.h"

namespace specontext {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

bool Engine::shares_selection(SparseMethod m) {
  return m == SparseMethod::kSpeContext || m == SparseMethod::kStreaming;
}

bool Engine::wants_fused() const {
  return observer_ != nullptr || options_.sparse.method == SparseMethod::kSpeContext;
}

bool Engine::decodes_sparse(const Sequence& s, const StepRequest& r) const {
  return options_.sparse.method != SparseMethod::kDense && r.tokens.size() == 1 && !r.prompt &&
         s.length + 1 > options_.sparse.selection.budget;
}

Result<StepOutput> Engine::forward(std::span<const StepRequest> requests) {
  const ModelConfig& c = config();

  // ---- validate everything before touching state ----
  if (requests.empty()) return invalid_argument("forward: empty batch");
  std::unordered_set<SeqId> seen;
  for (const StepRequest& r : requests) {
    auto it = sequences_.find(r.seq);
    if (it == sequences_.end()) return invalid_argument("forward: unknown sequence " + std::to_string(r.seq.value()));
    if (!seen.insert(r.seq).second) {
      return invalid_argument("forward: sequence " + std::to_string(r.seq.value()) + " appears twice in one batch");
    }
    if (r.tokens.empty()) return invalid_argument("forward: request without tokens");
    if (r.logits == LogitsMode::kSample) {
      if (r.draw == nullptr) {
        return invalid_argument("forward: sequence " + std::to_string(r.seq.value()) + " asks kSample without a draw");
      }
      SPX_RETURN_IF_ERROR_CTX(r.draw->params.validate(), "forward: sequence " + std::to_string(r.seq.value()));
      if (!(r.draw->coin >= 0.0f && r.draw->coin < 1.0f)) {
        return invalid_argument("forward: sequence " + std::to_string(r.seq.value()) + ": draw coin " +
                                std::to_string(r.draw->coin) + " outside [0, 1)");
      }
    }
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
  }

  if (options_.tiering.between_steps) options_.tiering.between_steps();

  // ---- the placement for the lengths this step reaches (migrations happen here) ----
  if (options_.tiering.policy) SPX_RETURN_IF_ERROR(rebalance(requests));

  // ---- reserve pages (all or nothing) ----
  std::vector<PageId> newly_allocated;
  auto give_back_pages = [&] {
    std::unordered_set<PageId> fresh(newly_allocated.begin(), newly_allocated.end());
    for (auto& [id, seq] : sequences_) {
      while (!seq.pages.empty() && fresh.count(seq.pages.back())) seq.pages.pop_back();
    }
    for (PageId p : newly_allocated) kv_->free_page(p);
  };
  std::vector<Sequence*> seqs(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    seqs[i] = &sequences_[requests[i].seq];
    Status st = reserve_pages(*seqs[i], seqs[i]->length + static_cast<int64_t>(requests[i].tokens.size()), newly_allocated);
    if (!st.is_ok()) {
      give_back_pages();
      return st;
    }
  }

  for (TierTraffic& t : step_traffic_) t = TierTraffic{};
  const Clock::time_point start = Clock::now();
  if (options_.tiering.copies) options_.tiering.copies->reset_window();
  Result<StepOutput> out = run_forward(requests, seqs);
  if (!out.is_ok()) {
    // No copy may still touch the buffers; the working sets filled in this step no longer match
    // their slot maps, so they are reloaded from scratch at the next sparse step.
    if (options_.tiering.copies) (void)options_.tiering.copies->wait_all();
    for (Sequence* s : seqs) {
      invalidate_working_sets(*s);
      const auto kept = static_cast<size_t>(s->length / kv_->page_size());
      if (s->boundary_fused.size() > kept) s->boundary_fused.resize(kept);
    }
    give_back_pages();
    return out.status();
  }
  for (size_t i = 0; i < requests.size(); ++i) seqs[i]->length += static_cast<int64_t>(requests[i].tokens.size());
  ++forwards_;
  for (size_t t = 0; t < step_traffic_.size(); ++t) {
    total_traffic_[t] += step_traffic_[t];
    peak_used_[t] = std::max(peak_used_[t], kv_->tier_used_bytes(TierId(static_cast<int32_t>(t))));
  }
  if (options_.tiering.copies) {
    const CopyWindowStats w = options_.tiering.copies->window_stats();
    uint64_t moved = 0;
    for (uint64_t b : w.bytes) moved += b;
    last_overlap_ = OverlapStats{};
    if (moved > 0) {
      last_overlap_.steps = 1;
      last_overlap_.step_seconds = seconds_since(start);
      last_overlap_.copy_busy_seconds = w.busy_seconds;
      last_overlap_.wait_seconds = w.wait_seconds;
      overlap_.steps += 1;
      overlap_.step_seconds += last_overlap_.step_seconds;
      overlap_.copy_busy_seconds += w.busy_seconds;
      overlap_.wait_seconds += w.wait_seconds;
    }
  }
  return out;
}

Result<StepOutput> Engine::run_forward(std::span<const StepRequest> requests, const std::vector<Sequence*>& seqs) {
  const ModelConfig& c = config();
  Backend& be = *backend_;
  const int64_t dim = c.dim, qd = c.q_dim(), kvd = c.kv_dim(), hd = c.hidden_dim;
  const int64_t ps = kv_->page_size();
  const size_t n_req = requests.size();
  const TierId device(0);
  CopyQueue* copies = options_.tiering.copies.get();
  Communicator* comm = options_.communicator.get();

  // ---- tokens and positions ----
  int64_t total = 0;
  for (const StepRequest& r : requests) total += static_cast<int64_t>(r.tokens.size());
  ids_.resize(static_cast<size_t>(total));
  positions_.resize(static_cast<size_t>(total));
  items_.resize(n_req);
  k_ptrs_.resize(n_req);
  v_ptrs_.resize(n_req);
  std::vector<bool> sparse(n_req);
  int64_t row = 0;
  for (size_t i = 0; i < n_req; ++i) {
    const int64_t start = seqs[i]->length;
    items_[i].token_offset = row;
    items_[i].n_tokens = static_cast<int64_t>(requests[i].tokens.size());
    items_[i].start_pos = start;
    sparse[i] = decodes_sparse(*seqs[i], requests[i]);
    for (size_t j = 0; j < requests[i].tokens.size(); ++j) {
      ids_[static_cast<size_t>(row)] = requests[i].tokens[j];
      positions_[static_cast<size_t>(row)] = start + static_cast<int64_t>(j);
      ++row;
    }
  }
  auto fitf = [&](Workspace& w, int64_t floats) -> Result<float*> {
    SPX_ASSIGN_OR_RETURN(void* p, fit(w, static_cast<size_t>(std::max<int64_t>(floats, 1)) * sizeof(float)));
    return static_cast<float*>(p);
  };
  SPX_ASSIGN_OR_RETURN(void* ids_p, fit(ids_dev_, static_cast<size_t>(total) * sizeof(TokenId)));
  SPX_ASSIGN_OR_RETURN(void* pos_p, fit(positions_dev_, static_cast<size_t>(total) * sizeof(int64_t)));
  auto* ids_dev = static_cast<TokenId*>(ids_p);
  auto* positions_dev = static_cast<int64_t*>(pos_p);
  SPX_RETURN_IF_ERROR(be.upload(ids_dev, ids_.data(), ids_.size() * sizeof(TokenId)));
  SPX_RETURN_IF_ERROR(be.upload(positions_dev, positions_.data(), positions_.size() * sizeof(int64_t)));
  SPX_ASSIGN_OR_RETURN(float* x, fitf(x_, total * dim));
  SPX_ASSIGN_OR_RETURN(float* xb, fitf(xb_, total * dim));
  SPX_ASSIGN_OR_RETURN(float* q, fitf(q_, total * qd));
  SPX_ASSIGN_OR_RETURN(float* k, fitf(k_, total * kvd));
  SPX_ASSIGN_OR_RETURN(float* v, fitf(v_, total * kvd));
  SPX_ASSIGN_OR_RETURN(float* att, fitf(att_, total * qd));
  SPX_ASSIGN_OR_RETURN(float* tmp, fitf(tmp_, total * dim));
  SPX_ASSIGN_OR_RETURN(float* gate, fitf(gate_, total * hd));
  SPX_ASSIGN_OR_RETURN(float* up, fitf(up_, total * hd));
  const bool capture_fused = wants_fused();
  float* fused = nullptr;
  if (capture_fused) {
    SPX_ASSIGN_OR_RETURN(fused, fitf(fused_, total * 3 * dim));
  }

  // ---- sparse decode: selections that serve every layer, made before layer 0 ----
  const SparseMethod method = options_.sparse.method;
  const bool shared = shares_selection(method);
  for (size_t i = 0; i < n_req; ++i) {
    if (!sparse[i]) continue;
    Sequence& s = *seqs[i];
    SPX_RETURN_IF_ERROR(ensure_sparse_state(s));
    if (shared) {
      const int64_t off = items_[i].token_offset;
      SPX_RETURN_IF_ERROR(shared_selection_for(s, requests[i].seq, ids_dev + off, positions_dev + off,
                                               items_[i].start_pos));
      s.shared_loads.clear();
      s.shared_stats = s.shared_ws.update(s.shared_selection, s.shared_loads);
    }
  }

  // ---- loads of offloaded layers, posted now (the selection is known before layer 0) ----
  // A layer homed in a tier the backend reads (device, host pools on the CPU, mapped pinned host
  // memory on CUDA) is attended in place; only a shared selection's working set is loaded, elastic.
  // A layer in a tier it cannot read (remote) is staged on the device. Each item's pages this step
  // writes (its tail: the new tokens' pages, the first loaded when it holds cached tokens) get a
  // buffer per remote layer, from which they go home after the layer. The cached pages before the
  // tail, which items that attend densely or select per layer read whole, go through a ring of
  // staging_layers buffers: remote layer j + depth is loaded once layer j has computed, so the
  // device holds that many remote layers' KV at a time, not every remote layer's.
  const int64_t n_layers = c.n_layers;
  const uint64_t row_bytes = kv_->row_bytes();
  const uint64_t block_bytes = kv_->block_bytes();
  const uint64_t page_bytes = kv_->page_bytes();
  std::vector<CopyTicket> load_ticket(static_cast<size_t>(n_layers)), store_ticket(static_cast<size_t>(n_layers));
  std::vector<CopyTicket> ring_ticket(static_cast<size_t>(n_layers));
  std::vector<int64_t> remote_layers;  // in layer order
  std::vector<bool> remote(static_cast<size_t>(n_layers), false);
  std::vector<size_t> remote_rank(static_cast<size_t>(n_layers), 0);  // remote layer j uses ring slot j % depth
  for (int64_t l = 0; l < n_layers; ++l) {
    const TierId home = kv_->home(LayerId(static_cast<int32_t>(l)));
    if (home != device && !backend_reads(home)) {
      remote[static_cast<size_t>(l)] = true;
      remote_rank[static_cast<size_t>(l)] = remote_layers.size();
      remote_layers.push_back(l);
    }
  }
  // Per item: pages [0, ring_pages) through the ring, the rest in the tail (from tail_first).
  std::vector<int64_t> ring_first(n_req, 0), ring_pages(n_req, 0), tail_first(n_req, 0);
  int64_t ring_total = 0, tail_total = 0;
  for (size_t i = 0; i < n_req; ++i) {
    const bool elastic = sparse[i] && shared;  // stages only its new token's page
    const int64_t start = items_[i].start_pos;
    const int64_t last_page = (start + items_[i].n_tokens - 1) / ps;
    ring_first[i] = ring_total;
    ring_pages[i] = elastic ? 0 : start / ps;
    ring_total += ring_pages[i];
    tail_first[i] = tail_total;
    tail_total += elastic ? 1 : last_page - start / ps + 1;
  }
  const size_t depth = ring_total == 0 ? 0
                                       : std::min(remote_layers.size(),
                                                  static_cast<size_t>(options_.tiering.staging_layers));
  std::vector<uint64_t> ring_at(depth, 0), tail_at(static_cast<size_t>(n_layers), 0);
  std::vector<uint64_t> staging_held;  // every staging allocation, released when the step ends
  struct StagingGuard {
    KvStore* kv;
    TierId device;
    std::vector<uint64_t>* held;
    ~StagingGuard() {
      for (uint64_t at : *held) (void)kv->release(device, at);
    }
  } staging_guard{kv_.get(), device, &staging_held};
  for (size_t slot = 0; slot < depth; ++slot) {
    SPX_ASSIGN_OR_RETURN(ring_at[slot], kv_->allocate(device, static_cast<uint64_t>(ring_total) * page_bytes));
    staging_held.push_back(ring_at[slot]);
  }
  for (int64_t l : remote_layers) {
    SPX_ASSIGN_OR_RETURN(tail_at[static_cast<size_t>(l)],
                         kv_->allocate(device, static_cast<uint64_t>(tail_total) * page_bytes));
    staging_held.push_back(tail_at[static_cast<size_t>(l)]);
  }
  peak_staging_ = std::max(peak_staging_, static_cast<uint64_t>(static_cast<int64_t>(depth) * ring_total +
                                                                static_cast<int64_t>(remote_layers.size()) * tail_total) *
                                              page_bytes);
  auto ring_of = [&](int64_t l) { return ring_at[remote_rank[static_cast<size_t>(l)] % depth]; };  // its slot's offset
  peak_used_[0] = std::max(peak_used_[0], kv_->tier_used_bytes(device));
  auto count_loads = [&](TierId home, const std::vector<TransferRequest>& loads) {
    uint64_t bytes = 0;
    for (const TransferRequest& r : loads) bytes += r.bytes;
    traffic(home).bytes_out += bytes;
    traffic(device).bytes_in += bytes;
  };
  // The cached pages before each item's tail, of remote layer `l`, into its ring slot.
  auto post_ring_loads = [&](int64_t l) -> Status {
    const LayerId layer(static_cast<int32_t>(l));
    const TierId home = kv_->home(layer);
    const uint64_t base = ring_of(l);
    std::vector<TransferRequest> loads;
    for (size_t i = 0; i < n_req; ++i) {
      for (int64_t p = 0; p < ring_pages[i]; ++p) {
        const PageLocation loc = kv_->locate(layer, seqs[i]->pages[static_cast<size_t>(p)]);
        loads.push_back({home, loc.offset, device, base + static_cast<uint64_t>(ring_first[i] + p) * page_bytes, page_bytes});
      }
    }
    count_loads(home, loads);
    SPX_ASSIGN_OR_RETURN(ring_ticket[static_cast<size_t>(l)], copies->submit(layer, CopyDirection::kLoad, std::move(loads)));
    return Status::ok();
  };
  auto ws_offset = [&](const Slice& ws, int64_t head, int64_t slot) {
    return ws.offset + static_cast<uint64_t>(head * options_.sparse.selection.budget + slot) * row_bytes;
  };
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerId layer(static_cast<int32_t>(l));
    const TierId home = kv_->home(layer);
    if (home == device) continue;
    std::vector<TransferRequest> loads;
    for (size_t i = 0; i < n_req; ++i) {
      const Sequence& s = *seqs[i];
      const int64_t start = items_[i].start_pos;
      if (sparse[i] && shared) {
        const LayerSparseState& ls = s.layers[static_cast<size_t>(l)];
        for (const GatherEntry& e : s.shared_loads) {
          if (e.token >= start) continue;  // this step's token: appended, then gathered on the device
          const PageLocation loc = kv_->locate(layer, s.pages[static_cast<size_t>(e.token / ps)]);
          const uint64_t in_block = static_cast<uint64_t>(e.kv_head * ps + e.token % ps) * row_bytes;
          loads.push_back({home, loc.offset + in_block, device, ws_offset(ls.ws_k, e.kv_head, e.slot), row_bytes});
          loads.push_back({home, loc.offset + block_bytes + in_block, device, ws_offset(ls.ws_v, e.kv_head, e.slot),
                           row_bytes});
          ++traffic(home).tokens_loaded;
        }
        traffic(home).tokens_hit += s.shared_stats.tokens_kept;
      } else if (remote[static_cast<size_t>(l)] && start % ps != 0) {
        // The tail's first page holds cached tokens: it is loaded, then the new ones are appended.
        const PageLocation loc = kv_->locate(layer, s.pages[static_cast<size_t>(start / ps)]);
        loads.push_back({home, loc.offset, device,
                         tail_at[static_cast<size_t>(l)] + static_cast<uint64_t>(tail_first[i]) * page_bytes, page_bytes});
      }
    }
    count_loads(home, loads);
    if (!loads.empty()) {
      SPX_ASSIGN_OR_RETURN(load_ticket[static_cast<size_t>(l)], copies->submit(layer, CopyDirection::kLoad, std::move(loads)));
    }
  }
  for (size_t j = 0; j < depth; ++j) SPX_RETURN_IF_ERROR(post_ring_loads(remote_layers[j]));
  auto wait_ticket = [&](CopyTicket& t) -> Status {
    if (!t.valid()) return Status::ok();
    const CopyTicket ticket = t;
    t = CopyTicket{};
    return copies->wait(ticket);
  };

  // ---- layers ----
  SPX_RETURN_IF_ERROR(be.embed(ids_dev, total, tok_embeddings_, x));
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerPtrs& w = layer_ptrs_[static_cast<size_t>(l)];
    const LayerId layer(static_cast<int32_t>(l));
    const TierId home = kv_->home(layer);
    const bool staged = remote[static_cast<size_t>(l)];
    if (capture_fused) {
      for (int slot = 0; slot < 3; ++slot) {
        if (fused_layers_[static_cast<size_t>(slot)] != l) continue;
        SPX_RETURN_IF_ERROR(be.copy_rows(fused + slot * dim, static_cast<size_t>(3 * dim) * sizeof(float), x,
                                         static_cast<size_t>(dim) * sizeof(float),
                                         static_cast<size_t>(dim) * sizeof(float), total));
      }
    }
    SPX_RETURN_IF_ERROR(be.rmsnorm(x, w.attn_norm, total, dim, c.norm_eps, xb));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.wq, w.bq, q));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.wk, w.bk, k));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.wv, w.bv, v));
    if (c.qk_norm) {
      SPX_RETURN_IF_ERROR(be.rmsnorm(q, w.q_norm, total * c.n_heads, c.head_dim, c.norm_eps, q));
      SPX_RETURN_IF_ERROR(be.rmsnorm(k, w.k_norm, total * c.n_kv_heads, c.head_dim, c.norm_eps, k));
    }
    SPX_RETURN_IF_ERROR(be.rope(q, total, c.n_heads, positions_dev, rope_));
    SPX_RETURN_IF_ERROR(be.rope(k, total, c.n_kv_heads, positions_dev, rope_));
    // A staged layer's pages must have arrived before new tokens are appended to them.
    if (staged) {
      SPX_RETURN_IF_ERROR(wait_ticket(load_ticket[static_cast<size_t>(l)]));
      SPX_RETURN_IF_ERROR(wait_ticket(ring_ticket[static_cast<size_t>(l)]));
    }
    dense_items_.clear();
    sparse_items_.clear();
    sparse_index_.clear();
    for (size_t i = 0; i < n_req; ++i) {
      if (!staged) {
        items_[i].kv = kv_->view(layer, seqs[i]->pages, k_ptrs_[i], v_ptrs_[i]);
      } else {
        const size_t n_pages = seqs[i]->pages.size();
        k_ptrs_[i].resize(n_pages);
        v_ptrs_[i].resize(n_pages);
        auto* ring = ring_pages[i] > 0 ? static_cast<std::byte*>(kv_->address(device, ring_of(l))) : nullptr;
        auto* tail = static_cast<std::byte*>(kv_->address(device, tail_at[static_cast<size_t>(l)]));
        for (size_t p = 0; p < n_pages; ++p) {
          // An elastic item stages only the page of its new token; every entry points at it.
          const auto pi = static_cast<int64_t>(p);
          std::byte* page = sparse[i] && shared ? tail + static_cast<uint64_t>(tail_first[i]) * page_bytes
                            : pi < ring_pages[i]
                                ? ring + static_cast<uint64_t>(ring_first[i] + pi) * page_bytes
                                : tail + static_cast<uint64_t>(tail_first[i] + pi - ring_pages[i]) * page_bytes;
          k_ptrs_[i][p] = page;
          v_ptrs_[i][p] = page + block_bytes;
        }
        KvLayerView view;
        view.k_pages = k_ptrs_[i].data();
        view.v_pages = v_ptrs_[i].data();
        view.n_pages = static_cast<int64_t>(n_pages);
        view.page_size = ps;
        view.kv_heads = c.n_kv_heads;
        view.head_dim = c.head_dim;
        view.dtype = kv_->dtype();
        items_[i].kv = view;
      }
      const int64_t off = items_[i].token_offset;
      SPX_RETURN_IF_ERROR(be.kv_append(k + off * kvd, v + off * kvd, items_[i].n_tokens, items_[i].start_pos,
                                       items_[i].kv));
      if (method == SparseMethod::kQuest) {
        host_rows_.resize(static_cast<size_t>(items_[i].n_tokens * kvd));
        SPX_RETURN_IF_ERROR(be.download(host_rows_.data(), k + off * kvd, host_rows_.size() * sizeof(float)));
        SPX_RETURN_IF_ERROR(update_quest_bounds(*seqs[i], layer, host_rows_.data(), items_[i].start_pos, items_[i].n_tokens));
      }
      if (!sparse[i]) dense_items_.push_back(items_[i]);
    }
    if (observer_ != nullptr) observer_->on_attention(layer, q, items_);
    if (!dense_items_.empty()) {
      SPX_RETURN_IF_ERROR(be.attention(q, dense_items_.data(), static_cast<int64_t>(dense_items_.size()),
                                       c.n_heads, att));
    }
    selections_.clear();
    for (size_t i = 0; i < n_req; ++i) {
      if (!sparse[i]) continue;
      Sequence& s = *seqs[i];
      LayerSparseState& ls = s.layers[static_cast<size_t>(l)];
      const Selection* sel = nullptr;
      SPX_RETURN_IF_ERROR(select_for_layer(s, layer, items_[i], q + items_[i].token_offset * qd, &sel));
      selections_.push_back(sel);
      const ElasticWorkingSet& ws = shared ? s.shared_ws : ls.ws;
      ElasticStats es = s.shared_stats;
      const std::vector<GatherEntry>* gathers = &loads_;
      if (!shared) {
        loads_.clear();
        es = ls.ws.update(*sel, loads_);
        if (home != device) {
          traffic(home).tokens_loaded += es.tokens_loaded;
          traffic(home).tokens_hit += es.tokens_kept;
        }
      } else if (home == device) {
        gathers = &s.shared_loads;  // every load is an on-device gather
      } else {
        // Cached tokens arrive through the copy engine; this step's token is gathered here.
        current_loads_.clear();
        for (const GatherEntry& e : s.shared_loads) {
          if (e.token >= items_[i].start_pos) current_loads_.push_back(e);
        }
        gathers = &current_loads_;
      }
      if (home == device) {
        traffic(device).tokens_loaded += es.tokens_loaded;
        traffic(device).tokens_hit += es.tokens_kept;
      }
      WorkingSetView wsv;
      wsv.k = kv_->address(device, ls.ws_k.offset);
      wsv.v = kv_->address(device, ls.ws_v.offset);
      wsv.dtype = kv_->dtype();
      wsv.kv_heads = c.n_kv_heads;
      wsv.slots = ws.slots();
      wsv.head_dim = c.head_dim;
      wsv.counts = ws.counts().data();
      if (!gathers->empty()) {
        SPX_RETURN_IF_ERROR(be.kv_gather(items_[i].kv, gathers->data(), static_cast<int64_t>(gathers->size()), wsv));
      }
      const int64_t token_bytes = static_cast<int64_t>(2 * row_bytes);
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
      // The layer waits for its own loads only (posted before layer 0).
      SPX_RETURN_IF_ERROR(wait_ticket(load_ticket[static_cast<size_t>(l)]));
      SPX_RETURN_IF_ERROR(be.attention_sparse(q, sparse_items_.data(), static_cast<int64_t>(sparse_items_.size()),
                                              c.n_heads, att));
    }
    SPX_RETURN_IF_ERROR(wait_ticket(load_ticket[static_cast<size_t>(l)]));
    if (staged) {
      // The new tokens go home from the tail: whole pages for densely attended items (their
      // cached part was loaded), the token's rows for elastic items. The copy engine reads what
      // the compute wrote.
      SPX_RETURN_IF_ERROR(be.synchronize());
      std::vector<TransferRequest> stores;
      const uint64_t tail = tail_at[static_cast<size_t>(l)];
      for (size_t i = 0; i < n_req; ++i) {
        const Sequence& s = *seqs[i];
        const int64_t start = items_[i].start_pos, n = items_[i].n_tokens;
        if (sparse[i] && shared) {
          const PageLocation loc = kv_->locate(layer, s.pages[static_cast<size_t>(start / ps)]);
          const uint64_t src_page = tail + static_cast<uint64_t>(tail_first[i]) * page_bytes;
          for (int64_t h = 0; h < c.n_kv_heads; ++h) {
            const uint64_t in_block = static_cast<uint64_t>(h * ps + start % ps) * row_bytes;
            stores.push_back({device, src_page + in_block, home, loc.offset + in_block, row_bytes});
            stores.push_back({device, src_page + block_bytes + in_block, home, loc.offset + block_bytes + in_block,
                              row_bytes});
          }
        } else {
          for (int64_t p = start / ps; p <= (start + n - 1) / ps; ++p) {
            const PageLocation loc = kv_->locate(layer, s.pages[static_cast<size_t>(p)]);
            stores.push_back({device, tail + static_cast<uint64_t>(tail_first[i] + p - start / ps) * page_bytes, home,
                              loc.offset, page_bytes});
          }
        }
      }
      uint64_t bytes = 0;
      for (const TransferRequest& r : stores) bytes += r.bytes;
      traffic(home).bytes_in += bytes;
      traffic(device).bytes_out += bytes;
      SPX_ASSIGN_OR_RETURN(store_ticket[static_cast<size_t>(l)], copies->submit(layer, CopyDirection::kStore, std::move(stores)));
      // This layer's ring slot has been read (synchronized above): the remote layer `depth`
      // places further on is loaded into it now.
      const size_t j = remote_rank[static_cast<size_t>(l)] + depth;
      if (depth > 0 && j < remote_layers.size()) SPX_RETURN_IF_ERROR(post_ring_loads(remote_layers[j]));
    }
    SPX_RETURN_IF_ERROR(be.matmul(att, total, w.wo, nullptr, tmp));
    if (comm != nullptr) SPX_RETURN_IF_ERROR(comm->all_reduce_sum(tmp, total * dim));
    SPX_RETURN_IF_ERROR(be.add(x, tmp, total * dim));
    SPX_RETURN_IF_ERROR(be.rmsnorm(x, w.ffn_norm, total, dim, c.norm_eps, xb));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.w_gate, nullptr, gate));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.w_up, nullptr, up));
    SPX_RETURN_IF_ERROR(be.swiglu(gate, up, total * hd, gate));
    SPX_RETURN_IF_ERROR(be.matmul(gate, total, w.w_down, nullptr, tmp));
    if (comm != nullptr) SPX_RETURN_IF_ERROR(comm->all_reduce_sum(tmp, total * dim));
    SPX_RETURN_IF_ERROR(be.add(x, tmp, total * dim));
  }
  // Stores must land before the step counts (the next step may load these tokens).
  for (CopyTicket& t : store_ticket) SPX_RETURN_IF_ERROR(wait_ticket(t));
  for (size_t i = 0; i < n_req; ++i) sparse_stats_.sparse_steps += sparse[i] ? 1 : 0;

  // ---- retrieval head keys of the tokens not yet fed to it; fused state for the next step ----
  if (capture_fused) {
    if (observer_ != nullptr) observer_->on_fused_hidden(fused, total, items_);
    const int64_t fd = 3 * dim;
    const size_t fused_row = static_cast<size_t>(fd) * sizeof(float);
    for (size_t i = 0; i < n_req; ++i) {
      Sequence& s = *seqs[i];
      const AttentionItem& it = items_[i];
      if (!s.last_fused) {
        SPX_ASSIGN_OR_RETURN(s.last_fused, be.allocate(fused_row));
        const std::vector<float> zeros(static_cast<size_t>(fd), 0.0f);  // fused(−1) = 0
        SPX_RETURN_IF_ERROR(be.upload(s.last_fused.get(), zeros.data(), fused_row));
      }
      if (method == SparseMethod::kSpeContext && !sparse[i]) {
        // fused(p−1) of each row: the stored last one for the first row, this forward's rows after.
        SPX_ASSIGN_OR_RETURN(float* prev, fitf(fused_prev_, it.n_tokens * fd));
        SPX_RETURN_IF_ERROR(be.copy_rows(prev, fused_row, s.last_fused.get(), fused_row, fused_row, 1));
        if (it.n_tokens > 1) {
          SPX_RETURN_IF_ERROR(be.copy_rows(prev + fd, fused_row, fused + it.token_offset * fd, fused_row, fused_row,
                                           it.n_tokens - 1));
        }
        const auto& hc = options_.retrieval_head->config;
        SPX_ASSIGN_OR_RETURN(float* hq, fitf(head_q_, it.n_tokens * hc.n_heads * hc.head_dim));
        SPX_RETURN_IF_ERROR(ensure_head_capacity(s, it.start_pos + it.n_tokens));
        SPX_RETURN_IF_ERROR(run_head(s, ids_dev + it.token_offset, prev, positions_dev + it.token_offset, it.start_pos,
                                     it.n_tokens, hq));
      }
      SPX_RETURN_IF_ERROR(be.copy_rows(s.last_fused.get(), fused_row, fused + (it.token_offset + it.n_tokens - 1) * fd,
                                       fused_row, fused_row, 1));
      if (options_.prefix_sharing && method == SparseMethod::kSpeContext) {
        // Page-boundary features for fork_sequence; a failed step truncates them again (forward).
        for (int64_t k = 0; k < it.n_tokens; ++k) {
          const int64_t pos = it.start_pos + k;
          if ((pos + 1) % ps != 0) continue;
          SPX_ASSIGN_OR_RETURN(std::shared_ptr<void> boundary, be.allocate(fused_row));
          SPX_RETURN_IF_ERROR(be.copy_rows(boundary.get(), fused_row, fused + (it.token_offset + k) * fd,
                                           fused_row, fused_row, 1));
          s.boundary_fused.resize(static_cast<size_t>(pos / ps));
          s.boundary_fused.push_back(std::move(boundary));
        }
      }
    }
  }

  // ---- logits for the rows asked for; sampled rows first, decided where the logits are ----
  StepOutput out;
  out.vocab = c.vocab_size;
  out.first_row.assign(n_req, -1);
  out.n_rows.assign(n_req, 0);
  out.tokens.assign(n_req, -1);
  int64_t n_sample = 0, n_out = 0;
  for (size_t i = 0; i < n_req; ++i) {
    if (requests[i].logits == LogitsMode::kSample) ++n_sample;
    const int64_t n = requests[i].logits == LogitsMode::kAll ? items_[i].n_tokens
                      : requests[i].logits == LogitsMode::kLast ? 1 : 0;
    if (n > 0) out.first_row[i] = n_out;
    out.n_rows[i] = n;
    n_out += n;
  }
  if (n_sample + n_out > 0) {
    SPX_ASSIGN_OR_RETURN(float* rows, fitf(rows_, (n_sample + n_out) * dim));
    const size_t dim_bytes = static_cast<size_t>(dim) * sizeof(float);
    int64_t sampled = 0, returned = n_sample;
    draw_values_.clear();
    for (size_t i = 0; i < n_req; ++i) {
      const bool sample = requests[i].logits == LogitsMode::kSample;
      const int64_t n = sample ? 1 : out.n_rows[i];
      if (n == 0) continue;
      const int64_t first = items_[i].token_offset + items_[i].n_tokens - n;
      int64_t& r = sample ? sampled : returned;
      SPX_RETURN_IF_ERROR(be.copy_rows(rows + r * dim, dim_bytes, x + first * dim, dim_bytes, dim_bytes, n));
      r += n;
      if (sample) draw_values_.push_back(*requests[i].draw);
    }
    SPX_RETURN_IF_ERROR(be.rmsnorm(rows, final_norm_, n_sample + n_out, dim, c.norm_eps, rows));
    if (n_sample > 0) {
      SPX_ASSIGN_OR_RETURN(float* logits, fitf(logits_, n_sample * c.vocab_size));
      SPX_RETURN_IF_ERROR(be.matmul(rows, n_sample, lm_head_, nullptr, logits));
      sampled_.resize(static_cast<size_t>(n_sample));
      SPX_RETURN_IF_ERROR(be.sample_rows(logits, n_sample, c.vocab_size, draw_values_.data(), sampled_.data()));
      for (size_t i = 0, k = 0; i < n_req; ++i) {
        if (requests[i].logits == LogitsMode::kSample) out.tokens[i] = sampled_[k++];
      }
    }
    if (n_out > 0) {
      const float* out_rows = rows + n_sample * dim;
      out.logits.resize(static_cast<size_t>(n_out * c.vocab_size));
      if (be.memory_kind() == MemoryKind::kHost) {
        SPX_RETURN_IF_ERROR(be.matmul(out_rows, n_out, lm_head_, nullptr, out.logits.data()));
      } else {
        SPX_ASSIGN_OR_RETURN(float* logits, fitf(logits_, n_out * c.vocab_size));
        SPX_RETURN_IF_ERROR(be.matmul(out_rows, n_out, lm_head_, nullptr, logits));
        SPX_RETURN_IF_ERROR(be.download(out.logits.data(), logits, out.logits.size() * sizeof(float)));
      }
    }
  }
  SPX_RETURN_IF_ERROR(be.synchronize());
  return out;
}

}  // namespace specontext
