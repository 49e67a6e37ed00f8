#include "core/base/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace specontext {

Result<std::shared_ptr<MappedFile>> MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return not_found(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument(path + ": not a regular file");
  }
  std::shared_ptr<MappedFile> f(new MappedFile());
  f->path_ = path;
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return resource_exhausted(path + ": mmap failed: " + std::strerror(errno));
    }
    f->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return f;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

Status ByteReader::skip(size_t n, std::string_view what) {
  if (n > remaining()) {
    return data_loss(source_ + ": truncated while reading " + std::string(what) + " at byte " +
                     std::to_string(off_) + " (need " + std::to_string(n) + ", have " +
                     std::to_string(remaining()) + ")");
  }
  off_ += n;
  return Status::ok();
}

Status ByteReader::read_bytes(void* out, size_t n, std::string_view what) {
  const size_t at = off_;
  SPX_RETURN_IF_ERROR(skip(n, what));
  if (n > 0) std::memcpy(out, data_ + at, n);  // an empty array's data() may be null
  return Status::ok();
}

}  // namespace specontext
