// GGUF v3 writer: metadata key/values and tensors, for files made by tests and benchmarks (the
// reader is core/model/gguf.h). Tensors are written in the order added, each at a 32-byte
// aligned offset (GGUF's default alignment).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/base/status.h"

namespace specontext {

class GgufWriter {
 public:
  void add_u32(const std::string& key, uint32_t value);
  void add_f32(const std::string& key, float value);
  void add_string(const std::string& key, const std::string& value);
  // `dims` fastest-varying first, as GGUF lists them (a row-major [rows, cols] matrix is
  // {cols, rows}); `data` holds the tensor as ggml type `ggml_type` stores it.
  void add_tensor(const std::string& name, std::vector<int64_t> dims, uint32_t ggml_type, std::vector<uint8_t> data);
  // kInternal naming the path when it cannot be written.
  Status write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> dims;
    uint32_t ggml_type;
    std::vector<uint8_t> data;
  };
  std::string kv_;
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace specontext
