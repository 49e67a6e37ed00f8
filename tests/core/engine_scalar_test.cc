// The engine against a straightforward scalar implementation of the same formulas written here
// (independent of core/ and cpu/): Qwen3-style (q/k norm, explicit head_dim, YaRN), Qwen2-style
// (attention bias), Llama-3-style (llama3 rope scaling, tied embeddings, GQA), MQA and MHA.
// Each model also goes through the file formats it can be stored in: a Hugging Face directory
// and a GGUF file written as llama.cpp's converter writes one (llama q/k rows permuted to
// interleaved pairs, Llama 3.1's llama3 scaling as rope_freqs.weight, qwen2 / qwen3 keys).
// Also batching: sequences of different lengths in one forward equal separate runs.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include <filesystem>
#include <fstream>

#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "core/model/safetensors.h"
#include "core/model/synthetic.h"
#include "cpu/cpu_backend.h"
#include "tests/core/loader_test_util.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

using Mat = std::vector<float>;

// ---- scalar reference, deliberately simple ----
std::vector<float> row_f32(const WeightMatrix& w, int64_t r) {
  std::vector<float> out(static_cast<size_t>(w.cols));
  const auto* base = static_cast<const uint8_t*>(w.data) + r * w.cols * dtype_size(w.dtype);
  convert_to_f32(w.dtype, base, out.data(), out.size());
  return out;
}

std::vector<float> linear(const WeightMatrix& w, const std::vector<float>& x, const Vec& bias) {
  std::vector<float> y(static_cast<size_t>(w.rows));
  for (int64_t r = 0; r < w.rows; ++r) {
    const auto row = row_f32(w, r);
    double acc = bias.empty() ? 0.0 : bias[static_cast<size_t>(r)];
    for (int64_t c = 0; c < w.cols; ++c) acc += double(row[static_cast<size_t>(c)]) * x[static_cast<size_t>(c)];
    y[static_cast<size_t>(r)] = static_cast<float>(acc);
  }
  return y;
}

void rmsnorm_inplace(float* x, int64_t n, const Vec& w, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const double inv = 1.0 / std::sqrt(ss / n + eps);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(x[i] * inv * w[static_cast<size_t>(i)]);
}

// Frequencies written from the HF formulas directly.
std::vector<double> reference_inv_freq(const ModelConfig& c, double* mscale) {
  const int64_t half = c.head_dim / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) f[static_cast<size_t>(i)] = std::pow(c.rope_theta, -2.0 * i / c.head_dim);
  *mscale = 1.0;
  const auto& s = c.rope_scaling;
  const double pi = std::numbers::pi;
  if (s.type == RopeScalingType::kLlama3) {
    for (auto& x : f) {
      const double wl = 2 * pi / x;
      const double lo = s.original_max_position_embeddings / s.low_freq_factor;
      const double hi = s.original_max_position_embeddings / s.high_freq_factor;
      if (wl > lo) {
        x /= s.factor;
      } else if (wl >= hi) {
        const double sm = (s.original_max_position_embeddings / wl - s.low_freq_factor) /
                          (s.high_freq_factor - s.low_freq_factor);
        x = (1 - sm) * x / s.factor + sm * x;
      }
    }
  } else if (s.type == RopeScalingType::kYarn) {
    auto corr = [&](double rot) {
      return c.head_dim * std::log(s.original_max_position_embeddings / (rot * 2 * pi)) / (2 * std::log(c.rope_theta));
    };
    double lo = std::max(0.0, std::floor(corr(s.beta_fast)));
    double hi = std::min(double(c.head_dim - 1), std::ceil(corr(s.beta_slow)));
    if (lo == hi) hi += 0.001;
    for (int64_t i = 0; i < half; ++i) {
      const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
      const double extra = 1 - ramp;
      f[static_cast<size_t>(i)] = f[static_cast<size_t>(i)] / s.factor * (1 - extra) + f[static_cast<size_t>(i)] * extra;
    }
    *mscale = 0.1 * std::log(s.factor) + 1.0;
  }
  return f;
}

void rope_inplace(float* x, int64_t head_dim, int64_t pos, const std::vector<double>& f, double mscale,
                  RopeStyle style) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = style == RopeStyle::kHalf ? i : 2 * i;
    const int64_t b = style == RopeStyle::kHalf ? i + half : 2 * i + 1;
    const double ang = pos * f[static_cast<size_t>(i)];
    const double x0 = x[a], x1 = x[b];
    x[a] = static_cast<float>((x0 * std::cos(ang) - x1 * std::sin(ang)) * mscale);
    x[b] = static_cast<float>((x0 * std::sin(ang) + x1 * std::cos(ang)) * mscale);
  }
}

// Logits of the last token after running `tokens` from position 0.
std::vector<float> scalar_forward(const Model& m, const std::vector<TokenId>& tokens) {
  const ModelConfig& c = m.config;
  double mscale;
  const auto freqs = reference_inv_freq(c, &mscale);
  const int64_t T = static_cast<int64_t>(tokens.size());
  std::vector<std::vector<float>> xs;
  for (TokenId t : tokens) xs.push_back(row_f32(m.tok_embeddings, t));
  for (const LayerWeights& w : m.layers) {
    std::vector<std::vector<float>> qs, ks, vs;
    for (int64_t t = 0; t < T; ++t) {
      auto h = xs[static_cast<size_t>(t)];
      rmsnorm_inplace(h.data(), c.dim, w.attn_norm, c.norm_eps);
      auto q = linear(w.wq, h, w.bq), k = linear(w.wk, h, w.bk), v = linear(w.wv, h, w.bv);
      for (int64_t hh = 0; hh < c.n_heads; ++hh) {
        if (c.qk_norm) rmsnorm_inplace(q.data() + hh * c.head_dim, c.head_dim, w.q_norm, c.norm_eps);
        rope_inplace(q.data() + hh * c.head_dim, c.head_dim, t, freqs, mscale, c.rope_style);
      }
      for (int64_t hh = 0; hh < c.n_kv_heads; ++hh) {
        if (c.qk_norm) rmsnorm_inplace(k.data() + hh * c.head_dim, c.head_dim, w.k_norm, c.norm_eps);
        rope_inplace(k.data() + hh * c.head_dim, c.head_dim, t, freqs, mscale, c.rope_style);
      }
      qs.push_back(q); ks.push_back(k); vs.push_back(v);
    }
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> att(static_cast<size_t>(c.q_dim()), 0.0f);
      for (int64_t hh = 0; hh < c.n_heads; ++hh) {
        const int64_t kvh = hh / (c.n_heads / c.n_kv_heads);
        std::vector<double> sc(static_cast<size_t>(t + 1));
        double mx = -1e300;
        for (int64_t s = 0; s <= t; ++s) {
          double d = 0;
          for (int64_t i = 0; i < c.head_dim; ++i)
            d += double(qs[t][hh * c.head_dim + i]) * ks[s][kvh * c.head_dim + i];
          sc[s] = d / std::sqrt(double(c.head_dim));
          mx = std::max(mx, sc[s]);
        }
        double sum = 0;
        for (auto& x : sc) { x = std::exp(x - mx); sum += x; }
        for (int64_t s = 0; s <= t; ++s)
          for (int64_t i = 0; i < c.head_dim; ++i)
            att[hh * c.head_dim + i] += static_cast<float>(sc[s] / sum * vs[s][kvh * c.head_dim + i]);
      }
      auto o = linear(w.wo, att, {});
      auto& x = xs[static_cast<size_t>(t)];
      for (int64_t i = 0; i < c.dim; ++i) x[i] += o[i];
      auto h = x;
      rmsnorm_inplace(h.data(), c.dim, w.ffn_norm, c.norm_eps);
      auto g = linear(w.w_gate, h, {}), u = linear(w.w_up, h, {});
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      auto d = linear(w.w_down, g, {});
      for (int64_t i = 0; i < c.dim; ++i) x[i] += d[i];
    }
  }
  auto last = xs.back();
  rmsnorm_inplace(last.data(), c.dim, m.final_norm, c.norm_eps);
  return linear(m.lm_head, last, {});
}

using testing::rel_l2;

ModelConfig base_config() {
  ModelConfig c;
  c.dim = 48; c.hidden_dim = 96; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2; c.head_dim = 12;
  c.vocab_size = 97; c.max_seq_len = 256; c.rope_theta = 10000.0; c.rope_style = RopeStyle::kHalf;
  return c;
}

struct Case {
  std::string name;
  ModelConfig config;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  ModelConfig qwen3 = base_config();
  qwen3.arch = Architecture::kQwen3; qwen3.qk_norm = true; qwen3.head_dim = 16;  // q_dim != dim
  qwen3.rope_scaling = {RopeScalingType::kYarn, 4.0, 1.0, 4.0, 64, 32.0, 1.0, 0.0};
  qwen3.rope_theta = 1000000.0; qwen3.norm_eps = 1e-6f;
  out.push_back({"qwen3_qknorm_yarn", qwen3});
  ModelConfig qwen2 = base_config();
  qwen2.arch = Architecture::kQwen2; qwen2.attention_bias = true;
  out.push_back({"qwen2_bias", qwen2});
  ModelConfig llama3 = base_config();
  llama3.rope_scaling = {RopeScalingType::kLlama3, 8.0, 1.0, 4.0, 32};
  llama3.rope_theta = 500000.0; llama3.tie_embeddings = true;
  out.push_back({"llama3_scaling_tied", llama3});
  ModelConfig mqa = base_config();
  mqa.n_kv_heads = 1; mqa.rope_style = RopeStyle::kInterleaved;
  out.push_back({"mqa_interleaved", mqa});
  ModelConfig mha = base_config();
  mha.n_kv_heads = 4;
  out.push_back({"mha", mha});
  return out;
}

class ScalarTest : public ::testing::TestWithParam<Case> {};

// One file format's tensor names, for the writers below.
struct TensorNames {
  const char* embed;
  const char* layer_prefix;  // + layer index + "."
  const char *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *q_norm, *k_norm, *ffn_norm, *gate, *up, *down;
  const char* final_norm;
  const char* lm_head;
};
const TensorNames kHfNames = {"model.embed_tokens.weight", "model.layers.", "input_layernorm.weight",
                              "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                              "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                              "self_attn.v_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                              "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                              "mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"};
const TensorNames kGgufNames = {"token_embd.weight", "blk.", "attn_norm.weight", "attn_q.weight", "attn_k.weight",
                                "attn_v.weight", "attn_output.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
                                "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight",
                                "ffn_up.weight", "ffn_down.weight", "output_norm.weight", "output.weight"};

// Calls mat(name, matrix) and vec(name, vector) for every tensor of `m` under `n`'s names; the
// lm_head only when it is not tied.
template <typename Mat, typename VecFn>
void visit_tensors(const Model& m, const TensorNames& n, Mat mat, VecFn vec) {
  mat(n.embed, m.tok_embeddings);
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const auto& l = m.layers[i];
    const std::string p = n.layer_prefix + std::to_string(i) + ".";
    vec(p + n.attn_norm, l.attn_norm);
    mat(p + n.wq, l.wq);
    mat(p + n.wk, l.wk);
    mat(p + n.wv, l.wv);
    mat(p + n.wo, l.wo);
    if (!l.bq.empty()) {
      vec(p + n.bq, l.bq);
      vec(p + n.bk, l.bk);
      vec(p + n.bv, l.bv);
    }
    if (!l.q_norm.empty()) {
      vec(p + n.q_norm, l.q_norm);
      vec(p + n.k_norm, l.k_norm);
    }
    vec(p + n.ffn_norm, l.ffn_norm);
    mat(p + n.gate, l.w_gate);
    mat(p + n.up, l.w_up);
    mat(p + n.down, l.w_down);
  }
  vec(n.final_norm, m.final_norm);
  if (!m.config.tie_embeddings) mat(n.lm_head, m.lm_head);
}

// Writes the model as a Hugging Face directory (config.json + model.safetensors).
std::string write_hf_dir(const Model& m) {
  const ModelConfig& c = m.config;
  const std::string dir = testing::temp_dir("spx-hf");
  std::vector<NamedTensor> t;
  auto mat = [&](const std::string& name, const WeightMatrix& w) {
    t.push_back({name, w.dtype, {w.rows, w.cols}, w.data});
  };
  auto vec = [&](const std::string& name, const Vec& v) {
    t.push_back({name, DType::kF32, {static_cast<int64_t>(v.size())}, v.data()});
  };
  visit_tensors(m, kHfNames, mat, vec);
  EXPECT_TRUE(write_safetensors(dir + "/model.safetensors", t).is_ok());
  const char* arch = c.arch == Architecture::kQwen3 ? "Qwen3ForCausalLM"
                     : c.arch == Architecture::kQwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM";
  std::string scaling = "null";
  const auto& rs = c.rope_scaling;
  if (rs.type == RopeScalingType::kLlama3) {
    scaling = "{\"rope_type\": \"llama3\", \"factor\": " + std::to_string(rs.factor) +
              ", \"low_freq_factor\": " + std::to_string(rs.low_freq_factor) + ", \"high_freq_factor\": " +
              std::to_string(rs.high_freq_factor) + ", \"original_max_position_embeddings\": " +
              std::to_string(rs.original_max_position_embeddings) + "}";
  } else if (rs.type == RopeScalingType::kYarn) {
    scaling = "{\"rope_type\": \"yarn\", \"factor\": " + std::to_string(rs.factor) +
              ", \"original_max_position_embeddings\": " + std::to_string(rs.original_max_position_embeddings) + "}";
  }
  std::ofstream(dir + "/config.json")
      << "{\"architectures\": [\"" << arch << "\"], \"hidden_size\": " << c.dim
      << ", \"intermediate_size\": " << c.hidden_dim << ", \"num_hidden_layers\": " << c.n_layers
      << ", \"num_attention_heads\": " << c.n_heads << ", \"num_key_value_heads\": " << c.n_kv_heads
      << ", \"head_dim\": " << c.head_dim << ", \"vocab_size\": " << c.vocab_size
      << ", \"max_position_embeddings\": " << c.max_seq_len << ", \"rms_norm_eps\": " << c.norm_eps
      << ", \"rope_theta\": " << c.rope_theta << ", \"rope_scaling\": " << scaling
      << ", \"tie_word_embeddings\": " << (c.tie_embeddings ? "true" : "false")
      << ", \"hidden_act\": \"silu\"}";
  return dir;
}

// Writes the model as llama.cpp's convert_hf_to_gguf.py would (F32 tensors).
std::string write_gguf_file(const Model& m) {
  const ModelConfig& c = m.config;
  using testing::GgufBuilder;
  GgufBuilder b;
  const std::string a = c.arch == Architecture::kQwen3 ? "qwen3" : c.arch == Architecture::kQwen2 ? "qwen2" : "llama";
  b.kv_str("general.architecture", a);
  b.kv_u32(a + ".embedding_length", static_cast<uint32_t>(c.dim));
  b.kv_u32(a + ".feed_forward_length", static_cast<uint32_t>(c.hidden_dim));
  b.kv_u32(a + ".block_count", static_cast<uint32_t>(c.n_layers));
  b.kv_u32(a + ".attention.head_count", static_cast<uint32_t>(c.n_heads));
  b.kv_u32(a + ".attention.head_count_kv", static_cast<uint32_t>(c.n_kv_heads));
  b.kv_u32(a + ".attention.key_length", static_cast<uint32_t>(c.head_dim));
  b.kv_u32(a + ".attention.value_length", static_cast<uint32_t>(c.head_dim));
  b.kv_u32(a + ".rope.dimension_count", static_cast<uint32_t>(c.head_dim));
  b.kv_u32(a + ".context_length", static_cast<uint32_t>(c.max_seq_len));
  b.kv_f32(a + ".rope.freq_base", static_cast<float>(c.rope_theta));
  b.kv_f32(a + ".attention.layer_norm_rms_epsilon", c.norm_eps);
  const RopeScaling& rs = c.rope_scaling;
  if (rs.type == RopeScalingType::kYarn) {
    b.kv_str(a + ".rope.scaling.type", "yarn");
    b.kv_f32(a + ".rope.scaling.factor", static_cast<float>(rs.factor));
    b.kv_u32(a + ".rope.scaling.original_context_length",
             static_cast<uint32_t>(rs.original_max_position_embeddings));
  }
  if (rs.type == RopeScalingType::kLlama3) {
    // convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): freqs in float32 as torch
    // computes them, the factor per frequency in Python floats, stored as float32.
    std::vector<float> factors;
    for (int64_t i = 0; i < c.head_dim; i += 2) {
      const float freq = 1.0f / std::pow(static_cast<float>(c.rope_theta), static_cast<float>(i) / static_cast<float>(c.head_dim));
      const double wavelen = 2 * std::numbers::pi / freq;
      const double old_ctx = static_cast<double>(rs.original_max_position_embeddings);
      if (wavelen < old_ctx / rs.high_freq_factor) {
        factors.push_back(1.0f);
      } else if (wavelen > old_ctx / rs.low_freq_factor) {
        factors.push_back(static_cast<float>(rs.factor));
      } else {
        const double smooth = (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
        factors.push_back(static_cast<float>(1.0 / ((1 - smooth) / rs.factor + smooth)));
      }
    }
    b.tensor("rope_freqs.weight", {factors.size()}, 0, GgufBuilder::f32_bytes(factors));
  }
  auto raw = [](const WeightMatrix& w) {
    return std::string(static_cast<const char*>(w.data), static_cast<size_t>(w.rows * w.cols) * 4);
  };
  // llama: q/k rows from rotate_half halves to interleaved pairs, per head (llama.cpp permute()).
  auto qk = [&](const WeightMatrix& w, int64_t heads) {
    if (a != "llama" || c.rope_style == RopeStyle::kInterleaved) return raw(w);
    std::string out(static_cast<size_t>(w.rows * w.cols) * 4, '\0');
    const int64_t half = c.head_dim / 2;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < 2; ++i) {
        for (int64_t j = 0; j < half; ++j) {
          const int64_t from = h * c.head_dim + i * half + j, to = h * c.head_dim + 2 * j + i;
          std::memcpy(out.data() + to * w.cols * 4, static_cast<const char*>(w.data) + from * w.cols * 4,
                      static_cast<size_t>(w.cols) * 4);
        }
      }
    }
    return out;
  };
  auto mat = [&](const std::string& name, const WeightMatrix& w) {
    EXPECT_EQ(w.dtype, DType::kF32);
    const bool q = name.ends_with(".attn_q.weight");
    const bool k = name.ends_with(".attn_k.weight");
    const std::string bytes = q ? qk(w, c.n_heads) : k ? qk(w, c.n_kv_heads) : raw(w);
    b.tensor(name, {static_cast<uint64_t>(w.cols), static_cast<uint64_t>(w.rows)}, 0, bytes);
  };
  auto vec = [&](const std::string& name, const Vec& v) { b.tensor(name, {v.size()}, 0, GgufBuilder::f32_bytes(v)); };
  visit_tensors(m, kGgufNames, mat, vec);
  const std::string path = testing::temp_dir("spx-gguf") + "/model.gguf";
  testing::write_file(path, b.build());
  return path;
}

TEST_P(ScalarTest, EngineMatchesScalarFormulas) {
  auto model = make_random_model(GetParam().config, DType::kF32, 7);
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  // Biases and norm weights away from 1 so that they matter.
  for (auto& l : (*model)->layers) {
    for (auto* v : {&l.attn_norm, &l.ffn_norm, &l.q_norm, &l.k_norm})
      for (size_t i = 0; i < v->size(); ++i) (*v)[i] = 0.5f + 0.03f * static_cast<float>(i % 17);
  }
  struct Variant {
    std::string name;
    std::shared_ptr<const Model> model;
    bool reference;
  };
  std::vector<Variant> variants = {{"reference", *model, true}, {"optimised", *model, false}};
  // The same weights through a safetensors directory (HF layout uses rotate_half RoPE only).
  if (GetParam().config.rope_style == RopeStyle::kHalf) {
    auto l = load_hf_model(write_hf_dir(**model));
    ASSERT_TRUE(l.is_ok()) << l.status().to_string();
    const auto& loaded = *l;
    EXPECT_EQ(loaded->config.qk_norm, GetParam().config.qk_norm);
    EXPECT_EQ(loaded->config.attention_bias, GetParam().config.attention_bias);
    EXPECT_EQ(loaded->config.tie_embeddings, GetParam().config.tie_embeddings);
    EXPECT_EQ(loaded->config.rope_scaling.type, GetParam().config.rope_scaling.type);
    variants.push_back({"via safetensors", loaded, false});
  }
  // And through GGUF, every case.
  {
    auto l = load_gguf_model(write_gguf_file(**model));
    ASSERT_TRUE(l.is_ok()) << l.status().to_string();
    const auto& loaded = *l;
    EXPECT_EQ(loaded->config.arch, GetParam().config.arch);
    EXPECT_EQ(loaded->config.qk_norm, GetParam().config.qk_norm);
    EXPECT_EQ(loaded->config.attention_bias, GetParam().config.attention_bias);
    EXPECT_EQ(loaded->config.tie_embeddings, GetParam().config.tie_embeddings);
    EXPECT_EQ(loaded->config.head_dim, GetParam().config.head_dim);
    EXPECT_EQ(loaded->config.rope_freq_factors.empty(),
              GetParam().config.rope_scaling.type != RopeScalingType::kLlama3);
    variants.push_back({"via gguf", loaded, false});
  }
  for (const Variant& variant : variants) {
    const bool reference = variant.reference;
    const auto& run_model = variant.model;
    cpu::CpuBackendOptions o;
    o.reference = reference;
    auto b = cpu::create_cpu_backend(o);
    ASSERT_TRUE(b.is_ok());
    EngineOptions eo;
    eo.page_size = 8;  // several pages, last one partial
    auto e = Engine::create(run_model, std::shared_ptr<Backend>(std::move(*b)), eo);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    std::vector<TokenId> tokens;
    for (int i = 0; i < 21; ++i) tokens.push_back((i * 37 + 5) % 97);
    auto seq = (*e)->memory().add_sequence();
    ASSERT_TRUE(seq.is_ok());
    // Prefill 13 tokens in one chunk, then decode the rest one at a time.
    std::vector<float> last;
    StepRequest r{*seq, std::span<const TokenId>(tokens.data(), 13), LogitsMode::kLast};
    auto out = (*e)->forward(std::span<const StepRequest>(&r, 1));
    ASSERT_TRUE(out.is_ok()) << out.status().to_string();
    for (size_t t = 13; t < tokens.size(); ++t) {
      StepRequest d{*seq, std::span<const TokenId>(&tokens[t], 1), LogitsMode::kLast};
      out = (*e)->forward(std::span<const StepRequest>(&d, 1));
      ASSERT_TRUE(out.is_ok());
    }
    const auto expect = scalar_forward(**model, tokens);
    const auto got = out->row(0);
    double norm = 0;
    for (float v : got) {
      ASSERT_TRUE(std::isfinite(v));
      norm += v * v;
    }
    EXPECT_GT(norm, 1e-6);
    EXPECT_LT(rel_l2(got, expect), 2e-5)
        << GetParam().name << " " << variant.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, ScalarTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// Sequences of different lengths batched in one forward (mixed prefill and decode) give the
// same logits as running each alone.
TEST(EngineBatch, MixedBatchEqualsSeparateRuns) {
  auto model = make_random_model(base_config(), DType::kF32, 11);
  ASSERT_TRUE(model.is_ok());
  auto b = cpu::create_cpu_backend({});
  ASSERT_TRUE(b.is_ok());
  EngineOptions eo;
  eo.page_size = 4;
  auto e = Engine::create(*model, std::shared_ptr<Backend>(std::move(*b)), eo);
  ASSERT_TRUE(e.is_ok());
  Engine& eng = **e;
  const std::vector<std::vector<TokenId>> prompts = {{1, 2, 3, 4, 5, 6, 7}, {9, 8}, {40, 41, 42, 43, 44}};
  // Separate: each prompt alone, logits of its last token.
  std::vector<std::vector<float>> alone;
  for (const auto& p : prompts) {
    auto s = eng.memory().add_sequence();
    ASSERT_TRUE(s.is_ok());
    StepRequest r{*s, p, LogitsMode::kLast};
    auto out = eng.forward(std::span<const StepRequest>(&r, 1));
    ASSERT_TRUE(out.is_ok());
    alone.emplace_back(out->row(0).begin(), out->row(0).end());
    ASSERT_TRUE(eng.memory().remove_sequence(*s).is_ok());
  }
  // Batched: seq 0 prefilled earlier with its first 6 tokens then decodes its 7th, together
  // with full prefills of seqs 1 and 2.
  auto s0 = eng.memory().add_sequence(), s1 = eng.memory().add_sequence(), s2 = eng.memory().add_sequence();
  StepRequest pre{*s0, std::span<const TokenId>(prompts[0].data(), 6), LogitsMode::kNone};
  ASSERT_TRUE(eng.forward(std::span<const StepRequest>(&pre, 1)).is_ok());
  std::vector<StepRequest> batch = {
      {*s1, prompts[1], LogitsMode::kLast},
      {*s0, std::span<const TokenId>(prompts[0].data() + 6, 1), LogitsMode::kLast},
      {*s2, prompts[2], LogitsMode::kLast}};
  auto out = eng.forward(batch);
  ASSERT_TRUE(out.is_ok());
  EXPECT_LT(rel_l2(out->row(0), alone[1]), 1e-5);
  EXPECT_LT(rel_l2(out->row(1), alone[0]), 1e-5);
  EXPECT_LT(rel_l2(out->row(2), alone[2]), 1e-5);
  EXPECT_EQ(eng.memory().sequence_length(*s0), 7);
  EXPECT_EQ(eng.memory().sequence_length(*s1), 2);
}

TEST(EngineErrors, ContextLimitAndFullCacheLeaveStateUnchanged) {
  auto model = make_random_model(base_config(), DType::kF32, 3);
  ASSERT_TRUE(model.is_ok());
  auto b = cpu::create_cpu_backend({});
  ASSERT_TRUE(b.is_ok());
  EngineOptions eo;
  eo.page_size = 4;
  eo.max_context = 10;
  eo.kv_pages = 4;  // 16 tokens in the whole pool
  auto e = Engine::create(*model, std::shared_ptr<Backend>(std::move(*b)), eo);
  ASSERT_TRUE(e.is_ok());
  Engine& eng = **e;
  auto a = eng.memory().add_sequence(), c = eng.memory().add_sequence();
  std::vector<TokenId> eleven(11, 5), nine(9, 6), eight(8, 7);
  StepRequest too_long{*a, eleven, LogitsMode::kLast};
  auto r = eng.forward(std::span<const StepRequest>(&too_long, 1));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(r.status().message().find("context limit of 10"), std::string::npos);
  StepRequest ok{*a, nine, LogitsMode::kLast};
  ASSERT_TRUE(eng.forward(std::span<const StepRequest>(&ok, 1)).is_ok());  // 3 pages
  StepRequest no_room{*c, eight, LogitsMode::kLast};                          // needs 2, 1 free
  r = eng.forward(std::span<const StepRequest>(&no_room, 1));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(eng.memory().sequence_length(*c), 0);
  EXPECT_EQ(eng.memory().sequence_length(*a), 9);
  EXPECT_EQ(eng.memory().kv_bytes_in_use(), 3 * 2 * 4 * base_config().kv_dim() * 4 * base_config().n_layers);
  // The failed request's pages went back: a 4-token request now fits.
  StepRequest small{*c, std::span<const TokenId>(eight.data(), 4), LogitsMode::kLast};
  EXPECT_TRUE(eng.forward(std::span<const StepRequest>(&small, 1)).is_ok());
  TokenId bad = 1000;
  StepRequest bad_token{*c, std::span<const TokenId>(&bad, 1), LogitsMode::kLast};
  r = eng.forward(std::span<const StepRequest>(&bad_token, 1));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("outside the vocabulary"), std::string::npos);
}

}  // namespace
}  // namespace specontext
