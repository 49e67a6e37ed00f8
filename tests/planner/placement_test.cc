// Fresh plans: how many layers leave the device, which tier each one lands in (host NUMA nodes in
// order of bandwidth, then remote), CPU filtering beyond S^T_L, and admission refusals.
#include <gtest/gtest.h>

#include "core/model/synthetic.h"
#include "planner/plan.h"

namespace specontext::planner {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// The hand-computed model of thresholds_test.cc: thresholds {10, 11, 13, 16, 20}; one token of one
// layer is H·D·kvc = 1·4·4 = 16 bytes; the head's K cache is H·D·elem = 8 bytes per token;
// weights + runtime = 130 bytes; device 1250 bytes.
// Tiers: device = 0, host0 (NUMA 0, 600 B, 10 GB/s) = 1, host1 (NUMA 1, 300 B, 20 GB/s) = 2,
// remote0 (1000 B, 5 GB/s) = 3. host1 is faster, so it fills first.
PlannerSnapshot tiny(int64_t seq) {
  PlannerSnapshot s;
  s.model = {4, 1, 4, 2, 0};
  s.kv_elem_bytes = 2;
  s.model_bytes = 100;
  s.budget = 2;
  s.requests = 1;
  s.device_bytes = 1250;
  s.host = {{0, 600, 10e9}, {1, 300, 20e9}};
  s.remote = {{0, 1000, 5e9}};
  s.host_to_host_bandwidth_bps = 8e9;
  s.seq_lens = {seq};
  return s;
}

std::vector<int32_t> homes(const Plan& p) {
  std::vector<int32_t> h;
  for (const auto& l : p.layers) h.push_back(l.home.value());
  return h;
}

TEST(PlannerPlacement, NothingLiveKeepsEverythingOnDevice) {
  PlannerSnapshot s = tiny(0);
  s.seq_lens.clear();
  auto p = plan(s);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->offloaded_layers, 0);
  EXPECT_EQ(homes(*p), (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ(p->device.total_bytes, 130);
  EXPECT_TRUE(p->migrations.empty());
}

// S = 12: S^T_1 = 11 ≤ 12 < S^T_2 = 13 → 2 layers offloaded, the last two (3, 2).
// Layer KV = 12·16 = 192 B. Layer 3 → host1 (fastest, 192 ≤ 300); layer 2 → host1 would need 384 >
// 300 → host0. Device: 130 + 16·[(4−2)·12 + 3·12 + 2·1·2] = 130 + 16·64 = 1154.
TEST(PlannerPlacement, TwoLayersOffloadedLastFirst) {
  auto p = plan(tiny(12));
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->seq_len, 12);
  EXPECT_EQ(p->offloaded_layers, 2);
  EXPECT_FALSE(p->cpu_filtering);
  EXPECT_EQ(homes(*p), (std::vector<int32_t>{0, 0, 1, 2}));
  EXPECT_EQ(p->layers[3].kv_bytes, 192);
  EXPECT_EQ(p->device.weights_bytes, 130);
  EXPECT_EQ(p->device.resident_kv_bytes, 2 * 12 * 16);
  EXPECT_EQ(p->device.retrieval_bytes, 3 * 12 * 16);
  EXPECT_EQ(p->device.staging_bytes, 2 * 2 * 16);
  EXPECT_EQ(p->device.total_bytes, 1154);
  EXPECT_EQ(p->tiers[1].used_bytes, 192);
  EXPECT_EQ(p->tiers[2].used_bytes, 192);
  EXPECT_EQ(p->head_cache_home, TierId(0));
  EXPECT_EQ(p->head_cache_bytes, 12 * 8);
}

// S = 18: S^T_3 = 16 ≤ 18 < S^T_4 = 20 → all 4 layers offloaded, 288 B each.
// layer 3 → host1 (288 ≤ 300); layer 2 → host1 full (576) → host0 (288); layer 1 → host0 (576 ≤ 600);
// layer 0 → host0 would be 864 > 600 → remote0. Device: 130 + 16·(3·18 + 4·2) = 1122.
TEST(PlannerPlacement, ThreeTiersSpillToSecondNumaNodeAndRemote) {
  auto p = plan(tiny(18));
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->offloaded_layers, 4);
  EXPECT_FALSE(p->cpu_filtering);
  EXPECT_EQ(homes(*p), (std::vector<int32_t>{3, 1, 1, 2}));
  EXPECT_EQ(p->device.total_bytes, 1122);
  EXPECT_EQ(p->tiers[0].used_bytes, 1122);
  EXPECT_EQ(p->tiers[1].used_bytes, 576);
  EXPECT_EQ(p->tiers[2].used_bytes, 288);
  EXPECT_EQ(p->tiers[3].used_bytes, 288);
  EXPECT_EQ(p->tiers[1].name, "host0");
  EXPECT_EQ(p->tiers[3].name, "remote0");
  EXPECT_EQ(p->tiers[3].kind, TierKind::kRemote);
}

// Equal bandwidths keep NUMA order: host0 first.
TEST(PlannerPlacement, UnmeasuredBandwidthsKeepNumaOrder) {
  PlannerSnapshot s = tiny(18);
  s.host[0].device_bandwidth_bps = 0;
  s.host[1].device_bandwidth_bps = 0;
  auto p = plan(s);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  // layer 3 → host0, layer 2 → host0 (576), layer 1 → host1 (288), layer 0 → remote.
  EXPECT_EQ(homes(*p), (std::vector<int32_t>{3, 2, 1, 1}));
}

// S = 20 ≥ S^T_4: even with every layer offloaded the head's K cache and expansion buffer do not fit
// → CPU filtering. The head's K cache (20·8 = 160 B) must live on a host node and is placed first:
// host1 (160). Layers (320 B): 3 → host1 480 > 300 → host0 (320); 2 → host0 640 > 600 → remote (320);
// 1 → remote (640); 0 → remote (960 ≤ 1000). Device keeps a shortlist of 4·B = 8 tokens:
// 130 + 16·(3·8 + 4·2) = 642.
TEST(PlannerPlacement, CpuFilteringBeyondLastThreshold) {
  auto p = plan(tiny(20));
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_TRUE(p->cpu_filtering);
  EXPECT_EQ(p->offloaded_layers, 4);
  EXPECT_EQ(p->head_cache_home, TierId(2));
  EXPECT_EQ(p->head_cache_bytes, 160);
  EXPECT_EQ(homes(*p), (std::vector<int32_t>{3, 3, 3, 1}));
  EXPECT_EQ(p->device.retrieval_bytes, 3 * 8 * 16);
  EXPECT_EQ(p->device.total_bytes, 642);
  EXPECT_EQ(p->tiers[2].used_bytes, 160);
  EXPECT_EQ(p->tiers[3].used_bytes, 960);
}

TEST(PlannerAdmission, LayerFitsNoTier) {
  PlannerSnapshot s = tiny(12);  // layers of 192 B
  s.host = {{0, 100, 10e9}};
  s.remote.clear();
  auto p = plan(s);
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  const std::string& m = p.status().message();
  EXPECT_NE(m.find("layer 3"), std::string::npos) << m;
  EXPECT_NE(m.find("192 B"), std::string::npos) << m;
  EXPECT_NE(m.find("host0 100 B free of 100 B"), std::string::npos) << m;
  EXPECT_NE(m.find("no remote tier"), std::string::npos) << m;
}

TEST(PlannerAdmission, AllTiersFull) {
  PlannerSnapshot s = tiny(18);
  s.remote[0].capacity_bytes = 100;  // layer 0 (288 B) fits nowhere
  auto p = plan(s);
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("layer 0"), std::string::npos) << p.status().message();
  EXPECT_NE(p.status().message().find("remote0 100 B free"), std::string::npos) << p.status().message();
}

TEST(PlannerAdmission, WeightsDoNotFitTheDevice) {
  PlannerSnapshot s = tiny(1);
  s.device_bytes = 100;  // < 1.3·100
  auto p = plan(s);
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(p.status().message().rfind("device:", 0), 0u) << p.status().message();
}

TEST(PlannerAdmission, HeadCacheNeedsHostMemoryForFiltering) {
  PlannerSnapshot s = tiny(20);  // filtering; the head's K cache is 160 B
  s.host = {{0, 100, 10e9}};
  s.remote = {{0, 100000, 5e9}};  // remote has room, but CPU filter workers need it in host memory
  auto p = plan(s);
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("retrieval head's K cache"), std::string::npos) << p.status().message();
  EXPECT_NE(p.status().message().find("host"), std::string::npos);
}

TEST(PlannerAdmission, FilteringDeviceTooSmall) {
  PlannerSnapshot s = tiny(20);
  s.filter_shortlist_tokens = 100;  // 130 + 16·(3·100 + 8) = 5058 > 1250
  auto p = plan(s);
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("CPU candidate filtering"), std::string::npos) << p.status().message();
}

// Mixed lengths: R = 2, lengths {11, 14} → Σ = 25, S = ceil(25/2) = 13. With R = 2 and Mem = 2370:
// Mem − 130 = 2240, kvc·R·H·D = 32 → S^T_0 = 2240/224 = 10, S^T_1 = (2240 − 32·2)/192 = 11,
// S^T_2 = (2240 − 128)/160 = 13, S^T_3 = (2240 − 192)/128 = 16. 13 → 3 layers offloaded.
// Each layer holds Σ·16 = 400 B; staging 3·2·2·16 = 192; device 130 + 16·(1·25 + 3·25) + 192 = 1922.
TEST(PlannerPlacement, MixedLengthsUseTotalTokens) {
  PlannerSnapshot s = tiny(0);
  s.requests = 2;
  s.device_bytes = 2370;
  s.seq_lens = {11, 14};
  s.host = {{0, 10000, 10e9}};
  auto p = plan(s);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->thresholds[2], 13);
  EXPECT_EQ(p->seq_len, 13);
  EXPECT_EQ(p->total_tokens, 25);
  EXPECT_EQ(p->offloaded_layers, 3);
  EXPECT_EQ(p->layers[0].kv_bytes, 400);
  EXPECT_EQ(p->device.total_bytes, 1922);
}

// The acceptance case at S = 32768: 8 layers (24..31) go to the single 512 GiB host node, 2 GiB
// each (16·32768·8·128·4 B); the device holds 1.3·(M_O + M_D) + 24·2 + 5·2 + 1 GiB (staging:
// 8·16·2048·4096 B) = 84469382349 B of 80 GiB.
TEST(PlannerPlacement, Llama8bAt32K) {
  const ModelConfig c = *synthetic_config("llama-3.1-8b");
  PlannerSnapshot s;
  s.model = *shape_from_config(c);
  s.model_bytes = model_parameter_count(c) * 2;
  s.head_bytes = retrieval_head_parameter_count(c) * 2;
  s.budget = 2048;
  s.requests = 16;
  s.device_bytes = 80 * kGiB;
  s.host = {{0, 512 * kGiB, 0}};
  s.seq_lens.assign(16, 32768);
  auto p = plan(s);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->offloaded_layers, 8);
  for (int l = 0; l < 32; ++l) EXPECT_EQ(p->layers[static_cast<size_t>(l)].home, TierId(l < 24 ? 0 : 1)) << l;
  EXPECT_EQ(p->layers[31].kv_bytes, 2 * kGiB);
  EXPECT_EQ(p->device.staging_bytes, 1 * kGiB);
  EXPECT_EQ(p->device.total_bytes, 84'469'382'349);
  EXPECT_LE(p->device.total_bytes, 80 * kGiB);
  EXPECT_EQ(p->tiers[1].used_bytes, 16 * kGiB);
}

TEST(PlannerUnits, FormatBytes) {
  EXPECT_EQ(format_bytes(100), "100 B");
  EXPECT_EQ(format_bytes(2 * kGiB), "2.00 GiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
}

}  // namespace
}  // namespace specontext::planner
