// The safetensors reader: a model directory holding either one model.safetensors (the whole
// input) or a model.safetensors.index.json and one shard "a.safetensors" (the input split at
// the first "\n--shard--\n"). Every tensor the reader returns is read to its last byte
// (AddressSanitizer checks that it lies in the mapping). msa::Error is the expected outcome
// of bad input; anything else escaping, or a crash, is a finding.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "msa/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  using namespace msa;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const fs::path dir = fuzz::scratch_dir() / "model";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fuzz::Split parts = fuzz::split_at(input, "\n--shard--\n");
  if (parts.found) {
    fuzz::write_file(dir / "model.safetensors.index.json", parts.first);
    fuzz::write_file(dir / "a.safetensors", parts.second);
  } else {
    fuzz::write_file(dir / "model.safetensors", input);
  }
  try {
    const SafetensorsModel model = SafetensorsModel::open(dir.string());
    uint64_t checksum = 0;
    for (const std::string& name : model.names()) {
      const Tensor tensor = model.get(name);
      const auto* bytes = static_cast<const unsigned char*>(tensor.raw());
      for (size_t i = 0; i < tensor.nbytes(); ++i) checksum += bytes[i];
      checksum += static_cast<uint64_t>(first_non_finite(tensor) + 1);
    }
    for (const auto& [key, value] : model.metadata()) checksum += key.size() + value.size();
    if (checksum == 0xdeadbeef) std::fputs("", stderr);  // keep the reads
  } catch (const Error&) {
  }
  return 0;
}
