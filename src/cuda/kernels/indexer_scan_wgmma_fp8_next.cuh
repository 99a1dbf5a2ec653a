// Opt-in variant of fp8_tile_scan_kernel (MSA_INDEXER_FP8_NEXT=1, indexer.cu): the same
// scores, block maxima, lists and rows (bitwise: the rows equal the default kernel's), with
// the non-MMA work per 128-key block cut down and taken off the tensor cores' path.
// NOT YET RUN ON A GPU (written 2026-12 without a device; see "Risks" below).
//
// Why: the budget in indexer_scan_wgmma_fp8.cuh. Per 128-key block the tensor cores need
// 1024 clocks per SM while each SM sub-partition issues ~1030 instructions of the default
// kernel's 2 warps (~516 each): the epilogue binds, and every latency (the CTA barrier each
// block, the page-table load before the next MMA issue, a list insert shifting ~40 clocks
// per entry, taken by some warp in most blocks on random data) stalls all 8 warps.
// Measured 1M: 1.92 us per block per SM (577 TFLOP/s), ~3.3x the MMA time.
//
// What changes (everything else is fp8_tile_scan_kernel's):
// - A producer warpgroup (threads 256..383) does every key copy (cp.async, 16 B, coalesced
//   512-byte runs) and arms each stage's mbarrier when its copies land
//   (cp.async.mbarrier.arrive.noinc): the consumers issue no copies, no page-table loads,
//   no CTA barrier. A stage is refilled once all 8 consumer warps released it (empty
//   mbarrier). The two consumer warpgroups are no longer in lockstep: one can reduce while
//   the other's MMAs run, and a warp stalled in a list insert holds up its own warpgroup
//   only. setmaxnreg moves registers from the producer (40) to the consumers (232).
// - Consumers wait for the 4 blocks of a chain at its start (no MMA in flight there, so the
//   spin loops never sit inside an overlapped chain) and make the copies visible to the
//   tensor cores with one proxy fence per chain (reader side: after the mbarrier acquire).
// - Key scales are stored permuted (and XOR-swizzled, conflict-free): 8 LDS.128 per unit
//   instead of 16 LDS.64; A and B descriptors sit in uniform registers.
// - Lists are unsorted with the worst entry tracked (TopSet): an insert overwrites the
//   worst entry and rescans the list in batches of 8 independent loads (M3: 2 round trips,
//   ~100 clocks) instead of shifting entries on a dependent chain (~40-50 clocks per entry,
//   ~8 on average); each list is sorted once at the end, so rows come out in the default
//   kernel's order. With the CTA barrier per block, the slowest insert of the 16 warp-units
//   of a block (most blocks have one on random data) delayed the whole CTA: likely most of
//   the gap between the default kernel (1.92 us per block) and the prototype that stored
//   block maxima instead (1.34 us).
// SASS (nvcc 13.0): ~365 instructions per block and consumer warp on the common path (262
// FMUL/FMNMX, 16 LDS.128, 8 SHFL, 8 QGMMA, ~80 other) vs ~516, i.e. ~730 per sub-partition
// per 1024 tensor clocks (+ ~30 for its producer warp). Registers: 168 at entry, consumers
// use <= 177 of 232, the producer <= 20 of 40; no spills, no C7514/C7508. Prediction:
// 650-850 TFLOP/s at 1M (default 577), if issue and exposed latency bind as budgeted.
//
// Ring protocol (block index j = 0.. of the tile's scan, stage j % kStages):
//   full[s]  (count 128): each producer thread's noinc arrive fires when its copies landed.
//            Consumers wait for parity (j / kStages) & 1.
//   empty[s] (count 8): lane 0 of each consumer warp arrives after its last reduce of block
//            j (its wgmma reads retired at wait_group, its scale loads consumed). The
//            producer waits for parity (j / kStages - 1) & 1 before copying block j >= kStages.
//   Deadlock-free: consumers wait for blocks [4c, 4c + 4) at chain c's start having released
//   every block < 4c; the producer needs only releases of blocks <= 4c + 3 - kStages < 4c.
//
// Shared memory: as fp8_tile_scan_kernel (Q 32 KB, 8 x (16 KB + 512 B) ring, lists,
//   1 KB alignment reserve); the 16 mbarriers (128 B) live in that reserve, before the
//   aligned region when its pad is >= 128 B, else after the lists (the reserve's other end
//   then has >= 897 B free). So every list pitch <= 31 still fits 227 KB.
//
// Risks (unverified without a device): the reader-side proxy fence (the validated kernels
//   fence on the writer side before a CTA barrier); mbarrier phase bookkeeping (a mistake
//   hangs: run the tests under `timeout`); ptxas serialising the wgmma chains (C7514: none
//   with nvcc 13.0 here); shared-memory bandwidth (SS wgmma reads ~96 B/clk at the fp8
//   rate, out of 128) may bind before the issue budget does.
#pragma once
#include <type_traits>

#include "cuda/kernels/indexer_scan_wgmma_fp8.cuh"

namespace msa::cuda::indexer_detail {

struct Fp8NextTraits {
  static constexpr int kDi = 128;
  static constexpr int kBlock = 128;
  static constexpr int kConsumerThreads = 256;                 // warpgroups 0 and 1
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kProducerThreads = 128;                 // warpgroup 2
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  // setmaxnreg: 384 threads start at 168 registers (3 warps per sub-partition share its 64 KB);
  // the producer gives its share to the consumers: 2 x 232 + 40 = 504 <= 512 per lane.
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static constexpr int kTiles = 2;                             // 64-row tiles per warpgroup
  static constexpr int kRows = 128 * kTiles;
  static constexpr int kStages = 8;
  static constexpr int kChainBlocks = 4;
  static constexpr int kQBytes = kRows * kDi;
  static constexpr int kBlockBytes = kBlock * kDi;             // 16 KB of e4m3 codes
  static constexpr int kScaleBytes = kBlock * 4;               // 512 B of f32 scales
  static constexpr int kQCopiesPerThread = kQBytes / 16 / kConsumerThreads;       // 8
  static constexpr int kCodeCopiesPerThread = kBlockBytes / 16 / kProducerThreads;  // 8
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  static constexpr size_t kPipelineBytes =
      size_t{kQBytes} + size_t{kStages} * (kBlockBytes + kScaleBytes);
  static_assert(kTiles == 2, "units alternate between the two row tiles of a block");
  static_assert(kStages % kChainBlocks == 0 && kStages >= 2 * kChainBlocks,
                "whole chains never wrap the ring; two chains in flight");
  static_assert((kStages & (kStages - 1)) == 0, "stage and parity by shifts");
  static_assert(kProducerThreads == kBlock, "one key scale per producer thread");
  static_assert(kCodeCopiesPerThread * kProducerThreads * 16 == kBlockBytes &&
                    kProducerThreads % 64 == 0,
                "whole 16-byte chunks; keys tid / 8 + 16 i keep one swizzle phase");
  static_assert(2 * kConsumerRegisters + kProducerRegisters <= 512, "one sub-partition's file");
  static_assert(kBarrierBytes <= 512, "the barriers fit either end of the 1 KB reserve");
  static constexpr size_t kMaxSmemBytes = 227 * 1024;
  static constexpr size_t smem_bytes(int list_pitch) {
    return 1024 + kPipelineBytes + size_t{kRows} * list_pitch * (sizeof(float) + sizeof(int32_t));
  }
};
static_assert(Fp8NextTraits::smem_bytes(kMaxTopk - 1) <= Fp8NextTraits::kMaxSmemBytes,
              "every list pitch (topk <= 32) must fit");

// ---- mbarrier vocabulary (shared::cta, 64-bit barriers at shared addresses) ----
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Orders the initialisations before later barrier operations of other threads (with the
// CTA barrier that follows).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive (release, CTA scope): this thread's earlier shared-memory reads are done.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// An arrive that fires once every cp.async this thread issued so far has landed; counts
// against the barrier's expected arrivals (noinc).
__device__ __forceinline__ void mbar_arrive_on_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits (acquire) for the completion of the barrier's phase of parity `parity`.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_test(bar, parity)) {
  }
}
// 16-byte cp.async to a shared address; `valid` false writes zeros instead.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(global),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- key-scale layout of one stage ----
// The reduce's thread quad q needs the scales of columns 8n + 2q + e (n < 16, e < 2): as 8
// float4 chunks m = {cols (2m, q, 0), (2m, q, 1), (2m + 1, q, 0), (2m + 1, q, 1)}. Chunk m of
// quad q sits at float 32 q + 4 (m ^ q): the 4 quads of a quarter warp hit 4 bank groups.
__device__ __forceinline__ int scale_chunk_offset(int quad, int chunk) {  // floats
  return 32 * quad + 4 * (chunk ^ quad);
}
__device__ __forceinline__ int scale_slot(int key) {  // floats, 0..127
  const int n = key / 8, quad = (key % 8) / 2, e = key % 2;
  return scale_chunk_offset(quad, n / 2) + 2 * (n % 2) + e;
}

// ---- lists ----
// The best `capacity` candidates of one row, unsorted, with the worst entry tracked (the
// smallest value; among equal values the highest id, which ranks last). Owned by one thread.
// Offered ids ascend, so an entry enters only when strictly better than the worst (an equal
// value offered later ranks after it): exactly the set TopList keeps. sort_best_first()
// orders it as TopList does (value descending, equal values by ascending id).
struct TopSet {
  float* values;
  int32_t* ids;
  int capacity;
  int count;
  int worst;        // slot of the worst entry once full
  float threshold;  // its value once full; -inf before; +inf for an empty capacity

  __device__ __forceinline__ void init(float* v, int32_t* i, int cap) {
    values = v;
    ids = i;
    capacity = cap;
    count = 0;
    worst = 0;
    threshold = cap > 0 ? kNegInf : -kNegInf;
  }
  __device__ __forceinline__ bool wants(float value) const {
    return count < capacity || value > threshold;
  }
  // Batches of 8 independent (predicated, branch-free) loads: the rescan of a 15-entry list
  // costs ~2 shared-memory round trips, not one per entry.
  __device__ __forceinline__ void find_worst() {
    constexpr int kBatch = 8;
    float worst_value = -kNegInf;
    int32_t worst_id = -1;
    int slot = 0;
    for (int base = 0; base < capacity; base += kBatch) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int k = base + u;
        const bool valid = k < capacity;
        const float v = values[valid ? k : 0];
        const int32_t id = ids[valid ? k : 0];
        if (valid && (v < worst_value || (v == worst_value && id > worst_id))) {
          worst_value = v;
          worst_id = id;
          slot = k;
        }
      }
    }
    worst = slot;
    threshold = worst_value;
  }
  // Precondition: wants(value).
  __device__ __forceinline__ void insert(float value, int32_t id) {
    const int slot = count < capacity ? count++ : worst;
    values[slot] = value;
    ids[slot] = id;
    if (count == capacity) find_worst();
  }
  __device__ __forceinline__ void offer(float value, int32_t id) {
    if (wants(value)) insert(value, id);
  }
  __device__ void sort_best_first() {  // once per row, at the end (insertion sort)
    for (int i = 1; i < count; ++i) {
      const float v = values[i];
      const int32_t id = ids[i];
      int j = i;
      while (j > 0 && ranks_before(v, id, values[j - 1], ids[j - 1])) {
        values[j] = values[j - 1];
        ids[j] = ids[j - 1];
        --j;
      }
      values[j] = v;
      ids[j] = id;
    }
  }
};

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// The kernel's shared-memory plan (addresses; see "Shared memory" above).
struct Fp8NextSmem {
  uint32_t q = 0;       // [kRows][128 B] e4m3, swizzled
  uint32_t ring = 0;    // kStages x [128 keys][128 B] e4m3, swizzled
  uint32_t scales = 0;  // kStages x [128] f32, permuted (scale_slot)
  uint32_t bars = 0;    // full[kStages], empty[kStages]
  const float* scale_ring = nullptr;  // = scales, as a pointer (LDS)
  float* list_values = nullptr;       // [kRows][list_pitch]
  int32_t* list_ids = nullptr;        // [kRows][list_pitch]
  __device__ __forceinline__ uint32_t full(int stage) const { return bars + 8 * stage; }
  __device__ __forceinline__ uint32_t empty(int stage) const {
    return bars + 8 * (Fp8NextTraits::kStages + stage);
  }
};

__device__ __forceinline__ Fp8NextSmem fp8_next_smem(unsigned char* smem_raw,
                                                     const TileScanPlan& plan) {
  using T = Fp8NextTraits;
  Fp8NextSmem m;
  const uint32_t raw = smem_address(smem_raw);
  const uint32_t pad = (1024 - (raw & 1023)) & 1023;
  unsigned char* smem = smem_raw + pad;  // 1024-byte aligned
  m.q = raw + pad;
  m.ring = m.q + T::kQBytes;
  m.scale_ring = reinterpret_cast<const float*>(smem + T::kQBytes + T::kStages * T::kBlockBytes);
  m.scales = smem_address(m.scale_ring);
  m.list_values = reinterpret_cast<float*>(smem + T::kPipelineBytes);
  m.list_ids = reinterpret_cast<int32_t*>(m.list_values + T::kRows * plan.list_pitch);
  // Split mode allocates no lists (the launcher's smem_bytes(0)).
  const int allocated_pitch = plan.block_max == nullptr ? plan.list_pitch : 0;
  const uint32_t lists_end = m.q + static_cast<uint32_t>(T::kPipelineBytes) +
                             static_cast<uint32_t>(T::kRows * allocated_pitch * 8);
  m.bars = pad >= T::kBarrierBytes ? raw : lists_end;
  return m;
}

// The producer warpgroup: copies blocks 0..n_blocks-1 of the tile's scan into the ring, each
// stage's codes (swizzled) and scales (permuted), and arms its full barrier.
__device__ __forceinline__ void fp8_next_produce(const IndexerParams& p, const TileGeometry& tile,
                                                 const Fp8ScanOperands& ops, const Fp8NextSmem& m,
                                                 int n_blocks) {
  using T = Fp8NextTraits;
  const int ptid = threadIdx.x - T::kConsumerThreads;  // 0..127
  // Thread ptid copies chunk ptid % 8 of keys ptid / 8 + 16 i (i < 8): a warp's instruction
  // is a coalesced 512-byte run of 4 keys; key % 8 = (ptid / 8) % 8 for every i (one phase).
  const int key0 = ptid / 8, chunk = ptid % 8;
  const uint32_t dst0 = key0 * 128 + ((chunk ^ (key0 % 8)) * 16);
  const int src0 = key0 * T::kDi + chunk * 16;
  const uint32_t scale_dst = 4 * scale_slot(ptid);  // key ptid's scale

  const bool paged = p.ki.page_table != nullptr;
  const int64_t seq_start = paged ? 0 : p.ki.seq_token_start[tile.seq];
  const auto block_token = [&](int j) -> int64_t {
    const int64_t block = tile.scan_begin + j;
    if (paged)
      return static_cast<int64_t>(p.ki.page_table[tile.seq * p.ki.page_table_stride + block]) *
             p.ki.block_size;
    return seq_start + block * p.ki.block_size;
  };
  int64_t token = n_blocks > 0 ? block_token(0) : 0;
  for (int j = 0; j < n_blocks; ++j) {
    // The next block's first token, loaded one block ahead (paged: a page-table read).
    const int64_t next_token = j + 1 < n_blocks ? block_token(j + 1) : 0;
    const int stage = j % T::kStages;
    if (j >= T::kStages) mbar_wait(m.empty(stage), ((j / T::kStages) - 1) & 1);
    const uint8_t* src = ops.k_codes + token * T::kDi + src0;
    const uint32_t dst = m.ring + stage * T::kBlockBytes + dst0;
#pragma unroll
    for (int i = 0; i < T::kCodeCopiesPerThread; ++i)
      cp_async_16_if(dst + i * 16 * 128, src + i * 16 * T::kDi, true);
    // 4 bytes: a varlen sequence's first token (hence its scales) may sit anywhere.
    cp_async_4_if(m.scales + stage * T::kScaleBytes + scale_dst, ops.k_scales + token + ptid, true);
    mbar_arrive_on_copies(m.full(stage));
    token = next_token;
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives the warp
}

// The two consumer warpgroups: fp8_tile_scan_kernel's tiles, units and rows, fed by the ring.
__device__ __forceinline__ void fp8_next_consume(const IndexerParams& p, const TileScanPlan& plan,
                                                 const Fp8ScanOperands& ops,
                                                 const TileGeometry& tile, const Fp8NextSmem& m,
                                                 int n_blocks) {
  using T = Fp8NextTraits;
  constexpr int kTiles = T::kTiles;
  const bool fused = plan.block_max == nullptr;
  const int heads = static_cast<int>(p.heads);
  const int64_t tile_row0 = tile.first_query * p.heads;
  // This thread's rows in the accumulator layout of tile t: r and r + 8 with
  // r = 16 warp + lane / 4; after the reduce quad lane 0 owns row r, quad lane 1 row r + 8.
  // The warpgroup index through a shuffle: provably warp-uniform, so the A descriptors live
  // in uniform registers (no per-MMA register moves).
  const int tid = threadIdx.x, lane = tid % 32, warp = (tid % 128) / 32;
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int quad = lane % 4;
  int own_row[kTiles];
  bool owner[kTiles];
  int32_t own_block[kTiles], own_cand_end[kTiles];
  float own_q_scale[kTiles];
  TopSet list[kTiles];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    own_row[t] = (warpgroup * kTiles + t) * 64 + warp * 16 + lane / 4 + 8 * (quad & 1);
    owner[t] = quad < 2 && own_row[t] < tile.n_rows;
    own_block[t] = static_cast<int32_t>((tile.first_pos + own_row[t] / heads) / p.block_size);
    own_cand_end[t] = own_block[t] - p.local_blocks + 1;
    own_q_scale[t] = own_row[t] < tile.n_rows ? ops.q_scales[tile_row0 + own_row[t]] : 0.0f;
    list[t].init(m.list_values + own_row[t] * plan.list_pitch,
                 m.list_ids + own_row[t] * plan.list_pitch, plan.ranked);
  }

  if (n_blocks > 0) {
    // Q codes (rows past the tile zero-filled), visible to both warpgroups' MMAs.
    const uint8_t* tile_q = ops.q_codes + tile_row0 * T::kDi;
#pragma unroll
    for (int j = 0; j < T::kQCopiesPerThread; ++j) {
      const int c = tid + j * T::kConsumerThreads, row = c / 8, chunk = c % 8;
      const bool valid = row < tile.n_rows;
      cp_async_16_zfill(m.q + swizzled_offset(row, chunk, T::kRows),
                        tile_q + (valid ? int64_t{row} * T::kDi + chunk * 16 : 0), valid);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_shared();
    named_barrier_sync(1, T::kConsumerThreads);

    uint64_t a_desc[kTiles];
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
      a_desc[t] = wgmma_descriptor(m.q + (warpgroup * kTiles + t) * 64 * T::kDi);
    const uint64_t b_desc = wgmma_descriptor(m.ring);
    // This quad's scale chunks c < 4 of stage 0 (chunk c + 4: +16 floats; stage s: +128 s).
    const float* scale_chunk[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) scale_chunk[c] = m.scale_ring + scale_chunk_offset(quad, c);

    // One unit: 4 x m64n128k32 e4m3 of row tile t against the block in `stage`. Descriptors
    // count 16-byte units: a stage is kBlockBytes / 16 of them, a k step of 32 B is 2.
    const auto issue = [&](float(&acc)[64], int stage, int t) {
      fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < T::kDi / 32; ++k)
        wgmma_m64n128k32_e4m3(acc, a_desc[t] + 2 * k,
                              b_desc + static_cast<uint64_t>(stage * (T::kBlockBytes / 16) + 2 * k),
                              k > 0);
      wgmma_commit();
    };
    // The block max of a retired unit (fp8_tile_scan_kernel's arithmetic: the same values).
    const auto reduce = [&](float(&acc)[64], int index, int stage, int t) {
      fence_operands(acc);
      float top[16], bottom[16];
#pragma unroll
      for (int c = 0; c < 8; ++c) {  // chunk c: groups 2c, 2c + 1
        const float4 s = *reinterpret_cast<const float4*>(scale_chunk[c % 4] +
                                                          stage * T::kBlock + 16 * (c / 4));
        const int n0 = 2 * c, n1 = 2 * c + 1;
        top[n0] = fmaxf(acc[4 * n0] * s.x, acc[4 * n0 + 1] * s.y);
        bottom[n0] = fmaxf(acc[4 * n0 + 2] * s.x, acc[4 * n0 + 3] * s.y);
        top[n1] = fmaxf(acc[4 * n1] * s.z, acc[4 * n1 + 1] * s.w);
        bottom[n1] = fmaxf(acc[4 * n1 + 2] * s.z, acc[4 * n1 + 3] * s.w);
      }
      float tv = max_tree16(top), bv = max_tree16(bottom);
      tv = fmaxf(tv, __shfl_xor_sync(0xffffffffu, tv, 1));
      bv = fmaxf(bv, __shfl_xor_sync(0xffffffffu, bv, 1));
      tv = fmaxf(tv, __shfl_xor_sync(0xffffffffu, tv, 2));
      bv = fmaxf(bv, __shfl_xor_sync(0xffffffffu, bv, 2));
      const int32_t block = tile.scan_begin + index;
      if (!owner[t] || block >= own_cand_end[t]) return;
      const float value = ((quad & 1) ? bv : tv) * own_q_scale[t];
      if (fused)
        list[t].offer(value, block);
      else
        plan.block_max[(tile_row0 + own_row[t]) * plan.block_max_stride + block] = value;
    };
    // After this warp's last reduce of a block: its MMAs retired (wait_group) and its scale
    // loads consumed (the shuffles above need every lane's products).
    const auto release = [&](int stage) {
      if (lane == 0) mbar_arrive(m.empty(stage));
    };

    // A chain of kBlocks blocks from block `first` (stages first % kStages + b: a whole chain
    // starts at a multiple of kChainBlocks, so it never wraps): units block by block, tile
    // by tile, in accumulator set u % 2; straight-line code, no MMA in flight at its ends.
    float acc[2][64];
    const auto run_chain = [&](int first, auto chain_blocks) {
      constexpr int kBlocks = decltype(chain_blocks)::value;
      constexpr int kUnits = kBlocks * kTiles;
      const int stage0 = first % T::kStages;
      const uint32_t parity = (first / T::kStages) & 1;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) mbar_wait(m.full(stage0 + b), parity);
      fence_async_shared();  // the producer's cp.async writes -> this thread's wgmma reads
      issue(acc[0], stage0, 0);
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        const int next = u + 1;
        if (next < kUnits) {  // resolved at compile time (the loop is unrolled)
          issue(acc[next % 2], stage0 + next / kTiles, next % kTiles);
          wgmma_wait<1>();  // retires unit u
        } else {
          wgmma_wait<0>();
        }
        reduce(acc[u % 2], first + u / kTiles, stage0 + u / kTiles, u % kTiles);
        if (u % kTiles == kTiles - 1) release(stage0 + u / kTiles);
      }
    };
    int i = 0;
    for (; i + T::kChainBlocks <= n_blocks; i += T::kChainBlocks)
      run_chain(i, std::integral_constant<int, T::kChainBlocks>{});
    for (; i < n_blocks; ++i) run_chain(i, std::integral_constant<int, 1>{});
  }

  if (!fused) return;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    if (!owner[t]) continue;
    list[t].sort_best_first();
    const int64_t own_query = tile.first_query + own_row[t] / heads;
    const int own_head = own_row[t] % heads;
    int32_t* out = p.topk_out + (own_head * p.batch.total_q + own_query) * p.topk;
    for (int slot = 0; slot < p.topk; ++slot)
      out[slot] = selection_slot(slot, p, own_block[t], list[t].ids, list[t].count);
  }
}

// grid = (tile bound, chunks) as fp8_tile_scan_kernel; 384 threads: warpgroups 0 and 1
// consume (MMA + reduce), warpgroup 2 produces (copies).
__global__ void __launch_bounds__(Fp8NextTraits::kThreads, 1)
    fp8_tile_scan_next_kernel(const IndexerParams p, const TileScanPlan plan,
                              const Fp8ScanOperands ops) {
  using T = Fp8NextTraits;
  extern __shared__ unsigned char smem_raw[];
  const Fp8NextSmem m = fp8_next_smem(smem_raw, plan);
  const TileGeometry tile = tile_geometry(p, plan);
  if (!tile.valid) return;  // uniform over the CTA: before any barrier
  const int n_blocks = max(0, tile.scan_end - tile.scan_begin);
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(m.full(s), T::kProducerThreads);
      mbar_init(m.empty(s), T::kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the barriers' initialisation is visible to every thread
  // One if/else over whole warpgroups: what setmaxnreg needs to take effect.
  if (threadIdx.x >= T::kConsumerThreads) {
    setmaxnreg_dec<T::kProducerRegisters>();
    fp8_next_produce(p, tile, ops, m, n_blocks);
  } else {
    setmaxnreg_inc<T::kConsumerRegisters>();
    fp8_next_consume(p, plan, ops, tile, m, n_blocks);
  }
}

}  // namespace msa::cuda::indexer_detail
