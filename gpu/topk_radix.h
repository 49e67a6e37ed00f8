// The arithmetic of the device top-k selection (select_top_tokens), shared by the kernels
// (kernels_retrieval.cu) and the host mirror in tests/gpu/retrieval_plan_test.cc, so the key
// order, the digit passes and the final predicate are tested without a GPU. Plain C++ that nvcc
// also compiles for the device (SPX_HD); no core headers.
//
// Order: core/ports/selection.cc keeps, per KV head, the `take` best middle tokens by score with ties
// preferring the OLDER token. Here every (score, token) becomes one 64-bit key, larger = better:
// the high word is the float's bits made monotone (sign flipped for positives, all bits flipped
// for negatives; -0 folded onto +0 because the host compares them equal), the low word is ~token
// (a smaller token gives a larger key). Keys are distinct, so the take largest keys are exactly
// the host's set. A radix select finds the threshold digit by digit (six passes of 11/11/10 bits
// over each word); a segment is done as soon as the chosen digit's bin holds exactly the number
// still missing, and the selection is then every key with (key & mask) >= prefix.
// NaN scores: the host's comparison is not a strict weak order on NaN, so the set is unspecified
// there; here a NaN (positive sign) ranks above +inf.
#pragma once

#include <cstdint>

#include "gpu/host_device.h"

namespace specontext::gpu::kernels {

inline constexpr int kSelectPasses = 6;
inline constexpr int kSelectMaxBins = 2048;  // 11-bit digits

// Shift and width of pass p (most significant digit first).
SPX_HD int select_pass_shift(int p) {
  constexpr int kShift[kSelectPasses] = {53, 42, 32, 21, 10, 0};
  return kShift[p];
}
SPX_HD int select_pass_bits(int p) { return p == 2 || p == 5 ? 10 : 11; }

SPX_HD uint32_t score_order_bits(float s) {
  uint32_t b = float_bits(s);
  if (b == 0x80000000u) b = 0;  // -0 == +0
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}

SPX_HD uint64_t select_key(float score, uint32_t token) {
  return (static_cast<uint64_t>(score_order_bits(score)) << 32) | static_cast<uint32_t>(~token);
}

// Radix-select state of one segment (one KV head), in device scratch between the passes.
struct SelectState {
  uint64_t prefix;    // threshold bits decided so far
  uint64_t mask;      // which bits are decided
  int64_t remaining;  // keys equal to prefix (under mask) still to take; >= 1 until done
  int32_t done;       // 1: the selection is every key with (key & mask) >= prefix
  int32_t pad;
};

SPX_HD bool select_matches(uint64_t key, const SelectState& st) { return (key & st.mask) == st.prefix; }
SPX_HD uint32_t select_digit(uint64_t key, int p) {
  return static_cast<uint32_t>(key >> select_pass_shift(p)) & ((1u << select_pass_bits(p)) - 1u);
}
SPX_HD bool select_chosen(uint64_t key, const SelectState& st) { return (key & st.mask) >= st.prefix; }

// The state after pass p given the digit d it chose: `above` keys of the matching ones had a
// larger digit (all taken), hist_d had digit d.
SPX_HD SelectState select_advance(const SelectState& st, int p, uint32_t d, int64_t above, int64_t hist_d) {
  SelectState next = st;
  const int shift = select_pass_shift(p);
  next.prefix |= static_cast<uint64_t>(d) << shift;
  next.mask |= static_cast<uint64_t>((1u << select_pass_bits(p)) - 1u) << shift;
  next.remaining = st.remaining - above;
  next.done = hist_d == next.remaining ? 1 : 0;
  return next;
}

}  // namespace specontext::gpu::kernels
