// Prefix offloading: a sequence's whole pages out of the KV cache into host memory and back
// (PrefixSnapshot). The scheduler keeps evicted cached prefixes this way (serving/scheduler.h).
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "core/base/fnv1a.h"
#include "core/engine/engine.h"

namespace specontext {
namespace {

class Fnv1a {
 public:
  void add_bytes(const void* data, size_t n) { hash_ = fnv1a64(data, n, hash_); }
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
  uint64_t hash_ = kFnv1aBasis;
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

}  // namespace specontext
