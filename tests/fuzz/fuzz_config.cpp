// The config.json loader. A config it accepts must also pass ModelConfig::validate() and
// survive a round trip through model_config_to_json unchanged (what make-model writes must
// read back as the same model).
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "msa/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace msa;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  ModelConfig config;
  try {
    config = parse_model_config(input, "fuzz config.json");
  } catch (const Error&) {
    return 0;
  }
  try {
    config.validate();
    const ModelConfig back = parse_model_config(model_config_to_json(config), "round trip");
    if (back.vocab_size != config.vocab_size || back.hidden_size != config.hidden_size ||
        back.num_layers != config.num_layers || back.head_dim != config.head_dim ||
        back.rotary_dim != config.rotary_dim || back.sparse_layers != config.sparse_layers ||
        back.moe_layers != config.moe_layers || back.topk_blocks != config.topk_blocks ||
        back.block_size != config.block_size || back.eos_token_ids != config.eos_token_ids ||
        back.bos_token_id != config.bos_token_id || back.rope_theta != config.rope_theta)
      fuzz::invariant_failed("config changed in a round trip through model_config_to_json");
  } catch (const Error& e) {
    fuzz::invariant_failed(std::string("an accepted config fails later: ") + e.what());
  }
  return 0;
}
