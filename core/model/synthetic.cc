#include "core/model/synthetic.h"

#include "core/model/ggml_quants.h"
#include "core/model/gguf_writer.h"
#include "core/model/random_gguf.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

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

namespace {

void put_f16(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v);
  std::memcpy(p, &h, 2);
}

// Scale fields of one random block of type t, so that its weights spread about ±`spread`:
// Q8_0 d·q (|q| ≤ 128); Q4_0 d·(q − 8); Q4_K / Q5_K d·sc·q − dmin·m with 6-bit sc, m and 4- / 5-bit
// q (dmin centres the mean); Q6_K d·sc·(q − 32) with int8 sc.
void set_block_scales(DType t, uint8_t* blk, float spread, Rng& rng) {
  const float sign = rng.next() < 0 ? -1.0f : 1.0f;
  switch (t) {
    case DType::kQ8_0: put_f16(blk, sign * spread / 128.0f); break;
    case DType::kQ4_0: put_f16(blk, sign * spread / 8.0f); break;
    case DType::kQ4_K:
      put_f16(blk, spread / 236.0f);
      put_f16(blk + 2, 7.5f * spread / 236.0f);
      break;
    case DType::kQ5_K:
      put_f16(blk, spread / 488.0f);
      put_f16(blk + 2, 15.5f * spread / 488.0f);
      break;
    case DType::kQ6_K: put_f16(blk + 208, spread / 1024.0f); break;
    default: break;
  }
}

std::vector<uint8_t> random_matrix_bytes(DType t, int64_t rows, int64_t cols, Rng& rng) {
  const float spread = 1.0f / std::sqrt(static_cast<float>(cols));
  if (t == DType::kF32) {
    std::vector<uint8_t> out(static_cast<size_t>(rows * cols) * 4);
    auto* p = reinterpret_cast<float*>(out.data());
    for (int64_t i = 0; i < rows * cols; ++i) p[i] = rng.next() * spread;
    return out;
  }
  const size_t block_bytes = dtype_row_bytes(t, dtype_block_elements(t));
  std::vector<uint8_t> out(static_cast<size_t>(rows) * dtype_row_bytes(t, cols));
  for (size_t b = 0; b < out.size(); b += block_bytes) {
    for (size_t i = 0; i < block_bytes; i += 2) {
      const auto bits = static_cast<uint16_t>((rng.next() + 1.0f) * 32768.0f);
      std::memcpy(out.data() + b + i, &bits, std::min<size_t>(2, block_bytes - i));
    }
    set_block_scales(t, out.data() + b, spread, rng);
  }
  return out;
}

}  // namespace

namespace {

// The writer behind write_random_gguf and write_random_gguf_mix: matrix `name` of type_of(name)
// (f32 or a block type whose rows the caller checked), general.file_type when given.
template <typename TypeOf>
Status write_random_gguf_typed(const std::string& path, const ModelConfig& c, const TypeOf& type_of,
                               std::optional<uint32_t> file_type, uint64_t seed) {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  if (file_type) {
    w.add_u32("general.file_type", *file_type);
    w.add_u32("general.quantization_version", 2);
  }
  w.add_u32("llama.embedding_length", static_cast<uint32_t>(c.dim));
  w.add_u32("llama.feed_forward_length", static_cast<uint32_t>(c.hidden_dim));
  w.add_u32("llama.block_count", static_cast<uint32_t>(c.n_layers));
  w.add_u32("llama.attention.head_count", static_cast<uint32_t>(c.n_heads));
  w.add_u32("llama.attention.head_count_kv", static_cast<uint32_t>(c.n_kv_heads));
  w.add_u32("llama.attention.key_length", static_cast<uint32_t>(c.head_dim));
  w.add_u32("llama.context_length", static_cast<uint32_t>(c.max_seq_len));
  w.add_f32("llama.rope.freq_base", static_cast<float>(c.rope_theta));
  w.add_f32("llama.attention.layer_norm_rms_epsilon", c.norm_eps);
  w.add_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(std::max(c.bos_token_id, 0)));
  w.add_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(std::max(c.eos_token_id, 0)));
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 1};
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols) {
    const DType t = type_of(name);
    const uint32_t id = t == DType::kF32 ? 0u : *ggml_block_type_id(t);
    w.add_tensor(name, {cols, rows}, id, random_matrix_bytes(t, rows, cols, rng));
  };
  auto ones = [&](const std::string& name, int64_t n) {
    const std::vector<float> v(static_cast<size_t>(n), 1.0f);
    std::vector<uint8_t> bytes(v.size() * 4);
    std::memcpy(bytes.data(), v.data(), bytes.size());
    w.add_tensor(name, {n}, 0, std::move(bytes));
  };
  matrix("token_embd.weight", c.vocab_size, c.dim);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    ones(p + "attn_norm.weight", c.dim);
    matrix(p + "attn_q.weight", c.q_dim(), c.dim);
    matrix(p + "attn_k.weight", c.kv_dim(), c.dim);
    matrix(p + "attn_v.weight", c.kv_dim(), c.dim);
    matrix(p + "attn_output.weight", c.dim, c.q_dim());
    ones(p + "ffn_norm.weight", c.dim);
    matrix(p + "ffn_gate.weight", c.hidden_dim, c.dim);
    matrix(p + "ffn_up.weight", c.hidden_dim, c.dim);
    matrix(p + "ffn_down.weight", c.dim, c.hidden_dim);
  }
  ones("output_norm.weight", c.dim);
  if (!c.tie_embeddings) matrix("output.weight", c.vocab_size, c.dim);
  return w.write(path);
}

Status check_whole_blocks(const std::string& path, const ModelConfig& c, DType t) {
  const int64_t block = dtype_block_elements(t);
  for (int64_t cols : {c.dim, c.q_dim(), c.hidden_dim}) {
    if (cols % block != 0) {
      return invalid_argument(path + ": " + std::string(dtype_name(t)) + " needs rows of whole " +
                              std::to_string(block) + "-element blocks, got " + std::to_string(cols) + " columns");
    }
  }
  return Status::ok();
}

}  // namespace

Status write_random_gguf(const std::string& path, const ModelConfig& config, DType matrix_type, uint64_t seed) {
  SPX_RETURN_IF_ERROR(config.validate(path));
  if (matrix_type != DType::kF32) {
    if (!ggml_block_type_id(matrix_type)) {
      return invalid_argument(path + ": random GGUF matrices must be f32 or a block type, not " +
                              std::string(dtype_name(matrix_type)));
    }
    SPX_RETURN_IF_ERROR(check_whole_blocks(path, config, matrix_type));
  }
  return write_random_gguf_typed(
      path, config, [&](const std::string&) { return matrix_type; }, std::nullopt, seed);
}

std::optional<GgufMix> gguf_mix_from_name(std::string_view name) {
  if (name == "q4_k_m") return GgufMix::kQ4_K_M;
  if (name == "q5_k_m") return GgufMix::kQ5_K_M;
  return std::nullopt;
}

std::string_view gguf_mix_name(GgufMix mix) { return mix == GgufMix::kQ4_K_M ? "q4_k_m" : "q5_k_m"; }

uint32_t gguf_mix_file_type(GgufMix mix) { return mix == GgufMix::kQ4_K_M ? 15u : 17u; }

bool gguf_mix_use_more_bits(int64_t layer, int64_t n_layers) {
  return layer < n_layers / 8 || layer >= 7 * n_layers / 8 || (layer - n_layers / 8) % 3 == 2;
}

DType gguf_mix_tensor_type(GgufMix mix, const ModelConfig& config, const std::string& name) {
  const DType base = mix == GgufMix::kQ4_K_M ? DType::kQ4_K : DType::kQ5_K;
  if (name == "output.weight" || (config.tie_embeddings && name == "token_embd.weight")) {
    return config.dim % 256 == 0 ? DType::kQ6_K : DType::kQ8_0;
  }
  int64_t layer = -1;
  if (name.rfind("blk.", 0) == 0) {
    const char* first = name.data() + 4;
    const char* last = name.data() + name.size();
    int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(first, last, v);
    if (ec == std::errc() && ptr != first && ptr < last && *ptr == '.') layer = v;
  }
  const bool v_or_down = name.find("attn_v.weight") != std::string::npos || name.find("ffn_down") != std::string::npos;
  if (layer >= 0 && v_or_down && gguf_mix_use_more_bits(layer, config.n_layers)) return DType::kQ6_K;
  return base;
}

Status write_random_gguf_mix(const std::string& path, const ModelConfig& config, GgufMix mix, uint64_t seed) {
  SPX_RETURN_IF_ERROR(config.validate(path));
  for (DType t : {DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) SPX_RETURN_IF_ERROR(check_whole_blocks(path, config, t));
  return write_random_gguf_typed(
      path, config, [&](const std::string& name) { return gguf_mix_tensor_type(mix, config, name); },
      gguf_mix_file_type(mix), seed);
}

}  // namespace specontext
