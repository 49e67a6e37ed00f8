// Host mirrors of the device code shared by the dense and sparse flash-decoding kernels
// (gpu/attention_common.cuh), for the plan tests: one warp's lanes become loops, and the
// arithmetic is the kernels' (log2 units, fma order, o * (1 / l)).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "core/base/dtype.h"
#include "core/ports/backend.h"
#include "gpu/kernels.h"

namespace specontext::gpu::plan_test {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr int kKeyTile = static_cast<int>(kernels::kAttentionKeyTile);
inline constexpr int kWarps = kernels::kAttentionWarps;
inline constexpr DType kKvDtypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// The core dtype of a kernel element type (the inverse of the plans' mapping).
inline DType dtype_of(kernels::KvType t) {
  return t == kernels::KvType::kF16 ? DType::kF16 : t == kernels::KvType::kBF16 ? DType::kBF16 : DType::kF32;
}

// Element i of a KV array of dtype t, widened to f32 as the kernels stage it (kv_to_f32 equals
// core's conversion: tests/gpu/kv_convert_test.cc).
inline float kv_load(const void* base, DType t, int64_t i) {
  float f = 0.0f;
  convert_to_f32(t, element_at(base, t, i), &f, 1);
  return f;
}

// n random values in [lo, hi) rounded to dtype t, as raw bytes.
inline std::vector<uint8_t> random_kv(std::mt19937& rng, size_t n, DType t, float lo = -1.0f,
                                      float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> f(n);
  for (float& x : f) x = dist(rng);
  std::vector<uint8_t> bytes(n * dtype_size(t));
  convert_from_f32(t, f.data(), bytes.data(), n);
  return bytes;
}

inline int64_t find_segment(const int64_t* begin, int64_t n, int64_t x) {
  int64_t lo = 0;
  int64_t hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (begin[mid] <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The tile's queries, pre-scaled, as stage_queries lays them out; padding slots are zeros.
inline void stage_queries(std::vector<float>& q_s, const float* q, int qpb, int hd, int64_t pair0,
                          int64_t n_pairs, int64_t token_offset, int64_t group, int64_t kvh, int64_t n_heads,
                          float q_scale) {
  for (int slot = 0; slot < qpb; ++slot) {
    const int64_t pair = pair0 + slot;
    for (int d = 0; d < hd; ++d) {
      float val = 0.0f;
      if (pair < n_pairs) {
        const int64_t row = token_offset + pair / group;
        const int64_t h = kvh * group + pair % group;
        val = q[(row * n_heads + h) * hd + d] * q_scale;
      }
      q_s[static_cast<size_t>(slot * hd + d)] = val;
    }
  }
}

// One key tile (k_s, v_s rows of hd, n_keys of them) for query slot: tile_scores,
// online_softmax_step and accumulate_pv. visible(lane) masks keys; a tile without a visible key
// leaves (m, l, o) alone.
template <typename Visible>
void attend_tile(const float* q_slot, const std::vector<float>& k_s, const std::vector<float>& v_s, int hd,
                 int n_keys, Visible visible, float& m, float& l, float* o) {
  float score[kKeyTile];
  float p[kKeyTile] = {};
  float tile_max = -INFINITY;
  for (int lane = 0; lane < kKeyTile; ++lane) {
    float sc = 0.0f;
    if (lane < n_keys) {
      for (int d = 0; d < hd; ++d) sc = std::fma(q_slot[d], k_s[static_cast<size_t>(lane * hd + d)], sc);
    }
    score[lane] = lane < n_keys && visible(lane) ? sc : -INFINITY;
    tile_max = std::max(tile_max, score[lane]);
  }
  if (tile_max == -INFINITY) return;
  const float m_new = std::max(m, tile_max);
  const float alpha = std::exp2(m - m_new);
  float sum = 0.0f;
  for (int lane = 0; lane < kKeyTile; ++lane) {
    p[lane] = score[lane] == -INFINITY ? 0.0f : std::exp2(score[lane] - m_new);
    sum += p[lane];
  }
  l = std::fma(l, alpha, sum);
  for (int d = 0; d < hd; ++d) o[d] *= alpha;
  m = m_new;
  for (int j = 0; j < n_keys; ++j) {
    for (int d = 0; d < hd; ++d) o[d] = std::fma(p[j], v_s[static_cast<size_t>(j * hd + d)], o[d]);
  }
}

// Split-K scratch as the backend lays it out: partial_ml holds [m][l]; NaN marks unwritten.
struct Partials {
  Partials(size_t o_floats, size_t ml_floats)
      : o(o_floats, std::numeric_limits<float>::quiet_NaN()),
        ml(ml_floats, std::numeric_limits<float>::quiet_NaN()) {}
  float* m() { return ml.data(); }
  float* l() { return ml.data() + ml.size() / 2; }
  std::vector<float> o;
  std::vector<float> ml;
};

// store_query: the result of query pair `pair` (row pair / group of item it, head
// kvh * group + pair % group): o / l into out without a split, else the partial (m, l, o).
template <typename Launch, typename Item>
void store_query(const Launch& a, const Item& it, Partials& partials, float* out, int64_t pair, int64_t group,
                 int64_t kvh, int64_t chunk, float m, float l, const float* o) {
  const int64_t hd = a.head_dim;
  const int64_t h = kvh * group + pair % group;
  if (a.n_chunks_max == 1) {
    const float inv = 1.0f / l;
    const int64_t row = it.token_offset + pair / group;
    for (int64_t d = 0; d < hd; ++d) out[(row * a.n_heads + h) * hd + d] = o[d] * inv;
  } else {
    const int64_t idx = ((it.row_begin + pair / group) * a.n_heads + h) * a.n_chunks_max + chunk;
    std::copy(o, o + hd, partials.o.begin() + idx * hd);
    partials.m()[idx] = m;
    partials.l()[idx] = l;
  }
}

// merge_chunks: partials base + 0 .. n - 1 (n >= 1) of one query into dst.
inline void merge_chunks(Partials& partials, int64_t base, int64_t n, int64_t hd, float* dst) {
  const float* partial_m = partials.m();
  const float* partial_l = partials.l();
  float mx = -INFINITY;
  for (int64_t c = 0; c < n; ++c) mx = std::max(mx, partial_m[base + c]);
  std::vector<float> acc(static_cast<size_t>(hd), 0.0f);
  float denom = 0.0f;
  for (int64_t c = 0; c < n; ++c) {
    const float weight = std::exp2(partial_m[base + c] - mx);
    denom = std::fma(weight, partial_l[base + c], denom);
    for (int64_t d = 0; d < hd; ++d) {
      acc[static_cast<size_t>(d)] =
          std::fma(weight, partials.o[static_cast<size_t>((base + c) * hd + d)], acc[static_cast<size_t>(d)]);
    }
  }
  for (int64_t d = 0; d < hd; ++d) dst[d] = acc[static_cast<size_t>(d)] * (1.0f / denom);
}

// A host paged cache of `dtype` elements with its pages in shuffled order.
struct HostCache {
  std::vector<uint8_t> k, v;
  std::vector<void*> k_pages, v_pages;
  KvLayerView view;
};

inline std::unique_ptr<HostCache> make_cache(std::mt19937& rng, int64_t pages, int64_t ps, int64_t kvh,
                                             int64_t hd, DType dtype = DType::kF32) {
  auto c = std::make_unique<HostCache>();
  const size_t page_elems = static_cast<size_t>(ps * kvh * hd);
  const size_t page_bytes = page_elems * dtype_size(dtype);
  c->k = random_kv(rng, page_elems * static_cast<size_t>(pages), dtype);
  c->v = random_kv(rng, page_elems * static_cast<size_t>(pages), dtype);
  std::vector<int64_t> order(static_cast<size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t p = 0; p < pages; ++p) {
    c->k_pages.push_back(c->k.data() + static_cast<size_t>(order[static_cast<size_t>(p)]) * page_bytes);
    c->v_pages.push_back(c->v.data() + static_cast<size_t>(order[static_cast<size_t>(p)]) * page_bytes);
  }
  c->view = KvLayerView{c->k_pages.data(), c->v_pages.data(), pages, ps, kvh, hd, dtype};
  return c;
}

}  // namespace specontext::gpu::plan_test
