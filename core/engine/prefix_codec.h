// The byte-level pieces shared by the two encodings of prefix KV: whole prefix files
// (prefix_file.cc, SPXPREF1) and chunks for the shared store (prefix_chunk.cc, SPXCHNK1). Host
// byte order, length-prefixed arrays, a CRC-32 over everything before it. Internal to
// core/engine: the formats themselves are those two files' business.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/mapped_file.h"
#include "core/base/status.h"
#include "core/engine/kv_memory.h"

namespace specontext::prefix_codec {

static_assert(std::endian::native == std::endian::little, "prefix encodings are written in host order");

inline uint32_t crc32_of(const std::byte* data, size_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  constexpr size_t kPiece = size_t{1} << 30;  // zlib takes uInt lengths: large buffers in pieces
  for (size_t at = 0; at < n; at += kPiece) {
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data + at), static_cast<uInt>(std::min(kPiece, n - at)));
  }
  return static_cast<uint32_t>(crc);
}

class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_array(std::span<const T> v) {
    put(static_cast<uint64_t>(v.size()));
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    out_.insert(out_.end(), p, p + v.size_bytes());
  }
  void put_rows(const std::vector<std::vector<float>>& rows) {
    put(static_cast<uint64_t>(rows.size()));
    for (const auto& r : rows) put_array(std::span<const float>(r));
  }
  std::vector<std::byte>& bytes() { return out_; }
  // What was written, closed by the CRC-32 of it all.
  std::vector<std::byte> finish() {
    put(crc32_of(out_.data(), out_.size()));
    return std::move(out_);
  }

 private:
  std::vector<std::byte> out_;
};

// Reads what Writer wrote from hostile bytes: every count is checked against the bytes left
// before anything is allocated; errors are kDataLoss naming `kind name` and the field.
class Parser {
 public:
  Parser(std::span<const std::byte> bytes, std::string kind, const std::string& name)
      : reader_(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), kind + " " + name),
        what_(std::move(kind) + " " + name) {}
  template <typename T>
  Status get(T* v, std::string_view field) {
    return reader_.read(v, field);
  }
  template <typename T>
  Status get_array(std::vector<T>* v, std::string_view field) {
    uint64_t count = 0;
    SPX_RETURN_IF_ERROR(reader_.read(&count, field));
    if (count > reader_.remaining() / sizeof(T)) {
      return bad(field, "holds " + std::to_string(count) + " elements, more than the " +
                            std::to_string(reader_.remaining()) + " bytes left");
    }
    v->resize(static_cast<size_t>(count));
    return reader_.read_bytes(v->data(), v->size() * sizeof(T), field);
  }
  Status get_rows(std::vector<std::vector<float>>* rows, std::string_view field) {
    uint64_t count = 0;
    SPX_RETURN_IF_ERROR(reader_.read(&count, field));
    if (count > reader_.remaining() / sizeof(uint64_t)) {  // every row takes at least its length
      return bad(field, "holds " + std::to_string(count) + " rows, more than the bytes left");
    }
    rows->resize(static_cast<size_t>(count));
    for (auto& r : *rows) SPX_RETURN_IF_ERROR(get_array(&r, field));
    return Status::ok();
  }
  Status bad(std::string_view field, const std::string& why) const {
    return data_loss(what_ + ": field '" + std::string(field) + "' " + why);
  }
  size_t remaining() const { return reader_.remaining(); }

 private:
  ByteReader reader_;
  std::string what_;
};

// An encoding's first bytes: its magic and format version.
inline void put_header(Writer& w, const char (&magic)[8], uint32_t version) {
  for (char c : magic) w.put(c);
  w.put(version);
}

// A snapshot's KV layout: page_size, layers, page_bytes, then kv_dtype and method a byte each.
inline void put_snapshot_layout(Writer& w, const PrefixSnapshot& s) {
  w.put(s.page_size);
  w.put(s.layers);
  w.put(s.page_bytes);
  w.put(static_cast<uint8_t>(s.kv_dtype));
  w.put(static_cast<uint8_t>(s.method));
}

// A snapshot's arrays (after the token ids): kv, head_keys, boundary_fused, quest_min, quest_max.
inline void put_snapshot_arrays(Writer& w, const PrefixSnapshot& s) {
  w.put_array(std::span<const std::byte>(s.kv));
  w.put_array(std::span<const float>(s.head_keys));
  w.put_rows(s.boundary_fused);
  w.put_rows(s.quest_min);
  w.put_rows(s.quest_max);
}

// What put_header wrote, checked against `magic` and `version`, and (`check_crc`) the CRC-32 at
// the end of `bytes` against everything before it; `noun` ("file", "chunk") names the encoding
// in the errors.
inline Status get_header(Parser& in, std::span<const std::byte> bytes, const char (&magic)[8],
                         uint32_t version, std::string_view noun, bool check_crc) {
  char got[sizeof(magic)];
  SPX_RETURN_IF_ERROR(in.get(&got, "magic"));
  if (std::memcmp(got, magic, sizeof(magic)) != 0) {
    return in.bad("magic", "is not " + std::string(magic, sizeof(magic)));
  }
  uint32_t got_version = 0;
  SPX_RETURN_IF_ERROR(in.get(&got_version, "version"));
  if (got_version != version) {
    return in.bad("version",
                  "is " + std::to_string(got_version) + ", this build reads " + std::to_string(version));
  }
  // The checksum first: a corrupt encoding is named as such rather than by whichever field broke.
  if (bytes.size() < sizeof(magic) + 2 * sizeof(uint32_t)) {
    return in.bad("crc32", "is missing: the " + std::string(noun) + " is truncated");
  }
  if (!check_crc) return Status::ok();
  const size_t body = bytes.size() - sizeof(uint32_t);
  uint32_t stored = 0;
  std::memcpy(&stored, bytes.data() + body, sizeof(stored));
  if (const uint32_t actual = crc32_of(bytes.data(), body); actual != stored) {
    return in.bad("crc32", "does not match the contents (stored " + std::to_string(stored) + ", computed " +
                               std::to_string(actual) + "): the " + std::string(noun) +
                               " is corrupt or truncated");
  }
  return Status::ok();
}

// What put_snapshot_layout wrote, into `s`; a dtype or sparse method that does not exist is refused.
inline Status get_snapshot_layout(Parser& in, PrefixSnapshot& s) {
  uint8_t dtype = 0, method = 0;
  SPX_RETURN_IF_ERROR(in.get(&s.page_size, "page_size"));
  SPX_RETURN_IF_ERROR(in.get(&s.layers, "layers"));
  SPX_RETURN_IF_ERROR(in.get(&s.page_bytes, "page_bytes"));
  SPX_RETURN_IF_ERROR(in.get(&dtype, "kv_dtype"));
  SPX_RETURN_IF_ERROR(in.get(&method, "method"));
  if (dtype > static_cast<uint8_t>(DType::kU8)) {
    return in.bad("kv_dtype", "is " + std::to_string(dtype) + ", no dtype");
  }
  if (method > static_cast<uint8_t>(SparseMethod::kOracle)) {
    return in.bad("method", "is " + std::to_string(method) + ", no sparse method");
  }
  s.kv_dtype = static_cast<DType>(dtype);
  s.method = static_cast<SparseMethod>(method);
  return Status::ok();
}

// The snapshot's kv array, checked to be layers × its tokens' whole pages × page_bytes (the
// layout and tokens read and positive before).
inline Status get_snapshot_kv(Parser& in, PrefixSnapshot& s) {
  SPX_RETURN_IF_ERROR(in.get_array(&s.kv, "kv"));
  // Computed without overflow.
  const uint64_t pages = static_cast<uint64_t>(s.tokens / s.page_size);
  const uint64_t kv_len = s.kv.size();
  if (pages == 0 || kv_len / s.page_bytes / pages != static_cast<uint64_t>(s.layers) ||
      kv_len % (s.page_bytes * pages) != 0) {
    return in.bad("kv", "holds " + std::to_string(kv_len) + " bytes, not layers × pages × page_bytes");
  }
  return Status::ok();
}

// The CRC-32 Writer::finish wrote is all that is left.
inline Status get_end(const Parser& in) {
  if (in.remaining() != sizeof(uint32_t)) {
    return in.bad("crc32",
                  "is not where the contents end (" + std::to_string(in.remaining()) + " bytes left)");
  }
  return Status::ok();
}

}  // namespace specontext::prefix_codec
