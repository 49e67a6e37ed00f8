// Retrieval-head distillation: teacher capture through ForwardObserver, a KL(teacher ‖ head)
// objective with hand-written gradients for every parameter the head keeps (fc, both RMSNorm
// weights, wq, wk), Adam, and the held-out fidelity report.
#include "research/distill.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <string>

#include "core/engine/engine.h"
#include "core/model/safetensors.h"

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

// Records, per KV head, the layer average of the group's max (or mean) attention (unnormalised:
// the rows are renormalised once every layer is in) and the fused features of one dense prefill.
class TeacherObserver final : public ForwardObserver {
 public:
  TeacherObserver(const ModelConfig& c, DistillChunk* chunk, TeacherReduction reduction)
      : c_(c), chunk_(chunk), reduction_(reduction) {}

  void on_attention(LayerId, const float* q, std::span<const AttentionItem> items) override {
    if (items.size() != 1 || items[0].start_pos != 0 || items[0].n_tokens != chunk_->length()) {
      error_ = internal_error("distill: expected one dense prefill of the whole chunk");
      return;
    }
    const int64_t n = chunk_->length(), hd = c_.head_dim;
    std::vector<float> keys(static_cast<size_t>(n * hd));
    for (int64_t g = 0; g < c_.n_kv_heads; ++g) {
      copy_keys(items[0].kv, g, n, keys.data());
      add_group(q + items[0].token_offset * c_.n_heads * hd, keys.data(), g, n);
    }
    ++layers_seen_;
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
  // Contiguous copy of KV head g's keys: page t/ps, slot t%ps, block [kv_heads][ps][hd].
  void copy_keys(const KvLayerView& kv, int64_t g, int64_t n, float* keys) const {
    const int64_t hd = c_.head_dim;
    for (int64_t t = 0; t < n; ++t) {
      const float* src = kv_row_f32(kv, /*values=*/false, g, t, keys + t * hd);
      if (src != keys + t * hd) std::copy_n(src, hd, keys + t * hd);
    }
  }

  // teacher_g(t) += the max (or mean) over the group's query heads of softmax(q_h(t)·K/√hd),
  // divided by n_layers.
  void add_group(const float* q, const float* keys, int64_t g, int64_t n) {
    const int64_t hd = c_.head_dim, nh = c_.n_heads, group = nh / c_.n_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const float weight = 1.0f / static_cast<float>(c_.n_layers);
    std::vector<float> row(static_cast<size_t>(n)), best(static_cast<size_t>(n));
    float* out = chunk_->teacher.data() + g * tri(n);
    for (int64_t t = 0; t < n; ++t) {
      std::fill_n(best.begin(), t + 1, 0.0f);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qh = q + t * nh * hd + h * hd;
        float mx = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          float s = 0.0f;
          for (int64_t i = 0; i < hd; ++i) s += qh[i] * keys[j * hd + i];
          row[static_cast<size_t>(j)] = s * scale;
          mx = std::max(mx, s * scale);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= t; ++j) {
          row[static_cast<size_t>(j)] = std::exp(row[static_cast<size_t>(j)] - mx);
          sum += row[static_cast<size_t>(j)];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t j = 0; j <= t; ++j) {
          const float p = row[static_cast<size_t>(j)] * inv;
          float& b = best[static_cast<size_t>(j)];
          b = reduction_ == TeacherReduction::kGroupMax ? std::max(b, p) : b + p / static_cast<float>(group);
        }
      }
      float* dst = out + tri(t);
      for (int64_t j = 0; j <= t; ++j) dst[j] += best[static_cast<size_t>(j)] * weight;
    }
  }

  const ModelConfig& c_;
  DistillChunk* chunk_;
  TeacherReduction reduction_;
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

// KL(T_g(t) ‖ the group's max over its query heads of p [heads][t+1], renormalised) over every key;
// `m` is scratch.
double kl_group_max_row(const DistillChunk& ch, int64_t g, int64_t t, const float* p, int64_t group,
                        std::vector<float>& m) {
  const int64_t len = t + 1;
  double sum = 0.0;
  for (int64_t j = 0; j < len; ++j) {
    float v = 0.0f;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) v = std::max(v, p[h * len + j]);
    m[static_cast<size_t>(j)] = v;
    sum += v;
  }
  for (int64_t j = 0; j < len; ++j) m[static_cast<size_t>(j)] = static_cast<float>(m[static_cast<size_t>(j)] / sum);
  return kl_row(ch.teacher.data() + g * tri(ch.length()) + tri(t), m.data(), len);
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


// Each teacher row (a layer average of group maxima) rescaled to a distribution.
void normalize_teacher_rows(DistillChunk* ch, int64_t n_kv_heads) {
  const int64_t n = ch->length();
  for (int64_t g = 0; g < n_kv_heads; ++g) {
    for (int64_t t = 0; t < n; ++t) {
      float* row = ch->teacher.data() + g * tri(n) + tri(t);
      double sum = 0.0;
      for (int64_t j = 0; j <= t; ++j) sum += row[j];
      const float inv = sum > 0.0 ? static_cast<float>(1.0 / sum) : 0.0f;
      for (int64_t j = 0; j <= t; ++j) row[j] *= inv;
    }
  }
}

struct HeadShape {
  int64_t d, nh, nkv, hd, qd, kvd, group;
  explicit HeadShape(const RetrievalHeadConfig& c)
      : d(c.hidden),
        nh(c.n_heads),
        nkv(c.n_kv_heads),
        hd(c.head_dim),
        qd(c.n_heads * c.head_dim),
        kvd(c.n_kv_heads * c.head_dim),
        group(c.n_heads / c.n_kv_heads) {}
};

const float* f32(const WeightMatrix& w) { return static_cast<const float*>(w.data); }
float* mutable_f32(const WeightMatrix& w) { return const_cast<float*>(f32(w)); }  // owned by head->storage

// 1/sqrt(mean(v²) + eps): the scale of an RMSNorm row, as the backends compute it.
float inv_rms(const float* v, int64_t d, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < d; ++i) ss += v[i] * v[i];
  return 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
}

// out[r] = Σ_c w[r, c] · v[c] for a row-major [rows, cols] matrix.
void matvec(const float* w, const float* v, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = dot(w + r * cols, v, cols);
}

// out[c] += Σ_r w[r, c] · v[r] (the transpose), and grad[r, c] += v[r] · x[c].
void matvec_t_and_outer(const float* w, const float* v, const float* x, int64_t rows, int64_t cols, float* out,
                        float* grad) {
  for (int64_t r = 0; r < rows; ++r) {
    if (v[r] == 0.0f) continue;
    axpy(v[r], w + r * cols, out, cols);
    axpy(v[r], x, grad + r * cols, cols);
  }
}

// The head's forward over rows 0..n−1 of a chunk (retrieval_qk's arithmetic), kept for the
// backward pass.
struct HeadForward {
  std::vector<float> h;      // [n, d] fc · fused(p−1), before hidden_norm
  std::vector<float> r_in;   // [n] RMS scale of the embedding row
  std::vector<float> r_hid;  // [n] RMS scale of h
  std::vector<float> x;      // [n, 2d] RMSNorm_in(embed) ⊕ RMSNorm_hidden(h)
  std::vector<float> k;      // [n, kvd] keys after RoPE
};

HeadForward forward_head(const RetrievalHead& head, const RopeTable& rope, const HeadInputs& in, int64_t n) {
  const HeadShape s(head.config);
  const int64_t d = s.d, d2 = 2 * d, d3 = 3 * d;
  const float eps = head.config.norm_eps;
  HeadForward f;
  f.h.resize(static_cast<size_t>(n * d));
  f.r_in.resize(static_cast<size_t>(n));
  f.r_hid.resize(static_cast<size_t>(n));
  f.x.resize(static_cast<size_t>(n * d2));
  f.k.resize(static_cast<size_t>(n * s.kvd));
  for (int64_t p = 0; p < n; ++p) {
    const float* e = in.embed.data() + p * d;
    float* h = f.h.data() + p * d;
    float* x = f.x.data() + p * d2;
    const float ri = f.r_in[static_cast<size_t>(p)] = inv_rms(e, d, eps);
    for (int64_t i = 0; i < d; ++i) x[i] = e[i] * ri * head.input_norm[static_cast<size_t>(i)];
    matvec(f32(head.fc), in.fused_prev.data() + p * d3, d, d3, h);
    const float rh = f.r_hid[static_cast<size_t>(p)] = inv_rms(h, d, eps);
    for (int64_t i = 0; i < d; ++i) x[d + i] = h[i] * rh * head.hidden_norm[static_cast<size_t>(i)];
    float* k = f.k.data() + p * s.kvd;
    matvec(f32(head.wk), x, s.kvd, d2, k);
    for (int64_t g = 0; g < s.nkv; ++g) rope.apply(k + g * s.hd, p, false);
  }
  return f;
}

// The keys the objective ranks for query row t: [lo, hi) of 0..t.
struct RankedKeys {
  int64_t lo = 0, hi = 0;
};
RankedKeys ranked_keys(const DistillObjective& obj, int64_t t) {
  const int64_t len = t + 1;
  const int64_t lo = std::min(obj.exclude_sinks, len), hi = std::max(lo, len - obj.exclude_window);
  return {lo, hi};
}

// The teacher mass T_g(t) puts on keys [lo, hi).
double ranked_mass(const DistillChunk& ch, int64_t g, int64_t t, RankedKeys r) {
  const float* tg = ch.teacher.data() + g * tri(ch.length()) + tri(t);
  double tmass = 0.0;
  for (int64_t j = r.lo; j < r.hi; ++j) tmass += tg[j];
  return tmass;
}

// Σ over query heads of weight[h] · KL(T_g(t) ‖ P_h(t)) for one query row q (after RoPE), both
// restricted to the keys the objective scores (renormalised there). With dq and dk non-null,
// adds norm[h]·∂KL_h/∂q into dq [qd] and norm[h]·∂KL_h/∂k into dk [t+1, kvd] (after RoPE).
double attend_row_group_max(const HeadShape& s, const DistillChunk& ch, const DistillObjective& obj,
                            const float* q, const float* keys, int64_t t, const float* norm,
                            const double* weight, float* dq, float* dk);

double attend_row_each(const HeadShape& s, const DistillChunk& ch, const DistillObjective& obj,
                       const float* q, const float* keys, int64_t t, const float* norm, const double* weight,
                       float* dq, float* dk);

double attend_row(const HeadShape& s, const DistillChunk& ch, const DistillObjective& obj, const float* q,
                  const float* keys, int64_t t, const float* norm, const double* weight, float* dq,
                  float* dk) {
  switch (obj.group_loss) {
    case GroupLoss::kEach: return attend_row_each(s, ch, obj, q, keys, t, norm, weight, dq, dk);
    case GroupLoss::kGroupMax: return attend_row_group_max(s, ch, obj, q, keys, t, norm, weight, dq, dk);
    case GroupLoss::kMix: break;
  }
  // Both terms with their weights (and gradient scales) multiplied by 1 − group_mix and group_mix.
  const auto scaled = [&](double by, std::vector<float>* n, std::vector<double>* w) {
    for (int64_t h = 0; h < s.nh; ++h) {
      (*n)[static_cast<size_t>(h)] = static_cast<float>(norm[h] * by);
      (*w)[static_cast<size_t>(h)] = weight[h] * by;
    }
  };
  std::vector<float> n(static_cast<size_t>(s.nh));
  std::vector<double> w(static_cast<size_t>(s.nh));
  scaled(1.0 - obj.group_mix, &n, &w);
  double loss = attend_row_each(s, ch, obj, q, keys, t, n.data(), w.data(), dq, dk);
  scaled(obj.group_mix, &n, &w);
  loss += attend_row_group_max(s, ch, obj, q, keys, t, n.data(), w.data(), dq, dk);
  return loss;
}

double attend_row_each(const HeadShape& s, const DistillChunk& ch, const DistillObjective& obj,
                       const float* q, const float* keys, int64_t t, const float* norm, const double* weight,
                       float* dq, float* dk) {
  const int64_t n = ch.length(), len = t + 1;
  const auto [lo, hi] = ranked_keys(obj, t);
  if (hi - lo < 2) return 0.0;  // at most one candidate: nothing to rank
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  std::vector<float> logit(static_cast<size_t>(len));
  double loss = 0.0;
  for (int64_t h = 0; h < s.nh; ++h) {
    const int64_t g = h / s.group;
    const float* qh = q + h * s.hd;
    const float* tg = ch.teacher.data() + g * tri(n) + tri(t);
    const double tmass = ranked_mass(ch, g, t, {lo, hi});
    if (tmass <= 0.0) continue;
    const double w = weight[h];
    const float gn = norm[h];
    float mx = -INFINITY;
    for (int64_t j = lo; j < hi; ++j) {
      logit[static_cast<size_t>(j)] = dot(qh, keys + j * s.kvd + g * s.hd, s.hd) * scale;
      mx = std::max(mx, logit[static_cast<size_t>(j)]);
    }
    double z = 0.0;
    for (int64_t j = lo; j < hi; ++j) z += std::exp(double(logit[static_cast<size_t>(j)] - mx));
    const double log_z = std::log(z) + mx;
    for (int64_t j = lo; j < hi; ++j) {
      const double log_p = logit[static_cast<size_t>(j)] - log_z;
      const double tj = tg[j] / tmass;
      if (tj > 0.0) loss += w * (tj * (std::log(tj) - log_p));
      if (dq == nullptr) continue;
      // dKL/dlogit = P − T; chain through logit = q·k·scale.
      const float ds = static_cast<float>(std::exp(log_p) - tj) * gn * scale;
      if (ds == 0.0f) continue;
      axpy(ds, keys + j * s.kvd + g * s.hd, dq + h * s.hd, s.hd);
      axpy(ds, qh, dk + j * s.kvd + g * s.hd, s.hd);
    }
  }
  return loss;
}

// attend_row for GroupLoss::kGroupMax: per KV head g, Σ_{h∈g} weight[h] · KL(T_g ‖ M_g) with
// M_g(j) = max_{h∈g} P_h(j) / Σ_i max_{h∈g} P_h(i) over the ranked keys (P_h renormalised there).
// Gradient: with m_j = max_h P_h(j) (head h*(j) attains it) and M = Σ m, ∂KL/∂m_j = −T_j/m_j + 1/M
// reaches head h*(j) only; through its softmax, ∂KL/∂logit_h(i) = P_h(i)(g_h(i) − Σ_j P_h(j) g_h(j))
// with P_h(j) g_h(j) = −T_j + m_j/M where h = h*(j), else 0. Scaled by Σ_{h∈g} norm[h].
double attend_row_group_max(const HeadShape& s, const DistillChunk& ch, const DistillObjective& obj,
                            const float* q, const float* keys, int64_t t, const float* norm,
                            const double* weight, float* dq, float* dk) {
  const int64_t n = ch.length();
  const auto [lo, hi] = ranked_keys(obj, t);
  if (hi - lo < 2) return 0.0;
  const int64_t nr = hi - lo;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  std::vector<double> log_p(static_cast<size_t>(s.group * nr));  // [group][ranked key]
  std::vector<int32_t> best(static_cast<size_t>(nr));
  std::vector<double> pg(static_cast<size_t>(s.group));
  double loss = 0.0;
  for (int64_t g = 0; g < s.nkv; ++g) {
    const float* tg = ch.teacher.data() + g * tri(n) + tri(t);
    const double tmass = ranked_mass(ch, g, t, {lo, hi});
    if (tmass <= 0.0) continue;
    double w = 0.0;
    float gn = 0.0f;
    for (int64_t h = g * s.group; h < (g + 1) * s.group; ++h) {
      w += weight[h];
      gn += norm[h];
    }
    for (int64_t a = 0; a < s.group; ++a) {  // each head's log-softmax over the ranked keys
      const float* qh = q + (g * s.group + a) * s.hd;
      double* lp = log_p.data() + a * nr;
      double mx = -INFINITY;
      for (int64_t j = lo; j < hi; ++j) {
        lp[j - lo] = dot(qh, keys + j * s.kvd + g * s.hd, s.hd) * scale;
        mx = std::max(mx, lp[j - lo]);
      }
      double z = 0.0;
      for (int64_t r = 0; r < nr; ++r) z += std::exp(lp[r] - mx);
      const double log_z = std::log(z) + mx;
      for (int64_t r = 0; r < nr; ++r) lp[r] -= log_z;
    }
    double big_m = 0.0;  // Σ_j max_h P_h(j)
    for (int64_t r = 0; r < nr; ++r) {
      int32_t b = 0;
      for (int64_t a = 1; a < s.group; ++a) {
        if (log_p[static_cast<size_t>(a * nr + r)] > log_p[static_cast<size_t>(b * nr + r)]) b = static_cast<int32_t>(a);
      }
      best[static_cast<size_t>(r)] = b;
      big_m += std::exp(log_p[static_cast<size_t>(b * nr + r)]);
    }
    const double log_big_m = std::log(big_m);
    std::fill(pg.begin(), pg.end(), 0.0);  // Σ_j P_h(j) g_h(j) per head
    for (int64_t r = 0; r < nr; ++r) {
      const double tj = tg[lo + r] / tmass;
      const double log_m = log_p[static_cast<size_t>(best[static_cast<size_t>(r)] * nr + r)];
      if (tj > 0.0) loss += w * (tj * (std::log(tj) - (log_m - log_big_m)));
      pg[static_cast<size_t>(best[static_cast<size_t>(r)])] += -tj + std::exp(log_m - log_big_m);
    }
    if (dq == nullptr) continue;
    for (int64_t a = 0; a < s.group; ++a) {
      const int64_t h = g * s.group + a;
      const float* qh = q + h * s.hd;
      for (int64_t r = 0; r < nr; ++r) {
        const double p = std::exp(log_p[static_cast<size_t>(a * nr + r)]);
        const double own = best[static_cast<size_t>(r)] == a ? -tg[lo + r] / tmass + p / big_m : 0.0;  // P_h(j) g_h(j)
        const float ds = static_cast<float>(own - p * pg[static_cast<size_t>(a)]) * gn * scale;
        if (ds == 0.0f) continue;
        const int64_t j = lo + r;
        axpy(ds, keys + j * s.kvd + g * s.hd, dq + h * s.hd, s.hd);
        axpy(ds, qh, dk + j * s.kvd + g * s.hd, s.hd);
      }
    }
  }
  return loss;
}

// From ∂L/∂x [n, 2d] into the norm weights and fc: x = w ⊙ u · r with r = (mean(u²) + eps)^−½,
// so ∂w = ∂x ⊙ u · r and ∂u = r · (w ⊙ ∂x) − r³ · u · Σ(w ⊙ ∂x ⊙ u) / d; then h = fc · fused(p−1).
void backprop_inputs(const RetrievalHead& head, const HeadInputs& in, const HeadForward& f, const float* dx,
                     int64_t n, HeadGradients* g) {
  const int64_t d = head.config.hidden, d2 = 2 * d, d3 = 3 * d;
  std::vector<float> du(static_cast<size_t>(d));
  for (int64_t p = 0; p < n; ++p) {
    const float* dxe = dx + p * d2;
    const float* dxh = dxe + d;
    const float* e = in.embed.data() + p * d;
    const float* h = f.h.data() + p * d;
    const float ri = f.r_in[static_cast<size_t>(p)], rh = f.r_hid[static_cast<size_t>(p)];
    float wdu = 0.0f;  // Σ w ⊙ ∂x ⊙ u of the hidden half
    for (int64_t i = 0; i < d; ++i) {
      g->input_norm[static_cast<size_t>(i)] += dxe[i] * e[i] * ri;
      g->hidden_norm[static_cast<size_t>(i)] += dxh[i] * h[i] * rh;
      wdu += head.hidden_norm[static_cast<size_t>(i)] * dxh[i] * h[i];
    }
    const float coef = rh * rh * rh * wdu / static_cast<float>(d);
    for (int64_t i = 0; i < d; ++i) {
      du[static_cast<size_t>(i)] = rh * head.hidden_norm[static_cast<size_t>(i)] * dxh[i] - coef * h[i];
    }
    const float* fused = in.fused_prev.data() + p * d3;
    for (int64_t r = 0; r < d; ++r) {
      if (du[static_cast<size_t>(r)] != 0.0f) axpy(du[static_cast<size_t>(r)], fused, g->fc.data() + r * d3, d3);
    }
  }
}

void zero_gradients(const HeadShape& s, HeadGradients* g) {
  g->fc.assign(static_cast<size_t>(3 * s.d * s.d), 0.0f);
  g->input_norm.assign(static_cast<size_t>(s.d), 0.0f);
  g->hidden_norm.assign(static_cast<size_t>(s.d), 0.0f);
  g->wq.assign(static_cast<size_t>(s.qd * 2 * s.d), 0.0f);
  g->wk.assign(static_cast<size_t>(s.kvd * 2 * s.d), 0.0f);
}


// The starting point: EAGLE-3 shape, fc = [I/3 I/3 I/3] exactly (the mean of the three taps),
// norms 1, random wq/wk; trained_context = the window it will see (YaRN applies beyond it).
// q_per_group > 0: that many query heads per KV head instead of the target's.
Result<std::shared_ptr<RetrievalHead>> initial_head(const ModelConfig& c, uint64_t seed, int64_t context,
                                                    int64_t q_per_group) {
  ModelConfig shape = c;
  if (q_per_group > 0) shape.n_heads = c.n_kv_heads * q_per_group;
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<RetrievalHead> head, make_random_head(shape, seed));
  const int64_t d = head->config.hidden;
  float* fc = mutable_f32(head->fc);
  for (int64_t r = 0; r < d; ++r) {
    for (int64_t col = 0; col < 3 * d; ++col) fc[r * 3 * d + col] = (col % d == r) ? 1.0f / 3.0f : 0.0f;
  }
  head->config.trained_context = context;
  return head;
}

// One parameter group that training updates, with its gradient and Adam state.
struct TrainedGroup {
  float* w;
  const std::vector<float>* grad;
  Adam adam;
};

std::vector<TrainedGroup> trained_groups(RetrievalHead* head, const HeadGradients& g, const DistillTrain& t) {
  const HeadShape s(head->config);
  std::vector<TrainedGroup> out;
  auto add = [&out](float* w, const std::vector<float>& grad, size_t n) { out.push_back({w, &grad, Adam(n)}); };
  if (t.fc) add(mutable_f32(head->fc), g.fc, static_cast<size_t>(3 * s.d * s.d));
  if (t.norms) {
    add(head->input_norm.data(), g.input_norm, static_cast<size_t>(s.d));
    add(head->hidden_norm.data(), g.hidden_norm, static_cast<size_t>(s.d));
  }
  if (t.qk) {
    add(mutable_f32(head->wq), g.wq, static_cast<size_t>(s.qd * 2 * s.d));
    add(mutable_f32(head->wk), g.wk, static_cast<size_t>(s.kvd * 2 * s.d));
  }
  return out;
}

// A chunk with probability ∝ its query positions (t ≥ 1), then up to `batch` distinct positions.
struct Minibatch {
  size_t chunk = 0;
  std::vector<int64_t> positions;
};

Minibatch sample_minibatch(SplitMix& rng, std::span<const DistillChunk> chunks, int64_t total_positions,
                           int64_t batch) {
  Minibatch mb;
  int64_t r = rng.below(total_positions);
  while (r >= chunks[mb.chunk].length() - 1) r -= chunks[mb.chunk++].length() - 1;
  const int64_t n = chunks[mb.chunk].length();
  std::vector<int64_t> all(static_cast<size_t>(n - 1));
  std::iota(all.begin(), all.end(), int64_t{1});
  const int64_t m = std::min<int64_t>(batch, n - 1);
  for (int64_t i = 0; i < m; ++i) {  // partial Fisher–Yates
    std::swap(all[static_cast<size_t>(i)], all[static_cast<size_t>(i + rng.below(n - 1 - i))]);
  }
  mb.positions.assign(all.begin(), all.begin() + m);
  return mb;
}

// Cosine decay from lr to lr/10: large early steps, a settled head at the end.
double cosine_lr(const DistillOptions& o, int64_t step) {
  const double progress = o.steps > 1 ? double(step) / double(o.steps - 1) : 1.0;
  return o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(3.141592653589793 * progress)));
}

// Adam on the groups of o.train for o.steps minibatches.
void train_head(RetrievalHead* head, std::span<const DistillChunk> chunks, std::span<const HeadInputs> inputs,
                const DistillOptions& o) {
  int64_t total_positions = 0;
  for (const DistillChunk& ch : chunks) total_positions += ch.length() - 1;
  const RopeParams rope = make_head_rope_params(head->config, head->config.trained_context);
  HeadGradients grads;
  zero_gradients(HeadShape(head->config), &grads);
  std::vector<TrainedGroup> groups = trained_groups(head, grads, o.train);
  SplitMix rng{o.seed ^ 0x5eed5eedull};
  double running = 0.0;
  int64_t running_n = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    const Minibatch mb = sample_minibatch(rng, chunks, total_positions, o.batch_positions);
    running += distill_loss_grad(*head, rope, chunks[mb.chunk], inputs[mb.chunk], mb.positions, &grads, o.objective);
    ++running_n;
    const double lr = cosine_lr(o, step);
    for (TrainedGroup& g : groups) g.adam.step(g.w, g.grad->data(), g.grad->size(), lr);
    if (o.on_step && o.log_every > 0 && ((step + 1) % o.log_every == 0 || step + 1 == o.steps)) {
      o.on_step(step + 1, running / static_cast<double>(running_n));
      running = 0.0;
      running_n = 0;
    }
  }
}

}  // namespace

Result<std::vector<CorpusStory>> encode_corpus_stories(const Tokenizer& tokenizer, std::string_view text) {
  std::vector<CorpusStory> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(kStorySeparator, start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view story = text.substr(start, end - start);
    while (!story.empty() && std::isspace(static_cast<unsigned char>(story.front()))) story.remove_prefix(1);
    while (!story.empty() && std::isspace(static_cast<unsigned char>(story.back()))) story.remove_suffix(1);
    if (!story.empty()) {
      SPX_ASSIGN_OR_RETURN(std::vector<TokenId> ids, tokenizer.encode(story, /*add_bos=*/true));
      out.push_back(CorpusStory{start, std::move(ids)});
    }
    if (end == text.size()) break;
    start = end + kStorySeparator.size();
  }
  return out;
}

Result<std::vector<TokenId>> encode_corpus(const Tokenizer& tokenizer, std::string_view text) {
  SPX_ASSIGN_OR_RETURN(std::vector<CorpusStory> stories, encode_corpus_stories(tokenizer, text));
  std::vector<TokenId> out;
  for (const CorpusStory& st : stories) out.insert(out.end(), st.tokens.begin(), st.tokens.end());
  return out;
}

CorpusSplit split_heldout_stories(std::span<const CorpusStory> stories, double fraction) {
  CorpusSplit sp;
  sp.stories = static_cast<int64_t>(stories.size());
  size_t total = 0;
  for (const CorpusStory& st : stories) total += st.tokens.size();
  const size_t want = static_cast<size_t>(std::ceil(fraction * static_cast<double>(total)));
  if (stories.size() <= 1) {  // one text: a token cut
    for (const CorpusStory& st : stories) sp.train = st.tokens;
    const size_t cut = total - std::min(want, total);
    sp.heldout.assign(sp.train.begin() + static_cast<std::ptrdiff_t>(cut), sp.train.end());
    sp.train.resize(cut);
    sp.train_stories = sp.stories;
    return sp;
  }
  size_t held = 0, first = stories.size();
  while (first > 1 && held < want) held += stories[--first].tokens.size();
  for (size_t i = 0; i < stories.size(); ++i) {
    std::vector<TokenId>& dst = i < first ? sp.train : sp.heldout;
    dst.insert(dst.end(), stories[i].tokens.begin(), stories[i].tokens.end());
  }
  sp.heldout_byte = stories[first].byte_begin;
  sp.train_stories = static_cast<int64_t>(first);
  return sp;
}

std::vector<std::vector<TokenId>> split_chunks(std::span<const TokenId> tokens, int64_t context,
                                               int64_t min_len, TokenId bos) {
  std::vector<std::vector<TokenId>> out;
  if (context <= 1) return out;
  size_t i = 0;
  while (i < tokens.size()) {
    const bool lead = bos >= 0 && tokens[i] != bos;
    const size_t n = std::min(tokens.size() - i, static_cast<size_t>(context - (lead ? 1 : 0)));
    if (static_cast<int64_t>(n + (lead ? 1 : 0)) < std::max<int64_t>(min_len, 2)) break;
    std::vector<TokenId> chunk;
    if (lead) chunk.push_back(bos);
    chunk.insert(chunk.end(), tokens.begin() + static_cast<std::ptrdiff_t>(i),
                 tokens.begin() + static_cast<std::ptrdiff_t>(i + n));
    out.push_back(std::move(chunk));
    i += n;
  }
  return out;
}

Result<std::vector<DistillChunk>> collect_teacher(std::shared_ptr<const Model> model,
                                                  std::shared_ptr<Backend> backend,
                                                  const std::vector<std::vector<TokenId>>& chunks,
                                                  TeacherReduction reduction) {
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
    TeacherObserver obs(c, &ch, reduction);
    engine->set_observer(&obs);
    SPX_ASSIGN_OR_RETURN(SeqId seq, engine->memory().add_sequence());
    StepRequest req{seq, std::span<const TokenId>(ch.tokens), LogitsMode::kNone};
    auto step = engine->forward(std::span<const StepRequest>(&req, 1));
    engine->set_observer(nullptr);
    SPX_RETURN_IF_ERROR(engine->memory().remove_sequence(seq));
    if (!step.is_ok()) return step.status();
    SPX_RETURN_IF_ERROR(obs.status());
    normalize_teacher_rows(&ch, c.n_kv_heads);
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
  double kl_sum = 0.0, kl_group_sum = 0.0;
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
      for (int64_t g = 0; g < nkv; ++g) kl_group_sum += kl_group_max_row(ch, g, t, p.data(), group, group_score);
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
  if (f.positions > 0) {
    f.kl = kl_sum / static_cast<double>(f.positions * nh);
    f.kl_group = kl_group_sum / static_cast<double>(f.positions * nkv);
  }
  for (BudgetRecall& r : f.recall) {
    if (r.positions == 0) continue;
    r.head /= static_cast<double>(r.positions);
    r.streaming /= static_cast<double>(r.positions);
    r.oracle /= static_cast<double>(r.positions);
  }
  return f;
}

Result<HeadInputs> head_inputs(Backend& backend, const Model& model, const DistillChunk& ch) {
  const int64_t d = model.config.dim, n = ch.length();
  if (static_cast<int64_t>(ch.fused.size()) != n * 3 * d) {
    return invalid_argument("distill: the chunk's fused features do not match the model's hidden size");
  }
  HeadInputs in;
  in.embed.resize(static_cast<size_t>(n * d));
  SPX_RETURN_IF_ERROR(backend.embed(ch.tokens.data(), n, model.tok_embeddings, in.embed.data()));
  in.fused_prev = shifted_fused(ch, d);
  return in;
}

double distill_loss_grad(const RetrievalHead& head, const RopeParams& rope_params, const DistillChunk& ch,
                         const HeadInputs& in, std::span<const int64_t> positions, HeadGradients* grads,
                         const DistillObjective& objective) {
  const HeadShape s(head.config);
  const int64_t d2 = 2 * s.d;
  if (grads != nullptr) zero_gradients(s, grads);
  if (positions.empty()) return 0.0;
  const int64_t nk = *std::max_element(positions.begin(), positions.end()) + 1;
  const RopeTable rope(rope_params, nk);
  const HeadForward f = forward_head(head, rope, in, nk);
  // Per-head gradient scale and loss weight of each position: uniform, 1/(positions·heads) and
  // 1; kFar, w/W and w with w = ranked teacher mass + floor and W their sum.
  const bool far = objective.position_weight == PositionWeight::kFar;
  const float norm = 1.0f / static_cast<float>(static_cast<int64_t>(positions.size()) * s.nh);
  double total_weight = 0.0;
  auto far_weight = [&](int64_t t, int64_t h) {
    const RankedKeys r = ranked_keys(objective, t);
    if (r.hi <= r.lo) return 0.0;  // no ranked key: the position is left out
    return ranked_mass(ch, h / s.group, t, r) + objective.weight_floor;
  };
  if (far) {
    for (int64_t t : positions) {
      for (int64_t h = 0; h < s.nh; ++h) total_weight += far_weight(t, h);
    }
    if (!(total_weight > 0.0)) return 0.0;
  }
  std::vector<float> head_norm(static_cast<size_t>(s.nh), norm);
  std::vector<double> head_weight(static_cast<size_t>(s.nh), 1.0);
  std::vector<float> q(static_cast<size_t>(s.qd)), dq(static_cast<size_t>(s.qd));
  std::vector<float> dk, dx;
  if (grads != nullptr) {
    dk.assign(static_cast<size_t>(nk * s.kvd), 0.0f);
    dx.assign(static_cast<size_t>(nk * d2), 0.0f);
  }
  double loss = 0.0;
  for (int64_t t : positions) {
    if (far) {
      for (int64_t h = 0; h < s.nh; ++h) {
        const double w = far_weight(t, h);
        head_weight[static_cast<size_t>(h)] = w;
        head_norm[static_cast<size_t>(h)] = static_cast<float>(w / total_weight);
      }
    }
    const float* xt = f.x.data() + t * d2;
    matvec(f32(head.wq), xt, s.qd, d2, q.data());
    for (int64_t h = 0; h < s.nh; ++h) rope.apply(q.data() + h * s.hd, t, false);
    std::fill(dq.begin(), dq.end(), 0.0f);
    loss += attend_row(s, ch, objective, q.data(), f.k.data(), t, head_norm.data(), head_weight.data(),
                       grads ? dq.data() : nullptr, grads ? dk.data() : nullptr);
    if (grads == nullptr) continue;
    // Back through RoPE (its transpose) and q = wq · x.
    for (int64_t h = 0; h < s.nh; ++h) rope.apply(dq.data() + h * s.hd, t, true);
    matvec_t_and_outer(f32(head.wq), dq.data(), xt, s.qd, d2, dx.data() + t * d2, grads->wq.data());
  }
  if (grads != nullptr) {
    for (int64_t j = 0; j < nk; ++j) {  // the keys: k = RoPE(wk · x)
      float* dkj = dk.data() + j * s.kvd;
      for (int64_t g = 0; g < s.nkv; ++g) rope.apply(dkj + g * s.hd, j, true);
      matvec_t_and_outer(f32(head.wk), dkj, f.x.data() + j * d2, s.kvd, d2, dx.data() + j * d2, grads->wk.data());
    }
    backprop_inputs(head, in, f, dx.data(), nk, grads);
  }
  return far ? loss / total_weight : loss * norm;
}

Result<DistillReport> distill_retrieval_head(std::shared_ptr<const Model> model,
                                             std::shared_ptr<Backend> backend,
                                             const std::vector<std::vector<TokenId>>& train,
                                             const std::vector<std::vector<TokenId>>& heldout,
                                             const DistillOptions& o) {
  if (!model || !backend) return invalid_argument("distill: a model and a backend are required");
  if (o.steps < 0 || o.lr <= 0 || o.batch_positions <= 0 || o.q_per_group < 0) {
    return invalid_argument("distill: steps and q_per_group must be >= 0, lr and batch_positions positive");
  }
  const ModelConfig& c = model->config;
  DistillReport rep;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  SPX_ASSIGN_OR_RETURN(std::vector<DistillChunk> train_chunks, collect_teacher(model, backend, train, o.teacher));
  SPX_ASSIGN_OR_RETURN(std::vector<DistillChunk> held_chunks, collect_teacher(model, backend, heldout, o.teacher));
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

  SPX_ASSIGN_OR_RETURN(std::shared_ptr<RetrievalHead> head, initial_head(c, o.seed, rep.context, o.q_per_group));
  SPX_ASSIGN_OR_RETURN(rep.before, evaluate_head(*backend, *model, *head, held_chunks, o.budgets));
  SPX_ASSIGN_OR_RETURN(Fidelity train_before, evaluate_head(*backend, *model, *head, train_chunks, {}));
  rep.train_kl_before = train_before.kl;

  std::vector<HeadInputs> inputs;
  for (const DistillChunk& ch : train_chunks) {
    SPX_ASSIGN_OR_RETURN(HeadInputs in, head_inputs(*backend, *model, ch));
    inputs.push_back(std::move(in));
  }
  const auto t1 = Clock::now();
  train_head(head.get(), train_chunks, inputs, o);
  rep.train_seconds = std::chrono::duration<double>(Clock::now() - t1).count();

  SPX_ASSIGN_OR_RETURN(rep.after, evaluate_head(*backend, *model, *head, held_chunks, o.budgets));
  SPX_ASSIGN_OR_RETURN(Fidelity train_after, evaluate_head(*backend, *model, *head, train_chunks, {}));
  rep.train_kl_after = train_after.kl;
  rep.head = std::move(head);
  return rep;
}

Result<TeacherReduction> parse_teacher_reduction(std::string_view name) {
  if (name == "max") return TeacherReduction::kGroupMax;
  if (name == "mean") return TeacherReduction::kGroupMean;
  return invalid_argument("distill: unknown teacher reduction '" + std::string(name) + "' (expected max or mean)");
}

Result<GroupLoss> parse_group_loss(std::string_view name) {
  if (name == "each") return GroupLoss::kEach;
  if (name == "max") return GroupLoss::kGroupMax;
  if (name == "mix") return GroupLoss::kMix;
  return invalid_argument("distill: unknown group loss '" + std::string(name) + "' (expected each, max or mix)");
}

Result<PositionWeight> parse_position_weight(std::string_view name) {
  if (name == "uniform") return PositionWeight::kUniform;
  if (name == "far") return PositionWeight::kFar;
  return invalid_argument("distill: unknown position weighting '" + std::string(name) +
                          "' (expected uniform or far)");
}

Result<DistillTrain> parse_distill_train(std::string_view names) {
  DistillTrain t{false, false, false};
  size_t start = 0;
  while (start <= names.size()) {
    size_t end = names.find(',', start);
    if (end == std::string_view::npos) end = names.size();
    const std::string_view name = names.substr(start, end - start);
    if (name == "fc") {
      t.fc = true;
    } else if (name == "norms") {
      t.norms = true;
    } else if (name == "qk") {
      t.qk = true;
    } else {
      return invalid_argument("distill: unknown parameter group '" + std::string(name) +
                              "' (expected fc, norms or qk)");
    }
    start = end + 1;
  }
  return t;
}

std::string distill_train_names(const DistillTrain& t) {
  std::string out;
  for (auto [on, name] : {std::pair{t.fc, "fc"}, std::pair{t.norms, "norms"}, std::pair{t.qk, "qk"}}) {
    if (!on) continue;
    if (!out.empty()) out += ',';
    out += name;
  }
  return out;
}

uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

Status write_distilled_head(const std::string& path, const RetrievalHead& head,
                            const std::map<std::string, std::string>& extra) {
  // The head's own layout first (write_retrieval_head), then the same tensors again with the
  // extra metadata merged in.
  const std::string staging = path + ".partial";
  SPX_RETURN_IF_ERROR(write_retrieval_head(staging, head));
  Status st = [&]() -> Status {
    SPX_ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> f, SafetensorsFile::open(staging));
    std::map<std::string, std::string> meta = f->metadata();
    for (const auto& [key, value] : extra) {
      if (!meta.emplace(key, value).second) {
        return invalid_argument("distill: metadata key '" + key + "' is the head's own");
      }
    }
    std::vector<NamedTensor> tensors;
    for (const SafetensorsTensor& t : f->tensors()) tensors.push_back({t.name, t.dtype, t.shape, t.data});
    return write_safetensors(path, tensors, meta);
  }();
  std::error_code ec;
  std::filesystem::remove(staging, ec);
  return st;
}

}  // namespace specontext
