// ggml's tensor types (the table GGUF files index by type id) and the decoding of its block
// quantisations to f32. GGUF weights in these formats are dequantised on load; the backends
// compute with f32 or bf16 weights.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "core/base/dtype.h"
#include "core/base/status.h"

namespace specontext {

struct GgmlTypeInfo {
  uint32_t id;
  std::string_view name;  // as ggml names it: "Q4_K", "F16", ...
  int64_t block;          // elements per block (1 for plain types)
  int64_t bytes;          // bytes per block
};

// Every type of ggml's type table (ggml.c type_traits), or nullptr for an unknown id.
const GgmlTypeInfo* ggml_type_info(uint32_t id);

// True for the block types ggml_dequantize decodes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS.
bool ggml_is_dequantizable(uint32_t id);

// The names ggml_dequantize accepts, for error messages ("Q4_0, Q4_1, ...").
std::string_view ggml_dequantizable_names();

// The DType of a block type a matrix may hold as stored (ggml ids 8, 2, 12, 13, 14: kQ8_0,
// kQ4_0, kQ4_K, kQ5_K, kQ6_K), nullopt for every other id.
std::optional<DType> ggml_block_dtype(uint32_t id);
// The ggml type id of a block DType (is_block_dtype), nullopt for the rest.
std::optional<uint32_t> ggml_block_type_id(DType t);

// Decodes `n` elements (a whole number of blocks) of ggml type `id` read from `src` (any
// alignment; (n / block) · bytes bytes) into `dst`, as ggml's dequantize_row_* do: each
// element is the f32 product (and difference) of the block's f16 scales and its integer code,
// in ggml's order of operations, so the result is bit-exact against ggml and gguf-py.
// kInvalidArgument when the type is not a decodable block type or n is not a whole number of
// blocks.
[[nodiscard]] Status ggml_dequantize(uint32_t id, const void* src, float* dst, int64_t n);

}  // namespace specontext
