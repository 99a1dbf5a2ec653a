// MiniMax-M3's text model on one rank of a tensor- and expert-parallel run (CPU;
// docs/parallel.md). Every rank loads only its part (msa/model_shard.h) and keeps a KV cache
// of its own KV heads; all ranks call forward() with the same requests, in the same order.
//
//   auto comms = msa::make_local_communicators(4);
//   msa::run_on_ranks(comms, [&](msa::Communicator& comm) {
//     msa::ParallelModel model = msa::ParallelModel::load(dir, comm);
//     msa::KvCache cache(model.rank_config(), /*num_pages=*/64);   // this rank's KV heads
//     msa::SequenceCache seq;                                       // one per rank and request
//     msa::ForwardRequest step{.sequence = &seq, .tokens = prompt, .all_logits = true};
//     msa::Tensor logits = model.forward({&step, 1}, cache);       // the same on every rank
//   });
//
// Per layer: attention over the rank's heads and o_proj over their columns, then one
// all-reduce; the dense MLP over its columns, then one all-reduce; on MoE layers each rank
// routes its share of the tokens, sends each chosen (token, expert) row to the expert's owner
// (all_to_all_v), the owners run their experts and send the rows back (all_to_all_v), and one
// all-reduce sums the routed rows with the shared expert's column-split partials.
//
// On a CUDA device (ParallelModel::load(dir, comm, Device::cuda)) a rank uploads its part to
// the calling thread's current device and runs the step there (the CUDA model's layers with
// the same collectives, on its stream: docs/parallel.md; MXFP8 / NVFP4 routed experts stay
// quantized there, as on one GPU); its cache is a bf16 Device::cuda
// KvCache(model.rank_config(), pages, DType::bf16, Device::cuda) and `comm` a device
// communicator (make_local_device_communicators, make_nccl_communicator).
#pragma once
#include <span>
#include <string>
#include <vector>

#include "msa/communicator.h"
#include "msa/model.h"
#include "msa/model_engine.h"
#include "msa/model_shard.h"

namespace msa {

class ParallelModel {
 public:
  // Reads `dir`/config.json and this rank's part of the weights (comm.rank() of
  // comm.world_size()); a world size the model cannot be split over is an msa::Error naming
  // the config field. Collective: every rank loads.
  static ParallelModel load(const std::string& dir, Communicator& comm);
  static ParallelModel load(const std::string& dir, Communicator& comm, Device device);
  ParallelModel(ModelConfig config, SafetensorsModel file, Communicator& comm);
  ParallelModel(ModelConfig config, SafetensorsModel file, Communicator& comm, Device device);

  const ModelConfig& config() const { return config_; }            // the whole model's
  const ModelConfig& rank_config() const { return rank_config_; }  // this rank's shapes
  const ShardPlan& plan() const { return plan_; }
  const ModelWeights& weights() const { return weights_; }  // this rank's part
  Communicator& communicator() const { return *comm_; }
  Device device() const { return device_; }

  // One step, as Model::forward: writes the requests' new K/V into this rank's `cache` (built
  // from rank_config()) and advances their lengths. Returns the f32 logits on every rank
  // (lm_head is replicated, so every rank can sample the same next token). Collective.
  // `tap` (Device::cuda only; the CPU ranks refuse it) observes what Model::forward's tap
  // does: the residual stream and the branches after their all-reduce (whole-model values),
  // and each MSA layer's top-k of this rank's index heads only.
  Tensor forward(std::span<const ForwardRequest> requests, KvCache& cache, const ForwardTap& tap = nullptr) const;

  void set_attention_impl(Impl impl) { impl_ = impl; }

 private:
  ParallelModel(ModelConfig config, SafetensorsModel file, Communicator& comm, const WeightLoadOptions& options);

  ModelConfig config_;
  ShardPlan plan_;
  ModelConfig rank_config_;
  SafetensorsModel file_;  // keeps the mapping alive
  ModelWeights weights_;
  std::vector<float> inv_freq_;
  Communicator* comm_;
  Impl impl_ = Impl::cpu;
  Device device_ = Device::cpu;
  std::shared_ptr<model::gpu::CudaModel> cuda_;  // set when device_ is cuda
};

// One request generated on one rank (what `msa run --tp N` runs on every rank): the prompt
// in prefill steps of at most `prefill_chunk` tokens, then one token per step until a stop
// token (emitted) or max_tokens, sampling with request.sampling. Every rank gets the same
// logits, so every rank's seeded sampler picks the same tokens and no broadcast is needed.
// `on_token` (may be null) sees each token as it comes; stats are filled like Engine's.
// Collective. Text only (request.visual must be empty).
struct ParallelGenerateOptions {
  int64_t cache_tokens = 0;  // 0: prompt + max_tokens
  int64_t prefill_chunk = 256;
  DType cache_dtype = DType::f32;  // a CUDA model's: bf16 for f32 (no f32 pages there), else this (bf16, e4m3)
};
std::vector<int32_t> generate_on_rank(const ParallelModel& model, const GenerationRequest& request,
                                      const ParallelGenerateOptions& options,
                                      const std::function<void(int32_t)>& on_token,
                                      EngineStats* stats = nullptr);

}  // namespace msa
