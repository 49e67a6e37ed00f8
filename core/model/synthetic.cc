#include "core/model/synthetic.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <thread>

namespace specontext {

namespace {

struct Rng {
  uint64_t s;
  float next() {  // uniform [-1, 1)
    s ^= s >> 12; s ^= s << 25; s ^= s >> 27;
    return static_cast<float>(static_cast<uint32_t>((s * 0x2545F4914F6CDD1Dull) >> 40)) / 8388608.0f - 1.0f;
  }
};

class Builder {
 public:
  Builder(Model& m, DType dtype, uint64_t seed) : m_(m), dtype_(dtype), seed_(seed) {}

  WeightMatrix matrix(int64_t rows, int64_t cols) {
    const size_t n = static_cast<size_t>(rows * cols);
    const size_t bytes = n * dtype_size(dtype_);
    std::shared_ptr<uint8_t[]> buf(new uint8_t[bytes]);
    const float scale = 1.0f / std::sqrt(static_cast<float>(cols));
    const uint64_t base = seed_ * 0x9E3779B97F4A7C15ull + ++counter_;
    // Big matrices (embeddings of 128K-token vocabularies) fill in parallel stripes.
    const unsigned n_threads = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < n_threads; ++t) {
      threads.emplace_back([&, t] {
        const size_t begin = n * t / n_threads, end = n * (t + 1) / n_threads;
        Rng rng{base + 0x1234567ull * (t + 1)};
        if (dtype_ == DType::kBF16) {
          auto* p = reinterpret_cast<uint16_t*>(buf.get());
          for (size_t i = begin; i < end; ++i) p[i] = f32_to_bf16(rng.next() * scale);
        } else {
          auto* p = reinterpret_cast<float*>(buf.get());
          for (size_t i = begin; i < end; ++i) p[i] = rng.next() * scale;
        }
      });
    }
    for (auto& th : threads) th.join();
    WeightMatrix w{dtype_, rows, cols, buf.get()};
    m_.storage.push_back(std::shared_ptr<const void>(buf, buf.get()));
    return w;
  }
  Vec ones(int64_t n) { return Vec(static_cast<size_t>(n), 1.0f); }
  Vec small(int64_t n, float scale) {
    Rng rng{seed_ + 77 + ++counter_};
    Vec v(static_cast<size_t>(n));
    for (auto& x : v) x = rng.next() * scale;
    return v;
  }

 private:
  Model& m_;
  DType dtype_;
  uint64_t seed_;
  uint64_t counter_ = 0;
};

}  // namespace

std::vector<std::string> synthetic_model_names() {
  return {"llama-3.2-1b", "llama-3.1-8b", "qwen3-8b", "toy"};
}

Result<ModelConfig> synthetic_config(const std::string& name) {
  ModelConfig c;
  c.rope_style = RopeStyle::kHalf;
  if (name == "llama-3.2-1b") {
    c.arch = Architecture::kLlama;
    c.dim = 2048; c.hidden_dim = 8192; c.n_layers = 16; c.n_heads = 32; c.n_kv_heads = 8;
    c.head_dim = 64; c.vocab_size = 128256; c.max_seq_len = 131072; c.rope_theta = 500000.0;
    c.rope_scaling = {RopeScalingType::kLlama3, 32.0, 1.0, 4.0, 8192};
    c.tie_embeddings = true; c.bos_token_id = 128000; c.eos_token_id = 128001;
  } else if (name == "llama-3.1-8b") {
    c.arch = Architecture::kLlama;
    c.dim = 4096; c.hidden_dim = 14336; c.n_layers = 32; c.n_heads = 32; c.n_kv_heads = 8;
    c.head_dim = 128; c.vocab_size = 128256; c.max_seq_len = 131072; c.rope_theta = 500000.0;
    c.rope_scaling = {RopeScalingType::kLlama3, 8.0, 1.0, 4.0, 8192};
    c.bos_token_id = 128000; c.eos_token_id = 128001;
  } else if (name == "qwen3-8b") {
    c.arch = Architecture::kQwen3;
    c.dim = 4096; c.hidden_dim = 12288; c.n_layers = 36; c.n_heads = 32; c.n_kv_heads = 8;
    c.head_dim = 128; c.vocab_size = 151936; c.max_seq_len = 40960; c.rope_theta = 1000000.0;
    c.qk_norm = true; c.norm_eps = 1e-6f; c.bos_token_id = 151643; c.eos_token_id = 151645;
  } else if (name == "toy") {
    c.arch = Architecture::kLlama;
    c.dim = 64; c.hidden_dim = 128; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2;
    c.head_dim = 16; c.vocab_size = 256; c.max_seq_len = 4096;
  } else {
    std::string known;
    for (const auto& n : synthetic_model_names()) known += (known.empty() ? "" : ", ") + n;
    return invalid_argument("unknown synthetic model '" + name + "' (known: " + known + ")");
  }
  return c;
}

Result<std::shared_ptr<Model>> make_random_model(const ModelConfig& config, DType dtype, uint64_t seed) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return invalid_argument("synthetic weights must be f32 or bf16, not " + std::string(dtype_name(dtype)));
  }
  SPX_RETURN_IF_ERROR(config.validate("synthetic config"));
  auto m = std::make_shared<Model>();
  m->config = config;
  m->format = "synthetic";
  m->source = "synthetic";
  m->weight_dtype = dtype;
  Builder b(*m, dtype, seed);
  const ModelConfig& c = config;
  m->tok_embeddings = b.matrix(c.vocab_size, c.dim);
  m->layers.resize(static_cast<size_t>(c.n_layers));
  for (auto& l : m->layers) {
    l.attn_norm = b.ones(c.dim);
    l.wq = b.matrix(c.q_dim(), c.dim);
    l.wk = b.matrix(c.kv_dim(), c.dim);
    l.wv = b.matrix(c.kv_dim(), c.dim);
    l.wo = b.matrix(c.dim, c.q_dim());
    if (c.attention_bias) {
      l.bq = b.small(c.q_dim(), 0.1f);
      l.bk = b.small(c.kv_dim(), 0.1f);
      l.bv = b.small(c.kv_dim(), 0.1f);
    }
    if (c.qk_norm) {
      l.q_norm = b.ones(c.head_dim);
      l.k_norm = b.ones(c.head_dim);
    }
    l.ffn_norm = b.ones(c.dim);
    l.w_gate = b.matrix(c.hidden_dim, c.dim);
    l.w_up = b.matrix(c.hidden_dim, c.dim);
    l.w_down = b.matrix(c.dim, c.hidden_dim);
  }
  m->final_norm = b.ones(c.dim);
  m->lm_head = c.tie_embeddings ? m->tok_embeddings : b.matrix(c.vocab_size, c.dim);
  return m;
}

Result<std::shared_ptr<Model>> make_synthetic_model(const std::string& name, int64_t layers,
                                                    DType dtype, uint64_t seed) {
  SPX_ASSIGN_OR_RETURN(ModelConfig c, synthetic_config(name));
  if (layers > 0) c.n_layers = std::min(layers, c.n_layers);
  return make_random_model(c, dtype, seed);
}

}  // namespace specontext
