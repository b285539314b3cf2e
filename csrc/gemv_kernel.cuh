// Small-M GEMV without tensor cores: out[m, n] = sum_k x[m, k] * W[n, k], M <= kGemvMaxM.
//
// Decode budget (H100: ~5-6 lane-ops per weight element at HBM speed for k = 4):
//  * SWAR index extraction: for each of the 4 "s" offsets, one shift+mask+or per plane turns
//    the plane words of a block into a word whose byte b holds the indices of the adjacent
//    elements 8b+2s and 8b+2s+1 (format bit order p = 8b + 4h + s): ~1 op per element.
//  * One 64-bit shared-memory load per element pair from a table of codebook-value pairs
//    (float2) with 32 lane-private copies, addressed by a single byte permute
//    (address = pair_index * 256 + lane * 8): conflict-free, ~1 op per element.
//  * One FMA per element and activation row, against activations staged in shared memory
//    as float32 (one 16-byte load per 4 elements and row); block scale once per block,
//    row scale once per row at the end.
// Work: a CTA of 8 warps owns `row_tiles` 16-row tiles; each warp's half-warps take
// alternate K tiles (lane = row in tile, so each plane load is 16 bytes per lane and 256
// contiguous bytes per half-warp). The grid is persistent (the pair table is built once per
// CTA) and walks units of (row group, K split); split-K partial sums go to a float32
// workspace that a second kernel reduces, in a fixed order (deterministic).
#pragma once

#include "kbit_common.cuh"

namespace kbit {


template <int BITS> struct PairTable {
  static constexpr int kEntries = pair_table_entries(BITS);
  static constexpr int kCopies = pair_table_copies(BITS);
  static constexpr int kBytes = pair_table_bytes(BITS);
  static constexpr bool kHalf = kGemvHalfTable;
  static constexpr int kEntryBytes = kHalf ? 4 : 8;
  // k <= 4: one byte permute gives index * 256 + lane * 8; half entries shift that right by
  // one (stride 128 bytes), float2 entries use it as is.
  static constexpr int kStride = kCopies * kEntryBytes;
  static_assert(BITS >= 2 && BITS <= 5, "kbit supports 2..5 bits");
};


__device__ __forceinline__ uint32_t word_of(const uint4& v, int q) {
  return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

template <int BITS>
__device__ __forceinline__ void load_tile(const GemvParams& p, int64_t tile, int r, uint4 (&pl)[BITS], uint32_t& sc) {
#pragma unroll
  for (int j = 0; j < BITS; ++j)
    pl[j] = __ldcs(reinterpret_cast<const uint4*>(p.planes) + (tile * BITS + j) * kTileN + r);
  sc = __ldcs(reinterpret_cast<const uint32_t*>(p.block_scales) + tile * kTileN + r);
}

// Decode one K tile (4 blocks of 32) of this lane's row and accumulate x . w into acc.
template <int BITS, int M, typename Table>
__device__ __forceinline__ void decode_tile(const uint4 (&pl)[BITS], uint32_t sc, const float* xk, int x_m_stride,
                                            const char* table, uint32_t lane_bytes, float (&acc)[M]) {
#pragma unroll
    for (int q = 0; q < kBlocksPerTile; ++q) {
      uint32_t w[4], hi[4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t acc_w = 0;
#pragma unroll
        for (int j = 0; j < (BITS < 4 ? BITS : 4); ++j)
          acc_w |= ((word_of(pl[j], q) >> s) & 0x11111111u) << j;
        w[s] = acc_w;
        if (BITS == 5) {
          const uint32_t t = (word_of(pl[BITS - 1], q) >> s) & 0x11111111u;
          hi[s] = (t | (t >> 3)) & 0x03030303u;  // byte b: bit 0 = hi bit of element 8b+2s, bit 1 = of 8b+2s+1
        } else {
          hi[s] = 0;
        }
      }
      float part[M];
#pragma unroll
      for (int m = 0; m < M; ++m) part[m] = 0.f;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        float2 wv[4];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t off;
          if (BITS <= 4) {
            // byte 0 = lane_bytes, byte 1 = pair index, bytes 2-3 = 0 -> index * 256 + lane_bytes
            off = __byte_perm(lane_bytes, w[s], 0x1100u | ((4u + b) << 4));
            if (Table::kHalf) off >>= 1;
          } else {
            const uint32_t idx = __byte_perm(w[s], hi[s], b | ((4u + b) << 4)) & 0x3FFu;
            off = idx * static_cast<uint32_t>(Table::kStride) + lane_bytes;
          }
          if (Table::kHalf)
            wv[s] = __half22float2(*reinterpret_cast<const __half2*>(table + off));
          else
            wv[s] = *reinterpret_cast<const float2*>(table + off);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float4 xa = *reinterpret_cast<const float4*>(xk + m * x_m_stride + q * kBlockSize + 8 * b);
          const float4 xb = *reinterpret_cast<const float4*>(xk + m * x_m_stride + q * kBlockSize + 8 * b + 4);
          float t = part[m];
          t = fmaf(wv[0].x, xa.x, t);
          t = fmaf(wv[0].y, xa.y, t);
          t = fmaf(wv[1].x, xa.z, t);
          t = fmaf(wv[1].y, xa.w, t);
          t = fmaf(wv[2].x, xb.x, t);
          t = fmaf(wv[2].y, xb.y, t);
          t = fmaf(wv[3].x, xb.z, t);
          t = fmaf(wv[3].y, xb.w, t);
          part[m] = t;
        }
      }
      const float bscale = e4m4_decode((sc >> (8 * q)) & 0xFFu);
#pragma unroll
      for (int m = 0; m < M; ++m) acc[m] = fmaf(part[m], bscale, acc[m]);
    }
}

template <int BITS, typename T, int M>
__global__ void __launch_bounds__(kGemvThreads, gemv_min_ctas(BITS, M)) gemv_kernel(GemvParams p, int sub_kt) {
  using Table = PairTable<BITS>;
  constexpr int kDepth = gemv_depth(BITS, M);  // plane-load stages per lane
  constexpr int kLevels = 1 << BITS;
  extern __shared__ float4 smem_f4[];
  char* table = reinterpret_cast<char*>(smem_f4);
  float* xs = reinterpret_cast<float*>(table + Table::kBytes);
  float* red = xs + M * sub_kt * kXStride;

  // Pair table: entry e, copy c at byte offset e * kStride + c * kEntryBytes. Each thread
  // writes whole 16-byte chunks (several copies of one entry) so the build costs a few stores.
  {
    constexpr int kChunks = Table::kCopies * Table::kEntryBytes / 16;  // 16-byte chunks per entry
    for (int i = threadIdx.x; i < Table::kEntries * kChunks; i += kGemvThreads) {
      const int e = i / kChunks, c = i % kChunks;
      int i0, i1;
      if (BITS <= 4) {
        i0 = e & 15;
        i1 = e >> 4;
      } else {
        i0 = (e & 15) | (((e >> 8) & 1) << 4);
        i1 = ((e >> 4) & 15) | (((e >> 9) & 1) << 4);
      }
      float a = 0.f, b = 0.f;
      if (i0 < kLevels && i1 < kLevels) {
        a = __ldg(p.codebook + i0);
        b = __ldg(p.codebook + i1);
      }
      uint4 v;
      if (Table::kHalf) {
        const __half2 hv = __floats2half2_rn(a, b);
        const uint32_t u = *reinterpret_cast<const uint32_t*>(&hv);
        v = make_uint4(u, u, u, u);
      } else {
        v = make_uint4(__float_as_uint(a), __float_as_uint(b), __float_as_uint(a), __float_as_uint(b));
      }
      *reinterpret_cast<uint4*>(table + e * Table::kStride + c * 16) = v;
    }
  }

  const int lane = threadIdx.x & 31, r = lane & 15, h = lane >> 4, warp = threadIdx.x >> 5;
  const int k_warps = p.k_warps, row_tiles = p.row_tiles;
  const int rt = warp / k_warps, kw = warp % k_warps;
  const int64_t n_tiles = (p.n + kTileN - 1) / kTileN, k_tiles = (p.k + kTileK - 1) / kTileK;
  const int64_t groups = (n_tiles + row_tiles - 1) / row_tiles;
  const int64_t units = groups * p.splits;
  const T* x = static_cast<const T*>(p.x);
  const int x_m_stride = sub_kt * kXStride;
  // This lane's table copy: k <= 4 -> byte 0 of the permute source is lane * 8.
  const uint32_t lane_bytes = BITS <= 4 ? static_cast<uint32_t>(lane) * 8u
                                        : static_cast<uint32_t>(lane % Table::kCopies) * Table::kEntryBytes;
  const int step = 2 * k_warps;
  // 16-byte activation loads need every row start aligned.
  const bool vec_ok = (p.k % 8 == 0) && (reinterpret_cast<uintptr_t>(p.x) % 16 == 0);

  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t group = u / p.splits;
    const int split = static_cast<int>(u % p.splits);
    const int64_t kc0 = static_cast<int64_t>(split) * p.chunk_kt;
    const int64_t kc1 = min(k_tiles, kc0 + p.chunk_kt);
    const int64_t tile_n = group * row_tiles + rt;
    const bool active = tile_n < n_tiles;

    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.f;

    for (int64_t ks = kc0; ks < kc1; ks += sub_kt) {
      const int64_t ke = min(kc1, ks + sub_kt);
      // The first kDepth - 1 K tiles' planes are issued before the staging barrier so that
      // their latency overlaps the activation staging; the loop keeps kDepth - 1 in flight.
      const int64_t tile_base = tile_n * k_tiles;
      const int64_t kt0 = ks + 2 * kw + h;
      uint4 buf[kDepth][BITS];
      uint32_t sc[kDepth];
#pragma unroll
      for (int d = 0; d < kDepth - 1; ++d) {
        const int64_t ktd = kt0 + d * step;
        sc[d] = 0;
        if (active && ktd < ke) load_tile<BITS>(p, tile_base + ktd, r, buf[d], sc[d]);
      }
      __syncthreads();  // table built / previous sub-chunk's readers done with xs
      // Stage x[:, ks*128 : ke*128) as float32, 8 elements (one 16-byte load) per thread and
      // step. x beyond K is zero: padded weights of a partial block may decode to nonzero levels.
      const int span8 = static_cast<int>(ke - ks) * (kTileK / 8);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const T* xm = x + m * p.k + ks * kTileK;
        const int64_t left = p.k - ks * kTileK;  // valid elements from the chunk start
        for (int v = threadIdx.x; v < span8; v += kGemvThreads) {
          const int kk = v * 8;
          float f[8];
          if (vec_ok && kk + 8 <= left) {
            union { uint4 u; T h[8]; } pack;
            pack.u = __ldg(reinterpret_cast<const uint4*>(xm + kk));
#pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = to_float(pack.h[e]);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = kk + e < left ? to_float(xm[kk + e]) : 0.f;
          }
          float* dst = xs + m * x_m_stride + (kk >> 7) * kXStride + (kk & (kTileK - 1));
          *reinterpret_cast<float4*>(dst) = make_float4(f[0], f[1], f[2], f[3]);
          *reinterpret_cast<float4*>(dst + 4) = make_float4(f[4], f[5], f[6], f[7]);
        }
      }
      __syncthreads();
      if (!active) continue;

      for (int64_t kt = kt0; kt < ke; kt += kDepth * step) {
#pragma unroll
        for (int d = 0; d < kDepth; ++d) {
          const int64_t ktd = kt + d * step;
          if (ktd >= ke) break;
          const int64_t ktn = ktd + (kDepth - 1) * step;
          if (ktn < ke) load_tile<BITS>(p, tile_base + ktn, r, buf[(d + kDepth - 1) % kDepth], sc[(d + kDepth - 1) % kDepth]);
          decode_tile<BITS, M, Table>(buf[d], sc[d], xs + (ktd - ks) * kXStride, x_m_stride, table, lane_bytes, acc);
        }
      }
    }

    // Reduce: the two half-warps, then the k_warps warps of each row tile.
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], 16);
    if (h == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m) red[(warp * M + m) * kTileN + r] = acc[m];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < row_tiles * M * kTileN; i += kGemvThreads) {
      const int rt2 = i / (M * kTileN), m = (i / kTileN) % M, r2 = i % kTileN;
      float v = 0.f;
      for (int w2 = 0; w2 < k_warps; ++w2) v += red[((rt2 * k_warps + w2) * M + m) * kTileN + r2];
      const int64_t n = (group * row_tiles + rt2) * kTileN + r2;
      if (n < p.n) {
        v *= p.row_scales[n];
        if (p.splits == 1)
          static_cast<T*>(p.out)[m * p.n + n] = from_float<T>(v);
        else
          p.workspace[(static_cast<int64_t>(split) * p.m + m) * p.n + n] = v;
      }
    }
  }
}

// Sum of the split-K partials in split order, rounded once to the output dtype.
template <typename T>
__global__ void __launch_bounds__(256) gemv_reduce_kernel(GemvParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t mn = p.m * p.n;
  if (i >= mn) return;
  float v = 0.f;
  for (int s = 0; s < p.splits; ++s) v += p.workspace[s * mn + i];
  static_cast<T*>(p.out)[i] = from_float<T>(v);
}

template <int BITS, typename T, int M>
cudaError_t launch_gemv(const GemvParams& p, int sub_kt, int grid, cudaStream_t stream) {
  const int smem = gemv_smem_bytes(BITS, M, sub_kt);
  cudaError_t err = cudaSuccess;
  // The dynamic shared-memory limit is raised once per device (and again if a larger plan
  // needs more): a driver call per launch costs about a microsecond of eager time.
  static int raised[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64 || raised[dev] < smem) {
    err = cudaFuncSetAttribute(gemv_kernel<BITS, T, M>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    if (dev >= 0 && dev < 64) raised[dev] = smem;
  }
  gemv_kernel<BITS, T, M><<<grid, kGemvThreads, smem, stream>>>(p, sub_kt);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.splits == 1) return err;
  const int64_t mn = p.m * p.n;
  gemv_reduce_kernel<T><<<static_cast<unsigned>((mn + 255) / 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kbit
