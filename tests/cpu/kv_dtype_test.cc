// f16 / bf16 KV caches. The reference defines them: kv_append rounds to the dtype (nearest even),
// attention and attention_sparse widen to f32, kv_gather copies elements. Checked here:
//  * the rounding, bit for bit, including NaN, overflow and ties;
//  * reference attention over a bf16 / f16 cache equals reference attention over an f32 cache
//    holding the same rounded values (so the dtype changes the storage, nothing else), and
//    differs from attention over the unrounded values (the rounding did happen);
//  * CpuBackend against the reference on randomised shapes (kv_append bytes exact, attention and
//    attention_sparse at the f32 tolerance, kv_gather bytes exact, guard regions);
//  * bad dtypes and mismatched working sets are rejected with the dtype named.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
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

std::vector<float> rounded(DType t, const std::vector<float>& x) {
  std::vector<uint16_t> bits(x.size());
  std::vector<float> out(x.size());
  convert_from_f32(t, x.data(), bits.data(), x.size());
  convert_to_f32(t, bits.data(), out.data(), x.size());
  return out;
}

class KvDtypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(KvDtypeTest, AppendRoundsToNearestEvenOnBothBackends) {
  const DType t = GetParam();
  // Ties, values that round up/down, a NaN, an f16 overflow, a subnormal, signed zero.
  const std::vector<float> k = {1.0f,  1.00390625f, 1.01171875f, 3.14159265f, -2.718281828f, 70000.0f,
                                1e-6f, -0.0f,       std::numeric_limits<float>::quiet_NaN(), 0.33333334f};
  std::vector<float> v(k.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = -k[i] * 0.5f;
  const int64_t head_dim = 5, kv_heads = 1;  // two tokens of one head
  ReferenceBackend ref;
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  for (Backend* be : {static_cast<Backend*>(&ref), static_cast<Backend*>(cpu.get())}) {
    SCOPED_TRACE(std::string(be->name()));
    PagedKv kv(1, 4, kv_heads, head_dim, 0, t);
    ASSERT_TRUE(be->kv_append(k.data(), v.data(), 2, 0, kv.view).is_ok());
    const auto* kp = static_cast<const uint16_t*>(kv.k_pages[0]);
    const auto* vp = static_cast<const uint16_t*>(kv.v_pages[0]);
    for (size_t i = 0; i < k.size(); ++i) {
      const uint16_t want_k = t == DType::kBF16 ? f32_to_bf16(k[i]) : f32_to_f16(k[i]);
      const uint16_t want_v = t == DType::kBF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
      if (std::isnan(k[i])) {
        const float got = t == DType::kBF16 ? bf16_to_f32(kp[i]) : f16_to_f32(kp[i]);
        EXPECT_TRUE(std::isnan(got)) << "element " << i;
        continue;
      }
      EXPECT_EQ(kp[i], want_k) << "K element " << i;
      EXPECT_EQ(vp[i], want_v) << "V element " << i;
    }
    // Slots 2, 3 were never written: still NaN.
    const float untouched = t == DType::kBF16 ? bf16_to_f32(kp[2 * head_dim]) : f16_to_f32(kp[2 * head_dim]);
    EXPECT_TRUE(std::isnan(untouched));
  }
  // Spot values: a bf16 tie rounds to even; 70000 overflows f16 to inf.
  if (t == DType::kBF16) {
    EXPECT_EQ(f32_to_bf16(1.00390625f), f32_to_bf16(1.0f));  // halfway between 1 and 1+2^-7
  } else {
    EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(70000.0f))));
  }
}

TEST_P(KvDtypeTest, ReferenceAttentionIsF32AttentionOverRoundedValues) {
  const DType t = GetParam();
  const int64_t n_heads = 8, kv_heads = 2, head_dim = 16, page_size = 8, len = 45;
  ReferenceBackend ref;
  const size_t n = static_cast<size_t>(len * kv_heads * head_dim);
  const auto k = random_floats(n, 11, -3.0f, 3.0f);
  const auto v = random_floats(n, 12);
  const auto q = random_floats(static_cast<size_t>(4 * n_heads * head_dim), 13, -2.0f, 2.0f);
  const int64_t pages = (len + page_size - 1) / page_size;
  PagedKv narrow(pages, page_size, kv_heads, head_dim, 1, t), wide(pages, page_size, kv_heads, head_dim, 1),
      exact(pages, page_size, kv_heads, head_dim, 1);
  ASSERT_TRUE(ref.kv_append(k.data(), v.data(), len, 0, narrow.view).is_ok());
  const auto kr = rounded(t, k), vr = rounded(t, v);
  ASSERT_TRUE(ref.kv_append(kr.data(), vr.data(), len, 0, wide.view).is_ok());
  ASSERT_TRUE(ref.kv_append(k.data(), v.data(), len, 0, exact.view).is_ok());
  // Four rows: a prefill tail of 3 tokens and nothing else (positions len-4 .. len-1 of one item).
  const size_t out_n = static_cast<size_t>(4 * n_heads * head_dim);
  std::vector<float> a(out_n), b(out_n), c(out_n);
  AttentionItem it{0, 4, len - 4, narrow.view};
  ASSERT_TRUE(ref.attention(q.data(), &it, 1, n_heads, a.data()).is_ok());
  it.kv = wide.view;
  ASSERT_TRUE(ref.attention(q.data(), &it, 1, n_heads, b.data()).is_ok());
  it.kv = exact.view;
  ASSERT_TRUE(ref.attention(q.data(), &it, 1, n_heads, c.data()).is_ok());
  ASSERT_GT(testing::l2_norm(a.data(), out_n), 0.0);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), out_n * sizeof(float)));
  const double err = testing::rel_l2(a.data(), c.data(), out_n);
  EXPECT_GT(err, 0.0) << "rounding to " << dtype_name(t) << " changed nothing";
  EXPECT_LT(err, t == DType::kBF16 ? 2e-2 : 2e-3) << "more error than one rounding of K and V explains";
}

struct Shape {
  int64_t n_heads, kv_heads, head_dim, page_size;
};

TEST_P(KvDtypeTest, CpuAttentionMatchesReference) {
  const DType t = GetParam();
  ReferenceBackend ref;
  uint32_t seed = 100;
  for (int64_t chunk : {int64_t{0}, int64_t{24}}) {  // automatic, and a forced split-K
    auto cpu = make_cpu({.attention_chunk = chunk});
    ASSERT_NE(cpu, nullptr);
    for (const Shape& s : {Shape{4, 4, 64, 16}, Shape{8, 2, 80, 7}, Shape{8, 1, 128, 16}, Shape{6, 3, 8, 5}}) {
      SCOPED_TRACE("heads " + std::to_string(s.n_heads) + "/" + std::to_string(s.kv_heads) + " d " +
                   std::to_string(s.head_dim) + " page " + std::to_string(s.page_size) + " chunk " +
                   std::to_string(chunk));
      // Items: decode tokens at several lengths and a prefill chunk after a cached prefix.
      const std::vector<std::pair<int64_t, int64_t>> seqs = {{0, 1}, {37, 1}, {200, 1}, {20, 13}};
      std::vector<std::unique_ptr<PagedKv>> ref_kv, cpu_kv;
      std::vector<AttentionItem> ref_items, cpu_items;
      int64_t rows = 0;
      for (const auto& [start, n_new] : seqs) {
        const int64_t len = start + n_new;
        const int64_t pages = (len + s.page_size - 1) / s.page_size + 1;
        ref_kv.push_back(std::make_unique<PagedKv>(pages, s.page_size, s.kv_heads, s.head_dim, seed, t));
        cpu_kv.push_back(std::make_unique<PagedKv>(pages, s.page_size, s.kv_heads, s.head_dim, seed, t));
        const size_t n = static_cast<size_t>(len * s.kv_heads * s.head_dim);
        const auto k = random_floats(n, seed + 1, -2.0f, 2.0f);
        const auto v = random_floats(n, seed + 2);
        ++seed;
        ASSERT_TRUE(ref.kv_append(k.data(), v.data(), len, 0, ref_kv.back()->view).is_ok());
        ASSERT_TRUE(cpu->kv_append(k.data(), v.data(), len, 0, cpu_kv.back()->view).is_ok());
        for (int64_t p = 0; p < pages; ++p) {
          ASSERT_EQ(0, std::memcmp(ref_kv.back()->k_pages[p], cpu_kv.back()->k_pages[p], ref_kv.back()->page_bytes()));
          ASSERT_EQ(0, std::memcmp(ref_kv.back()->v_pages[p], cpu_kv.back()->v_pages[p], ref_kv.back()->page_bytes()));
        }
        ref_items.push_back({rows, n_new, start, ref_kv.back()->view});
        cpu_items.push_back({rows, n_new, start, cpu_kv.back()->view});
        rows += n_new;
      }
      const size_t out_n = static_cast<size_t>(rows * s.n_heads * s.head_dim);
      const auto q = random_floats(out_n, seed + 500, -2.0f, 2.0f);
      GuardedBuffer want(out_n, 0.0f), got(out_n, 0.0f);
      ASSERT_TRUE(ref.attention(q.data(), ref_items.data(), 4, s.n_heads, want.data()).is_ok());
      ASSERT_TRUE(cpu->attention(q.data(), cpu_items.data(), 4, s.n_heads, got.data()).is_ok());
      EXPECT_TRUE(got.intact());
      expect_close(got.data(), want.data(), out_n, 1e-5, "attention");
    }
  }
}

TEST_P(KvDtypeTest, GatherCopiesElementsAndSparseAttentionMatchesReference) {
  const DType t = GetParam();
  ReferenceBackend ref;
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  const int64_t n_heads = 8, kv_heads = 2, head_dim = 64, page_size = 16, len = 300, slots = 40;
  PagedKv kv((len + page_size - 1) / page_size, page_size, kv_heads, head_dim, 3, t);
  const size_t n = static_cast<size_t>(len * kv_heads * head_dim);
  const auto k = random_floats(n, 31, -2.0f, 2.0f);
  const auto v = random_floats(n, 32);
  ASSERT_TRUE(ref.kv_append(k.data(), v.data(), len, 0, kv.view).is_ok());
  // Head 0: 40 scattered tokens; head 1: 17.
  std::vector<GatherEntry> entries;
  std::mt19937 rng(5);
  std::vector<int32_t> counts = {40, 17};
  for (int32_t h = 0; h < kv_heads; ++h) {
    std::vector<int32_t> toks(len);
    for (int32_t i = 0; i < len; ++i) toks[static_cast<size_t>(i)] = i;
    std::shuffle(toks.begin(), toks.end(), rng);
    for (int32_t s = 0; s < counts[static_cast<size_t>(h)]; ++s) entries.push_back({h, toks[static_cast<size_t>(s)], s});
  }
  const size_t elem = dtype_size(t);
  const size_t ws_bytes = static_cast<size_t>(kv_heads * slots * head_dim) * elem;
  std::vector<unsigned char> ref_k(ws_bytes, 0xAB), ref_v(ws_bytes, 0xAB), cpu_k(ws_bytes, 0xCD), cpu_v(ws_bytes, 0xCD);
  WorkingSetView ref_ws{ref_k.data(), ref_v.data(), kv_heads, slots, head_dim, counts.data(), t};
  WorkingSetView cpu_ws{cpu_k.data(), cpu_v.data(), kv_heads, slots, head_dim, counts.data(), t};
  const auto n_entries = static_cast<int64_t>(entries.size());
  ASSERT_TRUE(ref.kv_gather(kv.view, entries.data(), n_entries, ref_ws).is_ok());
  ASSERT_TRUE(cpu->kv_gather(kv.view, entries.data(), n_entries, cpu_ws).is_ok());
  const size_t row = static_cast<size_t>(head_dim) * elem;
  for (const GatherEntry& e : entries) {
    const size_t at = static_cast<size_t>(e.kv_head * slots + e.slot) * row;
    const auto* src_k = static_cast<const unsigned char*>(kv.k_pages[e.token / page_size]) +
                        static_cast<size_t>(kv.offset(e.token, e.kv_head)) * elem;
    EXPECT_EQ(0, std::memcmp(cpu_k.data() + at, src_k, row)) << "token " << e.token;
    EXPECT_EQ(0, std::memcmp(ref_k.data() + at, src_k, row)) << "token " << e.token;
    EXPECT_EQ(0, std::memcmp(cpu_v.data() + at, ref_v.data() + at, row)) << "token " << e.token;
  }
  // Slots beyond the counts were not written.
  EXPECT_EQ(cpu_k[static_cast<size_t>(1 * slots + 17) * row], 0xCD);
  // Sparse attention of two decode rows over the gathered sets.
  const auto q = random_floats(static_cast<size_t>(2 * n_heads * head_dim), 33, -2.0f, 2.0f);
  SparseAttentionItem it{0, 2, cpu_ws};
  GuardedBuffer want(q.size(), 0.0f), got(q.size(), 0.0f);
  ASSERT_TRUE(ref.attention_sparse(q.data(), &it, 1, n_heads, want.data()).is_ok());
  ASSERT_TRUE(cpu->attention_sparse(q.data(), &it, 1, n_heads, got.data()).is_ok());
  EXPECT_TRUE(got.intact());
  expect_close(got.data(), want.data(), q.size(), 1e-5, "attention_sparse");
  // A working set of another dtype than the cache is refused, naming both.
  WorkingSetView wrong = cpu_ws;
  wrong.dtype = DType::kF32;
  for (Backend* be : {static_cast<Backend*>(&ref), static_cast<Backend*>(cpu.get())}) {
    const Status st = be->kv_gather(kv.view, entries.data(), n_entries, wrong);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(std::string(dtype_name(t))), std::string::npos) << st.message();
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvDtypeTest, ::testing::Values(DType::kF16, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

TEST(KvDtype, NonFloatDtypesAreRejectedNamingTheDtype) {
  ReferenceBackend ref;
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  PagedKv kv(1, 4, 1, 8, 0);
  kv.view.dtype = DType::kQ8_0;
  const std::vector<float> k(8, 1.0f);
  const std::vector<float> q(8, 1.0f);
  std::vector<float> out(8);
  for (Backend* be : {static_cast<Backend*>(&ref), static_cast<Backend*>(cpu.get())}) {
    const Status a = be->kv_append(k.data(), k.data(), 1, 0, kv.view);
    EXPECT_EQ(a.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(a.message().find("q8_0"), std::string::npos) << a.message();
    AttentionItem it{0, 1, 0, kv.view};
    EXPECT_EQ(be->attention(q.data(), &it, 1, 1, out.data()).code(), StatusCode::kInvalidArgument);
    std::vector<float> ws(8);
    const int32_t count = 1;
    WorkingSetView wsv{ws.data(), ws.data(), 1, 1, 8, &count, DType::kI32};
    SparseAttentionItem sit{0, 1, wsv};
    const Status s = be->attention_sparse(q.data(), &sit, 1, 1, out.data());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("i32"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace specontext::cpu
