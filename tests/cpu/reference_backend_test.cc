// The oracle against hand-computed numbers: if these pass, the reference is right, and every
// randomised comparison against it means something.
#include "cpu/reference_backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "cpu/cpu_backend.h"
#include "tests/cpu/cpu_test_util.h"

namespace specontext::cpu {
namespace {

using testing::PagedKv;

TEST(ReferenceBackend, MatmulSmallKnown) {
  ReferenceBackend ref;
  // W [3, 2], x [2, 2]: y = x · Wᵀ + b.
  const float w[] = {1, 2, 3, 4, 5, 6};
  const float x[] = {1, -1, 0.5f, 2};
  const float b[] = {10, 20, 30};
  WeightMatrix wm{DType::kF32, 3, 2, w};
  float y[6];
  ASSERT_TRUE(ref.matmul(x, 2, wm, b, y).is_ok());
  const float want[] = {1 - 2 + 10, 3 - 4 + 20, 5 - 6 + 30, 0.5f + 4 + 10, 1.5f + 8 + 20, 2.5f + 12 + 30};
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(y[i], want[i]) << i;
  ASSERT_TRUE(ref.matmul(x, 2, wm, nullptr, y).is_ok());
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(y[i], want[i] - b[i % 3]) << i;
}

TEST(ReferenceBackend, MatmulBf16WeightsAreWidenedExactly) {
  ReferenceBackend ref;
  const uint16_t w[] = {f32_to_bf16(1.5f), f32_to_bf16(-2.0f)};  // exactly representable
  WeightMatrix wm{DType::kBF16, 1, 2, w};
  const float x[] = {2.0f, 0.25f};
  float y = 0;
  ASSERT_TRUE(ref.matmul(x, 1, wm, nullptr, &y).is_ok());
  EXPECT_FLOAT_EQ(y, 2.5f);
}

TEST(ReferenceBackend, MatmulRejectsF16AndQ8) {
  ReferenceBackend ref;
  const uint16_t w[] = {0, 0};
  float x[2] = {1, 1}, y = 0;
  EXPECT_EQ(ref.matmul(x, 1, WeightMatrix{DType::kF16, 1, 2, w}, nullptr, &y).code(),
            StatusCode::kUnimplemented);
  EXPECT_FALSE(ref.supports(BackendOp::kMatmul, DType::kF16));
  EXPECT_TRUE(ref.supports(BackendOp::kMatmul, DType::kBF16));
  EXPECT_TRUE(ref.supports(BackendOp::kEmbed, DType::kF16));
}

TEST(ReferenceBackend, RmsNormKnown) {
  ReferenceBackend ref;
  const float x[] = {3, 4, 0, 0};  // mean(x²) = 25/4
  const float w[] = {1, 2, 3, 4};
  float y[4];
  ASSERT_TRUE(ref.rmsnorm(x, w, 1, 4, 0.0f, y).is_ok());
  EXPECT_FLOAT_EQ(y[0], 3 / 2.5f);
  EXPECT_FLOAT_EQ(y[1], 4 / 2.5f * 2);
  EXPECT_EQ(y[2], 0.0f);
  // In place, and eps counts.
  float z[] = {1, 1};
  const float w1[] = {1, 1};
  ASSERT_TRUE(ref.rmsnorm(z, w1, 1, 2, 3.0f, z).is_ok());
  EXPECT_FLOAT_EQ(z[0], 0.5f);
}

TEST(ReferenceBackend, RopeBothStylesKnown) {
  ReferenceBackend ref;
  RopeParams p;
  p.head_dim = 4;
  p.inv_freq = {1.0f, 0.5f};
  p.mscale = 2.0f;
  const int64_t pos = 3;
  const float a0 = 3.0f, a1 = 1.5f;  // angles of pair 0 and pair 1
  {
    p.style = RopeStyle::kInterleaved;  // pairs (0,1), (2,3)
    float x[] = {1, 2, 3, 4};
    ASSERT_TRUE(ref.rope(x, 1, 1, &pos, p).is_ok());
    EXPECT_NEAR(x[0], 2 * (1 * std::cos(a0) - 2 * std::sin(a0)), 1e-5);
    EXPECT_NEAR(x[1], 2 * (1 * std::sin(a0) + 2 * std::cos(a0)), 1e-5);
    EXPECT_NEAR(x[2], 2 * (3 * std::cos(a1) - 4 * std::sin(a1)), 1e-5);
    EXPECT_NEAR(x[3], 2 * (3 * std::sin(a1) + 4 * std::cos(a1)), 1e-5);
  }
  {
    p.style = RopeStyle::kHalf;  // pairs (0,2), (1,3)
    float x[] = {1, 2, 3, 4};
    ASSERT_TRUE(ref.rope(x, 1, 1, &pos, p).is_ok());
    EXPECT_NEAR(x[0], 2 * (1 * std::cos(a0) - 3 * std::sin(a0)), 1e-5);
    EXPECT_NEAR(x[2], 2 * (1 * std::sin(a0) + 3 * std::cos(a0)), 1e-5);
    EXPECT_NEAR(x[1], 2 * (2 * std::cos(a1) - 4 * std::sin(a1)), 1e-5);
    EXPECT_NEAR(x[3], 2 * (2 * std::sin(a1) + 4 * std::cos(a1)), 1e-5);
  }
  // Position 0 is the identity (times mscale).
  p.mscale = 1.0f;
  const int64_t zero = 0;
  float x[] = {1, 2, 3, 4};
  ASSERT_TRUE(ref.rope(x, 1, 1, &zero, p).is_ok());
  EXPECT_FLOAT_EQ(x[1], 2.0f);
  p.inv_freq = {1.0f};
  EXPECT_EQ(ref.rope(x, 1, 1, &zero, p).code(), StatusCode::kInvalidArgument);
}

TEST(ReferenceBackend, SwigluAddKnown) {
  ReferenceBackend ref;
  const float g[] = {0.0f, 1.0f, -2.0f};
  const float u[] = {5.0f, 2.0f, 3.0f};
  float out[3];
  ASSERT_TRUE(ref.swiglu(g, u, 3, out).is_ok());
  EXPECT_FLOAT_EQ(out[0], 0.0f);
  EXPECT_NEAR(out[1], 1.0 / (1.0 + std::exp(-1.0)) * 2.0, 1e-6);
  EXPECT_NEAR(out[2], -2.0 / (1.0 + std::exp(2.0)) * 3.0, 1e-6);
  float x[] = {1, 2};
  const float y[] = {0.5f, -2};
  ASSERT_TRUE(ref.add(x, y, 2).is_ok());
  EXPECT_EQ(x[0], 1.5f);
  EXPECT_EQ(x[1], 0.0f);
}

TEST(ReferenceBackend, EmbedAllDtypes) {
  ReferenceBackend ref;
  const float f32[] = {1, 2, 3, 4, 5, 6};
  const uint16_t bf16[] = {f32_to_bf16(1), f32_to_bf16(2), f32_to_bf16(3),
                           f32_to_bf16(4), f32_to_bf16(5), f32_to_bf16(-6)};
  const uint16_t f16[] = {f32_to_f16(1), f32_to_f16(2),    f32_to_f16(3),
                          f32_to_f16(4), f32_to_f16(0.5f), f32_to_f16(6)};
  const TokenId ids[] = {2, 0, 2};
  float out[6];
  ASSERT_TRUE(ref.embed(ids, 3, WeightMatrix{DType::kF32, 3, 2, f32}, out).is_ok());
  EXPECT_EQ(std::vector<float>(out, out + 6), (std::vector<float>{5, 6, 1, 2, 5, 6}));
  ASSERT_TRUE(ref.embed(ids, 3, WeightMatrix{DType::kBF16, 3, 2, bf16}, out).is_ok());
  EXPECT_EQ(std::vector<float>(out, out + 6), (std::vector<float>{5, -6, 1, 2, 5, -6}));
  ASSERT_TRUE(ref.embed(ids, 3, WeightMatrix{DType::kF16, 3, 2, f16}, out).is_ok());
  EXPECT_EQ(std::vector<float>(out, out + 6), (std::vector<float>{0.5f, 6, 1, 2, 0.5f, 6}));
  const TokenId bad[] = {3};
  EXPECT_EQ(ref.embed(bad, 1, WeightMatrix{DType::kF32, 3, 2, f32}, out).code(), StatusCode::kOutOfRange);
}

TEST(ReferenceBackend, KvAppendLayout) {
  ReferenceBackend ref;
  // page_size 2, 2 kv heads, head_dim 1: page p = [head0 slot0, head0 slot1, head1 slot0, head1 slot1].
  PagedKv kv(2, 2, 2, 1, /*seed=*/0);
  const float k[] = {10, 11, 20, 21, 30, 31};  // 3 tokens x (head0, head1)
  const float v[] = {-10, -11, -20, -21, -30, -31};
  ASSERT_TRUE(ref.kv_append(k, v, 3, 0, kv.view).is_ok());
  EXPECT_EQ(*kv.k_at(0, 0), 10);
  EXPECT_EQ(*kv.k_at(0, 1), 11);
  EXPECT_EQ(*kv.k_at(1, 1), 21);
  EXPECT_EQ(*kv.v_at(2, 0), -30);
  // Token 2 -> page 1 slot 0: head 0 at [0*2 + 0], head 1 at [1*2 + 0].
  const float* page1 = static_cast<const float*>(kv.k_pages[1]);
  EXPECT_EQ(page1[0], 30);
  EXPECT_EQ(page1[2], 31);
  EXPECT_TRUE(std::isnan(page1[1]));  // head 0, slot 1: never written
  EXPECT_TRUE(std::isnan(page1[3]));  // head 1, slot 1: never written
  EXPECT_EQ(ref.kv_append(k, v, 2, 3, kv.view).code(), StatusCode::kOutOfRange);
}

// Hand-computed: one head, head_dim 2, two tokens (prefill). Token 0 sees only key 0, so its
// output is V0. Token 1 (q = [2, 0]) scores key 0 at 2/√2 and key 1 at 0:
// p0 = e^√2 / (e^√2 + 1), out = p0·V0 + (1 − p0)·V1.
void check_tiny_attention(Backend& backend) {
  PagedKv kv(1, 4, 1, 2, 0);
  const float k[] = {1, 0, 0, 1};
  const float v[] = {1, 2, 3, 4};
  ASSERT_TRUE(backend.kv_append(k, v, 2, 0, kv.view).is_ok());
  const float q[] = {5, -7, 2, 0};  // token 0's query is irrelevant: a single key gets weight 1
  AttentionItem item{0, 2, 0, kv.view};
  float out[4] = {};
  ASSERT_TRUE(backend.attention(q, &item, 1, 1, out).is_ok());
  EXPECT_NEAR(out[0], 1.0, 1e-6);
  EXPECT_NEAR(out[1], 2.0, 1e-6);
  EXPECT_NEAR(out[2], 1.3911406349860862, 1e-6);
  EXPECT_NEAR(out[3], 2.391140634986086, 1e-6);
}

TEST(ReferenceBackend, AttentionTinyHandComputed) {
  ReferenceBackend ref;
  check_tiny_attention(ref);
}

TEST(ReferenceBackend, AttentionTinyHandComputedCpuBackend) {
  auto cpu = CpuBackend::create({});
  ASSERT_TRUE(cpu.is_ok()) << cpu.status().to_string();
  check_tiny_attention(**cpu);
}

TEST(ReferenceBackend, AttentionGqaUsesTheRightKvHead) {
  // 4 query heads on 2 KV heads, one cached token: each head's output is its KV head's V.
  ReferenceBackend ref;
  PagedKv kv(1, 3, 2, 2, 0);
  const float k[] = {1, 1, 1, 1};
  const float v[] = {7, 8, -7, -8};
  ASSERT_TRUE(ref.kv_append(k, v, 1, 0, kv.view).is_ok());
  const float q[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  AttentionItem item{0, 1, 0, kv.view};
  float out[8];
  ASSERT_TRUE(ref.attention(q, &item, 1, 4, out).is_ok());
  EXPECT_EQ(std::vector<float>(out, out + 8), (std::vector<float>{7, 8, 7, 8, -7, -8, -7, -8}));
  EXPECT_EQ(ref.attention(q, &item, 1, 3, out).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specontext::cpu
