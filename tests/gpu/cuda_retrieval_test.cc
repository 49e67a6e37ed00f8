// CudaBackend's host↔device memory ops, retrieval-head ops and argmax against the host
// defaults of core/ports/backend.cc (run on a CPU reference backend) and plain host loops. Device
// outputs sit between sentinel guard regions; scores are compared by relative L2 with NaN/inf and
// non-zero checks; selections must be identical to select_from_group_scores. A failing selection
// writes its scores and both selections to a file named in the failure message. Without a device
// every case skips ("no CUDA device").
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/ports/backend.h"
#include "core/ports/selection.h"
#include "cpu/cpu_backend.h"
#include "gpu/cuda_backend.h"
#include "gpu/cuda_raii.h"
#include "tests/gpu/device_test_util.h"

namespace specontext::gpu {
namespace {

using device_test::CaseDump;
using device_test::close;
using device_test::cuda_or_die;
using device_test::Guarded;
using device_test::pick;
using device_test::random_floats;
using device_test::uniform;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

class CudaRetrievalTest : public device_test::BackendTest {
 protected:
  std::mt19937 rng_{20250101};
};

std::vector<uint8_t> random_bytes(std::mt19937& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// ---- memory ops ----

TEST_F(CudaRetrievalTest, InterfaceFacts) {
  EXPECT_EQ(gpu_->memory_kind(), MemoryKind::kDevice);
  EXPECT_TRUE(gpu_->supports(BackendOp::kRetrievalScores, DType::kF32));
}

// The host source is overwritten right after upload() returns: the device must still get the
// old bytes (pageable and pinned sources, small copies that wrap the staging ring many times and
// copies larger than the ring, which travel in chunks).
TEST_F(CudaRetrievalTest, UploadSourceIsReusableAtReturn) {
  auto pinned = PinnedHostBuffer::create(size_t{24} << 20);
  ASSERT_TRUE(pinned.is_ok()) << pinned.status().to_string();
  for (bool use_pinned : {false, true}) {
    for (size_t bytes : {size_t{1}, size_t{1000}, size_t{4096}, size_t{3} << 20, size_t{20} << 20}) {
      SCOPED_TRACE(std::string(use_pinned ? "pinned" : "pageable") + " source, " + std::to_string(bytes) +
                   " bytes");
      const int copies = bytes < 8192 ? 3000 : 2;  // 3000 small copies wrap the 8 MiB ring
      std::vector<uint8_t> pageable(bytes);
      uint8_t* src = use_pinned ? pinned->as<uint8_t>() : pageable.data();
      Guarded<uint8_t> dst(bytes * static_cast<size_t>(copies));
      std::vector<uint8_t> want(dst.size());
      for (int c = 0; c < copies; ++c) {
        const std::vector<uint8_t> data = random_bytes(rng_, bytes);
        std::memcpy(src, data.data(), bytes);
        std::memcpy(want.data() + static_cast<size_t>(c) * bytes, data.data(), bytes);
        ASSERT_TRUE(gpu_->upload(dst.data() + static_cast<size_t>(c) * bytes, src, bytes).is_ok());
        std::memset(src, 0xEE, bytes);  // reuse at once
      }
      sync();
      EXPECT_TRUE(dst.download() == want) << "device copy does not hold the bytes at upload time";
      EXPECT_TRUE(dst.guards_intact());
    }
  }
}

// download() is ordered after queued ops: an add enqueued before it is visible without an
// explicit synchronize, into pageable and pinned destinations.
TEST_F(CudaRetrievalTest, DownloadIsOrderedAfterQueuedOps) {
  const int64_t n = 1 << 20;
  const std::vector<float> a = random_floats(rng_, n);
  const std::vector<float> b = random_floats(rng_, n);
  auto pinned = PinnedHostBuffer::create(n * sizeof(float));
  ASSERT_TRUE(pinned.is_ok());
  for (bool to_pinned : {false, true}) {
    Guarded<float> d_a(a.size());
    Guarded<float> d_b(b.size());
    ASSERT_TRUE(gpu_->upload(d_a.data(), a.data(), n * sizeof(float)).is_ok());
    ASSERT_TRUE(gpu_->upload(d_b.data(), b.data(), n * sizeof(float)).is_ok());
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(gpu_->add(d_a.data(), d_b.data(), n).is_ok());
    std::vector<float> pageable(n);
    float* host = to_pinned ? pinned->as<float>() : pageable.data();
    ASSERT_TRUE(gpu_->download(host, d_a.data(), n * sizeof(float)).is_ok());
    for (int64_t i = 0; i < n; i += 997) {
      ASSERT_EQ(host[i], ((a[i] + b[i]) + b[i]) + b[i]) << "element " << i << (to_pinned ? " (pinned)" : "");
    }
    EXPECT_TRUE(d_a.guards_intact());
  }
}

TEST_F(CudaRetrievalTest, CopyRowsMatchesHostDefault) {
  for (int trial = 0; trial < 20; ++trial) {
    const size_t row_bytes = static_cast<size_t>(pick(rng_, {1, 3, 4, 16, 100, 512, 4096}));
    const int64_t rows = pick(rng_, {1, 2, 7, 64, 1000});
    const size_t src_stride = row_bytes + static_cast<size_t>(uniform(rng_, 0, 64));
    const size_t dst_stride = row_bytes + static_cast<size_t>(uniform(rng_, 0, 64));
    SCOPED_TRACE("row_bytes " + std::to_string(row_bytes) + " rows " + std::to_string(rows) + " strides " +
                 std::to_string(src_stride) + "/" + std::to_string(dst_stride));
    const std::vector<uint8_t> src = random_bytes(rng_, src_stride * static_cast<size_t>(rows));
    std::vector<uint8_t> want = random_bytes(rng_, dst_stride * static_cast<size_t>(rows));
    Guarded<uint8_t> d_src(src);
    Guarded<uint8_t> d_dst(want);  // bytes between rows must survive
    ASSERT_TRUE(gpu_->copy_rows(d_dst.data(), dst_stride, d_src.data(), src_stride, row_bytes, rows).is_ok());
    ASSERT_TRUE(ref_->copy_rows(want.data(), dst_stride, src.data(), src_stride, row_bytes, rows).is_ok());
    sync();
    EXPECT_TRUE(d_dst.download() == want);
    EXPECT_TRUE(d_dst.guards_intact());
  }
  Guarded<uint8_t> buf(256);
  EXPECT_EQ(gpu_->copy_rows(buf.data(), 8, buf.data() + 128, 16, 16, 2).code(), StatusCode::kInvalidArgument)
      << "dst_stride < row_bytes with two rows";
  EXPECT_EQ(gpu_->copy_rows(buf.data(), 16, buf.data(), 16, 16, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(gpu_->copy_rows(buf.data(), 16, buf.data() + 128, 16, 16, 0).is_ok());
}

TEST_F(CudaRetrievalTest, ImportWeightsUploadsOncePerPointerAndContent) {
  std::vector<float> w = random_floats(rng_, 100000);
  const std::vector<float> original = w;
  auto first = gpu_->import_weights(w.data(), w.size() * sizeof(float));
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  auto again = gpu_->import_weights(w.data(), w.size() * sizeof(float));
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(*first, *again) << "the same pointer, size and bytes must return the same device copy";
  std::vector<float> back(original.size());
  ASSERT_TRUE(gpu_->download(back.data(), *first, back.size() * sizeof(float)).is_ok());
  EXPECT_EQ(back, original);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, *first), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  // Other weights at the same address (what freeing a model and loading another can give): a
  // copy of the new bytes, not the stale one.
  std::vector<float> replaced = random_floats(rng_, w.size());
  std::copy(replaced.begin(), replaced.end(), w.begin());
  auto reused = gpu_->import_weights(w.data(), w.size() * sizeof(float));
  ASSERT_TRUE(reused.is_ok()) << reused.status().to_string();
  ASSERT_TRUE(gpu_->download(back.data(), *reused, back.size() * sizeof(float)).is_ok());
  EXPECT_EQ(back, replaced);
  // The same address with another size: a copy of that size.
  auto smaller = gpu_->import_weights(w.data(), 16 * sizeof(float));
  ASSERT_TRUE(smaller.is_ok()) << smaller.status().to_string();
  std::vector<float> head(16);
  ASSERT_TRUE(gpu_->download(head.data(), *smaller, head.size() * sizeof(float)).is_ok());
  EXPECT_EQ(head, std::vector<float>(replaced.begin(), replaced.begin() + 16));
  std::vector<float> second(10, 1.5f);
  auto other = gpu_->import_weights(second.data(), second.size() * sizeof(float));
  ASSERT_TRUE(other.is_ok());
  EXPECT_NE(*other, *smaller);
}

// The hash import_weights tells reused addresses by: every byte and the length count.
TEST(ContentHash, EveryByteAndTheLengthCount) {
  std::vector<uint8_t> bytes(1003);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 13 + 1);
  const uint64_t h = content_hash(bytes.data(), bytes.size());
  EXPECT_EQ(content_hash(bytes.data(), bytes.size()), h);
  for (size_t i : {size_t{0}, size_t{7}, size_t{8}, size_t{500}, size_t{1000}, size_t{1002}}) {
    bytes[i] ^= 1;
    EXPECT_NE(content_hash(bytes.data(), bytes.size()), h) << "byte " << i;
    bytes[i] ^= 1;
  }
  EXPECT_NE(content_hash(bytes.data(), bytes.size() - 1), h);
  std::vector<uint8_t> zeros(64, 0);
  EXPECT_NE(content_hash(zeros.data(), 64), content_hash(zeros.data(), 56)) << "zero bytes still count";
}

// ---- retrieval_group_scores ----

struct ScoreCase {
  int64_t n_heads, n_kv_heads, head_dim, length;
  bool misaligned_k = false;  // K blocks one element past a 4-element boundary: scalar staging
  int64_t block_tokens = 0;   // 0: one block holds everything
  DType k_dtype = DType::kF32;  // the keys as stored (the KV dtype): f32, f16 or bf16
};

// A paged K cache as the engine keeps it: blocks of block_tokens rows, stored in reverse order in
// one buffer (so a kernel that ignores the table reads the wrong rows).
struct PagedKeys {
  int64_t block_tokens = 0, n_blocks = 0;
  std::vector<float> host;  // [n_blocks][block_tokens][kvd] (+1 element when misaligned)
  std::vector<int64_t> slot_of_block;
  // Pointers into a buffer of `elem`-byte elements.
  std::vector<const void*> table(const void* base, size_t elem, bool misaligned, int64_t kvd) const {
    std::vector<const void*> t(static_cast<size_t>(n_blocks));
    const auto* bytes = static_cast<const unsigned char*>(base);
    for (int64_t b = 0; b < n_blocks; ++b) {
      t[static_cast<size_t>(b)] =
          bytes + ((misaligned ? 1 : 0) + slot_of_block[static_cast<size_t>(b)] * block_tokens * kvd) * elem;
    }
    return t;
  }
};

PagedKeys page_keys(std::mt19937& rng, const ScoreCase& c) {
  PagedKeys p;
  const int64_t kvd = c.n_kv_heads * c.head_dim;
  p.block_tokens = c.block_tokens > 0 ? c.block_tokens : std::max<int64_t>(c.length, 1);
  p.n_blocks = (c.length + p.block_tokens - 1) / p.block_tokens;
  p.host = random_floats(rng, static_cast<size_t>(p.n_blocks * p.block_tokens * kvd) + 1, -1.5f, 1.5f);
  for (int64_t b = 0; b < p.n_blocks; ++b) p.slot_of_block.push_back(p.n_blocks - 1 - b);
  return p;
}

void run_score_case(CudaBackend& gpu, Backend& ref, std::mt19937& rng, const ScoreCase& c) {
  const std::string what = "heads " + std::to_string(c.n_heads) + " kv " + std::to_string(c.n_kv_heads) +
                           " hd " + std::to_string(c.head_dim) + " length " + std::to_string(c.length) +
                           " blocks of " + std::to_string(c.block_tokens) + (c.misaligned_k ? " misaligned" : "") +
                           " keys " + std::string(dtype_name(c.k_dtype));
  SCOPED_TRACE(what);
  // Logits of a few units: a realistic, peaked softmax.
  const std::vector<float> q = random_floats(rng, static_cast<size_t>(c.n_heads * c.head_dim), -1.5f, 1.5f);
  const int64_t kvd = c.n_kv_heads * c.head_dim;
  const PagedKeys keys = page_keys(rng, c);
  Guarded<float> d_q(q);
  Guarded<float> d_out(static_cast<size_t>(c.n_kv_heads * c.length));
  // f16 / bf16: the keys rounded to the dtype, the host default reading the same stored bits.
  const bool narrow = c.k_dtype != DType::kF32;
  std::vector<uint16_t> host16(narrow ? keys.host.size() : 1);
  if (narrow) convert_from_f32(c.k_dtype, keys.host.data(), host16.data(), keys.host.size());
  Guarded<float> d_k(narrow ? std::vector<float>(1) : keys.host);
  Guarded<uint16_t> d_k16(host16);
  const size_t elem = dtype_size(c.k_dtype);
  const void* dev_base = narrow ? static_cast<const void*>(d_k16.data()) : d_k.data();
  const void* host_base = narrow ? static_cast<const void*>(host16.data()) : keys.host.data();
  const std::vector<const void*> dev_table = keys.table(dev_base, elem, c.misaligned_k, kvd);
  const std::vector<const void*> host_table = keys.table(host_base, elem, c.misaligned_k, kvd);
  const Status s = gpu.retrieval_group_scores(d_q.data(), dev_table.data(), c.k_dtype, keys.block_tokens, c.length,
                                              c.n_heads, c.n_kv_heads, c.head_dim, d_out.data());
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  std::vector<float> want(d_out.size());
  ASSERT_TRUE(ref.retrieval_group_scores(q.data(), host_table.data(), c.k_dtype, keys.block_tokens, c.length,
                                         c.n_heads, c.n_kv_heads, c.head_dim, want.data())
                  .is_ok());
  const Status synced = gpu.synchronize();
  ASSERT_TRUE(synced.is_ok()) << "device fault: " << synced.to_string();
  const std::vector<float> got = d_out.download();
  EXPECT_TRUE(close(got, want, 1e-4)) << what;  // exp2 of log2-scaled logits vs exp, other sum orders
  EXPECT_TRUE(d_out.guards_intact()) << "write outside out[n_kv_heads][length]";
  if (c.n_heads == c.n_kv_heads) {  // MHA: each row is a softmax and sums to 1
    for (int64_t g = 0; g < c.n_kv_heads; ++g) {
      const double sum = std::accumulate(got.begin() + g * c.length, got.begin() + (g + 1) * c.length, 0.0);
      EXPECT_NEAR(sum, 1.0, 1e-4) << "head " << g;
    }
  }
}

TEST_F(CudaRetrievalTest, ScoresMatchHostDefaultOnRandomShapes) {
  const ScoreCase fixed[] = {
      {8, 8, 64, 1},           {4, 1, 128, 7},    {32, 8, 128, 4096, false, 2048}, {8, 2, 256, 3000, false, 100},
      {14, 2, 64, 200000},     {64, 1, 64, 1000, false, 7}, {2, 2, 100, 517, false, 64}, {3, 1, 7, 33, true, 5},
      {8, 4, 128, 1025, true, 256}, {1, 1, 1, 2}, {16, 16, 80, 2049, false, 2048}, {8, 1, 255, 129, false, 1},
      // At most 48 KiB of dynamic shared memory but more with the kernel's static array: these
      // launches need the opt-in (they failed when the plan counted the dynamic part alone).
      {20, 1, 128, 3000, false, 256}, {38, 2, 128, 700}, {10, 1, 256, 1500, false, 64}, {56, 1, 64, 900},
      // Keys in f16 / bf16 (the KV dtype), widened as the kernel stages them: 4-element loads,
      // scalar loads (misaligned, head_dim not a multiple of 4), and the shared-memory opt-in.
      {32, 8, 128, 4096, false, 2048, DType::kF16}, {8, 2, 64, 1000, false, 7, DType::kBF16},
      {3, 1, 7, 33, true, 5, DType::kF16},          {8, 4, 128, 1025, true, 256, DType::kBF16},
      {20, 1, 128, 3000, false, 256, DType::kF16},  {16, 16, 80, 2049, false, 2048, DType::kBF16},
  };
  for (const ScoreCase& c : fixed) run_score_case(*gpu_, *ref_, rng_, c);
  for (int trial = 0; trial < 10; ++trial) {
    const int64_t kv = pick(rng_, {1, 2, 4, 8});
    const int64_t group = pick(rng_, {1, 2, 4, 7});  // MHA, GQA, MQA-like groups
    const int64_t hd = pick(rng_, {16, 48, 64, 96, 128, 192, 256});
    const int64_t length = pick(rng_, {1, 31, 129, 1000, 8191, 20000});
    const int64_t block = pick(rng_, {0, 16, 200, 2048});
    const DType dt = trial % 3 == 1 ? DType::kF16 : trial % 3 == 2 ? DType::kBF16 : DType::kF32;
    run_score_case(*gpu_, *ref_, rng_, ScoreCase{kv * group, kv, hd, length, trial % 4 == 0, block, dt});
  }
}

// Scratch grows for a long context and is reused (not regrown) for shorter ones afterwards.
TEST_F(CudaRetrievalTest, ScoresScratchReuseAcrossShapes) {
  for (int64_t length : {50000, 100, 30000, 7})
    run_score_case(*gpu_, *ref_, rng_, ScoreCase{8, 2, 64, length});
}

TEST_F(CudaRetrievalTest, ScoresRejectBadArguments) {
  Guarded<float> buf(4096);
  const void* table[1] = {buf.data()};
  const DType f32 = DType::kF32;
  EXPECT_EQ(gpu_->retrieval_group_scores(buf.data(), table, f32, 16, 4, 3, 2, 8, buf.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->retrieval_group_scores(buf.data(), table, f32, 16, 4, 2, 1, 300, buf.data()).code(),
            StatusCode::kUnimplemented);
  EXPECT_EQ(gpu_->retrieval_group_scores(buf.data(), table, f32, 0, 4, 2, 1, 8, buf.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->retrieval_group_scores(buf.data(), table, DType::kQ8_0, 16, 4, 2, 1, 8, buf.data()).code(),
            StatusCode::kInvalidArgument);
  const void* null_block[1] = {nullptr};
  EXPECT_EQ(gpu_->retrieval_group_scores(buf.data(), null_block, f32, 16, 4, 2, 1, 8, buf.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(gpu_->retrieval_group_scores(nullptr, nullptr, f32, 16, 0, 2, 1, 8, nullptr).is_ok()) << "empty context";
  sync();
}

// ---- select_top_tokens ----

// Scores with deliberate ties (quantised levels), signed zeros, or plain softmax-like values.
std::vector<float> select_scores(std::mt19937& rng, size_t n, int kind) {
  std::vector<float> v(n);
  std::uniform_real_distribution<float> real(0.0f, 1.0f);
  std::uniform_int_distribution<int> level(0, 15);
  for (float& x : v) {
    switch (kind) {
      case 0:
        x = real(rng) * 1e-5f;
        break;
      case 1:
        x = static_cast<float>(level(rng)) / 16.0f;
        break;
      case 2:
        x = level(rng) < 8 ? (level(rng) < 8 ? -0.0f : 0.0f) : real(rng);
        break;
      default:
        x = 0.125f;
        break;  // one big tie: the oldest middle tokens win
    }
  }
  return v;
}

::testing::AssertionResult same_selection(const Selection& want, const Selection& got,
                                          const std::string& name, const std::vector<float>& scores) {
  bool same = want.kv_heads == got.kv_heads && want.budget == got.budget && want.counts == got.counts;
  for (int64_t h = 0; same && h < want.kv_heads; ++h) {
    const auto w = want.head(h);
    const auto g = got.head(h);
    same = std::equal(w.begin(), w.end(), g.begin(), g.end());
  }
  if (same) return ::testing::AssertionSuccess();
  CaseDump dump(name);
  dump.add("scores", scores).add("host_counts", want.counts).add("device_counts", got.counts);
  dump.add("host_indices", want.indices).add("device_indices", got.indices);
  return ::testing::AssertionFailure()
         << "device selection differs from select_from_group_scores; inputs and both "
            "outputs in "
         << dump.write();
}

TEST_F(CudaRetrievalTest, SelectEqualsHostSelectionExactly) {
  struct Case {
    int64_t kv, length, budget, sinks, window;
    int kind;
  };
  std::vector<Case> cases = {
      {1, 1, 4, 1, 4, 0},         {2, 100, 100, 1, 4, 0},    {8, 101, 100, 1, 4, 1},
      {4, 5000, 64, 0, 0, 1},     {4, 5000, 64, 4, 4, 2},    {1, 200000, 8192, 1, 4, 0},
      {8, 200000, 2048, 4, 1, 1}, {2, 70000, 8192, 0, 1, 3}, {3, 10000, 6, 4, 4, 0},
      {1, 10, 3, 0, 0, 3},        {16, 4097, 4096, 1, 4, 2}, {1, 1 << 20, 8192, 1, 4, 0},
  };
  for (int trial = 0; trial < 20; ++trial) {
    cases.push_back(Case{pick(rng_, {1, 2, 8}), pick(rng_, {1, 2, 17, 300, 4096, 65537}),
                         pick(rng_, {1, 2, 16, 256, 2048, 8192}), pick(rng_, {0, 1, 4}),
                         pick(rng_, {0, 1, 4}), static_cast<int>(uniform(rng_, 0, 3))});
  }
  Selection got;  // reused across cases: stale content must not leak into the result
  for (const Case& c : cases) {
    const std::string name = "select_kv" + std::to_string(c.kv) + "_len" + std::to_string(c.length) +
                             "_budget" + std::to_string(c.budget) + "_sinks" + std::to_string(c.sinks) +
                             "_window" + std::to_string(c.window) + "_kind" + std::to_string(c.kind);
    SCOPED_TRACE(name);
    const std::vector<float> scores = select_scores(rng_, static_cast<size_t>(c.kv * c.length), c.kind);
    Guarded<float> d_scores(scores);
    const SelectionOptions o{c.budget, c.sinks, c.window};
    const Status s = gpu_->select_top_tokens(d_scores.data(), c.kv, c.length, o, got);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    Selection want;
    select_from_group_scores(scores, c.kv, c.length, o, want);
    EXPECT_TRUE(same_selection(want, got, name, scores));
    EXPECT_TRUE(d_scores.download() == scores) << "scores were modified";
    EXPECT_TRUE(d_scores.guards_intact());
  }
}

// The pipeline as the engine runs it: device scores, then the device selection, against the host
// selection of the same (downloaded) scores.
TEST_F(CudaRetrievalTest, SelectOnDeviceScores) {
  const int64_t heads = 32, kv = 8, hd = 128, length = 50000;
  const std::vector<float> q = random_floats(rng_, heads * hd, -1.0f, 1.0f);
  const std::vector<float> k = random_floats(rng_, length * kv * hd, -1.0f, 1.0f);
  Guarded<float> d_q(q);
  Guarded<float> d_k(k);
  Guarded<float> d_scores(static_cast<size_t>(kv * length));
  const void* table[1] = {d_k.data()};
  ASSERT_TRUE(gpu_->retrieval_group_scores(d_q.data(), table, DType::kF32, length, length, heads, kv, hd,
                                           d_scores.data())
                  .is_ok());
  Selection got;
  const SelectionOptions o{2048, 1, 4};
  ASSERT_TRUE(gpu_->select_top_tokens(d_scores.data(), kv, length, o, got).is_ok());
  const std::vector<float> scores = d_scores.download();
  Selection want;
  select_from_group_scores(scores, kv, length, o, want);
  EXPECT_TRUE(same_selection(want, got, "select_on_device_scores", scores));
}

TEST_F(CudaRetrievalTest, SelectRejectsBadArguments) {
  Guarded<float> scores(1000);
  Selection out;
  EXPECT_EQ(gpu_->select_top_tokens(scores.data(), 1, 1000, SelectionOptions{10, -1, 4}, out).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->select_top_tokens(scores.data(), 1, 1000, SelectionOptions{10, 1, -4}, out).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->select_top_tokens(nullptr, 1, 1000, SelectionOptions{10, 1, 4}, out).code(),
            StatusCode::kInvalidArgument);
  // Fits the budget: answered on the host, the (null) scores are never read.
  ASSERT_TRUE(gpu_->select_top_tokens(nullptr, 2, 5, SelectionOptions{10, 1, 4}, out).is_ok());
  EXPECT_EQ(out.counts, (std::vector<int32_t>{5, 5}));
  EXPECT_EQ(std::vector<int32_t>(out.head(1).begin(), out.head(1).end()),
            (std::vector<int32_t>{0, 1, 2, 3, 4}));
}

}  // namespace
}  // namespace specontext::gpu
