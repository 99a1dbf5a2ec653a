// Bad inputs: every op throws msa::Error naming the bad argument, and leaves the caller's
// tensors bitwise untouched.
#include <gtest/gtest.h>

#include <functional>

#include "op_cases.h"

namespace msa::testing {
namespace {

// Every argument of the forward ops, valid until a test breaks one. Three sequences
// (q_len, k_len) = (3, 6), (5, 9), (2, 2) with B = 2: rows 0..2 sit at positions 3..5,
// rows 8..9 at positions 0..1 (own block 0, a row with a single valid entry).
struct OpArgs {
  VarlenCase c;
  MsaParams params;
  Tensor topk;
  PagedRequests paged;

  IndexerOutput run_indexer(Impl impl) const {
    return indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, params, impl);
  }
  AttentionOutput run_sparse(Impl impl) const {
    return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, params, impl);
  }
  AttentionOutput run_dense(Impl impl) const {
    return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, params, impl);
  }
  IndexerOutput run_paged_indexer(Impl impl) const {
    return paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, params, impl, true);
  }
  AttentionOutput run_paged_sparse(Impl impl) const {
    return paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, params, impl);
  }
  AttentionOutput run_paged_dense(Impl impl) const {
    return paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, params, impl);
  }
  std::vector<Tensor> tensors() const {
    return {c.q,           c.k,           c.v,
            c.qi,          c.ki,          c.cu_seqlens_q,
            c.cu_seqlens_k, topk,         paged.cu_seqlens_q,
            paged.cache.k_cache, paged.cache.v_cache, paged.cache.index_key_cache,
            paged.cache.page_table, paged.cache.seq_lens};
  }
};

OpArgs valid_args() {
  OpArgs args;
  args.c = make_varlen_case(make_shape(2, 2, 8, 8, 2, 3, 1, 0),
                            {{.q_len = 3, .k_len = 6}, {.q_len = 5, .k_len = 9},
                             {.q_len = 2, .k_len = 2}});
  args.params = args.c.params();
  args.topk = indexer(args.c.qi, args.c.ki, args.c.cu_seqlens_q, args.c.cu_seqlens_k, args.params,
                      Impl::reference)
                  .topk;
  args.paged = page_varlen_case(args.c);
  return args;
}

Tensor int32_tensor(const std::vector<int32_t>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
}

// `call` must throw msa::Error whose message names `argument` ("argument '<argument>...");
// the tensors of `args` must be bitwise unchanged afterwards.
void expect_rejected(const OpArgs& args, const std::function<void()>& call,
                     const std::string& argument) {
  SCOPED_TRACE("bad argument " + argument);
  std::vector<Tensor> before;
  for (const Tensor& t : args.tensors()) before.push_back(t.clone());
  try {
    call();
    ADD_FAILURE() << "no msa::Error";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("argument '" + argument), std::string::npos) << message;
  } catch (const std::exception& other) {
    ADD_FAILURE() << "not an msa::Error: " << other.what();
  }
  const std::vector<Tensor> after = args.tensors();
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_TRUE(bitwise_equal(after[i], before[i])) << "input tensor " << i << " was modified";
}

class OpErrors : public ::testing::TestWithParam<Impl> {
 protected:
  void SetUp() override { args = valid_args(); }
  Impl impl() const { return GetParam(); }
  // Each op of a family must reject `args` naming `argument`.
  void expect_varlen_attention_rejects(const std::string& argument) {
    expect_rejected(args, [&] { args.run_sparse(impl()); }, argument);
    expect_rejected(args, [&] { args.run_dense(impl()); }, argument);
  }
  void expect_paged_ops_reject(const std::string& argument) {
    expect_rejected(args, [&] { args.run_paged_indexer(impl()); }, argument);
    expect_rejected(args, [&] { args.run_paged_sparse(impl()); }, argument);
    expect_rejected(args, [&] { args.run_paged_dense(impl()); }, argument);
  }
  void expect_every_op_rejects(const std::string& argument) {
    expect_rejected(args, [&] { args.run_indexer(impl()); }, argument);
    expect_varlen_attention_rejects(argument);
    expect_paged_ops_reject(argument);
  }
  OpArgs args;
};

TEST_P(OpErrors, ValidArgumentsPassValidation) {
  EXPECT_NO_THROW(args.run_indexer(impl()));
  EXPECT_NO_THROW(args.run_sparse(impl()));
  EXPECT_NO_THROW(args.run_dense(impl()));
  EXPECT_NO_THROW(args.run_paged_indexer(impl()));
  EXPECT_NO_THROW(args.run_paged_sparse(impl()));
  EXPECT_NO_THROW(args.run_paged_dense(impl()));
}

TEST_P(OpErrors, WrongRank) {
  const int64_t total_q = args.c.total_q();
  args.c.q = args.c.q.clone().reshape({total_q, args.c.q.numel() / total_q});
  expect_varlen_attention_rejects("q");
  expect_rejected(args, [&] { args.run_paged_sparse(impl()); }, "q");
  args = valid_args();
  args.c.qi = args.c.qi.clone().reshape({args.c.qi.numel()});
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "qi");
  expect_rejected(args, [&] { args.run_paged_indexer(impl()); }, "qi");
  args = valid_args();
  args.c.ki = args.c.ki.clone().reshape({args.c.ki.size(0), 1, args.c.ki.size(1)});
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "ki");
  args = valid_args();
  args.topk = args.topk.clone().reshape({args.topk.size(0) * args.topk.size(1), args.topk.size(2)});
  expect_rejected(args, [&] { args.run_sparse(impl()); }, "topk");
  expect_rejected(args, [&] { args.run_paged_sparse(impl()); }, "topk");
  args = valid_args();
  args.paged.cache.k_cache = args.paged.cache.k_cache.clone().reshape({args.paged.cache.k_cache.numel()});
  expect_rejected(args, [&] { args.run_paged_dense(impl()); }, "k_cache");
}

TEST_P(OpErrors, WrongExtents) {
  const VarlenCase& c = args.c;
  args.c.k = random_normal({c.k.size(0), c.shape.kv_heads, c.shape.head_dim + 1});
  expect_varlen_attention_rejects("k");
  args = valid_args();
  args.c.v = random_normal({c.v.size(0), c.shape.kv_heads + 1, c.shape.head_dim});
  expect_varlen_attention_rejects("v");
  args = valid_args();
  args.c.q = random_normal({c.total_q(), c.shape.kv_heads + 1, c.shape.head_dim});  // 3 q / 2 kv
  expect_varlen_attention_rejects("q");
  expect_rejected(args, [&] { args.run_paged_sparse(impl()); }, "q");
  args = valid_args();
  args.c.ki = random_normal({c.ki.size(0), c.shape.index_dim * 2});
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "ki");
  args = valid_args();
  args.paged.cache.k_cache = random_normal({args.paged.cache.k_cache.size(0), c.shape.kv_heads,
                                            c.params().block_size + 1, c.shape.head_dim});
  expect_rejected(args, [&] { args.run_paged_dense(impl()); }, "k_cache");
  args = valid_args();
  args.paged.cache.v_cache = random_normal({args.paged.cache.v_cache.size(0) - 1, c.shape.kv_heads,
                                            c.params().block_size, c.shape.head_dim});
  expect_rejected(args, [&] { args.run_paged_sparse(impl()); }, "v_cache");
  args = valid_args();
  args.paged.cache.index_key_cache = random_normal(
      {args.paged.cache.index_key_cache.size(0), c.params().block_size, c.shape.index_dim + 1});
  expect_rejected(args, [&] { args.run_paged_indexer(impl()); }, "index_key_cache");
}

TEST_P(OpErrors, WrongDtypes) {
  args.c.q = args.c.q.to(DType::i32);
  expect_varlen_attention_rejects("q");
  args = valid_args();
  args.c.qi = args.c.qi.to(DType::i32);
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "qi");
  args = valid_args();
  args.c.k = args.c.k.to(DType::i64);
  expect_varlen_attention_rejects("k");
  args = valid_args();
  args.c.cu_seqlens_q = args.c.cu_seqlens_q.to(DType::f32);
  args.paged.cu_seqlens_q = args.c.cu_seqlens_q;
  expect_every_op_rejects("cu_seqlens_q");
  args = valid_args();
  args.c.cu_seqlens_k = args.c.cu_seqlens_k.to(DType::i64);
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "cu_seqlens_k");
  args = valid_args();
  args.topk = args.topk.to(DType::f32);
  expect_rejected(args, [&] { args.run_sparse(impl()); }, "topk");
  args = valid_args();
  args.paged.cache.page_table = args.paged.cache.page_table.to(DType::f32);
  expect_paged_ops_reject("page_table");
  args = valid_args();
  args.paged.cache.seq_lens = args.paged.cache.seq_lens.to(DType::i64);
  expect_paged_ops_reject("seq_lens");
}

TEST_P(OpErrors, BadCuSeqlens) {
  // Valid: cu_seqlens_q = [0, 3, 8, 10], cu_seqlens_k = [0, 6, 15, 17].
  args.c.cu_seqlens_q = int32_tensor({0, 8, 3, 10});  // decreasing
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "cu_seqlens_q");
  expect_varlen_attention_rejects("cu_seqlens_q");
  args = valid_args();
  args.c.cu_seqlens_k = int32_tensor({1, 6, 15, 17});  // not starting at 0
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "cu_seqlens_k[0]");
  expect_varlen_attention_rejects("cu_seqlens_k[0]");
  args = valid_args();
  args.c.cu_seqlens_q = int32_tensor({0, 3, 8, 9});  // last != total_q
  expect_varlen_attention_rejects("cu_seqlens_q[3]");
  args.paged.cu_seqlens_q = args.c.cu_seqlens_q;
  expect_paged_ops_reject("cu_seqlens_q[3]");
  args = valid_args();
  args.c.cu_seqlens_k = int32_tensor({0, 17});  // a different batch size
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "cu_seqlens_k");
  expect_varlen_attention_rejects("cu_seqlens_k");
  args = valid_args();
  args.c.cu_seqlens_q = int32_tensor({0, 7, 8, 10});  // sequence 0: 7 queries, 6 keys
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "cu_seqlens_q");
  expect_varlen_attention_rejects("cu_seqlens_q");
  args = valid_args();
  args.c.cu_seqlens_q = int32_tensor({0});  // no batch at all
  expect_rejected(args, [&] { args.run_indexer(impl()); }, "cu_seqlens_q");
}

// Sets slot `slot` of (group 0, row `row`) of the args' selection.
void set_selection(OpArgs& args, int64_t row, int64_t slot, int32_t id) {
  args.topk = args.topk.clone();
  args.topk.set(row * args.topk.size(2) + slot, id);
}

TEST_P(OpErrors, BadSelectionRows) {
  const auto expect_sparse_rejects = [&](const std::string& argument) {
    expect_rejected(args, [&] { args.run_sparse(impl()); }, argument);
    expect_rejected(args, [&] { args.run_paged_sparse(impl()); }, argument);
  };
  set_selection(args, 0, 0, 2);  // row 0 sits at position 3: own block 1
  expect_sparse_rejects("topk[0][0][0]");
  args = valid_args();
  set_selection(args, 0, 0, -2);
  expect_sparse_rejects("topk[0][0][0]");
  args = valid_args();
  set_selection(args, 0, 0, args.topk.get(1));  // slot 0 duplicates slot 1
  expect_sparse_rejects("topk[0][0][1]");
  args = valid_args();
  set_selection(args, 8, 0, -1);  // row 8 = [0, -1, -1] becomes [-1, 0, -1]
  set_selection(args, 8, 1, 0);
  expect_sparse_rejects("topk[0][8][1]");
  args = valid_args();
  for (const Shape& shape : {Shape{1, args.topk.size(1), 3}, Shape{2, args.topk.size(1) - 1, 3},
                             Shape{2, args.topk.size(1), 0}}) {
    args.topk = Tensor::full(shape, DType::i32, -1);
    expect_sparse_rejects("topk");
  }
}

TEST_P(OpErrors, BadPagedCaches) {
  // Request 1 holds 9 tokens in 5 pages of 2.
  const int64_t pages = args.paged.cache.k_cache.size(0);
  const int64_t columns = args.paged.cache.page_table.size(1);
  for (int32_t bad_page : {static_cast<int32_t>(pages), -1}) {
    args = valid_args();
    args.paged.cache.page_table = args.paged.cache.page_table.clone();
    args.paged.cache.page_table.set(1 * columns + 4, bad_page);
    expect_paged_ops_reject("page_table[1][4]");
  }
  args = valid_args();
  args.paged.cache.page_table = Tensor::zeros({3, 4}, DType::i32);  // 4 columns < 5 pages
  expect_paged_ops_reject("page_table");
  args = valid_args();
  args.paged.cache.seq_lens = int32_tensor({6, 4, 2});  // request 1 has 5 new queries
  expect_paged_ops_reject("seq_lens[1]");
  args = valid_args();
  args.paged.cache.seq_lens = int32_tensor({6, 9});  // one entry per request
  expect_paged_ops_reject("seq_lens");
  args = valid_args();
  args.paged.cache.page_table = Tensor::zeros({2, columns}, DType::i32);
  expect_paged_ops_reject("page_table");
}

TEST_P(OpErrors, GarbageBeyondARequestsPagesIsAccepted) {
  // page_varlen_case fills the columns beyond each request's pages with 999999.
  EXPECT_EQ(args.paged.cache.page_table.get(args.paged.cache.page_table.size(1) - 1),
            kUnusedPageColumn);
  EXPECT_NO_THROW(args.run_paged_indexer(impl()));
  EXPECT_NO_THROW(args.run_paged_dense(impl()));
}

TEST_P(OpErrors, BadParams) {
  const MsaParams valid = args.params;
  const auto expect_params_rejected = [&](const std::function<void(MsaParams&)>& edit,
                                          const std::string& argument) {
    args.params = valid;
    edit(args.params);
    expect_every_op_rejects(argument);
    EXPECT_THROW(validate_params(args.params), Error);
  };
  expect_params_rejected([](MsaParams& p) { p.topk = 0; }, "topk");
  expect_params_rejected([](MsaParams& p) { p.local_blocks = 0; }, "local_blocks");
  expect_params_rejected([](MsaParams& p) { p.init_blocks = -1; }, "init_blocks");
  expect_params_rejected([](MsaParams& p) { p.init_blocks = 3; }, "local_blocks + init_blocks");
  expect_params_rejected([](MsaParams& p) { p.temperature = 0; }, "temperature");
  expect_params_rejected([](MsaParams& p) { p.temperature = -1; }, "temperature");
  expect_params_rejected([](MsaParams& p) { p.temperature = std::nan(""); }, "temperature");
  expect_params_rejected([](MsaParams& p) { p.block_size = 0; }, "block_size");
  expect_params_rejected([](MsaParams& p) { p.scale = std::nan(""); }, "scale");
}

INSTANTIATE_TEST_SUITE_P(Impls, OpErrors, ::testing::Values(Impl::reference, Impl::cpu),
                         impl_test_name);

}  // namespace
}  // namespace msa::testing
