// The MoE layer with expert parallelism: dispatch and combine by all-to-all-v.
//
// Every rank holds the layer's input for all tokens (attention ends in an all-reduce), but
// only routes its own contiguous share of them ("home" tokens), so no routing is repeated. A
// home token's row goes once to the owner of each expert it chose; the owner runs its experts
// over what it received and sends the rows back in the order they came. The home rank weights
// them, and one all-reduce adds them to the shared expert's column-split partial sums, which
// every rank computes for all tokens.
#include <algorithm>
#include <vector>

#include "model/layers.h"
#include "parallel/parallel_layers.h"

namespace msa::parallel {

void moe_expert_parallel(const float* xn, int64_t T, const LayerWeights& w, const ModelConfig& c,
                         const ShardPlan& plan, Communicator& comm, float* out) {
  const int world = plan.world, rank = plan.rank;
  const int64_t H = c.hidden_size, K = c.experts_per_token;
  const int64_t home_begin = T * rank / world, home_end = T * (rank + 1) / world;
  const int64_t home = home_end - home_begin;
  const std::vector<model::ExpertChoice> choices =
      model::route_tokens(xn + home_begin * H, home, w, c);

  // Dispatch: (home token, choice) pairs grouped by the owner of the chosen expert.
  std::vector<int64_t> send_rows(world, 0);
  for (const model::ExpertChoice& pick : choices) ++send_rows[plan.expert_owner(pick.expert)];
  std::vector<int64_t> send_at(world, 0);  // where each owner's rows start in the send buffer
  for (int p = 1; p < world; ++p) send_at[p] = send_at[p - 1] + send_rows[p - 1];
  const int64_t sent = home * K;
  std::vector<float> send(sent * H);
  std::vector<int32_t> send_expert(sent);
  std::vector<int64_t> slot(sent);  // choice i of the home tokens -> its row in send
  {
    std::vector<int64_t> next = send_at;
    for (int64_t i = 0; i < sent; ++i) {
      const int owner = plan.expert_owner(choices[i].expert);
      const int64_t row = next[owner]++;
      slot[i] = row;
      std::copy_n(xn + (home_begin + i / K) * H, H, send.data() + row * H);
      send_expert[row] = static_cast<int32_t>(choices[i].expert - plan.expert_owner(choices[i].expert) * plan.experts);
    }
  }
  const std::vector<int64_t> recv_rows = exchange_counts(comm, send_rows);
  int64_t received = 0;
  for (int64_t n : recv_rows) received += n;
  std::vector<float> recv(received * H);
  std::vector<int32_t> recv_expert(received);
  comm.all_to_all_v(send.data(), send_rows, recv.data(), recv_rows, H, DType::f32);
  comm.all_to_all_v(send_expert.data(), send_rows, recv_expert.data(), recv_rows, 1, DType::i32);

  // This rank's experts over the rows they received.
  std::vector<float> result(received * H), gathered, computed;
  std::vector<int64_t> rows;
  for (int64_t e = 0; e < plan.experts; ++e) {
    rows.clear();
    for (int64_t i = 0; i < received; ++i)
      if (recv_expert[i] == e) rows.push_back(i);
    if (rows.empty()) continue;
    const int64_t n = static_cast<int64_t>(rows.size());
    gathered.resize(n * H);
    computed.resize(n * H);
    for (int64_t i = 0; i < n; ++i) std::copy_n(recv.data() + rows[i] * H, H, gathered.data() + i * H);
    model::mlp_forward(gathered.data(), n, w.experts[e], c, computed.data());
    for (int64_t i = 0; i < n; ++i) std::copy_n(computed.data() + i * H, H, result.data() + rows[i] * H);
  }

  // Combine: the rows go back the way they came.
  std::vector<float> returned(sent * H);
  comm.all_to_all_v(result.data(), recv_rows, returned.data(), send_rows, H, DType::f32);

  if (w.shared_expert.down.defined()) model::mlp_forward(xn, T, w.shared_expert, c, out);
  else std::fill_n(out, T * H, 0.0f);
  // A token's experts are added in expert order, as the single-rank moe_forward adds them.
  std::vector<int64_t> order(K);
  for (int64_t t = 0; t < home; ++t) {
    for (int64_t j = 0; j < K; ++j) order[j] = t * K + j;
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return choices[a].expert < choices[b].expert; });
    float* row = out + (home_begin + t) * H;
    for (int64_t i : order) {
      const float weight = choices[i].weight;
      const float* value = returned.data() + slot[i] * H;
      for (int64_t h = 0; h < H; ++h) row[h] += weight * value[h];
    }
  }
  comm.all_reduce_sum(out, T * H);
}

}  // namespace msa::parallel
