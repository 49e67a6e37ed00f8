// A remote KV tier lost for good mid-run (every replica died): the scheduler abandons it and
// recomputes every request without it, so each still gets the tokens it gets alone on an
// all-device engine (Engine::abandon_tier, GeneratorOptions::recompute_lost_tiers); with
// recompute off the step's requests fail; abandon_tier refuses what it cannot do; offloaded prefixes
// outlive the tier.
#include <gtest/gtest.h>

#include <map>

#include "core/model/model_loader.h"
#include "serving/generator.h"
#include "serving/scheduler.h"
#include "tests/core/tier_test_util.h"

namespace specontext {
namespace {

using testing::alone;

std::shared_ptr<Model> stories() {
  auto m = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  return *m;
}

// Forwards `seq` (a prompt, then one token a step) until the engine reports an error, at most
// 20 steps; returns that error (ok if the node never died).
Status forward_until_the_node_dies(Engine& e, SeqId seq) {
  std::vector<TokenId> tokens{1, 403, 407};
  Status failed;
  for (int i = 0; i < 20 && failed.is_ok(); ++i) {
    StepRequest r{seq, tokens, LogitsMode::kLast};
    failed = e.forward(std::span<const StepRequest>(&r, 1)).status();
    tokens = {378};
  }
  return failed;
}

GenerationRequest request(std::vector<TokenId> prompt, int64_t n, float temperature, uint64_t seed) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = n;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  return r;
}

std::vector<GenerationRequest> requests() {
  return {request({1, 403, 407, 261, 378}, 60, 0.0f, 1), request({1, 426}, 50, 0.9f, 5),
          request({1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315}, 40, 0.7f, 9)};
}

struct Outcome {
  std::map<int64_t, std::vector<TokenId>> tokens;
  std::map<int64_t, FinishReason> finish;
  std::vector<RequestId> ids;
  Status first_error;
};

Outcome run_all(Scheduler& s, const std::vector<GenerationRequest>& reqs) {
  Outcome run;
  for (const auto& r : reqs) {
    auto id = s.submit(r);
    EXPECT_TRUE(id.is_ok());
    run.ids.push_back(*id);
  }
  std::vector<SchedulerEvent> ev;
  for (int i = 0; i < 5000 && !s.idle(); ++i) {
    ev.clear();
    Status st = s.step(ev);
    if (!st.is_ok() && run.first_error.is_ok()) run.first_error = st;
    for (const SchedulerEvent& e : ev) {
      if (e.finished) {
        run.finish[e.request.value()] = e.finish;
      } else {
        run.tokens[e.request.value()].push_back(e.token);
      }
    }
  }
  EXPECT_TRUE(s.idle());
  return run;
}

TEST(LostTier, RequestsAreRecomputedWithoutTheTierAndGetTheirAloneTokens) {
  const auto model = stories();
  const auto reqs = requests();
  std::vector<std::vector<TokenId>> expect;
  for (const auto& r : reqs) expect.push_back(alone(r));
  for (bool caching : {false, true}) {
    SCOPED_TRACE(caching ? "prefix caching" : "no prefix caching");
    // Layer 1 on a remote node that dies for good after 40 posts (mid-run: the run posts more).
    auto f = testing::failing_link_engine(model, /*fail_after_posts=*/40, 3, /*permanent=*/true);
    ASSERT_NE(f.engine, nullptr);
    GeneratorOptions go;
    go.prefill_chunk = 4;
    go.prefix_caching = caching;
    Scheduler s(*f.engine, go);
    const Outcome run = run_all(s, reqs);
    EXPECT_TRUE(run.first_error.is_ok()) << run.first_error.to_string();
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(run.finish.at(run.ids[i].value()), FinishReason::kLength) << i;
      EXPECT_EQ(run.tokens.at(run.ids[i].value()), expect[i]) << "request " << i;
    }
    EXPECT_EQ(s.stats().lost_tiers, 1);
    EXPECT_GE(s.stats().lost_tier_requeues, 1);
    auto& link = static_cast<transport::FaultInjectingTransport&>(*f.link);
    EXPECT_GE(link.injected_failures(), 1);
    EXPECT_GT(link.posts(), 40) << "the node died before the run used it";
    EXPECT_EQ(f.engine->abandoned_tiers(), std::vector<TierId>{TierId(1)});
    EXPECT_TRUE(f.engine->lost_tiers().empty());
    EXPECT_EQ(f.engine->memory().placement().layer_home[1], TierId(0));
    EXPECT_TRUE(f.engine->memory().check_invariants().is_ok());
  }
}

// Offloaded prefixes are host memory apart from the tiers: one stored before the node died is
// restored after the tier is abandoned, into the layers' new homes.
TEST(LostTier, AnOffloadedPrefixOutlivesTheTierAndIsRestoredAfterwards) {
  const auto model = stories();
  const GenerationRequest a = request({1, 403, 407, 261, 378}, 60, 0.0f, 1);  // 64 tokens cached
  const GenerationRequest b = request({1, 426}, 20, 0.9f, 5);
  const GenerationRequest c = request({1, 432, 383, 286, 261, 376, 298, 315}, 40, 0.7f, 9);
  GeneratorOptions go;
  go.prefill_chunk = 4;
  go.prefix_caching = true;
  go.prefix_offload_bytes = uint64_t{16} << 20;
  // Two slots: C's admission evicts A's cached sequence into the store. A first run on a link that
  // never fails counts the posts until C's first step; the second run's node dies just after.
  int64_t posts_at_c = 0;
  for (int run = 0; run < 2; ++run) {
    SCOPED_TRACE(run == 0 ? "counting posts" : "the node dies");
    auto f = testing::failing_link_engine(model, run == 0 ? int64_t{1} << 40 : posts_at_c + 3, 2,
                                          /*permanent=*/true);
    ASSERT_NE(f.engine, nullptr);
    auto& link = static_cast<transport::FaultInjectingTransport&>(*f.link);
    Scheduler s(*f.engine, go);
    const Outcome first = run_all(s, {a});  // then B: A is the least recently used
    ASSERT_TRUE(first.first_error.is_ok());
    ASSERT_TRUE(run_all(s, {b}).first_error.is_ok());
    ASSERT_TRUE(s.submit(c).is_ok());
    std::vector<SchedulerEvent> ev;
    ASSERT_TRUE(s.step(ev).is_ok());
    EXPECT_EQ(s.stats().prefix_offloads, 1) << "A went to the store";
    if (run == 0) {
      posts_at_c = link.posts();
      continue;
    }
    (void)run_all(s, {});  // C, recomputed without the tier
    EXPECT_EQ(s.stats().lost_tiers, 1);
    EXPECT_GE(link.injected_failures(), 1);
    EXPECT_EQ(s.prefix_store().offloaded_prefixes(), 1u) << "the store kept A";
    GenerationRequest next = a;
    next.prompt.insert(next.prompt.end(), first.tokens.at(first.ids[0].value()).begin(),
                       first.tokens.at(first.ids[0].value()).end());
    next.prompt.push_back(403);
    next.max_new_tokens = 10;
    const int64_t cached_before = s.stats().cached_prompt_tokens;
    const Outcome turn = run_all(s, {next});
    EXPECT_TRUE(turn.first_error.is_ok()) << turn.first_error.to_string();
    EXPECT_EQ(turn.tokens.at(turn.ids[0].value()), alone(next));
    EXPECT_EQ(s.stats().prefix_restores, 1);
    EXPECT_EQ(s.stats().cached_prompt_tokens - cached_before, 64);
    EXPECT_EQ(f.engine->memory().placement().layer_home[1], TierId(0));
    EXPECT_TRUE(f.engine->memory().check_invariants().is_ok());
  }
  EXPECT_GT(posts_at_c, 0);
}

TEST(LostTier, WithRecomputeOffTheStepsRequestsFailNamingTheLayer) {
  auto f = testing::failing_link_engine(stories(), /*fail_after_posts=*/40, 3, /*permanent=*/true);
  ASSERT_NE(f.engine, nullptr);
  GeneratorOptions go;
  go.recompute_lost_tiers = false;
  Scheduler s(*f.engine, go);
  const Outcome run = run_all(s, requests());
  ASSERT_FALSE(run.first_error.is_ok());
  EXPECT_EQ(run.first_error.code(), StatusCode::kUnavailable) << run.first_error.to_string();
  EXPECT_NE(run.first_error.message().find("layer 1"), std::string::npos) << run.first_error.to_string();
  int failed = 0;
  for (const auto& [id, reason] : run.finish) failed += reason == FinishReason::kError;
  EXPECT_GE(failed, 1);
  EXPECT_EQ(s.stats().lost_tiers, 0);
  EXPECT_EQ(f.engine->lost_tiers(), std::vector<TierId>{TierId(1)});
  EXPECT_TRUE(f.engine->abandoned_tiers().empty());
}

TEST(LostTier, AbandonTierRefusesWhatItCannotDo) {
  auto f = testing::failing_link_engine(stories(), /*fail_after_posts=*/4, 2, /*permanent=*/true);
  ASSERT_NE(f.engine, nullptr);
  Engine& e = *f.engine;
  auto seq = e.memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  EXPECT_TRUE(e.lost_tiers().empty());
  // Forwards until the node dies; the sequence keeps what it had (all-or-nothing).
  ASSERT_FALSE(forward_until_the_node_dies(e, *seq).is_ok());
  ASSERT_GT(e.memory().kv_bytes_in_use(), 0) << "the first forward did not succeed";
  EXPECT_EQ(e.lost_tiers(), std::vector<TierId>{TierId(1)});
  EXPECT_EQ(e.abandon_tier(TierId(0)).code(), StatusCode::kInvalidArgument);  // the device
  EXPECT_EQ(e.abandon_tier(TierId(7)).code(), StatusCode::kInvalidArgument);
  // The sequence holds pages, partly on the lost tier: it must go first.
  Status busy = e.abandon_tier(TierId(1));
  EXPECT_EQ(busy.code(), StatusCode::kInvalidArgument) << busy.to_string();
  EXPECT_NE(busy.message().find("drop every sequence"), std::string::npos) << busy.to_string();
  EXPECT_TRUE(e.abandoned_tiers().empty());
  ASSERT_TRUE(e.memory().remove_sequence(*seq).is_ok());
  Status ok = e.abandon_tier(TierId(1));
  ASSERT_TRUE(ok.is_ok()) << ok.to_string();
  EXPECT_EQ(e.abandon_tier(TierId(1)).code(), StatusCode::kInvalidArgument);  // twice
  EXPECT_TRUE(e.lost_tiers().empty());
  EXPECT_EQ(e.memory().placement().layer_home[1], TierId(0));
  KvPlacement back = e.memory().placement();
  back.layer_home[1] = TierId(1);
  EXPECT_EQ(e.apply_placement(back).code(), StatusCode::kInvalidArgument);
  // A new sequence runs without the tier.
  auto fresh = e.memory().add_sequence();
  ASSERT_TRUE(fresh.is_ok());
  const std::vector<TokenId> prompt{1, 403, 407};
  StepRequest r{*fresh, prompt, LogitsMode::kLast};
  auto out = e.forward(std::span<const StepRequest>(&r, 1));
  EXPECT_TRUE(out.is_ok()) << out.status().to_string();
  EXPECT_TRUE(e.memory().check_invariants().is_ok());
}

// A policy that refuses every admission, as the planner does once nothing fits.
class RefusingPolicy final : public PlacementPolicy {
 public:
  Result<PlacementDecision> decide(const PlacementInput& in) override {
    PlacementDecision d;
    d.placement = in.current;
    return d;
  }
  Status admit(const PlacementInput&, int64_t, bool) override {
    return resource_exhausted("remote0 0 B free of 0 B");
  }
};

// What reports a loss names what died, as the transport tells it (Transport::tier_loss): for a
// KV node tier, each replica's node and why (UcxRemoteTransport, KvNodeProcess tests). The
// placement event of the abandonment, a placement that names the tier, and an admission refused
// afterwards (where the planner sees the lost tier as "0 B free of 0 B") all carry it.
TEST(LostTier, ItsErrorsNameWhatDied) {
  auto f = testing::failing_link_engine(stories(), /*fail_after_posts=*/4, 2, /*permanent=*/true);
  ASSERT_NE(f.engine, nullptr);
  Engine& e = *f.engine;
  auto seq = e.memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  ASSERT_FALSE(forward_until_the_node_dies(e, *seq).is_ok());
  ASSERT_EQ(e.lost_tiers(), std::vector<TierId>{TierId(1)});
  EXPECT_EQ(f.link->tier_loss(TierId(1)), "fault injection: the node of tier 1 died for good after 4 posts");
  EXPECT_EQ(f.link->tier_loss(TierId(0)), "");
  ASSERT_TRUE(e.memory().remove_sequence(*seq).is_ok());
  EXPECT_EQ(e.lost_tier_error(TierId(1)), "") << "not abandoned yet";
  ASSERT_TRUE(e.abandon_tier(TierId(1)).is_ok());
  const std::string name = e.memory().kv_store().tiers()[1].desc.name;
  const std::string error = e.lost_tier_error(TierId(1));
  EXPECT_EQ(error, "tier " + name + " was lost: fault injection: the node of tier 1 died for good after 4 posts");
  EXPECT_EQ(e.lost_tier_error(TierId(0)), "");
  const std::string event = e.placement_events().back().reasons.at(0);
  EXPECT_NE(event.find("lost (fault injection: the node of tier 1 died for good"), std::string::npos) << event;
  KvPlacement back = e.memory().placement();
  back.layer_home[1] = TierId(1);
  const Status placed = e.apply_placement(back);
  EXPECT_EQ(placed.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(placed.message().find(error), std::string::npos) << placed.to_string();
  ASSERT_TRUE(e.set_placement_policy(std::make_shared<RefusingPolicy>()).is_ok());
  const Status refused = e.admit(10, /*alone=*/true);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("0 B free of 0 B (" + error + ")"), std::string::npos) << refused.to_string();
}

}  // namespace
}  // namespace specontext
