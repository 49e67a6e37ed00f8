// AVX-512 (F/BW/VL) + VNNI kernels. Compiled for these extensions by the target pragma below,
// called only where the CPU has them.
//
// Design (issue #30: the 4/5/6-bit types were bound by unpacking, not bytes):
// - Weight codes stay unsigned and go straight into vpdpbusd (u8 × s8 → int32, four products a
//   lane); each type's offset is moved onto the activations, computed once per activation block
//   (per activation row and step): Q4_0's −8 and Q8_0's +128 bias (codes XOR 0x80
//   are unsigned) start the dpbusd accumulator at −c·Σx; Q4_K/Q5_K's mins are Σ mn·bsums, Q6_K's
//   −32 is −32·Σ sc·bsums.
// - K-type sub-block scales multiply the int32 lanes with vpdpwssd (a lane's dot product of 4
//   codes fits int16, the scale sits in the lane's low half), so a super-block's integer sum is
//   exact and meets a float once.
// - Activation rows go two at a time (M = 2): each weight block is decoded once per pair. Every
//   (row, activation row) pair runs the same instructions in the same order whatever the tile,
//   so results do not depend on where a row split falls or on m.
// - Q4_0/Q8_0 go four 32-blocks a step (their four f16 scales picked with one vpermw);
//   Q4_K/Q5_K codes are arranged two sub-blocks a vector ([0|2], [1|3], [4|6], [5|7]) so that a
//   64-byte load of nibbles gives two vectors, the activations arranged to match.
// Accumulators are float lanes, reduced once per output.
// GCC 12 warns that the undefined upper lanes _mm512_cast*128/256_*512 leave are "(maybe)
// uninitialized" inside its own headers (GCC bug 105593); these casts are always followed by
// inserts of those lanes or by a permute that reads only the defined ones.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

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

inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
// Four 16-byte pieces as one vector, p0 in the lowest lane.
inline __m512i join4(const void* p0, const void* p1, const void* p2, const void* p3) {
  __m512i v = _mm512_castsi128_si512(load128(p0));
  v = _mm512_inserti32x4(v, load128(p1), 1);
  v = _mm512_inserti32x4(v, load128(p2), 2);
  return _mm512_inserti32x4(v, load128(p3), 3);
}
// (a & 0x0F) | (b & 0xF0) per byte.
inline __m512i nibble_select(__m512i a, __m512i b) {
  return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi8(0x0F), 0xE4);  // c ? a : b
}
inline float hsum128(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

// ---- 32-element blocks, four a step ----

// Q4_0: block = f16 d, 16 bytes of nibbles (low: elements 0..15, high: 16..31).
struct Q4_0K {
  using Act = ActQ8_0;
  static constexpr int kBytes = kQ4_0Bytes;
  static constexpr int kOffset = 8;  // code − 8
  struct X {
    __m512i lo, hi, off;  // lo: elements 0..15 of blocks 0..3 (a 128-bit lane each), hi: 16..31
    __m128 dx;
  };
  struct W {
    __m512i lo, hi;
    __m128 dw;
  };
  static X prep(const ActQ8_0* x) {
    X p;
    p.lo = join4(x[0].qs, x[1].qs, x[2].qs, x[3].qs);
    p.hi = join4(x[0].qs + 16, x[1].qs + 16, x[2].qs + 16, x[3].qs + 16);
    const __m512i c = _mm512_set1_epi8(kOffset);
    p.off = _mm512_sub_epi32(_mm512_setzero_si512(),
                             _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c, p.lo), c, p.hi));
    p.dx = _mm_setr_ps(x[0].d, x[1].d, x[2].d, x[3].d);
    return p;
  }
  static W decode(const uint8_t* g) {
    W w;
    const __m512i raw = join4(g + 2, g + 2 + kBytes, g + 2 + 2 * kBytes, g + 2 + 3 * kBytes);
    const __m512i m = _mm512_set1_epi8(0xF);
    w.lo = _mm512_and_si512(raw, m);
    w.hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m);
    // The four f16 scales: words 0, 9, 18, 27 of the group's first 64 bytes.
    const __m512i d = _mm512_permutexvar_epi16(_mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 27, 18, 9, 0),
                                               load512(g));
    w.dw = _mm_cvtph_ps(_mm512_castsi512_si128(d));
    return w;
  }
  static void accum(const W& w, const X& x, __m512& acc) {
    const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(x.off, w.lo, x.lo), w.hi, x.hi);
    const __m512 sc = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                            _mm512_castps128_ps512(_mm_mul_ps(w.dw, x.dx)));
    acc = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(s), acc);
  }
  // One block's 32 unsigned codes in element order.
  static __m256i codes1(const uint8_t* blk) {
    const __m128i raw = load128(blk + 2);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xF));
  }
};

// Q8_0: block = f16 d, int8 qs[32]; codes XOR 0x80 are code + 128, unsigned.
struct Q8_0K {
  using Act = ActQ8_0;
  static constexpr int kBytes = kQ8_0Bytes;
  static constexpr int kOffset = 128;
  struct X {
    __m512i x01, x23, off01, off23;  // blocks 0,1 and 2,3 (a 256-bit half each)
    __m128 dx;
  };
  struct W {
    __m512i w01, w23;
    __m128 dw;
  };
  static X prep(const ActQ8_0* x) {
    X p;
    p.x01 = join(load256(x[0].qs), load256(x[1].qs));
    p.x23 = join(load256(x[2].qs), load256(x[3].qs));
    const __m512i c = _mm512_set1_epi8(static_cast<char>(kOffset));
    p.off01 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, p.x01));
    p.off23 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, p.x23));
    p.dx = _mm_setr_ps(x[0].d, x[1].d, x[2].d, x[3].d);
    return p;
  }
  static W decode(const uint8_t* g) {
    W w;
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    w.w01 = _mm512_xor_si512(join(load256(g + 2), load256(g + 2 + kBytes)), bias);
    w.w23 = _mm512_xor_si512(join(load256(g + 2 + 2 * kBytes), load256(g + 2 + 3 * kBytes)), bias);
    // Words 0, 17, 34, 51 of the group's first 128 bytes.
    const __m512i d = _mm512_permutex2var_epi16(load512(g),
                                                _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 51, 34, 17, 0),
                                                load512(g + 64));
    w.dw = _mm_cvtph_ps(_mm512_castsi512_si128(d));
    return w;
  }
  static void accum(const W& w, const X& x, __m512& acc) {
    const __m512 sc = _mm512_castps128_ps512(_mm_mul_ps(w.dw, x.dx));
    const __m512i s01 = _mm512_dpbusd_epi32(x.off01, w.w01, x.x01);
    const __m512i s23 = _mm512_dpbusd_epi32(x.off23, w.w23, x.x23);
    const __m512 sc01 = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), sc);
    const __m512 sc23 = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2), sc);
    acc = _mm512_fmadd_ps(sc01, _mm512_cvtepi32_ps(s01), acc);
    acc = _mm512_fmadd_ps(sc23, _mm512_cvtepi32_ps(s23), acc);
  }
  static __m256i codes1(const uint8_t* blk) { return _mm256_xor_si256(load256(blk + 2), _mm256_set1_epi8(static_cast<char>(0x80))); }
};

// xp: the prepared activation steps, a.nb / 4 a row (K::prep of each four blocks).
template <class K, int R, int M>
void tile32(const KernelArgs& a, int64_t r0, int64_t i0, const typename K::X* xp) {
  __m512 acc[R][M];
  __m256 acc1[R][M];
  const ActQ8_0* x[M];
  const uint8_t* row[R];
  for (int i = 0; i < M; ++i) x[i] = reinterpret_cast<const ActQ8_0*>(a.act + (i0 + i) * a.act_row_bytes);
  for (int r = 0; r < R; ++r) {
    row[r] = a.w + (r0 + r) * a.row_bytes;
    for (int i = 0; i < M; ++i) {
      acc[r][i] = _mm512_setzero_ps();
      acc1[r][i] = _mm256_setzero_ps();
    }
  }
  int64_t b = 0;
  for (; b + 4 <= a.nb; b += 4) {
    for (int r = 0; r < R; ++r) {
      const typename K::W w = K::decode(row[r] + b * K::kBytes);
      for (int i = 0; i < M; ++i) K::accum(w, xp[(i0 + i) * (a.nb / 4) + b / 4], acc[r][i]);
    }
  }
  for (; b < a.nb; ++b) {  // the last nb % 4 blocks, one at a time
    const __m256i c = _mm256_set1_epi8(static_cast<char>(K::kOffset));
    for (int i = 0; i < M; ++i) {
      const __m256i xv = load256(x[i][b].qs);
      const __m256i off = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xv));
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = row[r] + b * K::kBytes;
        const __m256i s = _mm256_dpbusd_epi32(off, K::codes1(blk), xv);
        acc1[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(blk) * x[i][b].d), _mm256_cvtepi32_ps(s), acc1[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < M; ++i) {
      const __m256 t = acc1[r][i];
      a.y[(i0 + i) * a.ldy + r0 + r] =
          _mm512_reduce_add_ps(acc[r][i]) + hsum128(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
  }
}

// ---- 256-element super-blocks ----

// The activations of one super-block as four vectors of 64 in sub-block pairs [0|2], [1|3],
// [4|6], [5|7] (Q4_K/Q5_K), the pair sums of bsums (sub-blocks of 32) and d.
struct XK4 {
  __m512i v[4];
  __m128i bsum8;
  float d;
};
inline XK4 prep_k4(const ActQ8K& x) {
  XK4 p;
  for (int h = 0; h < 2; ++h) {
    p.v[2 * h] = join(load256(x.qs + 128 * h), load256(x.qs + 128 * h + 64));
    p.v[2 * h + 1] = join(load256(x.qs + 128 * h + 32), load256(x.qs + 128 * h + 96));
  }
  const __m256i bs = load256(x.bsums);
  p.bsum8 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
  p.d = x.d;
  return p;
}

// Q4_K / Q5_K scales and mins (ggml's get_scale_min_k4 for all 8 sub-blocks): bytes 0..7 the
// scales, 8..15 the mins, from the 12 packed bytes at q (16 bytes are read).
inline __m128i k4_scales_mins_simd(const uint8_t* q) {
  const __m128i v = load128(q);  // words u0, u1, u2 (u3 unused)
  // Target words: u0 & m1, (u2 & m2) | ((u0 >> 6) & m3) << 4, u1 & m1, ((u2 >> 4) & m2) | ((u1 >> 6) & m3) << 4.
  const __m128i p = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  // u0, u2, u1, u2
  const __m128i q2 = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  // u0, u0, u1, u1
  const __m128i low = _mm_and_si128(_mm_srlv_epi32(p, _mm_setr_epi32(0, 0, 0, 4)),
                                    _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i high = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(q2, 6), _mm_setr_epi32(0, 0x03030303, 0, 0x03030303)), 4);
  return _mm_or_si128(low, high);
}

// Q4_K: f16 d, f16 dmin, scales[12], qs[128] (bytes 32h..32h+31 of qs hold sub-blocks 2h (low
// nibbles) and 2h + 1 (high)).
struct Q4KK {
  static constexpr int kBytes = kQ4KBytes;
  static void codes(const uint8_t* blk, __m512i c[4]) {
    const __m512i m = _mm512_set1_epi8(0xF);
    for (int h = 0; h < 2; ++h) {
      const __m512i q = load512(blk + 16 + 64 * h);  // sub-blocks 4h..4h+3
      c[2 * h] = _mm512_and_si512(q, m);                            // [4h | 4h + 2]
      c[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m);  // [4h + 1 | 4h + 3]
    }
  }
};
// Q5_K: f16 d, f16 dmin, scales[12], qh[32] (bit j of byte l: element l of sub-block j), qs[128].
struct Q5KK {
  static constexpr int kBytes = kQ5KBytes;
  static void codes(const uint8_t* blk, __m512i c[4]) {
    const __m256i qh = load256(blk + 16);
    // Bytes 0..31: qh; 32..63: qh >> 2. Bits 0, 1, 4, 5 are then those of sub-blocks
    // [0|2], [1|3], [4|6], [5|7] in that vector order.
    const __m512i hv = join(qh, _mm256_srli_epi16(qh, 2));
    const __m512i m = _mm512_set1_epi8(0x10);
    const __m512i h[4] = {_mm512_and_si512(_mm512_slli_epi16(hv, 4), m), _mm512_and_si512(_mm512_slli_epi16(hv, 3), m),
                          _mm512_and_si512(hv, m), _mm512_and_si512(_mm512_srli_epi16(hv, 1), m)};
    for (int j = 0; j < 2; ++j) {
      const __m512i q = load512(blk + 48 + 64 * j);
      c[2 * j] = nibble_select(q, h[2 * j]);
      c[2 * j + 1] = nibble_select(_mm512_srli_epi16(q, 4), h[2 * j + 1]);
    }
  }
};

// xp: the prepared activation super-blocks, a.nb a row (prep_k4).
template <class K, int R, int M>
void tile_k4(const KernelArgs& a, int64_t r0, int64_t i0, const XK4* xp) {
  __m512 acc[R][M];
  __m128 accm[R][M];
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) {
    row[r] = a.w + (r0 + r) * a.row_bytes;
    for (int i = 0; i < M; ++i) {
      acc[r][i] = _mm512_setzero_ps();
      accm[r][i] = _mm_setzero_ps();
    }
  }
  // Lanes 0..7 of sub-block pair k's scale vector: the first sub-block's, 8..15 the second's.
  const __m512i idx[4] = {_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
                          _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
                          _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
                          _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5)};
  for (int64_t b = 0; b < a.nb; ++b) {
    const XK4* xs[M];
    for (int i = 0; i < M; ++i) xs[i] = xp + (i0 + i) * a.nb + b;
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row[r] + b * K::kBytes;
      __m512i c[4];
      K::codes(blk, c);
      const __m128i sm = k4_scales_mins_simd(blk + 4);
      const __m512i sc32 = _mm512_cvtepu8_epi32(sm);  // lanes 0..7 scales (8..15 mins, unused)
      const __m128i mins16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
      __m512i s[4];
      for (int k = 0; k < 4; ++k) s[k] = _mm512_permutexvar_epi32(idx[k], sc32);
      int32_t d2;
      std::memcpy(&d2, blk, 4);
      const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(d2));  // d, dmin
      for (int i = 0; i < M; ++i) {
        __m512i isum = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k) {
          // A lane's 4 products are at most 4·31·127 < 2^15: exact as the int16 low half of the
          // lane (the high half is its sign), times the scale in the low half of s[k].
          isum = _mm512_dpwssd_epi32(isum, _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[k], xs[i]->v[k]), s[k]);
        }
        // Σ_j mn[j]·(bsums[2j] + bsums[2j + 1]) in four int32 lanes.
        const __m128i pm = _mm_madd_epi16(mins16, xs[i]->bsum8);
        const __m128 f = _mm_mul_ps(dd, _mm_set1_ps(xs[i]->d));  // d·dx, dmin·dx
        acc[r][i] = _mm512_fmadd_ps(_mm512_broadcastss_ps(f), _mm512_cvtepi32_ps(isum), acc[r][i]);
        accm[r][i] = _mm_fmadd_ps(_mm_shuffle_ps(f, f, 0x55), _mm_cvtepi32_ps(pm), accm[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < M; ++i) {
      a.y[(i0 + i) * a.ldy + r0 + r] = _mm512_reduce_add_ps(acc[r][i]) - hsum128(accm[r][i]);
    }
  }
}

// Q6_K: ql[128], qh[64], int8 scales[16], f16 d. Half h (elements 128h..128h+127): ql bytes
// 64h..64h+63 hold elements 128h + l (low nibbles of 0..31), +32 (low, 32..63), +64 (high,
// 0..31), +96 (high, 32..63); qh byte 32h + l bits 0-1, 2-3, 4-5, 6-7 the same four. Vector
// 2h + t holds elements 128h + 64t..+63 in order: scale g (16 elements) covers its lanes 4g..4g+3.
template <int R, int M>
void tile_q6_k(const KernelArgs& a, int64_t r0, int64_t i0) {
  __m512 acc[R][M];
  const ActQ8K* x[M];
  const uint8_t* row[R];
  for (int i = 0; i < M; ++i) x[i] = reinterpret_cast<const ActQ8K*>(a.act + (i0 + i) * a.act_row_bytes);
  for (int r = 0; r < R; ++r) {
    row[r] = a.w + (r0 + r) * a.row_bytes;
    for (int i = 0; i < M; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  const __m512i m2 = _mm512_set1_epi8(0x30);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i xv[M][4];
    __m256i nbs[M];  // −bsums (|bsums| ≤ 16·127: no int16 overflow)
    for (int i = 0; i < M; ++i) {
      for (int k = 0; k < 4; ++k) xv[i][k] = load512(x[i][b].qs + 64 * k);
      nbs[i] = _mm256_sub_epi16(_mm256_setzero_si256(), load256(x[i][b].bsums));
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row[r] + b * kQ6KBytes;
      __m512i v[4];
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = load512(blk + 64 * h);
        const __m256i qh = load256(blk + 128 + 32 * h);
        const __m512i hv = join(qh, _mm256_srli_epi16(qh, 2));  // bits 0-1 then 4-5: the high bits of vectors 2h, 2h + 1
        v[2 * h] = nibble_select(ql, _mm512_and_si512(_mm512_slli_epi16(hv, 4), m2));
        v[2 * h + 1] = nibble_select(_mm512_srli_epi16(ql, 4), _mm512_and_si512(hv, m2));
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(load128(blk + 192));
      const __m512i sc32 = _mm512_cvtepu16_epi32(sc16);  // signed scale in each lane's low half, high half 0
      __m512i s[4];
      for (int k = 0; k < 4; ++k) {
        s[k] = _mm512_permutexvar_epi32(_mm512_set_epi32(4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 2, 4 * k + 2,
                                                         4 * k + 2, 4 * k + 2, 4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k + 1,
                                                         4 * k, 4 * k, 4 * k, 4 * k),
                                        sc32);
      }
      const float d = f16_at(blk + 208);
      for (int i = 0; i < M; ++i) {
        // −32·Σ_g sc[g]·bsums[g] (eight int32 lanes), then the codes' sums on top.
        __m512i isum = _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(nbs[i], sc16), 5));
        for (int k = 0; k < 4; ++k) {
          // ≤ 4·63·127 < 2^15 a lane: exact as its int16 low half (see tile_k4).
          isum = _mm512_dpwssd_epi32(isum, _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[k], xv[i][k]), s[k]);
        }
        acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(d * x[i][b].d), _mm512_cvtepi32_ps(isum), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < M; ++i) a.y[(i0 + i) * a.ldy + r0 + r] = _mm512_reduce_add_ps(acc[r][i]);
  }
}

// n elements of X, 64-byte aligned, in a buffer of the calling thread that only grows (X is a
// trivially copyable bundle of vectors, an implicit-lifetime type).
template <class X>
X* scratch(size_t n) {
  thread_local std::vector<unsigned char> raw;
  const size_t bytes = n * sizeof(X);
  if (raw.size() < bytes + alignof(X)) raw.resize(bytes + alignof(X));
  void* p = raw.data();
  size_t space = raw.size();
  return static_cast<X*>(std::align(alignof(X), bytes, p, space));
}

// Each activation row's steps arranged once per call of rows() (one task of the row split), in a
// buffer of the calling thread (rows() runs no nested oneTBB work, so it is not re-entered).
template <class K> struct T32 {
  using X = typename K::X;
  static const X* prepare(const KernelArgs& a) {
    const int64_t steps = a.nb / 4;
    X* buf = scratch<X>(static_cast<size_t>(a.m * steps));
    for (int64_t i = 0; i < a.m; ++i) {
      const auto* x = reinterpret_cast<const typename K::Act*>(a.act + i * a.act_row_bytes);
      for (int64_t s = 0; s < steps; ++s) buf[i * steps + s] = K::prep(x + 4 * s);
    }
    return buf;
  }
  template <int R, int M> static void run(const KernelArgs& a, int64_t r, int64_t i, const X* xp) { tile32<K, R, M>(a, r, i, xp); }
  // Bytes of one activation row the tiles read: its arranged steps and the last nb % 4 blocks.
  static int64_t act_bytes(const KernelArgs& a) {
    return static_cast<int64_t>(sizeof(X)) * (a.nb / 4) + static_cast<int64_t>(sizeof(typename K::Act)) * (a.nb % 4);
  }
};
template <class K> struct TK4 {
  static const XK4* prepare(const KernelArgs& a) {
    XK4* buf = scratch<XK4>(static_cast<size_t>(a.m * a.nb));
    for (int64_t i = 0; i < a.m; ++i) {
      const auto* x = reinterpret_cast<const ActQ8K*>(a.act + i * a.act_row_bytes);
      for (int64_t b = 0; b < a.nb; ++b) buf[i * a.nb + b] = prep_k4(x[b]);
    }
    return buf;
  }
  template <int R, int M> static void run(const KernelArgs& a, int64_t r, int64_t i, const XK4* xp) { tile_k4<K, R, M>(a, r, i, xp); }
  static int64_t act_bytes(const KernelArgs& a) { return static_cast<int64_t>(sizeof(XK4)) * a.nb; }
};
struct TQ6 {  // reads the activations as they are
  static const void* prepare(const KernelArgs&) { return nullptr; }
  template <int R, int M> static void run(const KernelArgs& a, int64_t r, int64_t i, const void*) { tile_q6_k<R, M>(a, r, i); }
  static int64_t act_bytes(const KernelArgs& a) { return a.act_row_bytes; }
};

// Activation rows are taken in groups whose bytes (as the tiles read them) fit in L1 beside a
// weight row: every weight row of a block of rows goes over one group, then over the next, so a
// group's activations are read from L1 and each block's weights from DRAM once (then from L2).
// One group holding all m rows (m = 1 and every m whose activations fit) is the plain loop over
// weight rows. Without the groups, m = 16 at k = 2048 read 80 KiB of Q8_0 activations per weight
// row from L2 and ran slower than the AVX2 kernel (bench/RESULTS.md, 2026-12-07).
inline constexpr int64_t kActGroupBytes = int64_t{24} << 10;    // of a 32 KiB L1d
inline constexpr int64_t kWeightBlockBytes = int64_t{128} << 10;  // of a 1 MiB L2

// Activation rows per group: even (the pairs of a group are the pairs of the whole batch), at
// least 2, at most m; the groups as even as that allows (m = 8 with room for 6: 4 and 4, not a
// full group and a short one that rereads the weights for little work).
inline int64_t act_group_rows(int64_t m, int64_t act_bytes) {
  const int64_t most = std::max<int64_t>(2, kActGroupBytes / std::max<int64_t>(1, act_bytes) / 2 * 2);
  if (most >= m) return m;
  const int64_t groups = (m + most - 1) / most;
  const int64_t g = (m + groups - 1) / groups;
  return g + (g & 1);  // <= most: rounding up to even stays below an even bound
}

// Rows r0..r1 one weight row at a time (R = 1), activation rows two at a time. Tiles of 2 or 4
// weight rows (R = 2, 4), which share each activation block's arrangement between rows, ran
// slower at m = 1 with the weights streamed from DRAM (bench_quant_gemv, 2026-12-07: 4 interleaved
// row streams against one sequential stream), so the kernels keep R as a parameter but use 1.
template <class T>
void rows(const KernelArgs& a, int64_t r0, int64_t r1) {
  const auto* xp = T::prepare(a);
  const int64_t group = act_group_rows(a.m, T::act_bytes(a));
  const int64_t block = group >= a.m ? r1 - r0 : std::max<int64_t>(1, kWeightBlockBytes / a.row_bytes);
  for (int64_t rs = r0; rs < r1; rs += block) {
    const int64_t re = std::min(r1, rs + block);
    for (int64_t i0 = 0; i0 < a.m; i0 += group) {
      const int64_t ie = std::min(a.m, i0 + group);
      for (int64_t r = rs; r < re; ++r) {
        int64_t i = i0;
        for (; i + 2 <= ie; i += 2) T::template run<1, 2>(a, r, i, xp);
        if (i < ie) T::template run<1, 1>(a, r, i, xp);
      }
    }
  }
}

}  // namespace

const Kernels& avx512_kernels() {
  static constexpr Kernels k{rows<T32<Q8_0K>>, rows<T32<Q4_0K>>, rows<TK4<Q4KK>>, rows<TK4<Q5KK>>, rows<TQ6>};
  return k;
}

}  // namespace specontext::cpu::quant

#pragma GCC pop_options
#pragma GCC diagnostic pop
