// CpuBackend::matmul and embed on block-type weights (GGUF Q8_0, Q4_0, Q4_K, Q5_K, Q6_K kept as
// stored): random-weight matrices from write_random_gguf, each type against
// - m <= 16 (decode, small batches): quant_gemv's scalar reference (QuantPath::kScalar), the
//   oracle tests/cpu/quant_gemv_test.cc checks against ggml's semantics; the backend runs the
//   best SIMD path split over its threads, which forms the same integer block sums and differs
//   only in float summation order: rel-L2 < 1e-5.
// - m > 16 (prefill): ReferenceBackend (double accumulation) on the dequantised f32 matrix; the
//   backend dequantises tiles of rows and multiplies them in f32 (oneDNN): rel-L2 < 1e-5. Shapes
//   give several tiles and a short last one (rows 2304 of 256 columns: tiles of 2048 rows; 256 rows
//   of 2304 columns: tiles of 224).
// - embed: the dequantised rows, bit for bit.
// - dequantize_rows (cpu/quant_dequant.h, the tiles' decoder): ggml_dequantize's values bit for
//   bit, on random blocks (any code, any sub-block scale).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/model/ggml_quants.h"
#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "cpu/quant_dequant.h"
#include "cpu/quant_gemv.h"
#include "cpu/reference_backend.h"
#include "tests/cpu/cpu_test_util.h"
#include "tests/tests_common.h"

namespace specontext::cpu {
namespace {

using testing::make_cpu;
using testing::random_floats;
using testing::rel_l2;

constexpr DType kBlockTypes[] = {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};

// The same random file loaded twice: blocks kept, and dequantised to f32.
struct Pair {
  std::shared_ptr<Model> kept, plain;
};
Pair load_pair(DType t) {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.dim = 256;
  c.hidden_dim = 2304;
  c.n_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.head_dim = 64;
  c.vocab_size = 40;
  c.max_seq_len = 64;
  const std::string path = specontext::testing::temp_dir("quantized_matmul") + "/m.gguf";
  EXPECT_TRUE(write_random_gguf(path, c, t, 3).is_ok());
  auto kept = load_model(path, LoadOptions{.keep_quantized = true});
  auto plain = load_model(path);
  EXPECT_TRUE(kept.is_ok() && plain.is_ok());
  return {*kept, *plain};
}

std::vector<float> run_matmul(Backend& b, const std::vector<float>& x, int64_t m, const WeightMatrix& w,
                              const float* bias) {
  testing::GuardedBuffer y(static_cast<size_t>(m * w.rows), -1.0f);
  const Status s = b.matmul(x.data(), m, w, bias, y.data());
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(y.intact()) << "matmul wrote outside y";
  return std::vector<float>(y.data(), y.data() + y.size());
}

TEST(QuantizedMatmul, SmallBatchesMatchQuantGemvsScalarReference) {
  auto cpu = make_cpu(CpuBackendOptions{.num_threads = 2});
  ASSERT_NE(cpu, nullptr);
  for (DType t : kBlockTypes) {
    const Pair p = load_pair(t);
    for (const WeightMatrix* w : {&p.kept->layers[0].w_gate, &p.kept->layers[0].w_down}) {
      const std::vector<float> bias = random_floats(static_cast<size_t>(w->rows), 5);
      for (int64_t m : {1, 3, 16}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " " + std::to_string(w->rows) + "x" + std::to_string(w->cols) +
                     " m=" + std::to_string(m));
        const std::vector<float> x = random_floats(static_cast<size_t>(m * w->cols), 11 + static_cast<uint32_t>(m));
        const std::vector<float> got = run_matmul(*cpu, x, m, *w, bias.data());
        EXPECT_EQ(cpu->matmul_path(t).rfind("quant_gemv:", 0), 0u) << cpu->matmul_path(t);
        std::vector<float> want(static_cast<size_t>(m * w->rows));
        const QuantMatrix q{*ggml_block_type_id(t), w->rows, w->cols, w->data};
        ASSERT_TRUE(quant_gemv(q, x.data(), m, want.data(), {QuantPath::kScalar, false}).is_ok());
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t r = 0; r < w->rows; ++r) want[static_cast<size_t>(i * w->rows + r)] += bias[static_cast<size_t>(r)];
        }
        EXPECT_LT(rel_l2(got.data(), want.data(), want.size()), 1e-5);
      }
    }
  }
}

TEST(QuantizedMatmul, LargeBatchesMatchTheReferenceOnTheDequantisedMatrix) {
  auto cpu = make_cpu(CpuBackendOptions{.num_threads = 2});
  ASSERT_NE(cpu, nullptr);
  ReferenceBackend ref;
  for (DType t : kBlockTypes) {
    const Pair p = load_pair(t);
    const LayerWeights& kl = p.kept->layers[0];
    const LayerWeights& pl = p.plain->layers[0];
    for (auto [kw, pw] : {std::pair{&kl.w_gate, &pl.w_gate}, std::pair{&kl.w_down, &pl.w_down}}) {
      const std::vector<float> bias = random_floats(static_cast<size_t>(kw->rows), 6);
      for (int64_t m : {17, 40}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " " + std::to_string(kw->rows) + "x" + std::to_string(kw->cols) +
                     " m=" + std::to_string(m));
        const std::vector<float> x = random_floats(static_cast<size_t>(m * kw->cols), 21 + static_cast<uint32_t>(m));
        const std::vector<float> got = run_matmul(*cpu, x, m, *kw, bias.data());
        EXPECT_EQ(cpu->matmul_path(t).rfind("dequantised-tiles+", 0), 0u) << cpu->matmul_path(t);
        const std::vector<float> want = run_matmul(ref, x, m, *pw, bias.data());
        EXPECT_LT(rel_l2(got.data(), want.data(), want.size()), 1e-5);
        const std::vector<float> no_bias = run_matmul(*cpu, x, m, *kw, nullptr);
        const std::vector<float> want_no_bias = run_matmul(ref, x, m, *pw, nullptr);
        EXPECT_LT(rel_l2(no_bias.data(), want_no_bias.data(), want_no_bias.size()), 1e-5);
      }
    }
  }
}

TEST(QuantizedMatmul, EmbedDequantisesTheRowsAskedFor) {
  auto cpu = make_cpu(CpuBackendOptions{.num_threads = 2});
  ASSERT_NE(cpu, nullptr);
  for (DType t : kBlockTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Pair p = load_pair(t);
    const WeightMatrix& table = p.kept->tok_embeddings;
    ASSERT_EQ(table.dtype, t);
    const std::vector<TokenId> ids = {0, 39, 7, 7, 20};
    std::vector<float> got(ids.size() * static_cast<size_t>(table.cols), -1.0f);
    ASSERT_TRUE(cpu->embed(ids.data(), static_cast<int64_t>(ids.size()), table, got.data()).is_ok());
    const auto* want = static_cast<const float*>(p.plain->tok_embeddings.data);
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(std::memcmp(got.data() + i * static_cast<size_t>(table.cols),
                            want + static_cast<size_t>(ids[i] * table.cols), static_cast<size_t>(table.cols) * 4),
                0)
          << "row " << ids[i];
    }
    const TokenId bad = 40;
    EXPECT_EQ(cpu->embed(&bad, 1, table, got.data()).code(), StatusCode::kOutOfRange);
  }
}

TEST(QuantizedMatmul, DequantizeRowsIsGgmlDequantizeBitForBit) {
  for (DType t : kBlockTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const Pair p = load_pair(t);
    const WeightMatrix& w = p.kept->layers[0].w_down;  // 256 rows of 2304: 9 K-blocks or 72 32-blocks a row
    const uint32_t id = *ggml_block_type_id(t);
    std::vector<float> got(static_cast<size_t>(w.rows * w.cols), -1.0f), want(got.size());
    ASSERT_TRUE(dequantize_rows(id, w.data, w.rows, w.cols, got.data()).is_ok());
    ASSERT_TRUE(ggml_dequantize(id, w.data, want.data(), w.rows * w.cols).is_ok());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0);
    // Row 5 alone lands where it belongs.
    std::vector<float> row(static_cast<size_t>(w.cols));
    ASSERT_TRUE(dequantize_rows(id, static_cast<const uint8_t*>(w.data) + 5 * w.row_bytes(), 1, w.cols, row.data())
                    .is_ok());
    EXPECT_EQ(std::memcmp(row.data(), want.data() + 5 * w.cols, row.size() * 4), 0);
    EXPECT_EQ(dequantize_rows(id, w.data, 1, w.cols + 1, row.data()).code(), StatusCode::kInvalidArgument);
  }
  float out[32];
  const uint8_t blk[34] = {};
  EXPECT_EQ(dequantize_rows(3 /* Q4_1 */, blk, 1, 32, out).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dequantize_rows(8, nullptr, 1, 32, out).code(), StatusCode::kInvalidArgument);
}

TEST(QuantizedMatmul, TheReferenceBackendRefusesBlockTypes) {
  ReferenceBackend ref;
  const Pair p = load_pair(DType::kQ8_0);
  const WeightMatrix& w = p.kept->layers[0].wq;
  EXPECT_FALSE(ref.supports(BackendOp::kMatmul, DType::kQ8_0));
  EXPECT_FALSE(ref.supports(BackendOp::kEmbed, DType::kQ8_0));
  std::vector<float> x(static_cast<size_t>(w.cols), 1.0f), y(static_cast<size_t>(w.rows));
  EXPECT_EQ(ref.matmul(x.data(), 1, w, nullptr, y.data()).code(), StatusCode::kUnimplemented);
  const TokenId id = 0;
  EXPECT_EQ(ref.embed(&id, 1, p.kept->tok_embeddings, y.data()).code(), StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace specontext::cpu
