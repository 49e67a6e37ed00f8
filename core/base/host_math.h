// Host loops of the retrieval head's scoring, shared so that every host scorer (the Backend
// default, the CPU backend, retrieval_scores, select_among_candidates) gives bit-identical values.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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

// logits[h][t] = q_h · k_t / √head_dim for tokens [t0, t1), token-major (each key row is read once
// for all query heads of its group). Keys are paged: block b of k_blocks holds tokens
// [b·block_tokens, (b+1)·block_tokens), [block_tokens][n_kv_heads·head_dim].
inline void head_logits(const float* q, const float* const* k_blocks, int64_t block_tokens, int64_t t0, int64_t t1,
                        int64_t length, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float* logits) {
  const int64_t group = n_heads / n_kv_heads;
  const int64_t kvd = n_kv_heads * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t t = t0; t < t1; ++t) {
    const float* row = k_blocks[t / block_tokens] + (t % block_tokens) * kvd;
    for (int64_t g = 0; g < n_kv_heads; ++g) {
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        logits[h * length + t] = dot8(q + h * head_dim, row + g * head_dim, head_dim) * scale;
      }
    }
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
