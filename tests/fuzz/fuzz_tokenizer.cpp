// tokenizer.json loading and encoding.
//   With a NUL byte: the part before it is a tokenizer.json, the part after a text to
//   encode (and decode) with it when it loads.
//   Without: the input is a text for the tokenizer `msa make-model` writes (byte-level BPE,
//   M3's special tokens). Valid UTF-8 must decode back to itself exactly (byte-level BPE
//   loses nothing); invalid UTF-8 must be refused with msa::Error.
#include <cstddef>
#include <cstdint>
#include <optional>

#include "fuzz_util.h"
#include "msa/model_config.h"
#include "msa/model_random.h"
#include "msa/tokenizer.h"

namespace {

const msa::Tokenizer& made_tokenizer() {
  static const msa::Tokenizer tokenizer = [] {
    const std::filesystem::path dir = msa::fuzz::scratch_dir() / "made_tokenizer";
    msa::ModelConfig config = msa::model_config_preset("tiny");
    config.vocab_size = 2048;  // room for merges beyond the byte alphabet
    msa::write_random_tokenizer(config, dir.string());
    return msa::Tokenizer::from_model_dir(dir.string());
  }();
  return tokenizer;
}

bool is_utf8(std::string_view text) {
  try {
    made_tokenizer().encode(text);
    return true;
  } catch (const msa::Error&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  made_tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace msa;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const fuzz::Split parts = fuzz::split_at(input, std::string_view("\0", 1));
  if (parts.found) {
    std::optional<Tokenizer> tokenizer;
    try {
      tokenizer = Tokenizer::from_json_string(parts.first, "fuzz tokenizer.json");
    } catch (const Error&) {
      return 0;
    }
    try {
      const std::vector<int32_t> ids = tokenizer->encode(parts.second, /*add_special_tokens=*/true);
      tokenizer->decode(ids, /*skip_special_tokens=*/true);
      tokenizer->decode(ids);
      for (int32_t id : ids)
        if (id < 0) fuzz::invariant_failed("encode returned a negative id");
    } catch (const Error&) {
    }
    return 0;
  }
  const Tokenizer& tokenizer = made_tokenizer();
  std::vector<int32_t> ids;
  try {
    ids = tokenizer.encode(input);
  } catch (const Error&) {
    if (is_utf8(input)) fuzz::invariant_failed("valid UTF-8 refused");
    return 0;
  }
  const std::string back = tokenizer.decode(ids);
  if (back != input) fuzz::invariant_failed("decode(encode(text)) != text");
  return 0;
}
