// safetensors: memory-mapped reading with full header validation, sharded model
// directories, and atomic writing. Nothing here trusts a byte of the file: every size and
// offset is checked against the mapping before it is used.
#include "msa/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "core/json_parse.h"
#include "core/text_file.h"

namespace msa {

using json = nlohmann::json;

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // a guard against absurd lengths
constexpr const char* kMetadataKey = "__metadata__";

template <class Expected, class Got>
[[noreturn]] void file_error(const std::string& path, const std::string& what,
                             const Expected& expected, const Got& got) {
  MSA_FAIL("safetensors file '", path, "': ", what, ": expected ", expected, ", got ", got);
}

std::string json_type_and_text(const json& value) { return json_excerpt(value); }

// The whole file mapped private copy-on-write; the returned owner unmaps it.
std::shared_ptr<void> map_file(const std::string& path, uint64_t& size) {
  // O_NONBLOCK: opening a FIFO must not hang; fstat then rejects anything not regular.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) MSA_FAIL("safetensors file '", path, "': cannot open: ", std::strerror(errno));
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    file_error(path, "file type", "a regular file", "something else (directory, device, ...)");
  }
  size = static_cast<uint64_t>(info.st_size);
  if (size < 8) {
    ::close(fd);
    file_error(path, "file size", "at least 8 bytes (the header length)",
               std::to_string(size) + " bytes");
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (base == MAP_FAILED)
    MSA_FAIL("safetensors file '", path, "': cannot map ", size,
             " bytes: ", std::strerror(map_errno));
  return std::shared_ptr<void>(base, [size](void* p) { ::munmap(p, size); });
}

uint64_t read_u64_le(const unsigned char* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

void write_u64_le(uint64_t value, unsigned char* bytes) {
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(value >> (8 * i));
}

std::string list_names(const std::vector<std::string>& names) {
  std::string out;
  const size_t shown = std::min<size_t>(names.size(), 10);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > shown) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return names.empty() ? "none" : out;
}

}  // namespace

// ---------------------------------------------------------------- SafetensorsFile

struct SafetensorsFile::Contents {
  struct Entry {
    DType dtype;
    Shape shape;
    uint64_t begin;  // byte offsets into the data section
    uint64_t end;
  };
  std::string path;
  std::shared_ptr<void> mapping;
  std::byte* data = nullptr;  // start of the data section
  uint64_t data_size = 0;
  std::map<std::string, Entry> entries;
  std::map<std::string, std::string> metadata;
};

namespace {

using Entry = SafetensorsFile::Contents::Entry;

std::map<std::string, std::string> parse_metadata(const std::string& path, const json& value) {
  if (!value.is_object())
    file_error(path, "\"__metadata__\"", "an object of strings", json_type_and_text(value));
  std::map<std::string, std::string> out;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string())
      file_error(path, "\"__metadata__\" entry '" + key + "'", "a string",
                 json_type_and_text(item));
    out.emplace(key, item.get<std::string>());
  }
  return out;
}

uint64_t byte_count(const std::string& path, const std::string& what, const Shape& shape,
                    DType dtype) {
  uint64_t bytes = dtype_size(dtype);
  for (int64_t extent : shape)
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(extent), &bytes))
      file_error(path, what + " shape", "a size that fits in 64 bits", shape_string(shape));
  return bytes;
}

Entry parse_entry(const std::string& path, const std::string& name, const json& value,
                  uint64_t data_size) {
  const std::string what = "tensor '" + name + "'";
  if (!value.is_object())
    file_error(path, what, "an object with dtype, shape, data_offsets", json_type_and_text(value));
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!value.contains(field))
      file_error(path, what, std::string("a field \"") + field + "\"", json_type_and_text(value));

  const json& dtype_json = value["dtype"];
  if (!dtype_json.is_string())
    file_error(path, what + " dtype", "a string", json_type_and_text(dtype_json));
  Entry entry{};
  try {
    entry.dtype = dtype_from_safetensors_name(dtype_json.get<std::string>());
  } catch (const Error&) {
    file_error(path, what + " dtype", "one of F32, F64, BF16, F16, F8_E4M3, I32, I64, U8",
               dtype_json.dump());
  }

  const json& shape_json = value["shape"];
  if (!shape_json.is_array())
    file_error(path, what + " shape", "an array of integers", json_type_and_text(shape_json));
  for (const json& extent : shape_json) {
    if (!extent.is_number_integer())
      file_error(path, what + " shape", "an array of integers", json_type_and_text(shape_json));
    if (extent.is_number_unsigned()) {
      if (extent.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        file_error(path, what + " shape", "extents below 2^63", shape_json.dump());
    } else if (extent.get<int64_t>() < 0) {
      file_error(path, what + " shape", "non-negative extents", shape_json.dump());
    }
    entry.shape.push_back(extent.get<int64_t>());
  }

  const json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    file_error(path, what + " data_offsets", "[begin, end] with non-negative integers",
               json_type_and_text(offsets));
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.begin > entry.end)
    file_error(path, what + " data_offsets", "begin <= end", offsets.dump());
  if (entry.end > data_size)
    file_error(path, what + " data_offsets",
               "end within the data section of " + std::to_string(data_size) +
                   " bytes (is the file truncated?)",
               offsets.dump());
  const uint64_t bytes = byte_count(path, what, entry.shape, entry.dtype);
  if (entry.end - entry.begin != bytes)
    file_error(path, what + " data_offsets",
               "a range of " + std::to_string(bytes) + " bytes for " +
                   std::string(dtype_safetensors_name(entry.dtype)) + " " +
                   shape_string(entry.shape),
               std::to_string(entry.end - entry.begin) + " bytes " + offsets.dump());
  return entry;
}

void check_no_overlap(const std::string& path, const std::map<std::string, Entry>& entries) {
  std::vector<std::pair<const std::string*, const Entry*>> ranges;
  for (const auto& [name, entry] : entries)
    if (entry.end > entry.begin) ranges.emplace_back(&name, &entry);
  std::sort(ranges.begin(), ranges.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const auto& [prev_name, prev] = ranges[i - 1];
    const auto& [name, entry] = ranges[i];
    if (entry->begin < prev->end)
      file_error(path, "tensor '" + *name + "' data_offsets",
                 "no overlap with tensor '" + *prev_name + "' [" + std::to_string(prev->begin) +
                     ", " + std::to_string(prev->end) + ")",
                 "[" + std::to_string(entry->begin) + ", " + std::to_string(entry->end) + ")");
  }
}

}  // namespace

SafetensorsFile::SafetensorsFile(std::shared_ptr<const Contents> contents)
    : contents_(std::move(contents)) {}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  auto contents = std::make_shared<Contents>();
  contents->path = path;
  uint64_t file_size = 0;
  contents->mapping = map_file(path, file_size);
  const auto* bytes = static_cast<const unsigned char*>(contents->mapping.get());

  const uint64_t header_size = read_u64_le(bytes);
  if (header_size > kMaxHeaderBytes)
    file_error(path, "header length", "at most 100 MiB", std::to_string(header_size) + " bytes");
  if (header_size > file_size - 8)
    file_error(path, "header length",
               "at most the " + std::to_string(file_size - 8) +
                   " bytes after the length field (is the file truncated?)",
               std::to_string(header_size) + " bytes");

  json header;
  try {
    header = parse_json_limited(
        std::string_view(reinterpret_cast<const char*>(bytes + 8), header_size));
  } catch (const JsonParseError& e) {
    file_error(path, "header",
               "valid JSON nested at most " + std::to_string(kMaxJsonDepth) + " levels deep",
               e.what());
  }
  if (!header.is_object()) file_error(path, "header", "a JSON object", json_type_and_text(header));

  contents->data = static_cast<std::byte*>(contents->mapping.get()) + 8 + header_size;
  contents->data_size = file_size - 8 - header_size;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey)
      contents->metadata = parse_metadata(path, value);
    else
      contents->entries.emplace(name, parse_entry(path, name, value, contents->data_size));
  }
  check_no_overlap(path, contents->entries);
  return SafetensorsFile(std::move(contents));
}

const std::string& SafetensorsFile::path() const { return contents_->path; }

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& entry : contents_->entries) out.push_back(entry.first);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const {
  return contents_->entries.count(name) != 0;
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const auto found = contents_->entries.find(name);
  if (found == contents_->entries.end())
    MSA_FAIL("safetensors file '", contents_->path, "': no tensor named '", name,
             "' (it holds: ", list_names(names()), ")");
  const Entry& entry = found->second;
  std::byte* data = contents_->data + entry.begin;
  if (reinterpret_cast<uintptr_t>(data) % dtype_size(entry.dtype) != 0) {
    Tensor aligned = Tensor::zeros(entry.shape, entry.dtype);
    std::memcpy(aligned.raw(), data, entry.end - entry.begin);
    return aligned;
  }
  return Tensor::wrap(data, entry.shape, entry.dtype, contents_->mapping);
}

const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return contents_->metadata;
}

// ---------------------------------------------------------------- SafetensorsModel

struct SafetensorsModel::Contents {
  std::string path;
  std::vector<SafetensorsFile> files;
  std::map<std::string, size_t> file_of_tensor;  // index into `files`
  std::map<std::string, std::string> metadata;
};

namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

template <class Expected, class Got>
[[noreturn]] void index_error(const std::string& path, const std::string& what,
                              const Expected& expected, const Got& got) {
  MSA_FAIL("safetensors index '", path, "': ", what, ": expected ", expected, ", got ", got);
}

json read_index(const std::string& path) {
  const std::string text = read_text_file(path, "safetensors index '" + path + "'");
  try {
    return parse_json_limited(text);
  } catch (const JsonParseError& e) {
    index_error(path, "contents",
                "valid JSON nested at most " + std::to_string(kMaxJsonDepth) + " levels deep",
                e.what());
  }
}

void check_shard_name(const std::string& index_path, const std::string& tensor,
                      const std::string& shard) {
  if (shard.empty() || shard.find('/') != std::string::npos ||
      shard.find('\\') != std::string::npos || shard.find("..") != std::string::npos)
    index_error(index_path, "weight_map entry '" + tensor + "'",
                "a plain file name in the index's directory (no '/', '\\' or '..')",
                "\"" + shard + "\"");
}

void load_sharded(SafetensorsModel::Contents& model, const std::string& directory) {
  const std::string index_path = directory + "/" + kIndexName;
  const json index = read_index(index_path);
  if (!index.is_object()) index_error(index_path, "contents", "a JSON object", json_type_and_text(index));
  if (index.contains("metadata")) {
    const json& metadata = index["metadata"];
    if (!metadata.is_object() && !metadata.is_null())
      index_error(index_path, "\"metadata\"", "an object", json_type_and_text(metadata));
    if (metadata.is_object())
      for (const auto& [key, value] : metadata.items())
        model.metadata.emplace(key, value.is_string() ? value.get<std::string>() : value.dump());
  }
  if (!index.contains("weight_map") || !index["weight_map"].is_object())
    index_error(index_path, "\"weight_map\"", "an object {tensor name: shard file name}",
                index.contains("weight_map") ? json_type_and_text(index["weight_map"])
                                             : std::string("no such field"));

  std::map<std::string, size_t> file_of_shard;
  for (const auto& [tensor, shard_json] : index["weight_map"].items()) {
    if (!shard_json.is_string())
      index_error(index_path, "weight_map entry '" + tensor + "'", "a shard file name",
                  json_type_and_text(shard_json));
    const std::string shard = shard_json.get<std::string>();
    check_shard_name(index_path, tensor, shard);
    auto found = file_of_shard.find(shard);
    if (found == file_of_shard.end()) {
      const std::string shard_path = directory + "/" + shard;
      std::error_code status_error;  // e.g. a name too long for the file system
      if (!std::filesystem::is_regular_file(shard_path, status_error))
        index_error(index_path, "shard '" + shard + "' (holding tensor '" + tensor + "')",
                    "a file '" + shard_path + "'", "no such file");
      model.files.push_back(SafetensorsFile::open(shard_path));
      found = file_of_shard.emplace(shard, model.files.size() - 1).first;
    }
    if (!model.files[found->second].contains(tensor))
      index_error(index_path, "weight_map entry '" + tensor + "'",
                  "the tensor in shard '" + shard + "'", "a shard without it");
    model.file_of_tensor.emplace(tensor, found->second);
  }
}

void load_single(SafetensorsModel::Contents& model, const std::string& file_path) {
  model.files.push_back(SafetensorsFile::open(file_path));
  for (const std::string& name : model.files.back().names()) model.file_of_tensor.emplace(name, 0);
  model.metadata = model.files.back().metadata();
}

}  // namespace

SafetensorsModel::SafetensorsModel(std::shared_ptr<const Contents> contents)
    : contents_(std::move(contents)) {}

SafetensorsModel SafetensorsModel::open(const std::string& path) {
  namespace fs = std::filesystem;
  auto contents = std::make_shared<Contents>();
  contents->path = path;
  std::error_code ignored;
  if (fs::is_directory(path, ignored)) {
    if (fs::exists(path + "/" + kIndexName, ignored))
      load_sharded(*contents, path);
    else if (fs::exists(path + "/" + kSingleName, ignored))
      load_single(*contents, path + "/" + kSingleName);
    else
      MSA_FAIL("safetensors model '", path, "': expected a directory with ", kIndexName, " or ",
               kSingleName, ", got neither");
  } else {
    load_single(*contents, path);
  }
  return SafetensorsModel(std::move(contents));
}

const std::string& SafetensorsModel::path() const { return contents_->path; }

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  for (const auto& entry : contents_->file_of_tensor) out.push_back(entry.first);
  return out;
}

bool SafetensorsModel::contains(const std::string& name) const {
  return contents_->file_of_tensor.count(name) != 0;
}

Tensor SafetensorsModel::get(const std::string& name) const {
  const auto found = contents_->file_of_tensor.find(name);
  if (found == contents_->file_of_tensor.end())
    MSA_FAIL("safetensors model '", contents_->path, "': no tensor named '", name,
             "' (it holds: ", list_names(names()), ")");
  return contents_->files[found->second].get(name);
}

const std::string& SafetensorsModel::file_path(const std::string& name) const {
  const auto found = contents_->file_of_tensor.find(name);
  if (found == contents_->file_of_tensor.end())
    MSA_FAIL("safetensors model '", contents_->path, "': no tensor named '", name, "'");
  return contents_->files[found->second].path();
}

const std::map<std::string, std::string>& SafetensorsModel::metadata() const {
  return contents_->metadata;
}

// ---------------------------------------------------------------- writing

namespace {

std::string build_header(const std::vector<SafetensorsEntry>& tensors,
                         const std::vector<size_t>& order,
                         const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (size_t i : order) {
    const SafetensorsEntry& tensor = tensors[i];
    const uint64_t end = offset + static_cast<uint64_t>(shape_numel(tensor.shape)) * dtype_size(tensor.dtype);
    header[tensor.name] = {{"dtype", std::string(dtype_safetensors_name(tensor.dtype))},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    MSA_FAIL("save_safetensors: tensor names and metadata must be valid UTF-8: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd, bytes, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      MSA_FAIL("save_safetensors: cannot write '", path, "': ", std::strerror(errno));
    }
    bytes += written;
    size -= static_cast<size_t>(written);
  }
}

void check_entries(const std::vector<SafetensorsEntry>& tensors) {
  std::map<std::string, int> seen;
  for (const SafetensorsEntry& tensor : tensors) {
    const std::string& name = tensor.name;
    MSA_CHECK_ARG(!name.empty() && name != kMetadataKey, "tensor name",
                  "a non-empty name other than \"__metadata__\"", "\"" + name + "\"");
    MSA_CHECK_ARG(++seen[name] == 1, "tensor name", "unique names", "'" + name + "' twice");
    for (int64_t extent : tensor.shape)
      MSA_CHECK_ARG(extent >= 0, "shape of '" + name + "'", "non-negative extents", shape_string(tensor.shape));
    shape_numel(tensor.shape);  // throws when the size does not fit
  }
}

void check_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  for (const auto& [name, tensor] : tensors) {
    const std::string what = "tensors['" + name + "']";
    MSA_CHECK_ARG(tensor.defined(), what, "a defined tensor", "an empty Tensor()");
    MSA_CHECK_ARG(tensor.device() == Device::cpu, what, "a cpu tensor",
                  device_name(tensor.device()));
    MSA_CHECK_ARG(tensor.is_contiguous(), what, "a contiguous tensor",
                  "strides " + shape_string(tensor.strides()));
  }
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  check_tensors(tensors);
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) entries.push_back({name, tensor.dtype(), tensor.shape()});
  save_safetensors_streamed(path, entries, metadata,
                            [&](size_t index, int64_t offset, void* data, int64_t bytes) {
                              std::memcpy(data, static_cast<const char*>(tensors[index].second.raw()) + offset,
                                          static_cast<size_t>(bytes));
                            });
}

void save_safetensors_streamed(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                               const std::map<std::string, std::string>& metadata,
                               const SafetensorsFill& fill, int64_t chunk_bytes) {
  check_entries(tensors);
  MSA_CHECK_ARG(chunk_bytes >= 8 && chunk_bytes % 8 == 0, "chunk_bytes", "a positive multiple of 8",
                chunk_bytes);
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors[a].dtype) > dtype_size(tensors[b].dtype);
  });
  const std::string header = build_header(tensors, order, metadata);

  // A fresh name next to `path`, created exclusively: a fixed name such as path + ".tmp"
  // would truncate whatever file of the user's already has it (or follow a symlink there).
  std::string temp_path;
  int fd = -1;
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    temp_path = path + ".tmp." + std::to_string(::getpid()) + "." +
                std::to_string(counter.fetch_add(1));
    fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0)
    MSA_FAIL("save_safetensors: cannot create '", temp_path, "': ", std::strerror(errno));
  bool fd_open = true;
  try {
    unsigned char length[8];
    write_u64_le(header.size(), length);
    write_all(fd, length, sizeof length, temp_path);
    write_all(fd, header.data(), header.size(), temp_path);
    // One chunk buffer for the whole file: a tensor of several GB is filled and written a
    // chunk at a time (chunks are whole elements: chunk_bytes is a multiple of 8).
    int64_t largest = 0;
    for (const SafetensorsEntry& tensor : tensors)
      largest = std::max(largest, shape_numel(tensor.shape) * static_cast<int64_t>(dtype_size(tensor.dtype)));
    std::vector<char> buffer(static_cast<size_t>(std::min(largest, chunk_bytes)));
    for (size_t i : order) {
      const int64_t total = shape_numel(tensors[i].shape) * static_cast<int64_t>(dtype_size(tensors[i].dtype));
      for (int64_t offset = 0; offset < total; offset += chunk_bytes) {
        const int64_t bytes = std::min(chunk_bytes, total - offset);
        fill(i, offset, buffer.data(), bytes);
        write_all(fd, buffer.data(), static_cast<size_t>(bytes), temp_path);
      }
    }
    if (::fsync(fd) != 0)
      MSA_FAIL("save_safetensors: cannot flush '", temp_path, "': ", std::strerror(errno));
    fd_open = false;
    if (::close(fd) != 0)
      MSA_FAIL("save_safetensors: cannot close '", temp_path, "': ", std::strerror(errno));
  } catch (...) {
    if (fd_open) ::close(fd);
    ::unlink(temp_path.c_str());
    throw;
  }
  if (::rename(temp_path.c_str(), path.c_str()) != 0) {
    const int rename_errno = errno;
    ::unlink(temp_path.c_str());
    MSA_FAIL("save_safetensors: cannot rename '", temp_path, "' to '", path,
             "': ", std::strerror(rename_errno));
  }
}

}  // namespace msa
