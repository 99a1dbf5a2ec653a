// Workspace layout of the launchers' plans (plan/run: the plan lays out one caller-owned
// workspace from host-known sizes, the run only offsets into it), and the alignment checks of
// the launchers' pointers. Host-only, no CUDA headers.
#pragma once
#include <cstddef>
#include <cstdint>

namespace msa::cuda {

constexpr size_t kWorkspaceAlign = 256;  // every workspace region starts 256-byte aligned

inline size_t align_up(size_t bytes) { return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Equal chunks: the chunk that splits total_q in as many chunks as `chunk` does, with no
// small tail chunk (a mostly idle grid); never larger than `chunk`.
inline int64_t balanced_chunk(int64_t total_q, int64_t chunk) {
  return ceil_div(total_q, ceil_div(total_q, chunk));
}
// Whether `pointer` is a multiple of `bytes` (a vector load's or a copy's width).
inline bool is_aligned(const void* pointer, size_t bytes) { return reinterpret_cast<uintptr_t>(pointer) % bytes == 0; }

// Counting allocator: take(bytes) is the next region's offset; `at` ends as the total size.
struct WorkspaceCursor {
  size_t at = 0;
  size_t take(size_t bytes) {
    const size_t offset = at;
    at += align_up(bytes);
    return offset;
  }
  // A region of `count` elements of T (a count <= 0: an empty region, nothing taken).
  template <class T>
  size_t take_elements(int64_t count) {
    return take(static_cast<size_t>(count > 0 ? count : 0) * sizeof(T));
  }
  size_t total() const { return at; }
};

}  // namespace msa::cuda
