// The sparse-decode work split, checked without a GPU: plan_kv_gather's and
// plan_attention_sparse's metadata drive host mirrors of the kernels in gpu/kernels_sparse.cu
// (same block decomposition, same per-lane arithmetic in log2 units, same split-K indexing and
// merge), and the results must match the CPU reference backend. The CUDA tests
// (sparse_ops_test.cc) check the kernels themselves on a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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
#include "gpu/sparse_plan.h"
#include "tests/gpu/plan_test_util.h"

namespace specontext::gpu {
namespace {

using plan_test::attend_tile;
using plan_test::dtype_of;
using plan_test::find_segment;
using plan_test::kKeyTile;
using plan_test::kKvDtypes;
using plan_test::kLog2e;
using plan_test::kv_load;
using plan_test::kWarps;
using plan_test::make_cache;
using plan_test::merge_chunks;
using plan_test::Partials;
using plan_test::random_kv;
using plan_test::stage_queries;
using plan_test::store_query;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// Host mirror of kv_gather_kernel: the plan's page range and table, entries as uploaded, rows of
// head_dim elements of the plan's kv_type copied as bytes.
void emulate_gather(const KvGatherPlan& plan, const GatherEntry* entries) {
  const kernels::KvGatherLaunch& g = plan.launch;
  const int64_t elem = kernels::kv_type_bytes(g.kv_type);
  for (int64_t w = 0; w < g.n_entries; ++w) {
    const GatherEntry& e = entries[w];
    const int64_t page = e.token / g.page_size;
    const int64_t src = (e.kv_head * g.page_size + (e.token - page * g.page_size)) * g.head_dim * elem;
    const int64_t dst = (e.kv_head * g.slots + e.slot) * g.head_dim * elem;
    ASSERT_GE(page - g.first_page, 0);
    ASSERT_LT(page - g.first_page, g.n_pages);
    const auto* k_src =
        static_cast<const uint8_t*>(plan.pages[static_cast<size_t>(page - g.first_page)]) + src;
    const auto* v_src =
        static_cast<const uint8_t*>(plan.pages[static_cast<size_t>(g.n_pages + page - g.first_page)]) + src;
    std::memcpy(static_cast<uint8_t*>(g.ws_k) + dst, k_src, static_cast<size_t>(g.head_dim * elem));
    std::memcpy(static_cast<uint8_t*>(g.ws_v) + dst, v_src, static_cast<size_t>(g.head_dim * elem));
  }
}

// Host mirror of split_attention_partial_kernel and split_attention_merge_kernel over WorkingSetKv,
// or (`indexed`, a plan_attention_indexed plan) over IndexedPagedKv: key j of head kvh is token
// indices[indices_offset + kvh · slots + j] of the item's pages.
void emulate_attention(const SparseAttentionPlan& plan, const float* q, float* out, bool indexed = false) {
  const kernels::SparseAttentionLaunch& a = plan.launch;
  const DType dtype = dtype_of(a.kv_type);
  const int hd = static_cast<int>(a.head_dim);
  const int qpb = kWarps * a.queries_per_warp;
  const int64_t group = a.n_heads / a.kv_heads;
  Partials partials(plan.partial_o_floats(), plan.partial_ml_floats());
  std::vector<float> k_s(static_cast<size_t>(kKeyTile * hd)), v_s(k_s.size()),
      q_s(static_cast<size_t>(qpb * hd));
  for (int64_t bx = 0; bx < a.total_blocks; ++bx) {
    for (int64_t kvh = 0; kvh < a.kv_heads; ++kvh) {
      const int64_t item_idx = find_segment(plan.block_begin.data(), a.n_items, bx);
      const kernels::SparseItemMeta& it = plan.items[static_cast<size_t>(item_idx)];
      const int64_t local = bx - plan.block_begin[static_cast<size_t>(item_idx)];
      const int64_t tile = local / it.n_chunks;
      const int64_t chunk = local - tile * it.n_chunks;
      const int64_t n_pairs = it.n_tokens * group;
      const int64_t pair0 = tile * qpb;
      const int64_t count = plan.counts[static_cast<size_t>(it.counts_offset + kvh)];
      const int64_t key_begin = chunk * a.chunk_size;
      if (key_begin >= count) {
        if (a.n_chunks_max == 1) {
          for (int slot = 0; slot < qpb && pair0 + slot < n_pairs; ++slot) {
            const int64_t pair = pair0 + slot;
            const int64_t row = it.token_offset + pair / group;
            const int64_t h = kvh * group + pair % group;
            std::fill(out + (row * a.n_heads + h) * hd, out + (row * a.n_heads + h + 1) * hd, 0.0f);
          }
        }
        continue;
      }
      const int64_t key_end = std::min(key_begin + a.chunk_size, count);
      stage_queries(q_s, q, qpb, hd, pair0, n_pairs, it.token_offset, group, kvh, a.n_heads,
                    a.scale * kLog2e);
      std::vector<float> m(static_cast<size_t>(qpb), -INFINITY), l(static_cast<size_t>(qpb), 0.0f);
      std::vector<float> o(static_cast<size_t>(qpb * hd), 0.0f);
      const int64_t head = kvh * it.slots * hd;
      for (int64_t t0 = key_begin; t0 < key_end; t0 += kKeyTile) {
        const int n_keys = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - t0));
        for (int j = 0; j < n_keys; ++j) {
          const void* k_base = it.k;
          const void* v_base = it.v;
          int64_t row = head + (t0 + j) * hd;
          if (indexed) {
            const int32_t token =
                plan.indices[static_cast<size_t>(it.indices_offset + kvh * it.slots + t0 + j)];
            const int64_t page = token / it.page_size;
            k_base = plan.pages[static_cast<size_t>(it.pages_offset + page)];
            v_base = plan.pages[static_cast<size_t>(it.pages_offset + it.n_pages + page)];
            row = (kvh * it.page_size + (token - page * it.page_size)) * hd;
          }
          for (int d = 0; d < hd; ++d) {
            k_s[static_cast<size_t>(j * hd + d)] = kv_load(k_base, dtype, row + d);
            v_s[static_cast<size_t>(j * hd + d)] = kv_load(v_base, dtype, row + d);
          }
        }
        for (int slot = 0; slot < qpb; ++slot) {  // no mask: every key of the set is visible
          attend_tile(
              q_s.data() + slot * hd, k_s, v_s, hd, n_keys, [](int) { return true; },
              m[static_cast<size_t>(slot)], l[static_cast<size_t>(slot)], o.data() + slot * hd);
        }
      }
      for (int slot = 0; slot < qpb; ++slot) {
        const int64_t pair = pair0 + slot;
        if (pair >= n_pairs) continue;
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
    const kernels::SparseItemMeta& it = plan.items[static_cast<size_t>(item_idx)];
    const int64_t row = it.token_offset + (r - plan.row_begin[static_cast<size_t>(item_idx)]);
    const int64_t count = plan.counts[static_cast<size_t>(it.counts_offset + h / group)];
    const int64_t n = (count + a.chunk_size - 1) / a.chunk_size;
    const int64_t base = (r * a.n_heads + h) * a.n_chunks_max;
    float* dst = out + (row * a.n_heads + h) * hd;
    if (n == 0) {
      std::fill(dst, dst + hd, 0.0f);
      continue;
    }
    merge_chunks(partials, base, n, hd, dst);
  }
}

// A host working set of `dtype` elements; slots beyond counts[h] hold NaN (in the dtype).
struct HostWorkingSet {
  int64_t kv_heads, slots, head_dim;
  DType dtype;
  std::vector<uint8_t> k, v;
  std::vector<int32_t> counts;
  HostWorkingSet(std::mt19937& rng, int64_t kvh, int64_t n_slots, int64_t hd, const std::vector<int32_t>& c,
                 DType t = DType::kF32)
      : kv_heads(kvh), slots(n_slots), head_dim(hd), dtype(t), counts(c) {
    const size_t n = static_cast<size_t>(kvh * n_slots * hd);
    const std::vector<float> nan(n, kNan);
    k.resize(n * dtype_size(t));
    v.resize(k.size());
    convert_from_f32(t, nan.data(), k.data(), n);
    convert_from_f32(t, nan.data(), v.data(), n);
    for (int64_t h = 0; h < kvh; ++h) {
      const size_t count = static_cast<size_t>(counts[static_cast<size_t>(h)] * hd);
      const size_t at = static_cast<size_t>(h * n_slots * hd) * dtype_size(t);
      const std::vector<uint8_t> kh = random_kv(rng, count, t, -2.0f, 2.0f);
      const std::vector<uint8_t> vh = random_kv(rng, count, t);
      std::copy(kh.begin(), kh.end(), k.begin() + static_cast<std::ptrdiff_t>(at));
      std::copy(vh.begin(), vh.end(), v.begin() + static_cast<std::ptrdiff_t>(at));
    }
  }
  WorkingSetView view() { return {k.data(), v.data(), kv_heads, slots, head_dim, counts.data(), dtype}; }
};

struct ItemSpec {
  int64_t n_tokens;
  std::vector<int32_t> counts;  // per KV head
  int64_t slots;
};

struct Case {
  std::string name;
  int64_t n_heads, kv_heads, head_dim;
  std::vector<ItemSpec> items;
  int sm_count;
  bool expect_split;
};

class SparsePlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ref = cpu::create_cpu_backend(cpu::CpuBackendOptions{.reference = true});
    ASSERT_TRUE(ref.is_ok()) << ref.status().to_string();
    ref_ = std::move(ref).value();
  }

  // Every case runs for each KV dtype: the plan must record it, and the mirror reads it.
  void run(const Case& c) {
    for (DType dtype : kKvDtypes) run(c, dtype);
  }

  void run(const Case& c, DType dtype) {
    SCOPED_TRACE(c.name + ", " + std::string(dtype_name(dtype)));
    std::vector<std::unique_ptr<HostWorkingSet>> sets;
    std::vector<SparseAttentionItem> items;
    int64_t total_rows = 0;
    for (const ItemSpec& s : c.items) total_rows += s.n_tokens;
    int64_t next_row = total_rows;  // reverse row order: rows are not in item order
    for (const ItemSpec& s : c.items) {
      sets.push_back(
          std::make_unique<HostWorkingSet>(rng_, c.kv_heads, s.slots, c.head_dim, s.counts, dtype));
      next_row -= s.n_tokens;
      items.push_back({next_row, s.n_tokens, sets.back()->view()});
    }
    const size_t size = static_cast<size_t>(total_rows * c.n_heads * c.head_dim);
    std::vector<float> q(size);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (float& x : q) x = dist(rng_);

    auto plan =
        plan_attention_sparse(items.data(), static_cast<int64_t>(items.size()), c.n_heads, c.sm_count);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    const kernels::SparseAttentionLaunch& a = plan->launch;
    EXPECT_EQ(dtype_of(a.kv_type), dtype);
    EXPECT_EQ(a.n_chunks_max > 1, c.expect_split) << "chunk " << a.chunk_size;
    EXPECT_EQ(a.chunk_size % kernels::kAttentionKeyTile, 0);
    EXPECT_EQ(a.total_rows, total_rows);
    for (size_t i = 0; i < plan->items.size(); ++i) {
      const kernels::SparseItemMeta& it = plan->items[i];
      const int32_t item_max = *std::max_element(c.items[i].counts.begin(), c.items[i].counts.end());
      EXPECT_GE(it.n_chunks * a.chunk_size, item_max);  // chunks cover every head's slots
      EXPECT_LE(it.n_chunks, a.n_chunks_max);
      EXPECT_GE(it.n_chunks, 1);
    }

    std::vector<float> got(size, kNan);  // anything left unwritten fails the finiteness check
    emulate_attention(*plan, q.data(), got.data());
    std::vector<float> want(size);
    ASSERT_TRUE(ref_->attention_sparse(q.data(), items.data(), static_cast<int64_t>(items.size()), c.n_heads,
                                       want.data())
                    .is_ok());
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < size; ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << "element " << i << " not written or not finite";
      if (want[i] == 0.0f) {
        EXPECT_EQ(got[i], 0.0f) << "element " << i;  // empty heads: exact zeros
      }
      num += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
      den += static_cast<double>(want[i]) * want[i];
    }
    bool any_keys = false;  // else the exact-zero check above is the whole test
    for (const ItemSpec& spec : c.items) {
      for (int32_t count : spec.counts) any_keys = any_keys || (spec.n_tokens > 0 && count > 0);
    }
    if (!any_keys) return;
    ASSERT_GT(den, 0.0);
    EXPECT_LT(std::sqrt(num / den), 1e-5);
  }

  std::unique_ptr<Backend> ref_;
  std::mt19937 rng_{91};
};

TEST_F(SparsePlanTest, DecodeBatchesSplitWhenTheGridIsSmall) {
  run({"gqa 4, one sequence, 2048 slots", 32, 8, 128, {{1, std::vector<int32_t>(8, 2048), 2048}}, 132, true});
  run({"mqa, counts 0..slots", 8, 1, 64, {{1, {1500}, 1500}, {2, {0}, 40}, {1, {700}, 900}}, 132, true});
  run({"head_dim 256, gqa 8, 2 rows", 16, 2, 256, {{2, {1100, 3}, 1200}}, 108, true});
  run({"head_dim 80, mha, an empty head", 4, 4, 80, {{1, {600, 0, 33, 599}, 600}}, 132, true});
}

TEST_F(SparsePlanTest, NoSplitWhenBlocksSufficeOrSetsAreShort) {
  run({"short sets", 8, 2, 64, {{1, {200, 17}, 256}, {2, {0, 256}, 256}}, 132, false});
  run({"enough blocks",
       32,
       8,
       128,
       {{1, std::vector<int32_t>(8, 2048), 2048}, {1, std::vector<int32_t>(8, 1000), 2048}},
       2,
       false});
  run({"one SM", 8, 8, 8, {{2, {900, 1, 0, 5, 900, 7, 800, 2}, 900}}, 1, false});
  run({"all heads empty", 8, 2, 64, {{1, {0, 0}, 16}, {2, {0, 0}, 0}}, 132, false});
  run({"mixed with an empty item", 12, 4, 64, {{0, {5, 5, 5, 5}, 8}, {1, {8, 0, 3, 8}, 8}}, 132, false});
}

// plan_attention_indexed: the same split over the selected positions of paged caches (random
// pages in shuffled order; indices ascending or shuffled, runs and scattered; counts 0 .. stride),
// every KV dtype, with and without a split; the mirror against the reference's attention_indexed.
TEST_F(SparsePlanTest, IndexedAttentionMatchesReference) {
  struct IndexedCase {
    int64_t n_heads, kv_heads, head_dim, sm_count;
    std::vector<int64_t> lengths;  // per item; rows alternate 1, 2
    int64_t stride;
    bool expect_split;
  };
  const IndexedCase cases[] = {{32, 8, 128, 132, {2100}, 2048, true},
                               {8, 1, 64, 132, {1600, 50, 900}, 800, true},
                               {8, 2, 64, 132, {300, 70}, 64, false},
                               {4, 4, 80, 1, {500}, 300, false}};
  for (const IndexedCase& c : cases) {
    for (DType dtype : kKvDtypes) {
      SCOPED_TRACE("heads " + std::to_string(c.n_heads) + "/" + std::to_string(c.kv_heads) + " d " +
                   std::to_string(c.head_dim) + " " + std::string(dtype_name(dtype)));
      const int64_t ps = 16;
      std::vector<std::unique_ptr<plan_test::HostCache>> caches;
      std::vector<std::vector<int32_t>> indices, counts;
      std::vector<IndexedAttentionItem> items;
      int64_t rows = 0;
      for (size_t i = 0; i < c.lengths.size(); ++i) {
        const int64_t length = c.lengths[i];
        caches.push_back(make_cache(rng_, (length + ps - 1) / ps, ps, c.kv_heads, c.head_dim, dtype));
        std::vector<int32_t> idx(static_cast<size_t>(c.kv_heads * c.stride), -1), cnt;
        for (int64_t h = 0; h < c.kv_heads; ++h) {
          std::vector<int32_t> all(static_cast<size_t>(length));
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin(), all.end(), rng_);
          const int64_t most = std::min(c.stride, length);
          const int64_t n = h == 0 && i == 0 && c.kv_heads > 1 ? 0  // an empty head
                            : h == c.kv_heads - 1              ? most  // a full one
                                                               : static_cast<int64_t>(rng_() % static_cast<uint32_t>(most + 1));
          all.resize(static_cast<size_t>(n));
          if (h % 2 == 0) std::sort(all.begin(), all.end());
          std::copy(all.begin(), all.end(), idx.begin() + h * c.stride);
          cnt.push_back(static_cast<int32_t>(n));
        }
        indices.push_back(std::move(idx));
        counts.push_back(std::move(cnt));
        const int64_t n_tokens = 1 + static_cast<int64_t>(i % 2);
        items.push_back({rows, n_tokens, caches.back()->view, indices.back().data(), counts.back().data(), c.stride});
        rows += n_tokens;
      }
      const size_t size = static_cast<size_t>(rows * c.n_heads * c.head_dim);
      std::vector<float> q(size);
      std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
      for (float& x : q) x = dist(rng_);
      auto plan = plan_attention_indexed(items.data(), static_cast<int64_t>(items.size()), c.n_heads, c.sm_count);
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      EXPECT_EQ(dtype_of(plan->launch.kv_type), dtype);
      EXPECT_EQ(plan->launch.n_chunks_max > 1, c.expect_split);
      std::vector<float> got(size, kNan);
      emulate_attention(*plan, q.data(), got.data(), /*indexed=*/true);
      std::vector<float> want(size);
      ASSERT_TRUE(ref_->attention_indexed(q.data(), items.data(), static_cast<int64_t>(items.size()), c.n_heads,
                                          want.data())
                      .is_ok());
      double num = 0.0, den = 0.0;
      for (size_t e = 0; e < size; ++e) {
        ASSERT_TRUE(std::isfinite(got[e])) << "element " << e << " not written or not finite";
        if (want[e] == 0.0f) {
          EXPECT_EQ(got[e], 0.0f) << "element " << e;
        }
        num += (static_cast<double>(got[e]) - want[e]) * (static_cast<double>(got[e]) - want[e]);
        den += static_cast<double>(want[e]) * want[e];
      }
      ASSERT_GT(den, 0.0);
      EXPECT_LT(std::sqrt(num / den), 1e-5);
    }
  }
  // Bad batches are refused as the CPU backends refuse them.
  auto cache = make_cache(rng_, 2, 4, 2, 8);
  std::vector<int32_t> idx = {0, 3, 5, 7, 1, 8}, cnt = {3, 3};
  IndexedAttentionItem bad{0, 1, cache->view, idx.data(), cnt.data(), 3};
  EXPECT_EQ(plan_attention_indexed(&bad, 1, 4, 132).status().code(), StatusCode::kInvalidArgument);  // 8 >= 8
  cnt = {3, 2};
  EXPECT_TRUE(plan_attention_indexed(&bad, 1, 4, 132).is_ok());
  EXPECT_EQ(plan_attention_indexed(&bad, 1, 3, 132).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(SparsePlanTest, EmptyBatchesPlanNothing) {
  auto none = plan_attention_sparse(nullptr, 0, 8, 132);
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->launch.total_blocks, 0);
  HostWorkingSet ws(rng_, 2, 4, 8, {4, 4});
  SparseAttentionItem empty{0, 0, ws.view()};
  auto plan = plan_attention_sparse(&empty, 1, 4, 132);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->launch.total_blocks, 0);
}

TEST_F(SparsePlanTest, AttentionRejectsBadBatches) {
  HostWorkingSet ws(rng_, 2, 4, 8, {4, 4});
  SparseAttentionItem item{0, 1, ws.view()};
  EXPECT_TRUE(plan_attention_sparse(&item, 1, 4, 132).is_ok());
  EXPECT_EQ(plan_attention_sparse(&item, 1, 3, 132).status().code(), StatusCode::kInvalidArgument);
  ws.counts = {5, 0};  // > slots
  EXPECT_EQ(plan_attention_sparse(&item, 1, 4, 132).status().code(), StatusCode::kInvalidArgument);
  ws.counts = {-1, 0};
  EXPECT_EQ(plan_attention_sparse(&item, 1, 4, 132).status().code(), StatusCode::kInvalidArgument);
  ws.counts = {1, 1};
  SparseAttentionItem no_counts{0, 1, ws.view()};
  no_counts.ws.counts = nullptr;
  EXPECT_EQ(plan_attention_sparse(&no_counts, 1, 4, 132).status().code(), StatusCode::kInvalidArgument);
  SparseAttentionItem negative{-1, 1, ws.view()};
  EXPECT_EQ(plan_attention_sparse(&negative, 1, 4, 132).status().code(), StatusCode::kInvalidArgument);
  HostWorkingSet wide(rng_, 1, 4, 512, {1});
  SparseAttentionItem wide_item{0, 1, wide.view()};
  EXPECT_EQ(plan_attention_sparse(&wide_item, 1, 1, 132).status().code(), StatusCode::kUnimplemented);
  HostWorkingSet other(rng_, 1, 4, 8, {1});
  SparseAttentionItem mixed[2] = {item, SparseAttentionItem{1, 1, other.view()}};
  EXPECT_EQ(plan_attention_sparse(mixed, 2, 4, 132).status().code(), StatusCode::kInvalidArgument);
}

// One element type per launch: a batch mixing working-set dtypes, or holding one that is not
// f32, f16 or bf16, is refused with the offending item's field named, also when it has no rows.
TEST_F(SparsePlanTest, AttentionRejectsMixedAndNonKvDtypes) {
  HostWorkingSet f32(rng_, 2, 4, 8, {4, 2}, DType::kF32);
  HostWorkingSet bf16(rng_, 2, 4, 8, {1, 3}, DType::kBF16);
  HostWorkingSet f16(rng_, 2, 4, 8, {0, 4}, DType::kF16);
  const auto status = [&](std::vector<SparseAttentionItem> items) {
    return plan_attention_sparse(items.data(), static_cast<int64_t>(items.size()), 4, 132).status();
  };
  EXPECT_TRUE(status({{0, 1, bf16.view()}, {1, 2, bf16.view()}}).is_ok());
  Status s = status({{0, 1, f32.view()}, {1, 1, f16.view()}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("items[1].ws.dtype is f16 but items[0] has f32"), std::string::npos)
      << s.to_string();
  s = status({{0, 1, bf16.view()}, {1, 0, f32.view()}});  // an empty item
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("items[1].ws.dtype"), std::string::npos) << s.to_string();
  for (DType bad : {DType::kI32, DType::kQ8_0, DType::kU8, DType::kI64}) {
    WorkingSetView view = f32.view();
    view.dtype = bad;
    s = status({{0, 1, view}});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << dtype_name(bad);
    EXPECT_NE(s.message().find("items[0].ws.dtype is " + std::string(dtype_name(bad))), std::string::npos)
        << s.to_string();
  }
}

// ---- kv_gather ----

TEST_F(SparsePlanTest, GatherPlanCopiesLikeTheReference) {
  for (DType dtype : kKvDtypes) {
    const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
    for (int trial = 0; trial < 15; ++trial) {
      const int64_t page_size = std::vector<int64_t>{1, 7, 16}[static_cast<size_t>(trial % 3)];
      const int64_t kv_heads = std::vector<int64_t>{1, 2, 8}[static_cast<size_t>(trial / 3 % 3)];
      // Rows of 8 to 512 bytes: 16-byte multiples and not, for 4- and 2-byte elements.
      const int64_t head_dim = std::vector<int64_t>{4, 6, 8, 64, 128}[static_cast<size_t>(trial % 5)];
      const int64_t pages = 1 + static_cast<int64_t>(rng_() % 20);
      const int64_t slots = 1 + static_cast<int64_t>(rng_() % 50);
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " trial " + std::to_string(trial) + " head_dim " +
                   std::to_string(head_dim));
      auto cache = make_cache(rng_, pages, page_size, kv_heads, head_dim, dtype);
      // Entries over a sub-range of the cache, so the plan's page window is exercised.
      const int64_t capacity = pages * page_size;
      const int64_t lo = static_cast<int64_t>(rng_() % static_cast<uint32_t>(capacity));
      const int64_t hi = lo + static_cast<int64_t>(rng_() % static_cast<uint32_t>(capacity - lo));
      std::vector<GatherEntry> entries;
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t s = 0; s < slots; ++s) {
          if (rng_() % 4 == 0) continue;
          entries.push_back({static_cast<int32_t>(h), static_cast<int32_t>(lo + rng_() % (hi - lo + 1)),
                             static_cast<int32_t>(s)});
        }
      }
      if (entries.empty()) entries.push_back({0, static_cast<int32_t>(lo), 0});
      std::shuffle(entries.begin(), entries.end(), rng_);
      const size_t ws_bytes = static_cast<size_t>(kv_heads * slots * head_dim * elem);
      std::vector<uint8_t> got_k(ws_bytes, 0x3c), got_v(ws_bytes, 0x3c), want_k(ws_bytes, 0x3c),
          want_v(ws_bytes, 0x3c);
      std::vector<int32_t> counts(static_cast<size_t>(kv_heads), 0);
      const WorkingSetView got{got_k.data(), got_v.data(), kv_heads, slots, head_dim, counts.data(), dtype};
      const WorkingSetView want{want_k.data(), want_v.data(), kv_heads, slots,
                                head_dim,      counts.data(), dtype};
      const int64_t n = static_cast<int64_t>(entries.size());
      auto plan = plan_kv_gather(cache->view, entries.data(), n, got);
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      int32_t min_tok = entries[0].token, max_tok = entries[0].token;
      for (const GatherEntry& e : entries) {
        min_tok = std::min(min_tok, e.token);
        max_tok = std::max(max_tok, e.token);
      }
      EXPECT_EQ(plan->launch.first_page, min_tok / page_size);
      EXPECT_EQ(plan->launch.n_pages, max_tok / page_size - min_tok / page_size + 1);
      EXPECT_EQ(plan->pages.size(), static_cast<size_t>(2 * plan->launch.n_pages));
      EXPECT_EQ(plan->launch.n_entries, n);
      EXPECT_EQ(dtype_of(plan->launch.kv_type), dtype);
      // std::vector data is 16-byte aligned (operator new), and pages are whole rows apart, so
      // every base is 16-byte aligned exactly when a row is a multiple of 16 bytes.
      EXPECT_EQ(plan->launch.vec16, head_dim * elem % 16 == 0);
      emulate_gather(*plan, entries.data());
      ASSERT_TRUE(ref_->kv_gather(cache->view, entries.data(), n, want).is_ok());
      EXPECT_EQ(got_k, want_k);
      EXPECT_EQ(got_v, want_v);
    }
  }
}

// The 16-byte path needs rows of a multiple of 16 bytes (head_dim · element size) and every base
// (working set K and V, each touched page) 16-byte aligned.
TEST_F(SparsePlanTest, GatherVecPathDependsOnElementBytesAndAlignment) {
  const GatherEntry entry{0, 0, 0};
  const auto vec16 = [&](DType dtype, int64_t head_dim, int64_t ws_offset, int64_t page_offset) {
    auto cache = make_cache(rng_, 2, 4, 1, head_dim, dtype);
    std::vector<uint8_t> k(static_cast<size_t>(4 * head_dim) * dtype_size(dtype) + 64), v(k.size());
    // Offsets in bytes; the cache's K page 0 moves by page_offset (still inside the page).
    KvLayerView view = cache->view;
    std::vector<void*> k_pages = cache->k_pages;
    k_pages[0] = static_cast<uint8_t*>(k_pages[0]) + page_offset;
    view.k_pages = k_pages.data();
    const WorkingSetView ws{k.data() + ws_offset, v.data(), 1, 4, head_dim, nullptr, dtype};
    auto plan = plan_kv_gather(view, &entry, 1, ws);
    EXPECT_TRUE(plan.is_ok()) << plan.status().to_string();
    return plan.is_ok() && plan->launch.vec16;
  };
  EXPECT_TRUE(vec16(DType::kF32, 4, 0, 0));    // 16-byte rows
  EXPECT_FALSE(vec16(DType::kBF16, 4, 0, 0));  // 8-byte rows
  EXPECT_TRUE(vec16(DType::kBF16, 8, 0, 0));   // 16-byte rows of bf16
  EXPECT_TRUE(vec16(DType::kF16, 8, 0, 0));
  EXPECT_FALSE(vec16(DType::kF16, 12, 0, 0));   // 24 bytes
  EXPECT_TRUE(vec16(DType::kBF16, 128, 0, 0));  // 256 bytes
  EXPECT_FALSE(vec16(DType::kF32, 6, 0, 0));    // 24 bytes
  EXPECT_FALSE(vec16(DType::kBF16, 8, 2, 0));   // working set one element off
  EXPECT_TRUE(vec16(DType::kBF16, 8, 16, 0));   // eight elements off: aligned again
  EXPECT_FALSE(vec16(DType::kBF16, 8, 0, 8));   // a page 8 bytes off
  EXPECT_FALSE(vec16(DType::kF32, 4, 4, 0));
}

TEST_F(SparsePlanTest, GatherPlanRejectsBadEntries) {
  auto cache = make_cache(rng_, 2, 4, 2, 8);  // capacity 8
  std::vector<float> k(2 * 4 * 8), v(k.size());
  const WorkingSetView ws{k.data(), v.data(), 2, 4, 8, nullptr};
  auto code = [&](std::vector<GatherEntry> e, const WorkingSetView& view) {
    return plan_kv_gather(cache->view, e.data(), static_cast<int64_t>(e.size()), view).status().code();
  };
  EXPECT_EQ(code({{1, 7, 3}}, ws), StatusCode::kOk);
  EXPECT_EQ(code({{0, 8, 0}}, ws), StatusCode::kInvalidArgument);             // token >= capacity
  EXPECT_EQ(code({{0, 0, 4}}, ws), StatusCode::kInvalidArgument);             // slot >= slots
  EXPECT_EQ(code({{2, 0, 0}}, ws), StatusCode::kInvalidArgument);             // head >= kv_heads
  EXPECT_EQ(code({{0, 1, 1}, {0, 2, 1}}, ws), StatusCode::kInvalidArgument);  // same destination
  WorkingSetView wrong = ws;
  wrong.head_dim = 4;
  EXPECT_EQ(code({{0, 0, 0}}, wrong), StatusCode::kInvalidArgument);
  WorkingSetView misaligned = ws;
  misaligned.k = k.data() + 1;  // still valid, but no 16-byte copies
  auto plan = plan_kv_gather(cache->view, std::vector<GatherEntry>{{0, 0, 0}}.data(), 1, misaligned);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_FALSE(plan->launch.vec16);
  // The working set holds the cache's element type: the gather copies elements unchanged.
  WorkingSetView other_dtype = ws;
  other_dtype.dtype = DType::kBF16;
  Status s = plan_kv_gather(cache->view, std::vector<GatherEntry>{{0, 0, 0}}.data(), 1, other_dtype).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("ws.dtype bf16 differs from kv.dtype f32"), std::string::npos) << s.to_string();
  KvLayerView not_kv = cache->view;
  for (DType bad : {DType::kI32, DType::kQ8_0, DType::kU8}) {
    not_kv.dtype = bad;
    WorkingSetView same = ws;
    same.dtype = bad;
    s = plan_kv_gather(not_kv, std::vector<GatherEntry>{{0, 0, 0}}.data(), 1, same).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << dtype_name(bad);
    EXPECT_NE(s.message().find("kv.dtype is " + std::string(dtype_name(bad))), std::string::npos)
        << s.to_string();
  }
  auto empty = plan_kv_gather(KvLayerView{}, nullptr, 0, WorkingSetView{});
  ASSERT_TRUE(empty.is_ok());
  EXPECT_EQ(empty->launch.n_entries, 0);
}

}  // namespace
}  // namespace specontext::gpu
