// Read-only memory map of a whole file (RAII).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/base/status.h"

namespace specontext {

class MappedFile {
 public:
  static Result<std::shared_ptr<MappedFile>> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

// Bounds-checked little-endian reader over a byte range; every read names the file on failure.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size, std::string source)
      : data_(data), size_(size), source_(std::move(source)) {}
  size_t offset() const { return off_; }
  size_t remaining() const { return size_ - off_; }
  const uint8_t* cursor() const { return data_ + off_; }
  Status skip(size_t n, std::string_view what);
  template <typename T>
  Status read(T* out, std::string_view what);
  Status read_bytes(void* out, size_t n, std::string_view what);

 private:
  const uint8_t* data_;
  size_t size_;
  size_t off_ = 0;
  std::string source_;
};

template <typename T>
Status ByteReader::read(T* out, std::string_view what) {
  return read_bytes(out, sizeof(T), what);
}

}  // namespace specontext
