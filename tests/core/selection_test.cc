// Head-level top-k with the GQA max, sinks and window, ties and small lengths; Quest page
// ranking; elastic working-set invariants over long random selection sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <set>

#include "core/ports/backend.h"
#include "core/ports/selection.h"
#include "core/sparse/elastic.h"

namespace specontext {
namespace {

std::vector<int32_t> head_vec(const Selection& s, int64_t h) {
  auto sp = s.head(h);
  return {sp.begin(), sp.end()};
}

TEST(Selection, GqaMaxOverTheGroupThenTopK) {
  // 4 query heads, 2 KV heads (group 2), 10 tokens, budget 4 = 1 sink + 1 window + 2 chosen.
  const int64_t L = 10;
  std::vector<float> scores(4 * L, 0.01f);
  scores[0 * L + 3] = 0.5f;  // q head 0 (kv 0) likes token 3
  scores[1 * L + 6] = 0.4f;  // q head 1 (kv 0) likes token 6
  scores[1 * L + 3] = 0.1f;
  scores[2 * L + 5] = 0.3f;  // kv 1
  scores[3 * L + 2] = 0.2f;
  Selection sel;
  select_tokens(scores, 4, 2, L, {4, 1, 1}, sel);
  EXPECT_EQ(head_vec(sel, 0), (std::vector<int32_t>{0, 3, 6, 9}));
  EXPECT_EQ(head_vec(sel, 1), (std::vector<int32_t>{0, 2, 5, 9}));
  // A mean over the group would pick differently for kv 0 when one head is sharp: the max keeps
  // each query head's favourite.
}

TEST(Selection, GroupsTakingTurnsKeepEveryQueryHeadsBestRanks) {
  // One KV head, 2 query heads, 12 tokens, budget 6 = 1 sink + 1 window + 4 chosen. Head 0 is
  // sharp (large weights on 2, 3, 4, 5), head 1 flat (small weights, best 9 > 8 > 7 > 6).
  const int64_t L = 12;
  std::vector<float> scores(2 * L, 0.001f);
  for (int t : {2, 3, 4, 5}) scores[t] = 0.3f - 0.01f * static_cast<float>(t);
  for (int t : {6, 7, 8, 9}) scores[L + t] = 0.002f + 0.001f * static_cast<float>(t - 6);
  const SelectionOptions o{6, 1, 1};
  Selection max_sel, turns_sel;
  select_tokens(scores, 2, 1, L, o, max_sel);
  EXPECT_EQ(head_vec(max_sel, 0), (std::vector<int32_t>{0, 2, 3, 4, 5, 11})) << "the max keeps only the sharp head's";
  std::vector<float> g;
  reduce_group_scores(scores, 2, 1, L, o, GroupReduce::kTurns, g);
  select_from_group_scores(g, 1, L, o, turns_sel);
  EXPECT_EQ(head_vec(turns_sel, 0), (std::vector<int32_t>{0, 2, 3, 8, 9, 11})) << "two best of each head";
  // A rank counts within the middle only: the sink and the window score 0 and are kept anyway.
  EXPECT_EQ(g[0], 0.0f);
  EXPECT_EQ(g[L - 1], 0.0f);
  EXPECT_EQ(g[2], 0.0f);   // head 0's best
  EXPECT_EQ(g[9], 0.0f);   // head 1's best
  EXPECT_EQ(g[8], -1.0f);  // head 1's second
  // kMax through reduce_group_scores is select_tokens' group max.
  reduce_group_scores(scores, 2, 1, L, o, GroupReduce::kMax, g);
  EXPECT_EQ(g[2], scores[2]);
  EXPECT_EQ(g[9], scores[L + 9]);
}

TEST(Selection, TiesPreferOlderTokensAndAreDeterministic) {
  const int64_t L = 12;
  std::vector<float> scores(L, 1.0f / L);  // MQA, all equal
  Selection sel;
  select_tokens(scores, 1, 1, L, {5, 1, 2}, sel);
  EXPECT_EQ(head_vec(sel, 0), (std::vector<int32_t>{0, 1, 2, 10, 11}));
}

TEST(Selection, BudgetAtLeastLengthSelectsEverything) {
  std::vector<float> scores(2 * 7, 0.1f);
  Selection sel;
  for (int64_t budget : {7, 8, 100}) {
    select_tokens(scores, 2, 1, 7, {budget, 4, 16}, sel);
    EXPECT_EQ(head_vec(sel, 0), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
  }
}

TEST(Selection, SinksAndWindowShrinkToASmallBudget) {
  std::vector<float> scores(100, 0.01f);
  Selection sel;
  select_tokens(scores, 1, 1, 100, {3, 4, 16}, sel);  // budget smaller than sinks
  EXPECT_EQ(head_vec(sel, 0), (std::vector<int32_t>{0, 1, 2}));
  select_tokens(scores, 1, 1, 100, {6, 4, 16}, sel);
  EXPECT_EQ(head_vec(sel, 0), (std::vector<int32_t>{0, 1, 2, 3, 98, 99}));
  select_streaming(2, 100, {6, 2, 16}, sel);
  EXPECT_EQ(head_vec(sel, 1), (std::vector<int32_t>{0, 1, 96, 97, 98, 99}));
}

TEST(Selection, MhaEachHeadItsOwnChoice) {
  const int64_t L = 20;
  std::vector<float> scores(3 * L, 0.0f);
  for (int h = 0; h < 3; ++h) scores[h * L + 5 + h] = 1.0f;
  Selection sel;
  select_tokens(scores, 3, 3, L, {3, 1, 1}, sel);
  for (int h = 0; h < 3; ++h) EXPECT_EQ(head_vec(sel, h), (std::vector<int32_t>{0, 5 + h, 19}));
}

TEST(Selection, QuestRanksPagesByTheKeyBound) {
  // 1 KV head, head_dim 2, pages of 4 tokens, 16 tokens; page 2 has a large positive key bound.
  const int64_t hd = 2, ps = 4, L = 16;
  std::vector<float> mn(4 * hd, -0.1f), mx(4 * hd, 0.1f);
  mx[2 * hd + 0] = 5.0f;
  const float q[2] = {1.0f, 0.0f};
  Selection sel;
  select_quest(q, 1, 1, hd, mn.data(), mx.data(), ps, L, {6, 1, 1}, sel);
  EXPECT_EQ(head_vec(sel, 0), (std::vector<int32_t>{0, 8, 9, 10, 11, 15}));
}

TEST(Elastic, WorkingSetEqualsSelectionAndNothingLoadsTwice) {
  std::mt19937 rng(123);
  const int64_t heads = 3, budget = 24;
  ElasticWorkingSet ws(heads, budget);
  Selection sel;
  std::vector<GatherEntry> loads;
  int64_t length = 30;
  for (int step = 0; step < 300; ++step, ++length) {
    std::vector<float> scores(static_cast<size_t>(heads * 2 * length));
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (auto& s : scores) s = u(rng);
    // Occasionally change the budget so the working set also shrinks and grows.
    const int64_t b = step % 50 == 49 ? budget / 2 : budget;
    select_tokens(scores, heads * 2, heads, length, {b, 2, 3}, sel);
    // Before: slot contents; apply the loads to a shadow copy like a gather would.
    std::vector<std::vector<int32_t>> shadow(heads, std::vector<int32_t>(budget, -1));
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t s = 0; s < budget; ++s) shadow[h][s] = ws.token_at(h, s);
    loads.clear();
    const ElasticStats st = ws.update(sel, loads);
    std::set<std::pair<int32_t, int32_t>> loaded;
    for (const auto& e : loads) {
      ASSERT_TRUE(loaded.insert({e.kv_head, e.token}).second) << "token loaded twice";
      ASSERT_LT(e.slot, budget);
      shadow[e.kv_head][e.slot] = e.token;
    }
    int64_t selected = 0;
    for (int64_t h = 0; h < heads; ++h) {
      const auto want = head_vec(sel, h);
      selected += static_cast<int64_t>(want.size());
      ASSERT_EQ(ws.counts()[h], static_cast<int32_t>(want.size()));
      std::vector<int32_t> have(shadow[h].begin(), shadow[h].begin() + ws.counts()[h]);
      std::sort(have.begin(), have.end());
      ASSERT_EQ(have, want) << "step " << step << " head " << h;
    }
    EXPECT_EQ(st.tokens_selected, selected);
    // Loads beyond |S_now − S_last| only come from compaction when the selection shrinks.
    EXPECT_GE(st.tokens_loaded + st.tokens_kept, st.tokens_selected);
    EXPECT_EQ(static_cast<int64_t>(loads.size()), st.tokens_loaded);
  }
}

TEST(Elastic, StableSelectionLoadsOnlyTheNewToken) {
  // Streaming selection slides by one token per step: sinks stay, one new token enters.
  ElasticWorkingSet ws(1, 8);
  Selection sel;
  std::vector<GatherEntry> loads;
  select_streaming(1, 20, {8, 2, 6}, sel);
  ElasticStats st = ws.update(sel, loads);
  EXPECT_EQ(st.tokens_loaded, 8);
  for (int64_t len = 21; len < 40; ++len) {
    loads.clear();
    select_streaming(1, len, {8, 2, 6}, sel);
    st = ws.update(sel, loads);
    ASSERT_EQ(st.tokens_loaded, 1);
    EXPECT_EQ(loads[0].token, len - 1);
    EXPECT_DOUBLE_EQ(st.overlap(), 7.0 / 8.0);
  }
}

}  // namespace
}  // namespace specontext

namespace specontext {
namespace {

// The Backend's default retrieval ops (host loops) against the composition they replace:
// retrieval_scores-style per-head softmax, then select_tokens' group max and top-k.
class HostOnlyBackend final : public Backend {
 public:
  std::string_view name() const override { return "host-only"; }
  bool supports(BackendOp, DType) const override { return false; }
  Status embed(const TokenId*, int64_t, const WeightMatrix&, float*) override { return Status::ok(); }
  Status matmul(const float*, int64_t, const WeightMatrix&, const float*, float*) override { return Status::ok(); }
  Status rmsnorm(const float*, const float*, int64_t, int64_t, float, float*) override { return Status::ok(); }
  Status rope(float*, int64_t, int64_t, const int64_t*, const RopeParams&) override { return Status::ok(); }
  Status swiglu(const float*, const float*, int64_t, float*) override { return Status::ok(); }
  Status add(float*, const float*, int64_t) override { return Status::ok(); }
  Status kv_append(const float*, const float*, int64_t, int64_t, const KvLayerView&) override { return Status::ok(); }
  Status attention(const float*, const AttentionItem*, int64_t, int64_t, float*) override { return Status::ok(); }
};

TEST(Selection, BackendDefaultRetrievalOpsEqualScoresThenSelect) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const auto [nh, nkv, hd, L] : {std::array<int64_t, 4>{8, 2, 16, 300}, {4, 4, 8, 70}, {6, 1, 12, 129}}) {
    std::vector<float> q(static_cast<size_t>(nh * hd)), k(static_cast<size_t>(L * nkv * hd));
    for (auto& x : q) x = nd(rng);
    for (auto& x : k) x = nd(rng);
    // Per query head softmax in double, the reference of both.
    std::vector<float> scores(static_cast<size_t>(nh * L));
    const int64_t group = nh / nkv;
    for (int64_t h = 0; h < nh; ++h) {
      std::vector<double> row(static_cast<size_t>(L));
      double mx = -1e300, sum = 0;
      for (int64_t t = 0; t < L; ++t) {
        double d = 0;
        for (int64_t i = 0; i < hd; ++i) d += double(q[h * hd + i]) * k[(t * nkv + h / group) * hd + i];
        row[t] = d / std::sqrt(double(hd));
        mx = std::max(mx, row[t]);
      }
      for (auto& r : row) sum += (r = std::exp(r - mx));
      for (int64_t t = 0; t < L; ++t) scores[h * L + t] = static_cast<float>(row[t] / sum);
    }
    HostOnlyBackend be;
    std::vector<float> group_scores(static_cast<size_t>(nkv * L), -1.0f);
    // Paged keys: blocks of 32 tokens, stored out of order.
    const int64_t bt = 32, n_blocks = (L + bt - 1) / bt;
    std::vector<std::vector<float>> blocks(static_cast<size_t>(n_blocks), std::vector<float>(static_cast<size_t>(bt * nkv * hd)));
    std::vector<const void*> table(static_cast<size_t>(n_blocks));
    for (int64_t b = 0; b < n_blocks; ++b) {
      auto& blk = blocks[static_cast<size_t>(n_blocks - 1 - b)];
      for (int64_t t = b * bt; t < std::min(L, (b + 1) * bt); ++t) {
        std::copy_n(k.data() + t * nkv * hd, nkv * hd, blk.data() + (t - b * bt) * nkv * hd);
      }
      table[static_cast<size_t>(b)] = blk.data();
    }
    ASSERT_TRUE(be.retrieval_group_scores(q.data(), table.data(), DType::kF32, bt, L, nh, nkv, hd, group_scores.data()).is_ok());
    double max_err = 0;
    for (int64_t g = 0; g < nkv; ++g) {
      for (int64_t t = 0; t < L; ++t) {
        float want = 0;
        for (int64_t j = 0; j < group; ++j) want = std::max(want, scores[(g * group + j) * L + t]);
        max_err = std::max(max_err, double(std::abs(want - group_scores[g * L + t])) / std::max(1e-6f, want));
      }
    }
    EXPECT_LT(max_err, 1e-4);
    const SelectionOptions opts{32, 2, 4};
    Selection want, got;
    select_tokens(scores, nh, nkv, L, opts, want);
    ASSERT_TRUE(be.select_top_tokens(group_scores.data(), nkv, L, opts, got).is_ok());
    // Float rounding can reorder near-ties; compare the selected mass instead of the exact sets.
    for (int64_t h = 0; h < nkv; ++h) {
      ASSERT_EQ(got.counts[h], want.counts[h]);
      double mass_got = 0, mass_want = 0;
      for (int32_t t : got.head(h)) mass_got += group_scores[h * L + t];
      for (int32_t t : want.head(h)) mass_want += group_scores[h * L + t];
      EXPECT_NEAR(mass_got, mass_want, 1e-4 * std::max(1.0, mass_want));
    }
  }
  EXPECT_FALSE(HostOnlyBackend().retrieval_group_scores(nullptr, nullptr, DType::kF32, 16, 4, 3, 2, 8, nullptr).is_ok());
}

}  // namespace
}  // namespace specontext
