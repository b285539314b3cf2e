// Mid-M GEMM on tensor cores: out[m, n] = sum_k x[m, k] * W[n, k], for M from ~16 to a few
// hundred tokens, where the GEMV's "stage all of x once" no longer fits and dequantize + cuBLAS
// is bound by writing the dequantized weight (docs/kernels.md).
//
// Dequantize-during-fetch, register flavour: the packed tiles and the x tile of a K step
// stream into shared memory with cp.async (gemm_stages deep), and each warp decodes its
// weight pairs straight into mma A fragments with the GEMV's decode (pair table, SWAR index
// words: gemv_kernel.cuh), so no dequantized weight ever touches memory. A decoded pair feeds
// NT mma (NT token tiles of 8), so the decode is paid once per weight and token block.
//  * CTA: kGemmWarps (8) warps; warp w owns row tiles kGemmRowTiles w .. + kGemmRowTiles - 1
//    of the CTA's 16 (256 rows) and every token of its token block (8 NT), so each B fragment
//    it reads feeds kGemmRowTiles mma per chunk.
//  * mma K order: within a K tile, lane t decodes block t (as in the GEMV); chunk c = 2 j + cc
//    takes from byte j of its index words the pairs at K offsets 32 t + 8 j + 4 cc + {0, 2}
//    (k >= 3; k = 2: + 2 cc + {0, 4}), so the B fragments of chunks 2 j, 2 j + 1 are exactly
//    x[token][32 t + 8 j : + 8]: x lands in shared memory in its natural order, one 16-byte
//    cp.async per 8 elements, and each lane reads the B fragments of both chunks with one
//    16-byte load per token tile.
//  * x tile rows (tokens) of 256 bytes, 16-byte units XOR-swizzled (x_unit) so that the 8 lanes
//    of each load phase hit 8 different bank groups.
//  * Grid (token blocks, row blocks, K splits); token blocks vary fastest, so the CTAs that
//    decode the same weight tiles run together and share them through L2. Split-K partials
//    (plan_gemm adds splits only to fill the GPU) go to a float32 workspace reduced in split
//    order by splitk_reduce_kernel.
//  * Rotated layers (rot_signs): the standalone rotation (rotation.cuh) writes x R into the head of
//    the workspace (x_perm, planned by the host), which the GEMM then reads as its x. Rotating the x
//    tiles in shared memory instead would repeat the work in every row block and roughly double the
//    CUDA cores' share per K tile (rotation.py's design note); the extra pass is 2 M K bytes each way.
#pragma once

#include "gemv_kernel.cuh"
#include "rotation.cuh"

namespace kbit {

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  // .cg: cache in L2 only; the packed weight is read once per token block and x once per CTA.
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Physical 16-byte unit of unit u (K offset 8 u) in the x tile row of `token`: lane (g, t)
// reads u = 4 t + j, so XOR-ing bit 1 with bit 3 of u (t / 2) and bit 0 with the token's
// parity (g % 2) spreads a load phase (g in {2p, 2p + 1}, t = 0..3) over 8 bank groups.
__device__ __forceinline__ int x_unit(int u, int token) { return u ^ ((((u >> 3) & 1) << 1) | (token & 1)); }

template <int BITS, typename T, int NT>
struct GemmTile {
  static constexpr int kBlockM = gemm_block_m(NT);
  static constexpr int kPlaneBytes = kGemmTiles * BITS * 256;  // packed planes of the CTA's row tiles
  static constexpr int kScaleBytes = kGemmTiles * 64;
  static constexpr int kStageBytes = gemm_stage_bytes(BITS, NT);
  static constexpr int kStages = gemm_stages(NT);
  static_assert(kStageBytes == kPlaneBytes + kScaleBytes + kBlockM * kTileK * 2, "stage layout");
  static_assert(kStageBytes % 16 == 0, "stages stay 16-byte aligned");
};

// Issue the cp.async of K tile `kt` into `stage`: the CTA's packed tiles (rows past the last
// tile read nothing, so they decode to zero-scale pairs) and its tokens' x (zero past m and k).
template <int BITS, typename T, int NT>
__device__ __forceinline__ void gemm_load_stage(const MmParams& p, char* stage, int kt, int k_tiles, int n_tiles,
                                                bool x_vec) {
  using Tile = GemmTile<BITS, T, NT>;
  const int row_tile0 = blockIdx.y * kGemmTiles;
  const char* planes = reinterpret_cast<const char*>(p.planes);
  for (int i = threadIdx.x; i < kGemmTiles * BITS * 16; i += kGemmThreads) {
    const int tile = i / (BITS * 16), c = i - tile * (BITS * 16);
    const int gt = row_tile0 + tile;
    const bool ok = gt < n_tiles;
    const char* src = planes + ((static_cast<int64_t>(ok ? gt : 0) * k_tiles + kt) * BITS * 256 + c * 16);
    cp_async16(stage + tile * BITS * 256 + c * 16, src, ok ? 16 : 0);
  }
  char* scales = stage + Tile::kPlaneBytes;
  for (int i = threadIdx.x; i < kGemmTiles * 4; i += kGemmThreads) {
    const int tile = i >> 2, c = i & 3;
    const int gt = row_tile0 + tile;
    const bool ok = gt < n_tiles;
    const uint8_t* src = p.block_scales + ((static_cast<int64_t>(ok ? gt : 0) * k_tiles + kt) * 64 + c * 16);
    cp_async16(scales + tile * 64 + c * 16, src, ok ? 16 : 0);
  }
  char* xs = scales + Tile::kScaleBytes;
  const T* x = static_cast<const T*>(p.x);
  const int64_t tok0 = static_cast<int64_t>(blockIdx.x) * Tile::kBlockM;
  for (int i = threadIdx.x; i < Tile::kBlockM * 16; i += kGemmThreads) {
    const int row = i >> 4, u = i & 15;
    const int64_t tok = tok0 + row, kk = static_cast<int64_t>(kt) * kTileK + u * 8;
    char* dst = xs + row * 256 + x_unit(u, row) * 16;
    if (x_vec) {  // k % 8 == 0 and x 16-byte aligned: a unit is wholly inside or outside k
      const bool ok = tok < p.m && kk < p.k;
      cp_async16(dst, ok ? x + tok * p.k + kk : x, ok ? 16 : 0);
    } else {
      union { uint4 u; T e[8]; } pack;
#pragma unroll
      for (int e = 0; e < 8; ++e) pack.e[e] = (tok < p.m && kk + e < p.k) ? x[tok * p.k + kk + e] : from_float<T>(0.f);
      *reinterpret_cast<uint4*>(dst) = pack.u;
    }
  }
}

// One K tile of warp `warp`: decode its row tiles two chunks at a time into A fragments and
// run them against every token tile's B fragments.
template <int BITS, typename T, int NT>
__device__ __forceinline__ void gemm_mma_stage(const char* stage, const char* table, uint32_t lane_word, int lane,
                                               int warp, float (&acc)[kGemmRowTiles][NT][4]) {
  using Tile = GemmTile<BITS, T, NT>;
  const int g = lane >> 2, t = lane & 3;
  TileIndex<BITS> ti[kGemmRowTiles];
#pragma unroll
  for (int r = 0; r < kGemmRowTiles; ++r) {
    const int tile = warp * kGemmRowTiles + r;
    const uint32_t* pw = reinterpret_cast<const uint32_t*>(stage + tile * BITS * 256) + lane;
    const uint8_t* sc = reinterpret_cast<const uint8_t*>(stage + Tile::kPlaneBytes + tile * 64) + lane;
    TileWords<BITS> tw;
#pragma unroll
    for (int j = 0; j < BITS; ++j) {
      tw.w[0][j] = pw[j * 64];
      tw.w[1][j] = pw[j * 64 + 32];
    }
    tw.sc[0] = sc[0];
    tw.sc[1] = sc[32];
    index_words<BITS>(tw, table, lane_word, ti[r]);
  }

  const uint4* xrow = reinterpret_cast<const uint4*>(stage + Tile::kPlaneBytes + Tile::kScaleBytes) + g * 16;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t a[kGemmRowTiles][2][4];  // chunks 2 j, 2 j + 1 of each row tile
#pragma unroll
    for (int r = 0; r < kGemmRowTiles; ++r) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          if constexpr (BITS == 2) {
            const uint2 e = decode_quad<T>(ti[r], rr, cc, j, table, lane_word);
            a[r][cc][rr] = e.x;
            a[r][cc][2 + rr] = e.y;
          } else {
#pragma unroll
            for (int h = 0; h < 2; ++h)
              a[r][cc][2 * h + rr] = decode_pair<BITS, T>(ti[r], rr, 2 * cc + h, j, table, lane_word);
          }
        }
      }
    }
    const int unit = x_unit(4 * t + j, g);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      // Natural-order record (pairs at 8 j + 0, 2, 4, 6 in x, y, z, w): k >= 3 takes
      // (x, y) / (z, w) for chunks 2 j / 2 j + 1, k = 2 takes (x, z) / (y, w).
      const uint4 bx = xrow[nt * 8 * 16 + unit];
#pragma unroll
      for (int r = 0; r < kGemmRowTiles; ++r) {
        if constexpr (BITS == 2) {
          mma_16816<T>(acc[r][nt], a[r][0], bx.x, bx.z);
          mma_16816<T>(acc[r][nt], a[r][1], bx.y, bx.w);
        } else {
          mma_16816<T>(acc[r][nt], a[r][0], bx.x, bx.y);
          mma_16816<T>(acc[r][nt], a[r][1], bx.z, bx.w);
        }
      }
    }
  }
}

template <int BITS, typename T, int NT>
__global__ void __launch_bounds__(kGemmThreads, 1) gemm_kernel(MmParams p) {
  using Tile = GemmTile<BITS, T, NT>;
  extern __shared__ float4 smem_f4[];
  char* table = reinterpret_cast<char*>(smem_f4);
  char* stages = table + kGemvTableBytes + kGemvScaleBytes;
  allow_dependent_launch();

  const int k_tiles = static_cast<int>((p.k + kTileK - 1) / kTileK), n_tiles = static_cast<int>((p.n + kTileN - 1) / kTileN);
  const int kt0 = blockIdx.z * p.chunk_kt;
  const int steps = max(0, min(k_tiles, kt0 + p.chunk_kt) - kt0);
  const bool x_vec = (p.k % 8 == 0) && (reinterpret_cast<uintptr_t>(p.x) % 16 == 0);

  // The first stages' copies fly while the table is built.
#pragma unroll
  for (int s = 0; s < Tile::kStages - 1; ++s) {
    if (s < steps) gemm_load_stage<BITS, T, NT>(p, stages + s * Tile::kStageBytes, kt0 + s, k_tiles, n_tiles, x_vec);
    cp_async_commit();
  }
  build_table<BITS, T>(table, codebook_lane<BITS>(p.codebook, threadIdx.x & 31));

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t lane_word = table_lane_word<BITS, false>(lane, 0);
  float acc[kGemmRowTiles][NT][4];
#pragma unroll
  for (int r = 0; r < kGemmRowTiles; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][nt][e] = 0.f;

  for (int i = 0; i < steps; ++i) {
    cp_async_wait<Tile::kStages - 2>();
    __syncthreads();  // stage i landed for everyone; everyone is done with stage i - 1
    const int next = i + Tile::kStages - 1;
    if (next < steps)
      gemm_load_stage<BITS, T, NT>(p, stages + (next % Tile::kStages) * Tile::kStageBytes, kt0 + next, k_tiles,
                                   n_tiles, x_vec);
    cp_async_commit();
    gemm_mma_stage<BITS, T, NT>(stages + (i % Tile::kStages) * Tile::kStageBytes, table, lane_word, lane, warp, acc);
  }

  // Lane (g, t) holds rows g, g + 8 of each of the warp's row tiles and tokens 8 nt + 2 t, + 1.
  const int g = lane >> 2, t = lane & 3;
  const int64_t m = p.m, n = p.n;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kGemmRows + warp * kGemmRowTiles * kTileN;
  const int64_t tok0 = static_cast<int64_t>(blockIdx.x) * Tile::kBlockM;
  float* ws = p.splits > 1 ? p.workspace + static_cast<int64_t>(blockIdx.z) * m * n : nullptr;
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int r = 0; r < kGemmRowTiles; ++r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + r * kTileN + g + 8 * h;
      if (row >= n) continue;
      const float rs = __ldg(p.row_scales + row);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t tok = tok0 + nt * 8 + 2 * t + e;
          if (tok >= m) continue;
          const float y = acc[r][nt][2 * h + e] * rs;
          if (ws) ws[tok * n + row] = y;
          else out[tok * n + row] = from_float<T>(y);
        }
      }
    }
  }
}

template <int BITS, typename T, int NT>
cudaError_t launch_gemm(const MmParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int kSmem = gemm_smem_bytes(BITS, NT);
  cudaError_t err = raise_smem_limit<gemm_kernel<BITS, T, NT>>(kSmem);
  if (err != cudaSuccess) return err;
  MmParams q = p;
  if (p.rot_signs) {  // x R into the workspace's head, then the GEMM on it
    const RotateParams r{p.x, p.x_perm, p.rot_signs, p.m, p.k, p.k, TypeOf<T>::value, 0};
    err = launch_rotate<T>(r, stream);
    if (err != cudaSuccess) return err;
    q.x = p.x_perm;
    q.rot_signs = nullptr;
  }
  gemm_kernel<BITS, T, NT><<<grid, kGemmThreads, kSmem, stream>>>(q);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.splits == 1) return err;
  return launch_splitk_reduce<T>(p.workspace, p.out, p.m * p.n, p.splits, stream);
}

}  // namespace kbit
