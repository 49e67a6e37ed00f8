// The incremental scheduler: requests submitted while others run join the batch and get the
// tokens they get alone; cancelling frees the sequence at once and leaves the others unchanged;
// waiting requests are admitted in order as slots free up.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>

#include "core/model/model_loader.h"
#include "core/sparse/retrieval_head.h"
#include "serving/generator.h"
#include "serving/scheduler.h"
#include "tests/core/tier_test_util.h"
#include "tests/serving/scheduler_test_util.h"

namespace specontext {
namespace {

using testing::alone;
using testing::request;
using testing::story_prompt;

std::unique_ptr<Engine> make_engine(int64_t max_sequences) { return testing::stories_engine(max_sequences); }

// stories260K on an engine of `slots` sequence slots and a pool of `pages` KV pages (0: enough
// for `running` sequences at the context limit; running 0: every slot).
std::unique_ptr<Engine> pool_engine(int64_t slots, int64_t pages, int64_t running = 0) {
  auto m = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(m.is_ok());
  if (!m.is_ok()) return nullptr;
  EngineOptions eo;
  eo.max_sequences = slots;
  eo.max_running = running;
  eo.kv_pages = pages;
  auto engine = Engine::create(*m, testing::cpu_backend(), eo);
  EXPECT_TRUE(engine.is_ok());
  return engine.is_ok() ? std::move(*engine) : nullptr;
}

struct Collected {
  std::map<int64_t, std::vector<TokenId>> tokens;
  std::map<int64_t, FinishReason> finish;
  std::map<int64_t, int64_t> cached;  // cached_prompt_tokens of the finished event
};

void collect(const std::vector<SchedulerEvent>& events, Collected& c) {
  for (const SchedulerEvent& ev : events) {
    if (ev.finished) {
      EXPECT_FALSE(c.finish.count(ev.request.value())) << "two endings for request " << ev.request.value();
      c.finish[ev.request.value()] = ev.finish;
      c.cached[ev.request.value()] = ev.cached_prompt_tokens;
    } else {
      EXPECT_FALSE(c.finish.count(ev.request.value())) << "token after the ending";
      c.tokens[ev.request.value()].push_back(ev.token);
    }
  }
}

TEST(Scheduler, RequestsSubmittedMidRunJoinTheBatchAndGetTheirAloneTokens) {
  const GenerationRequest a = request({1, 403, 407, 261, 378}, 30);
  const GenerationRequest b = request({1, 426}, 20, 0.8f);
  const GenerationRequest c = request({1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315}, 25);
  auto engine = make_engine(3);
  GeneratorOptions go;
  go.prefill_chunk = 4;
  Scheduler s(*engine, go);
  Collected got;
  std::vector<SchedulerEvent> ev;
  auto ia = s.submit(a);
  ASSERT_TRUE(ia.is_ok());
  for (int i = 0; i < 5; ++i) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    collect(ev, got);
  }
  EXPECT_EQ(got.tokens[ia->value()].size(), 4u);  // 2 prefill steps (chunks of 4 and 1) + decode
  auto ib = s.submit(b);
  ASSERT_TRUE(ib.is_ok());
  ev.clear();
  ASSERT_TRUE(s.step(ev).is_ok());
  collect(ev, got);
  auto ic = s.submit(c);
  ASSERT_TRUE(ic.is_ok());
  while (!s.idle()) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    collect(ev, got);
  }
  EXPECT_EQ(s.stats().max_batch_sequences, 3);
  EXPECT_EQ(got.tokens[ia->value()], alone(a));
  EXPECT_EQ(got.tokens[ib->value()], alone(b));
  EXPECT_EQ(got.tokens[ic->value()], alone(c));
  for (int64_t id : {ia->value(), ib->value(), ic->value()}) EXPECT_EQ(got.finish[id], FinishReason::kLength);
  EXPECT_EQ(engine->memory().live_sequences(), 0);
}

TEST(Scheduler, CancelFreesTheSequenceAtOnceAndTheOthersGoOn) {
  const GenerationRequest a = request({1, 403, 407, 261, 378}, 40);
  const GenerationRequest b = request({1, 426}, 40);
  auto engine = make_engine(2);
  Scheduler s(*engine, GeneratorOptions{});
  auto ia = s.submit(a), ib = s.submit(b);
  ASSERT_TRUE(ia.is_ok() && ib.is_ok());
  Collected got;
  std::vector<SchedulerEvent> ev;
  for (int i = 0; i < 6; ++i) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    collect(ev, got);
  }
  EXPECT_EQ(engine->memory().live_sequences(), 2);
  const int64_t kv_two = engine->memory().kv_bytes_in_use();
  EXPECT_TRUE(s.cancel(*ia));
  EXPECT_EQ(engine->memory().live_sequences(), 1);
  EXPECT_LT(engine->memory().kv_bytes_in_use(), kv_two);
  EXPECT_FALSE(s.cancel(*ia)) << "a second cancel finds nothing";
  EXPECT_FALSE(s.cancel(RequestId(999)));
  while (!s.idle()) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    collect(ev, got);
  }
  EXPECT_EQ(got.tokens[ia->value()].size(), 6u);
  EXPECT_FALSE(got.finish.count(ia->value())) << "no event follows a cancel";
  EXPECT_EQ(got.tokens[ib->value()], alone(b));
  EXPECT_EQ(engine->memory().live_sequences(), 0);
}

TEST(Scheduler, WaitingRequestsAreAdmittedInOrderAndCanBeCancelledBeforeTheyRun) {
  auto engine = make_engine(1);
  Scheduler s(*engine, GeneratorOptions{});
  auto i1 = s.submit(request({1, 403}, 5));
  auto i2 = s.submit(request({1, 426}, 5));
  auto i3 = s.submit(request({1, 378}, 5));
  ASSERT_TRUE(i1.is_ok() && i2.is_ok() && i3.is_ok());
  std::vector<SchedulerEvent> ev;
  ASSERT_TRUE(s.step(ev).is_ok());
  EXPECT_EQ(s.running(), 1u);
  EXPECT_EQ(s.waiting(), 2u);
  EXPECT_TRUE(s.cancel(*i2));
  EXPECT_EQ(s.waiting(), 1u);
  Collected got;
  collect(ev, got);
  std::vector<int64_t> order;
  while (!s.idle()) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    for (const auto& e : ev) {
      if (e.finished) order.push_back(e.request.value());
    }
    collect(ev, got);
  }
  EXPECT_EQ(order, (std::vector<int64_t>{i1->value(), i3->value()}));
  EXPECT_FALSE(got.tokens.count(i2->value()));
  EXPECT_EQ(got.tokens[i3->value()], alone(request({1, 378}, 5)));
}

// Admission counts a running sequence at the final length it was admitted for, not at its
// current length: two requests that fit the pool only one at a time are not admitted together
// just because the first has not grown yet; the second waits and then runs.
TEST(Scheduler, AdmissionCountsRunningRequestsAtTheirFinalLength) {
  auto m = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  ASSERT_TRUE(m.is_ok());
  EngineOptions eo;
  eo.max_sequences = 2;
  eo.kv_pages = 20;  // 320 tokens: one 200-token request at a time
  auto engine = Engine::create(*m, testing::cpu_backend(), eo);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  auto seq = (*engine)->memory().add_sequence(/*final_length=*/200);
  ASSERT_TRUE(seq.is_ok());
  EXPECT_EQ((*engine)->admit(200, /*alone=*/false).code(), StatusCode::kResourceExhausted)
      << "13 pages promised to the empty sequence";
  EXPECT_TRUE((*engine)->admit(100, /*alone=*/false).is_ok());
  ASSERT_TRUE((*engine)->memory().remove_sequence(*seq).is_ok());

  Scheduler s(**engine, GeneratorOptions{});
  auto a = s.submit(request({1, 403, 407, 261, 378}, 195));
  auto b = s.submit(request({1, 426}, 198));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  Collected got;
  std::vector<SchedulerEvent> ev;
  int64_t most_running = 0;
  while (!s.idle()) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    collect(ev, got);
    most_running = std::max<int64_t>(most_running, static_cast<int64_t>(s.running()));
  }
  EXPECT_EQ(most_running, 1);
  EXPECT_EQ(got.finish[a->value()], FinishReason::kLength);
  EXPECT_EQ(got.finish[b->value()], FinishReason::kLength);
  EXPECT_EQ(got.tokens[b->value()].size(), 198u);
}

// The same pool under AdmissionPolicy::kPreempt: requests run together until the pool is short,
// then the newest gives way and is recomputed later; every request still gets its alone tokens,
// and one that cannot fit even alone is refused.
TEST(Scheduler, PreemptingAdmissionRunsRequestsTogetherAndRecomputesTheOnesThatGiveWay) {
  auto m = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  ASSERT_TRUE(m.is_ok());
  for (bool caching : {false, true}) {
    SCOPED_TRACE(caching ? "prefix caching" : "no prefix caching");
    EngineOptions eo;
    eo.max_sequences = 3;
    eo.kv_pages = 20;  // 320 tokens; the three requests reach 200 + 200 + 162
    auto engine = Engine::create(*m, testing::cpu_backend(), eo);
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    const std::vector<GenerationRequest> reqs{
        request({1, 403, 407, 261, 378}, 195), request({1, 426}, 198),
        request({1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315}, 150, 0.8f)};
    GeneratorOptions go;
    go.admission = AdmissionPolicy::kPreempt;
    go.prefill_chunk = 64;
    go.prefix_caching = caching;
    Scheduler s(**engine, go);
    std::vector<RequestId> ids;
    for (const auto& r : reqs) {
      auto id = s.submit(r);
      ASSERT_TRUE(id.is_ok());
      ids.push_back(*id);
    }
    GenerationRequest too_long = request({1, 426}, 400);  // 402 tokens: 26 pages of 20
    auto refused = s.submit(too_long);
    ASSERT_TRUE(refused.is_ok());
    Collected got;
    std::vector<SchedulerEvent> ev;
    int64_t most_running = 0;
    for (int i = 0; i < 5000 && !s.idle(); ++i) {
      ev.clear();
      ASSERT_TRUE(s.step(ev).is_ok());
      collect(ev, got);
      most_running = std::max<int64_t>(most_running, static_cast<int64_t>(s.running()));
    }
    ASSERT_TRUE(s.idle());
    EXPECT_GE(most_running, 2) << "requests ran together";
    EXPECT_GE(s.stats().preemptions, 1) << "the pool was too small for all three at their final lengths";
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got.finish[ids[i].value()], FinishReason::kLength) << i;
      EXPECT_EQ(got.tokens[ids[i].value()], alone(reqs[i])) << "request " << i;
    }
    EXPECT_EQ(got.finish[refused->value()], FinishReason::kRefused);
    EXPECT_FALSE(got.tokens.count(refused->value()));
    // Finished sequences stay cached (evicted as the others needed room).
    EXPECT_EQ((*engine)->memory().live_sequences(),
              static_cast<int64_t>(s.prefix_store().cached_sequences()));
    if (caching) {
      EXPECT_GE(s.stats().prefix_cache_evictions, 1);
    } else {
      EXPECT_EQ((*engine)->memory().kv_bytes_in_use(), 0);
    }
    EXPECT_TRUE((*engine)->memory().check_invariants().is_ok());
  }
}

TEST(Scheduler, SubmitRefusesWhatCanNeverRun) {
  auto engine = make_engine(1);
  Scheduler s(*engine, GeneratorOptions{});
  EXPECT_EQ(s.submit(request({}, 5)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.submit(request({1, 2}, 0)).status().code(), StatusCode::kInvalidArgument);
  auto bad_sampling = request({1, 2}, 5);
  bad_sampling.sampling.top_p = 2.0f;
  EXPECT_EQ(s.submit(bad_sampling).status().code(), StatusCode::kInvalidArgument);
  auto st = s.submit(request(std::vector<TokenId>(static_cast<size_t>(engine->max_context()) + 1, 5), 1));
  EXPECT_EQ(st.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.status().message().find("context limit"), std::string::npos) << st.status().message();
  EXPECT_TRUE(s.idle());
}

// A layer homed on a remote node whose link dies: the forward fails, the request of that batch ends
// with kError naming the layer, its sequence is freed, and the request waiting behind it is
// neither lost nor ended by that failure (it runs, and ends, on its own).
TEST(Scheduler, AFailedForwardEndsOnlyItsBatchAndWaitingRequestsStayQueued) {
  testing::FailingLinkEngine f = testing::failing_link_engine(testing::toy_model(2), /*fail_after_posts=*/4, 1);
  ASSERT_TRUE(f.engine);
  auto& engine = f.engine;
  Scheduler s(*engine, GeneratorOptions{});
  auto a = s.submit(request({1, 2, 3, 4, 5, 6, 7, 8}, 50));
  auto c = s.submit(request({9, 10}, 5));
  ASSERT_TRUE(a.is_ok() && c.is_ok());
  Collected got;
  std::vector<SchedulerEvent> ev;
  Status failed;
  for (int i = 0; i < 60 && failed.is_ok(); ++i) {
    ev.clear();
    failed = s.step(ev);
    collect(ev, got);
  }
  ASSERT_FALSE(failed.is_ok()) << "the link never failed";
  ASSERT_TRUE(got.finish.count(a->value()));
  EXPECT_EQ(got.finish[a->value()], FinishReason::kError);
  EXPECT_NE(failed.message().find("layer"), std::string::npos) << failed.to_string();
  EXPECT_EQ(engine->memory().live_sequences(), 0) << "the failed request's sequence is freed";
  EXPECT_FALSE(got.finish.count(c->value())) << "the waiting request was not in the failed batch";
  EXPECT_EQ(s.waiting(), 1u);
  // It runs next (and fails on the dead link too): one ending, not lost.
  for (int i = 0; i < 10 && !s.idle(); ++i) {
    ev.clear();
    (void)s.step(ev);
    collect(ev, got);
  }
  EXPECT_TRUE(s.idle());
  ASSERT_TRUE(got.finish.count(c->value()));
  EXPECT_EQ(got.finish[c->value()], FinishReason::kError);
}

// Asking for logprobs moves the draw to the host (kLast) but changes no token, greedy or seeded
// with the penalty on; each logprob is log_softmax of the logits a dense forward over the same
// tokens gives, and the alternatives are the most likely tokens, in order.
TEST(Scheduler, LogprobsLeaveTheTokensUnchangedAndMatchADenseForward) {
  std::vector<GenerationRequest> plain{request({1, 403, 407, 261, 378}, 24), request({1, 426}, 20, 0.8f)};
  plain[1].sampling.repetition_penalty = 1.3f;
  std::vector<GenerationRequest> asking = plain;
  asking[0].logprobs = 4;
  asking[1].logprobs = 0;
  auto run = [&](const std::vector<GenerationRequest>& rs) {
    auto engine = make_engine(2);
    Scheduler s(*engine, GeneratorOptions{});
    std::map<int64_t, std::vector<SchedulerEvent>> events;
    for (const auto& r : rs) EXPECT_TRUE(s.submit(r).is_ok());
    std::vector<SchedulerEvent> ev;
    while (!s.idle()) {
      ev.clear();
      EXPECT_TRUE(s.step(ev).is_ok());
      for (auto& e : ev) {
        if (!e.finished) events[e.request.value()].push_back(std::move(e));
      }
    }
    return events;
  };
  auto without = run(plain);
  auto with = run(asking);
  ASSERT_EQ(with.size(), 2u);
  auto dense = make_engine(1);
  for (int64_t id = 1; id <= 2; ++id) {
    const GenerationRequest& r = asking[static_cast<size_t>(id - 1)];
    const auto& got = with[id];
    ASSERT_EQ(got.size(), without[id].size());
    std::vector<TokenId> tokens = r.prompt;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].token, without[id][i].token) << "request " << id << " token " << i;
      EXPECT_FALSE(without[id][i].logprobs.has_value());
      tokens.push_back(got[i].token);
    }
    auto seq = dense->memory().add_sequence();
    ASSERT_TRUE(seq.is_ok());
    tokens.pop_back();  // the last token's logits are not needed
    const std::vector<StepRequest> step{{*seq, tokens, LogitsMode::kAll, nullptr}};
    auto out = dense->forward(step);
    ASSERT_TRUE(out.is_ok()) << out.status().to_string();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(got[i].logprobs.has_value());
      const TokenLogprobs& lp = *got[i].logprobs;
      const auto row = out->row(0, static_cast<int64_t>(r.prompt.size() + i - 1));
      double sum = 0;
      for (float v : row) sum += std::exp(static_cast<double>(v));
      EXPECT_EQ(lp.chosen.token, got[i].token);
      EXPECT_NEAR(lp.chosen.logprob, row[static_cast<size_t>(got[i].token)] - std::log(sum), 1e-3)
          << "request " << id << " token " << i;
      ASSERT_EQ(lp.top.size(), static_cast<size_t>(r.logprobs));
      for (size_t k = 0; k < lp.top.size(); ++k) {
        EXPECT_NEAR(lp.top[k].logprob, row[static_cast<size_t>(lp.top[k].token)] - std::log(sum), 1e-3);
        if (k > 0) {
          EXPECT_GE(lp.top[k - 1].logprob, lp.top[k].logprob);
        }
      }
      if (r.sampling.temperature == 0.0f) {
        EXPECT_EQ(lp.top[0].token, got[i].token) << "greedy takes the top";
      }
    }
    ASSERT_TRUE(dense->memory().remove_sequence(*seq).is_ok());
  }
  GenerationRequest too_many = plain[0];
  too_many.logprobs = kMaxLogprobs + 1;
  auto engine = make_engine(1);
  Scheduler s(*engine, GeneratorOptions{});
  EXPECT_EQ(s.submit(too_many).status().code(), StatusCode::kInvalidArgument);
}

// Prompt logprobs (echo): gathered over several prompt chunks, one per prompt token after the
// first, equal to log_softmax of a dense forward's rows; the generated tokens are unchanged.
TEST(Scheduler, PromptLogprobsCoverEveryPromptTokenAcrossChunks) {
  GenerationRequest r = request({1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298}, 6);
  const std::vector<TokenId> plain = alone(r);
  r.logprobs = 2;
  r.prompt_logprobs = 2;
  auto engine = make_engine(1);
  GeneratorOptions go;
  go.prefill_chunk = 4;  // chunks of 4, 4, 3
  Scheduler s(*engine, go);
  ASSERT_TRUE(s.submit(r).is_ok());
  std::vector<SchedulerEvent> all, ev;
  while (!s.idle()) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    all.insert(all.end(), ev.begin(), ev.end());
  }
  ASSERT_FALSE(all.empty());
  const std::vector<TokenLogprobs>& lp = all[0].prompt_logprobs;
  ASSERT_EQ(lp.size(), r.prompt.size() - 1);
  for (size_t i = 1; i < all.size(); ++i) EXPECT_TRUE(all[i].prompt_logprobs.empty()) << "only the first event";
  std::vector<TokenId> tokens;
  for (const auto& e : all) {
    if (!e.finished) tokens.push_back(e.token);
  }
  EXPECT_EQ(tokens, plain);

  auto dense = make_engine(1);
  auto seq = dense->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  const std::vector<StepRequest> step{{*seq, r.prompt, LogitsMode::kAll, nullptr}};
  auto out = dense->forward(step);
  ASSERT_TRUE(out.is_ok());
  for (size_t i = 0; i + 1 < r.prompt.size(); ++i) {
    const auto row = out->row(0, static_cast<int64_t>(i));
    double sum = 0;
    for (float v : row) sum += std::exp(static_cast<double>(v));
    EXPECT_EQ(lp[i].chosen.token, r.prompt[i + 1]);
    EXPECT_NEAR(lp[i].chosen.logprob, row[static_cast<size_t>(r.prompt[i + 1])] - std::log(sum), 1e-3) << i;
    EXPECT_EQ(lp[i].top.size(), 2u);
  }
  GenerationRequest bad = r;
  bad.prompt_logprobs = kMaxLogprobs + 1;
  EXPECT_EQ(s.submit(bad).status().code(), StatusCode::kInvalidArgument);
  // Prompt logprobs without generated-token logprobs: the same entries.
  GenerationRequest prompt_only = r;
  prompt_only.logprobs = -1;
  ASSERT_TRUE(s.submit(prompt_only).is_ok());
  std::vector<SchedulerEvent> first;
  while (first.empty() && !s.idle()) ASSERT_TRUE(s.step(first).is_ok());
  ASSERT_FALSE(first.empty());
  ASSERT_EQ(first[0].prompt_logprobs.size(), lp.size());
  EXPECT_FALSE(first[0].logprobs.has_value());
  for (size_t i = 0; i < lp.size(); ++i)
    EXPECT_NEAR(first[0].prompt_logprobs[i].chosen.logprob, lp[i].chosen.logprob, 1e-5);
}

// logit_bias and frequency/presence penalties: the scheduler's tokens equal a hand-written greedy
// loop that adjusts a dense forward's logits the same way; banning the plain run's first token
// changes the output.
TEST(Scheduler, LogitBiasAndPenaltiesEqualAHandWrittenGreedyLoop) {
  GenerationRequest r = request({1, 403, 407, 261, 378}, 40);
  const std::vector<TokenId> plain = alone(r);
  ASSERT_FALSE(plain.empty());
  r.logit_bias = {{plain[0], -100.0f}, {300, 2.5f}};
  r.frequency_penalty = 1.5f;
  r.presence_penalty = 0.5f;
  const std::vector<TokenId> got = alone(r);
  ASSERT_EQ(got.size(), 40u);
  EXPECT_NE(got[0], plain[0]) << "the banned token is never drawn first";

  auto engine = make_engine(1);
  auto seq = engine->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  std::vector<TokenId> feed = r.prompt, expected;
  std::map<TokenId, int> counts;
  for (size_t i = 0; i < got.size(); ++i) {
    const std::vector<StepRequest> step{{*seq, feed, LogitsMode::kLast, nullptr}};
    auto out = engine->forward(step);
    ASSERT_TRUE(out.is_ok());
    std::vector<float> l(out->row(0).begin(), out->row(0).end());
    for (const auto& [id, bias] : r.logit_bias) l[static_cast<size_t>(id)] += bias;
    for (const auto& [id, n] : counts) l[static_cast<size_t>(id)] -= r.frequency_penalty * n + r.presence_penalty;
    const TokenId next = argmax(l);
    expected.push_back(next);
    ++counts[next];
    feed = {next};
  }
  EXPECT_EQ(got, expected);

  GenerationRequest bad = r;
  bad.frequency_penalty = 2.5f;
  Scheduler s(*engine, GeneratorOptions{});
  EXPECT_EQ(s.submit(bad).status().code(), StatusCode::kInvalidArgument);
  bad = r;
  bad.logit_bias = {{5, std::numeric_limits<float>::quiet_NaN()}};
  EXPECT_EQ(s.submit(bad).status().code(), StatusCode::kInvalidArgument);
}

// min_tokens keeps stop ids out of the first tokens; min_p = 1 keeps only the likeliest token,
// so sampling at temperature 2 gives the greedy text.
TEST(Scheduler, MinTokensAndMinP) {
  GenerationRequest r = request({1, 403, 407, 261, 378}, 12);
  const std::vector<TokenId> greedy = alone(r);
  ASSERT_GE(greedy.size(), 3u);
  GenerationRequest stop_first = r;
  stop_first.stop_ids = {greedy[0]};
  EXPECT_TRUE(alone(stop_first).empty()) << "its first token is a stop id";
  stop_first.min_tokens = 3;
  const std::vector<TokenId> held = alone(stop_first);
  ASSERT_GE(held.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(held[i], greedy[0]) << i;

  GenerationRequest sharp = request({1, 403, 407, 261, 378}, 12, 2.0f);
  EXPECT_NE(alone(sharp), greedy) << "temperature 2 alone differs";
  sharp.min_p = 1.0f;
  EXPECT_EQ(alone(sharp), greedy);

  auto engine = make_engine(1);
  Scheduler s(*engine, GeneratorOptions{});
  GenerationRequest bad = r;
  bad.min_tokens = 13;
  EXPECT_EQ(s.submit(bad).status().code(), StatusCode::kInvalidArgument);
  bad = r;
  bad.min_p = 1.5f;
  EXPECT_EQ(s.submit(bad).status().code(), StatusCode::kInvalidArgument);
}

// ---- prefix caching ----

void run_to_idle(Scheduler& s, Collected& got) {
  std::vector<SchedulerEvent> ev;
  for (int i = 0; i < 5000 && !s.idle(); ++i) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    collect(ev, got);
  }
  ASSERT_TRUE(s.idle());
}

// The next turn of conversation r: its prompt, its answer, then `more`; n tokens to generate.
GenerationRequest next_turn(const GenerationRequest& r, const std::vector<TokenId>& answer,
                            std::vector<TokenId> more, int64_t n) {
  GenerationRequest next = r;
  next.prompt.insert(next.prompt.end(), answer.begin(), answer.end());
  next.prompt.insert(next.prompt.end(), more.begin(), more.end());
  next.max_new_tokens = n;
  return next;
}

// Four unrelated conversations of 4 whole pages each (65 tokens cached), one after another.
std::vector<GenerationRequest> four_conversations(Scheduler& s, Collected& got) {
  std::vector<GenerationRequest> reqs;
  for (TokenId first : {403, 426, 432, 298}) {
    reqs.push_back(request({1, first, 261}, 63));
    EXPECT_TRUE(s.submit(reqs.back()).is_ok());
    run_to_idle(s, got);
  }
  return reqs;
}

TEST(Scheduler, PrefixCachingStartsTheNextTurnFromTheLastTurnsCache) {
  auto engine = make_engine(4);  // pages of 16 tokens
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefill_chunk = 16;
  Scheduler s(*engine, go);
  const GenerationRequest a = request(story_prompt(40), 30);
  ASSERT_TRUE(s.submit(a).is_ok());
  Collected got;
  run_to_idle(s, got);
  const std::vector<TokenId> ta = got.tokens[1];
  ASSERT_EQ(ta, alone(a));
  EXPECT_EQ(got.cached[1], 0);
  EXPECT_EQ(s.prefix_store().cached_sequences(), 1u);
  EXPECT_EQ(engine->memory().live_sequences(), 1);

  // The next turn: the conversation so far and more. A's cache holds 40 + 30 − 1 tokens (its
  // last token was never fed): 64 of them in whole pages.
  GenerationRequest b = a;
  b.prompt.insert(b.prompt.end(), ta.begin(), ta.end());
  b.prompt.insert(b.prompt.end(), {403, 407, 261});
  b.max_new_tokens = 20;
  ASSERT_TRUE(s.submit(b).is_ok());
  run_to_idle(s, got);
  EXPECT_EQ(got.tokens[2], alone(b));
  EXPECT_EQ(got.cached[2], 64);
  EXPECT_EQ(s.stats().cached_prompt_tokens, 64);
  EXPECT_EQ(s.stats().prompt_tokens, 40 + static_cast<int64_t>(b.prompt.size()) - 64);
  EXPECT_EQ(s.prefix_store().cached_sequences(), 1u) << "B took all of A's whole pages: A is superseded";
  EXPECT_EQ(s.stats().prefix_cache_evictions, 0);

  // A prompt that is all cached still computes its last token: 39 usable, 32 in pages.
  ASSERT_TRUE(s.submit(a).is_ok());
  run_to_idle(s, got);
  EXPECT_EQ(got.tokens[3], ta);
  EXPECT_EQ(got.cached[3], 32);
  EXPECT_EQ(s.prefix_store().cached_sequences(), 2u) << "B keeps pages beyond C's prefix";
  EXPECT_TRUE(engine->memory().check_invariants().is_ok()) << engine->memory().check_invariants().to_string();
}

TEST(Scheduler, TheNextTurnTakesOverTheLastTurnsSequenceEvenWithOneSlot) {
  auto engine = make_engine(1);  // a fork would need a second slot
  GeneratorOptions go;
  go.prefix_caching = true;
  for (AdmissionPolicy policy : {AdmissionPolicy::kPreempt, AdmissionPolicy::kReserve}) {
    go.admission = policy;
    Scheduler s(*engine, go);
    const GenerationRequest a = request(story_prompt(40), 30);
    ASSERT_TRUE(s.submit(a).is_ok());
    Collected got;
    run_to_idle(s, got);
    const GenerationRequest b = next_turn(a, got.tokens[1], {403}, 20);
    ASSERT_TRUE(s.submit(b).is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(got.tokens[2], alone(b));
    EXPECT_EQ(got.cached[2], 64) << "69 cached tokens, cut to 4 pages";
    EXPECT_EQ(s.stats().prefix_cache_evictions, 0);
    EXPECT_EQ(s.prefix_store().cached_sequences(), 1u);
    EXPECT_TRUE(engine->memory().check_invariants().is_ok());
  }
}

// The same prompt again, one slot: the cached sequence holds more than the prompt, so a fork
// would need a second slot and evicting it would lose the prefix. The request takes it over, cut
// to the prompt's whole pages; with an offload store, its longer tokens are offloaded first.
TEST(Scheduler, ThePromptAgainTakesOverALongerCachedSequenceWithOneSlot) {
  for (const bool store : {false, true}) {
    SCOPED_TRACE(store ? "with an offload store" : "without one");
    auto engine = make_engine(1);
    GeneratorOptions go;
    go.prefix_caching = true;
    if (store) go.prefix_offload_bytes = uint64_t{64} << 20;
    Scheduler s(*engine, go);
    const GenerationRequest a = request(story_prompt(40), 30);  // 69 tokens cached: 64 whole
    Collected got;
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(s.submit(a).is_ok());
      run_to_idle(s, got);
    }
    EXPECT_EQ(got.tokens[1], alone(a));
    EXPECT_EQ(got.tokens[2], got.tokens[1]);
    EXPECT_EQ(got.cached[2], 32) << "39 usable, 2 pages";
    EXPECT_EQ(s.stats().prefix_cache_evictions, 0);
    EXPECT_EQ(s.prefix_store().cached_sequences(), 1u);
    EXPECT_EQ(s.stats().prefix_offloads, store ? 1 : 0);
    EXPECT_EQ(s.prefix_store().offloaded_prefixes(), store ? 1u : 0u);
    EXPECT_TRUE(engine->memory().check_invariants().is_ok())
        << engine->memory().check_invariants().to_string();
  }
}

TEST(Scheduler, SlotsBeyondTheRunningOnesHoldCachedSequences) {
  auto m = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  ASSERT_TRUE(m.is_ok());
  EngineOptions eo;
  eo.max_sequences = 3;
  eo.max_running = 1;  // the pool: one sequence at the context limit (32 pages of 16)
  auto engine = Engine::create(*m, testing::cpu_backend(), eo);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  EXPECT_EQ((*engine)->memory().kv_store().total_pages(), 32);
  GeneratorOptions go;
  go.prefix_caching = true;
  Scheduler s(**engine, go);
  const GenerationRequest a = request(story_prompt(40), 30);
  const GenerationRequest b = request({1, 426, 298}, 30);
  ASSERT_TRUE(s.submit(a).is_ok());
  ASSERT_TRUE(s.submit(b).is_ok());
  Collected got;
  run_to_idle(s, got);
  EXPECT_EQ(s.stats().max_batch_sequences, 1) << "one running at a time";
  EXPECT_EQ(got.tokens[1], alone(a));
  EXPECT_EQ(got.tokens[2], alone(b));
  EXPECT_EQ(s.prefix_store().cached_sequences(), 2u);
  const GenerationRequest next = next_turn(a, got.tokens[1], {403}, a.max_new_tokens);
  ASSERT_TRUE(s.submit(next).is_ok());
  run_to_idle(s, got);
  EXPECT_EQ(got.tokens[3], alone(next));
  EXPECT_EQ(got.cached[3], 64);
  EXPECT_EQ(s.stats().prefix_cache_evictions, 0);
  EXPECT_TRUE((*engine)->memory().check_invariants().is_ok());
}

TEST(Scheduler, PrefixCachingForksFromARunningRequest) {
  auto engine = make_engine(4);
  GeneratorOptions go;
  go.prefix_caching = true;
  Scheduler s(*engine, go);
  const GenerationRequest a = request(story_prompt(40), 40);
  ASSERT_TRUE(s.submit(a).is_ok());
  Collected got;
  std::vector<SchedulerEvent> ev;
  while (got.tokens[1].size() < 5) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    collect(ev, got);
  }
  GenerationRequest b = request(story_prompt(36), 25, 0.8f);
  b.prompt.insert(b.prompt.end(), {426, 298, 315});
  ASSERT_TRUE(s.submit(b).is_ok());
  run_to_idle(s, got);
  EXPECT_EQ(got.tokens[1], alone(a));
  EXPECT_EQ(got.tokens[2], alone(b));
  EXPECT_EQ(got.cached[2], 32);
  EXPECT_EQ(s.stats().prefix_cache_evictions, 0);
  EXPECT_TRUE(engine->memory().check_invariants().is_ok());
}

TEST(Scheduler, APromptSentTwiceAtOnceIsComputedOnce) {
  auto engine = make_engine(4);
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefill_chunk = 16;  // the first copy prefills over three steps; the second waits for it
  Scheduler s(*engine, go);
  const GenerationRequest greedy = request(story_prompt(40), 12);
  const GenerationRequest sampled = request(story_prompt(40), 12, 0.8f);
  ASSERT_TRUE(s.submit(greedy).is_ok());
  ASSERT_TRUE(s.submit(sampled).is_ok());
  Collected got;
  run_to_idle(s, got);
  EXPECT_EQ(got.tokens[1], alone(greedy));
  EXPECT_EQ(got.tokens[2], alone(sampled));
  EXPECT_EQ(got.cached[2], 32);
  EXPECT_GE(s.stats().prefix_waits, 1);
  EXPECT_EQ(s.stats().prompt_tokens, 40 + 8);
}

TEST(Scheduler, CachedSequencesGiveWayToNewRequests) {
  for (AdmissionPolicy policy : {AdmissionPolicy::kReserve, AdmissionPolicy::kPreempt}) {
    SCOPED_TRACE(policy == AdmissionPolicy::kReserve ? "reserve" : "preempt");
    // Memory: 20 pages, and each request reaches 13. Slots: 2.
    auto engine = pool_engine(2, 20);
    ASSERT_TRUE(engine);
    GeneratorOptions go;
    go.prefix_caching = true;
    go.admission = policy;
    Scheduler s(*engine, go);
    const std::vector<GenerationRequest> reqs{request({1, 403, 407, 261, 378}, 195), request({1, 426}, 198),
                                              request({1, 432, 383}, 190)};
    Collected got;
    for (size_t i = 0; i < reqs.size(); ++i) {
      ASSERT_TRUE(s.submit(reqs[i]).is_ok());
      run_to_idle(s, got);
      EXPECT_EQ(got.finish[static_cast<int64_t>(i + 1)], FinishReason::kLength) << i;
      EXPECT_EQ(got.tokens[static_cast<int64_t>(i + 1)], alone(reqs[i])) << i;
      EXPECT_EQ(s.stats().prefix_cache_evictions, static_cast<int64_t>(i))
          << "each one's memory evicts the last";
      EXPECT_EQ(s.prefix_store().cached_sequences(), 1u);
    }
    EXPECT_TRUE(engine->memory().check_invariants().is_ok());
  }
}

// Reserving admission counts a cached sequence the request takes over once: the next turn fits
// where its history and its final length counted apart would not, and needs no eviction.
TEST(Scheduler, TheNextTurnTakesOverItsCacheWhereCountingBothWouldNotFit) {
  for (AdmissionPolicy policy : {AdmissionPolicy::kReserve, AdmissionPolicy::kPreempt}) {
    SCOPED_TRACE(policy == AdmissionPolicy::kReserve ? "reserve" : "preempt");
    auto engine = pool_engine(2, 20);
    ASSERT_TRUE(engine);
    GeneratorOptions go;
    go.prefix_caching = true;
    go.admission = policy;
    Scheduler s(*engine, go);
    const GenerationRequest a = request(story_prompt(40), 30);  // 5 pages, 4 of them whole
    Collected got;
    ASSERT_TRUE(s.submit(a).is_ok());
    run_to_idle(s, got);
    // 271 tokens: 17 pages, beside A's 5 there would be 22.
    const GenerationRequest next = next_turn(a, got.tokens[1], {403}, 200);
    ASSERT_TRUE(s.submit(next).is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(got.finish[2], FinishReason::kLength);
    EXPECT_EQ(got.cached[2], 64);
    EXPECT_EQ(s.stats().prefix_cache_evictions, 0);
    EXPECT_EQ(got.tokens[2], alone(next));
    EXPECT_TRUE(engine->memory().check_invariants().is_ok());
  }
}

// Offloading the prefix cache: a conversation's cached sequence evicted for another request's
// memory goes to host memory, and its next turn writes it back instead of computing it again.
TEST(Scheduler, AnEvictedConversationIsOffloadedAndItsNextTurnRestoresIt) {
  for (AdmissionPolicy policy : {AdmissionPolicy::kReserve, AdmissionPolicy::kPreempt}) {
    for (uint64_t budget : {uint64_t{64} << 20, uint64_t{100} << 10, uint64_t{0}}) {
      SCOPED_TRACE(std::string(policy == AdmissionPolicy::kReserve ? "reserve" : "preempt") + ", budget " +
                   std::to_string(budget));
      // Memory: 20 pages. A reaches 5 of them, B 16: B evicts A. A's next turn (6 pages) fits
      // beside A's restored 4 whole pages once B is evicted in turn.
      auto engine = pool_engine(2, 20);
      ASSERT_TRUE(engine);
      GeneratorOptions go;
      go.prefix_caching = true;
      go.admission = policy;
      go.prefix_offload_bytes = budget;
      Scheduler s(*engine, go);
      const GenerationRequest a = request(story_prompt(40), 30);
      const GenerationRequest b = request({1, 426}, 250);
      Collected got;
      for (const GenerationRequest& r : {a, b}) {
        ASSERT_TRUE(s.submit(r).is_ok());
        run_to_idle(s, got);
      }
      EXPECT_EQ(s.stats().prefix_cache_evictions, 1);
      const uint64_t page = engine->memory().kv_store().page_bytes() * 5;  // one page of every layer
      const bool kept_a = budget >= 4 * page, kept_b = budget >= 15 * page;
      EXPECT_EQ(s.stats().prefix_offloads, kept_a ? 1 : 0);
      EXPECT_EQ(s.prefix_store().offloaded_bytes(), kept_a ? 4 * page : 0);
      const GenerationRequest next = next_turn(a, got.tokens[1], {403, 407}, 20);
      ASSERT_TRUE(s.submit(next).is_ok());
      run_to_idle(s, got);
      EXPECT_EQ(got.finish[3], FinishReason::kLength);
      EXPECT_EQ(got.tokens[3], alone(next));
      EXPECT_EQ(got.cached[3], kept_a ? 64 : 0) << "A's cache held 69 tokens: 4 whole pages";
      EXPECT_EQ(s.stats().prefix_restores, kept_a ? 1 : 0);
      EXPECT_EQ(s.stats().prefix_cache_evictions, 2) << "B gave way to the next turn";
      EXPECT_EQ(s.stats().prefix_offloads, (kept_a ? 1 : 0) + (kept_b ? 1 : 0));
      EXPECT_EQ(s.prefix_store().offloaded_prefixes(), kept_b ? 1u : 0u) << "A left the store";
      EXPECT_EQ(s.prefix_store().offloaded_bytes(), kept_b ? 15 * page : 0);
      EXPECT_TRUE(engine->memory().check_invariants().is_ok());
    }
  }
}

// A full store drops its least recently used prefix first.
TEST(Scheduler, TheOffloadStoreKeepsItsBudgetLeastRecentlyUsedOut) {
  auto engine = pool_engine(2, 0, /*running=*/1);  // one slot for a cached sequence
  ASSERT_TRUE(engine);
  GeneratorOptions go;
  go.prefix_caching = true;
  const uint64_t page = engine->memory().kv_store().page_bytes() * 5;  // one page of every layer
  go.prefix_offload_bytes = 10 * page;                         // two prefixes of 4 pages
  Scheduler s(*engine, go);
  // Four unrelated conversations of 4 whole pages each (65 tokens cached): from the third on,
  // each evicts the least recently used cached one into the store.
  Collected got;
  const std::vector<GenerationRequest> reqs = four_conversations(s, got);
  EXPECT_EQ(s.stats().prefix_offloads, 2);
  EXPECT_EQ(s.prefix_store().offloaded_bytes(), 8 * page);
  // The first conversation's next turn: out of the store (the third's cache is evicted into it
  // for the slot), taken over and computed on from 64 tokens.
  const GenerationRequest next = next_turn(reqs[0], got.tokens[1], {407}, 10);
  ASSERT_TRUE(s.submit(next).is_ok());
  run_to_idle(s, got);
  EXPECT_EQ(got.cached[5], 64);
  EXPECT_EQ(got.tokens[5], alone(next));
  EXPECT_EQ(s.stats().prefix_restores, 1);
  EXPECT_EQ(s.stats().prefix_offloads, 3);
  EXPECT_EQ(s.stats().prefix_offload_drops, 0);
  // The fourth's cache goes too, and the store drops the second conversation (the oldest) for it.
  ASSERT_TRUE(s.submit(request({1, 378}, 10)).is_ok());
  run_to_idle(s, got);
  EXPECT_EQ(s.stats().prefix_offloads, 4);
  EXPECT_EQ(s.stats().prefix_offload_drops, 1);
  EXPECT_EQ(s.prefix_store().offloaded_prefixes(), 2u);
  EXPECT_EQ(s.prefix_store().offloaded_bytes(), 8 * page);
  EXPECT_EQ(s.stats().prefix_offload_peak_bytes, static_cast<int64_t>(8 * page));
  // The third conversation's next turn is restored; the second's, dropped, is computed again.
  for (size_t c : {size_t{2}, size_t{1}}) {
    const GenerationRequest turn = next_turn(reqs[c], got.tokens[static_cast<int64_t>(c + 1)], {}, 5);
    auto id = s.submit(turn);
    ASSERT_TRUE(id.is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(got.cached[id->value()], c == 1 ? 0 : 64) << c;
    EXPECT_EQ(got.tokens[id->value()], alone(turn)) << c;
  }
  EXPECT_TRUE(engine->memory().check_invariants().is_ok());
}

// The store holds one copy of a prefix: one that another extends is dropped for it, and one that
// a stored prefix extends is not stored again. (Requests with prompt_logprobs compute their whole
// prompt, so the same tokens can be cached twice.)
TEST(Scheduler, TheOffloadStoreKeepsTheLongerOfTwoPrefixesOfTheSameTokens) {
  auto engine = make_engine(2);
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefix_offload_bytes = uint64_t{64} << 20;
  Scheduler s(*engine, go);
  GenerationRequest shorter = request(story_prompt(40), 30);  // 69 tokens cached: 64 whole
  shorter.prompt_logprobs = 0;
  GenerationRequest longer = shorter;  // greedy: the same 29 tokens first, 96 whole in the end
  longer.max_new_tokens = 60;
  Collected got;
  // Unrelated requests of one whole page each evict them, the shorter first.
  for (const GenerationRequest& r : {shorter, longer, request({1, 426}, 20), request({1, 432}, 20)}) {
    ASSERT_TRUE(s.submit(r).is_ok());
    run_to_idle(s, got);
  }
  ASSERT_EQ(std::vector<TokenId>(got.tokens[2].begin(), got.tokens[2].begin() + 30), got.tokens[1]);
  EXPECT_EQ(s.stats().prefix_offloads, 2);
  EXPECT_EQ(s.stats().prefix_offload_drops, 1) << "the longer one's 96 tokens replaced the 64";
  EXPECT_EQ(s.prefix_store().offloaded_prefixes(), 1u);
  const uint64_t held = s.prefix_store().offloaded_bytes();
  // The same 64 tokens cached again and evicted: the store has them already.
  for (const GenerationRequest& r : {shorter, request({1, 298}, 20), request({1, 378}, 20)}) {
    ASSERT_TRUE(s.submit(r).is_ok());
    run_to_idle(s, got);
  }
  EXPECT_EQ(s.stats().prefix_offloads, 2 + 2) << "the two short unrelated ones only";
  EXPECT_EQ(s.prefix_store().offloaded_prefixes(), 3u);
  EXPECT_GT(s.prefix_store().offloaded_bytes(), held);
  EXPECT_TRUE(engine->memory().check_invariants().is_ok());
}

// The store's disk level: prefix files in a directory of the scheduler's own.
size_t prefix_files(const std::string& dir) {
  size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) n += entry.path().extension() == ".spxprefix";
  return n;
}

// With no host memory for the store, an evicted conversation's prefix goes to a file, and its
// next turn reads it back instead of computing it; the directory goes with the scheduler.
TEST(Scheduler, AnEvictedConversationGoesToDiskAndItsNextTurnReadsItBack) {
  auto engine = pool_engine(2, 20);  // as AnEvictedConversationIsOffloadedAndItsNextTurnRestoresIt
  ASSERT_TRUE(engine);
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefix_disk_bytes = uint64_t{64} << 20;
  go.prefix_disk_dir = ::testing::TempDir();
  std::string dir;
  {
    Scheduler s(*engine, go);
    const GenerationRequest a = request(story_prompt(40), 30);
    Collected got;
    for (const GenerationRequest& r : {a, request({1, 426}, 250)}) {
      ASSERT_TRUE(s.submit(r).is_ok());
      run_to_idle(s, got);
    }
    const uint64_t page = engine->memory().kv_store().page_bytes() * 5;  // one page of every layer
    EXPECT_EQ(s.stats().prefix_cache_evictions, 1);
    EXPECT_EQ(s.stats().prefix_offloads, 0) << "no host memory";
    EXPECT_EQ(s.stats().prefix_disk_writes, 1);
    EXPECT_EQ(s.prefix_store().prefixes_on_disk(), 1u);
    EXPECT_EQ(s.prefix_store().offloaded_prefixes(), 0u);
    EXPECT_GT(s.prefix_store().disk_bytes(), 4 * page) << "the KV of 4 pages, and the tokens";
    dir = s.prefix_store().prefix_disk_directory();
    ASSERT_FALSE(dir.empty());
    EXPECT_TRUE(std::filesystem::equivalent(std::filesystem::path(dir).parent_path(), go.prefix_disk_dir)) << dir;
    EXPECT_EQ(prefix_files(dir), 1u);
    const GenerationRequest next = next_turn(a, got.tokens[1], {403, 407}, 20);
    ASSERT_TRUE(s.submit(next).is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(got.tokens[3], alone(next));
    EXPECT_EQ(got.cached[3], 64) << "A's 4 whole pages came off the disk";
    EXPECT_EQ(s.stats().prefix_restores, 1);
    EXPECT_EQ(s.stats().prefix_disk_restores, 1);
    EXPECT_EQ(s.stats().prefix_disk_errors, 0) << s.prefix_store().last_prefix_disk_error();
    EXPECT_EQ(s.stats().prefix_disk_writes, 2) << "B went to disk for the next turn's room";
    EXPECT_EQ(s.prefix_store().prefixes_on_disk(), 1u) << "A's file was removed once read";
    EXPECT_EQ(prefix_files(dir), 1u);
    EXPECT_TRUE(engine->memory().check_invariants().is_ok());
  }
  EXPECT_FALSE(std::filesystem::exists(dir)) << "the scheduler removes its directory";
}

// prefix_disk_persist: a conversation's cache, written to its directory when the scheduler ends,
// answers its next turn in the next scheduler (a restarted process); the directory is locked
// while a scheduler has it, and a file of another model is removed and counted, not restored.
TEST(Scheduler, PersistentPrefixFilesOutliveTheSchedulerAndAnswerTheNextOne) {
  auto engine = pool_engine(2, 20);
  ASSERT_TRUE(engine);
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefix_disk_bytes = uint64_t{64} << 20;
  const std::filesystem::path base = std::filesystem::path(::testing::TempDir()) / "persist-test";
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base);
  go.prefix_disk_dir = base.string();
  go.prefix_disk_persist = true;
  const GenerationRequest a = request(story_prompt(40), 30);
  Collected first;
  std::string dir;
  {
    Scheduler s(*engine, go);
    ASSERT_TRUE(s.open_prefix_disk().is_ok());
    dir = s.prefix_store().prefix_disk_directory();
    EXPECT_EQ(std::filesystem::path(dir).parent_path(), base);
    {
      Scheduler other(*engine, go);  // a second process on the same directory
      const Status busy = other.open_prefix_disk();
      EXPECT_EQ(busy.code(), StatusCode::kUnavailable);
      EXPECT_NE(busy.message().find(dir), std::string::npos) << busy.message();
    }
    ASSERT_TRUE(s.submit(a).is_ok());
    run_to_idle(s, first);
    EXPECT_EQ(s.stats().prefix_disk_writes, 0) << "cached in the pool while it runs";
    EXPECT_EQ(prefix_files(dir), 0u);
  }
  EXPECT_EQ(prefix_files(dir), 1u) << "written at the end";
  EXPECT_TRUE(std::filesystem::exists(dir));
  EXPECT_EQ(engine->memory().live_sequences(), 0);
  const GenerationRequest next = next_turn(a, first.tokens[1], {403, 407}, 20);
  {
    Scheduler s(*engine, go);
    ASSERT_TRUE(s.open_prefix_disk().is_ok());
    EXPECT_EQ(s.stats().prefix_disk_found, 1);
    EXPECT_EQ(s.prefix_store().prefixes_on_disk(), 1u);
    Collected got;
    ASSERT_TRUE(s.submit(next).is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(got.tokens[1], alone(next));
    EXPECT_EQ(got.cached[1], 64) << "the 4 whole pages of the last scheduler's file";
    EXPECT_EQ(s.stats().prefix_disk_restores, 1);
    EXPECT_EQ(s.stats().prefix_disk_errors, 0) << s.prefix_store().last_prefix_disk_error();
  }
  // The same file under another identity: removed at open, counted, and the prompt computed.
  ASSERT_EQ(prefix_files(dir), 1u);
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".spxprefix") continue;
    std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(12);  // the identity, after the magic and the version
    const char byte = static_cast<char>(f.get() ^ 0xff);
    f.seekp(12);
    f.put(byte);
  }
  {
    Scheduler s(*engine, go);
    ASSERT_TRUE(s.open_prefix_disk().is_ok());
    EXPECT_EQ(s.stats().prefix_disk_found, 0);
    EXPECT_EQ(s.stats().prefix_disk_errors, 1);
    EXPECT_NE(s.prefix_store().last_prefix_disk_error().find("'identity'"), std::string::npos)
        << s.prefix_store().last_prefix_disk_error();
    EXPECT_EQ(prefix_files(dir), 0u);
    Collected got;
    ASSERT_TRUE(s.submit(next).is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(got.tokens[1], alone(next));
    EXPECT_EQ(got.cached[1], 0);
  }
  // Without a directory the option is refused.
  go.prefix_disk_dir.clear();
  Scheduler no_dir(*engine, go);
  EXPECT_EQ(no_dir.open_prefix_disk().code(), StatusCode::kInvalidArgument);
  std::filesystem::remove_all(base);
}

// Host memory full: its least recently used prefix goes to disk rather than being dropped, and is
// read back from there; disk full: its least recently used file is removed.
TEST(Scheduler, HostMemoryLetsItsOldestPrefixGoToDiskAndTheDiskItsOldestFile) {
  for (bool disk_fits_one : {false, true}) {
    SCOPED_TRACE(disk_fits_one ? "disk for one prefix" : "disk for all");
    auto engine = pool_engine(2, 0, /*running=*/1);  // as TheOffloadStoreKeepsItsBudgetLeastRecentlyUsedOut
    ASSERT_TRUE(engine);
    GeneratorOptions go;
    go.prefix_caching = true;
    const uint64_t page = engine->memory().kv_store().page_bytes() * 5;  // one page of every layer
    go.prefix_offload_bytes = 5 * page;                          // one prefix of 4 pages
    go.prefix_disk_bytes = disk_fits_one ? 6 * page : uint64_t{64} << 20;
    Scheduler s(*engine, go);
    Collected got;
    const std::vector<GenerationRequest> reqs = four_conversations(s, got);
    // The first two conversations were evicted, the first from host memory to disk for the second.
    EXPECT_EQ(s.stats().prefix_offloads, 2);
    EXPECT_EQ(s.stats().prefix_disk_writes, 1);
    EXPECT_EQ(s.stats().prefix_offload_drops, 0);
    EXPECT_EQ(s.prefix_store().offloaded_prefixes(), 1u);
    EXPECT_EQ(s.prefix_store().prefixes_on_disk(), 1u);
    EXPECT_EQ(s.prefix_store().offloaded_bytes(), 4 * page);
    // The first conversation's next turn comes off the disk; the third's cache goes to host
    // memory for the slot, and the second's prefix from there to disk, except on a disk for one
    // prefix: the first's file counts until it has been read back, so the second is dropped.
    const GenerationRequest next = next_turn(reqs[0], got.tokens[1], {407}, 10);
    ASSERT_TRUE(s.submit(next).is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(got.cached[5], 64);
    EXPECT_EQ(got.tokens[5], alone(next));
    EXPECT_EQ(s.stats().prefix_disk_restores, 1);
    EXPECT_EQ(s.stats().prefix_disk_writes, disk_fits_one ? 1 : 2);
    EXPECT_EQ(s.stats().prefix_offload_drops, disk_fits_one ? 1 : 0);
    EXPECT_EQ(s.prefix_store().prefixes_on_disk(), disk_fits_one ? 0u : 1u);
    // One more conversation: the fourth's cache goes to host memory, the third's from there to disk.
    ASSERT_TRUE(s.submit(request({1, 378}, 10)).is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(s.stats().prefix_disk_writes, disk_fits_one ? 2 : 3);
    EXPECT_EQ(s.prefix_store().prefixes_on_disk(), disk_fits_one ? 1u : 2u);
    // The second conversation's next turn: read back, or computed when it was dropped. The first's
    // next turn goes to host memory for the slot and the fourth's from there to disk; a disk for
    // one prefix removes the third's file for it.
    const GenerationRequest turn = next_turn(reqs[1], got.tokens[2], {}, 5);
    ASSERT_TRUE(s.submit(turn).is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(got.cached[7], disk_fits_one ? 0 : 64);
    EXPECT_EQ(got.tokens[7], alone(turn));
    EXPECT_EQ(s.stats().prefix_disk_restores, disk_fits_one ? 1 : 2);
    EXPECT_EQ(s.stats().prefix_disk_writes, disk_fits_one ? 3 : 4);
    EXPECT_EQ(s.stats().prefix_disk_drops, disk_fits_one ? 1 : 0);
    EXPECT_EQ(s.prefix_store().prefixes_on_disk(), disk_fits_one ? 1u : 2u);
    EXPECT_LE(s.prefix_store().disk_bytes(), go.prefix_disk_bytes);
    EXPECT_EQ(prefix_files(s.prefix_store().prefix_disk_directory()), s.prefix_store().prefixes_on_disk());
    EXPECT_LE(static_cast<uint64_t>(s.stats().prefix_disk_peak_bytes), go.prefix_disk_bytes);
    EXPECT_EQ(s.stats().prefix_disk_errors, 0) << s.prefix_store().last_prefix_disk_error();
    EXPECT_TRUE(engine->memory().check_invariants().is_ok());
  }
}

// A prefix file that is damaged, gone, or never written costs only its recomputation: the error
// is counted and kept, the file dropped, and the request gets its tokens.
TEST(Scheduler, AFileThatCannotBeReadBackOrWrittenIsDroppedAndThePromptComputed) {
  for (const std::string damage : {"flip", "truncate", "remove", "unwritable"}) {
    SCOPED_TRACE(damage);
    auto engine = pool_engine(2, 20);
    ASSERT_TRUE(engine);
    GeneratorOptions go;
    go.prefix_caching = true;
    go.prefix_disk_bytes = uint64_t{64} << 20;
    go.prefix_disk_dir = damage == "unwritable" ? "/nonexistent-dir" : ::testing::TempDir();
    Scheduler s(*engine, go);
    const GenerationRequest a = request(story_prompt(40), 30);
    Collected got;
    for (const GenerationRequest& r : {a, request({1, 426}, 250)}) {
      ASSERT_TRUE(s.submit(r).is_ok());
      run_to_idle(s, got);
    }
    std::string file;
    if (damage == "unwritable") {
      EXPECT_EQ(s.stats().prefix_disk_errors, 1);
      EXPECT_NE(s.prefix_store().last_prefix_disk_error().find("/nonexistent-dir"), std::string::npos)
          << s.prefix_store().last_prefix_disk_error();
      EXPECT_EQ(s.prefix_store().prefixes_on_disk(), 0u);
    } else {
      ASSERT_EQ(s.prefix_store().prefixes_on_disk(), 1u);
      for (const auto& entry : std::filesystem::directory_iterator(s.prefix_store().prefix_disk_directory()))
        file = entry.path();
      const auto size = std::filesystem::file_size(file);
      if (damage == "flip") {
        std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(static_cast<std::streamoff>(size / 2));
        f.put('\x5a');
      } else if (damage == "truncate") {
        std::filesystem::resize_file(file, size - 100);
      } else {
        std::filesystem::remove(file);
      }
    }
    const GenerationRequest next = next_turn(a, got.tokens[1], {403, 407}, 20);
    ASSERT_TRUE(s.submit(next).is_ok());
    run_to_idle(s, got);
    EXPECT_EQ(got.finish[3], FinishReason::kLength);
    EXPECT_EQ(got.tokens[3], alone(next));
    EXPECT_EQ(got.cached[3], 0) << "computed";
    EXPECT_EQ(s.stats().prefix_disk_restores, 0);
    if (damage != "unwritable") {
      EXPECT_EQ(s.stats().prefix_disk_errors, 1);
      EXPECT_NE(s.prefix_store().last_prefix_disk_error().find(file), std::string::npos)
          << s.prefix_store().last_prefix_disk_error();
      EXPECT_NE(
          s.prefix_store().last_prefix_disk_error().find(damage == "remove" ? "cannot open" : "'crc32'"),
          std::string::npos)
          << s.prefix_store().last_prefix_disk_error();
      EXPECT_FALSE(std::filesystem::exists(file));
    }
    EXPECT_TRUE(engine->memory().check_invariants().is_ok());
  }
}

// Swap preemption: under the pool of PreemptingAdmissionRunsRequestsTogetherAndRecomputes..., a
// preempted request's whole pages go to the offload store (host memory, or disk) and come back
// when it runs again, each once; only what is short of a page is computed. The tokens are the
// alone ones, as with recompute, for fewer prompt tokens computed.
TEST(Scheduler, APreemptedRequestIsSwappedOutAndItsPagesComeBackOnce) {
  const std::vector<GenerationRequest> reqs{
      request({1, 403, 407, 261, 378}, 195), request({1, 426}, 198),
      request({1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315}, 150, 0.8f)};
  std::vector<std::vector<TokenId>> expected;
  int64_t submitted_prompt_tokens = 0;
  for (const auto& r : reqs) {
    expected.push_back(alone(r));
    submitted_prompt_tokens += static_cast<int64_t>(r.prompt.size());
  }
  enum class Mode { kRecompute, kSwapToHost, kSwapToDisk };
  std::map<Mode, GenerationStats> stats;
  for (Mode mode : {Mode::kRecompute, Mode::kSwapToHost, Mode::kSwapToDisk}) {
    SCOPED_TRACE(mode == Mode::kRecompute    ? "recompute"
                 : mode == Mode::kSwapToHost ? "swap to host"
                                             : "swap to disk");
    auto engine = pool_engine(3, 20);  // 320 tokens; the three requests reach 200 + 200 + 162
    ASSERT_TRUE(engine);
    GeneratorOptions go;
    go.admission = AdmissionPolicy::kPreempt;
    go.prefill_chunk = 64;
    go.prefix_caching = true;
    go.swap_preempted = mode != Mode::kRecompute;
    go.prefix_offload_bytes = mode == Mode::kSwapToHost ? uint64_t{64} << 20 : 0;
    go.prefix_disk_bytes = mode == Mode::kSwapToDisk ? uint64_t{64} << 20 : 0;
    go.prefix_disk_dir = ::testing::TempDir();
    Scheduler s(*engine, go);
    for (const auto& r : reqs) ASSERT_TRUE(s.submit(r).is_ok());
    Collected got;
    run_to_idle(s, got);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got.finish[static_cast<int64_t>(i + 1)], FinishReason::kLength) << i;
      EXPECT_EQ(got.tokens[static_cast<int64_t>(i + 1)], expected[i]) << "request " << i;
    }
    const GenerationStats& st = s.stats();
    EXPECT_GE(st.preemptions, 1) << "the pool was too small for all three at their final lengths";
    // Every restore is a swap-in, one for each swap-out (a prefix restored while its request
    // still had to wait would be evicted, offloaded and restored again).
    EXPECT_EQ(st.prefix_restores, st.preemption_swaps);
    EXPECT_EQ(st.prefix_disk_errors, 0) << s.prefix_store().last_prefix_disk_error();
    if (mode == Mode::kRecompute) {
      EXPECT_EQ(st.preemption_swaps, 0);
    } else {
      EXPECT_EQ(st.preemption_swaps, st.preemptions) << "each preempted request held a whole page";
      // Each swap-in computes less than a page (16 tokens) and the token not yet fed.
      EXPECT_LE(st.prompt_tokens, submitted_prompt_tokens + st.preemptions * 16);
      EXPECT_EQ(st.prefix_disk_restores, mode == Mode::kSwapToDisk ? st.preemption_swaps : 0);
    }
    EXPECT_TRUE(engine->memory().check_invariants().is_ok());
    stats[mode] = st;
  }
  EXPECT_GT(stats[Mode::kRecompute].prompt_tokens,
            submitted_prompt_tokens + stats[Mode::kRecompute].preemptions * 16)
      << "recompute computes each preempted request's tokens again";
  std::fprintf(stderr, "prompt tokens computed: recompute %lld (%lld preemptions), swap %lld (%lld swaps)\n",
               static_cast<long long>(stats[Mode::kRecompute].prompt_tokens),
               static_cast<long long>(stats[Mode::kRecompute].preemptions),
               static_cast<long long>(stats[Mode::kSwapToHost].prompt_tokens),
               static_cast<long long>(stats[Mode::kSwapToHost].preemption_swaps));
}

// Prefix caching under load: shared system prompts, conversations that continue finished ones,
// sampled and greedy requests, cancels, a pool too small for everyone (preemption, eviction) and
// slots for cached sequences; the KV invariants after every step, and every request that ends
// gets exactly the tokens it gets alone on an engine without caching.
// The naive reference kernels: each row's sums in one order whatever the batch's shape, so that
// sparse selections (top-k over near ties) do not depend on how prompts were chunked or forked.
// (oneDNN's GEMM rounds a row differently at another M; dense attention shrugs that off.)
std::shared_ptr<Backend> reference_backend() {
  cpu::CpuBackendOptions o;
  o.reference = true;
  o.num_threads = 1;
  auto b = cpu::create_cpu_backend(o);
  EXPECT_TRUE(b.is_ok());
  return std::shared_ptr<Backend>(std::move(*b));
}

// Where evicted prefixes go: nowhere, host memory, or a little host memory and then disk.
enum class OffloadStore { kNone, kHost, kHostAndDisk };
// Param: the method, and the offload store.
class PrefixCachingUnderLoad : public ::testing::TestWithParam<std::tuple<SparseMethod, OffloadStore>> {};

TEST_P(PrefixCachingUnderLoad, EveryRequestGetsItsAloneTokens) {
  auto loaded = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  ASSERT_TRUE(loaded.is_ok());
  std::shared_ptr<const Model> model = *loaded;
  EngineOptions eo;
  const auto [method, store] = GetParam();
  eo.sparse.method = method;
  eo.sparse.selection = {32, 1, 4};  // sparse decode past 32 tokens
  if (method == SparseMethod::kSpeContext) {
    auto head =
        load_eagle3_head(testing::repo_path("models/stories260K/retrieval_head.safetensors"), model->config);
    ASSERT_TRUE(head.is_ok()) << head.status().to_string();
    eo.retrieval_head = *head;
  }
  auto alone_tokens = [&](const GenerationRequest& r) {
    EngineOptions one = eo;  // without the sharing, slots and pool set below
    one.max_sequences = 1;
    one.max_running = 0;
    one.kv_pages = 0;
    one.prefix_sharing = false;
    auto e = Engine::create(model, reference_backend(), one);
    EXPECT_TRUE(e.is_ok());
    Generator g(**e, GeneratorOptions{});  // one prefill chunk, not the 24-token ones below
    auto res = g.run({r});
    EXPECT_TRUE(res.is_ok());
    return res.is_ok() ? (*res)[0].tokens : std::vector<TokenId>{};
  };
  eo.prefix_sharing = true;
  eo.max_sequences = 6;
  eo.max_running = 3;
  eo.kv_pages = 20;  // 320 tokens for up to three running requests of up to 150: some give way
  auto engine = Engine::create(model, reference_backend(), eo);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  GeneratorOptions go;
  go.prefix_caching = true;
  go.admission = AdmissionPolicy::kPreempt;
  go.prefill_chunk = 24;
  // 256 KiB: about 12 pages of every layer; 64 KiB about 3, the rest to disk.
  go.prefix_offload_bytes = store == OffloadStore::kHost ? uint64_t{256} << 10
                            : store == OffloadStore::kHostAndDisk ? uint64_t{64} << 10
                                                                  : 0;
  go.prefix_disk_bytes = store == OffloadStore::kHostAndDisk ? uint64_t{1} << 20 : 0;
  Scheduler s(**engine, go);

  std::mt19937 rng(11);
  auto random_ids = [&](size_t n) {
    std::vector<TokenId> t(n);
    for (auto& x : t) x = static_cast<TokenId>(3 + rng() % 500);
    return t;
  };
  std::vector<std::vector<TokenId>> systems;
  for (size_t n : {20u, 37u, 50u}) {
    std::vector<TokenId> p{1};
    for (TokenId t : random_ids(n)) p.push_back(t);
    systems.push_back(std::move(p));
  }
  const bool multi_turn = method == SparseMethod::kDense;
  std::map<int64_t, GenerationRequest> submitted;
  std::set<int64_t> cancelled;
  Collected got;
  std::vector<SchedulerEvent> ev;
  const int kRequests = 24;
  for (int step = 0; step < 6000 && (static_cast<int>(submitted.size()) < kRequests || !s.idle()); ++step) {
    if (static_cast<int>(submitted.size()) < kRequests && rng() % 3 == 0) {
      GenerationRequest r = request({}, 5 + rng() % 30, rng() % 2 ? 0.8f : 0.0f);
      r.sampling.seed = rng();
      std::vector<int64_t> done;
      for (const auto& [id, reason] : got.finish) {
        if (reason == FinishReason::kLength && !cancelled.count(id)) done.push_back(id);
      }
      // The next turn of a finished conversation, under dense attention only: a sparse method's
      // generated tokens have the KV their sparse decode gave them, which a fresh dense prefill
      // of the same tokens does not reproduce (and need not: it is what the model saw).
      if (multi_turn && !done.empty() && rng() % 3 == 0) {
        const int64_t prev = done[rng() % done.size()];
        r.prompt = submitted[prev].prompt;
        r.prompt.insert(r.prompt.end(), got.tokens[prev].begin(), got.tokens[prev].end());
      } else {
        r.prompt = systems[rng() % systems.size()];
      }
      for (TokenId t : random_ids(rng() % 20)) r.prompt.push_back(t);
      if (r.prompt.size() + static_cast<size_t>(r.max_new_tokens) > 150) continue;
      auto id = s.submit(r);
      ASSERT_TRUE(id.is_ok()) << id.status().to_string();
      submitted[id->value()] = std::move(r);
    }
    if (!submitted.empty() && rng() % 40 == 0) {  // cancel one now and then
      const auto it = std::next(submitted.begin(), static_cast<std::ptrdiff_t>(rng() % submitted.size()));
      const bool keep_cached = rng() % 2 == 0;
      if (!got.finish.count(it->first) && s.cancel(RequestId(it->first), keep_cached))
        cancelled.insert(it->first);
    }
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    collect(ev, got);
    ASSERT_TRUE((*engine)->memory().check_invariants().is_ok())
        << "step " << step << ": " << (*engine)->memory().check_invariants().to_string();
  }
  ASSERT_TRUE(s.idle());
  int checked = 0;
  for (const auto& [id, r] : submitted) {
    if (cancelled.count(id)) continue;
    ASSERT_TRUE(got.finish.count(id)) << "request " << id << " never ended";
    EXPECT_EQ(got.finish[id], FinishReason::kLength) << id;
    EXPECT_EQ(got.tokens[id], alone_tokens(r))
        << "request " << id << " (" << r.prompt.size() << " prompt tokens, " << got.cached[id]
        << " from the cache, temperature " << r.sampling.temperature << ")";
    ++checked;
  }
  EXPECT_GE(checked, kRequests / 2);
  EXPECT_GT(s.stats().cached_prompt_tokens, 0);
  EXPECT_GT(s.stats().prefix_cache_evictions + s.stats().preemptions, 0) << "the pool was tight";
  if (store != OffloadStore::kNone) {
    EXPECT_GT(s.stats().prefix_restores, 0);
    EXPECT_LE(s.prefix_store().offloaded_bytes(), go.prefix_offload_bytes);
  }
  if (store == OffloadStore::kHostAndDisk) {
    EXPECT_GT(s.stats().prefix_disk_restores, 0);
    EXPECT_EQ(s.stats().prefix_disk_errors, 0) << s.prefix_store().last_prefix_disk_error();
    EXPECT_LE(static_cast<uint64_t>(s.stats().prefix_disk_peak_bytes), go.prefix_disk_bytes);
  }
  std::fprintf(stderr,
               "cached %lld prompt tokens, computed %lld; %lld preemptions, %lld evictions, %lld waits; "
               "%lld offloaded, %lld restored, %lld dropped; %lld written to disk, %lld read back\n",
               static_cast<long long>(s.stats().cached_prompt_tokens), static_cast<long long>(s.stats().prompt_tokens),
               static_cast<long long>(s.stats().preemptions), static_cast<long long>(s.stats().prefix_cache_evictions),
               static_cast<long long>(s.stats().prefix_waits), static_cast<long long>(s.stats().prefix_offloads),
               static_cast<long long>(s.stats().prefix_restores), static_cast<long long>(s.stats().prefix_offload_drops),
               static_cast<long long>(s.stats().prefix_disk_writes), static_cast<long long>(s.stats().prefix_disk_restores));
}

INSTANTIATE_TEST_SUITE_P(Methods, PrefixCachingUnderLoad,
                         ::testing::Combine(::testing::Values(SparseMethod::kDense, SparseMethod::kSpeContext,
                                                              SparseMethod::kQuest),
                                            ::testing::Values(OffloadStore::kNone, OffloadStore::kHost,
                                                              OffloadStore::kHostAndDisk)),
                         [](const auto& info) {
                           const OffloadStore store = std::get<1>(info.param);
                           return std::string(sparse_method_name(std::get<0>(info.param))) +
                                  (store == OffloadStore::kHost          ? "_offload"
                                   : store == OffloadStore::kHostAndDisk ? "_offload_disk"
                                                                         : "");
                         });

}  // namespace
}  // namespace specontext
