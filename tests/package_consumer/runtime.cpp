// msa::runtime from the installed package: a tiny random M3-shaped checkpoint, loaded back.
#include <cstdio>
#include <string>

#include "msa/model.h"
#include "msa/model_random.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  msa::RandomCheckpointOptions options;
  options.seed = 7;
  options.dtype = msa::DType::f32;
  msa::write_random_checkpoint(msa::model_config_preset("tiny"), dir, options);
  const msa::Model model = msa::Model::load(dir, msa::Device::cpu);
  std::printf("loaded a model of %lld layers\n", static_cast<long long>(model.config().num_layers));
  return model.config().num_layers > 0 ? 0 : 1;
}
