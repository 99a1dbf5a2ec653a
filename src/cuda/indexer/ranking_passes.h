// The prefill index scan's separate-ranking passes (indexer.cu make_plan): the scan writes
// the block maxima of a pass's queries to the workspace, select_rows_kernel ranks them, and
// the next pass reuses the maxima. Plain C++ (no CUDA) so CPU tests check it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/common/workspace_layout.h"  // ceil_div, balanced_chunk

namespace msa::cuda {

struct RankingPasses {
  int64_t pass_queries = 0;  // queries per pass (the last may have fewer); 0: none fits
  int64_t passes = 0;        // ceil(total_q / pass_queries)
  size_t maxima_bytes = 0;   // workspace of one pass's maxima: pass_queries x one query's
};

// Equal passes over total_q >= 1 queries whose maxima (query_maxima_bytes each: index heads x
// blocks x 4) fit cap_bytes, of at most max_chunk_queries queries when that is > 0. None
// (passes 0) where one query's maxima exceed the cap.
inline RankingPasses ranking_passes(int64_t total_q, size_t query_maxima_bytes, size_t cap_bytes,
                                    int64_t max_chunk_queries) {
  RankingPasses r;
  int64_t fit = query_maxima_bytes == 0
                    ? total_q
                    : std::min<int64_t>(total_q, static_cast<int64_t>(cap_bytes / query_maxima_bytes));
  if (max_chunk_queries > 0) fit = std::min(fit, max_chunk_queries);
  if (fit < 1 || total_q < 1) return r;
  r.pass_queries = balanced_chunk(total_q, fit);
  r.passes = ceil_div(total_q, r.pass_queries);
  r.maxima_bytes = size_t(r.pass_queries) * query_maxima_bytes;
  return r;
}

}  // namespace msa::cuda
