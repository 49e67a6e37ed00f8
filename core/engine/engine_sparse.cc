// Sparse-decode state of the engine: working sets, the retrieval head and its K cache, and the
// per-step selections (SpeContext, streaming, Quest, oracle).
#include <algorithm>
#include <cmath>
#include <string>

#include "core/engine/engine.h"
#include "core/sparse/candidate_select.h"

namespace specontext {

Status Engine::project_head(const TokenId* tokens_dev, const float* fused_prev, const int64_t* positions_dev,
                            int64_t n, float* q_out, float* k_out) {
  const RetrievalHeadConfig& hc = options_.retrieval_head->config;
  Backend& be = *backend_;
  const int64_t d = hc.hidden;
  SPX_ASSIGN_OR_RETURN(void* scratch, fit(head_x_, static_cast<size_t>(n * 4 * d) * sizeof(float)));
  float* x = static_cast<float*>(scratch);  // [n, 2d]
  float* e = x + n * 2 * d;                 // [n, d]
  float* h = e + n * d;                     // [n, d]
  // x = RMSNorm_input(embed(token)) ⊕ RMSNorm_hidden(fc · fused(p−1)); see core/sparse/retrieval_head.h.
  SPX_RETURN_IF_ERROR(be.embed(tokens_dev, n, tok_embeddings_, e));
  SPX_RETURN_IF_ERROR(be.rmsnorm(e, head_input_norm_, n, d, hc.norm_eps, e));
  SPX_RETURN_IF_ERROR(be.matmul(fused_prev, n, head_fc_, nullptr, h));
  SPX_RETURN_IF_ERROR(be.rmsnorm(h, head_hidden_norm_, n, d, hc.norm_eps, h));
  const size_t row = static_cast<size_t>(d) * sizeof(float);
  SPX_RETURN_IF_ERROR(be.copy_rows(x, 2 * row, e, row, row, n));
  SPX_RETURN_IF_ERROR(be.copy_rows(x + d, 2 * row, h, row, row, n));
  SPX_RETURN_IF_ERROR(be.matmul(x, n, head_wq_, nullptr, q_out));
  SPX_RETURN_IF_ERROR(be.matmul(x, n, head_wk_, nullptr, k_out));
  SPX_RETURN_IF_ERROR(be.rope(q_out, n, hc.n_heads, positions_dev, head_rope_));
  return be.rope(k_out, n, hc.n_kv_heads, positions_dev, head_rope_);
}

Status Engine::store_head_keys(Sequence& s, const float* k, int64_t start_pos, int64_t n) {
  const RetrievalHeadConfig& hc = options_.retrieval_head->config;
  const int64_t kd = hc.n_kv_heads * hc.head_dim;
  if (start_pos + n > memory_->head_capacity(s)) return internal_error("retrieval head cache too small");
  if (options_.kv_dtype != DType::kF32) {
    // Rounded to the KV dtype as KV is (nearest even), by kv_append over the key blocks seen as
    // pages of one "head" of kd elements: [1][block_tokens][kd] is the blocks' token-major layout.
    // The V pages are the K pages and v = k, so each element is written twice with the same value
    // by the same thread (every backend's kv_append handles a (token, head) row on one thread).
    const void* const* table = memory_->head_block_table(s);
    KvLayerView view;
    view.k_pages = const_cast<void* const*>(table);
    view.v_pages = view.k_pages;
    view.n_pages = memory_->head_capacity(s) / memory_->head_block_tokens_;
    view.page_size = memory_->head_block_tokens_;
    view.kv_heads = 1;
    view.head_dim = kd;
    view.dtype = options_.kv_dtype;
    return backend_->kv_append(k, k, n, start_pos, view);
  }
  // Into the paged cache, one run of rows per block touched.
  const size_t key_row = static_cast<size_t>(kd) * sizeof(float);
  for (int64_t t = start_pos; t < start_pos + n;) {
    const int64_t run =
        std::min(start_pos + n - t, memory_->head_block_tokens_ - t % memory_->head_block_tokens_);
    SPX_RETURN_IF_ERROR(backend_->copy_rows(memory_->head_row(s, t), key_row, k + (t - start_pos) * kd, key_row,
                                            key_row, run));
    t += run;
  }
  return Status::ok();
}

Status Engine::run_head(Sequence& s, const TokenId* tokens_dev, const float* fused_prev, const int64_t* positions_dev,
                        int64_t start_pos, int64_t n, float* q_out) {
  const RetrievalHeadConfig& hc = options_.retrieval_head->config;
  const int64_t kd = hc.n_kv_heads * hc.head_dim;
  SPX_ASSIGN_OR_RETURN(float* k, fit_floats(head_k_rows_, n * kd));  // store_head_keys checks the capacity
  SPX_RETURN_IF_ERROR(project_head(tokens_dev, fused_prev, positions_dev, n, q_out, k));
  return store_head_keys(s, k, start_pos, n);
}

Status Engine::shared_selection_for(Sequence& s, SeqId id, const float* head_q, int64_t start_pos) {
  const int64_t length = start_pos + 1;  // the current token is attended too
  const SelectionOptions& opts = options_.sparse.selection;
  if (options_.sparse.method == SparseMethod::kStreaming) {
    select_streaming(config().n_kv_heads, length, opts, s.shared_selection);
    return Status::ok();
  }
  const RetrievalHeadConfig& hc = options_.retrieval_head->config;
  Backend& be = *backend_;
  const float* hq = head_q;
  if (memory_->placement_.cpu_filtering && options_.tiering.candidate_filter) {
    // The CPU shortlists pages from its summaries of the head's keys; the head scores only those
    // candidates (core/ports/candidate_filter.h). Keys and query are read on the host. A head
    // whose query heads take turns is shortlisted by the same bound (the group's max: a page that
    // any one head ranks high has a high max) and ranks its candidates by turns.
    if (!memory_->host_visible(s.head_tier)) {
      return unimplemented("CPU candidate filtering reads the retrieval head's keys on the host, but they are in " +
                           kv_->tiers()[static_cast<size_t>(s.head_tier.value())].desc.name);
    }
    CandidateFilter& filter = *options_.tiering.candidate_filter;
    // Catch the summaries up to the keys written so far, this step's included (a failed step
    // leaves its key summarised: a summary only bounds a page, so that loosens, never breaks, it).
    // The filter summarises f32 rows: keys of an f16 / bf16 cache are widened a run (at most one
    // block) at a time into host_keys_.
    const int64_t kd = hc.n_kv_heads * hc.head_dim;
    while (s.filter_tokens < length) {
      const int64_t t = s.filter_tokens;
      const int64_t run = std::min(length - t, memory_->head_block_tokens_ - t % memory_->head_block_tokens_);
      const void* rows = memory_->head_row(s, t);
      if (options_.kv_dtype != DType::kF32) {
        host_keys_.resize(static_cast<size_t>(run * kd));
        convert_to_f32(options_.kv_dtype, rows, host_keys_.data(), host_keys_.size());
        rows = host_keys_.data();
      }
      SPX_RETURN_IF_ERROR(filter.append_keys(id, static_cast<const float*>(rows), t, run));
      s.filter_tokens += run;
    }
    host_q_.resize(static_cast<size_t>(hc.n_heads * hc.head_dim));
    SPX_RETURN_IF_ERROR(be.download(host_q_.data(), hq, host_q_.size() * sizeof(float)));
    const int64_t shortlist = options_.tiering.shortlist_tokens > 0 ? options_.tiering.shortlist_tokens : 4 * opts.budget;
    SPX_RETURN_IF_ERROR(filter.shortlist(id, host_q_.data(), length, shortlist, opts, candidates_));
    ++filtered_steps_;
    return select_among_candidates(host_q_.data(), memory_->head_block_table(s), options_.kv_dtype,
                                   memory_->head_block_tokens_,
                                   hc.n_heads, hc.n_kv_heads, hc.head_dim, candidates_, opts,
                                   s.shared_selection, hc.select_group);
  }
  if (hc.select_group == GroupReduce::kTurns) {  // a head whose query heads learned one layer each
    SPX_ASSIGN_OR_RETURN(float* scratch, fit_floats(scores_, select_by_turns_scratch_floats(hc, length)));
    return select_by_turns(be, hc, hq, memory_->head_block_table(s), options_.kv_dtype, memory_->head_block_tokens_,
                           length, opts,
                           scratch, s.shared_selection);
  }
  SPX_ASSIGN_OR_RETURN(void* sp, fit(scores_, static_cast<size_t>(hc.n_kv_heads * length) * sizeof(float)));
  float* scores = static_cast<float*>(sp);
  SPX_RETURN_IF_ERROR(be.retrieval_group_scores(hq, memory_->head_block_table(s), options_.kv_dtype,
                                                memory_->head_block_tokens_,
                                                length, hc.n_heads, hc.n_kv_heads, hc.head_dim, scores));
  return be.select_top_tokens(scores, hc.n_kv_heads, length, opts, s.shared_selection);
}

Status Engine::update_quest_bounds(Sequence& s, LayerId layer, const float* k_rows, int64_t start_pos, int64_t n) {
  const ModelConfig& c = config();
  memory_->ensure_layers(s);
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
  return Status::ok();
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
      host_q_.resize(static_cast<size_t>(c.q_dim()));
      SPX_RETURN_IF_ERROR(backend_->download(host_q_.data(), q, host_q_.size() * sizeof(float)));
      select_quest(host_q_.data(), c.n_heads, c.n_kv_heads, c.head_dim, ls.page_min.data(), ls.page_max.data(),
                   options_.sparse.quest_page_size, length, options_.sparse.selection, ls.selection);
      *selection = &ls.selection;
      return Status::ok();
    case SparseMethod::kOracle: {
      // The layer's true attention weights of this token: softmax(q·Kᵀ/√d) over the whole cache
      // (host memory: Engine::create allows the oracle on host backends only).
      std::vector<float> sc(static_cast<size_t>(c.n_heads * length));
      const int64_t group = c.n_heads / c.n_kv_heads;
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      std::vector<float> kr(static_cast<size_t>(c.head_dim));
      for (int64_t h = 0; h < c.n_heads; ++h) {
        const int64_t kvh = h / group;
        float* row = sc.data() + h * length;
        float mx = -INFINITY;
        for (int64_t t = 0; t < length; ++t) {
          const float* k = kv_row_f32(item.kv, /*values=*/false, kvh, t, kr.data());
          float d = 0.0f;
          for (int64_t i = 0; i < c.head_dim; ++i) d += q[h * c.head_dim + i] * k[i];
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

}  // namespace specontext
