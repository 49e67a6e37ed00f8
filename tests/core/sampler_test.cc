// Sampling: greedy, temperature, top-k, top-p, repetition penalty, seeds, parameter checks.
// (The seeded top-p stream is also checked end to end against llama2.c in engine_golden_test.)
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <set>

#include "core/ports/sampler.h"

namespace specontext {
namespace {

std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

std::map<TokenId, int> histogram(const SamplingParams& p, const std::vector<double>& probs, int n) {
  Sampler s(p);
  std::map<TokenId, int> h;
  for (int i = 0; i < n; ++i) {
    auto l = logits_of(probs);
    ++h[s.sample(l, {})];
  }
  return h;
}

TEST(Sampler, GreedyTakesTheArgmaxFirstOnTies) {
  Sampler s(SamplingParams{});
  std::vector<float> l = {0.1f, 3.0f, 3.0f, -1.0f};
  EXPECT_EQ(s.sample(l, {}), 1);
}

TEST(Sampler, TemperatureOneFollowsTheDistribution) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 99;
  const auto h = histogram(p, {0.5, 0.3, 0.2}, 20000);
  EXPECT_NEAR(h.at(0) / 20000.0, 0.5, 0.02);
  EXPECT_NEAR(h.at(1) / 20000.0, 0.3, 0.02);
  EXPECT_NEAR(h.at(2) / 20000.0, 0.2, 0.02);
}

TEST(Sampler, TopKKeepsOnlyTheKMostLikely) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;
  p.seed = 5;
  const auto h = histogram(p, {0.4, 0.1, 0.35, 0.15}, 5000);
  EXPECT_EQ(h.count(1), 0u);
  EXPECT_EQ(h.count(3), 0u);
  EXPECT_NEAR(h.at(0) / 5000.0, 0.4 / 0.75, 0.03);
}

TEST(Sampler, TopPKeepsTheSmallestPrefixAboveP) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.7f;  // 0.5 + 0.3 > 0.7: tokens 0 and 1 only
  p.seed = 7;
  const auto h = histogram(p, {0.5, 0.3, 0.15, 0.05}, 5000);
  EXPECT_EQ(h.count(2), 0u);
  EXPECT_EQ(h.count(3), 0u);
  EXPECT_NEAR(h.at(0) / 5000.0, 0.5 / 0.8, 0.03);
}

TEST(Sampler, LowTemperatureSharpens) {
  SamplingParams p;
  p.temperature = 0.1f;
  p.seed = 3;
  const auto h = histogram(p, {0.4, 0.35, 0.25}, 2000);
  EXPECT_GT(h.at(0), 1500);
}

TEST(Sampler, RepetitionPenaltyDemotesSeenTokens) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  Sampler s(p);
  std::vector<float> l = {2.0f, 1.5f, -1.0f};
  const std::vector<TokenId> history = {0};
  EXPECT_EQ(s.sample(l, history), 1);  // 2.0 / 2 = 1.0 < 1.5
  std::vector<float> neg = {-0.5f, -0.6f};
  const std::vector<TokenId> h2 = {0};
  EXPECT_EQ(s.sample(neg, h2), 1);  // -0.5 · 2 = -1.0 < -0.6
}

TEST(Sampler, SameSeedSameStreamDifferentSeedDifferentStream) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 1234;
  std::vector<double> flat(50, 1.0 / 50);
  auto run = [&](uint64_t seed) {
    SamplingParams q = p;
    q.seed = seed;
    Sampler s(q);
    std::vector<TokenId> out;
    for (int i = 0; i < 20; ++i) {
      auto l = logits_of(flat);
      out.push_back(s.sample(l, {}));
    }
    return out;
  };
  EXPECT_EQ(run(1234), run(1234));
  EXPECT_NE(run(1234), run(4321));
}

TEST(Sampler, InvalidParametersAreRejected) {
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_FALSE(p.validate().is_ok());
  p = {};
  p.temperature = -1.0f;
  EXPECT_FALSE(p.validate().is_ok());
  p = {};
  p.top_k = -2;
  EXPECT_FALSE(p.validate().is_ok());
  p = {};
  p.repetition_penalty = 0.0f;
  EXPECT_NE(p.validate().message().find("repetition_penalty"), std::string::npos);
  EXPECT_TRUE(SamplingParams{}.validate().is_ok());
}

// The split used by Backend::sample_rows: next_draw() advances the stream as sample() does and
// sample_with_coin() makes the same decision, for every kind of parameters.
TEST(Sampler, DrawThenDecideEqualsSample) {
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int config = 0; config < 8; ++config) {
    SamplingParams p;
    p.temperature = config == 0 ? 0.0f : 0.3f * static_cast<float>(config);
    p.top_p = config % 3 == 0 ? 1.0f : 0.5f + 0.1f * static_cast<float>(config % 4);
    p.top_k = config % 2 == 0 ? 0 : config * 3;
    p.repetition_penalty = config % 4 == 1 ? 1.3f : 1.0f;
    p.seed = 100 + static_cast<uint64_t>(config);
    Sampler whole(p), split(p), kept(p);
    std::vector<TokenId> history = {3, 3, 7, 1000, -2};  // repeats and out-of-range ids
    DistinctTokens distinct;  // the generator's incremental form of the same history
    distinct.add(history);
    std::vector<std::pair<float, int32_t>> scratch;
    for (int step = 0; step < 200; ++step) {
      std::vector<float> logits(97);
      for (auto& l : logits) l = std::round(normal(gen) * 2.0f) / 2.0f;  // many ties
      std::vector<float> copy = logits;
      const TokenId a = whole.sample(logits, history);
      const TokenDraw draw = split.next_draw(history);
      if (p.temperature == 0.0f) {
        EXPECT_EQ(draw.coin, 0.0f);  // greedy draws no coin
      }
      std::vector<float> copy2 = copy;
      const TokenId b = sample_with_coin(copy, draw, scratch);
      ASSERT_EQ(a, b) << "config " << config << " step " << step;
      const TokenDraw from_distinct = kept.next_draw(distinct);
      EXPECT_EQ(from_distinct.coin, draw.coin);
      EXPECT_EQ(std::set<TokenId>(from_distinct.penalized.begin(), from_distinct.penalized.end()),
                std::set<TokenId>(draw.penalized.begin(), draw.penalized.end()));
      EXPECT_EQ(from_distinct.penalized.size(), draw.penalized.size());  // no repeats
      ASSERT_EQ(sample_with_coin(copy2, from_distinct, scratch), a);
      history.push_back(a);
      distinct.add(a);
    }
  }
}

// top_p < 1/n and a flat distribution: no token reaches the cutoff; the most probable one is
// taken (the lowest index among equals) instead of reading past the candidate list.
TEST(Sampler, TopPBelowOneOverNWithNoCandidate) {
  TokenDraw d;
  d.params.temperature = 1.0f;
  d.params.top_p = 0.1f;
  std::vector<std::pair<float, int32_t>> scratch;
  for (float coin : {0.0f, 0.5f, 0.999f}) {
    d.coin = coin;
    std::vector<float> flat = {1.0f, 1.0f};
    EXPECT_EQ(sample_with_coin(flat, d, scratch), 0);
    std::vector<float> almost = {1.0f, 1.001f, 1.0f};  // p ≈ 0.333 each, cutoff 0.45
    EXPECT_EQ(sample_with_coin(almost, d, scratch), 1);
  }
}

TEST(Sampler, OneTokenVocabularyWithTopP) {
  TokenDraw d;
  d.params.temperature = 1.0f;
  d.params.top_p = 0.5f;
  d.coin = 0.7f;
  std::vector<float> l = {2.0f};
  std::vector<std::pair<float, int32_t>> scratch;
  EXPECT_EQ(sample_with_coin(l, d, scratch), 0);
}

// Against a naive log(softmax) in long double, on logits with ties and a wide range.
TEST(TokenLogprobs, MatchNaiveLogSoftmaxAndRankTiesByLowerId) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  std::vector<float> logits(3000);
  for (float& v : logits) v = dist(rng);
  logits[17] = logits[900] = logits[2999] = 30.0f;  // a three-way tie at the top
  long double sum = 0;
  for (float v : logits) sum += std::exp(static_cast<long double>(v));
  auto naive = [&](size_t id) { return static_cast<double>(logits[id] - std::log(sum)); };
  const TokenLogprobs lp = token_logprobs(logits, 123, 5);
  EXPECT_EQ(lp.chosen.token, 123);
  EXPECT_NEAR(lp.chosen.logprob, naive(123), 1e-5);
  ASSERT_EQ(lp.top.size(), 5u);
  EXPECT_EQ(lp.top[0].token, 17);
  EXPECT_EQ(lp.top[1].token, 900);
  EXPECT_EQ(lp.top[2].token, 2999);
  std::vector<size_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  for (size_t k = 0; k < 5; ++k) {
    EXPECT_EQ(lp.top[k].token, static_cast<TokenId>(order[k])) << k;
    EXPECT_NEAR(lp.top[k].logprob, naive(order[k]), 1e-5) << k;
    EXPECT_LE(lp.top[k].logprob, 0.0f);
  }
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) total += std::exp(token_logprobs(logits, static_cast<TokenId>(i), 0).chosen.logprob);
  EXPECT_NEAR(total, 1.0, 1e-4);
  EXPECT_TRUE(token_logprobs(logits, 0, 0).top.empty());
  const std::vector<float> three{1.0f, 2.0f, 3.0f};
  EXPECT_EQ(token_logprobs(three, 0, kMaxLogprobs).top.size(), 3u) << "capped at the vocabulary";
  // Rank: 1 + how many are strictly more likely (the sorted position of the chosen one).
  const auto pos = static_cast<int32_t>(std::find(order.begin(), order.end(), size_t{123}) - order.begin());
  EXPECT_EQ(lp.chosen_rank, pos + 1);
  EXPECT_EQ(token_logprobs(logits, 900, 0).chosen_rank, 1) << "tied at the top";
  EXPECT_EQ(token_logprobs(three, 0, 0).chosen_rank, 3);
}

}  // namespace
}  // namespace specontext
