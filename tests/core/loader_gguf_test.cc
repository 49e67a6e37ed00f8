// GGUF parsing (metadata types, alignment, bounds checks), ggml block dequantisation (bit-exact
// against gguf-py's decoder: tests/data/ggml_quants_golden.gguf) and loading (llama, qwen2 and
// qwen3 architectures, dims reversed, block types and F16 converted, BF16 in place, Llama 3.1
// rope_freqs), against the bundled files and hand-made ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "core/model/ggml_quants.h"
#include "core/model/gguf.h"
#include "core/model/loader_internal.h"
#include "core/model/model_loader.h"
#include "core/ports/backend.h"
#include "tests/core/loader_test_util.h"

namespace specontext {
namespace {

using testing::GgufBuilder;
using testing::read_text_file;
using testing::repo_path;
using testing::temp_dir;
using testing::write_file;

const std::string kStoriesGguf = "models/stories260K/stories260K.gguf";

Result<std::shared_ptr<GgufFile>> parse(const std::string& bytes) {
  return GgufFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "test.gguf");
}

void expect_error(const std::string& bytes, StatusCode code,
                  const std::vector<std::string>& words) {
  auto r = parse(bytes);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find("test.gguf"), std::string::npos) << r.status().to_string();
  for (const auto& w : words) {
    EXPECT_NE(r.status().message().find(w), std::string::npos)
        << "missing '" << w << "' in " << r.status().to_string();
  }
}

TEST(LoaderGgufParser, ReadsStories260KMetadataAndTensors) {
  auto r = GgufFile::open(repo_path(kStoriesGguf));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const GgufFile& g = **r;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(*g.get_string("general.architecture"), "llama");
  EXPECT_EQ(*g.get_int("llama.block_count"), 5);
  EXPECT_EQ(*g.get_int("llama.embedding_length"), 64);
  EXPECT_NEAR(*g.get_float("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-9);
  EXPECT_EQ(*g.get_float("llama.context_length"), 512.0);  // ints are accepted as floats
  EXPECT_EQ(*g.get_int("tokenizer.ggml.padding_token_id"), 4294967295);
  auto tokens = g.get_string_array("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.is_ok());
  ASSERT_EQ(tokens->size(), 512u);
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ(g.get_float_array("tokenizer.ggml.scores")->size(), 512u);
  EXPECT_EQ((*g.get_int_array("tokenizer.ggml.token_type"))[0], 2);
  EXPECT_EQ(g.tensors().size(), 48u);
  const GgufTensorInfo* t = g.find_tensor("blk.0.attn_k.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dims, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(t->ggml_type, 0u);
  EXPECT_EQ(t->n_elements(), 64 * 32);
  EXPECT_EQ(t->n_bytes, 64u * 32u * 4u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % 32, 0u);
  EXPECT_EQ(g.find_tensor("nope"), nullptr);
}

TEST(LoaderGgufParser, GetterErrorsNameTheKey) {
  auto r = GgufFile::open(repo_path(kStoriesGguf));
  ASSERT_TRUE(r.is_ok());
  const GgufFile& g = **r;
  auto missing = g.get_int("llama.nope");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("\"llama.nope\""), std::string::npos);
  auto wrong = g.get_int("general.architecture");
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("\"general.architecture\""), std::string::npos);
  EXPECT_NE(wrong.status().message().find("string"), std::string::npos);
  EXPECT_FALSE(g.get_string("llama.block_count").is_ok());
  EXPECT_FALSE(g.get_string_array("tokenizer.ggml.scores").is_ok());
  EXPECT_FALSE(g.get_int_array("tokenizer.ggml.tokens").is_ok());
  EXPECT_FALSE(g.get_float("tokenizer.ggml.model").is_ok());
}

TEST(LoaderGgufParser, AllValueTypes) {
  GgufBuilder b;
  b.kv_raw("u8", 0, GgufBuilder::pod(uint8_t{200}));
  b.kv_raw("i8", 1, GgufBuilder::pod(int8_t{-100}));
  b.kv_raw("u16", 2, GgufBuilder::pod(uint16_t{60000}));
  b.kv_raw("i16", 3, GgufBuilder::pod(int16_t{-30000}));
  b.kv_u32("u32", 4000000000u);
  b.kv_i32("i32", -2000000000);
  b.kv_f32("f32", 0.5f);
  b.kv_raw("bool", 7, GgufBuilder::pod(uint8_t{1}));
  b.kv_str("str", "héllo");
  b.kv_raw("u64", 10, GgufBuilder::pod(uint64_t{1} << 40));
  b.kv_raw("i64", 11, GgufBuilder::pod(int64_t{-(int64_t{1} << 40)}));
  b.kv_raw("f64", 12, GgufBuilder::pod(2.25));
  b.kv_raw("big", 10, GgufBuilder::pod(~uint64_t{0}));
  b.kv_raw("arr_i16", 9,
           GgufBuilder::pod(uint32_t{3}) + GgufBuilder::pod(uint64_t{2}) +
               GgufBuilder::pod(int16_t{-1}) + GgufBuilder::pod(int16_t{7}));
  b.kv_raw("arr_f32", 9,
           GgufBuilder::pod(uint32_t{6}) + GgufBuilder::pod(uint64_t{2}) + GgufBuilder::pod(1.0f) +
               GgufBuilder::pod(-3.0f));
  b.kv_raw("arr_empty", 9, GgufBuilder::pod(uint32_t{8}) + GgufBuilder::pod(uint64_t{0}));
  b.kv_str_array("arr_str", {"a", "", "ccc"});
  auto r = parse(b.build());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const GgufFile& g = **r;
  EXPECT_EQ(*g.get_int("u8"), 200);
  EXPECT_EQ(*g.get_int("i8"), -100);
  EXPECT_EQ(*g.get_int("u16"), 60000);
  EXPECT_EQ(*g.get_int("i16"), -30000);
  EXPECT_EQ(*g.get_int("u32"), 4000000000LL);
  EXPECT_EQ(*g.get_int("i32"), -2000000000);
  EXPECT_EQ(*g.get_float("f32"), 0.5);
  EXPECT_EQ(std::get<bool>(g.metadata().at("bool").scalar), true);
  EXPECT_EQ(*g.get_string("str"), "héllo");
  EXPECT_EQ(*g.get_int("u64"), int64_t{1} << 40);
  EXPECT_EQ(*g.get_int("i64"), -(int64_t{1} << 40));
  EXPECT_EQ(*g.get_float("f64"), 2.25);
  EXPECT_EQ(g.get_int("big").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*g.get_int_array("arr_i16"), (std::vector<int64_t>{-1, 7}));
  EXPECT_EQ(*g.get_float_array("arr_f32"), (std::vector<double>{1.0, -3.0}));
  EXPECT_TRUE(g.get_string_array("arr_empty")->empty());
  EXPECT_EQ(*g.get_string_array("arr_str"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_TRUE(g.metadata().at("arr_str").is_array());
  EXPECT_TRUE(g.tensors().empty());
}

TEST(LoaderGgufParser, Version2IsAccepted) {
  GgufBuilder b(2);
  b.kv_str("general.architecture", "llama");
  auto r = parse(b.build());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ((*r)->version(), 2u);
}

TEST(LoaderGgufParser, StructuralErrors) {
  expect_error("", StatusCode::kDataLoss, {"magic"});
  expect_error("GGML\x03\0\0\0", StatusCode::kInvalidArgument, {"magic"});
  expect_error(GgufBuilder(1).build(), StatusCode::kUnimplemented, {"version 1"});
  expect_error(GgufBuilder(0x03000000).build(), StatusCode::kUnimplemented, {"big-endian"});
  {  // counts larger than the file can hold
    std::string bytes = GgufBuilder().build();
    const uint64_t n = uint64_t{1} << 60;
    std::memcpy(bytes.data() + 16, &n, 8);
    expect_error(bytes, StatusCode::kDataLoss, {"metadata count"});
    const uint64_t zero = 0;
    std::memcpy(bytes.data() + 16, &zero, 8);
    std::memcpy(bytes.data() + 8, &n, 8);
    expect_error(bytes, StatusCode::kDataLoss, {"tensor count"});
  }
  {  // a string longer than the file
    GgufBuilder b;
    b.kv_raw("s", 8, GgufBuilder::pod(uint64_t{1} << 62) + "abc");
    expect_error(b.build(), StatusCode::kDataLoss, {"\"s\""});
  }
  {
    GgufBuilder b;
    b.kv_raw("arr", 9, GgufBuilder::pod(uint32_t{9}) + GgufBuilder::pod(uint64_t{1}));
    expect_error(b.build(), StatusCode::kUnimplemented, {"\"arr\"", "nested"});
  }
  {
    GgufBuilder b;
    b.kv_raw("arr", 9, GgufBuilder::pod(uint32_t{4}) + GgufBuilder::pod(uint64_t{1} << 40));
    expect_error(b.build(), StatusCode::kDataLoss, {"\"arr\""});
  }
  {
    GgufBuilder b;
    b.kv_raw("weird", 13, GgufBuilder::pod(uint32_t{0}));
    expect_error(b.build(), StatusCode::kInvalidArgument, {"\"weird\"", "type 13"});
  }
  {
    GgufBuilder b;
    b.kv_u32("k", 1);
    b.kv_u32("k", 2);
    expect_error(b.build(), StatusCode::kInvalidArgument, {"duplicate", "\"k\""});
  }
  {
    GgufBuilder b;
    b.kv_u32("general.alignment", 48);
    expect_error(b.build(), StatusCode::kInvalidArgument, {"general.alignment"});
  }
}

TEST(LoaderGgufParser, TensorInfoErrorsNameTheTensor) {
  const std::string data(128, '\1');
  {
    GgufBuilder b;
    b.tensor("w", {8, 4}, 0, data);
    b.tensor("w", {8}, 0, data);
    expect_error(b.build(), StatusCode::kInvalidArgument, {"duplicate", "\"w\""});
  }
  {
    GgufBuilder b;
    b.tensor("w", {8, 8}, 0, data.substr(0, 100));  // needs 256 bytes
    expect_error(b.build(), StatusCode::kDataLoss, {"truncated", "\"w\""});
  }
  {
    GgufBuilder b;
    b.tensor("w", {8}, 0, data, /*offset=*/int64_t{1} << 50);
    expect_error(b.build(), StatusCode::kDataLoss, {"\"w\""});
  }
  {
    GgufBuilder b;
    b.tensor("w", {8}, 0, data, /*offset=*/4);
    expect_error(b.build(), StatusCode::kInvalidArgument, {"\"w\"", "alignment"});
  }
  {
    GgufBuilder b;
    b.tensor("w", {8}, 77, data);
    expect_error(b.build(), StatusCode::kInvalidArgument, {"\"w\"", "ggml type 77"});
  }
  {
    GgufBuilder b;
    b.tensor("w", {16}, 8, data);  // Q8_0 needs a multiple of 32 elements per row
    expect_error(b.build(), StatusCode::kInvalidArgument, {"\"w\"", "block size"});
  }
  {
    GgufBuilder b;
    b.tensor("w", {}, 0, data);
    expect_error(b.build(), StatusCode::kInvalidArgument, {"\"w\"", "dimensions"});
  }
  {
    GgufBuilder b;
    b.tensor("w", {1, 1, 1, 1, 1}, 0, data);
    expect_error(b.build(), StatusCode::kInvalidArgument, {"\"w\"", "dimensions"});
  }
  {
    GgufBuilder b;
    b.tensor("w", {uint64_t{1} << 40, uint64_t{1} << 40}, 0, data);
    expect_error(b.build(), StatusCode::kInvalidArgument, {"\"w\"", "overflow"});
  }
}

TEST(LoaderGgufParser, HonoursGeneralAlignment) {
  GgufBuilder b;
  b.set_alignment(64);
  b.kv_u32("general.alignment", 64);
  const std::vector<float> x = {1, 2, 3};
  const std::vector<float> y = {4, 5};
  b.tensor("x", {3}, 0, GgufBuilder::f32_bytes(x));
  b.tensor("y", {2}, 0, GgufBuilder::f32_bytes(y));
  const std::string bytes = b.build();
  auto r = parse(bytes);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const GgufTensorInfo* ty = (*r)->find_tensor("y");
  ASSERT_NE(ty, nullptr);
  EXPECT_EQ(ty->offset, 64u);
  EXPECT_EQ((ty->data - reinterpret_cast<const uint8_t*>(bytes.data())) % 64, 0);
  float got[2];
  std::memcpy(got, ty->data, 8);
  EXPECT_EQ(got[0], 4.0f);
  EXPECT_EQ(got[1], 5.0f);
}

TEST(LoaderGgufParser, Q8_0BlockDequantisation) {
  // One hand-made block: scale 0.5 (f16 0x3800), quants -16..15.
  std::string block = GgufBuilder::pod(uint16_t{0x3800});
  for (int j = 0; j < 32; ++j) block.push_back(static_cast<char>(j - 16));
  ASSERT_EQ(block.size(), 34u);
  GgufBuilder b;
  b.tensor("q", {32}, 8, block);
  const std::string bytes = b.build();
  auto r = parse(bytes);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const GgufTensorInfo* t = (*r)->find_tensor("q");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->n_bytes, 34u);
  float out[32];
  convert_to_f32(DType::kQ8_0, t->data, out, 32);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(out[j], 0.5f * static_cast<float>(j - 16)) << j;
}

// Every decodable block type against gguf-py's numpy decoder (llama.cpp gguf-py/gguf/quants.py):
// random blocks with scales of both signs, zero, subnormal and large, decoded bit for bit.
TEST(GgmlQuants, EveryBlockTypeMatchesGgufPyBitForBit) {
  auto r = GgufFile::open(repo_path("tests/data/ggml_quants_golden.gguf"));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const GgufFile& g = **r;
  const std::vector<std::pair<std::string, uint32_t>> types = {
      {"q4_0", 2}, {"q4_1", 3}, {"q5_0", 6},  {"q5_1", 7},  {"q8_0", 8},    {"q2_k", 10},
      {"q3_k", 11}, {"q4_k", 12}, {"q5_k", 13}, {"q6_k", 14}, {"iq4_nl", 20}, {"iq4_xs", 23}};
  for (const auto& [name, id] : types) {
    SCOPED_TRACE(name);
    const GgufTensorInfo* blocks = g.find_tensor(name + ".blocks");
    const GgufTensorInfo* expected = g.find_tensor(name + ".expected");
    ASSERT_NE(blocks, nullptr);
    ASSERT_NE(expected, nullptr);
    ASSERT_EQ(blocks->ggml_type, id);
    ASSERT_TRUE(ggml_is_dequantizable(id));
    const int64_t n = blocks->n_elements();
    ASSERT_EQ(n, expected->n_elements());
    ASSERT_GE(n / ggml_type_info(id)->block, 8);
    // A guard after the output catches a decoder that writes past its blocks.
    std::vector<float> got(static_cast<size_t>(n) + 16, -12345.0f);
    ASSERT_TRUE(ggml_dequantize(id, blocks->data, got.data(), n).is_ok());
    std::vector<float> want(static_cast<size_t>(n));
    std::memcpy(want.data(), expected->data, want.size() * 4);
    int64_t mismatches = 0, nonzero = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float a = got[static_cast<size_t>(i)], b = want[static_cast<size_t>(i)];
      ASSERT_TRUE(std::isfinite(a)) << i;
      nonzero += a != 0.0f;
      uint32_t ab = 0, bb = 0;
      std::memcpy(&ab, &a, 4);
      std::memcpy(&bb, &b, 4);
      if (ab != bb && mismatches++ < 5) ADD_FAILURE() << "element " << i << ": " << a << " vs " << b;
    }
    EXPECT_EQ(mismatches, 0);
    EXPECT_GT(nonzero, n / 2);
    for (size_t i = static_cast<size_t>(n); i < got.size(); ++i) ASSERT_EQ(got[i], -12345.0f);
  }
}

TEST(GgmlQuants, HandMadeBlocksDecodeToKnownValues) {
  // Q4_0: d = 0.5, codes 0..15 then 15..0: (code - 8) * d.
  std::string q4 = GgufBuilder::pod(uint16_t{0x3800});
  for (int j = 0; j < 16; ++j) q4.push_back(static_cast<char>(j | ((15 - j) << 4)));
  float y[256];
  ASSERT_TRUE(ggml_dequantize(2, q4.data(), y, 32).is_ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.5f * static_cast<float>(j - 8)) << j;
    EXPECT_EQ(y[j + 16], 0.5f * static_cast<float>(7 - j)) << j;
  }
  // Q6_K: every code 33 (low nibble 1, high bits 2), every scale 3, d = 0.25: 0.25 * 3 * 1.
  std::string q6(210, '\0');
  for (int i = 0; i < 128; ++i) q6[i] = 0x11;
  for (int i = 128; i < 192; ++i) q6[i] = static_cast<char>(0xAA);
  for (int i = 192; i < 208; ++i) q6[i] = 3;
  const uint16_t quarter = 0x3400;
  std::memcpy(q6.data() + 208, &quarter, 2);
  ASSERT_TRUE(ggml_dequantize(14, q6.data(), y, 256).is_ok());
  for (int i = 0; i < 256; ++i) ASSERT_EQ(y[i], 0.75f) << i;
}

TEST(GgmlQuants, RefusesOtherTypesAndPartialBlocks) {
  float y[64];
  const std::string zeros(256, '\0');
  for (uint32_t id : {0u, 1u, 9u, 15u, 16u, 30u, 99u}) {
    EXPECT_FALSE(ggml_is_dequantizable(id)) << id;
    const Status s = ggml_dequantize(id, zeros.data(), y, 32);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << id;
    EXPECT_NE(s.message().find("Q4_K"), std::string::npos) << s.to_string();  // lists what works
  }
  const Status partial = ggml_dequantize(2, zeros.data(), y, 48);
  EXPECT_EQ(partial.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(partial.message().find("Q4_0"), std::string::npos) << partial.to_string();
  ASSERT_NE(ggml_type_info(12), nullptr);
  EXPECT_EQ(ggml_type_info(12)->name, "Q4_K");
  EXPECT_EQ(ggml_type_info(12)->bytes, 144);
  EXPECT_EQ(ggml_type_info(99), nullptr);
}

TEST(LoaderGguf, LoadsStories260K) {
  auto r = load_gguf_model(repo_path(kStoriesGguf));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const Model& m = **r;
  const ModelConfig& c = m.config;
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
  EXPECT_EQ(c.rope_style, RopeStyle::kInterleaved);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_FALSE(c.tie_embeddings);  // this conversion wrote output.weight
  EXPECT_EQ(m.format, "gguf");
  EXPECT_EQ(m.weight_dtype, DType::kF32);
  EXPECT_TRUE(m.validate().is_ok());
}

TEST(LoaderGguf, AgreesWithLlama2cCheckpoints) {
  for (const auto& [bin, gguf] :
       {std::pair<std::string, std::string>{"models/stories260K/stories260K.bin", kStoriesGguf},
        {"models/babyllama105/model5000.bin", "models/babyllama105/babyllama105.gguf"}}) {
    auto a = load_llama2c_model(repo_path(bin));
    auto b = load_gguf_model(repo_path(gguf));
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    ASSERT_TRUE(b.is_ok()) << b.status().to_string();
    const ModelConfig& ca = (*a)->config;
    const ModelConfig& cb = (*b)->config;
    EXPECT_EQ(ca.dim, cb.dim);
    EXPECT_EQ(ca.hidden_dim, cb.hidden_dim);
    EXPECT_EQ(ca.n_layers, cb.n_layers);
    EXPECT_EQ(ca.n_heads, cb.n_heads);
    EXPECT_EQ(ca.n_kv_heads, cb.n_kv_heads);
    EXPECT_EQ(ca.vocab_size, cb.vocab_size);
    EXPECT_EQ(ca.max_seq_len, cb.max_seq_len);
    EXPECT_EQ(ca.rope_style, cb.rope_style);
    // Same RoPE layout, so every tensor (q/k included) is identical.
    testing::expect_same_weights(**a, **b);
  }
}

TEST(LoaderGguf, TruncatedFileIsDataLossNamingTheFile) {
  const std::string bytes = read_text_file(repo_path(kStoriesGguf));
  const std::string dir = temp_dir("spx-gguf");
  for (size_t n : {bytes.size() - 1, bytes.size() / 2, size_t{3000}, size_t{20}}) {
    const std::string path = dir + "/cut.gguf";
    write_file(path, bytes.substr(0, n));
    auto r = load_gguf_model(path);
    ASSERT_FALSE(r.is_ok()) << n;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
    EXPECT_NE(r.status().message().find("cut.gguf"), std::string::npos) << r.status().to_string();
  }
}

// A tiny GGUF: 1 layer, vocab 32; by default dim 32, hidden 64, 2 heads, 1 kv head (head_dim 16).
struct TinyGguf {
  std::map<std::string, std::vector<float>> f32;  // expected values (after conversion)
  std::string bytes;
};

struct TinyShape {
  uint64_t dim = 32, hidden = 64, heads = 2, kv_heads = 1;
};

std::string q8_0_encode(const std::vector<float>& v, std::vector<float>* decoded) {
  std::string out;
  for (size_t b = 0; b < v.size() / 32; ++b) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[b * 32 + j]));
    const uint16_t d16 = f32_to_f16(amax / 127.0f);
    const float d = f16_to_f32(d16);
    out += GgufBuilder::pod(d16);
    for (int j = 0; j < 32; ++j) {
      const int q = d == 0 ? 0 : static_cast<int>(std::lround(v[b * 32 + j] / d));
      const int8_t qc = static_cast<int8_t>(std::clamp(q, -127, 127));
      out.push_back(static_cast<char>(qc));
      decoded->push_back(d * qc);
    }
  }
  return out;
}

// Random blocks of ggml block type `type` whose f16 scales are small and finite (random bytes
// elsewhere are valid codes), decoded into `decoded` by ggml_dequantize (itself checked against
// gguf-py above): what the loader must place at each row and column.
std::string random_blocks(uint32_t type, size_t n, uint32_t seed, std::vector<float>* decoded) {
  static const std::map<uint32_t, std::vector<size_t>> kScaleOffsets = {
      {2, {0}},   {3, {0, 2}},  {6, {0}},     {7, {0, 2}},   {10, {80, 82}}, {11, {108}},
      {12, {0, 2}}, {13, {0, 2}}, {14, {208}}, {20, {0}}, {23, {0}}};
  const GgmlTypeInfo* info = ggml_type_info(type);
  std::mt19937 rng(seed);
  std::string out(n / static_cast<size_t>(info->block) * static_cast<size_t>(info->bytes), '\0');
  for (auto& c : out) c = static_cast<char>(rng() & 0xFF);
  for (size_t b = 0; b < n / static_cast<size_t>(info->block); ++b) {
    for (size_t off : kScaleOffsets.at(type)) {
      const float scale = (static_cast<float>(rng() % 1000) + 1.0f) * 2e-6f * ((rng() & 1) ? 1.0f : -1.0f);
      const uint16_t h = f32_to_f16(scale);
      std::memcpy(out.data() + b * static_cast<size_t>(info->bytes) + off, &h, 2);
    }
  }
  decoded->resize(n);
  EXPECT_TRUE(ggml_dequantize(type, out.data(), decoded->data(), static_cast<int64_t>(n)).is_ok());
  return out;
}

// `type`: the ggml type of the matrices (F32, F16, BF16 or a block type); norms always F32.
// `extra` adds keys or tensors before the file is built.
TinyGguf make_tiny_gguf(uint32_t type, bool with_output, TinyShape shape = {},
                        const std::function<void(GgufBuilder&)>& extra = {}) {
  TinyGguf t;
  GgufBuilder b;
  const uint64_t head_dim = shape.dim / shape.heads;
  b.kv_str("general.architecture", "llama");
  b.kv_u32("llama.embedding_length", static_cast<uint32_t>(shape.dim));
  b.kv_u32("llama.feed_forward_length", static_cast<uint32_t>(shape.hidden));
  b.kv_u32("llama.block_count", 1);
  b.kv_u32("llama.attention.head_count", static_cast<uint32_t>(shape.heads));
  b.kv_u32("llama.attention.head_count_kv", static_cast<uint32_t>(shape.kv_heads));
  b.kv_u32("llama.context_length", 128);
  b.kv_f32("llama.rope.freq_base", 500000.0f);
  b.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-6f);
  b.kv_u32("llama.rope.dimension_count", static_cast<uint32_t>(head_dim));
  b.kv_u32("tokenizer.ggml.bos_token_id", 5);
  b.kv_u32("tokenizer.ggml.eos_token_id", 6);
  uint32_t seed = 1;
  auto add_matrix = [&](const std::string& name, uint64_t rows, uint64_t cols) {
    const auto v = testing::random_floats(rows * cols, seed++);
    std::vector<float> expect;
    std::string data;
    if (type == 0) {
      data = GgufBuilder::f32_bytes(v);
      expect = v;
    } else if (type == 1 || type == 30) {
      for (float x : v) {
        const uint16_t h = type == 1 ? f32_to_f16(x) : f32_to_bf16(x);
        data += GgufBuilder::pod(h);
        expect.push_back(type == 1 ? f16_to_f32(h) : bf16_to_f32(h));
      }
    } else if (type == 8) {
      data = q8_0_encode(v, &expect);
    } else {
      data = random_blocks(type, v.size(), seed * 7919u, &expect);
    }
    b.tensor(name, {cols, rows}, type, data);
    t.f32[name] = expect;
  };
  auto add_vec = [&](const std::string& name, uint64_t n) {
    const auto v = testing::random_floats(n, seed++, 1.0f);
    b.tensor(name, {n}, 0, GgufBuilder::f32_bytes(v));
    t.f32[name] = v;
  };
  const uint64_t kv_dim = shape.kv_heads * head_dim;
  add_matrix("token_embd.weight", 32, shape.dim);
  add_vec("blk.0.attn_norm.weight", shape.dim);
  add_matrix("blk.0.attn_q.weight", shape.dim, shape.dim);
  add_matrix("blk.0.attn_k.weight", kv_dim, shape.dim);
  add_matrix("blk.0.attn_v.weight", kv_dim, shape.dim);
  add_matrix("blk.0.attn_output.weight", shape.dim, shape.dim);
  add_vec("blk.0.ffn_norm.weight", shape.dim);
  add_matrix("blk.0.ffn_gate.weight", shape.hidden, shape.dim);
  add_matrix("blk.0.ffn_up.weight", shape.hidden, shape.dim);
  add_matrix("blk.0.ffn_down.weight", shape.dim, shape.hidden);
  add_vec("output_norm.weight", shape.dim);
  if (with_output) add_matrix("output.weight", 32, shape.dim);
  if (extra) extra(b);
  t.bytes = b.build();
  return t;
}

void expect_tiny_values(const Model& m, const TinyGguf& t) {
  EXPECT_EQ(testing::to_f32(m.tok_embeddings), t.f32.at("token_embd.weight"));
  EXPECT_EQ(testing::to_f32(m.layers[0].wq), t.f32.at("blk.0.attn_q.weight"));
  EXPECT_EQ(testing::to_f32(m.layers[0].wk), t.f32.at("blk.0.attn_k.weight"));
  EXPECT_EQ(testing::to_f32(m.layers[0].wv), t.f32.at("blk.0.attn_v.weight"));
  EXPECT_EQ(testing::to_f32(m.layers[0].wo), t.f32.at("blk.0.attn_output.weight"));
  EXPECT_EQ(testing::to_f32(m.layers[0].w_gate), t.f32.at("blk.0.ffn_gate.weight"));
  EXPECT_EQ(testing::to_f32(m.layers[0].w_up), t.f32.at("blk.0.ffn_up.weight"));
  EXPECT_EQ(testing::to_f32(m.layers[0].w_down), t.f32.at("blk.0.ffn_down.weight"));
  EXPECT_EQ(m.layers[0].attn_norm, t.f32.at("blk.0.attn_norm.weight"));
  EXPECT_EQ(m.layers[0].ffn_norm, t.f32.at("blk.0.ffn_norm.weight"));
  EXPECT_EQ(m.final_norm, t.f32.at("output_norm.weight"));
}

TEST(LoaderGguf, HandMadeModelsInEveryMatrixType) {
  const std::string dir = temp_dir("spx-gguf");
  // Block types of 32 fit the default shape; k-quants (super-blocks of 256) need 256 columns.
  const TinyShape wide{256, 256, 2, 1};
  const std::vector<std::pair<uint32_t, TinyShape>> cases = {
      {0, {}},  {1, {}},  {8, {}},  {30, {}},   {2, {}},    {3, {}},    {6, {}},   {7, {}},
      {20, {}}, {10, wide}, {11, wide}, {12, wide}, {13, wide}, {14, wide}, {23, wide}};
  for (const auto& [type, shape] : cases) {
    SCOPED_TRACE("ggml type " + std::string(ggml_type_info(type)->name));
    const TinyGguf t = make_tiny_gguf(type, /*with_output=*/true, shape);
    const std::string path = dir + "/tiny" + std::to_string(type) + ".gguf";
    write_file(path, t.bytes);
    auto r = load_gguf_model(path);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    const Model& m = **r;
    EXPECT_EQ(m.config.head_dim, static_cast<int64_t>(shape.dim / shape.heads));
    EXPECT_EQ(m.config.kv_dim(), static_cast<int64_t>(shape.dim / shape.heads));
    EXPECT_EQ(m.config.bos_token_id, 5);
    EXPECT_EQ(m.config.eos_token_id, 6);
    EXPECT_DOUBLE_EQ(m.config.rope_theta, 500000.0);
    EXPECT_FLOAT_EQ(m.config.norm_eps, 1e-6f);
    EXPECT_FALSE(m.config.tie_embeddings);
    EXPECT_EQ(m.weight_dtype, type == 30 ? DType::kBF16 : DType::kF32);
    EXPECT_EQ(m.layers[0].wq.dtype, m.weight_dtype);
    // Nine matrices, all stored in `type`.
    const std::map<std::string, int64_t> stored = {{std::string(ggml_type_info(type)->name), 9}};
    EXPECT_EQ(m.stored_types, stored);
    expect_tiny_values(m, t);
    EXPECT_EQ(testing::to_f32(m.lm_head), t.f32.at("output.weight"));
    EXPECT_TRUE(m.validate().is_ok());
  }
}

// --dtype bf16: every matrix held in bf16, each element the bf16 rounding of what the f32 load
// gives (block types dequantised, f16 and f32 converted).
TEST(LoaderGguf, ForceBf16HoldsEveryMatrixInBf16) {
  const std::string dir = temp_dir("spx-gguf");
  const TinyShape wide{256, 256, 2, 1};
  for (const auto& [type, shape] : std::vector<std::pair<uint32_t, TinyShape>>{{0, {}}, {1, {}}, {2, {}}, {12, wide}, {14, wide}}) {
    SCOPED_TRACE("ggml type " + std::string(ggml_type_info(type)->name));
    const TinyGguf t = make_tiny_gguf(type, /*with_output=*/true, shape);
    const std::string path = dir + "/bf16_" + std::to_string(type) + ".gguf";
    write_file(path, t.bytes);
    auto r = load_gguf_model(path, LoadOptions{.force_bf16 = true});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    const Model& m = **r;
    EXPECT_EQ(m.weight_dtype, DType::kBF16);
    for (const auto& [name, matrix] : std::vector<std::pair<std::string, const WeightMatrix*>>{
             {"blk.0.attn_q.weight", &m.layers[0].wq}, {"blk.0.ffn_down.weight", &m.layers[0].w_down},
             {"output.weight", &m.lm_head}, {"token_embd.weight", &m.tok_embeddings}}) {
      ASSERT_EQ(matrix->dtype, DType::kBF16) << name;
      std::vector<float> want = t.f32.at(name);
      for (float& x : want) x = bf16_to_f32(f32_to_bf16(x));
      EXPECT_EQ(testing::to_f32(*matrix), want) << name;
    }
  }
  auto both = load_gguf_model(dir + "/bf16_0.gguf", LoadOptions{.force_f32 = true, .force_bf16 = true});
  EXPECT_EQ(both.status().code(), StatusCode::kInvalidArgument) << both.status().to_string();
}

// Matrices of many megabytes are converted into huge-page-advised mappings (aligned to 2 MiB) and
// hold the same values as small ones; the storage keeps them alive.
TEST(LoaderGguf, LargeConvertedMatricesAreWholeAndHugePageAligned) {
  const int64_t rows = 4096, cols = 1024;  // 16 MiB of f32
  std::vector<float> expect;
  const std::string blocks = random_blocks(12, static_cast<size_t>(rows * cols), 99, &expect);
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f32");
    Model model;
    auto m = loader_internal::make_dequantized_matrix(&model, 12, blocks.data(), rows, cols,
                                                      LoadOptions{.force_bf16 = bf16}, "big");
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(m->data) % (uintptr_t{2} << 20), 0u);
    ASSERT_EQ(model.storage.size(), 1u);
    std::vector<float> want = expect;
    if (bf16) {
      for (float& x : want) x = bf16_to_f32(f32_to_bf16(x));
    }
    EXPECT_EQ(testing::to_f32(*m), want);
  }
}

TEST(LoaderGguf, BlockTypesWithoutADecoderAreNamed) {
  const std::string dir = temp_dir("spx-gguf");
  // IQ2_XXS parses (its size is in ggml's table) but is not decoded: the error names the
  // tensor, the type and what is supported.
  std::string bytes = make_tiny_gguf(0, false, TinyShape{256, 256, 2, 1}).bytes;
  // Rewrite the q matrix's type field (the u32 after its name, dim count and two dims) to
  // IQ2_XXS (16); its data shrinks, which the parser accepts.
  const std::string name = "blk.0.attn_q.weight";
  const size_t pos = bytes.find(name);
  ASSERT_NE(pos, std::string::npos);
  const size_t type_at = pos + name.size() + 4 + 2 * 8;
  const uint32_t iq2 = 16;
  std::memcpy(bytes.data() + type_at, &iq2, 4);
  write_file(dir + "/iq2.gguf", bytes);
  auto m = load_gguf_model(dir + "/iq2.gguf");
  ASSERT_FALSE(m.is_ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnimplemented) << m.status().to_string();
  for (const char* word : {"\"blk.0.attn_q.weight\"", "IQ2_XXS", "Q4_K", "iq2.gguf"}) {
    EXPECT_NE(m.status().message().find(word), std::string::npos) << word << ": " << m.status().to_string();
  }
}

// Llama 3.1+ conversions carry their llama3 RoPE scaling as rope_freqs.weight: per-frequency
// divisors that make_rope_params applies (ggml_rope_ext's freq_factors).
TEST(LoaderGguf, RopeFreqsDivideTheFrequenciesAndBadOnesAreNamed) {
  const std::string dir = temp_dir("spx-gguf");
  const std::vector<float> factors = {1.0f, 1.0f, 1.5f, 2.0f, 3.25f, 8.0f, 8.0f, 8.0f};  // head_dim 16
  auto with = [&](const std::vector<uint64_t>& dims, const std::vector<float>& values) {
    return make_tiny_gguf(0, false, {}, [&](GgufBuilder& b) {
      b.tensor("rope_freqs.weight", dims, 0, GgufBuilder::f32_bytes(values));
    });
  };
  write_file(dir + "/freqs.gguf", with({8}, factors).bytes);
  auto r = load_gguf_model(dir + "/freqs.gguf");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ((*r)->config.rope_freq_factors, factors);
  const RopeParams p = make_rope_params((*r)->config);
  ASSERT_EQ(p.inv_freq.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    const double plain = 1.0 / std::pow(500000.0, 2.0 * static_cast<double>(i) / 16.0);
    EXPECT_NEAR(p.inv_freq[i], plain / factors[i], 1e-7 * plain) << i;
  }
  write_file(dir + "/short.gguf", with({4}, {1, 2, 3, 4}).bytes);
  auto bad_dims = load_gguf_model(dir + "/short.gguf");
  EXPECT_EQ(bad_dims.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_dims.status().message().find("rope_freqs.weight"), std::string::npos)
      << bad_dims.status().to_string();
  write_file(dir + "/zero.gguf", with({8}, {1, 1, 0, 1, 1, 1, 1, 1}).bytes);
  auto zero = load_gguf_model(dir + "/zero.gguf");
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("rope_freq_factors[2]"), std::string::npos)
      << zero.status().to_string();
  EXPECT_NE(zero.status().message().find("zero.gguf"), std::string::npos) << zero.status().to_string();
}

TEST(LoaderGguf, Bf16ForceF32Converts) {
  const TinyGguf t = make_tiny_gguf(30, false);
  const std::string path = temp_dir("spx-gguf") + "/bf16.gguf";
  write_file(path, t.bytes);
  auto r = load_gguf_model(path, LoadOptions{.force_f32 = true});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ((*r)->weight_dtype, DType::kF32);
  EXPECT_EQ((*r)->layers[0].w_up.dtype, DType::kF32);
  expect_tiny_values(**r, t);
}

TEST(LoaderGguf, MissingOutputMeansTied) {
  const TinyGguf t = make_tiny_gguf(0, false);
  const std::string path = temp_dir("spx-gguf") + "/tied.gguf";
  write_file(path, t.bytes);
  auto r = load_gguf_model(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_TRUE((*r)->config.tie_embeddings);
  EXPECT_EQ((*r)->lm_head.data, (*r)->tok_embeddings.data);
}

TEST(LoaderGguf, ErrorsNameTheKeyOrTensor) {
  const std::string dir = temp_dir("spx-gguf");
  auto load_bytes = [&](const std::string& bytes) {
    write_file(dir + "/m.gguf", bytes);
    return load_gguf_model(dir + "/m.gguf");
  };
  {
    GgufBuilder b;
    b.kv_str("general.architecture", "gpt2");
    auto r = load_bytes(b.build());
    EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(r.status().message().find("general.architecture"), std::string::npos);
    EXPECT_NE(r.status().message().find("gpt2"), std::string::npos);
  }
  {
    GgufBuilder b;
    b.kv_str("general.architecture", "llama");
    auto r = load_bytes(b.build());
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
    EXPECT_NE(r.status().message().find("llama.embedding_length"), std::string::npos);
  }
  {  // a missing tensor
    std::string bytes = make_tiny_gguf(0, false).bytes;
    const std::string name = "blk.0.ffn_up.weight";
    auto pos = bytes.find(name);
    ASSERT_NE(pos, std::string::npos);
    bytes[pos + 8] = 'X';  // "blk.0.ffX_up.weight"
    auto r = load_bytes(bytes);
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
    EXPECT_NE(r.status().message().find("\"blk.0.ffn_up.weight\""), std::string::npos)
        << r.status().to_string();
    EXPECT_NE(r.status().message().find("m.gguf"), std::string::npos);
  }
  {  // qwen3 files need per-head q/k norms
    std::string bytes = make_tiny_gguf(0, false).bytes;
    // Same length keeps every offset: "llama" -> "qwen3" in the value and in every key prefix.
    for (size_t at = bytes.find("llama"); at != std::string::npos && at < bytes.find("tokenizer.");
         at = bytes.find("llama", at + 5)) {
      bytes.replace(at, 5, "qwen3");
    }
    auto r = load_bytes(bytes);
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().to_string();
    EXPECT_NE(r.status().message().find("\"blk.0.attn_q_norm.weight\""), std::string::npos)
        << r.status().to_string();
  }
  {  // wrong dims: claim 2 kv heads, so attn_k should be [32, 32]
    std::string bytes = make_tiny_gguf(0, false).bytes;
    const std::string key = "llama.attention.head_count_kv";
    auto pos = bytes.find(key);
    ASSERT_NE(pos, std::string::npos);
    const uint32_t two = 2;
    std::memcpy(bytes.data() + pos + key.size() + 4, &two, 4);
    auto r = load_bytes(bytes);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("\"blk.0.attn_k.weight\""), std::string::npos)
        << r.status().to_string();
    EXPECT_NE(r.status().message().find("expected dims [32, 32]"), std::string::npos)
        << r.status().to_string();
  }
}

}  // namespace
}  // namespace specontext
