// One request at a time on a Scheduler, for the tests of what it keeps between requests (its
// prefix cache and the stores behind it).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "serving/scheduler.h"

namespace specontext::testing {

// A request for `n` tokens after `prompt` (greedy unless `temperature` is given; seed 7).
inline GenerationRequest request(std::vector<TokenId> prompt, int64_t n, float temperature = 0.0f) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = n;
  r.sampling.temperature = temperature;
  r.sampling.seed = 7;
  return r;
}

// Submits `r` and steps `s` until it is idle (5000 steps at most): the tokens `r` got; `cached`
// (if given): the prompt tokens it took from the prefix cache, as its finished event says.
inline std::vector<TokenId> run_request(Scheduler& s, const GenerationRequest& r, int64_t* cached = nullptr) {
  auto id = s.submit(r);
  EXPECT_TRUE(id.is_ok()) << id.status().to_string();
  std::vector<TokenId> tokens;
  if (!id.is_ok()) return tokens;
  std::vector<SchedulerEvent> ev;
  for (int i = 0; i < 5000 && !s.idle(); ++i) {
    ev.clear();
    EXPECT_TRUE(s.step(ev).is_ok());
    for (const SchedulerEvent& e : ev) {
      if (!(e.request == *id)) continue;
      if (!e.finished) tokens.push_back(e.token);
      if (e.finished && cached) *cached = e.cached_prompt_tokens;
    }
  }
  EXPECT_TRUE(s.idle());
  return tokens;
}

}  // namespace specontext::testing
