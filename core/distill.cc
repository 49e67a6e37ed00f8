// Retrieval-head distillation: teacher capture through ForwardObserver, a KL(teacher ‖ head)
// objective with hand-written gradients for wq/wk, Adam, and the held-out fidelity report.
#include "core/distill.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <numeric>
#include <string>

#include "core/engine.h"

namespace specontext {

namespace {

constexpr std::string_view kStorySeparator = "<|endoftext|>";

int64_t tri(int64_t t) { return t * (t + 1) / 2; }  // offset of teacher row t

struct SplitMix {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

// Records the layer- and group-averaged attention of one dense prefill and its fused features.
class TeacherObserver final : public ForwardObserver {
 public:
  TeacherObserver(const ModelConfig& c, DistillChunk* chunk) : c_(c), chunk_(chunk) {}

  void on_attention(LayerId layer, const float* q, std::span<const AttentionItem> items) override {
    if (items.size() != 1 || items[0].start_pos != 0 || items[0].n_tokens != chunk_->length()) {
      error_ = internal_error("distill: expected one dense prefill of the whole chunk");
      return;
    }
    const KvLayerView& kv = items[0].kv;
    const int64_t n = chunk_->length(), hd = c_.head_dim, nh = c_.n_heads, nkv = c_.n_kv_heads;
    const int64_t group = nh / nkv;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const float weight = 1.0f / static_cast<float>(c_.n_layers * group);
    std::vector<float> keys(static_cast<size_t>(n * hd));
    std::vector<float> row(static_cast<size_t>(n));
    for (int64_t g = 0; g < nkv; ++g) {
      // Contiguous copy of head g's keys: page t/ps, slot t%ps, block [kv_heads][ps][hd].
      for (int64_t t = 0; t < n; ++t) {
        const float* src = kv_row_f32(kv, /*values=*/false, g, t, keys.data() + t * hd);
        if (src != keys.data() + t * hd) std::copy_n(src, hd, keys.data() + t * hd);
      }
      float* out = chunk_->teacher.data() + g * tri(n);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t t = 0; t < n; ++t) {
          const float* qh = q + (items[0].token_offset + t) * nh * hd + h * hd;
          float mx = -INFINITY;
          for (int64_t j = 0; j <= t; ++j) {
            float s = 0.0f;
            for (int64_t i = 0; i < hd; ++i) s += qh[i] * keys[static_cast<size_t>(j * hd + i)];
            row[static_cast<size_t>(j)] = s * scale;
            mx = std::max(mx, s * scale);
          }
          double sum = 0.0;
          for (int64_t j = 0; j <= t; ++j) {
            row[static_cast<size_t>(j)] = std::exp(row[static_cast<size_t>(j)] - mx);
            sum += row[static_cast<size_t>(j)];
          }
          const float w = static_cast<float>(weight / sum);
          float* dst = out + tri(t);
          for (int64_t j = 0; j <= t; ++j) dst[j] += row[static_cast<size_t>(j)] * w;
        }
      }
    }
    ++layers_seen_;
    (void)layer;
  }

  void on_fused_hidden(const float* fused, int64_t rows, std::span<const AttentionItem>) override {
    chunk_->fused.assign(fused, fused + rows * 3 * c_.dim);
  }

  Status status() const {
    if (!error_.is_ok()) return error_;
    if (layers_seen_ != c_.n_layers) {
      return internal_error("distill: the engine reported " + std::to_string(layers_seen_) +
                            " attention layers, the model has " + std::to_string(c_.n_layers));
    }
    if (static_cast<int64_t>(chunk_->fused.size()) != chunk_->length() * 3 * c_.dim) {
      return internal_error("distill: the engine emitted no fused hidden features");
    }
    return Status::ok();
  }

 private:
  const ModelConfig& c_;
  DistillChunk* chunk_;
  Status error_;
  int64_t layers_seen_ = 0;
};

// fused(p−1) of each row: zeros for position 0, then the previous rows.
std::vector<float> shifted_fused(const DistillChunk& ch, int64_t d) {
  const int64_t fd = 3 * d, n = ch.length();
  std::vector<float> prev(static_cast<size_t>(n * fd), 0.0f);
  if (n > 1) std::copy_n(ch.fused.data(), (n - 1) * fd, prev.data() + fd);
  return prev;
}

// cos/sin tables of the head's RoPE for positions [0, n), as the reference backend computes them.
struct RopeTable {
  int64_t half = 0;
  float mscale = 1.0f;
  std::vector<float> cos, sin;
  RopeTable(const RopeParams& p, int64_t n) : half(p.head_dim / 2), mscale(p.mscale) {
    cos.resize(static_cast<size_t>(n * half));
    sin.resize(static_cast<size_t>(n * half));
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(t) * p.inv_freq[static_cast<size_t>(i)];
        cos[static_cast<size_t>(t * half + i)] = std::cos(a);
        sin[static_cast<size_t>(t * half + i)] = std::sin(a);
      }
    }
  }
  // Rotates one head vector (rotate_half pairing) by position t; transpose = the inverse
  // rotation (RoPE is orthogonal up to the scalar mscale), used to backpropagate.
  void apply(float* v, int64_t t, bool transpose) const {
    const float* c = cos.data() + t * half;
    const float* s = sin.data() + t * half;
    const float sign = transpose ? -1.0f : 1.0f;
    for (int64_t i = 0; i < half; ++i) {
      const float x0 = v[i], x1 = v[i + half], si = sign * s[i];
      v[i] = (x0 * c[i] - x1 * si) * mscale;
      v[i + half] = (x0 * si + x1 * c[i]) * mscale;
    }
  }
};

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

struct Adam {
  std::vector<float> m, v;
  int64_t t = 0;
  explicit Adam(size_t n) : m(n, 0.0f), v(n, 0.0f) {}
  void step(float* w, const float* g, size_t n, double lr) {
    constexpr double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    ++t;
    const double c1 = 1.0 - std::pow(b1, static_cast<double>(t));
    const double c2 = 1.0 - std::pow(b2, static_cast<double>(t));
    for (size_t i = 0; i < n; ++i) {
      m[i] = static_cast<float>(b1 * m[i] + (1.0 - b1) * g[i]);
      v[i] = static_cast<float>(b2 * v[i] + (1.0 - b2) * double(g[i]) * g[i]);
      w[i] -= static_cast<float>(lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + eps));
    }
  }
};

// KL(T ‖ P) for one query row given the head's probabilities.
double kl_row(const float* teacher, const float* p, int64_t n) {
  double kl = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double t = teacher[j];
    if (t > 0.0) kl += t * (std::log(t) - std::log(std::max<double>(p[j], 1e-30)));
  }
  return kl;
}

// Sum of the teacher's weights on the top-B entries of `score` (ties: older token first).
double top_mass(const float* score, const float* teacher, int64_t n, int64_t budget,
                std::vector<int32_t>& idx) {
  idx.resize(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [score](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + budget, idx.end(), better);
  double mass = 0.0;
  for (int64_t i = 0; i < budget; ++i) mass += teacher[idx[static_cast<size_t>(i)]];
  return mass;
}

}  // namespace

Result<std::vector<TokenId>> encode_corpus(const Tokenizer& tokenizer, std::string_view text) {
  std::vector<TokenId> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(kStorySeparator, start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view story = text.substr(start, end - start);
    while (!story.empty() && std::isspace(static_cast<unsigned char>(story.front()))) story.remove_prefix(1);
    while (!story.empty() && std::isspace(static_cast<unsigned char>(story.back()))) story.remove_suffix(1);
    if (!story.empty()) {
      SPX_ASSIGN_OR_RETURN(std::vector<TokenId> ids, tokenizer.encode(story, /*add_bos=*/true));
      out.insert(out.end(), ids.begin(), ids.end());
    }
    if (end == text.size()) break;
    start = end + kStorySeparator.size();
  }
  return out;
}

std::vector<std::vector<TokenId>> split_chunks(std::span<const TokenId> tokens, int64_t context,
                                               int64_t min_len) {
  std::vector<std::vector<TokenId>> out;
  if (context <= 0) return out;
  for (size_t i = 0; i < tokens.size(); i += static_cast<size_t>(context)) {
    const size_t n = std::min(tokens.size() - i, static_cast<size_t>(context));
    if (static_cast<int64_t>(n) < std::max<int64_t>(min_len, 2)) break;
    out.emplace_back(tokens.begin() + static_cast<std::ptrdiff_t>(i),
                     tokens.begin() + static_cast<std::ptrdiff_t>(i + n));
  }
  return out;
}

Result<std::vector<DistillChunk>> collect_teacher(std::shared_ptr<const Model> model,
                                                  std::shared_ptr<Backend> backend,
                                                  const std::vector<std::vector<TokenId>>& chunks) {
  if (!model || !backend) return invalid_argument("distill: a model and a backend are required");
  const ModelConfig& c = model->config;
  int64_t longest = 1;
  for (const auto& ch : chunks) longest = std::max<int64_t>(longest, static_cast<int64_t>(ch.size()));
  EngineOptions eo;
  eo.max_sequences = 1;
  eo.max_context = longest;
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::create(model, backend, eo));
  std::vector<DistillChunk> out;
  out.reserve(chunks.size());
  for (const auto& tokens : chunks) {
    if (tokens.empty()) continue;
    DistillChunk ch;
    ch.tokens = tokens;
    ch.teacher.assign(static_cast<size_t>(c.n_kv_heads * tri(ch.length())), 0.0f);
    TeacherObserver obs(c, &ch);
    engine->set_observer(&obs);
    SPX_ASSIGN_OR_RETURN(SeqId seq, engine->add_sequence());
    StepRequest req{seq, std::span<const TokenId>(ch.tokens), LogitsMode::kNone};
    auto step = engine->forward(std::span<const StepRequest>(&req, 1));
    engine->set_observer(nullptr);
    SPX_RETURN_IF_ERROR(engine->remove_sequence(seq));
    if (!step.is_ok()) return step.status();
    SPX_RETURN_IF_ERROR(obs.status());
    out.push_back(std::move(ch));
  }
  return out;
}

Result<Fidelity> evaluate_head(Backend& backend, const Model& model, const RetrievalHead& head,
                               std::span<const DistillChunk> chunks, std::span<const int64_t> budgets) {
  const RetrievalHeadConfig& hc = head.config;
  const int64_t d = hc.hidden, nh = hc.n_heads, nkv = hc.n_kv_heads, hd = hc.head_dim;
  const int64_t qd = nh * hd, kvd = nkv * hd, group = nh / nkv;
  if (nkv != model.config.n_kv_heads) {
    return invalid_argument("distill: head KV heads differ from the target's");
  }
  Fidelity f;
  for (int64_t b : budgets) f.recall.push_back(BudgetRecall{b});
  double kl_sum = 0.0;
  std::vector<float> p, group_score(0);
  std::vector<int32_t> idx;
  for (const DistillChunk& ch : chunks) {
    const int64_t n = ch.length();
    const RopeParams rope = make_head_rope_params(hc, n);
    std::vector<float> q(static_cast<size_t>(n * qd)), k(static_cast<size_t>(n * kvd));
    std::vector<int64_t> pos(static_cast<size_t>(n));
    std::iota(pos.begin(), pos.end(), int64_t{0});
    const std::vector<float> prev = shifted_fused(ch, d);
    SPX_RETURN_IF_ERROR(retrieval_qk(backend, head, rope, model.tok_embeddings, ch.tokens.data(), prev.data(),
                                     pos.data(), n, q.data(), k.data()));
    for (int64_t t = 1; t < n; ++t) {
      const int64_t len = t + 1;
      p.resize(static_cast<size_t>(nh * len));
      retrieval_scores(head, q.data() + t * qd, k.data(), len, p.data());
      for (int64_t h = 0; h < nh; ++h) {
        kl_sum += kl_row(ch.teacher.data() + (h / group) * tri(n) + tri(t), p.data() + h * len, len);
      }
      ++f.positions;
      group_score.resize(static_cast<size_t>(len));
      for (BudgetRecall& r : f.recall) {
        if (len <= r.budget) continue;
        ++r.positions;
        double head_mass = 0, stream_mass = 0, oracle_mass = 0;
        for (int64_t g = 0; g < nkv; ++g) {
          const float* tg = ch.teacher.data() + g * tri(n) + tri(t);
          for (int64_t j = 0; j < len; ++j) {
            float m = 0.0f;
            for (int64_t h = g * group; h < (g + 1) * group; ++h)
              m = std::max(m, p[static_cast<size_t>(h * len + j)]);
            group_score[static_cast<size_t>(j)] = m;
          }
          head_mass += top_mass(group_score.data(), tg, len, r.budget, idx);
          oracle_mass += top_mass(tg, tg, len, r.budget, idx);
          const int64_t sinks = std::min<int64_t>(4, r.budget);
          const int64_t recent = r.budget - sinks;
          for (int64_t j = 0; j < len; ++j) {
            if (j < sinks || j >= len - recent) stream_mass += tg[j];
          }
        }
        r.head += head_mass / static_cast<double>(nkv);
        r.streaming += stream_mass / static_cast<double>(nkv);
        r.oracle += oracle_mass / static_cast<double>(nkv);
      }
    }
  }
  if (f.positions > 0) f.kl = kl_sum / static_cast<double>(f.positions * nh);
  for (BudgetRecall& r : f.recall) {
    if (r.positions == 0) continue;
    r.head /= static_cast<double>(r.positions);
    r.streaming /= static_cast<double>(r.positions);
    r.oracle /= static_cast<double>(r.positions);
  }
  return f;
}

double distill_loss_grad(const RetrievalHead& head, const RopeParams& rope_params, const DistillChunk& ch,
                         const float* x, std::span<const int64_t> positions, float* grad_q, float* grad_k) {
  const RetrievalHeadConfig& hc = head.config;
  const int64_t d2 = 2 * hc.hidden, nh = hc.n_heads, nkv = hc.n_kv_heads, hd = hc.head_dim;
  const int64_t qd = nh * hd, kvd = nkv * hd, group = nh / nkv, n = ch.length();
  std::fill(grad_q, grad_q + qd * d2, 0.0f);
  std::fill(grad_k, grad_k + kvd * d2, 0.0f);
  if (positions.empty()) return 0.0;
  const float* wq = static_cast<const float*>(head.wq.data);
  const float* wk = static_cast<const float*>(head.wk.data);
  const int64_t tmax = *std::max_element(positions.begin(), positions.end());
  const int64_t nk = tmax + 1;
  const RopeTable rope(rope_params, nk);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  // Keys of positions 0..tmax with the current wk.
  std::vector<float> keys(static_cast<size_t>(nk * kvd)), dkeys(static_cast<size_t>(nk * kvd), 0.0f);
  for (int64_t j = 0; j < nk; ++j) {
    float* kj = keys.data() + j * kvd;
    for (int64_t r = 0; r < kvd; ++r) kj[r] = dot(wk + r * d2, x + j * d2, d2);
    for (int64_t g = 0; g < nkv; ++g) rope.apply(kj + g * hd, j, false);
  }
  std::vector<float> qv(static_cast<size_t>(qd)), dq(static_cast<size_t>(qd)), logit(static_cast<size_t>(nk));
  const float norm = 1.0f / static_cast<float>(static_cast<int64_t>(positions.size()) * nh);
  double loss = 0.0;
  for (int64_t t : positions) {
    const float* xt = x + t * d2;
    for (int64_t r = 0; r < qd; ++r) qv[static_cast<size_t>(r)] = dot(wq + r * d2, xt, d2);
    for (int64_t h = 0; h < nh; ++h) rope.apply(qv.data() + h * hd, t, false);
    std::fill(dq.begin(), dq.end(), 0.0f);
    const int64_t len = t + 1;
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t g = h / group;
      const float* qh = qv.data() + h * hd;
      const float* tg = ch.teacher.data() + g * tri(n) + tri(t);
      float mx = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        logit[static_cast<size_t>(j)] = dot(qh, keys.data() + j * kvd + g * hd, hd) * scale;
        mx = std::max(mx, logit[static_cast<size_t>(j)]);
      }
      double z = 0.0;
      for (int64_t j = 0; j < len; ++j) z += std::exp(double(logit[static_cast<size_t>(j)] - mx));
      const double log_z = std::log(z) + mx;
      float* dqh = dq.data() + h * hd;
      for (int64_t j = 0; j < len; ++j) {
        const double log_p = logit[static_cast<size_t>(j)] - log_z;
        const double tj = tg[j];
        if (tj > 0.0) loss += tj * (std::log(tj) - log_p);
        // dKL/dlogit = P − T; chain through logit = q·k·scale.
        const float ds = static_cast<float>(std::exp(log_p) - tj) * norm * scale;
        if (ds == 0.0f) continue;
        axpy(ds, keys.data() + j * kvd + g * hd, dqh, hd);
        axpy(ds, qh, dkeys.data() + j * kvd + g * hd, hd);
      }
    }
    // Back through RoPE (its transpose) and the projection: grad_q += dq_pre ⊗ x_t.
    for (int64_t h = 0; h < nh; ++h) rope.apply(dq.data() + h * hd, t, true);
    for (int64_t r = 0; r < qd; ++r) {
      if (dq[static_cast<size_t>(r)] != 0.0f) axpy(dq[static_cast<size_t>(r)], xt, grad_q + r * d2, d2);
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    float* dk = dkeys.data() + j * kvd;
    for (int64_t g = 0; g < nkv; ++g) rope.apply(dk + g * hd, j, true);
    for (int64_t r = 0; r < kvd; ++r) {
      if (dk[r] != 0.0f) axpy(dk[r], x + j * d2, grad_k + r * d2, d2);
    }
  }
  return loss * norm;
}

Result<DistillReport> distill_retrieval_head(std::shared_ptr<const Model> model,
                                             std::shared_ptr<Backend> backend,
                                             const std::vector<std::vector<TokenId>>& train,
                                             const std::vector<std::vector<TokenId>>& heldout,
                                             const DistillOptions& o) {
  if (!model || !backend) return invalid_argument("distill: a model and a backend are required");
  if (o.steps < 0 || o.lr <= 0 || o.batch_positions <= 0) {
    return invalid_argument("distill: steps must be >= 0, lr and batch_positions positive");
  }
  const ModelConfig& c = model->config;
  DistillReport rep;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  SPX_ASSIGN_OR_RETURN(std::vector<DistillChunk> train_chunks, collect_teacher(model, backend, train));
  SPX_ASSIGN_OR_RETURN(std::vector<DistillChunk> held_chunks, collect_teacher(model, backend, heldout));
  rep.teacher_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (train_chunks.empty())
    return invalid_argument("distill: the training corpus has no chunk of at least 2 tokens");
  for (const auto& ch : train_chunks) {
    rep.train_tokens += ch.length();
    rep.context = std::max(rep.context, ch.length());
  }
  for (const auto& ch : held_chunks) {
    rep.heldout_tokens += ch.length();
    rep.context = std::max(rep.context, ch.length());
  }
  rep.train_chunks = static_cast<int64_t>(train_chunks.size());
  rep.heldout_chunks = static_cast<int64_t>(held_chunks.size());

  // ---- initial head: EAGLE-3 shape, fc = [I/3 I/3 I/3] exactly, norms 1 (kept fixed) ----
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<RetrievalHead> head, make_random_head(c, o.seed));
  RetrievalHeadConfig& hc = head->config;
  const int64_t d = hc.hidden, nh = hc.n_heads, nkv = hc.n_kv_heads, hd = hc.head_dim;
  const int64_t d2 = 2 * d, qd = nh * hd, kvd = nkv * hd;
  {
    float* fc = const_cast<float*>(static_cast<const float*>(head->fc.data));  // owned by head->storage
    for (int64_t r = 0; r < d; ++r) {
      for (int64_t col = 0; col < 3 * d; ++col) fc[r * 3 * d + col] = (col % d == r) ? 1.0f / 3.0f : 0.0f;
    }
  }
  hc.trained_context = rep.context;  // the window it saw; YaRN applies beyond it
  float* wq = const_cast<float*>(static_cast<const float*>(head->wq.data));
  float* wk = const_cast<float*>(static_cast<const float*>(head->wk.data));

  SPX_ASSIGN_OR_RETURN(rep.before, evaluate_head(*backend, *model, *head, held_chunks, o.budgets));
  SPX_ASSIGN_OR_RETURN(Fidelity train_before, evaluate_head(*backend, *model, *head, train_chunks, {}));
  rep.train_kl_before = train_before.kl;

  // ---- student inputs x [T, 2d]: fixed because fc and the norms are ----
  std::vector<std::vector<float>> xs;
  std::vector<int64_t> weights;  // query positions per chunk (t ≥ 1)
  for (const DistillChunk& ch : train_chunks) {
    std::vector<float> x(static_cast<size_t>(ch.length() * d2));
    const std::vector<float> prev = shifted_fused(ch, d);
    SPX_RETURN_IF_ERROR(retrieval_inputs(*backend, *head, model->tok_embeddings, ch.tokens.data(),
                                         prev.data(), ch.length(), x.data()));
    xs.push_back(std::move(x));
    weights.push_back(ch.length() - 1);
  }
  const int64_t total_positions = std::accumulate(weights.begin(), weights.end(), int64_t{0});
  const RopeParams rope = make_head_rope_params(hc, rep.context);

  const auto t1 = Clock::now();
  SplitMix rng{o.seed ^ 0x5eed5eedull};
  Adam adam_q(static_cast<size_t>(qd * d2)), adam_k(static_cast<size_t>(kvd * d2));
  std::vector<float> gq(static_cast<size_t>(qd * d2)), gk(static_cast<size_t>(kvd * d2));
  std::vector<int64_t> all_pos, picked;
  double running = 0.0;
  int64_t running_n = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    // A chunk with probability ∝ its positions, then up to batch_positions distinct positions.
    int64_t r = rng.below(total_positions), ci = 0;
    while (r >= weights[static_cast<size_t>(ci)]) r -= weights[static_cast<size_t>(ci++)];
    const DistillChunk& ch = train_chunks[static_cast<size_t>(ci)];
    const float* x = xs[static_cast<size_t>(ci)].data();
    const int64_t n = ch.length();
    all_pos.resize(static_cast<size_t>(n - 1));
    std::iota(all_pos.begin(), all_pos.end(), int64_t{1});
    const int64_t m = std::min<int64_t>(o.batch_positions, n - 1);
    for (int64_t i = 0; i < m; ++i) {  // partial Fisher–Yates
      std::swap(all_pos[static_cast<size_t>(i)], all_pos[static_cast<size_t>(i + rng.below(n - 1 - i))]);
    }
    picked.assign(all_pos.begin(), all_pos.begin() + m);
    const double loss = distill_loss_grad(*head, rope, ch, x, picked, gq.data(), gk.data());
    // Cosine decay to lr/10: large early steps, a settled head at the end.
    const double progress = o.steps > 1 ? double(step) / double(o.steps - 1) : 1.0;
    const double lr = o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(3.141592653589793 * progress)));
    adam_q.step(wq, gq.data(), gq.size(), lr);
    adam_k.step(wk, gk.data(), gk.size(), lr);

    running += loss;
    ++running_n;
    if (o.on_step && o.log_every > 0 && ((step + 1) % o.log_every == 0 || step + 1 == o.steps)) {
      o.on_step(step + 1, running / static_cast<double>(running_n));
      running = 0.0;
      running_n = 0;
    }
  }
  rep.train_seconds = std::chrono::duration<double>(Clock::now() - t1).count();

  SPX_ASSIGN_OR_RETURN(rep.after, evaluate_head(*backend, *model, *head, held_chunks, o.budgets));
  SPX_ASSIGN_OR_RETURN(Fidelity train_after, evaluate_head(*backend, *model, *head, train_chunks, {}));
  rep.train_kl_after = train_after.kl;
  rep.head = std::move(head);
  return rep;
}

}  // namespace specontext
