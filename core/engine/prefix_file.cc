#include "core/engine/prefix_file.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include "core/base/mapped_file.h"
#include "core/engine/prefix_codec.h"

namespace specontext {
namespace {

constexpr char kMagic[8] = {'S', 'P', 'X', 'P', 'R', 'E', 'F', '1'};
constexpr uint32_t kVersion = 2;  // 2: the identity after the version

using prefix_codec::crc32_of;
using prefix_codec::Writer;

}  // namespace

std::vector<std::byte> encode_prefix_file(std::span<const TokenId> tokens, const PrefixSnapshot& s,
                                          uint64_t identity) {
  Writer w;
  for (char c : kMagic) w.put(c);
  w.put(kVersion);
  w.put(identity);
  w.put(s.tokens);
  w.put(s.page_size);
  w.put(s.layers);
  w.put(s.page_bytes);
  w.put(static_cast<uint8_t>(s.kv_dtype));
  w.put(static_cast<uint8_t>(s.method));
  w.put_array(tokens);
  w.put_array(std::span<const std::byte>(s.kv));
  w.put_array(std::span<const float>(s.head_keys));
  w.put_rows(s.boundary_fused);
  w.put_rows(s.quest_min);
  w.put_rows(s.quest_max);
  w.put(crc32_of(w.bytes().data(), w.bytes().size()));
  return std::move(w.bytes());
}

Result<PrefixFile> parse_prefix_file(std::span<const std::byte> bytes, const std::string& name,
                                     bool header_only) {
  prefix_codec::Parser in(bytes, "prefix file", name);
  char magic[sizeof(kMagic)];
  SPX_RETURN_IF_ERROR(in.get(&magic, "magic"));
  if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) return in.bad("magic", "is not SPXPREF1");
  uint32_t version = 0;
  SPX_RETURN_IF_ERROR(in.get(&version, "version"));
  if (version != kVersion) {
    return in.bad("version", "is " + std::to_string(version) + ", this build reads " + std::to_string(kVersion));
  }
  // The checksum first: a corrupt file is named as such rather than by whichever field broke.
  if (bytes.size() < sizeof(kMagic) + 2 * sizeof(uint32_t)) return in.bad("crc32", "is missing: the file is truncated");
  const size_t body = bytes.size() - sizeof(uint32_t);
  if (!header_only) {
    uint32_t stored = 0;
    std::memcpy(&stored, bytes.data() + body, sizeof(stored));
    if (const uint32_t actual = crc32_of(bytes.data(), body); actual != stored) {
      return in.bad("crc32", "does not match the contents (stored " + std::to_string(stored) + ", computed " +
                                 std::to_string(actual) + "): the file is corrupt or truncated");
    }
  }
  PrefixFile f;
  PrefixSnapshot& s = f.snapshot;
  uint8_t dtype = 0, method = 0;
  SPX_RETURN_IF_ERROR(in.get(&f.identity, "identity"));
  SPX_RETURN_IF_ERROR(in.get(&s.tokens, "tokens"));
  SPX_RETURN_IF_ERROR(in.get(&s.page_size, "page_size"));
  SPX_RETURN_IF_ERROR(in.get(&s.layers, "layers"));
  SPX_RETURN_IF_ERROR(in.get(&s.page_bytes, "page_bytes"));
  SPX_RETURN_IF_ERROR(in.get(&dtype, "kv_dtype"));
  SPX_RETURN_IF_ERROR(in.get(&method, "method"));
  if (dtype > static_cast<uint8_t>(DType::kU8)) return in.bad("kv_dtype", "is " + std::to_string(dtype) + ", no dtype");
  if (method > static_cast<uint8_t>(SparseMethod::kOracle)) {
    return in.bad("method", "is " + std::to_string(method) + ", no sparse method");
  }
  s.kv_dtype = static_cast<DType>(dtype);
  s.method = static_cast<SparseMethod>(method);
  if (s.tokens <= 0 || s.page_size <= 0 || s.layers <= 0 || s.page_bytes == 0) {
    return in.bad("tokens", "and page_size, layers, page_bytes must be positive");
  }
  SPX_RETURN_IF_ERROR(in.get_array(&f.tokens, "token_ids"));
  if (static_cast<int64_t>(f.tokens.size()) != s.tokens) {
    return in.bad("token_ids", "holds " + std::to_string(f.tokens.size()) + " ids for " + std::to_string(s.tokens) +
                                   " tokens");
  }
  if (header_only) return f;
  SPX_RETURN_IF_ERROR(in.get_array(&s.kv, "kv"));
  // layers × whole pages × page_bytes, computed without overflow.
  const uint64_t pages = static_cast<uint64_t>(s.tokens / s.page_size);
  const uint64_t kv_len = s.kv.size();
  if (pages == 0 || kv_len / s.page_bytes / pages != static_cast<uint64_t>(s.layers) || kv_len % (s.page_bytes * pages) != 0) {
    return in.bad("kv", "holds " + std::to_string(kv_len) + " bytes, not layers × pages × page_bytes");
  }
  SPX_RETURN_IF_ERROR(in.get_array(&s.head_keys, "head_keys"));
  SPX_RETURN_IF_ERROR(in.get_rows(&s.boundary_fused, "boundary_fused"));
  SPX_RETURN_IF_ERROR(in.get_rows(&s.quest_min, "quest_min"));
  SPX_RETURN_IF_ERROR(in.get_rows(&s.quest_max, "quest_max"));
  if (in.remaining() != sizeof(uint32_t)) {
    return in.bad("crc32", "is not where the contents end (" + std::to_string(in.remaining()) + " bytes left)");
  }
  return f;
}

Status write_prefix_file(const std::string& path, std::span<const std::byte> encoded) {
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(encoded.data()), static_cast<std::streamsize>(encoded.size()));
    out.close();
    if (!out) {
      const std::string why = std::strerror(errno);
      std::remove(partial.c_str());
      return unavailable("cannot write prefix file " + partial + ": " + why);
    }
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(partial.c_str());
    return unavailable("cannot rename prefix file " + partial + " to " + path + ": " + why);
  }
  return Status::ok();
}

Result<PrefixFile> read_prefix_file(const std::string& path, bool header_only) {
  SPX_ASSIGN_OR_RETURN(auto file, MappedFile::open(path));  // header_only touches the first pages only
  return parse_prefix_file(std::span(reinterpret_cast<const std::byte*>(file->data()), file->size()), path,
                           header_only);
}

Result<FileLock> FileLock::acquire(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return unavailable("cannot open lock file " + path + ": " + std::strerror(errno));
  // flock locks belong to the open file description: a second open in this process conflicts too.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) return unavailable("lock file " + path + " is held by another process");
    return unavailable("cannot lock " + path + ": " + std::strerror(err));
  }
  return FileLock(fd);
}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the lock
}

}  // namespace specontext
