// The generation loop: continuous batching gives each request the output it gets alone, chunked
// prefill changes nothing, stop tokens and max tokens end requests, bad requests are refused.
#include <gtest/gtest.h>

#include "core/model/model_loader.h"
#include "cpu/cpu_backend.h"
#include "serving/generator.h"
#include "tests/core/tier_test_util.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

std::unique_ptr<Engine> make_engine(int64_t max_sequences) { return testing::stories_engine(max_sequences); }

std::vector<GenerationRequest> requests() {
  std::vector<GenerationRequest> r(3);
  r[0].prompt = {1, 403, 407, 261, 378};           // "Once upon a time"
  r[1].prompt = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315};
  r[2].prompt = {1, 426};
  for (size_t i = 0; i < r.size(); ++i) {
    r[i].max_new_tokens = 20 + 5 * static_cast<int64_t>(i);
    r[i].sampling.temperature = i == 1 ? 0.8f : 0.0f;
    r[i].sampling.seed = 11;
  }
  return r;
}

TEST(Generator, BatchedRequestsEqualSeparateRuns) {
  const auto reqs = requests();
  std::vector<std::vector<TokenId>> alone;
  for (const auto& r : reqs) {
    auto e = make_engine(1);
    Generator g(*e, GeneratorOptions{});
    auto res = g.run({r});
    ASSERT_TRUE(res.is_ok());
    alone.push_back((*res)[0].tokens);
  }
  auto e = make_engine(3);
  GeneratorOptions go;
  go.prefill_chunk = 3;  // chunked prefill interleaved with other requests' decode steps
  go.max_batch_tokens = 5;
  Generator g(*e, go);
  std::vector<size_t> streamed(3, 0);
  auto res = g.run(reqs, [&](size_t i, TokenId) { ++streamed[i]; });
  ASSERT_TRUE(res.is_ok()) << res.status().to_string();
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ((*res)[i].tokens, alone[i]) << "request " << i;
    EXPECT_EQ(streamed[i], alone[i].size());
    EXPECT_EQ((*res)[i].finish, FinishReason::kLength);
  }
  EXPECT_EQ(g.stats().prompt_tokens, 5 + 12 + 2);
  EXPECT_EQ(g.stats().generated_tokens, 20 + 25 + 30);
  EXPECT_EQ(e->memory().live_sequences(), 0);  // every sequence released
}

// The generator samples on the backend (kSample) with the penalty set it keeps incrementally:
// the tokens must be those of a plain loop that forwards kLast and samples the returned logits
// with the whole history, for a penalised sampled request and a penalised greedy one.
TEST(Generator, PenalisedSamplingEqualsAPlainLoopOverTheLogits) {
  for (float temperature : {0.0f, 0.9f}) {
    GenerationRequest r;
    r.prompt = {1, 403, 407, 261, 378};
    r.max_new_tokens = 60;
    r.sampling.temperature = temperature;
    r.sampling.top_p = 0.9f;
    r.sampling.repetition_penalty = 1.3f;
    r.sampling.seed = 5;
    auto e = make_engine(1);
    Generator g(*e, GeneratorOptions{});
    auto res = g.run({r});
    ASSERT_TRUE(res.is_ok()) << res.status().to_string();

    auto plain = make_engine(1);
    auto seq = plain->memory().add_sequence();
    ASSERT_TRUE(seq.is_ok());
    Sampler sampler(r.sampling);
    std::vector<TokenId> history = r.prompt, generated;
    std::span<const TokenId> feed(r.prompt);
    TokenId next = -1;
    while (static_cast<int64_t>(generated.size()) < r.max_new_tokens) {
      StepRequest step{*seq, feed, LogitsMode::kLast};
      auto out = plain->forward(std::span<const StepRequest>(&step, 1));
      ASSERT_TRUE(out.is_ok());
      next = sampler.sample(out->row(0), history);
      generated.push_back(next);
      history.push_back(next);
      feed = std::span<const TokenId>(&next, 1);
    }
    EXPECT_EQ((*res)[0].tokens, generated) << "temperature " << temperature;
    // The penalty is doing something: the unpenalised greedy text differs.
    if (temperature == 0.0f) {
      GenerationRequest unpenalised = r;
      unpenalised.sampling.repetition_penalty = 1.0f;
      auto base = Generator(*e, GeneratorOptions{}).run({unpenalised});
      ASSERT_TRUE(base.is_ok());
      EXPECT_NE((*base)[0].tokens, generated);
    }
  }
}

TEST(Generator, StopTokenEndsTheRequestWithoutEmittingIt) {
  auto e = make_engine(1);
  Generator g(*e, GeneratorOptions{});
  GenerationRequest r;
  r.prompt = {1, 403, 407, 261, 378};
  r.max_new_tokens = 50;
  auto full = g.run({r});
  ASSERT_TRUE(full.is_ok());
  const TokenId stop = (*full)[0].tokens[4];
  r.stop_ids = {stop};
  auto res = g.run({r});
  ASSERT_TRUE(res.is_ok());
  EXPECT_EQ((*res)[0].finish, FinishReason::kStop);
  const auto& toks = (*res)[0].tokens;
  EXPECT_EQ(std::find(toks.begin(), toks.end(), stop), toks.end());
  EXPECT_LE(toks.size(), 4u);
}

TEST(Generator, ContextLimitEndsGenerationAndLongPromptsAreRefused) {
  auto e = make_engine(2);
  Generator g(*e, GeneratorOptions{});
  GenerationRequest r;
  r.prompt = std::vector<TokenId>(500, 300);
  r.max_new_tokens = 100;
  auto res = g.run({r});
  ASSERT_TRUE(res.is_ok());
  EXPECT_EQ((*res)[0].finish, FinishReason::kContext);
  EXPECT_EQ((*res)[0].tokens.size(), 13u);  // 500 + 12 fed back = 512 cached, 13th sampled last
  r.prompt = std::vector<TokenId>(513, 300);
  res = g.run({r});
  ASSERT_FALSE(res.is_ok());
  EXPECT_NE(res.status().message().find("longer than the context limit of 512"), std::string::npos);
  GenerationRequest empty;
  res = g.run({empty});
  EXPECT_FALSE(res.is_ok());
  // More requests than sequence slots: the rest wait and are admitted as slots free up.
  GenerationRequest ok;
  ok.prompt = {1, 403};
  ok.max_new_tokens = 6;
  res = g.run({ok, ok, ok, ok, ok});
  ASSERT_TRUE(res.is_ok()) << res.status().to_string();
  for (const auto& r : *res) EXPECT_EQ(r.tokens, (*res)[0].tokens);
  EXPECT_EQ(e->memory().live_sequences(), 0);
}

}  // namespace
}  // namespace specontext
