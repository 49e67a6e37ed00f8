// select_among_candidates against select_tokens on the full scores (exact) and against a naive
// double-precision softmax over the candidates; the shared Quest bound against a double loop;
// ReferenceCandidateFilter on hand-computed pages, ties and trimming; argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/ports/selection.h"
#include "core/sparse/candidate_select.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/reference_backend.h"

namespace specontext {
namespace {

std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<int32_t> head_vec(const Selection& s, int64_t h) {
  auto sp = s.head(h);
  return {sp.begin(), sp.end()};
}

std::vector<int32_t> cand_vec(const Candidates& c, int64_t h) {
  return {c.tokens.begin() + c.offsets[static_cast<size_t>(h)],
          c.tokens.begin() + c.offsets[static_cast<size_t>(h + 1)]};
}

// Per KV head, the forced tokens (sinks and window of fx) and a random third of the others.
Candidates random_candidates(int64_t kv_heads, int64_t length, const FixedTokens& fx, uint32_t seed) {
  std::mt19937 rng(seed);
  Candidates cand;
  cand.kv_heads = kv_heads;
  cand.length = length;
  cand.offsets = {0};
  for (int64_t g = 0; g < kv_heads; ++g) {
    for (int64_t t = 0; t < length; ++t) {
      const bool forced = t < fx.sinks || t >= length - fx.window;
      if (forced || rng() % 3 == 0) cand.tokens.push_back(static_cast<int32_t>(t));
    }
    cand.offsets.push_back(static_cast<int64_t>(cand.tokens.size()));
  }
  return cand;
}

// q_h · k_t of KV head g, in double (q [n_heads][head_dim], k token-major [length][kvd]).
double qk(const std::vector<float>& q, const std::vector<float>& k, int64_t h, int64_t t, int64_t g,
          int64_t head_dim, int64_t kvd) {
  double d = 0;
  for (int64_t j = 0; j < head_dim; ++j) {
    d += double(q[static_cast<size_t>(h * head_dim + j)]) * k[static_cast<size_t>(t * kvd + g * head_dim + j)];
  }
  return d;
}

void expect_invalid(const Status& st, const std::string& needle) {
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos)
      << "message: " << st.message() << "\nwanted: " << needle;
}

TEST(QuestPageBound, MatchesADoubleLoop) {
  for (int64_t hd : {1, 7, 16, 31, 64, 128, 129}) {
    for (uint32_t seed = 1; seed <= 5; ++seed) {
      const auto q = randn(static_cast<size_t>(hd), seed);
      auto a = randn(static_cast<size_t>(hd), seed + 100), b = randn(static_cast<size_t>(hd), seed + 200);
      std::vector<float> mn(a.size()), mx(a.size());
      for (size_t i = 0; i < a.size(); ++i) {
        mn[i] = std::min(a[i], b[i]);
        mx[i] = std::max(a[i], b[i]);
      }
      double want = 0, mag = 0;
      for (int64_t i = 0; i < hd; ++i) {
        const double t = std::max(double(q[i]) * mn[i], double(q[i]) * mx[i]);
        want += t;
        mag += std::abs(t);
      }
      const float got = quest_page_bound(q.data(), mn.data(), mx.data(), hd);
      ASSERT_TRUE(std::isfinite(got));
      ASSERT_GT(mag, 0.0);
      EXPECT_NEAR(got, want, 1e-6 * mag + 1e-7) << "head_dim " << hd;
      // It is an upper bound of q·k for every k inside the box.
      double dot_mn = 0, dot_mx = 0;
      for (int64_t i = 0; i < hd; ++i) {
        dot_mn += double(q[i]) * mn[i];
        dot_mx += double(q[i]) * mx[i];
      }
      EXPECT_GE(got + 1e-5 * mag, std::max(dot_mn, dot_mx));
    }
  }
}

struct Shape {
  int64_t n_heads, n_kv_heads, head_dim;
};

// Every token a candidate: the selection of select_tokens on the full per-head softmax
// (retrieval_scores) and of Backend::retrieval_group_scores + select_from_group_scores, exactly;
// with GroupReduce::kTurns (query heads take turns), exactly reduce_group_scores(kTurns) +
// select_from_group_scores on the same scores, and not the group max's selection everywhere.
TEST(SelectAmongCandidates, AllTokensEqualSelectTokensExactly) {
  cpu::ReferenceBackend backend;
  const std::vector<Shape> shapes = {{4, 4, 8}, {8, 2, 13}, {4, 1, 64}, {6, 3, 16}};
  const std::vector<SelectionOptions> opts = {{1, 1, 4},  {4, 1, 4},  {16, 0, 0},  {16, 4, 16},
                                              {64, 3, 0}, {33, 0, 1}, {512, 1, 4}, {2, 5, 5}};
  int compared = 0, turns_differ = 0;
  uint32_t seed = 1;
  for (const Shape& sh : shapes) {
    RetrievalHead head;
    head.config.n_heads = sh.n_heads;
    head.config.n_kv_heads = sh.n_kv_heads;
    head.config.head_dim = sh.head_dim;
    for (int64_t length : {1, 5, 64, 300}) {
      const auto q = randn(static_cast<size_t>(sh.n_heads * sh.head_dim), ++seed, 2.0f);
      const auto k = randn(static_cast<size_t>(length * sh.n_kv_heads * sh.head_dim), ++seed);
      std::vector<float> scores(static_cast<size_t>(sh.n_heads * length));
      retrieval_scores(head, q.data(), k.data(), length, scores.data());
      std::vector<float> group(static_cast<size_t>(sh.n_kv_heads * length));
      const void* table[1] = {k.data()};
      ASSERT_TRUE(backend
                      .retrieval_group_scores(q.data(), table, DType::kF32, std::max<int64_t>(length, 1), length,
                                              sh.n_heads,
                                              sh.n_kv_heads, sh.head_dim, group.data())
                      .is_ok());
      Candidates cand;
      all_candidates(sh.n_kv_heads, length, cand);
      for (const SelectionOptions& o : opts) {
        Selection want, want_group, got;
        select_tokens(scores, sh.n_heads, sh.n_kv_heads, length, o, want);
        select_from_group_scores(group, sh.n_kv_heads, length, o, want_group);
        ASSERT_TRUE(
            select_among_candidates(q.data(), k.data(), sh.n_heads, sh.n_kv_heads, sh.head_dim, cand, o, got)
                .is_ok());
        ASSERT_EQ(got.kv_heads, want.kv_heads);
        ASSERT_EQ(got.budget, want.budget);
        for (int64_t h = 0; h < sh.n_kv_heads; ++h) {
          EXPECT_EQ(head_vec(got, h), head_vec(want, h)) << "length " << length << " budget " << o.budget;
          EXPECT_EQ(head_vec(got, h), head_vec(want_group, h));
        }
        std::vector<float> turns;
        reduce_group_scores(scores, sh.n_heads, sh.n_kv_heads, length, o, GroupReduce::kTurns, turns);
        Selection want_turns, got_turns;
        select_from_group_scores(turns, sh.n_kv_heads, length, o, want_turns);
        ASSERT_TRUE(select_among_candidates(q.data(), k.data(), sh.n_heads, sh.n_kv_heads, sh.head_dim, cand, o,
                                            got_turns, GroupReduce::kTurns)
                        .is_ok());
        for (int64_t h = 0; h < sh.n_kv_heads; ++h) {
          EXPECT_EQ(head_vec(got_turns, h), head_vec(want_turns, h)) << "turns, length " << length;
          turns_differ += head_vec(got_turns, h) != head_vec(got, h) ? 1 : 0;
        }
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 4 * 4 * 8);
  EXPECT_GT(turns_differ, 5);
}

// Keys stored in f16 / bf16 (the KV dtype) and paged: with every token a candidate, the selection
// is exactly that of Backend::retrieval_group_scores over the same stored keys (the host default,
// widening on load) + select_from_group_scores, and that of the f32 path over the keys widened
// beforehand; a random half of the tokens as candidates also gives the f32 path's selection.
TEST(SelectAmongCandidates, F16AndBf16PagedKeysSelectAsTheWidenedF32Keys) {
  cpu::ReferenceBackend backend;
  const Shape sh{8, 2, 24};
  const int64_t length = 300, bt = 32, kd = sh.n_kv_heads * sh.head_dim, n_blocks = (length + bt - 1) / bt;
  int compared = 0;
  for (const DType dt : {DType::kF16, DType::kBF16}) {
    const auto q = randn(static_cast<size_t>(sh.n_heads * sh.head_dim), 71, 2.0f);
    const auto k = randn(static_cast<size_t>(n_blocks * bt * kd), 72);
    std::vector<uint16_t> stored(k.size());
    convert_from_f32(dt, k.data(), stored.data(), k.size());
    std::vector<float> widened(k.size());
    convert_to_f32(dt, stored.data(), widened.data(), k.size());
    size_t changed = 0;
    for (size_t i = 0; i < k.size(); ++i) changed += widened[i] != k[i];
    EXPECT_GT(changed, k.size() / 2) << "the keys were rounded";
    std::vector<const void*> t_stored, t_widened;
    for (int64_t b = 0; b < n_blocks; ++b) {
      t_stored.push_back(stored.data() + b * bt * kd);
      t_widened.push_back(widened.data() + b * bt * kd);
    }
    std::vector<float> group(static_cast<size_t>(sh.n_kv_heads * length));
    ASSERT_TRUE(backend
                    .retrieval_group_scores(q.data(), t_stored.data(), dt, bt, length, sh.n_heads, sh.n_kv_heads,
                                            sh.head_dim, group.data())
                    .is_ok());
    for (float v : group) ASSERT_TRUE(std::isfinite(v));
    Candidates all, half;
    all_candidates(sh.n_kv_heads, length, all);
    half.kv_heads = sh.n_kv_heads;
    half.length = length;
    half.offsets.push_back(0);
    std::mt19937 rng(5);
    for (int64_t g = 0; g < sh.n_kv_heads; ++g) {
      for (int64_t t = 0; t < length; ++t) {
        if (t < 1 || t >= length - 4 || rng() % 2 == 0) half.tokens.push_back(static_cast<int32_t>(t));
      }
      half.offsets.push_back(static_cast<int64_t>(half.tokens.size()));
    }
    for (const SelectionOptions& o : {SelectionOptions{16, 1, 4}, SelectionOptions{64, 1, 4}}) {
      Selection want_group, got, got_f32, got_half, got_half_f32;
      select_from_group_scores(group, sh.n_kv_heads, length, o, want_group);
      const auto select = [&](const std::vector<const void*>& table, DType kdt, const Candidates& cands,
                              Selection& out) {
        ASSERT_TRUE(select_among_candidates(q.data(), table.data(), kdt, bt, sh.n_heads, sh.n_kv_heads, sh.head_dim,
                                            cands, o, out)
                        .is_ok());
      };
      select(t_stored, dt, all, got);
      select(t_widened, DType::kF32, all, got_f32);
      select(t_stored, dt, half, got_half);
      select(t_widened, DType::kF32, half, got_half_f32);
      for (int64_t h = 0; h < sh.n_kv_heads; ++h) {
        EXPECT_EQ(head_vec(got, h), head_vec(want_group, h)) << dtype_name(dt) << " budget " << o.budget;
        EXPECT_EQ(head_vec(got, h), head_vec(got_f32, h));
        EXPECT_EQ(head_vec(got_half, h), head_vec(got_half_f32, h));
        EXPECT_EQ(static_cast<int64_t>(got.counts[static_cast<size_t>(h)]), o.budget);
      }
      ++compared;
    }
  }
  EXPECT_EQ(compared, 4);
  // Not a KV dtype: refused.
  const float x = 0.0f;
  const void* one[1] = {&x};
  Candidates c;
  all_candidates(1, 1, c);
  Selection out;
  expect_invalid(select_among_candidates(&x, one, DType::kQ8_0, 1, 1, 1, 1, c, {1, 0, 0}, out), "dtype");
}

// A subset of candidates: softmax over the candidates only (double precision here), group max,
// sinks and window forced, the rest by score with ties to the older token. With GroupReduce::kTurns
// each query head ranks the middle candidates by its softmax there instead, every head's best ranks
// fill the free slots, the older candidate first at the last rank reached.
TEST(SelectAmongCandidates, SubsetMatchesNaiveSoftmaxOverCandidates) {
  const std::vector<Shape> shapes = {{4, 4, 8}, {8, 2, 16}, {4, 1, 32}, {6, 3, 8}};
  uint32_t seed = 77;
  int nontrivial = 0, nontrivial_turns = 0;
  for (const Shape& sh : shapes) {
    const int64_t length = 200, kvd = sh.n_kv_heads * sh.head_dim, group = sh.n_heads / sh.n_kv_heads;
    const auto q = randn(static_cast<size_t>(sh.n_heads * sh.head_dim), ++seed, 2.0f);
    const auto k = randn(static_cast<size_t>(length * kvd), ++seed);
    for (const SelectionOptions& o : std::vector<SelectionOptions>{{8, 1, 4}, {20, 0, 2}, {12, 3, 0}, {40, 1, 4}}) {
      const FixedTokens fx = fixed_tokens(o);
      const Candidates cand = random_candidates(sh.n_kv_heads, length, fx, ++seed);
      Selection got, got_turns;
      ASSERT_TRUE(
          select_among_candidates(q.data(), k.data(), sh.n_heads, sh.n_kv_heads, sh.head_dim, cand, o, got)
              .is_ok());
      ASSERT_TRUE(select_among_candidates(q.data(), k.data(), sh.n_heads, sh.n_kv_heads, sh.head_dim, cand, o,
                                          got_turns, GroupReduce::kTurns)
                      .is_ok());
      for (int64_t g = 0; g < sh.n_kv_heads; ++g) {
        const auto c = cand_vec(cand, g);
        std::vector<int32_t> want, middle;
        for (size_t i = 0; i < c.size(); ++i) {
          if (c[i] < fx.sinks || c[i] >= length - fx.window) {
            want.push_back(c[i]);
          } else {
            middle.push_back(static_cast<int32_t>(i));
          }
        }
        const size_t free = std::min(static_cast<size_t>(std::max<int64_t>(o.budget - static_cast<int64_t>(want.size()), 0)),
                                     middle.size());
        std::vector<double> score(c.size(), 0.0);
        std::vector<size_t> best(c.size(), c.size());  // turns: best rank over the group's heads
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          std::vector<double> logit(c.size());
          double mx = -INFINITY, sum = 0;
          for (size_t i = 0; i < c.size(); ++i) {
            logit[i] = qk(q, k, h, c[i], g, sh.head_dim, kvd) / std::sqrt(double(sh.head_dim));
            mx = std::max(mx, logit[i]);
          }
          for (double& l : logit) sum += (l = std::exp(l - mx));
          for (size_t i = 0; i < c.size(); ++i) score[i] = std::max(score[i], logit[i] / sum);
          std::vector<int32_t> order = middle;
          std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return logit[x] > logit[y]; });
          for (size_t r = 0; r < free; ++r) best[static_cast<size_t>(order[r])] = std::min(best[static_cast<size_t>(order[r])], r);
        }
        std::vector<int32_t> want_turns = want, rest = middle, by_rank = middle;
        std::stable_sort(rest.begin(), rest.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });
        std::stable_sort(by_rank.begin(), by_rank.end(), [&](int32_t a, int32_t b) { return best[a] < best[b]; });
        for (size_t i = 0; i < free; ++i) {
          want.push_back(c[static_cast<size_t>(rest[i])]);
          want_turns.push_back(c[static_cast<size_t>(by_rank[i])]);
        }
        std::sort(want.begin(), want.end());
        std::sort(want_turns.begin(), want_turns.end());
        if (static_cast<int64_t>(c.size()) <= o.budget) want = want_turns = c;
        EXPECT_EQ(head_vec(got, g), want) << "KV head " << g << " budget " << o.budget;
        EXPECT_EQ(head_vec(got_turns, g), want_turns) << "turns, KV head " << g << " budget " << o.budget;
        nontrivial += static_cast<int64_t>(c.size()) > o.budget ? 1 : 0;
        nontrivial_turns += want_turns != want ? 1 : 0;
      }
    }
  }
  EXPECT_GT(nontrivial, 10);
  EXPECT_GT(nontrivial_turns, 5);
}

// The normaliser covers the candidates only: with full-sequence softmaxes query head B would win
// (head A's mass sits on a token that is not a candidate); over the candidates head A wins.
TEST(SelectAmongCandidates, NormaliserCoversTheCandidatesOnly) {
  // One-hot keys: token t has logit q_h[t] (q scaled by √d to undo the 1/√d).
  const int64_t length = 24, d = 24, n_heads = 2;
  std::vector<float> k(static_cast<size_t>(length * d), 0.0f);
  for (int64_t t = 0; t < length; ++t) k[static_cast<size_t>(t * d + t)] = 1.0f;
  const float s = std::sqrt(static_cast<float>(d));
  std::vector<float> q(static_cast<size_t>(n_heads * d), 0.0f);
  const int32_t u = 5, v = 9, z = 15;
  q[u] = 3.0f * s;                    // head A likes u ...
  q[z] = 10.0f * s;                   // ... but most of its mass is on z, no candidate
  q[d + v] = 2.0f * s;                // head B likes v
  const SelectionOptions o{3, 1, 1};  // sink 0 + window 23 + one pick
  Candidates cand;
  cand.kv_heads = 1;
  cand.length = length;
  cand.tokens = {0, u, v, 23};
  cand.offsets = {0, 4};
  Selection got;
  ASSERT_TRUE(select_among_candidates(q.data(), k.data(), n_heads, 1, d, cand, o, got).is_ok());
  EXPECT_EQ(head_vec(got, 0), (std::vector<int32_t>{0, u, 23}));
  // The full-sequence normalisers pick v instead: the two rules do differ here.
  RetrievalHead head;
  head.config.n_heads = n_heads;
  head.config.n_kv_heads = 1;
  head.config.head_dim = d;
  std::vector<float> scores(static_cast<size_t>(n_heads * length));
  retrieval_scores(head, q.data(), k.data(), length, scores.data());
  EXPECT_LT(std::max(scores[u], scores[length + u]), std::max(scores[v], scores[length + v]));
}

TEST(SelectAmongCandidates, ArgumentErrorsNameTheField) {
  const int64_t length = 10, hd = 4;
  const auto q = randn(2 * hd, 1), k = randn(static_cast<size_t>(length * hd), 2);
  Candidates c;
  all_candidates(1, length, c);
  Selection out;
  const SelectionOptions o{4, 1, 1};
  expect_invalid(select_among_candidates(q.data(), k.data(), 3, 2, hd, c, o, out), "multiple of n_kv_heads");
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 0, hd, c, o, out), "n_kv_heads");
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 1, 0, c, o, out), "head_dim");
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 2, hd, c, o, out), "cand.kv_heads");
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 1, hd, c, {0, 1, 1}, out), "budget");
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 1, hd, c, {4, -1, 1}, out), "sinks");
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 1, hd, c, {4, 1, -2}, out), "window");
  expect_invalid(select_among_candidates(nullptr, k.data(), 2, 1, hd, c, o, out), "null");
  Candidates bad = c;
  bad.offsets = {0};
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 1, hd, bad, o, out), "cand.offsets");
  bad = c;
  bad.tokens[3] = 2;
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 1, hd, bad, o, out), "strictly ascending");
  bad = c;
  bad.tokens.back() = static_cast<int32_t>(length);
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 1, hd, bad, o, out),
                 "outside [0, cand.length");
  bad = c;  // drop the sink: more candidates than the budget, so it would be needed
  bad.tokens.erase(bad.tokens.begin());
  bad.offsets = {0, length - 1};
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 1, hd, bad, o, out), "sink");
  bad = c;  // drop the window
  bad.tokens.pop_back();
  bad.offsets = {0, length - 1};
  expect_invalid(select_among_candidates(q.data(), k.data(), 2, 1, hd, bad, o, out), "window");
  auto kn = k;
  kn[5 * hd + 1] = NAN;
  expect_invalid(select_among_candidates(q.data(), kn.data(), 2, 1, hd, c, o, out), "not finite");
}

// ---- ReferenceCandidateFilter ----

std::unique_ptr<ReferenceCandidateFilter> make_ref(int64_t page, int64_t nh, int64_t nkv, int64_t hd) {
  auto f = ReferenceCandidateFilter::create({page, nh, nkv, hd});
  EXPECT_TRUE(f.is_ok()) << f.status().to_string();
  return f.is_ok() ? std::move(*f) : nullptr;
}

TEST(ReferenceCandidateFilter, HandComputedPagesTiesAndTrim) {
  // MQA, head_dim 1, q = +1: a page's bound is its largest key. Pages of 4, length 20.
  auto f = make_ref(4, 1, 1, 1);
  ASSERT_NE(f, nullptr);
  std::vector<float> keys(20, 0.0f);
  keys[5] = 3.0f;   // page 1: bound 3
  keys[9] = 5.0f;   // page 2: bound 5
  keys[14] = 5.0f;  // page 3: bound 5 (tie with page 2: page 2 first)
  keys[1] = 9.0f;   // page 0 holds the sink anyway
  const SeqId s(7);
  ASSERT_TRUE(f->append_keys(s, keys.data(), 0, 20).is_ok());
  const float qp = 1.0f, qm = -1.0f;
  Candidates c;
  // sinks 1, window 2: pages 0 and 4 forced (8 tokens); 6 more = page 2 and the first half of page 3.
  ASSERT_TRUE(f->shortlist(s, &qp, 20, 14, {8, 1, 2}, c).is_ok());
  ASSERT_EQ(c.kv_heads, 1);
  EXPECT_EQ(c.length, 20);
  EXPECT_EQ(cand_vec(c, 0), (std::vector<int32_t>{0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 16, 17, 18, 19}));
  // q = −1: the bound is −min = 0 for every page (all hold a 0): ties, so the oldest pages.
  ASSERT_TRUE(f->shortlist(s, &qm, 20, 12, {8, 1, 2}, c).is_ok());
  EXPECT_EQ(cand_vec(c, 0), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19}));
  // Window straddling two pages and a partial last page: length 18, window 3 = 15..17.
  ASSERT_TRUE(f->shortlist(s, &qp, 18, 10, {8, 1, 3}, c).is_ok());
  EXPECT_EQ(cand_vec(c, 0), (std::vector<int32_t>{0, 1, 2, 3, 12, 13, 14, 15, 16, 17}));
  // Forced pages beyond the shortlist size: kept whole (more than shortlist_tokens).
  ASSERT_TRUE(f->shortlist(s, &qp, 20, 2, {8, 1, 2}, c).is_ok());
  EXPECT_EQ(cand_vec(c, 0), (std::vector<int32_t>{0, 1, 2, 3, 16, 17, 18, 19}));
  // Sinks and window shrink to a small budget as in select_from_group_scores: budget 1 keeps the
  // sink only, so only page 0 is forced.
  ASSERT_TRUE(f->shortlist(s, &qp, 20, 8, {1, 1, 2}, c).is_ok());
  EXPECT_EQ(cand_vec(c, 0), (std::vector<int32_t>{0, 1, 2, 3, 8, 9, 10, 11}));
  // length <= shortlist_tokens: everything; length 0: nothing.
  ASSERT_TRUE(f->shortlist(s, &qp, 20, 20, {8, 1, 2}, c).is_ok());
  EXPECT_EQ(c.count(0), 20);
  ASSERT_TRUE(f->shortlist(s, &qp, 0, 5, {8, 1, 2}, c).is_ok());
  EXPECT_EQ(c.count(0), 0);
  EXPECT_EQ(c.length, 0);
}

TEST(ReferenceCandidateFilter, GroupMaxOverQueryHeads) {
  // Two query heads on one KV head, head_dim 2: head 0 looks along +x, head 1 along +y.
  auto f = make_ref(2, 2, 1, 2);
  ASSERT_NE(f, nullptr);
  const std::vector<float> keys = {0, 0, 0, 0,   // page 0 (sink)
                                   1, 0, 0, 0,   // page 1: x = 1
                                   0, 0, 0, 4,   // page 2: y = 4
                                   2, 0, 0, 0,   // page 3: x = 2
                                   0, 0, 0, 0};  // page 4 (window)
  ASSERT_TRUE(f->append_keys(SeqId(1), keys.data(), 0, 10).is_ok());
  const std::vector<float> q = {1, 0, 0, 1};
  Candidates c;
  ASSERT_TRUE(f->shortlist(SeqId(1), q.data(), 10, 6, {4, 1, 1}, c).is_ok());
  EXPECT_EQ(cand_vec(c, 0), (std::vector<int32_t>{0, 1, 4, 5, 8, 9}));  // page 2 (bound 4) beats page 3 (2)
}

TEST(ReferenceCandidateFilter, ErrorsAndDrop) {
  expect_invalid(ReferenceCandidateFilter::create({0, 2, 1, 4}).status(), "page_size");
  expect_invalid(ReferenceCandidateFilter::create({16, 3, 2, 4}).status(), "n_heads");
  expect_invalid(ReferenceCandidateFilter::create({16, 2, 0, 4}).status(), "n_kv_heads");
  expect_invalid(ReferenceCandidateFilter::create({16, 2, 1, 0}).status(), "head_dim");
  auto f = make_ref(4, 2, 1, 2);
  ASSERT_NE(f, nullptr);
  const auto keys = randn(20, 3);
  const SeqId s(3);
  expect_invalid(f->append_keys(s, keys.data(), 1, 2), "start 1 is out of order");
  ASSERT_TRUE(f->append_keys(s, keys.data(), 0, 6).is_ok());
  expect_invalid(f->append_keys(s, keys.data(), 5, 1), "start 5 is out of order");
  expect_invalid(f->append_keys(s, nullptr, 6, 1), "keys is null");
  auto nan_keys = keys;
  nan_keys[3] = INFINITY;
  expect_invalid(f->append_keys(s, nan_keys.data(), 6, 2), "position 7, KV head 0 is not finite");
  EXPECT_EQ(f->length(s), 6);
  const std::vector<float> q = {1, 2, 3, 4};
  Candidates c;
  expect_invalid(f->shortlist(SeqId(99), q.data(), 4, 2, {}, c), "unknown sequence 99");
  expect_invalid(f->shortlist(s, q.data(), 7, 2, {}, c), "length 7 exceeds the 6 tokens");
  expect_invalid(f->shortlist(s, q.data(), 6, 0, {}, c), "shortlist_tokens");
  expect_invalid(f->shortlist(s, q.data(), 6, 2, {0, 1, 1}, c), "SelectionOptions.budget");
  expect_invalid(f->shortlist(s, nullptr, 6, 2, {}, c), "q is null");
  const std::vector<float> qn = {1, 2, NAN, 4};
  expect_invalid(f->shortlist(s, qn.data(), 6, 2, {}, c), "query head 1");
  f->drop(s);
  f->drop(s);  // no-op
  EXPECT_EQ(f->length(s), 0);
  expect_invalid(f->shortlist(s, q.data(), 1, 2, {}, c), "unknown sequence 3");
  ASSERT_TRUE(f->append_keys(s, keys.data(), 0, 3).is_ok());  // the id is reusable from 0
  EXPECT_EQ(f->length(s), 3);
}

}  // namespace
}  // namespace specontext
