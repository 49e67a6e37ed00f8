// The sort key of device sampling (CudaBackend::sample_rows), shared by the kernels
// (kernels_sampling.cu) and the host mirror in tests/gpu/sampling_plan_test.cc. Plain C++ that
// nvcc also compiles for the device (SPX_HD); no core headers.
//
// core/ports/sampler.cc orders probabilities descending with ties at the LOWER index first (top-k keeps
// the lowest indices of a tie at the k-th value; top-p's stable sort puts them first). Here every
// (p, i) of a row of n becomes one 64-bit key, larger = earlier: the high part is the bits of p
// (p in [0, 1], so the bits are monotone and below 2^30), the low `shift` bits are n - 1 - i.
// Keys are distinct, so a descending sort of the keys of any subset, in any input order, is
// exactly the host's order, and the k-th key decides top-k membership of every index:
// i is kept  <=>  key(p_i, i) >= key of the k-th sorted entry.
// The radix sort needs only bits [0, 30 + shift). NaN probabilities (NaN logits) give keys
// beyond that range and an unspecified, still in-range, token.
#pragma once

#include <cstdint>

#include "gpu/host_device.h"

namespace specontext::gpu::kernels {

// Smallest shift >= 1 with n - 1 < 2^shift (n >= 1, n <= 2^31 - 1).
inline constexpr int sample_key_shift(int64_t n) {
  int shift = 1;
  while (shift < 31 && (int64_t{1} << shift) < n) ++shift;
  return shift;
}

// Bits the radix sort has to look at: p's bits (< 2^30 for p <= 1) above the index field.
inline constexpr int sample_key_bits(int shift) { return 30 + shift; }

SPX_HD uint64_t sample_key(float p, int64_t i, int64_t n, int shift) {
  return (static_cast<uint64_t>(float_bits(p)) << shift) | static_cast<uint64_t>(n - 1 - i);
}

SPX_HD float sample_key_prob(uint64_t key, int shift) {
  return bits_float(static_cast<uint32_t>(key >> shift));
}

SPX_HD int64_t sample_key_index(uint64_t key, int64_t n, int shift) {
  return n - 1 - static_cast<int64_t>(key & ((uint64_t{1} << shift) - 1));
}

}  // namespace specontext::gpu::kernels
