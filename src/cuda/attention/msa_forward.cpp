// MSA forward = indexer + sparse attention, or dense attention where they are equal
// (msa/cuda/attention.h).
#include <algorithm>

#include "cuda/common/workspace_layout.h"
#include "cuda/launch.h"
#include "msa/error.h"
#include "msa/ops.h"

namespace msa::cuda {

namespace {
AttentionLaunch dense_of(AttentionLaunch attention) {
  attention.topk = nullptr;
  attention.slots = 0;
  return attention;
}
}  // namespace

bool msa_is_dense(const IndexerLaunch& index) {
  return msa_equals_dense(index.batch.max_k_len, index.topk, index.block_size);
}

size_t msa_forward_workspace_bytes(const MsaForwardLaunch& params) {
  if (msa_is_dense(params.index)) return attention_workspace_bytes(dense_of(params.attention));
  // The attention reads the indexer's rows, so the two workspaces live side by side.
  return align_up(indexer_workspace_bytes(params.index)) +
         attention_workspace_bytes(params.attention);
}

void msa_forward(const MsaForwardLaunch& params, void* workspace, void* stream) {
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
