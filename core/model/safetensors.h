// Safetensors reader (over a memory map or a caller's buffer) and a small writer.
// Format: u64 LE header length N, N bytes of JSON {name: {dtype, shape, data_offsets}, ...,
// "__metadata__": {str: str}}, then the data section; offsets are relative to its start.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "core/base/mapped_file.h"
#include "core/base/status.h"

namespace specontext {

struct SafetensorsTensor {
  std::string name;
  std::string dtype_name;    // as written in the file: "F32", "BF16", "I8", ...
  size_t element_size = 0;   // bytes per element of dtype_name
  bool supported = false;    // dtype maps to a DType this project handles
  DType dtype = DType::kU8;  // meaningful only when supported
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the data section
  uint64_t end = 0;
  const uint8_t* data = nullptr;  // resolved pointer into the buffer
  size_t n_bytes() const { return static_cast<size_t>(end - begin); }
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps the file and parses its header; the map stays alive as long as this object.
  [[nodiscard]] static Result<std::shared_ptr<SafetensorsFile>> open(const std::string& path);
  // Parses a buffer holding a whole safetensors file (used by the fuzzer and tests); the buffer
  // must outlive the object. Validates header length, JSON, dtypes, shapes and offsets.
  [[nodiscard]] static Result<std::shared_ptr<SafetensorsFile>> parse(const uint8_t* data,
                                                                      size_t size,
                                                                      std::string source);

  const std::string& source() const { return source_; }
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }  // sorted by name
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsTensor* find(const std::string& name) const;
  // The map backing the data pointers (null when parsed from a caller's buffer).
  std::shared_ptr<const MappedFile> map() const { return map_; }

 private:
  SafetensorsFile() = default;
  std::shared_ptr<const MappedFile> map_;
  std::string source_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write. `data` is not owned: it must hold numel·dtype_size bytes of `dtype`
// (f32, f16, bf16, i32, i64 or u8) until write_safetensors returns.
struct NamedTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes a safetensors file (tensors laid out in the given order, header padded to 8 bytes so
// f32 payloads stay aligned in a memory map). Fails on duplicate names or unsupported dtypes.
[[nodiscard]] Status write_safetensors(const std::string& path,
                                       const std::vector<NamedTensor>& tensors,
                                       const std::map<std::string, std::string>& metadata = {});

// Safetensors dtype string for a DType ("F32", "BF16", ...); empty when it has none (q8_0).
std::string_view safetensors_dtype_name(DType t);

}  // namespace specontext
