// Dequantize: packed tensors -> weight [batch, n, k] in float32/float16/bfloat16.
// Same float32 arithmetic as format.dequantize (codebook[idx] * (e4m4(code) * row_scale)),
// then one rounding to the output dtype, so the result is bit-exact with the reference.
#pragma once

#include "kbit_common.cuh"

namespace kbit {

constexpr int kDequantizeThreads = 256;

// One thread per 32-element block; 64 threads per tile (16 rows x 4 blocks, the tiled order
// of block_scales) so lanes read consecutive plane words (128 contiguous bytes per warp and
// plane). 32-bit index math: only the tile count needs a division.
constexpr int kDequantizeTilesPerCta = kDequantizeThreads / (kTileN * kBlocksPerTile);

template <typename T, int BITS>
__global__ void __launch_bounds__(kDequantizeThreads) dequantize_kernel(DequantizeParams p) {
  constexpr int kLevels = 1 << BITS;
  const int nt = static_cast<int>((p.n + kTileN - 1) / kTileN), kt = static_cast<int>((p.k + kTileK - 1) / kTileK);
  const int64_t b = static_cast<int64_t>(blockIdx.y);

  __shared__ float cb[kLevels];
  if (threadIdx.x < kLevels) cb[threadIdx.x] = p.codebook[b * p.codebook_stride + threadIdx.x];
  __syncthreads();

  const int tile = blockIdx.x * kDequantizeTilesPerCta + threadIdx.x / (kTileN * kBlocksPerTile);
  if (tile >= nt * kt) return;
  const int q = threadIdx.x % kBlocksPerTile, r = (threadIdx.x / kBlocksPerTile) % kTileN;
  const int tile_n = tile / kt, tile_k = tile - tile_n * kt;
  const int64_t row = static_cast<int64_t>(tile_n) * kTileN + r;
  if (row >= p.n) return;  // padding rows are never visible
  const int64_t k0 = static_cast<int64_t>(tile_k * kBlocksPerTile + q) * kBlockSize;
  if (k0 >= p.k) return;

  const int64_t gtile = b * nt * kt + tile;
  uint32_t planes[BITS];
#pragma unroll
  for (int j = 0; j < BITS; ++j)
    planes[j] = static_cast<uint32_t>(p.planes[((gtile * BITS + j) * kTileN + r) * kBlocksPerTile + q]);
  const float scale = __fmul_rn(e4m4_decode(p.block_scales[(gtile * kTileN + r) * kBlocksPerTile + q]),
                                p.row_scales[b * p.n + row]);

  T* out = static_cast<T*>(p.out) + (b * p.n + row) * p.k + k0;
  float v[kBlockSize];
#define KBIT_DEQ_ELEM(E) v[E] = __fmul_rn(cb[element_index<BITS, E>(planes)], scale);
  KBIT_DEQ_ELEM(0) KBIT_DEQ_ELEM(1) KBIT_DEQ_ELEM(2) KBIT_DEQ_ELEM(3) KBIT_DEQ_ELEM(4) KBIT_DEQ_ELEM(5)
  KBIT_DEQ_ELEM(6) KBIT_DEQ_ELEM(7) KBIT_DEQ_ELEM(8) KBIT_DEQ_ELEM(9) KBIT_DEQ_ELEM(10) KBIT_DEQ_ELEM(11)
  KBIT_DEQ_ELEM(12) KBIT_DEQ_ELEM(13) KBIT_DEQ_ELEM(14) KBIT_DEQ_ELEM(15) KBIT_DEQ_ELEM(16) KBIT_DEQ_ELEM(17)
  KBIT_DEQ_ELEM(18) KBIT_DEQ_ELEM(19) KBIT_DEQ_ELEM(20) KBIT_DEQ_ELEM(21) KBIT_DEQ_ELEM(22) KBIT_DEQ_ELEM(23)
  KBIT_DEQ_ELEM(24) KBIT_DEQ_ELEM(25) KBIT_DEQ_ELEM(26) KBIT_DEQ_ELEM(27) KBIT_DEQ_ELEM(28) KBIT_DEQ_ELEM(29)
  KBIT_DEQ_ELEM(30) KBIT_DEQ_ELEM(31)
#undef KBIT_DEQ_ELEM

  const int64_t valid = p.k - k0;
  // Wide stores when the whole block is in range and the row start is 16-byte aligned.
  constexpr int kPerVec = 16 / sizeof(T);
  if (valid >= kBlockSize && (reinterpret_cast<uintptr_t>(out) % 16) == 0) {
#pragma unroll
    for (int i = 0; i < kBlockSize; i += kPerVec) {
      union { uint4 u; T h[kPerVec]; } pack;
#pragma unroll
      for (int e = 0; e < kPerVec; ++e) pack.h[e] = from_float<T>(v[i + e]);
      *reinterpret_cast<uint4*>(out + i) = pack.u;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kBlockSize; ++e)
      if (e < valid) out[e] = from_float<T>(v[e]);
  }
}

template <typename T, int BITS>
cudaError_t launch_dequantize(const DequantizeParams& p, cudaStream_t stream) {
  const int64_t nt = (p.n + kTileN - 1) / kTileN, kt = (p.k + kTileK - 1) / kTileK;
  if (nt * kt == 0 || p.batch == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((nt * kt + kDequantizeTilesPerCta - 1) / kDequantizeTilesPerCta),
                  static_cast<unsigned>(p.batch));
  dequantize_kernel<T, BITS><<<grid, kDequantizeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kbit
