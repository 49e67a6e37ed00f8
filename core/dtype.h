// Element types of weights and their conversions to f32.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace specontext {

enum class DType : uint8_t { kF32, kF16, kBF16, kQ8_0, kI32, kI64, kU8 };

std::string_view dtype_name(DType t);
// Bytes per element; 0 for block-quantised types (use row_bytes).
size_t dtype_size(DType t);

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Converts n elements of `src` (dtype t) to f32. Q8_0 needs n to be a multiple of 32.
void convert_to_f32(DType t, const void* src, float* dst, size_t n);

}  // namespace specontext
