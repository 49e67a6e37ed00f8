// Helpers shared by the CPU backend tests: random data, error norms, guarded output buffers and
// a paged KV cache built from ordinary vectors.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "core/base/dtype.h"
#include "core/ports/backend.h"
#include "cpu/cpu_backend.h"

namespace specontext::cpu::testing {

// The optimised backend with `options`; nullptr (and a test failure naming why) if it cannot start.
inline std::unique_ptr<CpuBackend> make_cpu(const CpuBackendOptions& options = {}) {
  auto b = CpuBackend::create(options);
  EXPECT_TRUE(b.is_ok()) << b.status().to_string();
  return b.is_ok() ? std::move(b).value() : nullptr;
}

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

inline double l2_norm(const float* a, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * a[i];
  return std::sqrt(s);
}

// ||got - want|| / ||want||; +inf when want is all zero (a test would then prove nothing).
inline double rel_l2(const float* got, const float* want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  if (den == 0) return std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

inline bool all_finite(const float* a, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return false;
  }
  return true;
}

// An output buffer of n floats with sentinel regions on both sides; intact() says whether an op
// wrote outside its bounds.
class GuardedBuffer {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr float kSentinel = -12345.678f;
  explicit GuardedBuffer(size_t n, float fill = 0.0f) : n_(n) {
    buf_.reserve(n + 2 * kGuard);
    buf_.insert(buf_.end(), kGuard, kSentinel);
    buf_.insert(buf_.end(), n, fill);
    buf_.insert(buf_.end(), kGuard, kSentinel);
  }
  float* data() { return buf_.data() + kGuard; }
  const float* data() const { return buf_.data() + kGuard; }
  size_t size() const { return n_; }
  float& operator[](size_t i) { return data()[i]; }
  bool intact() const {
    for (size_t i = 0; i < kGuard; ++i) {
      if (std::memcmp(&buf_[i], &kSentinel, 4) != 0) return false;
      if (std::memcmp(&buf_[kGuard + n_ + i], &kSentinel, 4) != 0) return false;
    }
    return true;
  }

 private:
  size_t n_;
  std::vector<float> buf_;
};

// Standard assertions on an op's output against the oracle's.
inline void expect_close(const float* got, const float* want, size_t n, double tol, const char* what) {
  ASSERT_TRUE(all_finite(want, n)) << what << ": reference output has NaN/inf";
  ASSERT_TRUE(all_finite(got, n)) << what << ": output has NaN/inf";
  ASSERT_GT(l2_norm(want, n), 0.0) << what << ": reference output is all zero";
  EXPECT_LT(rel_l2(got, want, n), tol) << what;
}

// A paged KV cache for one layer of one sequence, elements of `dtype` (f32 unless given). Pages
// are separate allocations in shuffled order; every slot is NaN until written, so reading a slot
// outside the causal window poisons the result.
struct PagedKv {
  std::vector<std::vector<unsigned char>> k_store, v_store;
  std::vector<void*> k_pages, v_pages;
  KvLayerView view;

  PagedKv(int64_t n_pages, int64_t page_size, int64_t kv_heads, int64_t head_dim, uint32_t seed,
          DType dtype = DType::kF32) {
    const size_t page_elems = static_cast<size_t>(kv_heads * page_size * head_dim);
    const size_t elem = dtype_size(dtype);
    std::vector<unsigned char> nan_page(page_elems * elem);
    const std::vector<float> nans(page_elems, std::numeric_limits<float>::quiet_NaN());
    convert_from_f32(dtype, nans.data(), nan_page.data(), page_elems);
    k_store.assign(static_cast<size_t>(n_pages), nan_page);
    v_store.assign(static_cast<size_t>(n_pages), nan_page);
    std::vector<size_t> order(static_cast<size_t>(n_pages));
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(seed));
    for (size_t i = 0; i < order.size(); ++i) {
      k_pages.push_back(k_store[order[i]].data());
      v_pages.push_back(v_store[order[i]].data());
    }
    view.k_pages = k_pages.data();
    view.v_pages = v_pages.data();
    view.n_pages = n_pages;
    view.page_size = page_size;
    view.kv_heads = kv_heads;
    view.head_dim = head_dim;
    view.dtype = dtype;
  }
  size_t page_bytes() const { return k_store.empty() ? 0 : k_store[0].size(); }
  // Element offset of (pos, head) inside its page.
  int64_t offset(int64_t pos, int64_t head) const {
    return (head * view.page_size + pos % view.page_size) * view.head_dim;
  }
  // f32 caches only.
  float* k_at(int64_t pos, int64_t head) {
    return static_cast<float*>(k_pages[pos / view.page_size]) + offset(pos, head);
  }
  float* v_at(int64_t pos, int64_t head) {
    return static_cast<float*>(v_pages[pos / view.page_size]) + offset(pos, head);
  }
  // Random K/V for positions [0, n).
  void fill(int64_t n, uint32_t seed, float k_scale = 1.0f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t h = 0; h < view.kv_heads; ++h) {
        float* k = k_at(p, h);
        float* v = v_at(p, h);
        for (int64_t e = 0; e < view.head_dim; ++e) {
          k[e] = dist(rng) * k_scale;
          v[e] = dist(rng);
        }
      }
    }
  }
};

}  // namespace specontext::cpu::testing
