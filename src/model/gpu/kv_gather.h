// The copy in front of the gathered cuDNN dense attention (dense_attention_cudnn.h): each
// request's visible keys [0, k_len) of the paged K and V caches [pages, heads, B, head_dim]
// (through a page table) into contiguous buffers [total_k, heads, head_dim], request r's keys
// at rows [k_rows[r], k_rows[r + 1]) (cuDNN's THD layout). A bf16 copy, bitwise. Host-only
// header; implemented in kv_gather.cu.
#pragma once
#include <cstdint>

namespace msa::model::gpu {

struct KvGather {
  const uint16_t* k_cache = nullptr;  // bf16 [pages, heads, block_size, head_dim]
  const uint16_t* v_cache = nullptr;  // the same layout
  int64_t pages = 0, heads = 0, block_size = 0, head_dim = 0;
  const int32_t* page_table = nullptr;  // device [requests, max_pages]: block j of request r -> page
  int64_t requests = 0, max_pages = 0;
  // Device [requests + 1], non-decreasing from 0: request r's keys go to rows [k_rows[r],
  // k_rows[r + 1]), so its k_len is the difference (at most max_pages * block_size).
  const int32_t* k_rows = nullptr;
  int64_t rows = 0;              // rows of k_out / v_out: the kernel writes none at or past it
  uint16_t* k_out = nullptr;     // bf16 [rows, heads, head_dim]
  uint16_t* v_out = nullptr;
};

// Enqueues the copy on `stream` (a cudaStream_t); nothing for zero requests. The sizes and
// pointers are checked on the host (msa::Error: null or unaligned pointers, head_dim not a
// multiple of 8, more requests than a grid holds); the device values (page ids, k_rows) are
// the caller's: pack_step has checked the page ids, and the caller stages k_rows from the
// same lengths it sized `rows` by.
void gather_kv(const KvGather& job, void* stream);

}  // namespace msa::model::gpu
