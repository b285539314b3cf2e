// Dequantize: packed tensors -> weight [batch, n, k] in float32/float16/bfloat16.
// Same float32 arithmetic as format.dequantize (codebook[idx] * (e4m4(code) * row_scale)),
// then one rounding to the output dtype, so the result is bit-exact with the reference.
//
// The kernel is bound by writing the output (2-4 bytes per element against 0.3-0.7 bytes of
// packed input), so the design is about stores: each thread makes 8 consecutive elements of
// one row (one 16-byte store in 16-bit dtypes, two in float32), and a warp's 16 lanes per row
// write 128 contiguous columns. Measured on an H100 at 14336 x 4096: bf16 50-62 us for
// k = 2..5 (2.5-2.7 TB/s read + written; a device copy reaches 2.9), float32 92-99 us.
//
// Rotated layers (kRotate, rot_signs, rotation.cuh): each row comes out unrotated, W' R^T (the public
// dequantize; the matmul paths multiply the stored W' by x R instead). A thread's 8 elements
// (columns 8c .. 8c + 7) are one segment, unrotated in registers in float32 before the one rounding:
// bit-exact with rotation.unrotate of format.dequantize's float32 weight, rounded to the output dtype.
//
// Block records (kOffsets, DequantizeParams::records; format.py): block_scales holds an int16 per block, the
// E4M4 code in its low byte and a signed offset code o in its high byte. A thread loads its block's record where
// it loaded the code and adds the offset in format.dequantize's order: codebook[idx] * (e4m4(code) * row_scale)
// + (0.125 o) * row_scale, each product and the sum rounded in float32 (no fma: the reference rounds the product
// before the add), then one rounding to the output dtype. A template flag: the instantiations without it compile
// to the code they had before. No rotated instantiation reads records (KbitConfig refuses rotation with offsets).
#pragma once

#include "kbit_common.cuh"
#include "rotation.cuh"

namespace kbit {

// Elements per thread: byte `c % 4` of each plane word of block `c / 4` (format.py's bit order
// keeps elements 8b..8b+7 of a block in byte b of every plane word).
constexpr int kDequantizeElems = 8;
constexpr int kDequantizeChunks = kTileK / kDequantizeElems;  // threads per row of one tile (16)
// A CTA is one tile wide in rows: thread (r, c) owns row r, columns [8c, 8c + 8) of each tile.
// Warp w then holds rows 2w and 2w + 1, so each of its plane loads reads the 32 contiguous
// bytes of those two rows (one full sector; 4 lanes share each word).
constexpr int kDequantizeThreads = kTileN * kDequantizeChunks;
// K tiles per CTA, consecutive along the row: their loads are all issued before the first
// store, so a thread has several in flight, and the row scale and codebook are read once for
// all of them. 2, 4 and 8 measured within 4% of each other; 4 keeps registers under 64.
constexpr int kDequantizeKTiles = 4;
static_assert(kDequantizeThreads == 256, "thread (r, c) mapping assumes 16 rows x 16 chunks");
static_assert(kDequantizeChunks == kBlocksPerTile * 4, "a chunk is one byte of one block's plane words");

// Codebook indices of block elements 8 * byte + 0..7 from the block's BITS plane words.
// Returns byte fields: even[i] = index of element 8 * byte + 2i, odd[i] = of element 8 * byte + 2i + 1.
//
// Why it works: the bit of element 8 * byte + 2s + h (s in 0..3, h in 0..1) in plane j is bit
// 4h + s of byte `byte`. Gathering that byte of planes 0..3 into one word Y puts the bit at
// position 8j + 4h + s: address bits [4:3] = j, [2] = h, [1:0] = s. Exchanging the fields
// [4:3] and [1:0] (two delta swaps, one per address-bit pair) moves it to 8s + 4h + j =
// 4 * (2s + h) + j, i.e. nibble e = 2s + h of Y holds element e's index bits 0..3. Even and
// odd nibbles then split into byte fields. Plane 4 (k = 5) adds bit 4 of each field: its low
// nibble (h = 0, even elements s = 0..3) spreads to bits 8s + 4 by one multiply (the four
// shifted copies of a nibble at 0, 7, 14, 21 never overlap, so no carries), its high nibble
// (odd elements) likewise.
template <int BITS>
__device__ __forceinline__ void block_byte_indices(const uint32_t (&w)[BITS], uint32_t byte, uint32_t& even,
                                                   uint32_t& odd) {
  const uint32_t sel = byte | ((byte + 4) << 4);  // PRMT: byte `byte` of a, then of b
  const uint32_t w1 = BITS > 1 ? w[1] : 0u, w2 = BITS > 2 ? w[2] : 0u, w3 = BITS > 3 ? w[3] : 0u;
  uint32_t y = __byte_perm(__byte_perm(w[0], w1, sel), __byte_perm(w2, w3, sel), 0x5410);
  uint32_t t = (y ^ (y >> 14)) & 0x0000CCCCu;  // swap address bits 4 <-> 1
  y ^= t ^ (t << 14);
  t = (y ^ (y >> 7)) & 0x00AA00AAu;  // swap address bits 3 <-> 0
  y ^= t ^ (t << 7);
  even = y & 0x0F0F0F0Fu;
  odd = (y >> 4) & 0x0F0F0F0Fu;
  if constexpr (BITS == 5) {
    const uint32_t y4 = w[4] >> (8 * byte);
    even |= ((y4 & 0x0Fu) * 0x02040810u) & 0x10101010u;  // bit s -> 8s + 4
    odd |= ((y4 & 0xF0u) * 0x00204081u) & 0x10101010u;   // bit 4 + s -> 8s + 4
  }
  static_assert(BITS >= 2 && BITS <= 5, "byte fields hold indices of up to 5 bits");
}

template <typename T, int BITS, bool kRotate, bool kOffsets = false>
__global__ void __launch_bounds__(kDequantizeThreads) dequantize_kernel(DequantizeParams p) {
  static_assert(!(kRotate && kOffsets), "no rotated layer holds block records (KbitConfig refuses the pair)");
  constexpr int kLevels = 1 << BITS;
  constexpr int kTileWords = BITS * kTileN * kBlocksPerTile;  // plane words of one tile
  constexpr int kTileScales = kTileN * kBlocksPerTile;
  const int nt = static_cast<int>((p.n + kTileN - 1) / kTileN), kt = static_cast<int>((p.k + kTileK - 1) / kTileK);
  const int k_groups = (kt + kDequantizeKTiles - 1) / kDequantizeKTiles;
  const int64_t b = blockIdx.y;
  const int tile_n = static_cast<int>(blockIdx.x) / k_groups;
  const int tile_k0 = (static_cast<int>(blockIdx.x) - tile_n * k_groups) * kDequantizeKTiles;
  const int r = threadIdx.x / kDequantizeChunks, c = threadIdx.x % kDequantizeChunks;
  const int q = c / 4;
  const uint32_t byte = c % 4;
  const int64_t row = static_cast<int64_t>(tile_n) * kTileN + r;
  const bool row_valid = row < p.n;  // padding rows are never visible

  // Issue every global load before the barrier so their latency overlaps the codebook's.
  const int64_t tile0 = (b * nt + tile_n) * kt + tile_k0;  // 64-bit: batch * tiles * words can pass 2^31
  const int32_t* planes = p.planes + tile0 * kTileWords + r * kBlocksPerTile + q;
  const uint8_t* codes = p.block_scales + tile0 * kTileScales + r * kBlocksPerTile + q;
  uint32_t w[kDequantizeKTiles][BITS];
  uint32_t code[kDequantizeKTiles];  // kOffsets: the block record, sign-extended (bits 8 and up: the offset code)
  uint32_t sign_word[kDequantizeKTiles];  // kRotate: the sign word of this thread's block
#pragma unroll
  for (int i = 0; i < kDequantizeKTiles; ++i) {
    const bool live = row_valid && tile_k0 + i < kt;
#pragma unroll
    for (int j = 0; j < BITS; ++j)
      w[i][j] = live ? static_cast<uint32_t>(__ldg(planes + i * kTileWords + j * kTileN * kBlocksPerTile)) : 0u;
    if constexpr (kOffsets) {
      const int16_t* records =
          reinterpret_cast<const int16_t*>(p.block_scales) + tile0 * kTileScales + r * kBlocksPerTile + q;
      code[i] = live ? static_cast<uint32_t>(static_cast<int32_t>(__ldg(records + i * kTileScales))) : 0u;
    } else {
      code[i] = live ? __ldg(codes + i * kTileScales) : 0u;
    }
    if constexpr (kRotate) {
      // Word (tile_k0 + i) * 4 + q of [k / 32]; k % 64 == 0, so a live tile's half past k is a whole
      // segment that breaks out of the loop below before using it.
      const int64_t word = static_cast<int64_t>(tile_k0 + i) * kBlocksPerTile + q;
      sign_word[i] = live && word * kBlockSize < p.k ? __ldg(p.rot_signs + word) : 0u;
    }
  }
  const float row_scale = row_valid ? __ldg(p.row_scales + b * p.n + row) : 0.f;

  // At most 32 floats: one bank each, so lanes reading different entries never conflict.
  __shared__ float cb[kLevels];
  if (threadIdx.x < kLevels) cb[threadIdx.x] = p.codebook[b * p.codebook_stride + threadIdx.x];
  __syncthreads();
  if (!row_valid) return;

  T* out_row = static_cast<T*>(p.out) + (b * p.n + row) * p.k;
  // Wide stores need a 16-byte aligned row start (col * sizeof(T) is a multiple of 16 anyway);
  // rows of an odd k alternate, and the others take the element-wise tail path.
  const bool row_aligned = reinterpret_cast<uintptr_t>(out_row) % 16 == 0;
#pragma unroll
  for (int i = 0; i < kDequantizeKTiles; ++i) {
    const int64_t col = static_cast<int64_t>(tile_k0 + i) * kTileK + c * kDequantizeElems;
    if (col >= p.k) break;  // padding columns are never visible (tiles past kt start past k too)
    const float scale = __fmul_rn(e4m4_decode(kOffsets ? code[i] & 0xFFu : code[i]), row_scale);
    uint32_t idx_even, idx_odd;
    block_byte_indices<BITS>(w[i], byte, idx_even, idx_odd);
    float v[kDequantizeElems];
#pragma unroll
    for (int e = 0; e < kDequantizeElems / 2; ++e) {
      v[2 * e] = __fmul_rn(cb[(idx_even >> (8 * e)) & 0xFFu], scale);
      v[2 * e + 1] = __fmul_rn(cb[(idx_odd >> (8 * e)) & 0xFFu], scale);
    }
    if constexpr (kOffsets) {
      // format.block_offset_values: (float(o) * OFFSET_STEP) * row_scale, the first product exact (|o| <= 127).
      const float offset = __fmul_rn(static_cast<float>(static_cast<int32_t>(code[i]) >> 8) * kOffsetStep, row_scale);
#pragma unroll
      for (int e = 0; e < kDequantizeElems; ++e) v[e] = __fadd_rn(v[e], offset);
    }
    if constexpr (kRotate) unrotate8(v, sign_word[i] >> (8 * byte));  // v: one 8-element segment

    // __stwb is st.global.wb.v4 (default caching): a plain uint4/float4 assignment here was
    // split into 32-bit stores by the compiler (float32 then took 1.5x as long).
    T* dst = out_row + col;
    if constexpr (sizeof(T) == 4) {
      // A lane's 32 bytes are one DRAM sector, but one store instruction writes 16 of them, so
      // every sector would arrive in two halves (measured 127 us against 95 us at 14336 x 4096).
      // Lanes 2m and 2m + 1 (neighbouring chunks of one row) swap halves instead: store 1 of
      // the pair fills the even lane's sector, store 2 the odd lane's.
      const int odd_lane = c & 1;
      if (row_aligned && col - 8 * odd_lane + 2 * kDequantizeElems <= p.k) {  // same in both lanes
        const unsigned pair = 3u << (threadIdx.x & 30);
        float got[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) got[e] = __shfl_xor_sync(pair, odd_lane ? v[e] : v[4 + e], 1);
        const float4 mine_lo = make_float4(v[0], v[1], v[2], v[3]), mine_hi = make_float4(v[4], v[5], v[6], v[7]);
        const float4 theirs = make_float4(got[0], got[1], got[2], got[3]);
        __stwb(reinterpret_cast<float4*>(dst - 4 * odd_lane), odd_lane ? theirs : mine_lo);
        __stwb(reinterpret_cast<float4*>(dst + 8 - 4 * odd_lane), odd_lane ? mine_hi : theirs);
        continue;
      }
    } else {
      if (row_aligned && col + kDequantizeElems <= p.k) {
        __stwb(reinterpret_cast<uint4*>(dst),
               make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7])));
        continue;
      }
    }
    const int64_t valid = p.k - col;  // row tail or unaligned row
#pragma unroll
    for (int e = 0; e < kDequantizeElems; ++e)
      if (e < valid) dst[e] = from_float<T>(v[e]);
  }
}

template <typename T, int BITS>
cudaError_t launch_dequantize(const DequantizeParams& p, cudaStream_t stream) {
  const int64_t nt = (p.n + kTileN - 1) / kTileN, kt = (p.k + kTileK - 1) / kTileK;
  if (nt * kt == 0 || p.batch == 0) return cudaSuccess;
  const int64_t ctas = nt * ((kt + kDequantizeKTiles - 1) / kDequantizeKTiles);
  if (ctas > INT32_MAX) return cudaErrorInvalidConfiguration;  // the kernel's tile indices are int
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(p.batch));
  if (p.records) {
    if (p.rot_signs) return cudaErrorInvalidValue;  // no rotated instantiation reads records (kbit_api.cu refuses)
    dequantize_kernel<T, BITS, false, true><<<grid, kDequantizeThreads, 0, stream>>>(p);
  } else if (p.rot_signs) {
    dequantize_kernel<T, BITS, true><<<grid, kDequantizeThreads, 0, stream>>>(p);
  } else {
    dequantize_kernel<T, BITS, false><<<grid, kDequantizeThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace kbit
