// Tensor / expert parallelism on the CPU (docs/parallel.md): the in-process communicator's
// collectives against plain loops, its errors (on every rank, never a hang), the sharding plan,
// rank-local weights, and the parity of the parallel forward with 1, 2, 4 and 8 ranks against
// the single-rank msa::Model on a made 2-layer model.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <filesystem>
#include <mutex>
#include <random>

#include "cli_runner.h"
#include "msa/communicator.h"
#include "msa/model.h"
#include "msa/model_random.h"
#include "msa/model_shard.h"
#include "msa/parallel_model.h"
#include "msa/safetensors.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::fresh_dir;

constexpr int kWorldSizes[] = {1, 2, 3, 4, 8};

// Rank `rank`'s random values (seeded by rank and salt).
std::vector<float> rank_values(int rank, int64_t count, int salt) {
  std::mt19937 rng(static_cast<uint32_t>(1000 * salt + rank));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = dist(rng);
  return values;
}

// ---- communicator ----

TEST(Communicator, AllReduceSumIsTheRankOrderSumOnEveryRank) {
  for (int world : kWorldSizes)
    for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{37}}) {
      // The plain loop: ((r0 + r1) + r2) + ...
      std::vector<float> expected = rank_values(0, count, 1);
      for (int r = 1; r < world; ++r) {
        const std::vector<float> values = rank_values(r, count, 1);
        for (int64_t i = 0; i < count; ++i) expected[i] += values[i];
      }
      std::vector<std::vector<float>> results(world);
      const auto comms = make_local_communicators(world);
      run_on_ranks(comms, [&](Communicator& comm) {
        std::vector<float> data = rank_values(comm.rank(), count, 1);
        comm.all_reduce_sum(data.data(), count);
        // Twice in a row: the second call must not see the first's buffers.
        comm.all_reduce_sum(data.data(), count);
        results[comm.rank()] = data;
      });
      for (int r = 0; r < world; ++r)
        for (int64_t i = 0; i < count; ++i)
          // The second call sums `world` copies of the first's result in rank order.
          ASSERT_EQ(results[r][i], [&] {
            float sum = expected[i];
            for (int k = 1; k < world; ++k) sum += expected[i];
            return sum;
          }()) << "world " << world << " rank " << r << " element " << i;
    }
}

TEST(Communicator, AllGatherConcatenatesInRankOrder) {
  for (int world : kWorldSizes)
    for (int64_t rows : {int64_t{0}, int64_t{3}}) {
      const int64_t width = 5;
      std::vector<std::vector<float>> got_f32(world);
      std::vector<std::vector<int32_t>> got_i32(world);
      const auto comms = make_local_communicators(world);
      run_on_ranks(comms, [&](Communicator& comm) {
        const std::vector<float> mine = rank_values(comm.rank(), rows * width, 2);
        std::vector<float> all(world * rows * width, -7.0f);
        comm.all_gather(mine.data(), rows, width, DType::f32, all.data());
        got_f32[comm.rank()] = all;
        std::vector<int32_t> ids(rows * width), all_ids(world * rows * width, -1);
        for (int64_t i = 0; i < rows * width; ++i) ids[i] = comm.rank() * 1000 + static_cast<int32_t>(i);
        comm.all_gather(ids.data(), rows, width, DType::i32, all_ids.data());
        got_i32[comm.rank()] = all_ids;
      });
      for (int r = 0; r < world; ++r)
        for (int src = 0; src < world; ++src) {
          const std::vector<float> part = rank_values(src, rows * width, 2);
          for (int64_t i = 0; i < rows * width; ++i) {
            ASSERT_EQ(got_f32[r][src * rows * width + i], part[i]) << world << " " << r << " " << src;
            ASSERT_EQ(got_i32[r][src * rows * width + i], src * 1000 + i);
          }
        }
    }
}

// Rows rank `from` sends to rank `to` in the all-to-all tests: 0 to 3, zero for some pairs.
int64_t pair_rows(int from, int to) { return (from * 3 + to * 5 + 1) % 4; }
// The value of element e of row i from `from` to `to`: identifies all four.
float pair_value(int from, int to, int64_t i, int64_t e) {
  return static_cast<float>(from * 100000 + to * 1000 + i * 10 + e);
}

TEST(Communicator, AllToAllVDeliversEveryPeersRows) {
  for (int world : kWorldSizes) {
    const int64_t width = 3;
    std::vector<std::vector<float>> received(world);
    std::vector<std::vector<int64_t>> counts(world);
    const auto comms = make_local_communicators(world);
    run_on_ranks(comms, [&](Communicator& comm) {
      const int me = comm.rank();
      std::vector<int64_t> send_rows(world);
      std::vector<float> send;
      for (int to = 0; to < world; ++to) {
        send_rows[to] = pair_rows(me, to);
        for (int64_t i = 0; i < send_rows[to]; ++i)
          for (int64_t e = 0; e < width; ++e) send.push_back(pair_value(me, to, i, e));
      }
      const std::vector<int64_t> recv_rows = exchange_counts(comm, send_rows);
      int64_t total = 0;
      for (int64_t n : recv_rows) total += n;
      std::vector<float> recv(total * width, -1.0f);
      comm.all_to_all_v(send.data(), send_rows, recv.data(), recv_rows, width, DType::f32);
      received[me] = recv;
      counts[me] = recv_rows;
    });
    for (int to = 0; to < world; ++to) {
      std::vector<float> expected;
      for (int from = 0; from < world; ++from) {
        ASSERT_EQ(counts[to][from], pair_rows(from, to)) << "world " << world;
        for (int64_t i = 0; i < pair_rows(from, to); ++i)
          for (int64_t e = 0; e < width; ++e) expected.push_back(pair_value(from, to, i, e));
      }
      EXPECT_EQ(received[to], expected) << "world " << world << " rank " << to;
    }
  }
}

TEST(Communicator, BarrierWaitsForEveryRank) {
  for (int world : kWorldSizes) {
    std::atomic<int> arrived{0};
    std::atomic<int> early{0};
    const auto comms = make_local_communicators(world);
    run_on_ranks(comms, [&](Communicator& comm) {
      arrived.fetch_add(1);
      comm.barrier();
      if (arrived.load() != world) early.fetch_add(1);
    });
    EXPECT_EQ(early.load(), 0) << "world " << world;
  }
}

TEST(Communicator, ReusableAcrossRuns) {
  const auto comms = make_local_communicators(3);
  for (int run = 0; run < 3; ++run) {
    std::atomic<int> done{0};
    run_on_ranks(comms, [&](Communicator& comm) {
      float one = 1;
      comm.all_reduce_sum(&one, 1);
      if (one == 3) done.fetch_add(1);
    });
    EXPECT_EQ(done.load(), 3);
  }
}

// Runs fn on `world` ranks, expecting every rank to throw; returns the rethrown message and
// checks that each rank saw an msa::Error.
std::string error_on_every_rank(int world, const std::function<void(Communicator&)>& fn) {
  std::atomic<int> threw{0};
  const auto comms = make_local_communicators(world);
  const std::string message = error_of([&] {
    run_on_ranks(comms, [&](Communicator& comm) {
      try {
        fn(comm);
      } catch (const Error&) {
        threw.fetch_add(1);
        throw;
      }
    });
  });
  EXPECT_EQ(threw.load(), world) << message;
  return message;
}

TEST(Communicator, MismatchesThrowOnEveryRank) {
  EXPECT_NE(error_on_every_rank(3, [](Communicator& comm) {
              std::vector<float> data(4 + comm.rank());
              comm.all_reduce_sum(data.data(), static_cast<int64_t>(data.size()));
            }).find("all_reduce_sum count differs between ranks: rank 0 passed 4, rank 1 passed 5"),
            std::string::npos);
  EXPECT_NE(error_on_every_rank(2, [](Communicator& comm) {
              float x = 0;
              if (comm.rank() == 0) comm.all_reduce_sum(&x, 1);
              else comm.barrier();
            }).find("rank 0 called all_reduce_sum while rank 1 called barrier"),
            std::string::npos);
  EXPECT_NE(error_on_every_rank(2, [](Communicator& comm) {
              float rows[4] = {};
              comm.all_gather(rows, 1, comm.rank() + 1, DType::f32, rows);
            }).find("all_gather row_elements differs"),
            std::string::npos);
  EXPECT_NE(error_on_every_rank(2, [](Communicator& comm) {
              std::vector<float> send(8), recv(8);
              // Rank 0 sends 2 rows to rank 1, which expects 1.
              const std::vector<int64_t> send_rows = {1, comm.rank() == 0 ? 2 : 1};
              const std::vector<int64_t> recv_rows = {1, 1};
              comm.all_to_all_v(send.data(), send_rows, recv.data(), recv_rows, 1, DType::f32);
            }).find("rank 0 sends 2 rows to rank 1, which expects 1"),
            std::string::npos);
}

TEST(Communicator, AFailedRankFailsTheOthersAndItsErrorIsRethrown) {
  const auto comms = make_local_communicators(4);
  std::atomic<int> aborted{0};
  const std::string message = error_of([&] {
    run_on_ranks(comms, [&](Communicator& comm) {
      if (comm.rank() == 2) throw Error("rank two's own problem");
      float x = 1;
      try {
        comm.all_reduce_sum(&x, 1);
      } catch (const Error& e) {
        if (std::string(e.what()).find("rank 2 failed: rank two's own problem") != std::string::npos)
          aborted.fetch_add(1);
        throw;
      }
    });
  });
  EXPECT_EQ(message, "rank two's own problem");
  EXPECT_EQ(aborted.load(), 3);
}

TEST(Communicator, ARankThatReturnsEarlyFailsTheWaitingOnes) {
  const std::string message = error_of([&] {
    const auto comms = make_local_communicators(3);
    run_on_ranks(comms, [&](Communicator& comm) {
      if (comm.rank() == 1) return;
      comm.barrier();
    });
  });
  EXPECT_NE(message.find("rank 1 returned without joining this collective"), std::string::npos) << message;
}

TEST(Communicator, BadArguments) {
  EXPECT_NE(error_of([] { make_local_communicators(0); }).find("world_size"), std::string::npos);
  const auto comms = make_local_communicators(2);
  const std::string message = error_of([&] {
    run_on_ranks(comms, [&](Communicator& comm) {
      const std::vector<int64_t> three = {0, 0, 0}, two = {0, 0};
      comm.all_to_all_v(nullptr, three, nullptr, two, 1, DType::f32);
    });
  });
  EXPECT_NE(message.find("'all_to_all_v send_rows': expected 2 counts (one per rank), got 3"),
            std::string::npos) << message;
  const auto fresh = make_local_communicators(2);  // a failed run leaves a set aborted
  EXPECT_NE(error_of([&] {
              run_on_ranks(fresh, [&](Communicator& comm) {
                float x = 0;
                comm.all_gather(&x, 1, 1, DType::u8, &x);
              });
            }).find("all_gather dtype"),
            std::string::npos);
}

TEST(Communicator, DeviceCommunicatorsWithoutTheirBackendAreClearErrors) {
  // The device and NCCL communicators run in test_cuda_parallel (label gpu); here only what a
  // build or a machine without them says.
#ifndef MSA_WITH_CUDA
  EXPECT_NE(error_of([] { make_local_device_communicators(2); }).find("no CUDA backend"), std::string::npos);
#endif
  if (!nccl_available()) {
    EXPECT_NE(error_of([] { make_nccl_unique_id(); }).find("NCCL"), std::string::npos);
    EXPECT_NE(error_of([] { make_nccl_communicator(0, 1, NcclUniqueId{}, 0); }).find("NCCL"), std::string::npos);
  } else {
    EXPECT_NE(error_of([] { make_nccl_communicator(2, 2, NcclUniqueId{}, 0); }).find("'rank'"), std::string::npos);
  }
}

// ---- sharding plan ----

TEST(ShardPlan, SplitsHeadsColumnsAndExpertsWithoutGapsOrOverlap) {
  const ModelConfig c = model_config_preset("tiny-tp");
  for (int world : {1, 2, 4, 8}) {
    std::vector<int> q_owner(c.num_heads, 0), expert_owner(c.num_experts, 0);
    std::vector<int> dense_owner(c.dense_intermediate_size, 0), shared_owner(c.shared_intermediate_size, 0);
    for (int r = 0; r < world; ++r) {
      const ShardPlan p = make_shard_plan(c, r, world);
      const int64_t group = c.num_heads / c.num_kv_heads;
      // Every query head of the rank belongs to one of its KV groups.
      for (int64_t h = p.q_begin; h < p.q_begin + p.q_heads; ++h) {
        ++q_owner[h];
        EXPECT_GE(h / group, p.kv_begin);
        EXPECT_LT(h / group, p.kv_begin + p.kv_heads);
      }
      for (int64_t e = p.expert_begin; e < p.expert_begin + p.experts; ++e) {
        ++expert_owner[e];
        EXPECT_EQ(p.expert_owner(e), r);
      }
      for (int64_t i = p.dense_begin; i < p.dense_begin + p.dense_columns; ++i) ++dense_owner[i];
      for (int64_t i = p.shared_begin; i < p.shared_begin + p.shared_columns; ++i) ++shared_owner[i];
      EXPECT_EQ(p.kv_replicas, world > c.num_kv_heads ? world / c.num_kv_heads : 1);
      const ModelConfig local = rank_config(c, p);
      EXPECT_NO_THROW(local.validate());
      EXPECT_EQ(local.num_kv_heads, p.kv_heads);
      EXPECT_EQ(local.index_heads, p.kv_heads);
    }
    for (int n : q_owner) EXPECT_EQ(n, 1) << "world " << world;
    for (int n : expert_owner) EXPECT_EQ(n, 1) << "world " << world;
    for (int n : dense_owner) EXPECT_EQ(n, 1) << "world " << world;
    for (int n : shared_owner) EXPECT_EQ(n, 1) << "world " << world;
  }
}

TEST(ShardPlan, MiniMaxM3OnEightRanksReplicatesKvGroups) {
  const ModelConfig m3;  // the real M3 values: 64 query / 4 KV heads, 128 experts
  ModelConfig c = m3;
  c.sparse_layers.assign(c.num_layers, true);
  c.moe_layers.assign(c.num_layers, true);
  const ShardPlan p = make_shard_plan(c, 5, 8);
  EXPECT_EQ(p.kv_begin, 2);
  EXPECT_EQ(p.kv_heads, 1);
  EXPECT_EQ(p.kv_replicas, 2);
  EXPECT_EQ(p.q_begin, 40);  // group 2 is heads [32, 48); the second replica takes [40, 48)
  EXPECT_EQ(p.q_heads, 8);
  EXPECT_EQ(p.expert_begin, 80);
  EXPECT_EQ(p.experts, 16);
  const ShardPlan two = make_shard_plan(c, 1, 2);
  EXPECT_EQ(two.kv_begin, 2);
  EXPECT_EQ(two.kv_heads, 2);
  EXPECT_EQ(two.q_begin, 32);
  EXPECT_EQ(two.q_heads, 32);
}

TEST(ShardPlan, WorldSizesTheModelCannotTakeNameTheField) {
  const ModelConfig c = model_config_preset("tiny-tp");  // 8 q / 4 KV heads, 8 experts
  EXPECT_NE(error_of([&] { make_shard_plan(c, 0, 3); }).find("config.num_key_value_heads"), std::string::npos);
  // 16 ranks: 4 per KV group, but a group has 2 query heads.
  EXPECT_NE(error_of([&] { make_shard_plan(c, 0, 16); }).find("config.num_attention_heads"), std::string::npos);
  ModelConfig experts = c;
  experts.num_experts = 12;
  EXPECT_NE(error_of([&] { make_shard_plan(experts, 0, 8); }).find("config.num_local_experts"), std::string::npos);
  ModelConfig dense = c;
  dense.dense_intermediate_size = 100;
  EXPECT_NE(error_of([&] { make_shard_plan(dense, 0, 8); }).find("config.dense_intermediate_size"), std::string::npos);
  ModelConfig shared = c;
  shared.shared_intermediate_size = 36;
  EXPECT_NE(error_of([&] { make_shard_plan(shared, 0, 8); }).find("config.shared_intermediate_size"), std::string::npos);
  EXPECT_NE(error_of([&] { make_shard_plan(c, 2, 2); }).find("'rank'"), std::string::npos);
  EXPECT_NE(error_of([&] { make_shard_plan(c, 0, 0); }).find("'world'"), std::string::npos);
}

// ---- rank-local weights and the parallel forward ----

// The made 2-layer model (f32): 1 dense + 1 MSA/MoE layer, 4 KV heads, 8 experts.
const fs::path& tiny_tp_dir() { return testing::made_model_dir("tiny_tp", "tiny-tp", 5, DType::f32); }

// Element (r, c) of a [rows, cols] matrix of any float dtype.
double element(const Tensor& t, int64_t r, int64_t c) { return t.get(r * t.size(1) + c); }

TEST(ShardedWeights, RowsAreViewsColumnsAreTheOwnedCopyOneRankIsTheWholeModel) {
  const ModelConfig c = load_model_config(tiny_tp_dir().string());
  const SafetensorsModel file = SafetensorsModel::open(tiny_tp_dir().string());
  const ModelWeights full = load_model_weights(file, c);
  const ModelWeights one = load_model_weights(file, c, make_shard_plan(c, 0, 1));
  for (int64_t l = 0; l < c.num_layers; ++l) {  // world 1: the same views, nothing copied
    EXPECT_EQ(one.layers[l].q_proj.raw(), full.layers[l].q_proj.raw());
    EXPECT_EQ(one.layers[l].o_proj.raw(), full.layers[l].o_proj.raw());
  }
  const int64_t D = c.head_dim, H = c.hidden_size;
  for (int world : {2, 8}) {
    for (int r = 0; r < world; ++r) {
      const ShardPlan p = make_shard_plan(c, r, world);
      const ModelWeights mine = load_model_weights(file, c, p);
      const LayerWeights &dense = mine.layers[0], &moe = mine.layers[1];
      const LayerWeights &dense_full = full.layers[0], &moe_full = full.layers[1];
      EXPECT_EQ(dense.q_proj.raw(), dense_full.q_proj.slice0(p.q_begin * D, p.q_begin * D + 1).raw());
      EXPECT_EQ(dense.k_proj.raw(), dense_full.k_proj.slice0(p.kv_begin * D, p.kv_begin * D + 1).raw());
      EXPECT_EQ(dense.mlp.gate.raw(), dense_full.mlp.gate.slice0(p.dense_begin, p.dense_begin + 1).raw());
      ASSERT_EQ(dense.o_proj.shape(), (Shape{H, p.q_heads * D}));
      for (int64_t i = 0; i < H; ++i)
        for (int64_t j = 0; j < p.q_heads * D; ++j)
          ASSERT_EQ(element(dense.o_proj, i, j), element(dense_full.o_proj, i, p.q_begin * D + j));
      ASSERT_EQ(dense.mlp.down.shape(), (Shape{H, p.dense_columns}));
      for (int64_t i = 0; i < H; ++i)
        for (int64_t j = 0; j < p.dense_columns; ++j)
          ASSERT_EQ(element(dense.mlp.down, i, j), element(dense_full.mlp.down, i, p.dense_begin + j));
      ASSERT_EQ(static_cast<int64_t>(moe.experts.size()), p.experts);
      for (int64_t e = 0; e < p.experts; ++e)
        EXPECT_EQ(moe.experts[e].gate.raw(), moe_full.experts[p.expert_begin + e].gate.raw());
      EXPECT_EQ(moe.index_q_proj.shape(), (Shape{p.kv_heads * c.index_head_dim, H}));
      EXPECT_EQ(moe.index_k_proj.raw(), moe_full.index_k_proj.raw());
      EXPECT_EQ(moe.shared_expert.down.shape(), (Shape{H, p.shared_columns}));
    }
  }
}

// tiny-tp's checkpoint with its tensors passed through `edit`.
fs::path edited_tiny_tp(const std::string& name,
                        const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  const fs::path dir = fresh_dir(name);
  fs::copy_file(tiny_tp_dir() / "config.json", dir / "config.json");
  const SafetensorsFile file = SafetensorsFile::open((tiny_tp_dir() / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& tensor : file.names()) tensors.emplace_back(tensor, file.get(tensor).clone());
  edit(tensors);
  save_safetensors((dir / "model.safetensors").string(), tensors);
  return dir;
}

TEST(ShardedWeights, Mxfp8SlicesEqualTheWholeMatrixsDequantizedSlices) {
  // Every layer projection as e4m3 codes of its values with a UE8M0 scale per 32 columns
  // that varies by row and block, so that a scale taken from the wrong block shows. o_proj's
  // and down's column slices are whole 32-column blocks on 2 ranks (o_proj) and not
  // (down: 48 columns; every slice on 8 ranks): both slicing paths.
  const fs::path dir = edited_tiny_tp("tp_mxfp8", [](std::vector<std::pair<std::string, Tensor>>& tensors) {
    std::vector<std::pair<std::string, Tensor>> out;
    for (auto& [name, tensor] : tensors) {
      const bool projection = name.find(".layers.") != std::string::npos && tensor.dim() == 2 &&
                              name.ends_with(".weight") && name.find("norm") == std::string::npos &&
                              name.find("gate.weight") == std::string::npos;
      if (!projection) {
        out.emplace_back(name, tensor);
        continue;
      }
      const int64_t rows = tensor.size(0), in = tensor.size(1), blocks = (in + 31) / 32;
      Tensor codes = Tensor::zeros({rows, in}, DType::e4m3), scale = Tensor::zeros({rows, blocks}, DType::u8);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < in; ++i)
          static_cast<uint8_t*>(codes.raw())[r * in + i] = float_to_e4m3(tensor.data<float>()[r * in + i] * 64);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) scale.data<uint8_t>()[r * blocks + b] = static_cast<uint8_t>(118 + (r + 3 * b) % 5);
      out.emplace_back(name, codes);
      out.emplace_back(name + "_scale_inv", scale);
    }
    tensors = std::move(out);
  });
  const ModelConfig c = load_model_config(dir.string());
  const SafetensorsModel file = SafetensorsModel::open(dir.string());
  const ModelWeights full = load_model_weights(file, c);
  ASSERT_EQ(full.layers[0].o_proj.dtype(), DType::bf16);
  const auto same = [](const Tensor& part, const Tensor& whole, int64_t row0, int64_t col0) {
    for (int64_t r = 0; r < part.size(0); ++r)
      for (int64_t j = 0; j < part.size(1); ++j)
        if (element(part, r, j) != element(whole, row0 + r, col0 + j)) return false;
    return true;
  };
  const int64_t D = c.head_dim;
  for (int world : {2, 8})
    for (int r = 0; r < world; ++r) {
      const ShardPlan p = make_shard_plan(c, r, world);
      const ModelWeights mine = load_model_weights(file, c, p);
      const LayerWeights &dense = mine.layers[0], &dense_full = full.layers[0];
      EXPECT_TRUE(same(dense.q_proj, dense_full.q_proj, p.q_begin * D, 0)) << world << " " << r;
      EXPECT_TRUE(same(dense.o_proj, dense_full.o_proj, 0, p.q_begin * D)) << world << " " << r;
      EXPECT_TRUE(same(dense.mlp.down, dense_full.mlp.down, 0, p.dense_begin)) << world << " " << r;
      EXPECT_TRUE(same(mine.layers[1].shared_expert.down, full.layers[1].shared_expert.down, 0, p.shared_begin));
      EXPECT_TRUE(same(mine.layers[1].experts[0].down, full.layers[1].experts[p.expert_begin].down, 0, 0));
    }
}

TEST(ShardedWeights, AnotherRanksBadTensorIsReportedOnEveryRank) {
  const std::string name = "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight";
  const fs::path dir = edited_tiny_tp("tp_missing", [&](auto& tensors) {
    std::erase_if(tensors, [&](const auto& entry) { return entry.first == name; });
  });
  const ModelConfig c = load_model_config(dir.string());
  const SafetensorsModel file = SafetensorsModel::open(dir.string());
  // Rank 0 of 2 owns experts 0..3, yet names the missing expert 7.
  EXPECT_NE(error_of([&] { load_model_weights(file, c, make_shard_plan(c, 0, 2)); }).find("missing tensor '" + name + "'"),
            std::string::npos);
}

// tiny-tp's weights under transformers' names and fused layouts: model.language_model.*,
// self_attn.indexer.*, mlp.gate_up_proj [2I, H], mlp.gate.*, mlp.experts.gate_up_proj
// [E, 2I, H] and down_proj [E, H, I], mlp.shared_experts.gate_up_proj.
const fs::path& tiny_tp_transformers_dir() {
  static const fs::path dir = [] {
    const ModelConfig c = model_config_preset("tiny-tp");
    const SafetensorsFile file = SafetensorsFile::open((tiny_tp_dir() / "model.safetensors").string());
    const auto get = [&](const std::string& name) { return file.get(name).clone(); };
    const auto stack = [](const std::vector<Tensor>& parts) {  // along a new or the leading axis
      int64_t rows = 0;
      for (const Tensor& t : parts) rows += t.size(0);
      Shape shape = parts[0].shape();
      shape[0] = rows;
      Tensor out = Tensor::zeros(shape, parts[0].dtype());
      size_t at = 0;
      for (const Tensor& t : parts) {
        std::memcpy(static_cast<char*>(out.raw()) + at, t.raw(), t.nbytes());
        at += t.nbytes();
      }
      return out;
    };
    std::vector<std::pair<std::string, Tensor>> out;
    const std::string from = "language_model.model.", to = "model.language_model.";
    out.emplace_back("lm_head.weight", get("language_model.lm_head.weight"));
    out.emplace_back(to + "embed_tokens.weight", get(from + "embed_tokens.weight"));
    out.emplace_back(to + "norm.weight", get(from + "norm.weight"));
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string a = from + "layers." + std::to_string(l) + ".", b = to + "layers." + std::to_string(l) + ".";
      for (const char* name : {"input_layernorm.weight", "post_attention_layernorm.weight",
                               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                               "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"})
        out.emplace_back(b + name, get(a + name));
      if (c.sparse_layers[l])
        for (const char* part : {"q_proj", "k_proj", "q_norm", "k_norm"})
          out.emplace_back(b + "self_attn.indexer." + part + ".weight",
                           get(a + "self_attn.index_" + part + ".weight"));
      if (!c.moe_layers[l]) {
        out.emplace_back(b + "mlp.gate_up_proj.weight",
                         stack({get(a + "mlp.gate_proj.weight"), get(a + "mlp.up_proj.weight")}));
        out.emplace_back(b + "mlp.down_proj.weight", get(a + "mlp.down_proj.weight"));
        continue;
      }
      const std::string moe = a + "block_sparse_moe.";
      out.emplace_back(b + "mlp.gate.weight", get(moe + "gate.weight"));
      out.emplace_back(b + "mlp.gate.e_score_correction_bias", get(moe + "e_score_correction_bias"));
      std::vector<Tensor> gate_up, down;
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string expert = moe + "experts." + std::to_string(e) + ".";
        gate_up.push_back(stack({get(expert + "w1.weight"), get(expert + "w3.weight")})
                              .reshape({1, 2 * c.moe_intermediate_size, c.hidden_size}));
        down.push_back(get(expert + "w2.weight").reshape({1, c.hidden_size, c.moe_intermediate_size}));
      }
      out.emplace_back(b + "mlp.experts.gate_up_proj", stack(gate_up));
      out.emplace_back(b + "mlp.experts.down_proj", stack(down));
      out.emplace_back(b + "mlp.shared_experts.gate_up_proj.weight",
                       stack({get(moe + "shared_experts.gate_proj.weight"), get(moe + "shared_experts.up_proj.weight")}));
      out.emplace_back(b + "mlp.shared_experts.down_proj.weight", get(moe + "shared_experts.down_proj.weight"));
    }
    const fs::path d = fresh_dir("tiny_tp_transformers");
    fs::copy_file(tiny_tp_dir() / "config.json", d / "config.json");
    save_safetensors((d / "model.safetensors").string(), out);
    return d;
  }();
  return dir;
}

// Prompts of different lengths (the first past the 4 x 16 tokens that MSA's top-k covers, so
// the selection is exercised), then decode steps of every request together.
std::vector<std::vector<int32_t>> parity_prompts() {
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n : {90, 37, 5}) {
    std::vector<int32_t> p;
    for (int64_t i = 0; i < n; ++i) p.push_back(static_cast<int32_t>((i * 53 + n * 7 + 3) % 509 + 3));
    prompts.push_back(p);
  }
  return prompts;
}
constexpr int kDecodeSteps = 3;

// Logits of every step (prefill: all rows of all requests; decode: one row per request),
// feeding fixed tokens so that every run sees the same inputs.
template <class Forward>
std::vector<Tensor> run_steps(Forward forward) {
  const std::vector<std::vector<int32_t>> prompts = parity_prompts();
  const size_t n = prompts.size();
  std::vector<SequenceCache> sequences(n);
  std::vector<Tensor> steps;
  std::vector<ForwardRequest> requests(n);
  for (size_t b = 0; b < n; ++b)
    requests[b] = {.sequence = &sequences[b], .tokens = prompts[b], .all_logits = true};
  steps.push_back(forward(requests));
  std::vector<int32_t> next(n);
  for (int s = 0; s < kDecodeSteps; ++s) {
    for (size_t b = 0; b < n; ++b) {
      next[b] = static_cast<int32_t>((s * 31 + b * 17 + 11) % 509 + 3);
      requests[b] = {.sequence = &sequences[b], .tokens = std::span(&next[b], 1)};
    }
    steps.push_back(forward(requests));
  }
  return steps;
}

std::vector<Tensor> single_rank_logits() {
  const Model model = Model::load(tiny_tp_dir().string());
  KvCache cache(model.config(), 32);
  return run_steps([&](std::span<const ForwardRequest> requests) { return model.forward(requests, cache); });
}

// Every rank's logits of every step.
std::vector<std::vector<Tensor>> parallel_logits(int world, const fs::path& dir = tiny_tp_dir()) {
  std::vector<std::vector<Tensor>> per_rank(world);
  const auto comms = make_local_communicators(world);
  run_on_ranks(
      comms,
      [&](Communicator& comm) {
        const ParallelModel model = ParallelModel::load(dir.string(), comm);
        KvCache cache(model.rank_config(), 32);
        per_rank[comm.rank()] = run_steps(
            [&](std::span<const ForwardRequest> requests) { return model.forward(requests, cache); });
      },
      /*threads_per_rank=*/1);
  return per_rank;
}

// max |a - b| / max |a|.
double relative_error(const Tensor& expected, const Tensor& got) {
  EXPECT_EQ(expected.shape(), got.shape());
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < expected.numel(); ++i) {
    worst = std::max(worst, std::abs(expected.get(i) - got.get(i)));
    scale = std::max(scale, std::abs(expected.get(i)));
  }
  return worst / std::max(scale, 1e-30);
}

TEST(ParallelModel, LogitsOfOneTwoFourAndEightRanksMatchTheSingleRankModel) {
  const std::vector<Tensor> expected = single_rank_logits();
  for (int world : {1, 2, 4, 8}) {
    const std::vector<std::vector<Tensor>> got = parallel_logits(world);
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(got[r].size(), expected.size());
      for (size_t s = 0; s < expected.size(); ++s) {
        // f32: only the order of the sums differs (partial o_proj / down sums per rank, the
        // routed experts' and shared expert's adds). Far below any real difference.
        EXPECT_LT(relative_error(expected[s], got[r][s]), 1e-5) << "world " << world << " rank " << r << " step " << s;
        // Every rank returns the same logits (bitwise): lm_head runs on identical rows.
        EXPECT_EQ(std::memcmp(got[r][s].raw(), got[0][s].raw(), got[0][s].nbytes()), 0)
            << "world " << world << " rank " << r << " step " << s;
      }
    }
  }
}

TEST(ParallelModel, TransformersLayoutShardsGiveTheSameLogits) {
  // Fused gate/up (dense, shared) and stacked experts are sliced by other paths.
  const std::vector<Tensor> expected = single_rank_logits();
  for (int world : {2, 4}) {
    const std::vector<std::vector<Tensor>> got = parallel_logits(world, tiny_tp_transformers_dir());
    for (size_t s = 0; s < expected.size(); ++s)
      EXPECT_LT(relative_error(expected[s], got[0][s]), 1e-5) << "world " << world << " step " << s;
  }
  const ModelConfig c = load_model_config(tiny_tp_transformers_dir().string());
  const SafetensorsModel file = SafetensorsModel::open(tiny_tp_transformers_dir().string());
  EXPECT_EQ(load_model_weights(file, c, make_shard_plan(c, 1, 2)).layout, "transformers");
}

TEST(ParallelModel, AWorldSizeIsBitwiseReproducible) {
  const std::vector<std::vector<Tensor>> a = parallel_logits(4), b = parallel_logits(4);
  for (size_t s = 0; s < a[0].size(); ++s)
    EXPECT_EQ(std::memcmp(a[0][s].raw(), b[0][s].raw(), a[0][s].nbytes()), 0) << "step " << s;
}

TEST(ParallelModel, ErrorsNameTheProblem) {
  const auto comms = make_local_communicators(3);
  EXPECT_NE(error_of([&] {
              run_on_ranks(comms, [&](Communicator& comm) { ParallelModel::load(tiny_tp_dir().string(), comm); });
            }).find("config.num_key_value_heads"),
            std::string::npos);
  const auto two = make_local_communicators(2);
  EXPECT_NE(error_of([&] {
              run_on_ranks(two, [&](Communicator& comm) {
                const ParallelModel model = ParallelModel::load(tiny_tp_dir().string(), comm);
                KvCache whole(model.config(), 4);  // all 4 KV heads: not this rank's cache
                SequenceCache seq;
                const int32_t token = 5;
                const ForwardRequest request{.sequence = &seq, .tokens = std::span(&token, 1)};
                model.forward({&request, 1}, whole);
              });
            }).find("this rank's 2 KV heads"),
            std::string::npos);
}

// ---- msa run --tp N ----

// The generated ids (stdout's first line) of `msa run` on the made model.
std::string generated_ids(const testing::CliResult& result) { return result.out.substr(0, result.out.find('\n')); }

TEST(ParallelCli, RunWithTwoAndFourRanksGeneratesWhatOneRankDoes) {
  const std::string model = "--model " + testing::shell_quote(tiny_tp_dir().string());
  const std::string prompt = " --prompt-tokens 5,17,200,33,91,7,64,12 --max-tokens 6 --stop 0 --threads 2";
  const testing::CliResult one = testing::run_cli("run " + model + prompt);
  ASSERT_EQ(one.exit_code, 0) << one.out;
  for (int tp : {2, 4}) {
    const testing::CliResult many = testing::run_cli("run " + model + prompt + " --tp " + std::to_string(tp));
    ASSERT_EQ(many.exit_code, 0) << many.out;
    EXPECT_EQ(generated_ids(many), generated_ids(one)) << "--tp " << tp;
    EXPECT_NE(many.out.find(std::to_string(tp) + " ranks x 1 threads"), std::string::npos) << many.out;
  }
}

TEST(ParallelCli, WorldSizesTheModelCannotTakeAreClearErrors) {
  const std::string model = "--model " + testing::shell_quote(tiny_tp_dir().string());
  const testing::CliResult three = testing::run_cli("run " + model + " --prompt-tokens 5,6 --tp 3");
  EXPECT_NE(three.exit_code, 0);
  EXPECT_NE(three.out.find("config.num_key_value_heads"), std::string::npos) << three.out;
  const testing::CliResult cuda = testing::run_cli("run " + model + " --prompt-tokens 5,6 --tp 2 --device cuda");
  EXPECT_NE(cuda.exit_code, 0);
  EXPECT_NE(cuda.out.find("--tp"), std::string::npos) << cuda.out;
  const testing::CliResult zero = testing::run_cli("run " + model + " --prompt-tokens 5,6 --tp 0");
  EXPECT_NE(zero.exit_code, 0);
  EXPECT_NE(zero.out.find("--tp"), std::string::npos) << zero.out;
}

}  // namespace
}  // namespace msa
