// Running the `msa` binary from the tests (test_cli.cpp, test_model.cpp, test_cuda_model.cpp):
// MSA_CLI_PATH names it (msa_test_uses_cli in tests/CMakeLists.txt), and scratch directories
// of this process, removed when the tests end.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "msa/model_random.h"
#include "test_util.h"

#ifndef MSA_CLI_PATH
#error "MSA_CLI_PATH must name the msa binary (set in tests/CMakeLists.txt)"
#endif

namespace msa::testing {

// `arg` as one shell word.
inline std::string shell_quote(const std::string& arg) {
  std::string out = "'";
  for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Scratch directories of this process, removed when the tests end.
inline std::vector<std::filesystem::path>& scratch_dirs() {
  static std::vector<std::filesystem::path> dirs;
  return dirs;
}

class RemoveScratchDirs : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const std::filesystem::path& dir : scratch_dirs()) std::filesystem::remove_all(dir);
  }
};
inline ::testing::Environment* const kRemoveScratchDirs =
    ::testing::AddGlobalTestEnvironment(new RemoveScratchDirs);

// An empty directory <gtest TempDir>/msa_<name>_<pid>, removed when the tests end.
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("msa_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  scratch_dirs().push_back(dir);
  return dir;
}

// A made checkpoint of the preset `preset` (random weights from `seed`, floats in `dtype`) in
// fresh_dir(folder), written on the first call for that folder in this process; later calls
// return the same path. Thread-safe: the ranks of a parallel test ask for it at once.
inline const std::filesystem::path& made_model_dir(const std::string& folder, const std::string& preset,
                                                   uint64_t seed, DType dtype) {
  static std::mutex mutex;
  static std::map<std::string, std::filesystem::path> made;  // node-based: references stay valid
  const std::lock_guard<std::mutex> lock(mutex);
  auto found = made.find(folder);
  if (found != made.end()) return found->second;
  const std::filesystem::path dir = fresh_dir(folder);
  write_random_checkpoint(model_config_preset(preset), dir.string(), {.seed = seed, .dtype = dtype});
  return made.emplace(folder, dir).first->second;
}

struct CliResult {
  int exit_code = -1;    // -1: the tool did not exit normally
  std::string out, err;  // err stays empty when merged into out
};

// Runs `msa <args>` through the shell (`args` is shell text: quote what needs quoting) with
// its stdout and stderr captured in files of `dir`; with merge_stderr, stderr goes into
// `out` in the order written.
inline CliResult run_cli(const std::string& args, const std::filesystem::path& dir, bool merge_stderr) {
  const std::string out = (dir / "stdout.txt").string(), err = (dir / "stderr.txt").string();
  const std::string command = shell_quote(MSA_CLI_PATH) + " " + args + " >" + shell_quote(out) +
                              (merge_stderr ? " 2>&1" : " 2>" + shell_quote(err));
  const int status = std::system(command.c_str());
  CliResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.out = read_bytes(out);
  if (!merge_stderr) result.err = read_bytes(err);
  return result;
}

// `msa <args>` in a fresh scratch directory, stdout and stderr together in `out`.
inline CliResult run_cli(const std::string& args) {
  return run_cli(args, fresh_dir("cli_out"), /*merge_stderr=*/true);
}

// `msa make-model --config CONFIG --seed SEED` into a fresh scratch folder NAME/CONFIG (a
// failure is reported); returns the model's folder. Tests keep the result in a static.
inline std::string make_model_with_cli(const std::string& config, int seed, const std::string& name) {
  const std::filesystem::path dir = fresh_dir(name) / config;
  const CliResult made = run_cli("make-model --config " + config + " --seed " + std::to_string(seed) +
                                 " --out " + shell_quote(dir.string()));
  EXPECT_EQ(made.exit_code, 0) << made.out;
  return dir.string();
}

}  // namespace msa::testing
