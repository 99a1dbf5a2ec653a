// Case builders and spec checks shared by the op tests: seeded random packed batches, paged
// caches built from varlen tensors, and the selection-row rules of docs/msa.md §3 recomputed
// independently here in double.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "msa/ops.h"
#include "test_util.h"

namespace msa {
// Readable test names and parameter printouts for tests parameterised on the implementation.
inline void PrintTo(Impl impl, std::ostream* out) { *out << impl_name(impl); }
}  // namespace msa

namespace msa::testing {

inline std::string impl_test_name(const ::testing::TestParamInfo<Impl>& info) {
  return std::string(impl_name(info.param));
}

// ---- seeds ----

// Seeds are fixed by default: each test (and each reseed within it) gets a seed derived from
// its name, so every run draws the same inputs and a failure reproduces by running the test
// again. MSA_TEST_SEED=random draws fresh seeds instead (each printed when drawn);
// MSA_TEST_SEED=<n> replays the seed a failure message printed.
inline uint64_t fresh_seed() {
  const char* forced = std::getenv("MSA_TEST_SEED");
  if (forced && std::string(forced) == "random") {
    std::random_device device;
    const uint64_t seed = (static_cast<uint64_t>(device()) << 32) ^ device();
    std::fprintf(stderr, "[seed] MSA_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
    return seed;
  }
  if (forced && *forced) return std::stoull(forced);
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  static std::string last_test;
  static uint64_t reseeds = 0;
  if (name != last_test) last_test = name, reseeds = 0;
  uint64_t hash = 1469598103934665603ull;  // FNV-1a of the name, then the reseed count
  for (const char ch : name) hash = (hash ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  return hash ^ (0x9e3779b97f4a7c15ull * ++reseeds);
}

// Reseeds rng() and keeps the seed in every failure message of the enclosing scope.
#define MSA_RESEED_AND_TRACE()                                                            \
  const uint64_t msa_test_seed = ::msa::testing::fresh_seed();                            \
  ::msa::testing::rng().seed(msa_test_seed);                                              \
  SCOPED_TRACE("seed " + std::to_string(msa_test_seed) + " (replay: MSA_TEST_SEED=" +    \
               std::to_string(msa_test_seed) + ")")

inline constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// ---- shapes and packed batches ----

struct CaseShape {
  int64_t kv_heads = 1;
  int64_t group = 1;  // q heads per KV head
  int64_t head_dim = 16;
  int64_t index_dim = 16;
  MsaParams params;
  int64_t q_heads() const { return kv_heads * group; }
  std::string describe() const {
    std::ostringstream out;
    out << "Hkv" << kv_heads << "_G" << group << "_D" << head_dim << "_Di" << index_dim << "_B"
        << params.block_size << "_k" << params.topk << "_local" << params.local_blocks << "_init"
        << params.init_blocks;
    return out.str();
  }
};

// Test names of shape-parameterised suites (INSTANTIATE_TEST_SUITE_P's name generator).
inline std::string shape_name(const ::testing::TestParamInfo<CaseShape>& info) { return info.param.describe(); }

inline CaseShape make_shape(int64_t kv_heads, int64_t group, int64_t head_dim, int64_t index_dim,
                            int block_size, int topk, int local_blocks, int init_blocks) {
  CaseShape shape;
  shape.kv_heads = kv_heads;
  shape.group = group;
  shape.head_dim = head_dim;
  shape.index_dim = index_dim;
  shape.params.block_size = block_size;
  shape.params.topk = topk;
  shape.params.local_blocks = local_blocks;
  shape.params.init_blocks = init_blocks;
  return shape;
}

struct Seq {
  int64_t q_len = 0;
  int64_t k_len = 0;
};

// Sequence lengths around the block and selection boundaries: 1, B-1, B, B+1, kB-1, kB, kB+1,
// and one several blocks beyond kB (so that the ranking decides what is read).
inline std::vector<int64_t> edge_lengths(int64_t block_size, int64_t topk) {
  const int64_t kb = block_size * topk;
  std::vector<int64_t> lengths{1,      block_size - 1, block_size, block_size + 1,
                               kb - 1, kb,             kb + 1,     kb + 5 * block_size + block_size / 2};
  std::erase_if(lengths, [](int64_t n) { return n < 1; });
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  return lengths;
}

inline int64_t uniform_int(int64_t lo, int64_t hi) {  // inclusive
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng());
}

// Whole-sequence prefills (q_len == k_len) of these lengths, in this order.
inline std::vector<Seq> whole_prefills(const std::vector<int64_t>& lengths) {
  std::vector<Seq> seqs;
  for (const int64_t length : lengths) seqs.push_back({.q_len = length, .k_len = length});
  return seqs;
}

// Alternates q_len == k_len (whole-sequence prefill) with a strict random suffix (chunked
// prefill over a cached prefix), in a shuffled order so that long and short sequences mix.
inline std::vector<Seq> mixed_sequences(const std::vector<int64_t>& key_lengths) {
  std::vector<Seq> seqs;
  for (size_t i = 0; i < key_lengths.size(); ++i) {
    const int64_t k_len = key_lengths[i];
    const bool suffix = i % 2 == 1 && k_len > 1;
    seqs.push_back({.q_len = suffix ? uniform_int(1, k_len - 1) : k_len, .k_len = k_len});
  }
  std::shuffle(seqs.begin(), seqs.end(), rng());
  return seqs;
}

// A packed varlen batch with normal random q, k, v, qi, ki and its geometry.
struct VarlenCase {
  CaseShape shape;
  std::vector<Seq> seqs;
  Tensor q, k, v, qi, ki, cu_seqlens_q, cu_seqlens_k;
  std::vector<int64_t> row_seq, row_pos, k_start;  // per packed query row / per sequence

  const MsaParams& params() const { return shape.params; }
  int64_t total_q() const { return q.size(0); }
  int64_t own_block(int64_t row) const { return row_pos[row] / shape.params.block_size; }
};

inline VarlenCase make_varlen_case(const CaseShape& shape, std::vector<Seq> seqs) {
  VarlenCase c;
  c.shape = shape;
  c.seqs = std::move(seqs);
  std::vector<int64_t> q_lens, k_lens;
  int64_t total_q = 0, total_k = 0;
  for (size_t b = 0; b < c.seqs.size(); ++b) {
    const Seq& s = c.seqs[b];
    q_lens.push_back(s.q_len);
    k_lens.push_back(s.k_len);
    c.k_start.push_back(total_k);
    for (int64_t i = 0; i < s.q_len; ++i) {
      c.row_seq.push_back(static_cast<int64_t>(b));
      c.row_pos.push_back(s.k_len - s.q_len + i);
    }
    total_q += s.q_len;
    total_k += s.k_len;
  }
  c.q = random_normal({total_q, shape.q_heads(), shape.head_dim});
  c.k = random_normal({total_k, shape.kv_heads, shape.head_dim});
  c.v = random_normal({total_k, shape.kv_heads, shape.head_dim});
  c.qi = random_normal({total_q, shape.kv_heads, shape.index_dim});
  c.ki = random_normal({total_k, shape.index_dim});
  c.cu_seqlens_q = cu_seqlens(q_lens);
  c.cu_seqlens_k = cu_seqlens(k_lens);
  return c;
}

// The given rows of the leading axis, gathered into a contiguous copy.
inline Tensor gather_rows(const Tensor& packed, const std::vector<int64_t>& rows) {
  Shape shape = packed.shape();
  shape[0] = static_cast<int64_t>(rows.size());
  Tensor out = Tensor::zeros(shape, packed.dtype());
  const int64_t inner = packed.numel() / std::max<int64_t>(packed.size(0), 1);
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t e = 0; e < inner; ++e)
      out.set(static_cast<int64_t>(i) * inner + e, packed.get(rows[i] * inner + e));
  return out;
}

// Selection rows [H, total_q, k] restricted to the given query rows (axis 1).
inline Tensor gather_selection_rows(const Tensor& topk, const std::vector<int64_t>& rows) {
  const int64_t heads = topk.size(0), total = topk.size(1), slots = topk.size(2);
  Tensor out = Tensor::zeros({heads, static_cast<int64_t>(rows.size()), slots}, DType::i32);
  for (int64_t h = 0; h < heads; ++h)
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t s = 0; s < slots; ++s)
        out.set((h * static_cast<int64_t>(rows.size()) + static_cast<int64_t>(i)) * slots + s,
                topk.get((h * total + rows[i]) * slots + s));
  return out;
}

// Per-row values [H, total_q] (indexer LSE) restricted to the given rows.
inline Tensor gather_head_major(const Tensor& values, const std::vector<int64_t>& rows) {
  const int64_t heads = values.size(0), total = values.size(1);
  Tensor out = Tensor::zeros({heads, static_cast<int64_t>(rows.size())}, values.dtype());
  for (int64_t h = 0; h < heads; ++h)
    for (size_t i = 0; i < rows.size(); ++i)
      out.set(h * static_cast<int64_t>(rows.size()) + static_cast<int64_t>(i),
              values.get(h * total + rows[i]));
  return out;
}

// ---- paged caches ----

struct PagedRequests {
  PagedKvCache cache;
  Tensor cu_seqlens_q;
};

inline constexpr int32_t kUnusedPageColumn = 999999;

// Pages the keys, values and index keys of a varlen case: physical pages in shuffled order,
// `spare_pages` pages nobody uses, every unwritten cache element (spare pages, the tail of a
// partial last page) random garbage, and page-table columns beyond a request's pages set to
// an invalid id. seq_lens = each sequence's k_len (the caller may lower them).
inline PagedRequests page_varlen_case(const VarlenCase& c, int64_t spare_pages = 3,
                                      int64_t spare_columns = 2) {
  const int64_t B = c.params().block_size, H = c.shape.kv_heads, D = c.shape.head_dim,
                Di = c.shape.index_dim;
  std::vector<int64_t> pages_of;
  int64_t used = 0, widest = 0;
  for (const Seq& s : c.seqs) {
    pages_of.push_back((s.k_len + B - 1) / B);
    used += pages_of.back();
    widest = std::max(widest, pages_of.back());
  }
  const int64_t num_pages = used + spare_pages;
  std::vector<int32_t> physical(static_cast<size_t>(num_pages));
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng());

  PagedRequests out;
  PagedKvCache& cache = out.cache;
  cache.k_cache = random_normal({num_pages, H, B, D}, 3.0);  // garbage until written
  cache.v_cache = random_normal({num_pages, H, B, D}, 3.0);
  cache.index_key_cache = random_normal({num_pages, B, Di}, 3.0);
  const int64_t batch = static_cast<int64_t>(c.seqs.size());
  const int64_t columns = widest + spare_columns;
  std::vector<int32_t> table(static_cast<size_t>(batch * columns), kUnusedPageColumn);
  std::vector<int32_t> lens;
  const float* k = c.k.data<float>();
  const float* v = c.v.data<float>();
  const float* ki = c.ki.data<float>();
  float* k_cache = cache.k_cache.data<float>();
  float* v_cache = cache.v_cache.data<float>();
  float* ki_cache = cache.index_key_cache.data<float>();
  size_t next = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < pages_of[b]; ++j) table[b * columns + j] = physical[next++];
    for (int64_t t = 0; t < c.seqs[b].k_len; ++t) {
      const int64_t page = table[b * columns + t / B], slot = t % B;
      const int64_t token = c.k_start[b] + t;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          k_cache[((page * H + h) * B + slot) * D + d] = k[(token * H + h) * D + d];
          v_cache[((page * H + h) * B + slot) * D + d] = v[(token * H + h) * D + d];
        }
      for (int64_t d = 0; d < Di; ++d) ki_cache[(page * B + slot) * Di + d] = ki[token * Di + d];
    }
    lens.push_back(static_cast<int32_t>(c.seqs[b].k_len));
  }
  cache.page_table = Tensor::from_vector(table, {batch, columns});
  cache.seq_lens = Tensor::from_vector(lens, {batch});
  out.cu_seqlens_q = c.cu_seqlens_q;
  return out;
}

// ---- the spec's selection rule, recomputed in double ----

// Inputs of a case as doubles, for the in-test recomputations.
struct DoubleInputs {
  std::vector<double> qi, ki, q, k;
  explicit DoubleInputs(const VarlenCase& c) {
    const auto read = [](const Tensor& t) {
      const Tensor f64 = t.dtype() == DType::f64 ? t : t.to(DType::f64);
      const double* data = f64.data<double>();
      return std::vector<double>(data, data + f64.numel());
    };
    qi = read(c.qi);
    ki = read(c.ki);
    q = read(c.q);
    k = read(c.k);
  }
};

inline double dot(const double* a, const double* b, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Raw index score s_h(t) = qi_h . ki(t) of packed query row `row`.
inline double index_score(const VarlenCase& c, const DoubleInputs& in, int64_t row, int64_t head,
                          int64_t t) {
  const int64_t Di = c.shape.index_dim;
  return dot(&in.qi[(row * c.shape.kv_heads + head) * Di],
             &in.ki[(c.k_start[c.row_seq[row]] + t) * Di], Di);
}

// S_h(j) for j in [0, own block]: max of the raw scores over the visible keys of block j.
inline std::vector<double> block_maxima(const VarlenCase& c, const DoubleInputs& in, int64_t row,
                                        int64_t head) {
  const int64_t B = c.params().block_size, pos = c.row_pos[row];
  std::vector<double> maxima(static_cast<size_t>(pos / B + 1), kNegInf);
  for (int64_t t = 0; t <= pos; ++t)
    maxima[t / B] = std::max(maxima[t / B], index_score(c, in, row, head, t));
  return maxima;
}

// Empties every `step`-th row of selection rows topk [heads, rows, slots] (all -1): queries
// that read no block.
inline void empty_every_nth_row(Tensor& topk, int64_t step) {
  const int64_t slots = topk.size(2);
  for (int64_t flat_row = 0; flat_row < topk.size(0) * topk.size(1); flat_row += step)
    for (int64_t s = 0; s < slots; ++s) topk.set(flat_row * slots + s, -1);
}

inline std::vector<int32_t> selection_row(const Tensor& topk, int64_t head, int64_t row) {
  const int64_t total = topk.size(1), slots = topk.size(2);
  const int32_t* data = topk.data<int32_t>() + (head * total + row) * slots;
  return {data, data + slots};
}

inline std::set<int32_t> valid_ids(const std::vector<int32_t>& row) {
  std::set<int32_t> ids;
  for (int32_t id : row)
    if (id >= 0) ids.insert(id);
  return ids;
}

inline std::string row_string(const std::vector<int32_t>& row) {
  std::string out = "[";
  for (size_t i = 0; i < row.size(); ++i) out += (i ? ", " : "") + std::to_string(row[i]);
  return out + "]";
}

inline bool is_forced(int64_t block, int64_t own_block, const MsaParams& params) {
  return block < params.init_blocks || block > own_block - params.local_blocks;
}

// The structural rules of a row: valid count min(k, L+1), -1 suffix, ids in [0, L] without
// duplicates, own block L in the last valid slot, init and local blocks present.
inline ::testing::AssertionResult row_structure_ok(const std::vector<int32_t>& row,
                                                   int64_t own_block, const MsaParams& params) {
  const auto fail = [&](const std::string& why) {
    return ::testing::AssertionFailure() << why << " in row " << row_string(row) << " (own block "
                                         << own_block << ")";
  };
  const int64_t count = std::min<int64_t>(params.topk, own_block + 1);
  if (static_cast<int64_t>(row.size()) != params.topk) return fail("wrong slot count");
  for (int64_t slot = 0; slot < params.topk; ++slot) {
    if (slot < count && row[slot] < 0) return fail("missing entry at slot " + std::to_string(slot));
    if (slot >= count && row[slot] != -1) return fail("no -1 at slot " + std::to_string(slot));
    if (slot < count && row[slot] > own_block) return fail("id beyond the own block");
  }
  if (row[count - 1] != own_block) return fail("own block not in the last valid slot");
  const std::set<int32_t> ids = valid_ids(row);
  if (static_cast<int64_t>(ids.size()) != count) return fail("duplicate ids");
  for (int64_t j = 0; j < std::min<int64_t>(params.init_blocks, own_block + 1); ++j)
    if (!ids.count(static_cast<int32_t>(j))) return fail("init block " + std::to_string(j) + " missing");
  for (int64_t j = std::max<int64_t>(0, own_block - params.local_blocks + 1); j <= own_block; ++j)
    if (!ids.count(static_cast<int32_t>(j))) return fail("local block " + std::to_string(j) + " missing");
  return ::testing::AssertionSuccess();
}

// Relative tie tolerance on block maxima (scores are O(sqrt(Di)), never tiny on average).
inline double tie_tolerance(double relative, double threshold) {
  return relative * std::max(std::fabs(threshold), 1.0);
}

// The ranked (non-forced) entries are the best candidates: no unselected candidate j < L beats
// a ranked entry r, i.e. S(j) < S(r), or S(j) == S(r) and j > r. With `relative_tie` > 0,
// S(j) <= S(r) + tolerance suffices (f32 block maxima may reorder near-ties).
inline ::testing::AssertionResult ranked_entries_are_best(const std::vector<int32_t>& row,
                                                          int64_t own_block,
                                                          const MsaParams& params,
                                                          const std::vector<double>& maxima,
                                                          double relative_tie) {
  const std::set<int32_t> ids = valid_ids(row);
  for (int32_t r : ids) {
    if (is_forced(r, own_block, params)) continue;
    for (int64_t j = 0; j < own_block; ++j) {
      if (ids.count(static_cast<int32_t>(j)) || is_forced(j, own_block, params)) continue;
      const bool beaten = relative_tie > 0
                              ? maxima[j] > maxima[r] + tie_tolerance(relative_tie, maxima[r])
                              : maxima[j] > maxima[r] || (maxima[j] == maxima[r] && j < r);
      if (beaten)
        return ::testing::AssertionFailure()
               << "unselected block " << j << " (max " << maxima[j] << ") beats selected block "
               << r << " (max " << maxima[r] << ") in row " << row_string(row);
    }
  }
  return ::testing::AssertionSuccess();
}

// Rows `got` and `want` ([H, rows, k]) compared as sets; row i is row case_rows[i] of `c`
// (identity when empty). A differing block passes only as a near-tie: its block max within
// `relative_tie` of the k-th best (smallest ranked) maximum of `want`'s row. The structure
// of every `got` row is checked exactly. Returns the fraction of rows whose sets differ.
inline double expect_same_selection(const Tensor& got, const Tensor& want, const VarlenCase& c,
                                    const DoubleInputs& in, double relative_tie,
                                    const std::vector<int64_t>& case_rows = {}) {
  EXPECT_EQ(got.shape(), want.shape());
  EXPECT_EQ(got.dtype(), DType::i32);
  if (got.shape() != want.shape()) return 1.0;
  const int64_t heads = got.size(0), rows = got.size(1);
  int64_t differing = 0, failures = 0;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < rows && failures < 5; ++i) {
      const int64_t row = case_rows.empty() ? i : case_rows[i];
      const int64_t own = c.own_block(row);
      const std::vector<int32_t> got_row = selection_row(got, h, i), want_row = selection_row(want, h, i);
      const ::testing::AssertionResult structure = row_structure_ok(got_row, own, c.params());
      if (!structure) {
        ADD_FAILURE() << "head " << h << " row " << row << ": " << structure.message();
        ++failures;
        continue;
      }
      const std::set<int32_t> got_ids = valid_ids(got_row), want_ids = valid_ids(want_row);
      if (got_ids == want_ids) continue;
      ++differing;
      const std::vector<double> maxima = block_maxima(c, in, row, h);
      double kth_best = std::numeric_limits<double>::infinity();
      for (int32_t id : want_ids)
        if (!is_forced(id, own, c.params())) kth_best = std::min(kth_best, maxima[id]);
      std::vector<int32_t> differ;
      std::set_symmetric_difference(got_ids.begin(), got_ids.end(), want_ids.begin(),
                                    want_ids.end(), std::back_inserter(differ));
      for (int32_t id : differ) {
        if (std::isfinite(kth_best) &&
            std::fabs(maxima[id] - kth_best) <= tie_tolerance(relative_tie, kth_best))
          continue;
        ADD_FAILURE() << "head " << h << " row " << row << " (pos " << c.row_pos[row]
                      << "): block " << id << " (max " << maxima[id]
                      << ") differs and is no near-tie of the k-th best " << kth_best
                      << "; got " << row_string(got_row) << ", want " << row_string(want_row);
        ++failures;
        break;
      }
    }
  }
  return rows * heads == 0 ? 0.0 : static_cast<double>(differing) / static_cast<double>(rows * heads);
}

// log sum_{t in selected blocks, t <= pos} exp(index_scale * s(t) / T) for one row, in double.
inline double selected_index_lse(const VarlenCase& c, const DoubleInputs& in,
                                 const std::vector<int32_t>& row, int64_t query_row, int64_t head,
                                 double index_scale, double temperature) {
  const int64_t B = c.params().block_size, pos = c.row_pos[query_row];
  std::vector<double> logits;
  for (int32_t id : row) {
    if (id < 0) continue;
    for (int64_t t = id * B; t < (id + 1) * B && t <= pos; ++t)
      logits.push_back(index_scale * index_score(c, in, query_row, head, t) / temperature);
  }
  if (logits.empty()) return kNegInf;
  const double top = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (double logit : logits) sum += std::exp(logit - top);
  return top + std::log(sum);
}

// Expected indexer LSE [H, total_q] for the given rows, computed in the test.
inline Tensor expected_index_lse(const VarlenCase& c, const DoubleInputs& in, const Tensor& topk,
                                 double index_scale, double temperature) {
  const int64_t heads = topk.size(0), rows = topk.size(1);
  Tensor out = Tensor::zeros({heads, rows}, DType::f64);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t row = 0; row < rows; ++row)
      out.set(h * rows + row, selected_index_lse(c, in, selection_row(topk, h, row), row, h,
                                                 index_scale, temperature));
  return out;
}

// Expected indexer LSE [H, rows] for the rows `got_topk`: `want_lse` (of rows `want_topk`)
// where the two rows hold the same blocks, else recomputed here over got's blocks (so that a
// legitimate near-tie swap is not counted twice). Row i is row case_rows[i] of `c`.
inline Tensor expected_lse_for_rows(const VarlenCase& c, const DoubleInputs& in,
                                    const Tensor& got_topk, const Tensor& want_topk,
                                    const Tensor& want_lse, const std::vector<int64_t>& case_rows = {}) {
  Tensor expected = want_lse.to(DType::f64);
  const int64_t heads = got_topk.size(0), rows = got_topk.size(1);
  const double index_scale = c.params().index_scale != 0
                                 ? c.params().index_scale
                                 : 1.0 / std::sqrt(static_cast<double>(c.shape.index_dim));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < rows; ++i) {
      const std::vector<int32_t> got_row = selection_row(got_topk, h, i);
      if (valid_ids(got_row) == valid_ids(selection_row(want_topk, h, i))) continue;
      expected.set(h * rows + i,
                   selected_index_lse(c, in, got_row, case_rows.empty() ? i : case_rows[i], h,
                                      index_scale, c.params().temperature));
    }
  return expected;
}

// Positions holding -inf are the same in both tensors.
inline ::testing::AssertionResult same_neg_inf_positions(const Tensor& a, const Tensor& b) {
  if (a.numel() != b.numel()) return ::testing::AssertionFailure() << "sizes differ";
  ::testing::AssertionResult result = ::testing::AssertionSuccess();
  for_each_pair(a, b, [&](int64_t i, double x, double y) {
    if ((x == kNegInf) == (y == kNegInf)) return true;
    result = ::testing::AssertionFailure() << "-inf differs at flat index " << i << ": " << x << " vs " << y;
    return false;
  });
  return result;
}

// Close in two senses: norm-wise relative error below `relative`, and no element off by more
// than `absolute` (a single wrong element would be diluted in the norm of a large tensor).
// -inf must sit at the same positions.
inline void expect_close(const Tensor& got, const Tensor& want, double relative, double absolute,
                         const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(got.shape(), want.shape());
  if (got.shape() != want.shape()) return;
  EXPECT_TRUE(same_neg_inf_positions(got, want));
  EXPECT_LT(relative_error(got, want), relative);
  EXPECT_LT(max_abs_diff(got, want), absolute);
}

inline double default_index_scale(const CaseShape& shape) {
  return shape.params.index_scale != 0 ? shape.params.index_scale
                                       : 1.0 / std::sqrt(static_cast<double>(shape.index_dim));
}

}  // namespace msa::testing

namespace msa::testing {

// ---- low-precision caches ----

// Sets every element of a paged cache that holds none of its requests' tokens (spare pages,
// the tail of a partial last page) to NaN: an op that reads one returns NaN somewhere.
// Each page's used prefix: the tokens of the cache's requests it holds (the rest of its slots
// belong to no request).
inline std::vector<int64_t> used_page_prefixes(const PagedKvCache& cache) {
  const int64_t pages = cache.k_cache.size(0), B = cache.k_cache.size(2), columns = cache.page_table.size(1);
  std::vector<int64_t> used_slots(static_cast<size_t>(pages), 0);
  for (int64_t b = 0; b < cache.seq_lens.size(0); ++b) {
    const int64_t len = static_cast<int64_t>(cache.seq_lens.get(b));
    for (int64_t j = 0; j * B < len; ++j) {
      const int64_t page = static_cast<int64_t>(cache.page_table.get(b * columns + j));
      used_slots[page] = std::max(used_slots[page], std::min(B, len - j * B));
    }
  }
  return used_slots;
}

inline void poison_unused_cache_slots(PagedKvCache& cache) {
  const int64_t pages = cache.k_cache.size(0), H = cache.k_cache.size(1),
                B = cache.k_cache.size(2), D = cache.k_cache.size(3),
                Di = cache.index_key_cache.size(2);
  const std::vector<int64_t> used_slots = used_page_prefixes(cache);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t page = 0; page < pages; ++page)
    for (int64_t slot = used_slots[page]; slot < B; ++slot) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          cache.k_cache.set(((page * H + h) * B + slot) * D + d, nan);
          cache.v_cache.set(((page * H + h) * B + slot) * D + d, nan);
        }
      for (int64_t d = 0; d < Di; ++d) cache.index_key_cache.set((page * B + slot) * Di + d, nan);
    }
}

}  // namespace msa::testing
