// CudaBackend::sample_rows against the host default (Backend::sample_rows = sample_with_coin per
// row, run on the CPU reference backend). Greedy rows must be identical (ties, -inf, NaN). Sampled
// rows must be identical wherever the decision is numerically clear: a double-precision model of
// the procedure (softmax in double, exact top-k / top-p / CDF) marks a case undecided when the
// coin, top_p or the cutoff lies within a tolerance of a boundary the float sums could move, or
// when the chosen token has a near-equal (not equal) neighbour in the sorted order; at least 95%
// of the cases must be decided. The model itself is checked against the host on the same cases
// without a device (SamplingOracle.*). Frequencies of 20 000 draws from a fixed 5-token
// distribution must be within 0.02 of the truncated distribution. Without a device the CUDA
// cases skip ("no CUDA device").
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/ports/backend.h"
#include "core/ports/sampler.h"
#include "cpu/cpu_backend.h"
#include "gpu/cuda_backend.h"
#include "tests/gpu/device_test_util.h"

namespace specontext::gpu {
namespace {

using device_test::Guarded;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- the double-precision oracle ----

struct Decision {
  bool decided = true;  // far enough from every boundary that float summation order cannot matter
  TokenId token = 0;    // the model's token (equal to the host's whenever decided)
  const char* why = "";  // the first reason it is not decided
  void undecided(const char* reason) {
    if (decided) why = reason;
    decided = false;
  }
};

Decision model_decision(std::vector<float> row, const TokenDraw& d) {
  const SamplingParams& p = d.params;
  const int64_t n = static_cast<int64_t>(row.size());
  if (p.repetition_penalty != 1.0f) {
    for (TokenId t : d.penalized) {
      if (t < 0 || t >= n) continue;
      float& l = row[static_cast<size_t>(t)];
      l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
    }
  }
  Decision out;
  if (p.temperature == 0.0f) {
    out.token = argmax(row);
    return out;
  }
  if (n <= 1) return out;
  const double tol = 2e-6 + 4e-7 * std::sqrt(static_cast<double>(n));  // absolute, probability units
  const double rel = 1e-5;                                            // near ties of probabilities
  constexpr double kTiny = 1e-37;
  for (float& l : row) l /= p.temperature;
  const float xmax = *std::max_element(row.begin(), row.end());
  std::vector<double> q(static_cast<size_t>(n));
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += q[static_cast<size_t>(i)] = std::exp(double(row[i]) - double(xmax));
  for (double& v : q) v /= s;
  // Host order: probability descending, lower index first; equal x <=> an exact tie.
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
  auto near_tie = [&](int64_t a, int64_t b) {
    return row[a] != row[b] && std::fabs(q[a] - q[b]) <= rel * std::max(q[a], q[b]);
  };
  if (p.top_k > 0 && p.top_k < n) {
    const int64_t k = p.top_k;
    if (near_tie(order[k - 1], order[k])) out.undecided("k-th near tie");
    double kept = 0.0;
    for (int64_t j = 0; j < k; ++j) kept += q[order[j]];
    for (int64_t j = 0; j < n; ++j) q[order[j]] = j < k ? q[order[j]] / kept : 0.0;
  }
  // The slot of seq[0..last] that holds every x in [x_lo, x_hi], tol away from its edges.
  auto draw = [&](const std::vector<int64_t>& seq, double x_lo, double x_hi, int64_t last, int64_t fallback) {
    double before = 0.0;
    for (int64_t j = 0; j <= last; ++j) {
      const double after = before + q[seq[j]];
      if (x_lo < after) {
        // A zero coin takes the first token of positive probability whatever the sums.
        const bool upper_close = x_hi == 0.0 ? after <= kTiny : after - x_hi < tol;
        if ((before > kTiny && x_lo - before < tol) || upper_close) out.undecided("coin at a boundary");
        return j;
      }
      before = after;
    }
    out.undecided("coin beyond the total");  // float rounding decides
    return fallback;
  };
  if (p.top_p >= 1.0f) {
    std::vector<int64_t> seq(static_cast<size_t>(n));
    std::iota(seq.begin(), seq.end(), 0);
    out.token = static_cast<TokenId>(draw(seq, d.coin, d.coin, n - 1, n - 1));
    return out;
  }
  const double cutoff = (1.0f - p.top_p) / static_cast<float>(n - 1);
  std::vector<int64_t> cand;
  int64_t safe = 0;  // candidates clearly above the cutoff; they come first in the order
  bool near_cutoff = false;
  for (int64_t i : order) {
    if (q[i] > 0.0 && std::fabs(q[i] - cutoff) <= rel * cutoff) near_cutoff = true;
    if (q[i] > cutoff * (1.0 + rel)) ++safe;
    if (q[i] >= cutoff) cand.push_back(i);
  }
  if (cand.empty()) {
    out.undecided("no candidate");
    return out;
  }
  // Prefix: the float sums may end it anywhere from the first sum above top_p - tol (lo) to the
  // first above top_p + tol (hi); the draw must not depend on which.
  const int64_t m = static_cast<int64_t>(cand.size());
  std::vector<double> cum(static_cast<size_t>(m));
  double c = 0.0;
  int64_t lo = -1, last = -1, hi = -1;
  for (int64_t j = 0; j < m; ++j) {
    cum[j] = c += q[cand[j]];
    if (lo < 0 && c > p.top_p - tol) lo = j;
    if (last < 0 && c > p.top_p) last = j;
    if (hi < 0 && c > p.top_p + tol) hi = j;
  }
  if (lo < 0) lo = m - 1;
  if (last < 0) last = m - 1;
  if (hi < 0) hi = m - 1;
  if (near_cutoff && hi >= safe) out.undecided("cutoff");
  const int64_t j = draw(cand, double(d.coin) * cum[lo], double(d.coin) * cum[hi], last, last);
  if (lo != hi && j >= lo) out.undecided("top_p at a prefix sum");
  if ((j > 0 && near_tie(cand[j - 1], cand[j])) || (j + 1 < m && near_tie(cand[j], cand[j + 1]))) {
    out.undecided("near-tie neighbour");
  }
  out.token = static_cast<TokenId>(cand[j]);
  return out;
}

// ---- random cases ----

void fill_row(std::mt19937& rng, float* row, int64_t n, int kind) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::normal_distribution<float> g(0.0f, 1.0f);
  switch (kind) {
    case 0:
      for (int64_t i = 0; i < n; ++i) row[i] = 4.0f * u(rng);
      break;
    case 1: {  // heavy ties
      const int levels = 1 + static_cast<int>(rng() % 4);
      for (int64_t i = 0; i < n; ++i) row[i] = static_cast<float>(static_cast<int>(rng() % levels)) * 0.75f;
      break;
    }
    case 2:  // -inf entries and ±0
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t c = rng() % 8;
        row[i] = c == 0 ? -kInf : c == 1 ? -0.0f : c == 2 ? 0.0f : u(rng);
      }
      row[rng() % n] = 1.0f;
      break;
    default:  // peaked, like language-model logits (also tied peaks)
      for (int64_t i = 0; i < n; ++i) row[i] = g(rng);
      for (int j = 0; j < 6; ++j) row[rng() % n] = 18.0f + static_cast<float>(rng() % 4);
      break;
  }
}

// top_p values are jittered off round numbers: tied probabilities make prefix sums hit 0.5 or
// 0.9 exactly, which the float sums may or may not exceed (undecided cases, not errors).
TokenDraw random_draw(std::mt19937& rng, int64_t n, bool long_vocab) {
  TokenDraw d;
  SamplingParams& p = d.params;
  const float temps[] = {0.0f, 0.05f, 0.5f, 1.0f, 1.3f, 2.0f};
  // Long rows at T > 1 put most of the mass in a flat tail of tiny slots: undecided, not useful.
  p.temperature = temps[rng() % (long_vocab ? 4 : 6)];
  const float top_ps[] = {1.0f, 1.0f, 0.1f, 0.5f, 0.9f, 0.95f, 0.999f, 0.0f};
  p.top_p = top_ps[rng() % 8];
  if (p.top_p == 0.0f) p.top_p = std::uniform_real_distribution<float>(0.05f, 1.0f)(rng);
  if (p.top_p < 1.0f) p.top_p += std::uniform_real_distribution<float>(-0.004f, 0.0f)(rng);
  // top_p <= 1/n can leave no candidate (the argmax then; its own test covers it).
  p.top_p = std::min(1.0f, std::max(p.top_p, 1.0f / static_cast<float>(n) + 0.01f));
  const int64_t ks[] = {0, 0, 1, 2, 50, -1, n - 1, n};
  // A random k in a long row lands among dense values (near ties): only for short rows.
  const int64_t drawn = ks[rng() % 8];
  const int64_t k = drawn == -1 && long_vocab ? 40 : drawn;
  p.top_k = static_cast<int32_t>(k == -1 ? 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(n))
                                         : std::min<int64_t>(std::max<int64_t>(k, 0), INT32_MAX));
  const float penalties[] = {1.0f, 1.0f, 1.1f, 1.5f, 0.8f};
  p.repetition_penalty = penalties[rng() % 5];
  const uint32_t c = rng() % 100;
  d.coin = c < 12 ? 0.0f : c == 12 ? 0.999999f : std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
  if (d.coin >= 1.0f) d.coin = 0.5f;
  if (p.repetition_penalty != 1.0f) {
    std::vector<TokenId> ids;
    const int64_t h = static_cast<int64_t>(rng() % 64);
    for (int64_t i = 0; i < h && static_cast<int64_t>(ids.size()) < n; ++i) {
      const TokenId t = static_cast<TokenId>(rng() % static_cast<uint32_t>(n));
      if (std::find(ids.begin(), ids.end(), t) == ids.end()) ids.push_back(t);
    }
    ids.insert(ids.end(), {-1, -1, static_cast<TokenId>(n), static_cast<TokenId>(n + 7)});
    std::shuffle(ids.begin(), ids.end(), rng);
    d.penalized = ids;
  }
  return d;
}

struct Case {
  int64_t rows = 0;
  int64_t vocab = 0;
  std::vector<float> logits;
  std::vector<TokenDraw> draws;
};

// Small and medium vocabularies with every kind of row; long ones with language-model-like rows.
std::vector<Case> random_cases(uint32_t seed, int iterations, bool long_vocab) {
  std::mt19937 rng(seed);
  const int64_t small[] = {2, 3, 5, 17, 100, 1000, 4099, 32000};
  const int64_t large[] = {131072, 262144, 300000};
  std::vector<Case> cases;
  for (int it = 0; it < iterations; ++it) {
    Case c;
    c.vocab = long_vocab ? large[it % 3] : small[it % 8];
    c.rows = long_vocab ? 4 : 1 + static_cast<int64_t>(rng() % 8);
    c.logits.resize(static_cast<size_t>(c.rows * c.vocab));
    for (int64_t r = 0; r < c.rows; ++r) {
      const int kind = long_vocab || c.vocab >= 32000 ? 3 : static_cast<int>(rng() % 4);
      fill_row(rng, c.logits.data() + r * c.vocab, c.vocab, kind);
      c.draws.push_back(random_draw(rng, c.vocab, c.vocab >= 32000));
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

std::vector<TokenId> host_tokens(Backend& ref, const Case& c) {
  std::vector<float> logits = c.logits;
  std::vector<TokenId> out(static_cast<size_t>(c.rows), -1);
  const Status s = ref.sample_rows(logits.data(), c.rows, c.vocab, c.draws.data(), out.data());
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

std::unique_ptr<Backend> reference_backend() {
  auto ref = cpu::create_cpu_backend(cpu::CpuBackendOptions{.reference = true});
  if (!ref.is_ok()) std::abort();
  return std::move(ref).value();
}

// The oracle, without a device: where it decides, it must give the host's token, and it must
// decide at least 95% of the cases the device test uses.
TEST(SamplingOracle, AgreesWithHostWhereDecided) {
  auto ref = reference_backend();
  for (bool long_vocab : {false, true}) {
    int total = 0;
    int decided = 0;
    std::map<std::string, int> reasons;
    for (const Case& c : random_cases(long_vocab ? 99 : 42, long_vocab ? 12 : 250, long_vocab)) {
      const std::vector<TokenId> want = host_tokens(*ref, c);
      for (int64_t r = 0; r < c.rows; ++r) {
        const Decision m = model_decision(
            std::vector<float>(c.logits.begin() + r * c.vocab, c.logits.begin() + (r + 1) * c.vocab),
            c.draws[static_cast<size_t>(r)]);
        ++total;
        if (!m.decided) {
          ++reasons[m.why];
          if (long_vocab) {
            const TokenDraw& d = c.draws[static_cast<size_t>(r)];
            std::printf("  undecided: vocab %ld T %g top_k %d top_p %g coin %g: %s\n", static_cast<long>(c.vocab),
                        d.params.temperature, d.params.top_k, d.params.top_p, d.coin, m.why);
          }
          continue;
        }
        ++decided;
        ASSERT_EQ(m.token, want[static_cast<size_t>(r)]) << "vocab " << c.vocab << " row " << r;
      }
    }
    std::printf("oracle: %d of %d cases decided (%s vocabularies)", decided, total, long_vocab ? "long" : "short");
    for (const auto& [why, count] : reasons) std::printf("; %s: %d", why.c_str(), count);
    std::printf("\n");
    EXPECT_GE(decided, total * 95 / 100);
  }
}

// ---- on the device ----

class CudaSamplingTest : public device_test::BackendTest {
 protected:
  std::vector<TokenId> device_tokens(const Case& c) {
    Guarded<float> d_logits(c.logits);
    std::vector<TokenId> out(static_cast<size_t>(c.rows), -1);
    const Status s = gpu_->sample_rows(d_logits.data(), c.rows, c.vocab, c.draws.data(), out.data());
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_TRUE(d_logits.guards_intact()) << "sample_rows wrote outside the logits";
    return out;
  }

  void compare(const std::vector<Case>& cases, int& total, int& decided) {
    for (const Case& c : cases) {
      const std::vector<TokenId> want = host_tokens(*ref_, c);
      const std::vector<TokenId> got = device_tokens(c);
      for (int64_t r = 0; r < c.rows; ++r) {
        const TokenId g = got[static_cast<size_t>(r)];
        ASSERT_TRUE(g >= 0 && g < c.vocab) << "token " << g << " outside the vocabulary of " << c.vocab;
        const TokenDraw& d = c.draws[static_cast<size_t>(r)];
        const Decision m = model_decision(
            std::vector<float>(c.logits.begin() + r * c.vocab, c.logits.begin() + (r + 1) * c.vocab), d);
        ++total;
        if (d.params.temperature != 0.0f && !m.decided) continue;
        ++decided;
        ASSERT_EQ(g, want[static_cast<size_t>(r)])
            << "vocab " << c.vocab << " row " << r << " T " << d.params.temperature << " top_k " << d.params.top_k
            << " top_p " << d.params.top_p << " penalty " << d.params.repetition_penalty << " coin " << d.coin;
      }
    }
  }
};

TEST_F(CudaSamplingTest, GreedyIsExactIncludingTiesAndNaN) {
  std::mt19937 rng(5);
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{1000}, int64_t{131072}, int64_t{262144}}) {
    Case c;
    c.vocab = n;
    c.rows = 8;
    c.logits.resize(static_cast<size_t>(c.rows * n));
    for (int64_t r = 0; r < c.rows; ++r) {
      float* row = c.logits.data() + r * n;
      fill_row(rng, row, n, static_cast<int>(r % 4));
      if (r == 4) std::fill(row, row + n, 2.0f);                        // all tied: 0
      if (r == 5) row[0] = kNan;                                         // host: 0
      if (r == 6 && n > 2) row[n / 2] = kNan, row[n - 1] = 1e30f, row[n - 2] = 1e30f;  // NaN skipped, first max
      if (r == 7) std::fill(row, row + n, -kInf);                        // 0
      TokenDraw d;
      d.params.temperature = 0.0f;
      if (r % 2 == 1) {
        d.params.repetition_penalty = 1.3f;
        d.penalized = {0, static_cast<TokenId>(n - 1), -5, static_cast<TokenId>(n + 3)};
        if (n == 1) d.penalized = {0, -5};
      }
      c.draws.push_back(d);
    }
    EXPECT_EQ(device_tokens(c), host_tokens(*ref_, c)) << "vocab " << n;
  }
}

TEST_F(CudaSamplingTest, RandomRowsMatchHostWhereDecided) {
  int total = 0;
  int decided = 0;
  compare(random_cases(42, 250, false), total, decided);
  if (HasFatalFailure()) return;
  std::printf("%d of %d rows decided and equal\n", decided, total);
  EXPECT_GE(decided, total * 95 / 100);
}

TEST_F(CudaSamplingTest, LongVocabulariesMatchHostWhereDecided) {
  int total = 0;
  int decided = 0;
  compare(random_cases(99, 12, true), total, decided);
  if (HasFatalFailure()) return;
  std::printf("%d of %d rows decided and equal\n", decided, total);
  EXPECT_GE(decided, total * 95 / 100);
}

// 72 top-k / top-p rows of 262144 need more than one group of sort buffers (2^24 keys each).
TEST_F(CudaSamplingTest, ManySortedRowsSpanGroups) {
  std::mt19937 rng(11);
  Case c;
  c.vocab = 262144;
  c.rows = 72;
  c.logits.resize(static_cast<size_t>(c.rows * c.vocab));
  for (int64_t r = 0; r < c.rows; ++r) {
    fill_row(rng, c.logits.data() + r * c.vocab, c.vocab, 3);
    TokenDraw d;
    d.params.temperature = 0.9f;
    d.params.top_k = r % 3 == 2 ? 0 : 40;
    d.params.top_p = r % 3 == 0 ? 1.0f : 0.9f;
    d.coin = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    c.draws.push_back(d);
  }
  int total = 0;
  int decided = 0;
  compare({c}, total, decided);
  EXPECT_GE(decided, total * 95 / 100);
}

// 20 000 draws of one 5-token distribution: frequencies within 0.02 of the (truncated,
// renormalised) probabilities, for the full distribution, top-k, top-p and both.
TEST_F(CudaSamplingTest, FrequenciesFollowTheDistribution) {
  const std::vector<float> logits5 = {1.0f, 2.0f, 0.5f, 1.5f, -1.0f};
  const int64_t n = 5;
  const int64_t draws = 20000;
  struct Mode {
    int32_t top_k;
    float top_p;
  };
  for (Mode mode : {Mode{0, 1.0f}, Mode{3, 1.0f}, Mode{0, 0.8f}, Mode{3, 0.7f}}) {
    // Expected: softmax, keep the top_k largest, then the smallest prefix of mass > top_p.
    std::vector<double> p(n);
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += p[i] = std::exp(double(logits5[i]));
    for (double& v : p) v /= s;
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    int64_t keep = mode.top_k > 0 ? mode.top_k : n;
    double kept = 0.0;
    for (int64_t j = 0; j < keep; ++j) kept += p[order[j]];
    if (mode.top_p < 1.0f) {
      double cum = 0.0;
      for (int64_t j = 0; j < keep; ++j) {
        cum += p[order[j]] / kept;
        if (cum > mode.top_p) {
          keep = j + 1;
          break;
        }
      }
    }
    std::vector<double> want(n, 0.0);
    double mass = 0.0;
    for (int64_t j = 0; j < keep; ++j) mass += p[order[j]];
    for (int64_t j = 0; j < keep; ++j) want[order[j]] = p[order[j]] / mass;

    Case c;
    c.vocab = n;
    c.rows = draws;
    SamplingParams params;
    params.temperature = 1.0f;
    params.top_k = mode.top_k;
    params.top_p = mode.top_p;
    params.seed = 1234;
    Sampler sampler(params);
    for (int64_t r = 0; r < draws; ++r) {
      c.logits.insert(c.logits.end(), logits5.begin(), logits5.end());
      c.draws.push_back(sampler.next_draw(std::span<const TokenId>()));
    }
    const std::vector<TokenId> got = device_tokens(c);
    std::vector<double> freq(n, 0.0);
    for (TokenId t : got) {
      ASSERT_TRUE(t >= 0 && t < n);
      freq[t] += 1.0 / static_cast<double>(draws);
    }
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(freq[i], want[i], 0.02) << "token " << i << " top_k " << mode.top_k << " top_p " << mode.top_p;
    }
  }
}

TEST_F(CudaSamplingTest, ArgumentChecks) {
  Guarded<float> d_logits(std::vector<float>(8, 0.0f));
  std::vector<TokenDraw> d(2);
  TokenId tokens[2] = {-1, -1};
  EXPECT_TRUE(gpu_->sample_rows(d_logits.data(), 0, 4, d.data(), tokens).is_ok());
  EXPECT_TRUE(gpu_->sample_rows(nullptr, 0, 4, nullptr, nullptr).is_ok());
  EXPECT_EQ(gpu_->sample_rows(d_logits.data(), 2, 0, d.data(), tokens).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->sample_rows(nullptr, 2, 4, d.data(), tokens).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->sample_rows(d_logits.data(), 2, 4, nullptr, tokens).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->sample_rows(d_logits.data(), 2, 4, d.data(), nullptr).code(), StatusCode::kInvalidArgument);
  d[1].params.top_p = 0.0f;
  Status s = gpu_->sample_rows(d_logits.data(), 2, 4, d.data(), tokens);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("draws[1].params: top_p"), std::string::npos) << s.to_string();
  d[1].params.top_p = 1.0f;
  d[1].params.temperature = 1.0f;
  d[1].coin = 1.0f;
  s = gpu_->sample_rows(d_logits.data(), 2, 4, d.data(), tokens);
  EXPECT_NE(s.message().find("draws[1].coin"), std::string::npos) << s.to_string();
  d[1].coin = 0.5f;
  d[0].params.repetition_penalty = 1.2f;
  d[0].penalized = {2, 2};
  s = gpu_->sample_rows(d_logits.data(), 2, 4, d.data(), tokens);
  EXPECT_NE(s.message().find("draws[0].penalized"), std::string::npos) << s.to_string();
  d[0].penalized = {2, 3, -1, -1, 4};
  ASSERT_TRUE(gpu_->sample_rows(d_logits.data(), 2, 4, d.data(), tokens).is_ok());
  EXPECT_EQ(tokens[0], 0);  // greedy over penalised zeros: all tied
  EXPECT_TRUE(tokens[1] >= 0 && tokens[1] < 4);
  // vocab 1: every token 0 without touching the device memory.
  ASSERT_TRUE(gpu_->sample_rows(d_logits.data(), 2, 1, d.data(), tokens).is_ok());
  EXPECT_EQ(tokens[0], 0);
  EXPECT_EQ(tokens[1], 0);
  EXPECT_TRUE(d_logits.guards_intact());
}

// A top-p row where no token passes the cutoff gets the argmax (as on the host); calls
// with other shapes in between reuse the scratch.
TEST_F(CudaSamplingTest, NoCandidateAndScratchReuse) {
  Case c;
  c.vocab = 3;
  c.rows = 1;
  c.logits = {0.1f, 0.3f, 0.2f};
  TokenDraw d;
  d.params.temperature = 1.0f;
  d.params.top_p = 0.05f;
  d.coin = 0.3f;
  c.draws = {d};
  EXPECT_EQ(device_tokens(c), (std::vector<TokenId>{1}));
  int total = 0;
  int decided = 0;
  for (uint32_t seed : {1u, 2u, 3u}) compare(random_cases(seed, 24, false), total, decided);
  EXPECT_GE(decided, total * 95 / 100);
}

}  // namespace
}  // namespace specontext::gpu
