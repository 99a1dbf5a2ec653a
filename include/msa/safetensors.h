// Reading and writing the safetensors format (https://github.com/huggingface/safetensors):
// an 8-byte little-endian header length N, N bytes of JSON header
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data section; offsets are relative to the start of the data section.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "msa/tensor.h"

namespace msa {

// One .safetensors file, memory-mapped. The whole header is validated by open(); every
// failure is an msa::Error naming the file, what was expected and what came.
//
// Tensors returned by get() are zero-copy CPU views into the mapping, which they keep
// alive: they stay valid after the SafetensorsFile is destroyed. The mapping is private
// copy-on-write, so writing into a returned tensor changes this process's copy only,
// never the file. Exception: a tensor whose data is not aligned to its element size (a
// legal but unusual file) is copied into an aligned tensor of its own.
// Copying a SafetensorsFile is cheap (it shares the parsed header and the mapping).
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const;
  std::vector<std::string> names() const;  // sorted by name
  bool contains(const std::string& name) const;
  Tensor get(const std::string& name) const;  // unknown name -> msa::Error
  const std::map<std::string, std::string>& metadata() const;  // the "__metadata__" map

  struct Contents;  // the parsed header and the mapping (defined in the .cpp)

 private:
  explicit SafetensorsFile(std::shared_ptr<const Contents> contents);
  std::shared_ptr<const Contents> contents_;
};

// A model's weights: a single .safetensors file, or a directory holding either
// `model.safetensors` or the Hugging Face sharded layout `model.safetensors.index.json`
// ({"metadata": {...}, "weight_map": {tensor name: shard file name}}) plus its shards.
// open() opens every shard once and checks that every tensor of the weight map is in its
// shard, so get() never fails for a name in names().
class SafetensorsModel {
 public:
  static SafetensorsModel open(const std::string& path);

  const std::string& path() const;
  std::vector<std::string> names() const;  // sorted by name
  bool contains(const std::string& name) const;
  Tensor get(const std::string& name) const;  // unknown name -> msa::Error
  // The file's "__metadata__", or for a sharded model the index's "metadata"
  // (non-string values, e.g. "total_size", are kept as their JSON text).
  const std::map<std::string, std::string>& metadata() const;

  struct Contents;

 private:
  explicit SafetensorsModel(std::shared_ptr<const Contents> contents);
  std::shared_ptr<const Contents> contents_;
};

// Writes `tensors` (CPU, contiguous, unique non-empty names other than "__metadata__") to
// `path` in the standard layout that Python's `safetensors` reads: the header is padded
// with spaces to a multiple of 8 bytes, and the data is laid out largest element size
// first (stable otherwise) so that every tensor is aligned to its element size.
// Writes a new file `path + ".tmp.<pid>.<n>"` (never an existing one) and renames it, so
// `path` is never left half-written.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace msa
