// Mid/large-M GEMM on Hopper's asynchronous tensor cores (sm_90a): out[m, n] = sum_k x[m, k] * W[n, k].
//
// The weight is the wgmma A operand, straight from registers: each warp of a warpgroup decodes
// its 16-row tile with the GEMV's decode (gemv_kernel.cuh: plane words loaded per lane
// kGemvDepth - 1 K tiles ahead, SWAR index words, pair-table lookups, block scale), which yields
// exactly the m64k16 A fragment of a chunk. Tokens are the wgmma N dimension (sub-blocks of 64,
// NB per CTA), read from shared memory through a matrix descriptor. So each weight is decoded
// once per CTA (64 NB tokens), no dequantized weight touches shared memory, and chunk c + 2 is
// decoded while the tensor cores work on chunks c and c + 1.
//  * K order: the chunk's K positions are the GEMV's (lane t's block supplies rows 2t, 2t+1,
//    2t+8, 2t+9 of every chunk), so x must lie in that order. wgmma_x_kernel rewrites x once per
//    call into x_perm (the head of the workspace), byte for byte the shared-memory stage of each
//    (token block, K tile): 2 atoms (chunks 0-3, 4-7) of 64 NB token rows x 128 bytes, 16-byte
//    unit u of row r at u ^ (r % 8) (the 128-byte swizzle; K-major B, no transpose). The GEMM
//    copies x with 16-byte cp.async one K tile ahead, in whole K tiles (NB = 1, 3 slots) or
//    half K tiles (one atom, 4 slots), so that a slot is refilled only after its wgmma groups
//    retired without a drain at the end of a K tile. A rotated layer's x is turned into x R in the
//    same pass (rotate_x_groups), so the GEMM itself does not know about rotation.
//  * CTA: 2 warpgroups (8 row tiles, 128 rows) x 64 NB tokens; grid (token blocks, row blocks,
//    K splits), token blocks fastest so that CTAs decoding the same weight run together. Split-K
//    partials go to the float32 workspace and splitk_reduce_kernel (split order: deterministic).
//  * The GEMM is a programmatic dependent launch of wgmma_x_kernel: its prologue (first plane
//    loads, pair table) overlaps the rewrite, and griddepcontrol.wait precedes the first x_perm
//    read. Before that wait it reads only the packed weight and codebook (copied in, or written
//    by the quantize kernel, which fences its stores). wgmma_x_kernel is itself a programmatic
//    dependent launch of the stream's previous kernel (sm_90+) and waits for it before
//    reading x.
//  * Block records (kOffsets instantiations, launch_wgmma_gemm_offsets; format.py): block_scales holds an int16
//    per block (E4M4 code in the low byte, signed offset code in the high byte), in the layout of the codes. The
//    decode is the GEMV's on records (gemv_kernel.cuh, kOffsets): each lane loads its two records where it loaded
//    two codes, and every pair of the A fragment is one packed fma, codebook pair * scale + offset pair, rounded
//    once to the activation dtype; the row scale applies in the epilogue as before. A template flag: the
//    instantiations without it compile to the code they had before.
#pragma once

#include "gemm_kernel.cuh"
#include "gemv_kernel.cuh"
#include "rotation.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_HAS_WGMMA 1
#else
#define KBIT_HAS_WGMMA 0  // other targets: the kernel is a trap the host never launches
#endif

namespace kbit {

// ---- wgmma primitives (sm_90a) ----

__device__ __forceinline__ void wgmma_fence() {
#if KBIT_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if KBIT_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
#if KBIT_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// Generic-proxy writes to shared memory (cp.async here) before async-proxy reads (wgmma).
__device__ __forceinline__ void fence_proxy_async() {
#if KBIT_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// Pins registers at this point of the program: wgmma reads and writes them asynchronously, so
// the compiler must not move their other uses across the fences and waits.
template <typename R, int N> __device__ __forceinline__ void pin(R (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if constexpr (std::is_same_v<R, float>) asm volatile("" : "+f"(r[i])::"memory");
    else asm volatile("" : "+r"(r[i])::"memory");
  }
}

// Descriptor of a K-major operand in 128-byte-swizzled atoms (8 rows x 128 bytes, rows of
// consecutive atoms 1024 bytes apart); `addr` = atom base + 32 bytes per k16 step.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// d[64 rows, 64 tokens] += a (registers, m64k16: the mma.m16n8k16 A fragment in each warp) * B
// (descriptor, k16 x 64 tokens), float32 accumulation. d[4 j + 2 h + e] is row 16 (warp % 4) +
// g + 8 h, token 8 j + 2 t + e. (One m64n128 / m64n256 wgmma per chunk instead of 2 / 4 of
// these measured the same.)
#define KBIT_ACC8(i)                                                                                           \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define KBIT_WGMMA_N64(TYPE)                                                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." \
               TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                    \
               : KBIT_ACC8(0), KBIT_ACC8(8), KBIT_ACC8(16), KBIT_ACC8(24)                                      \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
#if KBIT_HAS_WGMMA
  if constexpr (std::is_same_v<T, __half>) KBIT_WGMMA_N64("f16");
  else KBIT_WGMMA_N64("bf16");
#else
  __trap();
#endif
}
#undef KBIT_WGMMA_N64
#undef KBIT_ACC8

// ---- x rewrite ----

// 16-byte unit (of a stage atom row) of pair j of x's 8-element group q in each block: chunk
// c, positions 2t + 8h + {0, 1} of K offset 32t + 8q + 2j + {0, 1} (the GEMV's chunk order,
// gemv_kernel.cuh chunk_offset / kPairB), unit 2 (c % 4) + h, word t; the atom is q / 2.
template <int BITS> __device__ __forceinline__ int x_perm_unit(int q, int j) {
  return BITS == 2 ? 4 * (q & 1) + 2 * (j & 1) + (j >> 1) : 2 * j + (q & 1);
}

// Group q (8 elements) of token `tok`'s 4 blocks in K tile kt, zero past m and k.
template <typename T>
__device__ __forceinline__ void load_x_groups(const T* x, int64_t m, int64_t k, bool vec_ok, int64_t tok, int kt,
                                              int q, uint4 (&v)[4]) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int64_t kk = static_cast<int64_t>(kt) * kTileK + 32 * t + 8 * q;
    const T* src = x + tok * k + kk;
    if (tok < m && vec_ok && kk + 8 <= k) {
      v[t] = __ldg(reinterpret_cast<const uint4*>(src));
    } else {
      union { uint4 u; T e[8]; } g;
#pragma unroll
      for (int e = 0; e < 8; ++e) g.e[e] = tok < m && kk + e < k ? src[e] : from_float<T>(0.f);
      v[t] = g.u;
    }
  }
}

// Rotated layers: the 4 groups (elements 32 t + 8 q + 0..7 of K tile kt, t = 0..3) turned into x R
// (rotation.cuh): each group is one 8-element segment, rotated in registers. Float32, the reference's
// order, one rounding.
template <typename T>
__device__ __forceinline__ void rotate_x_groups(uint4 (&v)[4], const uint32_t* rot_signs, int64_t k, int kt, int q) {
  union Group { uint4 u; T e[8]; };
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int64_t word = static_cast<int64_t>(kt) * kBlocksPerTile + t;
    // k % 64 == 0: a group past k is zero (no sign word to read).
    const uint32_t bits = word * kBlockSize < k ? __ldg(rot_signs + word) >> (8 * q) : 0u;
    Group g;
    g.u = v[t];
    float f[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = to_float(g.e[e]);
    rotate8(f, bits);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = pack2<T>(f[2 * i], f[2 * i + 1]);
    v[t] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Transposes the 4 groups into their 4 stage units (word t from block t) in row r of a stage
// whose atoms are atom_bytes apart.
template <int BITS>
__device__ __forceinline__ void store_x_groups(char* stage, int atom_bytes, int r, int q, const uint4 (&v)[4]) {
  char* row = stage + (q >> 1) * atom_bytes + r * 128;
  const uint32_t w[4][4] = {{v[0].x, v[1].x, v[2].x, v[3].x}, {v[0].y, v[1].y, v[2].y, v[3].y},
                            {v[0].z, v[1].z, v[2].z, v[3].z}, {v[0].w, v[1].w, v[2].w, v[3].w}};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    *reinterpret_cast<uint4*>(row + ((x_perm_unit<BITS>(q, j) ^ (r & 7)) * 16)) = make_uint4(w[j][0], w[j][1], w[j][2], w[j][3]);
}

// One thread per (token, K tile, group q) of every token block; kRotate: rot_signs are a rotated
// layer's sign words and x R is staged (a template flag: the unrotated instantiation is the code it was
// before rotation existed). The 4 threads of a (token, K tile) are consecutive lanes, and whole warps
// run the grid-stride loop together (every count is a multiple of 256).
template <int BITS, typename T, bool kRotate>
__global__ void __launch_bounds__(256) wgmma_x_kernel(const T* x, int64_t m, int64_t k, int k_tiles, int nb,
                                                      int64_t tokens_padded, char* x_perm,
                                                      const uint32_t* rot_signs) {
  wait_for_primary_grid();  // a programmatic dependent launch (sm_90+): x may be the previous kernel's output
  allow_dependent_launch();
  const int block_tokens = nb * kWgmmaTokens;
  const bool vec_ok = (k % 8 == 0) && (reinterpret_cast<uintptr_t>(x) % 16 == 0);
  const int64_t total = tokens_padded * k_tiles * 4;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int q = static_cast<int>(i & 3);
    const int64_t rest = i >> 2;
    const int kt = static_cast<int>(rest % k_tiles);
    const int64_t tok = rest / k_tiles;
    uint4 v[4];
    load_x_groups<T>(x, m, k, vec_ok, tok, kt, q, v);
    if constexpr (kRotate) rotate_x_groups<T>(v, rot_signs, k, kt, q);
    const int64_t tb = tok / block_tokens;
    const int r = static_cast<int>(tok - tb * block_tokens);
    store_x_groups<BITS>(x_perm + (tb * k_tiles + kt) * 2 * (block_tokens * 128), block_tokens * 128, r, q, v);
  }
}

// ---- the GEMM ----

// The NB wgmma of chunk c of an x part (descriptor of its first atom): chunks 4-7 of a whole K
// tile are one atom further on, token sub-block nb 64 rows (8 KB), each chunk 32 bytes along
// the row.
template <typename T, int NB>
__device__ __forceinline__ void wgmma_chunk(float (&acc)[NB][32], uint32_t (&a)[4], uint64_t part_desc, int c) {
  pin(a);
  wgmma_fence();
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
    wgmma_m64n64k16<T>(acc[nb],
                       a, part_desc + (((c >> 2) * wgmma_atom_bytes(NB) + nb * kWgmmaTokens * 128 + (c & 3) * 32) >> 4));
  wgmma_commit();
}

// kOffsets: p.block_scales points at int16 block records (launch_wgmma_gemm_offsets).
template <int BITS, typename T, int NB, bool kOffsets = false>
__global__ void __launch_bounds__(kWgmmaThreads, wgmma_ctas_per_sm(NB)) wgmma_gemm_kernel(MmParams p) {
#if KBIT_HAS_WGMMA
  // Plane loads kDepth - 1 K tiles ahead: the GEMV's depth where a K tile is short (64 tokens),
  // 2 for larger token blocks (half the unrolled code).
  constexpr int kDepth = NB == 1 ? kGemvDepth : 2;
  constexpr int kParts = wgmma_parts(NB), kSlots = wgmma_slots(NB);
  constexpr int kPartBytes = wgmma_stage_bytes(NB) / kParts, kPartChunks = 8 / kParts;
  static_assert(kPartBytes % (16 * kWgmmaThreads) == 0, "every thread copies the same number of 16-byte units");
  static_assert(kSlots - kParts == 2, "a slot is refilled 2 parts after its use: the chunk waits leave 2 pending");
  extern __shared__ float4 smem_f4[];
  char* table = reinterpret_cast<char*>(smem_f4);
  char* slots = table + kGemvTableBytes + kGemvScaleBytes;
  const uint32_t slots_addr = static_cast<uint32_t>(__cvta_generic_to_shared(slots));
  // Dynamic shared memory starts after the reserved 1 KB (no static shared memory here).
  if (slots_addr & 1023u) __trap();  // the swizzle atoms need 1 KB alignment

  const int k_tiles = static_cast<int>((p.k + kTileK - 1) / kTileK), n_tiles = static_cast<int>((p.n + kTileN - 1) / kTileN);
  const int kt0 = blockIdx.z * p.chunk_kt;
  const int steps = max(0, min(k_tiles, kt0 + p.chunk_kt) - kt0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int row_tile = blockIdx.y * kWgmmaTiles + warp;
  // A row tile past n still takes part in its warpgroup's wgmma: it decodes the last tile (finite
  // values) into rows that are never stored.
  const int tile0 = min(row_tile, n_tiles - 1) * k_tiles + kt0;

  TileWords<BITS> buf[kDepth];
  int load_i = 0;
  auto advance_load = [&](TileWords<BITS>& dst) {
    if (load_i < steps) load_tile<BITS, kOffsets>(p.planes, p.block_scales, tile0 + load_i, lane, dst);
    ++load_i;
  };
#pragma unroll
  for (int d = 0; d < kDepth - 1; ++d) advance_load(buf[d]);
  build_table<BITS, T>(table, codebook_lane<BITS>(p.codebook, lane));

  // x parts (consecutive in x_perm), copied one K tile ahead: part j goes to the slot of part
  // j + kParts - kSlots (2 parts back), whose wgmma groups have retired (at most 2 chunk groups
  // are ever pending), so no K tile waits for its wgmma to drain. This thread's 16-byte units
  // are threadIdx.x + i * kWgmmaThreads.
  const int parts = kParts * steps;
  const char* x_src = p.x_perm + (static_cast<int64_t>(blockIdx.x) * k_tiles + kt0) * wgmma_stage_bytes(NB) +
                      16 * threadIdx.x;
  char* x_dst = slots + 16 * threadIdx.x;
  auto load_part = [&](int j) {
    if (j < parts) {
      char* dst = x_dst + (j % kSlots) * kPartBytes;
      const char* src = x_src + static_cast<int64_t>(j) * kPartBytes;
#pragma unroll
      for (int i = 0; i < kPartBytes / (16 * kWgmmaThreads); ++i)
        cp_async16(dst + i * 16 * kWgmmaThreads, src + i * 16 * kWgmmaThreads, 16);
    }
    cp_async_commit();
  };
  wait_for_primary_grid();  // x_perm is written by wgmma_x_kernel
  allow_dependent_launch();
#pragma unroll
  for (int j = 0; j < kParts; ++j) load_part(j);

  const uint32_t lane_word = table_lane_word<BITS, false>(lane, 0);
  float acc[NB][32];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[nb][i] = 0.f;

  // Software pipeline over chunks, across K tiles: chunk q + 2 is decoded (into the fourth of
  // four A fragment buffers) while the wgmma groups of chunks q and q + 1 may run, so its table
  // loads have two chunks' time to land; the wait before it retires chunk q - 2, whose buffer it
  // takes.
  TileIndex<BITS> ti;
  uint32_t a[4][4];
  __syncthreads();  // the table is built: the first chunks are decoded before the loop's barrier
  if (steps > 0) {
    index_words<BITS, kOffsets, T>(buf[0], table, lane_word, ti);
    decode_chunk<BITS, T, false, kOffsets>(ti, 0, table, lane_word, a[0]);
    decode_chunk<BITS, T, false, kOffsets>(ti, 1, table, lane_word, a[1]);
  }
  for (int i = 0; i < steps; i += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int s = i + d;
      if (s >= steps) break;
      advance_load(buf[(d + kDepth - 1) % kDepth]);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        static_assert(8 * kDepth % 4 == 0, "the buffer rotation restarts with each unrolled pass");
        const int q = 8 * d + c;  // chunk q of this pass uses buffer q % 4
        const int j = kParts * s + c / kPartChunks;  // the x part of chunk c
        if (c % kPartChunks == 0) {
          cp_async_wait<kParts - 1>();
          fence_proxy_async();
          __syncthreads();  // part j landed for everyone
          load_part(j + kParts);
        }
        wgmma_chunk<T, NB>(acc, a[q % 4], sw128_desc(slots_addr + (j % kSlots) * kPartBytes), c % kPartChunks);
        wgmma_wait<2>();
        if (c < 6) {
          decode_chunk<BITS, T, false, kOffsets>(ti, c + 2, table, lane_word, a[(q + 2) % 4]);
        } else if (s + 1 < steps) {
          if (c == 6) index_words<BITS, kOffsets, T>(buf[(d + 1) % kDepth], table, lane_word, ti);
          decode_chunk<BITS, T, false, kOffsets>(ti, c - 6, table, lane_word, a[(q + 2) % 4]);
        }
      }
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) pin(acc[nb]);

  // Lane (g, t) holds rows g, g + 8 of the warp's tile; acc[nb][4 j + 2 h + e] is row g + 8 h,
  // token 64 nb + 8 j + 2 t + e.
  const int64_t m = p.m, n = p.n;
  const int64_t tok0 = static_cast<int64_t>(blockIdx.x) * NB * kWgmmaTokens;
  float* ws = p.splits > 1 ? p.workspace + static_cast<int64_t>(blockIdx.z) * m * n : nullptr;
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = static_cast<int64_t>(row_tile) * kTileN + g + 8 * h;
    if (row >= n) continue;
    const float rs = __ldg(p.row_scales + row);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t tok = tok0 + nb * kWgmmaTokens + 8 * j + 2 * t + e;
          if (tok >= m) continue;
          const float y = acc[nb][4 * j + 2 * h + e] * rs;
          if (ws) ws[tok * n + row] = y;
          else out[tok * n + row] = from_float<T>(y);
        }
      }
    }
  }
#else
  __trap();
#endif
}

// x rewrite, then the GEMM (kOffsets: on block records) as its programmatic dependent launch, then the split-K
// reduce.
template <int BITS, typename T, int NB, bool kOffsets>
cudaError_t launch_wgmma_kernels(const MmParams& p, dim3 grid, cudaStream_t stream) {
  const int k_tiles = static_cast<int>((p.k + kTileK - 1) / kTileK);
  const int64_t tokens_padded = static_cast<int64_t>(grid.x) * NB * kWgmmaTokens;
  const int64_t threads = tokens_padded * k_tiles * 4;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((threads + 255) / 256, int64_t{1} << 20));
  const KernelLaunch x_launch(blocks, 256, 0, stream, 1, use_pdl());
  cudaError_t err = cudaLaunchKernelEx(&x_launch.config, p.rot_signs ? wgmma_x_kernel<BITS, T, true>
                                                                      : wgmma_x_kernel<BITS, T, false>,
                                       static_cast<const T*>(p.x), p.m, p.k, k_tiles, NB, tokens_padded, p.x_perm,
                                       p.rot_signs);
  if (err != cudaSuccess) return err;

  constexpr auto kernel = wgmma_gemm_kernel<BITS, T, NB, kOffsets>;
  constexpr int kSmem = wgmma_smem_bytes(NB);
  err = raise_smem_limit<kernel>(kSmem);
  if (err != cudaSuccess) return err;
  const KernelLaunch launch(grid, kWgmmaThreads, kSmem, stream, 1, true);  // sm_90 only: always PDL
  err = cudaLaunchKernelEx(&launch.config, kernel, p);
  if (err != cudaSuccess || p.splits == 1) return err;
  return launch_splitk_reduce<T>(p.workspace, p.out, p.m * p.n, p.splits, stream);
}

template <int BITS, typename T, int NB>
cudaError_t launch_wgmma_gemm(const MmParams& p, dim3 grid, cudaStream_t stream) {
  return launch_wgmma_kernels<BITS, T, NB, false>(p, grid, stream);
}

// Block records (p.block_scales int16, format.py): the GEMM with kOffsets on x as it is (kbit_gemm_offsets; no
// rotated layer holds records, and the x rewrite is the unrotated one).
template <int BITS, typename T, int NB>
cudaError_t launch_wgmma_gemm_offsets(const MmParams& p, dim3 grid, cudaStream_t stream) {
  if (p.rot_signs) return cudaErrorInvalidValue;
  return launch_wgmma_kernels<BITS, T, NB, true>(p, grid, stream);
}

}  // namespace kbit
