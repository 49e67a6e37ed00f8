// Dispatch, activation quantisation (ggml's reference quantisers) and the row split over oneTBB.
#include "cpu/quant_gemv.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "cpu/quant_gemv_kernels.h"

namespace specontext::cpu {

namespace {

using quant::ActQ8_0;
using quant::ActQ8K;

struct TypeLayout {
  uint32_t id;
  int64_t block;  // elements
  int64_t bytes;  // per block
  bool k_type;    // activations as Q8_K (else Q8_0)
};

constexpr TypeLayout kLayouts[] = {
    {2, 32, quant::kQ4_0Bytes, false},  {8, 32, quant::kQ8_0Bytes, false},
    {12, 256, quant::kQ4KBytes, true},  {13, 256, quant::kQ5KBytes, true},
    {14, 256, quant::kQ6KBytes, true},
};

const TypeLayout* layout_of(uint32_t id) {
  for (const auto& l : kLayouts) {
    if (l.id == id) return &l;
  }
  return nullptr;
}

quant::RowsKernel kernel_for(const quant::Kernels& k, uint32_t id) {
  switch (id) {
    case 2: return k.q4_0;
    case 8: return k.q8_0;
    case 12: return k.q4_k;
    case 13: return k.q5_k;
    case 14: return k.q6_k;
    default: return nullptr;
  }
}

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool cpu_has_avx512() {
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

bool all_finite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return false;
  }
  return true;
}

// ggml's nearest_int: round to nearest, ties to even, for |v| < 2^22.
int nearest_int(float v) {
  const float biased = v + 12582912.f;
  int32_t i = 0;
  std::memcpy(&i, &biased, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// All m rows of x as activation blocks, each row `nb` blocks.
void quantize_activations(const TypeLayout& l, const float* x, int64_t m, int64_t k, int64_t nb,
                          uint8_t* out, int64_t act_row_bytes) {
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * k;
    uint8_t* row = out + i * act_row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t valid = std::min(l.block, k - b * l.block);
      if (l.k_type) {
        quant::quantize_block_q8_k(xr + b * l.block, valid, reinterpret_cast<ActQ8K*>(row) + b);
      } else {
        quant::quantize_block_q8_0(xr + b * l.block, valid, reinterpret_cast<ActQ8_0*>(row) + b);
      }
    }
  }
}

}  // namespace

namespace quant {

// quantize_row_q8_0_ref on one block of 32 (zero-padded past `valid`); a block holding a
// non-finite value gets d = NaN so every product with it is NaN.
void quantize_block_q8_0(const float* x, int64_t valid, ActQ8_0* out) {
  float v[32] = {};
  for (int64_t j = 0; j < valid; ++j) v[j] = x[j];
  std::memset(out->qs, 0, sizeof(out->qs));
  out->sum = 0;
  if (!all_finite(v, 32)) {
    out->d = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  float amax = 0.0f;
  for (float e : v) amax = std::fmax(amax, std::fabs(e));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  out->d = f16_to_f32(f32_to_f16(d));
  for (int j = 0; j < 32; ++j) {
    out->qs[j] = static_cast<int8_t>(std::roundf(v[j] * id));
    out->sum += out->qs[j];
  }
}

// quantize_row_q8_K_ref on one block of 256 (zero-padded past `valid`), same non-finite rule.
void quantize_block_q8_k(const float* x, int64_t valid, ActQ8K* out) {
  float v[256] = {};
  for (int64_t j = 0; j < valid; ++j) v[j] = x[j];
  std::memset(out->qs, 0, sizeof(out->qs));
  std::memset(out->bsums, 0, sizeof(out->bsums));
  out->d = 0.0f;
  if (!all_finite(v, 256)) {
    out->d = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  float max = 0.0f, amax = 0.0f;
  for (float e : v) {
    if (std::fabs(e) > amax) {
      amax = std::fabs(e);
      max = e;
    }
  }
  if (amax == 0.0f) return;
  const float iscale = -127.0f / max;
  for (int j = 0; j < 256; ++j) out->qs[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * v[j])));
  for (int g = 0; g < 16; ++g) {
    int s = 0;
    for (int j = 0; j < 16; ++j) s += out->qs[g * 16 + j];
    out->bsums[g] = static_cast<int16_t>(s);
  }
  out->d = 1.0f / iscale;
}

}  // namespace quant

std::string_view quant_path_name(QuantPath path) {
  switch (path) {
    case QuantPath::kAuto: return "auto";
    case QuantPath::kScalar: return "scalar";
    case QuantPath::kAvx2: return "avx2";
    case QuantPath::kAvx512: return "avx512";
  }
  return "?";
}

bool quant_path_available(QuantPath path) {
  switch (path) {
    case QuantPath::kAuto:
    case QuantPath::kScalar: return true;
    case QuantPath::kAvx2: return cpu_has_avx2();
    case QuantPath::kAvx512: return cpu_has_avx512();
  }
  return false;
}

QuantPath resolve_quant_path(QuantPath path) {
  if (path != QuantPath::kAuto) return path;
  if (cpu_has_avx512()) return QuantPath::kAvx512;
  if (cpu_has_avx2()) return QuantPath::kAvx2;
  return QuantPath::kScalar;
}

bool quant_gemv_supports(uint32_t ggml_type) { return layout_of(ggml_type) != nullptr; }

int64_t quant_row_bytes(uint32_t ggml_type, int64_t cols) {
  const TypeLayout* l = layout_of(ggml_type);
  if (l == nullptr || cols <= 0) return 0;
  return (cols + l->block - 1) / l->block * l->bytes;
}

Status quant_gemv(const QuantMatrix& w, const float* x, int64_t m, float* y, const QuantGemvOptions& options) {
  const TypeLayout* l = layout_of(w.ggml_type);
  if (l == nullptr) {
    return unimplemented("quant_gemv: ggml type " + std::to_string(w.ggml_type) +
                         " (supported: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K)");
  }
  if (w.data == nullptr || x == nullptr || y == nullptr) return invalid_argument("quant_gemv: null pointer");
  if (w.rows <= 0 || w.cols <= 0 || m <= 0) {
    return invalid_argument("quant_gemv: rows, cols and m must be positive (rows " + std::to_string(w.rows) +
                            ", cols " + std::to_string(w.cols) + ", m " + std::to_string(m) + ")");
  }
  const QuantPath path = resolve_quant_path(options.path);
  if (!quant_path_available(path)) {
    return unavailable("quant_gemv: this CPU cannot run the " + std::string(quant_path_name(path)) + " path");
  }
  const quant::Kernels& kernels = path == QuantPath::kAvx512 ? quant::avx512_kernels()
                                  : path == QuantPath::kAvx2 ? quant::avx2_kernels()
                                                             : quant::scalar_kernels();
  const quant::RowsKernel kernel = kernel_for(kernels, w.ggml_type);
  const int64_t nb = (w.cols + l->block - 1) / l->block;
  const int64_t act_row_bytes =
      nb * static_cast<int64_t>(l->k_type ? sizeof(quant::ActQ8K) : sizeof(quant::ActQ8_0));
  try {
    std::vector<uint8_t> act(static_cast<size_t>(m * act_row_bytes));
    quantize_activations(*l, x, m, w.cols, nb, act.data(), act_row_bytes);
    const quant::KernelArgs args{static_cast<const uint8_t*>(w.data), nb * l->bytes, nb, act.data(),
                                 act_row_bytes, m, y, w.rows};
    const int64_t bytes = w.rows * args.row_bytes;
    const int threads = tbb::this_task_arena::max_concurrency();
    if (!options.parallel || threads <= 1 || bytes < (int64_t{256} << 10)) {
      kernel(args, 0, w.rows);
      return Status::ok();
    }
    // About 8 tasks per thread, each at least 64 KiB of weights.
    const int64_t min_rows = std::max<int64_t>(1, (int64_t{64} << 10) / args.row_bytes);
    const int64_t grain = std::max(min_rows, w.rows / (8 * static_cast<int64_t>(threads)));
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, w.rows, grain),
                      [&](const tbb::blocked_range<int64_t>& r) { kernel(args, r.begin(), r.end()); });
  } catch (const std::bad_alloc&) {
    return resource_exhausted("quant_gemv: out of memory for the quantised activations");
  } catch (const std::exception& e) {
    return internal_error(std::string("quant_gemv: ") + e.what());
  }
  return Status::ok();
}

}  // namespace specontext::cpu
