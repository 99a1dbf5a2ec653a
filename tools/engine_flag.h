// --backward-engine, --attention-engine (msa bench): automatic|wgmma|mma_sync, a kernel engine
// choice (msa::cuda::Engine) named on the command line.
#pragma once
#include <initializer_list>
#include <string>

#include "cli_args.h"
#include "msa/cuda/types.h"

namespace msa::cli {

// The engine `text` names, or a UsageError naming `flag`.
inline cuda::Engine parse_engine_flag(const std::string& text, const std::string& flag) {
  for (const cuda::Engine engine : {cuda::Engine::automatic, cuda::Engine::wgmma, cuda::Engine::mma_sync})
    if (text == cuda::engine_name(engine)) return engine;
  throw UsageError(flag + ": expected automatic, wgmma or mma_sync, got \"" + text + "\"");
}

}  // namespace msa::cli
