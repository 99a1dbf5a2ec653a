// MSA forward = indexer + sparse attention, or dense attention where they are equal.
#include <algorithm>

#include "cuda/launch.h"
#include "msa/error.h"

namespace msa::cuda {

namespace {
constexpr size_t kAlignment = 256;
size_t align_up(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

AttentionParams dense_of(AttentionParams attention) {
  attention.topk = nullptr;
  attention.slots = 0;
  return attention;
}
}  // namespace

bool msa_is_dense(const IndexerParams& index) {
  return index.batch.max_k_len <= int64_t{index.topk} * index.block_size;
}

size_t msa_forward_workspace_bytes(const MsaForwardParams& params) {
  if (msa_is_dense(params.index)) return attention_workspace_bytes(dense_of(params.attention));
  // The attention reads the indexer's rows, so the two workspaces live side by side.
  return align_up(indexer_workspace_bytes(params.index)) +
         attention_workspace_bytes(params.attention);
}

void msa_forward(const MsaForwardParams& params, void* workspace, void* stream) {
  if (msa_is_dense(params.index)) {
    attention(dense_of(params.attention), workspace, stream);
    return;
  }
  MSA_CHECK_ARG(params.attention.topk == params.index.topk_out, "attention.topk",
                "the indexer's topk_out", "another pointer");
  indexer(params.index, workspace, stream);
  attention(params.attention,
            static_cast<char*>(workspace) + align_up(indexer_workspace_bytes(params.index)),
            stream);
}

}  // namespace msa::cuda
