#include "core/base/dtype.h"

#include <cmath>

namespace specontext {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kQ8_0: return "q8_0";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU8: return "u8";
    case DType::kQ4_0: return "q4_0";
    case DType::kQ4_K: return "q4_k";
    case DType::kQ5_K: return "q5_k";
    case DType::kQ6_K: return "q6_k";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kI32, DType::kI64, DType::kU8,
                  DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
    if (dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF16: case DType::kBF16: return 2;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
    case DType::kQ8_0: case DType::kQ4_0: case DType::kQ4_K: case DType::kQ5_K: case DType::kQ6_K: return 0;
  }
  return 0;
}

namespace {

struct BlockLayout {
  int64_t elements;
  size_t bytes;
};

// ggml-common.h: block_q8_0 {f16 d; i8 qs[32]}, block_q4_0 {f16 d; u8 qs[16]}, block_q4_K {f16 d,
// dmin; u8 scales[12], qs[128]}, block_q5_K {... qh[32], qs[128]}, block_q6_K {ql[128], qh[64],
// i8 scales[16]; f16 d}.
std::optional<BlockLayout> block_layout(DType t) {
  switch (t) {
    case DType::kQ8_0: return BlockLayout{32, 34};
    case DType::kQ4_0: return BlockLayout{32, 18};
    case DType::kQ4_K: return BlockLayout{256, 144};
    case DType::kQ5_K: return BlockLayout{256, 176};
    case DType::kQ6_K: return BlockLayout{256, 210};
    default: return std::nullopt;
  }
}

}  // namespace

bool is_block_dtype(DType t) { return block_layout(t).has_value(); }

int64_t dtype_block_elements(DType t) {
  const std::optional<BlockLayout> b = block_layout(t);
  return b ? b->elements : 1;
}

size_t dtype_row_bytes(DType t, int64_t cols) {
  if (cols <= 0) return 0;
  if (const std::optional<BlockLayout> b = block_layout(t)) {
    return static_cast<size_t>((cols + b->elements - 1) / b->elements) * b->bytes;
  }
  return static_cast<size_t>(cols) * dtype_size(t);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absx >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absx < 0x38800000u) {  // subnormal or zero in f16
    const float af = std::fabs(f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(af * 16777216.0f)));
  }
  uint32_t rounded = absx + 0xfffu + ((absx >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

void dequantize_q8_0_block(const uint8_t* block, float* out) {
  uint16_t h = 0;
  std::memcpy(&h, block, 2);
  const float d = f16_to_f32(h);
  for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(block[2 + j])) * d;
}

void convert_to_f32(DType t, const void* src, float* dst, size_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::kQ8_0: {  // blocks of {f16 scale; int8 q[32]}: ggml type 8
      const size_t whole = n / 32 * 32;
      const auto* blocks = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < whole; i += 32) dequantize_q8_0_block(blocks + i / 32 * 34, dst + i);
      for (size_t i = whole; i < n; ++i) dst[i] = 0.0f;
      return;
    }
    default:
      for (size_t i = 0; i < n; ++i) dst[i] = 0.0f;  // non-float types are never converted
  }
}

void convert_from_f32(DType t, const float* src, void* dst, size_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    default:
      return;  // callers check is_kv_dtype first
  }
}

}  // namespace specontext
