#include "core/model/gguf.h"

#include <limits>
#include <new>

#include "core/model/ggml_quants.h"

namespace specontext {

namespace {

enum GgufValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

const char* value_type_name(uint32_t t) {
  static const char* const kNames[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                       "int32",  "float32", "bool",   "string", "array",
                                       "uint64", "int64",   "float64"};
  return t <= kF64 ? kNames[t] : "unknown";
}

// Smallest encoding of one value of type t (strings: their u64 length).
size_t min_value_bytes(uint32_t t) {
  switch (t) {
    case kU8:
    case kI8:
    case kBool: return 1;
    case kU16:
    case kI16: return 2;
    case kU32:
    case kI32:
    case kF32: return 4;
    case kU64:
    case kI64:
    case kF64:
    case kString: return 8;
    default: return 12;  // array header
  }
}

constexpr size_t kMaxDims = 4;  // GGML_MAX_DIMS

class Parser {
 public:
  Parser(const uint8_t* data, size_t size, const std::string& source)
      : r_(data, size, source), source_(source) {}
  ByteReader& reader() { return r_; }

  Status read_string(std::string* out, const std::string& what) {
    uint64_t len = 0;
    SPX_RETURN_IF_ERROR(r_.read(&len, what + " length"));
    if (len > r_.remaining()) {
      return data_loss(source_ + ": truncated: " + what + " has length " + std::to_string(len) +
                       " at byte " + std::to_string(r_.offset()) + " but only " +
                       std::to_string(r_.remaining()) + " bytes remain");
    }
    out->assign(reinterpret_cast<const char*>(r_.cursor()), static_cast<size_t>(len));
    return r_.skip(static_cast<size_t>(len), what);
  }

  Status read_scalar(uint32_t type, GgufScalar* out, const std::string& what) {
    switch (type) {
      case kU8: return read_as<uint8_t, uint64_t>(out, what);
      case kI8: return read_as<int8_t, int64_t>(out, what);
      case kU16: return read_as<uint16_t, uint64_t>(out, what);
      case kI16: return read_as<int16_t, int64_t>(out, what);
      case kU32: return read_as<uint32_t, uint64_t>(out, what);
      case kI32: return read_as<int32_t, int64_t>(out, what);
      case kU64: return read_as<uint64_t, uint64_t>(out, what);
      case kI64: return read_as<int64_t, int64_t>(out, what);
      case kF32: return read_as<float, double>(out, what);
      case kF64: return read_as<double, double>(out, what);
      case kBool: {
        uint8_t b = 0;
        SPX_RETURN_IF_ERROR(r_.read(&b, what));
        *out = b != 0;
        return Status::ok();
      }
      case kString: {
        std::string s;
        SPX_RETURN_IF_ERROR(read_string(&s, what));
        *out = std::move(s);
        return Status::ok();
      }
      default:
        return invalid_argument(source_ + ": " + what + ": unknown value type " +
                                std::to_string(type));
    }
  }

  Status read_value(GgufValue* v, const std::string& key) {
    const std::string what = "value of key \"" + key + "\"";
    SPX_RETURN_IF_ERROR(r_.read(&v->type, "type of key \"" + key + "\""));
    if (v->type != kArray) return read_scalar(v->type, &v->scalar, what);
    SPX_RETURN_IF_ERROR(r_.read(&v->array_type, "array type of key \"" + key + "\""));
    if (v->array_type == kArray) {
      return unimplemented(source_ + ": key \"" + key + "\": nested arrays are not supported");
    }
    if (v->array_type > kF64) {
      return invalid_argument(source_ + ": key \"" + key + "\": unknown array element type " +
                              std::to_string(v->array_type));
    }
    uint64_t n = 0;
    SPX_RETURN_IF_ERROR(r_.read(&n, "array length of key \"" + key + "\""));
    if (n > r_.remaining() / min_value_bytes(v->array_type)) {
      return data_loss(source_ + ": truncated: key \"" + key + "\" claims " + std::to_string(n) +
                       " elements but only " + std::to_string(r_.remaining()) + " bytes remain");
    }
    try {  // each element is a ~40-byte variant: a huge array in a huge file may not fit in RAM
      v->array.resize(static_cast<size_t>(n));
    } catch (const std::bad_alloc&) {
      return resource_exhausted(source_ + ": key \"" + key + "\": cannot hold " +
                                std::to_string(n) + " array elements in memory");
    }
    for (auto& e : v->array) SPX_RETURN_IF_ERROR(read_scalar(v->array_type, &e, what));
    return Status::ok();
  }

 private:
  template <typename Raw, typename Stored>
  Status read_as(GgufScalar* out, const std::string& what) {
    Raw raw{};
    SPX_RETURN_IF_ERROR(r_.read(&raw, what));
    *out = static_cast<Stored>(raw);
    return Status::ok();
  }

  ByteReader r_;
  const std::string& source_;
};

// Integer scalars as int64; false for non-integers and unsigned values above INT64_MAX.
bool scalar_to_int(const GgufScalar& s, int64_t* out) {
  if (const auto* u = std::get_if<uint64_t>(&s)) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(*u);
    return true;
  }
  if (const auto* i = std::get_if<int64_t>(&s)) {
    *out = *i;
    return true;
  }
  return false;
}

}  // namespace

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;  // overflow rejected at parse time
  return n;
}

Result<std::shared_ptr<GgufFile>> GgufFile::open(const std::string& path) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> map, MappedFile::open(path));
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<GgufFile> f, parse(map->data(), map->size(), path));
  f->map_ = std::move(map);
  return f;
}

Result<std::shared_ptr<GgufFile>> GgufFile::parse(const uint8_t* data, size_t size,
                                                  std::string source) {
  std::shared_ptr<GgufFile> f(new GgufFile());
  f->source_ = std::move(source);
  const std::string& src = f->source_;
  Parser p(data, size, src);
  ByteReader& r = p.reader();

  char magic[4] = {};
  SPX_RETURN_IF_ERROR(r.read_bytes(magic, 4, "magic"));
  if (std::string_view(magic, 4) != "GGUF") {
    return invalid_argument(src + ": bad magic (not a GGUF file)");
  }
  SPX_RETURN_IF_ERROR(r.read(&f->version_, "version"));
  if (f->version_ != 2 && f->version_ != 3) {
    return unimplemented(src + ": GGUF version " + std::to_string(f->version_) +
                         " is not supported (expected 2 or 3" +
                         (f->version_ > 0xffff ? "; big-endian file?)" : ")"));
  }
  uint64_t n_tensors = 0;
  uint64_t n_kv = 0;
  SPX_RETURN_IF_ERROR(r.read(&n_tensors, "tensor count"));
  SPX_RETURN_IF_ERROR(r.read(&n_kv, "metadata count"));
  // Each key/value needs >= 13 bytes and each tensor info >= 24; reject absurd counts up front.
  if (n_kv > r.remaining() / 13) {
    return data_loss(src + ": truncated: metadata count " + std::to_string(n_kv) +
                     " cannot fit in the remaining " + std::to_string(r.remaining()) + " bytes");
  }
  if (n_tensors > r.remaining() / 24) {
    return data_loss(src + ": truncated: tensor count " + std::to_string(n_tensors) +
                     " cannot fit in the remaining " + std::to_string(r.remaining()) + " bytes");
  }

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    SPX_RETURN_IF_ERROR(p.read_string(&key, "metadata key #" + std::to_string(i)));
    GgufValue v;
    SPX_RETURN_IF_ERROR(p.read_value(&v, key));
    if (!f->kv_.emplace(key, std::move(v)).second) {
      return invalid_argument(src + ": duplicate metadata key \"" + key + "\"");
    }
  }

  uint64_t alignment = 32;
  if (f->has("general.alignment")) {
    auto a = f->get_int("general.alignment");
    if (!a.is_ok()) return a.status();
    if (*a <= 0 || *a > (1 << 24) || (*a & (*a - 1)) != 0) {
      return invalid_argument(src + ": key \"general.alignment\" = " + std::to_string(*a) +
                              " must be a power of two");
    }
    alignment = static_cast<uint64_t>(*a);
  }

  f->tensors_.resize(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo& t = f->tensors_[static_cast<size_t>(i)];
    SPX_RETURN_IF_ERROR(p.read_string(&t.name, "name of tensor #" + std::to_string(i)));
    const std::string what = "tensor \"" + t.name + "\"";
    uint32_t n_dims = 0;
    SPX_RETURN_IF_ERROR(r.read(&n_dims, what + " dimension count"));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return invalid_argument(src + ": " + what + ": " + std::to_string(n_dims) +
                              " dimensions (expected 1.." + std::to_string(kMaxDims) + ")");
    }
    int64_t n = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t dim = 0;
      SPX_RETURN_IF_ERROR(r.read(&dim, what + " dims"));
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(n, static_cast<int64_t>(dim), &n)) {
        return invalid_argument(src + ": " + what + ": dims overflow");
      }
      t.dims.push_back(static_cast<int64_t>(dim));
    }
    SPX_RETURN_IF_ERROR(r.read(&t.ggml_type, what + " type"));
    SPX_RETURN_IF_ERROR(r.read(&t.offset, what + " offset"));
    const GgmlTypeInfo* gt = ggml_type_info(t.ggml_type);
    if (gt == nullptr) {
      return invalid_argument(src + ": " + what + ": unknown ggml type " +
                              std::to_string(t.ggml_type));
    }
    if (t.dims[0] % gt->block != 0) {
      return invalid_argument(src + ": " + what + ": first dimension " + std::to_string(t.dims[0]) +
                              " is not a multiple of the " + std::string(gt->name) + " block size " +
                              std::to_string(gt->block));
    }
    int64_t bytes = 0;
    if (__builtin_mul_overflow(n / gt->block, gt->bytes, &bytes)) {
      return invalid_argument(src + ": " + what + ": size overflows");
    }
    t.n_bytes = static_cast<size_t>(bytes);
    if (t.offset % alignment != 0) {
      return invalid_argument(src + ": " + what + ": offset " + std::to_string(t.offset) +
                              " is not a multiple of the alignment " + std::to_string(alignment));
    }
    if (!f->tensor_index_.emplace(t.name, static_cast<size_t>(i)).second) {
      return invalid_argument(src + ": duplicate tensor \"" + t.name + "\"");
    }
  }

  // The data section starts at the next multiple of the alignment.
  const uint64_t header_end = r.offset();
  const uint64_t data_start = (header_end + alignment - 1) / alignment * alignment;
  if (n_tensors > 0 && data_start > size) {
    return data_loss(src + ": truncated: data section would start at byte " +
                     std::to_string(data_start) + " but the file has " + std::to_string(size));
  }
  const uint64_t data_size = data_start <= size ? size - data_start : 0;
  for (GgufTensorInfo& t : f->tensors_) {
    if (t.offset > data_size || t.n_bytes > data_size - t.offset) {
      return data_loss(src + ": truncated: tensor \"" + t.name + "\" spans bytes [" +
                       std::to_string(t.offset) + ", " + std::to_string(t.offset + t.n_bytes) +
                       ") of a data section of " + std::to_string(data_size) + " bytes");
    }
    t.data = data + data_start + t.offset;
  }
  return f;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

Status type_mismatch(const std::string& src, const std::string& key, const char* want,
                     const GgufValue& v) {
  std::string got = value_type_name(v.type);
  if (v.is_array()) got += std::string(" of ") + value_type_name(v.array_type);
  return invalid_argument(src + ": key \"" + key + "\": expected " + want + ", got " + got);
}

bool is_int_type(uint32_t t) {
  return t == kU8 || t == kI8 || t == kU16 || t == kI16 || t == kU32 || t == kI32 || t == kU64 ||
         t == kI64;
}

}  // namespace

Result<std::string> GgufFile::get_string(const std::string& key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return not_found(source_ + ": missing key \"" + key + "\"");
  if (it->second.type != kString) return type_mismatch(source_, key, "a string", it->second);
  return std::get<std::string>(it->second.scalar);
}

Result<int64_t> GgufFile::get_int(const std::string& key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return not_found(source_ + ": missing key \"" + key + "\"");
  if (!is_int_type(it->second.type)) return type_mismatch(source_, key, "an integer", it->second);
  int64_t v = 0;
  if (!scalar_to_int(it->second.scalar, &v)) {
    return invalid_argument(source_ + ": key \"" + key + "\": value too large");
  }
  return v;
}

Result<double> GgufFile::get_float(const std::string& key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return not_found(source_ + ": missing key \"" + key + "\"");
  const GgufValue& v = it->second;
  if (v.type == kF32 || v.type == kF64) return std::get<double>(v.scalar);
  if (is_int_type(v.type)) {
    if (const auto* u = std::get_if<uint64_t>(&v.scalar)) return static_cast<double>(*u);
    return static_cast<double>(std::get<int64_t>(v.scalar));
  }
  return type_mismatch(source_, key, "a number", v);
}

Result<std::vector<std::string>> GgufFile::get_string_array(const std::string& key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return not_found(source_ + ": missing key \"" + key + "\"");
  const GgufValue& v = it->second;
  if (!v.is_array() || v.array_type != kString) {
    return type_mismatch(source_, key, "an array of string", v);
  }
  std::vector<std::string> out;
  out.reserve(v.array.size());
  for (const auto& e : v.array) out.push_back(std::get<std::string>(e));
  return out;
}

Result<std::vector<double>> GgufFile::get_float_array(const std::string& key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return not_found(source_ + ": missing key \"" + key + "\"");
  const GgufValue& v = it->second;
  if (!v.is_array() ||
      (v.array_type != kF32 && v.array_type != kF64 && !is_int_type(v.array_type))) {
    return type_mismatch(source_, key, "an array of numbers", v);
  }
  std::vector<double> out;
  out.reserve(v.array.size());
  for (const auto& e : v.array) {
    if (const auto* d = std::get_if<double>(&e)) {
      out.push_back(*d);
    } else if (const auto* u = std::get_if<uint64_t>(&e)) {
      out.push_back(static_cast<double>(*u));
    } else {
      out.push_back(static_cast<double>(std::get<int64_t>(e)));
    }
  }
  return out;
}

Result<std::vector<int64_t>> GgufFile::get_int_array(const std::string& key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return not_found(source_ + ": missing key \"" + key + "\"");
  const GgufValue& v = it->second;
  if (!v.is_array() || !is_int_type(v.array_type)) {
    return type_mismatch(source_, key, "an array of integers", v);
  }
  std::vector<int64_t> out;
  out.reserve(v.array.size());
  for (size_t i = 0; i < v.array.size(); ++i) {
    int64_t x = 0;
    if (!scalar_to_int(v.array[i], &x)) {
      return invalid_argument(source_ + ": key \"" + key + "\": element " + std::to_string(i) +
                              " too large");
    }
    out.push_back(x);
  }
  return out;
}

}  // namespace specontext
