// Reading a whole small text file (config.json, tokenizer.json, an index, a template).
#pragma once
#include <cstdint>
#include <string>

namespace msa {

inline constexpr uint64_t kMaxTextFileBytes = 1ull << 30;

// The bytes of the regular file `path`. Throws msa::Error starting with `what` (e.g.
// "model config 'DIR/config.json'") when it cannot be opened, is not a regular file (a FIFO
// would block, /dev/zero never ends) or holds more than `max_bytes`.
std::string read_text_file(const std::string& path, const std::string& what,
                           uint64_t max_bytes = kMaxTextFileBytes);

// Writes `text` to `path` whole or not at all: into a new file next to it, then renamed
// over it. Throws msa::Error starting with `what` when that fails.
void write_text_file(const std::string& path, const std::string& text, const std::string& what);

// Creates directory `path` and its parents; throws msa::Error starting with `what`.
void create_directories(const std::string& path, const std::string& what);

}  // namespace msa
