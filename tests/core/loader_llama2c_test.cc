// llama2.c checkpoint loading: header parsing, in-place f32 views, exact size validation and
// the errors for truncated or inconsistent files.
#include <gtest/gtest.h>

#include <cstring>

#include "core/model/model_loader.h"
#include "tests/core/loader_test_util.h"

namespace specontext {
namespace {

using testing::read_text_file;
using testing::repo_path;
using testing::temp_dir;
using testing::write_file;

const std::string kStories = "models/stories260K/stories260K.bin";

float raw_float(const std::string& bytes, size_t float_index) {
  float f;
  std::memcpy(&f, bytes.data() + 28 + float_index * 4, 4);
  return f;
}

std::string with_header(std::string bytes, int field, int32_t value) {
  std::memcpy(bytes.data() + field * 4, &value, 4);
  return bytes;
}

TEST(LoaderLlama2c, LoadsStories260K) {
  auto r = load_llama2c_model(repo_path(kStories));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const Model& m = **r;
  const ModelConfig& c = m.config;
  EXPECT_EQ(c.arch, Architecture::kLlama);
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_EQ(c.rope_style, RopeStyle::kInterleaved);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kNone);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(m.format, "llama2c");
  EXPECT_EQ(m.source, repo_path(kStories));
  EXPECT_EQ(m.weight_dtype, DType::kF32);
  EXPECT_EQ(m.lm_head.data, m.tok_embeddings.data);
  ASSERT_EQ(m.layers.size(), 5u);
  EXPECT_EQ(m.layers[0].wk.rows, 32);
  EXPECT_EQ(m.layers[0].w_down.rows, 64);
  EXPECT_EQ(m.layers[0].w_down.cols, 172);
  EXPECT_TRUE(m.validate().is_ok());
  // vocab·dim + per layer (2 norms, wq, wk, wv, wo, 3 MLP matrices) + final norm.
  const int64_t per_layer = 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 172 * 64;
  EXPECT_EQ(m.parameter_count(), 512 * 64 + 5 * per_layer + 64);
}

TEST(LoaderLlama2c, TensorsComeFromTheDocumentedOffsets) {
  const std::string bytes = read_text_file(repo_path(kStories));
  auto r = load_llama2c_model(repo_path(kStories));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const Model& m = **r;
  const size_t V = 512, D = 64, L = 5, KV = 32, H = 172;
  size_t off = 0;
  EXPECT_EQ(static_cast<const float*>(m.tok_embeddings.data)[7], raw_float(bytes, off + 7));
  off += V * D;
  EXPECT_EQ(m.layers[1].attn_norm[3], raw_float(bytes, off + D + 3));
  off += L * D;
  EXPECT_EQ(static_cast<const float*>(m.layers[2].wq.data)[5],
            raw_float(bytes, off + 2 * D * D + 5));
  off += L * D * D;
  EXPECT_EQ(static_cast<const float*>(m.layers[1].wk.data)[0], raw_float(bytes, off + KV * D));
  off += L * KV * D;
  EXPECT_EQ(static_cast<const float*>(m.layers[0].wv.data)[9], raw_float(bytes, off + 9));
  off += L * KV * D;
  EXPECT_EQ(static_cast<const float*>(m.layers[4].wo.data)[1],
            raw_float(bytes, off + 4 * D * D + 1));
  off += L * D * D;
  EXPECT_EQ(m.layers[4].ffn_norm[0], raw_float(bytes, off + 4 * D));
  off += L * D;
  // w1 = gate, w2 = down, w3 = up
  EXPECT_EQ(static_cast<const float*>(m.layers[0].w_gate.data)[2], raw_float(bytes, off + 2));
  off += L * H * D;
  EXPECT_EQ(static_cast<const float*>(m.layers[0].w_down.data)[2], raw_float(bytes, off + 2));
  off += L * D * H;
  EXPECT_EQ(static_cast<const float*>(m.layers[3].w_up.data)[2],
            raw_float(bytes, off + 3 * H * D + 2));
  off += L * H * D;
  EXPECT_EQ(m.final_norm[63], raw_float(bytes, off + 63));
}

TEST(LoaderLlama2c, LoadsBabyLlama105) {
  auto r = load_llama2c_model(repo_path("models/babyllama105/model5000.bin"));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const ModelConfig& c = (*r)->config;
  EXPECT_EQ(c.dim, 128);
  EXPECT_EQ(c.hidden_dim, 352);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 105);
  EXPECT_EQ(c.max_seq_len, 256);
  EXPECT_TRUE((*r)->validate().is_ok());
}

TEST(LoaderLlama2c, ForceF32KeepsWeightsInPlace) {
  auto a = load_llama2c_model(repo_path(kStories));
  auto b = load_llama2c_model(repo_path(kStories), LoadOptions{.force_f32 = true});
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ((*b)->weight_dtype, DType::kF32);
  testing::expect_same_weights(**a, **b);
}

TEST(LoaderLlama2c, TruncatedFileIsDataLossNamingTheFile) {
  const std::string bytes = read_text_file(repo_path(kStories));
  const std::string path = temp_dir("spx-l2c") + "/stories260K.bin";
  write_file(path, bytes.substr(0, bytes.size() - 100));
  auto r = load_llama2c_model(path);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  const std::string& msg = r.status().message();
  EXPECT_NE(msg.find("stories260K.bin: truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dim=64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("n_layers=5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expects 1056540 bytes, file has 1056440"), std::string::npos) << msg;
}

TEST(LoaderLlama2c, TinyAndHeaderOnlyFilesAreDataLoss) {
  const std::string bytes = read_text_file(repo_path(kStories));
  const std::string dir = temp_dir("spx-l2c");
  for (size_t n : {size_t{0}, size_t{10}, size_t{28}}) {
    const std::string path = dir + "/cut" + std::to_string(n) + ".bin";
    write_file(path, bytes.substr(0, n));
    auto r = load_llama2c_model(path);
    ASSERT_FALSE(r.is_ok()) << n;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
    EXPECT_NE(r.status().message().find(path), std::string::npos);
  }
}

TEST(LoaderLlama2c, TrailingBytesAreRejected) {
  const std::string path = temp_dir("spx-l2c") + "/long.bin";
  write_file(path, read_text_file(repo_path(kStories)) + std::string(64 * 4, '\0'));
  auto r = load_llama2c_model(path);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("size mismatch"), std::string::npos);
}

TEST(LoaderLlama2c, InconsistentHeaderNamesTheField) {
  const std::string bytes = read_text_file(repo_path(kStories));
  const std::string dir = temp_dir("spx-l2c");
  struct Case {
    int field;
    int32_t value;
    const char* expect;
  } cases[] = {
      {0, 0, "dim"},         {1, -5, "hidden_dim"}, {2, 0, "n_layers"},
      {3, 0, "n_heads"},     {3, 7, "n_heads"},     {4, 3, "n_kv_heads"},
      {4, 16, "n_kv_heads"}, {5, 0, "vocab_size"},  {6, -1, "seq_len"},
  };
  for (const auto& c : cases) {
    const std::string path = dir + "/bad.bin";
    write_file(path, with_header(bytes, c.field, c.value));
    auto r = load_llama2c_model(path);
    ASSERT_FALSE(r.is_ok()) << c.expect;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().to_string();
    EXPECT_NE(r.status().message().find("bad.bin"), std::string::npos);
  }
}

TEST(LoaderLlama2c, HugeHeaderValuesDoNotOverflow) {
  const std::string dir = temp_dir("spx-l2c");
  std::string bytes = read_text_file(repo_path(kStories));
  for (int32_t v : {INT32_MAX, 1 << 20}) {
    const std::string path = dir + "/huge.bin";
    std::string b = with_header(bytes, 0, v);
    b = with_header(b, 1, v);
    b = with_header(b, 2, 4096);
    write_file(path, b);
    auto r = load_llama2c_model(path);
    ASSERT_FALSE(r.is_ok());
  }
}

TEST(LoaderLlama2c, NegativeVocabMeansSeparateClassifier) {
  const std::string bytes = read_text_file(repo_path(kStories));
  const std::vector<float> wcls = testing::random_floats(512 * 64, 7);
  const std::string path = temp_dir("spx-l2c") + "/untied.bin";
  write_file(path, with_header(bytes, 5, -512) + testing::GgufBuilder::f32_bytes(wcls));
  auto r = load_llama2c_model(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const Model& m = **r;
  EXPECT_FALSE(m.config.tie_embeddings);
  EXPECT_EQ(m.config.vocab_size, 512);
  EXPECT_NE(m.lm_head.data, m.tok_embeddings.data);
  EXPECT_EQ(testing::to_f32(m.lm_head), wcls);
  EXPECT_TRUE(m.validate().is_ok());

  // Without the classifier the same header is a truncated file.
  write_file(path, with_header(bytes, 5, -512));
  auto t = load_llama2c_model(path);
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kDataLoss);
}

TEST(LoaderLlama2c, MissingFileIsNotFound) {
  auto r = load_llama2c_model("/nonexistent/dir/model.bin");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("/nonexistent/dir/model.bin"), std::string::npos);
}

}  // namespace
}  // namespace specontext
