// PyTorch zip checkpoints (core/model/torch_zip.h, core/model/torch_pickle.h): the torch.save fixtures of
// tests/data/torch_eagle3 against their safetensors twins, and every refusal (truncation, bad
// offsets, compressed entries, disallowed globals, strides, overflowing shapes) failing cleanly.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/model/safetensors.h"
#include "core/model/torch_zip.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

std::string fixture(const std::string& name) { return testing::repo_path("tests/data/torch_eagle3/" + name); }

// Bytes in 8-byte-aligned memory, as a memory map would give them.
struct Buffer {
  std::vector<uint64_t> words;
  size_t size = 0;
  explicit Buffer(const std::string& bytes) : words(bytes.size() / 8 + 1), size(bytes.size()) {
    if (size > 0) std::memcpy(words.data(), bytes.data(), size);
  }
  const uint8_t* data() const { return reinterpret_cast<const uint8_t*>(words.data()); }
};

// Parses `bytes`; on success touches every byte of every tensor view while the buffer lives, so
// ASan catches a view outside it.
Status parse_and_touch(const std::string& bytes, bool verify_crc = true) {
  Buffer b(bytes);
  auto r = TorchZipFile::parse(b.data(), b.size, "test.bin", verify_crc);
  if (!r.is_ok()) return r.status();
  for (const SafetensorsTensor& t : (*r)->tensors()) {
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < t.n_bytes(); ++i) sink = sink ^ t.data[i];
  }
  return Status::ok();
}

template <size_t N>
std::string bin(const char (&s)[N]) {  // a literal with its NUL bytes
  return std::string(s, N - 1);
}

// Expects `bytes` to be refused with a message containing `needle`.
void expect_refused(const std::string& bytes, const std::string& needle, bool verify_crc = true) {
  Buffer b(bytes);
  auto r = TorchZipFile::parse(b.data(), b.size, "test.bin", verify_crc);
  ASSERT_FALSE(r.is_ok()) << "accepted; expected an error containing '" << needle << "'";
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
}

// ---- a tiny pickle writer: what torch.save emits for one tensor in an OrderedDict ----
struct Pickle {
  std::string b = std::string("\x80\x02", 2);
  Pickle& op(char c) {
    b += c;
    return *this;
  }
  Pickle& str(const std::string& s) {
    b += 'X';
    for (int k = 0; k < 4; ++k) b += static_cast<char>((s.size() >> (8 * k)) & 0xFF);
    b += s;
    return *this;
  }
  Pickle& integer(int64_t v) {  // LONG1 of 8 bytes
    b += "\x8a\x08";
    for (int k = 0; k < 8; ++k) b += static_cast<char>((static_cast<uint64_t>(v) >> (8 * k)) & 0xFF);
    return *this;
  }
  Pickle& global(const std::string& module, const std::string& name) {
    b += 'c' + module + '\n' + name + '\n';
    return *this;
  }
  Pickle& ints(const std::vector<int64_t>& v) {
    op('(');
    for (int64_t x : v) integer(x);
    return op('t');
  }
};

struct TensorSpec {
  std::string storage_class = "FloatStorage";
  int64_t storage_numel = 12;
  int64_t offset = 0;
  std::vector<int64_t> shape = {3, 4};
  std::vector<int64_t> stride = {4, 1};
  std::string callable_module = "torch._utils";
  std::string callable = "_rebuild_tensor_v2";
};

std::string tensor_pickle(const TensorSpec& s) {
  Pickle p;
  p.global("collections", "OrderedDict").op(')').op('R').op('(');
  p.str("w").global(s.callable_module, s.callable).op('(');
  p.op('(')
      .str("storage")
      .global("torch", s.storage_class)
      .str("0")
      .str("cpu")
      .integer(s.storage_numel)
      .op('t');
  p.op('Q').integer(s.offset).ints(s.shape).ints(s.stride).op('\x89');
  p.global("collections", "OrderedDict").op(')').op('R').op('t').op('R');
  p.op('u').op('.');
  return p.b;
}

// 12 f32 values 0..11 in archive/data/0 unless `storage` is given.
std::string archive(const std::string& pickle, std::string storage = "", bool zip64 = false) {
  if (storage.empty()) {
    for (int i = 0; i < 12; ++i) {
      const float f = static_cast<float>(i);
      storage.append(reinterpret_cast<const char*>(&f), 4);
    }
  }
  return make_stored_zip(
      {{"archive/data.pkl", pickle}, {"archive/data/0", storage}, {"archive/version", "3\n"}}, zip64);
}

TEST(TorchZip, FixturesMatchTheirSafetensorsTwinsByteForByte) {
  for (const char* name : {"eagle3_f32", "eagle3_f16", "eagle3_bf16"}) {
    SCOPED_TRACE(name);
    auto pt = TorchZipFile::open(fixture(std::string(name) + ".bin"));
    ASSERT_TRUE(pt.is_ok()) << pt.status().to_string();
    auto st = SafetensorsFile::open(fixture(std::string(name) + ".safetensors"));
    ASSERT_TRUE(st.is_ok()) << st.status().to_string();
    const auto& a = (*pt)->tensors();
    const auto& b = (*st)->tensors();
    ASSERT_EQ(a.size(), b.size());
    ASSERT_GE(a.size(), 10u);
    for (size_t i = 0; i < a.size(); ++i) {
      SCOPED_TRACE(a[i].name);
      EXPECT_EQ(a[i].name, b[i].name);
      EXPECT_EQ(a[i].dtype_name, b[i].dtype_name);
      EXPECT_EQ(a[i].supported, b[i].supported);
      if (a[i].supported) {
        EXPECT_EQ(a[i].dtype, b[i].dtype);
      }
      EXPECT_EQ(a[i].shape, b[i].shape);
      ASSERT_EQ(a[i].n_bytes(), b[i].n_bytes());
      EXPECT_EQ(std::memcmp(a[i].data, b[i].data, a[i].n_bytes()), 0);
      EXPECT_EQ((*pt)->find(a[i].name), &a[i]);
    }
  }
}

TEST(TorchZip, ViewsOfOneStorageKeepTheirOffsets) {
  // eagle3_f32.bin pickles q/k/v_proj as rows 0-15, 16-23 and 24-31 of one [32, 32] storage.
  auto pt = TorchZipFile::open(fixture("eagle3_f32.bin"));
  ASSERT_TRUE(pt.is_ok()) << pt.status().to_string();
  const SafetensorsTensor* q = (*pt)->find("midlayer.self_attn.q_proj.weight");
  const SafetensorsTensor* k = (*pt)->find("midlayer.self_attn.k_proj.weight");
  const SafetensorsTensor* v = (*pt)->find("midlayer.self_attn.v_proj.weight");
  ASSERT_TRUE(q && k && v);
  EXPECT_EQ(k->begin, q->begin + 16 * 32 * 4);
  EXPECT_EQ(v->begin, q->begin + 24 * 32 * 4);
  EXPECT_EQ(v->end, q->begin + 32 * 32 * 4);
  const SafetensorsTensor* d2t = (*pt)->find("d2t");
  const SafetensorsTensor* t2d = (*pt)->find("t2d");
  ASSERT_TRUE(d2t && t2d);
  EXPECT_EQ(d2t->dtype_name, "I64");
  EXPECT_EQ(t2d->dtype_name, "BOOL");
  EXPECT_FALSE(t2d->supported);
}

TEST(TorchZip, RefusesWhatTorchWritesButThisReaderDoesNot) {
  struct Case {
    const char* file;
    StatusCode code;
    const char* needle;
  };
  for (const Case& c :
       {Case{"strided.bin", StatusCode::kInvalidArgument, "not contiguous"},
        Case{"legacy.bin", StatusCode::kUnimplemented, "legacy (pre-1.6, non-zip)"},
        Case{"deflated.bin", StatusCode::kUnimplemented, "is compressed (method 8)"},
        Case{"evil_global.bin", StatusCode::kInvalidArgument, "disallowed global 'os.system'"}}) {
    SCOPED_TRACE(c.file);
    auto r = TorchZipFile::open(fixture(c.file));
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), c.code) << r.status().to_string();
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().to_string();
    EXPECT_NE(r.status().message().find(c.file), std::string::npos)
        << "names the file: " << r.status().to_string();
  }
}

TEST(TorchZip, EveryTruncationIsRefused) {
  const std::string bytes = testing::read_text_file(fixture("eagle3_f16.bin"));
  ASSERT_GT(bytes.size(), 1000u);
  for (size_t n = 0; n < bytes.size(); ++n) {
    Buffer b(bytes.substr(0, n));
    auto r = TorchZipFile::parse(b.data(), b.size, "cut.bin");
    ASSERT_FALSE(r.is_ok()) << "a prefix of " << n << " bytes parsed";
  }
}

TEST(TorchZip, EveryFlippedByteFailsCleanlyOrStaysInBounds) {
  // Without CRCs a flipped payload byte still parses; whatever parses must view bytes in bounds
  // (parse_and_touch reads every byte under ASan). With CRCs, a flipped payload byte is data loss.
  // Payload bytes are only read, not interpreted: one in 61 of them is enough (ASan is slow).
  const std::string bytes = testing::read_text_file(fixture("eagle3_bf16.bin"));
  auto original = TorchZipFile::open(fixture("eagle3_bf16.bin"));
  ASSERT_TRUE(original.is_ok()) << original.status().to_string();
  std::vector<bool> payload(bytes.size(), false);
  for (const SafetensorsTensor& t : (*original)->tensors()) {
    for (uint64_t i = t.begin; i < t.end; ++i) payload[i] = true;
  }
  size_t parsed = 0, tried = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (payload[i] && i % 61 != 0) continue;
    ++tried;
    std::string m = bytes;
    m[i] = static_cast<char>(m[i] ^ 0x5A);
    if (parse_and_touch(m, /*verify_crc=*/false).is_ok()) ++parsed;
  }
  // Payload, padding, names and unchecked CRC bytes may change; structure bytes may not.
  EXPECT_GT(parsed, 0u);
  EXPECT_LT(parsed, tried);
}

TEST(TorchZip, ACorruptPayloadFailsItsCrc) {
  std::string bytes = testing::read_text_file(fixture("eagle3_f32.bin"));
  auto ok = TorchZipFile::open(fixture("eagle3_f32.bin"));
  ASSERT_TRUE(ok.is_ok());
  const SafetensorsTensor* fc = (*ok)->find("fc.weight");
  bytes[fc->begin + 7] ^= 1;
  Buffer b(bytes);
  auto r = TorchZipFile::parse(b.data(), b.size, "test.bin");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("CRC-32"), std::string::npos) << r.status().to_string();
}

// Offset `field` of the central directory record of entry `name` (or of the ZIP64 end record).
size_t central_field(const std::string& bytes, const std::string& name, size_t field) {
  for (size_t p = bytes.find("PK\x01\x02"); p != std::string::npos; p = bytes.find("PK\x01\x02", p + 1)) {
    if (bytes.compare(p + 46, name.size(), name) == 0) return p + field;
  }
  ADD_FAILURE() << "no central record for " << name;
  return 0;
}

void put_le(std::string* bytes, size_t at, uint64_t v, int n) {
  for (int k = 0; k < n; ++k)
    (*bytes)[at + static_cast<size_t>(k)] = static_cast<char>((v >> (8 * k)) & 0xFF);
}

TEST(TorchZip, OffsetsOutsideTheFileAreRefused) {
  const std::string bytes = testing::read_text_file(fixture("eagle3_f32.bin"));
  {
    std::string m = bytes;  // a local header offset past the central directory
    put_le(&m, central_field(m, "eagle3_f32/data/0", 42), 0x7FFFFFF0, 4);
    expect_refused(m, "local header offset out of range");
  }
  {
    std::string m = bytes;  // a payload size running into the central directory
    put_le(&m, central_field(m, "eagle3_f32/data/0", 20), 0x100000, 4);
    put_le(&m, central_field(m, "eagle3_f32/data/0", 24), 0x100000, 4);
    expect_refused(m, "run past the data");
  }
  {
    std::string m = bytes;  // ZIP64 sizes deferred to an extra field that is not there
    put_le(&m, central_field(m, "eagle3_f32/data/0", 20), 0xFFFFFFFF, 4);
    put_le(&m, central_field(m, "eagle3_f32/data/0", 24), 0xFFFFFFFF, 4);
    expect_refused(m, "run past the data");
  }
  {
    std::string m = bytes;  // the ZIP64 end record's central directory offset
    const size_t end64 = m.rfind("PK\x06\x06");
    ASSERT_NE(end64, std::string::npos);
    put_le(&m, end64 + 48, uint64_t{1} << 62, 8);
    expect_refused(m, "lies outside the file");
  }
  {
    std::string m = bytes;  // an entry count the directory cannot hold
    const size_t end64 = m.rfind("PK\x06\x06");
    put_le(&m, end64 + 24, uint64_t{1} << 40, 8);
    put_le(&m, end64 + 32, uint64_t{1} << 40, 8);
    expect_refused(m, "entries in");
  }
  {
    std::string m = bytes;  // the ZIP64 locator pointing past itself
    const size_t loc = m.rfind("PK\x06\x07");
    ASSERT_NE(loc, std::string::npos);
    put_le(&m, loc + 8, ~uint64_t{0}, 8);
    expect_refused(m, "ZIP64 end record offset");
  }
}

TEST(TorchZip, HandMadeArchiveReadsItsTensor) {
  const Status plain = parse_and_touch(archive(tensor_pickle({})));
  EXPECT_TRUE(plain.is_ok()) << plain.to_string();

  const std::string bytes = archive(tensor_pickle({.offset = 4, .shape = {2, 1, 4}, .stride = {4, 99, 1}}));
  Buffer b(bytes);
  auto f = TorchZipFile::parse(b.data(), b.size, "test.bin");
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  const SafetensorsTensor* w = (*f)->find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 1, 4}));  // a size-1 dim's stride is free, as in torch
  const float* v = reinterpret_cast<const float*>(w->data);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(v[i], static_cast<float>(4 + i));
}

// Past 4 GiB, sizes and offsets move to ZIP64 records (extra field 1 of each central record, and
// the ZIP64 end record): torch's fixtures only have the end record, so this archive has both.
TEST(TorchZip, Zip64ExtraFieldsAreFollowed) {
  const std::string bytes = archive(tensor_pickle({}), "", /*zip64=*/true);
  {
    Buffer b(bytes);
    auto f = TorchZipFile::parse(b.data(), b.size, "test.bin");
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    const SafetensorsTensor* w = (*f)->find("w");
    ASSERT_NE(w, nullptr);
    const float* v = reinterpret_cast<const float*>(w->data);
    for (int i = 0; i < 12; ++i) EXPECT_EQ(v[i], static_cast<float>(i));
  }
  const size_t extra = central_field(bytes, "archive/data/0", 46 + std::string("archive/data/0").size());
  {
    std::string m = bytes;  // an extra field of another id: the 0xFFFFFFFF fields stay unresolved
    put_le(&m, extra, 2, 2);
    expect_refused(m, "local header offset out of range");
  }
  {
    std::string m = bytes;  // field 1 two values long where three are deferred to it
    put_le(&m, extra + 2, 16, 2);
    expect_refused(m, "ZIP64 extra field is too short");
  }
  {
    std::string m = bytes;  // the deferred local header offset pointing past the file
    put_le(&m, extra + 4 + 16, uint64_t{1} << 63, 8);
    expect_refused(m, "local header offset out of range");
  }
}

TEST(TorchZip, TensorViewsOutsideTheirStorageAreRefused) {
  expect_refused(archive(tensor_pickle({.offset = 1})), "run past storage");
  expect_refused(archive(tensor_pickle({.offset = int64_t{1} << 62})), "run past storage");
  expect_refused(archive(tensor_pickle({.shape = {int64_t{1} << 40, int64_t{1} << 40}, .stride = {1, 1}})),
                 "overflows");
  expect_refused(archive(tensor_pickle({.storage_numel = 13})), "holds 48 bytes, not 13 elements");
  expect_refused(archive(tensor_pickle({.storage_numel = int64_t{1} << 62})), "holds 48 bytes");
  expect_refused(archive(tensor_pickle({.stride = {1, 3}})), "strides [1, 3] are not contiguous");
  expect_refused(archive(tensor_pickle({.shape = {3, -4}})), "negative");
  expect_refused(archive(tensor_pickle({.stride = {4}})), "size and stride differ");
  expect_refused(make_stored_zip({{"archive/data.pkl", tensor_pickle({})}}), "'archive/data/0' is missing");
  expect_refused(make_stored_zip({{"archive/data/0", "x"}}), "'archive/data.pkl' is missing");
  expect_refused(make_stored_zip({{"data.pkl", tensor_pickle({})}}), "has no folder");
}

TEST(TorchZip, OnlyAllowListedGlobalsAreNamed) {
  expect_refused(archive(tensor_pickle({.callable_module = "os", .callable = "system"})),
                 "disallowed global 'os.system'");
  expect_refused(archive(tensor_pickle({.callable_module = "builtins", .callable = "eval"})),
                 "disallowed global 'builtins.eval'");
  expect_refused(archive(tensor_pickle({.storage_class = "UntypedStorage"})),
                 "disallowed global 'torch.UntypedStorage'");
  expect_refused(archive(tensor_pickle({.callable_module = "torch", .callable = "FloatStorage"})),
                 "a torch storage class is called");
  // STACK_GLOBAL goes through the same allow-list.
  Pickle p;
  p.str("subprocess").str("call").op('\x93').op('.');
  expect_refused(archive(p.b), "disallowed global 'subprocess.call'");
}

TEST(TorchZip, MalformedPicklesFailCleanly) {
  expect_refused(archive(bin("\x80\x02"
                             "ios\nsystem\n")),
                 "unsupported pickle opcode 0x69");
  expect_refused(archive(bin("\x80\x02}")), "ends without STOP");
  expect_refused(archive(bin("\x80\x02.")), "stack underflow");
  expect_refused(archive(bin("\x80\x02h\x07.")), "memo key 7 was never stored");
  expect_refused(archive(bin("\x80\x02K\x01.")), "does not hold a dict of tensors");
  expect_refused(archive(bin("\x80\x02X\xff\xff\xff\x7f")), "runs past the end");
  expect_refused(archive(bin("\x80\x02\x8a\x09") + std::string(9, '\1')), "more than 64 bits");
  expect_refused(archive(bin("\x80\x02}(K\x01u.")), "odd item count");
  expect_refused(archive(bin("\x80\x02](K\x01K\x02u.")), "SETITEM(S) on a non-dict");
  expect_refused(archive(bin("\x80\x06}.")), "protocol 6");
  expect_refused(archive(bin("\x80\x02(K\x01\x86.")), "stack underflow");  // TUPLE2 across a MARK
  expect_refused(archive(bin("\x80\x02") + std::string(5000, '(') + "}."), "MARKs nested deeper");
  // A dict that holds itself: nothing recurses, so no trouble; not a tensor, so it is skipped.
  const Status cyclic =
      parse_and_touch(archive(bin("\x80\x02}q\x00X\x01\x00\x00\x00"
                                  "ah\x00s.")));
  EXPECT_TRUE(cyclic.is_ok()) << cyclic.to_string();
}

TEST(TorchZip, BigEndianArchivesAreRefused) {
  expect_refused(make_stored_zip({{"archive/data.pkl", tensor_pickle({})},
                                  {"archive/byteorder", "big"},
                                  {"archive/data/0", std::string(48, '\0')}}),
                 "byteorder 'big'");
  const Status little = parse_and_touch(make_stored_zip({{"archive/data.pkl", tensor_pickle({})},
                                                         {"archive/byteorder", "little"},
                                                         {"archive/data/0", std::string(48, '\0')}}));
  EXPECT_TRUE(little.is_ok()) << little.to_string();
}

}  // namespace
}  // namespace specontext
