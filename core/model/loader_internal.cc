#include "core/model/loader_internal.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <new>

#include "core/model/ggml_quants.h"

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

// Converted weights run to gigabytes, written once at load. Large buffers are anonymous mappings
// advised to use transparent huge pages (aligned to 2 MiB so that every page can be one), so that
// filling them takes a page fault per 2 MiB instead of per 4 KiB: on this project's VMs a fault
// costs microseconds, and a 1.2B-parameter Q4_K_M file spent most of its 31 s load in them. The
// advice is only advice: where THP is off the pages are 4 KiB and all else is the same.
template <typename T>
std::shared_ptr<T[]> alloc_array(size_t n) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = (n == 0 ? 1 : n) * sizeof(T);
  if (bytes < 4 * kHuge) return std::shared_ptr<T[]>(new (std::nothrow) T[n == 0 ? 1 : n]);
  const size_t mapped = bytes + kHuge;
  void* base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge;
  ::madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
  return std::shared_ptr<T[]>(reinterpret_cast<T*>(aligned), [base, mapped](T*) { ::munmap(base, mapped); });
}

// rows · cols of a weight matrix, refusing empty, overflowing and absurd (> 2^40) shapes.
Result<int64_t> matrix_elements(int64_t rows, int64_t cols, const std::string& what) {
  int64_t n = 0;
  if (rows <= 0 || cols <= 0 || !checked_mul(rows, cols, &n) || n > (int64_t{1} << 40)) {
    return invalid_argument(what + ": bad matrix shape [" + std::to_string(rows) + ", " +
                            std::to_string(cols) + "]");
  }
  return n;
}

}  // namespace

Vec to_f32_vec(DType t, const void* src, size_t n) {
  Vec v(n);
  if (n > 0) convert_aligned(t, src, v.data(), n);
  return v;
}

namespace {

// A converted copy of an [rows, cols] matrix, kept alive in model->storage: `decode(first_row,
// n_rows, out)` writes f32 rows; the copy holds them as f32, or as bf16 (rounded to nearest even)
// when `to_bf16`, decoded a slab of rows at a time so that no f32 copy of the whole matrix exists.
template <typename Decode>
Result<WeightMatrix> converted_matrix(Model* model, int64_t rows, int64_t cols, int64_t n, bool to_bf16,
                                      const std::string& what, Decode decode) {
  WeightMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.dtype = to_bf16 ? DType::kBF16 : DType::kF32;
  if (!to_bf16) {
    auto buf = alloc_array<float>(static_cast<size_t>(n));
    if (!buf) return resource_exhausted(what + ": out of memory converting to f32");
    SPX_RETURN_IF_ERROR(decode(0, rows, buf.get()));
    m.data = buf.get();
    model->storage.push_back(std::shared_ptr<const void>(buf, buf.get()));
    return m;
  }
  auto buf = alloc_array<uint16_t>(static_cast<size_t>(n));
  if (!buf) return resource_exhausted(what + ": out of memory converting to bf16");
  const int64_t slab = std::max<int64_t>(1, (int64_t{1} << 16) / cols);
  std::vector<float> rows_f32(static_cast<size_t>(std::min(slab, rows) * cols));
  for (int64_t r = 0; r < rows; r += slab) {
    const int64_t count = std::min(slab, rows - r);
    SPX_RETURN_IF_ERROR(decode(r, count, rows_f32.data()));
    uint16_t* out = buf.get() + r * cols;
    for (int64_t i = 0; i < count * cols; ++i) out[i] = f32_to_bf16(rows_f32[static_cast<size_t>(i)]);
  }
  m.data = buf.get();
  model->storage.push_back(std::shared_ptr<const void>(buf, buf.get()));
  return m;
}

}  // namespace

Result<WeightMatrix> make_matrix(Model* model, DType t, const void* src, int64_t rows, int64_t cols,
                                 const LoadOptions& opts, const std::string& what) {
  SPX_ASSIGN_OR_RETURN(const int64_t n, matrix_elements(rows, cols, what));
  if (opts.force_f32 && opts.force_bf16) {
    return invalid_argument(what + ": force_f32 and force_bf16 exclude each other");
  }
  const bool in_place = (t == DType::kF32 && !opts.force_bf16) || (t == DType::kBF16 && !opts.force_f32);
  if (in_place) {
    WeightMatrix m;
    m.rows = rows;
    m.cols = cols;
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
  if (t == DType::kQ8_0) return make_dequantized_matrix(model, 8, src, rows, cols, opts, what);
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) {
    return unimplemented(what + ": dtype " + std::string(dtype_name(t)) +
                         " is not supported for weight matrices");
  }
  const size_t row_bytes = static_cast<size_t>(cols) * dtype_size(t);
  return converted_matrix(model, rows, cols, n, opts.force_bf16, what,
                          [&](int64_t first, int64_t count, float* out) {
                            convert_aligned(t, static_cast<const uint8_t*>(src) + static_cast<size_t>(first) * row_bytes,
                                            out, static_cast<size_t>(count * cols));
                            return Status::ok();
                          });
}

Result<WeightMatrix> make_dequantized_matrix(Model* model, uint32_t ggml_type, const void* src,
                                             int64_t rows, int64_t cols, const LoadOptions& opts,
                                             const std::string& what) {
  const GgmlTypeInfo* info = ggml_type_info(ggml_type);
  const std::string type_name = info != nullptr ? std::string(info->name) : std::to_string(ggml_type);
  SPX_ASSIGN_OR_RETURN(const int64_t n, matrix_elements(rows, cols, what));
  if (info == nullptr || !ggml_is_dequantizable(ggml_type)) {
    return unimplemented(what + ": ggml type " + type_name +
                         " is not supported (supported: F32, F16, BF16, " +
                         std::string(ggml_dequantizable_names()) + ")");
  }
  if (cols % info->block != 0) {
    return invalid_argument(what + ": " + type_name + " rows need a multiple of " +
                            std::to_string(info->block) + " columns, got " + std::to_string(cols));
  }
  const size_t row_bytes = static_cast<size_t>(cols / info->block * info->bytes);
  return converted_matrix(model, rows, cols, n, opts.force_bf16, what + " (" + type_name + ")",
                          [&](int64_t first, int64_t count, float* out) {
                            return ggml_dequantize(ggml_type,
                                                   static_cast<const uint8_t*>(src) + static_cast<size_t>(first) * row_bytes,
                                                   out, count * cols);
                          });
}

Result<WeightMatrix> make_block_matrix(DType t, const void* src, int64_t rows, int64_t cols,
                                       const std::string& what) {
  SPX_RETURN_IF_ERROR(matrix_elements(rows, cols, what).status());
  if (!is_block_dtype(t)) {
    return invalid_argument(what + ": dtype " + std::string(dtype_name(t)) + " is not a block type");
  }
  if (cols % dtype_block_elements(t) != 0) {
    return invalid_argument(what + ": " + std::string(dtype_name(t)) + " rows need a multiple of " +
                            std::to_string(dtype_block_elements(t)) + " columns, got " + std::to_string(cols));
  }
  return WeightMatrix{t, rows, cols, src};
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
