#include "core/base/private_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace specontext {

Result<std::string> read_private_file(const std::string& file, size_t max_bytes, const std::string& what) {
  const std::string label = what + " " + file;
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return invalid_argument(label + ": " + std::strerror(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return invalid_argument(label + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return invalid_argument(label + ": not a regular file");
  if ((st.st_mode & 077) != 0) {
    return invalid_argument(label + ": readable by group or others (chmod 600 " + file + ")");
  }
  if (st.st_size > static_cast<off_t>(max_bytes)) {
    return invalid_argument(label + ": longer than " + std::to_string(max_bytes) + " bytes");
  }
  std::string text(max_bytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return invalid_argument(label + ": " + std::strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got > max_bytes) return invalid_argument(label + ": longer than " + std::to_string(max_bytes) + " bytes");
  text.resize(got);
  return text;
}

}  // namespace specontext
