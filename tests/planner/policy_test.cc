// PlannerPolicy, the engine's placement policy over plan()/replan(): layers leave at the
// thresholds as lengths grow, come back only with the hysteresis margin, a wobbling length moves
// nothing, admission names what does not fit, and disallowed CPU filtering is a refusal.
#include <gtest/gtest.h>

#include "planner/planner_policy.h"

namespace specontext::planner {
namespace {

// 4 layers, 2 KV heads of 16 (kvc = 8 with f32): a token costs 256 B per layer on the device.
PolicyConfig config(bool allow_filtering = true) {
  PolicyConfig pc;
  pc.base.model = ModelShape{4, 2, 16, 4, 2};
  pc.base.kv_elem_bytes = 4;
  pc.base.model_bytes = 0;
  pc.base.head_bytes = 0;
  pc.base.runtime_factor = 1.0;
  pc.base.budget = 8;
  pc.base.requests = 1;
  pc.base.host.push_back({0, 1 << 20, 10e9});
  pc.base.retrieval_bytes_per_token = 128;  // K only: 2 heads × 16 × 4 B
  pc.allow_cpu_filtering = allow_filtering;
  pc.page_size = 1;
  pc.chunk_bytes = 0;
  return pc;
}

PlacementInput input(int64_t len, const KvPlacement& current, uint64_t device = 64 << 10) {
  PlacementInput in;
  in.seq_lens = {len};
  in.current = current;
  TierDescription d;
  d.id = TierId(0);
  d.kind = TierKind::kDevice;
  d.capacity_bytes = device;
  TierDescription h;
  h.id = TierId(1);
  h.kind = TierKind::kHost;
  h.capacity_bytes = 1 << 20;
  in.tiers = {d, h};
  in.tier_used_bytes = {0, 0};
  return in;
}

int offloaded(const KvPlacement& p) {
  int n = 0;
  for (TierId t : p.layer_home) n += t != TierId(0);
  return n;
}

TEST(PlannerPolicy, LayersLeaveAtThresholdsAndComeBackWithHysteresis) {
  auto policy = PlannerPolicy::create(config());
  ASSERT_TRUE(policy.is_ok()) << policy.status().to_string();
  KvPlacement current;
  current.layer_home.assign(4, TierId(0));
  // 64 KiB: S^T_0 = 65536 / (4·256 + 128) = 56.
  auto th = [&] { return *(*policy)->current_thresholds(); };
  int max_off = 0;
  std::vector<int> trace;
  for (int64_t len = 1; len <= 120; ++len) {
    auto d = (*policy)->decide(input(len, current));
    ASSERT_TRUE(d.is_ok()) << "len " << len << ": " << d.status().to_string();
    if (d->changed) {
      ASSERT_FALSE(d->reasons.empty()) << "a change without a reason at len " << len;
      current = d->placement;
    }
    trace.push_back(offloaded(current));
    max_off = std::max(max_off, offloaded(current));
    // Never more layers resident than the thresholds allow.
    EXPECT_GE(offloaded(current), layers_to_offload(th(), len)) << "len " << len;
  }
  EXPECT_EQ(th()[0], 56);
  EXPECT_GT(max_off, 0);
  // Offloading only grows while the length grows.
  for (size_t i = 1; i < trace.size(); ++i) EXPECT_GE(trace[i], trace[i - 1]);
  // A length wobbling just around S^T_1 moves nothing.
  const int64_t s1 = th()[1];
  KvPlacement at_s1 = current;
  int changes = 0;
  for (int i = 0; i < 40; ++i) {
    const int64_t len = s1 + (i % 2 == 0 ? 1 : -1);
    auto d = (*policy)->decide(input(len, at_s1));
    ASSERT_TRUE(d.is_ok());
    if (d->changed) {
      ++changes;
      at_s1 = d->placement;
    }
  }
  EXPECT_LE(changes, 1) << "wobbling around S^T_1 must not oscillate";
  // The sequence finishes: a short one brings every layer back (well below S^T_0·(1 − 10%)).
  auto back = (*policy)->decide(input(4, at_s1));
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(offloaded(back->placement), 0);
  bool said_return = false;
  for (const auto& r : back->reasons) said_return = said_return || r.rfind("return to device", 0) == 0;
  EXPECT_TRUE(said_return);
}

TEST(PlannerPolicy, AdmissionAndFilteringRefusalsNameWhatDoesNotFit) {
  auto policy = PlannerPolicy::create(config(/*allow_filtering=*/false));
  ASSERT_TRUE(policy.is_ok());
  KvPlacement current;
  current.layer_home.assign(4, TierId(0));
  EXPECT_TRUE((*policy)->admit(input(10, current), 40, true).is_ok());
  // The plan is sized for R = 1: a second sequence beside the live one does not fit.
  const Status second = (*policy)->admit(input(10, current), 40, false);
  EXPECT_EQ(second.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(second.message().find("requests"), std::string::npos) << second.message();
  // Beyond S^T_L the head's keys need CPU filtering, which is off here.
  const Status far = (*policy)->admit(input(10, current), 100000, true);
  EXPECT_EQ(far.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(far.message().find("tokens"), std::string::npos) << far.message();
  auto d = (*policy)->decide(input(100000, current));
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), StatusCode::kResourceExhausted);
  // A device tier smaller than the engine's other needs: clear, not a planner crash.
  PlacementInput tiny = input(10, current, 1024);
  tiny.device_other_bytes = 4096;
  const Status s = (*policy)->admit(tiny, 10, true);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("cannot be placed"), std::string::npos) << s.message();
  // Tiers the base snapshot does not describe are an error, not a guess.
  PlacementInput one = input(10, current);
  one.tiers.resize(1);
  EXPECT_EQ((*policy)->decide(one).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specontext::planner
