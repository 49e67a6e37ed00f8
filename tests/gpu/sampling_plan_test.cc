// Device sampling's plan and formulation, checked without a GPU. plan_sample_rows (modes, penalty
// ids, cutoff, sort slots, groups) drives a host mirror of the kernels of gpu/kernels_sampling.cu:
// the same sort keys (gpu/sample_keys.h), the same compaction (in a shuffled order: the device's
// atomics give any order), sorts of the slots, the k-th key as the top-k membership test, the
// renormalised second sort, and the top-p prefix and draw. Sums run in the host's sequential
// order here (the kernels sum by warps; that is the only difference), so the mirror must give
// sample_with_coin's token for every case. The CUDA test (cuda_sampling_test.cc) checks the
// kernels themselves on a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/ports/sampler.h"
#include "gpu/kernels.h"
#include "gpu/sample_keys.h"
#include "gpu/sampling_plan.h"

namespace specontext::gpu {
namespace {

using kernels::SampleRowMeta;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Host mirror of one group's pipeline. Scratch starts filled with garbage the kernels must not read.
void emulate_group(const SamplePlan& plan, const SampleGroupPlan& g, std::vector<float>& logits,
                   std::vector<TokenId>& tokens, std::mt19937& rng) {
  const int64_t n = plan.vocab;
  const int shift = plan.key_shift;
  const uint64_t key_limit = uint64_t{1} << kernels::sample_key_bits(shift);
  const size_t words = static_cast<size_t>(g.n_slots()) * static_cast<size_t>(n);
  ASSERT_LE(g.n_slots(), plan.max_slots);
  ASSERT_LE(g.n_seg2(), plan.max_seg2);
  std::vector<uint64_t> keys_a(words, 0xdeadbeefdeadbeefull), keys_b(words, 0xdeadbeefdeadbeefull);
  std::vector<int32_t> end1(static_cast<size_t>(g.n_slots()), -1), end2(static_cast<size_t>(g.n_seg2()), -1);

  // sample_prepare_kernel
  for (int64_t r = g.row_begin; r < g.row_begin + g.n_rows; ++r) {
    const SampleRowMeta& m = plan.meta[static_cast<size_t>(r)];
    float* row = logits.data() + r * n;
    for (int32_t j = 0; j < m.n_penalized; ++j) {
      const int32_t id = plan.penalized[static_cast<size_t>(m.penalized_offset + j)];
      ASSERT_TRUE(id >= 0 && id < n);
      float& l = row[id];
      l = l > 0.0f ? l / m.penalty : l * m.penalty;
    }
    // argmax_merge over the row: first index of the max, NaN never wins
    auto argmax = [&](int64_t& best) {
      float v = -kInf;
      best = -1;
      for (int64_t k = 0; k < n; ++k) {
        if (row[k] > v || (row[k] == v && best < 0)) {
          v = row[k];
          best = k;
        }
      }
      return v;
    };
    int64_t best = -1;
    if (m.mode == kernels::kSampleGreedy) {
      argmax(best);
      tokens[static_cast<size_t>(r)] = std::isnan(row[0]) || best < 0 ? 0 : static_cast<TokenId>(best);
      continue;
    }
    for (int64_t k = 0; k < n; ++k) row[k] /= m.temperature;
    const float vmax = argmax(best);
    tokens[static_cast<size_t>(r)] = best < 0 ? 0 : static_cast<TokenId>(best);  // fallback
    float sum = 0.0f;
    for (int64_t k = 0; k < n; ++k) sum += std::exp(row[k] - vmax);
    const bool all_keys = m.mode == kernels::kSampleTopK || m.mode == kernels::kSampleTopKTopP;
    const bool candidates = m.mode == kernels::kSampleTopP;
    std::vector<uint64_t> emitted;
    for (int64_t k = 0; k < n; ++k) {
      const float p = std::exp(row[k] - vmax) / sum;
      row[k] = p;
      if (all_keys || (candidates && p >= m.cutoff)) emitted.push_back(kernels::sample_key(p, k, n, shift));
    }
    if (all_keys || candidates) {
      ASSERT_GE(m.slot, 0);
      ASSERT_LT(m.slot, g.n_slots());
      const int32_t begin = g.begin1[static_cast<size_t>(m.slot)];
      ASSERT_EQ(begin, static_cast<int64_t>(m.slot) * n);
      if (candidates) std::shuffle(emitted.begin(), emitted.end(), rng);  // atomics: any order
      for (size_t j = 0; j < emitted.size(); ++j) {
        if (std::isfinite(kernels::sample_key_prob(emitted[j], shift))) {
          ASSERT_LT(emitted[j], key_limit);
        }
        keys_a[static_cast<size_t>(begin) + j] = emitted[j];
      }
      end1[static_cast<size_t>(m.slot)] = begin + static_cast<int32_t>(emitted.size());
      continue;
    }
    ASSERT_EQ(m.mode, kernels::kSampleIndexCdf);
    ASSERT_EQ(m.slot, -1);
    int64_t hit = n - 1;
    float cdf = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
      cdf += row[k];
      if (m.coin < cdf) {
        hit = k;
        break;
      }
    }
    tokens[static_cast<size_t>(r)] = static_cast<TokenId>(hit);
  }

  auto sort_segments = [](std::vector<uint64_t>& keys, const std::vector<int32_t>& begin,
                          const std::vector<int32_t>& end) {
    for (size_t s = 0; s < begin.size(); ++s) {
      ASSERT_GE(end[s], begin[s]) << "segment " << s << " has no end";
      std::sort(keys.begin() + begin[s], keys.begin() + end[s], std::greater<>());
    }
  };
  sort_segments(keys_a, g.begin1, end1);
  if (::testing::Test::HasFatalFailure()) return;

  // sample_topk_kernel
  for (int32_t r : g.rows_topk) {
    const SampleRowMeta& m = plan.meta[static_cast<size_t>(r)];
    ASSERT_TRUE(m.mode == kernels::kSampleTopK || m.mode == kernels::kSampleTopKTopP);
    ASSERT_TRUE(m.top_k > 0 && m.top_k < n);
    const float* row = logits.data() + r * n;
    const size_t base = static_cast<size_t>(m.slot) * static_cast<size_t>(n);
    ASSERT_EQ(end1[static_cast<size_t>(m.slot)], static_cast<int64_t>(base) + n);
    const uint64_t kth = keys_a[base + static_cast<size_t>(m.top_k) - 1];
    auto kept = [&](int64_t i) { return kernels::sample_key(row[i], i, n, shift) >= kth; };
    float kept_sum = 0.0f;  // the device sums the sorted prefix; the host's order here
    int64_t n_kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (kept(i)) {
        kept_sum += row[i];
        ++n_kept;
      }
    }
    ASSERT_EQ(n_kept, m.top_k);
    if (m.mode == kernels::kSampleTopK) {
      int64_t hit = n - 1;
      float cdf = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        cdf += kept(i) ? row[i] / kept_sum : 0.0f;
        if (m.coin < cdf) {
          hit = i;
          break;
        }
      }
      tokens[static_cast<size_t>(r)] = static_cast<TokenId>(hit);
      continue;
    }
    ASSERT_GE(m.seg2, 0);
    ASSERT_EQ(g.begin2[static_cast<size_t>(m.seg2)], static_cast<int64_t>(base));
    std::vector<uint64_t> emitted;
    for (int64_t j = 0; j < m.top_k; ++j) {
      const uint64_t key = keys_a[base + static_cast<size_t>(j)];
      const float p = kernels::sample_key_prob(key, shift) / kept_sum;
      if (p >= m.cutoff) emitted.push_back(kernels::sample_key(p, kernels::sample_key_index(key, n, shift), n, shift));
    }
    std::shuffle(emitted.begin(), emitted.end(), rng);
    std::copy(emitted.begin(), emitted.end(), keys_b.begin() + static_cast<int64_t>(base));
    end2[static_cast<size_t>(m.seg2)] = static_cast<int32_t>(base + emitted.size());
  }
  sort_segments(keys_b, g.begin2, end2);
  if (::testing::Test::HasFatalFailure()) return;

  // sample_topp_kernel
  for (int32_t r : g.rows_topp) {
    const SampleRowMeta& m = plan.meta[static_cast<size_t>(r)];
    ASSERT_TRUE(m.mode == kernels::kSampleTopP || m.mode == kernels::kSampleTopKTopP);
    const bool second = m.mode == kernels::kSampleTopKTopP;
    const size_t base = static_cast<size_t>(m.slot) * static_cast<size_t>(n);
    const uint64_t* keys = (second ? keys_b : keys_a).data() + base;
    const int64_t count =
        (second ? end2[static_cast<size_t>(m.seg2)] : end1[static_cast<size_t>(m.slot)]) - static_cast<int64_t>(base);
    if (count <= 0) continue;  // the argmax stays
    float cumulative = 0.0f;
    int64_t last = count - 1;
    for (int64_t j = 0; j < count; ++j) {
      cumulative += kernels::sample_key_prob(keys[j], shift);
      if (cumulative > m.top_p) {
        last = j;
        break;
      }
    }
    const float x = m.coin * cumulative;
    int64_t hit = last;
    float cdf = 0.0f;
    for (int64_t j = 0; j <= last; ++j) {
      cdf += kernels::sample_key_prob(keys[j], shift);
      if (x < cdf) {
        hit = j;
        break;
      }
    }
    tokens[static_cast<size_t>(r)] = static_cast<TokenId>(kernels::sample_key_index(keys[hit], n, shift));
  }
}

std::vector<TokenId> emulate(const SamplePlan& plan, std::vector<float> logits, std::mt19937& rng) {
  std::vector<TokenId> tokens(static_cast<size_t>(plan.rows), -7);
  if (plan.host_only) {
    fill_host_only(plan, tokens.data());
    return tokens;
  }
  int64_t next = 0;
  for (const SampleGroupPlan& g : plan.groups) {
    EXPECT_EQ(g.row_begin, next) << "groups must tile the rows";
    next = g.row_begin + g.n_rows;
    emulate_group(plan, g, logits, tokens, rng);
  }
  EXPECT_EQ(next, plan.rows);
  return tokens;
}

std::vector<TokenId> host_tokens(std::vector<float> logits, int64_t rows, int64_t vocab,
                                 const std::vector<TokenDraw>& draws) {
  std::vector<TokenId> out(static_cast<size_t>(rows));
  std::vector<std::pair<float, int32_t>> scratch;
  for (int64_t r = 0; r < rows; ++r) {
    out[static_cast<size_t>(r)] = sample_with_coin(
        std::span<float>(logits.data() + r * vocab, static_cast<size_t>(vocab)), draws[static_cast<size_t>(r)], scratch);
  }
  return out;
}

// Random logits of one row: uniform, heavily tied (few distinct values), all equal, peaked, with
// some -inf entries.
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
    case 2:
      for (int64_t i = 0; i < n; ++i) row[i] = 0.5f;
      break;
    case 3:  // peaked, like language-model logits
      for (int64_t i = 0; i < n; ++i) row[i] = 2.0f * g(rng);
      for (int j = 0; j < 3; ++j) row[rng() % n] = 12.0f + 2.0f * u(rng);
      break;
    default:  // -inf entries and ±0
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t c = rng() % 8;
        row[i] = c == 0 ? -kInf : c == 1 ? -0.0f : c == 2 ? 0.0f : u(rng);
      }
      row[rng() % n] = 1.0f;  // never all -inf
      break;
  }
}

TokenDraw random_draw(std::mt19937& rng, int64_t n, bool greedy_allowed) {
  TokenDraw d;
  SamplingParams& p = d.params;
  const float temps[] = {0.0f, 0.05f, 0.5f, 1.0f, 1.3f, 2.0f};
  p.temperature = temps[greedy_allowed ? rng() % 6 : 1 + rng() % 5];
  const float top_ps[] = {1.0f, 1.0f, 0.1f, 0.5f, 0.9f, 0.95f, 0.999f, 0.0f};
  p.top_p = top_ps[rng() % 8];
  if (p.top_p == 0.0f) p.top_p = std::uniform_real_distribution<float>(0.05f, 1.0f)(rng);
  // top_p <= 1/n can leave no candidate (both sides then take the argmax, see
  // NoCandidateGetsTheArgmax); the random cases stay in the usual range.
  p.top_p = std::min(1.0f, std::max(p.top_p, 1.0f / static_cast<float>(n) + 0.01f));
  const int64_t ks[] = {0, 0, 1, 2, -1, n - 1, n, n + 5};
  const int64_t k = ks[rng() % 8];
  p.top_k = static_cast<int32_t>(k == -1 ? 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(n)) : std::max<int64_t>(k, 0));
  const float penalties[] = {1.0f, 1.0f, 1.1f, 1.5f, 0.8f};
  p.repetition_penalty = penalties[rng() % 5];
  const uint32_t c = rng() % 5;
  d.coin = c == 0 ? 0.0f : c == 1 ? 0.999999f : std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
  if (d.coin >= 1.0f) d.coin = 0.5f;
  if (p.repetition_penalty != 1.0f) {
    const int64_t h = static_cast<int64_t>(rng() % 40);
    std::vector<TokenId> ids;
    for (int64_t i = 0; i < h && static_cast<int64_t>(ids.size()) < n; ++i) {
      const TokenId t = static_cast<TokenId>(rng() % static_cast<uint32_t>(n));
      if (std::find(ids.begin(), ids.end(), t) == ids.end()) ids.push_back(t);
    }
    ids.push_back(-1);  // ignored, and may repeat
    ids.push_back(-1);
    ids.push_back(static_cast<TokenId>(n));
    ids.push_back(static_cast<TokenId>(n + 100));
    std::shuffle(ids.begin(), ids.end(), rng);
    d.penalized = ids;
  }
  return d;
}

TEST(SamplingPlan, HostMirrorEqualsSampleWithCoin) {
  std::mt19937 rng(20260101);
  const int64_t vocabs[] = {1, 2, 3, 5, 17, 100, 1000, 4099, 32000};
  int cases = 0;
  int sampled = 0;
  int sorted_rows = 0;
  for (int iter = 0; iter < 600; ++iter) {
    const int64_t n = vocabs[iter % 9];
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 6);
    std::vector<float> logits(static_cast<size_t>(rows * n));
    std::vector<TokenDraw> draws;
    for (int64_t r = 0; r < rows; ++r) {
      fill_row(rng, logits.data() + r * n, n, static_cast<int>(rng() % 5));
      draws.push_back(random_draw(rng, n, true));
    }
    std::vector<TokenId> tokens(static_cast<size_t>(rows));
    // Small sort budgets split the rows into groups.
    const int64_t budget = iter % 3 == 0 ? n : iter % 3 == 1 ? 3 * n : kSampleMaxSortKeys;
    auto plan = plan_sample_rows(logits.data(), rows, n, draws.data(), tokens.data(), budget);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    const std::vector<TokenId> want = host_tokens(logits, rows, n, draws);
    const std::vector<TokenId> got = emulate(plan.value(), logits, rng);
    if (HasFatalFailure()) return;
    for (int64_t r = 0; r < rows; ++r) {
      const TokenDraw& d = draws[static_cast<size_t>(r)];
      ASSERT_EQ(got[static_cast<size_t>(r)], want[static_cast<size_t>(r)])
          << "iter " << iter << " row " << r << " vocab " << n << " T " << d.params.temperature << " top_k "
          << d.params.top_k << " top_p " << d.params.top_p << " penalty " << d.params.repetition_penalty << " coin "
          << d.coin;
      ++cases;
      sampled += d.params.temperature != 0.0f ? 1 : 0;
      sorted_rows += plan.value().meta[static_cast<size_t>(r)].slot >= 0 ? 1 : 0;
    }
  }
  EXPECT_GT(sampled, cases / 2);
  EXPECT_GT(sorted_rows, cases / 3);
  std::printf("%d rows (%d sampled, %d sorted) equal to sample_with_coin\n", cases, sampled, sorted_rows);
}

// Long vocabularies, one row each mode: 128K and 300K.
TEST(SamplingPlan, HostMirrorLongVocabularies) {
  std::mt19937 rng(7);
  int cases = 0;
  for (int64_t n : {int64_t{131072}, int64_t{300000}}) {
    for (int kind : {0, 1, 3}) {
      const int64_t rows = 4;
      std::vector<float> logits(static_cast<size_t>(rows * n));
      std::vector<TokenDraw> draws(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        fill_row(rng, logits.data() + r * n, n, kind);
        TokenDraw& d = draws[static_cast<size_t>(r)];
        d.params.temperature = 0.8f;
        d.params.top_k = r == 1 || r == 3 ? 50 : 0;
        d.params.top_p = r >= 2 ? 0.9f : 1.0f;
        d.params.repetition_penalty = 1.2f;
        d.penalized = {0, 5, static_cast<TokenId>(n - 1), -3, static_cast<TokenId>(n)};
        d.coin = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
      }
      std::vector<TokenId> tokens(static_cast<size_t>(rows));
      auto plan = plan_sample_rows(logits.data(), rows, n, draws.data(), tokens.data());
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      EXPECT_EQ(emulate(plan.value(), logits, rng), host_tokens(logits, rows, n, draws)) << "vocab " << n << " kind " << kind;
      cases += static_cast<int>(rows);
    }
  }
  EXPECT_EQ(cases, 24);
}

TEST(SamplingPlan, ModesSlotsAndGroups) {
  const int64_t n = 10;
  std::vector<float> logits(static_cast<size_t>(6 * n), 0.0f);
  std::vector<TokenId> tokens(6);
  std::vector<TokenDraw> d(6);
  d[0].params.temperature = 0.0f;                                  // greedy
  d[1].params.temperature = 1.0f;                                  // index CDF
  d[2].params.temperature = 1.0f, d[2].params.top_k = 3;           // top-k
  d[3].params.temperature = 1.0f, d[3].params.top_p = 0.5f;        // top-p
  d[4].params.temperature = 1.0f, d[4].params.top_k = 3, d[4].params.top_p = 0.5f;  // both
  d[5].params.temperature = 1.0f, d[5].params.top_k = 10, d[5].params.top_p = 1.0f;  // k >= n: off
  auto plan = plan_sample_rows(logits.data(), 6, n, d.data(), tokens.data(), 2 * n);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  const SamplePlan& p = plan.value();
  EXPECT_FALSE(p.host_only);
  EXPECT_EQ(p.key_shift, 4);
  const int32_t modes[] = {kernels::kSampleGreedy, kernels::kSampleIndexCdf, kernels::kSampleTopK,
                           kernels::kSampleTopP, kernels::kSampleTopKTopP, kernels::kSampleIndexCdf};
  for (int r = 0; r < 6; ++r) EXPECT_EQ(p.meta[static_cast<size_t>(r)].mode, modes[r]) << r;
  EXPECT_EQ(p.meta[5].top_k, 0);
  EXPECT_EQ(p.meta[3].cutoff, 0.5f / 9.0f);
  // Two sorted rows per group: rows 2, 3 | 4 (and the unsorted 5 joins the last group).
  ASSERT_EQ(p.groups.size(), 2u);
  EXPECT_EQ(p.groups[0].row_begin, 0);
  EXPECT_EQ(p.groups[0].n_rows, 4);
  EXPECT_EQ(p.groups[0].begin1, (std::vector<int32_t>{0, 10}));
  EXPECT_EQ(p.groups[0].rows_topk, (std::vector<int32_t>{2}));
  EXPECT_EQ(p.groups[0].rows_topp, (std::vector<int32_t>{3}));
  EXPECT_EQ(p.groups[1].row_begin, 4);
  EXPECT_EQ(p.groups[1].n_rows, 2);
  EXPECT_EQ(p.groups[1].begin1, (std::vector<int32_t>{0}));
  EXPECT_EQ(p.groups[1].begin2, (std::vector<int32_t>{0}));
  EXPECT_EQ(p.meta[4].slot, 0);
  EXPECT_EQ(p.meta[4].seg2, 0);
  EXPECT_EQ(p.max_slots, 2);
  EXPECT_EQ(p.max_seg2, 1);
  EXPECT_EQ(p.key_words(), 20u);

  // vocab 1: every token is 0, nothing on the device.
  float one[2] = {3.0f, -1.0f};
  auto single = plan_sample_rows(one, 2, 1, d.data(), tokens.data());
  ASSERT_TRUE(single.is_ok());
  EXPECT_TRUE(single.value().host_only);
  std::mt19937 rng(1);
  EXPECT_EQ(emulate(single.value(), {3.0f, -1.0f}, rng), (std::vector<TokenId>{0, 0}));
  // rows == 0: nothing at all, even with null pointers.
  auto none = plan_sample_rows(nullptr, 0, 5, nullptr, nullptr);
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none.value().rows, 0);
}

TEST(SamplingPlan, PenaltyIdsInRangeAndDistinct) {
  const int64_t n = 8;
  std::vector<float> logits(2 * n, 1.0f);
  std::vector<TokenId> tokens(2);
  std::vector<TokenDraw> d(2);
  d[0].params.repetition_penalty = 1.5f;
  d[0].penalized = {3, -1, 8, -1, 0, 7, 100};
  d[1].params.repetition_penalty = 1.0f;  // off: ids not uploaded
  d[1].penalized = {1, 2};
  auto plan = plan_sample_rows(logits.data(), 2, n, d.data(), tokens.data());
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan.value().penalized, (std::vector<int32_t>{3, 0, 7}));
  EXPECT_EQ(plan.value().meta[0].n_penalized, 3);
  EXPECT_EQ(plan.value().meta[1].n_penalized, 0);
  d[1].params.repetition_penalty = 2.0f;
  d[1].penalized = {1, 2, 1};
  auto dup = plan_sample_rows(logits.data(), 2, n, d.data(), tokens.data());
  ASSERT_FALSE(dup.is_ok());
  EXPECT_NE(dup.status().message().find("draws[1].penalized"), std::string::npos) << dup.status().to_string();
  EXPECT_NE(dup.status().message().find("token 1 twice"), std::string::npos);
}

// top_p <= 1/n can leave no candidate above llama2.c's cutoff (llama2.c reads past its candidate
// list there); sample_with_coin, the plan and the kernels answer the most probable token.
TEST(SamplingPlan, NoCandidateGetsTheArgmax) {
  std::vector<float> logits = {0.1f, 0.3f, 0.2f};
  TokenDraw d;
  d.params.temperature = 1.0f;
  d.params.top_p = 0.05f;  // cutoff 0.475 > every probability
  d.coin = 0.3f;
  TokenId token = -1;
  auto plan = plan_sample_rows(logits.data(), 1, 3, &d, &token);
  ASSERT_TRUE(plan.is_ok());
  std::mt19937 rng(3);
  EXPECT_EQ(emulate(plan.value(), logits, rng), (std::vector<TokenId>{1}));
  std::vector<float> host = {0.1f, 0.3f, 0.2f};
  std::vector<std::pair<float, int32_t>> scratch;
  EXPECT_EQ(sample_with_coin(host, d, scratch), 1);
}

TEST(SamplingPlan, ArgumentChecksNameTheField) {
  std::vector<float> logits(4, 0.0f);
  TokenId tokens[2];
  std::vector<TokenDraw> d(2);
  auto message = [&](const float* l, int64_t rows, int64_t vocab, const TokenDraw* dr, const TokenId* t) {
    auto plan = plan_sample_rows(l, rows, vocab, dr, t);
    EXPECT_FALSE(plan.is_ok());
    if (plan.is_ok()) return std::string();
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
    return plan.status().message();
  };
  auto has = [](const std::string& s, const char* what) { return s.find(what) != std::string::npos; };
  EXPECT_TRUE(has(message(logits.data(), 2, 0, d.data(), tokens), "vocabulary of 0"));
  EXPECT_TRUE(has(message(logits.data(), 2, -3, d.data(), tokens), "vocabulary of -3"));
  EXPECT_TRUE(has(message(logits.data(), 1, int64_t{1} << 31, d.data(), tokens), "vocab"));
  EXPECT_TRUE(has(message(logits.data(), int64_t{1} << 31, 2, d.data(), tokens), "rows"));
  EXPECT_TRUE(has(message(nullptr, 2, 2, d.data(), tokens), "null logits"));
  EXPECT_TRUE(has(message(logits.data(), 2, 2, nullptr, tokens), "null draws"));
  EXPECT_TRUE(has(message(logits.data(), 2, 2, d.data(), nullptr), "null tokens"));
  d[1].params.top_p = 1.5f;
  EXPECT_TRUE(has(message(logits.data(), 2, 2, d.data(), tokens), "draws[1].params: top_p"));
  d[1].params.top_p = 1.0f;
  d[1].params.temperature = -1.0f;
  EXPECT_TRUE(has(message(logits.data(), 2, 2, d.data(), tokens), "draws[1].params: temperature"));
  d[1].params.temperature = 1.0f;
  d[0].params.top_k = -2;
  EXPECT_TRUE(has(message(logits.data(), 2, 2, d.data(), tokens), "draws[0].params: top_k"));
  d[0].params.top_k = 0;
  d[0].params.repetition_penalty = 0.0f;
  EXPECT_TRUE(has(message(logits.data(), 2, 2, d.data(), tokens), "draws[0].params: repetition_penalty"));
  d[0].params.repetition_penalty = 1.0f;
  d[1].coin = 1.0f;
  EXPECT_TRUE(has(message(logits.data(), 2, 2, d.data(), tokens), "draws[1].coin"));
  d[1].coin = kNan;
  EXPECT_TRUE(has(message(logits.data(), 2, 2, d.data(), tokens), "draws[1].coin"));
  d[1].coin = -0.25f;
  EXPECT_TRUE(has(message(logits.data(), 2, 2, d.data(), tokens), "draws[1].coin"));
  // Greedy rows draw no coin: not checked.
  d[1].params.temperature = 0.0f;
  auto greedy = plan_sample_rows(logits.data(), 2, 2, d.data(), tokens);
  EXPECT_TRUE(greedy.is_ok()) << greedy.status().to_string();
}

TEST(SamplingPlan, KeyOrder) {
  const int64_t n = 300000;
  const int shift = kernels::sample_key_shift(n);
  EXPECT_EQ(shift, 19);
  EXPECT_EQ(kernels::sample_key_shift(1), 1);
  EXPECT_EQ(kernels::sample_key_shift(2), 1);
  EXPECT_EQ(kernels::sample_key_shift(3), 2);
  EXPECT_EQ(kernels::sample_key_shift(int64_t{1} << 20), 20);
  EXPECT_EQ(kernels::sample_key_shift((int64_t{1} << 20) + 1), 21);
  EXPECT_EQ(kernels::sample_key_shift(INT32_MAX), 31);
  using kernels::sample_key;
  EXPECT_GT(sample_key(0.5f, 7, n, shift), sample_key(0.25f, 0, n, shift));   // larger p first
  EXPECT_GT(sample_key(0.5f, 3, n, shift), sample_key(0.5f, 4, n, shift));    // tie: lower index first
  EXPECT_GT(sample_key(1e-30f, n - 1, n, shift), sample_key(0.0f, 0, n, shift));
  EXPECT_LT(sample_key(1.0f, 0, n, shift), uint64_t{1} << kernels::sample_key_bits(shift));
  for (int64_t i : {int64_t{0}, int64_t{1}, int64_t{12345}, n - 1}) {
    const uint64_t key = sample_key(0.125f, i, n, shift);
    EXPECT_EQ(kernels::sample_key_index(key, n, shift), i);
    EXPECT_EQ(kernels::sample_key_prob(key, shift), 0.125f);
  }
}

}  // namespace
}  // namespace specontext::gpu
