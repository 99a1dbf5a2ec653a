#include "core/text_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

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

void write_text_file(const std::string& path, const std::string& text, const std::string& what) {
  std::string temp_path;
  int fd = -1;
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    temp_path = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
    fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) MSA_FAIL(what, ": cannot create '", temp_path, "': ", std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t wrote = ::write(fd, text.data() + done, text.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote < 0) {
      const int write_errno = errno;
      ::close(fd);
      ::unlink(temp_path.c_str());
      MSA_FAIL(what, ": cannot write '", temp_path, "': ", std::strerror(write_errno));
    }
    done += static_cast<size_t>(wrote);
  }
  if (::close(fd) != 0 || ::rename(temp_path.c_str(), path.c_str()) != 0) {
    const int rename_errno = errno;
    ::unlink(temp_path.c_str());
    MSA_FAIL(what, ": cannot write '", path, "': ", std::strerror(rename_errno));
  }
}

void create_directories(const std::string& path, const std::string& what) {
  std::error_code error;
  std::filesystem::create_directories(path, error);
  if (error) MSA_FAIL(what, ": cannot create the directory '", path, "': ", error.message());
}

}  // namespace msa
