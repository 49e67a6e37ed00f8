// f32 inputs where rounding to f16 / bf16 is delicate, shared by the host check of the kernels'
// conversions (kv_convert_test.cc) and the device check of kv_append (cuda_ops_test.cc).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace specontext::gpu::kv_test {

// Zeros, infinities, NaNs with payloads and signs, the f16 overflow threshold 65520 (a tie:
// rounds to inf), f16's and bf16's subnormal range and ties, f32 subnormals, the largest floats.
inline std::vector<float> kv_rounding_special_values() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(),
                          65504.0f,
                          65519.996f,
                          65520.0f,
                          65536.0f,
                          -65520.0f,
                          1e6f,
                          std::ldexp(1.0f, -24),
                          std::ldexp(1.0f, -25),
                          std::ldexp(3.0f, -25),
                          std::ldexp(1.0f, -14),
                          std::ldexp(1.0f, -15),
                          std::ldexp(1023.5f, -24),
                          1.0f + std::ldexp(1.0f, -8),
                          1.0f + std::ldexp(3.0f, -8),
                          1.0f + std::ldexp(1.0f, -11),
                          1.0f + std::ldexp(3.0f, -11),
                          std::ldexp(1.0f, -126),
                          std::ldexp(1.0f, -130),
                          std::ldexp(1.0f, -133)};
  for (uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu,
                       0x7fa5a5a5u, 0x7f80e000u, 0x7f812345u, 0xff812345u}) {
    v.push_back(std::bit_cast<float>(nan));
  }
  return v;
}

}  // namespace specontext::gpu::kv_test
