#include "core/model/gguf_writer.h"

#include <cstdio>
#include <cstring>
#include <memory>

namespace specontext {

namespace {

constexpr uint64_t kAlignment = 32;
constexpr uint32_t kTypeU32 = 4, kTypeF32 = 6, kTypeString = 8;

template <typename T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void put_string(std::string& out, const std::string& s) {
  put(out, static_cast<uint64_t>(s.size()));
  out += s;
}

uint64_t aligned(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

void GgufWriter::add_u32(const std::string& key, uint32_t value) {
  put_string(kv_, key);
  put(kv_, kTypeU32);
  put(kv_, value);
  ++n_kv_;
}

void GgufWriter::add_f32(const std::string& key, float value) {
  put_string(kv_, key);
  put(kv_, kTypeF32);
  put(kv_, value);
  ++n_kv_;
}

void GgufWriter::add_string(const std::string& key, const std::string& value) {
  put_string(kv_, key);
  put(kv_, kTypeString);
  put_string(kv_, value);
  ++n_kv_;
}

void GgufWriter::add_tensor(const std::string& name, std::vector<int64_t> dims, uint32_t ggml_type,
                            std::vector<uint8_t> data) {
  tensors_.push_back({name, std::move(dims), ggml_type, std::move(data)});
}

Status GgufWriter::write(const std::string& path) const {
  std::string head = "GGUF";
  put(head, uint32_t{3});
  put(head, static_cast<uint64_t>(tensors_.size()));
  put(head, n_kv_);
  head += kv_;
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    put_string(head, t.name);
    put(head, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) put(head, static_cast<uint64_t>(d));
    put(head, t.ggml_type);
    put(head, offset);
    offset = aligned(offset + t.data.size());
  }
  head.resize(aligned(head.size()), '\0');
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  if (!f) return internal_error(path + ": cannot open for writing");
  bool ok = std::fwrite(head.data(), 1, head.size(), f.get()) == head.size();
  const char zeros[kAlignment] = {};
  for (const Tensor& t : tensors_) {
    ok = ok && std::fwrite(t.data.data(), 1, t.data.size(), f.get()) == t.data.size();
    const size_t pad = aligned(t.data.size()) - t.data.size();
    ok = ok && std::fwrite(zeros, 1, pad, f.get()) == pad;
  }
  ok = ok && std::fflush(f.get()) == 0;
  if (!ok) return internal_error(path + ": write failed");
  return Status::ok();
}

}  // namespace specontext
