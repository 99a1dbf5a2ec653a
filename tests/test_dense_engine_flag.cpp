// The dense attention engine choice (msa/model.h DenseAttentionEngine) where no GPU is needed:
// its names and parsing, Model::set_dense_attention_engine on a CPU model, and the CLI's
// --dense-engine flag refusing what cannot run (before any model is read).
#include <gtest/gtest.h>

#include "cli_runner.h"
#include "msa/model.h"
#include "msa/model_random.h"

namespace msa {
namespace {

using testing::CliResult;
using testing::fresh_dir;
using testing::run_cli;

TEST(DenseEngineFlag, NamesParseBack) {
  for (DenseAttentionEngine e : {DenseAttentionEngine::automatic, DenseAttentionEngine::msa, DenseAttentionEngine::cudnn,
                                 DenseAttentionEngine::cudnn_gathered})
    EXPECT_EQ(parse_dense_attention_engine(dense_attention_engine_name(e)), e);
  EXPECT_EQ(parse_dense_attention_engine("automatic"), DenseAttentionEngine::automatic);
  EXPECT_STREQ(dense_attention_engine_name(DenseAttentionEngine::automatic), "auto");
  EXPECT_STREQ(dense_attention_engine_name(DenseAttentionEngine::cudnn_gathered), "cudnn-gathered");
  EXPECT_FALSE(dense_attention_engine_needs_cudnn(DenseAttentionEngine::automatic));
  EXPECT_FALSE(dense_attention_engine_needs_cudnn(DenseAttentionEngine::msa));
  EXPECT_TRUE(dense_attention_engine_needs_cudnn(DenseAttentionEngine::cudnn));
  EXPECT_TRUE(dense_attention_engine_needs_cudnn(DenseAttentionEngine::cudnn_gathered));
}

TEST(DenseEngineFlag, UnknownNamesAreRefusedWithTheChoices) {
  for (const char* bad : {"", "CUDNN", "flash", "auto ", "cudnn_gathered", "gathered"}) {
    try {
      parse_dense_attention_engine(bad, "--dense-engine");
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--dense-engine"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("auto, msa, cudnn or cudnn-gathered"), std::string::npos) << e.what();
    }
  }
}

// A CPU model has no engine to choose: auto and msa are accepted (nothing changes), cudnn and
// cudnn-gathered are refused, naming the engine and why (no cuDNN in this build, or a CPU model).
TEST(DenseEngineFlag, CpuModelRefusesCudnn) {
  const std::string dir = fresh_dir("dense_engine_cpu").string();
  write_random_checkpoint(model_config_preset("tiny"), dir, {.seed = 3});
  Model model = Model::load(dir, Device::cpu);
  EXPECT_NO_THROW(model.set_dense_attention_engine(DenseAttentionEngine::automatic));
  EXPECT_NO_THROW(model.set_dense_attention_engine(DenseAttentionEngine::msa));
  for (DenseAttentionEngine engine : {DenseAttentionEngine::cudnn, DenseAttentionEngine::cudnn_gathered}) {
    try {
      model.set_dense_attention_engine(engine);
      ADD_FAILURE() << dense_attention_engine_name(engine) << " accepted on a CPU model";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::string("engine ") + dense_attention_engine_name(engine) + ":"), std::string::npos)
          << what;
      EXPECT_NE(what.find(dense_attention_cudnn_built() ? "CPU" : "no cuDNN"), std::string::npos) << what;
    }
  }
}

TEST(DenseEngineFlag, CliRefusesBeforeReadingTheModel) {
  const std::string missing = (fresh_dir("dense_engine_cli") / "no-model").string();
  const std::string run = "run --model " + testing::shell_quote(missing) + " --prompt-tokens 1,2 ";
  CliResult r = run_cli(run + "--dense-engine flash");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--dense-engine: expected auto, msa, cudnn or cudnn-gathered, got \"flash\""),
            std::string::npos)
      << r.out;
  r = run_cli(run + "--device cpu --dense-engine msa");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("only with --device cuda"), std::string::npos) << r.out;
  r = run_cli(run + "--device cpu --dense-engine cudnn-gathered");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("only with --device cuda"), std::string::npos) << r.out;
  if (!dense_attention_cudnn_built()) {
    for (const std::string engine : {"cudnn", "cudnn-gathered"}) {
      r = run_cli(run + "--device cuda --dense-engine " + engine);
      EXPECT_EQ(r.exit_code, 2) << r.out;
      EXPECT_NE(r.out.find("--dense-engine " + engine + ": this build of msa has no cuDNN"), std::string::npos)
          << r.out;
      r = run_cli("serve --model " + testing::shell_quote(missing) + " --device cuda --dense-engine " + engine);
      EXPECT_EQ(r.exit_code, 2) << r.out;
      EXPECT_NE(r.out.find("no cuDNN"), std::string::npos) << r.out;
    }
  }
}

}  // namespace
}  // namespace msa
