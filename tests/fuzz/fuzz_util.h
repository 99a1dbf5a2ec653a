// Helpers of the libFuzzer targets: a scratch directory per process for inputs that must be
// files, and the split of one input into parts.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>

#include "msa/error.h"

namespace msa::fuzz {

// An empty directory of this process (on /dev/shm when there is one: the targets write a
// file per input), removed at exit.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    namespace fs = std::filesystem;
    const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    const fs::path made = base / ("msa_fuzz_" + std::to_string(::getpid()));
    fs::remove_all(made);
    fs::create_directories(made);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(scratch_dir(), ignored);
    });
    return made;
  }();
  return dir;
}

inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The input up to the first occurrence of `separator`, and what follows it (nullopt-like
// empty second part and found = false when there is none).
struct Split {
  std::string_view first, second;
  bool found = false;
};
inline Split split_at(std::string_view input, std::string_view separator) {
  const size_t at = input.find(separator);
  if (at == std::string_view::npos) return {input, {}, false};
  return {input.substr(0, at), input.substr(at + separator.size()), true};
}

// A finding that is not a crash: a broken invariant. Aborts so that libFuzzer records it.
[[noreturn]] inline void invariant_failed(const std::string& what) {
  std::fprintf(stderr, "invariant failed: %s\n", what.c_str());
  std::abort();
}

}  // namespace msa::fuzz
