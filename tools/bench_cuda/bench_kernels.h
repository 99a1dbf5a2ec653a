// Small device helpers for `msa bench --device cuda`: random inputs made on the device, the
// streaming-read ceiling and output comparison. Host-only header (no CUDA headers);
// implemented in bench_kernels.cu. `stream` is a cudaStream_t (null = legacy default).
#pragma once
#include <cstddef>
#include <cstdint>

namespace msa::cuda::bench {

// data[i] = bf16(normal(0, stddev)), a counter-based stream selected by `seed`.
void fill_normal_bf16(uint16_t* data, size_t count, uint64_t seed, float stddev, void* stream);

// data[i] = a byte uniform in [lo, hi], with bit 7 set at random when `random_top_bit`
// (e4m3 codes without NaN: [0, 0x7e] and a random sign), the same counter-based stream.
void fill_uniform_bytes(uint8_t* data, size_t count, uint64_t seed, uint8_t lo, uint8_t hi, bool random_top_bit,
                        void* stream);

// Planted structure in bf16 token rows [tokens, row_elems]: every token not at a multiple of
// `block` becomes its block's first row plus noise x its own row.
void share_block_rows(uint16_t* rows, size_t tokens, size_t row_elems, size_t block, float noise, void* stream);

// Reads `bytes` (a multiple of 16) from `data` once, 16 bytes per load, over every SM; one
// word goes to `sink` (device, 4 bytes) only in a case that never happens, so the loads stay.
void stream_read(const void* data, size_t bytes, uint32_t* sink, void* stream);

// out[i] = bf16(in[i]) (round to nearest even) over `count` elements: the f32 attention
// output as the bf16 O the backward reads, on the device (the training-step chain).
void f32_to_bf16(const float* in, uint16_t* out, size_t count, void* stream);

// sqrt(sum (a - b)^2 / sum b^2) over `count` elements: a f32, b f32 or bf16 (`b_is_bf16`),
// b the reference. Synchronous (waits for `stream`); NaN if either holds a NaN.
double relative_l2_error(const float* a, const void* b, bool b_is_bf16, size_t count,
                         void* stream);

}  // namespace msa::cuda::bench
