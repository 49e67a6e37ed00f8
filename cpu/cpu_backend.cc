#include "cpu/cpu_backend.h"

#include <dlfcn.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/base/host_math.h"
#include "core/model/ggml_quants.h"
#include "core/ports/backend_checks.h"
#include "core/ports/selection.h"
#include "cpu/numa.h"
#include "cpu/quant_dequant.h"
#include "cpu/quant_gemv.h"
#include "cpu/reference_backend.h"

// Hot loops are compiled three times (baseline x86-64, AVX2+FMA, AVX-512) and one variant is
// picked per process from the CPU's features, so the binary keeps the portable default target
// yet uses wide vectors where they exist. SPECONTEXT_CPU_ISA=base|avx2|avx512 caps the choice
// (for tests and comparisons). target_clones("arch=...") is not used: GCC 12 dispatches those
// on the CPU model name, which VMs often hide.
#if defined(__x86_64__) && defined(__GNUC__)
#define SPX_HAVE_ISA_VARIANTS 1
#define SPX_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define SPX_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi2")))
#else
#define SPX_HAVE_ISA_VARIANTS 0
#endif
#define SPX_INLINE inline __attribute__((always_inline))

namespace specontext::cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Vectorisable scalar building blocks. Without -ffast-math the compiler will not reorder a
// float reduction, so sums use 16 explicit lanes that it can map onto SIMD registers.

SPX_INLINE float bf16_bits_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// K / V elements as f32: f32 itself, or bf16 bits (a shift, which vectorises). f16 attention
// runs fused16::attend_block instead, see attend_rows.
SPX_INLINE float as_f32(float x) { return x; }
SPX_INLINE float as_f32(uint16_t bf16_bits) { return bf16_bits_to_f32(bf16_bits); }

template <typename T>
SPX_INLINE float dot(const float* a, const T* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * as_f32(b[i + l]);
  }
  for (int l = 0; l < 8; ++l) acc[l] += acc[l + 8];  // tree reduction: short dependency chains
  for (int l = 0; l < 4; ++l) acc[l] += acc[l + 4];
  float s = (acc[0] + acc[2]) + (acc[1] + acc[3]);
  for (; i < n; ++i) s += a[i] * as_f32(b[i]);
  return s;
}

// Dot products of q with four consecutive rows of k (row stride n).
template <typename T>
SPX_INLINE void dot4(const float* q, const T* k, int64_t n, float* out) {
  float a0[16] = {}, a1[16] = {}, a2[16] = {}, a3[16] = {};
  const T* k0 = k;
  const T* k1 = k + n;
  const T* k2 = k + 2 * n;
  const T* k3 = k + 3 * n;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) {
      const float qv = q[i + l];
      a0[l] += qv * as_f32(k0[i + l]);
      a1[l] += qv * as_f32(k1[i + l]);
      a2[l] += qv * as_f32(k2[i + l]);
      a3[l] += qv * as_f32(k3[i + l]);
    }
  }
  for (int l = 0; l < 8; ++l) {
    a0[l] += a0[l + 8];
    a1[l] += a1[l + 8];
    a2[l] += a2[l + 8];
    a3[l] += a3[l + 8];
  }
  for (int l = 0; l < 4; ++l) {
    a0[l] += a0[l + 4];
    a1[l] += a1[l + 4];
    a2[l] += a2[l + 4];
    a3[l] += a3[l + 4];
  }
  float s0 = (a0[0] + a0[2]) + (a0[1] + a0[3]);
  float s1 = (a1[0] + a1[2]) + (a1[1] + a1[3]);
  float s2 = (a2[0] + a2[2]) + (a2[1] + a2[3]);
  float s3 = (a3[0] + a3[2]) + (a3[1] + a3[3]);
  for (; i < n; ++i) {
    s0 += q[i] * as_f32(k0[i]);
    s1 += q[i] * as_f32(k1[i]);
    s2 += q[i] * as_f32(k2[i]);
    s3 += q[i] * as_f32(k3[i]);
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// exp(x) with ~2 ulp error (Cephes expf polynomial), branch-free so loops over it vectorise.
// Inputs are clamped to the normal range: exp(-87.3) ~ 1e-38 stands in for smaller results.
SPX_INLINE float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = x - n * 0.693359375f - n * -2.12194440e-4f;              // Cody-Waite
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  return p * std::bit_cast<float>(static_cast<uint32_t>(e) << 23);
}

// ---------------------------------------------------------------------------------------------
// Kernel bodies, instantiated once per ISA by SPX_DISPATCH below

SPX_INLINE void rmsnorm_rows_body(const float* x, const float* w, int64_t r0, int64_t r1, int64_t dim,
                                  float eps, float* y) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * dim;
    const float ss = dot(xr, xr, dim);
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    float* yr = y + r * dim;
    for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * scale * w[i];
  }
}

SPX_INLINE void swiglu_range_body(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + fast_exp(-g)) * up[i];
  }
}

SPX_INLINE void add_range_body(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

SPX_INLINE void bf16_to_f32_range_body(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(src[i]);
}

SPX_INLINE void f32_to_bf16_range_body(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// y[:, n0:n1] of x[m, K] · W[N, K]ᵀ, W f32: the row loop, for small f32 batches
// (kRowLoopMaxRows) and when oneDNN has no primitive.
SPX_INLINE void matmul_rows_f32_body(const float* x, int64_t m, int64_t k, const float* w, const float* bias,
                                     int64_t n0, int64_t n1, int64_t n_total, float* y) {
  // Four weight rows at a time: each input row is read once per four outputs, and the four
  // weight rows stay in cache while every input passes over them.
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    for (int64_t i = 0; i < m; ++i) {
      float out[4];
      dot4(x + i * k, w + n * k, k, out);
      for (int j = 0; j < 4; ++j) y[i * n_total + n + j] = out[j] + (bias != nullptr ? bias[n + j] : 0.0f);
    }
  }
  for (; n < n1; ++n) {
    const float* wr = w + n * k;
    const float b = bias != nullptr ? bias[n] : 0.0f;
    for (int64_t i = 0; i < m; ++i) y[i * n_total + n] = dot(x + i * k, wr, k) + b;
  }
}

// Same with bf16 weights, each row widened once into `wbuf` [K] and reused for all m inputs.
SPX_INLINE void matmul_rows_bf16_body(const float* x, int64_t m, int64_t k, const uint16_t* w,
                                      const float* bias, int64_t n0, int64_t n1, int64_t n_total, float* wbuf,
                                      float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * k;
    for (int64_t c = 0; c < k; ++c) wbuf[c] = bf16_bits_to_f32(wr[c]);
    const float b = bias != nullptr ? bias[n] : 0.0f;
    for (int64_t i = 0; i < m; ++i) y[i * n_total + n] = dot(x + i * k, wbuf, k) + b;
  }
}

// The online-softmax step every attention block shares: s[0..nv) holds one query's scores of the
// block and becomes exp(s − m_new); the running max m, the running sum l and the accumulator row
// ar [d] are rescaled to the new max, and l gains the block's sum.
SPX_INLINE void online_softmax_fold(float* s, int64_t nv, int64_t d, float& m, float& l, float* ar) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < nv; ++j) block_max = std::max(block_max, s[j]);
  const float m_old = m;
  const float m_new = std::max(m_old, block_max);
  float sum = 0.0f;
  for (int64_t j = 0; j < nv; ++j) s[j] = fast_exp(s[j] - m_new);
  for (int64_t j = 0; j < nv; ++j) sum += s[j];
  if (m_new != m_old) {
    const float alpha = m_old == -std::numeric_limits<float>::infinity() ? 0.0f : fast_exp(m_old - m_new);
    l *= alpha;
    for (int64_t e = 0; e < d; ++e) ar[e] *= alpha;
    m = m_new;
  }
  l += sum;
}

// One block of `n` consecutive keys (contiguous rows of K and V) folded into the online-softmax
// state of `nq` queries. q is pre-scaled by 1/sqrt(d). valid[r] = how many leading keys of the
// block query r may see (causal mask). s is scratch of >= n floats.
// K and V are f32 or bf16 bits (T), widened as they are read.
template <typename T>
SPX_INLINE void attend_block_body(const float* q, int64_t nq, int64_t d, const int64_t* valid, const T* k,
                                  const T* v, float* m_state, float* l_state, float* acc, float* s) {
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t nv = valid[r];
    if (nv <= 0) continue;
    const float* qr = q + r * d;
    // Scores four keys at a time: four independent accumulator chains, q loaded once.
    int64_t j = 0;
    for (; j + 4 <= nv; j += 4) dot4(qr, k + j * d, d, s + j);
    for (; j < nv; ++j) s[j] = dot(qr, k + j * d, d);
    float* ar = acc + r * d;
    online_softmax_fold(s, nv, d, m_state[r], l_state[r], ar);
    // Four V rows per pass: one load/store of the accumulator row per four keys.
    for (j = 0; j + 4 <= nv; j += 4) {
      const float p0 = s[j], p1 = s[j + 1], p2 = s[j + 2], p3 = s[j + 3];
      const T* v0 = v + j * d;
      const T* v1 = v0 + d;
      const T* v2 = v1 + d;
      const T* v3 = v2 + d;
      for (int64_t e = 0; e < d; ++e) {
        ar[e] += (p0 * as_f32(v0[e]) + p1 * as_f32(v1[e])) + (p2 * as_f32(v2[e]) + p3 * as_f32(v3[e]));
      }
    }
    for (; j < nv; ++j) {
      const float p = s[j];
      const T* vj = v + j * d;
      for (int64_t e = 0; e < d; ++e) ar[e] += p * as_f32(vj[e]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// ISA dispatch

enum class Isa { kBase = 0, kAvx2 = 1, kAvx512 = 2 };

Isa detect_isa() {
  Isa best = Isa::kBase;
#if SPX_HAVE_ISA_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("bmi2")) {
    best = Isa::kAvx2;
  }
  if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
    best = Isa::kAvx512;
  }
#endif
  if (const char* cap = std::getenv("SPECONTEXT_CPU_ISA")) {
    Isa limit = best;
    if (std::strcmp(cap, "base") == 0) limit = Isa::kBase;
    if (std::strcmp(cap, "avx2") == 0) limit = Isa::kAvx2;
    if (static_cast<int>(limit) < static_cast<int>(best)) best = limit;
  }
  return best;
}

Isa active_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "base";
  }
}

#if SPX_HAVE_ISA_VARIANTS
#define SPX_DISPATCH(name, params, args)                                 \
  SPX_TARGET_AVX512 void name##_avx512 params { name##_body args; }      \
  SPX_TARGET_AVX2 void name##_avx2 params { name##_body args; }          \
  void name##_base params { name##_body args; }                          \
  void name params {                                                     \
    static const auto fn = active_isa() == Isa::kAvx512 ? &name##_avx512 \
                           : active_isa() == Isa::kAvx2 ? &name##_avx2   \
                                                        : &name##_base;  \
    fn args;                                                             \
  }
#else
#define SPX_DISPATCH(name, params, args) \
  void name params { name##_body args; }
#endif

SPX_DISPATCH(rmsnorm_rows,
             (const float* x, const float* w, int64_t r0, int64_t r1, int64_t dim, float eps, float* y),
             (x, w, r0, r1, dim, eps, y))
SPX_DISPATCH(swiglu_range, (const float* gate, const float* up, int64_t n, float* out), (gate, up, n, out))
SPX_DISPATCH(add_range, (float* x, const float* y, int64_t n), (x, y, n))
SPX_DISPATCH(bf16_to_f32_range, (const uint16_t* src, float* dst, int64_t n), (src, dst, n))
SPX_DISPATCH(f32_to_bf16_range, (const float* src, uint16_t* dst, int64_t n), (src, dst, n))
SPX_DISPATCH(matmul_rows_f32,
             (const float* x, int64_t m, int64_t k, const float* w, const float* bias, int64_t n0, int64_t n1,
              int64_t n_total, float* y),
             (x, m, k, w, bias, n0, n1, n_total, y))
SPX_DISPATCH(matmul_rows_bf16,
             (const float* x, int64_t m, int64_t k, const uint16_t* w, const float* bias, int64_t n0,
              int64_t n1, int64_t n_total, float* wbuf, float* y),
             (x, m, k, w, bias, n0, n1, n_total, wbuf, y))
SPX_DISPATCH(attend_block,
             (const float* q, int64_t nq, int64_t d, const int64_t* valid, const float* k, const float* v,
              float* m_state, float* l_state, float* acc, float* s),
             (q, nq, d, valid, k, v, m_state, l_state, acc, s))
SPX_INLINE void attend_block_bf16_body(const float* q, int64_t nq, int64_t d, const int64_t* valid,
                                       const uint16_t* k, const uint16_t* v, float* m_state, float* l_state,
                                       float* acc, float* s) {
  attend_block_body(q, nq, d, valid, k, v, m_state, l_state, acc, s);
}
SPX_DISPATCH(attend_block_bf16,
             (const float* q, int64_t nq, int64_t d, const int64_t* valid, const uint16_t* k, const uint16_t* v,
              float* m_state, float* l_state, float* acc, float* s),
             (q, nq, d, valid, k, v, m_state, l_state, acc, s))

#if SPX_HAVE_ISA_VARIANTS
// f16 K / V with the widening fused into the loads: F16C's vcvtph2ps, 8 lanes per load straight
// into the FMAs (no f32 copy of the block). Same algorithm as attend_block_body (4 keys per score
// pass, 4 V rows per accumulator pass); sums in 8-lane order. Compiled for AVX2+FMA+F16C by the
// pragma (this region only), called when active_isa() >= kAvx2, AVX-512 CPUs included (on this
// Zen 4 box it already beats the AVX-512 f32 kernel: SparseOpsTest.DISABLED_Timing). bf16 keeps
// attend_block_bf16 (the generic template, widened by a shift in registers): measured, this
// kernel's bf16 form (zero-extend + shift, 8 lanes) was ~10% slower than that one's AVX-512 variant.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fused16 {

inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float load1(uint16_t h) {
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// Scores of q against four consecutive rows of k (row stride d).
inline void dot4(const float* q, const uint16_t* k, int64_t d, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, load8(k + i), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k + d + i), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k + 2 * d + i), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k + 3 * d + i), a3);
  }
  float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
  for (; i < d; ++i) {
    s0 += q[i] * load1(k[i]);
    s1 += q[i] * load1(k[d + i]);
    s2 += q[i] * load1(k[2 * d + i]);
    s3 += q[i] * load1(k[3 * d + i]);
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

inline float dot1(const float* q, const uint16_t* k, int64_t d) {
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a);
  float s = hsum(a);
  for (; i < d; ++i) s += q[i] * load1(k[i]);
  return s;
}

void attend_block(const float* q, int64_t nq, int64_t d, const int64_t* valid, const uint16_t* k,
                  const uint16_t* v, float* m_state, float* l_state, float* acc, float* s) {
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t nv = valid[r];
    if (nv <= 0) continue;
    const float* qr = q + r * d;
    int64_t j = 0;
    for (; j + 4 <= nv; j += 4) dot4(qr, k + j * d, d, s + j);
    for (; j < nv; ++j) s[j] = dot1(qr, k + j * d, d);
    float* ar = acc + r * d;
    online_softmax_fold(s, nv, d, m_state[r], l_state[r], ar);
    for (j = 0; j + 4 <= nv; j += 4) {
      const float p0 = s[j], p1 = s[j + 1], p2 = s[j + 2], p3 = s[j + 3];
      const __m256 p0v = _mm256_set1_ps(p0), p1v = _mm256_set1_ps(p1), p2v = _mm256_set1_ps(p2),
                   p3v = _mm256_set1_ps(p3);
      const uint16_t* v0 = v + j * d;
      const uint16_t* v1 = v0 + d;
      const uint16_t* v2 = v1 + d;
      const uint16_t* v3 = v2 + d;
      int64_t e = 0;
      for (; e + 8 <= d; e += 8) {
        const __m256 lo = _mm256_fmadd_ps(p1v, load8(v1 + e), _mm256_mul_ps(p0v, load8(v0 + e)));
        const __m256 hi = _mm256_fmadd_ps(p3v, load8(v3 + e), _mm256_mul_ps(p2v, load8(v2 + e)));
        _mm256_storeu_ps(ar + e, _mm256_add_ps(_mm256_loadu_ps(ar + e), _mm256_add_ps(lo, hi)));
      }
      for (; e < d; ++e) {
        ar[e] += (p0 * load1(v0[e]) + p1 * load1(v1[e])) + (p2 * load1(v2[e]) + p3 * load1(v3[e]));
      }
    }
    for (; j < nv; ++j) {
      const float p = s[j];
      const __m256 pv = _mm256_set1_ps(p);
      const uint16_t* vj = v + j * d;
      int64_t e = 0;
      for (; e + 8 <= d; e += 8) {
        _mm256_storeu_ps(ar + e, _mm256_fmadd_ps(pv, load8(vj + e), _mm256_loadu_ps(ar + e)));
      }
      for (; e < d; ++e) ar[e] += p * load1(vj[e]);
    }
  }
}

}  // namespace fused16
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------------------------------------
// Helpers

// Runs f and turns any exception into a Status: nothing may escape a Backend call.
template <typename F>
Status guarded(const char* op, F&& f) noexcept {
  try {
    return f();
  } catch (const dnnl::error& e) {
    return internal_error(std::string(op) + ": oneDNN error: " + e.what());
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(op) + ": out of memory");
  } catch (const std::exception& e) {
    return internal_error(std::string(op) + ": " + e.what());
  } catch (...) {
    return internal_error(std::string(op) + ": unknown exception");
  }
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

// oneDNN in Debian 12 is built with the OpenMP runtime (libgomp). The backend runs oneDNN
// single-threaded inside its own TBB tasks (one slice of the output each), so every thread that
// executes a primitive sets its OpenMP team size to 1: no second thread pool, no OpenMP spin
// barriers (which stall for a whole scheduler tick when a core is shared), and NUMA pinning of
// the arena covers matmul too. Looked up dynamically because libgomp arrives only as a
// dependency of libdnnl; absent with a TBB/sequential oneDNN build, which needs nothing.
using OmpSetNumThreads = void (*)(int);
OmpSetNumThreads find_omp_set_num_threads() {
  return reinterpret_cast<OmpSetNumThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
}

struct MatmulKey {
  int64_t m, k, n;
  DType dtype;
  bool bias;
  bool operator==(const MatmulKey&) const = default;
};
struct MatmulKeyHash {
  size_t operator()(const MatmulKey& key) const noexcept {
    size_t h = std::hash<int64_t>()(key.m);
    h = h * 1000003u ^ std::hash<int64_t>()(key.k);
    h = h * 1000003u ^ std::hash<int64_t>()(key.n);
    return h * 31u + static_cast<size_t>(key.dtype) * 2u + (key.bias ? 1u : 0u);
  }
};

// One oneDNN primitive computing y[:, n0:n0+width] = x · W[n0:n0+width, :]ᵀ for any n0: W's
// slice is the {K, width} matrix in format `ba` at W + n0·K. y's slice is written in place with
// row stride N, or, when `staged`, densely into a per-slot buffer and copied: oneDNN 2.6 offers
// brgemm (its fastest f32 kernel for m > 2) only for a dense destination.
struct MatmulSlice {
  dnnl::matmul prim;
  dnnl::memory::desc src_md, w_md, dst_md, bias_md;
  size_t scratch_bytes = 0;  // user-managed scratchpad (thread-safe execution)
  bool staged = false;
};

struct MatmulPlan {
  bool usable = false;  // false: oneDNN offers nothing better than its reference code here
  std::string impl;
  int64_t width = 0;     // output columns per slice; the last slice may be narrower
  int64_t n_slices = 0;  // one TBB task each
  MatmulSlice full, tail;
};

// A slice primitive of `width` output columns for the f32 tiles of a block-type matmul
// (matmul_block_tiles): key.n is the whole output's row stride.
struct TileKey {
  MatmulKey key;
  int64_t width;
  bool operator==(const TileKey&) const = default;
};
struct TileKeyHash {
  size_t operator()(const TileKey& t) const noexcept { return MatmulKeyHash()(t.key) * 1000003u ^ std::hash<int64_t>()(t.width); }
};
struct TileSlice {
  bool usable = false;  // false: no oneDNN primitive but its reference code; the row loop runs
  MatmulSlice slice;
};

constexpr size_t kMaxPlans = 256;        // prefill chunk sizes vary; bound the cache
constexpr int64_t kMinSliceCols = 64;    // narrower matmul slices lose more than threads gain
// f32 with 2..8 input rows (small decode batches): oneDNN's sgemm packs the weights on every
// call, while the row loop streams each weight row once for all inputs, four rows at a time.
// Decode tok/s, `specontext generate --synthetic llama-3.2-1b --layers 4 --batch B -n 16
// --prompt-tokens 64`, 2-core EPYC, oneDNN vs row loop: B=2 9.5 vs 22.1, B=4 17.2 vs 30.3,
// B=6 24.6 vs 35.9, B=8 29.5 vs 40.9, B=12 38.7 vs 34.1, B=16 44.1 vs 43.1; one row stays on
// oneDNN's gemv (11.7 vs 11.3).
constexpr int64_t kRowLoopMaxRows = 8;
// Block-type weights (GGUF Q8_0, Q4_0, Q4_K, Q5_K, Q6_K kept as stored): up to this many input
// rows quant_gemv reads the blocks directly (decode and small batches: bytes bound); more rows
// (prefill: compute bound) dequantise kBlockTileBytes of weight rows at a time into f32 and run
// them through the f32 path, so prefill keeps oneDNN's GEMM. Measured in bench/RESULTS.md
// ("Quantized weights kept as stored").
constexpr int64_t kQuantGemvMaxRows = 16;
constexpr int64_t kBlockTileBytes = int64_t{1} << 20;
constexpr int64_t kBlockTileMinRows = 64;  // narrower GEMMs lose more than the cache gains
constexpr int64_t kKeyBlock = 64;        // keys per attention block (K and V block fit L1/L2)
constexpr int64_t kMinChunk = 512;       // smallest automatic split-K chunk
constexpr int64_t kMaxTileQueries = 32;  // queries (tokens x heads of a group) per task

struct AttnTask {
  int64_t item;
  int64_t kvh;
  int64_t t0, t1;   // tokens of the item (relative to its first new token)
  int64_t k0, k1;   // key positions covered by this task
  int64_t partial;  // offset into the partial buffer, -1: write the output directly
};
struct AttnGroup {  // tasks [task_begin, task_end) split one (item, tile, kv head) over keys
  size_t task_begin, task_end;
};

// Per-thread scratch of one attention task over nq queries of head_dim d, with the online-softmax
// state (acc, m, l) reset for its first key block; qs and s are left for the task to fill.
struct TaskScratch {
  float* qs;       // [nq, d] scaled queries
  float* acc;      // [nq, d]
  float* m_state;  // [nq]
  float* l_state;  // [nq]
  float* s;        // [kKeyBlock] scores
};

TaskScratch task_scratch(int64_t nq, int64_t d) {
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>(nq * d * 2 + nq * 2 + kKeyBlock);
  if (scratch.size() < need) scratch.resize(need);
  TaskScratch t;
  t.qs = scratch.data();
  t.acc = t.qs + nq * d;
  t.m_state = t.acc + nq * d;
  t.l_state = t.m_state + nq;
  t.s = t.l_state + nq;
  std::fill(t.acc, t.acc + nq * d, 0.0f);
  std::fill(t.m_state, t.m_state + nq, -std::numeric_limits<float>::infinity());
  std::fill(t.l_state, t.l_state + nq, 0.0f);
  return t;
}

// Split-K partial states of one attention call, owned by the calling thread (attention may run
// concurrently from several threads). Shared by the dense and sparse paths.
float* partial_scratch(int64_t floats) {
  thread_local std::vector<float> partials;
  if (partials.size() < static_cast<size_t>(floats)) partials.resize(static_cast<size_t>(floats));
  return partials.data();
}

// attend_block over `rows` keys whose K and V rows start at element `first` of k_base / v_base
// (element type t), all read in place: f32 directly, bf16 widened in registers (a shift), f16 by
// fused16::attend_block (F16C, AVX2 CPUs and up). Only on baseline x86-64 are f16 rows widened
// into per-thread buffers first.
void attend_rows(const float* q, int64_t nq, int64_t d, const int64_t* valid, const void* k_base,
                 const void* v_base, DType t, int64_t first, int64_t rows, float* m_state, float* l_state,
                 float* acc, float* s) {
  if (t == DType::kF32) {
    attend_block(q, nq, d, valid, static_cast<const float*>(k_base) + first, static_cast<const float*>(v_base) + first,
                 m_state, l_state, acc, s);
#if SPX_HAVE_ISA_VARIANTS
  } else if (t == DType::kF16 && active_isa() != Isa::kBase) {
    fused16::attend_block(q, nq, d, valid, static_cast<const uint16_t*>(k_base) + first,
                          static_cast<const uint16_t*>(v_base) + first, m_state, l_state, acc, s);
#endif
  } else if (t == DType::kBF16) {
    attend_block_bf16(q, nq, d, valid, static_cast<const uint16_t*>(k_base) + first,
                      static_cast<const uint16_t*>(v_base) + first, m_state, l_state, acc, s);
  } else {
    thread_local std::vector<float> buf;
    const size_t need = static_cast<size_t>(2 * kKeyBlock * d);
    if (buf.size() < need) buf.resize(need);
    const size_t n = static_cast<size_t>(rows * d);
    convert_to_f32(t, element_at(k_base, t, first), buf.data(), n);
    convert_to_f32(t, element_at(v_base, t, first), buf.data() + kKeyBlock * d, n);
    attend_block(q, nq, d, valid, buf.data(), buf.data() + kKeyBlock * d, m_state, l_state, acc, s);
  }
}

// Ends a task of the dense or sparse attention: acc / l into out (query r = token t0 + r / group,
// head kvh * group + r % group; l == 0, no visible key, gives zeros), or with a split the raw
// [m][l][acc] state into the partial buffer for merge_partials.
void store_task_result(const AttnTask& task, int64_t nq, int64_t group, int64_t d, int64_t n_heads,
                       int64_t token_offset, const float* m_state, const float* l_state, const float* acc,
                       float* out, float* partial_base) {
  if (task.partial < 0) {
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t t = task.t0 + r / group;
      const int64_t h = task.kvh * group + r % group;
      float* o = out + ((token_offset + t) * n_heads + h) * d;
      const float inv = l_state[r] > 0.0f ? 1.0f / l_state[r] : 0.0f;
      for (int64_t e = 0; e < d; ++e) o[e] = acc[r * d + e] * inv;
    }
  } else {
    float* p = partial_base + task.partial;
    std::copy(m_state, m_state + nq, p);
    std::copy(l_state, l_state + nq, p + nq);
    std::copy(acc, acc + nq * d, p + 2 * nq);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Impl

struct CpuBackend::Impl {
  int num_threads = 1;
  int numa_node = 0;
  int64_t attention_chunk = 0;
  bool force_matmul_fallback = false;
  OmpSetNumThreads omp_set_num_threads = nullptr;

  // Declaration order is destruction order reversed: the observer must go before the arena.
  std::unique_ptr<tbb::task_arena> arena;
  std::unique_ptr<NodePinningObserver> pinning;

  std::mutex matmul_mu;  // guards everything below
  dnnl::engine engine;
  // Per arena slot (tbb::this_task_arena::current_thread_index(); 0 when run inline): a stream
  // and a scratchpad, so slices execute concurrently without sharing either.
  std::vector<dnnl::stream> streams;
  std::vector<std::vector<uint8_t>> scratch;
  std::vector<std::vector<float>> staging;  // dense outputs of staged slices
  std::unordered_map<MatmulKey, MatmulPlan, MatmulKeyHash> plans;
  std::vector<uint16_t> x_bf16;  // reusable bf16 copy of the matmul input
  std::vector<float> x_rounded;  // the fallback's bf16-rounded input, widened back to f32
  std::mutex retrieval_mu;              // guards retrieval_logits (the op stays re-entrant)
  std::vector<float> retrieval_logits;  // retrieval_group_scores' [n_heads][length] scratch
  std::unordered_map<TileKey, TileSlice, TileKeyHash> tile_slices;
  std::vector<std::vector<float>> tile_bufs;  // per arena slot: dequantised weight rows of one tile
  std::string last_path_f32 = "none", last_path_bf16 = "none", last_path_block = "none";

  // Runs f(begin, end) over [0, n) on the arena, or inline when the work is too small for
  // threads to pay off.
  template <typename F>
  void parallel(int64_t n, int64_t grain, F&& f) {
    if (n <= 0) return;
    if (num_threads <= 1 || n <= grain) {
      f(int64_t{0}, n);
      return;
    }
    arena->execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, static_cast<size_t>(std::max<int64_t>(grain, 1))),
                        [&](const tbb::blocked_range<int64_t>& r) { f(r.begin(), r.end()); });
    });
  }

  MatmulPlan& plan_for(const MatmulKey& key);
  // Builds the primitive for output slices of `width` columns; false when oneDNN has only its
  // reference implementation. Throws dnnl::error when it has nothing.
  bool make_slice(const MatmulKey& key, int64_t width, bool strided_dst, MatmulSlice& slice,
                  std::string& impl);
  // make_slice choosing between a strided and a staged destination (see MatmulSlice).
  bool make_best_slice(const MatmulKey& key, int64_t width, bool whole, MatmulSlice& slice,
                       std::string& impl);
  // Runs slice `index` with the stream and scratchpad of arena slot `slot`.
  void run_slice(const MatmulPlan& plan, int64_t index, int slot, const void* src, const void* w,
                 const float* bias, float* y, int64_t n_total, int64_t k, size_t elem_bytes);
  Status matmul_fallback(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y);
  // f32 / bf16 weights: oneDNN's plan for the shape, or the row loops. Caller holds matmul_mu.
  Status matmul_plain(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y);
  // Block-type weights (is_block_dtype): quant_gemv for m <= kQuantGemvMaxRows, else
  // matmul_block_tiles. Caller holds matmul_mu.
  Status matmul_blocks(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y);
  Status matmul_block_tiles(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y);
  // The primitive for tiles of `width` weight rows of an [n_total, k] block-type matrix.
  const TileSlice& tile_slice(int64_t m, int64_t k, int64_t n_total, int64_t width, bool bias);
  // Runs one slice primitive with the stream and scratchpad of arena slot `slot`: dst is y's
  // first column of the slice (row stride per the primitive), or a dense buffer when staged.
  void execute_slice(const MatmulSlice& sl, int slot, const void* src, const void* w, const float* bias, float* dst);
  // attention, attention_sparse and attention_indexed: one kernel over a KV reader
  // (PagedCausalKv, WorkingSetKv, IndexedPagedKv).
  template <typename Kv>
  Status attend(const float* q, const Kv& kv, int64_t n_items, int64_t n_heads, float* out);
  // Tasks per (item, KV head, token tile) before splitting, and the key chunks wanted per task
  // so that there are about 4 tasks per thread.
  int64_t chunks_wanted(int64_t base_tasks) const;
  // Merges split-K partials of each group: out = Σ_c e^(m_c - M) acc_c / Σ_c e^(m_c - M) l_c.
  // layout(item) = (first output row of the item, query heads per KV head).
  template <typename Layout>
  void merge_partials(const std::vector<AttnTask>& tasks, const std::vector<AttnGroup>& groups,
                      int64_t n_heads, int64_t d, const float* partial_base, float* out, Layout&& layout);
};

MatmulPlan& CpuBackend::Impl::plan_for(const MatmulKey& key) {
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  if (plans.size() >= kMaxPlans) plans.clear();
  MatmulPlan& plan = plans[key];
  // As many slices as threads, none narrower than kMinSliceCols, widths a multiple of 16.
  const int64_t n_slices = std::clamp<int64_t>(key.n / kMinSliceCols, 1, num_threads);
  const int64_t width = ((key.n + n_slices - 1) / n_slices + 15) / 16 * 16;
  plan.width = std::min(width, key.n);
  plan.n_slices = (key.n + plan.width - 1) / plan.width;
  try {
    std::string impl;
    const bool whole = plan.n_slices == 1;
    bool ok = make_best_slice(key, plan.width, whole, plan.full, plan.impl);
    const int64_t tail = key.n - (plan.n_slices - 1) * plan.width;
    if (ok && tail != plan.width) ok = make_best_slice(key, tail, whole, plan.tail, impl);
    plan.usable = ok;
    if (ok && verbose_logging()) {
      std::fprintf(stderr, "[specontext cpu] matmul m=%lld k=%lld n=%lld %s%s: oneDNN %s, %lld slices\n",
                   static_cast<long long>(key.m), static_cast<long long>(key.k),
                   static_cast<long long>(key.n), std::string(dtype_name(key.dtype)).c_str(),
                   key.bias ? " +bias" : "", plan.impl.c_str(), static_cast<long long>(plan.n_slices));
    }
  } catch (const dnnl::error& e) {
    // Unimplemented combination (e.g. bf16 without avx512_core): the fallback loop serves it.
    if (verbose_logging()) {
      std::fprintf(stderr, "[specontext cpu] no oneDNN matmul for m=%lld k=%lld n=%lld %s: %s\n",
                   static_cast<long long>(key.m), static_cast<long long>(key.k),
                   static_cast<long long>(key.n), std::string(dtype_name(key.dtype)).c_str(), e.what());
    }
    plan.usable = false;
  }
  if (!plan.usable) plan = MatmulPlan{};
  return plan;
}

bool CpuBackend::Impl::make_best_slice(const MatmulKey& key, int64_t width, bool whole, MatmulSlice& slice,
                                       std::string& impl) {
  // A slice covering all of y is dense anyway. Otherwise try dense: if oneDNN then picks a GEMM
  // kernel (which handles strides itself), rebuild it strided and skip the copy.
  if (!make_slice(key, width, /*strided_dst=*/false, slice, impl)) return false;
  slice.staged = !whole;
  if (whole || impl.find("gemm") == std::string::npos) return true;
  if (!make_slice(key, width, /*strided_dst=*/true, slice, impl)) return false;
  slice.staged = false;
  return true;
}

bool CpuBackend::Impl::make_slice(const MatmulKey& key, int64_t width, bool strided_dst, MatmulSlice& slice,
                                  std::string& impl) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const dt in_type = key.dtype == DType::kBF16 ? dt::bf16 : dt::f32;
  slice.src_md = dnnl::memory::desc({key.m, key.k}, in_type, tag::ab);
  // W is [N, K] row-major = the {K, N} matrix with K innermost: format `ba`; a slice of rows of W
  // is the same format at an offset.
  slice.w_md = dnnl::memory::desc({key.k, width}, in_type, tag::ba);
  slice.dst_md = strided_dst ? dnnl::memory::desc({key.m, width}, dt::f32, dnnl::memory::dims{key.n, 1})
                             : dnnl::memory::desc({key.m, width}, dt::f32, tag::ab);
  slice.bias_md = dnnl::memory::desc({1, width}, dt::f32, tag::ab);
  // Must outlive every primitive_desc built from it: the implementation iterator behind
  // next_impl() keeps a pointer to it.
  const dnnl::matmul::desc desc =
      key.bias ? dnnl::matmul::desc(slice.src_md, slice.w_md, slice.bias_md, slice.dst_md)
               : dnnl::matmul::desc(slice.src_md, slice.w_md, slice.dst_md);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto is_ref = [](const char* name) { return std::strstr(name, "ref") != nullptr; };
  // For f32 with m <= 2 the jit GEMV beats brgemm, which repacks the weights on every call
  // (measured 2x at K = N = 2048). Elsewhere oneDNN's first choice is its best.
  const bool prefer_gemm = key.dtype == DType::kF32 && key.m <= 2;
  int chosen = -1;
  {
    dnnl::matmul::primitive_desc pd(desc, attr, engine, /*allow_empty=*/true);
    int index = 0;
    int first_fast = -1;
    if (pd) {
      do {
        const char* name = pd.impl_info_str();
        if (!is_ref(name)) {
          if (first_fast < 0) first_fast = index;
          if (!prefer_gemm || std::strstr(name, "gemm") != nullptr) {
            chosen = index;
            break;
          }
        }
        ++index;
      } while (pd.next_impl());
    }
    if (chosen < 0) chosen = first_fast;
  }
  if (chosen < 0) return false;  // only reference code, or nothing
  dnnl::matmul::primitive_desc pd(desc, attr, engine);
  for (int i = 0; i < chosen; ++i) pd.next_impl();
  impl = pd.impl_info_str();
  slice.scratch_bytes = pd.scratchpad_desc().get_size();
  slice.prim = dnnl::matmul(pd);
  return true;
}

void CpuBackend::Impl::run_slice(const MatmulPlan& plan, int64_t index, int slot, const void* src,
                                 const void* w, const float* bias, float* y, int64_t n_total, int64_t k,
                                 size_t elem_bytes) {
  const bool last = index == plan.n_slices - 1;
  const MatmulSlice& sl = last && plan.n_slices * plan.width != n_total ? plan.tail : plan.full;
  const int64_t n0 = index * plan.width;
  const auto* w_bytes = static_cast<const uint8_t*>(w) + static_cast<size_t>(n0 * k) * elem_bytes;
  float* dst = y + n0;
  if (sl.staged) {
    std::vector<float>& stage = staging[static_cast<size_t>(slot)];
    const size_t need = static_cast<size_t>(sl.dst_md.dims()[0] * sl.dst_md.dims()[1]);
    if (stage.size() < need) stage.resize(need);
    dst = stage.data();
  }
  execute_slice(sl, slot, src, w_bytes, bias != nullptr ? bias + n0 : nullptr, dst);
  if (sl.staged) {
    const int64_t rows = sl.dst_md.dims()[0];
    const int64_t width = sl.dst_md.dims()[1];
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(y + i * n_total + n0, dst + i * width, static_cast<size_t>(width) * sizeof(float));
    }
  }
}

void CpuBackend::Impl::execute_slice(const MatmulSlice& sl, int slot, const void* src, const void* w,
                                     const float* bias, float* dst) {
  std::vector<uint8_t>& pad = scratch[static_cast<size_t>(slot)];
  if (pad.size() < sl.scratch_bytes) pad.resize(sl.scratch_bytes);
  // Single-threaded oneDNN inside this task (see find_omp_set_num_threads).
  if (omp_set_num_threads != nullptr) omp_set_num_threads(1);
  // oneDNN takes non-const handles but only reads src/weights/bias.
  std::unordered_map<int, dnnl::memory> args = {
      {DNNL_ARG_SRC, dnnl::memory(sl.src_md, engine, const_cast<void*>(src))},
      {DNNL_ARG_WEIGHTS, dnnl::memory(sl.w_md, engine, const_cast<void*>(w))},
      {DNNL_ARG_DST, dnnl::memory(sl.dst_md, engine, dst)},
  };
  if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, dnnl::memory(sl.bias_md, engine, const_cast<float*>(bias)));
  if (sl.scratch_bytes > 0) {
    args.emplace(DNNL_ARG_SCRATCHPAD,
                 dnnl::memory(dnnl::memory::desc({static_cast<int64_t>(sl.scratch_bytes)},
                                                 dnnl::memory::data_type::u8, dnnl::memory::format_tag::a),
                              engine, pad.data()));
  }
  dnnl::stream& stream = streams[static_cast<size_t>(slot)];
  sl.prim.execute(stream, args);
  stream.wait();
}

Status CpuBackend::Impl::matmul_fallback(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                                         float* y) {
  const int64_t n_total = w.rows;
  const int64_t k = w.cols;
  // Enough output rows per task that each streams a few hundred KB of weights.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(k, 1));
  if (w.dtype == DType::kF32) {
    parallel(n_total, grain, [&](int64_t n0, int64_t n1) {
      matmul_rows_f32(x, m, k, static_cast<const float*>(w.data), bias, n0, n1, n_total, y);
    });
  } else {
    // x is rounded to bf16 as on the oneDNN path, so results do not depend on whether this CPU
    // has avx512_core (oneDNN's bf16 kernels) or takes this loop.
    const size_t count = static_cast<size_t>(m * k);
    if (x_bf16.size() < count) x_bf16.resize(count);
    if (x_rounded.size() < count) x_rounded.resize(count);
    parallel(static_cast<int64_t>(count), 1 << 16, [&](int64_t b, int64_t e) {
      f32_to_bf16_range(x + b, x_bf16.data() + b, e - b);
      bf16_to_f32_range(x_bf16.data() + b, x_rounded.data() + b, e - b);
    });
    const float* xr = x_rounded.data();
    parallel(n_total, grain, [&](int64_t n0, int64_t n1) {
      thread_local std::vector<float> wbuf;
      if (wbuf.size() < static_cast<size_t>(k)) wbuf.resize(static_cast<size_t>(k));
      matmul_rows_bf16(xr, m, k, static_cast<const uint16_t*>(w.data), bias, n0, n1, n_total, wbuf.data(), y);
    });
  }
  return Status::ok();
}

Status CpuBackend::Impl::matmul_plain(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                                      float* y) {
  const MatmulKey key{m, w.cols, w.rows, w.dtype, bias != nullptr};
  std::string& last_path = w.dtype == DType::kBF16 ? last_path_bf16 : last_path_f32;
  if (force_matmul_fallback) {
    last_path = "fallback";
    return matmul_fallback(x, m, w, bias, y);
  }
  if (w.dtype == DType::kF32 && m >= 2 && m <= kRowLoopMaxRows) {
    last_path = "rows:small-batch";
    return matmul_fallback(x, m, w, bias, y);
  }
  MatmulPlan& plan = plan_for(key);
  if (!plan.usable) {
    last_path = "fallback";
    return matmul_fallback(x, m, w, bias, y);
  }
  const void* src = x;
  if (w.dtype == DType::kBF16) {
    const size_t count = static_cast<size_t>(m * w.cols);
    if (x_bf16.size() < count) x_bf16.resize(count);
    uint16_t* dst = x_bf16.data();
    parallel(static_cast<int64_t>(count), 1 << 16,
               [&](int64_t b, int64_t e) { f32_to_bf16_range(x + b, dst + b, e - b); });
    src = dst;
  }
  const size_t elem_bytes = w.dtype == DType::kBF16 ? 2 : 4;
  if (plan.n_slices == 1 || num_threads <= 1) {
    // Inline on the caller: slot 0 is free, slices only run under matmul_mu.
    for (int64_t i = 0; i < plan.n_slices; ++i) {
      run_slice(plan, i, 0, src, w.data, bias, y, w.rows, w.cols, elem_bytes);
    }
  } else {
    arena->execute([&] {
      tbb::parallel_for(int64_t{0}, plan.n_slices, [&](int64_t i) {
        // Inside the arena the slot index is unique among the threads running its tasks.
        const int slot = std::max(0, tbb::this_task_arena::current_thread_index());
        run_slice(plan, i, slot, src, w.data, bias, y, w.rows, w.cols, elem_bytes);
      });
    });
  }
  last_path = "onednn:" + plan.impl;
  return Status::ok();
}

Status CpuBackend::Impl::matmul_blocks(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                                       float* y) {
  if (m > kQuantGemvMaxRows) return matmul_block_tiles(x, m, w, bias, y);
  const QuantMatrix q{*ggml_block_type_id(w.dtype), w.rows, w.cols, w.data};
  // quant_gemv splits its output rows over oneTBB in the caller's arena: ours.
  Status st;
  const QuantGemvOptions opts{QuantPath::kAuto, /*parallel=*/num_threads > 1};
  arena->execute([&] { st = quant_gemv(q, x, m, y, opts); });
  SPX_RETURN_IF_ERROR(st);
  if (bias != nullptr) {
    for (int64_t i = 0; i < m; ++i) add_range(y + i * w.rows, bias, w.rows);
  }
  last_path_block = "quant_gemv:" + std::string(quant_path_name(resolve_quant_path(QuantPath::kAuto)));
  return Status::ok();
}

const TileSlice& CpuBackend::Impl::tile_slice(int64_t m, int64_t k, int64_t n_total, int64_t width, bool bias) {
  const TileKey key{{m, k, n_total, DType::kF32, bias}, width};
  auto it = tile_slices.find(key);
  if (it != tile_slices.end()) return it->second;
  TileSlice& t = tile_slices[key];
  try {
    std::string impl;
    t.usable = make_best_slice(key.key, width, /*whole=*/false, t.slice, impl);
  } catch (const dnnl::error&) {
    t.usable = false;  // the row loop serves it
  }
  return t;
}

Status CpuBackend::Impl::matmul_block_tiles(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                                            float* y) {
  const uint32_t ggml_type = *ggml_block_type_id(w.dtype);
  const int64_t k = w.cols;
  const int64_t tile_rows = std::min(w.rows, std::max(kBlockTileMinRows, kBlockTileBytes / (k * 4) / 16 * 16));
  const int64_t n_tiles = (w.rows + tile_rows - 1) / tile_rows;
  const int64_t last_rows = w.rows - (n_tiles - 1) * tile_rows;
  if (tile_slices.size() + 2 > kMaxPlans) tile_slices.clear();  // before taking references into it
  const TileSlice& full = tile_slice(m, k, w.rows, tile_rows, bias != nullptr);
  const TileSlice& last = tile_slice(m, k, w.rows, last_rows, bias != nullptr);
  if (tile_bufs.size() < streams.size()) tile_bufs.resize(streams.size());
  const size_t row_bytes = w.row_bytes();
  const auto* src = static_cast<const uint8_t*>(w.data);
  Status failed;
  std::mutex failed_mu;
  // One task per tile: decode its rows into the slot's buffer (it stays in cache), then multiply
  // them on one thread, writing y's columns of those rows. No barrier between tiles.
  auto run_tile = [&](int64_t t, int slot) {
    const int64_t r0 = t * tile_rows;
    const int64_t rows = t == n_tiles - 1 ? last_rows : tile_rows;
    std::vector<float>& buf = tile_bufs[static_cast<size_t>(slot)];
    if (buf.size() < static_cast<size_t>(tile_rows * k)) buf.resize(static_cast<size_t>(tile_rows * k));
    const Status st = dequantize_rows(ggml_type, src + static_cast<size_t>(r0) * row_bytes, rows, k, buf.data());
    if (!st.is_ok()) {
      std::lock_guard<std::mutex> lock(failed_mu);
      failed = st;
      return;
    }
    const float* b = bias != nullptr ? bias + r0 : nullptr;
    const TileSlice& ts = t == n_tiles - 1 ? last : full;
    if (!ts.usable) {
      matmul_rows_f32(x, m, k, buf.data(), b, 0, rows, w.rows, y + r0);
      return;
    }
    if (!ts.slice.staged) {
      execute_slice(ts.slice, slot, x, buf.data(), b, y + r0);
      return;
    }
    std::vector<float>& stage = staging[static_cast<size_t>(slot)];
    if (stage.size() < static_cast<size_t>(m * rows)) stage.resize(static_cast<size_t>(m * rows));
    execute_slice(ts.slice, slot, x, buf.data(), b, stage.data());
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(y + i * w.rows + r0, stage.data() + i * rows, static_cast<size_t>(rows) * sizeof(float));
    }
  };
  if (num_threads <= 1 || n_tiles == 1) {
    for (int64_t t = 0; t < n_tiles; ++t) run_tile(t, 0);
  } else {
    arena->execute([&] {
      tbb::parallel_for(int64_t{0}, n_tiles, [&](int64_t t) {
        run_tile(t, std::max(0, tbb::this_task_arena::current_thread_index()));
      });
    });
  }
  SPX_RETURN_IF_ERROR(failed);
  last_path_block = std::string("dequantised-tiles+") + (full.usable ? (full.slice.staged ? "onednn:staged" : "onednn") : "rows");
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------
// Attention: one kernel for both KV layouts. Tasks are (item, tile of new tokens, KV head, key
// chunk). All query heads sharing a KV head are processed together, so each K/V row is read once
// per tile, not once per head. Long contexts with too few tasks to fill the threads are split
// over keys (flash-decoding); the per-chunk (max, sum, weighted V) partials are merged afterwards.
// What differs between dense and sparse attention is only how a task reads its keys, which a
// KV reader says (PagedCausalKv, WorkingSetKv):
//   items / head_dim(): the items and their one head_dim, each item with token_offset, n_tokens
//     and a view (kv_heads, dtype);
//   keys(i, t1, h): key positions [0, keys) that tokens < t1 of item i see from KV head h;
//   kCausal: whether token t of item i sees only positions < limit(i, t) (else every key);
//   block(i, h, pos, k1): the next ≤ kKeyBlock keys from pos (< k1), in one contiguous run.

namespace {

struct KvBlock {
  const void* k_base;
  const void* v_base;
  int64_t first;  // element offset of the first row in k_base / v_base
  int64_t rows;
};

// The paged cache under the causal mask: token t of an item sees positions ≤ start_pos + t.
// A block stays within one page.
struct PagedCausalKv {
  static constexpr bool kCausal = true;
  const AttentionItem* items;
  static const KvLayerView& view(const AttentionItem& it) { return it.kv; }
  int64_t head_dim() const { return items[0].kv.head_dim; }
  int64_t keys(int64_t i, int64_t t1, int64_t /*kvh*/) const { return items[i].start_pos + t1; }
  int64_t limit(int64_t i, int64_t t) const { return items[i].start_pos + t + 1; }
  KvBlock block(int64_t i, int64_t kvh, int64_t pos, int64_t k1) const {
    const KvLayerView& kv = items[i].kv;
    const int64_t page = pos / kv.page_size;
    const int64_t slot = pos % kv.page_size;
    return {kv.k_pages[page], kv.v_pages[page], (kvh * kv.page_size + slot) * kv.head_dim,
            std::min({kKeyBlock, kv.page_size - slot, k1 - pos})};
  }
};

// A working set ([kv_heads][slots][head_dim], one head's rows contiguous): every token of an item
// sees the first counts[h] rows of head h; no mask.
struct WorkingSetKv {
  static constexpr bool kCausal = false;
  const SparseAttentionItem* items;
  static const WorkingSetView& view(const SparseAttentionItem& it) { return it.ws; }
  int64_t head_dim() const { return items[0].ws.head_dim; }
  int64_t keys(int64_t i, int64_t /*t1*/, int64_t kvh) const { return items[i].ws.counts[kvh]; }
  KvBlock block(int64_t i, int64_t kvh, int64_t pos, int64_t k1) const {
    const WorkingSetView& ws = items[i].ws;
    return {ws.k, ws.v, (kvh * ws.slots + pos) * ws.head_dim, std::min(kKeyBlock, k1 - pos)};
  }
};

// Selected positions of the paged cache, read in place (attention_indexed): head h of an item
// sees indices[h·stride + j], j < counts[h]; no mask. Blocks are WorkingSetKv's (kKeyBlock keys
// from pos), so over indices in a working set's slot order the arithmetic is attention_sparse's
// bit for bit. A block whose positions are consecutive within one page is read where it lies;
// any other is copied, as stored (no conversion), into a per-thread block that attend_rows then
// reads as it reads a working set.
struct IndexedPagedKv {
  static constexpr bool kCausal = false;
  const IndexedAttentionItem* items;
  static const KvLayerView& view(const IndexedAttentionItem& it) { return it.kv; }
  int64_t head_dim() const { return items[0].kv.head_dim; }
  int64_t keys(int64_t i, int64_t /*t1*/, int64_t kvh) const { return items[i].counts[kvh]; }
  KvBlock block(int64_t i, int64_t kvh, int64_t pos, int64_t k1) const {
    const IndexedAttentionItem& it = items[i];
    const KvLayerView& kv = it.kv;
    const int64_t d = kv.head_dim;
    const int32_t* idx = it.indices + kvh * it.stride + pos;
    const int64_t n = std::min(kKeyBlock, k1 - pos);
    const int64_t t0 = idx[0];
    const int64_t slot = t0 % kv.page_size;
    int64_t run = 1;
    while (run < n && slot + run < kv.page_size && idx[run] == t0 + run) ++run;
    if (run == n) {
      const int64_t page = t0 / kv.page_size;
      return {kv.k_pages[page], kv.v_pages[page], (kvh * kv.page_size + slot) * d, n};
    }
    const size_t row_bytes = static_cast<size_t>(d) * dtype_size(kv.dtype);
    thread_local std::vector<float> rows;  // [K block][V block], kKeyBlock rows each
    const size_t need = (2 * static_cast<size_t>(kKeyBlock) * row_bytes + sizeof(float) - 1) / sizeof(float);
    if (rows.size() < need) rows.resize(need);
    auto* k_dst = reinterpret_cast<std::byte*>(rows.data());
    std::byte* v_dst = k_dst + static_cast<size_t>(kKeyBlock) * row_bytes;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = idx[r];
      const int64_t off = (kvh * kv.page_size + t % kv.page_size) * d;
      std::memcpy(k_dst + r * row_bytes, element_at(kv.k_pages[t / kv.page_size], kv.dtype, off), row_bytes);
      std::memcpy(v_dst + r * row_bytes, element_at(kv.v_pages[t / kv.page_size], kv.dtype, off), row_bytes);
    }
    return {k_dst, v_dst, 0, n};
  }
};

}  // namespace

template <typename Kv>
Status CpuBackend::Impl::attend(const float* q, const Kv& kv, int64_t n_items, int64_t n_heads, float* out) {
  if (n_items == 0) return Status::ok();
  const int64_t d = kv.head_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const auto group_of = [&](int64_t i) { return n_heads / Kv::view(kv.items[i]).kv_heads; };
  const auto tile_of = [&](int64_t i) { return std::max<int64_t>(1, kMaxTileQueries / group_of(i)); };

  // 1. Tasks. A head without keys (an empty working set) still gets one (empty) task: it writes zeros.
  std::vector<AttnTask> tasks;
  std::vector<AttnGroup> groups;
  int64_t base_tasks = 0;
  for (int64_t i = 0; i < n_items; ++i) {
    base_tasks += (kv.items[i].n_tokens + tile_of(i) - 1) / tile_of(i) * Kv::view(kv.items[i]).kv_heads;
  }
  const int64_t split = chunks_wanted(base_tasks);
  int64_t partial_floats = 0;
  for (int64_t i = 0; i < n_items; ++i) {
    const int64_t n_tokens = kv.items[i].n_tokens;
    const int64_t tile = tile_of(i);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += tile) {
      const int64_t t1 = std::min(n_tokens, t0 + tile);
      const int64_t nq = (t1 - t0) * group_of(i);
      for (int64_t h = 0; h < Kv::view(kv.items[i]).kv_heads; ++h) {
        const int64_t keys = kv.keys(i, t1, h);  // the last token of the tile sees the most
        int64_t chunk = std::max<int64_t>(keys, 1);
        if (attention_chunk > 0) {
          chunk = attention_chunk;
        } else if (split > 1) {
          chunk = std::max(kMinChunk, (keys + split - 1) / split);
        }
        const int64_t n_chunks = std::max<int64_t>(1, (keys + chunk - 1) / chunk);
        AttnGroup g{tasks.size(), 0};
        for (int64_t c = 0; c < n_chunks; ++c) {
          int64_t partial = -1;
          if (n_chunks > 1) {
            partial = partial_floats;
            partial_floats += nq * (d + 2);
          }
          tasks.push_back(
              {i, h, t0, t1, std::min(keys, c * chunk), std::min(keys, (c + 1) * chunk), partial});
        }
        g.task_end = tasks.size();
        if (n_chunks > 1) groups.push_back(g);
      }
    }
  }
  float* partial_base = partial_scratch(partial_floats);

  // 2. Every task folds its keys into the online-softmax state of its queries.
  auto run_task = [&](const AttnTask& task) {
    const int64_t group = group_of(task.item);
    const int64_t token_offset = kv.items[task.item].token_offset;
    const DType dtype = Kv::view(kv.items[task.item]).dtype;
    const int64_t nq = (task.t1 - task.t0) * group;
    const auto [qs, acc, m_state, l_state, s] = task_scratch(nq, d);
    thread_local std::vector<int64_t> limits;
    if (limits.size() < static_cast<size_t>(nq * 2)) limits.resize(static_cast<size_t>(nq * 2));
    int64_t* limit = limits.data();  // [nq] first key position query r may not see (causal)
    int64_t* valid = limit + nq;     // [nq] keys of the block query r sees
    for (int64_t t = task.t0; t < task.t1; ++t) {
      // Heads kvh*group .. kvh*group+group-1 are adjacent in q's row.
      const float* src = q + ((token_offset + t) * n_heads + task.kvh * group) * d;
      float* dst = qs + (t - task.t0) * group * d;
      for (int64_t e = 0; e < group * d; ++e) dst[e] = src[e] * scale;
      if constexpr (Kv::kCausal) std::fill_n(limit + (t - task.t0) * group, group, kv.limit(task.item, t));
    }
    for (int64_t pos = task.k0; pos < task.k1;) {
      const KvBlock b = kv.block(task.item, task.kvh, pos, task.k1);
      if constexpr (Kv::kCausal) {
        for (int64_t r = 0; r < nq; ++r) valid[r] = std::clamp<int64_t>(limit[r] - pos, 0, b.rows);
      } else {
        std::fill(valid, valid + nq, b.rows);
      }
      attend_rows(qs, nq, d, valid, b.k_base, b.v_base, dtype, b.first, b.rows, m_state, l_state, acc, s);
      pos += b.rows;
    }
    store_task_result(task, nq, group, d, n_heads, token_offset, m_state, l_state, acc, out, partial_base);
  };
  parallel(static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) run_task(tasks[static_cast<size_t>(i)]);
  });

  // 3. Merge split-K partials.
  merge_partials(tasks, groups, n_heads, d, partial_base, out, [&](int64_t item) {
    return std::pair<int64_t, int64_t>(kv.items[item].token_offset, group_of(item));
  });
  return Status::ok();
}

int64_t CpuBackend::Impl::chunks_wanted(int64_t base_tasks) const {
  const int64_t target_tasks = 4 * static_cast<int64_t>(num_threads);
  return base_tasks >= target_tasks ? 1 : (target_tasks + base_tasks - 1) / std::max<int64_t>(base_tasks, 1);
}

template <typename Layout>
void CpuBackend::Impl::merge_partials(const std::vector<AttnTask>& tasks,
                                      const std::vector<AttnGroup>& groups, int64_t n_heads, int64_t d,
                                      const float* partial_base, float* out, Layout&& layout) {
  parallel(static_cast<int64_t>(groups.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t gi = b; gi < e; ++gi) {
      const AttnGroup& g = groups[static_cast<size_t>(gi)];
      const AttnTask& first = tasks[g.task_begin];
      const auto [token_offset, group] = layout(first.item);
      const int64_t nq = (first.t1 - first.t0) * group;
      for (int64_t r = 0; r < nq; ++r) {
        float big_m = -std::numeric_limits<float>::infinity();
        for (size_t ti = g.task_begin; ti < g.task_end; ++ti) {
          big_m = std::max(big_m, partial_base[tasks[ti].partial + r]);
        }
        const int64_t t = first.t0 + r / group;
        const int64_t h = first.kvh * group + r % group;
        float* o = out + ((token_offset + t) * n_heads + h) * d;
        std::fill(o, o + d, 0.0f);
        float denom = 0.0f;
        for (size_t ti = g.task_begin; ti < g.task_end; ++ti) {
          const float* p = partial_base + tasks[ti].partial;
          const float mc = p[r];
          if (mc == -std::numeric_limits<float>::infinity()) continue;  // chunk beyond its mask
          const float w = std::exp(mc - big_m);
          denom += w * p[nq + r];
          const float* a = p + 2 * nq + r * d;
          for (int64_t k = 0; k < d; ++k) o[k] += w * a[k];
        }
        const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
        for (int64_t k = 0; k < d; ++k) o[k] *= inv;
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// CpuBackend

CpuBackend::CpuBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuBackend::~CpuBackend() = default;

Result<std::unique_ptr<CpuBackend>> CpuBackend::create(const CpuBackendOptions& options) {
  if (options.num_threads < 0) {
    return invalid_argument("CpuBackendOptions.num_threads must be >= 0");
  }
  if (options.attention_chunk < 0) {
    return invalid_argument("CpuBackendOptions.attention_chunk must be >= 0");
  }
  std::unique_ptr<Impl> impl;
  Status st = guarded("create CPU backend", [&]() -> Status {
    impl = std::make_unique<Impl>();
    auto topo = system_topology();
    int nodes = 1;
    int node = std::max(options.numa_node, 0);
    if (topo.is_ok()) {
      nodes = (*topo)->num_numa_nodes();
      node = options.numa_node < 0 ? (*topo)->node_of_current_thread() : options.numa_node;
    } else if (verbose_logging()) {
      std::fprintf(stderr, "[specontext cpu] no hwloc topology (%s); assuming one NUMA node\n",
                   topo.status().to_string().c_str());
    }
    if (node >= nodes) {
      return invalid_argument("NUMA node " + std::to_string(node) + " does not exist (machine has " +
                              std::to_string(nodes) + ")");
    }
    int threads = options.num_threads;
    if (threads == 0 && topo.is_ok()) threads = (*topo)->cores_in_node(node);
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    impl->num_threads = threads;
    impl->numa_node = node;
    impl->attention_chunk = options.attention_chunk;
    impl->force_matmul_fallback = options.force_matmul_fallback;
    impl->omp_set_num_threads = find_omp_set_num_threads();
    impl->arena = std::make_unique<tbb::task_arena>(threads);
    impl->arena->initialize();
    // On one node pinning changes nothing but costs a syscall per worker entry: skip it.
    if (topo.is_ok() && nodes > 1) {
      impl->pinning = std::make_unique<NodePinningObserver>(*impl->arena, **topo, node);
    }
    impl->engine = dnnl::engine(dnnl::engine::kind::cpu, 0);
    const int slots = std::max(impl->arena->max_concurrency(), 1);
    for (int i = 0; i < slots; ++i) impl->streams.emplace_back(impl->engine);
    impl->scratch.resize(static_cast<size_t>(slots));
    impl->staging.resize(static_cast<size_t>(slots));
    if (verbose_logging()) {
      std::fprintf(stderr, "[specontext cpu] backend: node %d of %d, %d threads, kernels %s, oneDNN %s\n",
                   node, nodes, threads, isa_name(active_isa()),
                   impl->omp_set_num_threads ? "OpenMP" : "(no omp symbol)");
    }
    return Status::ok();
  });
  if (!st.is_ok()) return st;
  return std::unique_ptr<CpuBackend>(new (std::nothrow) CpuBackend(std::move(impl)));
}

int CpuBackend::num_threads() const { return impl_->num_threads; }
int CpuBackend::numa_node() const { return impl_->numa_node; }

std::string CpuBackend::matmul_path(DType dtype) const {
  std::lock_guard<std::mutex> lock(impl_->matmul_mu);
  if (is_block_dtype(dtype)) return impl_->last_path_block;
  return dtype == DType::kBF16 ? impl_->last_path_bf16 : impl_->last_path_f32;
}

bool CpuBackend::supports(BackendOp op, DType weight_dtype) const {
  const std::optional<uint32_t> block = ggml_block_type_id(weight_dtype);
  const bool runs_blocks = block && quant_gemv_supports(*block);
  switch (op) {
    case BackendOp::kMatmul:
      return weight_dtype == DType::kF32 || weight_dtype == DType::kBF16 || runs_blocks;
    case BackendOp::kEmbed:
      return weight_dtype == DType::kF32 || weight_dtype == DType::kBF16 || weight_dtype == DType::kF16 ||
             runs_blocks;
    default:
      return true;  // no weight matrix involved
  }
}

Status CpuBackend::embed(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) {
  if (is_block_dtype(table.dtype)) {
    SPX_RETURN_IF_ERROR(check_embed_ids(ids, n, table));
    return guarded("embed", [&]() -> Status { return embed_blocks(ids, n, table, out); });
  }
  SPX_RETURN_IF_ERROR(check_embed_args(ids, n, table));
  return guarded("embed", [&]() -> Status {
    const int64_t cols = table.cols;
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(cols, 1));
    impl_->parallel(n, grain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const size_t row = static_cast<size_t>(ids[i]) * static_cast<size_t>(cols);
        float* o = out + i * cols;
        switch (table.dtype) {
          case DType::kF32:
            std::memcpy(o, static_cast<const float*>(table.data) + row, static_cast<size_t>(cols) * 4);
            break;
          case DType::kBF16:
            bf16_to_f32_range(static_cast<const uint16_t*>(table.data) + row, o, cols);
            break;
          default:  // kF16 (checked above)
            convert_to_f32(DType::kF16, static_cast<const uint16_t*>(table.data) + row, o,
                           static_cast<size_t>(cols));
            break;
        }
      }
    });
    return Status::ok();
  });
}

Status CpuBackend::embed_blocks(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) {
  const uint32_t ggml_type = *ggml_block_type_id(table.dtype);
  const size_t row_bytes = table.row_bytes();
  Status decoded;
  std::mutex decoded_mu;
  impl_->parallel(n, std::max<int64_t>(1, 4096 / table.cols), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const auto* row = static_cast<const uint8_t*>(table.data) + static_cast<size_t>(ids[i]) * row_bytes;
      const Status st = dequantize_rows(ggml_type, row, 1, table.cols, out + i * table.cols);
      if (!st.is_ok()) {
        std::lock_guard<std::mutex> lock(decoded_mu);
        decoded = st;
      }
    }
  });
  return decoded;
}

Status CpuBackend::matmul(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y) {
  if (!is_block_dtype(w.dtype) || !supports(BackendOp::kMatmul, w.dtype)) {
    SPX_RETURN_IF_ERROR(check_matmul_dtype(w.dtype));
  }
  if (m <= 0 || w.rows <= 0) return Status::ok();
  if (w.cols <= 0) {  // empty reduction: y = bias or 0 (oneDNN rejects zero-size K)
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t n = 0; n < w.rows; ++n) y[i * w.rows + n] = bias != nullptr ? bias[n] : 0.0f;
    }
    return Status::ok();
  }
  return guarded("matmul", [&]() -> Status {
    Impl& s = *impl_;
    std::lock_guard<std::mutex> lock(s.matmul_mu);
    return is_block_dtype(w.dtype) ? s.matmul_blocks(x, m, w, bias, y) : s.matmul_plain(x, m, w, bias, y);
  });
}

Status CpuBackend::rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps,
                           float* y) {
  return guarded("rmsnorm", [&]() -> Status {
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1));
    impl_->parallel(rows, grain, [&](int64_t b, int64_t e) { rmsnorm_rows(x, weight, b, e, dim, eps, y); });
    return Status::ok();
  });
}

Status CpuBackend::rope(float* x, int64_t n_tokens, int64_t n_heads, const int64_t* positions,
                        const RopeParams& params) {
  SPX_RETURN_IF_ERROR(check_rope_params(params));
  return guarded("rope", [&]() -> Status {
    const int64_t d = params.head_dim;
    const int64_t half = d / 2;
    const bool interleaved = params.style == RopeStyle::kInterleaved;
    const float mscale = params.mscale;
    const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(n_heads * d, 1));
    impl_->parallel(n_tokens, grain, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> cs;
      if (cs.size() < static_cast<size_t>(d)) cs.resize(static_cast<size_t>(d));
      float* cosv = cs.data();
      float* sinv = cs.data() + half;
      for (int64_t t = b; t < e; ++t) {
        // Same float expressions as the reference: sin/cos once per token, reused by all heads.
        for (int64_t i = 0; i < half; ++i) {
          const float angle = static_cast<float>(positions[t]) * params.inv_freq[static_cast<size_t>(i)];
          cosv[i] = std::cos(angle);
          sinv[i] = std::sin(angle);
        }
        for (int64_t h = 0; h < n_heads; ++h) {
          float* v = x + (t * n_heads + h) * d;
          if (interleaved) {
            for (int64_t i = 0; i < half; ++i) {
              const float x0 = v[2 * i], x1 = v[2 * i + 1];
              v[2 * i] = (x0 * cosv[i] - x1 * sinv[i]) * mscale;
              v[2 * i + 1] = (x0 * sinv[i] + x1 * cosv[i]) * mscale;
            }
          } else {
            for (int64_t i = 0; i < half; ++i) {
              const float x0 = v[i], x1 = v[i + half];
              v[i] = (x0 * cosv[i] - x1 * sinv[i]) * mscale;
              v[i + half] = (x0 * sinv[i] + x1 * cosv[i]) * mscale;
            }
          }
        }
      }
    });
    return Status::ok();
  });
}

Status CpuBackend::swiglu(const float* gate, const float* up, int64_t n, float* out) {
  return guarded("swiglu", [&]() -> Status {
    impl_->parallel(n, 1 << 14,
                    [&](int64_t b, int64_t e) { swiglu_range(gate + b, up + b, e - b, out + b); });
    return Status::ok();
  });
}

Status CpuBackend::add(float* x, const float* y, int64_t n) {
  return guarded("add", [&]() -> Status {
    impl_->parallel(n, 1 << 15, [&](int64_t b, int64_t e) { add_range(x + b, y + b, e - b); });
    return Status::ok();
  });
}

Status CpuBackend::retrieval_group_scores(const float* q, const void* const* k_blocks, DType k_dtype,
                                          int64_t block_tokens, int64_t length, int64_t n_heads, int64_t n_kv_heads,
                                          int64_t head_dim, float* out) {
  if (length <= 0) return Status::ok();
  if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || head_dim <= 0 || block_tokens <= 0 ||
      !is_head_key_dtype(k_dtype)) {  // the default names the argument
    return Backend::retrieval_group_scores(q, k_blocks, k_dtype, block_tokens, length, n_heads, n_kv_heads,
                                           head_dim, out);
  }
  return guarded("retrieval_group_scores", [&]() -> Status {
    Impl& s = *impl_;
    std::lock_guard<std::mutex> lock(s.retrieval_mu);
    std::vector<float>& logits = s.retrieval_logits;
    logits.resize(static_cast<size_t>(n_heads * length));
    float* lg = logits.data();
    const int64_t grain = std::max<int64_t>(64, (int64_t{1} << 14) / std::max<int64_t>(n_heads * head_dim, 1));
    s.parallel(length, grain, [&](int64_t t0, int64_t t1) {
      head_logits(q, k_blocks, k_dtype, block_tokens, t0, t1, length, n_heads, n_kv_heads, head_dim, lg);
    });
    // The softmax of each head's row, the heads spread over the threads (each row whole on one
    // thread, by the host default's softmax_rows: the same bits).
    s.parallel(n_heads, 1, [&](int64_t h0, int64_t h1) { softmax_rows(lg + h0 * length, h1 - h0, length); });
    s.parallel(length, 1 << 12, [&](int64_t t0, int64_t t1) {
      group_max(lg, t0, t1, length, n_heads, n_kv_heads, out);
    });
    return Status::ok();
  });
}

Status CpuBackend::select_top_tokens(const float* group_scores, int64_t n_kv_heads, int64_t length,
                                     const SelectionOptions& options, Selection& out) {
  if (n_kv_heads <= 1 || length <= 0) {
    select_from_group_scores(std::span<const float>(group_scores, static_cast<size_t>(std::max<int64_t>(n_kv_heads * length, 0))),
                             n_kv_heads, length, options, out);
    return Status::ok();
  }
  return guarded("select_top_tokens", [&]() -> Status {
    const int64_t budget = std::max<int64_t>(options.budget, 1);
    out.kv_heads = n_kv_heads;
    out.budget = budget;
    out.indices.resize(static_cast<size_t>(n_kv_heads * budget));
    out.counts.assign(static_cast<size_t>(n_kv_heads), 0);
    // Each head on its own: select_from_group_scores of one head is that head's part of the
    // selection of all (the heads do not interact).
    impl_->parallel(n_kv_heads, 1, [&](int64_t h0, int64_t h1) {
      Selection one;
      for (int64_t h = h0; h < h1; ++h) {
        select_from_group_scores(std::span<const float>(group_scores + h * length, static_cast<size_t>(length)), 1,
                                 length, options, one);
        const int32_t n = one.counts[0];
        std::copy_n(one.indices.data(), n, out.indices.data() + h * budget);
        out.counts[static_cast<size_t>(h)] = n;
      }
    });
    return Status::ok();
  });
}

Status CpuBackend::kv_append(const float* k, const float* v, int64_t n_tokens, int64_t start_pos,
                             const KvLayerView& kv) {
  SPX_RETURN_IF_ERROR(check_kv_append_args(n_tokens, start_pos, kv));
  return guarded("kv_append", [&]() -> Status {
    const int64_t d = kv.head_dim;
    const int64_t kv_dim = kv.kv_heads * d;
    const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(kv_dim, 1));
    impl_->parallel(n_tokens, grain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const int64_t pos = start_pos + t;
        void* kp = kv.k_pages[pos / kv.page_size];
        void* vp = kv.v_pages[pos / kv.page_size];
        const int64_t slot = pos % kv.page_size;
        for (int64_t h = 0; h < kv.kv_heads; ++h) {
          const int64_t dst = (h * kv.page_size + slot) * d;
          const float* ks = k + t * kv_dim + h * d;
          const float* vs = v + t * kv_dim + h * d;
          if (kv.dtype == DType::kBF16) {  // the vectorised rounding of the matmul path
            f32_to_bf16_range(ks, static_cast<uint16_t*>(kp) + dst, d);
            f32_to_bf16_range(vs, static_cast<uint16_t*>(vp) + dst, d);
          } else {
            convert_from_f32(kv.dtype, ks, element_at(kp, kv.dtype, dst), static_cast<size_t>(d));
            convert_from_f32(kv.dtype, vs, element_at(vp, kv.dtype, dst), static_cast<size_t>(d));
          }
        }
      }
    });
    return Status::ok();
  });
}

Status CpuBackend::attention(const float* q, const AttentionItem* items, int64_t n_items, int64_t n_heads,
                             float* out) {
  SPX_RETURN_IF_ERROR(check_attention_args(items, n_items, n_heads));
  return guarded("attention",
                 [&]() -> Status { return impl_->attend(q, PagedCausalKv{items}, n_items, n_heads, out); });
}

Status CpuBackend::kv_gather(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                             const WorkingSetView& ws) {
  return guarded("kv_gather", [&]() -> Status {  // the duplicate check allocates
    SPX_RETURN_IF_ERROR(check_kv_gather_args(kv, entries, n_entries, ws));
    if (n_entries == 0) return Status::ok();  // the views may be empty then
    const int64_t d = kv.head_dim;
    const size_t row_bytes = static_cast<size_t>(d) * dtype_size(kv.dtype);
    const int64_t grain = std::max<int64_t>(1, 4096 / d);  // ~32 KiB of f32 K+V per task
    impl_->parallel(n_entries, grain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const GatherEntry& g = entries[i];
        const int64_t page = g.token / kv.page_size;
        const int64_t src = (g.kv_head * kv.page_size + g.token % kv.page_size) * d;
        const int64_t dst = (g.kv_head * ws.slots + g.slot) * d;
        std::memcpy(element_at(ws.k, ws.dtype, dst), element_at(kv.k_pages[page], kv.dtype, src), row_bytes);
        std::memcpy(element_at(ws.v, ws.dtype, dst), element_at(kv.v_pages[page], kv.dtype, src), row_bytes);
      }
    });
    return Status::ok();
  });
}

Status CpuBackend::attention_sparse(const float* q, const SparseAttentionItem* items, int64_t n_items,
                                    int64_t n_heads, float* out) {
  SPX_RETURN_IF_ERROR(check_attention_sparse_args(items, n_items, n_heads));
  return guarded("attention_sparse",
                 [&]() -> Status { return impl_->attend(q, WorkingSetKv{items}, n_items, n_heads, out); });
}

Status CpuBackend::attention_indexed(const float* q, const IndexedAttentionItem* items, int64_t n_items,
                                     int64_t n_heads, float* out) {
  SPX_RETURN_IF_ERROR(check_attention_indexed_args(items, n_items, n_heads));
  return guarded("attention_indexed",
                 [&]() -> Status { return impl_->attend(q, IndexedPagedKv{items}, n_items, n_heads, out); });
}

// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<Backend>> create_cpu_backend(const CpuBackendOptions& options) {
  if (options.reference || env_flag("SPECONTEXT_CPU_REFERENCE")) {
    std::unique_ptr<Backend> ref;
    SPX_RETURN_IF_ERROR(guarded("create reference backend", [&]() -> Status {
      ref = std::make_unique<ReferenceBackend>();
      return Status::ok();
    }));
    return ref;
  }
  auto backend = CpuBackend::create(options);
  if (!backend.is_ok()) return backend.status();
  return std::unique_ptr<Backend>(std::move(backend).value());
}

}  // namespace specontext::cpu
