// Made checkpoints for the loader tests: a random checkpoint of a preset in a fresh folder, and
// a copy of one with its tensors edited (corrupt or mixed inputs).
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cli_runner.h"
#include "msa/model_random.h"
#include "msa/safetensors.h"

namespace msa::testing {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

inline std::filesystem::path made_checkpoint(const std::string& name, const std::string& preset,
                                             CheckpointFormat format, int64_t shard_bytes = 0, uint64_t seed = 7) {
  const std::filesystem::path dir = fresh_dir(name);
  write_random_checkpoint(model_config_preset(preset), dir.string(),
                          {.seed = seed, .dtype = DType::bf16, .shard_bytes = shard_bytes, .format = format});
  return dir;
}

// A one-file copy of the checkpoint at `source` (one file or sharded) in the fresh folder
// `name`, its tensors passed through `edit`.
inline std::filesystem::path edited_checkpoint(const std::filesystem::path& source, const std::string& name,
                                               const std::function<void(NamedTensors&)>& edit) {
  const std::filesystem::path dir = fresh_dir(name);
  std::filesystem::copy_file(source / "config.json", dir / "config.json");
  const SafetensorsModel file = SafetensorsModel::open(source.string());
  NamedTensors tensors;
  for (const std::string& tensor : file.names()) tensors.emplace_back(tensor, file.get(tensor).clone());
  edit(tensors);
  save_safetensors((dir / "model.safetensors").string(), tensors);
  return dir;
}

}  // namespace msa::testing
