#include "core/loader_internal.h"

#include <sys/stat.h>

#include <cstring>
#include <map>
#include <new>

namespace specontext::loader_internal {

Result<nlohmann::json> parse_json(std::string_view text, const std::string& source, int max_depth) {
  // nlohmann's parser is iterative, but destroying or walking a deeply nested value is not;
  // a cheap pre-scan bounds the depth so no input can exhaust the stack.
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return invalid_argument(source + ": invalid JSON: nesting deeper than " +
                                std::to_string(max_depth) + " levels");
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(source + ": invalid JSON: " + e.what());
  } catch (const std::bad_alloc&) {
    return resource_exhausted(source + ": out of memory while parsing JSON");
  } catch (const std::exception& e) {
    return invalid_argument(source + ": invalid JSON: " + e.what());
  }
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

bool checked_mul(int64_t a, int64_t b, int64_t* out) {
  if (a < 0 || b < 0) return false;
  return !__builtin_mul_overflow(a, b, out);
}

namespace {

// convert_to_f32 reads 16-bit types through typed pointers; a safetensors payload can sit at an
// odd offset, so misaligned sources are first copied to an aligned buffer.
void convert_aligned(DType t, const void* src, float* dst, size_t n) {
  const size_t esz = dtype_size(t);
  if (esz > 1 && reinterpret_cast<uintptr_t>(src) % esz != 0) {
    std::vector<uint8_t> tmp(n * esz);
    std::memcpy(tmp.data(), src, tmp.size());
    convert_to_f32(t, tmp.data(), dst, n);
    return;
  }
  convert_to_f32(t, src, dst, n);
}

template <typename T>
std::shared_ptr<T[]> alloc_array(size_t n) {
  return std::shared_ptr<T[]>(new (std::nothrow) T[n == 0 ? 1 : n]);
}

}  // namespace

Vec to_f32_vec(DType t, const void* src, size_t n) {
  Vec v(n);
  if (n > 0) convert_aligned(t, src, v.data(), n);
  return v;
}

Result<WeightMatrix> make_matrix(Model* model, DType t, const void* src, int64_t rows, int64_t cols,
                                 const LoadOptions& opts, const std::string& what) {
  int64_t n = 0;
  if (rows <= 0 || cols <= 0 || !checked_mul(rows, cols, &n) || n > (int64_t{1} << 40)) {
    return invalid_argument(what + ": bad matrix shape [" + std::to_string(rows) + ", " +
                            std::to_string(cols) + "]");
  }
  WeightMatrix m;
  m.rows = rows;
  m.cols = cols;
  const bool in_place = t == DType::kF32 || (t == DType::kBF16 && !opts.force_f32);
  if (in_place) {
    const size_t esz = dtype_size(t);
    m.dtype = t;
    if (reinterpret_cast<uintptr_t>(src) % esz == 0) {
      m.data = src;
      return m;
    }
    // Misaligned in the file: typed loads would be undefined behaviour, so copy once.
    auto buf = alloc_array<uint8_t>(static_cast<size_t>(n) * esz);
    if (!buf) return resource_exhausted(what + ": out of memory copying a misaligned tensor");
    std::memcpy(buf.get(), src, static_cast<size_t>(n) * esz);
    m.data = buf.get();
    model->storage.push_back(std::shared_ptr<const void>(buf, buf.get()));
    return m;
  }
  switch (t) {
    case DType::kF16:
    case DType::kBF16: break;
    case DType::kQ8_0:
      if (cols % 32 != 0) {
        return invalid_argument(what + ": q8_0 rows need a multiple of 32 columns, got " +
                                std::to_string(cols));
      }
      break;
    default:
      return unimplemented(what + ": dtype " + std::string(dtype_name(t)) +
                           " is not supported for weight matrices");
  }
  auto buf = alloc_array<float>(static_cast<size_t>(n));
  if (!buf) return resource_exhausted(what + ": out of memory converting to f32");
  if (t == DType::kQ8_0) {
    convert_to_f32(t, src, buf.get(),
                   static_cast<size_t>(n));  // byte-wise reads: no alignment need
  } else {
    convert_aligned(t, src, buf.get(), static_cast<size_t>(n));
  }
  m.dtype = DType::kF32;
  m.data = buf.get();
  model->storage.push_back(std::shared_ptr<const void>(buf, buf.get()));
  return m;
}

void unify_weight_dtype(Model* model) {
  std::vector<WeightMatrix*> all = {&model->tok_embeddings, &model->lm_head};
  for (auto& l : model->layers) {
    for (WeightMatrix* m : l.matrices()) {
      all.push_back(m);
    }
  }
  bool any_f32 = false;
  bool any_bf16 = false;
  for (const WeightMatrix* m : all) {
    if (m->empty()) continue;
    any_f32 |= m->dtype == DType::kF32;
    any_bf16 |= m->dtype == DType::kBF16;
  }
  if (any_f32 && any_bf16) {
    std::map<const void*, const void*> converted;  // tied matrices share one copy
    for (WeightMatrix* m : all) {
      if (m->empty() || m->dtype != DType::kBF16) continue;
      auto it = converted.find(m->data);
      if (it == converted.end()) {
        const size_t n = static_cast<size_t>(m->rows * m->cols);
        auto buf = alloc_array<float>(n);
        if (!buf)
          continue;  // out of memory: leave this one as bf16; weight_dtype stays honest below
        convert_aligned(DType::kBF16, m->data, buf.get(), n);
        model->storage.push_back(std::shared_ptr<const void>(buf, buf.get()));
        it = converted.emplace(m->data, buf.get()).first;
      }
      m->data = it->second;
      m->dtype = DType::kF32;
    }
  }
  model->weight_dtype = DType::kF32;
  for (const WeightMatrix* m : all) {
    if (!m->empty() && m->dtype == DType::kBF16) model->weight_dtype = DType::kBF16;
  }
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace specontext::loader_internal
