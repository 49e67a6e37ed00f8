// Format detection in load_model, cross-format agreement of the bundled models, and the checks of
// Model::validate / ModelConfig::validate.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/model/model_loader.h"
#include "tests/core/loader_test_util.h"

namespace specontext {
namespace {

using testing::repo_path;
using testing::temp_dir;
using testing::write_file;

std::shared_ptr<Model> load_ok(const std::string& rel) {
  auto r = load_model(repo_path(rel));
  EXPECT_TRUE(r.is_ok()) << rel << ": " << r.status().to_string();
  return r.is_ok() ? *r : nullptr;
}

TEST(LoaderDetect, DetectsEveryFormat) {
  auto bin = load_ok("models/stories260K/stories260K.bin");
  auto gguf = load_ok("models/stories260K/stories260K.gguf");
  auto hf = load_ok("models/stories260K/hf");
  ASSERT_TRUE(bin && gguf && hf);
  EXPECT_EQ(bin->format, "llama2c");
  EXPECT_EQ(gguf->format, "gguf");
  EXPECT_EQ(hf->format, "safetensors");
  for (const Model* m : {bin.get(), gguf.get(), hf.get()}) {
    SCOPED_TRACE(m->format);
    const ModelConfig& c = m->config;
    EXPECT_EQ(c.dim, 64);
    EXPECT_EQ(c.hidden_dim, 172);
    EXPECT_EQ(c.n_layers, 5);
    EXPECT_EQ(c.n_heads, 8);
    EXPECT_EQ(c.n_kv_heads, 4);
    EXPECT_EQ(c.head_dim, 8);
    EXPECT_EQ(c.vocab_size, 512);
    EXPECT_EQ(c.max_seq_len, 512);
    EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
    EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
    EXPECT_EQ(c.bos_token_id, 1);
    EXPECT_EQ(c.eos_token_id, 2);
    EXPECT_EQ(m->weight_dtype, DType::kF32);
    EXPECT_TRUE(m->validate().is_ok());
    EXPECT_EQ(m->parameter_count(),
              bin->parameter_count() + (m->lm_head.data == m->tok_embeddings.data ? 0 : 512 * 64));
  }
  EXPECT_EQ(bin->config.rope_style, RopeStyle::kInterleaved);
  EXPECT_EQ(gguf->config.rope_style, RopeStyle::kInterleaved);
  EXPECT_EQ(hf->config.rope_style, RopeStyle::kHalf);
  // The GGUF conversion stored an explicit (identical) output matrix.
  EXPECT_EQ(testing::to_f32(gguf->lm_head), testing::to_f32(bin->lm_head));
}

TEST(LoaderDetect, BabyLlamaBinAndGgufAgree) {
  auto bin = load_ok("models/babyllama105/model5000.bin");
  auto gguf = load_ok("models/babyllama105/babyllama105.gguf");
  ASSERT_TRUE(bin && gguf);
  EXPECT_EQ(bin->config.vocab_size, 105);
  EXPECT_EQ(gguf->config.vocab_size, 105);
  EXPECT_EQ(gguf->config.max_seq_len, 256);
  testing::expect_same_weights(*bin, *gguf);
}

TEST(LoaderDetect, MissingPathsAndEmptyDirectories) {
  auto r = load_model("/nonexistent/model");
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("/nonexistent/model"), std::string::npos);
  const std::string dir = temp_dir("spx-lm");
  r = load_model(dir);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("config.json"), std::string::npos);
  // A file that is neither GGUF nor a plausible llama2.c checkpoint.
  write_file(dir + "/junk.bin", std::string(100, 'x'));
  r = load_model(dir + "/junk.bin");
  EXPECT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("junk.bin"), std::string::npos);
  // GGUF magic routes to the GGUF parser even with a .bin name.
  write_file(dir + "/fake.bin", std::string("GGUF\x03\0\0\0", 8));
  r = load_model(dir + "/fake.bin");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("tensor count"), std::string::npos) << r.status().to_string();
}

TEST(LoaderModelValidate, NamesTheOffendingTensor) {
  auto m = load_ok("models/stories260K/stories260K.bin");
  ASSERT_NE(m, nullptr);
  {
    Model bad = *m;
    bad.layers[3].wk.rows = 64;
    Status s = bad.validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("layers.3.wk: expected [32, 64], got [64, 64]"), std::string::npos)
        << s.to_string();
    EXPECT_NE(s.message().find("stories260K.bin"), std::string::npos);
  }
  {
    Model bad = *m;
    bad.layers[0].wv.data = nullptr;
    Status s = bad.validate();
    EXPECT_EQ(s.code(), StatusCode::kNotFound);
    EXPECT_NE(s.message().find("layers.0.wv: missing"), std::string::npos) << s.to_string();
  }
  {
    Model bad = *m;
    bad.layers[1].w_down.dtype = DType::kI32;
    Status s = bad.validate();
    EXPECT_NE(s.message().find("layers.1.w_down: dtype i32"), std::string::npos) << s.to_string();
  }
  {
    Model bad = *m;
    bad.final_norm.pop_back();
    EXPECT_NE(bad.validate().message().find("final_norm: expected [64], got [63]"),
              std::string::npos);
  }
  {
    Model bad = *m;
    bad.config.attention_bias = true;  // Qwen2 layout without biases
    EXPECT_NE(bad.validate().message().find("layers.0.bq: expected [64], got [0]"),
              std::string::npos)
        << bad.validate().to_string();
  }
  {
    Model bad = *m;
    bad.config.qk_norm = true;
    EXPECT_NE(bad.validate().message().find("layers.0.q_norm: expected [8], got [0]"),
              std::string::npos);
  }
  {
    Model bad = *m;
    bad.layers.pop_back();
    EXPECT_NE(bad.validate().message().find("layers: expected 5, got 4"), std::string::npos);
  }
  {
    Model bad = *m;
    bad.tok_embeddings.cols = 32;
    EXPECT_NE(bad.validate().message().find("tok_embeddings: expected [512, 64], got [512, 32]"),
              std::string::npos);
  }
}

TEST(LoaderModelConfigValidate, NamesTheField) {
  ModelConfig ok;
  ok.dim = 64;
  ok.hidden_dim = 128;
  ok.n_layers = 2;
  ok.n_heads = 4;
  ok.n_kv_heads = 2;
  ok.head_dim = 16;
  ok.vocab_size = 100;
  ok.max_seq_len = 256;
  ASSERT_TRUE(ok.validate("cfg").is_ok());

  struct Case {
    const char* expect;
    void (*mutate)(ModelConfig&);
  } cases[] = {
      {"dim", [](ModelConfig& c) { c.dim = 0; }},
      {"hidden_dim", [](ModelConfig& c) { c.hidden_dim = -1; }},
      {"n_layers", [](ModelConfig& c) { c.n_layers = 0; }},
      {"n_heads", [](ModelConfig& c) { c.n_heads = 0; }},
      {"n_kv_heads", [](ModelConfig& c) { c.n_kv_heads = 3; }},
      {"n_kv_heads", [](ModelConfig& c) { c.n_kv_heads = 0; }},
      {"head_dim", [](ModelConfig& c) { c.head_dim = 0; }},
      {"head_dim", [](ModelConfig& c) { c.head_dim = 15; }},
      {"vocab_size", [](ModelConfig& c) { c.vocab_size = 0; }},
      {"max_seq_len", [](ModelConfig& c) { c.max_seq_len = 0; }},
      {"dim", [](ModelConfig& c) { c.dim = int64_t{1} << 40; }},
      {"rope_theta", [](ModelConfig& c) { c.rope_theta = 0; }},
      {"norm_eps", [](ModelConfig& c) { c.norm_eps = -1; }},
      {"eos_token_id", [](ModelConfig& c) { c.eos_token_id = 100; }},
      {"rope_scaling.factor",
       [](ModelConfig& c) {
         c.rope_scaling.type = RopeScalingType::kLinear;
         c.rope_scaling.factor = 0;
       }},
      {"rope_scaling.original_max_position_embeddings",
       [](ModelConfig& c) {
         c.rope_scaling.type = RopeScalingType::kLlama3;
         c.rope_scaling.factor = 8;
       }},
      {"rope_scaling.beta_fast",
       [](ModelConfig& c) {
         c.rope_scaling.type = RopeScalingType::kYarn;
         c.rope_scaling.beta_fast = -1;
       }},
  };
  for (const auto& c : cases) {
    ModelConfig bad = ok;
    c.mutate(bad);
    Status s = bad.validate("cfg");
    ASSERT_FALSE(s.is_ok()) << c.expect;
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message().rfind("cfg: ", 0), 0u) << s.to_string();
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << s.to_string();
  }
}

TEST(LoaderModelConfig, ArchitectureNames) {
  EXPECT_EQ(architecture_name(Architecture::kLlama), "llama");
  EXPECT_EQ(architecture_name(Architecture::kMistral), "mistral");
  EXPECT_EQ(architecture_name(Architecture::kQwen2), "qwen2");
  EXPECT_EQ(architecture_name(Architecture::kQwen3), "qwen3");
}

}  // namespace
}  // namespace specontext
