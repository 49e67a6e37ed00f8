// Engine::forward: one batched forward over device memory, with the SpeContext selection made
// before layer 0 and the loads of offloaded layers posted up front (core/README.md "One step").
//
// forward() validates, re-plans and reserves pages, then run_forward() runs the step as a list of
// phases, each a function below in the order it runs: lay out the tokens, upload them, fit the
// activations, make the shared selections, plan the staging of remote layers, post the prefetch
// loads, then per layer (run_layer) project q/k/v, append the new KV, attend dense and sparse items,
// store staged layers home and run the MLP; then wait for the stores, feed the retrieval head and
// keep the fused state, and compute the logits (sampling where they are).
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

size_t at(int64_t i) { return static_cast<size_t>(i); }

// Every staging allocation of a step in the device tier, released when the step ends.
class StagingHold {
 public:
  explicit StagingHold(KvStore* kv) : kv_(kv) {}
  StagingHold(const StagingHold&) = delete;
  StagingHold& operator=(const StagingHold&) = delete;
  ~StagingHold() {
    for (uint64_t offset : held_) (void)kv_->release(TierId(0), offset);
  }
  void keep(uint64_t offset) { held_.push_back(offset); }

 private:
  KvStore* kv_;
  std::vector<uint64_t> held_;
};

}  // namespace

bool Engine::wants_fused() const {
  return observer_ != nullptr || options_.sparse.method == SparseMethod::kSpeContext;
}

bool Engine::decodes_sparse(const Sequence& s, const StepRequest& r) const {
  return options_.sparse.method != SparseMethod::kDense && r.tokens.size() == 1 && !r.prompt &&
         s.length + 1 > options_.sparse.selection.budget;
}

// What the phases of one forward hand on to each other: the batch, its device buffers and where
// remote layers are staged.
struct Engine::ForwardStep {
  ForwardStep(std::span<const StepRequest> r, const std::vector<Sequence*>& s, KvStore* kv)
      : requests(r), seqs(s), n_req(r.size()), staging_hold(kv) {}

  std::span<const StepRequest> requests;
  const std::vector<Sequence*>& seqs;  // per request
  size_t n_req = 0;
  int64_t total = 0;         // rows (tokens) of the batch
  std::vector<bool> sparse;  // per request: a sparse decode step
  SparseMethod method = SparseMethod::kDense;
  bool shared = false;  // the method's selection serves every layer (made before layer 0)
  bool capture_fused = false;

  // Backend memory (workspaces).
  TokenId* ids_dev = nullptr;
  int64_t* positions_dev = nullptr;
  float *x = nullptr, *xb = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *tmp = nullptr,
        *gate = nullptr, *up = nullptr, *fused = nullptr;

  // Staging of remote layers (plan_staging). Per layer: the copy tickets of its loads, of its
  // ring slot's loads and of its stores.
  std::vector<CopyTicket> load_ticket, store_ticket, ring_ticket;
  std::vector<int64_t> remote_layers;  // in layer order
  std::vector<bool> remote;            // per layer
  std::vector<size_t> remote_rank;     // per layer: remote layer j uses ring slot j % depth
  // Per item: pages [0, ring_pages) through the ring, the rest in the tail (from tail_first).
  std::vector<int64_t> ring_first, ring_pages, tail_first;
  int64_t ring_total = 0, tail_total = 0;
  size_t depth = 0;               // ring slots
  std::vector<uint64_t> ring_at;  // per slot: its offset in the device tier
  std::vector<uint64_t> tail_at;  // per layer: its tail buffer's offset (remote layers)
  StagingHold staging_hold;

  // Per item, its ring and tail pages; the ring's depth.
  void lay_out_staging(const std::vector<AttentionItem>& items, int64_t ps, int64_t staging_layers) {
    ring_first.assign(n_req, 0);
    ring_pages.assign(n_req, 0);
    tail_first.assign(n_req, 0);
    for (size_t i = 0; i < n_req; ++i) {
      const bool elastic = sparse[i] && shared;  // stages only its new token's page
      const int64_t start = items[i].start_pos;
      const int64_t last_page = (start + items[i].n_tokens - 1) / ps;
      ring_first[i] = ring_total;
      ring_pages[i] = elastic ? 0 : start / ps;
      ring_total += ring_pages[i];
      tail_first[i] = tail_total;
      tail_total += elastic ? 1 : last_page - start / ps + 1;
    }
    depth = ring_total == 0 ? 0 : std::min(remote_layers.size(), static_cast<size_t>(staging_layers));
  }
  uint64_t ring_of(int64_t l) const { return ring_at[remote_rank[at(l)] % depth]; }  // its slot's offset
};

Result<StepOutput> Engine::forward(std::span<const StepRequest> requests) {
  SPX_RETURN_IF_ERROR(validate_step(requests));
  if (options_.tiering.between_steps) options_.tiering.between_steps();
  // The placement for the lengths this step reaches (migrations happen here).
  if (options_.tiering.policy) SPX_RETURN_IF_ERROR(rebalance(requests));
  std::vector<Sequence*> seqs;
  std::vector<PageId> newly_allocated;
  SPX_RETURN_IF_ERROR(reserve_step_pages(requests, seqs, newly_allocated));

  for (TierTraffic& t : step_traffic_) t = TierTraffic{};
  const Clock::time_point start = Clock::now();
  if (options_.tiering.copies) options_.tiering.copies->reset_window();
  Result<StepOutput> out = run_forward(requests, seqs);
  if (!out.is_ok()) {
    undo_step(seqs, newly_allocated);
    return out.status();
  }
  for (size_t i = 0; i < requests.size(); ++i)
    seqs[i]->length += static_cast<int64_t>(requests[i].tokens.size());
  ++forwards_;
  record_step_stats(start);
  return out;
}

Status Engine::validate_step(std::span<const StepRequest> requests) const {
  if (requests.empty()) return invalid_argument("forward: empty batch");
  std::unordered_set<SeqId> seen;
  for (const StepRequest& r : requests) {
    auto it = memory_->sequences_.find(r.seq);
    if (it == memory_->sequences_.end())
      return invalid_argument("forward: unknown sequence " + std::to_string(r.seq.value()));
    if (!seen.insert(r.seq).second) {
      return invalid_argument("forward: sequence " + std::to_string(r.seq.value()) +
                              " appears twice in one batch");
    }
    SPX_RETURN_IF_ERROR(validate_request(r, it->second));
  }
  return Status::ok();
}

Status Engine::validate_request(const StepRequest& r, const Sequence& s) const {
  const ModelConfig& c = config();
  if (r.tokens.empty()) return invalid_argument("forward: request without tokens");
  if (r.logits == LogitsMode::kSample) {
    if (r.draw == nullptr) {
      return invalid_argument("forward: sequence " + std::to_string(r.seq.value()) +
                              " asks kSample without a draw");
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
  const int64_t new_len = s.length + static_cast<int64_t>(r.tokens.size());
  if (new_len > max_context_) {
    return out_of_range("sequence " + std::to_string(r.seq.value()) + " would hold " +
                        std::to_string(new_len) + " tokens, beyond the context limit of " +
                        std::to_string(max_context_));
  }
  return Status::ok();
}

Status Engine::reserve_step_pages(std::span<const StepRequest> requests, std::vector<Sequence*>& seqs,
                                  std::vector<PageId>& newly_allocated) {
  seqs.assign(requests.size(), nullptr);
  for (size_t i = 0; i < requests.size(); ++i) {
    seqs[i] = &memory_->sequences_[requests[i].seq];
    Status st = memory_->reserve_pages(
        *seqs[i], seqs[i]->length + static_cast<int64_t>(requests[i].tokens.size()), newly_allocated);
    if (!st.is_ok()) {
      memory_->give_back_pages(newly_allocated);
      return st;
    }
  }
  return Status::ok();
}

void Engine::undo_step(const std::vector<Sequence*>& seqs, const std::vector<PageId>& newly_allocated) {
  // No copy may still touch the buffers; the working sets filled in this step no longer match
  // their slot maps, so they are reloaded from scratch at the next sparse step.
  if (options_.tiering.copies) (void)options_.tiering.copies->wait_all();
  for (Sequence* s : seqs) {
    memory_->invalidate_working_sets(*s);
    const auto kept = static_cast<size_t>(s->length / kv_->page_size());
    if (s->boundary_fused.size() > kept) s->boundary_fused.resize(kept);
  }
  memory_->give_back_pages(newly_allocated);
}

void Engine::record_step_stats(std::chrono::steady_clock::time_point start) {
  for (size_t t = 0; t < step_traffic_.size(); ++t) {
    total_traffic_[t] += step_traffic_[t];
    peak_used_[t] = std::max(peak_used_[t], kv_->tier_used_bytes(TierId(static_cast<int32_t>(t))));
  }
  if (!options_.tiering.copies) return;
  const CopyWindowStats w = options_.tiering.copies->window_stats();
  uint64_t moved = 0;
  for (uint64_t b : w.bytes) moved += b;
  last_overlap_ = OverlapStats{};
  if (moved == 0) return;
  last_overlap_.steps = 1;
  last_overlap_.step_seconds = seconds_since(start);
  last_overlap_.copy_busy_seconds = w.busy_seconds;
  last_overlap_.wait_seconds = w.wait_seconds;
  overlap_.steps += 1;
  overlap_.step_seconds += last_overlap_.step_seconds;
  overlap_.copy_busy_seconds += w.busy_seconds;
  overlap_.wait_seconds += w.wait_seconds;
}

Result<StepOutput> Engine::run_forward(std::span<const StepRequest> requests,
                                       const std::vector<Sequence*>& seqs) {
  ForwardStep st(requests, seqs, kv_);
  lay_out_tokens(st);
  SPX_RETURN_IF_ERROR(upload_tokens(st));
  SPX_RETURN_IF_ERROR(fit_activations(st));
  SPX_RETURN_IF_ERROR(make_shared_selections(st));
  SPX_RETURN_IF_ERROR(plan_staging(st));
  SPX_RETURN_IF_ERROR(post_prefetch_loads(st));
  SPX_RETURN_IF_ERROR(backend_->embed(st.ids_dev, st.total, tok_embeddings_, st.x));
  for (int64_t l = 0; l < config().n_layers; ++l) SPX_RETURN_IF_ERROR(run_layer(st, l));
  // Stores must land before the step counts (the next step may load these tokens).
  for (CopyTicket& t : st.store_ticket) SPX_RETURN_IF_ERROR(wait_ticket(t));
  for (size_t i = 0; i < st.n_req; ++i) sparse_stats_.sparse_steps += st.sparse[i] ? 1 : 0;
  if (st.capture_fused) SPX_RETURN_IF_ERROR(update_fused_state(st));
  SPX_ASSIGN_OR_RETURN(StepOutput out, compute_logits(st));
  SPX_RETURN_IF_ERROR(backend_->synchronize());
  return out;
}

Result<float*> Engine::fit_floats(Workspace& w, int64_t floats) {
  SPX_ASSIGN_OR_RETURN(void* p, fit(w, static_cast<size_t>(std::max<int64_t>(floats, 1)) * sizeof(float)));
  return static_cast<float*>(p);
}

Status Engine::wait_ticket(CopyTicket& t) {
  if (!t.valid()) return Status::ok();
  const CopyTicket ticket = t;
  t = CopyTicket{};
  return options_.tiering.copies->wait(ticket);
}

// ---- tokens, positions and activations ----

void Engine::lay_out_tokens(ForwardStep& st) {
  const size_t n_req = st.n_req;
  for (const StepRequest& r : st.requests) st.total += static_cast<int64_t>(r.tokens.size());
  ids_.resize(at(st.total));
  positions_.resize(at(st.total));
  items_.resize(n_req);
  k_ptrs_.resize(n_req);
  v_ptrs_.resize(n_req);
  st.sparse.assign(n_req, false);
  int64_t row = 0;
  for (size_t i = 0; i < n_req; ++i) {
    const StepRequest& r = st.requests[i];
    const int64_t start = st.seqs[i]->length;
    items_[i].token_offset = row;
    items_[i].n_tokens = static_cast<int64_t>(r.tokens.size());
    items_[i].start_pos = start;
    st.sparse[i] = decodes_sparse(*st.seqs[i], r);
    for (size_t j = 0; j < r.tokens.size(); ++j) {
      ids_[at(row)] = r.tokens[j];
      positions_[at(row)] = start + static_cast<int64_t>(j);
      ++row;
    }
  }
}

Status Engine::upload_tokens(ForwardStep& st) {
  Backend& be = *backend_;
  SPX_ASSIGN_OR_RETURN(void* ids_p, fit(ids_dev_, at(st.total) * sizeof(TokenId)));
  SPX_ASSIGN_OR_RETURN(void* pos_p, fit(positions_dev_, at(st.total) * sizeof(int64_t)));
  st.ids_dev = static_cast<TokenId*>(ids_p);
  st.positions_dev = static_cast<int64_t*>(pos_p);
  SPX_RETURN_IF_ERROR(be.upload(st.ids_dev, ids_.data(), ids_.size() * sizeof(TokenId)));
  return be.upload(st.positions_dev, positions_.data(), positions_.size() * sizeof(int64_t));
}

Status Engine::fit_activations(ForwardStep& st) {
  const ModelConfig& c = config();
  const int64_t total = st.total, dim = c.dim, qd = c.q_dim(), kvd = c.kv_dim(), hd = c.hidden_dim;
  SPX_ASSIGN_OR_RETURN(st.x, fit_floats(x_, total * dim));
  SPX_ASSIGN_OR_RETURN(st.xb, fit_floats(xb_, total * dim));
  SPX_ASSIGN_OR_RETURN(st.q, fit_floats(q_, total * qd));
  SPX_ASSIGN_OR_RETURN(st.k, fit_floats(k_, total * kvd));
  SPX_ASSIGN_OR_RETURN(st.v, fit_floats(v_, total * kvd));
  SPX_ASSIGN_OR_RETURN(st.att, fit_floats(att_, total * qd));
  SPX_ASSIGN_OR_RETURN(st.tmp, fit_floats(tmp_, total * dim));
  SPX_ASSIGN_OR_RETURN(st.gate, fit_floats(gate_, total * hd));
  SPX_ASSIGN_OR_RETURN(st.up, fit_floats(up_, total * hd));
  st.capture_fused = wants_fused();
  if (st.capture_fused) {
    SPX_ASSIGN_OR_RETURN(st.fused, fit_floats(fused_, total * 3 * dim));
  }
  return Status::ok();
}

// ---- sparse decode: selections that serve every layer, made before layer 0 ----
// SpeContext: the retrieval head runs once for all sparse sequences of the step, one row each
// (its weights are read once a step, not once per sequence); each row's key goes into its
// sequence's head cache, then each sequence selects from its own query row.

Status Engine::make_shared_selections(ForwardStep& st) {
  st.method = options_.sparse.method;
  st.shared = shares_selection(st.method);
  std::vector<size_t> rows;  // the sparse requests in request order: row j of the head's batch
  for (size_t i = 0; i < st.n_req; ++i) {
    if (!st.sparse[i]) continue;
    SPX_RETURN_IF_ERROR(memory_->ensure_sparse_state(*st.seqs[i]));
    rows.push_back(i);
  }
  if (!st.shared || rows.empty()) return Status::ok();
  const float* head_q = nullptr;
  int64_t qd = 0;
  if (st.method == SparseMethod::kSpeContext) {
    const RetrievalHeadConfig& hc = options_.retrieval_head->config;
    Backend& be = *backend_;
    const int64_t n = static_cast<int64_t>(rows.size());
    const int64_t fd = 3 * config().dim, kd = hc.n_kv_heads * hc.head_dim;
    qd = hc.n_heads * hc.head_dim;
    auto row_item = [&](int64_t j) -> const AttentionItem& { return items_[rows[at(j)]]; };
    // Inputs of the batch (backend memory): each row's token and position, read in place when
    // the rows' tokens lie consecutively in the step (every request decoding), else gathered
    // behind the key rows in head_k_rows_; each row's fused(p−1), gathered.
    const size_t k_bytes = (static_cast<size_t>(n * kd) * sizeof(float) + 7) / 8 * 8;
    SPX_ASSIGN_OR_RETURN(void* kp, fit(head_k_rows_, k_bytes + static_cast<size_t>(n) * (sizeof(int64_t) + sizeof(TokenId))));
    float* k = static_cast<float*>(kp);
    const TokenId* ids = st.ids_dev + row_item(0).token_offset;
    const int64_t* positions = st.positions_dev + row_item(0).token_offset;
    bool consecutive = true;
    for (int64_t j = 0; j < n; ++j) consecutive = consecutive && row_item(j).token_offset == row_item(0).token_offset + j;
    if (!consecutive) {
      auto* pos_rows = reinterpret_cast<int64_t*>(static_cast<char*>(kp) + k_bytes);
      auto* id_rows = reinterpret_cast<TokenId*>(pos_rows + n);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t off = row_item(j).token_offset;
        SPX_RETURN_IF_ERROR(be.copy_rows(pos_rows + j, sizeof(int64_t), st.positions_dev + off, sizeof(int64_t),
                                         sizeof(int64_t), 1));
        SPX_RETURN_IF_ERROR(
            be.copy_rows(id_rows + j, sizeof(TokenId), st.ids_dev + off, sizeof(TokenId), sizeof(TokenId), 1));
      }
      ids = id_rows;
      positions = pos_rows;
    }
    const size_t fused_row = static_cast<size_t>(fd) * sizeof(float);
    SPX_ASSIGN_OR_RETURN(float* fused, fit_floats(fused_prev_, n * fd));
    for (int64_t j = 0; j < n; ++j) {
      SPX_RETURN_IF_ERROR(be.copy_rows(fused + j * fd, fused_row, st.seqs[rows[at(j)]]->last_fused.get(), fused_row,
                                       fused_row, 1));
    }
    SPX_ASSIGN_OR_RETURN(float* q, fit_floats(head_q_, n * qd));
    SPX_RETURN_IF_ERROR(project_head(ids, fused, positions, n, q, k));
    for (int64_t j = 0; j < n; ++j) {
      Sequence& s = *st.seqs[rows[at(j)]];
      const int64_t start_pos = row_item(j).start_pos;
      SPX_RETURN_IF_ERROR(memory_->ensure_head_capacity(s, start_pos + 1));
      SPX_RETURN_IF_ERROR(store_head_keys(s, k + j * kd, start_pos, 1));
    }
    head_q = q;
  }
  for (size_t j = 0; j < rows.size(); ++j) {
    const size_t i = rows[j];
    Sequence& s = *st.seqs[i];
    const float* q = head_q == nullptr ? nullptr : head_q + static_cast<int64_t>(j) * qd;
    SPX_RETURN_IF_ERROR(shared_selection_for(s, st.requests[i].seq, q, items_[i].start_pos));
    s.shared_loads.clear();
    s.shared_stats = s.shared_ws.update(s.shared_selection, s.shared_loads);
  }
  return Status::ok();
}

// ---- staging of remote layers ----
// A layer homed in a tier the backend reads (device, host pools on the CPU, mapped pinned host
// memory on CUDA) is attended in place; only a shared selection's working set is loaded, elastic.
// A layer in a tier it cannot read (remote) is staged on the device. Each item's pages this step
// writes (its tail: the new tokens' pages, the first loaded when it holds cached tokens) get a
// buffer per remote layer, from which they go home after the layer. The cached pages before the
// tail, which items that attend densely or select per layer read whole, go through a ring of
// staging_layers buffers: remote layer j + depth is loaded once layer j has computed, so the
// device holds that many remote layers' KV at a time, not every remote layer's.

Status Engine::plan_staging(ForwardStep& st) {
  const TierId device(0);
  const int64_t n_layers = config().n_layers;
  const uint64_t page_bytes = kv_->page_bytes();
  st.load_ticket.assign(at(n_layers), CopyTicket{});
  st.store_ticket.assign(at(n_layers), CopyTicket{});
  st.ring_ticket.assign(at(n_layers), CopyTicket{});
  st.remote.assign(at(n_layers), false);
  st.remote_rank.assign(at(n_layers), 0);
  for (int64_t l = 0; l < n_layers; ++l) {
    const TierId home = kv_->home(LayerId(static_cast<int32_t>(l)));
    if (home != device && !memory_->backend_reads(home)) {
      st.remote[at(l)] = true;
      st.remote_rank[at(l)] = st.remote_layers.size();
      st.remote_layers.push_back(l);
    }
  }
  st.lay_out_staging(items_, kv_->page_size(), options_.tiering.staging_layers);
  st.ring_at.assign(st.depth, 0);
  st.tail_at.assign(at(n_layers), 0);
  for (size_t slot = 0; slot < st.depth; ++slot) {
    SPX_ASSIGN_OR_RETURN(st.ring_at[slot],
                         kv_->allocate(device, static_cast<uint64_t>(st.ring_total) * page_bytes));
    st.staging_hold.keep(st.ring_at[slot]);
  }
  for (int64_t l : st.remote_layers) {
    SPX_ASSIGN_OR_RETURN(st.tail_at[at(l)],
                         kv_->allocate(device, static_cast<uint64_t>(st.tail_total) * page_bytes));
    st.staging_hold.keep(st.tail_at[at(l)]);
  }
  peak_staging_ = std::max(
      peak_staging_, static_cast<uint64_t>(static_cast<int64_t>(st.depth) * st.ring_total +
                                           static_cast<int64_t>(st.remote_layers.size()) * st.tail_total) *
                         page_bytes);
  peak_used_[0] = std::max(peak_used_[0], kv_->tier_used_bytes(device));
  return Status::ok();
}

void Engine::count_loads(TierId home, const std::vector<TransferRequest>& loads) {
  uint64_t bytes = 0;
  for (const TransferRequest& r : loads) bytes += r.bytes;
  traffic(home).bytes_out += bytes;
  traffic(TierId(0)).bytes_in += bytes;
}

Status Engine::post_ring_loads(ForwardStep& st, int64_t l) {
  const TierId device(0);
  const LayerId layer(static_cast<int32_t>(l));
  const TierId home = kv_->home(layer);
  const uint64_t page_bytes = kv_->page_bytes();
  const uint64_t base = st.ring_of(l);
  std::vector<TransferRequest> loads;
  for (size_t i = 0; i < st.n_req; ++i) {
    for (int64_t p = 0; p < st.ring_pages[i]; ++p) {
      const PageLocation loc = kv_->locate(layer, st.seqs[i]->pages[at(p)]);
      loads.push_back({home, loc.offset, device,
                       base + static_cast<uint64_t>(st.ring_first[i] + p) * page_bytes, page_bytes});
    }
  }
  count_loads(home, loads);
  SPX_ASSIGN_OR_RETURN(st.ring_ticket[at(l)],
                       options_.tiering.copies->submit(layer, CopyDirection::kLoad, std::move(loads)));
  return Status::ok();
}

Status Engine::post_prefetch_loads(ForwardStep& st) {
  for (int64_t l = 0; l < config().n_layers; ++l) {
    const LayerId layer(static_cast<int32_t>(l));
    const TierId home = kv_->home(layer);
    if (home == TierId(0)) continue;
    std::vector<TransferRequest> loads = layer_loads(st, l);
    count_loads(home, loads);
    if (!loads.empty()) {
      SPX_ASSIGN_OR_RETURN(st.load_ticket[at(l)],
                           options_.tiering.copies->submit(layer, CopyDirection::kLoad, std::move(loads)));
    }
  }
  for (size_t j = 0; j < st.depth; ++j) SPX_RETURN_IF_ERROR(post_ring_loads(st, st.remote_layers[j]));
  return Status::ok();
}

std::vector<TransferRequest> Engine::layer_loads(ForwardStep& st, int64_t l) {
  const TierId device(0);
  const LayerId layer(static_cast<int32_t>(l));
  const TierId home = kv_->home(layer);
  const int64_t ps = kv_->page_size();
  const uint64_t row_bytes = kv_->row_bytes();
  const uint64_t block_bytes = kv_->block_bytes();
  const uint64_t page_bytes = kv_->page_bytes();
  auto ws_offset = [&](const Slice& ws, int64_t head, int64_t slot) {
    return ws.offset + static_cast<uint64_t>(head * options_.sparse.selection.budget + slot) * row_bytes;
  };
  std::vector<TransferRequest> loads;
  for (size_t i = 0; i < st.n_req; ++i) {
    const Sequence& s = *st.seqs[i];
    const int64_t start = items_[i].start_pos;
    if (st.sparse[i] && st.shared) {
      const LayerSparseState& ls = s.layers[at(l)];
      for (const GatherEntry& e : ls.ws_fresh ? all_slots(s.shared_ws) : s.shared_loads) {
        if (e.token >= start) continue;  // this step's token: appended, then gathered on the device
        const PageLocation loc = kv_->locate(layer, s.pages[at(e.token / ps)]);
        const uint64_t in_block = static_cast<uint64_t>(e.kv_head * ps + e.token % ps) * row_bytes;
        loads.push_back(
            {home, loc.offset + in_block, device, ws_offset(ls.ws_k, e.kv_head, e.slot), row_bytes});
        loads.push_back({home, loc.offset + block_bytes + in_block, device,
                         ws_offset(ls.ws_v, e.kv_head, e.slot), row_bytes});
        ++traffic(home).tokens_loaded;
      }
      traffic(home).tokens_hit += s.shared_stats.tokens_kept;
    } else if (st.remote[at(l)] && start % ps != 0) {
      // The tail's first page holds cached tokens: it is loaded, then the new ones are appended.
      const PageLocation loc = kv_->locate(layer, s.pages[at(start / ps)]);
      loads.push_back({home, loc.offset, device,
                       st.tail_at[at(l)] + static_cast<uint64_t>(st.tail_first[i]) * page_bytes, page_bytes});
    }
  }
  return loads;
}

// ---- one layer ----

Status Engine::run_layer(ForwardStep& st, int64_t l) {
  const LayerId layer(static_cast<int32_t>(l));
  const bool staged = st.remote[at(l)];
  if (st.capture_fused) SPX_RETURN_IF_ERROR(capture_fused_input(st, l));
  SPX_RETURN_IF_ERROR(project_qkv(st, l));
  // A staged layer's pages must have arrived before new tokens are appended to them.
  if (staged) {
    SPX_RETURN_IF_ERROR(wait_ticket(st.load_ticket[at(l)]));
    SPX_RETURN_IF_ERROR(wait_ticket(st.ring_ticket[at(l)]));
  }
  SPX_RETURN_IF_ERROR(append_kv(st, l));
  if (observer_ != nullptr) observer_->on_attention(layer, st.q, items_);
  if (!dense_items_.empty()) {
    SPX_RETURN_IF_ERROR(backend_->attention(
        st.q, dense_items_.data(), static_cast<int64_t>(dense_items_.size()), config().n_heads, st.att));
  }
  SPX_RETURN_IF_ERROR(attend_sparse(st, l));
  SPX_RETURN_IF_ERROR(wait_ticket(st.load_ticket[at(l)]));
  if (staged) SPX_RETURN_IF_ERROR(store_staged_layer(st, l));
  return attention_out_and_mlp(st, l);
}

Status Engine::capture_fused_input(ForwardStep& st, int64_t l) {
  const int64_t dim = config().dim;
  for (int slot = 0; slot < 3; ++slot) {
    if (fused_layers_[static_cast<size_t>(slot)] != l) continue;
    SPX_RETURN_IF_ERROR(backend_->copy_rows(
        st.fused + slot * dim, static_cast<size_t>(3 * dim) * sizeof(float), st.x,
        static_cast<size_t>(dim) * sizeof(float), static_cast<size_t>(dim) * sizeof(float), st.total));
  }
  return Status::ok();
}

Status Engine::project_qkv(ForwardStep& st, int64_t l) {
  const ModelConfig& c = config();
  Backend& be = *backend_;
  const LayerPtrs& w = layer_ptrs_[at(l)];
  const int64_t total = st.total;
  SPX_RETURN_IF_ERROR(be.rmsnorm(st.x, w.attn_norm, total, c.dim, c.norm_eps, st.xb));
  SPX_RETURN_IF_ERROR(be.matmul(st.xb, total, w.wq, w.bq, st.q));
  SPX_RETURN_IF_ERROR(be.matmul(st.xb, total, w.wk, w.bk, st.k));
  SPX_RETURN_IF_ERROR(be.matmul(st.xb, total, w.wv, w.bv, st.v));
  if (c.qk_norm) {
    SPX_RETURN_IF_ERROR(be.rmsnorm(st.q, w.q_norm, total * c.n_heads, c.head_dim, c.norm_eps, st.q));
    SPX_RETURN_IF_ERROR(be.rmsnorm(st.k, w.k_norm, total * c.n_kv_heads, c.head_dim, c.norm_eps, st.k));
  }
  SPX_RETURN_IF_ERROR(be.rope(st.q, total, c.n_heads, st.positions_dev, rope_));
  return be.rope(st.k, total, c.n_kv_heads, st.positions_dev, rope_);
}

Status Engine::append_kv(ForwardStep& st, int64_t l) {
  const LayerId layer(static_cast<int32_t>(l));
  const int64_t kvd = config().kv_dim();
  Backend& be = *backend_;
  dense_items_.clear();
  for (size_t i = 0; i < st.n_req; ++i) {
    if (!st.remote[at(l)]) {
      items_[i].kv = kv_->view(layer, st.seqs[i]->pages, k_ptrs_[i], v_ptrs_[i]);
    } else {
      items_[i].kv = staged_view(st, i, l);
    }
    const int64_t off = items_[i].token_offset;
    SPX_RETURN_IF_ERROR(be.kv_append(st.k + off * kvd, st.v + off * kvd, items_[i].n_tokens,
                                     items_[i].start_pos, items_[i].kv));
    if (st.method == SparseMethod::kQuest) {
      host_rows_.resize(static_cast<size_t>(items_[i].n_tokens * kvd));
      SPX_RETURN_IF_ERROR(
          be.download(host_rows_.data(), st.k + off * kvd, host_rows_.size() * sizeof(float)));
      SPX_RETURN_IF_ERROR(update_quest_bounds(*st.seqs[i], layer, host_rows_.data(), items_[i].start_pos,
                                              items_[i].n_tokens));
    }
    if (!st.sparse[i]) dense_items_.push_back(items_[i]);
  }
  return Status::ok();
}

KvLayerView Engine::staged_view(ForwardStep& st, size_t i, int64_t l) {
  const ModelConfig& c = config();
  const TierId device(0);
  const uint64_t page_bytes = kv_->page_bytes();
  const size_t n_pages = st.seqs[i]->pages.size();
  k_ptrs_[i].resize(n_pages);
  v_ptrs_[i].resize(n_pages);
  auto* ring = st.ring_pages[i] > 0 ? static_cast<std::byte*>(kv_->address(device, st.ring_of(l))) : nullptr;
  auto* tail = static_cast<std::byte*>(kv_->address(device, st.tail_at[at(l)]));
  for (size_t p = 0; p < n_pages; ++p) {
    // An elastic item stages only the page of its new token; every entry points at it.
    const auto pi = static_cast<int64_t>(p);
    std::byte* page =
        st.sparse[i] && st.shared ? tail + static_cast<uint64_t>(st.tail_first[i]) * page_bytes
        : pi < st.ring_pages[i]
            ? ring + static_cast<uint64_t>(st.ring_first[i] + pi) * page_bytes
            : tail + static_cast<uint64_t>(st.tail_first[i] + pi - st.ring_pages[i]) * page_bytes;
    k_ptrs_[i][p] = page;
    v_ptrs_[i][p] = page + kv_->block_bytes();
  }
  KvLayerView view;
  view.k_pages = k_ptrs_[i].data();
  view.v_pages = v_ptrs_[i].data();
  view.n_pages = static_cast<int64_t>(n_pages);
  view.page_size = kv_->page_size();
  view.kv_heads = c.n_kv_heads;
  view.head_dim = c.head_dim;
  view.dtype = kv_->dtype();
  return view;
}

Status Engine::attend_sparse(ForwardStep& st, int64_t l) {
  const LayerId layer(static_cast<int32_t>(l));
  sparse_items_.clear();
  indexed_items_.clear();
  sparse_index_.clear();
  selections_.clear();
  for (size_t i = 0; i < st.n_req; ++i) {
    if (st.sparse[i]) SPX_RETURN_IF_ERROR(add_sparse_item(st, i, l));
  }
  if (sparse_index_.empty()) return Status::ok();
  if (observer_ != nullptr) {
    std::vector<AttentionItem> sparse_attention_items;
    for (size_t idx : sparse_index_) sparse_attention_items.push_back(items_[idx]);
    observer_->on_sparse_selection(layer, sparse_attention_items, selections_);
  }
  const int64_t n_heads = config().n_heads;
  if (!indexed_items_.empty()) {
    // A device-homed layer: the selection is attended where the pages are, no working set.
    SPX_RETURN_IF_ERROR(backend_->attention_indexed(st.q, indexed_items_.data(),
                                                    static_cast<int64_t>(indexed_items_.size()), n_heads, st.att));
  }
  if (sparse_items_.empty()) return Status::ok();
  // The layer waits for its own loads only (posted before layer 0).
  SPX_RETURN_IF_ERROR(wait_ticket(st.load_ticket[at(l)]));
  return backend_->attention_sparse(st.q, sparse_items_.data(), static_cast<int64_t>(sparse_items_.size()), n_heads,
                                    st.att);
}

Status Engine::add_sparse_item(ForwardStep& st, size_t i, int64_t l) {
  const ModelConfig& c = config();
  const LayerId layer(static_cast<int32_t>(l));
  Sequence& s = *st.seqs[i];
  LayerSparseState& ls = s.layers[at(l)];
  const Selection* sel = nullptr;
  SPX_RETURN_IF_ERROR(select_for_layer(s, layer, items_[i], st.q + items_[i].token_offset * c.q_dim(), &sel));
  selections_.push_back(sel);
  sparse_index_.push_back(i);
  const ElasticWorkingSet& ws = st.shared ? s.shared_ws : ls.ws;
  ElasticStats es = s.shared_stats;
  const std::vector<GatherEntry>& gathers = sparse_gathers(st, i, l, *sel, es);
  count_sparse_stats(es);
  if (kv_->home(layer) == TierId(0)) {
    // The selection in the slot map's order (the order a working set would hold it: the
    // attention is then the working set's, bit for bit on the CPU), read where the pages are.
    IndexedAttentionItem ii;
    ii.token_offset = items_[i].token_offset;
    ii.n_tokens = items_[i].n_tokens;
    ii.kv = items_[i].kv;
    ii.indices = ws.slot_tokens().data();
    ii.counts = ws.counts().data();
    ii.stride = ws.slots();
    indexed_items_.push_back(ii);
    return Status::ok();
  }
  WorkingSetView wsv;
  wsv.k = kv_->address(TierId(0), ls.ws_k.offset);
  wsv.v = kv_->address(TierId(0), ls.ws_v.offset);
  wsv.dtype = kv_->dtype();
  wsv.kv_heads = c.n_kv_heads;
  wsv.slots = ws.slots();
  wsv.head_dim = c.head_dim;
  wsv.counts = ws.counts().data();
  if (!gathers.empty()) {
    SPX_RETURN_IF_ERROR(
        backend_->kv_gather(items_[i].kv, gathers.data(), static_cast<int64_t>(gathers.size()), wsv));
  }
  SparseAttentionItem si;
  si.token_offset = items_[i].token_offset;
  si.n_tokens = items_[i].n_tokens;
  si.ws = wsv;
  sparse_items_.push_back(si);
  return Status::ok();
}

const std::vector<GatherEntry>& Engine::sparse_gathers(ForwardStep& st, size_t i, int64_t l,
                                                       const Selection& sel, ElasticStats& es) {
  const TierId device(0);
  const TierId home = kv_->home(LayerId(static_cast<int32_t>(l)));
  Sequence& s = *st.seqs[i];
  LayerSparseState& ls = s.layers[at(l)];
  const bool fresh = ls.ws_fresh;  // a working set allocated this step loads its whole map
  ls.ws_fresh = false;
  loads_.clear();
  if (!st.shared) {
    // The slot map moves on for every layer (the diff is the elastic statistics); only a layer
    // with a working set loads it.
    es = ls.ws.update(sel, loads_);
    if (home == device) {
      loads_.clear();
      return loads_;
    }
    const std::vector<GatherEntry>& loads = fresh ? all_slots(ls.ws) : loads_;
    traffic(home).tokens_loaded += static_cast<int64_t>(loads.size());
    traffic(home).tokens_hit += fresh ? 0 : es.tokens_kept;
    return loads;
  }
  if (home == device) return loads_;  // attended in place: nothing to load
  // Cached tokens arrive through the copy engine; this step's token is gathered here.
  current_loads_.clear();
  for (const GatherEntry& e : fresh ? all_slots(s.shared_ws) : s.shared_loads) {
    if (e.token >= items_[i].start_pos) current_loads_.push_back(e);
  }
  return current_loads_;
}

const std::vector<GatherEntry>& Engine::all_slots(const ElasticWorkingSet& ws) {
  full_loads_.clear();
  for (int64_t h = 0; h < ws.kv_heads(); ++h) {
    for (int64_t slot = 0; slot < ws.counts()[static_cast<size_t>(h)]; ++slot) {
      full_loads_.push_back({static_cast<int32_t>(h), ws.token_at(h, slot), static_cast<int32_t>(slot)});
    }
  }
  return full_loads_;
}

void Engine::count_sparse_stats(const ElasticStats& es) {
  const auto token_bytes = static_cast<int64_t>(2 * kv_->row_bytes());
  sparse_stats_.tokens_selected += es.tokens_selected;
  sparse_stats_.tokens_loaded += es.tokens_loaded;
  sparse_stats_.tokens_kept += es.tokens_kept;
  sparse_stats_.bytes_loaded += es.tokens_loaded * token_bytes;
  sparse_stats_.bytes_full_reload += es.tokens_selected * token_bytes;
}

Status Engine::store_staged_layer(ForwardStep& st, int64_t l) {
  const LayerId layer(static_cast<int32_t>(l));
  const TierId home = kv_->home(layer);
  // The copy engine reads what the compute wrote.
  SPX_RETURN_IF_ERROR(backend_->synchronize());
  std::vector<TransferRequest> stores = staged_stores(st, l);
  uint64_t bytes = 0;
  for (const TransferRequest& r : stores) bytes += r.bytes;
  traffic(home).bytes_in += bytes;
  traffic(TierId(0)).bytes_out += bytes;
  SPX_ASSIGN_OR_RETURN(st.store_ticket[at(l)],
                       options_.tiering.copies->submit(layer, CopyDirection::kStore, std::move(stores)));
  // This layer's ring slot has been read (synchronized above): the remote layer `depth` places
  // further on is loaded into it now.
  const size_t j = st.remote_rank[at(l)] + st.depth;
  if (st.depth > 0 && j < st.remote_layers.size())
    SPX_RETURN_IF_ERROR(post_ring_loads(st, st.remote_layers[j]));
  return Status::ok();
}

std::vector<TransferRequest> Engine::staged_stores(ForwardStep& st, int64_t l) {
  const ModelConfig& c = config();
  const TierId device(0);
  const LayerId layer(static_cast<int32_t>(l));
  const TierId home = kv_->home(layer);
  const int64_t ps = kv_->page_size();
  const uint64_t row_bytes = kv_->row_bytes();
  const uint64_t block_bytes = kv_->block_bytes();
  const uint64_t page_bytes = kv_->page_bytes();
  // The new tokens go home from the tail: whole pages for densely attended items (their cached
  // part was loaded), the token's rows for elastic items.
  std::vector<TransferRequest> stores;
  const uint64_t tail = st.tail_at[at(l)];
  for (size_t i = 0; i < st.n_req; ++i) {
    const Sequence& s = *st.seqs[i];
    const int64_t start = items_[i].start_pos, n = items_[i].n_tokens;
    if (st.sparse[i] && st.shared) {
      const PageLocation loc = kv_->locate(layer, s.pages[at(start / ps)]);
      const uint64_t src_page = tail + static_cast<uint64_t>(st.tail_first[i]) * page_bytes;
      for (int64_t h = 0; h < c.n_kv_heads; ++h) {
        const uint64_t in_block = static_cast<uint64_t>(h * ps + start % ps) * row_bytes;
        stores.push_back({device, src_page + in_block, home, loc.offset + in_block, row_bytes});
        stores.push_back({device, src_page + block_bytes + in_block, home,
                          loc.offset + block_bytes + in_block, row_bytes});
      }
    } else {
      for (int64_t p = start / ps; p <= (start + n - 1) / ps; ++p) {
        const PageLocation loc = kv_->locate(layer, s.pages[at(p)]);
        stores.push_back({device,
                          tail + static_cast<uint64_t>(st.tail_first[i] + p - start / ps) * page_bytes, home,
                          loc.offset, page_bytes});
      }
    }
  }
  return stores;
}

Status Engine::attention_out_and_mlp(ForwardStep& st, int64_t l) {
  const ModelConfig& c = config();
  Backend& be = *backend_;
  Communicator* comm = options_.communicator.get();
  const LayerPtrs& w = layer_ptrs_[at(l)];
  const int64_t total = st.total, dim = c.dim;
  SPX_RETURN_IF_ERROR(be.matmul(st.att, total, w.wo, nullptr, st.tmp));
  if (comm != nullptr) SPX_RETURN_IF_ERROR(comm->all_reduce_sum(st.tmp, total * dim));
  SPX_RETURN_IF_ERROR(be.add(st.x, st.tmp, total * dim));
  SPX_RETURN_IF_ERROR(be.rmsnorm(st.x, w.ffn_norm, total, dim, c.norm_eps, st.xb));
  SPX_RETURN_IF_ERROR(be.matmul(st.xb, total, w.w_gate, nullptr, st.gate));
  SPX_RETURN_IF_ERROR(be.matmul(st.xb, total, w.w_up, nullptr, st.up));
  SPX_RETURN_IF_ERROR(be.swiglu(st.gate, st.up, total * c.hidden_dim, st.gate));
  SPX_RETURN_IF_ERROR(be.matmul(st.gate, total, w.w_down, nullptr, st.tmp));
  if (comm != nullptr) SPX_RETURN_IF_ERROR(comm->all_reduce_sum(st.tmp, total * dim));
  return be.add(st.x, st.tmp, total * dim);
}

// ---- retrieval head keys of the tokens not yet fed to it; fused state for the next step ----

Status Engine::update_fused_state(ForwardStep& st) {
  if (observer_ != nullptr) observer_->on_fused_hidden(st.fused, st.total, items_);
  const int64_t fd = 3 * config().dim;
  const size_t fused_row = static_cast<size_t>(fd) * sizeof(float);
  Backend& be = *backend_;
  for (size_t i = 0; i < st.n_req; ++i) {
    Sequence& s = *st.seqs[i];
    const AttentionItem& it = items_[i];
    if (!s.last_fused) {
      SPX_ASSIGN_OR_RETURN(s.last_fused, be.allocate(fused_row));
      const std::vector<float> zeros(static_cast<size_t>(fd), 0.0f);  // fused(−1) = 0
      SPX_RETURN_IF_ERROR(be.upload(s.last_fused.get(), zeros.data(), fused_row));
    }
    if (st.method == SparseMethod::kSpeContext && !st.sparse[i])
      SPX_RETURN_IF_ERROR(feed_retrieval_head(st, i));
    SPX_RETURN_IF_ERROR(be.copy_rows(s.last_fused.get(), fused_row,
                                     st.fused + (it.token_offset + it.n_tokens - 1) * fd, fused_row,
                                     fused_row, 1));
    if (options_.prefix_sharing && st.method == SparseMethod::kSpeContext) {
      SPX_RETURN_IF_ERROR(keep_boundary_fused(st, i));
    }
  }
  return Status::ok();
}

Status Engine::feed_retrieval_head(ForwardStep& st, size_t i) {
  Backend& be = *backend_;
  Sequence& s = *st.seqs[i];
  const AttentionItem& it = items_[i];
  const int64_t fd = 3 * config().dim;
  const size_t fused_row = static_cast<size_t>(fd) * sizeof(float);
  // fused(p−1) of each row: the stored last one for the first row, this forward's rows after.
  SPX_ASSIGN_OR_RETURN(float* prev, fit_floats(fused_prev_, it.n_tokens * fd));
  SPX_RETURN_IF_ERROR(be.copy_rows(prev, fused_row, s.last_fused.get(), fused_row, fused_row, 1));
  if (it.n_tokens > 1) {
    SPX_RETURN_IF_ERROR(be.copy_rows(prev + fd, fused_row, st.fused + it.token_offset * fd, fused_row,
                                     fused_row, it.n_tokens - 1));
  }
  const auto& hc = options_.retrieval_head->config;
  SPX_ASSIGN_OR_RETURN(float* hq, fit_floats(head_q_, it.n_tokens * hc.n_heads * hc.head_dim));
  SPX_RETURN_IF_ERROR(memory_->ensure_head_capacity(s, it.start_pos + it.n_tokens));
  return run_head(s, st.ids_dev + it.token_offset, prev, st.positions_dev + it.token_offset, it.start_pos,
                  it.n_tokens, hq);
}

Status Engine::keep_boundary_fused(ForwardStep& st, size_t i) {
  // Page-boundary features for fork_sequence; a failed step truncates them again (undo_step).
  Sequence& s = *st.seqs[i];
  const AttentionItem& it = items_[i];
  const int64_t ps = kv_->page_size();
  const int64_t fd = 3 * config().dim;
  const size_t fused_row = static_cast<size_t>(fd) * sizeof(float);
  for (int64_t k = 0; k < it.n_tokens; ++k) {
    const int64_t pos = it.start_pos + k;
    if ((pos + 1) % ps != 0) continue;
    SPX_ASSIGN_OR_RETURN(std::shared_ptr<void> boundary, backend_->allocate(fused_row));
    SPX_RETURN_IF_ERROR(backend_->copy_rows(boundary.get(), fused_row, st.fused + (it.token_offset + k) * fd,
                                            fused_row, fused_row, 1));
    s.boundary_fused.resize(static_cast<size_t>(pos / ps));
    s.boundary_fused.push_back(std::move(boundary));
  }
  return Status::ok();
}

// ---- logits for the rows asked for; sampled rows first, decided where the logits are ----

Result<StepOutput> Engine::compute_logits(ForwardStep& st) {
  const ModelConfig& c = config();
  StepOutput out;
  out.vocab = c.vocab_size;
  out.first_row.assign(st.n_req, -1);
  out.n_rows.assign(st.n_req, 0);
  out.tokens.assign(st.n_req, -1);
  int64_t n_sample = 0, n_out = 0;
  for (size_t i = 0; i < st.n_req; ++i) {
    const LogitsMode mode = st.requests[i].logits;
    if (mode == LogitsMode::kSample) ++n_sample;
    const int64_t n = mode == LogitsMode::kAll ? items_[i].n_tokens : mode == LogitsMode::kLast ? 1 : 0;
    if (n > 0) out.first_row[i] = n_out;
    out.n_rows[i] = n;
    n_out += n;
  }
  if (n_sample + n_out == 0) return out;
  SPX_ASSIGN_OR_RETURN(float* rows, fit_floats(rows_, (n_sample + n_out) * c.dim));
  SPX_RETURN_IF_ERROR(gather_output_rows(st, out, n_sample, rows));
  SPX_RETURN_IF_ERROR(backend_->rmsnorm(rows, final_norm_, n_sample + n_out, c.dim, c.norm_eps, rows));
  if (n_sample > 0) SPX_RETURN_IF_ERROR(sample_tokens(st, rows, n_sample, out));
  if (n_out > 0) SPX_RETURN_IF_ERROR(project_logits(rows + n_sample * c.dim, n_out, out));
  return out;
}

Status Engine::gather_output_rows(ForwardStep& st, const StepOutput& out, int64_t n_sample, float* rows) {
  const int64_t dim = config().dim;
  const size_t dim_bytes = static_cast<size_t>(dim) * sizeof(float);
  int64_t sampled = 0, returned = n_sample;
  draw_values_.clear();
  for (size_t i = 0; i < st.n_req; ++i) {
    const bool sample = st.requests[i].logits == LogitsMode::kSample;
    const int64_t n = sample ? 1 : out.n_rows[i];
    if (n == 0) continue;
    const int64_t first = items_[i].token_offset + items_[i].n_tokens - n;
    int64_t& r = sample ? sampled : returned;
    SPX_RETURN_IF_ERROR(
        backend_->copy_rows(rows + r * dim, dim_bytes, st.x + first * dim, dim_bytes, dim_bytes, n));
    r += n;
    if (sample) draw_values_.push_back(*st.requests[i].draw);
  }
  return Status::ok();
}

Status Engine::sample_tokens(ForwardStep& st, const float* rows, int64_t n_sample, StepOutput& out) {
  const int64_t vocab = config().vocab_size;
  SPX_ASSIGN_OR_RETURN(float* logits, fit_floats(logits_, n_sample * vocab));
  SPX_RETURN_IF_ERROR(backend_->matmul(rows, n_sample, lm_head_, nullptr, logits));
  sampled_.resize(static_cast<size_t>(n_sample));
  SPX_RETURN_IF_ERROR(backend_->sample_rows(logits, n_sample, vocab, draw_values_.data(), sampled_.data()));
  for (size_t i = 0, k = 0; i < st.n_req; ++i) {
    if (st.requests[i].logits == LogitsMode::kSample) out.tokens[i] = sampled_[k++];
  }
  return Status::ok();
}

Status Engine::project_logits(const float* rows, int64_t n_out, StepOutput& out) {
  Backend& be = *backend_;
  const int64_t vocab = config().vocab_size;
  out.logits.resize(static_cast<size_t>(n_out * vocab));
  if (be.memory_kind() == MemoryKind::kHost)
    return be.matmul(rows, n_out, lm_head_, nullptr, out.logits.data());
  SPX_ASSIGN_OR_RETURN(float* logits, fit_floats(logits_, n_out * vocab));
  SPX_RETURN_IF_ERROR(be.matmul(rows, n_out, lm_head_, nullptr, logits));
  return be.download(out.logits.data(), logits, out.logits.size() * sizeof(float));
}

}  // namespace specontext
