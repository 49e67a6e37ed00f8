// AVX2 (+FMA, F16C) kernels: ggml's x86 scheme (sign trick + maddubs for signed codes, maddubs
// then madd by the sub-block scale for the K types), one weight row decoded once per block and
// used by a tile of up to 4 activation rows. Compiled for AVX2 by the target pragma below (only
// this file's own functions: the standard headers come first), called only where the CPU has it.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/quant_gemv_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace specontext::cpu::quant {

namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum(__m128 r) {
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
inline float hsum(__m256 v) { return hsum(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Σ pairs of w·x for signed w and x (|w| ≤ 128, |x| ≤ 127: no int16 saturation).
inline __m256i dot_i8(__m256i w, __m256i x) {
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

inline __m256i decode_q8_0(const uint8_t* blk) { return load(blk + 2); }
inline __m256i decode_q4_0(const uint8_t* blk) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xF));
  return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
}

template <int M, int kBytes, __m256i (*Decode)(const uint8_t*)>
void tile32(const KernelArgs& a, int64_t r, int64_t i0) {
  __m256 acc[M];
  const ActQ8_0* x[M];
  for (int i = 0; i < M; ++i) {
    acc[i] = _mm256_setzero_ps();
    x[i] = reinterpret_cast<const ActQ8_0*>(a.act + (i0 + i) * a.act_row_bytes);
  }
  const uint8_t* row = a.w + r * a.row_bytes;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    const float dw = f16_at(blk);
    const __m256i w = Decode(blk);
    for (int i = 0; i < M; ++i) {
      const __m256i s = dot_i8(w, load(x[i][b].qs));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[i][b].d), _mm256_cvtepi32_ps(s), acc[i]);
    }
  }
  for (int i = 0; i < M; ++i) a.y[(i0 + i) * a.ldy + r] = hsum(acc[i]);
}

// Q4_K / Q5_K: codes of the 64 elements 64j..64j+63 as two vectors (sub-blocks 2j and 2j + 1).
struct Codes64 {
  __m256i lo, hi;
};
inline Codes64 codes_q4_k(const uint8_t* blk, int j, __m256i& /*qh_state*/) {
  const __m256i q = load(blk + 16 + 32 * j);
  const __m256i m = _mm256_set1_epi8(0xF);
  return {_mm256_and_si256(q, m), _mm256_and_si256(_mm256_srli_epi16(q, 4), m)};
}
// qh_state starts as qh and is shifted right by 2 per call: bit 0 of each byte is then bit 2j.
inline Codes64 codes_q5_k(const uint8_t* blk, int j, __m256i& qh) {
  const __m256i q = load(blk + 48 + 32 * j);
  const __m256i m = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  const __m256i hlo = _mm256_slli_epi16(_mm256_and_si256(qh, one), 4);
  const __m256i hhi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4);
  qh = _mm256_srli_epi16(qh, 2);
  return {_mm256_or_si256(_mm256_and_si256(q, m), hlo),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m), hhi)};
}

template <int M, int kBytes, Codes64 (*Codes)(const uint8_t*, int, __m256i&)>
void tile_k4(const KernelArgs& a, int64_t r, int64_t i0) {
  __m256 acc[M];
  __m128 accm[M];
  const ActQ8K* x[M];
  for (int i = 0; i < M; ++i) {
    acc[i] = _mm256_setzero_ps();
    accm[i] = _mm_setzero_ps();
    x[i] = reinterpret_cast<const ActQ8K*>(a.act + (i0 + i) * a.act_row_bytes);
  }
  const uint8_t* row = a.w + r * a.row_bytes;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    uint32_t u[4];
    k4_scales_mins_packed(blk + 4, u);
    const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  // scales 0..7, both halves
    const __m128i mins16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
    __m256i isum[M];
    for (int i = 0; i < M; ++i) isum[i] = _mm256_setzero_si256();
    __m256i qh = load(blk + 16);
    for (int j = 0; j < 4; ++j) {
      const Codes64 c = Codes(blk, j, qh);
      const __m256i slo = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>((4 * j + 1) << 8 | 4 * j)));
      const __m256i shi = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>((4 * j + 3) << 8 | (4 * j + 2))));
      for (int i = 0; i < M; ++i) {
        const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(c.lo, load(x[i][b].qs + 64 * j)), slo);
        const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(c.hi, load(x[i][b].qs + 64 * j + 32)), shi);
        isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(plo, phi));
      }
    }
    const float d = f16_at(blk), dmin = f16_at(blk + 2);
    for (int i = 0; i < M; ++i) {
      // Σ_j mn[j]·(bsums[2j] + bsums[2j + 1]) in four int32 lanes.
      const __m256i bs = load(x[i][b].bsums);
      const __m128i pm = _mm_madd_epi16(mins16, _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[i][b].d), _mm256_cvtepi32_ps(isum[i]), acc[i]);
      accm[i] = _mm_fmadd_ps(_mm_set1_ps(dmin * x[i][b].d), _mm_cvtepi32_ps(pm), accm[i]);
    }
  }
  for (int i = 0; i < M; ++i) a.y[(i0 + i) * a.ldy + r] = hsum(acc[i]) - hsum(accm[i]);
}

// Q6_K: codes 0..63 (ggml's −32 offset applied as −32·Σ sc·bsums), 8 vectors of 32 elements.
template <int M>
void tile_q6_k(const KernelArgs& a, int64_t r, int64_t i0) {
  __m256 acc[M];
  const ActQ8K* x[M];
  for (int i = 0; i < M; ++i) {
    acc[i] = _mm256_setzero_ps();
    x[i] = reinterpret_cast<const ActQ8K*>(a.act + (i0 + i) * a.act_row_bytes);
  }
  const uint8_t* row = a.w + r * a.row_bytes;
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * kQ6KBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    __m256i isum[M];
    for (int i = 0; i < M; ++i) {
      // −32 · Σ_g sc[g]·bsums[g], exact in int32 lanes.
      isum[i] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                 _mm256_slli_epi32(_mm256_madd_epi16(load(x[i][b].bsums), sc16), 5));
    }
    for (int c = 0; c < 2; ++c) {
      const __m256i ql0 = load(blk + 64 * c), ql1 = load(blk + 64 * c + 32), qh = load(blk + 128 + 32 * c);
      const __m256i g[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)),
          _mm256_or_si256(_mm256_and_si256(ql1, m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4)),
      };
      for (int t = 0; t < 4; ++t) {
        const int gi = 4 * c + t;  // elements 32gi..32gi+31: scales 2gi, 2gi+1
        const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[2 * gi + 1]), _mm_set1_epi16(sc[2 * gi]));
        for (int i = 0; i < M; ++i) {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(g[t], load(x[i][b].qs + 32 * gi)), s);
          isum[i] = _mm256_add_epi32(isum[i], p);
        }
      }
    }
    const float d = f16_at(blk + 208);
    for (int i = 0; i < M; ++i) {
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[i][b].d), _mm256_cvtepi32_ps(isum[i]), acc[i]);
    }
  }
  for (int i = 0; i < M; ++i) a.y[(i0 + i) * a.ldy + r] = hsum(acc[i]);
}

// Rows r0..r1, activation rows in tiles of 4 (the weight row stays in L1 between tiles).
template <template <int> class Tile>
void rows(const KernelArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t i0 = 0; i0 < a.m; i0 += 4) {
      switch (a.m - i0) {
        case 1: Tile<1>::run(a, r, i0); break;
        case 2: Tile<2>::run(a, r, i0); break;
        case 3: Tile<3>::run(a, r, i0); break;
        default: Tile<4>::run(a, r, i0); break;
      }
    }
  }
}

template <int M> struct Q8_0 { static void run(const KernelArgs& a, int64_t r, int64_t i) { tile32<M, kQ8_0Bytes, decode_q8_0>(a, r, i); } };
template <int M> struct Q4_0 { static void run(const KernelArgs& a, int64_t r, int64_t i) { tile32<M, kQ4_0Bytes, decode_q4_0>(a, r, i); } };
template <int M> struct Q4K { static void run(const KernelArgs& a, int64_t r, int64_t i) { tile_k4<M, kQ4KBytes, codes_q4_k>(a, r, i); } };
template <int M> struct Q5K { static void run(const KernelArgs& a, int64_t r, int64_t i) { tile_k4<M, kQ5KBytes, codes_q5_k>(a, r, i); } };
template <int M> struct Q6K { static void run(const KernelArgs& a, int64_t r, int64_t i) { tile_q6_k<M>(a, r, i); } };

}  // namespace

const Kernels& avx2_kernels() {
  static constexpr Kernels k{rows<Q8_0>, rows<Q4_0>, rows<Q4K>, rows<Q5K>, rows<Q6K>};
  return k;
}

}  // namespace specontext::cpu::quant

#pragma GCC pop_options
