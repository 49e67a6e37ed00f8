// Paged causal attention: CpuBackend against ReferenceBackend for batches of sequences of
// different lengths, decode and chunked prefill, MHA / GQA / MQA, pages that do not divide the
// length, and the split-K (flash-decoding) path forced and automatic. KV slots beyond each
// sequence's length hold NaN, so reading outside the causal window fails the finiteness check.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

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

struct SeqSpec {
  int64_t start_pos;  // tokens cached before this forward
  int64_t n_tokens;   // new tokens (already appended to the cache)
};

struct Case {
  std::string name;
  int64_t n_heads, kv_heads, head_dim, page_size;
  std::vector<SeqSpec> seqs;
};

// Builds caches and queries for `c`, runs both backends and compares.
void run_case(const Case& c, Backend& cpu, uint32_t seed, double tol = 1e-5) {
  SCOPED_TRACE(c.name);
  ReferenceBackend ref;
  std::vector<std::unique_ptr<PagedKv>> caches;
  std::vector<AttentionItem> items;
  int64_t rows = 0;
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    const SeqSpec& s = c.seqs[i];
    const int64_t len = s.start_pos + s.n_tokens;
    const int64_t pages = (len + c.page_size - 1) / c.page_size + 1;  // one spare page
    caches.push_back(std::make_unique<PagedKv>(pages, c.page_size, c.kv_heads, c.head_dim,
                                               seed + static_cast<uint32_t>(i)));
    caches.back()->fill(len, seed * 31 + static_cast<uint32_t>(i), /*k_scale=*/2.0f);
    rows += 1;  // a gap row between sequences: must stay untouched
    items.push_back(AttentionItem{rows, s.n_tokens, s.start_pos, caches.back()->view});
    rows += s.n_tokens;
  }
  const size_t row_floats = static_cast<size_t>(c.n_heads * c.head_dim);
  const auto q = random_floats(static_cast<size_t>(rows) * row_floats, seed + 1000, -2.0f, 2.0f);
  const float kUntouched = 777.0f;
  GuardedBuffer want(static_cast<size_t>(rows) * row_floats, kUntouched);
  GuardedBuffer got(static_cast<size_t>(rows) * row_floats, kUntouched);
  ASSERT_TRUE(
      ref.attention(q.data(), items.data(), static_cast<int64_t>(items.size()), c.n_heads, want.data())
          .is_ok());
  ASSERT_TRUE(cpu.attention(q.data(), items.data(), static_cast<int64_t>(items.size()), c.n_heads, got.data())
                  .is_ok());
  EXPECT_TRUE(got.intact()) << "attention wrote outside out";
  // Compare only the rows that belong to items; the gap rows must be untouched.
  std::vector<float> got_rows, want_rows;
  for (const AttentionItem& it : items) {
    EXPECT_EQ(got[static_cast<size_t>(it.token_offset - 1) * row_floats], kUntouched);
    const size_t b = static_cast<size_t>(it.token_offset) * row_floats;
    const size_t e = b + static_cast<size_t>(it.n_tokens) * row_floats;
    got_rows.insert(got_rows.end(), got.data() + b, got.data() + e);
    want_rows.insert(want_rows.end(), want.data() + b, want.data() + e);
  }
  expect_close(got_rows.data(), want_rows.data(), got_rows.size(), tol, "attention");
  // Per-row check too: an error confined to one short sequence must not hide in the global norm.
  for (size_t r = 0; r < got_rows.size() / row_floats; ++r) {
    EXPECT_LT(
        testing::rel_l2(got_rows.data() + r * row_floats, want_rows.data() + r * row_floats, row_floats),
        tol * 10)
        << "row " << r;
  }
}

std::vector<Case> head_layouts(int64_t head_dim, int64_t page_size, std::vector<SeqSpec> seqs) {
  return {
      {"MHA 4/4", 4, 4, head_dim, page_size, seqs},
      {"GQA 8/2", 8, 2, head_dim, page_size, seqs},
      {"MQA 8/1", 8, 1, head_dim, page_size, seqs},
  };
}

TEST(CpuAttention, DecodeBatchOfDifferentLengths) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  // Decode: one new token each; lengths 1, page-straddling, and long-ish.
  const std::vector<SeqSpec> seqs = {{0, 1}, {6, 1}, {15, 1}, {16, 1}, {99, 1}, {300, 1}};
  uint32_t seed = 1;
  for (int64_t page_size : {16, 7}) {
    for (const Case& c : head_layouts(64, page_size, seqs)) run_case(c, *cpu, seed++);
  }
}

TEST(CpuAttention, ChunkedPrefillCausalMask) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  // Several new tokens per sequence after a cached prefix (chunked prefill) mixed with a
  // decode token and a fresh prompt: token i must see exactly [0, start_pos + i].
  const std::vector<SeqSpec> seqs = {{0, 37}, {10, 5}, {33, 1}, {64, 70}};
  uint32_t seed = 50;
  for (int64_t page_size : {16, 5}) {
    for (const Case& c : head_layouts(32, page_size, seqs)) run_case(c, *cpu, seed++);
  }
}

TEST(CpuAttention, OddHeadDims) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  const std::vector<SeqSpec> seqs = {{3, 4}, {20, 1}};
  uint32_t seed = 80;
  for (int64_t head_dim : {1, 3, 40, 80, 128}) {
    for (const Case& c : head_layouts(head_dim, 6, seqs)) run_case(c, *cpu, seed++);
  }
}

TEST(CpuAttention, ForcedSplitKMatchesReference) {
  // Small chunks that do not align with pages or with key blocks exercise the partial merge,
  // including chunks that lie entirely beyond some queries' causal limit.
  const std::vector<SeqSpec> seqs = {{0, 23}, {50, 9}, {129, 1}};
  uint32_t seed = 120;
  for (int64_t chunk : {1, 7, 64, 100}) {
    auto cpu = make_cpu({.attention_chunk = chunk});
    ASSERT_NE(cpu, nullptr);
    for (const Case& c : head_layouts(16, 7, seqs)) run_case(c, *cpu, seed++);
  }
}

TEST(CpuAttention, LongContextAutomaticSplit) {
  // One sequence, two KV heads: too few (sequence, head) tasks for the threads, so the
  // automatic split-K path runs (on any machine with >= 1 thread: 2 tasks < 4 x threads).
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  const Case c{"GQA 8/2 ctx 5000", 8, 2, 64, 16, {{4999, 1}}};
  run_case(c, *cpu, 200);
  const Case prefill{"GQA 8/2 ctx 3000 prefill 3", 8, 2, 64, 32, {{2997, 3}}};
  run_case(prefill, *cpu, 201);
}

TEST(CpuAttention, Batch16Decode) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  std::vector<SeqSpec> seqs;
  for (int i = 0; i < 16; ++i) seqs.push_back({37 * i + i * i * 5, 1});
  const Case c{"batch 16 GQA 8/2", 8, 2, 64, 16, seqs};
  run_case(c, *cpu, 300);
}

TEST(CpuAttention, SingleThreadMatchesToo) {
  CpuBackendOptions opt;
  opt.num_threads = 1;
  auto cpu = CpuBackend::create(opt);
  ASSERT_TRUE(cpu.is_ok());
  const std::vector<SeqSpec> seqs = {{0, 9}, {700, 1}};
  uint32_t seed = 400;
  for (const Case& c : head_layouts(64, 16, seqs)) run_case(c, **cpu, seed++);
}

TEST(CpuAttention, LargeScoresStayFinite) {
  // Scores in the hundreds: without max subtraction exp overflows.
  auto cpu = make_cpu({.attention_chunk = 8});
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  PagedKv kv(4, 8, 1, 16, 1);
  kv.fill(20, 2, /*k_scale=*/30.0f);
  const auto q = random_floats(2 * 16, 3, -30.0f, 30.0f);
  AttentionItem item{0, 2, 18, kv.view};
  GuardedBuffer got(2 * 16), want(2 * 16);
  ASSERT_TRUE(ref.attention(q.data(), &item, 1, 1, want.data()).is_ok());
  ASSERT_TRUE(cpu->attention(q.data(), &item, 1, 1, got.data()).is_ok());
  expect_close(got.data(), want.data(), got.size(), 1e-4, "large scores");
}

TEST(CpuAttention, RejectsBadShapes) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  PagedKv kv(1, 4, 2, 8, 1);
  float q[3 * 8] = {}, out[3 * 8] = {};
  AttentionItem too_long{0, 3, 2, kv.view};  // positions 2..4 but capacity 4
  EXPECT_EQ(cpu->attention(q, &too_long, 1, 2, out).code(), StatusCode::kOutOfRange);
  AttentionItem ok{0, 1, 0, kv.view};
  EXPECT_EQ(cpu->attention(q, &ok, 1, 3, out).code(), StatusCode::kInvalidArgument);  // 3 % 2
  EXPECT_TRUE(cpu->attention(q, nullptr, 0, 2, out).is_ok());
}

}  // namespace
}  // namespace specontext::cpu
