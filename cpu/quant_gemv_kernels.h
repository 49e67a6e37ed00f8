// Internal to cpu/quant_gemv*.cc: the quantised activation blocks and the per-path kernel
// tables. Layouts of the weight blocks follow ggml-common.h (block_q8_0, block_q4_0,
// block_q4_K, block_q5_K, block_q6_K).
#pragma once

#include <cstdint>
#include <cstring>

namespace specontext::cpu::quant {

// ggml's block sizes and bytes.
inline constexpr int kQ8_0Bytes = 34;   // f16 d, int8 qs[32]
inline constexpr int kQ4_0Bytes = 18;   // f16 d, uint8 qs[16] (low nibbles: elements 0..15)
inline constexpr int kQ4KBytes = 144;   // f16 d, f16 dmin, scales[12], qs[128]
inline constexpr int kQ5KBytes = 176;   // f16 d, f16 dmin, scales[12], qh[32], qs[128]
inline constexpr int kQ6KBytes = 210;   // ql[128], qh[64], int8 scales[16], f16 d

// A block_q8_0 of activations with its scale already widened (ggml stores f16 and converts
// it before use: d is that f32 value) and the sum of its codes (for Q4_0's -8 offset).
struct ActQ8_0 {
  float d;
  int32_t sum;
  int8_t qs[32];
};

// ggml's block_q8_K: f32 d, 256 codes, sums of each 16.
struct ActQ8K {
  float d;
  int16_t bsums[16];
  int8_t qs[256];
};

// ggml's quantize_row_q8_0_ref / quantize_row_q8_K_ref on one block of 32 / 256 elements (zero-padded
// past `valid`); a block holding a non-finite value gets d = NaN and codes 0, so every product with it
// is NaN. What quant_gemv does to activations; the CUDA quantisers' tests compare against these.
void quantize_block_q8_0(const float* x, int64_t valid, ActQ8_0* out);
void quantize_block_q8_k(const float* x, int64_t valid, ActQ8K* out);

struct KernelArgs {
  const uint8_t* w;      // row 0 of the weights
  int64_t row_bytes;     // bytes per weight row
  int64_t nb;            // blocks per row (32-element or 256-element)
  const uint8_t* act;    // quantised activations: m rows of nb ActQ8_0 or ActQ8K
  int64_t act_row_bytes;
  int64_t m;
  float* y;              // y[i * ldy + r]
  int64_t ldy;
};

// Computes outputs r in [r0, r1) for every activation row.
using RowsKernel = void (*)(const KernelArgs& args, int64_t r0, int64_t r1);

struct Kernels {
  RowsKernel q8_0, q4_0, q4_k, q5_k, q6_k;
};

const Kernels& scalar_kernels();
const Kernels& avx2_kernels();    // only called where the CPU has AVX2, FMA and F16C
const Kernels& avx512_kernels();  // only called where it has AVX-512 F/BW/VL and VNNI too

// Q4_K / Q5_K 6-bit scales and mins of sub-blocks 0..7 (ggml's get_scale_min_k4).
inline void k4_scales_mins(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
      mn[j] = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
  }
}

// The same 8 scales and 8 mins as bytes 0..7 and 8..15 of u (ggml's utmp shuffle in
// ggml_vec_dot_q4_K_q8_K), for the SIMD paths.
inline void k4_scales_mins_packed(const uint8_t* q, uint32_t u[4]) {
  constexpr uint32_t kMask1 = 0x3f3f3f3f, kMask2 = 0x0f0f0f0f, kMask3 = 0x03030303;
  std::memcpy(u, q, 12);
  u[3] = ((u[2] >> 4) & kMask2) | (((u[1] >> 6) & kMask3) << 4);
  const uint32_t aux = u[1] & kMask1;
  u[1] = (u[2] & kMask2) | (((u[0] >> 6) & kMask3) << 4);
  u[2] = aux;
  u[0] &= kMask1;
}

}  // namespace specontext::cpu::quant
