// Mid/large-M GEMM on Hopper (sm_90a): out[m, n] = sum_k x[m, k] * W[n, k], warp-specialized
// (HF_KBIT_GEMM_KERNEL=wgmma_ws; docs/kernels.md).
//
// Roles (384 threads, one persistent CTA per SM):
//  * A producer warp (warpgroup 2, one elected thread) streams operands into shared memory,
//    completing on mbarriers: x by the tensor copy engine (a 2-D tensor map over x [m, k], boxes
//    of 64 K x 64 NB tokens in the 128-byte swizzle that wgmma reads, zero past m and k), the
//    packed weight of 8 row tiles per K tile by two more tensor copies (3-D maps over the tiles as
//    stored, planes and scales: no repack). x comes in half K tiles, the weight in whole K tiles
//    (kbit_params.h: ws_x_slots, ws_w_slots).
//  * Two consumer warpgroups, 64 weight rows each (128 per CTA). The weight is the wgmma A
//    operand straight from registers: each warp decodes its 16-row tile with per-pair lookups in
//    the GEMV's table of codebook pairs (gemv_kernel.cuh; 64 KB, lane-private copies, no bank
//    conflicts) and one packed multiply by the block scale. Tokens are the wgmma N dimension
//    (NB sub-blocks of 64, from the swizzled x slot through a matrix descriptor).
//  * K order: natural. Lane (g, t) holds A rows g, g + 8 and K positions 2t, 2t+1, 2t+8, 2t+9 of
//    each 16-wide chunk, which in every 32-element block are the pairs (8b + 2t, 8b + 2t + 1),
//    b = 0..3: exactly bit t of each nibble of the block's plane words under the format's bit
//    order (format.py). So (plane >> t) & 0x11111111, combined over the planes, yields a word whose
//    byte b is the pair's table slot, with x in its stored order (no rewrite pass).
//  * Pipeline: the consumers wait on a slot's full barrier, decode chunk c + 1 while the tensor
//    cores run chunk c (one wgmma group in flight per warpgroup, the other warpgroup's fills the
//    gaps), and each warp releases a slot on its empty barrier once the groups reading it retired.
//    The producer runs ahead across tiles, so the next tile's loads overlap this tile's epilogue.
//  * Work: tiles of (64 NB tokens, 128 rows, one of `splits` K ranges), token blocks fastest, CTA c
//    taking tiles c, c + grid, ... Split-K partials go to the float32 workspace and
//    splitk_reduce_kernel (split order: deterministic).
//  * The tensor map needs x 16-byte aligned (the host API checks) at a row pitch of a multiple of
//    16 bytes: the launch copies x whose K is not a multiple of 8 into the workspace's head at a
//    padded pitch, and a rotated layer's x R comes from the standalone rotation there (rotation.cuh).
//  * A programmatic dependent launch: the table is built and the barriers set up while the kernel
//    before it finishes; every thread waits (griddepcontrol.wait) before any x is read.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "gemv_kernel.cuh"
#include "rotation.cuh"
#include "wgmma_kernel.cuh"  // KBIT_HAS_WGMMA and the wgmma primitives

namespace kbit {

constexpr int kWsProducerThread = 32 * kWsConsumerWarps;  // warpgroup 2's first thread

// ---- sm_90 primitives: mbarriers, bulk and tensor copies, register budgets ----

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
#if KBIT_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_init_fence() {
#if KBIT_HAS_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if KBIT_HAS_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}
// Arrives and adds `bytes` to the transactions the phase waits for (the copies' complete_tx).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
#if KBIT_HAS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
// Returns once the phase of parity `parity` completed (a fresh barrier's parity-1 phase counts as
// completed, so a producer's first wait on an empty slot passes).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if KBIT_HAS_WGMMA
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#endif
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
#if KBIT_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#endif
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
#if KBIT_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
#endif
}
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
#if KBIT_HAS_WGMMA
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}
// Warpgroup register budgets (setmaxnreg): the producer needs few, the consumers' accumulators many.
template <int kRegs> __device__ __forceinline__ void regs_alloc() {
#if KBIT_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}
template <int kRegs> __device__ __forceinline__ void regs_dealloc() {
#if KBIT_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}

// ---- the decode (natural K order) ----

// One K tile of this lane's rows g, g + 8 (r = 0, 1), blocks q = 0..3: index words whose byte b is
// the table slot of elements (8b + 2t, 8b + 2t + 1) (k = 5: their high bits in hb, with the lane
// copy offset), and the block scales as activation-dtype pairs.
template <int BITS> struct WsTile {
  uint32_t iw[2][4];
  uint32_t hb[2][BITS == 5 ? 4 : 1];
  uint32_t s2[2][4];
};

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// Bit t of each nibble of the planes' block words, as slot nibbles (bit j from plane j): with the
// words shifted right by t, the GEMV's s = 0 combine (index_words). k = 2, 3 leave garbage in a
// nibble's bits above BITS - 1, which their tables ignore (build_table fills every nibble value).
template <int BITS> __device__ __forceinline__ uint32_t slot_word(const uint32_t (&y)[BITS]) {
  const uint32_t u01 = lop3_or_and(y[0], y[1] << 1, 0x55555555u);
  if constexpr (BITS == 2) return u01;
  else if constexpr (BITS == 3) return lop3_or_and(u01, y[2] << 2, 0x33333333u);
  else return lop3_or_and(u01, lop3_or_and(y[2], y[3] << 1, 0x55555555u) << 2, 0x33333333u);
}

// w_tile: this warp's row tile in the weight slot (BITS planes of 16 rows x 4 words), scales: its
// 16 rows x 4 codes.
template <int BITS>
__device__ __forceinline__ void load_ws_tile(uint32_t w_tile, uint32_t scales, int g, int t, const char* table,
                                                uint32_t lane_word, WsTile<BITS>& wt) {
  const uint32_t* scale_pairs = reinterpret_cast<const uint32_t*>(table + kGemvTableBytes);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    uint4 pw[BITS];
#pragma unroll
    for (int j = 0; j < BITS; ++j) pw[j] = lds128(w_tile + j * 256 + row * 16);
    uint32_t codes;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(codes) : "r"(scales + row * 4));
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t y[BITS];
#pragma unroll
      for (int j = 0; j < BITS; ++j) {
        const uint32_t word = q == 0 ? pw[j].x : q == 1 ? pw[j].y : q == 2 ? pw[j].z : pw[j].w;
        y[j] = word >> t;
      }
      if constexpr (BITS == 5) {
        const uint32_t lo[4] = {y[0], y[1], y[2], y[3]};
        wt.iw[r][q] = slot_word<4>(lo);
        // byte b of hb: (high bit of element 8b+2t) << 6 | (of 8b+2t+1) << 7 | lane copy offset;
        // z keeps bits 0 and 4 of each byte, so z * 72 = z << 6 | z << 3 (no carries).
        const uint32_t z = y[4] & 0x11111111u;
        wt.hb[r][q] = ((z * 72u) & 0xC0C0C0C0u) | lane_word;
      } else {
        wt.iw[r][q] = slot_word<BITS>(y);
      }
      wt.s2[r][q] = scale_pairs[(codes >> (8 * q)) & 0xFFu];
    }
  }
}

// The A fragment of chunk c (K positions 16c .. 16c + 15 of the tile): register 2 h + r holds row
// g + 8 r, positions 2t + 8h + {0, 1}, which is byte 2 (c % 2) + h of block c / 2's index word.
template <int BITS, typename T>
__device__ __forceinline__ void decode_ws_chunk(const WsTile<BITS>& wt, int c, const char* table,
                                                   uint32_t lane_word, uint32_t (&a)[4]) {
  const int q = c >> 1;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      a[2 * h + r] = decode_pair_word<BITS, T>(wt.iw[r][q], BITS == 5 ? wt.hb[r][BITS == 5 ? q : 0] : 0u,
                                               wt.s2[r][q], 2 * (c & 1) + h, table, lane_word);
}

// ---- grouped calls (MoE prefill) ----

// A grouped call multiplies the rows of x sorted by expert (rows offsets[e] .. offsets[e + 1] - 1 by
// expert e's weight) and stores sorted row r at out row order[r]. Its tiles are the token blocks of each
// expert (in expert order) x the row blocks, listed on the device by ws_group_tiles_kernel.
struct WsGroups {
  const int4* tiles;     // [count]: (expert, first sorted row, the expert's end row, 0)
  const int* count;      // the number of token blocks
  const int64_t* order;  // [m]: out row of each sorted row
};

// One CTA of 1024 threads: each expert's token blocks of 64 NB rows, at the running sum of the blocks
// of the experts before it (a scan per 1024 experts). At most m / 64 + experts entries.
template <int NB>
__global__ void __launch_bounds__(1024) ws_group_tiles_kernel(const int64_t* offsets, int64_t experts, int4* tiles,
                                                              int* count) {
  constexpr int kBlockTokens = NB * kWgmmaTokens;
  __shared__ int scan[1024];
  __shared__ int carry;  // blocks of the experts of earlier passes
  wait_for_primary_grid();  // offsets come from the sort before
  allow_dependent_launch();
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < experts; base += 1024) {
    const int64_t e = base + threadIdx.x;
    const int64_t lo = e < experts ? offsets[e] : 0, hi = e < experts ? offsets[e + 1] : 0;
    const int blocks = static_cast<int>((hi - lo + kBlockTokens - 1) / kBlockTokens);
    scan[threadIdx.x] = blocks;
    __syncthreads();
    for (int d = 1; d < 1024; d <<= 1) {  // inclusive scan
      const int v = threadIdx.x >= d ? scan[threadIdx.x - d] : 0;
      __syncthreads();
      scan[threadIdx.x] += v;
      __syncthreads();
    }
    const int first = carry + scan[threadIdx.x] - blocks;
    for (int j = 0; j < blocks; ++j)
      tiles[first + j] = make_int4(static_cast<int>(e), static_cast<int>(lo + int64_t{j} * kBlockTokens),
                                   static_cast<int>(hi), 0);
    __syncthreads();  // every thread read carry
    if (threadIdx.x == 1023) carry += scan[1023];
    __syncthreads();
  }
  if (threadIdx.x == 0) *count = carry;
}

// ---- the GEMM ----

// kGrouped: a grouped call (WsGroups); else a dense one (grp unused).
template <int BITS, typename T, int NB, bool kGrouped>
__global__ void __launch_bounds__(kWsThreads, 1)
    wgmma_ws_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                    const __grid_constant__ CUtensorMap s_map, const MmParams p, const WsGroups grp) {
#if KBIT_HAS_WGMMA
  constexpr int kXSlots = ws_x_slots(NB), kWSlots = ws_w_slots(NB);
  constexpr int kXSlotBytes = ws_x_slot_bytes(NB), kWSlotBytes = ws_w_slot_bytes(BITS);
  constexpr int kPlaneBytes = BITS * 256, kScaleBytes = 64;  // one row tile's share of a K tile
  constexpr int kBlockTokens = NB * kWgmmaTokens;
  extern __shared__ __align__(1024) char smem[];
  char* table = smem;
  const uint32_t x_slots = smem_u32(smem + kWsTableBytes);
  const uint32_t w_slots = x_slots + kXSlots * kXSlotBytes;
  const uint32_t bars = w_slots + kWSlots * kWSlotBytes;  // x full, x empty, w full, w empty
  const auto x_full = [&](int s) { return bars + 8 * s; };
  const auto x_empty = [&](int s) { return bars + 8 * (kXSlots + s); };
  const auto w_full = [&](int s) { return bars + 8 * (2 * kXSlots + s); };
  const auto w_empty = [&](int s) { return bars + 8 * (2 * kXSlots + kWSlots + s); };
  if (x_slots & 1023u) __trap();  // the swizzle atoms need 1 KB alignment

  const int k_tiles = static_cast<int>((p.k + kTileK - 1) / kTileK);
  const int n_tiles = static_cast<int>((p.n + kTileN - 1) / kTileN);
  const int row_blocks = (n_tiles + kWsConsumerWarps - 1) / kWsConsumerWarps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kXSlots; ++s) {
      mbar_init(x_full(s), 1);
      mbar_init(x_empty(s), kWsConsumerWarps);
    }
    for (int s = 0; s < kWSlots; ++s) {
      mbar_init(w_full(s), 1);
      mbar_init(w_empty(s), kWsConsumerWarps);
    }
    mbar_init_fence();
  }
  if (threadIdx.x == kWsProducerThread) {
    prefetch_tensor_map(&x_map);
    prefetch_tensor_map(&w_map);
    prefetch_tensor_map(&s_map);
  }
  // The pair table (k = 2 in pairs too: the decode's slots) and the scale pairs, from the codebook
  // only, so before the wait.
  build_table<BITS, T, false>(table, codebook_lane<BITS>(p.codebook, lane));
  wait_for_primary_grid();  // x (and a grouped call's tile list) may be the previous kernel's output
  allow_dependent_launch();
  __syncthreads();

  // Tile i -> (token block, split, row block), token blocks fastest: CTAs that run together share
  // weight row blocks in L2. A token block is sorted rows row0 .. row_end - 1 of one expert (dense:
  // expert 0, every row up to m).
  const int token_blocks = kGrouped ? *grp.count : static_cast<int>((p.m + kBlockTokens - 1) / kBlockTokens);
  const int tiles = token_blocks * row_blocks * p.splits;
  struct Coords {
    int expert, split, rb;
    int64_t row0, row_end;
  };
  const auto tile_coords = [&](int i) {
    Coords c;
    const int tb = i % token_blocks, rest = i / token_blocks;
    c.split = rest % p.splits;
    c.rb = rest / p.splits;
    if constexpr (kGrouped) {
      const int4 e = grp.tiles[tb];
      c.expert = e.x;
      c.row0 = e.y;
      c.row_end = e.z;
    } else {
      c.expert = 0;
      c.row0 = static_cast<int64_t>(tb) * kBlockTokens;
      c.row_end = p.m;
    }
    return c;
  };

  if (warp >= kWsConsumerWarps) {  // ---- producer warpgroup ----
    regs_dealloc<40>();
    if (threadIdx.x != kWsProducerThread) return;
    int xs = 0, ws = 0;
    uint32_t x_phase = 0, w_phase = 0;
    for (int i = blockIdx.x; i < tiles; i += gridDim.x) {
      const Coords c = tile_coords(i);
      const int kt0 = c.split * p.chunk_kt, kt1 = min(k_tiles, kt0 + p.chunk_kt);
      // The CTA's 8 row tiles of the expert (past its n: the next expert's or zeros, never stored).
      const int tile_row0 = c.expert * n_tiles + c.rb * kWsConsumerWarps;
      for (int kt = kt0; kt < kt1; ++kt) {
        mbar_wait(w_empty(ws), w_phase ^ 1);
        mbar_expect_tx(w_full(ws), kWSlotBytes);
        const uint32_t w_dst = w_slots + ws * kWSlotBytes;
        tma_load_3d(w_dst, &w_map, 0, kt, tile_row0, w_full(ws));
        tma_load_3d(w_dst + kWsConsumerWarps * kPlaneBytes, &s_map, 0, kt, tile_row0, w_full(ws));
        if (++ws == kWSlots) {
          ws = 0;
          w_phase ^= 1;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mbar_wait(x_empty(xs), x_phase ^ 1);
          mbar_expect_tx(x_full(xs), kXSlotBytes);
          tma_load_2d(x_slots + xs * kXSlotBytes, &x_map, kt * kTileK + h * kWsXHalfK, static_cast<int>(c.row0),
                      x_full(xs));
          if (++xs == kXSlots) {
            xs = 0;
            x_phase ^= 1;
          }
        }
      }
    }
    return;
  }

  // ---- consumer warpgroups: warp w decodes row tile w of the CTA's 8 ----
  regs_alloc<232>();
  const int g = lane >> 2, t = lane & 3;
  const uint32_t lane_word = BITS <= 4 ? lane * 4u : table_lane_word<BITS, false>(lane, 0);
  int xs = 0, ws = 0;
  uint32_t x_phase = 0, w_phase = 0;
  const int64_t m = p.m, n = p.n;
  T* out = static_cast<T*>(p.out);
  for (int i = blockIdx.x; i < tiles; i += gridDim.x) {
    const Coords c = tile_coords(i);
    const int kt0 = c.split * p.chunk_kt, kt1 = min(k_tiles, kt0 + p.chunk_kt);
    float acc[NB][32];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 32; ++e) acc[nb][e] = 0.f;
    uint32_t a[2][4];
    int held = -1;  // the x slot whose last wgmma group may still run
    for (int kt = kt0; kt < kt1; ++kt) {
      mbar_wait(w_full(ws), w_phase);
      WsTile<BITS> wt;
      const uint32_t w_src = w_slots + ws * kWSlotBytes;
      load_ws_tile<BITS>(w_src + warp * kPlaneBytes, w_src + kWsConsumerWarps * kPlaneBytes + warp * kScaleBytes,
                            g, t, table, lane_word, wt);
      __syncwarp();
      if (lane == 0) mbar_arrive(w_empty(ws));  // the words are in registers
      if (++ws == kWSlots) {
        ws = 0;
        w_phase ^= 1;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mbar_wait(x_full(xs), x_phase);
        const uint32_t x_src = x_slots + xs * kXSlotBytes;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          uint32_t(&ac)[4] = a[c & 1];
          decode_ws_chunk<BITS, T>(wt, 4 * h + c, table, lane_word, ac);
          pin(ac);
          wgmma_fence();
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
            wgmma_m64n64k16<T>(acc[nb], ac, sw128_desc(x_src + nb * kWgmmaTokens * 128 + c * 32));
          wgmma_commit();
          wgmma_wait<1>();  // the previous chunk's group retired: its A registers and x slot are free
          if (c == 0 && held >= 0) {
            if (lane == 0) mbar_arrive(x_empty(held));
            held = -1;
          }
        }
        held = xs;
        if (++xs == kXSlots) {
          xs = 0;
          x_phase ^= 1;
        }
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) pin(acc[nb]);
    if (held >= 0 && lane == 0) mbar_arrive(x_empty(held));

    // Lane (g, t) holds rows g, g + 8 of the warp's tile; acc[nb][4 j + 2 h + e] is row g + 8 h,
    // token 64 nb + 8 j + 2 t + e (out row order[token] in a grouped call).
    float* wsp = p.splits > 1 ? p.workspace + static_cast<int64_t>(c.split) * m * n : nullptr;
    const int64_t end = min(c.row_end, m);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t tok = c.row0 + nb * kWgmmaTokens + 8 * j + 2 * t + e;
          if (tok >= end) continue;
          const int64_t out_row = kGrouped && grp.order ? __ldg(grp.order + tok) : tok;
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int64_t row = (static_cast<int64_t>(c.rb) * kWsConsumerWarps + warp) * kTileN + g + 8 * hh;
            if (row >= n) continue;
            const float y = acc[nb][4 * j + 2 * hh + e] * __ldg(p.row_scales + c.expert * n + row);
            if (wsp) wsp[out_row * n + row] = y;
            else out[out_row * n + row] = from_float<T>(y);
          }
        }
      }
    }
  }
#else
  __trap();
#endif
}

// ---- host ----

// cuTensorMapEncodeTiled from the driver, found once (the library links only the CUDA runtime).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f)
               : nullptr;
  }();
  return fn;
}

// x [m, k] at a row pitch of `pitch` elements, in boxes of 64 K x `box_tokens` tokens, 128-byte
// swizzle (wgmma's K-major layout), zero outside.
template <typename T>
cudaError_t encode_x_map(CUtensorMap* map, const void* x, int64_t m, int64_t k, int64_t pitch, int box_tokens) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (!encode) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(m)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(pitch) * sizeof(T)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kWsXHalfK), static_cast<cuuint32_t>(box_tokens)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUtensorMapDataType type =
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult rc = encode(map, type, 2, const_cast<void*>(x), dims, strides, box, elem_strides,
                             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return rc == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The packed tiles of `experts` [n, k] weights as [experts * n_tiles, k_tiles] arrays of tiles of
// `tile_bytes` (format.py's tile order), in boxes of one K tile of 8 row tiles: one copy per K tile
// for the planes and one for the scales of a CTA's 128 rows.
inline cudaError_t encode_tile_map(CUtensorMap* map, const void* base, int64_t rows, int64_t k_tiles, int tile_bytes) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (!encode) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(tile_bytes / 8), static_cast<cuuint64_t>(k_tiles),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(tile_bytes), static_cast<cuuint64_t>(k_tiles * tile_bytes)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(tile_bytes / 8), 1, static_cast<cuuint32_t>(kWsConsumerWarps)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult rc = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT64, 3, const_cast<void*>(base), dims, strides, box,
                             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return rc == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The GEMM on x through `map` and on `experts` weights (grid.x persistent CTAs), as a programmatic
// dependent launch.
template <int BITS, typename T, int NB, bool kGrouped>
cudaError_t launch_ws_kernel(const CUtensorMap& map, const MmParams& p, int64_t experts, const WsGroups& grp,
                             dim3 grid, cudaStream_t stream) {
  constexpr auto kernel = wgmma_ws_kernel<BITS, T, NB, kGrouped>;
  constexpr int kSmem = ws_smem_bytes(BITS, NB);
  const int64_t rows = experts * ((p.n + kTileN - 1) / kTileN), k_tiles = (p.k + kTileK - 1) / kTileK;
  CUtensorMap w_map, s_map;
  cudaError_t err = encode_tile_map(&w_map, p.planes, rows, k_tiles, BITS * 256);
  if (err == cudaSuccess) err = encode_tile_map(&s_map, p.block_scales, rows, k_tiles, 64);
  if (err == cudaSuccess) err = raise_smem_limit<kernel>(kSmem);
  if (err != cudaSuccess) return err;
  const KernelLaunch launch(grid, kWsThreads, kSmem, stream, 1, true);  // sm_90 only: always PDL
  return cudaLaunchKernelEx(&launch.config, kernel, map, w_map, s_map, p, grp);
}

// x as the tensor map may read it (a rotated layer's x R, or x at a 16-byte row pitch, into the
// workspace's head), then the GEMM, then the split-K reduce.
template <int BITS, typename T, int NB>
cudaError_t launch_wgmma_ws_gemm(const MmParams& p, dim3 grid, cudaStream_t stream) {
  const void* x = p.x;
  int64_t pitch = p.k;
  cudaError_t err = cudaSuccess;
  if (p.rot_signs) {  // k % 64 == 0: x R is contiguous at a 16-byte pitch
    const RotateParams r{p.x, p.x_perm, p.rot_signs, p.m, p.k, p.k, TypeOf<T>::value, 0};
    err = launch_rotate<T>(r, stream);
    x = p.x_perm;
  } else if (p.k % 8 != 0) {
    pitch = (p.k + 7) / 8 * 8;
    err = cudaMemcpy2DAsync(p.x_perm, pitch * sizeof(T), p.x, p.k * sizeof(T), p.k * sizeof(T), p.m,
                            cudaMemcpyDeviceToDevice, stream);
    x = p.x_perm;
  }
  if (err != cudaSuccess) return err;
  CUtensorMap map;
  err = encode_x_map<T>(&map, x, p.m, p.k, pitch, NB * kWgmmaTokens);
  if (err != cudaSuccess) return err;
  err = launch_ws_kernel<BITS, T, NB, false>(map, p, 1, WsGroups{}, grid, stream);
  if (err != cudaSuccess || p.splits == 1) return err;
  return launch_splitk_reduce<T>(p.workspace, p.out, p.m * p.n, p.splits, stream);
}

// A grouped call (GroupedParams: x sorted by expert at row pitch x_stride, order, offsets, tile_list):
// the tile list (one CTA), then the GEMM on it, `grid` persistent CTAs.
template <int BITS, typename T, int NB>
cudaError_t launch_wgmma_ws_grouped(const GroupedParams& gp, int grid, cudaStream_t stream) {
  int* count = gp.tile_list;
  int4* tiles = reinterpret_cast<int4*>(gp.tile_list + 4);  // 16-byte aligned after the count's unit
  const KernelLaunch list(1, 1024, 0, stream, 1, use_pdl());
  cudaError_t err = cudaLaunchKernelEx(&list.config, ws_group_tiles_kernel<NB>, gp.offsets, gp.e, tiles, count);
  if (err != cudaSuccess) return err;
  CUtensorMap map;
  err = encode_x_map<T>(&map, gp.x, gp.s, gp.k, gp.x_stride, NB * kWgmmaTokens);
  if (err != cudaSuccess) return err;
  MmParams p{};
  p.x = gp.x;
  p.planes = gp.planes;
  p.block_scales = gp.block_scales;
  p.row_scales = gp.row_scales;
  p.codebook = gp.codebook;
  p.out = gp.out;
  p.m = gp.s;
  p.n = gp.n;
  p.k = gp.k;
  p.bits = gp.bits;
  p.dtype = gp.dtype;
  p.splits = 1;
  p.chunk_kt = static_cast<int>((gp.k + kTileK - 1) / kTileK);
  return launch_ws_kernel<BITS, T, NB, true>(map, p, gp.e, WsGroups{tiles, count, gp.order}, dim3(grid), stream);
}

}  // namespace kbit
