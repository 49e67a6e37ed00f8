// Helpers of the quantised-weight tests (quant_plan_test.cc on the host, cuda_quant_test.cc on a
// device): random block matrices with realistic scales, ggml's reference activation quantisers
// (quantize_row_q8_0_ref / quantize_row_q8_K_ref, as cpu/quant_gemv.cc runs them), the CPU oracle
// (cpu::quant_gemv's scalar path), the dequantised matrix, the per-element error bound and the
// model shape of the random GGUF files. Random floats are tests/cpu/cpu_test_util.h's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "core/model/ggml_quants.h"
#include "core/model/model_config.h"
#include "cpu/quant_gemv.h"
#include "cpu/quant_gemv_kernels.h"
#include "gpu/kernels.h"
#include "gpu/quant_blocks.h"
#include "tests/cpu/cpu_test_util.h"

namespace specontext::gpu::quant_test {

using cpu::testing::random_floats;
using kernels::QuantType;

constexpr DType kBlockTypes[] = {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};

inline QuantType quant_type(DType t) {
  switch (t) {
    case DType::kQ8_0: return QuantType::kQ8_0;
    case DType::kQ4_0: return QuantType::kQ4_0;
    case DType::kQ4_K: return QuantType::kQ4_K;
    case DType::kQ5_K: return QuantType::kQ5_K;
    default: return QuantType::kQ6_K;
  }
}
inline uint32_t ggml_id(DType t) { return *ggml_block_type_id(t); }
inline int64_t block_of(DType t) { return kernels::quant::block_elems(quant_type(t)); }
inline int64_t blocks_per_row(DType t, int64_t k) { return (k + block_of(t) - 1) / block_of(t); }
inline int64_t row_bytes(DType t, int64_t k) { return blocks_per_row(t, k) * kernels::quant::block_bytes(quant_type(t)); }

inline void put_f16(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v);
  std::memcpy(p, &h, 2);
}

// n rows of k elements: random codes and sub-block scale bytes; the f16 block scales drawn from
// [0.002, 0.02] (signed for the 32-element types), what quantised checkpoints hold for weights of
// magnitude ~0.01-0.1 (the K types' d and dmin, Q6_K's d at byte 208).
inline std::vector<uint8_t> random_matrix(DType t, int64_t n, int64_t k, uint32_t seed) {
  const int bytes = kernels::quant::block_bytes(quant_type(t));
  const int64_t blocks = n * blocks_per_row(t, k);
  std::vector<uint8_t> w(static_cast<size_t>(blocks * bytes));
  std::mt19937 rng(seed);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(0.002f, 0.02f);
  for (int64_t i = 0; i < blocks; ++i) {
    uint8_t* blk = w.data() + i * bytes;
    if (t == DType::kQ6_K) {
      put_f16(blk + 208, scale(rng));
    } else {
      put_f16(blk, (rng() & 1) ? scale(rng) : -scale(rng));
      if (t == DType::kQ4_K || t == DType::kQ5_K) put_f16(blk + 2, scale(rng));
    }
  }
  return w;
}

// Row-major f32 [n][k] (each row decoded whole by ggml_dequantize, then cut to k).
inline std::vector<float> dequantise(DType t, const std::vector<uint8_t>& w, int64_t n, int64_t k) {
  const int64_t padded = blocks_per_row(t, k) * block_of(t);
  std::vector<float> row(static_cast<size_t>(padded)), out(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) {
    EXPECT_TRUE(ggml_dequantize(ggml_id(t), w.data() + r * row_bytes(t, k), row.data(), padded).is_ok());
    std::memcpy(out.data() + r * k, row.data(), static_cast<size_t>(k) * 4);
  }
  return out;
}

// Quantised activations as the kernels take them: codes [m][nb · block], scales [m][nb].
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> d;
};

// The CPU path's activation quantisers (cpu/quant_gemv_kernels.h: ggml's quantize_row_q8_0_ref /
// quantize_row_q8_K_ref on one zero-padded block; a non-finite block gets d = NaN, codes 0), with
// the codes and the scale written where the kernels take them.
inline void quantize_q8_0(const float* x, int64_t valid, int8_t* q, float* d) {
  cpu::quant::ActQ8_0 a;
  cpu::quant::quantize_block_q8_0(x, valid, &a);
  std::copy(a.qs, a.qs + 32, q);
  *d = a.d;
}

inline void quantize_q8_k(const float* x, int64_t valid, int8_t* q, float* d) {
  cpu::quant::ActQ8K a;
  cpu::quant::quantize_block_q8_k(x, valid, &a);
  std::copy(a.qs, a.qs + 256, q);
  *d = a.d;
}

inline Activations quantize(DType t, const std::vector<float>& x, int64_t m, int64_t k) {
  const int64_t block = block_of(t);
  const int64_t nb = blocks_per_row(t, k);
  Activations a;
  a.q.assign(static_cast<size_t>(m * nb * block), 0);
  a.d.assign(static_cast<size_t>(m * nb), 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t valid = std::min(block, k - b * block);
      int8_t* q = a.q.data() + i * nb * block + b * block;
      float* d = a.d.data() + i * nb + b;
      if (block == 32) {
        quantize_q8_0(x.data() + i * k + b * block, valid, q, d);
      } else {
        quantize_q8_k(x.data() + i * k + b * block, valid, q, d);
      }
    }
  }
  return a;
}

// The oracle: cpu::quant_gemv's scalar path (exact integer block sums, blocks summed in double).
inline std::vector<float> cpu_reference(DType t, const std::vector<uint8_t>& w, int64_t n, int64_t k,
                                        const std::vector<float>& x, int64_t m) {
  std::vector<float> y(static_cast<size_t>(m * n));
  const cpu::QuantMatrix q{ggml_id(t), n, k, w.data()};
  const Status s = cpu::quant_gemv(q, x.data(), m, y.data(), {cpu::QuantPath::kScalar, false});
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return y;
}

// B[i][r] = Σ_j |x[i][j]|·|w[r][j]| over the dequantised weights.
inline std::vector<double> abs_bound(const std::vector<float>& x, const std::vector<float>& wf, int64_t m, int64_t n,
                                     int64_t k) {
  std::vector<double> b(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < n; ++r) {
      double s = 0;
      for (int64_t j = 0; j < k; ++j) s += std::fabs(double(x[i * k + j]) * wf[r * k + j]);
      b[i * n + r] = s;
    }
  }
  return b;
}

// Every element finite and within tolerance · B of the reference; most elements non-zero.
inline ::testing::AssertionResult within_bound(const std::vector<float>& got, const std::vector<float>& want,
                                               const std::vector<double>& bound, double tolerance) {
  if (got.size() != want.size() || got.size() != bound.size()) return ::testing::AssertionFailure() << "size mismatch";
  size_t nonzero = 0;
  double worst = 0.0;
  for (size_t e = 0; e < got.size(); ++e) {
    if (!std::isfinite(got[e])) return ::testing::AssertionFailure() << "non-finite output " << got[e] << " at " << e;
    const double err = std::fabs(double(got[e]) - want[e]);
    if (err > tolerance * bound[e]) {
      return ::testing::AssertionFailure() << "element " << e << ": " << got[e] << " vs " << want[e] << " (|diff| "
                                           << err << " > " << tolerance << " x B = " << tolerance * bound[e] << ")";
    }
    worst = std::max(worst, bound[e] > 0 ? err / bound[e] : 0.0);
    nonzero += got[e] != 0.0f;
  }
  if (nonzero * 2 < got.size()) {
    return ::testing::AssertionFailure() << "only " << nonzero << " of " << got.size() << " outputs non-zero";
  }
  return ::testing::AssertionSuccess() << "worst |diff| / B " << worst;
}

// The Llama model of the random GGUF files: dim 256 and hidden 768 (every matrix whole blocks of
// each type), 2 layers, 4 heads over 2 KV heads of 64, a vocabulary of 512, 64 positions.
inline ModelConfig gguf_test_config() {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.dim = 256;
  c.hidden_dim = 768;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.vocab_size = 512;
  c.max_seq_len = 64;
  return c;
}

}  // namespace specontext::gpu::quant_test
