// The processes of `msa run --tp N --device cuda` (docs/parallel.md): one per GPU, rank r on
// device r, joined by NCCL.
//
// The parent is rank 0. It makes the NCCL unique id, writes it (128 bytes) to a file in a
// private temporary directory (mkdtemp, mode 0700) and starts ranks 1..N-1 as this
// executable (/proc/self/exe) with its own `run` arguments plus `--rank r --nccl-id FILE`;
// their stdout goes to /dev/null (rank 0 prints the tokens), their stderr stays (errors show).
// Every rank then creates its communicator (make_nccl_communicator) and runs the same steps.
#pragma once
#include <sys/types.h>

#include <string>
#include <vector>

#include "msa/communicator.h"

namespace msa::cli {

class TpProcesses {
 public:
  // Rank 0 of `world`: writes the id and starts the other ranks; `run_args` are the run
  // command's arguments (argv of `run`: run_args[0] is "run").
  static TpProcesses start(int world, const std::vector<std::string>& run_args);
  // Rank `rank` started by a parent: reads the id from `id_file`.
  static TpProcesses join(int rank, int world, const std::string& id_file);
  ~TpProcesses();  // a parent that has not waited stops its children (SIGTERM) and reaps them
  TpProcesses(TpProcesses&& other) noexcept;
  TpProcesses(const TpProcesses&) = delete;
  TpProcesses& operator=(const TpProcesses&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  const NcclUniqueId& id() const { return id_; }
  // Parent: waits for every child; throws msa::Error naming the ranks that failed.
  void wait();

 private:
  TpProcesses() = default;
  int rank_ = 0, world_ = 1;
  NcclUniqueId id_;
  std::string id_dir_;  // parent: the private directory holding the id file (removed after)
  std::vector<pid_t> children_;
};

}  // namespace msa::cli
