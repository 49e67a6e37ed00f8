// Helpers shared by the loader tests (header-only: each test file is its own executable).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "core/model/model.h"
#include "tests/tests_common.h"

namespace specontext::testing {

inline std::vector<float> to_f32(const WeightMatrix& m) {
  std::vector<float> v(static_cast<size_t>(m.rows * m.cols));
  if (!v.empty()) convert_to_f32(m.dtype, m.data, v.data(), v.size());
  return v;
}

inline std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 0.1f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Every tensor of two models, in the same order, with a name for failure messages.
struct NamedMatrix {
  std::string name;
  const WeightMatrix* m;
};
inline std::vector<NamedMatrix> all_matrices(const Model& model) {
  std::vector<NamedMatrix> out = {{"tok_embeddings", &model.tok_embeddings},
                                  {"lm_head", &model.lm_head}};
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const auto& l = model.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    out.push_back({p + "wq", &l.wq});
    out.push_back({p + "wk", &l.wk});
    out.push_back({p + "wv", &l.wv});
    out.push_back({p + "wo", &l.wo});
    out.push_back({p + "w_gate", &l.w_gate});
    out.push_back({p + "w_up", &l.w_up});
    out.push_back({p + "w_down", &l.w_down});
  }
  return out;
}

struct NamedVec {
  std::string name;
  const Vec* v;
};
inline std::vector<NamedVec> all_vectors(const Model& model) {
  std::vector<NamedVec> out = {{"final_norm", &model.final_norm}};
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const auto& l = model.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    out.push_back({p + "attn_norm", &l.attn_norm});
    out.push_back({p + "ffn_norm", &l.ffn_norm});
  }
  return out;
}

// Exact equality of every tensor, optionally skipping wq/wk (RoPE layout differs across formats).
inline void expect_same_weights(const Model& a, const Model& b, bool skip_qk = false) {
  const auto ma = all_matrices(a);
  const auto mb = all_matrices(b);
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    if (skip_qk && (ma[i].name.ends_with(".wq") || ma[i].name.ends_with(".wk"))) continue;
    ASSERT_EQ(ma[i].m->rows, mb[i].m->rows) << ma[i].name;
    ASSERT_EQ(ma[i].m->cols, mb[i].m->cols) << ma[i].name;
    EXPECT_EQ(to_f32(*ma[i].m), to_f32(*mb[i].m)) << ma[i].name;
  }
  const auto va = all_vectors(a);
  const auto vb = all_vectors(b);
  ASSERT_EQ(va.size(), vb.size());
  for (size_t i = 0; i < va.size(); ++i) EXPECT_EQ(*va[i].v, *vb[i].v) << va[i].name;
}

// Minimal GGUF v3 writer for hand-made test files.
class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3) : version_(version) {}

  void kv_u32(const std::string& k, uint32_t v) { kv_raw(k, 4, pod(v)); }
  void kv_i32(const std::string& k, int32_t v) { kv_raw(k, 5, pod(v)); }
  void kv_f32(const std::string& k, float v) { kv_raw(k, 6, pod(v)); }
  void kv_str(const std::string& k, const std::string& v) { kv_raw(k, 8, str(v)); }
  // Appends an already-encoded value of type `type`.
  void kv_raw(const std::string& k, uint32_t type, const std::string& payload) {
    kv_ += str(k) + pod(type) + payload;
    ++n_kv_;
  }
  void kv_str_array(const std::string& k, const std::vector<std::string>& v) {
    std::string p = pod(uint32_t{8}) + pod(uint64_t{v.size()});
    for (const auto& s : v) p += str(s);
    kv_raw(k, 9, p);
  }
  // dims fastest-varying first; `data` is appended to the data section at an aligned offset
  // unless `offset` is given explicitly.
  void tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t ggml_type,
              const std::string& data, int64_t offset = -1) {
    while (data_.size() % alignment_ != 0) data_.push_back('\0');
    const uint64_t off = offset >= 0 ? static_cast<uint64_t>(offset) : data_.size();
    infos_ += str(name) + pod(static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) infos_ += pod(d);
    infos_ += pod(ggml_type) + pod(off);
    data_ += data;
    ++n_tensors_;
  }
  void set_alignment(size_t a) { alignment_ = a; }

  std::string build() const {
    std::string out = "GGUF" + pod(version_) + pod(n_tensors_) + pod(n_kv_) + kv_ + infos_;
    while (out.size() % alignment_ != 0) out.push_back('\0');
    return out + data_;
  }

  template <typename T>
  static std::string pod(const T& v) {
    return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  static std::string str(const std::string& s) { return pod(uint64_t{s.size()}) + s; }
  static std::string f32_bytes(const std::vector<float>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
  }

 private:
  uint32_t version_;
  uint64_t n_tensors_ = 0;
  uint64_t n_kv_ = 0;
  std::string kv_, infos_, data_;
  size_t alignment_ = 32;
};

}  // namespace specontext::testing
