// The msa subcommands. Each takes the arguments after `msa` (argv[0] is the subcommand's
// own name) and returns the process exit code: 0 success, 2 bad usage or bad input.
#pragma once

// CMake defines MSA_VERSION from the project version.
#ifndef MSA_VERSION
#define MSA_VERSION "0.1.0"
#endif

namespace msa::cli {
inline constexpr const char* kVersion = MSA_VERSION;
}  // namespace msa::cli

int run_op_command(int argc, char** argv);     // msa op NAME --in ... --out ...
int run_bench_command(int argc, char** argv);  // msa bench ... (tools/bench_command.cpp)
// The MiniMax-M3 text runtime (tools/model_commands.cpp).
int run_make_model_command(int argc, char** argv);  // msa make-model --config ... --out DIR
int run_logits_command(int argc, char** argv);      // msa logits --model DIR --tokens ...
int run_run_command(int argc, char** argv);         // msa run --model DIR --prompt-tokens ...
int run_vision_encode_command(int argc, char** argv);  // msa vision-encode --model DIR --pixels ...
// The vision tower's media input (tools/media_command.cpp).
int run_preprocess_command(int argc, char** argv);  // msa preprocess --image F | --video V ...
// Attention maps over a span of tokens (tools/attn_map_command.cpp).
int run_attn_map_command(int argc, char** argv);    // msa attn-map --model DIR --span A:B ...
#ifdef MSA_WITH_SERVE
int run_serve_command(int argc, char** argv);        // msa serve (tools/serve/serve_command.cpp)
int run_bench_serve_command(int argc, char** argv);  // msa bench-serve (tools/serve/bench_serve.cpp)
#endif
int run_bench_vision_command(int argc, char** argv);  // msa bench-model --vision (tools/bench_vision.cpp)
#ifdef MSA_WITH_CUDA
int run_bench_model_command(int argc, char** argv);  // msa bench-model (tools/bench_model_cuda.cpp)
#endif
