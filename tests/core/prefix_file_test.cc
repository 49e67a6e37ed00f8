// Prefix files (core/engine/prefix_file.h): every field comes back as written, and a truncated, corrupt
// or inconsistent file is a kDataLoss naming the file and the field, never a crash or a snapshot
// that is quietly wrong.
#include "core/engine/prefix_file.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace specontext {
namespace {

constexpr uint64_t kIdentity = 0x0123456789abcdefULL;

// A SpeContext-shaped snapshot of 2 pages of 3 layers, with every array filled.
PrefixFile sample() {
  PrefixFile f;
  f.identity = kIdentity;
  PrefixSnapshot& s = f.snapshot;
  s.tokens = 32;
  s.page_size = 16;
  s.layers = 3;
  s.page_bytes = 40;
  s.kv_dtype = DType::kBF16;
  s.method = SparseMethod::kSpeContext;
  s.kv.resize(3 * 2 * 40);
  for (size_t i = 0; i < s.kv.size(); ++i) s.kv[i] = static_cast<std::byte>(i * 7 + 1);
  s.head_keys = {1.5f, -2.0f, 3.25f, 0.0f};
  s.boundary_fused = {{}, {0.5f, 0.25f, -1.0f}};
  s.quest_min = {{1.0f}, {2.0f}, {}};
  s.quest_max = {{3.0f}, {4.0f}, {}};
  for (int i = 0; i < 32; ++i) f.tokens.push_back(100 + i);
  return f;
}

void expect_equal(const PrefixFile& a, const PrefixFile& b) {
  EXPECT_EQ(a.identity, b.identity);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.snapshot.tokens, b.snapshot.tokens);
  EXPECT_EQ(a.snapshot.page_size, b.snapshot.page_size);
  EXPECT_EQ(a.snapshot.layers, b.snapshot.layers);
  EXPECT_EQ(a.snapshot.page_bytes, b.snapshot.page_bytes);
  EXPECT_EQ(a.snapshot.kv_dtype, b.snapshot.kv_dtype);
  EXPECT_EQ(a.snapshot.method, b.snapshot.method);
  EXPECT_EQ(a.snapshot.kv, b.snapshot.kv);
  EXPECT_EQ(a.snapshot.head_keys, b.snapshot.head_keys);
  EXPECT_EQ(a.snapshot.boundary_fused, b.snapshot.boundary_fused);
  EXPECT_EQ(a.snapshot.quest_min, b.snapshot.quest_min);
  EXPECT_EQ(a.snapshot.quest_max, b.snapshot.quest_max);
}

Status parse(const std::vector<std::byte>& bytes) {
  return parse_prefix_file(bytes, "p.spxprefix").status();
}

// Recomputes the trailing CRC-32, so that a test reaches the field checks behind it.
void reseal(std::vector<std::byte>& bytes) {
  bytes.resize(bytes.size() - 4);
  const auto crc = static_cast<uint32_t>(
      crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
  const auto* p = reinterpret_cast<const std::byte*>(&crc);
  bytes.insert(bytes.end(), p, p + 4);
}

TEST(PrefixFile, EveryFieldComesBackAsWritten) {
  const PrefixFile f = sample();
  const std::vector<std::byte> bytes = encode_prefix_file(f.tokens, f.snapshot, kIdentity);
  auto back = parse_prefix_file(bytes, "p.spxprefix");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  expect_equal(*back, f);

  const std::string path = (std::filesystem::path(::testing::TempDir()) / "roundtrip.spxprefix").string();
  const Status written = write_prefix_file(path, bytes);
  ASSERT_TRUE(written.is_ok()) << written.to_string();
  EXPECT_EQ(std::filesystem::file_size(path), bytes.size());
  EXPECT_FALSE(std::filesystem::exists(path + ".partial"));
  auto read = read_prefix_file(path);
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  expect_equal(*read, f);
  std::filesystem::remove(path);
}

TEST(PrefixFile, ATruncatedFileNamesTheChecksum) {
  const PrefixFile f = sample();
  const std::vector<std::byte> bytes = encode_prefix_file(f.tokens, f.snapshot, kIdentity);
  for (size_t keep : {size_t{0}, size_t{5}, size_t{12}, size_t{20}, bytes.size() / 2, bytes.size() - 1}) {
    SCOPED_TRACE(keep);
    const Status st = parse(std::vector<std::byte>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(keep)));
    EXPECT_EQ(st.code(), StatusCode::kDataLoss);
    EXPECT_NE(st.message().find("p.spxprefix"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(keep < 12 ? "magic" : "crc32"), std::string::npos) << st.message();
  }
}

TEST(PrefixFile, AnyFlippedByteIsCaught) {
  const PrefixFile f = sample();
  const std::vector<std::byte> bytes = encode_prefix_file(f.tokens, f.snapshot, kIdentity);
  for (size_t at = 0; at < bytes.size(); ++at) {
    std::vector<std::byte> bad = bytes;
    bad[at] ^= std::byte{0x10};
    const Status st = parse(bad);
    ASSERT_EQ(st.code(), StatusCode::kDataLoss) << "byte " << at;
    const char* field = at < 8 ? "'magic'" : at < 12 ? "'version'" : "'crc32'";
    ASSERT_NE(st.message().find(field), std::string::npos) << "byte " << at << ": " << st.message();
  }
}

TEST(PrefixFile, InconsistentFieldsAreNamedEvenUnderAValidChecksum) {
  PrefixFile f = sample();
  auto expect_field = [](const PrefixFile& file, std::span<const TokenId> tokens, const char* field) {
    std::vector<std::byte> bytes = encode_prefix_file(tokens, file.snapshot, kIdentity);
    const Status st = parse(bytes);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << field;
    EXPECT_NE(st.message().find(field), std::string::npos) << st.message();
  };
  expect_field(f, std::span<const TokenId>(f.tokens).first(31), "'token_ids'");
  PrefixFile short_kv = f;
  short_kv.snapshot.kv.resize(200);
  expect_field(short_kv, f.tokens, "'kv'");
  PrefixFile no_pages = f;
  no_pages.snapshot.page_size = 64;  // 32 tokens: not one whole page
  expect_field(no_pages, f.tokens, "'kv'");
  PrefixFile dtype = f;
  dtype.snapshot.kv_dtype = static_cast<DType>(200);
  expect_field(dtype, f.tokens, "'kv_dtype'");
  PrefixFile method = f;
  method.snapshot.method = static_cast<SparseMethod>(9);
  expect_field(method, f.tokens, "'method'");
  PrefixFile negative = f;
  negative.snapshot.layers = -3;
  expect_field(negative, f.tokens, "'tokens'");

  // An array length past the end of the file, with the checksum made to match.
  std::vector<std::byte> bytes = encode_prefix_file(f.tokens, f.snapshot, kIdentity);
  const size_t token_count_at = 8 + 4 + 8 + 4 * 8 + 2;
  const uint64_t huge = uint64_t{1} << 60;
  std::memcpy(bytes.data() + token_count_at, &huge, sizeof(huge));
  reseal(bytes);
  const Status st = parse(bytes);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("'token_ids'"), std::string::npos) << st.message();
  // Bytes after the last array.
  bytes = encode_prefix_file(f.tokens, f.snapshot, kIdentity);
  bytes.insert(bytes.end() - 4, std::byte{0});
  reseal(bytes);
  EXPECT_NE(parse(bytes).message().find("'crc32' is not where the contents end"), std::string::npos);
}

TEST(PrefixFile, TheHeaderAloneGivesIdentityAndTokensWithoutReadingTheRest) {
  const PrefixFile f = sample();
  std::vector<std::byte> bytes = encode_prefix_file(f.tokens, f.snapshot, kIdentity);
  const size_t kv_at = 8 + 4 + 8 + 4 * 8 + 2 + 8 + f.tokens.size() * sizeof(TokenId);
  bytes[kv_at + 8 + 3] ^= std::byte{0x40};  // a KV byte: the checksum no longer matches
  auto header = parse_prefix_file(bytes, "p.spxprefix", /*header_only=*/true);
  ASSERT_TRUE(header.is_ok()) << header.status().to_string();
  EXPECT_EQ(header->identity, kIdentity);
  EXPECT_EQ(header->tokens, f.tokens);
  EXPECT_EQ(header->snapshot.tokens, 32);
  EXPECT_TRUE(header->snapshot.kv.empty());
  // The full parse catches what the header parse does not read.
  EXPECT_NE(parse(bytes).message().find("'crc32'"), std::string::npos);
  // A header cut short is still named.
  bytes.resize(kv_at - 5);
  const Status cut = parse_prefix_file(bytes, "p.spxprefix", /*header_only=*/true).status();
  EXPECT_EQ(cut.code(), StatusCode::kDataLoss);
  EXPECT_NE(cut.message().find("'token_ids'"), std::string::npos) << cut.message();
}

TEST(PrefixFile, AFileThatCannotBeWrittenOrIsMissingIsNamed) {
  const PrefixFile f = sample();
  const Status nowhere =
      write_prefix_file("/nonexistent-dir/x.spxprefix", encode_prefix_file(f.tokens, f.snapshot, kIdentity));
  EXPECT_EQ(nowhere.code(), StatusCode::kUnavailable);
  EXPECT_NE(nowhere.message().find("/nonexistent-dir/x.spxprefix"), std::string::npos) << nowhere.message();
  auto missing = read_prefix_file("/nonexistent-dir/x.spxprefix");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace specontext
