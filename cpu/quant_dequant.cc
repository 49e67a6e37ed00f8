#include "cpu/quant_dequant.h"

#include <cstring>
#include <string>

#include "core/base/dtype.h"
#include "cpu/quant_gemv.h"
#include "cpu/quant_gemv_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define SPX_DQ_ISA_VARIANTS 1
#else
#define SPX_DQ_ISA_VARIANTS 0
#endif
#define SPX_DQ_INLINE inline __attribute__((always_inline))

namespace specontext::cpu {

namespace {

SPX_DQ_INLINE float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// One block each, in ggml's dequantize_row_* order of operations (ggml-quants.c).
SPX_DQ_INLINE void block_q8_0(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  const auto* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(q[j]) * d;
}

SPX_DQ_INLINE void block_q4_0(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0xF) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

SPX_DQ_INLINE void block_q4_k(const uint8_t* b, float* y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  uint8_t sc[8], mn[8];
  quant::k4_scales_mins(b + 4, sc, mn);
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j) {
    const float d1 = d * static_cast<float>(sc[2 * j]), m1 = dmin * static_cast<float>(mn[2 * j]);
    const float d2 = d * static_cast<float>(sc[2 * j + 1]), m2 = dmin * static_cast<float>(mn[2 * j + 1]);
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    y += 64;
  }
}

SPX_DQ_INLINE void block_q5_k(const uint8_t* b, float* y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  uint8_t sc[8], mn[8];
  quant::k4_scales_mins(b + 4, sc, mn);
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int j = 0; j < 4; ++j) {
    const float d1 = d * static_cast<float>(sc[2 * j]), m1 = dmin * static_cast<float>(mn[2 * j]);
    const float d2 = d * static_cast<float>(sc[2 * j + 1]), m2 = dmin * static_cast<float>(mn[2 * j + 1]);
    const int s1 = 2 * j, s2 = 2 * j + 1;
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * static_cast<float>((ql[l] & 0xF) + (((qh[l] >> s1) & 1) << 4)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      y[l + 32] = d2 * static_cast<float>((ql[l] >> 4) + (((qh[l] >> s2) & 1) << 4)) - m2;
    }
    ql += 32;
    y += 64;
  }
}

SPX_DQ_INLINE void block_q6_k(const uint8_t* b, float* y) {
  const float d = f16_at(b + 208);
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int n = 0; n < 2; ++n) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = static_cast<int>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = static_cast<int>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = static_cast<int>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = static_cast<int>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

template <int kBlock, int kBytes, void (*Decode)(const uint8_t*, float*)>
SPX_DQ_INLINE void blocks_body(const uint8_t* src, int64_t n_blocks, float* dst) {
  for (int64_t i = 0; i < n_blocks; ++i) Decode(src + i * kBytes, dst + i * kBlock);
}

// The five types' loops over consecutive blocks, compiled for one ISA.
struct BlockLoops {
  void (*q8_0)(const uint8_t*, int64_t, float*);
  void (*q4_0)(const uint8_t*, int64_t, float*);
  void (*q4_k)(const uint8_t*, int64_t, float*);
  void (*q5_k)(const uint8_t*, int64_t, float*);
  void (*q6_k)(const uint8_t*, int64_t, float*);
};

#define SPX_DQ_LOOPS(suffix, attr)                                                                                 \
  attr void q8_0_##suffix(const uint8_t* s, int64_t n, float* d) { blocks_body<32, quant::kQ8_0Bytes, block_q8_0>(s, n, d); } \
  attr void q4_0_##suffix(const uint8_t* s, int64_t n, float* d) { blocks_body<32, quant::kQ4_0Bytes, block_q4_0>(s, n, d); } \
  attr void q4_k_##suffix(const uint8_t* s, int64_t n, float* d) { blocks_body<256, quant::kQ4KBytes, block_q4_k>(s, n, d); } \
  attr void q5_k_##suffix(const uint8_t* s, int64_t n, float* d) { blocks_body<256, quant::kQ5KBytes, block_q5_k>(s, n, d); } \
  attr void q6_k_##suffix(const uint8_t* s, int64_t n, float* d) { blocks_body<256, quant::kQ6KBytes, block_q6_k>(s, n, d); } \
  constexpr BlockLoops kLoops_##suffix{q8_0_##suffix, q4_0_##suffix, q4_k_##suffix, q5_k_##suffix, q6_k_##suffix};

SPX_DQ_LOOPS(base, )
#if SPX_DQ_ISA_VARIANTS
SPX_DQ_LOOPS(avx2, __attribute__((target("avx2,fma,f16c,bmi2"))))
SPX_DQ_LOOPS(avx512, __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi2"))))
#endif

const BlockLoops& best_loops() {
#if SPX_DQ_ISA_VARIANTS
  static const BlockLoops& loops = [] () -> const BlockLoops& {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    return avx512 ? kLoops_avx512 : avx2 ? kLoops_avx2 : kLoops_base;
  }();
  return loops;
#else
  return kLoops_base;
#endif
}

}  // namespace

Status dequantize_rows(uint32_t ggml_type, const void* src, int64_t n_rows, int64_t cols, float* dst) {
  const BlockLoops& k = best_loops();
  void (*loop)(const uint8_t*, int64_t, float*) = nullptr;
  int64_t block = 0;
  switch (ggml_type) {
    case 8: loop = k.q8_0; block = 32; break;
    case 2: loop = k.q4_0; block = 32; break;
    case 12: loop = k.q4_k; block = 256; break;
    case 13: loop = k.q5_k; block = 256; break;
    case 14: loop = k.q6_k; block = 256; break;
    default:
      return invalid_argument("dequantize_rows: ggml type " + std::to_string(ggml_type) +
                              " is not Q8_0, Q4_0, Q4_K, Q5_K or Q6_K");
  }
  if (n_rows <= 0) return Status::ok();
  if (src == nullptr || dst == nullptr) return invalid_argument("dequantize_rows: null source or destination");
  if (cols <= 0 || cols % block != 0) {
    return invalid_argument("dequantize_rows: " + std::to_string(cols) + " columns are not whole " +
                            std::to_string(block) + "-element blocks");
  }
  // Rows are contiguous whole blocks, so the matrix is one run of blocks.
  loop(static_cast<const uint8_t*>(src), n_rows * (cols / block), dst);
  return Status::ok();
}

}  // namespace specontext::cpu
