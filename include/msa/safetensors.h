// Reading and writing the safetensors format (https://github.com/huggingface/safetensors):
// an 8-byte little-endian header length N, N bytes of JSON header
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data section; offsets are relative to the start of the data section.
#pragma once
#include <functional>
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
  // The .safetensors file (a shard, or the single file) that holds `name`.
  const std::string& file_path(const std::string& name) const;  // unknown name -> msa::Error
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

// One tensor of a file written by save_safetensors_streamed: its name, dtype and shape.
struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
};
// Fills bytes [offset, offset + bytes) of tensor `index`'s data into `data`. Called in the
// order the tensors are written, each tensor's chunks in increasing offset order.
using SafetensorsFill = std::function<void(size_t index, int64_t offset, void* data, int64_t bytes)>;

// save_safetensors for data that is produced while it is written (a checkpoint larger than
// memory): the header comes from `tensors`, then each tensor's data is asked of `fill` a
// chunk of at most `chunk_bytes` (a multiple of 8) at a time and written, so at most one
// chunk is held. The same layout, order and atomic rename as save_safetensors.
void save_safetensors_streamed(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                               const std::map<std::string, std::string>& metadata,
                               const SafetensorsFill& fill, int64_t chunk_bytes = int64_t{64} << 20);

}  // namespace msa
