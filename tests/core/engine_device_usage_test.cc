// The device memory the planner's model counts (paper Eq. 7) against what the engine allocates in
// its device tier, for the same configuration:
//  * resident KV  = (L − i)·T·H·D·kvc   ↔ the chunks of the layers homed on the device;
//  * staging      = i·R·B·H·D·kvc       ↔ the working sets (K + V) of the offloaded layers: a
//                                         device-homed layer has none (it is attended in place,
//                                         Backend::attention_indexed);
//  * retrieval    = T·r                 ↔ the retrieval head's key blocks;
// and nothing else is left in the tier between steps. The placement is the planner's own plan
// (`plan()` on a snapshot of the engine's shape, with a device capacity that makes it offload i
// layers), applied to the engine before the sequences arrive; R sequences then prefill and decode
// sparsely to a length S that fills whole KV chunks and head key blocks, so the granularities add
// nothing. Checked for all layers resident (i = 0) and partly offloaded (i = 2 of 5), every KV
// dtype. The engine's logits equal those of an engine with every layer on the device.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/sparse/retrieval_head.h"
#include "planner/plan.h"
#include "planner/snapshot.h"
#include "tests/core/tier_test_util.h"
#include "transport/local_transport.h"

namespace specontext {
namespace {

constexpr int64_t kLayers = 5;
constexpr int64_t kRequests = 4;
constexpr int64_t kBudget = 24;  // also the head's key block: 24 tokens
constexpr int64_t kPage = 8;
constexpr int64_t kLength = 72;  // 9 pages (whole chunks of one page), 3 key blocks

EngineOptions options(const std::shared_ptr<RetrievalHead>& head, DType kv_dtype) {
  EngineOptions o;
  o.kv_dtype = kv_dtype;
  o.max_sequences = kRequests;
  o.max_context = 256;
  o.page_size = kPage;
  o.kv_chunk_pages = 1;
  o.sparse.method = SparseMethod::kSpeContext;
  o.sparse.selection = {kBudget, 1, 4};
  o.retrieval_head = head;
  return o;
}

// The planner's snapshot of the engine: no weights in the device tier (they live outside it),
// head keys in the KV dtype (H_head·D·kvc bytes a token, as runtime/tier_setup.cc passes it),
// R running slots, the live lengths.
planner::PlannerSnapshot snapshot(const Model& m, const RetrievalHead& head, DType kv_dtype) {
  planner::PlannerSnapshot s;
  auto shape = planner::shape_from_config(m.config);
  EXPECT_TRUE(shape.is_ok());
  s.model = *shape;
  s.model.head_kv_heads = head.config.n_kv_heads;
  s.kv_elem_bytes = static_cast<int64_t>(dtype_size(kv_dtype));
  s.model_bytes = 0;
  s.head_bytes = 0;
  s.runtime_factor = 1.0;
  s.budget = kBudget;
  s.requests = kRequests;
  s.host.push_back({0, 64 << 20, 0});
  s.retrieval_bytes_per_token = head.config.n_kv_heads * head.config.head_dim * static_cast<int64_t>(dtype_size(kv_dtype));
  s.seq_lens.assign(kRequests, kLength);
  return s;
}

struct Outcome {
  planner::Plan plan;
  uint64_t device_used = 0, resident = 0, working_sets = 0;
  std::vector<std::vector<float>> logits;  // per decode step
};

// Plans for `offloaded` layers, applies the plan (or none: every layer on the device) to a fresh
// engine, prefills R sequences and decodes them to kLength.
Outcome run_engine(const std::shared_ptr<Model>& model, const std::shared_ptr<RetrievalHead>& head, DType kv_dtype,
        int64_t offloaded, bool apply) {
  Outcome r;
  planner::PlannerSnapshot s = snapshot(*model, *head, kv_dtype);
  // Capacity: the usage with `offloaded` layers off the device plus one token per request (so that
  // S < S^T_offloaded) — offloading fewer does not fit (a layer's T tokens exceed R·B).
  const int64_t token = s.model.kv_heads * s.model.head_dim * 2 * s.kv_elem_bytes;
  const int64_t T = kRequests * kLength;
  s.device_bytes = (kLayers - offloaded) * T * token + T * s.retrieval_bytes_per_token +
                   offloaded * kRequests * kBudget * token +
                   kRequests * ((kLayers - offloaded) * token + s.retrieval_bytes_per_token);
  auto p = planner::plan(s);
  EXPECT_TRUE(p.is_ok()) << p.status().to_string();
  if (!p.is_ok()) return r;
  r.plan = *p;
  EXPECT_EQ(r.plan.offloaded_layers, offloaded);

  transport::LocalTransport local;
  EngineOptions o = options(head, kv_dtype);
  o.tiering.device_bytes = 8 << 20;
  o.tiering.host.push_back(testing::host_tier(8 << 20));
  o.tiering.transport = &local;
  o.tiering.copies = std::make_shared<testing::InlineCopyQueue>(local);
  auto e = Engine::create(model, testing::cpu_backend(), o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  if (!e.is_ok()) return r;
  Engine& engine = **e;
  if (apply) {
    KvPlacement place = engine.memory().placement();
    for (const planner::LayerPlacement& lp : r.plan.layers) {
      place.layer_home[static_cast<size_t>(lp.layer.value())] = lp.home;
    }
    EXPECT_TRUE(engine.apply_placement(place).is_ok());
  }
  std::vector<SeqId> ids;
  std::vector<StepRequest> reqs;
  std::vector<std::vector<TokenId>> prompts(kRequests);
  for (int64_t i = 0; i < kRequests; ++i) {
    auto id = engine.memory().add_sequence();
    EXPECT_TRUE(id.is_ok());
    ids.push_back(*id);
    for (int64_t t = 0; t < kLength - 8; ++t) prompts[static_cast<size_t>(i)].push_back(static_cast<TokenId>((t * 7 + i) % 200 + 1));
    reqs.push_back({*id, prompts[static_cast<size_t>(i)], LogitsMode::kLast, nullptr, /*prompt=*/true});
  }
  EXPECT_TRUE(engine.forward(reqs).is_ok());
  std::vector<std::vector<TokenId>> next(kRequests);
  for (int step = 0; step < 8; ++step) {  // lengths 65 .. 72, every step sparse (length > B)
    reqs.clear();
    for (int64_t i = 0; i < kRequests; ++i) {
      next[static_cast<size_t>(i)] = {static_cast<TokenId>((step * 13 + i * 5) % 200 + 1)};
      reqs.push_back({ids[static_cast<size_t>(i)], next[static_cast<size_t>(i)], LogitsMode::kLast});
    }
    auto out = engine.forward(reqs);
    EXPECT_TRUE(out.is_ok()) << out.status().to_string();
    if (!out.is_ok()) return r;
    r.logits.push_back(out->logits);
  }
  EXPECT_EQ(engine.sparse_stats().sparse_steps, 8 * kRequests);
  for (SeqId id : ids) EXPECT_EQ(engine.memory().sequence_length(id), kLength);
  const KvStore& kv = engine.memory().kv_store();
  r.device_used = kv.tier_used_bytes(TierId(0));
  for (int64_t l = 0; l < kLayers; ++l) {
    if (kv.resident(LayerId(static_cast<int32_t>(l)))) r.resident += kv.layer_bytes(LayerId(static_cast<int32_t>(l)));
  }
  r.working_sets = engine.memory().working_set_bytes_in_use();
  EXPECT_TRUE(engine.memory().check_invariants().is_ok());
  return r;
}

class DeviceUsageMatchesPlanner : public ::testing::TestWithParam<DType> {};

TEST_P(DeviceUsageMatchesPlanner, AllResidentAndPartlyOffloaded) {
  const DType kv_dtype = GetParam();
  auto model = testing::toy_model(kLayers);
  auto head = make_random_head(model->config, 9);
  ASSERT_TRUE(head.is_ok());
  const Outcome all_device = run_engine(model, *head, kv_dtype, 0, /*apply=*/false);
  for (int64_t offloaded : {int64_t{0}, int64_t{2}}) {
    SCOPED_TRACE("offloaded " + std::to_string(offloaded));
    const Outcome r = run_engine(model, *head, kv_dtype, offloaded, /*apply=*/true);
    if (::testing::Test::HasFailure()) return;
    const planner::DeviceUsage& u = r.plan.device;
    EXPECT_EQ(u.weights_bytes, 0);
    EXPECT_EQ(r.resident, static_cast<uint64_t>(u.resident_kv_bytes));
    EXPECT_EQ(r.working_sets, static_cast<uint64_t>(u.staging_bytes));
    EXPECT_EQ(r.device_used - r.resident - r.working_sets, static_cast<uint64_t>(u.retrieval_bytes))
        << "the head's key blocks (nothing else stays in the tier)";
    EXPECT_EQ(r.device_used, static_cast<uint64_t>(u.total_bytes));
    EXPECT_LE(u.total_bytes, u.capacity_bytes);
    // Device-homed layers hold no working set: all resident, none at all.
    if (offloaded == 0) {
      EXPECT_EQ(r.working_sets, 0u);
    }
    EXPECT_GT(u.resident_kv_bytes, 0);
    EXPECT_GT(u.retrieval_bytes, 0);
    // The head's keys are kept in the KV dtype: T tokens of H_head·D elements of it, no more (for
    // f16 / bf16 half the f32 bytes).
    const uint64_t head_elems =
        static_cast<uint64_t>(kRequests * kLength * (*head)->config.n_kv_heads * (*head)->config.head_dim);
    EXPECT_EQ(r.device_used - r.resident - r.working_sets, head_elems * dtype_size(kv_dtype));
    ASSERT_EQ(r.logits.size(), all_device.logits.size());
    for (size_t step = 0; step < r.logits.size(); ++step) {
      EXPECT_EQ(testing::max_abs_diff(r.logits[step], all_device.logits[step]), 0.0f) << "step " << step;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, DeviceUsageMatchesPlanner, ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

}  // namespace
}  // namespace specontext
