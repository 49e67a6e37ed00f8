// The KV element conversions of the CUDA kernels (gpu/kv_convert.h: kv_append's rounding,
// attention's widening) against core's (core/base/dtype.h), without a GPU: the same functions compile
// for the host, where __float2half_rn / __float2bfloat16_rn are cuda_fp16.h's / cuda_bf16.h's
// software round-to-nearest-even, which the cvt.rn instructions of the device implement too. The
// device kernels themselves are compared with the reference backend in cuda_ops_test.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/base/dtype.h"
#include "gpu/kv_convert.h"
#include "tests/gpu/kv_rounding_values.h"

namespace specontext::gpu {
namespace {

using kernels::bits_float;
using kernels::float_bits;
using kernels::kv_from_f32;
using kernels::kv_round_bf16;
using kernels::kv_round_f16;
using kernels::kv_to_f32;

// Every 1021st bit pattern (all exponents, both signs, NaNs, infinities and subnormals of f32)
// plus the special values and the neighbours of each.
std::vector<float> sweep() {
  std::vector<float> v = kv_test::kv_rounding_special_values();
  for (uint64_t b = 0; b <= 0xffffffffull; b += 1021) v.push_back(bits_float(static_cast<uint32_t>(b)));
  const size_t n = v.size();
  for (size_t i = 0; i < n; ++i) {
    v.push_back(std::nextafter(v[i], std::numeric_limits<float>::infinity()));
    v.push_back(std::nextafter(v[i], -std::numeric_limits<float>::infinity()));
  }
  return v;
}

TEST(KvConvertTest, RoundingEqualsCoreBitForBit) {
  size_t nan_inputs = 0;
  for (float x : sweep()) {
    ASSERT_EQ(kv_round_bf16(x), f32_to_bf16(x)) << std::hex << "bf16 of 0x" << float_bits(x);
    ASSERT_EQ(kv_round_f16(x), f32_to_f16(x)) << std::hex << "f16 of 0x" << float_bits(x);
    ASSERT_EQ(__bfloat16_as_ushort(kv_from_f32<__nv_bfloat16>(x)), f32_to_bf16(x));
    ASSERT_EQ(__half_as_ushort(kv_from_f32<__half>(x)), f32_to_f16(x));
    ASSERT_EQ(float_bits(kv_from_f32<float>(x)), float_bits(x));
    nan_inputs += std::isnan(x) ? 1 : 0;
  }
  EXPECT_GT(nan_inputs, 1000u);
}

TEST(KvConvertTest, SpecialValuesRoundAsDocumented) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(kv_round_f16(65520.0f), 0x7c00);    // the tie above the largest f16 rounds to inf
  EXPECT_EQ(kv_round_f16(65519.996f), 0x7bff);  // just below it: 65504
  EXPECT_EQ(kv_round_f16(-1e6f), 0xfc00);
  EXPECT_EQ(kv_round_f16(std::ldexp(1.0f, -24)), 0x0001);               // smallest f16 subnormal
  EXPECT_EQ(kv_round_f16(std::ldexp(1.0f, -25)), 0x0000);               // tie to even: 0
  EXPECT_EQ(kv_round_f16(std::ldexp(3.0f, -25)), 0x0002);               // tie to even: 2 · 2^-24
  EXPECT_EQ(kv_round_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflow to inf
  EXPECT_EQ(kv_round_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);        // tie to even: 1
  EXPECT_EQ(kv_round_bf16(1.0f + std::ldexp(3.0f, -8)), 0x3f82);
  EXPECT_EQ(kv_round_bf16(-0.0f), 0x8000);
  EXPECT_EQ(kv_round_f16(-0.0f), 0x8000);
  for (uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff812345u}) {
    const float x = bits_float(nan);
    EXPECT_TRUE(std::isnan(kv_to_f32(kv_from_f32<__half>(x)))) << std::hex << nan;
    EXPECT_TRUE(std::isnan(kv_to_f32(kv_from_f32<__nv_bfloat16>(x)))) << std::hex << nan;
  }
  EXPECT_EQ(kv_to_f32(kv_from_f32<__half>(inf)), inf);
  EXPECT_EQ(kv_to_f32(kv_from_f32<__nv_bfloat16>(-inf)), -inf);
}

TEST(KvConvertTest, WideningEqualsCoreForEveryPattern) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t b16 = static_cast<uint16_t>(h);
    const float want_bf16 = bf16_to_f32(b16);
    const float got_bf16 = kv_to_f32(__ushort_as_bfloat16(b16));
    EXPECT_EQ(float_bits(got_bf16), float_bits(want_bf16)) << std::hex << "bf16 0x" << h;
    const float want_f16 = f16_to_f32(b16);
    const float got_f16 = kv_to_f32(__ushort_as_half(b16));
    if (std::isnan(want_f16)) {
      EXPECT_TRUE(std::isnan(got_f16)) << std::hex << "f16 0x" << h;  // payloads may differ
    } else {
      EXPECT_EQ(float_bits(got_f16), float_bits(want_f16)) << std::hex << "f16 0x" << h;
    }
    // Every finite value survives the round trip (rounding is exact on representable values).
    if (!std::isnan(want_bf16)) {
      EXPECT_EQ(kv_round_bf16(want_bf16), b16) << std::hex << h;
    }
    if (!std::isnan(want_f16)) {
      EXPECT_EQ(kv_round_f16(want_f16), b16) << std::hex << h;
    }
  }
}

}  // namespace
}  // namespace specontext::gpu
