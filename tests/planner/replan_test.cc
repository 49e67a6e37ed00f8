// Online re-planning: offload at once when S crosses S^T_i, come back only once S is `margin` below,
// so a length wobbling around a threshold never flip-flops; every change is a migration with a reason.
#include <gtest/gtest.h>

#include "planner/plan.h"

namespace specontext::planner {
namespace {

// Hand model (see thresholds_test.cc): S^T = {10, 11, 13, 16, 20}; with a 10% margin the return
// points floor(0.9·S^T_i) are {9, 9, 11, 14, 18}. One token of one layer = 16 B.
PlannerSnapshot tiny(int64_t seq, std::vector<HostPool> host = {{0, 100000, 10e9}}) {
  PlannerSnapshot s;
  s.model = {4, 1, 4, 2, 0};
  s.kv_elem_bytes = 2;
  s.model_bytes = 100;
  s.budget = 2;
  s.requests = 1;
  s.device_bytes = 1250;
  s.host = std::move(host);
  s.host_to_host_bandwidth_bps = 8e9;
  s.seq_lens = {seq};
  return s;
}

struct Step {
  int64_t seq;
  int64_t offloaded;
  size_t migrations;
};

TEST(PlannerReplan, RiseThenFallWithoutFlipFlop) {
  auto p = plan(tiny(5));
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  Plan cur = *p;
  const std::vector<Step> steps = {
      {9, 0, 0},
      {10, 1, 1},   // S ≥ S^T_0 = 10: layer 3 leaves
      {9, 1, 0},    // below S^T_0 but not below 9 (= 0.9·10): stays
      {10, 1, 0},   // wobbling around S^T_0: nothing moves
      {9, 1, 0},
      {10, 1, 0},
      {11, 2, 1},   // S ≥ S^T_1 = 11: layer 2 leaves
      {10, 2, 0},   // 10 < S^T_1 but ≥ 9: stays
      {11, 2, 0},
      {10, 2, 0},
      {16, 4, 2},   // S ≥ S^T_3 = 16: layers 1 and 0 leave together
      {15, 4, 0},   // ≥ 0.9·16 = 14: stays
      {14, 4, 0},   // S^T_4 · 0.9 = 18 > 14 but S^T_3 · 0.9 = 14 is not > 14 → still 4
      {13, 3, 1},   // 13 < 14: layer 0 returns (3 stay: 13 < floor(0.9·S^T_3) = 14)
      {12, 3, 0},   // 12 ≥ floor(0.9·S^T_2) = 11: 3 stay
      {10, 2, 1},   // 10 < 11: layer 1 returns
      {8, 0, 2},    // 8 < 9: everything returns
      {9, 0, 0},
  };
  int64_t total_migrations = 0;
  for (const Step& st : steps) {
    auto next = replan(cur, tiny(st.seq));
    ASSERT_TRUE(next.is_ok()) << "S = " << st.seq << ": " << next.status().to_string();
    EXPECT_EQ(next->offloaded_layers, st.offloaded) << "S = " << st.seq;
    EXPECT_EQ(next->migrations.size(), st.migrations) << "S = " << st.seq;
    for (const Migration& m : next->migrations) EXPECT_FALSE(m.reason.empty());
    total_migrations += static_cast<int64_t>(next->migrations.size());
    // The offloaded layers are always the last ones (Algorithm 1).
    for (int64_t l = 0; l < 4; ++l) {
      EXPECT_EQ(next->layers[static_cast<size_t>(l)].home == TierId(0), l < 4 - st.offloaded) << l;
    }
    cur = *next;
  }
  EXPECT_EQ(total_migrations, 8);  // 4 out, 4 back: each layer moved exactly twice
}

TEST(PlannerReplan, MigrationsCarryBytesReasonsAndEstimates) {
  Plan cur = *plan(tiny(9));
  auto up = replan(cur, tiny(11));  // S^T_1 = 11 ≤ 11 < 13: layers 3 and 2 leave at once
  ASSERT_TRUE(up.is_ok()) << up.status().to_string();
  ASSERT_EQ(up->migrations.size(), 2u);
  const Migration& m = up->migrations[0];
  EXPECT_EQ(m.item, MigrationItem::kLayerKv);
  EXPECT_EQ(m.layer, LayerId(3));
  EXPECT_EQ(m.from, TierId(0));
  EXPECT_EQ(m.to, TierId(1));
  EXPECT_EQ(m.bytes, 11 * 16);
  EXPECT_DOUBLE_EQ(m.est_seconds, 176.0 / 10e9);
  EXPECT_EQ(m.reason, "offload: S = 11 >= S^T_0 = 10");
  EXPECT_EQ(up->migrations[1].layer, LayerId(2));
  EXPECT_EQ(up->migrations[1].reason, "offload: S = 11 >= S^T_1 = 11");

  auto down = replan(*up, tiny(8));
  ASSERT_TRUE(down.is_ok());
  ASSERT_EQ(down->migrations.size(), 2u);
  EXPECT_EQ(down->migrations[0].from, TierId(1));
  EXPECT_EQ(down->migrations[0].to, TierId(0));
  EXPECT_EQ(down->migrations[0].bytes, 8 * 16);
  EXPECT_EQ(down->migrations[0].reason,
            "return to device: S = 8 < S^T_0 x (1 - 10%) = 9; 0 layers stay offloaded");
}

TEST(PlannerReplan, ZeroMarginFollowsThresholdsExactly) {
  Plan cur = *plan(tiny(10));
  EXPECT_EQ(cur.offloaded_layers, 1);
  auto next = replan(cur, tiny(9), HysteresisOptions{0.0});
  ASSERT_TRUE(next.is_ok());
  EXPECT_EQ(next->offloaded_layers, 0);
  EXPECT_EQ(replan(cur, tiny(9), HysteresisOptions{1.5}).status().code(), StatusCode::kInvalidArgument);
}

// Tier hysteresis: host0 is fast (700 B), host1 slow and large. At S = 18 (4 layers, 288 B each)
// layers 3, 2 → host0 (576), 1 and 0 → host1. As S falls the layers shrink; layer 1 re-enters host0
// only when host0 has 10% to spare: used + bytes ≤ floor(0.9·700) = 630.
TEST(PlannerReplan, FasterTierReenteredOnlyWithMargin) {
  const std::vector<HostPool> host = {{0, 700, 20e9}, {1, 100000, 5e9}};
  auto p = plan(tiny(18, host));
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->layers[1].home, TierId(2));
  EXPECT_EQ(p->layers[2].home, TierId(1));

  // S = 14: still 4 offloaded (14 ≥ floor(0.9·16) = 14); layers are 224 B; layer 1 would fit host0
  // exactly (448 + 224 = 672 ≤ 700) but not with margin (672 > 630): it stays on host1.
  auto a = replan(*p, tiny(14, host));
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_EQ(a->offloaded_layers, 4);
  EXPECT_TRUE(a->migrations.empty());
  EXPECT_EQ(a->layers[1].home, TierId(2));
  // A fresh plan at the same length would put it on host0: the difference is the hysteresis.
  EXPECT_EQ(plan(tiny(14, host))->layers[1].home, TierId(1));

  // S = 12: 3 stay offloaded (12 < 14, 12 ≥ 11), layer 0 returns to the device; layers are 192 B,
  // host0 holds 384 + 192 = 576 ≤ 630: layer 1 moves host1 → host0.
  auto b = replan(*a, tiny(12, host));
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_EQ(b->offloaded_layers, 3);
  ASSERT_EQ(b->migrations.size(), 2u);
  EXPECT_EQ(b->migrations[0].layer, LayerId(1));
  EXPECT_EQ(b->migrations[0].from, TierId(2));
  EXPECT_EQ(b->migrations[0].to, TierId(1));
  EXPECT_EQ(b->migrations[0].bytes, 192);
  EXPECT_DOUBLE_EQ(b->migrations[0].est_seconds, 192 / 8e9);  // host ↔ host bandwidth
  EXPECT_EQ(b->migrations[0].reason, "host0 has room again: 192 B needed, 316 B free (margin 10%)");
  EXPECT_EQ(b->migrations[1].layer, LayerId(0));
  EXPECT_EQ(b->migrations[1].to, TierId(0));
}

// Growing lengths push later layers out of a full node: a demotion with its reason.
TEST(PlannerReplan, FullNodeDemotes) {
  const std::vector<HostPool> host = {{0, 700, 20e9}, {1, 100000, 5e9}};
  Plan cur = *plan(tiny(16, host));  // 4 layers × 256 B: 3, 2 → host0 (512), 1, 0 → host1
  EXPECT_EQ(cur.layers[2].home, TierId(1));
  auto next = replan(cur, tiny(19, host));  // 304 B each: host0 holds 608; 912 > 700
  ASSERT_TRUE(next.is_ok());
  EXPECT_TRUE(next->migrations.empty());
  PlannerSnapshot smaller = tiny(19, {{0, 500, 20e9}, {1, 100000, 5e9}});
  next = replan(cur, smaller);  // host0 now holds only one 304-B layer: layer 2 is demoted
  ASSERT_TRUE(next.is_ok()) << next.status().to_string();
  ASSERT_EQ(next->migrations.size(), 1u);
  EXPECT_EQ(next->migrations[0].layer, LayerId(2));
  EXPECT_EQ(next->migrations[0].to, TierId(2));
  EXPECT_EQ(next->migrations[0].reason, "host0 full: 304 B needed, 196 B free");
}

// CPU filtering turns on at S ≥ S^T_4 = 20 and off only below floor(0.9·20) = 18.
TEST(PlannerReplan, FilteringHysteresis) {
  Plan cur = *plan(tiny(19));
  EXPECT_FALSE(cur.cpu_filtering);
  auto on = replan(cur, tiny(20));
  ASSERT_TRUE(on.is_ok()) << on.status().to_string();
  EXPECT_TRUE(on->cpu_filtering);
  ASSERT_EQ(on->migrations.size(), 1u);
  EXPECT_EQ(on->migrations[0].item, MigrationItem::kHeadKCache);
  EXPECT_FALSE(on->migrations[0].layer.valid());
  EXPECT_EQ(on->migrations[0].from, TierId(0));
  EXPECT_EQ(on->migrations[0].to, TierId(1));
  EXPECT_EQ(on->migrations[0].bytes, 160);
  EXPECT_NE(on->migrations[0].reason.find("CPU filtering on: S = 20 >= S^T_4 = 20"), std::string::npos);

  auto stay = replan(*on, tiny(19));
  ASSERT_TRUE(stay.is_ok());
  EXPECT_TRUE(stay->cpu_filtering);
  EXPECT_TRUE(stay->migrations.empty());

  auto off = replan(*stay, tiny(17));
  ASSERT_TRUE(off.is_ok());
  EXPECT_FALSE(off->cpu_filtering);
  EXPECT_EQ(off->offloaded_layers, 4);  // 17 ≥ floor(0.9·16) = 14: the layers stay out
  ASSERT_EQ(off->migrations.size(), 1u);
  EXPECT_EQ(off->migrations[0].to, TierId(0));
  EXPECT_NE(off->migrations[0].reason.find("CPU filtering off"), std::string::npos);
}

TEST(PlannerReplan, RejectsADifferentTierLayout) {
  Plan cur = *plan(tiny(10));
  PlannerSnapshot s = tiny(10);
  s.remote = {{0, 1000, 1e9}};
  auto next = replan(cur, s);
  ASSERT_FALSE(next.is_ok());
  EXPECT_EQ(next.status().code(), StatusCode::kInvalidArgument);
}

TEST(PlannerReplan, AdmissionStillApplies) {
  const std::vector<HostPool> host = {{0, 300, 10e9}};
  auto cur = plan(tiny(10, host));  // one layer of 160 B on host0
  ASSERT_TRUE(cur.is_ok()) << cur.status().to_string();
  auto next = replan(*cur, tiny(12, host));  // two layers of 192 B: 384 > 300 and no remote
  ASSERT_FALSE(next.is_ok());
  EXPECT_EQ(next.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(next.status().message().find("layer 2"), std::string::npos) << next.status().message();
}

}  // namespace
}  // namespace specontext::planner
