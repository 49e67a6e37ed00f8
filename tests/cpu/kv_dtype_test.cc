// f16 / bf16 KV caches. The reference defines them: kv_append rounds to the dtype (nearest even),
// attention and attention_sparse widen to f32, kv_gather copies elements. Checked here:
//  * the rounding, bit for bit, including NaN, overflow and ties;
//  * reference attention over a bf16 / f16 cache equals reference attention over an f32 cache
//    holding the same rounded values (so the dtype changes the storage, nothing else), and
//    differs from attention over the unrounded values (the rounding did happen);
//  * CpuBackend against the reference on randomised shapes (kv_append bytes exact, attention and
//    attention_sparse at the f32 tolerance, kv_gather bytes exact, guard regions), and the
//    fused 16-bit kernel over long contexts (split-K), GQA 32/8, head-dim tails and working
//    sets whose unused slots hold NaN / inf;
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

// The fused 16-bit kernel (f16 / bf16 widened in the loads) on what the short cases above do
// not reach: contexts of thousands of keys (automatic split-K over the threads, and a forced
// 100-key chunk), a prefill tail after a long cached prefix, Llama-3.2-1B's GQA 32/8 at d 64,
// head dims that leave a tail after the 8-lane loads (20, 68), MQA at d 128, scores in the
// hundreds. Slots past each sequence hold NaN (one spare page): reading them fails the check.
TEST_P(KvDtypeTest, CpuAttentionLongContextsMatchReference) {
  const DType t = GetParam();
  ReferenceBackend ref;
  uint32_t seed = 700;
  for (int64_t chunk : {int64_t{0}, int64_t{100}}) {
    auto cpu = make_cpu({.attention_chunk = chunk});
    ASSERT_NE(cpu, nullptr);
    for (const Shape& s : {Shape{32, 8, 64, 16}, Shape{8, 2, 20, 7}, Shape{8, 1, 128, 32}, Shape{4, 2, 68, 16}}) {
      SCOPED_TRACE("heads " + std::to_string(s.n_heads) + "/" + std::to_string(s.kv_heads) + " d " +
                   std::to_string(s.head_dim) + " page " + std::to_string(s.page_size) + " chunk " +
                   std::to_string(chunk));
      const std::vector<std::pair<int64_t, int64_t>> seqs = {{4999, 1}, {2043, 5}, {1500, 1}};
      std::vector<std::unique_ptr<PagedKv>> kvs;
      std::vector<AttentionItem> items;
      int64_t rows = 0;
      for (const auto& [start, n_new] : seqs) {
        const int64_t len = start + n_new;
        const int64_t pages = (len + s.page_size - 1) / s.page_size + 1;
        kvs.push_back(std::make_unique<PagedKv>(pages, s.page_size, s.kv_heads, s.head_dim, seed, t));
        const size_t n = static_cast<size_t>(len * s.kv_heads * s.head_dim);
        const float k_range = seqs.size() == kvs.size() ? 8.0f : 2.0f;  // the last: large scores
        const auto k = random_floats(n, seed + 1, -k_range, k_range);
        const auto v = random_floats(n, seed + 2);
        ++seed;
        ASSERT_TRUE(ref.kv_append(k.data(), v.data(), len, 0, kvs.back()->view).is_ok());
        rows += 1;  // a gap row between items: must stay untouched
        items.push_back({rows, n_new, start, kvs.back()->view});
        rows += n_new;
      }
      const size_t out_n = static_cast<size_t>(rows * s.n_heads * s.head_dim);
      const auto q = random_floats(out_n, seed + 500, -2.0f, 2.0f);
      GuardedBuffer want(out_n, 0.0f), got(out_n, 0.0f);
      const auto n_items = static_cast<int64_t>(items.size());
      ASSERT_TRUE(ref.attention(q.data(), items.data(), n_items, s.n_heads, want.data()).is_ok());
      ASSERT_TRUE(cpu->attention(q.data(), items.data(), n_items, s.n_heads, got.data()).is_ok());
      EXPECT_TRUE(got.intact());
      const size_t row_floats = static_cast<size_t>(s.n_heads * s.head_dim);
      for (const AttentionItem& it : items) {
        EXPECT_EQ(got[static_cast<size_t>(it.token_offset - 1) * row_floats], 0.0f) << "gap row written";
        const size_t b = static_cast<size_t>(it.token_offset) * row_floats;
        const size_t e = static_cast<size_t>(it.n_tokens) * row_floats;
        expect_close(got.data() + b, want.data() + b, e, 1e-5, "attention item");
      }
    }
  }
}

// attention_sparse over 16-bit working sets with the slots past counts[h] poisoned by NaN and
// ±inf bit patterns of the dtype: a head of 3000 rows (split-K), one of 13 (a tail of 4-row
// groups), an empty one (zeros), at d 68 (a tail after the 8-lane loads) and d 64.
TEST_P(KvDtypeTest, SparseAttentionOverPoisonedWorkingSetsMatchesReference) {
  const DType t = GetParam();
  const uint16_t nan_bits = t == DType::kF16 ? 0x7E00 : 0x7FC0;
  const uint16_t inf_bits = t == DType::kF16 ? 0x7C00 : 0x7F80;
  ReferenceBackend ref;
  for (int64_t chunk : {int64_t{0}, int64_t{333}}) {
    auto cpu = make_cpu({.attention_chunk = chunk});
    ASSERT_NE(cpu, nullptr);
    for (int64_t d : {int64_t{68}, int64_t{64}}) {
      SCOPED_TRACE("d " + std::to_string(d) + " chunk " + std::to_string(chunk));
      const int64_t kv_heads = 3, n_heads = 12, slots = 3072;
      const std::vector<int32_t> counts = {3000, 13, 0};
      const size_t n = static_cast<size_t>(kv_heads * slots * d);
      std::vector<uint16_t> k(n), v(n);
      const auto kf = random_floats(n, 41 + static_cast<uint32_t>(d), -3.0f, 3.0f);
      const auto vf = random_floats(n, 42 + static_cast<uint32_t>(d));
      convert_from_f32(t, kf.data(), k.data(), n);
      convert_from_f32(t, vf.data(), v.data(), n);
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t sl = counts[static_cast<size_t>(h)]; sl < slots; ++sl) {
          for (int64_t e = 0; e < d; ++e) {
            const size_t at = static_cast<size_t>((h * slots + sl) * d + e);
            k[at] = (sl + e) % 3 == 0 ? nan_bits : static_cast<uint16_t>(inf_bits | ((sl & 1) << 15));
            v[at] = (sl + e) % 2 == 0 ? nan_bits : inf_bits;
          }
        }
      }
      WorkingSetView ws{k.data(), v.data(), kv_heads, slots, d, counts.data(), t};
      const int64_t n_tokens = 3;
      const auto q = random_floats(static_cast<size_t>(n_tokens * n_heads * d), 43, -2.0f, 2.0f);
      SparseAttentionItem it{0, n_tokens, ws};
      GuardedBuffer want(q.size(), 1.0f), got(q.size(), 1.0f);
      ASSERT_TRUE(ref.attention_sparse(q.data(), &it, 1, n_heads, want.data()).is_ok());
      ASSERT_TRUE(cpu->attention_sparse(q.data(), &it, 1, n_heads, got.data()).is_ok());
      EXPECT_TRUE(got.intact());
      expect_close(got.data(), want.data(), q.size(), 1e-5, "attention_sparse");
      // Query heads 8..11 read KV head 2, which is empty: exact zeros.
      for (int64_t tok = 0; tok < n_tokens; ++tok) {
        for (int64_t h = 8; h < 12; ++h) {
          for (int64_t e = 0; e < d; ++e) {
            ASSERT_EQ(got[static_cast<size_t>((tok * n_heads + h) * d + e)], 0.0f);
          }
        }
      }
    }
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
