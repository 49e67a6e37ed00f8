// AVX-512 (F/BW/VL) + VNNI kernels: vpdpbusd (u8 × s8 → int32, four products a lane) replaces
// AVX2's maddubs + madd. Signed codes (Q8_0, Q4_0 − 8) move their sign onto the activations;
// the K types' codes are unsigned already (Q6_K's −32 is −32·Σ sc·bsums); sub-block scales
// multiply the int32 lanes, so each super-block's integer sum is exact before it meets a float.
// 32-element blocks go two to a 512-bit vector. Compiled for these extensions by the target
// pragma below, called only where the CPU has them.
// GCC 12 warns that the undefined upper half _mm512_cast*256_*512 leaves is "maybe
// uninitialized" inside its own headers (GCC bug 105593); these casts are always followed by an
// insert of that half.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/quant_gemv_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

namespace specontext::cpu::quant {

namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

inline __m256i decode_q8_0(const uint8_t* blk) { return load256(blk + 2); }
inline __m256i decode_q4_0(const uint8_t* blk) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xF));
  return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
}

template <int M, int kBytes, __m256i (*Decode)(const uint8_t*)>
void tile32(const KernelArgs& a, int64_t r, int64_t i0) {
  __m512 acc[M];
  __m256 acc1[M];
  const ActQ8_0* x[M];
  for (int i = 0; i < M; ++i) {
    acc[i] = _mm512_setzero_ps();
    acc1[i] = _mm256_setzero_ps();
    x[i] = reinterpret_cast<const ActQ8_0*>(a.act + (i0 + i) * a.act_row_bytes);
  }
  const uint8_t* row = a.w + r * a.row_bytes;
  int64_t b = 0;
  for (; b + 2 <= a.nb; b += 2) {
    const uint8_t* blk = row + b * kBytes;
    const float dw0 = f16_at(blk), dw1 = f16_at(blk + kBytes);
    const __m512i w = join(Decode(blk), Decode(blk + kBytes));
    const __m512i aw = _mm512_abs_epi8(w);
    const __mmask64 neg = _mm512_movepi8_mask(w);
    for (int i = 0; i < M; ++i) {
      const __m512i xv = join(load256(x[i][b].qs), load256(x[i][b + 1].qs));
      const __m512i xs = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
      const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xs);
      const __m512 scale = join(_mm256_set1_ps(dw0 * x[i][b].d), _mm256_set1_ps(dw1 * x[i][b + 1].d));
      acc[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), acc[i]);
    }
  }
  if (b < a.nb) {  // an odd last block, 256 bits wide
    const uint8_t* blk = row + b * kBytes;
    const float dw = f16_at(blk);
    const __m256i w = Decode(blk);
    const __m256i aw = _mm256_abs_epi8(w);
    const __mmask32 neg = _mm256_movepi8_mask(w);
    for (int i = 0; i < M; ++i) {
      const __m256i xv = load256(x[i][b].qs);
      const __m256i xs = _mm256_mask_sub_epi8(xv, neg, _mm256_setzero_si256(), xv);
      const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, xs);
      acc1[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[i][b].d), _mm256_cvtepi32_ps(s), acc1[i]);
    }
  }
  for (int i = 0; i < M; ++i) {
    const __m512 t = _mm512_add_ps(acc[i], join(acc1[i], _mm256_setzero_ps()));
    a.y[(i0 + i) * a.ldy + r] = _mm512_reduce_add_ps(t);
  }
}

// Q4_K / Q5_K codes of elements 64j..64j+63 in order (sub-blocks 2j, 2j + 1 in the two halves).
inline __m512i codes_q4_k(const uint8_t* blk, int j, __m256i& /*qh_state*/) {
  const __m256i q = load256(blk + 16 + 32 * j);
  return _mm512_and_si512(join(q, _mm256_srli_epi16(q, 4)), _mm512_set1_epi8(0xF));
}
// qh_state starts as qh and is shifted right by 2 per call: bit 0 of each byte is then bit 2j.
inline __m512i codes_q5_k(const uint8_t* blk, int j, __m256i& qh) {
  const __m256i q = load256(blk + 48 + 32 * j);
  const __m512i nib = _mm512_and_si512(join(q, _mm256_srli_epi16(q, 4)), _mm512_set1_epi8(0xF));
  const __m512i h = _mm512_and_si512(join(qh, _mm256_srli_epi16(qh, 1)), _mm512_set1_epi8(1));
  qh = _mm256_srli_epi16(qh, 2);
  return _mm512_or_si512(nib, _mm512_slli_epi16(h, 4));
}

template <int M, int kBytes, __m512i (*Codes)(const uint8_t*, int, __m256i&)>
void tile_k4(const KernelArgs& a, int64_t r, int64_t i0) {
  __m512 acc[M];
  __m128 accm[M];
  const ActQ8K* x[M];
  for (int i = 0; i < M; ++i) {
    acc[i] = _mm512_setzero_ps();
    accm[i] = _mm_setzero_ps();
    x[i] = reinterpret_cast<const ActQ8K*>(a.act + (i0 + i) * a.act_row_bytes);
  }
  const uint8_t* row = a.w + r * a.row_bytes;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    uint32_t u[4];
    k4_scales_mins_packed(blk + 4, u);
    const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
    const __m512i sc32 = _mm512_cvtepu8_epi32(sm);  // lanes 0..7 scales, 8..15 mins
    const __m128i mins16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
    __m512i isum[M];
    for (int i = 0; i < M; ++i) isum[i] = _mm512_setzero_si512();
    __m256i qh = load256(blk + 16);
    for (int j = 0; j < 4; ++j) {
      const __m512i c = Codes(blk, j, qh);
      const __m512i s = _mm512_permutexvar_epi32(join(_mm256_set1_epi32(2 * j), _mm256_set1_epi32(2 * j + 1)), sc32);
      for (int i = 0; i < M; ++i) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, load512(x[i][b].qs + 64 * j));
        isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(p, s));
      }
    }
    const float d = f16_at(blk), dmin = f16_at(blk + 2);
    for (int i = 0; i < M; ++i) {
      // Σ_j mn[j]·(bsums[2j] + bsums[2j + 1]) in four int32 lanes.
      const __m256i bs = load256(x[i][b].bsums);
      const __m128i pm = _mm_madd_epi16(mins16, _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)));
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(d * x[i][b].d), _mm512_cvtepi32_ps(isum[i]), acc[i]);
      accm[i] = _mm_fmadd_ps(_mm_set1_ps(dmin * x[i][b].d), _mm_cvtepi32_ps(pm), accm[i]);
    }
  }
  for (int i = 0; i < M; ++i) {
    a.y[(i0 + i) * a.ldy + r] =
        _mm512_reduce_add_ps(acc[i]) - _mm512_reduce_add_ps(_mm512_insertf32x4(_mm512_setzero_ps(), accm[i], 0));
  }
}

// Q6_K: four 512-bit vectors of codes 0..63 a super-block; scale g (16 elements) covers 4 lanes.
template <int M>
void tile_q6_k(const KernelArgs& a, int64_t r, int64_t i0) {
  __m512 acc[M];
  const ActQ8K* x[M];
  for (int i = 0; i < M; ++i) {
    acc[i] = _mm512_setzero_ps();
    x[i] = reinterpret_cast<const ActQ8K*>(a.act + (i0 + i) * a.act_row_bytes);
  }
  const uint8_t* row = a.w + r * a.row_bytes;
  const __m512i m4 = _mm512_set1_epi8(0xF), m2 = _mm512_set1_epi8(3);
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * kQ6KBytes;
    const __m512i sc32 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    __m512i isum[M];
    for (int i = 0; i < M; ++i) {
      // −32 · sc[g]·bsums[g] per lane g, exact.
      const __m512i bs = _mm512_cvtepi16_epi32(load256(x[i][b].bsums));
      isum[i] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_mullo_epi32(bs, sc32), 5));
    }
    for (int c = 0; c < 2; ++c) {
      const __m512i ql = load512(blk + 64 * c);
      const __m256i qh = load256(blk + 128 + 32 * c);
      const __m512i h01 = _mm512_and_si512(join(qh, _mm256_srli_epi16(qh, 2)), m2);
      const __m512i h23 = _mm512_and_si512(join(_mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6)), m2);
      const __m512i v[2] = {
          _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(h01, 4)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), _mm512_slli_epi16(h23, 4)),
      };
      for (int t = 0; t < 2; ++t) {
        const int vi = 2 * c + t;  // elements 64vi..64vi+63: scales 4vi..4vi+3, four lanes each
        const __m512i idx = _mm512_set_epi32(4 * vi + 3, 4 * vi + 3, 4 * vi + 3, 4 * vi + 3, 4 * vi + 2, 4 * vi + 2,
                                             4 * vi + 2, 4 * vi + 2, 4 * vi + 1, 4 * vi + 1, 4 * vi + 1, 4 * vi + 1,
                                             4 * vi, 4 * vi, 4 * vi, 4 * vi);
        const __m512i s = _mm512_permutexvar_epi32(idx, sc32);
        for (int i = 0; i < M; ++i) {
          const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[t], load512(x[i][b].qs + 64 * vi));
          isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(p, s));
        }
      }
    }
    const float d = f16_at(blk + 208);
    for (int i = 0; i < M; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(d * x[i][b].d), _mm512_cvtepi32_ps(isum[i]), acc[i]);
    }
  }
  for (int i = 0; i < M; ++i) a.y[(i0 + i) * a.ldy + r] = _mm512_reduce_add_ps(acc[i]);
}

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

const Kernels& avx512_kernels() {
  static constexpr Kernels k{rows<Q8_0>, rows<Q4_0>, rows<Q4K>, rows<Q5K>, rows<Q6K>};
  return k;
}

}  // namespace specontext::cpu::quant

#pragma GCC pop_options
#pragma GCC diagnostic pop
