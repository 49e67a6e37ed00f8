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
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/mapped_file.h"
#include "core/base/status.h"

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

}  // namespace specontext::prefix_codec
