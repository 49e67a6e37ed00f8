// Host loops of the retrieval head's scoring, shared so that every host scorer (the Backend
// default, the CPU backend, retrieval_scores, select_among_candidates) gives bit-identical values.
// The head's keys are stored in the KV dtype (f32, f16 or bf16); f16 / bf16 keys are widened to
// f32 element by element inside the dot product (exact: every f16 / bf16 value is an f32 value),
// so the sums are those of f32 keys holding the same values.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/base/dtype.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace specontext {

// Eight partial sums: the compiler vectorises them without reassociating one float chain.
inline float dot8(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int u = 0; u < 8; ++u) acc[u] += a[i + u] * b[i + u];
  }
  float dot = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) dot += a[i] * b[i];
  return dot;
}

// f16 bits to f32, exact for every value (subnormals, inf, NaN), branch-free so that the dot
// loops below vectorise with it (the bit trick of the FP16 library, Maratyszcza/FP16).
inline float f16_bits_to_f32(uint16_t h) {
  auto as_float = [](uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; };
  auto as_bits = [](float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; };
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = as_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = as_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // all ones or zero: no branch
  return as_float(sign | (as_bits(denormalized) & is_subnormal) | (as_bits(normalized) & ~is_subnormal));
}

// Element i of a key row of dtype T (f32, f16 or bf16), as f32.
template <DType T>
inline float key_at(const void* row, int64_t i) {
  if constexpr (T == DType::kF32) {
    return static_cast<const float*>(row)[i];
  } else if constexpr (T == DType::kF16) {
    return f16_bits_to_f32(static_cast<const uint16_t*>(row)[i]);
  } else {
    static_assert(T == DType::kBF16, "head keys are f32, f16 or bf16");
    return bf16_to_f32(static_cast<const uint16_t*>(row)[i]);
  }
}

// dot8 with b a key row of dtype T, widened on load: for T = f32 the very arithmetic of dot8.
template <DType T>
inline float dot8_key(const float* a, const void* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int u = 0; u < 8; ++u) acc[u] += a[i + u] * key_at<T>(b, i + u);
  }
  float dot = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) dot += a[i] * key_at<T>(b, i);
  return dot;
}

// dot8_key for a dtype known at run time (f32, f16 or bf16; anything else reads as bf16 and is
// refused by the callers' argument checks first).
inline float dot8_key(DType t, const float* a, const void* b, int64_t n) {
  switch (t) {
    case DType::kF32: return dot8_key<DType::kF32>(a, b, n);
    case DType::kF16: return dot8_key<DType::kF16>(a, b, n);
    default: return dot8_key<DType::kBF16>(a, b, n);
  }
}

// Whether `t` is a dtype the head's keys may be stored in (the KV dtypes).
inline bool is_head_key_dtype(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

// A key row of at most this many elements is widened once into a stack buffer for all query heads
// of its group (the same values dot8_key reads, so the same sums); longer rows widen per head.
inline constexpr int64_t kWidenRowMax = 512;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// f16 → f32 by F16C (vcvtph2ps: exact, as f16_bits_to_f32), 8 at a time; the run-time check
// below decides whether it may run.
__attribute__((target("avx,f16c"))) inline void widen_f16_f16c(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = f16_bits_to_f32(src[i]);
}
// AVX (which __builtin_cpu_supports checks with the OS's YMM state) and CPUID.1:ECX.F16C read
// directly: clang 16 (the fuzz build) has no "f16c" feature string for the builtin.
inline bool cpu_has_f16c() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
  }();
  return has;
}
#endif

// dst[i] = key_at<T>(src, i) for i < n (F16C where the CPU has it: the same values).
template <DType T>
inline void widen_key_row(const void* src, float* dst, int64_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if constexpr (T == DType::kF16) {
    if (cpu_has_f16c()) return widen_f16_f16c(static_cast<const uint16_t*>(src), dst, n);
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = key_at<T>(src, i);
}

// logit_h = q_h · k / √head_dim for the `group` query heads q_0.. (rows of head_dim) that share
// the key row k of dtype T, written to out[j·stride]. f16 / bf16 rows are widened once for the
// group (at most kWidenRowMax elements: a stack buffer, never a copy of the cache).
template <DType T>
inline void group_logits(const float* q, const void* k, int64_t group, int64_t head_dim, float scale, float* out,
                         int64_t stride) {
  if constexpr (T != DType::kF32) {
    if (group > 1 && head_dim <= kWidenRowMax) {
      float row[kWidenRowMax];
      widen_key_row<T>(k, row, head_dim);
      for (int64_t j = 0; j < group; ++j) out[j * stride] = dot8(q + j * head_dim, row, head_dim) * scale;
      return;
    }
  }
  for (int64_t j = 0; j < group; ++j) out[j * stride] = dot8_key<T>(q + j * head_dim, k, head_dim) * scale;
}

// group_logits for a dtype known at run time (f32, f16 or bf16).
inline void group_logits(DType t, const float* q, const void* k, int64_t group, int64_t head_dim, float scale,
                         float* out, int64_t stride) {
  switch (t) {
    case DType::kF32: return group_logits<DType::kF32>(q, k, group, head_dim, scale, out, stride);
    case DType::kF16: return group_logits<DType::kF16>(q, k, group, head_dim, scale, out, stride);
    default: return group_logits<DType::kBF16>(q, k, group, head_dim, scale, out, stride);
  }
}

template <DType T>
inline void head_logits_of(const float* q, const void* const* k_blocks, int64_t block_tokens, int64_t t0, int64_t t1,
                           int64_t length, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float* logits) {
  const int64_t group = n_heads / n_kv_heads;
  const int64_t kvd = n_kv_heads * head_dim;
  const size_t elem = T == DType::kF32 ? 4 : 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t t = t0; t < t1; ++t) {
    const auto* row = static_cast<const unsigned char*>(k_blocks[t / block_tokens]) +
                      static_cast<size_t>((t % block_tokens) * kvd) * elem;
    for (int64_t g = 0; g < n_kv_heads; ++g) {
      group_logits<T>(q + g * group * head_dim, row + static_cast<size_t>(g * head_dim) * elem, group, head_dim,
                      scale, logits + g * group * length + t, length);
    }
  }
}

// logits[h][t] = q_h · k_t / √head_dim for tokens [t0, t1), token-major (each key row is read once
// for all query heads of its group). Keys are paged: block b of k_blocks holds tokens
// [b·block_tokens, (b+1)·block_tokens), [block_tokens][n_kv_heads·head_dim] elements of k_dtype
// (f32, f16 or bf16: is_head_key_dtype), converted on load.
inline void head_logits(const float* q, const void* const* k_blocks, DType k_dtype, int64_t block_tokens, int64_t t0,
                        int64_t t1, int64_t length, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                        float* logits) {
  switch (k_dtype) {
    case DType::kF32:
      return head_logits_of<DType::kF32>(q, k_blocks, block_tokens, t0, t1, length, n_heads, n_kv_heads, head_dim,
                                         logits);
    case DType::kF16:
      return head_logits_of<DType::kF16>(q, k_blocks, block_tokens, t0, t1, length, n_heads, n_kv_heads, head_dim,
                                         logits);
    default:
      return head_logits_of<DType::kBF16>(q, k_blocks, block_tokens, t0, t1, length, n_heads, n_kv_heads, head_dim,
                                          logits);
  }
}

// In place: each head's row of logits [n_heads][length] becomes its softmax (max subtracted, the
// sum accumulated in double in ascending token order).
inline void softmax_rows(float* rows, int64_t n_rows, int64_t length) {
  for (int64_t h = 0; h < n_rows; ++h) {
    float* row = rows + h * length;
    float mx = -INFINITY;
    for (int64_t t = 0; t < length; ++t) mx = std::max(mx, row[t]);
    double sum = 0.0;
    for (int64_t t = 0; t < length; ++t) sum += (row[t] = std::exp(row[t] - mx));
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t t = 0; t < length; ++t) row[t] *= inv;
  }
}

// out[g][t] = max over the query heads of group g of probs[h][t], for tokens [t0, t1).
inline void group_max(const float* probs, int64_t t0, int64_t t1, int64_t length, int64_t n_heads,
                      int64_t n_kv_heads, float* out) {
  const int64_t group = n_heads / n_kv_heads;
  for (int64_t g = 0; g < n_kv_heads; ++g) {
    for (int64_t t = t0; t < t1; ++t) {
      float m = 0.0f;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) m = std::max(m, probs[h * length + t]);
      out[g * length + t] = m;
    }
  }
}

}  // namespace specontext
