// PyTorch zip checkpoints: the zip central directory (bounded, STORED entries only), data.pkl
// through core/model/torch_pickle.h, and every tensor view checked against its storage entry.
#include "core/model/torch_zip.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include "core/model/loader_internal.h"
#include "core/model/torch_pickle.h"

namespace specontext {

namespace {

using loader_internal::checked_mul;
using loader_internal::shape_string;

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kEnd64Sig = 0x06064b50;
constexpr uint32_t kLocator64Sig = 0x07064b50;
constexpr uint64_t kLocalSize = 30, kCentralSize = 46, kEndSize = 22, kLocatorSize = 20, kEnd64Size = 56;
constexpr uint64_t kMaxComment = 0xFFFF;
constexpr uint64_t kMaxEntries = uint64_t{1} << 20;
constexpr uint64_t kMaxPickleBytes = uint64_t{256} << 20;
constexpr uint32_t kZip64Marker = 0xFFFFFFFF;
constexpr size_t kStorageAlignment = 64;  // what torch.save aligns payloads to

uint64_t le(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(p[k]) << (8 * k);
  return v;
}
uint32_t le32(const uint8_t* p) { return static_cast<uint32_t>(le(p, 4)); }
uint16_t le16(const uint8_t* p) { return static_cast<uint16_t>(le(p, 2)); }

struct ZipEntry {
  std::string name;
  uint64_t offset = 0;  // of the payload in the archive
  uint64_t size = 0;
  uint32_t crc = 0;
};

// Where the central directory lies: [offset, offset + size) must end before `limit`, the
// first end record.
struct CentralDirectory {
  uint64_t offset = 0, size = 0, count = 0, limit = 0;
};

// A bounds-checked view of the archive; every error names the file.
class Archive {
 public:
  Archive(const uint8_t* data, uint64_t size, const std::string& source)
      : data_(data), size_(size), source_(source) {}

  Status error(const std::string& what) const { return invalid_argument(source_ + ": " + what); }

  Result<std::vector<ZipEntry>> read_directory() const {
    SPX_ASSIGN_OR_RETURN(uint64_t end, find_end_record());
    SPX_ASSIGN_OR_RETURN(CentralDirectory cd, read_end_records(end));
    std::vector<ZipEntry> entries;
    std::set<std::string> names;
    uint64_t pos = cd.offset;
    for (uint64_t k = 0; k < cd.count; ++k) {
      SPX_ASSIGN_OR_RETURN(ZipEntry e, read_central_entry(cd, &pos));
      if (!names.insert(e.name).second) return error("zip entry '" + e.name + "' appears twice");
      entries.push_back(std::move(e));
    }
    return entries;
  }

  uint32_t crc_of(const ZipEntry& e) const {
    uLong crc = crc32(0L, Z_NULL, 0);
    constexpr uint64_t kPiece = uint64_t{1} << 30;
    for (uint64_t at = 0; at < e.size; at += kPiece) {
      crc = crc32(crc, data_ + e.offset + at, static_cast<uInt>(std::min(kPiece, e.size - at)));
    }
    return static_cast<uint32_t>(crc);
  }

 private:
  // The end-of-central-directory record: its comment must reach exactly the end of the file.
  Result<uint64_t> find_end_record() const {
    if (size_ < kEndSize) return error("too short for a zip archive (truncated?)");
    const uint64_t lowest = size_ - kEndSize > kMaxComment ? size_ - kEndSize - kMaxComment : 0;
    for (uint64_t p = size_ - kEndSize + 1; p-- > lowest;) {
      if (le32(data_ + p) == kEndSig && p + kEndSize + le16(data_ + p + 20) == size_) return p;
    }
    return error("no zip end-of-central-directory record (not a PyTorch zip checkpoint, or truncated)");
  }

  Result<CentralDirectory> read_end_records(uint64_t end) const {
    const uint8_t* r = data_ + end;
    CentralDirectory cd{le32(r + 16), le32(r + 12), le16(r + 10), end};
    const bool multi_disk = le16(r + 4) != 0 || le16(r + 6) != 0 || le16(r + 8) != le16(r + 10);
    if (end >= kLocatorSize && le32(data_ + end - kLocatorSize) == kLocator64Sig) {
      SPX_ASSIGN_OR_RETURN(cd, read_zip64_end(end - kLocatorSize));
    } else if (cd.count == 0xFFFF || cd.size == kZip64Marker || cd.offset == kZip64Marker) {
      return error("zip end record defers to a ZIP64 record that is not there");
    } else if (multi_disk) {
      return error("multi-disk zip archives are not supported");
    }
    if (cd.offset > cd.limit || cd.size > cd.limit - cd.offset) {
      return error("zip central directory (offset " + std::to_string(cd.offset) + ", " +
                   std::to_string(cd.size) + " bytes) lies outside the file");
    }
    if (cd.count > kMaxEntries || cd.count > cd.size / kCentralSize) {
      return error("zip central directory claims " + std::to_string(cd.count) + " entries in " +
                   std::to_string(cd.size) + " bytes");
    }
    return cd;
  }

  Result<CentralDirectory> read_zip64_end(uint64_t locator) const {
    const uint8_t* l = data_ + locator;
    if (le32(l + 4) != 0 || le32(l + 16) > 1) return error("multi-disk zip archives are not supported");
    const uint64_t at = le(l + 8, 8);
    if (at > locator || locator - at < kEnd64Size)
      return error("ZIP64 end record offset lies outside the file");
    const uint8_t* r = data_ + at;
    if (le32(r) != kEnd64Sig) return error("ZIP64 locator does not point at a ZIP64 end record");
    if (le32(r + 16) != 0 || le32(r + 20) != 0 || le(r + 24, 8) != le(r + 32, 8)) {
      return error("multi-disk zip archives are not supported");
    }
    return CentralDirectory{le(r + 48, 8), le(r + 40, 8), le(r + 32, 8), at};
  }

  // Fields the ZIP64 extra field (id 1) replaces when the 32-bit field holds 0xFFFFFFFF, in order.
  Status read_zip64_extra(uint64_t at, uint64_t len, uint64_t* usize, uint64_t* csize,
                          uint64_t* local) const {
    const uint64_t end = at + len;
    while (end - at >= 4) {
      const uint64_t id = le16(data_ + at), n = le16(data_ + at + 2);
      if (n > end - at - 4) return error("zip extra field runs past its entry");
      if (id == 1) {
        uint64_t q = at + 4;
        for (uint64_t* field : {usize, csize, local}) {
          if (*field != kZip64Marker) continue;
          if (at + 4 + n - q < 8) return error("ZIP64 extra field is too short");
          *field = le(data_ + q, 8);
          q += 8;
        }
      }
      at += 4 + n;
    }
    return Status::ok();
  }

  Result<ZipEntry> read_central_entry(const CentralDirectory& cd, uint64_t* pos) const {
    const uint64_t end = cd.offset + cd.size;
    if (end - *pos < kCentralSize) return error("zip central directory is truncated");
    const uint8_t* h = data_ + *pos;
    if (le32(h) != kCentralSig) return error("zip central directory entry has a bad signature");
    const uint64_t flags = le16(h + 8), method = le16(h + 10), nlen = le16(h + 28), elen = le16(h + 30),
                   clen = le16(h + 32);
    uint64_t csize = le32(h + 20), usize = le32(h + 24), local = le32(h + 42);
    if (kCentralSize + nlen + elen + clen > end - *pos)
      return error("zip central directory entry runs past its end");
    ZipEntry e;
    e.name.assign(reinterpret_cast<const char*>(h + kCentralSize), nlen);
    e.crc = le32(h + 16);
    SPX_RETURN_IF_ERROR(read_zip64_extra(*pos + kCentralSize + nlen, elen, &usize, &csize, &local));
    *pos += kCentralSize + nlen + elen + clen;
    const std::string what = "zip entry '" + e.name + "'";
    if (nlen == 0) return error("zip entry with an empty name");
    if (flags & 1) return error(what + " is encrypted");
    if (method != 0) {
      return unimplemented(source_ + ": " + what + " is compressed (method " + std::to_string(method) +
                           "); torch.save writes uncompressed (STORED) entries: re-save the checkpoint with "
                           "torch.save, or convert it to safetensors");
    }
    if (csize != usize) return error(what + " is stored but its two sizes differ");
    // The local header: its own name and extra lengths place the payload.
    if (local > cd.offset || cd.offset - local < kLocalSize)
      return error(what + ": local header offset out of range");
    const uint8_t* lh = data_ + local;
    if (le32(lh) != kLocalSig) return error(what + ": local header has a bad signature");
    const uint64_t lnlen = le16(lh + 26), lelen = le16(lh + 28);
    if (kLocalSize + lnlen + lelen > cd.offset - local)
      return error(what + ": local header runs into the central directory");
    if (lnlen != nlen || std::memcmp(lh + kLocalSize, e.name.data(), nlen) != 0) {
      return error(what + ": local header names another entry");
    }
    e.offset = local + kLocalSize + lnlen + lelen;
    if (usize > cd.offset - e.offset)
      return error(what + ": its " + std::to_string(usize) + " bytes run past the data");
    e.size = usize;
    return e;
  }

  const uint8_t* data_;
  uint64_t size_;
  const std::string& source_;
};

// One tensor: a contiguous view inside its storage entry, elements aligned.
Result<SafetensorsTensor> make_tensor(const TorchTensorRecord& r, const ZipEntry& storage,
                                      const uint8_t* base, const std::string& source) {
  const TorchStorageType& type = *r.storage_type;
  const std::string what = source + ": tensor '" + r.name + "'";
  const int64_t es = static_cast<int64_t>(type.element_size);
  int64_t storage_bytes = 0;
  if (!checked_mul(r.storage_numel, es, &storage_bytes) ||
      static_cast<uint64_t>(storage_bytes) > storage.size) {
    return invalid_argument(what + ": storage '" + r.storage_key + "' holds " + std::to_string(storage.size) +
                            " bytes, not " + std::to_string(r.storage_numel) + " elements of " +
                            std::to_string(es));
  }
  int64_t numel = 1;
  for (int64_t d : r.shape) {
    if (!checked_mul(numel, d, &numel))
      return invalid_argument(what + ": shape " + shape_string(r.shape) + " overflows");
  }
  // Contiguous (row-major) strides; a dimension of size 1 may have any stride, as in torch.
  int64_t expect = 1;
  for (size_t k = r.shape.size(); k-- > 0 && numel > 0;) {
    if (r.shape[k] != 1 && r.stride[k] != expect) {
      return invalid_argument(what + ": strides " + shape_string(r.stride) +
                              " are not contiguous for shape " + shape_string(r.shape) +
                              " (only contiguous tensors are read: save t.contiguous())");
    }
    expect *= r.shape[k];  // <= numel: no overflow
  }
  if (r.storage_offset > r.storage_numel || numel > r.storage_numel - r.storage_offset) {
    return invalid_argument(what + ": offset " + std::to_string(r.storage_offset) + " + " +
                            std::to_string(numel) + " elements run past storage '" + r.storage_key + "' of " +
                            std::to_string(r.storage_numel) + " elements");
  }
  SafetensorsTensor t;
  t.name = r.name;
  t.dtype_name = type.dtype_name;
  t.element_size = type.element_size;
  t.supported = type.supported;
  t.dtype = type.dtype;
  t.shape = r.shape;
  t.begin = storage.offset + static_cast<uint64_t>(r.storage_offset * es);  // < storage_bytes: no overflow
  t.end = t.begin + static_cast<uint64_t>(numel * es);
  t.data = base + t.begin;
  if (reinterpret_cast<uintptr_t>(t.data) % type.element_size != 0) {
    return invalid_argument(what + ": data at byte " + std::to_string(t.begin) + " is not aligned to its " +
                            std::to_string(es) + "-byte elements (torch.save aligns storages to 64 bytes)");
  }
  return t;
}

}  // namespace

bool is_zip_magic(const uint8_t* data, size_t size) { return size >= 4 && le32(data) == kLocalSig; }

bool is_legacy_torch_magic(const uint8_t* data, size_t size) {
  // PROTO 2, LONG1 of 10 bytes: torch.serialization.MAGIC_NUMBER 0x1950a86a20f9469cfc6c.
  static const uint8_t kMagic[] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c,
                                   0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
  return size >= sizeof kMagic && std::memcmp(data, kMagic, sizeof kMagic) == 0;
}

const SafetensorsTensor* TorchZipFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Result<std::shared_ptr<TorchZipFile>> TorchZipFile::open(const std::string& path) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> map, MappedFile::open(path));
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<TorchZipFile> f, parse(map->data(), map->size(), path));
  f->map_ = std::move(map);
  return f;
}

Result<std::shared_ptr<TorchZipFile>> TorchZipFile::parse(const uint8_t* data, size_t size,
                                                          std::string source, bool verify_crc) {
  if (is_legacy_torch_magic(data, size)) {
    return unimplemented(
        source +
        ": PyTorch's legacy (pre-1.6, non-zip) checkpoint format is not supported; re-save it "
        "with torch.save in PyTorch >= 1.6 (the default zip format) or convert it to safetensors");
  }
  const Archive archive(data, size, source);
  SPX_ASSIGN_OR_RETURN(std::vector<ZipEntry> entries, archive.read_directory());
  if (entries.empty()) return archive.error("empty zip archive");
  // Like torch's reader: the archive's folder is the first entry's up to its first '/'.
  const size_t slash = entries.front().name.find('/');
  if (slash == std::string::npos)
    return archive.error("first zip entry '" + entries.front().name + "' has no folder");
  const std::string prefix = entries.front().name.substr(0, slash + 1);
  std::map<std::string, const ZipEntry*> by_name;
  for (const ZipEntry& e : entries) by_name[e.name] = &e;
  std::set<const ZipEntry*> verified;
  auto entry = [&](const std::string& name) -> Result<const ZipEntry*> {
    auto it = by_name.find(prefix + name);
    if (it == by_name.end()) return not_found(source + ": zip entry '" + prefix + name + "' is missing");
    if (verify_crc && verified.insert(it->second).second && archive.crc_of(*it->second) != it->second->crc) {
      return data_loss(source + ": zip entry '" + prefix + name + "' fails its CRC-32 check (corrupt file)");
    }
    return it->second;
  };

  if (by_name.count(prefix + "byteorder")) {
    SPX_ASSIGN_OR_RETURN(const ZipEntry* bo, entry("byteorder"));
    const std::string order(reinterpret_cast<const char*>(data + bo->offset), bo->size);
    if (order != "little")
      return unimplemented(source + ": byteorder '" + order + "' (only little-endian is read)");
  }
  SPX_ASSIGN_OR_RETURN(const ZipEntry* pkl, entry("data.pkl"));
  if (pkl->size > kMaxPickleBytes)
    return archive.error("data.pkl of " + std::to_string(pkl->size) + " bytes is too large");
  SPX_ASSIGN_OR_RETURN(std::vector<TorchTensorRecord> records,
                       read_torch_pickle(data + pkl->offset, pkl->size, source));

  auto f = std::shared_ptr<TorchZipFile>(new TorchZipFile());
  f->source_ = source;  // `archive` and `entry` keep naming `source`
  for (const TorchTensorRecord& r : records) {
    SPX_ASSIGN_OR_RETURN(const ZipEntry* storage, entry("data/" + r.storage_key));
    SPX_ASSIGN_OR_RETURN(SafetensorsTensor t, make_tensor(r, *storage, data, f->source_));
    f->tensors_.push_back(std::move(t));
  }
  std::sort(f->tensors_.begin(), f->tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) { return a.name < b.name; });
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->index_[f->tensors_[i].name] = i;
  return f;
}

std::string make_stored_zip(const std::vector<std::pair<std::string, std::string>>& entries, bool zip64) {
  auto put = [](std::string* out, uint64_t v, int n) {
    for (int k = 0; k < n; ++k) out->push_back(static_cast<char>((v >> (8 * k)) & 0xFF));
  };
  std::string out, central;
  for (const auto& [name, bytes] : entries) {
    const uint64_t local = out.size();
    const uint32_t crc = static_cast<uint32_t>(crc32(
        crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
    const size_t unpadded = out.size() + kLocalSize + name.size() + 4;
    const size_t pad = (kStorageAlignment - unpadded % kStorageAlignment) % kStorageAlignment;
    put(&out, kLocalSig, 4);
    put(&out, 20, 2);  // version needed
    put(&out, 0, 2);   // flags
    put(&out, 0, 2);   // STORED
    put(&out, 0, 4);   // time, date
    put(&out, crc, 4);
    put(&out, bytes.size(), 4);
    put(&out, bytes.size(), 4);
    put(&out, name.size(), 2);
    put(&out, 4 + pad, 2);
    out += name;
    put(&out, 0x4246, 2);  // "FB": torch's padding field
    put(&out, pad, 2);
    out.append(pad, 'Z');
    out += bytes;

    put(&central, kCentralSig, 4);
    put(&central, 20, 2);  // version made by
    put(&central, 20, 2);  // version needed
    put(&central, 0, 2);
    put(&central, 0, 2);
    put(&central, 0, 4);
    put(&central, crc, 4);
    put(&central, zip64 ? kZip64Marker : bytes.size(), 4);
    put(&central, zip64 ? kZip64Marker : bytes.size(), 4);
    put(&central, name.size(), 2);
    put(&central, zip64 ? 28 : 0, 2);  // extra
    put(&central, 0, 2);               // comment
    put(&central, 0, 2);               // disk
    put(&central, 0, 2);               // internal attributes
    put(&central, 0, 4);               // external attributes
    put(&central, zip64 ? kZip64Marker : local, 4);
    central += name;
    if (zip64) {  // what a writer puts for entries past 4 GiB: the real values in extra field 1
      put(&central, 1, 2);
      put(&central, 24, 2);
      put(&central, bytes.size(), 8);
      put(&central, bytes.size(), 8);
      put(&central, local, 8);
    }
  }
  const uint64_t cd_offset = out.size();
  out += central;
  if (zip64) {  // ZIP64 end record and its locator, then an end record deferring to them
    const uint64_t end64 = out.size();
    put(&out, kEnd64Sig, 4);
    put(&out, kEnd64Size - 12, 8);  // size of the rest of the record
    put(&out, 45, 2);               // version made by
    put(&out, 45, 2);               // version needed
    put(&out, 0, 8);                // disk numbers
    put(&out, entries.size(), 8);
    put(&out, entries.size(), 8);
    put(&out, central.size(), 8);
    put(&out, cd_offset, 8);
    put(&out, kLocator64Sig, 4);
    put(&out, 0, 4);
    put(&out, end64, 8);
    put(&out, 1, 4);  // total disks
  }
  put(&out, kEndSig, 4);
  put(&out, 0, 4);  // disk numbers
  put(&out, zip64 ? 0xFFFF : entries.size(), 2);
  put(&out, zip64 ? 0xFFFF : entries.size(), 2);
  put(&out, zip64 ? kZip64Marker : central.size(), 4);
  put(&out, zip64 ? kZip64Marker : cd_offset, 4);
  put(&out, 0, 2);  // comment
  return out;
}

}  // namespace specontext
