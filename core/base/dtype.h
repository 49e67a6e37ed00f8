// Element types of weights and their conversions to f32.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace specontext {

// kQ8_0, kQ4_0, kQ4_K, kQ5_K, kQ6_K are ggml's block quantisations (the layouts of ggml types 8,
// 2, 12, 13, 14 as GGUF stores them): a weight matrix may hold them as stored
// (LoadOptions::keep_quantized); they are never elements of a KV cache or an activation.
enum class DType : uint8_t { kF32, kF16, kBF16, kQ8_0, kI32, kI64, kU8, kQ4_0, kQ4_K, kQ5_K, kQ6_K };

std::string_view dtype_name(DType t);
// The DType whose dtype_name is `name`, if any.
std::optional<DType> dtype_from_name(std::string_view name);
// Bytes per element; 0 for block-quantised types (use dtype_row_bytes).
size_t dtype_size(DType t);
// True for the block-quantised types (kQ8_0, kQ4_0, kQ4_K, kQ5_K, kQ6_K).
bool is_block_dtype(DType t);
// Elements per block (32 or 256) of a block type; 1 for every other type.
int64_t dtype_block_elements(DType t);
// Bytes of one row of `cols` elements: cols · dtype_size for element types, ceil(cols / block)
// whole blocks for block types (GGUF pads rows to whole blocks).
size_t dtype_row_bytes(DType t, int64_t cols);

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

// One Q8_0 block (ggml type 8: f16 scale d, then 32 int8 q; 34 bytes) to 32 floats d·q. Here,
// not in core/model/ggml_quants (which uses it), because Q8_0 is also a DType a tensor may hold.
void dequantize_q8_0_block(const uint8_t* block, float* out);

// Converts n elements of `src` (dtype t) to f32. Q8_0 needs n to be a multiple of 32.
void convert_to_f32(DType t, const void* src, float* dst, size_t n);

// Element types a KV cache (and a working set) may hold: f32, f16, bf16.
inline bool is_kv_dtype(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }
// Rounds n f32 values to t (f32, f16 or bf16; nearest even, NaN stays NaN) into dst.
void convert_from_f32(DType t, const float* src, void* dst, size_t n);
// Address of element i of an array of element type t (f32/f16/bf16/i32/i64/u8).
inline void* element_at(void* base, DType t, int64_t i) {
  return static_cast<unsigned char*>(base) + static_cast<size_t>(i) * dtype_size(t);
}
inline const void* element_at(const void* base, DType t, int64_t i) {
  return static_cast<const unsigned char*>(base) + static_cast<size_t>(i) * dtype_size(t);
}

}  // namespace specontext
