// attention_indexed (a device-homed layer's sparse attention, read in place by index): CpuBackend
// against ReferenceBackend, and both against definitions that do not share their code:
//  * f32 caches: the reference equals dense attention restricted to the selected positions (a
//    double loop written here) at 1e-6;
//  * every dtype (f32 / f16 / bf16): the reference equals, bit for bit, kv_gather of the same
//    selection into a working set (slots in selection order) followed by attention_sparse — the
//    path device-homed layers took before;
//  * CpuBackend (automatic, one thread, forced split-K chunks of 7 and 64 keys) equals the
//    reference at attention's tolerance (rel. L2 < 1e-5 over all rows), on GQA 8/2, MQA 8/1 and
//    MHA 4/4 with head_dim 8, 64, 128; batches of 1-4 items of 1-2 rows between gap rows; per-head
//    counts including 0 and == stride; indices in runs (sinks, window, whole pages: read in place)
//    and scattered (copied into a block), ascending or shuffled; long selections (split-K).
// Every (head, position) row of the cache that its head does not select holds NaN (K) and +inf
// (V), and positions past the sequence are NaN, so reading anything unselected fails the
// finiteness checks; the output sits between guard regions, gap rows must stay untouched, heads
// with counts 0 give exact zeros, and rows of the others are finite and nonzero.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/base/dtype.h"
#include "cpu/cpu_backend.h"
#include "cpu/reference_backend.h"
#include "tests/cpu/cpu_test_util.h"

namespace specontext::cpu {
namespace {

using testing::expect_close;
using testing::GuardedBuffer;
using testing::make_cpu;
using testing::PagedKv;
using testing::random_floats;

struct HeadShape {
  int64_t n_heads, kv_heads;
};
constexpr HeadShape kHeadShapes[] = {{8, 2}, {8, 1}, {4, 4}};
constexpr int64_t kHeadDims[] = {8, 64, 128};
constexpr float kUntouched = 777.0f;

// One item: its cache, its selection ([kv_heads][stride] indices, counts) and the f32 values of
// its selected rows (after rounding to the dtype), for the independent check.
struct Case {
  std::unique_ptr<PagedKv> cache;
  int64_t length = 0;
  int64_t stride = 0;
  std::vector<int32_t> indices, counts;
};

void write_row(PagedKv& c, bool values, int64_t pos, int64_t head, const float* x) {
  void* page = (values ? c.v_pages : c.k_pages)[static_cast<size_t>(pos / c.view.page_size)];
  convert_from_f32(c.view.dtype, x, element_at(page, c.view.dtype, c.offset(pos, head)),
                   static_cast<size_t>(c.view.head_dim));
}

void read_row(const PagedKv& c, bool values, int64_t pos, int64_t head, float* x) {
  const void* page = (values ? c.v_pages : c.k_pages)[static_cast<size_t>(pos / c.view.page_size)];
  convert_to_f32(c.view.dtype, element_at(page, c.view.dtype, c.offset(pos, head)), x,
                 static_cast<size_t>(c.view.head_dim));
}

// A random selection of `length` cached positions per head: a run at the start (sinks), a run at
// the end (window), maybe a whole page, then scattered positions; some heads empty or full.
Case make_case(std::mt19937& rng, int64_t kv_heads, int64_t d, DType dtype, bool long_selection, bool shuffle) {
  Case c;
  const int64_t page_size = rng() % 2 == 0 ? 16 : 5;
  c.length = long_selection ? std::uniform_int_distribution<int64_t>(900, 1600)(rng)
                            : std::uniform_int_distribution<int64_t>(3, 220)(rng);
  c.stride = long_selection ? std::uniform_int_distribution<int64_t>(600, c.length)(rng)
                            : std::uniform_int_distribution<int64_t>(1, c.length)(rng);
  const int64_t n_pages = (c.length + page_size - 1) / page_size + 1;  // a page past the sequence
  c.cache = std::make_unique<PagedKv>(n_pages, page_size, kv_heads, d, static_cast<uint32_t>(rng()), dtype);
  c.indices.assign(static_cast<size_t>(kv_heads * c.stride), -1);
  c.counts.assign(static_cast<size_t>(kv_heads), 0);
  for (int64_t h = 0; h < kv_heads; ++h) {
    // Head 0 is never empty here (the caller empties one head of the first item); others may be.
    const int pick = static_cast<int>(rng() % 5);
    int64_t n = pick == 0 && h > 0 ? 0
                : pick == 1        ? c.stride
                                   : std::uniform_int_distribution<int64_t>(1, c.stride)(rng);
    std::vector<int32_t> chosen;
    std::vector<bool> taken(static_cast<size_t>(c.length), false);
    auto take = [&](int64_t t) {
      if (static_cast<int64_t>(chosen.size()) < n && t >= 0 && t < c.length && !taken[static_cast<size_t>(t)]) {
        taken[static_cast<size_t>(t)] = true;
        chosen.push_back(static_cast<int32_t>(t));
      }
    };
    for (int64_t t = 0; t < std::min<int64_t>(4, n); ++t) take(t);                      // sinks
    for (int64_t t = c.length - 12; t < c.length; ++t) take(t);                        // window
    if (rng() % 2 == 0) {                                                               // a whole page
      const int64_t p = std::uniform_int_distribution<int64_t>(0, c.length / page_size)(rng);
      for (int64_t t = p * page_size; t < (p + 1) * page_size; ++t) take(t);
    }
    std::vector<int32_t> rest(static_cast<size_t>(c.length));
    std::iota(rest.begin(), rest.end(), 0);
    std::shuffle(rest.begin(), rest.end(), rng);
    for (int32_t t : rest) take(t);
    n = static_cast<int64_t>(chosen.size());
    if (!shuffle) std::sort(chosen.begin(), chosen.end());
    std::copy(chosen.begin(), chosen.end(), c.indices.begin() + h * c.stride);
    c.counts[static_cast<size_t>(h)] = static_cast<int32_t>(n);
    // Selected rows random, every other row of this head poisoned.
    std::vector<float> k(static_cast<size_t>(d)), v(static_cast<size_t>(d));
    const std::vector<float> nan_row(static_cast<size_t>(d), std::numeric_limits<float>::quiet_NaN());
    const std::vector<float> inf_row(static_cast<size_t>(d), std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < c.length; ++t) {
      if (taken[static_cast<size_t>(t)]) {
        k = random_floats(k.size(), static_cast<uint32_t>(rng()), -2.0f, 2.0f);
        v = random_floats(v.size(), static_cast<uint32_t>(rng()));
        write_row(*c.cache, false, t, h, k.data());
        write_row(*c.cache, true, t, h, v.data());
      } else {
        write_row(*c.cache, false, t, h, nan_row.data());
        write_row(*c.cache, true, t, h, inf_row.data());
      }
    }
  }
  return c;
}

IndexedAttentionItem item_of(const Case& c, int64_t token_offset, int64_t n_tokens) {
  return {token_offset, n_tokens, c.cache->view, c.indices.data(), c.counts.data(), c.stride};
}

// Dense attention of one query vector over the selected rows of head kvh, in double.
void restricted_dense(const float* qh, const Case& c, int64_t kvh, float* out) {
  const int64_t d = c.cache->view.head_dim;
  const int64_t n = c.counts[static_cast<size_t>(kvh)];
  std::vector<float> k(static_cast<size_t>(d)), v(static_cast<size_t>(d));
  std::vector<double> s(static_cast<size_t>(n));
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    read_row(*c.cache, false, c.indices[static_cast<size_t>(kvh * c.stride + j)], kvh, k.data());
    double dot = 0.0;
    for (int64_t e = 0; e < d; ++e) dot += static_cast<double>(qh[e]) * k[e];
    s[static_cast<size_t>(j)] = dot / std::sqrt(static_cast<double>(d));
    mx = std::max(mx, s[static_cast<size_t>(j)]);
  }
  double denom = 0.0;
  for (double& x : s) denom += (x = std::exp(x - mx));
  std::vector<double> acc(static_cast<size_t>(d), 0.0);
  for (int64_t j = 0; j < n; ++j) {
    read_row(*c.cache, true, c.indices[static_cast<size_t>(kvh * c.stride + j)], kvh, v.data());
    for (int64_t e = 0; e < d; ++e) acc[static_cast<size_t>(e)] += s[static_cast<size_t>(j)] * v[e];
  }
  for (int64_t e = 0; e < d; ++e) out[e] = n == 0 ? 0.0f : static_cast<float>(acc[static_cast<size_t>(e)] / denom);
}

class IndexedAttentionTest : public ::testing::TestWithParam<DType> {};

TEST_P(IndexedAttentionTest, CpuMatchesReferenceAndReferenceMatchesGatherThenSparse) {
  const DType dtype = GetParam();
  ReferenceBackend ref;
  std::vector<std::pair<std::string, std::unique_ptr<CpuBackend>>> backends;
  backends.emplace_back("auto", make_cpu());
  backends.emplace_back("1 thread", make_cpu({.num_threads = 1}));
  backends.emplace_back("chunk 7", make_cpu({.attention_chunk = 7}));
  backends.emplace_back("chunk 64", make_cpu({.attention_chunk = 64}));
  for (auto& [name, b] : backends) ASSERT_NE(b, nullptr) << name;
  EXPECT_TRUE(ref.supports(BackendOp::kAttentionIndexed, DType::kF32));
  EXPECT_TRUE(backends[0].second->supports(BackendOp::kAttentionIndexed, DType::kF32));
  std::mt19937 rng(23 + static_cast<uint32_t>(dtype));
  for (const HeadShape& hs : kHeadShapes) {
    for (int64_t d : kHeadDims) {
      for (int trial = 0; trial < 4; ++trial) {
        SCOPED_TRACE("heads " + std::to_string(hs.n_heads) + "/" + std::to_string(hs.kv_heads) + " head_dim " +
                     std::to_string(d) + " trial " + std::to_string(trial));
        const int64_t n_items = std::uniform_int_distribution<int64_t>(1, 4)(rng);
        std::vector<Case> cases;
        std::vector<IndexedAttentionItem> items;
        int64_t rows = 0;
        for (int64_t i = 0; i < n_items; ++i) {
          cases.push_back(make_case(rng, hs.kv_heads, d, dtype, /*long_selection=*/trial == 3,
                                    /*shuffle=*/trial % 2 == 1));
          Case& c = cases.back();
          if (i == 0 && (hs.kv_heads > 1 || n_items > 1)) c.counts[0] = 0;  // an empty head (indices unread)
          const int64_t n_tokens = 1 + static_cast<int64_t>(rng() % 2);
          rows += 1;  // gap row
          items.push_back(item_of(c, rows, n_tokens));
          rows += n_tokens;
        }
        const size_t row_floats = static_cast<size_t>(hs.n_heads * d);
        const auto q = random_floats(static_cast<size_t>(rows) * row_floats, static_cast<uint32_t>(rng()), -2.0f, 2.0f);
        GuardedBuffer want(static_cast<size_t>(rows) * row_floats, kUntouched);
        ASSERT_TRUE(ref.attention_indexed(q.data(), items.data(), n_items, hs.n_heads, want.data()).is_ok());
        ASSERT_TRUE(want.intact());
        const int64_t group = hs.n_heads / hs.kv_heads;

        // The reference against the independent loop (f32: the cache holds the exact values) and
        // against gather + attention_sparse over a working set in selection order (bit for bit).
        GuardedBuffer via_ws(static_cast<size_t>(rows) * row_floats, kUntouched);
        std::vector<std::vector<unsigned char>> ws_k(items.size()), ws_v(items.size());
        std::vector<SparseAttentionItem> ws_items;
        for (size_t i = 0; i < items.size(); ++i) {
          const Case& c = cases[i];
          const size_t bytes = static_cast<size_t>(hs.kv_heads * std::max<int64_t>(c.stride, 1) * d) * dtype_size(dtype);
          ws_k[i].assign(bytes, 0);
          ws_v[i].assign(bytes, 0);
          WorkingSetView wsv{ws_k[i].data(), ws_v[i].data(), hs.kv_heads, c.stride, d, c.counts.data(), dtype};
          std::vector<GatherEntry> entries;
          for (int64_t h = 0; h < hs.kv_heads; ++h) {
            for (int64_t j = 0; j < c.counts[static_cast<size_t>(h)]; ++j) {
              entries.push_back({static_cast<int32_t>(h), c.indices[static_cast<size_t>(h * c.stride + j)],
                                 static_cast<int32_t>(j)});
            }
          }
          ASSERT_TRUE(ref.kv_gather(c.cache->view, entries.data(), static_cast<int64_t>(entries.size()), wsv).is_ok());
          ws_items.push_back({items[i].token_offset, items[i].n_tokens, wsv});
          if (dtype != DType::kF32) continue;
          for (int64_t t = 0; t < items[i].n_tokens; ++t) {
            for (int64_t h = 0; h < hs.n_heads; ++h) {
              const size_t at = static_cast<size_t>((items[i].token_offset + t) * hs.n_heads + h) * static_cast<size_t>(d);
              std::vector<float> exact(static_cast<size_t>(d));
              restricted_dense(q.data() + at, c, h / group, exact.data());
              for (int64_t e = 0; e < d; ++e) {
                ASSERT_NEAR(want[at + static_cast<size_t>(e)], exact[static_cast<size_t>(e)], 1e-6) << "head " << h;
              }
            }
          }
        }
        ASSERT_TRUE(ref.attention_sparse(q.data(), ws_items.data(), n_items, hs.n_heads, via_ws.data()).is_ok());
        for (size_t e = 0; e < want.size(); ++e) ASSERT_EQ(std::bit_cast<uint32_t>(want[e]), std::bit_cast<uint32_t>(via_ws[e])) << e;

        for (auto& [name, b] : backends) {
          SCOPED_TRACE(name);
          GuardedBuffer got(static_cast<size_t>(rows) * row_floats, kUntouched);
          ASSERT_TRUE(b->attention_indexed(q.data(), items.data(), n_items, hs.n_heads, got.data()).is_ok());
          EXPECT_TRUE(got.intact()) << "attention_indexed wrote outside out";
          std::vector<float> got_rows, want_rows;
          for (const IndexedAttentionItem& it : items) {
            EXPECT_EQ(got[static_cast<size_t>(it.token_offset - 1) * row_floats], kUntouched) << "gap row written";
            const size_t b0 = static_cast<size_t>(it.token_offset) * row_floats;
            const size_t b1 = b0 + static_cast<size_t>(it.n_tokens) * row_floats;
            got_rows.insert(got_rows.end(), got.data() + b0, got.data() + b1);
            want_rows.insert(want_rows.end(), want.data() + b0, want.data() + b1);
            for (int64_t t = 0; t < it.n_tokens; ++t) {
              for (int64_t h = 0; h < hs.n_heads; ++h) {
                const float* o = got.data() + ((it.token_offset + t) * hs.n_heads + h) * d;
                if (it.counts[h / group] == 0) {
                  for (int64_t e = 0; e < d; ++e) ASSERT_EQ(o[e], 0.0f) << "empty head " << h;
                } else {
                  double norm = 0.0;
                  for (int64_t e = 0; e < d; ++e) norm += std::fabs(o[e]);
                  EXPECT_GT(norm, 0.0) << "head " << h << " gave zeros";
                }
              }
            }
          }
          expect_close(got_rows.data(), want_rows.data(), got_rows.size(), 1e-5, "attention_indexed");
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, IndexedAttentionTest, ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

// Bad arguments are refused by both backends with kInvalidArgument naming the field; nothing to
// do is OK.
TEST(IndexedAttention, BadArgumentsAreRefusedNamingTheField) {
  ReferenceBackend ref;
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  PagedKv cache(2, 4, 2, 8, 1);
  cache.fill(8, 2);
  std::vector<int32_t> idx = {0, 3, 5, 7, 1, 2};
  std::vector<int32_t> counts = {3, 2};
  const std::vector<float> q(4 * 8, 0.5f);
  std::vector<float> out(4 * 8);
  for (Backend* be : {static_cast<Backend*>(&ref), static_cast<Backend*>(cpu.get())}) {
    SCOPED_TRACE(std::string(be->name()));
    auto run = [&](IndexedAttentionItem it, int64_t n_heads = 4) {
      return be->attention_indexed(q.data(), &it, 1, n_heads, out.data());
    };
    const IndexedAttentionItem good{0, 1, cache.view, idx.data(), counts.data(), 3};
    EXPECT_TRUE(run(good).is_ok());
    EXPECT_EQ(be->attention_indexed(q.data(), nullptr, 0, 4, out.data()).code(), StatusCode::kOk);
    EXPECT_EQ(run(good, 3).code(), StatusCode::kInvalidArgument);  // not a multiple of kv_heads
    IndexedAttentionItem bad = good;
    bad.counts = nullptr;
    EXPECT_EQ(run(bad).code(), StatusCode::kInvalidArgument);
    std::vector<int32_t> over = {4, 0};
    bad = good;
    bad.counts = over.data();
    const Status s = run(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.to_string().find("counts[0]"), std::string::npos) << s.to_string();
    std::vector<int32_t> outside = {0, 3, 8, 7, 1, 2};  // 8 is past the capacity
    bad = good;
    bad.indices = outside.data();
    const Status o = run(bad);
    EXPECT_EQ(o.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(o.to_string().find("indices[2]"), std::string::npos) << o.to_string();
    std::vector<int32_t> negative = {0, 3, 5, 7, -1, 2};
    bad = good;
    bad.indices = negative.data();
    EXPECT_EQ(run(bad).code(), StatusCode::kInvalidArgument);
    bad = good;
    bad.kv.dtype = DType::kQ8_0;
    EXPECT_EQ(run(bad).code(), StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace specontext::cpu
