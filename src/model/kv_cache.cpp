// Page allocation and the memory check of the paged KV cache.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "msa/model_kv_cache.h"
#ifdef MSA_WITH_CUDA
#include "gpu/device_tensor.h"
#endif

namespace msa {
namespace {
double gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

std::string gib_text(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", gib(bytes));
  return text;
}

// e4m3 caches keep their index keys in bf16 (the CUDA prefill indexer reads bf16 keys).
DType index_key_dtype(DType dtype) { return dtype == DType::e4m3 ? DType::bf16 : dtype; }

}  // namespace

int64_t KvCache::kv_bytes_per_token(const ModelConfig& c, DType dtype) {
  const int64_t kv_bytes = static_cast<int64_t>(dtype_size(dtype));
  const int64_t scale_bytes = dtype == DType::e4m3 ? static_cast<int64_t>(sizeof(float)) : 0;  // per token, head
  return 2 * c.num_kv_heads * (c.head_dim * kv_bytes + scale_bytes);
}

int64_t KvCache::index_key_bytes_per_token(const ModelConfig& c, DType dtype) {
  return c.index_head_dim * static_cast<int64_t>(dtype_size(index_key_dtype(dtype)));
}

int64_t KvCache::bytes_per_page(const ModelConfig& c, DType dtype) {
  int64_t bytes = 0;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    bytes += c.block_size * kv_bytes_per_token(c, dtype);
    if (c.sparse_layers[layer]) bytes += c.block_size * index_key_bytes_per_token(c, dtype);
  }
  return bytes;
}

KvCache::KvCache(const ModelConfig& c, int64_t num_pages, DType dtype, Device device)
    : page_size_(c.block_size), num_pages_(num_pages), dtype_(dtype), device_(device) {
  if (num_pages < 1) throw_arg_error("kv cache pages", "at least 1", num_pages);
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::e4m3)
    throw_arg_error("kv cache dtype", "f32, bf16 or e4m3", std::string(dtype_name(dtype)));
  const double bytes = static_cast<double>(bytes_per_page(c, dtype)) * static_cast<double>(num_pages);
  if (device == Device::cuda) allocate_on_device(c, bytes);
  else allocate_on_host(c, bytes);
  free_.resize(static_cast<size_t>(num_pages));
  // Hand out low page ids first (pop_back takes the last).
  for (int64_t i = 0; i < num_pages; ++i) free_[i] = static_cast<int32_t>(num_pages - 1 - i);
}

void KvCache::allocate_on_host(const ModelConfig& c, double bytes) {
  const DType dtype = dtype_;
  const int64_t num_pages = num_pages_;
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                        static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (bytes > 0.9 * memory)
    throw Error("KV cache of " + std::to_string(num_pages) + " pages x " +
                std::to_string(page_size_) + " tokens (" + std::string(dtype_name(dtype)) +
                ", " + std::to_string(bytes_per_page(c, dtype)) + " bytes per page) needs " +
                gib_text(bytes) +
                ", more than 90% of this machine's " + gib_text(memory) +
                "; ask for fewer tokens (--cache-tokens, --max-tokens, shorter prompts)" +
                (dtype == DType::f32 ? " or a bf16 or fp8 cache (--cache-dtype bf16 | fp8)"
                 : dtype == DType::bf16 ? " or an fp8 cache (--cache-dtype fp8)" : ""));
  allocate_layers(c, Tensor::zeros);
}

void KvCache::allocate_on_device(const ModelConfig& c, double bytes) {
#ifdef MSA_WITH_CUDA
  if (dtype_ != DType::bf16 && dtype_ != DType::e4m3)
    throw_arg_error("kv cache dtype", "bf16 or e4m3 (fp8) on the CUDA device (--cache-dtype bf16 | fp8)",
                    std::string(dtype_name(dtype_)));
  const model::gpu::DeviceMemory memory = model::gpu::device_memory();
  // Leave room for the step's activations and the attention workspace.
  if (bytes > 0.9 * static_cast<double>(memory.free_bytes))
    throw Error("KV cache of " + std::to_string(num_pages_) + " pages x " +
                std::to_string(page_size_) + " tokens (" + std::string(dtype_name(dtype_)) + ", " +
                std::to_string(bytes_per_page(c, dtype_)) + " bytes per page) needs " +
                gib_text(bytes) + ", more than 90% of the CUDA device's free " +
                gib_text(static_cast<double>(memory.free_bytes)) + " (of " +
                gib_text(static_cast<double>(memory.total_bytes)) +
                "); ask for fewer tokens (--cache-tokens, --max-tokens, shorter prompts)");
  allocate_layers(c, model::gpu::device_zeros);
#else
  (void)c;
  (void)bytes;
  throw Error("kv cache device cuda: this build of msa has no CUDA backend (configure with -DMSA_CUDA=ON)");
#endif
}

void KvCache::allocate_layers(const ModelConfig& c, Tensor (*zeros)(const Shape&, DType)) {
  const bool fp8 = dtype_ == DType::e4m3;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    k_.push_back(zeros({num_pages_, c.num_kv_heads, c.block_size, c.head_dim}, dtype_));
    v_.push_back(zeros({num_pages_, c.num_kv_heads, c.block_size, c.head_dim}, dtype_));
    k_scale_.push_back(fp8 ? zeros({num_pages_, c.num_kv_heads, c.block_size}, DType::f32) : Tensor());
    v_scale_.push_back(fp8 ? zeros({num_pages_, c.num_kv_heads, c.block_size}, DType::f32) : Tensor());
    index_keys_.push_back(c.sparse_layers[layer]
                              ? zeros({num_pages_, c.block_size, c.index_head_dim}, index_key_dtype(dtype_))
                              : Tensor());
  }
}

void KvCache::reserve(SequenceCache& sequence, int64_t tokens) {
  const int64_t needed = pages_for(tokens) - static_cast<int64_t>(sequence.pages.size());
  if (needed <= 0) return;
  if (needed > free_pages())
    throw Error("KV cache full: " + std::to_string(tokens) + " tokens need " +
                std::to_string(needed) + " more pages of " + std::to_string(page_size_) +
                " tokens, " + std::to_string(free_pages()) + " of " + std::to_string(num_pages_) +
                " are free");
  for (int64_t i = 0; i < needed; ++i) {
    sequence.pages.push_back(free_.back());
    free_.pop_back();
  }
}

void KvCache::release_pages(std::span<const int32_t> pages) {
  for (int32_t page : pages) {
    MSA_CHECK_ARG(page >= 0 && page < num_pages_, "kv cache page", "a page id in [0, " + std::to_string(num_pages_) + ")", page);
    free_.push_back(page);
  }
}

void KvCache::release(SequenceCache& sequence) {
  for (int32_t page : sequence.pages) free_.push_back(page);
  sequence.pages.clear();
  sequence.length = 0;
}

}  // namespace msa
