// Every op of the CUDA backend against the CPU reference backend on randomised shapes: inputs
// are generated on the host, copied to the device, run on both, and compared by relative L2
// error with a per-op tolerance. Device outputs sit between guard regions filled with a sentinel
// byte pattern that must survive the op. Without a device every case skips ("no CUDA device").
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "core/ports/backend.h"
#include "cpu/cpu_backend.h"
#include "gpu/cuda_backend.h"
#include "gpu/sparse_plan.h"
#include "tests/gpu/device_test_util.h"
#include "tests/gpu/kv_rounding_values.h"

namespace specontext::gpu {
namespace {

using device_test::close;
using device_test::cuda_or_die;
using device_test::Guarded;
using device_test::pick;
using device_test::random_floats;
using device_test::uniform;

class CudaOpsTest : public device_test::BackendTest {
 protected:
  std::mt19937 rng_{20240611};
};

// ---- embed ----

TEST_F(CudaOpsTest, EmbedAllTableTypes) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int trial = 0; trial < 4; ++trial) {
      const int64_t vocab = uniform(rng_, 5, 300);
      const int64_t cols = pick(rng_, {1, 7, 64, 333, 1024});
      const int64_t n = uniform(rng_, 1, 20);
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " vocab " + std::to_string(vocab) + " cols " +
                   std::to_string(cols) + " n " + std::to_string(n));
      const std::vector<float> values = random_floats(rng_, static_cast<size_t>(vocab * cols));
      std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
      for (size_t i = 0; i < values.size(); ++i) {
        if (dtype == DType::kF32) {
          std::memcpy(bytes.data() + 4 * i, &values[i], 4);
        } else {
          const uint16_t h = dtype == DType::kF16 ? f32_to_f16(values[i]) : f32_to_bf16(values[i]);
          std::memcpy(bytes.data() + 2 * i, &h, 2);
        }
      }
      std::vector<TokenId> ids(static_cast<size_t>(n));
      for (TokenId& id : ids) id = static_cast<TokenId>(uniform(rng_, 0, vocab - 1));

      Guarded<uint8_t> d_table(bytes);
      Guarded<TokenId> d_ids(ids);
      Guarded<float> d_out(static_cast<size_t>(n * cols));
      ASSERT_TRUE(gpu_->embed(d_ids.data(), n, WeightMatrix{dtype, vocab, cols, d_table.data()},
                              d_out.data()).is_ok());
      std::vector<float> want(static_cast<size_t>(n * cols));
      ASSERT_TRUE(ref_->embed(ids.data(), n, WeightMatrix{dtype, vocab, cols, bytes.data()},
                              want.data()).is_ok());
      sync();
      EXPECT_TRUE(close(d_out.download(), want, 0.0));  // a lossless conversion: exact
      EXPECT_TRUE(d_out.guards_intact());
    }
  }
}

TEST_F(CudaOpsTest, EmbedOutOfRangeIdGivesNanRow) {
  const std::vector<float> table = random_floats(rng_, 4 * 8);
  Guarded<float> d_table(table);
  Guarded<TokenId> d_ids(std::vector<TokenId>{1, 4, -1});
  Guarded<float> d_out(3 * 8);
  ASSERT_TRUE(gpu_->embed(d_ids.data(), 3, WeightMatrix{DType::kF32, 4, 8, d_table.data()},
                          d_out.data()).is_ok());
  sync();
  const std::vector<float> out = d_out.download();
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(out[c], table[8 + c]);
    EXPECT_TRUE(std::isnan(out[8 + c]));
    EXPECT_TRUE(std::isnan(out[16 + c]));
  }
  EXPECT_TRUE(d_out.guards_intact());
}

// ---- matmul ----

void run_matmul_case(CudaOpsTest& t, Backend& gpu, Backend& ref, std::mt19937& rng, DType dtype,
                     double tolerance) {
  for (int trial = 0; trial < 8; ++trial) {
    const int64_t m = pick(rng, {1, 2, 5, 32, 77});
    const int64_t k = pick(rng, {16, 100, 512, 1000});
    const int64_t n = pick(rng, {8, 129, 300, 1024});
    const bool with_bias = trial % 2 == 1;
    SCOPED_TRACE(std::string(dtype_name(dtype)) + " m " + std::to_string(m) + " k " +
                 std::to_string(k) + " n " + std::to_string(n) + (with_bias ? " +bias" : ""));
    const std::vector<float> x = random_floats(rng, static_cast<size_t>(m * k));
    const std::vector<float> w32 = random_floats(rng, static_cast<size_t>(n * k));
    const std::vector<float> bias = random_floats(rng, static_cast<size_t>(n));
    std::vector<uint8_t> w_bytes(w32.size() * dtype_size(dtype));
    for (size_t i = 0; i < w32.size(); ++i) {
      if (dtype == DType::kF32) {
        std::memcpy(w_bytes.data() + 4 * i, &w32[i], 4);
      } else {
        const uint16_t h = f32_to_bf16(w32[i]);
        std::memcpy(w_bytes.data() + 2 * i, &h, 2);
      }
    }
    Guarded<float> d_x(x);
    Guarded<uint8_t> d_w(w_bytes);
    Guarded<float> d_bias(bias);
    Guarded<float> d_y(static_cast<size_t>(m * n));
    const Status s = gpu.matmul(d_x.data(), m, WeightMatrix{dtype, n, k, d_w.data()},
                                with_bias ? d_bias.data() : nullptr, d_y.data());
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    std::vector<float> want(static_cast<size_t>(m * n));
    ASSERT_TRUE(ref.matmul(x.data(), m, WeightMatrix{dtype, n, k, w_bytes.data()},
                           with_bias ? bias.data() : nullptr, want.data()).is_ok());
    t.sync();
    EXPECT_TRUE(close(d_y.download(), want, tolerance));
    EXPECT_TRUE(d_y.guards_intact());
    EXPECT_EQ(d_x.download(), x);  // input untouched
  }
}

TEST_F(CudaOpsTest, MatmulF32) {
  // True f32 GEMM (TF32 would give ~1e-3).
  run_matmul_case(*this, *gpu_, *ref_, rng_, DType::kF32, 1e-5);
}

TEST_F(CudaOpsTest, MatmulBf16) {
  if (!ref_->supports(BackendOp::kMatmul, DType::kBF16)) GTEST_SKIP() << "reference lacks bf16";
  // Activations are rounded to bf16 (8 bits of mantissa): ~2^-9 relative per product.
  run_matmul_case(*this, *gpu_, *ref_, rng_, DType::kBF16, 5e-3);
}

// ---- rmsnorm ----

TEST_F(CudaOpsTest, RmsNorm) {
  for (int trial = 0; trial < 10; ++trial) {
    const int64_t rows = uniform(rng_, 1, 7);
    const int64_t dim = pick(rng_, {1, 3, 64, 100, 4096, 4097, 8192});
    const bool in_place = trial % 3 == 2;
    SCOPED_TRACE("rows " + std::to_string(rows) + " dim " + std::to_string(dim) +
                 (in_place ? " in place" : ""));
    const std::vector<float> x = random_floats(rng_, static_cast<size_t>(rows * dim), -3.0f, 3.0f);
    const std::vector<float> w = random_floats(rng_, static_cast<size_t>(dim), 0.5f, 1.5f);
    Guarded<float> d_x(x);
    Guarded<float> d_w(w);
    Guarded<float> d_y(static_cast<size_t>(rows * dim));
    float* y = in_place ? d_x.data() : d_y.data();
    ASSERT_TRUE(gpu_->rmsnorm(d_x.data(), d_w.data(), rows, dim, 1e-5f, y).is_ok());
    std::vector<float> want(x.size());
    ASSERT_TRUE(ref_->rmsnorm(x.data(), w.data(), rows, dim, 1e-5f, want.data()).is_ok());
    sync();
    EXPECT_TRUE(close(in_place ? d_x.download() : d_y.download(), want, 1e-5));
    EXPECT_TRUE(d_x.guards_intact());
    EXPECT_TRUE(d_y.guards_intact());
  }
}

// ---- rope ----

RopeParams make_params(int64_t head_dim, RopeStyle style, double theta, float mscale) {
  RopeParams p;
  p.head_dim = head_dim;
  p.style = style;
  p.mscale = mscale;
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    p.inv_freq.push_back(static_cast<float>(1.0 / std::pow(theta, 2.0 * i / head_dim)));
  }
  return p;
}

TEST_F(CudaOpsTest, RopeBothStyles) {
  for (int trial = 0; trial < 12; ++trial) {
    const RopeStyle style = trial % 2 == 0 ? RopeStyle::kHalf : RopeStyle::kInterleaved;
    const int64_t head_dim = pick(rng_, {2, 64, 80, 128, 256});
    const int64_t n_heads = pick(rng_, {1, 3, 8, 32});
    const int64_t n_tokens = pick(rng_, {1, 9, 33});
    const double theta = trial % 3 == 0 ? 500000.0 : 10000.0;
    const float mscale = trial % 4 == 3 ? 1.3f : 1.0f;
    SCOPED_TRACE("head_dim " + std::to_string(head_dim) + " heads " + std::to_string(n_heads) +
                 " tokens " + std::to_string(n_tokens) + " style " + std::to_string(trial % 2));
    // A different table every trial also exercises the device-side cache refresh.
    const RopeParams params = make_params(head_dim, style, theta, mscale);
    std::vector<int64_t> positions(static_cast<size_t>(n_tokens));
    for (int64_t& p : positions) p = uniform(rng_, 0, 8000);
    const std::vector<float> x =
        random_floats(rng_, static_cast<size_t>(n_tokens * n_heads * head_dim));
    Guarded<float> d_x(x);
    Guarded<int64_t> d_pos(positions);
    ASSERT_TRUE(gpu_->rope(d_x.data(), n_tokens, n_heads, d_pos.data(), params).is_ok());
    std::vector<float> want = x;
    ASSERT_TRUE(ref_->rope(want.data(), n_tokens, n_heads, positions.data(), params).is_ok());
    sync();
    EXPECT_TRUE(close(d_x.download(), want, 1e-5));
    EXPECT_TRUE(d_x.guards_intact());
  }
}

TEST_F(CudaOpsTest, RopeRejectsBadParams) {
  RopeParams params = make_params(64, RopeStyle::kHalf, 10000.0, 1.0f);
  params.inv_freq.pop_back();
  EXPECT_EQ(gpu_->rope(nullptr, 1, 1, nullptr, params).code(), StatusCode::kInvalidArgument);
}

// ---- swiglu, add ----

TEST_F(CudaOpsTest, SwigluAndAdd) {
  for (int trial = 0; trial < 8; ++trial) {
    const int64_t n = pick(rng_, {1, 3, 4, 1000, 11008, 65537});
    const bool in_place = trial % 2 == 1;
    SCOPED_TRACE("n " + std::to_string(n) + (in_place ? " in place" : ""));
    const std::vector<float> gate = random_floats(rng_, static_cast<size_t>(n), -6.0f, 6.0f);
    const std::vector<float> up = random_floats(rng_, static_cast<size_t>(n), -2.0f, 2.0f);
    Guarded<float> d_gate(gate);
    Guarded<float> d_up(up);
    Guarded<float> d_out(static_cast<size_t>(n));
    float* out = in_place ? d_gate.data() : d_out.data();
    ASSERT_TRUE(gpu_->swiglu(d_gate.data(), d_up.data(), n, out).is_ok());
    std::vector<float> want(gate.size());
    ASSERT_TRUE(ref_->swiglu(gate.data(), up.data(), n, want.data()).is_ok());
    sync();
    EXPECT_TRUE(close(in_place ? d_gate.download() : d_out.download(), want, 1e-6));
    EXPECT_TRUE(d_gate.guards_intact());
    EXPECT_TRUE(d_out.guards_intact());

    // add, also on a misaligned view (offset by one element: the scalar path).
    const size_t offset = in_place ? 1 : 0;
    const int64_t len = n - static_cast<int64_t>(offset);
    if (len <= 0) continue;
    const std::vector<float> a = random_floats(rng_, static_cast<size_t>(n));
    const std::vector<float> b = random_floats(rng_, static_cast<size_t>(n));
    Guarded<float> d_a(a);
    Guarded<float> d_b(b);
    ASSERT_TRUE(gpu_->add(d_a.data() + offset, d_b.data() + offset, len).is_ok());
    std::vector<float> want_a = a;
    ASSERT_TRUE(ref_->add(want_a.data() + offset, b.data() + offset, len).is_ok());
    sync();
    EXPECT_TRUE(close(d_a.download(), want_a, 0.0));
    EXPECT_TRUE(d_a.guards_intact());
  }
}

// ---- paged KV cache: host mirror and device pages with identical layout ----

constexpr DType kKvDtypes[] = {DType::kF32, DType::kF16, DType::kBF16};

std::string dtype_str(DType t) { return std::string(dtype_name(t)); }

// Raw bytes of `values` rounded to the KV dtype t (core's convert_from_f32, as the reference).
std::vector<uint8_t> kv_bytes(const std::vector<float>& values, DType t) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(t));
  convert_from_f32(t, values.data(), bytes.data(), values.size());
  return bytes;
}

std::vector<uint8_t> random_kv(std::mt19937& rng, size_t n, DType t, float lo = -1.0f, float hi = 1.0f) {
  return kv_bytes(random_floats(rng, n, lo, hi), t);
}

// Bit-exact comparison of two byte arrays, naming the first difference.
::testing::AssertionResult same_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  size_t first = got.size();
  size_t differing = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      first = std::min(first, i);
      ++differing;
    }
  }
  if (differing == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << differing << " bytes differ, the first at byte " << first << ": " << static_cast<int>(got[first])
         << " vs " << static_cast<int>(want[first]);
}

// n_pages pages of [kv_heads][page_size][head_dim] elements of `dtype`, stored in one allocation
// in a shuffled order so that logical page p is not at offset p (exercises the page tables).
struct PagedCache {
  int64_t n_pages, page_size, kv_heads, head_dim;
  DType dtype;
  std::vector<uint8_t> host_k, host_v;
  std::unique_ptr<Guarded<uint8_t>> dev_k, dev_v;
  std::vector<void*> host_k_pages, host_v_pages, dev_k_pages, dev_v_pages;

  PagedCache(std::mt19937& rng, int64_t pages, int64_t ps, int64_t kvh, int64_t hd, DType t = DType::kF32)
      : n_pages(pages), page_size(ps), kv_heads(kvh), head_dim(hd), dtype(t) {
    const size_t page_elems = static_cast<size_t>(ps * kvh * hd);
    const size_t page_bytes = page_elems * dtype_size(t);
    host_k = random_kv(rng, page_elems * static_cast<size_t>(pages), t);
    host_v = random_kv(rng, page_elems * static_cast<size_t>(pages), t);
    dev_k = std::make_unique<Guarded<uint8_t>>(host_k);
    dev_v = std::make_unique<Guarded<uint8_t>>(host_v);
    std::vector<int64_t> order(static_cast<size_t>(pages));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t p = 0; p < pages; ++p) {
      const size_t at = static_cast<size_t>(order[static_cast<size_t>(p)]) * page_bytes;
      host_k_pages.push_back(host_k.data() + at);
      host_v_pages.push_back(host_v.data() + at);
      dev_k_pages.push_back(dev_k->data() + at);
      dev_v_pages.push_back(dev_v->data() + at);
    }
  }
  KvLayerView host_view() const {
    return KvLayerView{
        host_k_pages.data(), host_v_pages.data(), n_pages, page_size, kv_heads, head_dim, dtype};
  }
  KvLayerView device_view() const {
    return KvLayerView{dev_k_pages.data(), dev_v_pages.data(), n_pages, page_size, kv_heads, head_dim, dtype};
  }
  // Device pages equal the host mirror bit for bit, and the guards around them are intact.
  ::testing::AssertionResult matches_host() const {
    ::testing::AssertionResult k = same_bytes(dev_k->download(), host_k);
    if (!k) return ::testing::AssertionFailure() << "K pages: " << k.message();
    ::testing::AssertionResult v = same_bytes(dev_v->download(), host_v);
    if (!v) return ::testing::AssertionFailure() << "V pages: " << v.message();
    if (!dev_k->guards_intact() || !dev_v->guards_intact()) return ::testing::AssertionFailure() << "guards";
    return ::testing::AssertionSuccess();
  }
};

TEST_F(CudaOpsTest, KvAppendAcrossPages) {
  for (DType dtype : kKvDtypes) {
    for (int trial = 0; trial < 10; ++trial) {
      const int64_t page_size = pick(rng_, {1, 4, 16, 64});
      const int64_t kv_heads = pick(rng_, {1, 2, 8});
      const int64_t head_dim = pick(rng_, {4, 6, 64, 128});
      const int64_t n_pages = uniform(rng_, 1, 12);
      const int64_t capacity = n_pages * page_size;
      const int64_t start_pos = uniform(rng_, 0, capacity - 1);
      const int64_t n_tokens = uniform(rng_, 1, capacity - start_pos);
      SCOPED_TRACE(dtype_str(dtype) + " page_size " + std::to_string(page_size) + " kv_heads " +
                   std::to_string(kv_heads) + " head_dim " + std::to_string(head_dim) + " start " +
                   std::to_string(start_pos) + " n " + std::to_string(n_tokens));
      PagedCache cache(rng_, n_pages, page_size, kv_heads, head_dim, dtype);
      const std::vector<float> k = random_floats(rng_, static_cast<size_t>(n_tokens * kv_heads * head_dim));
      const std::vector<float> v = random_floats(rng_, k.size());
      Guarded<float> d_k(k);
      Guarded<float> d_v(v);
      const KvLayerView dview = cache.device_view();
      ASSERT_TRUE(gpu_->kv_append(d_k.data(), d_v.data(), n_tokens, start_pos, dview).is_ok());
      ASSERT_TRUE(ref_->kv_append(k.data(), v.data(), n_tokens, start_pos, cache.host_view()).is_ok());
      sync();
      // Whole pages compared: written slots must match, untouched slots must be unchanged.
      EXPECT_TRUE(cache.matches_host());
    }
  }
  // Beyond capacity is refused before anything is enqueued.
  PagedCache small(rng_, 1, 4, 1, 4);
  EXPECT_EQ(gpu_->kv_append(nullptr, nullptr, 2, 3, small.device_view()).code(),
            StatusCode::kOutOfRange);
}

// The rounding of kv_append equals the reference's bit for bit on the hard cases: ±0, ±inf, NaNs
// of both signs and several payloads, the f16 overflow threshold (65520 is a tie and rounds to
// inf), f16 and bf16 subnormals and ties, f32 subnormals, FLT_MAX; then random bit patterns
// (every exponent).
TEST_F(CudaOpsTest, KvAppendRoundsLikeTheReference) {
  const int64_t page_size = 16, kv_heads = 2, head_dim = 64, n_tokens = 40, start_pos = 5;
  const size_t n = static_cast<size_t>(n_tokens * kv_heads * head_dim);
  std::vector<float> k = kv_test::kv_rounding_special_values();
  std::vector<float> v(k.rbegin(), k.rend());
  std::uniform_int_distribution<uint32_t> any_bits;
  while (k.size() < n) k.push_back(std::bit_cast<float>(any_bits(rng_)));
  while (v.size() < n) v.push_back(std::bit_cast<float>(any_bits(rng_)));
  Guarded<float> d_k(k);
  Guarded<float> d_v(v);
  for (DType dtype : kKvDtypes) {
    SCOPED_TRACE(dtype_str(dtype));
    PagedCache cache(rng_, 4, page_size, kv_heads, head_dim, dtype);
    ASSERT_TRUE(gpu_->kv_append(d_k.data(), d_v.data(), n_tokens, start_pos, cache.device_view()).is_ok());
    ASSERT_TRUE(ref_->kv_append(k.data(), v.data(), n_tokens, start_pos, cache.host_view()).is_ok());
    sync();
    EXPECT_TRUE(cache.matches_host());
  }
  const std::vector<float> k_after = d_k.download();  // the inputs are only read
  EXPECT_EQ(std::memcmp(k_after.data(), k.data(), k.size() * sizeof(float)), 0);
  EXPECT_TRUE(d_k.guards_intact());
}

// ---- attention ----

struct AttentionCase {
  const char* name;
  int64_t n_heads, kv_heads, head_dim, page_size;
  std::vector<std::pair<int64_t, int64_t>> items;  // (n_tokens, start_pos)
  float q_scale = 1.0f;
};

// Both sides widen the same rounded K/V to f32, so every dtype has f32's tolerance.
void run_attention_case(CudaOpsTest& t, Backend& gpu, Backend& ref, std::mt19937& rng, const AttentionCase& c,
                        DType dtype = DType::kF32) {
  SCOPED_TRACE(std::string(c.name) + ", " + dtype_str(dtype));
  // One cache per item; items get token offsets in reverse order to decouple rows from items.
  std::vector<std::unique_ptr<PagedCache>> caches;
  std::vector<AttentionItem> host_items, dev_items;
  int64_t total_rows = 0;
  for (const auto& [n_tokens, start_pos] : c.items) total_rows += n_tokens;
  int64_t next_row = total_rows;
  for (const auto& [n_tokens, start_pos] : c.items) {
    const int64_t len = start_pos + n_tokens;
    const int64_t pages = std::max<int64_t>(1, (len + c.page_size - 1) / c.page_size + 1);  // + slack
    caches.push_back(std::make_unique<PagedCache>(rng, pages, c.page_size, c.kv_heads, c.head_dim, dtype));
    next_row -= n_tokens;
    host_items.push_back(AttentionItem{next_row, n_tokens, start_pos, caches.back()->host_view()});
    dev_items.push_back(AttentionItem{next_row, n_tokens, start_pos, caches.back()->device_view()});
  }
  const size_t q_size = static_cast<size_t>(total_rows * c.n_heads * c.head_dim);
  std::vector<float> q = random_floats(rng, q_size, -c.q_scale, c.q_scale);
  Guarded<float> d_q(q);
  Guarded<float> d_out(q_size);
  const Status s = gpu.attention(d_q.data(), dev_items.data(), static_cast<int64_t>(dev_items.size()),
                                 c.n_heads, d_out.data());
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  std::vector<float> want(q_size);
  ASSERT_TRUE(ref.attention(q.data(), host_items.data(), static_cast<int64_t>(host_items.size()),
                            c.n_heads, want.data()).is_ok());
  t.sync();
  EXPECT_TRUE(close(d_out.download(), want, 1e-4));
  EXPECT_TRUE(d_out.guards_intact());
  for (const auto& cache : caches) EXPECT_TRUE(cache->matches_host());  // the cache is only read
}

TEST_F(CudaOpsTest, AttentionDecodeSplitK) {
  const std::vector<AttentionCase> cases = {
      {"mha decode, one long sequence", 4, 4, 64, 16, {{1, 3000}}},
      {"gqa decode batch", 32, 8, 128, 16, {{1, 700}, {1, 5}, {1, 2047}, {1, 0}}},
      {"gqa 8 decode, peaky softmax", 16, 2, 128, 32, {{1, 4100}}, 4.0f},
      {"head_dim 256 decode", 8, 1, 256, 16, {{1, 1500}, {1, 300}}},
      {"head_dim 80, page 1", 6, 3, 80, 1, {{1, 600}}},
  };
  for (const AttentionCase& c : cases) run_attention_case(*this, *gpu_, *ref_, rng_, c);
}

TEST_F(CudaOpsTest, AttentionPrefillAndMixedBatches) {
  const std::vector<AttentionCase> cases = {
      {"short prefill (no split)", 8, 2, 64, 16, {{100, 0}}},
      {"prefill, many tiles (no split)", 32, 8, 64, 16, {{400, 0}}},
      {"chunked prefill", 8, 2, 128, 16, {{40, 300}}},
      {"head_dim 256 prefill", 4, 1, 256, 32, {{20, 100}, {1, 1000}}},
      {"mixed batch with an empty item", 12, 4, 128, 8, {{33, 17}, {0, 50}, {1, 900}, {5, 0}}},
      {"odd head_dim 80 prefill", 6, 3, 80, 4, {{7, 33}, {64, 0}}},
  };
  for (const AttentionCase& c : cases) run_attention_case(*this, *gpu_, *ref_, rng_, c);
}

// Every instance of the partial kernel (dims per lane 2 / 4 / 8 by head_dim, queries per warp
// 1 / 2 / 4 by the largest item's (row, head-of-group) pairs), with and without a split, for each
// KV dtype.
TEST_F(CudaOpsTest, AttentionEveryKernelInstanceAllKvDtypes) {
  const std::vector<AttentionCase> cases = {
      {"head_dim 64, 1 query per warp, split", 4, 4, 64, 16, {{1, 2000}}},
      {"head_dim 64, 2 queries per warp, split", 16, 2, 64, 16, {{1, 1000}}},
      {"head_dim 64, 4 queries per warp, prefill", 8, 2, 64, 16, {{100, 0}}},
      {"head_dim 128, 1 query per warp, gqa batch", 32, 8, 128, 16, {{1, 700}, {1, 5}, {1, 2047}, {1, 0}}},
      {"head_dim 128, 2 queries per warp, peaky", 16, 2, 128, 32, {{1, 1500}}, 4.0f},
      {"head_dim 128, 4 queries per warp, chunked prefill", 8, 2, 128, 16, {{40, 300}}},
      {"head_dim 80, page 1", 6, 3, 80, 1, {{1, 600}}},
      {"head_dim 256, 1 query per warp", 4, 1, 256, 16, {{1, 1500}}},
      {"head_dim 256, 2 queries per warp", 8, 1, 256, 16, {{1, 1500}, {1, 300}}},
      {"head_dim 256, 4 queries per warp, prefill", 4, 1, 256, 32, {{20, 100}, {1, 1000}}},
      {"mixed batch with an empty item", 12, 4, 128, 8, {{33, 17}, {0, 50}, {1, 900}, {5, 0}}},
  };
  for (DType dtype : kKvDtypes) {
    for (const AttentionCase& c : cases) run_attention_case(*this, *gpu_, *ref_, rng_, c, dtype);
  }
}

TEST_F(CudaOpsTest, AttentionRejectsUnsupportedShapes) {
  PagedCache cache(rng_, 1, 4, 1, 512);
  AttentionItem item{0, 1, 0, cache.device_view()};
  EXPECT_EQ(gpu_->attention(nullptr, &item, 1, 2, nullptr).code(), StatusCode::kUnimplemented);
  PagedCache cache2(rng_, 1, 4, 3, 64);
  AttentionItem item2{0, 1, 0, cache2.device_view()};
  EXPECT_EQ(gpu_->attention(nullptr, &item2, 1, 4, nullptr).code(), StatusCode::kInvalidArgument);
  AttentionItem item3{0, 5, 0, cache2.device_view()};  // beyond capacity 4
  EXPECT_EQ(gpu_->attention(nullptr, &item3, 1, 3, nullptr).code(), StatusCode::kOutOfRange);
  // One KV dtype per batch (the kernels are instantiated per element type), f32 / f16 / bf16 only.
  PagedCache f32(rng_, 1, 4, 1, 64, DType::kF32);
  PagedCache bf16(rng_, 1, 4, 1, 64, DType::kBF16);
  AttentionItem mixed[2] = {{0, 1, 0, f32.device_view()}, {1, 1, 0, bf16.device_view()}};
  Status s = gpu_->attention(nullptr, mixed, 2, 2, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("items[1].kv.dtype"), std::string::npos) << s.to_string();
  KvLayerView q8 = f32.device_view();
  q8.dtype = DType::kQ8_0;
  AttentionItem not_kv{0, 1, 0, q8};
  EXPECT_EQ(gpu_->attention(nullptr, &not_kv, 1, 2, nullptr).code(), StatusCode::kInvalidArgument);
  s = gpu_->kv_append(nullptr, nullptr, 1, 0, q8);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("kv.dtype is q8_0"), std::string::npos) << s.to_string();
  sync();
  EXPECT_TRUE(f32.matches_host());  // nothing was enqueued
}

// Several decode steps of one layer (rope, kv_append, attention) queued back to back with no
// synchronisation in between: checks that the reuse of scratch memory (metadata, rope table) is
// correctly ordered on the stream. All inputs are uploaded before the first op is queued.
TEST_F(CudaOpsTest, QueuedOpsWithoutSynchronisation) {
  const int64_t page_size = 16, kv_heads = 2, head_dim = 64, n_heads = 4;
  for (DType dtype : kKvDtypes) {
    SCOPED_TRACE(dtype_str(dtype));
    PagedCache cache(rng_, 8, page_size, kv_heads, head_dim, dtype);
    const RopeParams params = make_params(head_dim, RopeStyle::kHalf, 10000.0, 1.0f);
    struct Step {
      int64_t n_tokens, pos;
      std::vector<float> q, k, v;
      std::vector<int64_t> positions;
      std::unique_ptr<Guarded<float>> d_q, d_k, d_v, d_out;
      std::unique_ptr<Guarded<int64_t>> d_pos;
    };
    std::vector<Step> steps;
    int64_t pos = 0;
    for (int i = 0; i < 6; ++i) {
      Step st;
      st.n_tokens = i == 0 ? 20 : 1;
      st.pos = pos;
      st.q = random_floats(rng_, static_cast<size_t>(st.n_tokens * n_heads * head_dim));
      st.k = random_floats(rng_, static_cast<size_t>(st.n_tokens * kv_heads * head_dim));
      st.v = random_floats(rng_, st.k.size());
      st.positions.resize(static_cast<size_t>(st.n_tokens));
      std::iota(st.positions.begin(), st.positions.end(), pos);
      st.d_q = std::make_unique<Guarded<float>>(st.q);
      st.d_k = std::make_unique<Guarded<float>>(st.k);
      st.d_v = std::make_unique<Guarded<float>>(st.v);
      st.d_out = std::make_unique<Guarded<float>>(st.q.size());
      st.d_pos = std::make_unique<Guarded<int64_t>>(st.positions);
      pos += st.n_tokens;
      steps.push_back(std::move(st));
    }
    const KvLayerView dview = cache.device_view();
    for (Step& st : steps) {
      ASSERT_TRUE(gpu_->rope(st.d_q->data(), st.n_tokens, n_heads, st.d_pos->data(), params).is_ok());
      ASSERT_TRUE(gpu_->rope(st.d_k->data(), st.n_tokens, kv_heads, st.d_pos->data(), params).is_ok());
      ASSERT_TRUE(gpu_->kv_append(st.d_k->data(), st.d_v->data(), st.n_tokens, st.pos, dview).is_ok());
      AttentionItem item{0, st.n_tokens, st.pos, dview};
      ASSERT_TRUE(gpu_->attention(st.d_q->data(), &item, 1, n_heads, st.d_out->data()).is_ok());
    }
    std::vector<std::vector<float>> want;
    for (Step& st : steps) {
      ASSERT_TRUE(ref_->rope(st.q.data(), st.n_tokens, n_heads, st.positions.data(), params).is_ok());
      ASSERT_TRUE(ref_->rope(st.k.data(), st.n_tokens, kv_heads, st.positions.data(), params).is_ok());
      ASSERT_TRUE(ref_->kv_append(st.k.data(), st.v.data(), st.n_tokens, st.pos, cache.host_view()).is_ok());
      AttentionItem item{0, st.n_tokens, st.pos, cache.host_view()};
      want.emplace_back(st.q.size());
      ASSERT_TRUE(ref_->attention(st.q.data(), &item, 1, n_heads, want.back().data()).is_ok());
    }
    sync();
    for (size_t i = 0; i < steps.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i));
      EXPECT_TRUE(close(steps[i].d_out->download(), want[i], 1e-4));
      EXPECT_TRUE(steps[i].d_out->guards_intact());
    }
    // The appended keys went through RoPE, whose device result may differ from the host's in the
    // last f32 bits (rope's tolerance is 1e-5), and rounding to a 2-byte type can carry such a
    // difference across a rounding boundary now and then: keys compare as values, V (not
    // rotated) bit for bit.
    const std::vector<uint8_t> got_k = cache.dev_k->download();
    std::vector<float> got(got_k.size() / dtype_size(dtype)), wanted(got.size());
    convert_to_f32(dtype, got_k.data(), got.data(), got.size());
    convert_to_f32(dtype, cache.host_k.data(), wanted.data(), wanted.size());
    EXPECT_TRUE(close(got, wanted, dtype == DType::kF32 ? 1e-5 : 1e-3));
    EXPECT_TRUE(same_bytes(cache.dev_v->download(), cache.host_v));
    EXPECT_TRUE(cache.dev_k->guards_intact());
    EXPECT_TRUE(cache.dev_v->guards_intact());
  }
}

// ---- sparse decode: kv_gather and attention_sparse over working sets ----

// A working set ([kv_heads][slots][head_dim] K and V of `dtype` elements) on the host and on the
// device, identical at creation. `offset` elements of padding (kPadByte) before the device data
// make it misaligned (the element-wise gather path). Slots beyond counts[h] hold NaN unless
// `fill` says otherwise.
struct DeviceWorkingSet {
  static constexpr uint8_t kPadByte = 0x5a;
  int64_t kv_heads, slots, head_dim, offset;
  DType dtype;
  std::vector<uint8_t> host_k, host_v;
  std::vector<int32_t> counts;
  std::unique_ptr<Guarded<uint8_t>> dev_k, dev_v;

  DeviceWorkingSet(int64_t kvh, int64_t n_slots, int64_t hd,
                   float fill = std::numeric_limits<float>::quiet_NaN(), int64_t pad = 0,
                   DType t = DType::kF32)
      : kv_heads(kvh),
        slots(n_slots),
        head_dim(hd),
        offset(pad),
        dtype(t),
        host_k(kv_bytes(std::vector<float>(static_cast<size_t>(kvh * n_slots * hd), fill), t)),
        host_v(host_k),
        counts(static_cast<size_t>(kvh), 0) {
    upload();
  }
  size_t pad_bytes() const { return static_cast<size_t>(offset) * dtype_size(dtype); }
  // Writes count rows of K and V (count · head_dim elements each, as bytes) at slot 0 of head h.
  void set_rows(int64_t h, const std::vector<uint8_t>& k, const std::vector<uint8_t>& v) {
    const size_t at = static_cast<size_t>(h * slots * head_dim) * dtype_size(dtype);
    std::copy(k.begin(), k.end(), host_k.begin() + static_cast<std::ptrdiff_t>(at));
    std::copy(v.begin(), v.end(), host_v.begin() + static_cast<std::ptrdiff_t>(at));
  }
  // (Re)creates the device copy from the host arrays.
  void upload() {
    std::vector<uint8_t> k(pad_bytes(), kPadByte), v(pad_bytes(), kPadByte);
    k.insert(k.end(), host_k.begin(), host_k.end());
    v.insert(v.end(), host_v.begin(), host_v.end());
    dev_k = std::make_unique<Guarded<uint8_t>>(k);
    dev_v = std::make_unique<Guarded<uint8_t>>(v);
  }
  WorkingSetView host_view() {
    return {host_k.data(), host_v.data(), kv_heads, slots, head_dim, counts.data(), dtype};
  }
  WorkingSetView device_view() {
    return {dev_k->data() + pad_bytes(),
            dev_v->data() + pad_bytes(),
            kv_heads,
            slots,
            head_dim,
            counts.data(),
            dtype};
  }
  // Device contents (padding included) must equal the host mirror bit for bit.
  ::testing::AssertionResult matches_host() const {
    const std::vector<uint8_t> k = dev_k->download();
    const std::vector<uint8_t> v = dev_v->download();
    const auto data = [&](const std::vector<uint8_t>& d) {
      return std::vector<uint8_t>(d.begin() + static_cast<std::ptrdiff_t>(pad_bytes()), d.end());
    };
    ::testing::AssertionResult same_k = same_bytes(data(k), host_k);
    if (!same_k) return ::testing::AssertionFailure() << "K: " << same_k.message();
    ::testing::AssertionResult same_v = same_bytes(data(v), host_v);
    if (!same_v) return ::testing::AssertionFailure() << "V: " << same_v.message();
    for (size_t i = 0; i < pad_bytes(); ++i) {
      if (k[i] != kPadByte || v[i] != kPadByte) {
        return ::testing::AssertionFailure() << "padding before the working set written";
      }
    }
    if (!dev_k->guards_intact() || !dev_v->guards_intact()) return ::testing::AssertionFailure() << "guards";
    return ::testing::AssertionSuccess();
  }
};

// Random entries with distinct destinations: about 3/4 of all (head, slot) pairs, tokens in [0, length).
std::vector<GatherEntry> random_entries(std::mt19937& rng, int64_t kv_heads, int64_t slots, int64_t length) {
  std::vector<GatherEntry> entries;
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t s = 0; s < slots; ++s) {
      if (uniform(rng, 0, 3) == 0) continue;
      entries.push_back({static_cast<int32_t>(h), static_cast<int32_t>(uniform(rng, 0, length - 1)),
                         static_cast<int32_t>(s)});
    }
  }
  std::shuffle(entries.begin(), entries.end(), rng);
  return entries;
}

// Every copy path of every dtype: 16-byte units (rows of a multiple of 16 bytes, aligned) and
// element units (other row sizes, or a working set one element off).
TEST_F(CudaOpsTest, KvGatherMatchesReferenceBitExactly) {
  for (DType dtype : kKvDtypes) {
    const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
    int vec_cases = 0;
    int element_cases = 0;
    for (int64_t head_dim : {4, 6, 8, 64, 128, 256}) {
      for (int64_t pad : {0, 1}) {
        const int64_t page_size = pick(rng_, {1, 5, 16});
        const int64_t kv_heads = pick(rng_, {1, 2, 8});
        const int64_t n_pages = uniform(rng_, 1, 20);
        const int64_t slots = uniform(rng_, 1, 80);
        SCOPED_TRACE(dtype_str(dtype) + " page_size " + std::to_string(page_size) + " kv_heads " +
                     std::to_string(kv_heads) + " head_dim " + std::to_string(head_dim) + " pad " +
                     std::to_string(pad));
        PagedCache cache(rng_, n_pages, page_size, kv_heads, head_dim, dtype);
        DeviceWorkingSet ws(kv_heads, slots, head_dim, 3.0f, pad, dtype);
        const std::vector<GatherEntry> entries = random_entries(rng_, kv_heads, slots, n_pages * page_size);
        const int64_t n = static_cast<int64_t>(entries.size());
        if (n == 0) continue;
        // The path the backend takes (its planner's decision): count both.
        auto plan = plan_kv_gather(cache.device_view(), entries.data(), n, ws.device_view());
        ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
        EXPECT_EQ(plan->launch.vec16, pad == 0 && head_dim * elem % 16 == 0);
        (plan->launch.vec16 ? vec_cases : element_cases) += 1;
        const Status s = gpu_->kv_gather(cache.device_view(), entries.data(), n, ws.device_view());
        ASSERT_TRUE(s.is_ok()) << s.to_string();
        ASSERT_TRUE(ref_->kv_gather(cache.host_view(), entries.data(), n, ws.host_view()).is_ok());
        sync();
        EXPECT_TRUE(ws.matches_host());     // copied rows exact, other slots still 3.0, guards intact
        EXPECT_TRUE(cache.matches_host());  // the cache is only read
      }
    }
    EXPECT_GE(vec_cases, 3) << dtype_str(dtype);
    EXPECT_GE(element_cases, 6) << dtype_str(dtype);
  }
}

struct SparseCase {
  const char* name;
  int64_t n_heads, kv_heads, head_dim;
  std::vector<std::pair<int64_t, int64_t>> items;  // (n_tokens, slots); counts are random
};

// Random per-head counts (0, slots, or between), random K/V in the counted slots, NaN beyond.
void run_sparse_case(CudaOpsTest& t, Backend& gpu, Backend& ref, std::mt19937& rng, const SparseCase& c,
                     DType dtype) {
  SCOPED_TRACE(std::string(c.name) + ", " + dtype_str(dtype));
  std::vector<std::unique_ptr<DeviceWorkingSet>> sets;
  std::vector<SparseAttentionItem> host_items, dev_items;
  int64_t total_rows = 0;
  for (const auto& [n_tokens, slots] : c.items) total_rows += n_tokens;
  int64_t next_row = total_rows;  // reverse order: rows are not in item order
  for (const auto& [n_tokens, slots] : c.items) {
    sets.push_back(std::make_unique<DeviceWorkingSet>(c.kv_heads, slots, c.head_dim,
                                                      std::numeric_limits<float>::quiet_NaN(), 0, dtype));
    DeviceWorkingSet& ws = *sets.back();
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      const int64_t which = uniform(rng, 0, 3);
      const int64_t count = which == 0 ? 0 : which == 1 ? slots : uniform(rng, 0, slots);
      ws.counts[static_cast<size_t>(h)] = static_cast<int32_t>(count);
      const size_t elems = static_cast<size_t>(count * c.head_dim);
      ws.set_rows(h, random_kv(rng, elems, dtype, -2.0f, 2.0f), random_kv(rng, elems, dtype));
    }
    ws.upload();
    next_row -= n_tokens;
    host_items.push_back({next_row, n_tokens, ws.host_view()});
    dev_items.push_back({next_row, n_tokens, ws.device_view()});
  }
  const size_t q_size = static_cast<size_t>(total_rows * c.n_heads * c.head_dim);
  const std::vector<float> q = random_floats(rng, q_size);
  Guarded<float> d_q(q);
  Guarded<float> d_out(q_size);
  const int64_t n_items = static_cast<int64_t>(dev_items.size());
  const Status s = gpu.attention_sparse(d_q.data(), dev_items.data(), n_items, c.n_heads, d_out.data());
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  std::vector<float> want(q_size);
  ASSERT_TRUE(ref.attention_sparse(q.data(), host_items.data(), n_items, c.n_heads, want.data()).is_ok());
  t.sync();
  const std::vector<float> got = d_out.download();
  EXPECT_TRUE(close(got, want, 1e-4));
  EXPECT_TRUE(d_out.guards_intact());
  for (size_t i = 0; i < q_size; ++i) {
    if (want[i] == 0.0f) {
      ASSERT_EQ(got[i], 0.0f) << "element " << i << " of an empty working set";
    }
  }
  for (const auto& ws : sets) EXPECT_TRUE(ws->matches_host());  // the working sets are only read
}

// Every instance of the sparse partial kernel (dims per lane 2 / 4 / 8, queries per warp 1 / 2 / 4),
// split and unsplit, empty heads and items, for each KV dtype.
TEST_F(CudaOpsTest, AttentionSparseMatchesReference) {
  std::vector<SparseCase> cases = {
      {"gqa 8/2 decode batch (head_dim 128, 2 queries per warp)",
       8,
       2,
       128,
       {{1, 300}, {2, 64}, {1, 1}, {1, 2048}}},
      {"mqa 8/1, split (head_dim 64, 4 queries per warp)", 8, 1, 64, {{1, 3000}, {2, 900}}},
      {"mha 4/4, head_dim 8", 4, 4, 8, {{2, 100}, {1, 0}, {1, 700}}},
      {"head_dim 256, 2 rows (4 queries per warp)", 16, 2, 256, {{2, 1500}, {1, 40}}},
      {"head_dim 80, an empty item", 6, 3, 80, {{1, 600}, {0, 20}, {1, 33}}},
      {"head_dim 64, 2 queries per warp", 16, 2, 64, {{1, 1200}}},
      {"head_dim 128, 4 queries per warp", 8, 2, 128, {{4, 500}, {1, 2000}}},
      {"head_dim 256, 1 query per warp", 4, 1, 256, {{1, 2000}}},
      {"head_dim 256, 2 queries per warp", 8, 1, 256, {{1, 1000}, {1, 64}}},
  };
  SparseCase many{"gqa 32/8, 16 sequences (enough blocks: no split)", 32, 8, 128, {}};
  for (int i = 0; i < 16; ++i) many.items.push_back({1, i < 8 ? 512 : 256});
  cases.push_back(many);
  for (DType dtype : kKvDtypes) {
    for (const SparseCase& c : cases) run_sparse_case(*this, *gpu_, *ref_, rng_, c, dtype);
  }
}

// B = length: gather every token [0, L) into shuffled slots on the device; sparse attention of a
// decode row equals the device's and the reference's dense attention at position L - 1.
TEST_F(CudaOpsTest, SparseWithFullBudgetEqualsDense) {
  const int64_t n_heads = 8, kv_heads = 2, head_dim = 128, page_size = 16;
  const std::vector<int64_t> lengths = {1, 37, 1000, 2500};
  for (DType dtype : kKvDtypes) {
    SCOPED_TRACE(dtype_str(dtype));
    std::vector<std::unique_ptr<PagedCache>> caches;
    std::vector<std::unique_ptr<DeviceWorkingSet>> sets;
    std::vector<AttentionItem> dense_dev, dense_host;
    std::vector<SparseAttentionItem> sparse_dev;
    for (size_t i = 0; i < lengths.size(); ++i) {
      const int64_t len = lengths[i];
      caches.push_back(std::make_unique<PagedCache>(rng_, (len + page_size - 1) / page_size, page_size,
                                                    kv_heads, head_dim, dtype));
      sets.push_back(std::make_unique<DeviceWorkingSet>(kv_heads, len + 5, head_dim,
                                                        std::numeric_limits<float>::quiet_NaN(), 0, dtype));
      std::vector<GatherEntry> entries;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::vector<int32_t> slot_of(static_cast<size_t>(len));
        std::iota(slot_of.begin(), slot_of.end(), 0);
        std::shuffle(slot_of.begin(), slot_of.end(), rng_);
        for (int64_t tok = 0; tok < len; ++tok) {
          entries.push_back(
              {static_cast<int32_t>(h), static_cast<int32_t>(tok), slot_of[static_cast<size_t>(tok)]});
        }
        sets.back()->counts[static_cast<size_t>(h)] = static_cast<int32_t>(len);
      }
      ASSERT_TRUE(gpu_->kv_gather(caches.back()->device_view(), entries.data(),
                                  static_cast<int64_t>(entries.size()), sets.back()->device_view())
                      .is_ok());
      const int64_t row = static_cast<int64_t>(i);
      dense_dev.push_back({row, 1, len - 1, caches.back()->device_view()});
      dense_host.push_back({row, 1, len - 1, caches.back()->host_view()});
      sparse_dev.push_back({row, 1, sets.back()->device_view()});
    }
    const int64_t n = static_cast<int64_t>(lengths.size());
    const std::vector<float> q = random_floats(rng_, static_cast<size_t>(n * n_heads * head_dim));
    Guarded<float> d_q(q);
    Guarded<float> d_sparse(q.size());
    Guarded<float> d_dense(q.size());
    ASSERT_TRUE(gpu_->attention_sparse(d_q.data(), sparse_dev.data(), n, n_heads, d_sparse.data()).is_ok());
    ASSERT_TRUE(gpu_->attention(d_q.data(), dense_dev.data(), n, n_heads, d_dense.data()).is_ok());
    std::vector<float> want(q.size());
    ASSERT_TRUE(ref_->attention(q.data(), dense_host.data(), n, n_heads, want.data()).is_ok());
    sync();
    EXPECT_TRUE(close(d_sparse.download(), want, 1e-4));
    EXPECT_TRUE(close(d_sparse.download(), d_dense.download(), 1e-4));
  }
}

// attention_indexed (device-homed layers: the selection read where the pages are) against the
// reference, every KV dtype and instance family (head_dim 64 / 128 / 256, 1-4 queries per warp,
// split and unsplit), counts 0 .. stride, indices ascending or shuffled; and against the device's
// own kv_gather + attention_sparse over the same selection in slot order. The host index and count
// arrays are overwritten right after the call (the backend must have copied them).
TEST_F(CudaOpsTest, AttentionIndexedMatchesReference) {
  struct IndexedCase {
    const char* name;
    int64_t n_heads, kv_heads, head_dim;
    std::vector<int64_t> lengths;  // per item (1 row, the last 2 rows)
    int64_t stride;
  };
  const std::vector<IndexedCase> cases = {
      {"gqa 8/2, head_dim 128, batch", 8, 2, 128, {300, 64, 2048, 40}, 256},
      {"mqa 8/1, head_dim 64, split", 8, 1, 64, {3000, 900}, 2048},
      {"head_dim 256, 2 rows", 16, 2, 256, {1500, 40}, 1024},
      {"mha 4/4, head_dim 8", 4, 4, 8, {700, 100}, 96},
  };
  const int64_t page_size = 16;
  for (DType dtype : kKvDtypes) {
    for (const IndexedCase& c : cases) {
      SCOPED_TRACE(std::string(c.name) + ", " + dtype_str(dtype));
      std::vector<std::unique_ptr<PagedCache>> caches;
      std::vector<std::unique_ptr<DeviceWorkingSet>> sets;
      std::vector<std::vector<int32_t>> indices, counts;
      std::vector<IndexedAttentionItem> dev_items, host_items;
      std::vector<SparseAttentionItem> ws_items;
      int64_t rows = 0;
      for (size_t i = 0; i < c.lengths.size(); ++i) {
        const int64_t len = c.lengths[i];
        caches.push_back(std::make_unique<PagedCache>(rng_, (len + page_size - 1) / page_size, page_size,
                                                      c.kv_heads, c.head_dim, dtype));
        sets.push_back(std::make_unique<DeviceWorkingSet>(c.kv_heads, c.stride, c.head_dim,
                                                          std::numeric_limits<float>::quiet_NaN(), 0, dtype));
        std::vector<int32_t> idx(static_cast<size_t>(c.kv_heads * c.stride), 0), cnt;
        std::vector<GatherEntry> entries;
        for (int64_t h = 0; h < c.kv_heads; ++h) {
          std::vector<int32_t> all(static_cast<size_t>(len));
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin(), all.end(), rng_);
          const int64_t most = std::min(c.stride, len);
          const int64_t which = uniform(rng_, 0, 3);
          const int64_t n = i == 0 && h == 0 ? 0 : which == 0 ? most : uniform(rng_, 0, most);
          all.resize(static_cast<size_t>(n));
          if (h % 2 == 0) std::sort(all.begin(), all.end());
          for (int64_t j = 0; j < n; ++j) {
            idx[static_cast<size_t>(h * c.stride + j)] = all[static_cast<size_t>(j)];
            entries.push_back({static_cast<int32_t>(h), all[static_cast<size_t>(j)], static_cast<int32_t>(j)});
          }
          cnt.push_back(static_cast<int32_t>(n));
          sets.back()->counts[static_cast<size_t>(h)] = static_cast<int32_t>(n);
        }
        ASSERT_TRUE(gpu_->kv_gather(caches.back()->device_view(), entries.data(),
                                    static_cast<int64_t>(entries.size()), sets.back()->device_view())
                        .is_ok());
        indices.push_back(std::move(idx));
        counts.push_back(std::move(cnt));
        const int64_t n_tokens = i + 1 == c.lengths.size() ? 2 : 1;
        dev_items.push_back({rows, n_tokens, caches.back()->device_view(), indices.back().data(),
                             counts.back().data(), c.stride});
        host_items.push_back({rows, n_tokens, caches.back()->host_view(), indices.back().data(),
                              counts.back().data(), c.stride});
        ws_items.push_back({rows, n_tokens, sets.back()->device_view()});
        rows += n_tokens;
      }
      const int64_t n = static_cast<int64_t>(dev_items.size());
      const std::vector<float> q = random_floats(rng_, static_cast<size_t>(rows * c.n_heads * c.head_dim));
      Guarded<float> d_q(q);
      Guarded<float> d_out(q.size());
      Guarded<float> d_ws(q.size());
      std::vector<float> want(q.size());
      ASSERT_TRUE(ref_->attention_indexed(q.data(), host_items.data(), n, c.n_heads, want.data()).is_ok());
      const Status st = gpu_->attention_indexed(d_q.data(), dev_items.data(), n, c.n_heads, d_out.data());
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      for (auto& idx : indices) std::fill(idx.begin(), idx.end(), -7);  // copied already
      ASSERT_TRUE(gpu_->attention_sparse(d_q.data(), ws_items.data(), n, c.n_heads, d_ws.data()).is_ok());
      sync();
      const std::vector<float> got = d_out.download();
      EXPECT_TRUE(close(got, want, 1e-4));
      EXPECT_TRUE(close(got, d_ws.download(), 1e-4));
      EXPECT_TRUE(d_out.guards_intact());
      for (size_t e = 0; e < got.size(); ++e) {
        if (want[e] == 0.0f) {
          ASSERT_EQ(got[e], 0.0f) << "element " << e << " of an empty head";
        }
      }
    }
  }
}

// Decode steps queued without synchronisation: each refills part of the working set in place
// (kv_gather) and attends over it with new counts. Entries and counts are host arrays that the
// test overwrites right after each call, so this also checks that the backend copied them.
TEST_F(CudaOpsTest, QueuedGatherAndSparseAttention) {
  const int64_t n_heads = 8, kv_heads = 2, head_dim = 64, page_size = 16, slots = 96, length = 500;
  for (DType dtype : kKvDtypes) {
    SCOPED_TRACE(dtype_str(dtype));
    PagedCache cache(rng_, (length + page_size - 1) / page_size, page_size, kv_heads, head_dim, dtype);
    DeviceWorkingSet ws(kv_heads, slots, head_dim, 0.0f, 0, dtype);
    std::vector<std::vector<float>> host_q, want;
    std::vector<std::unique_ptr<Guarded<float>>> d_q, d_out;
    for (int step = 0; step < 6; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      std::vector<GatherEntry> entries = random_entries(rng_, kv_heads, slots, length);
      const int64_t n = static_cast<int64_t>(entries.size());
      for (int32_t& c : ws.counts) c = static_cast<int32_t>(uniform(rng_, 1, slots));
      host_q.push_back(random_floats(rng_, static_cast<size_t>(n_heads * head_dim)));
      d_q.push_back(std::make_unique<Guarded<float>>(host_q.back()));
      d_out.push_back(std::make_unique<Guarded<float>>(host_q.back().size()));
      ASSERT_TRUE(gpu_->kv_gather(cache.device_view(), entries.data(), n, ws.device_view()).is_ok());
      SparseAttentionItem dev_item{0, 1, ws.device_view()};
      ASSERT_TRUE(
          gpu_->attention_sparse(d_q.back()->data(), &dev_item, 1, n_heads, d_out.back()->data()).is_ok());
      // The host mirror (reference) follows the same steps.
      ASSERT_TRUE(ref_->kv_gather(cache.host_view(), entries.data(), n, ws.host_view()).is_ok());
      SparseAttentionItem host_item{0, 1, ws.host_view()};
      want.emplace_back(host_q.back().size());
      ASSERT_TRUE(
          ref_->attention_sparse(host_q.back().data(), &host_item, 1, n_heads, want.back().data()).is_ok());
      std::fill(entries.begin(), entries.end(), GatherEntry{0, 0, 0});  // the backend must have copied them
      for (int32_t& c : ws.counts) c = 0;
    }
    sync();
    for (size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i));
      EXPECT_TRUE(close(d_out[i]->download(), want[i], 1e-4));
      EXPECT_TRUE(d_out[i]->guards_intact());
    }
    EXPECT_TRUE(ws.matches_host());
  }
}

TEST_F(CudaOpsTest, SparseOpsRejectBadArguments) {
  EXPECT_TRUE(gpu_->supports(BackendOp::kKvGather, DType::kF32));
  EXPECT_TRUE(gpu_->supports(BackendOp::kAttentionSparse, DType::kF32));
  PagedCache cache(rng_, 2, 4, 2, 8);  // capacity 8
  DeviceWorkingSet ws(2, 4, 8, 1.0f);
  const GatherEntry beyond{0, 8, 0};
  EXPECT_EQ(gpu_->kv_gather(cache.device_view(), &beyond, 1, ws.device_view()).code(),
            StatusCode::kInvalidArgument);
  const GatherEntry bad_slot{0, 0, 4};
  EXPECT_EQ(gpu_->kv_gather(cache.device_view(), &bad_slot, 1, ws.device_view()).code(),
            StatusCode::kInvalidArgument);
  ws.counts = {5, 0};
  SparseAttentionItem item{0, 1, ws.device_view()};
  EXPECT_EQ(gpu_->attention_sparse(nullptr, &item, 1, 4, nullptr).code(), StatusCode::kInvalidArgument);
  ws.counts = {1, 1};
  EXPECT_EQ(gpu_->attention_sparse(nullptr, &item, 1, 3, nullptr).code(), StatusCode::kInvalidArgument);
  DeviceWorkingSet wide(1, 2, 512, 1.0f);
  wide.counts = {1};
  SparseAttentionItem wide_item{0, 1, wide.device_view()};
  EXPECT_EQ(gpu_->attention_sparse(nullptr, &wide_item, 1, 1, nullptr).code(), StatusCode::kUnimplemented);
  // Dtypes: the working set holds the cache's; one dtype per sparse batch; f32 / f16 / bf16 only.
  DeviceWorkingSet bf16(2, 4, 8, 1.0f, 0, DType::kBF16);
  bf16.counts = {1, 1};
  const GatherEntry fine{0, 0, 0};
  Status s = gpu_->kv_gather(cache.device_view(), &fine, 1, bf16.device_view());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("ws.dtype bf16 differs from kv.dtype f32"), std::string::npos) << s.to_string();
  SparseAttentionItem mixed[2] = {{0, 1, ws.device_view()}, {1, 1, bf16.device_view()}};
  s = gpu_->attention_sparse(nullptr, mixed, 2, 4, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("items[1].ws.dtype"), std::string::npos) << s.to_string();
  SparseAttentionItem not_kv{0, 1, ws.device_view()};
  not_kv.ws.dtype = DType::kI32;
  EXPECT_EQ(gpu_->attention_sparse(nullptr, &not_kv, 1, 4, nullptr).code(), StatusCode::kInvalidArgument);
  sync();
  EXPECT_TRUE(ws.matches_host());  // nothing was enqueued
  EXPECT_TRUE(bf16.matches_host());
}

}  // namespace
}  // namespace specontext::gpu
