// GPU quantize: weight [batch, n, k] -> (planes, block_scales, row_scales), bit-exact with
// format.quantize. Every step of the float32 chain uses explicit round-to-nearest intrinsics
// (__fdiv_rn, __fmul_rn, __fadd_rn) so no FMA contraction or fast-math can change a bit.
#pragma once

#include <cmath>

#include "kbit_common.cuh"

namespace kbit {

constexpr int kQuantizeThreads = 256;

// One warp per row: row_scale = min(nextafter(rowmax / 31, inf), kRowScaleMax), 1.0 for an all-zero row.
template <typename T>
__global__ void __launch_bounds__(kQuantizeThreads) row_scale_kernel(QuantizeParams p) {
  const int64_t rows = p.batch * p.n;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kQuantizeThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* w = static_cast<const T*>(p.weight) + row * p.k;
  float mx = 0.f;
  for (int64_t i = lane; i < p.k; i += 32) mx = fmaxf(mx, fabsf(to_float(w[i])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) {
    const float e4m4_max = e4m4_decode(255);  // 31
    p.row_scales[row] = mx > 0.f ? fminf(nextafterf(__fdiv_rn(mx, e4m4_max), INFINITY), kRowScaleMax) : 1.f;
  }
}

// One thread per 32-element block of the padded weight: block code, indices, bit-planes.
template <typename T, int BITS>
__global__ void __launch_bounds__(kQuantizeThreads) quantize_blocks_kernel(QuantizeParams p) {
  constexpr int kLevels = 1 << BITS;
  __shared__ float e4m4[256];
  __shared__ float mids[kLevels - 1];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) e4m4[i] = e4m4_decode(i);
  for (int i = threadIdx.x; i < kLevels - 1; i += blockDim.x)
    mids[i] = __fmul_rn(__fadd_rn(p.codebook[i], p.codebook[i + 1]), 0.5f);  // (a + b) / 2, exact halving
  __syncthreads();

  const int64_t nt = (p.n + kTileN - 1) / kTileN, kt = (p.k + kTileK - 1) / kTileK;
  const int64_t blocks_per_row = kt * kBlocksPerTile;
  const int64_t total = p.batch * nt * kTileN * blocks_per_row;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= total) return;
  // t enumerates (batch, padded row, block) with the block fastest: coalesced weight reads.
  const int64_t blk = t % blocks_per_row;
  const int64_t prow = (t / blocks_per_row) % (nt * kTileN);
  const int64_t b = t / (blocks_per_row * nt * kTileN);
  const bool real_row = prow < p.n;
  const T* w = static_cast<const T*>(p.weight) + (b * p.n + prow) * p.k;
  const int64_t k0 = blk * kBlockSize;

  float v[kBlockSize];
  float bmax = 0.f;
#pragma unroll
  for (int e = 0; e < kBlockSize; ++e) {
    v[e] = (real_row && k0 + e < p.k) ? to_float(w[k0 + e]) : 0.f;
    bmax = fmaxf(bmax, fabsf(v[e]));
  }
  const float rs = real_row ? p.row_scales[b * p.n + prow] : 1.f;
  const float ratio = __fdiv_rn(bmax, rs);
  // Smallest code with e4m4[code] >= ratio (searchsorted, left), clamped to 255.
  int code = 0;
#pragma unroll
  for (int step = 128; step > 0; step >>= 1)
    if (e4m4[code + step - 1] < ratio) code += step;
  code = min(code, 255);
  if (bmax > 0.f) code = max(code, 1);  // a ratio that underflows to 0 must not zero a non-zero block
  const float scale = __fmul_rn(e4m4[code], rs);

  uint32_t planes[BITS];
#pragma unroll
  for (int j = 0; j < BITS; ++j) planes[j] = 0;
#pragma unroll
  for (int e = 0; e < kBlockSize; ++e) {
    const float x = scale > 0.f ? __fdiv_rn(v[e], scale) : 0.f;
    uint32_t idx = 0;
#pragma unroll
    for (int i = 0; i < kLevels - 1; ++i) idx += mids[i] < x ? 1u : 0u;
#pragma unroll
    for (int j = 0; j < BITS; ++j) planes[j] |= ((idx >> j) & 1u) << bit_of_element(e);
  }

  const int64_t tile_n = prow / kTileN, r = prow % kTileN;
  const int64_t tile_k = blk / kBlocksPerTile, q = blk % kBlocksPerTile;
  const int64_t tile = (b * nt + tile_n) * kt + tile_k;
  for (int j = 0; j < BITS; ++j)
    p.planes[((tile * BITS + j) * kTileN + r) * kBlocksPerTile + q] = static_cast<int32_t>(planes[j]);
  p.block_scales[(tile * kTileN + r) * kBlocksPerTile + q] = static_cast<uint8_t>(code);
  // The GEMVs and the wgmma GEMM read the packed weight before griddepcontrol.wait (they are
  // programmatic dependent launches, which may start once this grid's blocks have exited):
  // the stores are performed GPU-wide before this thread exits.
  __threadfence();
}

template <typename T, int BITS>
cudaError_t launch_quantize(const QuantizeParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.n;
  if (rows > 0) {
    const int64_t grid = (rows * 32 + kQuantizeThreads - 1) / kQuantizeThreads;
    row_scale_kernel<T><<<static_cast<unsigned>(grid), kQuantizeThreads, 0, stream>>>(p);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t nt = (p.n + kTileN - 1) / kTileN, kt = (p.k + kTileK - 1) / kTileK;
  const int64_t total = p.batch * nt * kTileN * kt * kBlocksPerTile;
  if (total == 0) return cudaSuccess;
  const int64_t grid = (total + kQuantizeThreads - 1) / kQuantizeThreads;
  quantize_blocks_kernel<T, BITS><<<static_cast<unsigned>(grid), kQuantizeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kbit
