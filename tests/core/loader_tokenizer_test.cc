// load_tokenizer_for: which tokenizer goes with each model format, and explicit overrides.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/model/model_loader.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "tests/core/loader_test_util.h"

namespace specontext {
namespace {

using testing::repo_path;
using testing::temp_dir;

std::shared_ptr<Model> load(const std::string& rel) {
  auto r = load_model(repo_path(rel));
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? *r : nullptr;
}

TEST(LoaderTokenizerFor, Llama2cUsesTheTokenizerBinNextToIt) {
  auto m = load("models/stories260K/stories260K.bin");
  ASSERT_NE(m, nullptr);
  auto t = load_tokenizer_for(*m, "");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ((*t)->kind(), "llama2c");
  EXPECT_EQ((*t)->vocab_size(), 512);

  auto baby = load("models/babyllama105/model5000.bin");
  ASSERT_NE(baby, nullptr);
  auto tb = load_tokenizer_for(*baby, "");
  ASSERT_TRUE(tb.is_ok()) << tb.status().to_string();
  EXPECT_EQ((*tb)->vocab_size(), 105);
}

TEST(LoaderTokenizerFor, HfDirectoryFallsBackToTheParentsTokBin) {
  auto m = load("models/stories260K/hf");
  ASSERT_NE(m, nullptr);
  auto t = load_tokenizer_for(*m, "");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ((*t)->kind(), "llama2c");
  EXPECT_EQ((*t)->vocab_size(), 512);
}

TEST(LoaderTokenizerFor, GgufUsesItsOwnVocabulary) {
  auto m = load("models/stories260K/stories260K.gguf");
  ASSERT_NE(m, nullptr);
  auto t = load_tokenizer_for(*m, "");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_NE((*t)->kind(), "llama2c");
  EXPECT_EQ((*t)->vocab_size(), 512);
}

TEST(LoaderTokenizerFor, ExplicitPaths) {
  auto m = load("models/stories260K/stories260K.bin");
  ASSERT_NE(m, nullptr);
  auto bin = load_tokenizer_for(*m, repo_path("models/stories260K/tok512.bin"));
  ASSERT_TRUE(bin.is_ok()) << bin.status().to_string();
  EXPECT_EQ((*bin)->kind(), "llama2c");
  auto gguf = load_tokenizer_for(*m, repo_path("models/stories260K/stories260K.gguf"));
  ASSERT_TRUE(gguf.is_ok()) << gguf.status().to_string();
  EXPECT_NE((*gguf)->kind(), "llama2c");
  auto json = load_tokenizer_for(*m, "/nonexistent/tokenizer.json");
  EXPECT_FALSE(json.is_ok());
}

TEST(LoaderTokenizerFor, MissingTokenizerIsNotFound) {
  const std::string dir = temp_dir("spx-tok");
  std::filesystem::copy_file(repo_path("models/stories260K/stories260K.bin"),
                             dir + "/stories260K.bin");
  auto m = load_model(dir + "/stories260K.bin");
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto t = load_tokenizer_for(**m, "");
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("stories260K.bin"), std::string::npos);

  Model synthetic;
  synthetic.format = "synthetic";
  EXPECT_EQ(load_tokenizer_for(synthetic, "").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace specontext
