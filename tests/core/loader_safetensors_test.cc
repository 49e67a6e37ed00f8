// Safetensors parser validation (header length, JSON, dtype, shape, offsets) and the writer.
#include <gtest/gtest.h>

#include <cstring>

#include "core/model/safetensors.h"
#include "tests/core/loader_test_util.h"

namespace specontext {
namespace {

using testing::read_text_file;
using testing::repo_path;
using testing::temp_dir;

// A file image from a header text and a data section.
std::string image(const std::string& header, const std::string& data = "") {
  const uint64_t n = header.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + header + data;
}

Result<std::shared_ptr<SafetensorsFile>> parse(const std::string& bytes) {
  return SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                "test.safetensors");
}

void expect_error(const std::string& bytes, StatusCode code,
                  const std::vector<std::string>& words) {
  auto r = parse(bytes);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find("test.safetensors"), std::string::npos)
      << r.status().to_string();
  for (const auto& w : words) {
    EXPECT_NE(r.status().message().find(w), std::string::npos)
        << "missing '" << w << "' in " << r.status().to_string();
  }
}

TEST(LoaderSafetensors, ParsesStories260K) {
  auto r = SafetensorsFile::open(repo_path("models/stories260K/hf/model.safetensors"));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const SafetensorsFile& f = **r;
  EXPECT_EQ(f.tensors().size(), 1u + 5u * 9u + 1u);  // embeddings, 5 layers, final norm
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const SafetensorsTensor* t = f.find("model.layers.0.self_attn.k_proj.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype_name, "F32");
  EXPECT_TRUE(t->supported);
  EXPECT_EQ(t->dtype, DType::kF32);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(t->numel(), 32 * 64);
  EXPECT_EQ(t->n_bytes(), 32u * 64u * 4u);
  ASSERT_NE(f.map(), nullptr);
  EXPECT_GE(t->data, f.map()->data());
  EXPECT_LE(t->data + t->n_bytes(), f.map()->data() + f.map()->size());
  EXPECT_EQ(f.find("lm_head.weight"), nullptr);
}

TEST(LoaderSafetensors, WriterRoundTrip) {
  const std::vector<float> a = testing::random_floats(6, 1);
  std::vector<uint16_t> h(4), b(3);
  for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_f16(0.25f * static_cast<float>(i));
  for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(-1.5f * static_cast<float>(i));
  const std::vector<int32_t> ints = {1, -2, 3};
  const std::string path = temp_dir("spx-st") + "/rt.safetensors";
  ASSERT_TRUE(write_safetensors(path,
                                {{"a", DType::kF32, {2, 3}, a.data()},
                                 {"h", DType::kF16, {4}, h.data()},
                                 {"b.odd", DType::kBF16, {1, 3}, b.data()},
                                 {"i", DType::kI32, {3}, ints.data()},
                                 {"empty", DType::kF32, {0, 5}, nullptr}},
                                {{"format", "pt"}, {"note", "x"}})
                  .is_ok());
  const std::string bytes = read_text_file(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ((8 + header_len) % 8, 0u) << "data section must start 8-byte aligned";

  auto r = SafetensorsFile::open(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const SafetensorsFile& f = **r;
  EXPECT_EQ(f.metadata().at("note"), "x");
  ASSERT_EQ(f.tensors().size(), 5u);
  const auto* ta = f.find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(ta->data, a.data(), 24), 0);
  const auto* th = f.find("h");
  ASSERT_NE(th, nullptr);
  EXPECT_EQ(th->dtype_name, "F16");
  EXPECT_EQ(std::memcmp(th->data, h.data(), 8), 0);
  const auto* tb = f.find("b.odd");
  ASSERT_NE(tb, nullptr);
  EXPECT_EQ(tb->dtype, DType::kBF16);
  EXPECT_EQ(std::memcmp(tb->data, b.data(), 6), 0);
  const auto* ti = f.find("i");
  ASSERT_NE(ti, nullptr);
  EXPECT_EQ(ti->dtype, DType::kI32);
  EXPECT_EQ(std::memcmp(ti->data, ints.data(), 12), 0);
  EXPECT_EQ(f.find("empty")->numel(), 0);
}

TEST(LoaderSafetensors, WriterRejectsBadInput) {
  const std::string dir = temp_dir("spx-st");
  const float x = 1.0f;
  Status dup = write_safetensors(dir + "/d.safetensors",
                                 {{"a", DType::kF32, {1}, &x}, {"a", DType::kF32, {1}, &x}});
  EXPECT_EQ(dup.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.message().find("\"a\""), std::string::npos);
  Status q8 = write_safetensors(dir + "/q.safetensors", {{"q", DType::kQ8_0, {32}, &x}});
  EXPECT_EQ(q8.code(), StatusCode::kUnimplemented);
  Status null_data = write_safetensors(dir + "/n.safetensors", {{"n", DType::kF32, {4}, nullptr}});
  EXPECT_EQ(null_data.code(), StatusCode::kInvalidArgument);
  Status no_dir = write_safetensors("/nonexistent/dir/x.safetensors", {});
  EXPECT_FALSE(no_dir.is_ok());
}

TEST(LoaderSafetensors, EmptyHeaderObjectIsValid) {
  auto r = parse(image("{}"));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_TRUE((*r)->tensors().empty());
}

TEST(LoaderSafetensors, ShortFileIsDataLoss) {
  expect_error("", StatusCode::kDataLoss, {"truncated"});
  expect_error(std::string("\x05\0\0", 3), StatusCode::kDataLoss, {"truncated"});
}

TEST(LoaderSafetensors, HeaderLengthBeyondFileIsDataLoss) {
  std::string bytes = image("{}");
  const uint64_t huge = 1000;
  std::memcpy(bytes.data(), &huge, 8);
  expect_error(bytes, StatusCode::kDataLoss, {"header length 1000"});
  const uint64_t max = ~uint64_t{0};
  std::memcpy(bytes.data(), &max, 8);
  expect_error(bytes, StatusCode::kDataLoss, {"header length"});
}

TEST(LoaderSafetensors, CorruptHeaderIsInvalidArgument) {
  expect_error(image("not json at all"), StatusCode::kInvalidArgument, {"JSON"});
  expect_error(image("{\"a\": {\"dtype\": \"F32\", "), StatusCode::kInvalidArgument,
               {"invalid JSON"});
  expect_error(image("{\"a\": 3}"), StatusCode::kInvalidArgument, {"\"a\"", "not an object"});
  expect_error(image(std::string(5000, '[')), StatusCode::kInvalidArgument, {"JSON"});
  expect_error(image("{" + std::string(5000, '[') + "}"), StatusCode::kInvalidArgument,
               {"nesting"});
}

TEST(LoaderSafetensors, FieldErrorsNameTheTensorAndField) {
  const std::string data(64, '\0');
  expect_error(image(R"({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}})", data),
               StatusCode::kInvalidArgument, {"\"w\"", "dtype", "F99"});
  expect_error(image(R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", data),
               StatusCode::kInvalidArgument, {"\"w\"", "dtype"});
  expect_error(image(R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", data),
               StatusCode::kInvalidArgument, {"\"w\"", "shape"});
  expect_error(image(R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", data),
               StatusCode::kInvalidArgument, {"\"w\"", "shape"});
  expect_error(image(R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", data),
               StatusCode::kInvalidArgument, {"\"w\"", "shape"});
  expect_error(image(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", data),
               StatusCode::kInvalidArgument, {"\"w\"", "data_offsets"});
  expect_error(image(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", data),
               StatusCode::kInvalidArgument, {"\"w\"", "data_offsets", "begin > end"});
  // Shape disagrees with the byte span.
  expect_error(image(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", data),
               StatusCode::kInvalidArgument, {"\"w\"", "data_offsets", "[3]", "needs 12"});
  // Offsets beyond the data section (a truncated file).
  expect_error(image(R"({"w": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]}})", data),
               StatusCode::kDataLoss, {"\"w\"", "data_offsets", "beyond"});
  expect_error(
      image(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [18446744073709551615, 8]}})",
            data),
      StatusCode::kInvalidArgument, {"\"w\""});
  // Products that overflow int64.
  expect_error(image(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296],
                              "data_offsets": [0, 0]}})",
                     data),
               StatusCode::kInvalidArgument, {"\"w\"", "overflow"});
  expect_error(image(R"({"w": {"dtype": "F64", "shape": [4611686018427387904],
                              "data_offsets": [0, 0]}})",
                     data),
               StatusCode::kInvalidArgument, {"\"w\"", "overflow"});
  expect_error(image(R"({"__metadata__": {"k": 1}})", data), StatusCode::kInvalidArgument,
               {"__metadata__", "\"k\""});
  expect_error(image(R"({"__metadata__": []})", data), StatusCode::kInvalidArgument,
               {"__metadata__"});
}

TEST(LoaderSafetensors, ExoticDtypesParseButAreNotSupported) {
  const std::string data(16, '\0');
  auto r = parse(image(R"({"x": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]},
                          "y": {"dtype": "F64", "shape": [1], "data_offsets": [8, 16]}})",
                       data));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_FALSE((*r)->find("x")->supported);
  EXPECT_EQ((*r)->find("y")->element_size, 8u);
}

TEST(LoaderSafetensors, MisalignedDataSectionStillParses) {
  // Header length 3 mod 8: the payload starts at an odd address.
  const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_NE((8 + header.size()) % 4, 0u);
  const float vals[2] = {1.5f, -2.0f};
  auto bytes = image(header, std::string(reinterpret_cast<const char*>(vals), 8));
  auto r = parse(bytes);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  float got[2];
  std::memcpy(got, (*r)->find("w")->data, 8);
  EXPECT_EQ(got[0], 1.5f);
  EXPECT_EQ(got[1], -2.0f);
}

TEST(LoaderSafetensors, OpenMissingFileIsNotFound) {
  auto r = SafetensorsFile::open("/nonexistent/model.safetensors");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace specontext
