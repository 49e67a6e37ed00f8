// Matrix-vector and small-batch matrix products that read ggml block-quantised weights as GGUF
// stores them: y[i][r] = sum_j x[i][j] * W[r][j] for W of type Q8_0, Q4_0, Q4_K, Q5_K or Q6_K
// (row-major, each row ceil(cols / block) blocks; ggml type ids) and x f32 with m rows (built for
// m = 1..16, any m >= 1 works). Activations are quantised per block the way ggml's own dot
// products do (quantize_row_q8_0_ref for Q8_0/Q4_0, quantize_row_q8_K_ref for the K types), so
// the integer dot products are ggml's exactly and results match ggml's up to float rounding.
//
// Paths: a scalar reference (the oracle the tests trust), AVX2 (+FMA, F16C) and AVX-512
// (F/BW/VL + VNNI), picked once per call from QuantGemvOptions::path; kAuto takes the best the
// CPU has. Output rows are split over oneTBB (in the caller's task arena) when the matrix is
// large. Non-finite policy: an activation row holding a NaN or an infinity yields NaN in every
// output of that row (quantisation cannot represent it); non-finite weight scales propagate
// through float arithmetic to the rows that hold them.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/base/status.h"

namespace specontext::cpu {

enum class QuantPath { kAuto, kScalar, kAvx2, kAvx512 };

std::string_view quant_path_name(QuantPath path);  // "auto", "scalar", "avx2", "avx512"
// Whether this CPU can run `path` (kAuto and kScalar always can).
bool quant_path_available(QuantPath path);
// kAuto resolved to the best available path; other values returned unchanged.
QuantPath resolve_quant_path(QuantPath path);

// ggml type ids quant_gemv reads: Q4_0 (2), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14).
bool quant_gemv_supports(uint32_t ggml_type);

struct QuantMatrix {
  uint32_t ggml_type = 0;
  int64_t rows = 0;  // n: outputs per activation row
  int64_t cols = 0;  // k: elements per row (rows are padded to whole blocks, as GGUF stores them)
  const void* data = nullptr;
};

// Bytes of one stored row (ceil(cols / block) blocks); 0 for an unsupported type.
int64_t quant_row_bytes(uint32_t ggml_type, int64_t cols);

struct QuantGemvOptions {
  QuantPath path = QuantPath::kAuto;
  bool parallel = true;  // split output rows over oneTBB when the matrix is at least 256 KiB
};

// y is [m][w.rows]. kInvalidArgument for null pointers or non-positive sizes, kUnimplemented
// for a type quant_gemv_supports refuses, kUnavailable for a path this CPU lacks.
Status quant_gemv(const QuantMatrix& w, const float* x, int64_t m, float* y,
                  const QuantGemvOptions& options = {});

}  // namespace specontext::cpu
