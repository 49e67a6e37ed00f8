// CudaBackend::matmul and embed with weights as stored (gpu/kernels_quant.cu) against the CPU:
// - block types Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, m in {1, 3, 16}: the GEMV kernel on activations
//   quantised on the device against cpu::quant_gemv's scalar reference (the same activation
//   quantisation, exact integer block sums; the float scale products and summation order differ):
//   |diff| <= 1e-5 · Σ|x|·|w| per element, as the CPU's SIMD paths are held to. Random blocks with
//   f16 scales in [0.002, 0.02], rows of 256, 288 (padded to whole blocks) and 4096 columns, 67 and
//   1000 rows (not multiples of the 4 rows a GEMV block takes), with and without bias;
// - the device's quantised activations equal ggml's reference quantisers bit for bit (codes and
//   scales; a block holding a NaN or an infinity gets a NaN scale);
// - m in {17, 40} (dequantised tiles + cuBLAS f32), two tiles and a short last one: rel-L2 < 1e-5
//   against the reference backend on the dequantised f32 matrix;
// - embed of block-type tables: ggml_dequantize's rows bit for bit; an id out of range a NaN row;
// - bf16 weights, m in {1, 3, 16} (launch_bf16_gemv, 16-byte and 2-byte loads): |diff| <= 1e-5 ·
//   Σ|bf16(x)|·|w| against a double-precision sum of bf16(x) · w;
// - an engine on a random Q4_K GGUF file keeps the blocks on the device (imported bytes = the
//   matrices' stored bytes) and its logits match the CPU engine's (which runs quant_gemv) within
//   rel-L2 1e-4 for a prefill and 8 greedy steps.
// Every output sits between guard regions whose sentinel bytes must survive; outputs must be
// finite and mostly non-zero. Without a device every case skips ("no CUDA device").
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "cpu/cpu_backend.h"
#include "gpu/cuda_backend.h"
#include "gpu/kernels.h"
#include "tests/gpu/device_test_util.h"
#include "tests/gpu/quant_test_util.h"
#include "tests/tests_common.h"

namespace specontext::gpu {
namespace {

using device_test::close;
using device_test::Guarded;
using namespace quant_test;

class CudaQuantTest : public device_test::BackendTest {
 protected:
  // y [m][n] of the CUDA backend for x [m][k] and a matrix of `bytes` (device copies here).
  std::vector<float> gpu_matmul(DType t, const std::vector<uint8_t>& bytes, int64_t n, int64_t k,
                                const std::vector<float>& x, int64_t m, const std::vector<float>* bias) {
    Guarded<uint8_t> d_w(bytes);
    Guarded<float> d_x(x);
    Guarded<float> d_y(static_cast<size_t>(m * n));
    std::unique_ptr<Guarded<float>> d_bias;
    if (bias != nullptr) d_bias = std::make_unique<Guarded<float>>(*bias);
    const Status s = gpu_->matmul(d_x.data(), m, WeightMatrix{t, n, k, d_w.data()},
                                  d_bias ? d_bias->data() : nullptr, d_y.data());
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    sync();
    EXPECT_TRUE(d_y.guards_intact()) << "matmul wrote outside y";
    EXPECT_EQ(d_x.download(), x) << "matmul changed x";
    return d_y.download();
  }
};

TEST_F(CudaQuantTest, GemvMatchesTheScalarReferenceForEveryBlockType) {
  struct Shape {
    int64_t n, k;
  };
  for (DType t : kBlockTypes) {
    for (const Shape& sh : {Shape{67, 256}, Shape{67, 288}, Shape{1000, 4096}}) {
      for (int64_t m : {1, 3, 16}) {
        const bool with_bias = m == 3;
        SCOPED_TRACE(std::string(dtype_name(t)) + " " + std::to_string(sh.n) + "x" + std::to_string(sh.k) +
                     " m=" + std::to_string(m) + (with_bias ? " +bias" : ""));
        const uint32_t seed = static_cast<uint32_t>(ggml_id(t) * 7919 + sh.k + m);
        const std::vector<uint8_t> w = random_matrix(t, sh.n, sh.k, seed);
        const std::vector<float> x = random_floats(static_cast<size_t>(m * sh.k), seed + 1);
        const std::vector<float> bias = random_floats(static_cast<size_t>(sh.n), seed + 2);
        const std::vector<float> got = gpu_matmul(t, w, sh.n, sh.k, x, m, with_bias ? &bias : nullptr);
        std::vector<float> want = cpu_reference(t, w, sh.n, sh.k, x, m);
        std::vector<double> bound = abs_bound(x, dequantise(t, w, sh.n, sh.k), m, sh.n, sh.k);
        if (with_bias) {
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t r = 0; r < sh.n; ++r) {
              want[static_cast<size_t>(i * sh.n + r)] += bias[static_cast<size_t>(r)];
              bound[static_cast<size_t>(i * sh.n + r)] += std::fabs(bias[static_cast<size_t>(r)]);
            }
          }
        }
        EXPECT_TRUE(within_bound(got, want, bound, 1e-5));
      }
    }
  }
}

TEST_F(CudaQuantTest, DeviceActivationQuantisationIsGgmlsBitForBit) {
  for (DType t : {DType::kQ8_0, DType::kQ4_K}) {  // the two activation formats: Q8_0 and Q8_K blocks
    for (int64_t k : {256, 300, 4096}) {
      constexpr int64_t kM = 5;
      SCOPED_TRACE(std::string(dtype_name(t)) + " k=" + std::to_string(k));
      std::vector<float> x = random_floats(static_cast<size_t>(kM * k), static_cast<uint32_t>(k + ggml_id(t)), -3.0f, 3.0f);
      for (int64_t j = 0; j < k; ++j) x[static_cast<size_t>(k + j)] = 0.0f;  // an all-zero row
      x[static_cast<size_t>(2 * k + 7)] = std::numeric_limits<float>::quiet_NaN();
      x[static_cast<size_t>(3 * k + k - 1)] = std::numeric_limits<float>::infinity();
      x[static_cast<size_t>(4 * k + 3)] = 3.0f;  // ties of the largest magnitude: the first one wins
      x[static_cast<size_t>(4 * k + 9)] = -3.0f;
      const Activations want = quantize(t, x, kM, k);
      const int64_t nb = blocks_per_row(t, k);
      Guarded<float> d_x(x);
      Guarded<int8_t> d_q(want.q.size());
      Guarded<float> d_d(want.d.size());
      ASSERT_EQ(kernels::launch_quantize_activations(quant_type(t), d_x.data(), kM, k, nb, d_q.data(), d_d.data(),
                                                     gpu_->stream()),
                cudaSuccess);
      sync();
      EXPECT_TRUE(d_q.guards_intact());
      EXPECT_TRUE(d_d.guards_intact());
      EXPECT_EQ(d_q.download(), want.q);
      const std::vector<float> got_d = d_d.download();
      for (size_t b = 0; b < want.d.size(); ++b) {
        if (std::isnan(want.d[b])) {
          EXPECT_TRUE(std::isnan(got_d[b])) << "block " << b;
        } else {
          EXPECT_EQ(std::memcmp(&got_d[b], &want.d[b], 4), 0) << "block " << b << ": " << got_d[b] << " vs " << want.d[b];
        }
      }
    }
  }
}

TEST_F(CudaQuantTest, ANonFiniteActivationRowGivesNanOnlyInThatRow) {
  for (DType t : kBlockTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    constexpr int64_t kN = 67, kK = 512, kM = 3;
    const std::vector<uint8_t> w = random_matrix(t, kN, kK, 99);
    std::vector<float> x = random_floats(static_cast<size_t>(kM * kK), 98);
    x[static_cast<size_t>(kK + 100)] = std::numeric_limits<float>::quiet_NaN();
    const std::vector<float> got = gpu_matmul(t, w, kN, kK, x, kM, nullptr);
    for (int64_t r = 0; r < kN; ++r) {
      EXPECT_TRUE(std::isfinite(got[static_cast<size_t>(r)])) << r;
      EXPECT_TRUE(std::isnan(got[static_cast<size_t>(kN + r)])) << r;
      EXPECT_TRUE(std::isfinite(got[static_cast<size_t>(2 * kN + r)])) << r;
    }
  }
}

TEST_F(CudaQuantTest, LargeBatchesMatchTheReferenceOnTheDequantisedMatrix) {
  struct Shape {
    int64_t n, k;
  };
  // 2100 x 4096: two tiles of 2048 rows and a short last one of 52 (kDequantTileMaxFloats / 4096).
  for (DType t : kBlockTypes) {
    for (const Shape& sh : {Shape{67, 512}, Shape{2100, 4096}}) {
      for (int64_t m : {17, 40}) {
        if (sh.n > 1000 && m == 40) continue;  // the reference's double loops: keep the run short
        const bool with_bias = m == 17;
        SCOPED_TRACE(std::string(dtype_name(t)) + " " + std::to_string(sh.n) + "x" + std::to_string(sh.k) +
                     " m=" + std::to_string(m));
        const uint32_t seed = static_cast<uint32_t>(ggml_id(t) * 31 + sh.n + m);
        const std::vector<uint8_t> w = random_matrix(t, sh.n, sh.k, seed);
        const std::vector<float> x = random_floats(static_cast<size_t>(m * sh.k), seed + 1);
        const std::vector<float> bias = random_floats(static_cast<size_t>(sh.n), seed + 2);
        const std::vector<float> got = gpu_matmul(t, w, sh.n, sh.k, x, m, with_bias ? &bias : nullptr);
        const std::vector<float> wf = dequantise(t, w, sh.n, sh.k);
        std::vector<float> want(static_cast<size_t>(m * sh.n));
        ASSERT_TRUE(ref_->matmul(x.data(), m, WeightMatrix{DType::kF32, sh.n, sh.k, wf.data()},
                                 with_bias ? bias.data() : nullptr, want.data())
                        .is_ok());
        EXPECT_TRUE(close(got, want, 1e-5));
      }
    }
  }
}

TEST_F(CudaQuantTest, EmbedDecodesBlockRowsBitForBit) {
  for (DType t : kBlockTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    constexpr int64_t kVocab = 37, kCols = 512;
    const std::vector<uint8_t> table = random_matrix(t, kVocab, kCols, 5 + ggml_id(t));
    const std::vector<float> rows = dequantise(t, table, kVocab, kCols);
    const std::vector<int32_t> ids = {0, 36, 5, 5, 17, 37, -1, 2};
    Guarded<uint8_t> d_table(table);
    Guarded<int32_t> d_ids(ids);
    Guarded<float> d_out(ids.size() * kCols);
    const Status s = gpu_->embed(d_ids.data(), static_cast<int64_t>(ids.size()),
                                 WeightMatrix{t, kVocab, kCols, d_table.data()}, d_out.data());
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    sync();
    EXPECT_TRUE(d_out.guards_intact());
    const std::vector<float> got = d_out.download();
    for (size_t i = 0; i < ids.size(); ++i) {
      const float* g = got.data() + i * kCols;
      if (ids[i] < 0 || ids[i] >= kVocab) {
        for (int64_t c = 0; c < kCols; ++c) ASSERT_TRUE(std::isnan(g[c])) << "id " << ids[i] << " col " << c;
        continue;
      }
      EXPECT_EQ(std::memcmp(g, rows.data() + ids[i] * kCols, kCols * sizeof(float)), 0) << "id " << ids[i];
    }
  }
}

TEST_F(CudaQuantTest, Bf16GemvMatchesTheSumOfRoundedProducts) {
  struct Shape {
    int64_t n, k;
    bool offset_x;  // x one float past a 16-byte boundary (the rounding pass reads it as it is)
  };
  // cols % 8 != 0 (100, 4100): 2-byte loads; 4096 and 512: 16-byte loads.
  for (const Shape& sh : {Shape{67, 100, false}, Shape{67, 4100, false}, Shape{1000, 4096, false}, Shape{67, 512, true}}) {
    for (int64_t m : {1, 3, 16}) {
      SCOPED_TRACE(std::to_string(sh.n) + "x" + std::to_string(sh.k) + " m=" + std::to_string(m) +
                   (sh.offset_x ? " unaligned x" : ""));
      const uint32_t seed = static_cast<uint32_t>(sh.k * 3 + m);
      const std::vector<float> w32 = random_floats(static_cast<size_t>(sh.n * sh.k), seed, -0.1f, 0.1f);
      const std::vector<float> x = random_floats(static_cast<size_t>(m * sh.k), seed + 1);
      std::vector<uint16_t> wb(w32.size());
      for (size_t i = 0; i < w32.size(); ++i) wb[i] = f32_to_bf16(w32[i]);
      std::vector<float> want(static_cast<size_t>(m * sh.n));
      std::vector<double> bound(want.size());
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t r = 0; r < sh.n; ++r) {
          double s = 0.0, b = 0.0;
          for (int64_t j = 0; j < sh.k; ++j) {
            const double p = double(bf16_to_f32(f32_to_bf16(x[i * sh.k + j]))) * bf16_to_f32(wb[r * sh.k + j]);
            s += p;
            b += std::fabs(p);
          }
          want[static_cast<size_t>(i * sh.n + r)] = static_cast<float>(s);
          bound[static_cast<size_t>(i * sh.n + r)] = b;
        }
      }
      Guarded<uint16_t> d_w(wb);
      std::vector<float> x_padded(x.size() + 1, 0.0f);
      std::memcpy(x_padded.data() + (sh.offset_x ? 1 : 0), x.data(), x.size() * sizeof(float));
      Guarded<float> d_x(x_padded);
      Guarded<float> d_y(want.size());
      const Status s = gpu_->matmul(d_x.data() + (sh.offset_x ? 1 : 0), m, WeightMatrix{DType::kBF16, sh.n, sh.k, d_w.data()},
                                    nullptr, d_y.data());
      ASSERT_TRUE(s.is_ok()) << s.to_string();
      sync();
      EXPECT_TRUE(d_y.guards_intact());
      EXPECT_TRUE(within_bound(d_y.download(), want, bound, 1e-5));
    }
  }
}

TEST_F(CudaQuantTest, AnEngineOnAQ4KFileKeepsTheBlocksAndMatchesTheCpuEngine) {
  const ModelConfig c = gguf_test_config();
  const std::string path = specontext::testing::temp_dir("cuda_quant") + "/q4k.gguf";
  ASSERT_TRUE(write_random_gguf(path, c, DType::kQ4_K, 21).is_ok());
  auto loaded = load_model(path, LoadOptions{.keep_quantized = true});
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  std::shared_ptr<const Model> model = *loaded;
  size_t matrix_bytes = 0;
  for (const WeightMatrix* w : model->matrices()) {
    ASSERT_EQ(w->dtype, DType::kQ4_K);
    matrix_bytes += w->bytes();
  }
  auto cpu = cpu::create_cpu_backend(cpu::CpuBackendOptions{});
  ASSERT_TRUE(cpu.is_ok()) << cpu.status().to_string();
  std::shared_ptr<Backend> cpu_backend(std::move(*cpu));
  CudaBackend* cuda_raw = gpu_.get();
  std::shared_ptr<Backend> cuda_backend(std::move(gpu_));
  EngineOptions o;
  o.max_sequences = 1;
  o.max_context = 64;
  auto ce = Engine::create(model, cpu_backend, o);
  ASSERT_TRUE(ce.is_ok()) << ce.status().to_string();
  auto ge = Engine::create(model, cuda_backend, o);
  ASSERT_TRUE(ge.is_ok()) << ge.status().to_string();
  // The matrices uploaded as stored (tied embeddings once), plus the f32 norm vectors.
  const size_t imported = cuda_raw->imported_weight_bytes();
  EXPECT_GE(imported, matrix_bytes);
  EXPECT_LE(imported, matrix_bytes + (size_t{64} << 10)) << "more than the stored blocks and the norms on the device";
  auto sc = (*ce)->memory().add_sequence();
  auto sg = (*ge)->memory().add_sequence();
  ASSERT_TRUE(sc.is_ok() && sg.is_ok());
  std::vector<TokenId> in_c = {1, 17, 300, 42, 5, 99, 256, 7, 8, 400, 3, 11};
  std::vector<TokenId> in_g = in_c;
  for (int step = 0; step <= 8; ++step) {
    const std::vector<StepRequest> rc = {StepRequest{*sc, in_c, LogitsMode::kLast}};
    const std::vector<StepRequest> rg = {StepRequest{*sg, in_g, LogitsMode::kLast}};
    auto oc = (*ce)->forward(rc);
    ASSERT_TRUE(oc.is_ok()) << oc.status().to_string();
    auto og = (*ge)->forward(rg);
    ASSERT_TRUE(og.is_ok()) << og.status().to_string();
    const auto want_row = oc->row(0);
    const auto got_row = og->row(0);
    const std::vector<float> want(want_row.begin(), want_row.end());
    const std::vector<float> got(got_row.begin(), got_row.end());
    EXPECT_TRUE(close(got, want, 1e-4)) << "step " << step << " (0 = prefill of 12 tokens)";
    const TokenId next = static_cast<TokenId>(std::max_element(want.begin(), want.end()) - want.begin());
    in_c = {next};
    in_g = {next};  // the CPU's token on both: the comparison continues past a near-tie
  }
}

}  // namespace
}  // namespace specontext::gpu
