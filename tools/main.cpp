// `msa`: dispatches to the subcommands in commands.h.
#include <cstdio>
#include <cstring>
#include <exception>

#include "commands.h"

namespace {

constexpr const char* kUsage =
    "usage: msa <command> [arguments]\n"
    "\n"
    "commands:\n"
    "  op NAME --in IN.safetensors --out OUT.safetensors [options]\n"
    "                 run one MSA op on tensors from a file (msa op --help lists the ops)\n"
    "  bench [options]  time the ops on random inputs (msa bench --help)\n"
    "  make-model --config tiny|small|m3-layer|tiny-vl|m3-vision|tiny-tp|tiny-tp-cuda|m3-full --out DIR\n"
    "                 write a randomly initialised MiniMax-M3-shaped checkpoint\n"
    "  logits --model DIR --tokens 1,2,3 --out OUT.safetensors [--pixels P.safetensors]\n"
    "                 the f32 logits of one prefill (with images / videos)\n"
    "  vision-encode --model DIR --pixels P.safetensors --out OUT.safetensors\n"
    "                 the vision tower's and projector's outputs for images / videos\n"
    "  run --model DIR --prompt-tokens 1,2,3 [--max-tokens N ...]\n"
    "                 generate tokens (msa run --help)\n"
    "  preprocess (--image FILE | --video FILE|DIR) --out OUT.safetensors [--model DIR]\n"
    "                 an image's or a video's pixel patches for the vision tower (--help)\n"
    "  attn-map --model DIR (--prompt TEXT | --tokens 1,2,3) --span A:B --grid RxC --out DIR\n"
    "                 per-layer attention maps of the text over a span of tokens: JSON and\n"
    "                 PNGs (msa attn-map --help, docs/attention-maps.md)\n"
#ifdef MSA_WITH_SERVE
    "  serve --model DIR [--port 8000 ...]\n"
    "                 an OpenAI-compatible server (msa serve --help, docs/serve.md)\n"
    "  bench-serve --model DIR [options]\n"
    "                 throughput, TTFT and TPOT of the server under load (--help)\n"
#endif
#ifdef MSA_WITH_CUDA
    "  bench-model --device cuda [options]\n"
    "                 per-layer GPU times of the text model at long contexts (--help)\n"
#endif
    "  bench-model --vision [--device cuda|cpu] [options]\n"
    "                 per-layer times of the vision tower on an image and a video (--help)\n"
    "  version        print the version\n"
    "  help           print this text\n";

}  // namespace

namespace {

int dispatch(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const char* command = argv[1];
  if (!std::strcmp(command, "op")) return run_op_command(argc - 1, argv + 1);
  if (!std::strcmp(command, "bench")) return run_bench_command(argc - 1, argv + 1);
  if (!std::strcmp(command, "make-model")) return run_make_model_command(argc - 1, argv + 1);
  if (!std::strcmp(command, "logits")) return run_logits_command(argc - 1, argv + 1);
  if (!std::strcmp(command, "run")) return run_run_command(argc - 1, argv + 1);
  if (!std::strcmp(command, "vision-encode")) return run_vision_encode_command(argc - 1, argv + 1);
  if (!std::strcmp(command, "preprocess")) return run_preprocess_command(argc - 1, argv + 1);
  if (!std::strcmp(command, "attn-map")) return run_attn_map_command(argc - 1, argv + 1);
#ifdef MSA_WITH_SERVE
  if (!std::strcmp(command, "serve")) return run_serve_command(argc - 1, argv + 1);
  if (!std::strcmp(command, "bench-serve")) return run_bench_serve_command(argc - 1, argv + 1);
#endif
  if (!std::strcmp(command, "bench-model")) {
    // --vision: the vision tower's bench (CPU or CUDA); else the text model's (CUDA).
    for (int i = 2; i < argc; ++i)
      if (!std::strcmp(argv[i], "--vision")) return run_bench_vision_command(argc - 1, argv + 1);
#ifdef MSA_WITH_CUDA
    return run_bench_model_command(argc - 1, argv + 1);
#else
    std::fputs("msa bench-model: error: the text model's bench needs a CUDA build (configure with "
               "-DMSA_CUDA=ON); --vision runs the vision tower's bench on the CPU too\n", stderr);
    return 2;
#endif
  }
  if (!std::strcmp(command, "version") || !std::strcmp(command, "--version")) {
    std::printf("msa %s\n", msa::cli::kVersion);
    return 0;
  }
  if (!std::strcmp(command, "help") || !std::strcmp(command, "--help") ||
      !std::strcmp(command, "-h")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::fprintf(stderr, "msa: unknown command \"%s\"\n\n%s", command, kUsage);
  return 2;
}

}  // namespace

// Every command reports its own errors with status 2; this is the backstop that keeps an
// exception a command did not expect from ending the process with abort().
int main(int argc, char** argv) {
  try {
    return dispatch(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "msa: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "msa: error: an unexpected exception\n");
  }
  return 2;
}
