// The chat-template renderer: the input up to its first NUL byte is a Jinja template, the
// rest the JSON context it renders with (a two-message conversation when there is no NUL).
// Parse errors, template errors and the renderer's work limit are msa::Error; a crash, an
// exhausted stack, a leak or a render that runs past the fuzzer's timeout is a finding.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "msa/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace msa;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const fuzz::Split parts = fuzz::split_at(input, std::string_view("\0", 1));
  const std::string_view context =
      parts.found ? parts.second
                  : R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                       "content": "hello"}], "add_generation_prompt": true, "bos_token": "<s>"})";
  try {
    const ChatTemplate chat_template = ChatTemplate::from_string(std::string(parts.first));
    // A smaller work limit than the default keeps every execution short (the limit's code
    // paths are the same; tests/test_hardening.cpp times the default one).
    chat_template.render_json(context, uint64_t{1} << 18);
  } catch (const Error&) {
  }
  return 0;
}
