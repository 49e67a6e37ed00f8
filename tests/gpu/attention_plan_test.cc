// The attention work split, checked without a GPU: plan_attention's metadata drives a host
// mirror of the two kernels (split_attention_partial_kernel and split_attention_merge_kernel of
// gpu/attention_common.cuh over kernels_attention.cu's PagedCausalKv: same block decomposition,
// same per-lane arithmetic in log2 units), and the result must match the CPU reference. This pins
// down the decomposition (tiles, chunks, causal early exits, split-K partial indexing and merge)
// in CI; the CUDA tests (cuda_ops_test.cc) check the kernels themselves on a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/ports/backend.h"
#include "cpu/cpu_backend.h"
#include "gpu/attention_plan.h"
#include "gpu/kernels.h"
#include "tests/gpu/plan_test_util.h"

namespace specontext::gpu {
namespace {

using plan_test::attend_tile;
using plan_test::dtype_of;
using plan_test::find_segment;
using plan_test::HostCache;
using plan_test::kKeyTile;
using plan_test::kKvDtypes;
using plan_test::kLog2e;
using plan_test::kv_load;
using plan_test::kWarps;
using plan_test::make_cache;
using plan_test::merge_chunks;
using plan_test::Partials;
using plan_test::stage_queries;
using plan_test::store_query;

// Host mirror of the kernels, driven by the plan (page tables hold host pointers here; elements
// of the plan's kv_type, widened while staged).
void emulate(const AttentionPlan& plan, const float* q, float* out) {
  const kernels::AttentionLaunch& a = plan.launch;
  const DType dtype = dtype_of(a.kv_type);
  const int hd = static_cast<int>(a.head_dim);
  const int qpw = a.queries_per_warp;
  const int qpb = kWarps * qpw;
  const int64_t group = a.n_heads / a.kv_heads;
  Partials partials(plan.partial_o_floats(), plan.partial_ml_floats());

  std::vector<float> k_s(kKeyTile * static_cast<size_t>(hd));
  std::vector<float> v_s(kKeyTile * static_cast<size_t>(hd));
  std::vector<float> q_s(static_cast<size_t>(qpb * hd));
  for (int64_t bx = 0; bx < a.total_blocks; ++bx) {
    for (int64_t kvh = 0; kvh < a.kv_heads; ++kvh) {
      const int64_t item_idx = find_segment(plan.block_begin.data(), a.n_items, bx);
      const kernels::AttentionItemMeta& it = plan.items[static_cast<size_t>(item_idx)];
      const int64_t local = bx - plan.block_begin[static_cast<size_t>(item_idx)];
      const int64_t tile = local / it.n_chunks;
      const int64_t chunk = local - tile * it.n_chunks;
      const int64_t n_pairs = it.n_tokens * group;
      const int64_t pair0 = tile * qpb;
      const int64_t last_pair = std::min<int64_t>(pair0 + qpb, n_pairs) - 1;
      const int64_t max_qpos = it.start_pos + last_pair / group;
      const int64_t key_begin = chunk * a.chunk_size;
      if (key_begin > max_qpos) continue;
      const int64_t key_end = std::min(key_begin + a.chunk_size, max_qpos + 1);
      stage_queries(q_s, q, qpb, hd, pair0, n_pairs, it.token_offset, group, kvh, a.n_heads,
                    a.scale * kLog2e);
      // Per (warp, query slot): qpos, m, l, o[hd].
      std::vector<int64_t> qpos(static_cast<size_t>(qpb));
      std::vector<float> m(static_cast<size_t>(qpb), -INFINITY);
      std::vector<float> l(static_cast<size_t>(qpb), 0.0f);
      std::vector<float> o(static_cast<size_t>(qpb * hd), 0.0f);
      for (int slot = 0; slot < qpb; ++slot) {
        const int64_t pair = pair0 + slot;
        qpos[static_cast<size_t>(slot)] = pair < n_pairs ? it.start_pos + pair / group : -1;
      }
      void* const* k_pages = plan.pages.data() + it.page_table_offset;
      void* const* v_pages = k_pages + it.n_pages;
      for (int64_t t0 = key_begin; t0 < key_end; t0 += kKeyTile) {
        const int n_keys = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - t0));
        for (int j = 0; j < n_keys; ++j) {
          const int64_t pos = t0 + j;
          const int64_t page = pos / it.page_size;
          const int64_t off = (kvh * it.page_size + (pos - page * it.page_size)) * hd;
          for (int d = 0; d < hd; ++d) {
            k_s[static_cast<size_t>(j * hd + d)] = kv_load(k_pages[page], dtype, off + d);
            v_s[static_cast<size_t>(j * hd + d)] = kv_load(v_pages[page], dtype, off + d);
          }
        }
        for (int slot = 0; slot < qpb; ++slot) {  // slot = warp * qpw + s
          const size_t us = static_cast<size_t>(slot);
          attend_tile(
              q_s.data() + slot * hd, k_s, v_s, hd, n_keys, [&](int lane) { return t0 + lane <= qpos[us]; },
              m[us], l[us], o.data() + slot * hd);
        }
      }
      for (int slot = 0; slot < qpb; ++slot) {
        if (qpos[static_cast<size_t>(slot)] < key_begin) continue;
        const int64_t pair = pair0 + slot;
        store_query(a, it, partials, out, pair, group, kvh, chunk, m[static_cast<size_t>(slot)],
                    l[static_cast<size_t>(slot)], o.data() + static_cast<size_t>(slot * hd));
      }
    }
  }
  if (a.n_chunks_max == 1) return;
  for (int64_t w = 0; w < a.total_rows * a.n_heads; ++w) {
    const int64_t r = w / a.n_heads;
    const int64_t h = w - r * a.n_heads;
    const int64_t item_idx = find_segment(plan.row_begin.data(), a.n_items, r);
    const int64_t local = r - plan.row_begin[static_cast<size_t>(item_idx)];
    const int64_t row = plan.items[static_cast<size_t>(item_idx)].token_offset + local;
    const int64_t qpos = plan.items[static_cast<size_t>(item_idx)].start_pos + local;
    const int64_t n = qpos / a.chunk_size + 1;
    const int64_t base = (r * a.n_heads + h) * a.n_chunks_max;
    merge_chunks(partials, base, n, hd, out + (row * a.n_heads + h) * hd);
  }
}

struct Case {
  const char* name;
  int64_t n_heads, kv_heads, head_dim, page_size;
  std::vector<std::pair<int64_t, int64_t>> items;  // (n_tokens, start_pos)
  int sm_count;
};

class AttentionPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ref = cpu::create_cpu_backend(cpu::CpuBackendOptions{.reference = true});
    ASSERT_TRUE(ref.is_ok()) << ref.status().to_string();
    ref_ = std::move(ref).value();
  }

  // Every case runs for each KV dtype: the plan must record it, and the mirror reads it.
  void run(const Case& c, bool expect_split) {
    for (DType dtype : kKvDtypes) run(c, expect_split, dtype);
  }

  void run(const Case& c, bool expect_split, DType dtype) {
    SCOPED_TRACE(std::string(c.name) + ", " + std::string(dtype_name(dtype)));
    std::vector<std::unique_ptr<HostCache>> caches;
    std::vector<AttentionItem> items;
    int64_t total_rows = 0;
    for (const auto& [n_tokens, start_pos] : c.items) total_rows += n_tokens;
    int64_t next_row = total_rows;  // reverse row order: rows are not in item order
    for (const auto& [n_tokens, start_pos] : c.items) {
      const int64_t pages = (start_pos + n_tokens + c.page_size - 1) / c.page_size + 1;
      caches.push_back(make_cache(rng_, pages, c.page_size, c.kv_heads, c.head_dim, dtype));
      next_row -= n_tokens;
      items.push_back(AttentionItem{next_row, n_tokens, start_pos, caches.back()->view});
    }
    const size_t size = static_cast<size_t>(total_rows * c.n_heads * c.head_dim);
    std::vector<float> q(size);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (float& x : q) x = dist(rng_);

    auto plan = plan_attention(items.data(), static_cast<int64_t>(items.size()), c.n_heads, c.sm_count);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    const kernels::AttentionLaunch& a = plan->launch;
    EXPECT_EQ(dtype_of(a.kv_type), dtype);
    EXPECT_EQ(a.n_chunks_max > 1, expect_split) << "chunk " << a.chunk_size;
    EXPECT_EQ(a.chunk_size % kernels::kAttentionKeyTile, 0);
    EXPECT_EQ(a.total_rows, total_rows);
    // Every item's chunks cover its keys; the partial index space covers every query.
    for (const kernels::AttentionItemMeta& it : plan->items) {
      if (it.n_tokens == 0) continue;
      EXPECT_GE(it.n_chunks * a.chunk_size, it.start_pos + it.n_tokens);
      EXPECT_LE(it.n_chunks, a.n_chunks_max);
    }

    std::vector<float> got(size, std::numeric_limits<float>::quiet_NaN());
    emulate(*plan, q.data(), got.data());
    std::vector<float> want(size);
    ASSERT_TRUE(ref_->attention(q.data(), items.data(), static_cast<int64_t>(items.size()),
                                c.n_heads, want.data()).is_ok());
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < size; ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << "element " << i << " not written or not finite";
      num += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
      den += static_cast<double>(want[i]) * want[i];
    }
    ASSERT_GT(den, 0.0);
    EXPECT_LT(std::sqrt(num / den), 1e-5);
  }

  std::unique_ptr<Backend> ref_;
  std::mt19937 rng_{77};
};

TEST_F(AttentionPlanTest, DecodeSplitsLongContexts) {
  run({"mha decode", 4, 4, 64, 16, {{1, 3000}}, 132}, true);
  run({"gqa decode batch", 32, 8, 128, 16, {{1, 700}, {1, 5}, {1, 2047}, {1, 0}}, 132}, true);
  run({"head_dim 256, page 1", 8, 1, 256, 1, {{1, 1500}}, 108}, true);
  run({"head_dim 80", 6, 3, 80, 4, {{1, 600}}, 132}, true);
}

TEST_F(AttentionPlanTest, PrefillAndMixedBatches) {
  run({"short prefill: no split", 8, 2, 64, 16, {{100, 0}}, 132}, false);
  run({"enough blocks: no split", 32, 8, 64, 16, {{300, 0}}, 2}, false);
  run({"chunked prefill, split", 8, 2, 128, 16, {{40, 300}}, 132}, true);
  run({"mixed with empty item", 12, 4, 128, 8, {{33, 17}, {0, 50}, {1, 900}, {5, 0}}, 132}, true);
  run({"qpw 2 (gqa 8 decode)", 16, 2, 64, 16, {{1, 1000}}, 132}, true);
  run({"one SM: no split", 8, 8, 64, 16, {{3, 2000}}, 1}, false);
}

TEST_F(AttentionPlanTest, EmptyBatchesPlanNothing) {
  auto none = plan_attention(nullptr, 0, 8, 132);
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->launch.total_blocks, 0);
  auto cache = make_cache(rng_, 2, 4, 1, 8);
  AttentionItem empty{0, 0, 3, cache->view};
  auto plan = plan_attention(&empty, 1, 2, 132);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->launch.total_blocks, 0);
}

TEST_F(AttentionPlanTest, RejectsBadBatches) {
  auto cache = make_cache(rng_, 2, 4, 2, 8);
  AttentionItem item{0, 1, 0, cache->view};
  EXPECT_EQ(plan_attention(&item, 1, 3, 132).status().code(), StatusCode::kInvalidArgument);
  AttentionItem too_long{0, 4, 5, cache->view};  // capacity 8
  EXPECT_EQ(plan_attention(&too_long, 1, 2, 132).status().code(), StatusCode::kOutOfRange);
  auto wide = make_cache(rng_, 1, 4, 1, 512);
  AttentionItem wide_item{0, 1, 0, wide->view};
  EXPECT_EQ(plan_attention(&wide_item, 1, 1, 132).status().code(), StatusCode::kUnimplemented);
  auto other = make_cache(rng_, 2, 4, 1, 8);
  AttentionItem items[2] = {item, AttentionItem{1, 1, 0, other->view}};
  EXPECT_EQ(plan_attention(items, 2, 2, 132).status().code(), StatusCode::kInvalidArgument);
}

// One element type per launch: a batch mixing KV dtypes, or holding one that is not f32, f16 or
// bf16, is refused with the offending item's field named, also when that item has no rows.
TEST_F(AttentionPlanTest, RejectsMixedAndNonKvDtypes) {
  auto f32 = make_cache(rng_, 2, 4, 2, 8, DType::kF32);
  auto bf16 = make_cache(rng_, 2, 4, 2, 8, DType::kBF16);
  auto f16 = make_cache(rng_, 2, 4, 2, 8, DType::kF16);
  const auto status = [&](std::vector<AttentionItem> items) {
    return plan_attention(items.data(), static_cast<int64_t>(items.size()), 4, 132).status();
  };
  EXPECT_TRUE(status({{0, 1, 0, bf16->view}, {1, 1, 3, bf16->view}}).is_ok());
  Status s = status({{0, 1, 0, f32->view}, {1, 1, 0, bf16->view}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("items[1].kv.dtype"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("bf16"), std::string::npos) << s.to_string();
  s = status({{0, 1, 0, f16->view}, {1, 1, 0, f16->view}, {2, 0, 0, bf16->view}});  // empty item
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("items[2].kv.dtype"), std::string::npos) << s.to_string();
  for (DType bad : {DType::kI32, DType::kQ8_0, DType::kU8, DType::kI64}) {
    KvLayerView view = f32->view;
    view.dtype = bad;
    s = status({{0, 1, 0, view}});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << dtype_name(bad);
    EXPECT_NE(s.message().find("items[0].kv.dtype is " + std::string(dtype_name(bad))), std::string::npos)
        << s.to_string();
  }
}

}  // namespace
}  // namespace specontext::gpu
