// Rows of a ggml block-quantised matrix (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, as quant_gemv reads them)
// decoded to f32: the same values as core/model/ggml_quants' ggml_dequantize (the oracle; bit
// for bit: ggml's order of operations, no contraction into FMAs), with loops the compiler
// vectorises, compiled for AVX-512, AVX2 or the baseline and picked once from the CPU's features.
// CpuBackend's prefill path decodes tiles of weight rows with it before an f32 GEMM.
// Thread safety: pure; callers split rows over threads.
#pragma once

#include <cstdint>

#include "core/base/status.h"

namespace specontext::cpu {

// dst [n_rows][cols] from n_rows stored rows of `cols` elements (cols a whole number of blocks;
// rows quant_row_bytes(ggml_type, cols) apart). kInvalidArgument for another type, null pointers,
// or cols not a whole number of blocks.
Status dequantize_rows(uint32_t ggml_type, const void* src, int64_t n_rows, int64_t cols, float* dst);

}  // namespace specontext::cpu
