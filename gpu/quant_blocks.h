// The block decoding of the quantised-weight kernels (gpu/kernels_quant.cu), shared with their host
// mirrors (tests/gpu/quant_plan_test.cc) so that the lane mapping, the block strides and the code
// unpacking are checked without a GPU. Plain C++ with SPX_HD functions; no core headers. Layouts
// of ggml-common.h (block_q8_0, block_q4_0, block_q4_K, block_q5_K, block_q6_K); the integer block
// sums are ggml_vec_dot_*'s, the element values ggml's dequantize_row_*'s.
#pragma once

#include <cstdint>
#include <cstring>

#include "gpu/host_device.h"
#include "gpu/kernels.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace specontext::gpu::kernels::quant {

// Elements and bytes of one block.
SPX_HD constexpr int block_elems(QuantType t) { return t == QuantType::kQ8_0 || t == QuantType::kQ4_0 ? 32 : 256; }
SPX_HD constexpr int block_bytes(QuantType t) {
  switch (t) {
    case QuantType::kQ8_0: return 34;   // f16 d, int8 qs[32]
    case QuantType::kQ4_0: return 18;   // f16 d, uint8 qs[16]
    case QuantType::kQ4_K: return 144;  // f16 d, f16 dmin, scales[12], qs[128]
    case QuantType::kQ5_K: return 176;  // f16 d, f16 dmin, scales[12], qh[32], qs[128]
    default: return 210;                // Q6_K: ql[128], qh[64], int8 scales[16], f16 d
  }
}
// Lanes of a warp that share one block in the GEMV kernel (each lane 8 elements of it).
SPX_HD constexpr int lanes_per_block(QuantType t) { return block_elems(t) / 8; }

// ---- loads (every weight offset below is even; the K-type words at multiples of 4) ----

SPX_HD uint16_t load_u16(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint16_t*>(p);
#else
  uint16_t v = 0;
  std::memcpy(&v, p, 2);
  return v;
#endif
}
// 4 bytes at a 4-byte aligned address.
SPX_HD uint32_t load_u32(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t v = 0;
  std::memcpy(&v, p, 4);
  return v;
#endif
}
// 4 bytes at a 2-byte aligned address (Q8_0, Q4_0 and Q6_K blocks are 34, 18 and 210 bytes).
SPX_HD uint32_t load_u32_a2(const uint8_t* p) {
  return static_cast<uint32_t>(load_u16(p)) | (static_cast<uint32_t>(load_u16(p + 2)) << 16);
}

// f16 bits to f32 (exact).
SPX_HD float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant · 2^-24, exact
    return sign != 0 ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
#endif
}

// Σ of the products of the 4 signed bytes of a and b (__dp4a on the device).
SPX_HD int32_t dot4(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __dp4a(static_cast<int>(a), static_cast<int>(b), 0);
#else
  int32_t s = 0;
  for (int k = 0; k < 4; ++k) {
    s += static_cast<int32_t>(static_cast<int8_t>(a >> (8 * k))) * static_cast<int8_t>(b >> (8 * k));
  }
  return s;
#endif
}

// Float products and differences rounded once each (no FMA contraction: ggml's dequantisation).
SPX_HD float fmul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SPX_HD float fsub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// Q4_K / Q5_K 6-bit scale and min of sub-block j (ggml's get_scale_min_k4); s = block + 4.
SPX_HD void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One lane's share of a block: 8 codes as two words of 4 bytes (each multiplying the 4 activation
// codes at block offsets e0 and e1), with their sub-block scales and mins and the code offset
// (Q4_0 −8, Q6_K −32; the codes in w0 / w1 are stored unsigned then). The block's contribution to a
// dot product is d·dx·Σ sc·(w·x + off·Σx) − dmin·dx·Σ mn·Σx over the lanes sharing it.
struct LaneWords {
  uint32_t w0 = 0, w1 = 0;
  int e0 = 0, e1 = 0;
  int sc0 = 1, sc1 = 1;
  int mn0 = 0, mn1 = 0;
  int off = 0;
  float d = 0.0f;
  float dmin = 0.0f;
};

// Lane t (0 .. lanes_per_block − 1) of block `blk`.
SPX_HD LaneWords lane_words(QuantType type, const uint8_t* blk, int t) {
  LaneWords L;
  switch (type) {
    case QuantType::kQ8_0: {  // elements 8t .. 8t+7
      L.d = half_to_float(load_u16(blk));
      L.w0 = load_u32_a2(blk + 2 + 8 * t);
      L.w1 = load_u32_a2(blk + 6 + 8 * t);
      L.e0 = 8 * t;
      L.e1 = 8 * t + 4;
      break;
    }
    case QuantType::kQ4_0: {  // qs[4t .. 4t+3]: low nibbles elements 4t.., high 16 + 4t..
      L.d = half_to_float(load_u16(blk));
      const uint32_t q = load_u32_a2(blk + 2 + 4 * t);
      L.w0 = q & 0x0F0F0F0Fu;
      L.w1 = (q >> 4) & 0x0F0F0F0Fu;
      L.e0 = 4 * t;
      L.e1 = 16 + 4 * t;
      L.off = -8;
      break;
    }
    case QuantType::kQ4_K:
    case QuantType::kQ5_K: {  // chunk j of 64: qs[32j + l0 ..]: low nibbles sub-block 2j, high 2j+1
      const int j = t >> 3;
      const int l0 = 4 * (t & 7);
      L.d = half_to_float(load_u16(blk));
      L.dmin = half_to_float(load_u16(blk + 2));
      const bool q5 = type == QuantType::kQ5_K;
      const uint32_t q = load_u32(blk + (q5 ? 48 : 16) + 32 * j + l0);
      L.w0 = q & 0x0F0F0F0Fu;
      L.w1 = (q >> 4) & 0x0F0F0F0Fu;
      if (q5) {  // fifth bit of element 64j + l (+32): bit 2j (2j+1) of qh[l]
        const uint32_t h = load_u32(blk + 16 + l0);
        L.w0 |= ((h >> (2 * j)) & 0x01010101u) << 4;
        L.w1 |= ((h >> (2 * j + 1)) & 0x01010101u) << 4;
      }
      L.e0 = 64 * j + l0;
      L.e1 = 64 * j + 32 + l0;
      scale_min_k4(blk + 4, 2 * j, L.sc0, L.mn0);
      scale_min_k4(blk + 4, 2 * j + 1, L.sc1, L.mn1);
      break;
    }
    default: {  // Q6_K: half c, quarter pair s: elements 128c + 32s + l0.. (low) and +64 (high)
      const int c = t >> 4;
      const int s = (t >> 3) & 1;
      const int l0 = 4 * (t & 7);
      L.d = half_to_float(load_u16(blk + 208));
      const uint32_t ql = load_u32_a2(blk + 64 * c + 32 * s + l0);
      const uint32_t qh = load_u32_a2(blk + 128 + 32 * c + l0);
      L.w0 = (ql & 0x0F0F0F0Fu) | (((qh >> (2 * s)) & 0x03030303u) << 4);
      L.w1 = ((ql >> 4) & 0x0F0F0F0Fu) | (((qh >> (2 * s + 4)) & 0x03030303u) << 4);
      L.e0 = 128 * c + 32 * s + l0;
      L.e1 = L.e0 + 64;
      L.sc0 = static_cast<int8_t>(blk[192 + L.e0 / 16]);
      L.sc1 = static_cast<int8_t>(blk[192 + L.e1 / 16]);
      L.off = -32;
      break;
    }
  }
  return L;
}

// The lane's share of one block's dot product with the activation block `xq` (its block's codes,
// 4-byte aligned) of scale dx.
SPX_HD float lane_dot(const LaneWords& L, const int8_t* xq, float dx) {
  const uint32_t x0 = load_u32(reinterpret_cast<const uint8_t*>(xq) + L.e0);
  const uint32_t x1 = load_u32(reinterpret_cast<const uint8_t*>(xq) + L.e1);
  const int32_t u0 = dot4(0x01010101u, x0);
  const int32_t u1 = dot4(0x01010101u, x1);
  const int32_t sumq = L.sc0 * (dot4(L.w0, x0) + L.off * u0) + L.sc1 * (dot4(L.w1, x1) + L.off * u1);
  const int32_t summ = L.mn0 * u0 + L.mn1 * u1;
  return (L.d * dx) * static_cast<float>(sumq) - (L.dmin * dx) * static_cast<float>(summ);
}

// Element e of a block, as ggml's dequantize_row_* computes it (order of operations included).
SPX_HD float dequant_element(QuantType type, const uint8_t* blk, int e) {
  switch (type) {
    case QuantType::kQ8_0:
      return fmul_rn(static_cast<float>(static_cast<int8_t>(blk[2 + e])), half_to_float(load_u16(blk)));
    case QuantType::kQ4_0: {
      const int b = blk[2 + (e & 15)];
      const int q = (e < 16 ? (b & 0xF) : (b >> 4)) - 8;
      return fmul_rn(static_cast<float>(q), half_to_float(load_u16(blk)));
    }
    case QuantType::kQ4_K:
    case QuantType::kQ5_K: {
      const int j = e >> 6;
      const int hi = (e >> 5) & 1;
      const int l = e & 31;
      int sc = 0, mn = 0;
      scale_min_k4(blk + 4, 2 * j + hi, sc, mn);
      const float d1 = fmul_rn(half_to_float(load_u16(blk)), static_cast<float>(sc));
      const float m1 = fmul_rn(half_to_float(load_u16(blk + 2)), static_cast<float>(mn));
      int q = 0;
      if (type == QuantType::kQ4_K) {
        const int b = blk[16 + 32 * j + l];
        q = hi ? (b >> 4) : (b & 0xF);
      } else {
        const int b = blk[48 + 32 * j + l];
        q = (hi ? (b >> 4) : (b & 0xF)) + (((blk[16 + l] >> (2 * j + hi)) & 1) << 4);
      }
      return fsub_rn(fmul_rn(d1, static_cast<float>(q)), m1);
    }
    default: {  // Q6_K
      const int c = e >> 7;
      const int quarter = (e >> 5) & 3;
      const int l = e & 31;
      const uint8_t* ql = blk + 64 * c;
      const uint8_t* qh = blk + 128 + 32 * c;
      const int lo = (quarter & 1) ? ql[l + 32] : ql[l];
      const int nib = (quarter & 2) ? (lo >> 4) : (lo & 0xF);
      const int q = (nib | (((qh[l] >> (2 * quarter)) & 3) << 4)) - 32;
      const int sc = static_cast<int8_t>(blk[192 + 8 * c + 2 * quarter + l / 16]);
      return fmul_rn(fmul_rn(half_to_float(load_u16(blk + 208)), static_cast<float>(sc)), static_cast<float>(q));
    }
  }
}

}  // namespace specontext::gpu::kernels::quant
