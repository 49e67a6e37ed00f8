#include "gpu/quant_plan.h"

#include <algorithm>
#include <climits>
#include <string>

#include "gpu/quant_blocks.h"

namespace specontext::gpu {

std::optional<kernels::QuantType> quant_type_of(DType t) {
  switch (t) {
    case DType::kQ8_0: return kernels::QuantType::kQ8_0;
    case DType::kQ4_0: return kernels::QuantType::kQ4_0;
    case DType::kQ4_K: return kernels::QuantType::kQ4_K;
    case DType::kQ5_K: return kernels::QuantType::kQ5_K;
    case DType::kQ6_K: return kernels::QuantType::kQ6_K;
    default: return std::nullopt;
  }
}

bool cuda_supports(BackendOp op, DType weight_dtype) {
  const bool plain = weight_dtype == DType::kF32 || weight_dtype == DType::kBF16;
  const bool blocks = quant_type_of(weight_dtype).has_value();
  switch (op) {
    case BackendOp::kMatmul: return plain || blocks;
    case BackendOp::kEmbed: return plain || blocks || weight_dtype == DType::kF16;
    default: return true;  // no weight matrix; f32 activations (kRetrievalScores included)
  }
}

Result<QuantMatmulPlan> plan_quant_matmul(const WeightMatrix& w, int64_t m) {
  const std::optional<kernels::QuantType> type = quant_type_of(w.dtype);
  if (!type) {
    return unimplemented("CUDA quantised matmul: " + std::string(dtype_name(w.dtype)) + " is not a block type");
  }
  if (w.rows <= 0 || w.cols <= 0 || m <= 0) {
    return invalid_argument("matmul: rows, cols and m must be positive (rows " + std::to_string(w.rows) + ", cols " +
                            std::to_string(w.cols) + ", m " + std::to_string(m) + ")");
  }
  if (w.data == nullptr) return invalid_argument("matmul: null weights");
  if ((reinterpret_cast<uintptr_t>(w.data) & 3u) != 0) {
    return invalid_argument("matmul: " + std::string(dtype_name(w.dtype)) +
                            " weights must be 4-byte aligned (device copies from import_weights are)");
  }
  QuantMatmulPlan p;
  p.type = *type;
  p.block = kernels::quant::block_elems(p.type);
  p.block_bytes = kernels::quant::block_bytes(p.type);
  p.nb = (w.cols + p.block - 1) / p.block;
  p.padded_cols = p.nb * p.block;
  p.row_bytes = p.nb * p.block_bytes;
  if (p.padded_cols > INT_MAX || w.rows > INT_MAX || m > INT_MAX) {
    return invalid_argument("matmul: shape (m " + std::to_string(m) + ", rows " + std::to_string(w.rows) +
                            ", cols " + std::to_string(w.cols) + ") outside the kernels' int range");
  }
  p.weight_bytes = static_cast<size_t>(w.rows) * static_cast<size_t>(p.row_bytes);
  p.gemv = m <= kernels::kQuantGemvMaxRows;
  if (p.gemv) {
    p.grid = (w.rows + kernels::kQuantGemvWarps - 1) / kernels::kQuantGemvWarps;
    p.act_codes_bytes = static_cast<size_t>(m * p.padded_cols);
    p.act_scales_offset = (p.act_codes_bytes + 255) / 256 * 256;
    p.scratch_bytes = p.act_scales_offset + static_cast<size_t>(m * p.nb) * sizeof(float);
  } else {
    p.tile_rows = std::clamp<int64_t>(kDequantTileMaxFloats / p.padded_cols, 1, w.rows);
    p.tiles = (w.rows + p.tile_rows - 1) / p.tile_rows;
    p.tile_floats = static_cast<size_t>(p.tile_rows * p.padded_cols);
  }
  return p;
}

}  // namespace specontext::gpu
