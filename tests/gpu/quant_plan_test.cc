// The quantised-weight path of the CUDA backend checked without a GPU:
// - cuda_supports (CudaBackend::supports): matmul and embed take the five block types, so the
//   engine keeps such matrices as stored and import_weights uploads the file's bytes;
// - plan_quant_matmul: byte counts (rows · ceil(cols / block) · block bytes = WeightMatrix::bytes()
//   = GGUF's tensor bytes; a random GGUF file's matrices sum to ≥ 0.9 of its size), the GEMV's
//   activation scratch, the tiles of the m > 16 path, refusals;
// - a host mirror of launch_quant_gemv (the kernel's lane split and block strides, with the same
//   gpu/quant_blocks.h lane arithmetic and the warp's butterfly sum) on ggml's quantised
//   activations against cpu::quant_gemv's scalar reference: |diff| <= 1e-5 · Σ|x|·|w| per
//   element (the integer block sums are exact on both sides; the float scale products and the
//   summation order differ), every type, m in {1, 3, 16}, rows padded to whole blocks;
// - dequant_element (embed and the m > 16 tiles) against ggml_dequantize, bit for bit.
// The device tests (cuda_quant_test.cc) run the kernels themselves.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "gpu/quant_blocks.h"
#include "gpu/quant_plan.h"
#include "tests/gpu/quant_test_util.h"
#include "tests/tests_common.h"

namespace specontext::gpu {
namespace {

using namespace quant_test;
namespace kq = kernels::quant;

TEST(QuantPlan, CudaSupportsEveryStoredBlockTypeForMatmulAndEmbed) {
  for (DType t : kBlockTypes) {
    EXPECT_TRUE(cuda_supports(BackendOp::kMatmul, t)) << dtype_name(t);
    EXPECT_TRUE(cuda_supports(BackendOp::kEmbed, t)) << dtype_name(t);
    ASSERT_TRUE(quant_type_of(t).has_value());
    EXPECT_EQ(*quant_type_of(t), quant_type(t));
  }
  EXPECT_TRUE(cuda_supports(BackendOp::kMatmul, DType::kF32));
  EXPECT_TRUE(cuda_supports(BackendOp::kMatmul, DType::kBF16));
  EXPECT_FALSE(cuda_supports(BackendOp::kMatmul, DType::kF16));  // loaders convert f16
  EXPECT_TRUE(cuda_supports(BackendOp::kEmbed, DType::kF16));
  EXPECT_FALSE(quant_type_of(DType::kF32).has_value());
  EXPECT_FALSE(quant_type_of(DType::kBF16).has_value());
}

TEST(QuantPlan, BlockLayoutsAreGgmls) {
  for (DType t : kBlockTypes) {
    const GgmlTypeInfo* info = ggml_type_info(ggml_id(t));
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(kq::block_elems(quant_type(t)), info->block) << info->name;
    EXPECT_EQ(kq::block_bytes(quant_type(t)), info->bytes) << info->name;
    EXPECT_EQ(kq::block_elems(quant_type(t)), dtype_block_elements(t)) << info->name;
  }
}

TEST(QuantPlan, DeviceBytesAreTheStoredBytes) {
  alignas(16) static const uint8_t kDummy[16] = {};
  for (DType t : kBlockTypes) {
    for (int64_t cols : {256, 288, 4096, 11008}) {
      for (int64_t rows : {1, 67, 4096}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " " + std::to_string(rows) + "x" + std::to_string(cols));
        const WeightMatrix w{t, rows, cols, kDummy};
        auto p = plan_quant_matmul(w, 1);
        ASSERT_TRUE(p.is_ok()) << p.status().to_string();
        const GgmlTypeInfo* info = ggml_type_info(ggml_id(t));
        const int64_t nb = (cols + info->block - 1) / info->block;
        EXPECT_EQ(p->nb, nb);
        EXPECT_EQ(p->padded_cols, nb * info->block);
        EXPECT_EQ(p->row_bytes, nb * info->bytes);
        EXPECT_EQ(p->row_bytes, cpu::quant_row_bytes(ggml_id(t), cols));
        EXPECT_EQ(p->weight_bytes, static_cast<size_t>(rows * nb * info->bytes));
        EXPECT_EQ(p->weight_bytes, w.bytes());
      }
    }
  }
}

TEST(QuantPlan, ARandomGgufFilesMatricesAreHeldAsStored) {
  const ModelConfig c = gguf_test_config();
  for (DType t : kBlockTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const std::string path = specontext::testing::temp_dir("quant_plan") + "/m.gguf";
    ASSERT_TRUE(write_random_gguf(path, c, t, 5).is_ok());
    auto model = load_model(path, LoadOptions{.keep_quantized = true});
    ASSERT_TRUE(model.is_ok()) << model.status().to_string();
    size_t held = 0;
    for (const WeightMatrix* w : (*model)->matrices()) {
      ASSERT_EQ(w->dtype, t);
      ASSERT_TRUE(cuda_supports(BackendOp::kMatmul, w->dtype) && cuda_supports(BackendOp::kEmbed, w->dtype));
      alignas(16) static const uint8_t kDummy[16] = {};
      const WeightMatrix aligned{w->dtype, w->rows, w->cols, kDummy};  // a device copy is 256-byte aligned
      auto p = plan_quant_matmul(aligned, 1);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      EXPECT_EQ(p->weight_bytes, w->bytes());
      held += p->weight_bytes;
    }
    const auto file = std::filesystem::file_size(path);
    EXPECT_LE(held, file);
    EXPECT_GE(static_cast<double>(held), 0.9 * static_cast<double>(file)) << held << " of " << file << " bytes";
  }
}

TEST(QuantPlan, GemvScratchAndLargeBatchTiles) {
  alignas(16) static const uint8_t kDummy[16] = {};
  {
    const WeightMatrix w{DType::kQ4_K, 1000, 4096, kDummy};
    auto p = plan_quant_matmul(w, 16);
    ASSERT_TRUE(p.is_ok());
    EXPECT_TRUE(p->gemv);
    EXPECT_EQ(p->grid, (1000 + kernels::kQuantGemvWarps - 1) / kernels::kQuantGemvWarps);
    EXPECT_EQ(p->act_codes_bytes, size_t{16} * 4096);
    EXPECT_EQ(p->act_scales_offset % 256, 0u);
    EXPECT_GE(p->act_scales_offset, p->act_codes_bytes);
    EXPECT_EQ(p->scratch_bytes, p->act_scales_offset + size_t{16} * 16 * sizeof(float));
  }
  {
    const WeightMatrix w{DType::kQ8_0, 3000, 4096, kDummy};
    auto p = plan_quant_matmul(w, 17);
    ASSERT_TRUE(p.is_ok());
    EXPECT_FALSE(p->gemv);
    EXPECT_EQ(p->tile_rows, kDequantTileMaxFloats / 4096);
    EXPECT_EQ(p->tiles, (3000 + p->tile_rows - 1) / p->tile_rows);
    EXPECT_GE(p->tiles, 2);
    EXPECT_LE(p->tile_floats, static_cast<size_t>(kDequantTileMaxFloats));
    EXPECT_GE(p->tile_rows * p->tiles, 3000);
  }
  {  // a row wider than the tile budget: tiles of one row
    const WeightMatrix w{DType::kQ6_K, 3, kDequantTileMaxFloats + 256, kDummy};
    auto p = plan_quant_matmul(w, 32);
    ASSERT_TRUE(p.is_ok());
    EXPECT_EQ(p->tile_rows, 1);
    EXPECT_EQ(p->tiles, 3);
  }
  {  // small matrices: one tile of every row
    const WeightMatrix w{DType::kQ5_K, 10, 256, kDummy};
    auto p = plan_quant_matmul(w, 40);
    ASSERT_TRUE(p.is_ok());
    EXPECT_EQ(p->tile_rows, 10);
    EXPECT_EQ(p->tiles, 1);
  }
}

TEST(QuantPlan, Refusals) {
  alignas(16) static const uint8_t kDummy[16] = {};
  EXPECT_EQ(plan_quant_matmul(WeightMatrix{DType::kF32, 4, 4, kDummy}, 1).status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(plan_quant_matmul(WeightMatrix{DType::kF16, 4, 4, kDummy}, 1).status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(plan_quant_matmul(WeightMatrix{DType::kQ8_0, 4, 32, nullptr}, 1).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_quant_matmul(WeightMatrix{DType::kQ8_0, 4, 32, kDummy + 2}, 1).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_quant_matmul(WeightMatrix{DType::kQ8_0, 0, 32, kDummy}, 1).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_quant_matmul(WeightMatrix{DType::kQ8_0, 4, 32, kDummy}, 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_quant_matmul(WeightMatrix{DType::kQ4_K, int64_t{1} << 32, 256, kDummy}, 1).status().code(),
            StatusCode::kInvalidArgument);
}

// launch_quant_gemv's arithmetic on the host: warp per weight row; lane l takes the blocks
// l / lanes_per_block + j · (32 / lanes_per_block) as its share t = l % lanes_per_block; the lanes'
// float partials summed by the kernel's butterfly (xor 16, 8, 4, 2, 1), lane 0's result written.
std::vector<float> mirror_gemv(DType dt, const std::vector<uint8_t>& w, int64_t n, int64_t k, const Activations& act,
                               int64_t m) {
  const QuantType t = quant_type(dt);
  const int lanes = kq::lanes_per_block(t);
  const int step = 32 / lanes;
  const int64_t nb = blocks_per_row(dt, k);
  const int64_t rb = row_bytes(dt, k);
  const int64_t act_row = nb * kq::block_elems(t);
  std::vector<float> y(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < m; ++i) {
      float acc[32] = {};
      for (int lane = 0; lane < 32; ++lane) {
        for (int64_t b = lane / lanes; b < nb; b += step) {
          const kq::LaneWords L = kq::lane_words(t, w.data() + r * rb + b * kq::block_bytes(t), lane % lanes);
          acc[lane] += kq::lane_dot(L, act.q.data() + i * act_row + b * kq::block_elems(t), act.d[i * nb + b]);
        }
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        float next[32];
        for (int lane = 0; lane < 32; ++lane) next[lane] = acc[lane] + acc[lane ^ offset];
        std::memcpy(acc, next, sizeof(acc));
      }
      y[i * n + r] = acc[0];
    }
  }
  return y;
}

TEST(QuantPlan, HostMirrorOfTheGemvKernelMatchesTheScalarReference) {
  constexpr int64_t kRows = 67;
  for (DType t : kBlockTypes) {
    for (int64_t k : {256, 288, 2048}) {
      for (int64_t m : {1, 3, 16}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " k=" + std::to_string(k) + " m=" + std::to_string(m));
        const uint32_t seed = static_cast<uint32_t>(ggml_id(t) * 1000 + k + m);
        const std::vector<uint8_t> w = random_matrix(t, kRows, k, seed);
        const std::vector<float> x = random_floats(static_cast<size_t>(m * k), seed + 1);
        const std::vector<float> want = cpu_reference(t, w, kRows, k, x, m);
        const std::vector<float> got = mirror_gemv(t, w, kRows, k, quantize(t, x, m, k), m);
        EXPECT_TRUE(within_bound(got, want, abs_bound(x, dequantise(t, w, kRows, k), m, kRows, k), 1e-5));
      }
    }
  }
}

TEST(QuantPlan, DequantElementIsGgmlDequantizeBitForBit) {
  for (DType t : kBlockTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    constexpr int64_t kRows = 5, kCols = 512;
    const std::vector<uint8_t> w = random_matrix(t, kRows, kCols, 77 + ggml_id(t));
    const std::vector<float> want = dequantise(t, w, kRows, kCols);
    const QuantType q = quant_type(t);
    const int64_t rb = row_bytes(t, kCols);
    int64_t mismatches = 0;
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < kCols; ++c) {
        const float got = kq::dequant_element(q, w.data() + r * rb + (c / kq::block_elems(q)) * kq::block_bytes(q),
                                              static_cast<int>(c % kq::block_elems(q)));
        if (std::memcmp(&got, &want[static_cast<size_t>(r * kCols + c)], 4) != 0 && ++mismatches <= 3) {
          ADD_FAILURE() << "row " << r << " col " << c << ": " << got << " vs " << want[static_cast<size_t>(r * kCols + c)];
        }
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(QuantPlan, HalfToFloatIsExact) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = kq::half_to_float(static_cast<uint16_t>(h));
    const float want = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(std::memcmp(&got, &want, 4), 0) << "f16 bits " << h << ": " << got << " vs " << want;
    }
  }
}

}  // namespace
}  // namespace specontext::gpu
