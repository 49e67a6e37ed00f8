// CPU candidate filtering (core/ports/candidate_filter.h, cpu/cpu_candidate_filter.h): how much of the
// retrieval head's full-scoring selection survives when the head scores only a shortlist of
// pages, and what the shortlist saves in time.
//
// 1. SYNTHETIC structured keys, a head shaped like Llama-3.1-8B's (32 query heads, 8 KV heads,
//    head_dim 128): keys around drifting cluster centres in segments (topics), a few planted
//    high-scoring tokens, queries aligned with some clusters and the planted direction. Per
//    length × budget B × shortlist C: token recall |S_f ∩ S_full| / |S_full|, attention-mass
//    recall Σ_{S_f} G / Σ_{S_full} G (G = full group scores), candidate recall
//    |S_full ∩ candidates| / |S_full|, and times of full scoring (Backend's host default and a
//    oneTBB-parallel scorer) vs shortlist + select_among_candidates.
// 2. The REAL bundled model: stories260K with its distilled head over data/tinystories_sample.txt
//    (chunks of the model's 512-token context), keys and queries from retrieval_qk on the
//    engine's fused features, the filter fed token by token as in decode; recall at small B.
//
//   build/release/bench/bench_candidate_filter --out bench_out/candidate_filter.json --plot
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "bench/lib/report.h"
#include "core/base/host_math.h"
#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "core/ports/backend.h"
#include "core/ports/selection.h"
#include "core/sparse/candidate_select.h"
#include "core/sparse/retrieval_head.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_candidate_filter.h"
#include "cpu/reference_backend.h"
#include "research/eval.h"

using namespace specontext;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int fail(const Status& st) {
  std::fprintf(stderr, "error: %s\n", st.to_string().c_str());
  return 1;
}

// Deterministic, cheap approximate normals for a few hundred million floats: splitmix64, each
// draw the Irwin–Hall sum of four 16-bit uniforms (mean 2, variance 1/3), rescaled.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  void normals(float* out, int64_t n, float sd) {
    constexpr float kScale = 1.7320508f / 65536.0f;  // √3 / 2^16
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t z = next();
      const uint32_t sum = static_cast<uint32_t>(z & 0xFFFF) + static_cast<uint32_t>((z >> 16) & 0xFFFF) +
                           static_cast<uint32_t>((z >> 32) & 0xFFFF) + static_cast<uint32_t>(z >> 48);
      out[i] = (static_cast<float>(sum) - 131070.0f) * kScale * sd;
    }
  }
};

struct Shape {
  int64_t n_heads = 32, n_kv_heads = 8, head_dim = 128;
  int64_t group() const { return n_heads / n_kv_heads; }
  int64_t kvd() const { return n_kv_heads * head_dim; }
};

// The synthetic world: keys [L][kvd] and a query generator.
struct SyntheticKeys {
  static constexpr int kClusters = 16;
  static constexpr float kNoise = 0.7f;         // per-dimension key noise sd around the centre
  static constexpr float kDrift = 0.6f;         // centre drift over the whole sequence (per dim sd)
  static constexpr int64_t kPlantEvery = 2048;  // one planted token per this many, per KV head
  static constexpr float kPlantNorm = 2.0f;     // planted offset = kPlantNorm·√d along u_g
  Shape sh;
  int64_t length = 0;
  std::vector<float> keys;     // [length][kvd]
  std::vector<float> centres;  // [kv][cluster][d]
  std::vector<float> drifts;   // [kv][cluster][d]
  std::vector<float> plant;    // [kv][d], unit vectors
  std::vector<int32_t> topic;  // [length] topic of each token (segments)

  const float* centre(int64_t g, int64_t j) const {
    return centres.data() + (g * kClusters + j) * sh.head_dim;
  }
  const float* drift(int64_t g, int64_t j) const { return drifts.data() + (g * kClusters + j) * sh.head_dim; }
  static int64_t cluster_of(int64_t topic, int64_t g) { return (topic + 5 * g) % kClusters; }

  void build(const Shape& s, int64_t n, uint64_t seed, tbb::task_arena& arena) {
    sh = s;
    length = n;
    const int64_t d = sh.head_dim, nkv = sh.n_kv_heads;
    Rng rng(seed);
    centres.resize(static_cast<size_t>(nkv * kClusters * d));
    drifts.resize(centres.size());
    plant.resize(static_cast<size_t>(nkv * d));
    rng.normals(centres.data(), static_cast<int64_t>(centres.size()), 1.0f);
    rng.normals(drifts.data(), static_cast<int64_t>(drifts.size()), kDrift);
    rng.normals(plant.data(), static_cast<int64_t>(plant.size()), 1.0f);
    for (int64_t g = 0; g < nkv; ++g) {
      float* u = plant.data() + g * d;
      double nn = 0;
      for (int64_t i = 0; i < d; ++i) nn += double(u[i]) * u[i];
      for (int64_t i = 0; i < d; ++i) u[i] = static_cast<float>(u[i] / std::sqrt(nn));
    }
    // Topics in segments of 16..1024 tokens (log-uniform), so neighbouring tokens share a cluster.
    topic.resize(static_cast<size_t>(n));
    for (int64_t t = 0; t < n;) {
      const int64_t len = static_cast<int64_t>(std::exp(std::log(16.0) + rng.uniform() * std::log(64.0)));
      const int32_t tp = static_cast<int32_t>(rng.next() % kClusters);
      for (int64_t e = std::min(n, t + len); t < e; ++t) topic[static_cast<size_t>(t)] = tp;
    }
    keys.resize(static_cast<size_t>(n * sh.kvd()));
    constexpr int64_t kBlock = 1024;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    arena.execute([&] {
      tbb::parallel_for(int64_t{0}, blocks, [&](int64_t b) {
        Rng r(seed * 1000003 + static_cast<uint64_t>(b) + 1);
        // Half of the noise variance is local (AR(1), ρ = 0.95: neighbours are alike, as real
        // keys are), half independent per token.
        std::vector<float> ar(static_cast<size_t>(sh.kvd())), eps(ar.size());
        r.normals(ar.data(), sh.kvd(), 1.0f);
        const float rho = 0.95f, innov = std::sqrt(1.0f - rho * rho), half = std::sqrt(0.5f);
        for (int64_t t = b * kBlock; t < std::min(n, (b + 1) * kBlock); ++t) {
          float* row = keys.data() + t * sh.kvd();
          r.normals(row, sh.kvd(), 1.0f);
          r.normals(eps.data(), sh.kvd(), 1.0f);
          for (int64_t i = 0; i < sh.kvd(); ++i) {
            ar[static_cast<size_t>(i)] =
                rho * ar[static_cast<size_t>(i)] + innov * eps[static_cast<size_t>(i)];
            row[i] = kNoise * half * (row[i] + ar[static_cast<size_t>(i)]);
          }
          const float frac = static_cast<float>(t) / static_cast<float>(n);
          for (int64_t g = 0; g < nkv; ++g) {
            const int64_t j = cluster_of(topic[static_cast<size_t>(t)], g);
            const float* m = centre(g, j);
            const float* dr = drift(g, j);
            float* k = row + g * d;
            for (int64_t i = 0; i < d; ++i) k[i] += m[i] + frac * dr[i];
            // Planted tokens: a strong component along u_g (never in the first or last page).
            if (t >= 64 && t < n - 64 && r.next() % kPlantEvery == 0) {
              const float a = kPlantNorm * std::sqrt(static_cast<float>(d));
              for (int64_t i = 0; i < d; ++i) k[i] += a * plant[static_cast<size_t>(g * d + i)];
            }
          }
        }
      });
    });
  }

  // The query at position L − 1 (index qi): per query head a N(0, 1) vector, plus 3 × the unit
  // direction of one favoured cluster's current centre (~3 logits above the bulk), plus, for
  // even query heads, 4 × the planted direction (planted tokens ~8 logits above).
  std::vector<float> query(int64_t L, int64_t qi) const {
    const int64_t d = sh.head_dim;
    std::vector<float> q(static_cast<size_t>(sh.n_heads * d));
    Rng r(77 + static_cast<uint64_t>(qi) * 131 + static_cast<uint64_t>(L));
    r.normals(q.data(), static_cast<int64_t>(q.size()), 1.0f);
    const float frac = static_cast<float>(L - 1) / static_cast<float>(length);
    for (int64_t h = 0; h < sh.n_heads; ++h) {
      const int64_t g = h / sh.group();
      const int64_t j = (qi * 7 + h * 3) % kClusters;
      std::vector<float> c(static_cast<size_t>(d));
      double nn = 0;
      for (int64_t i = 0; i < d; ++i) {
        c[static_cast<size_t>(i)] = centre(g, j)[i] + frac * drift(g, j)[i];
        nn += double(c[static_cast<size_t>(i)]) * c[static_cast<size_t>(i)];
      }
      // Logit gains: k·(γ ĉ)/√d ≈ γ |c|/√d ≈ γ for a key of that cluster (|c| ≈ √d), and
      // (β u)·(2√d u)/√d = 2β for a planted key.
      const float gamma = 3.0f / static_cast<float>(std::sqrt(nn));
      const float beta = h % 2 == 0 ? 4.0f : 0.0f;
      float* qh = q.data() + h * d;
      for (int64_t i = 0; i < d; ++i) {
        qh[i] += gamma * c[static_cast<size_t>(i)] + beta * plant[static_cast<size_t>(g * d + i)];
      }
    }
    return q;
  }
};

// Full scoring with oneTBB, same maths as Backend::retrieval_group_scores (the per-head sums run
// in blocks, so not necessarily bit-identical; the JSON reports the largest difference): logits
// per (KV head, token block), token-major for the group's query heads; softmax per query head;
// group max per block. Group size <= 64.
void parallel_group_scores(tbb::task_arena& arena, const float* q, const float* k, int64_t L, const Shape& sh,
                           std::vector<float>& logits, std::vector<float>& out) {
  const int64_t d = sh.head_dim, group = sh.group(), kvd = sh.kvd();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  constexpr int64_t kBlock = 2048;
  const int64_t blocks = (L + kBlock - 1) / kBlock;
  logits.resize(static_cast<size_t>(sh.n_heads * L));
  out.resize(static_cast<size_t>(sh.n_kv_heads * L));
  std::vector<float> block_max(static_cast<size_t>(sh.n_heads * blocks));
  std::vector<double> block_sum(block_max.size());
  arena.execute([&] {
    tbb::parallel_for(int64_t{0}, sh.n_kv_heads * blocks, [&](int64_t item) {
      const int64_t g = item / blocks, b = item % blocks;
      // Token-major: each key row is read once for the group's query heads.
      float mx[64];
      std::fill(mx, mx + group, -INFINITY);
      for (int64_t t = b * kBlock; t < std::min(L, (b + 1) * kBlock); ++t) {
        const float* kt = k + t * kvd + g * d;
        for (int64_t j = 0; j < group; ++j) {
          const float v = dot8(q + (g * group + j) * d, kt, d) * scale;
          logits[static_cast<size_t>((g * group + j) * L + t)] = v;
          mx[j] = std::max(mx[j], v);
        }
      }
      for (int64_t j = 0; j < group; ++j)
        block_max[static_cast<size_t>((g * group + j) * blocks + b)] = mx[j];
    });
    tbb::parallel_for(int64_t{0}, sh.n_heads * blocks, [&](int64_t item) {
      const int64_t h = item / blocks, b = item % blocks;
      float mx = -INFINITY;
      for (int64_t i = 0; i < blocks; ++i) mx = std::max(mx, block_max[static_cast<size_t>(h * blocks + i)]);
      float* row = logits.data() + h * L;
      double s = 0;
      for (int64_t t = b * kBlock; t < std::min(L, (b + 1) * kBlock); ++t)
        s += (row[t] = std::exp(row[t] - mx));
      block_sum[static_cast<size_t>(item)] = s;
    });
    tbb::parallel_for(int64_t{0}, sh.n_kv_heads * blocks, [&](int64_t item) {
      const int64_t g = item / blocks, b = item % blocks;
      float* dst = out.data() + g * L;
      for (int64_t t = b * kBlock; t < std::min(L, (b + 1) * kBlock); ++t) dst[t] = 0.0f;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        double s = 0;
        for (int64_t i = 0; i < blocks; ++i) s += block_sum[static_cast<size_t>(h * blocks + i)];
        const float inv = static_cast<float>(1.0 / s);
        const float* row = logits.data() + h * L;
        for (int64_t t = b * kBlock; t < std::min(L, (b + 1) * kBlock); ++t)
          dst[t] = std::max(dst[t], row[t] * inv);
      }
    });
  });
}

struct Recall {
  double tokens = 0, mass = 0, candidates = 0;
};

// S_f against S_full under the full group scores G [kv][L].
Recall recall_of(const Selection& filtered, const Selection& full, const Candidates& cand, const float* G,
                 int64_t L) {
  int64_t inter = 0, total = 0, in_cand = 0;
  double mass_f = 0, mass_full = 0;
  std::vector<char> mark(static_cast<size_t>(L));
  for (int64_t g = 0; g < full.kv_heads; ++g) {
    std::fill(mark.begin(), mark.end(), 0);
    for (int32_t t : filtered.head(g)) {
      mark[static_cast<size_t>(t)] = 1;
      mass_f += G[g * L + t];
    }
    for (int64_t i = cand.offsets[static_cast<size_t>(g)]; i < cand.offsets[static_cast<size_t>(g + 1)];
         ++i) {
      mark[static_cast<size_t>(cand.tokens[static_cast<size_t>(i)])] |= 2;
    }
    for (int32_t t : full.head(g)) {
      inter += mark[static_cast<size_t>(t)] & 1;
      in_cand += (mark[static_cast<size_t>(t)] >> 1) & 1;
      mass_full += G[g * L + t];
      ++total;
    }
  }
  Recall r;
  r.tokens = total ? double(inter) / double(total) : 1.0;
  r.candidates = total ? double(in_cand) / double(total) : 1.0;
  r.mass = mass_full > 0 ? mass_f / mass_full : 1.0;
  return r;
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() &&
      s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=,:") ==
          std::string::npos) {
    return s;
  }
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Captures the fused features of one dense prefill.
class FusedObserver final : public ForwardObserver {
 public:
  void on_fused_hidden(const float* fused, int64_t rows, std::span<const AttentionItem>) override {
    fused_.assign(fused, fused + rows * width_);
  }
  void set_width(int64_t w) { width_ = w; }
  std::vector<float> fused_;

 private:
  int64_t width_ = 0;
};

struct SyntheticConfig {
  std::vector<int64_t> lengths, budgets, multipliers;
  int64_t page = 16;
  int queries = 3;
  int threads = 0;
};

Result<nlohmann::json> run_synthetic(const SyntheticConfig& cfg) {
  const Shape sh;
  const int64_t max_len = *std::max_element(cfg.lengths.begin(), cfg.lengths.end());
  SPX_ASSIGN_OR_RETURN(
      auto filter,
      cpu::CpuCandidateFilter::create({{cfg.page, sh.n_heads, sh.n_kv_heads, sh.head_dim}, 0, cfg.threads}));
  tbb::task_arena arena(filter->num_threads());
  SyntheticKeys world;
  auto t0 = Clock::now();
  world.build(sh, max_len, 2024, arena);
  const double gen_s = seconds_since(t0);
  std::fprintf(stderr, "synthetic keys: %lld tokens x %lld floats (%.2f GiB) in %.1f s\n", (long long)max_len,
               (long long)sh.kvd(), double(world.keys.size()) * 4 / (1 << 30), gen_s);
  const SeqId seq(0);
  t0 = Clock::now();
  SPX_RETURN_IF_ERROR(filter->append_keys(seq, world.keys.data(), 0, max_len));
  const double append_s = seconds_since(t0);
  std::fprintf(stderr, "filter append: %.3f s (%.1f M tokens/s), summaries %.1f MiB\n", append_s,
               max_len / append_s / 1e6, filter->summary_bytes(seq) / 1048576.0);

  cpu::ReferenceBackend host;  // Backend's host default retrieval_group_scores (no override)
  std::vector<float> G, G_par, logits, q;
  Selection full, filtered;
  Candidates cand;
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t L : cfg.lengths) {
    struct Acc {
      std::vector<double> shortlist_s, select_s;
      Recall sum;
      int n = 0;
    };
    std::vector<double> full_serial_s, full_par_s, max_diff;
    std::vector<std::vector<double>> full_select_s(cfg.budgets.size());
    std::vector<Acc> acc(cfg.budgets.size() * cfg.multipliers.size());
    for (int qi = 0; qi < cfg.queries; ++qi) {
      q = world.query(L, qi);
      G.resize(static_cast<size_t>(sh.n_kv_heads * L));
      t0 = Clock::now();
      const void* table[1] = {world.keys.data()};
      SPX_RETURN_IF_ERROR(host.retrieval_group_scores(q.data(), table, DType::kF32, std::max<int64_t>(L, 1), L, sh.n_heads,
                                                      sh.n_kv_heads, sh.head_dim, G.data()));
      full_serial_s.push_back(seconds_since(t0));
      t0 = Clock::now();
      parallel_group_scores(arena, q.data(), world.keys.data(), L, sh, logits, G_par);
      full_par_s.push_back(seconds_since(t0));
      double md = 0;
      for (size_t i = 0; i < G.size(); ++i) md = std::max(md, double(std::abs(G[i] - G_par[i])));
      max_diff.push_back(md);
      for (size_t bi = 0; bi < cfg.budgets.size(); ++bi) {
        const SelectionOptions sel{cfg.budgets[bi], 1, 4};
        t0 = Clock::now();
        select_from_group_scores(G, sh.n_kv_heads, L, sel, full);
        full_select_s[bi].push_back(seconds_since(t0));
        for (size_t mi = 0; mi < cfg.multipliers.size(); ++mi) {
          const int64_t C = cfg.multipliers[mi] * cfg.budgets[bi];
          Acc& a = acc[bi * cfg.multipliers.size() + mi];
          t0 = Clock::now();
          SPX_RETURN_IF_ERROR(filter->shortlist(seq, q.data(), L, C, sel, cand));
          a.shortlist_s.push_back(seconds_since(t0));
          t0 = Clock::now();
          SPX_RETURN_IF_ERROR(select_among_candidates(q.data(), world.keys.data(), sh.n_heads, sh.n_kv_heads,
                                                      sh.head_dim, cand, sel, filtered));
          a.select_s.push_back(seconds_since(t0));
          const Recall r = recall_of(filtered, full, cand, G.data(), L);
          a.sum.tokens += r.tokens;
          a.sum.mass += r.mass;
          a.sum.candidates += r.candidates;
          ++a.n;
        }
      }
    }
    const double fs = median(full_serial_s), fp = median(full_par_s);
    for (size_t bi = 0; bi < cfg.budgets.size(); ++bi) {
      const double sel_s = median(full_select_s[bi]);
      for (size_t mi = 0; mi < cfg.multipliers.size(); ++mi) {
        const Acc& a = acc[bi * cfg.multipliers.size() + mi];
        const double sh_s = median(a.shortlist_s), cs = median(a.select_s);
        const double filt = sh_s + cs;
        nlohmann::json row = {
            {"length", L},
            {"budget", cfg.budgets[bi]},
            {"shortlist_tokens", cfg.multipliers[mi] * cfg.budgets[bi]},
            {"multiplier", cfg.multipliers[mi]},
            {"page_size", cfg.page},
            {"queries", a.n},
            {"token_recall", a.sum.tokens / a.n},
            {"mass_recall", a.sum.mass / a.n},
            {"candidate_recall", a.sum.candidates / a.n},
            {"full_serial_seconds", fs + sel_s},
            {"full_parallel_seconds", fp + sel_s},
            {"full_select_seconds", sel_s},
            {"shortlist_seconds", sh_s},
            {"candidate_select_seconds", cs},
            {"filtered_seconds", filt},
            {"speedup_vs_serial", (fs + sel_s) / filt},
            {"speedup_vs_parallel", (fp + sel_s) / filt},
            {"parallel_scorer_max_abs_diff", *std::max_element(max_diff.begin(), max_diff.end())}};
        std::fprintf(
            stderr,
            "L %7lld B %5lld C %6lld: recall tokens %.3f mass %.3f cand %.3f | full %.1f ms (tbb %.1f) "
            "vs shortlist %.1f + select %.1f ms: x%.1f (x%.1f vs tbb)\n",
            (long long)L, (long long)cfg.budgets[bi], (long long)(cfg.multipliers[mi] * cfg.budgets[bi]),
            a.sum.tokens / a.n, a.sum.mass / a.n, a.sum.candidates / a.n, 1e3 * (fs + sel_s),
            1e3 * (fp + sel_s), 1e3 * sh_s, 1e3 * cs, (fs + sel_s) / filt, (fp + sel_s) / filt);
        rows.push_back(row);
      }
    }
  }
  nlohmann::json doc = {
      {"data",
       "SYNTHETIC structured keys (not a model's): per KV head 16 cluster centres that drift over the "
       "sequence, tokens in topic segments of 16-1024 tokens, key = centre + noise of sd 0.7 per dimension "
       "(half "
       "of its variance i.i.d., half AR(1) along positions with rho 0.95), one planted "
       "token per 2048 (per KV head) with a 2*sqrt(d) offset along a fixed direction; queries = noise + a "
       "favoured cluster's current centre direction (about 3 logits) + the planted direction on even query "
       "heads (about 8 logits)"},
      {"shape", {{"n_heads", sh.n_heads}, {"n_kv_heads", sh.n_kv_heads}, {"head_dim", sh.head_dim}}},
      {"like", "Llama-3.1-8B attention shape"},
      {"sinks", 1},
      {"window", 4},
      {"threads", filter->num_threads()},
      {"candidate_select_threads", 1},
      {"summary_bytes", filter->summary_bytes(seq)},
      {"summary_memory_bound_to_node", filter->memory_bound()},
      {"append_seconds", append_s},
      {"key_generation_seconds", gen_s},
      {"results", rows}};
  return doc;
}

struct RealConfig {
  std::string model, head, text;
  std::vector<int64_t> budgets, multipliers, pages;
};

Result<nlohmann::json> run_real(const RealConfig& cfg) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<Model> model, load_model(cfg.model));
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<RetrievalHead> head, load_eagle3_head(cfg.head, model->config));
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, load_tokenizer_for(*model, ""));
  std::ifstream in(cfg.text, std::ios::binary);
  if (!in) return not_found("cannot read --text " + cfg.text);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  SPX_ASSIGN_OR_RETURN(std::vector<TokenId> all, encode_stories(*tok, text));
  const RetrievalHeadConfig& hc = head->config;
  const int64_t ctx = model->config.max_seq_len, nh = hc.n_heads, nkv = hc.n_kv_heads, hd = hc.head_dim;
  const int64_t qd = nh * hd, kvd = nkv * hd, fd = 3 * model->config.dim;
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<Backend> be, cpu::create_cpu_backend({}));
  std::shared_ptr<Backend> backend(std::move(be));
  EngineOptions eo;
  eo.max_sequences = 1;
  eo.max_context = ctx;
  eo.sparse.method = SparseMethod::kSpeContext;
  eo.retrieval_head = head;
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::create(model, backend, eo));
  FusedObserver obs;
  obs.set_width(fd);
  engine->set_observer(&obs);
  const RopeParams rope = make_head_rope_params(hc, engine->max_context());

  struct Acc {
    Recall sum;
    int64_t positions = 0;
  };
  std::vector<Acc> acc(cfg.pages.size() * cfg.budgets.size() * cfg.multipliers.size());
  int64_t chunks = 0, tokens_used = 0;
  cpu::ReferenceBackend host;
  std::vector<float> G;
  Selection full, filtered;
  Candidates cand;
  for (int64_t start = 0; start + 64 <= static_cast<int64_t>(all.size()); start += ctx) {
    const int64_t n = std::min<int64_t>(ctx, static_cast<int64_t>(all.size()) - start);
    const std::vector<TokenId> toks(all.begin() + start, all.begin() + start + n);
    SPX_ASSIGN_OR_RETURN(SeqId s, engine->memory().add_sequence());
    const StepRequest req{s, toks, LogitsMode::kNone};
    SPX_ASSIGN_OR_RETURN(StepOutput o, engine->forward(std::span<const StepRequest>(&req, 1)));
    (void)o;
    SPX_RETURN_IF_ERROR(engine->memory().remove_sequence(s));
    if (static_cast<int64_t>(obs.fused_.size()) != n * fd) {
      return internal_error("the engine emitted no fused features for the chunk");
    }
    // fused(p−1) of each row: zeros for position 0.
    std::vector<float> prev(static_cast<size_t>(n * fd), 0.0f);
    std::copy_n(obs.fused_.data(), (n - 1) * fd, prev.data() + fd);
    std::vector<int64_t> pos(static_cast<size_t>(n));
    std::iota(pos.begin(), pos.end(), int64_t{0});
    std::vector<float> q(static_cast<size_t>(n * qd)), k(static_cast<size_t>(n * kvd));
    SPX_RETURN_IF_ERROR(retrieval_qk(*backend, *head, rope, model->tok_embeddings, toks.data(), prev.data(),
                                     pos.data(), n, q.data(), k.data()));
    ++chunks;
    tokens_used += n;
    for (size_t pi = 0; pi < cfg.pages.size(); ++pi) {
      SPX_ASSIGN_OR_RETURN(auto filter,
                           cpu::CpuCandidateFilter::create({{cfg.pages[pi], nh, nkv, hd}, 0, 1}));
      for (int64_t t = 0; t < n; ++t) {  // decode order: key t arrives, then query t scores [0, t]
        SPX_RETURN_IF_ERROR(filter->append_keys(SeqId(0), k.data() + t * kvd, t, 1));
        const int64_t L = t + 1;
        const float* qt = q.data() + t * qd;
        G.resize(static_cast<size_t>(nkv * L));
        const void* table[1] = {k.data()};
        SPX_RETURN_IF_ERROR(
            host.retrieval_group_scores(qt, table, DType::kF32, std::max<int64_t>(L, 1), L, nh, nkv, hd, G.data()));
        for (size_t bi = 0; bi < cfg.budgets.size(); ++bi) {
          const SelectionOptions sel{cfg.budgets[bi], 1, 4};
          select_from_group_scores(G, nkv, L, sel, full);
          for (size_t mi = 0; mi < cfg.multipliers.size(); ++mi) {
            const int64_t C = cfg.multipliers[mi] * cfg.budgets[bi];
            if (L <= C) continue;  // every token a candidate: recall 1 by construction
            SPX_RETURN_IF_ERROR(filter->shortlist(SeqId(0), qt, L, C, sel, cand));
            SPX_RETURN_IF_ERROR(select_among_candidates(qt, k.data(), nh, nkv, hd, cand, sel, filtered));
            const Recall r = recall_of(filtered, full, cand, G.data(), L);
            Acc& a = acc[(pi * cfg.budgets.size() + bi) * cfg.multipliers.size() + mi];
            a.sum.tokens += r.tokens;
            a.sum.mass += r.mass;
            a.sum.candidates += r.candidates;
            ++a.positions;
          }
        }
      }
    }
  }
  nlohmann::json rows = nlohmann::json::array();
  for (size_t pi = 0; pi < cfg.pages.size(); ++pi) {
    for (size_t bi = 0; bi < cfg.budgets.size(); ++bi) {
      for (size_t mi = 0; mi < cfg.multipliers.size(); ++mi) {
        const Acc& a = acc[(pi * cfg.budgets.size() + bi) * cfg.multipliers.size() + mi];
        const double np = std::max<int64_t>(a.positions, 1);
        rows.push_back({{"page_size", cfg.pages[pi]},
                        {"budget", cfg.budgets[bi]},
                        {"shortlist_tokens", cfg.multipliers[mi] * cfg.budgets[bi]},
                        {"multiplier", cfg.multipliers[mi]},
                        {"positions", a.positions},
                        {"token_recall", a.sum.tokens / np},
                        {"mass_recall", a.sum.mass / np},
                        {"candidate_recall", a.sum.candidates / np}});
        std::fprintf(
            stderr, "real P %2lld B %3lld C %4lld: %4lld positions, recall tokens %.3f mass %.3f cand %.3f\n",
            (long long)cfg.pages[pi], (long long)cfg.budgets[bi],
            (long long)(cfg.multipliers[mi] * cfg.budgets[bi]), (long long)a.positions, a.sum.tokens / np,
            a.sum.mass / np, a.sum.candidates / np);
      }
    }
  }
  nlohmann::json doc = {
      {"data", "REAL: the bundled model's distilled retrieval head on TinyStories text"},
      {"model", cfg.model},
      {"head", cfg.head},
      {"text", cfg.text},
      {"head_shape", {{"n_heads", nh}, {"n_kv_heads", nkv}, {"head_dim", hd}}},
      {"context", ctx},
      {"chunks", chunks},
      {"tokens", tokens_used},
      {"sinks", 1},
      {"window", 4},
      {"note",
       "positions: decode positions whose length exceeds the shortlist C (shorter ones give every "
       "token as a candidate and recall 1); the filter is fed one key per position as in decode"},
      {"results", rows}};
  return doc;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU candidate filtering: recall and time vs full scoring"};
  SyntheticConfig syn;
  syn.lengths = {16384, 32768, 65536, 131072, 262144};
  syn.budgets = {256, 2048};
  syn.multipliers = {2, 4, 8};
  RealConfig real;
  real.model = std::string(SPECONTEXT_SOURCE_DIR) + "/models/stories260K/stories260K.bin";
  real.head = std::string(SPECONTEXT_SOURCE_DIR) + "/models/stories260K/retrieval_head.safetensors";
  real.text = std::string(SPECONTEXT_SOURCE_DIR) + "/data/tinystories_sample.txt";
  real.budgets = {16, 32, 64};
  real.multipliers = {2, 4};
  real.pages = {4, 16};
  std::string out = "bench_out/candidate_filter.json";
  bool plot = false, no_synthetic = false, no_real = false;
  app.add_option("--lengths", syn.lengths, "synthetic sequence lengths")->delimiter(',');
  app.add_option("--budgets", syn.budgets, "synthetic budgets B per KV head")->delimiter(',');
  app.add_option("--multipliers", syn.multipliers, "shortlist C = multiplier x B")->delimiter(',');
  app.add_option("--page", syn.page, "synthetic summary page size");
  app.add_option("--queries", syn.queries, "synthetic queries per length")->check(CLI::Range(1, 100));
  app.add_option("--threads", syn.threads, "filter and parallel-scorer threads (0 = cores of node 0)");
  app.add_option("--model", real.model, "real model");
  app.add_option("--head", real.head, "its retrieval head");
  app.add_option("--text", real.text, "text for the real run");
  app.add_option("--real-budgets", real.budgets, "real budgets B")->delimiter(',');
  app.add_option("--real-multipliers", real.multipliers, "real shortlist multipliers")->delimiter(',');
  app.add_option("--real-pages", real.pages, "real page sizes")->delimiter(',');
  app.add_flag("--no-synthetic", no_synthetic, "skip the synthetic part");
  app.add_flag("--no-real", no_real, "skip the real-model part");
  app.add_option("--out", out, "JSON output path");
  app.add_flag("--plot", plot, "also write a PNG next to the JSON (python3 + matplotlib)");
  CLI11_PARSE(app, argc, argv);
  for (const auto* v :
       {&syn.lengths, &syn.budgets, &syn.multipliers, &real.budgets, &real.multipliers, &real.pages}) {
    if (v->empty() || *std::min_element(v->begin(), v->end()) < 1) {
      std::fprintf(stderr, "error: lengths, budgets, multipliers and pages must be >= 1\n");
      return 1;
    }
  }
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + shell_quote(argv[i]);

  nlohmann::json doc = {{"command", command}, {"bench", "bench_candidate_filter"}};
  const auto t0 = Clock::now();
  if (!no_synthetic) {
    auto r = run_synthetic(syn);
    if (!r.is_ok()) return fail(r.status());
    doc["synthetic"] = std::move(*r);
  }
  if (!no_real) {
    auto r = run_real(real);
    if (!r.is_ok()) return fail(r.status());
    doc["real"] = std::move(*r);
  }
  doc["wall_seconds"] = seconds_since(t0);
  std::fprintf(stderr, "took %.0f s\n", seconds_since(t0));
  bench::write_report(doc, out, plot, std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_candidate_filter.py");
  return 0;
}
