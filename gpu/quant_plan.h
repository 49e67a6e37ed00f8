// Host-side planning of matmul and embed with weights the CUDA backend reads as stored: which
// dtypes it runs (the engine keeps such matrices as the file stores them and uploads their bytes
// unchanged), the checks, the activation scratch of the GEMV kernels and the tiles of the
// dequantise-then-cuBLAS path for larger batches. Pure C++ with no CUDA calls: tested without a
// GPU (tests/gpu/quant_plan_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "core/base/dtype.h"
#include "core/base/status.h"
#include "core/model/model.h"
#include "core/ports/backend.h"
#include "gpu/kernels.h"

namespace specontext::gpu {

// The kernels' type of a block DType (kQ8_0, kQ4_0, kQ4_K, kQ5_K, kQ6_K); nullopt for the rest.
std::optional<kernels::QuantType> quant_type_of(DType t);

// CudaBackend::supports: matmul on f32, bf16 and the five block types; embed on those and f16.
bool cuda_supports(BackendOp op, DType weight_dtype);

// Floats of the f32 tile a matmul with more than kQuantGemvMaxRows rows decodes weight rows into
// (32 MiB); a row wider than that is a tile of one row.
inline constexpr int64_t kDequantTileMaxFloats = int64_t{8} << 20;

struct QuantMatmulPlan {
  kernels::QuantType type = kernels::QuantType::kQ8_0;
  int64_t block = 0;        // elements per block
  int64_t block_bytes = 0;
  int64_t nb = 0;           // blocks per row: ceil(cols / block)
  int64_t padded_cols = 0;  // nb · block
  int64_t row_bytes = 0;    // nb · block_bytes (WeightMatrix::row_bytes)
  size_t weight_bytes = 0;  // rows · row_bytes: the bytes on the device, as the file stores them
  bool gemv = false;        // m <= kQuantGemvMaxRows: quantised activations and launch_quant_gemv
  // gemv: one scratch buffer, activation codes [m][padded_cols] then, 256-byte aligned, the
  // scales [m][nb] (f32).
  size_t act_codes_bytes = 0;
  size_t act_scales_offset = 0;
  size_t scratch_bytes = 0;
  int64_t grid = 0;  // GEMV blocks: ceil(rows / kQuantGemvWarps)
  // !gemv: tiles of tile_rows weight rows decoded to f32 [tile_rows][padded_cols] (lda
  // padded_cols), each multiplied by cuBLAS into its columns of y.
  int64_t tile_rows = 0;
  int64_t tiles = 0;
  size_t tile_floats = 0;
};

// kUnimplemented for a dtype that is not a block type; kInvalidArgument for non-positive rows or
// cols or m, a null or not 4-byte aligned w.data, or shapes beyond the launch limits (rows and
// padded_cols within int for cuBLAS; the GEMV grid within 2^31 - 1 blocks).
Result<QuantMatmulPlan> plan_quant_matmul(const WeightMatrix& w, int64_t m);

}  // namespace specontext::gpu
