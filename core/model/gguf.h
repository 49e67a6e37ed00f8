// GGUF v2/v3 reader: metadata key/values and tensor directory over a memory map.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "core/base/dtype.h"
#include "core/base/mapped_file.h"
#include "core/base/status.h"

namespace specontext {

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // as stored: dims[0] is the fastest-varying (columns)
  uint32_t ggml_type = 0;     // 0 F32, 1 F16, 8 Q8_0, 30 BF16, ...
  uint64_t offset = 0;        // relative to the data section
  const uint8_t* data = nullptr;  // resolved pointer into the map
  size_t n_bytes = 0;
  int64_t n_elements() const;
};

// One metadata value. Arrays keep their element values.
using GgufScalar = std::variant<uint64_t, int64_t, double, bool, std::string>;
struct GgufValue {
  uint32_t type = 0;                 // GGUF value type id
  GgufScalar scalar;                 // when not an array
  std::vector<GgufScalar> array;     // when type == 9 (ARRAY)
  uint32_t array_type = 0;
  bool is_array() const { return type == 9; }
};

class GgufFile {
 public:
  // Parses header, metadata and tensor infos; validates every offset/size against the file.
  static Result<std::shared_ptr<GgufFile>> open(const std::string& path);
  // Same over an in-memory buffer (used by the fuzzer); the buffer must outlive the object.
  static Result<std::shared_ptr<GgufFile>> parse(const uint8_t* data, size_t size, std::string source);

  uint32_t version() const { return version_; }
  const std::string& source() const { return source_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;

  bool has(const std::string& key) const { return kv_.count(key) != 0; }
  // Typed getters: NotFound when absent, InvalidArgument (naming the key) on a type mismatch.
  Result<std::string> get_string(const std::string& key) const;
  Result<int64_t> get_int(const std::string& key) const;     // any integer type
  Result<double> get_float(const std::string& key) const;    // f32/f64 (ints accepted)
  Result<std::vector<std::string>> get_string_array(const std::string& key) const;
  Result<std::vector<double>> get_float_array(const std::string& key) const;
  Result<std::vector<int64_t>> get_int_array(const std::string& key) const;

 private:
  GgufFile() = default;
  std::shared_ptr<MappedFile> map_;  // null when parsed from a caller's buffer
  std::string source_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

}  // namespace specontext
