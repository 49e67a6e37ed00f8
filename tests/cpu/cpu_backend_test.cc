// CpuBackend against ReferenceBackend on randomised shapes, for every op but attention (see
// attention_test.cc). Outputs live in guarded buffers; every comparison also checks finiteness
// and that the oracle's output is not trivially zero.
#include "cpu/cpu_backend.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/numa.h"
#include "cpu/reference_backend.h"
#include "tests/cpu/cpu_test_util.h"

namespace specontext::cpu {
namespace {

using testing::expect_close;
using testing::GuardedBuffer;
using testing::make_cpu;
using testing::PagedKv;
using testing::random_floats;

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}
std::vector<float> round_bf16(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(f32_to_bf16(v[i]));
  return out;
}

// ------------------------------------------------------------------------------------------
// Factory

TEST(CpuBackendFactory, ReferenceSwitchAndEnv) {
  unsetenv("SPECONTEXT_CPU_REFERENCE");
  auto def = create_cpu_backend({});
  ASSERT_TRUE(def.is_ok()) << def.status().to_string();
  EXPECT_EQ((*def)->name(), "cpu");
  CpuBackendOptions ref_opt;
  ref_opt.reference = true;
  auto ref = create_cpu_backend(ref_opt);
  ASSERT_TRUE(ref.is_ok());
  EXPECT_EQ((*ref)->name(), "cpu-reference");
  setenv("SPECONTEXT_CPU_REFERENCE", "1", 1);
  auto forced = create_cpu_backend({});
  unsetenv("SPECONTEXT_CPU_REFERENCE");
  ASSERT_TRUE(forced.is_ok());
  EXPECT_EQ((*forced)->name(), "cpu-reference");
}

TEST(CpuBackendFactory, ThreadsAndNodeOptions) {
  CpuBackendOptions one;
  one.num_threads = 1;
  auto b1 = make_cpu(one);
  ASSERT_NE(b1, nullptr);
  EXPECT_EQ(b1->num_threads(), 1);
  auto all = make_cpu({});
  ASSERT_NE(all, nullptr);
  EXPECT_GE(all->num_threads(), 1);
  EXPECT_GE(all->numa_node(), 0);  // -1 resolves to the caller's node
  auto topo = system_topology();
  ASSERT_TRUE(topo.is_ok());
  EXPECT_LT(all->numa_node(), (*topo)->num_numa_nodes());
  CpuBackendOptions node0;
  node0.numa_node = 0;
  auto b0 = make_cpu(node0);
  ASSERT_NE(b0, nullptr);
  EXPECT_EQ(b0->numa_node(), 0);
  EXPECT_GE(b0->num_threads(), 1);
  CpuBackendOptions bad_node;
  bad_node.numa_node = 4096;
  EXPECT_EQ(CpuBackend::create(bad_node).status().code(), StatusCode::kInvalidArgument);
  CpuBackendOptions bad_threads;
  bad_threads.num_threads = -2;
  EXPECT_EQ(CpuBackend::create(bad_threads).status().code(), StatusCode::kInvalidArgument);
}

TEST(CpuBackendFactory, Supports) {
  auto b = make_cpu();
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(b->supports(BackendOp::kMatmul, DType::kF32));
  EXPECT_TRUE(b->supports(BackendOp::kMatmul, DType::kBF16));
  EXPECT_FALSE(b->supports(BackendOp::kMatmul, DType::kF16));
  EXPECT_FALSE(b->supports(BackendOp::kMatmul, DType::kI32));
  // The block types quant_gemv reads (tests/cpu/quantized_matmul_test.cc).
  for (DType t : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
    EXPECT_TRUE(b->supports(BackendOp::kMatmul, t)) << dtype_name(t);
    EXPECT_TRUE(b->supports(BackendOp::kEmbed, t)) << dtype_name(t);
  }
  EXPECT_TRUE(b->supports(BackendOp::kEmbed, DType::kF16));
  EXPECT_TRUE(b->supports(BackendOp::kAttention, DType::kF32));
}

// ------------------------------------------------------------------------------------------
// Matmul

struct MatmulShape {
  int64_t m, k, n;
};
const MatmulShape kShapes[] = {{1, 1, 1},      {1, 3, 5},      {3, 172, 7},   {5, 172, 172},  {1, 288, 768},
                               {16, 288, 512}, {17, 768, 288}, {2, 1000, 33}, {64, 256, 384}, {1, 2048, 96}};

class MatmulTest : public ::testing::TestWithParam<std::tuple<bool, bool>> {};  // fallback, bias

TEST_P(MatmulTest, F32MatchesReference) {
  const auto [fallback, with_bias] = GetParam();
  CpuBackendOptions opt;
  opt.force_matmul_fallback = fallback;
  auto cpu = make_cpu(opt);
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  uint32_t seed = 1;
  for (const auto& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "m=" << s.m << " k=" << s.k << " n=" << s.n);
    const auto x = random_floats(static_cast<size_t>(s.m * s.k), seed++);
    const auto w = random_floats(static_cast<size_t>(s.n * s.k), seed++);
    const auto bias = random_floats(static_cast<size_t>(s.n), seed++);
    const WeightMatrix wm{DType::kF32, s.n, s.k, w.data()};
    const float* b = with_bias ? bias.data() : nullptr;
    GuardedBuffer want(static_cast<size_t>(s.m * s.n)), got(static_cast<size_t>(s.m * s.n));
    ASSERT_TRUE(ref.matmul(x.data(), s.m, wm, b, want.data()).is_ok());
    ASSERT_TRUE(cpu->matmul(x.data(), s.m, wm, b, got.data()).is_ok());
    expect_close(got.data(), want.data(), got.size(), 1e-5, "matmul f32");
    EXPECT_TRUE(got.intact()) << "matmul wrote outside y";
  }
  const std::string path = cpu->matmul_path(DType::kF32);
  if (fallback) {
    EXPECT_EQ(path, "fallback");
  } else {
    EXPECT_EQ(path.rfind("onednn:", 0), 0u) << path;  // oneDNN always has an f32 matmul
  }
}

// Small f32 batches take the row loop (it reads each weight row once for all inputs), one row
// and larger batches take oneDNN; all of them match the reference above.
TEST(CpuBackend, SmallF32BatchesTakeTheRowLoop) {
  auto cpu = make_cpu({});
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  for (const auto& [m, want_path] : {std::pair<int64_t, std::string>{1, "onednn:"}, {2, "rows:small-batch"},
                                     {8, "rows:small-batch"}, {9, "onednn:"}}) {
    SCOPED_TRACE("m=" + std::to_string(m));
    const int64_t k = 96, n = 130;  // n not a multiple of 4: the tail rows too
    const auto x = random_floats(static_cast<size_t>(m * k), 3);
    const auto w = random_floats(static_cast<size_t>(n * k), 4);
    const WeightMatrix wm{DType::kF32, n, k, w.data()};
    GuardedBuffer want(static_cast<size_t>(m * n)), got(static_cast<size_t>(m * n));
    ASSERT_TRUE(ref.matmul(x.data(), m, wm, nullptr, want.data()).is_ok());
    ASSERT_TRUE(cpu->matmul(x.data(), m, wm, nullptr, got.data()).is_ok());
    expect_close(got.data(), want.data(), got.size(), 1e-5, "matmul f32");
    EXPECT_TRUE(got.intact());
    EXPECT_EQ(cpu->matmul_path(DType::kF32).rfind(want_path, 0), 0u) << cpu->matmul_path(DType::kF32);
  }
}

TEST_P(MatmulTest, Bf16MatchesReference) {
  const auto [fallback, with_bias] = GetParam();
  CpuBackendOptions opt;
  opt.force_matmul_fallback = fallback;
  auto cpu = make_cpu(opt);
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  uint32_t seed = 100;
  for (const auto& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "m=" << s.m << " k=" << s.k << " n=" << s.n);
    const auto x = random_floats(static_cast<size_t>(s.m * s.k), seed++);
    const auto w32 = random_floats(static_cast<size_t>(s.n * s.k), seed++);
    const auto bias = random_floats(static_cast<size_t>(s.n), seed++);
    const auto w16 = to_bf16(w32);
    const auto w_rounded = round_bf16(w32);
    const auto x_rounded = round_bf16(x);
    const float* b = with_bias ? bias.data() : nullptr;
    const size_t out_n = static_cast<size_t>(s.m * s.n);
    GuardedBuffer got(out_n), want_exact_w(out_n), want_rounded_x(out_n);
    ASSERT_TRUE(
        cpu->matmul(x.data(), s.m, WeightMatrix{DType::kBF16, s.n, s.k, w16.data()}, b, got.data()).is_ok());
    // Oracle 1: f32 maths on the bf16-rounded weights, x unrounded. oneDNN rounds x to bf16,
    // so only the bf16 tolerance applies.
    ASSERT_TRUE(ref.matmul(x.data(), s.m, WeightMatrix{DType::kF32, s.n, s.k, w_rounded.data()}, b,
                           want_exact_w.data())
                    .is_ok());
    expect_close(got.data(), want_exact_w.data(), out_n, 1e-2, "matmul bf16 vs f32 of bf16 weights");
    // Oracle 2: both inputs rounded, as both paths do (oneDNN's bf16 kernels and the fallback
    // loop round x to bf16); only the accumulation order differs.
    ASSERT_TRUE(ref.matmul(x_rounded.data(), s.m, WeightMatrix{DType::kF32, s.n, s.k, w_rounded.data()}, b,
                           want_rounded_x.data())
                    .is_ok());
    expect_close(got.data(), want_rounded_x.data(), out_n, 1e-5, "matmul bf16 vs rounded inputs");
    EXPECT_TRUE(got.intact()) << "matmul wrote outside y";
  }
  if (fallback) {
    EXPECT_EQ(cpu->matmul_path(DType::kBF16), "fallback");
  }
  std::printf("bf16 matmul path: %s\n", cpu->matmul_path(DType::kBF16).c_str());
}

INSTANTIATE_TEST_SUITE_P(Paths, MatmulTest, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "Fallback" : "OneDnn") +
                                  (std::get<1>(info.param) ? "Bias" : "NoBias");
                         });

TEST(CpuMatmul, CachedPrimitiveSeesNewBuffers) {
  // The second call with the same shape reuses the cached primitive; it must read the new x/W
  // and write the new y, not the first call's buffers.
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  // All buffers stay alive so that no round can get a previous round's addresses back.
  std::vector<std::vector<float>> xs, ws, biases;
  std::vector<std::unique_ptr<GuardedBuffer>> outs;
  for (int round = 0; round < 3; ++round) {
    xs.push_back(random_floats(4 * 64, 10 + round));
    ws.push_back(random_floats(48 * 64, 20 + round));
    biases.push_back(random_floats(48, 30 + round));
    outs.push_back(std::make_unique<GuardedBuffer>(4 * 48));
  }
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int round = 0; round < 3; ++round) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " round " << round);
      std::vector<uint16_t> w16 = to_bf16(ws[round]);
      std::vector<float> w_used = dtype == DType::kF32 ? ws[round] : round_bf16(ws[round]);
      const WeightMatrix wm = dtype == DType::kF32 ? WeightMatrix{DType::kF32, 48, 64, ws[round].data()}
                                                   : WeightMatrix{DType::kBF16, 48, 64, w16.data()};
      GuardedBuffer& got = *outs[round];
      GuardedBuffer want(4 * 48);
      ASSERT_TRUE(cpu->matmul(xs[round].data(), 4, wm, biases[round].data(), got.data()).is_ok());
      ASSERT_TRUE(ref.matmul(xs[round].data(), 4, WeightMatrix{DType::kF32, 48, 64, w_used.data()},
                             biases[round].data(), want.data())
                      .is_ok());
      expect_close(got.data(), want.data(), got.size(), dtype == DType::kF32 ? 1e-5 : 1e-2, "cached matmul");
      EXPECT_TRUE(got.intact());
    }
  }
}

TEST(CpuMatmul, SlicedOverManyThreadsMatchesReference) {
  // More threads than this machine may have: y is split into up to 7 column slices (with a
  // narrower tail) run as separate oneDNN primitives, written strided or staged and copied.
  CpuBackendOptions opt;
  opt.num_threads = 7;
  auto cpu = make_cpu(opt);
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  uint32_t seed = 900;
  for (const MatmulShape& s : {MatmulShape{1, 96, 500}, MatmulShape{2, 64, 129}, MatmulShape{16, 200, 1000},
                               MatmulShape{33, 128, 449}, MatmulShape{5, 172, 172}}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "m=" << s.m << " k=" << s.k << " n=" << s.n << " "
                                          << dtype_name(dtype) << (with_bias ? " bias" : ""));
        const auto x = random_floats(static_cast<size_t>(s.m * s.k), seed++);
        const auto w = random_floats(static_cast<size_t>(s.n * s.k), seed++);
        const auto bias = random_floats(static_cast<size_t>(s.n), seed++);
        const auto w16 = to_bf16(w);
        const auto w_used = dtype == DType::kF32 ? w : round_bf16(w);
        const auto x_used = dtype == DType::kF32 ? x : round_bf16(x);
        const WeightMatrix wm = dtype == DType::kF32 ? WeightMatrix{DType::kF32, s.n, s.k, w.data()}
                                                     : WeightMatrix{DType::kBF16, s.n, s.k, w16.data()};
        const float* b = with_bias ? bias.data() : nullptr;
        GuardedBuffer got(static_cast<size_t>(s.m * s.n)), want(static_cast<size_t>(s.m * s.n));
        ASSERT_TRUE(cpu->matmul(x.data(), s.m, wm, b, got.data()).is_ok());
        ASSERT_TRUE(
            ref.matmul(x_used.data(), s.m, WeightMatrix{DType::kF32, s.n, s.k, w_used.data()}, b, want.data())
                .is_ok());
        expect_close(got.data(), want.data(), got.size(), 1e-5, "sliced matmul");
        EXPECT_TRUE(got.intact());
      }
    }
  }
}

TEST(CpuMatmul, UnsupportedDtypesAndEmptyShapes) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  const uint16_t w[4] = {};
  float x[2] = {1, 2}, y[2] = {5, 5};
  EXPECT_EQ(cpu->matmul(x, 1, WeightMatrix{DType::kF16, 2, 2, w}, nullptr, y).code(),
            StatusCode::kUnimplemented);
  EXPECT_EQ(cpu->matmul(x, 1, WeightMatrix{DType::kI32, 2, 2, w}, nullptr, y).code(),
            StatusCode::kUnimplemented);
  EXPECT_TRUE(cpu->matmul(x, 0, WeightMatrix{DType::kF32, 2, 2, w}, nullptr, y).is_ok());
  EXPECT_EQ(y[0], 5.0f);  // m = 0 writes nothing
}

// ------------------------------------------------------------------------------------------
// Elementwise and row ops

TEST(CpuOps, EmbedMatchesReferenceAllDtypes) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  const int64_t vocab = 97, dim = 172;
  const auto table = random_floats(static_cast<size_t>(vocab * dim), 7);
  const auto t_bf16 = to_bf16(table);
  std::vector<uint16_t> t_f16(table.size());
  for (size_t i = 0; i < table.size(); ++i) t_f16[i] = f32_to_f16(table[i]);
  for (int64_t n : {1, 3, 64}) {
    std::vector<TokenId> ids(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<TokenId>((i * 37 + 5) % vocab);
    for (auto [dtype, data] : {std::pair<DType, const void*>{DType::kF32, table.data()},
                               {DType::kBF16, t_bf16.data()},
                               {DType::kF16, t_f16.data()}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n));
      const WeightMatrix wm{dtype, vocab, dim, data};
      GuardedBuffer got(static_cast<size_t>(n * dim)), want(static_cast<size_t>(n * dim));
      ASSERT_TRUE(cpu->embed(ids.data(), n, wm, got.data()).is_ok());
      ASSERT_TRUE(ref.embed(ids.data(), n, wm, want.data()).is_ok());
      expect_close(got.data(), want.data(), got.size(), 1e-12, "embed");  // exact conversion
      EXPECT_TRUE(got.intact());
    }
  }
  const TokenId bad[] = {0, -1};
  GuardedBuffer out(2 * dim);
  EXPECT_EQ(cpu->embed(bad, 2, WeightMatrix{DType::kF32, vocab, dim, table.data()}, out.data()).code(),
            StatusCode::kOutOfRange);
}

TEST(CpuOps, RmsNormMatchesReference) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  uint32_t seed = 300;
  for (int64_t rows : {1, 3, 64}) {
    for (int64_t dim : {1, 7, 172, 288, 4096}) {
      SCOPED_TRACE(::testing::Message() << "rows=" << rows << " dim=" << dim);
      const auto x = random_floats(static_cast<size_t>(rows * dim), seed++, -3.0f, 3.0f);
      const auto w = random_floats(static_cast<size_t>(dim), seed++, 0.5f, 1.5f);
      GuardedBuffer got(x.size()), want(x.size());
      ASSERT_TRUE(cpu->rmsnorm(x.data(), w.data(), rows, dim, 1e-5f, got.data()).is_ok());
      ASSERT_TRUE(ref.rmsnorm(x.data(), w.data(), rows, dim, 1e-5f, want.data()).is_ok());
      expect_close(got.data(), want.data(), got.size(), 1e-6, "rmsnorm");
      EXPECT_TRUE(got.intact());
      // In place (y aliases x).
      GuardedBuffer inplace(x.size());
      std::copy(x.begin(), x.end(), inplace.data());
      ASSERT_TRUE(cpu->rmsnorm(inplace.data(), w.data(), rows, dim, 1e-5f, inplace.data()).is_ok());
      expect_close(inplace.data(), want.data(), x.size(), 1e-6, "rmsnorm in place");
      EXPECT_TRUE(inplace.intact());
    }
  }
}

TEST(CpuOps, RopeMatchesReferenceBothStyles) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  uint32_t seed = 400;
  for (RopeStyle style : {RopeStyle::kInterleaved, RopeStyle::kHalf}) {
    for (int64_t head_dim : {2, 8, 64, 128}) {
      for (int64_t n_tokens : {1, 5, 40}) {
        SCOPED_TRACE(::testing::Message() << "style=" << static_cast<int>(style) << " head_dim=" << head_dim
                                          << " tokens=" << n_tokens);
        const int64_t n_heads = 6;
        RopeParams p;
        p.head_dim = head_dim;
        p.style = style;
        p.mscale = 1.25f;
        for (int64_t i = 0; i < head_dim / 2; ++i) {
          p.inv_freq.push_back(
              std::pow(10000.0f, -2.0f * static_cast<float>(i) / static_cast<float>(head_dim)));
        }
        std::vector<int64_t> pos(static_cast<size_t>(n_tokens));
        for (int64_t t = 0; t < n_tokens; ++t) pos[t] = (t * 7919 + 3) % 32768;  // up to 32K
        const auto x = random_floats(static_cast<size_t>(n_tokens * n_heads * head_dim), seed++);
        GuardedBuffer got(x.size()), want(x.size());
        std::copy(x.begin(), x.end(), got.data());
        std::copy(x.begin(), x.end(), want.data());
        ASSERT_TRUE(cpu->rope(got.data(), n_tokens, n_heads, pos.data(), p).is_ok());
        ASSERT_TRUE(ref.rope(want.data(), n_tokens, n_heads, pos.data(), p).is_ok());
        expect_close(got.data(), want.data(), x.size(), 1e-6, "rope");
        EXPECT_TRUE(got.intact());
        // Rotation preserves each pair's norm (times mscale): catches a wrong pairing in both.
        const double in_norm = testing::l2_norm(x.data(), x.size());
        EXPECT_NEAR(testing::l2_norm(got.data(), x.size()), in_norm * 1.25, in_norm * 1e-5);
      }
    }
  }
}

TEST(CpuOps, SwigluMatchesReference) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  uint32_t seed = 500;
  for (int64_t n : {1, 17, 172, 100003}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto gate = random_floats(static_cast<size_t>(n), seed++, -8.0f, 8.0f);
    if (n > 3) {  // saturation on both sides
      gate[0] = 100.0f;
      gate[1] = -100.0f;
      gate[2] = -88.5f;
    }
    const auto up = random_floats(static_cast<size_t>(n), seed++, -2.0f, 2.0f);
    GuardedBuffer got(gate.size()), want(gate.size());
    ASSERT_TRUE(cpu->swiglu(gate.data(), up.data(), n, got.data()).is_ok());
    ASSERT_TRUE(ref.swiglu(gate.data(), up.data(), n, want.data()).is_ok());
    expect_close(got.data(), want.data(), gate.size(), 1e-6, "swiglu");
    EXPECT_TRUE(got.intact());
    // out may alias gate.
    GuardedBuffer alias(gate.size());
    std::copy(gate.begin(), gate.end(), alias.data());
    ASSERT_TRUE(cpu->swiglu(alias.data(), up.data(), n, alias.data()).is_ok());
    expect_close(alias.data(), want.data(), gate.size(), 1e-6, "swiglu aliased");
  }
}

TEST(CpuOps, AddMatchesReference) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  for (int64_t n : {1, 3, 172, 300001}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const auto x = random_floats(static_cast<size_t>(n), 600 + static_cast<uint32_t>(n));
    const auto y = random_floats(static_cast<size_t>(n), 700 + static_cast<uint32_t>(n));
    GuardedBuffer got(x.size()), want(x.size());
    std::copy(x.begin(), x.end(), got.data());
    std::copy(x.begin(), x.end(), want.data());
    ASSERT_TRUE(cpu->add(got.data(), y.data(), n).is_ok());
    ASSERT_TRUE(ref.add(want.data(), y.data(), n).is_ok());
    expect_close(got.data(), want.data(), x.size(), 1e-12, "add");  // exact
    EXPECT_TRUE(got.intact());
  }
}

TEST(CpuOps, KvAppendMatchesReference) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  for (int64_t page_size : {1, 5, 16}) {
    for (auto [start, n] : {std::pair<int64_t, int64_t>{0, 1}, {3, 37}, {0, 64}, {40, 1}}) {
      SCOPED_TRACE(::testing::Message() << "page_size=" << page_size << " start=" << start << " n=" << n);
      const int64_t kv_heads = 3, head_dim = 8;
      const int64_t pages = (start + n + page_size - 1) / page_size + 1;
      PagedKv a(pages, page_size, kv_heads, head_dim, 1), b(pages, page_size, kv_heads, head_dim, 1);
      const auto k = random_floats(static_cast<size_t>(n * kv_heads * head_dim), 800);
      const auto v = random_floats(static_cast<size_t>(n * kv_heads * head_dim), 801);
      ASSERT_TRUE(cpu->kv_append(k.data(), v.data(), n, start, a.view).is_ok());
      ASSERT_TRUE(ref.kv_append(k.data(), v.data(), n, start, b.view).is_ok());
      for (int64_t p = 0; p < pages; ++p) {
        // Compare bit patterns: untouched slots are NaN in both and must stay NaN.
        ASSERT_EQ(0, std::memcmp(a.k_pages[p], b.k_pages[p], a.page_bytes())) << "page " << p;
        ASSERT_EQ(0, std::memcmp(a.v_pages[p], b.v_pages[p], a.page_bytes())) << "page " << p;
      }
      EXPECT_EQ(*a.k_at(start + n - 1, kv_heads - 1),
                k[static_cast<size_t>((n - 1) * kv_heads * head_dim + (kv_heads - 1) * head_dim)]);
      EXPECT_TRUE(std::isnan(*a.k_at(start + n, 0)));
      EXPECT_EQ(cpu->kv_append(k.data(), v.data(), n, pages * page_size - n + 1, a.view).code(),
                StatusCode::kOutOfRange);
    }
  }
}

}  // namespace
}  // namespace specontext::cpu
