#include "core/model/safetensors.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "core/model/loader_internal.h"

namespace specontext {

namespace {

using loader_internal::checked_mul;
using loader_internal::shape_string;

// The reference implementation caps the header at 100 MB; a larger one is not a real file.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeInfo {
  const char* name;
  size_t size;
  bool supported;
  DType dtype;
};

// Every dtype the safetensors spec defines, so files with extra tensors of exotic types still
// parse; only `supported` ones can be turned into weights.
constexpr DTypeInfo kDTypes[] = {
    {"F64", 8, false, DType::kU8},     {"F32", 4, true, DType::kF32},
    {"F16", 2, true, DType::kF16},     {"BF16", 2, true, DType::kBF16},
    {"I64", 8, true, DType::kI64},     {"I32", 4, true, DType::kI32},
    {"I16", 2, false, DType::kU8},     {"I8", 1, false, DType::kU8},
    {"U64", 8, false, DType::kU8},     {"U32", 4, false, DType::kU8},
    {"U16", 2, false, DType::kU8},     {"U8", 1, true, DType::kU8},
    {"BOOL", 1, false, DType::kU8},    {"F8_E4M3", 1, false, DType::kU8},
    {"F8_E5M2", 1, false, DType::kU8},
};

const DTypeInfo* find_dtype(const std::string& name) {
  for (const auto& d : kDTypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

std::string quote_name(const std::string& s) { return "\"" + s + "\""; }

Result<uint64_t> json_u64(const nlohmann::json& v, const std::string& source,
                          const std::string& what) {
  if (!v.is_number_unsigned()) {
    return invalid_argument(source + ": " + what + ": expected a non-negative integer, got " +
                            std::string(v.type_name()));
  }
  return v.get<uint64_t>();
}

Result<SafetensorsTensor> parse_entry(const std::string& name, const nlohmann::json& e,
                                      const uint8_t* data_section, uint64_t data_size,
                                      const std::string& source) {
  const std::string where = "tensor " + quote_name(name);
  if (!e.is_object()) return invalid_argument(source + ": " + where + ": entry is not an object");
  SafetensorsTensor t;
  t.name = name;

  auto dt = e.find("dtype");
  if (dt == e.end() || !dt->is_string()) {
    return invalid_argument(source + ": " + where + ": field \"dtype\" missing or not a string");
  }
  t.dtype_name = dt->get<std::string>();
  const DTypeInfo* info = find_dtype(t.dtype_name);
  if (info == nullptr) {
    return invalid_argument(source + ": " + where + ": unknown dtype " + quote_name(t.dtype_name));
  }
  t.element_size = info->size;
  t.supported = info->supported;
  t.dtype = info->dtype;

  auto sh = e.find("shape");
  if (sh == e.end() || !sh->is_array()) {
    return invalid_argument(source + ": " + where + ": field \"shape\" missing or not an array");
  }
  if (sh->size() > 8) {
    return invalid_argument(source + ": " + where + ": field \"shape\" has " +
                            std::to_string(sh->size()) + " dimensions (at most 8 supported)");
  }
  int64_t numel = 1;
  for (const auto& d : *sh) {
    SPX_ASSIGN_OR_RETURN(uint64_t dim, json_u64(d, source, where + ": field \"shape\""));
    if (dim > static_cast<uint64_t>(INT64_MAX) ||
        !checked_mul(numel, static_cast<int64_t>(dim), &numel)) {
      return invalid_argument(source + ": " + where + ": field \"shape\" overflows");
    }
    t.shape.push_back(static_cast<int64_t>(dim));
  }
  int64_t n_bytes = 0;
  if (!checked_mul(numel, static_cast<int64_t>(t.element_size), &n_bytes)) {
    return invalid_argument(source + ": " + where + ": field \"shape\" " + shape_string(t.shape) +
                            " overflows in bytes");
  }

  auto off = e.find("data_offsets");
  if (off == e.end() || !off->is_array() || off->size() != 2) {
    return invalid_argument(source + ": " + where +
                            ": field \"data_offsets\" missing or not [begin, end]");
  }
  SPX_ASSIGN_OR_RETURN(t.begin, json_u64((*off)[0], source, where + ": field \"data_offsets\""));
  SPX_ASSIGN_OR_RETURN(t.end, json_u64((*off)[1], source, where + ": field \"data_offsets\""));
  if (t.begin > t.end) {
    return invalid_argument(source + ": " + where + ": field \"data_offsets\" [" +
                            std::to_string(t.begin) + ", " + std::to_string(t.end) +
                            "] has begin > end");
  }
  if (t.end > data_size) {
    return data_loss(source + ": " + where + ": field \"data_offsets\" [" +
                     std::to_string(t.begin) + ", " + std::to_string(t.end) +
                     "] beyond the data section (" + std::to_string(data_size) +
                     " bytes; truncated file?)");
  }
  if (t.end - t.begin != static_cast<uint64_t>(n_bytes)) {
    return invalid_argument(source + ": " + where + ": field \"data_offsets\" span " +
                            std::to_string(t.end - t.begin) + " bytes but shape " +
                            shape_string(t.shape) + " of " + t.dtype_name + " needs " +
                            std::to_string(n_bytes));
  }
  t.data = data_section + t.begin;
  return t;
}

}  // namespace

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated against overflow at parse time
  return n;
}

Result<std::shared_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> map, MappedFile::open(path));
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> f, parse(map->data(), map->size(), path));
  f->map_ = std::move(map);
  return f;
}

Result<std::shared_ptr<SafetensorsFile>> SafetensorsFile::parse(const uint8_t* data, size_t size,
                                                                std::string source) {
  if (size < 8) {
    return data_loss(source + ": truncated: file has " + std::to_string(size) +
                     " bytes, the header length alone needs 8");
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, data, 8);  // little-endian hosts only (x86-64, aarch64)
  if (header_len > size - 8) {
    return data_loss(source + ": truncated: header length " + std::to_string(header_len) +
                     " exceeds the file (" + std::to_string(size) + " bytes)");
  }
  if (header_len > kMaxHeaderBytes) {
    return invalid_argument(source + ": header length " + std::to_string(header_len) +
                            " is implausibly large");
  }
  if (header_len < 2 || data[8] != '{') {
    return invalid_argument(source + ": header is not a JSON object (corrupt header?)");
  }
  const std::string_view text(reinterpret_cast<const char*>(data + 8),
                              static_cast<size_t>(header_len));
  SPX_ASSIGN_OR_RETURN(nlohmann::json header,
                       loader_internal::parse_json(text, source + ": header"));
  if (!header.is_object()) return invalid_argument(source + ": header is not a JSON object");

  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->source_ = std::move(source);
  const uint8_t* data_section = data + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it->is_object()) {
          return invalid_argument(f->source_ + ": field \"__metadata__\" is not an object");
        }
        for (auto m = it->begin(); m != it->end(); ++m) {
          if (!m->is_string()) {
            return invalid_argument(f->source_ + ": field \"__metadata__\"." + quote_name(m.key()) +
                                    " is not a string");
          }
          f->metadata_[m.key()] = m->get<std::string>();
        }
        continue;
      }
      SPX_ASSIGN_OR_RETURN(SafetensorsTensor t,
                           parse_entry(it.key(), *it, data_section, data_size, f->source_));
      f->index_[t.name] = f->tensors_.size();
      f->tensors_.push_back(std::move(t));
    }
  } catch (const std::exception& e) {  // json accessors only throw on type errors we guard
    return invalid_argument(f->source_ + ": malformed header: " + e.what());
  }
  return f;
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::string_view safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
    case DType::kQ8_0: case DType::kQ4_0: case DType::kQ4_K: case DType::kQ5_K: case DType::kQ6_K: return "";
  }
  return "";
}

Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  std::string header_text;
  std::vector<uint64_t> sizes;
  try {
    nlohmann::json header = nlohmann::json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    std::set<std::string> seen;
    uint64_t offset = 0;
    for (const NamedTensor& t : tensors) {
      if (t.name.empty() || t.name == "__metadata__" || !seen.insert(t.name).second) {
        return invalid_argument(path + ": tensor name " + quote_name(t.name) +
                                " is empty, reserved or duplicated");
      }
      const std::string_view dn = safetensors_dtype_name(t.dtype);
      if (dn.empty()) {
        return unimplemented(path + ": tensor " + quote_name(t.name) + ": dtype " +
                             std::string(dtype_name(t.dtype)) + " has no safetensors encoding");
      }
      int64_t n = 1;
      for (int64_t d : t.shape) {
        if (!checked_mul(n, d, &n)) {
          return invalid_argument(path + ": tensor " + quote_name(t.name) + ": bad shape " +
                                  shape_string(t.shape));
        }
      }
      int64_t bytes = 0;
      if (!checked_mul(n, static_cast<int64_t>(dtype_size(t.dtype)), &bytes)) {
        return invalid_argument(path + ": tensor " + quote_name(t.name) + ": shape overflows");
      }
      if (bytes > 0 && t.data == nullptr) {
        return invalid_argument(path + ": tensor " + quote_name(t.name) + ": no data");
      }
      header[t.name] = {
          {"dtype", std::string(dn)},
          {"shape", t.shape},
          {"data_offsets", nlohmann::json::array({offset, offset + static_cast<uint64_t>(bytes)})}};
      offset += static_cast<uint64_t>(bytes);
      sizes.push_back(static_cast<uint64_t>(bytes));
    }
    header_text = header.dump();
  } catch (const std::exception& e) {  // e.g. a name that is not valid UTF-8
    return invalid_argument(path + ": cannot encode header: " + e.what());
  }
  // Pad with spaces (allowed by the format) so the data section starts 8-byte aligned.
  while ((8 + header_text.size()) % 8 != 0) header_text.push_back(' ');

  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) return not_found(path + ": cannot create: " + std::strerror(errno));
  const uint64_t len = header_text.size();
  bool ok = std::fwrite(&len, 8, 1, out) == 1 &&
            std::fwrite(header_text.data(), 1, header_text.size(), out) == header_text.size();
  for (size_t i = 0; ok && i < tensors.size(); ++i) {
    if (sizes[i] > 0) ok = std::fwrite(tensors[i].data, 1, sizes[i], out) == sizes[i];
  }
  ok = (std::fclose(out) == 0) && ok;
  if (!ok) return resource_exhausted(path + ": write failed: " + std::strerror(errno));
  return Status::ok();
}

}  // namespace specontext
