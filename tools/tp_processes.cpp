// One process per GPU for `msa run --tp N --device cuda` (see tp_processes.h).
#include "tp_processes.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "msa/error.h"

namespace msa::cli {

TpProcesses TpProcesses::start(int world, const std::vector<std::string>& run_args) {
  TpProcesses p;
  p.rank_ = 0;
  p.world_ = world;
  p.id_ = make_nccl_unique_id();
  if (world == 1) return p;  // one rank: nothing to start, nothing to share
  std::string pattern = (std::filesystem::temp_directory_path() / "msa-tp-XXXXXX").string();
  if (!mkdtemp(pattern.data()))
    throw Error("--tp: cannot create a private temporary directory for the NCCL id (" + pattern +
                "): " + std::strerror(errno));
  p.id_dir_ = pattern;
  const std::string id_file = p.id_dir_ + "/nccl-id";
  {
    std::ofstream out(id_file, std::ios::binary);
    out.write(reinterpret_cast<const char*>(p.id_.bytes), sizeof(p.id_.bytes));
    if (!out) throw Error("--tp: cannot write the NCCL id to " + id_file);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 1; r < world; ++r) {
    std::vector<std::string> args = {"msa"};
    args.insert(args.end(), run_args.begin(), run_args.end());
    for (const std::string& extra : {std::string("--rank"), std::to_string(r), std::string("--nccl-id"), id_file})
      args.push_back(extra);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) throw Error(std::string("--tp: fork failed: ") + std::strerror(errno));
    if (pid == 0) {
      // The child: only rank 0 prints the generated tokens.
      const int null = open("/dev/null", O_WRONLY);
      if (null >= 0) dup2(null, STDOUT_FILENO);
      execv("/proc/self/exe", argv.data());
      std::fprintf(stderr, "msa run --tp: rank %d: exec failed: %s\n", r, std::strerror(errno));
      _exit(127);
    }
    p.children_.push_back(pid);
  }
  return p;
}

TpProcesses TpProcesses::join(int rank, int world, const std::string& id_file) {
  TpProcesses p;
  p.rank_ = rank;
  p.world_ = world;
  std::ifstream in(id_file, std::ios::binary);
  in.read(reinterpret_cast<char*>(p.id_.bytes), sizeof(p.id_.bytes));
  if (!in || in.gcount() != static_cast<std::streamsize>(sizeof(p.id_.bytes)))
    throw_arg_error("--nccl-id", "a file of the " + std::to_string(sizeof(p.id_.bytes)) + "-byte NCCL id",
                    id_file);
  return p;
}

TpProcesses::TpProcesses(TpProcesses&& other) noexcept
    : rank_(other.rank_),
      world_(other.world_),
      id_(other.id_),
      id_dir_(std::move(other.id_dir_)),
      children_(std::move(other.children_)) {
  other.id_dir_.clear();
  other.children_.clear();
}

void TpProcesses::wait() {
  std::string failed;
  for (size_t i = 0; i < children_.size(); ++i) {
    int status = 0;
    if (waitpid(children_[i], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
      failed += (failed.empty() ? "" : ", ") + std::to_string(i + 1);
  }
  children_.clear();
  if (!failed.empty()) throw Error("--tp: rank(s) " + failed + " failed (their errors are on stderr above)");
}

TpProcesses::~TpProcesses() {
  // Rank 0 failed before its children finished: they would wait in NCCL for it forever.
  for (pid_t pid : children_) kill(pid, SIGTERM);
  for (pid_t pid : children_) waitpid(pid, nullptr, 0);
  if (!id_dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(id_dir_, ignored);
  }
}

}  // namespace msa::cli
