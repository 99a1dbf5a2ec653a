// The CUDA runtime's per-row kernels (src/model/gpu: embedding, RMSNorm, MoE routing and
// dispatch (fused for decode-sized steps, four launches above), MoE combine) against plain host loops of the CPU model's math, over shapes with
// the edges: one row (a decode step), widths that are and are not multiples of the vector
// width, rows longer than the register-cached path, expert counts below and above a warp,
// top-k 1..8, tied router scores. Outputs are poisoned first; a second run must be bitwise
// equal (every kernel is deterministic).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/common/device_buffer.h"
#include "model/gpu/kernels.h"
#include "msa/dtype.h"
#include "msa/error.h"
#include "gpu_checks.h"
#include "op_cases.h"
#include "test_util.h"

namespace msa {
namespace {

using cuda::DeviceBuffer;
using testing::rng;

std::vector<float> random_floats(int64_t count, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(static_cast<size_t>(count));
  for (float& v : out) v = dist(rng());
  return out;
}

template <class T>
std::vector<T> download(const DeviceBuffer& buffer) {
  std::vector<T> out(buffer.bytes() / sizeof(T));
  buffer.download(out.data(), buffer.bytes());
  return out;
}

TEST(CudaRowKernels, RmsNormMatchesHost) {
  MSA_REQUIRE_CUDA();
  for (const int64_t dim : {1, 7, 64, 1028, 6144, 8192, 8196, 12288}) {
    for (const bool gather : {false, true}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + (gather ? ", source rows" : ""));
      const int64_t rows = gather ? 3 : 5, source = 5;
      const std::vector<float> x = random_floats(source * dim, 3.0f), w = random_floats(dim, 0.5f);
      const std::vector<int64_t> picks = {4, 0, 4};
      DeviceBuffer dx = DeviceBuffer::from(x), dw = DeviceBuffer::from(w), dpicks = DeviceBuffer::from(picks);
      DeviceBuffer dbf(static_cast<size_t>(rows * dim) * 2), df(static_cast<size_t>(rows * dim) * 4);
      std::vector<uint16_t> first_bf;
      for (int run = 0; run < 2; ++run) {
        dbf.fill_bytes(0xff);
        df.fill_bytes(0xff);
        model::gpu::rms_norm_rows(dx.as<float>(), gather ? dpicks.as<int64_t>() : nullptr, rows, dim, dw.as<float>(),
                                  1e-6f, dbf.as<uint16_t>(), df.as<float>(), nullptr);
        const std::vector<uint16_t> bf = download<uint16_t>(dbf);
        const std::vector<float> f = download<float>(df);
        if (run == 1) {
          EXPECT_EQ(0, std::memcmp(bf.data(), first_bf.data(), bf.size() * 2)) << "not repeatable";
          break;
        }
        first_bf = bf;
        int64_t bad = 0;
        for (int64_t r = 0; r < rows; ++r) {
          const float* in = x.data() + (gather ? picks[r] : r) * dim;
          double sum = 0;
          for (int64_t i = 0; i < dim; ++i) sum += double{in[i]} * in[i];
          const double inv = 1.0 / std::sqrt(sum / static_cast<double>(dim) + 1e-6);
          for (int64_t i = 0; i < dim; ++i) {
            const double want = in[i] * inv * (1.0 + w[i]);
            const float got = f[r * dim + i];
            const float got_bf = bf16_to_float(bf[r * dim + i]);
            // f32 sum of squares in another order: a few ulps of the result; bf16 output:
            // its rounding of the f32 output exactly.
            if (!(std::fabs(got - want) <= 1e-5 * std::fabs(want) + 1e-6) ||
                got_bf != bf16_to_float(float_to_bf16(got))) {
              if (++bad <= 5) ADD_FAILURE() << "row " << r << " col " << i << ": got " << got << ", want " << want;
            }
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

TEST(CudaRowKernels, EmbedRowsMatchesHost) {
  MSA_REQUIRE_CUDA();
  for (const int64_t hidden : {1, 9, 16, 6144, 6150}) {
    SCOPED_TRACE("hidden " + std::to_string(hidden));
    const int64_t vocab = 11;
    std::vector<uint16_t> table(static_cast<size_t>(vocab * hidden));
    const std::vector<float> values = random_floats(vocab * hidden);
    for (size_t i = 0; i < table.size(); ++i) table[i] = float_to_bf16(values[i]);
    const std::vector<int32_t> tokens = {10, 0, 3, 10, 7};
    DeviceBuffer dt = DeviceBuffer::from(table), dtok = DeviceBuffer::from(tokens);
    DeviceBuffer dx(static_cast<size_t>(tokens.size() * hidden) * 4);
    dx.fill_bytes(0xff);
    model::gpu::embed_rows(dt.as<uint16_t>(), hidden, dtok.as<int32_t>(), static_cast<int64_t>(tokens.size()),
                           dx.as<float>(), nullptr);
    const std::vector<float> x = download<float>(dx);
    int64_t bad = 0;
    for (size_t t = 0; t < tokens.size(); ++t)
      for (int64_t i = 0; i < hidden; ++i)
        if (x[t * hidden + i] != bf16_to_float(table[tokens[t] * hidden + i]) && ++bad <= 5)
          ADD_FAILURE() << "token " << t << " col " << i;
    EXPECT_EQ(bad, 0);
  }
}

// The host routing of src/model/mlp.cpp: top-k of sigmoid + bias, ties to the lower id.
struct HostRoute {
  std::vector<int32_t> expert;  // [tokens * k]
  std::vector<float> weight;
};
HostRoute host_route(const std::vector<float>& logits, const std::vector<float>& bias, int64_t tokens,
                     int64_t experts, int64_t k, float scaling) {
  HostRoute r;
  std::vector<float> score(experts), choice(experts);
  std::vector<int32_t> order(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) {
      score[e] = 1.0f / (1.0f + std::exp(-logits[t * experts + e]));
      choice[e] = score[e] + bias[e];
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
    });
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += score[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      r.expert.push_back(order[j]);
      r.weight.push_back(score[order[j]] / sum * scaling);
    }
  }
  return r;
}

TEST(CudaRowKernels, MoeDispatchMatchesHostRouting) {
  MSA_REQUIRE_CUDA();
  struct Case {
    int64_t tokens, experts, k;
    bool ties;
  };
  // Up to 256 entries the dispatch is one fused launch, above it routing + radix sort +
  // offsets + gather: both sides of the boundary (64 x 4 = 256, 257 x 1), ties on both;
  // expert counts up to kMaxRoutedExperts (a lane's registers hold 16), and past a multiple of 32.
  for (const Case& c : {Case{1, 128, 4, false}, Case{1, 8, 2, false}, Case{3, 33, 8, false}, Case{300, 128, 4, false},
                        Case{17, 16, 1, true}, Case{5, 64, 4, true}, Case{2, 40, 16, false}, Case{64, 128, 4, false},
                        Case{64, 16, 4, true}, Case{257, 128, 1, false}, Case{260, 16, 4, true},
                        Case{2, 512, 8, false}, Case{3, 257, 4, true}, Case{300, 512, 2, false}}) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + ", experts " + std::to_string(c.experts) + ", top-" +
                 std::to_string(c.k) + (c.ties ? ", tied scores" : ""));
    const int64_t hidden = 24, entries = c.tokens * c.k;
    std::vector<float> logits = random_floats(c.tokens * c.experts), bias = random_floats(c.experts, 0.01f);
    if (c.ties) {  // few distinct values: ties decided by the id
      for (float& v : logits) v = std::round(v);
      std::fill(bias.begin(), bias.end(), 0.0f);
    }
    std::vector<uint16_t> x(static_cast<size_t>(c.tokens * hidden));
    for (size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(static_cast<float>(i % 251));
    DeviceBuffer dl = DeviceBuffer::from(logits), db = DeviceBuffer::from(bias), dx = DeviceBuffer::from(x);
    DeviceBuffer dweight(static_cast<size_t>(entries) * 4), drow(static_cast<size_t>(entries) * 4);
    DeviceBuffer doff(static_cast<size_t>(c.experts + 1) * 4), dsorted(static_cast<size_t>(entries * hidden) * 2);
    DeviceBuffer ws(model::gpu::moe_dispatch_workspace_bytes(c.tokens, c.k, c.experts));
    for (DeviceBuffer* b : {&dweight, &drow, &doff, &dsorted}) b->fill_bytes(0xff);
    model::gpu::MoeDispatch job{.router_logits = dl.as<float>(), .bias = db.as<float>(), .x = dx.as<uint16_t>(),
                                .tokens = c.tokens, .experts = c.experts, .top_k = c.k, .hidden = hidden,
                                .routed_scaling = 2.5f, .entry_weight = dweight.as<float>(),
                                .entry_row = drow.as<int32_t>(), .offsets = doff.as<int32_t>(),
                                .x_sorted = dsorted.as<uint16_t>()};
    model::gpu::moe_dispatch(job, ws.get(), ws.bytes(), nullptr);
    const std::vector<float> weight = download<float>(dweight);
    const std::vector<int32_t> row = download<int32_t>(drow), offsets = download<int32_t>(doff);
    const std::vector<uint16_t> sorted = download<uint16_t>(dsorted);
    const HostRoute want = host_route(logits, bias, c.tokens, c.experts, c.k, 2.5f);
    // Expected offsets: counts per expert, prefix-summed; rows of an expert in entry order.
    std::vector<int32_t> count(c.experts + 1, 0);
    for (int32_t e : want.expert) ++count[e + 1];
    std::partial_sum(count.begin(), count.end(), count.begin());
    EXPECT_EQ(offsets, count);
    std::vector<int32_t> next(count.begin(), count.end() - 1);
    int64_t bad = 0;
    for (int64_t entry = 0; entry < entries; ++entry) {
      const int32_t expect_row = next[want.expert[entry]]++;
      if (row[entry] != expect_row && ++bad <= 5)
        ADD_FAILURE() << "entry " << entry << ": row " << row[entry] << ", want " << expect_row << " (expert "
                      << want.expert[entry] << ")";
      // Same f32 expression on both sides except exp: a few ulps.
      if (!(std::fabs(weight[entry] - want.weight[entry]) <= 1e-6f * std::fabs(want.weight[entry])) && ++bad <= 5)
        ADD_FAILURE() << "entry " << entry << ": weight " << weight[entry] << ", want " << want.weight[entry];
      const int64_t token = entry / c.k;
      if (row[entry] >= 0 && row[entry] < entries &&
          std::memcmp(&sorted[row[entry] * hidden], &x[token * hidden], hidden * 2) != 0 && ++bad <= 5)
        ADD_FAILURE() << "entry " << entry << ": gathered row is not token " << token << "'s input";
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST(CudaRowKernels, MoeDispatchRefusesTooManyExperts) {
  MSA_REQUIRE_CUDA();
  const int64_t experts = model::gpu::kMaxRoutedExperts + 1, hidden = 8;
  DeviceBuffer dl(static_cast<size_t>(experts) * 4), db(static_cast<size_t>(experts) * 4), dx(hidden * 2);
  DeviceBuffer dweight(4), drow(4), doff(static_cast<size_t>(experts + 1) * 4), dsorted(hidden * 2);
  doff.fill_bytes(0xff);
  DeviceBuffer ws(model::gpu::moe_dispatch_workspace_bytes(1, 1, experts));
  model::gpu::MoeDispatch job{.router_logits = dl.as<float>(), .bias = db.as<float>(), .x = dx.as<uint16_t>(),
                              .tokens = 1, .experts = experts, .top_k = 1, .hidden = hidden,
                              .routed_scaling = 1.0f, .entry_weight = dweight.as<float>(),
                              .entry_row = drow.as<int32_t>(), .offsets = doff.as<int32_t>(),
                              .x_sorted = dsorted.as<uint16_t>()};
  try {
    model::gpu::moe_dispatch(job, ws.get(), ws.bytes(), nullptr);
    ADD_FAILURE() << "513 experts were accepted";
  } catch (const msa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("experts"), std::string::npos) << e.what();
  }
  for (int32_t v : download<int32_t>(doff)) ASSERT_EQ(v, -1);  // nothing written
}

TEST(CudaRowKernels, MoeCombineMatchesHost) {
  MSA_REQUIRE_CUDA();
  for (const int64_t hidden : {1, 6, 1024, 6144, 6146}) {
    for (const int64_t k : {1, 4, 8}) {
      SCOPED_TRACE("hidden " + std::to_string(hidden) + ", top-" + std::to_string(k));
      const int64_t tokens = 3, entries = tokens * k;
      const std::vector<float> y = random_floats(entries * hidden), w = random_floats(entries),
                               base = random_floats(tokens * hidden);
      std::vector<int32_t> row(static_cast<size_t>(entries));
      std::iota(row.begin(), row.end(), 0);
      std::shuffle(row.begin(), row.end(), rng());
      DeviceBuffer dy = DeviceBuffer::from(y), dw = DeviceBuffer::from(w), drow = DeviceBuffer::from(row),
                   dout = DeviceBuffer::from(base);
      model::gpu::moe_combine(dy.as<float>(), dw.as<float>(), drow.as<int32_t>(), tokens, k, hidden,
                              dout.as<float>(), nullptr);
      const std::vector<float> out = download<float>(dout);
      int64_t bad = 0;
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t i = 0; i < hidden; ++i) {
          float want = base[t * hidden + i];  // the kernel's order: choice order, f32 multiply-adds
          for (int64_t j = 0; j < k; ++j) want = std::fma(w[t * k + j], y[row[t * k + j] * hidden + i], want);
          if (!(std::fabs(out[t * hidden + i] - want) <= 1e-6f * (1 + std::fabs(want))) && ++bad <= 5)
            ADD_FAILURE() << "token " << t << " col " << i << ": got " << out[t * hidden + i] << ", want " << want;
        }
      EXPECT_EQ(bad, 0);
    }
  }
}

}  // namespace
}  // namespace msa
