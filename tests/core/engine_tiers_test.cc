// KV tiers in the engine: the region allocator and the KV store on their own, then engines whose
// layers live in host pools or on a remote node giving exactly the logits of an all-device
// engine — under forced placements, under the planner's online re-planning with many sequences
// coming and going (invariants checked after every step), under transport faults, and with
// admission refusing what fits nowhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "core/base/region_allocator.h"
#include "core/engine/kv_store.h"
#include "cpu/cpu_candidate_filter.h"
#include "planner/planner_policy.h"
#include "serving/generator.h"
#include "tests/core/tier_test_util.h"
#include "transport/copy_engine.h"
#include "transport/fault_transport.h"
#include "transport/local_transport.h"
#include "transport/loopback_transport.h"

namespace specontext {
namespace {

using testing::InlineCopyQueue;
using testing::max_abs_diff;

TEST(RegionAllocator, HugeRequestsAreRefusedNotWrapped) {
  RegionAllocator a(1 << 20, 4096);
  for (uint64_t bytes : {~uint64_t{0}, ~uint64_t{0} - 100, (uint64_t{1} << 20) + 1}) {
    EXPECT_EQ(a.allocate(bytes).status().code(), StatusCode::kResourceExhausted) << bytes;
    EXPECT_EQ(a.allocate_top(bytes).status().code(), StatusCode::kResourceExhausted) << bytes;
  }
  EXPECT_EQ(a.used_bytes(), 0u);
  EXPECT_TRUE(a.check().is_ok());
}

TEST(RegionAllocator, FirstFitCoalescesAndChecks) {
  RegionAllocator a(4096, 256);
  auto x = a.allocate(100), y = a.allocate(300), z = a.allocate(256);
  ASSERT_TRUE(x.is_ok() && y.is_ok() && z.is_ok());
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 256u);
  EXPECT_EQ(*z, 768u);
  EXPECT_EQ(a.used_bytes(), 1024u);
  ASSERT_TRUE(a.free(*y).is_ok());
  auto w = a.allocate(512);  // fits exactly where y was
  ASSERT_TRUE(w.is_ok());
  EXPECT_EQ(*w, 256u);
  ASSERT_TRUE(a.free(*x).is_ok());
  ASSERT_TRUE(a.free(*w).is_ok());
  ASSERT_TRUE(a.free(*z).is_ok());
  EXPECT_EQ(a.used_bytes(), 0u);
  EXPECT_EQ(a.largest_free(), 4096u);  // everything coalesced back
  EXPECT_TRUE(a.check().is_ok());
  EXPECT_EQ(a.free(12).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.allocate(0).status().code(), StatusCode::kInvalidArgument);
  auto big = a.allocate(8192);
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  std::mt19937 rng(1);
  std::vector<uint64_t> live;
  for (int i = 0; i < 2000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      auto r = a.allocate(1 + rng() % 600);
      if (r.is_ok()) live.push_back(*r);
    } else {
      const size_t k = rng() % live.size();
      ASSERT_TRUE(a.free(live[k]).is_ok());
      live.erase(live.begin() + static_cast<long>(k));
    }
    ASSERT_TRUE(a.check().is_ok()) << "step " << i;
  }
}

std::vector<TierMemory> device_and_host(uint64_t device, uint64_t host) {
  std::vector<TierMemory> t;
  t.push_back(testing::host_tier(device));
  t[0].desc.id = TierId(0);
  t[0].desc.kind = TierKind::kDevice;
  t[0].desc.name = "device";
  t.push_back(testing::host_tier(host));
  t[1].desc.id = TierId(1);
  t[1].desc.name = "host0";
  return t;
}

TEST(KvStore, HalfPrecisionPagesHoldHalfTheBytes) {
  auto c = synthetic_config("toy");
  ASSERT_TRUE(c.is_ok());
  c->n_layers = 2;
  for (DType t : {DType::kBF16, DType::kF16}) {
    auto store = KvStore::create(*c, 16, 10, device_and_host(1 << 20, 1 << 20), 10, t);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    KvStore& s = **store;
    EXPECT_EQ(s.dtype(), t);
    EXPECT_EQ(s.row_bytes(), 16u * 2);   // head_dim 16, 2 bytes each
    EXPECT_EQ(s.page_bytes(), 2048u);    // half the f32 page of the test below
    ASSERT_TRUE(s.allocate_page().is_ok());
    auto moves = s.begin_move(LayerId(1), TierId(1));
    ASSERT_TRUE(moves.is_ok());
    ASSERT_EQ(moves->size(), 1u);
    EXPECT_EQ((*moves)[0].bytes, 10u * 2048u);
    s.abort_move(LayerId(1));
    std::vector<PageId> pages = {PageId(9)};
    std::vector<void*> k, v;
    EXPECT_EQ(s.view(LayerId(0), pages, k, v).dtype, t);
  }
  auto bad = KvStore::create(*c, 16, 10, device_and_host(1 << 20, 1 << 20), 10, DType::kQ8_0);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("q8_0"), std::string::npos) << bad.status().message();
}

// Pages freed by one sequence are handed out lowest id first, so the next sequence's pages stay
// packed in as few chunks as they need: with LIFO reuse 11 pages after an 18-page sequence spread
// over two 16-page chunks in every layer, and a device sized for one chunk ran out mid-run.
TEST(KvStore, FreedPagesAreReusedLowestFirstSoPagesStayPacked) {
  auto c = synthetic_config("toy");
  ASSERT_TRUE(c.is_ok());
  c->n_layers = 2;
  auto store = KvStore::create(*c, 16, 64, device_and_host(4 << 20, 1 << 20), 16);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  KvStore& s = **store;
  std::vector<PageId> first;
  for (int i = 0; i < 18; ++i) {
    auto p = s.allocate_page();
    ASSERT_TRUE(p.is_ok());
    first.push_back(*p);
  }
  EXPECT_EQ(s.tier_used_bytes(TierId(0)), 2 * 2 * s.chunk_bytes());  // two chunks in each layer
  for (PageId p : first) s.free_page(p);
  EXPECT_EQ(s.tier_used_bytes(TierId(0)), 0u);
  std::vector<PageId> second;
  for (int i = 0; i < 11; ++i) {
    auto p = s.allocate_page();
    ASSERT_TRUE(p.is_ok());
    second.push_back(*p);
    EXPECT_EQ(p->value(), i);
  }
  EXPECT_EQ(s.tier_used_bytes(TierId(0)), 2 * s.chunk_bytes());  // one chunk in each layer
  // Freed in any order, the lowest comes back first.
  s.free_page(second[7]);
  s.free_page(second[2]);
  s.free_page(second[9]);
  auto again = s.allocate_page();
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(again->value(), 2);
  ASSERT_TRUE(s.check_invariants().is_ok());
}

TEST(KvStore, ChunksFollowPagesInEveryLayerAndMovesAreAllOrNothing) {
  auto c = synthetic_config("toy");
  ASSERT_TRUE(c.is_ok());
  c->n_layers = 3;
  // toy: page of 16 tokens = 16·2·16·4 = 2 KiB per block, 4 KiB per page slot.
  auto store = KvStore::create(*c, 16, 10, device_and_host(1 << 20, 1 << 20), 10);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  KvStore& s = **store;
  EXPECT_EQ(s.page_bytes(), 4096u);
  EXPECT_EQ(s.chunk_pages(), 10);  // asked for: one chunk of all pages
  auto p0 = s.allocate_page();
  ASSERT_TRUE(p0.is_ok());
  EXPECT_EQ(s.tier_used_bytes(TierId(0)), 3 * s.chunk_bytes());  // one chunk in each layer
  ASSERT_TRUE(s.check_invariants().is_ok());
  auto moves = s.begin_move(LayerId(1), TierId(1));
  ASSERT_TRUE(moves.is_ok());
  ASSERT_EQ(moves->size(), 1u);
  EXPECT_EQ((*moves)[0].bytes, s.chunk_bytes());
  // Pages taken during a move get storage on both sides.
  auto p1 = s.allocate_page();
  ASSERT_TRUE(p1.is_ok());
  s.abort_move(LayerId(1));
  EXPECT_EQ(s.home(LayerId(1)), TierId(0));
  EXPECT_EQ(s.tier_used_bytes(TierId(1)), 0u);
  moves = s.begin_move(LayerId(1), TierId(1));
  ASSERT_TRUE(moves.is_ok());
  ASSERT_TRUE(s.commit_move(LayerId(1)).is_ok());
  EXPECT_EQ(s.home(LayerId(1)), TierId(1));
  EXPECT_EQ(s.tier_used_bytes(TierId(0)), 2 * s.chunk_bytes());
  EXPECT_EQ(s.tier_used_bytes(TierId(1)), s.chunk_bytes());
  EXPECT_EQ(s.locate(LayerId(1), *p1).tier, TierId(1));
  ASSERT_TRUE(s.check_invariants().is_ok());
  s.free_page(*p0);
  s.free_page(*p1);
  EXPECT_EQ(s.tier_used_bytes(TierId(0)), 0u);  // the chunk's last page went: storage freed
  EXPECT_EQ(s.tier_used_bytes(TierId(1)), 0u);
  ASSERT_TRUE(s.check_invariants().is_ok());
  // A tier too small for a chunk: allocation fails cleanly and nothing is left behind.
  auto small = KvStore::create(*c, 16, 10, device_and_host(100000, 1 << 20), 10);
  EXPECT_EQ(KvStore::default_chunk_pages(4096, 10), 1);  // at least 8 chunks per layer
  EXPECT_EQ(KvStore::default_chunk_pages(4096, 1 << 20), 64);
  EXPECT_EQ(KvStore::default_chunk_pages(uint64_t{1} << 20, 1 << 20), 2);
  ASSERT_TRUE(small.is_ok());
  auto p = (*small)->allocate_page();
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("device is full"), std::string::npos) << p.status().message();
  EXPECT_EQ((*small)->tier_used_bytes(TierId(0)), 0u);
  EXPECT_EQ((*small)->free_pages(), 10);
}

// Two engines fed the same requests: `ref` keeps everything on the device, `tiered` moves layers.
// Members in construction order, so that the engines go first, then the copy engine, then the
// transport it uses.
struct Pair {
  std::unique_ptr<Transport> transport;
  std::shared_ptr<CopyQueue> copies;
  std::shared_ptr<Model> model;
  std::shared_ptr<RetrievalHead> head;
  std::unique_ptr<Engine> ref, tiered;
};

enum class Where { kHost, kRemote };

// The engine's copy queue: the threaded copy engine (the production path: loads posted before
// layer 0 land while layers compute), or the inline reference that completes in submit().
std::shared_ptr<CopyQueue> make_copies(Transport& t, bool threaded, int max_retries = 8) {
  if (!threaded) return std::make_shared<InlineCopyQueue>(t, max_retries);
  transport::CopyEngineConfig cfg;
  cfg.max_retries = max_retries;
  auto ce = transport::CopyEngine::create(t, cfg);
  EXPECT_TRUE(ce.is_ok()) << ce.status().to_string();
  return std::shared_ptr<CopyQueue>(std::move(*ce));
}

EngineOptions sparse_options(SparseMethod method, const std::shared_ptr<RetrievalHead>& head, int64_t chunk_pages = 4,
                             DType kv_dtype = DType::kF32) {
  EngineOptions o;
  o.kv_dtype = kv_dtype;
  o.max_sequences = 4;
  o.max_context = 512;
  o.page_size = 8;
  o.sparse.method = method;
  o.sparse.selection = {24, 1, 4};
  o.sparse.quest_page_size = 8;
  o.kv_chunk_pages = chunk_pages;  // 4: 32 tokens per chunk, fine-grained enough for these short runs
  if (method == SparseMethod::kSpeContext) o.retrieval_head = head;
  return o;
}

Pair make_pair(SparseMethod method, Where where, std::unique_ptr<Transport> transport = nullptr,
               uint64_t device_bytes = 0, std::shared_ptr<PlacementPolicy> policy = nullptr, int64_t layers = 5,
               uint64_t tier_bytes = 8 << 20, int64_t chunk_pages = 4, bool threaded = true,
               DType kv_dtype = DType::kF32, int64_t staging_layers = 2) {
  Pair p;
  p.model = testing::toy_model(layers);
  auto head = make_random_head(p.model->config, 9);
  EXPECT_TRUE(head.is_ok());
  p.head = *head;
  const EngineOptions o = sparse_options(method, p.head, chunk_pages, kv_dtype);
  auto ref = Engine::create(p.model, testing::cpu_backend(), o);
  EXPECT_TRUE(ref.is_ok()) << ref.status().to_string();
  p.ref = std::move(*ref);
  if (!transport) {
    if (where == Where::kHost) {
      transport = std::make_unique<transport::LocalTransport>();
    } else {
      auto lb = transport::LoopbackRemoteTransport::create();
      EXPECT_TRUE(lb.is_ok());
      transport = std::move(*lb);
    }
  }
  p.transport = std::move(transport);
  p.copies = make_copies(*p.transport, threaded);
  EngineOptions t = o;
  t.tiering.device_bytes = device_bytes;
  if (where == Where::kHost) {
    t.tiering.host.push_back(testing::host_tier(tier_bytes));
  } else {
    t.tiering.remote.push_back(testing::remote_tier(tier_bytes));
  }
  t.tiering.transport = p.transport.get();
  t.tiering.copies = p.copies;
  t.tiering.policy = std::move(policy);
  t.tiering.staging_layers = staging_layers;
  auto tiered = Engine::create(p.model, testing::cpu_backend(), t);
  EXPECT_TRUE(tiered.is_ok()) << tiered.status().to_string();
  if (tiered.is_ok()) p.tiered = std::move(*tiered);
  return p;
}

// One forward of the same requests on both engines; the logits must be equal bit for bit (the
// same kernels read the same values, wherever they were stored).
void step_both(Pair& p, const std::vector<SeqId>& ids, const std::vector<std::vector<TokenId>>& tokens,
               const std::string& what) {
  std::vector<StepRequest> reqs;
  for (size_t i = 0; i < ids.size(); ++i) reqs.push_back({ids[i], tokens[i], LogitsMode::kLast});
  auto a = p.ref->forward(reqs);
  auto b = p.tiered->forward(reqs);
  ASSERT_TRUE(a.is_ok()) << what << ": " << a.status().to_string();
  ASSERT_TRUE(b.is_ok()) << what << ": " << b.status().to_string();
  ASSERT_EQ(max_abs_diff(a->logits, b->logits), 0.0f) << what;
  ASSERT_TRUE(p.tiered->memory().check_invariants().is_ok())
      << what << ": " << p.tiered->memory().check_invariants().to_string();
}

TokenId argmax(const std::vector<float>& logits, int64_t vocab, int64_t row) {
  return static_cast<TokenId>(std::max_element(logits.begin() + row * vocab, logits.begin() + (row + 1) * vocab) -
                              (logits.begin() + row * vocab));
}

std::string forced_placement_name(const ::testing::TestParamInfo<std::tuple<SparseMethod, Where, bool, DType>>& info) {
  return std::string(sparse_method_name(std::get<0>(info.param))) +
         (std::get<1>(info.param) == Where::kHost ? "_host" : "_remote") +
         (std::get<2>(info.param) ? "_threaded" : "_inline") +
         (std::get<3>(info.param) == DType::kF32 ? "" : "_" + std::string(dtype_name(std::get<3>(info.param))));
}

class ForcedPlacement : public ::testing::TestWithParam<std::tuple<SparseMethod, Where, bool, DType>> {};

TEST_P(ForcedPlacement, OffloadedLayersGiveTheAllDeviceLogits) {
  const auto [method, where, threaded, kv_dtype] = GetParam();
  Pair p = make_pair(method, where, nullptr, 0, nullptr, 5, 8 << 20, 4, threaded, kv_dtype);
  ASSERT_TRUE(p.tiered);
  const TierId off(1);
  KvPlacement place = p.tiered->memory().placement();
  place.layer_home = {TierId(0), off, TierId(0), off, off};
  ASSERT_TRUE(p.tiered->apply_placement(place, {"test"}).is_ok());
  std::vector<SeqId> ids;
  for (int i = 0; i < 2; ++i) {
    auto a = p.ref->memory().add_sequence(), b = p.tiered->memory().add_sequence();
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    ASSERT_EQ(*a, *b);
    ids.push_back(*a);
  }
  std::mt19937 rng(4);
  // Prefill in chunks (dense over offloaded layers), then decode past the budget (sparse).
  std::vector<std::vector<TokenId>> prompts(2);
  for (int i = 0; i < 2; ++i) {
    for (int t = 0; t < 30 + 11 * i; ++t) prompts[i].push_back(static_cast<TokenId>(rng() % 256));
  }
  for (size_t off_tok = 0; off_tok < prompts[1].size(); off_tok += 13) {
    std::vector<SeqId> step_ids;
    std::vector<std::vector<TokenId>> chunks;
    for (int i = 0; i < 2; ++i) {
      if (off_tok >= prompts[i].size()) continue;
      const size_t n = std::min<size_t>(13, prompts[i].size() - off_tok);
      step_ids.push_back(ids[i]);
      chunks.emplace_back(prompts[i].begin() + off_tok, prompts[i].begin() + off_tok + n);
    }
    step_both(p, step_ids, chunks, "prefill at " + std::to_string(off_tok));
  }
  std::vector<std::vector<TokenId>> next = {{7}, {9}};
  for (int step = 0; step < 40; ++step) {
    if (step == 20) {
      // Move layers between steps: one back to the device, one more away.
      place.layer_home = {off, TierId(0), TierId(0), off, TierId(0)};
      ASSERT_TRUE(p.tiered->apply_placement(place, {"test move"}).is_ok());
    }
    std::vector<StepRequest> reqs;
    for (int i = 0; i < 2; ++i) reqs.push_back({ids[i], next[i], LogitsMode::kLast});
    auto a = p.ref->forward(reqs);
    auto b = p.tiered->forward(reqs);
    ASSERT_TRUE(a.is_ok() && b.is_ok()) << (a.is_ok() ? b.status() : a.status()).to_string();
    ASSERT_EQ(max_abs_diff(a->logits, b->logits), 0.0f) << "decode step " << step;
    ASSERT_TRUE(p.tiered->memory().check_invariants().is_ok());
    for (int i = 0; i < 2; ++i) next[i] = {argmax(a->logits, a->vocab, i)};
  }
  if (method != SparseMethod::kDense) {
    EXPECT_GT(p.tiered->sparse_stats().sparse_steps, 0);
  }
  // Something really moved through the offloaded tier, and the report agrees with the placement.
  const auto report = p.tiered->tier_report();
  ASSERT_EQ(report.size(), 2u);
  EXPECT_EQ(report[1].layers, 2);
  EXPECT_GT(report[1].total.bytes_in + report[1].total.bytes_out, 0u);
  EXPECT_EQ(p.tiered->placement_events().size(), 2u);
}

INSTANTIATE_TEST_SUITE_P(
    Methods, ForcedPlacement,
    ::testing::Combine(::testing::Values(SparseMethod::kDense, SparseMethod::kSpeContext, SparseMethod::kStreaming,
                                         SparseMethod::kQuest),
                       ::testing::Values(Where::kHost, Where::kRemote), ::testing::Bool(),
                       ::testing::Values(DType::kF32)),
    forced_placement_name);

// A bf16 / f16 cache moves half the bytes; placement must still not change a single bit.
INSTANTIATE_TEST_SUITE_P(
    HalfKv, ForcedPlacement,
    ::testing::Combine(::testing::Values(SparseMethod::kDense, SparseMethod::kSpeContext),
                       ::testing::Values(Where::kHost, Where::kRemote), ::testing::Values(true),
                       ::testing::Values(DType::kBF16, DType::kF16)),
    forced_placement_name);

// More remote layers than staging_layers: the layers that read whole pages (dense attention, Quest,
// SpeContext sequences not yet past the budget) go through a ring of staging_layers buffers, so
// the device holds that many remote layers' cached KV at once, and the logits stay the all-device
// engine's bit for bit. The peak staging is exactly the ring plus a tail buffer per remote layer.
class LayerWiseStaging : public ::testing::TestWithParam<std::tuple<SparseMethod, int64_t>> {};

TEST_P(LayerWiseStaging, ARingOfLayersGivesTheAllDeviceLogits) {
  const auto [method, depth] = GetParam();
  Pair p = make_pair(method, Where::kRemote, nullptr, 0, nullptr, 5, 8 << 20, 4, true, DType::kF32, depth);
  ASSERT_TRUE(p.tiered);
  const TierId off(1);
  KvPlacement place = p.tiered->memory().placement();
  place.layer_home = {TierId(0), off, off, off, off};
  ASSERT_TRUE(p.tiered->apply_placement(place, {"test"}).is_ok());
  const int64_t ps = 8, remote_layers = 4, budget = 24;
  const uint64_t page_bytes = 2 * 2 * ps * 16 * 4;  // K and V, 2 KV heads of 16, f32
  const bool shared = method == SparseMethod::kSpeContext;
  std::vector<SeqId> ids;
  std::vector<int64_t> lens;
  uint64_t expect_peak = 0;
  // One step; `expect_peak` follows the staging the engine should take for it.
  auto step = [&](const std::vector<size_t>& who, const std::vector<std::vector<TokenId>>& toks, const std::string& what) {
    std::vector<SeqId> step_ids;
    int64_t ring = 0, tail = 0;
    for (size_t k = 0; k < who.size(); ++k) {
      step_ids.push_back(ids[who[k]]);
      const int64_t start = lens[who[k]], n = static_cast<int64_t>(toks[k].size());
      const bool elastic = shared && n == 1 && start + 1 > budget;
      ring += elastic ? 0 : start / ps;
      tail += elastic ? 1 : (start + n - 1) / ps - start / ps + 1;
      lens[who[k]] += n;
    }
    const int64_t slots = ring == 0 ? 0 : std::min(depth, remote_layers);
    expect_peak = std::max(expect_peak, static_cast<uint64_t>(slots * ring + remote_layers * tail) * page_bytes);
    step_both(p, step_ids, toks, what);
  };
  auto add = [&] {
    auto a = p.ref->memory().add_sequence(), b = p.tiered->memory().add_sequence();
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    ASSERT_EQ(*a, *b);
    ids.push_back(*a);
    lens.push_back(0);
  };
  add();
  std::mt19937 rng(11);
  auto tokens = [&](int n) {
    std::vector<TokenId> t;
    for (int i = 0; i < n; ++i) t.push_back(static_cast<TokenId>(rng() % 256));
    return t;
  };
  // Prefill in chunks that end mid-page (the next chunk's first page is loaded, then appended to).
  for (int c = 0; c < 3; ++c) {
    step({0}, {tokens(13)}, "prefill chunk " + std::to_string(c));
    if (HasFatalFailure()) return;
  }
  for (int s = 0; s < 6; ++s) {
    step({0}, {tokens(1)}, "decode " + std::to_string(s));
    if (HasFatalFailure()) return;
  }
  // A short second sequence joins: under SpeContext it attends densely beside an elastic one.
  add();
  step({1}, {tokens(6)}, "second prefill");
  if (HasFatalFailure()) return;
  for (int s = 0; s < 30; ++s) {
    step({0, 1}, {tokens(1), tokens(1)}, "decode both " + std::to_string(s));
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(p.tiered->peak_staging_bytes(), expect_peak);
  if (shared) {
    EXPECT_GT(p.tiered->sparse_stats().sparse_steps, 0);
  }
  const auto report = p.tiered->tier_report();
  EXPECT_GT(report[1].total.bytes_out, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndDepths, LayerWiseStaging,
    ::testing::Combine(::testing::Values(SparseMethod::kDense, SparseMethod::kQuest, SparseMethod::kSpeContext),
                       ::testing::Values(int64_t{1}, int64_t{2}, int64_t{4})),
    [](const auto& info) {
      return std::string(sparse_method_name(std::get<0>(info.param))) + "_depth" +
             std::to_string(std::get<1>(info.param));
    });

std::shared_ptr<planner::PlannerPolicy> policy_for(const Model& m, const RetrievalHead& head, int64_t budget,
                                                   int64_t requests, uint64_t host_bytes, uint64_t chunk_bytes,
                                                   int64_t page_size) {
  planner::PolicyConfig pc;
  auto shape = planner::shape_from_config(m.config);
  EXPECT_TRUE(shape.is_ok());
  pc.base.model = *shape;
  pc.base.kv_elem_bytes = 4;
  pc.base.model_bytes = 0;  // weights live outside the device tier here
  pc.base.head_bytes = 0;
  pc.base.runtime_factor = 1.0;
  pc.base.budget = budget;
  pc.base.requests = requests;
  pc.base.host.push_back({0, static_cast<int64_t>(host_bytes), 0});
  pc.base.retrieval_bytes_per_token = head.config.n_kv_heads * head.config.head_dim * 4;
  pc.page_size = page_size;
  pc.chunk_bytes = chunk_bytes;
  auto p = planner::PlannerPolicy::create(pc);
  EXPECT_TRUE(p.is_ok()) << p.status().to_string();
  return std::shared_ptr<planner::PlannerPolicy>(std::move(*p));
}

// The randomised long run: sequences arrive with random prompts, decode a random number of steps
// and leave; the planner moves layers off the device as the cache grows and back as it shrinks.
// After every step the store's invariants hold and the logits equal the all-device engine's.
TEST(PlannerPolicyEngine, RandomisedGrowthAndShrinkMigratesWithoutLosingPages) {
  for (SparseMethod method : {SparseMethod::kSpeContext, SparseMethod::kDense}) {
    SCOPED_TRACE(std::string(sparse_method_name(method)));
    auto model = testing::toy_model(5);
    auto head = make_random_head(model->config, 9);
    ASSERT_TRUE(head.is_ok());
    // Device tier of 640 KiB: every layer resident up to about 300 live tokens, some offloaded
    // beyond. The live total moves between 0 and about 800 tokens, so layers leave and come back.
    const int64_t ps = 8;
    const uint64_t chunk = 2 * 8 * 32 * 4;  // one layer's chunk: 1 page of 8 tokens
    auto policy = policy_for(*model, **head, 24, 4, 8 << 20, chunk, ps);
    const uint64_t device_bytes = 640 << 10;
    Pair p = make_pair(method, Where::kHost, nullptr, device_bytes, policy, 5, 8 << 20, 1);
    ASSERT_EQ(p.tiered->memory().kv_store().chunk_bytes(), chunk);
    ASSERT_TRUE(p.tiered);
    std::mt19937 rng(11);
    struct Live {
      SeqId id;
      int64_t left;
      TokenId next;
    };
    std::vector<Live> live;
    int64_t offloads = 0, returns = 0;
    for (int step = 0; step < 400; ++step) {
      // Arrivals while there is room; long-lived sequences make the cache grow.
      if (live.size() < 3 && rng() % 4 == 0) {
        auto a = p.ref->memory().add_sequence(), b = p.tiered->memory().add_sequence();
        ASSERT_TRUE(a.is_ok() && b.is_ok());
        std::vector<TokenId> prompt(10 + rng() % 70);
        for (auto& t : prompt) t = static_cast<TokenId>(rng() % 256);
        step_both(p, {*a}, {prompt}, "prefill at step " + std::to_string(step));
        if (::testing::Test::HasFatalFailure()) return;
        live.push_back({*a, static_cast<int64_t>(20 + rng() % 200), static_cast<TokenId>(rng() % 256)});
      }
      if (live.empty()) continue;
      std::vector<StepRequest> reqs;
      std::vector<std::vector<TokenId>> toks(live.size());
      for (size_t i = 0; i < live.size(); ++i) {
        toks[i] = {live[i].next};
        reqs.push_back({live[i].id, toks[i], LogitsMode::kLast});
      }
      const size_t events_before = p.tiered->placement_events().size();
      auto a = p.ref->forward(reqs);
      auto b = p.tiered->forward(reqs);
      ASSERT_TRUE(a.is_ok()) << a.status().to_string();
      if (!b.is_ok()) {
        const auto& snap = policy->last_snapshot();
        std::string lens;
        for (auto l : snap.seq_lens) lens += std::to_string(l) + " ";
        auto th = policy->current_thresholds();
        std::string ths;
        if (th.is_ok()) for (auto t : *th) ths += std::to_string(t) + " ";
        ADD_FAILURE() << "planner state: device_bytes " << snap.device_bytes << " lens " << lens
                      << " thresholds " << ths << " offloaded "
                      << (policy->last_plan() ? policy->last_plan()->offloaded_layers : -1) << " device used "
                      << p.tiered->memory().kv_store().tier_used_bytes(TierId(0));
      }
      ASSERT_TRUE(b.is_ok()) << "step " << step << ": " << b.status().to_string();
      ASSERT_EQ(max_abs_diff(a->logits, b->logits), 0.0f) << "step " << step;
      ASSERT_TRUE(p.tiered->memory().check_invariants().is_ok())
          << p.tiered->memory().check_invariants().to_string();
      for (size_t e = events_before; e < p.tiered->placement_events().size(); ++e) {
        const PlacementEvent& ev = p.tiered->placement_events()[e];
        ASSERT_TRUE(ev.error.empty()) << ev.error;
        for (const std::string& r : ev.reasons) {
          offloads += r.rfind("offload", 0) == 0;
          returns += r.rfind("return to device", 0) == 0;
        }
      }
      for (size_t i = 0; i < live.size(); ++i) live[i].next = argmax(a->logits, a->vocab, static_cast<int64_t>(i));
      for (size_t i = live.size(); i-- > 0;) {
        if (--live[i].left > 0) continue;
        ASSERT_TRUE(p.ref->memory().remove_sequence(live[i].id).is_ok());
        ASSERT_TRUE(p.tiered->memory().remove_sequence(live[i].id).is_ok());
        live.erase(live.begin() + static_cast<long>(i));
        ASSERT_TRUE(p.tiered->memory().check_invariants().is_ok());
      }
    }
    // The run really exercised both directions.
    EXPECT_GT(offloads, 0);
    EXPECT_GT(returns, 0);
  }
}

// Transient transport failures are retried to exact results; a failure that outlasts the retries
// fails the step with a clear error, leaves the engine as before the step, and the retried step
// gives the right logits (working sets filled by the failed step are reloaded, never trusted).
TEST(TierFaults, FailuresAreRetriedOrReportedNeverWrongAttention) {
  for (const auto& [max_retries, threaded] : {std::pair{8, false}, std::pair{0, false}, std::pair{8, true},
                                              std::pair{0, true}}) {
    SCOPED_TRACE("max_retries " + std::to_string(max_retries) + (threaded ? " copy engine" : " inline"));
    transport::FaultPolicy fp;
    fp.seed = 5;
    fp.failure_rate = 0.3;
    fp.no_resource_rate = 0.3;
    fp.added_delay = std::chrono::microseconds(50);
    auto ft = transport::FaultInjectingTransport::create(std::make_unique<transport::LocalTransport>(), fp);
    ASSERT_TRUE(ft.is_ok());
    Pair p = make_pair(SparseMethod::kSpeContext, Where::kHost, std::move(*ft));
    ASSERT_TRUE(p.tiered);
    // Rebuild the tiered engine over a queue with the wanted retry bound.
    EngineOptions t = sparse_options(SparseMethod::kSpeContext, p.head);
    t.tiering.host.push_back(testing::host_tier(8 << 20));
    auto lt = std::make_unique<transport::LocalTransport>();
    auto ft2 = transport::FaultInjectingTransport::create(std::move(lt), fp);
    ASSERT_TRUE(ft2.is_ok());
    p.tiered.reset();
    p.copies.reset();
    p.transport = std::move(*ft2);
    p.copies = make_copies(*p.transport, threaded, max_retries);
    t.tiering.transport = p.transport.get();
    t.tiering.copies = p.copies;
    auto e = Engine::create(p.model, testing::cpu_backend(), t);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    p.tiered = std::move(*e);
    KvPlacement place = p.tiered->memory().placement();
    for (size_t l = 1; l < place.layer_home.size(); l += 2) place.layer_home[l] = TierId(1);
    Status moved;
    for (int attempt = 0; attempt < 50; ++attempt) {  // moves go through the faulty link too
      moved = p.tiered->apply_placement(place);
      if (moved.is_ok()) break;
      ASSERT_EQ(moved.code(), StatusCode::kUnavailable) << moved.to_string();
      ASSERT_TRUE(p.tiered->memory().check_invariants().is_ok());
    }
    ASSERT_TRUE(moved.is_ok()) << moved.to_string();
    auto a_id = p.ref->memory().add_sequence(), b_id = p.tiered->memory().add_sequence();
    ASSERT_TRUE(a_id.is_ok() && b_id.is_ok());
    std::vector<TokenId> prompt(40);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>((i * 37) % 256);
    TokenId next = 3;
    int failures = 0, done = 0;
    bool prefilled = false;
    for (int attempt = 0; attempt < 400 && done < 40; ++attempt) {
      std::vector<TokenId> toks = prefilled ? std::vector<TokenId>{next} : prompt;
      const StepRequest r{*a_id, toks, LogitsMode::kLast};
      auto b = p.tiered->forward(std::span<const StepRequest>(&r, 1));
      if (!b.is_ok()) {
        ++failures;
        EXPECT_EQ(b.status().code(), StatusCode::kUnavailable) << b.status().to_string();
        EXPECT_NE(b.status().message().find("layer"), std::string::npos) << b.status().to_string();
        ASSERT_TRUE(p.tiered->memory().check_invariants().is_ok());
        continue;  // the engine is as before the step: retry it
      }
      auto a = p.ref->forward(std::span<const StepRequest>(&r, 1));
      ASSERT_TRUE(a.is_ok());
      // After a failed step the working sets are reloaded into other slots, which changes the
      // summation order of sparse attention: equal to rounding, not bit for bit.
      if (failures == 0) {
        ASSERT_EQ(max_abs_diff(a->logits, b->logits), 0.0f) << "step " << done;
      } else {
        ASSERT_LT(max_abs_diff(a->logits, b->logits), 1e-4f) << "step " << done;
      }
      next = argmax(a->logits, a->vocab, 0);
      prefilled = true;
      ++done;
    }
    EXPECT_EQ(done, 40);
    if (max_retries == 0) {
      EXPECT_GT(failures, 0);  // with no retries the faults surface as step errors
    } else {
      EXPECT_EQ(failures, 0);  // 8 retries absorb a 30% transient failure rate here
    }
    EXPECT_GT(p.tiered->sparse_stats().sparse_steps, 0);
  }
}

// Admission: a request whose KV fits no tier even alone is refused with the reason; the others run.
// A SpeContext engine on the toy model with a 600 KiB device tier and a host pool of `host_bytes`,
// layers placed by the planner (pages of 8 tokens, chunks of 4 pages).
Pair planned_pair(uint64_t host_bytes) {
  auto model = testing::toy_model(5);
  auto head = make_random_head(model->config, 9);
  EXPECT_TRUE(head.is_ok());
  const uint64_t chunk = 2 * 8 * 32 * 4 * 4;
  auto policy = policy_for(*model, **head, 24, 4, host_bytes, chunk, 8);
  return make_pair(SparseMethod::kSpeContext, Where::kHost, nullptr, 600 << 10, policy, 5, host_bytes);
}

TEST(PlannerPolicyEngine, RequestThatFitsNowhereIsRefusedOthersRun) {
  // 512 tokens need 128 KiB per layer: more than the host pool, and the device holds far less.
  Pair p = planned_pair(64 << 10);
  ASSERT_TRUE(p.tiered);
  std::vector<GenerationRequest> reqs(3);
  for (auto& r : reqs) {
    r.prompt = {1, 2, 3, 4, 5};
    r.max_new_tokens = 10;
  }
  reqs[1].max_new_tokens = 100000;  // beyond every tier (and the context: clamped to 512 tokens)
  reqs[1].synthetic_context = 0;
  GeneratorOptions go;
  Generator gen(*p.tiered, go);
  auto out = gen.run(reqs);
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  EXPECT_EQ((*out)[0].tokens.size(), 10u);
  EXPECT_EQ((*out)[2].tokens.size(), 10u);
  if ((*out)[1].finish == FinishReason::kRefused) {
    EXPECT_NE((*out)[1].error.find("cannot be placed"), std::string::npos) << (*out)[1].error;
    EXPECT_TRUE((*out)[1].tokens.empty());
  } else {
    ADD_FAILURE() << "request 1 was expected not to fit: " << (*out)[1].tokens.size() << " tokens";
  }
}

// A synthetic context longer than the device holds (speed runs: `generate --synthetic-context`)
// is placed first, as a step of that length would be: layers leave the device, then the fill.
TEST(PlannerPolicyEngine, SyntheticFillLongerThanTheDeviceMovesLayersFirst) {
  Pair p = planned_pair(4 << 20);
  ASSERT_TRUE(p.tiered);
  GenerationRequest r;
  r.prompt = {1, 2, 3};
  r.max_new_tokens = 4;
  r.synthetic_context = 480;  // 600 KiB of KV (1280 B per token): the whole device tier
  Generator gen(*p.tiered, GeneratorOptions{});
  auto out = gen.run({r});
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  EXPECT_EQ((*out)[0].tokens.size(), 4u) << (*out)[0].error;
  int offloaded = 0;
  for (TierId t : p.tiered->memory().placement().layer_home) offloaded += t != TierId(0);
  EXPECT_GT(offloaded, 0);
  EXPECT_TRUE(p.tiered->memory().check_invariants().is_ok());
}

}  // namespace
}  // namespace specontext

namespace specontext {
namespace {

// CPU candidate filtering in the engine: the head's keys move to the host pool, the CPU filter
// shortlists candidates and the head scores only those. With a shortlist covering the whole
// context the selections, hence the logits, equal full scoring exactly; with a short one the
// engine still decodes sparsely from the candidates. With an f16 KV cache the head's keys are
// f16 (moved block by block at their own size, handed to the filter widened, scored widened on
// load) and the same holds. A head whose query heads take turns (select_group "turns") ranks the
// candidates by turns as full scoring does (select_by_turns), with the same exact equality.
TEST(CpuFiltering, EngineSelectsFromCandidatesAndEqualsFullScoringWhenAllAreCandidates) {
  for (const GroupReduce reduce : {GroupReduce::kMax, GroupReduce::kTurns})
  for (const DType kv_dtype : {DType::kF32, DType::kF16})
  for (int64_t shortlist : {int64_t{4096}, int64_t{32}}) {
    SCOPED_TRACE("shortlist " + std::to_string(shortlist) + ", KV " + std::string(dtype_name(kv_dtype)) +
                 (reduce == GroupReduce::kTurns ? ", turns" : ", group max"));
    Pair p = make_pair(SparseMethod::kSpeContext, Where::kHost, nullptr, 0, nullptr, 5, 8 << 20, 4, true, kv_dtype);
    ASSERT_TRUE(p.tiered);
    ASSERT_EQ(p.head->config.n_heads, 2 * p.head->config.n_kv_heads);  // groups of 2: turns differ from max
    p.head->config.select_group = reduce;  // read by both engines at every step
    // Rebuild the tiered engine with a filter (make_pair has none).
    EngineOptions t = sparse_options(SparseMethod::kSpeContext, p.head, 4, kv_dtype);
    t.tiering.host.push_back(testing::host_tier(8 << 20));
    t.tiering.transport = p.transport.get();
    t.tiering.copies = p.copies;
    t.tiering.shortlist_tokens = shortlist;
    cpu::CpuCandidateFilterOptions fo;
    fo.filter.page_size = 4;
    fo.filter.n_heads = p.head->config.n_heads;
    fo.filter.n_kv_heads = p.head->config.n_kv_heads;
    fo.filter.head_dim = p.head->config.head_dim;
    fo.num_threads = 1;
    auto filter = cpu::CpuCandidateFilter::create(fo);
    ASSERT_TRUE(filter.is_ok()) << filter.status().to_string();
    t.tiering.candidate_filter = std::shared_ptr<CandidateFilter>(std::move(*filter));
    p.tiered.reset();
    p.copies.reset();
    p.transport = std::make_unique<transport::LocalTransport>();
    p.copies = make_copies(*p.transport, true);
    t.tiering.transport = p.transport.get();
    t.tiering.copies = p.copies;
    auto e = Engine::create(p.model, testing::cpu_backend(), t);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    p.tiered = std::move(*e);
    auto a = p.ref->memory().add_sequence(), b = p.tiered->memory().add_sequence();
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    std::vector<TokenId> prompt(60);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>((i * 53 + 7) % 256);
    step_both(p, {*a}, {prompt}, "prefill");
    // Filtering switches on mid-run: the head's keys move to the host pool and the filter
    // catches up with every key written so far.
    KvPlacement place = p.tiered->memory().placement();
    place.cpu_filtering = true;
    place.head_cache_home = TierId(1);
    place.layer_home[2] = TierId(1);
    ASSERT_TRUE(p.tiered->apply_placement(place, {"filter on"}).is_ok());
    TokenId next = 3;
    double max_diff = 0;
    for (int step = 0; step < 40; ++step) {
      std::vector<TokenId> tok = {next};
      const StepRequest r{*a, tok, LogitsMode::kLast};
      auto x = p.ref->forward(std::span<const StepRequest>(&r, 1));
      auto y = p.tiered->forward(std::span<const StepRequest>(&r, 1));
      ASSERT_TRUE(x.is_ok() && y.is_ok()) << (x.is_ok() ? y.status() : x.status()).to_string();
      if (shortlist >= 4096) {
        ASSERT_EQ(max_abs_diff(x->logits, y->logits), 0.0f) << "step " << step;
      }
      max_diff = std::max<double>(max_diff, max_abs_diff(x->logits, y->logits));
      ASSERT_TRUE(std::isfinite(max_diff));
      next = argmax(x->logits, x->vocab, 0);
    }
    EXPECT_EQ(p.tiered->filtered_steps(), 40);
    if (shortlist < 4096) {
      EXPECT_GT(max_diff, 0.0) << "a 32-token shortlist of a 100-token context changed nothing";
    }
    // Switching filtering off again drops the summaries; scoring is full again.
    place.cpu_filtering = false;
    place.head_cache_home = TierId(0);
    ASSERT_TRUE(p.tiered->apply_placement(place, {"filter off"}).is_ok());
    ASSERT_TRUE(p.tiered->memory().check_invariants().is_ok());
  }
}

}  // namespace
}  // namespace specontext

namespace specontext {
namespace {

// The dataflow of a sparse step, from the order of events: every offloaded layer's loads are
// submitted before the first attention of the step (the selection exists before layer 0), and a
// layer waits for its own loads only — after the previous layer's attention, before its own.
struct EventLog {
  std::vector<std::string> events;
};

class RecordingQueue final : public CopyQueue {
 public:
  RecordingQueue(std::shared_ptr<CopyQueue> inner, EventLog& log) : inner_(std::move(inner)), log_(log) {}
  Result<CopyTicket> submit(LayerId layer, CopyDirection dir, std::vector<TransferRequest> reqs) override {
    auto t = inner_->submit(layer, dir, std::move(reqs));
    if (t.is_ok()) layer_of_[t->id] = layer.value();
    if (dir == CopyDirection::kLoad) log_.events.push_back("submit " + std::to_string(layer.value()));
    return t;
  }
  Status wait(CopyTicket t) override {
    log_.events.push_back("wait " + std::to_string(layer_of_[t.id]));
    return inner_->wait(t);
  }
  Status wait_all() override { return inner_->wait_all(); }
  void reset_window() override { inner_->reset_window(); }
  CopyWindowStats window_stats() const override { return inner_->window_stats(); }

 private:
  std::shared_ptr<CopyQueue> inner_;
  EventLog& log_;
  std::unordered_map<uint64_t, int32_t> layer_of_;
};

class RecordingBackend final : public Backend {
 public:
  RecordingBackend(std::shared_ptr<Backend> inner, EventLog& log) : inner_(std::move(inner)), log_(log) {}
  std::string_view name() const override { return "recording"; }
  bool supports(BackendOp op, DType d) const override { return inner_->supports(op, d); }
  Result<std::shared_ptr<void>> allocate(size_t b) override { return inner_->allocate(b); }
  Status embed(const TokenId* i, int64_t n, const WeightMatrix& t, float* o) override { return inner_->embed(i, n, t, o); }
  Status matmul(const float* x, int64_t m, const WeightMatrix& w, const float* b, float* y) override {
    return inner_->matmul(x, m, w, b, y);
  }
  Status rmsnorm(const float* x, const float* w, int64_t r, int64_t d, float e, float* y) override {
    return inner_->rmsnorm(x, w, r, d, e, y);
  }
  Status rope(float* x, int64_t n, int64_t h, const int64_t* p, const RopeParams& r) override { return inner_->rope(x, n, h, p, r); }
  Status swiglu(const float* g, const float* u, int64_t n, float* o) override { return inner_->swiglu(g, u, n, o); }
  Status add(float* x, const float* y, int64_t n) override { return inner_->add(x, y, n); }
  Status kv_append(const float* k, const float* v, int64_t n, int64_t s, const KvLayerView& kv) override {
    return inner_->kv_append(k, v, n, s, kv);
  }
  Status attention(const float* q, const AttentionItem* it, int64_t n, int64_t h, float* o) override {
    log_.events.push_back("dense");
    return inner_->attention(q, it, n, h, o);
  }
  Status kv_gather(const KvLayerView& kv, const GatherEntry* e, int64_t n, const WorkingSetView& ws) override {
    return inner_->kv_gather(kv, e, n, ws);
  }
  Status attention_sparse(const float* q, const SparseAttentionItem* it, int64_t n, int64_t h, float* o) override {
    log_.events.push_back("attend");
    return inner_->attention_sparse(q, it, n, h, o);
  }
  Status attention_indexed(const float* q, const IndexedAttentionItem* it, int64_t n, int64_t h, float* o) override {
    log_.events.push_back("attend");
    return inner_->attention_indexed(q, it, n, h, o);
  }

 private:
  std::shared_ptr<Backend> inner_;
  EventLog& log_;
};

// An engine whose backend records attention and whose copy queue (over `transport`) records
// loads and waits into `log`, with the layers' homes set to `homes`.
std::unique_ptr<Engine> recorded_engine(EngineOptions o, Transport& transport, EventLog& log,
                                        std::vector<TierId> homes) {
  o.tiering.transport = &transport;
  o.tiering.copies = std::make_shared<RecordingQueue>(make_copies(transport, true), log);
  auto e = Engine::create(testing::toy_model(5), std::make_shared<RecordingBackend>(testing::cpu_backend(), log), o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  if (!e.is_ok()) return nullptr;
  KvPlacement place = (*e)->memory().placement();
  place.layer_home = std::move(homes);
  EXPECT_TRUE((*e)->apply_placement(place).is_ok());
  return std::move(*e);
}

// What one decode step of `token` logs.
std::vector<std::string> logged_step(Engine& e, SeqId seq, TokenId token, EventLog& log) {
  log.events.clear();
  std::vector<TokenId> tok = {token};
  const StepRequest r{seq, tok, LogitsMode::kLast};
  EXPECT_TRUE(e.forward(std::span<const StepRequest>(&r, 1)).is_ok());
  return log.events;
}

TEST(TierDataflow, LoadsArePostedBeforeLayerZeroAndEachLayerWaitsForItsOwn) {
  EventLog log;
  auto head = make_random_head(testing::toy_model(5)->config, 9);
  ASSERT_TRUE(head.is_ok());
  transport::LocalTransport local;
  EngineOptions o = sparse_options(SparseMethod::kSpeContext, *head);
  o.tiering.host.push_back(testing::host_tier(8 << 20));
  auto e = recorded_engine(o, local, log, {TierId(0), TierId(1), TierId(0), TierId(1), TierId(1)});
  ASSERT_TRUE(e);
  auto seq = e->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  std::vector<TokenId> prompt(50, 3);
  const StepRequest pre{*seq, prompt, LogitsMode::kLast};
  ASSERT_TRUE(e->forward(std::span<const StepRequest>(&pre, 1)).is_ok());
  for (int step = 0; step < 3; ++step) {
    const std::vector<std::string> want = {"submit 1", "submit 3", "submit 4", "attend", "wait 1", "attend",
                                           "attend",   "wait 3",   "attend",   "wait 4", "attend"};
    EXPECT_EQ(logged_step(*e, *seq, static_cast<TokenId>(step + 1), log), want);
  }
}

// Dense attention over four remote layers, two staged at a time: every layer's tail page (which
// holds cached tokens) and the first two layers' cached pages are posted before layer 0; layer
// j + 2's cached pages are posted once layer j has computed, before layer j + 1 computes.
TEST(TierDataflow, RemoteLayersAreStagedTwoAtATimeUnderDenseAttention) {
  EventLog log;
  auto lb = transport::LoopbackRemoteTransport::create();
  ASSERT_TRUE(lb.is_ok());
  EngineOptions o = sparse_options(SparseMethod::kDense, nullptr);
  o.tiering.remote.push_back(testing::remote_tier(8 << 20));
  auto e = recorded_engine(o, **lb, log, {TierId(0), TierId(1), TierId(1), TierId(1), TierId(1)});
  ASSERT_TRUE(e);
  auto seq = e->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  for (int at = 0; at < 50; at += 8) {  // a page per chunk, so no prefill stages more than a decode step
    std::vector<TokenId> chunk(static_cast<size_t>(std::min(8, 50 - at)), 3);
    const StepRequest pre{*seq, chunk, LogitsMode::kLast};
    ASSERT_TRUE(e->forward(std::span<const StepRequest>(&pre, 1)).is_ok());
  }
  for (int step = 0; step < 3; ++step) {  // positions 50..52: mid-page, so every tail page is loaded
    const std::vector<std::string> want = {
        "submit 1", "submit 2", "submit 3", "submit 4", "submit 1", "submit 2",  // tails; ring of 1, 2
        "dense",                                                                 // layer 0
        "wait 1",   "wait 1",   "dense",    "submit 3",                          // layer 1, then 3's ring
        "wait 2",   "wait 2",   "dense",    "submit 4",                          // layer 2, then 4's ring
        "wait 3",   "wait 3",   "dense",                                         // layer 3
        "wait 4",   "wait 4",   "dense",                                         // layer 4
        "wait 1",   "wait 2",   "wait 3",   "wait 4"};                           // the stores
    EXPECT_EQ(logged_step(*e, *seq, static_cast<TokenId>(step + 1), log), want);
  }
  // The device never held more than two layers' cached pages (6 each) and four tail pages.
  EXPECT_EQ(e->peak_staging_bytes(), (2 * 6 + 4) * uint64_t{2 * 2 * 8 * 16 * 4});
}

}  // namespace
}  // namespace specontext

namespace specontext {
namespace {

// A CPU backend that calls its memory pinned host memory, so that the engine takes its
// device-memory paths (fill_synthetic uploads a pool of pages and copies them with copy_rows), and
// that counts the ops enqueued since the last synchronize() as a device backend's stream would
// hold them (download, select_top_tokens and sample_rows synchronise on a device, so they reset it).
class QueueingBackend final : public Backend {
 public:
  explicit QueueingBackend(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {}
  int64_t queued() const { return queued_; }

  std::string_view name() const override { return "queueing"; }
  bool supports(BackendOp op, DType d) const override { return inner_->supports(op, d); }
  Result<std::shared_ptr<void>> allocate(size_t b) override { return inner_->allocate(b); }
  Status place_weights(const Model& m) override { return inner_->place_weights(m); }
  MemoryKind memory_kind() const override { return MemoryKind::kPinnedHost; }
  bool addressable(MemoryKind k) const override { return inner_->addressable(k); }
  Result<const void*> import_weights(const void* h, size_t b) override { return inner_->import_weights(h, b); }
  Status upload(void* d, const void* s, size_t b) override { return queue(inner_->upload(d, s, b)); }
  Status download(void* d, const void* s, size_t b) override { return drain(inner_->download(d, s, b)); }
  Status copy_rows(void* d, size_t ds, const void* s, size_t ss, size_t rb, int64_t rows) override {
    return queue(inner_->copy_rows(d, ds, s, ss, rb, rows));
  }
  Status synchronize() override { return drain(inner_->synchronize()); }
  Status embed(const TokenId* i, int64_t n, const WeightMatrix& t, float* o) override { return queue(inner_->embed(i, n, t, o)); }
  Status matmul(const float* x, int64_t m, const WeightMatrix& w, const float* b, float* y) override {
    return queue(inner_->matmul(x, m, w, b, y));
  }
  Status rmsnorm(const float* x, const float* w, int64_t r, int64_t d, float e, float* y) override {
    return queue(inner_->rmsnorm(x, w, r, d, e, y));
  }
  Status rope(float* x, int64_t n, int64_t h, const int64_t* p, const RopeParams& r) override {
    return queue(inner_->rope(x, n, h, p, r));
  }
  Status swiglu(const float* g, const float* u, int64_t n, float* o) override { return queue(inner_->swiglu(g, u, n, o)); }
  Status add(float* x, const float* y, int64_t n) override { return queue(inner_->add(x, y, n)); }
  Status kv_append(const float* k, const float* v, int64_t n, int64_t s, const KvLayerView& kv) override {
    return queue(inner_->kv_append(k, v, n, s, kv));
  }
  Status attention(const float* q, const AttentionItem* it, int64_t n, int64_t h, float* o) override {
    return queue(inner_->attention(q, it, n, h, o));
  }
  Status kv_gather(const KvLayerView& kv, const GatherEntry* e, int64_t n, const WorkingSetView& ws) override {
    return queue(inner_->kv_gather(kv, e, n, ws));
  }
  Status attention_sparse(const float* q, const SparseAttentionItem* it, int64_t n, int64_t h, float* o) override {
    return queue(inner_->attention_sparse(q, it, n, h, o));
  }
  Status attention_indexed(const float* q, const IndexedAttentionItem* it, int64_t n, int64_t h, float* o) override {
    return queue(inner_->attention_indexed(q, it, n, h, o));
  }
  Status retrieval_group_scores(const float* q, const void* const* kb, DType kt, int64_t bt, int64_t len, int64_t h,
                                int64_t kv, int64_t hd, float* o) override {
    return queue(inner_->retrieval_group_scores(q, kb, kt, bt, len, h, kv, hd, o));
  }
  Status select_top_tokens(const float* s, int64_t kv, int64_t len, const SelectionOptions& o, Selection& out) override {
    return drain(inner_->select_top_tokens(s, kv, len, o, out));
  }
  Status sample_rows(float* l, int64_t r, int64_t v, const TokenDraw* d, TokenId* t) override {
    return drain(inner_->sample_rows(l, r, v, d, t));
  }

 private:
  Status queue(Status s) {
    ++queued_;
    return s;
  }
  Status drain(Status s) {
    queued_ = 0;
    return s;
  }
  std::shared_ptr<Backend> inner_;
  int64_t queued_ = 0;
};

// Notes, at every migration batch, how many backend ops were still queued.
class MigrationOrderQueue final : public CopyQueue {
 public:
  MigrationOrderQueue(std::shared_ptr<CopyQueue> inner, const QueueingBackend& backend)
      : inner_(std::move(inner)), backend_(backend) {}
  std::vector<int64_t> queued_at_migration;
  Result<CopyTicket> submit(LayerId layer, CopyDirection dir, std::vector<TransferRequest> reqs) override {
    if (dir == CopyDirection::kMigrate) queued_at_migration.push_back(backend_.queued());
    return inner_->submit(layer, dir, std::move(reqs));
  }
  Status wait(CopyTicket t) override { return inner_->wait(t); }
  Status wait_all() override { return inner_->wait_all(); }
  void reset_window() override { inner_->reset_window(); }
  CopyWindowStats window_stats() const override { return inner_->window_stats(); }

 private:
  std::shared_ptr<CopyQueue> inner_;
  const QueueingBackend& backend_;
};

// The copy queue moves layers on the transport's stream, which does not wait for the backend's:
// a layer must leave (or come back) only once every backend op queued before the placement has
// finished, or the move races a fill_synthetic's page copies (or a step's KV append). Before
// apply_placement synchronised the backend, the first move saw fill_synthetic's copies queued.
TEST(TierMigrationOrder, LayersMoveOnlyAfterTheBackendHasDrained) {
  auto backend = std::make_shared<QueueingBackend>(testing::cpu_backend());
  transport::LocalTransport local;
  auto queue = std::make_shared<MigrationOrderQueue>(std::make_shared<testing::InlineCopyQueue>(local), *backend);
  EngineOptions o = sparse_options(SparseMethod::kDense, nullptr);
  o.tiering.host.push_back(testing::host_tier(8 << 20));
  o.tiering.transport = &local;
  o.tiering.copies = queue;
  auto e = Engine::create(testing::toy_model(5), backend, o);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  auto a = (*e)->memory().add_sequence();
  ASSERT_TRUE(a.is_ok());
  ASSERT_TRUE((*e)->fill_synthetic(*a, 100, 1).is_ok());
  ASSERT_GT(backend->queued(), 0) << "fill_synthetic queued no backend copies: nothing to order against";
  KvPlacement place = (*e)->memory().placement();
  place.layer_home = {TierId(0), TierId(1), TierId(0), TierId(1), TierId(1)};
  ASSERT_TRUE((*e)->apply_placement(place, {"out"}).is_ok());
  ASSERT_EQ(queue->queued_at_migration.size(), 3u);
  // And back, after a second fill whose device-homed pages were copied by the backend.
  auto b = (*e)->memory().add_sequence();
  ASSERT_TRUE(b.is_ok());
  ASSERT_TRUE((*e)->fill_synthetic(*b, 60, 2).is_ok());
  ASSERT_GT(backend->queued(), 0);
  place.layer_home.assign(5, TierId(0));
  ASSERT_TRUE((*e)->apply_placement(place, {"back"}).is_ok());
  ASSERT_EQ(queue->queued_at_migration.size(), 6u);
  for (size_t i = 0; i < queue->queued_at_migration.size(); ++i) {
    EXPECT_EQ(queue->queued_at_migration[i], 0) << "migration batch " << i << " was submitted with backend ops queued";
  }
  EXPECT_TRUE((*e)->memory().check_invariants().is_ok());
}

}  // namespace
}  // namespace specontext
