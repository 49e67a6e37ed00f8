// The scalar reference: each block's codes decoded to integers as ggml's scalar
// ggml_vec_dot_*_q8_* do, the integer dot product exact, the block's float scale factor applied
// as ggml applies it, and the blocks summed in double. The SIMD paths are tested against this.
#include <cstring>

#include "core/base/dtype.h"
#include "cpu/quant_gemv_kernels.h"

namespace specontext::cpu::quant {

namespace {

float f16_at(const uint8_t* p) {
  uint16_t h = 0;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

const ActQ8_0* act_q8_0(const KernelArgs& a, int64_t i) {
  return reinterpret_cast<const ActQ8_0*>(a.act + i * a.act_row_bytes);
}
const ActQ8K* act_q8k(const KernelArgs& a, int64_t i) {
  return reinterpret_cast<const ActQ8K*>(a.act + i * a.act_row_bytes);
}

// y[i][r] = Σ_b dot(block b of weight row r, block b of activation row i), summed in double,
// for the weight rows [r0, r1) and every activation row.
template <typename Act, typename Dot>
void dot_rows(const KernelArgs& a, int64_t r0, int64_t r1, int64_t block_bytes,
              const Act* (*act)(const KernelArgs&, int64_t), Dot dot) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = a.w + r * a.row_bytes;
    for (int64_t i = 0; i < a.m; ++i) {
      const Act* x = act(a, i);
      double sum = 0.0;
      for (int64_t b = 0; b < a.nb; ++b) sum += dot(row + b * block_bytes, x[b]);
      a.y[i * a.ldy + r] = static_cast<float>(sum);
    }
  }
}

// One 32-element block: dw · dx · Σ w·x (ggml_vec_dot_q8_0_q8_0, ggml_vec_dot_q4_0_q8_0).
double block32(float dw, const int8_t* w, const ActQ8_0& x) {
  int32_t s = 0;
  for (int j = 0; j < 32; ++j) s += static_cast<int32_t>(w[j]) * x.qs[j];
  return static_cast<double>(dw * x.d) * s;
}

void decode_q8_0(const uint8_t* blk, int8_t* w) { std::memcpy(w, blk + 2, 32); }
void decode_q4_0(const uint8_t* blk, int8_t* w) {
  for (int j = 0; j < 16; ++j) {
    w[j] = static_cast<int8_t>((blk[2 + j] & 0xF) - 8);
    w[j + 16] = static_cast<int8_t>((blk[2 + j] >> 4) - 8);
  }
}

template <int kBytes, void (*Decode)(const uint8_t*, int8_t*)>
void rows32(const KernelArgs& a, int64_t r0, int64_t r1) {
  int8_t w[32];
  dot_rows(a, r0, r1, kBytes, act_q8_0, [&](const uint8_t* blk, const ActQ8_0& x) {
    Decode(blk, w);
    return block32(f16_at(blk), w, x);
  });
}

// Q4_K / Q5_K super-block: codes 0..15 (0..31), sub-block j of 32 has scale sc[j] and min mn[j]:
// d·dx·Σ_j sc[j]·(w_j·x_j) − dmin·dx·Σ_j mn[j]·Σ x_j (ggml_vec_dot_q4_K_q8_K).
double block_k4(const uint8_t* blk, const uint8_t* codes, const ActQ8K& x) {
  uint8_t sc[8], mn[8];
  k4_scales_mins(blk + 4, sc, mn);
  int32_t sumq = 0, summ = 0;
  for (int j = 0; j < 8; ++j) {
    int32_t s = 0;
    for (int l = 0; l < 32; ++l) s += static_cast<int32_t>(codes[32 * j + l]) * x.qs[32 * j + l];
    sumq += sc[j] * s;
    summ += mn[j] * (x.bsums[2 * j] + x.bsums[2 * j + 1]);
  }
  const float d = f16_at(blk) * x.d;
  const float dmin = f16_at(blk + 2) * x.d;
  return static_cast<double>(d) * sumq - static_cast<double>(dmin) * summ;
}

void decode_q4_k(const uint8_t* blk, uint8_t* codes) {
  const uint8_t* q = blk + 16;
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      codes[64 * j + l] = q[32 * j + l] & 0xF;
      codes[64 * j + 32 + l] = q[32 * j + l] >> 4;
    }
  }
}

void decode_q5_k(const uint8_t* blk, uint8_t* codes) {
  const uint8_t* qh = blk + 16;
  const uint8_t* q = blk + 48;
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      codes[64 * j + l] = static_cast<uint8_t>((q[32 * j + l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4));
      codes[64 * j + 32 + l] =
          static_cast<uint8_t>((q[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
    }
  }
}

template <int kBytes, void (*Decode)(const uint8_t*, uint8_t*)>
void rows_k4(const KernelArgs& a, int64_t r0, int64_t r1) {
  uint8_t codes[256];
  dot_rows(a, r0, r1, kBytes, act_q8k, [&](const uint8_t* blk, const ActQ8K& x) {
    Decode(blk, codes);
    return block_k4(blk, codes, x);
  });
}

// Q6_K super-block: codes −32..31, 16 sub-blocks of 16 with int8 scales:
// d·dx·Σ_g sc[g]·(w_g·x_g) (ggml_vec_dot_q6_K_q8_K).
void decode_q6_k(const uint8_t* blk, int8_t* w) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  for (int c = 0; c < 2; ++c) {
    for (int l = 0; l < 32; ++l) {
      int8_t* o = w + 128 * c;
      o[l] = static_cast<int8_t>(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
      o[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
      o[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      o[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
    ql += 64;
    qh += 32;
  }
}

void rows_q6_k(const KernelArgs& a, int64_t r0, int64_t r1) {
  int8_t w[256];
  dot_rows(a, r0, r1, kQ6KBytes, act_q8k, [&](const uint8_t* blk, const ActQ8K& x) {
    decode_q6_k(blk, w);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    int32_t sumq = 0;
    for (int g = 0; g < 16; ++g) {
      int32_t s = 0;
      for (int l = 0; l < 16; ++l) s += static_cast<int32_t>(w[16 * g + l]) * x.qs[16 * g + l];
      sumq += sc[g] * s;
    }
    const float d = f16_at(blk + 208) * x.d;
    return static_cast<double>(d) * sumq;
  });
}

}  // namespace

const Kernels& scalar_kernels() {
  static constexpr Kernels k{rows32<kQ8_0Bytes, decode_q8_0>, rows32<kQ4_0Bytes, decode_q4_0>,
                             rows_k4<kQ4KBytes, decode_q4_k>, rows_k4<kQ5KBytes, decode_q5_k>, rows_q6_k};
  return k;
}

}  // namespace specontext::cpu::quant
