// Sparse attention, KV-block-major, on Hopper warpgroup MMA with a producer warpgroup: the
// wgmma engine's kernel (attention.cu runs it for D = B = 128 and a positive scale).
//
// Items, tiles, tile math and partials: attention_sparse_wgmma.cuh (its header has the plan,
// the traffic, the floors and the profiles). Why a producer: when the two consumer
// warpgroups also issue the Q gathers (8 cp.async per thread and tile, with their address
// arithmetic), the row decode (a selection-key load, run-time divisions), the item decode and
// a CTA barrier at every item change (11% of the stall samples), all of that sits on the path
// between two tiles' MMAs. Here a third warpgroup does all of it, with the same tile math in
// the same order, so the outputs are bitwise those of a kernel without a producer.
// Roles:
//   warpgroups 0, 1 consume (S = Q K^T, softmax, O = P V, partial stores; S of
//     the next tile during this tile's softmax);
//   warpgroup 2 produces, in two halves of 64 threads, half h for consumer warpgroup h: the
//     item's K (half 0) or V (half 1) into the K/V double buffer, then, for each of the
//     item's tiles of warpgroup h, the row table (one row per thread) and the Q tile into
//     warpgroup h's two Q slots: for G = 8 or 16 (M3) by the bulk tensor copy engine, the
//     thread of each query's first row issuing its two 64-column boxes (q_tma, below); else
//     by cp.async gathers of all 64 threads. setmaxnreg: consumers 216 registers, producer 72
//     (2 x 128 x 216 + 128 x 72 = 64,512 of 65,536). ptxas (nvcc 13.0, sm_90a): the consumer
//     code spills the same 10 item-level values at 232, 224 or 216; the producer spilled its
//     look-ahead loads at 40 (109 local accesses, each load waited for at once) and 56 (21),
//     5 at 72.
// Barriers (mbarrier.cuh), phase parity = (use index / 2) & 1 (double buffers):
//   kv_full[b]  (count 128): every producer thread's copy-arrive (its K or V chunks landed).
//   kv_empty[b] (count 256): every consumer thread, after its warpgroup's last tile of
//                the item (or at once when it has none, after waiting kv_full: an arrival
//                never runs a phase ahead). The producer waits before refilling b.
//   q_full[w][s] (count 128; TMA: 64): the 64 copy-arrives of half w's gather plus its 64
//                plain arrives (release: the row table written before the gather); with
//                TMA one arrive per half thread, expect_tx (the query's 2 G x 128 B) from
//                the copying ones.
//   q_empty[w][s] (count 128): every thread of warpgroup w once S of the slot's tile retired.
//   Every consumer thread arrives (not one per warp after __syncwarp): each releases its own
//   reads of the row tables, the order compute-sanitizer's racecheck can follow.
// Row tables: tile u of warpgroup w uses table u % 4, written when slot u % 2 is free, i.e.
//   after S(u - 2) retired; the consumer then works on tile u - 2 (table (u - 2) % 4), and
//   tile u - 4, the table's last user, is finished.
// Deadlock-free: a half waits only for its own warpgroup's releases of earlier tiles and for
//   both warpgroups' releases of the item two before; a consumer waits only for copies of
//   items and tiles at or before its current one, which the halves issue in item order.
// Why the copy engine: with cp.async gathers, at 32K the consumers spent ~20% of their stall
//   samples waiting at q_full, while only ~10% of the producer halves' samples waited for a
//   free slot: the rest sat in the gather's dependent chains (row-table load, 64-bit
//   address, cp.async; 16 per thread and tile). With TMA the gather is ~4 instructions per
//   query; the sparse stage is faster at every context with bitwise equal outputs
//   (GpuSparseTmaQ; bench/results/history.md). AttentionLaunch::sparse_q_load pins either.
// Shared memory: SparseWgmmaTraits' layout + 12 mbarriers (96 B) after the row tables.
#pragma once
#include "cuda/attention/attention_sparse_wgmma.cuh"
#include "cuda/common/mbarrier.cuh"
#include "cuda/common/tma.cuh"

namespace msa::cuda::attn {

struct SparseProducerTraits {
  using W = SparseWgmmaTraits;
  static constexpr int kConsumerThreads = W::kThreads;  // warpgroups 0, 1
  static constexpr int kProducerThreads = 128;          // warpgroup 2
  static constexpr int kHalfThreads = 64;               // one half per consumer warpgroup
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  static constexpr int kConsumerRegisters = 216, kProducerRegisters = 72;
  static constexpr int kBarriers = 12;  // kv_full[2], kv_empty[2], q_full[2][2], q_empty[2][2]
  static constexpr size_t kSmemBytes = W::kSmemBytes + kBarriers * 8;
};
static_assert(SparseProducerTraits::kSmemBytes <= 227 * 1024, "one CTA per SM");
static_assert(SparseProducerTraits::kHalfThreads == SparseWgmmaTraits::kTileRows, "one table row per thread");

// The 12 barriers from a 32-bit shared address (a value: kept in a register by every role).
struct ProducerBarriers {
  uint32_t base;
  __device__ uint32_t kv_full(int b) const { return base + 8 * b; }
  __device__ uint32_t kv_empty(int b) const { return base + 16 + 8 * b; }
  __device__ uint32_t q_full(int w, int s) const { return base + 32 + 8 * (2 * w + s); }
  __device__ uint32_t q_empty(int w, int s) const { return base + 64 + 8 * (2 * w + s); }
};

struct SparseProducerSmem {
  unsigned char* kv;     // [2 buffers][K, V] 32 KB each
  unsigned char* q;      // [2 warpgroups][2 slots] 16 KB each
  unsigned char* stage;  // [8 consumer warps] store staging
  TileRows* tables;      // [2 warpgroups][4]
  ProducerBarriers bars;
};

// The next item's geometry (decode_item: 4 dependent global round trips), then the key of
// the half's first tile row, its block's address (a page-table read) and its valid keys (a
// k_len read), one round trip per step(): a producer half steps once per tile, so the chain
// runs under the current item's tiles and the next item starts without waiting for it;
// finish() completes what short items left.
struct NextItem {
  unsigned it;
  int stage;  // round trips issued: 0 none, 1 the item, 2 its first key, 3 the sequence, 4 info, 5 the rest
  WorkItem item;
  uint64_t first_key, row_key;
  int64_t seq;
  ItemInfo info;
  const uint16_t* src;  // the half's K or V block
  int valid_rows;

  __device__ __forceinline__ void start(unsigned next, unsigned n_items) {
    it = next;
    stage = next < n_items ? 0 : 5;  // none: nothing to load
  }
  __device__ __forceinline__ void step(const SparseArgs& a, const KeyLayout& layout, int G, int first_row,
                                       int r) {
    switch (stage) {
      case 0: item = a.items[it]; break;
      case 1: first_key = a.keys[item.first]; break;
      case 2: seq = item_seq(a, first_key); break;
      case 3: info = item_info(a, item, first_key, seq, G); break;
      case 4:
        row_key = load_row_key(a, info, first_row, G, r);
        src = block_pointer(layout, info.seq, info.block, info.g);
        valid_rows = item_valid_rows(a, info);
        break;
      default: return;
    }
    ++stage;
  }
  __device__ __forceinline__ void finish(const SparseArgs& a, const KeyLayout& layout, int G, int first_row,
                                         int r) {
    while (stage < 5) step(a, layout, G, first_row, r);
  }
};

// Producer half h (threads 64 h .. 64 h + 63 of warpgroup 2): K (h = 0) or V (h = 1) of every
// item of this CTA, and the row tables and Q gathers of consumer warpgroup h's tiles.
__device__ __forceinline__ void sparse_produce(const SparseArgs& a, const CUtensorMap& q_map, bool q_tma,
                                               const SparseProducerSmem& m, unsigned n_items, int G) {
  using T = SparseWgmmaTraits;
  using P = SparseProducerTraits;
  const int ptid = threadIdx.x - P::kConsumerThreads;
  const int h = ptid / P::kHalfThreads, htid = ptid % P::kHalfThreads;
  const KeyLayout& layout = h == 0 ? a.k : a.v;
  const int first_row = h * T::kTileRows;  // of warpgroup h's tiles in an item
  int u = 0;  // tiles of consumer warpgroup h so far
  int j = 0;  // items of this CTA so far
  NextItem next;
  next.start(blockIdx.x, n_items);
  next.finish(a, layout, G, first_row, htid);
  for (unsigned it = blockIdx.x; it < n_items; it += gridDim.x, ++j) {
    const ItemInfo info = next.info;
    uint64_t key = next.row_key;
    const uint16_t* src = next.src;
    const int valid_rows = next.valid_rows;
    next.start(it + gridDim.x, n_items);
    const int buf = j & 1;
    if (j >= 2) mbar_wait(m.bars.kv_empty(buf), ((j >> 1) - 1) & 1);
    unsigned char* dst = m.kv + (2 * buf + h) * T::kKeyBytes;
#pragma unroll 2
    for (int i = htid; i < T::kB * 16; i += P::kHalfThreads)
      copy_block_chunk(dst, src, layout.token_stride, valid_rows, i);
    mbar_arrive_on_copies(m.bars.kv_full(buf));

    for (int tile_row = first_row; tile_row < info.rows; tile_row += 2 * T::kTileRows, ++u) {
      const int slot = u & 1;
      if (u >= 2) mbar_wait(m.bars.q_empty(h, slot), ((u >> 1) - 1) & 1);
      TileRows& rows = m.tables[h * T::kRowTables + u % T::kRowTables];
      const int64_t q_row = decode_tile_row(a, info, tile_row, G, key, rows, htid);
      // The next tile's key now: its load runs under this tile's gather and the wait above.
      if (tile_row + 2 * T::kTileRows < info.rows) key = load_row_key(a, info, tile_row + 2 * T::kTileRows, G, htid);
      unsigned char* slot_q = m.q + (2 * h + slot) * T::kQBytes;
      if (q_tma) {
        // The thread whose row starts a query copies that query's G rows, two 64-column
        // boxes, by the copy engine; no table rows of other threads are read.
        if (htid % G == 0) {
          mbar_arrive_expect_tx(m.bars.q_full(h, slot), 2 * G * T::kD);  // + release: its table row
          const uint32_t dst = smem_address(slot_q) + htid * 128;
          tma_load_2d(dst, q_map, 0, static_cast<int>(q_row), m.bars.q_full(h, slot));
          tma_load_2d(dst + T::kTileRows * 128, q_map, 64, static_cast<int>(q_row), m.bars.q_full(h, slot));
        } else {
          mbar_arrive(m.bars.q_full(h, slot));  // release: this thread's table row
        }
      } else {
        named_barrier_sync(3 + h, P::kHalfThreads);  // the half's table rows -> its gather
        gather_q_tile(a, rows, slot_q, htid);
        mbar_arrive_on_copies(m.bars.q_full(h, slot));
        mbar_arrive(m.bars.q_full(h, slot));  // release: this thread's table row
      }
      next.step(a, layout, G, first_row, htid);
    }
    next.finish(a, layout, G, first_row, htid);
  }
  cp_async_wait<0>();  // no copy outlives the thread
}

// Consumer warpgroup w: its tiles (rows 64 w + 128 k of each item), fed by the producer.
struct ConsumerTiles {
  ProducerBarriers bars;
  int warpgroup, warp, lane;
  unsigned char* q_smem;  // this warpgroup's 2 slots
  TileRows* tables;       // this warpgroup's 4
  unsigned char* stage;   // this warp's staging
  uint32_t k_addr, v_addr;
  int t;  // tile stream index

  __device__ __forceinline__ void wait_q(int u) {
    mbar_wait(bars.q_full(warpgroup, u & 1), (u >> 1) & 1);
    fence_async_shared();  // the producer's cp.async writes -> this thread's wgmma reads
  }
  __device__ __forceinline__ void issue_scores(float (&s)[64], int u) {
    using T = SparseWgmmaTraits;
    wgmma_fence();
    wgmma_m64n128k128_ss(s, smem_address(q_smem + (u & 1) * T::kQBytes), T::kTileRows, k_addr, T::kB);
    wgmma_commit();
  }
  // S(u) retired in this warp: its Q slot may take tile u + 2.
  __device__ __forceinline__ void release_q(int u) {
    mbar_arrive(bars.q_empty(warpgroup, u & 1));
  }
  template <bool kNext>
  __device__ __forceinline__ void compute(const SparseArgs& a, float (&s)[64], float (&s_next)[64]) {
    using T = SparseWgmmaTraits;
    if constexpr (kNext) {
      wait_q(t + 1);
      issue_scores(s_next, t + 1);
      wgmma_wait<1>();  // S(t) done; S(t + 1) may run on
    } else {
      wgmma_wait<0>();
    }
    fence_operands(s);
    release_q(t);
    softmax_pv_store<kNext>(a, s, s_next, tables[t % T::kRowTables], warp, lane, stage, v_addr);
    ++t;
  }
};

__device__ __forceinline__ void sparse_consume(const SparseArgs& a, const SparseProducerSmem& m,
                                               unsigned n_items, int G) {
  using T = SparseWgmmaTraits;
  ConsumerTiles c;
  c.bars = m.bars;
  c.warpgroup = threadIdx.x / 128;
  c.warp = (threadIdx.x % 128) / 32;
  c.lane = threadIdx.x % 32;
  c.q_smem = m.q + 2 * c.warpgroup * T::kQBytes;
  c.tables = m.tables + c.warpgroup * T::kRowTables;
  c.stage = m.stage + (threadIdx.x / 32) * T::kStageBytes;
  c.t = 0;
  const int first_row = c.warpgroup * T::kTileRows;
  float s_a[64], s_b[64];  // the two score accumulator sets, alternating by tile
  int j = 0;
  int rows = a.items[blockIdx.x].count * G;  // the next item's row count, loaded one item ahead
  for (unsigned it = blockIdx.x; it < n_items; it += gridDim.x, ++j) {
    const int item_rows = rows;
    if (it + gridDim.x < n_items) rows = a.items[it + gridDim.x].count * G;
    const int buf = j & 1;
    mbar_wait(m.bars.kv_full(buf), (j >> 1) & 1);
    fence_async_shared();
    c.k_addr = smem_address(m.kv + 2 * buf * T::kKeyBytes);
    c.v_addr = c.k_addr + T::kKeyBytes;
    const int tiles =
        item_rows > first_row ? (item_rows - first_row + 2 * T::kTileRows - 1) / (2 * T::kTileRows) : 0;
    if (tiles > 0) {
      c.wait_q(c.t);
      c.issue_scores(s_a, c.t);
      // Unrolled by two so that s_a and s_b keep their roles by name.
      for (int k = 0;; k += 2) {
        if (k + 1 >= tiles) {
          c.compute<false>(a, s_a, s_b);
          break;
        }
        c.compute<true>(a, s_a, s_b);
        if (k + 2 >= tiles) {
          c.compute<false>(a, s_b, s_a);
          break;
        }
        c.compute<true>(a, s_b, s_a);
      }
    }
    // This warp's MMAs on the buffer retired (wait_group 0 ended the last tile).
    mbar_arrive(m.bars.kv_empty(buf));
  }
}

// q_tma: Q tiles by the copy engine from q_map (rows = (query, q-head), D = 128 columns, boxes
// of G rows x 64 columns; the host passes it only for G = 8 or 16, see attention.cu); else
// by cp.async gathers (q_map unused).
__global__ void __launch_bounds__(SparseProducerTraits::kThreads, 1)
    sparse_producer_kernel(const __grid_constant__ SparseArgs a, const __grid_constant__ CUtensorMap q_map,
                           const int q_tma) {
  using T = SparseWgmmaTraits;
  using P = SparseProducerTraits;
  extern __shared__ uint4 smem_raw[];  // same declaration as the other kernels of this namespace
  const uint32_t align_pad = (1024u - (smem_address(smem_raw) & 1023u)) & 1023u;
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_raw) + align_pad;
  SparseProducerSmem m;
  m.kv = smem;
  m.q = smem + 4 * T::kKeyBytes;
  m.stage = m.q + 4 * T::kQBytes;
  m.tables = reinterpret_cast<TileRows*>(m.stage + (T::kThreads / 32) * T::kStageBytes);
  m.bars.base = smem_address(m.tables + 2 * T::kRowTables);

  const unsigned n_items = *a.item_count;
  if (blockIdx.x >= n_items) return;  // uniform: before any barrier
  const int G = static_cast<int>(a.group);
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b) {
      mbar_init(m.bars.kv_full(b), P::kProducerThreads);
      mbar_init(m.bars.kv_empty(b), T::kThreads);
      for (int w = 0; w < 2; ++w) {
        // cp.async gathers: each half thread's copy-arrive and plain arrive; TMA: one arrive
        // per half thread (expect_tx from the copying ones).
        mbar_init(m.bars.q_full(w, b), q_tma ? P::kHalfThreads : 2 * P::kHalfThreads);
        mbar_init(m.bars.q_empty(w, b), 128);
      }
    }
    mbar_init_fence();
  }
  __syncthreads();  // the barriers' initialisation is visible to every thread
  // One if/else over whole warpgroups: what setmaxnreg needs to take effect.
  if (threadIdx.x >= P::kConsumerThreads) {
    setmaxnreg_dec<P::kProducerRegisters>();
    if (q_tma && threadIdx.x == P::kConsumerThreads) tma_prefetch_map(q_map);
    sparse_produce(a, q_map, q_tma != 0, m, n_items, G);
  } else {
    setmaxnreg_inc<P::kConsumerRegisters>();
    sparse_consume(a, m, n_items, G);
  }
}

}  // namespace msa::cuda::attn
