// The paged KV cache of the text model: per layer, K and V pages [pages, Hkv, B, D] and, on
// the MSA layers, index-key pages [pages, B, Di], all f32 (default) or bf16 (half the memory;
// new tokens are rounded to nearest even when written, the ops read bf16 in place), or e4m3
// (fp8 K/V, docs/msa.md §6.6: e4m3 codes with one f32 scale per token and head in k_scale /
// v_scale [pages, Hkv, B], written by append_kv_cache's quantization; a quarter of f32's K/V
// bytes, about half of bf16's; the index keys stay bf16). A page
// holds B tokens (B = the MSA block size); every layer uses the same page ids, so one page
// table per sequence serves all layers. A Device::cuda cache keeps the pages in device
// memory (bf16 or e4m3: what the CUDA kernels read); its tensors are device views.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "msa/model_config.h"
#include "msa/tensor.h"

namespace msa {

// One request's cache: its pages in logical order and how many tokens they hold.
struct SequenceCache {
  std::vector<int32_t> pages;
  int64_t length = 0;
};

class KvCache {
 public:
  // Allocates `num_pages` pages for every layer with elements of `dtype` (f32, bf16 or e4m3)
  // in host memory, or (Device::cuda, bf16 or e4m3) in the current CUDA device's memory. Throws
  // msa::Error when that does not fit in the host's (the device's free) memory.
  KvCache(const ModelConfig& config, int64_t num_pages, DType dtype = DType::f32,
          Device device = Device::cpu);

  static int64_t bytes_per_page(const ModelConfig& config, DType dtype = DType::f32);
  // Per token and layer: K and V of every KV head (e4m3: codes plus one f32 scale per head),
  // and the index key of an MSA layer (bf16 in an e4m3 cache).
  static int64_t kv_bytes_per_token(const ModelConfig& config, DType dtype);
  static int64_t index_key_bytes_per_token(const ModelConfig& config, DType dtype);
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  // Pages needed to hold `tokens` tokens.
  int64_t pages_for(int64_t tokens) const { return (tokens + page_size_ - 1) / page_size_; }

  int page_size() const { return page_size_; }
  int64_t num_pages() const { return num_pages_; }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }

  // Grows `sequence` so that it can hold `tokens` tokens; throws msa::Error naming the
  // shortfall when the cache has too few free pages.
  void reserve(SequenceCache& sequence, int64_t tokens);
  // Returns the sequence's pages to the free list and empties it.
  void release(SequenceCache& sequence);
  // Returns single pages to the free list (the prefix cache's evicted and unshared pages).
  void release_pages(std::span<const int32_t> pages);

  const Tensor& k(int64_t layer) const { return k_[layer]; }
  const Tensor& v(int64_t layer) const { return v_[layer]; }
  const Tensor& index_keys(int64_t layer) const { return index_keys_[layer]; }  // MSA layers
  // e4m3 caches: the f32 scales of k(layer) / v(layer), [pages, Hkv, B]; undefined otherwise.
  const Tensor& k_scale(int64_t layer) const { return k_scale_[layer]; }
  const Tensor& v_scale(int64_t layer) const { return v_scale_[layer]; }

 private:
  void allocate_on_host(const ModelConfig& config, double bytes);
  void allocate_on_device(const ModelConfig& config, double bytes);
  // Every layer's pages (and scales), each made by `zeros` in host or device memory.
  void allocate_layers(const ModelConfig& config, Tensor (*zeros)(const Shape&, DType));

  int page_size_;
  int64_t num_pages_;
  DType dtype_;
  Device device_;
  std::vector<int32_t> free_;
  std::vector<Tensor> k_, v_, index_keys_, k_scale_, v_scale_;
};

}  // namespace msa
