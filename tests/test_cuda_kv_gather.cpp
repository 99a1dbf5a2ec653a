// The K/V gather in front of the gathered cuDNN dense attention (src/model/gpu/kv_gather.cu)
// against a plain host gather, bitwise: request lengths around the page size B (1, B-1, B,
// B+1, several requests in one call, a request of no keys), page ids shuffled over a cache
// larger than the requests need, at M3's D = B = 128 and at D = B = 64 with other head counts.
// The outputs are poisoned first and the rows past the requests' keys must stay poisoned, as
// must the rows past `rows` when the buffer is declared shorter; unused page-table entries hold
// an id far out of range (never read). Host-side refusals need no device.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/common/device_buffer.h"
#include "model/gpu/kv_gather.h"
#include "msa/error.h"
#include "msa/ops.h"
#include "gpu_checks.h"
#include "op_cases.h"
#include "test_util.h"

namespace msa {
namespace {

using cuda::DeviceBuffer;
using model::gpu::gather_kv;
using model::gpu::KvGather;
using testing::rng;

constexpr uint16_t kPoison = 0xabab;

struct Cache {
  int64_t pages, heads, block, dim;
};

// The reference: request r's key t (< lengths[r]) of head h is row (first_r + t) of the output,
// read from page table[r][t / B], row t % B of that page's head h.
std::vector<uint16_t> host_gather(const std::vector<uint16_t>& cache, const Cache& c,
                                  const std::vector<int32_t>& table, int64_t max_pages,
                                  const std::vector<int64_t>& lengths, int64_t rows) {
  std::vector<uint16_t> out(static_cast<size_t>(rows * c.heads * c.dim), kPoison);
  int64_t row = 0;
  for (size_t r = 0; r < lengths.size(); ++r)
    for (int64_t t = 0; t < lengths[r]; ++t, ++row) {
      if (row >= rows) continue;
      const int64_t page = table[r * max_pages + t / c.block];
      for (int64_t h = 0; h < c.heads; ++h)
        for (int64_t d = 0; d < c.dim; ++d)
          out[(row * c.heads + h) * c.dim + d] = cache[((page * c.heads + h) * c.block + t % c.block) * c.dim + d];
    }
  return out;
}

// Gathers `lengths` from random caches on the device and compares with the host, bitwise.
// `short_by`: the buffer is declared that many rows shorter than the keys (the device guard).
void check_case(const Cache& c, const std::vector<int64_t>& lengths, const std::string& what, int64_t short_by = 0) {
  SCOPED_TRACE(what);
  const int64_t requests = static_cast<int64_t>(lengths.size());
  int64_t max_pages = 1, total = 0, needed = 0;
  for (int64_t n : lengths) {
    max_pages = std::max(max_pages, (n + c.block - 1) / c.block);
    needed += (n + c.block - 1) / c.block;
    total += n;
  }
  ASSERT_LE(needed, c.pages);
  // Page ids: a shuffled permutation of the cache, handed out to the requests' blocks in order.
  std::vector<int32_t> ids(static_cast<size_t>(c.pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng());
  std::vector<int32_t> table(static_cast<size_t>(requests * max_pages), 1 << 30);  // unused: never read
  size_t next = 0;
  for (int64_t r = 0; r < requests; ++r)
    for (int64_t j = 0; j < (lengths[r] + c.block - 1) / c.block; ++j) table[r * max_pages + j] = ids[next++];
  std::vector<int32_t> k_rows(static_cast<size_t>(requests + 1), 0);
  for (int64_t r = 0; r < requests; ++r) k_rows[r + 1] = k_rows[r] + static_cast<int32_t>(lengths[r]);

  const int64_t cache_elements = c.pages * c.heads * c.block * c.dim;
  std::vector<uint16_t> k(static_cast<size_t>(cache_elements)), v(k.size());
  std::uniform_int_distribution<int> bits(0, 0xffff);  // any bit pattern: the copy is bitwise
  for (uint16_t& x : k) x = static_cast<uint16_t>(bits(rng()));
  for (uint16_t& x : v) x = static_cast<uint16_t>(bits(rng()));
  const int64_t rows = total - short_by;
  const int64_t spare = 3;  // rows past the declared ones, which must stay poisoned
  const size_t out_bytes = static_cast<size_t>((total + spare) * c.heads * c.dim) * sizeof(uint16_t);
  DeviceBuffer dk = DeviceBuffer::from(k), dv = DeviceBuffer::from(v), dtable = DeviceBuffer::from(table),
               drows = DeviceBuffer::from(k_rows), k_out(out_bytes), v_out(out_bytes);
  k_out.fill_bytes(0xab);
  v_out.fill_bytes(0xab);
  KvGather job{.k_cache = dk.as<uint16_t>(), .v_cache = dv.as<uint16_t>(), .pages = c.pages, .heads = c.heads,
               .block_size = c.block, .head_dim = c.dim, .page_table = dtable.as<int32_t>(),
               .requests = requests, .max_pages = max_pages, .k_rows = drows.as<int32_t>(), .rows = rows,
               .k_out = k_out.as<uint16_t>(), .v_out = v_out.as<uint16_t>()};
  gather_kv(job, nullptr);
  std::vector<uint16_t> got_k(out_bytes / 2), got_v(out_bytes / 2);
  k_out.download(got_k.data(), out_bytes);
  v_out.download(got_v.data(), out_bytes);
  const std::vector<uint16_t> want_k = host_gather(k, c, table, max_pages, lengths, total + spare);
  const std::vector<uint16_t> want_v = host_gather(v, c, table, max_pages, lengths, total + spare);
  // Rows at or past `rows` are never written: the reference keeps them poisoned too.
  std::vector<uint16_t> expect_k = want_k, expect_v = want_v;
  std::fill(expect_k.begin() + rows * c.heads * c.dim, expect_k.end(), kPoison);
  std::fill(expect_v.begin() + rows * c.heads * c.dim, expect_v.end(), kPoison);
  int64_t bad = 0;
  for (size_t i = 0; i < expect_k.size(); ++i) {
    for (const auto& [got, want, name] : {std::tuple{got_k[i], expect_k[i], "k"}, std::tuple{got_v[i], expect_v[i], "v"}})
      if (got != want && ++bad <= 5)
        ADD_FAILURE() << name << " element " << i << " (row " << i / (c.heads * c.dim) << "): got " << got
                      << ", want " << want;
  }
  EXPECT_EQ(bad, 0);
}

TEST(CudaKvGather, MatchesTheHostGatherBitwise) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const Cache& c : {Cache{.pages = 24, .heads = 4, .block = 128, .dim = 128},
                         Cache{.pages = 40, .heads = 2, .block = 64, .dim = 64},
                         Cache{.pages = 40, .heads = 1, .block = 64, .dim = 128}}) {
    const int64_t b = c.block;
    const std::string shape = "heads " + std::to_string(c.heads) + ", B " + std::to_string(b) + ", D " +
                              std::to_string(c.dim) + ": ";
    for (int64_t n : {int64_t{1}, b - 1, b, b + 1, 3 * b + 5})
      check_case(c, {n}, shape + "one request of " + std::to_string(n));
    check_case(c, {1, b - 1, b, b + 1, 2 * b}, shape + "5 requests of 1, B-1, B, B+1, 2B");
    check_case(c, {b + 1, 0, 3}, shape + "a request of no keys between two");
    check_case(c, {2 * b + 7, b}, shape + "buffer declared 5 rows short", /*short_by=*/5);
  }
}

// Refused on the host before any launch (no device needed): null and unaligned pointers,
// a head dim that is not whole 16-byte chunks, more requests than the grid holds.
TEST(CudaKvGather, RefusesInconsistentArguments) {
  alignas(16) static uint16_t data[64];
  alignas(16) static int32_t ints[4];
  const KvGather good{.k_cache = data, .v_cache = data, .pages = 1, .heads = 1, .block_size = 4, .head_dim = 8,
                      .page_table = ints, .requests = 1, .max_pages = 1, .k_rows = ints, .rows = 4,
                      .k_out = data, .v_out = data};
  auto refused = [&](KvGather job, const char* needle) {
    try {
      gather_kv(job, nullptr);
      ADD_FAILURE() << "accepted (" << needle << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  KvGather job = good;
  job.k_out = nullptr;
  refused(job, "gather_kv pointers");
  job = good;
  job.v_cache = data + 1;  // 2-byte aligned
  refused(job, "16-byte aligned");
  job = good;
  job.head_dim = 12;
  refused(job, "gather_kv head_dim");
  job = good;
  job.requests = 70000;
  refused(job, "gather_kv requests");
  job = good;
  job.max_pages = 0;
  refused(job, "gather_kv max_pages");
  job = good;
  job.requests = 0;
  EXPECT_NO_THROW(gather_kv(job, nullptr));  // nothing to gather: no launch
}

}  // namespace
}  // namespace msa
