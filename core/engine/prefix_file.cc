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

using prefix_codec::Writer;

}  // namespace

std::vector<std::byte> encode_prefix_file(std::span<const TokenId> tokens, const PrefixSnapshot& s,
                                          uint64_t identity) {
  Writer w;
  prefix_codec::put_header(w, kMagic, kVersion);
  w.put(identity);
  w.put(s.tokens);
  prefix_codec::put_snapshot_layout(w, s);
  w.put_array(tokens);
  prefix_codec::put_snapshot_arrays(w, s);
  return w.finish();
}

Result<PrefixFile> parse_prefix_file(std::span<const std::byte> bytes, const std::string& name,
                                     bool header_only) {
  prefix_codec::Parser in(bytes, "prefix file", name);
  SPX_RETURN_IF_ERROR(
      prefix_codec::get_header(in, bytes, kMagic, kVersion, "file", /*check_crc=*/!header_only));
  PrefixFile f;
  PrefixSnapshot& s = f.snapshot;
  SPX_RETURN_IF_ERROR(in.get(&f.identity, "identity"));
  SPX_RETURN_IF_ERROR(in.get(&s.tokens, "tokens"));
  SPX_RETURN_IF_ERROR(prefix_codec::get_snapshot_layout(in, s));
  if (s.tokens <= 0 || s.page_size <= 0 || s.layers <= 0 || s.page_bytes == 0) {
    return in.bad("tokens", "and page_size, layers, page_bytes must be positive");
  }
  SPX_RETURN_IF_ERROR(in.get_array(&f.tokens, "token_ids"));
  if (static_cast<int64_t>(f.tokens.size()) != s.tokens) {
    return in.bad("token_ids", "holds " + std::to_string(f.tokens.size()) + " ids for " + std::to_string(s.tokens) +
                                   " tokens");
  }
  if (header_only) return f;
  SPX_RETURN_IF_ERROR(prefix_codec::get_snapshot_kv(in, s));
  SPX_RETURN_IF_ERROR(in.get_array(&s.head_keys, "head_keys"));
  SPX_RETURN_IF_ERROR(in.get_rows(&s.boundary_fused, "boundary_fused"));
  SPX_RETURN_IF_ERROR(in.get_rows(&s.quest_min, "quest_min"));
  SPX_RETURN_IF_ERROR(in.get_rows(&s.quest_max, "quest_max"));
  SPX_RETURN_IF_ERROR(prefix_codec::get_end(in));
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
