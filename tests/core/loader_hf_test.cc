// Hugging Face directories: config.json parsing (architectures, GQA, head_dim, rope_scaling),
// single and sharded safetensors, F32/F16/BF16 weights, and synthetic Qwen2/Qwen3/Mistral/Llama-3
// checkpoints written with the safetensors writer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/model/model_loader.h"
#include "core/model/safetensors.h"
#include "tests/core/loader_test_util.h"

namespace specontext {
namespace {

using testing::read_text_file;
using testing::repo_path;
using testing::temp_dir;
using testing::to_f32;
using testing::write_file;

const std::string kHfDir = "models/stories260K/hf";

// ---- helpers ----

// Owned tensor data for the writer.
struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

Status write_owned(const std::string& path, const std::vector<OwnedTensor>& ts) {
  std::vector<NamedTensor> named;
  for (const auto& t : ts) named.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
  return write_safetensors(path, named, {{"format", "pt"}});
}

// The stories260K tensors, converted to `dtype` (f32, f16 or bf16).
std::vector<OwnedTensor> stories_tensors(DType dtype) {
  auto f = SafetensorsFile::open(repo_path(kHfDir + "/model.safetensors"));
  EXPECT_TRUE(f.is_ok()) << f.status().to_string();
  std::vector<OwnedTensor> out;
  for (const auto& t : (*f)->tensors()) {
    OwnedTensor o{t.name, dtype, t.shape, {}};
    const auto* src = reinterpret_cast<const float*>(t.data);
    for (int64_t i = 0; i < t.numel(); ++i) {
      float x;
      std::memcpy(&x, src + i, 4);
      if (dtype == DType::kF32) {
        o.bytes.append(reinterpret_cast<const char*>(&x), 4);
      } else {
        const uint16_t h = dtype == DType::kF16 ? f32_to_f16(x) : f32_to_bf16(x);
        o.bytes.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
    out.push_back(std::move(o));
  }
  return out;
}

std::string new_model_dir(const std::string& config_json) {
  const std::string dir = temp_dir("spx-hf");
  write_file(dir + "/config.json", config_json);
  return dir;
}

std::string stories_config() { return read_text_file(repo_path(kHfDir + "/config.json")); }

std::shared_ptr<Model> load_ok(const std::string& dir, const LoadOptions& opts = {}) {
  auto r = load_hf_model(dir, opts);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? *r : nullptr;
}

void expect_error_contains(const Status& s, StatusCode code,
                           const std::vector<std::string>& words) {
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), code) << s.to_string();
  for (const auto& w : words) {
    EXPECT_NE(s.message().find(w), std::string::npos)
        << "missing '" << w << "' in " << s.to_string();
  }
}

// ---- the bundled stories260K copy ----

TEST(LoaderHf, LoadsStories260K) {
  auto m = load_ok(repo_path(kHfDir));
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config;
  EXPECT_EQ(c.arch, Architecture::kLlama);
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_EQ(c.rope_style, RopeStyle::kHalf);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(m->lm_head.data, m->tok_embeddings.data);
  EXPECT_EQ(m->format, "safetensors");
  EXPECT_EQ(m->weight_dtype, DType::kF32);
  EXPECT_TRUE(m->validate().is_ok());
}

TEST(LoaderHf, AgreesWithLlama2cUpToTheRopePermutation) {
  auto hf = load_ok(repo_path(kHfDir));
  auto bin = load_llama2c_model(repo_path("models/stories260K/stories260K.bin"));
  ASSERT_NE(hf, nullptr);
  ASSERT_TRUE(bin.is_ok());
  testing::expect_same_weights(*hf, **bin, /*skip_qk=*/true);
  // HF q/k rows are permuted from interleaved pairs to rotate_half halves, per head.
  const int64_t hd = hf->config.head_dim;
  for (size_t l = 0; l < hf->layers.size(); ++l) {
    for (auto [hm, bm] : {std::pair{&hf->layers[l].wq, &(*bin)->layers[l].wq},
                          std::pair{&hf->layers[l].wk, &(*bin)->layers[l].wk}}) {
      ASSERT_EQ(hm->rows, bm->rows);
      const auto a = to_f32(*hm);
      const auto b = to_f32(*bm);
      const int64_t cols = hm->cols;
      for (int64_t h = 0; h < hm->rows / hd; ++h) {
        for (int64_t i = 0; i < hd; ++i) {
          const int64_t src = h * hd + (i < hd / 2 ? 2 * i : 2 * (i - hd / 2) + 1);
          for (int64_t c = 0; c < cols; ++c) {
            ASSERT_EQ(a[(h * hd + i) * cols + c], b[src * cols + c])
                << "layer " << l << " head " << h << " row " << i;
          }
        }
      }
    }
  }
}

// ---- sharding ----

TEST(LoaderHf, ShardedIndex) {
  const auto ts = stories_tensors(DType::kF32);
  const std::string dir = new_model_dir(stories_config());
  std::vector<OwnedTensor> a(ts.begin(), ts.begin() + ts.size() / 2);
  std::vector<OwnedTensor> b(ts.begin() + ts.size() / 2, ts.end());
  ASSERT_TRUE(write_owned(dir + "/model-00001-of-00002.safetensors", a).is_ok());
  ASSERT_TRUE(write_owned(dir + "/model-00002-of-00002.safetensors", b).is_ok());
  nlohmann::json index;
  index["metadata"] = {{"total_size", 1045024}};
  for (const auto& t : a) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const auto& t : b) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  write_file(dir + "/model.safetensors.index.json", index.dump(2));

  auto sharded = load_ok(dir);
  auto single = load_ok(repo_path(kHfDir));
  ASSERT_NE(sharded, nullptr);
  ASSERT_NE(single, nullptr);
  testing::expect_same_weights(*sharded, *single);
  EXPECT_EQ(sharded->config.n_layers, 5);

  // A tensor the index puts in the wrong shard.
  index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors";
  write_file(dir + "/model.safetensors.index.json", index.dump());
  auto r = load_hf_model(dir);
  expect_error_contains(r.status(), StatusCode::kDataLoss,
                        {"model-00001-of-00002.safetensors", "\"model.norm.weight\""});

  // A shard that does not exist.
  index["weight_map"]["model.norm.weight"] = "model-00003-of-00002.safetensors";
  write_file(dir + "/model.safetensors.index.json", index.dump());
  r = load_hf_model(dir);
  expect_error_contains(r.status(), StatusCode::kNotFound, {"model-00003-of-00002.safetensors"});

  // Shard names may not escape the directory.
  index["weight_map"]["model.norm.weight"] = "../evil.safetensors";
  write_file(dir + "/model.safetensors.index.json", index.dump());
  r = load_hf_model(dir);
  expect_error_contains(r.status(), StatusCode::kInvalidArgument,
                        {"model.safetensors.index.json", "weight_map", "model.norm.weight"});

  write_file(dir + "/model.safetensors.index.json", "{\"weight_map\": 3}");
  r = load_hf_model(dir);
  expect_error_contains(r.status(), StatusCode::kInvalidArgument,
                        {"model.safetensors.index.json", "weight_map"});
}

// ---- dtypes ----

TEST(LoaderHf, Bf16WeightsStayBf16AndMatchWithinRounding) {
  const std::string dir = new_model_dir(stories_config());
  ASSERT_TRUE(write_owned(dir + "/model.safetensors", stories_tensors(DType::kBF16)).is_ok());
  auto ref = load_ok(repo_path(kHfDir));
  auto m = load_ok(dir);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->weight_dtype, DType::kBF16);
  EXPECT_EQ(m->layers[2].w_up.dtype, DType::kBF16);
  const auto mm = testing::all_matrices(*m);
  const auto mr = testing::all_matrices(*ref);
  for (size_t i = 0; i < mm.size(); ++i) {
    const auto a = to_f32(*mm[i].m);
    const auto b = to_f32(*mr[i].m);
    ASSERT_EQ(a.size(), b.size());
    for (size_t j = 0; j < a.size(); ++j) {
      ASSERT_NEAR(a[j], b[j], std::fabs(b[j]) * (1.0f / 256) + 1e-30f) << mm[i].name << " " << j;
    }
  }
  // Norms become f32 vectors with bf16 precision.
  EXPECT_NEAR(m->final_norm[3], ref->final_norm[3], std::fabs(ref->final_norm[3]) / 256);

  // force_f32 converts the same values exactly.
  auto f = load_ok(dir, LoadOptions{.force_f32 = true});
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->weight_dtype, DType::kF32);
  EXPECT_EQ(f->layers[0].wq.dtype, DType::kF32);
  testing::expect_same_weights(*m, *f);
}

TEST(LoaderHf, F16WeightsAreConvertedToF32) {
  const std::string dir = new_model_dir(stories_config());
  ASSERT_TRUE(write_owned(dir + "/model.safetensors", stories_tensors(DType::kF16)).is_ok());
  auto ref = load_ok(repo_path(kHfDir));
  auto m = load_ok(dir);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->weight_dtype, DType::kF32);
  EXPECT_EQ(m->layers[4].wo.dtype, DType::kF32);
  const auto mm = testing::all_matrices(*m);
  const auto mr = testing::all_matrices(*ref);
  for (size_t i = 0; i < mm.size(); ++i) {
    const auto a = to_f32(*mm[i].m);
    const auto b = to_f32(*mr[i].m);
    for (size_t j = 0; j < a.size(); ++j) {
      ASSERT_NEAR(a[j], b[j], std::fabs(b[j]) * (1.0f / 1024) + 6e-8f) << mm[i].name << " " << j;
    }
  }
}

TEST(LoaderHf, MixedBf16AndF32BecomeF32) {
  auto ts = stories_tensors(DType::kBF16);
  const auto f32 = stories_tensors(DType::kF32);
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].name == "model.layers.1.mlp.up_proj.weight") ts[i] = f32[i];
  }
  const std::string dir = new_model_dir(stories_config());
  ASSERT_TRUE(write_owned(dir + "/model.safetensors", ts).is_ok());
  auto m = load_ok(dir);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->weight_dtype, DType::kF32);
  for (const auto& nm : testing::all_matrices(*m)) EXPECT_EQ(nm.m->dtype, DType::kF32) << nm.name;
  EXPECT_EQ(m->lm_head.data, m->tok_embeddings.data);
}

// ---- errors ----

TEST(LoaderHf, ErrorsNameTheFileAndField) {
  const auto ts = stories_tensors(DType::kF32);
  {  // invalid JSON
    const std::string dir = new_model_dir("{\"architectures\": [");
    auto r = load_hf_model(dir);
    expect_error_contains(r.status(), StatusCode::kInvalidArgument, {"config.json", "JSON"});
  }
  {  // unknown architecture
    auto cfg = nlohmann::json::parse(stories_config());
    cfg["architectures"] = {"GPT2LMHeadModel"};
    const std::string dir = new_model_dir(cfg.dump());
    auto r = load_hf_model(dir);
    expect_error_contains(r.status(), StatusCode::kUnimplemented,
                          {"config.json", "\"architectures\"", "GPT2LMHeadModel"});
  }
  {  // no config.json
    auto r = load_hf_model(temp_dir("spx-hf"));
    expect_error_contains(r.status(), StatusCode::kNotFound, {"config.json"});
  }
  {  // no weights
    auto r = load_hf_model(new_model_dir(stories_config()));
    expect_error_contains(r.status(), StatusCode::kNotFound, {"model.safetensors"});
  }
  {  // shape mismatch: k_proj stored as [64, 64]
    auto bad = ts;
    for (auto& t : bad) {
      if (t.name == "model.layers.3.self_attn.k_proj.weight") {
        t.shape = {64, 64};
        t.bytes += t.bytes;
      }
    }
    const std::string dir = new_model_dir(stories_config());
    ASSERT_TRUE(write_owned(dir + "/model.safetensors", bad).is_ok());
    auto r = load_hf_model(dir);
    expect_error_contains(r.status(), StatusCode::kInvalidArgument,
                          {"model.safetensors", "\"model.layers.3.self_attn.k_proj.weight\"",
                           "expected shape [32, 64], got [64, 64]"});
  }
  {  // missing tensor
    auto bad = ts;
    std::erase_if(bad, [](const OwnedTensor& t) { return t.name == "model.norm.weight"; });
    const std::string dir = new_model_dir(stories_config());
    ASSERT_TRUE(write_owned(dir + "/model.safetensors", bad).is_ok());
    auto r = load_hf_model(dir);
    expect_error_contains(r.status(), StatusCode::kNotFound,
                          {"model.safetensors", "\"model.norm.weight\""});
  }
  {  // unsupported dtype
    auto bad = ts;
    for (auto& t : bad) {
      if (t.name == "model.layers.0.mlp.up_proj.weight") {
        t.dtype = DType::kI32;
      }
    }
    const std::string dir = new_model_dir(stories_config());
    ASSERT_TRUE(write_owned(dir + "/model.safetensors", bad).is_ok());
    auto r = load_hf_model(dir);
    expect_error_contains(r.status(), StatusCode::kUnimplemented,
                          {"\"model.layers.0.mlp.up_proj.weight\"", "I32"});
  }
  {  // corrupt safetensors header
    const std::string dir = new_model_dir(stories_config());
    std::string bytes = read_text_file(repo_path(kHfDir + "/model.safetensors"));
    bytes[bytes.find(':', 8)] = ';';
    write_file(dir + "/model.safetensors", bytes);
    auto r = load_hf_model(dir);
    expect_error_contains(r.status(), StatusCode::kInvalidArgument, {"model.safetensors", "JSON"});
  }
  {  // truncated safetensors
    const std::string dir = new_model_dir(stories_config());
    const std::string bytes = read_text_file(repo_path(kHfDir + "/model.safetensors"));
    write_file(dir + "/model.safetensors", bytes.substr(0, bytes.size() - 1000));
    auto r = load_hf_model(dir);
    expect_error_contains(r.status(), StatusCode::kDataLoss, {"model.safetensors", "data_offsets"});
  }
  {  // config vocab disagrees with the embedding
    auto cfg = nlohmann::json::parse(stories_config());
    cfg["vocab_size"] = 500;
    const std::string dir = new_model_dir(cfg.dump());
    ASSERT_TRUE(write_owned(dir + "/model.safetensors", ts).is_ok());
    auto r = load_hf_model(dir);
    expect_error_contains(r.status(), StatusCode::kInvalidArgument,
                          {"\"model.embed_tokens.weight\"", "expected shape [500, 64]"});
  }
}

// ---- config parsing ----

nlohmann::json base_config(const std::string& arch) {
  return {{"architectures", {arch}},  {"hidden_size", 32},
          {"intermediate_size", 48},  {"num_hidden_layers", 2},
          {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"vocab_size", 40},         {"max_position_embeddings", 256},
          {"rms_norm_eps", 1e-6},     {"rope_theta", 1000000.0}};
}

Result<ModelConfig> parse(const nlohmann::json& j) {
  return parse_hf_config(j.dump(), "cfg/config.json");
}

TEST(LoaderHfConfig, DefaultsAndGqaVariants) {
  auto j = base_config("LlamaForCausalLM");
  auto c = parse(j);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_EQ(c->n_kv_heads, 2);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_FLOAT_EQ(c->norm_eps, 1e-6f);
  EXPECT_EQ(c->rope_style, RopeStyle::kHalf);
  EXPECT_FALSE(c->tie_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);

  j.erase("num_key_value_heads");  // MHA by default
  EXPECT_EQ(parse(j)->n_kv_heads, 4);
  j["num_key_value_heads"] = nullptr;
  EXPECT_EQ(parse(j)->n_kv_heads, 4);
  j["num_key_value_heads"] = 1;  // MQA
  EXPECT_EQ(parse(j)->n_kv_heads, 1);
  j["rope_scaling"] = nullptr;
  EXPECT_TRUE(parse(j).is_ok());
  j["eos_token_id"] = {128001, 128008, 128009};
  j["bos_token_id"] = nullptr;
  j["vocab_size"] = 130000;
  auto ids = parse(j);
  ASSERT_TRUE(ids.is_ok()) << ids.status().to_string();
  EXPECT_EQ(ids->eos_token_id, 128001);
  EXPECT_EQ(ids->bos_token_id, -1);
  j["hidden_size"] = 32.0;  // integral floats are tolerated
  EXPECT_TRUE(parse(j).is_ok());
}

TEST(LoaderHfConfig, ArchitectureSpecifics) {
  auto q2 = parse(base_config("Qwen2ForCausalLM"));
  ASSERT_TRUE(q2.is_ok()) << q2.status().to_string();
  EXPECT_EQ(q2->arch, Architecture::kQwen2);
  EXPECT_TRUE(q2->attention_bias);
  EXPECT_FALSE(q2->qk_norm);

  auto j3 = base_config("Qwen3ForCausalLM");
  j3["head_dim"] = 16;  // explicit, != hidden_size / heads
  auto q3 = parse(j3);
  ASSERT_TRUE(q3.is_ok()) << q3.status().to_string();
  EXPECT_EQ(q3->arch, Architecture::kQwen3);
  EXPECT_TRUE(q3->qk_norm);
  EXPECT_FALSE(q3->attention_bias);
  EXPECT_EQ(q3->head_dim, 16);
  EXPECT_EQ(q3->q_dim(), 64);

  auto mi = parse(base_config("MistralForCausalLM"));
  ASSERT_TRUE(mi.is_ok());
  EXPECT_EQ(mi->arch, Architecture::kMistral);

  auto no_arch = base_config("x");
  no_arch.erase("architectures");
  no_arch["model_type"] = "qwen3";
  EXPECT_EQ(parse(no_arch)->arch, Architecture::kQwen3);
}

TEST(LoaderHfConfig, RopeScaling) {
  auto j = base_config("LlamaForCausalLM");
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 32.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  auto l3 = parse(j);
  ASSERT_TRUE(l3.is_ok()) << l3.status().to_string();
  EXPECT_EQ(l3->rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(l3->rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(l3->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(l3->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(l3->rope_scaling.original_max_position_embeddings, 8192);

  j["rope_scaling"] = {{"type", "yarn"},
                       {"factor", 4.0},
                       {"beta_fast", 16.0},
                       {"beta_slow", 2.0},
                       {"original_max_position_embeddings", 32768},
                       {"attention_factor", 1.25}};
  auto y = parse(j);
  ASSERT_TRUE(y.is_ok()) << y.status().to_string();
  EXPECT_EQ(y->rope_scaling.type, RopeScalingType::kYarn);
  EXPECT_DOUBLE_EQ(y->rope_scaling.factor, 4.0);
  EXPECT_DOUBLE_EQ(y->rope_scaling.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(y->rope_scaling.beta_slow, 2.0);
  EXPECT_EQ(y->rope_scaling.original_max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(y->rope_scaling.attention_factor, 1.25);

  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};  // defaults
  auto yd = parse(j);
  ASSERT_TRUE(yd.is_ok());
  EXPECT_DOUBLE_EQ(yd->rope_scaling.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(yd->rope_scaling.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(yd->rope_scaling.attention_factor, 0.0);
  EXPECT_EQ(yd->rope_scaling.original_max_position_embeddings, 256);

  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  auto lin = parse(j);
  ASSERT_TRUE(lin.is_ok());
  EXPECT_EQ(lin->rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_DOUBLE_EQ(lin->rope_scaling.factor, 2.0);

  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(parse(j)->rope_scaling.type, RopeScalingType::kNone);

  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  expect_error_contains(parse(j).status(), StatusCode::kUnimplemented,
                        {"cfg/config.json", "rope_scaling", "dynamic"});
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  expect_error_contains(parse(j).status(), StatusCode::kNotFound,
                        {"rope_scaling.original_max_position_embeddings"});
  j["rope_scaling"] = {
      {"rope_type", "llama3"}, {"factor", "big"}, {"original_max_position_embeddings", 8192}};
  expect_error_contains(parse(j).status(), StatusCode::kInvalidArgument, {"rope_scaling.factor"});
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 4.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  expect_error_contains(parse(j).status(), StatusCode::kInvalidArgument, {"high_freq_factor"});
  j["rope_scaling"] = "yarn";
  expect_error_contains(parse(j).status(), StatusCode::kInvalidArgument, {"rope_scaling"});
}

TEST(LoaderHfConfig, FieldErrors) {
  struct Case {
    std::string field;
    nlohmann::json value;  // null = erase
    StatusCode code;
  } cases[] = {
      {"hidden_size", nullptr, StatusCode::kNotFound},
      {"hidden_size", "64", StatusCode::kInvalidArgument},
      {"hidden_size", 0, StatusCode::kInvalidArgument},
      {"num_hidden_layers", -1, StatusCode::kInvalidArgument},
      {"num_key_value_heads", 3, StatusCode::kInvalidArgument},
      {"num_attention_heads", 0, StatusCode::kInvalidArgument},
      {"vocab_size", 1.5, StatusCode::kInvalidArgument},
      {"max_position_embeddings", nullptr, StatusCode::kNotFound},
      {"tie_word_embeddings", "yes", StatusCode::kInvalidArgument},
      {"rope_theta", "big", StatusCode::kInvalidArgument},
      {"hidden_act", "gelu", StatusCode::kUnimplemented},
      {"attention_bias", true, StatusCode::kUnimplemented},
      {"architectures", "LlamaForCausalLM", StatusCode::kInvalidArgument},
      {"architectures", nlohmann::json::array({"BertModel"}), StatusCode::kUnimplemented},
      {"architectures", nullptr, StatusCode::kInvalidArgument},
  };
  for (const auto& c : cases) {
    auto j = base_config("LlamaForCausalLM");
    if (c.value.is_null()) {
      j.erase(c.field);
    } else {
      j[c.field] = c.value;
    }
    auto r = parse(j);
    SCOPED_TRACE(c.field + " = " + c.value.dump());
    expect_error_contains(r.status(), c.code, {"cfg/config.json", "\"" + c.field + "\""});
  }
  expect_error_contains(parse_hf_config("[1, 2]", "x/config.json").status(),
                        StatusCode::kInvalidArgument, {"x/config.json"});
  expect_error_contains(parse_hf_config("", "x/config.json").status(), StatusCode::kInvalidArgument,
                        {"x/config.json", "JSON"});
}

// ---- synthetic checkpoints of each architecture ----

struct Synthetic {
  std::string dir;
  std::map<std::string, std::vector<float>> values;
};

// Writes config `j` and random f32 weights with HF names for its shapes.
Synthetic write_synthetic(const nlohmann::json& j, bool with_lm_head) {
  auto cr = parse(j);
  EXPECT_TRUE(cr.is_ok()) << cr.status().to_string();
  const ModelConfig c = *cr;
  Synthetic s;
  s.dir = new_model_dir(j.dump(2));
  std::vector<OwnedTensor> ts;
  uint32_t seed = 100;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    auto v = testing::random_floats(static_cast<size_t>(n), seed++);
    ts.push_back({name, DType::kF32, shape, testing::GgufBuilder::f32_bytes(v)});
    s.values[name] = std::move(v);
  };
  add("model.embed_tokens.weight", {c.vocab_size, c.dim});
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {c.dim});
    add(p + "self_attn.q_proj.weight", {c.q_dim(), c.dim});
    add(p + "self_attn.k_proj.weight", {c.kv_dim(), c.dim});
    add(p + "self_attn.v_proj.weight", {c.kv_dim(), c.dim});
    add(p + "self_attn.o_proj.weight", {c.dim, c.q_dim()});
    if (c.attention_bias) {
      add(p + "self_attn.q_proj.bias", {c.q_dim()});
      add(p + "self_attn.k_proj.bias", {c.kv_dim()});
      add(p + "self_attn.v_proj.bias", {c.kv_dim()});
    }
    if (c.qk_norm) {
      add(p + "self_attn.q_norm.weight", {c.head_dim});
      add(p + "self_attn.k_norm.weight", {c.head_dim});
    }
    add(p + "post_attention_layernorm.weight", {c.dim});
    add(p + "mlp.gate_proj.weight", {c.hidden_dim, c.dim});
    add(p + "mlp.up_proj.weight", {c.hidden_dim, c.dim});
    add(p + "mlp.down_proj.weight", {c.dim, c.hidden_dim});
  }
  add("model.norm.weight", {c.dim});
  if (with_lm_head) add("lm_head.weight", {c.vocab_size, c.dim});
  EXPECT_TRUE(write_owned(s.dir + "/model.safetensors", ts).is_ok());
  return s;
}

void expect_common_values(const Model& m, const Synthetic& s) {
  EXPECT_EQ(to_f32(m.tok_embeddings), s.values.at("model.embed_tokens.weight"));
  EXPECT_EQ(m.final_norm, s.values.at("model.norm.weight"));
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const LayerWeights& l = m.layers[i];
    EXPECT_EQ(l.attn_norm, s.values.at(p + "input_layernorm.weight"));
    EXPECT_EQ(to_f32(l.wq), s.values.at(p + "self_attn.q_proj.weight"));
    EXPECT_EQ(to_f32(l.wk), s.values.at(p + "self_attn.k_proj.weight"));
    EXPECT_EQ(to_f32(l.wv), s.values.at(p + "self_attn.v_proj.weight"));
    EXPECT_EQ(to_f32(l.wo), s.values.at(p + "self_attn.o_proj.weight"));
    EXPECT_EQ(l.ffn_norm, s.values.at(p + "post_attention_layernorm.weight"));
    EXPECT_EQ(to_f32(l.w_gate), s.values.at(p + "mlp.gate_proj.weight"));
    EXPECT_EQ(to_f32(l.w_up), s.values.at(p + "mlp.up_proj.weight"));
    EXPECT_EQ(to_f32(l.w_down), s.values.at(p + "mlp.down_proj.weight"));
  }
}

TEST(LoaderHf, Qwen2WithAttentionBias) {
  auto j = base_config("Qwen2ForCausalLM");
  j["tie_word_embeddings"] = true;
  const Synthetic s = write_synthetic(j, /*with_lm_head=*/false);
  auto m = load_ok(s.dir);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->config.arch, Architecture::kQwen2);
  EXPECT_TRUE(m->config.attention_bias);
  EXPECT_TRUE(m->config.tie_embeddings);
  expect_common_values(*m, s);
  for (size_t i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".self_attn.";
    EXPECT_EQ(m->layers[i].bq, s.values.at(p + "q_proj.bias"));
    EXPECT_EQ(m->layers[i].bk, s.values.at(p + "k_proj.bias"));
    EXPECT_EQ(m->layers[i].bv, s.values.at(p + "v_proj.bias"));
    EXPECT_EQ(m->layers[i].bk.size(), 16u);
    EXPECT_TRUE(m->layers[i].q_norm.empty());
  }
  EXPECT_EQ(m->lm_head.data, m->tok_embeddings.data);

  // Without the biases a Qwen2 checkpoint is incomplete.
  std::filesystem::remove(s.dir + "/model.safetensors");
  auto k = base_config("LlamaForCausalLM");
  const Synthetic no_bias = write_synthetic(k, false);
  std::filesystem::copy_file(no_bias.dir + "/model.safetensors", s.dir + "/model.safetensors");
  auto r = load_hf_model(s.dir);
  expect_error_contains(r.status(), StatusCode::kNotFound,
                        {"\"model.layers.0.self_attn.q_proj.bias\""});
}

TEST(LoaderHf, Qwen3WithQkNormAndExplicitHeadDim) {
  auto j = base_config("Qwen3ForCausalLM");
  j["head_dim"] = 16;
  j["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 64}};
  const Synthetic s = write_synthetic(j, /*with_lm_head=*/true);
  auto m = load_ok(s.dir);
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config;
  EXPECT_EQ(c.arch, Architecture::kQwen3);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(m->layers[0].wq.rows, 64);
  EXPECT_EQ(m->layers[0].wk.rows, 32);
  EXPECT_EQ(m->layers[0].wo.cols, 64);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kYarn);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 64);
  EXPECT_FALSE(c.tie_embeddings);
  expect_common_values(*m, s);
  for (size_t i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".self_attn.";
    EXPECT_EQ(m->layers[i].q_norm, s.values.at(p + "q_norm.weight"));
    EXPECT_EQ(m->layers[i].k_norm, s.values.at(p + "k_norm.weight"));
    EXPECT_TRUE(m->layers[i].bq.empty());
  }
  EXPECT_EQ(to_f32(m->lm_head), s.values.at("lm_head.weight"));
  EXPECT_TRUE(m->validate().is_ok());
}

TEST(LoaderHf, MistralGqa) {
  auto j = base_config("MistralForCausalLM");
  j["num_key_value_heads"] = 1;
  j["sliding_window"] = 4096;
  const Synthetic s = write_synthetic(j, true);
  auto m = load_ok(s.dir);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->config.arch, Architecture::kMistral);
  EXPECT_EQ(m->config.n_kv_heads, 1);
  EXPECT_EQ(m->layers[1].wv.rows, 8);
  expect_common_values(*m, s);
}

TEST(LoaderHf, Llama3WithRopeScalingAndUntiedHead) {
  auto j = base_config("LlamaForCausalLM");
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 128}};
  j["bos_token_id"] = 38;
  j["eos_token_id"] = {39, 37};
  const Synthetic s = write_synthetic(j, true);
  auto m = load_ok(s.dir);
  ASSERT_NE(m, nullptr);
  const ModelConfig& c = m->config;
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 128);
  EXPECT_EQ(c.bos_token_id, 38);
  EXPECT_EQ(c.eos_token_id, 39);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_NE(m->lm_head.data, m->tok_embeddings.data);
  EXPECT_EQ(to_f32(m->lm_head), s.values.at("lm_head.weight"));
  expect_common_values(*m, s);

  // Config says tied: lm_head.weight is ignored, as in transformers.
  auto jt = j;
  jt["tie_word_embeddings"] = true;
  write_file(s.dir + "/config.json", jt.dump());
  auto t = load_ok(s.dir);
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(t->config.tie_embeddings);
  EXPECT_EQ(t->lm_head.data, t->tok_embeddings.data);
}

TEST(LoaderHf, MissingLmHeadMeansTied) {
  const Synthetic s = write_synthetic(base_config("LlamaForCausalLM"), /*with_lm_head=*/false);
  auto m = load_ok(s.dir);
  ASSERT_NE(m, nullptr);
  EXPECT_TRUE(m->config.tie_embeddings);
  EXPECT_EQ(m->lm_head.data, m->tok_embeddings.data);
}

}  // namespace
}  // namespace specontext
