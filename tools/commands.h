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
