#include "core/text_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "msa/error.h"

namespace msa {

std::string read_text_file(const std::string& path, const std::string& what, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO must not hang; fstat then rejects anything not regular.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) MSA_FAIL(what, ": cannot open: ", std::strerror(errno));
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    MSA_FAIL(what, ": expected a regular file, got something else (directory, device, FIFO)");
  }
  if (static_cast<uint64_t>(info.st_size) > max_bytes) {
    ::close(fd);
    MSA_FAIL(what, ": expected at most ", max_bytes, " bytes, got ", info.st_size, " bytes");
  }
  std::string text(static_cast<size_t>(info.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(fd, text.data() + done, text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int read_errno = errno;
      ::close(fd);
      MSA_FAIL(what, ": read error: ", std::strerror(read_errno));
    }
    if (got == 0) break;  // the file shrank while being read
    done += static_cast<size_t>(got);
  }
  ::close(fd);
  text.resize(done);
  return text;
}

}  // namespace msa
