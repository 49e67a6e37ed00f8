#include "core/engine.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <unordered_set>

namespace specontext {

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
  e->options_ = options;
  e->max_context_ = options.max_context > 0 ? options.max_context : c.max_seq_len;
  if (e->max_context_ <= 0) return invalid_argument("model has no max_seq_len; set max_context");
  const int64_t pages_per_seq = (e->max_context_ + options.page_size - 1) / options.page_size;
  const int64_t n_pages = options.kv_pages > 0 ? options.kv_pages : pages_per_seq * options.max_sequences;
  SPX_ASSIGN_OR_RETURN(e->kv_, KvCache::create(c, *e->backend_, options.page_size, n_pages));
  e->rope_ = make_rope_params(c);
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
  int64_t row = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const StepRequest& r = requests[i];
    const int64_t start = sequences_[r.seq].length;
    items_[i].token_offset = row;
    items_[i].n_tokens = static_cast<int64_t>(r.tokens.size());
    items_[i].start_pos = start;
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

  SPX_RETURN_IF_ERROR(be.embed(ids_.data(), total, m.tok_embeddings, x));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layers[static_cast<size_t>(l)];
    const LayerId layer(static_cast<int32_t>(l));
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
    for (size_t i = 0; i < requests.size(); ++i) {
      items_[i].kv = kv_->view(layer, sequences_[requests[i].seq].pages, k_ptrs_[i], v_ptrs_[i]);
      const int64_t off = items_[i].token_offset;
      SPX_RETURN_IF_ERROR(be.kv_append(k + off * kvd, v + off * kvd, items_[i].n_tokens,
                                       items_[i].start_pos, items_[i].kv));
    }
    SPX_RETURN_IF_ERROR(be.attention(q, items_.data(), static_cast<int64_t>(items_.size()), c.n_heads, att));
    SPX_RETURN_IF_ERROR(be.matmul(att, total, w.wo, nullptr, tmp));
    SPX_RETURN_IF_ERROR(be.add(x, tmp, total * dim));
    SPX_RETURN_IF_ERROR(be.rmsnorm(x, w.ffn_norm.data(), total, dim, c.norm_eps, xb));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.w_gate, nullptr, gate));
    SPX_RETURN_IF_ERROR(be.matmul(xb, total, w.w_up, nullptr, up));
    SPX_RETURN_IF_ERROR(be.swiglu(gate, up, total * hd, gate));
    SPX_RETURN_IF_ERROR(be.matmul(gate, total, w.w_down, nullptr, tmp));
    SPX_RETURN_IF_ERROR(be.add(x, tmp, total * dim));
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
  for (size_t i = 0; i < requests.size(); ++i) sequences_[requests[i].seq].length += items_[i].n_tokens;
  return out;
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
  s.length = n_tokens;
  return Status::ok();
}

}  // namespace specontext
