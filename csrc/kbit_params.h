// Shapes and launch parameters shared by the host API and the kernels.
// Format constants mirror hf_kbit/format.py (format v1); the Python side is the spec.
#pragma once

#include <cstdint>

namespace kbit {

constexpr int kBlockSize = 32;     // elements along K sharing one scale; bits of one plane word
constexpr int kTileN = 16;         // rows per tile
constexpr int kBlocksPerTile = 4;  // plane words per (row, plane) per tile: one 16-byte load
constexpr int kTileK = kBlockSize * kBlocksPerTile;
constexpr int kE4M4Bias = 11;

// Activation dtypes the kernels take (values fixed: they cross the C ABI).
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct QuantizeParams {
  const void* weight;      // [batch, n, k] row-major, dtype `dtype`
  const float* codebook;   // [2^bits]
  int32_t* planes;         // [batch, nt, kt, bits, 16, 4]
  uint8_t* block_scales;   // [batch, nt, kt, 16, 4]
  float* row_scales;       // [batch, n]
  int64_t batch, n, k;
  int bits;
  int dtype;
};

struct DequantizeParams {
  const int32_t* planes;
  const uint8_t* block_scales;
  const float* row_scales;
  const float* codebook;     // [batch or 1, 2^bits]
  void* out;                 // [batch, n, k] in `dtype`
  int64_t batch, n, k;
  int64_t codebook_stride;   // 0 when one codebook serves every batch entry
  int bits;
  int dtype;
};

// Small-M GEMV: out[m, n] = sum_k x[m, k] * W[n, k]; no tensor cores.
struct GemvParams {
  const void* x;               // [m, k] row-major, dtype `dtype`
  const int32_t* planes;       // [nt, kt, bits, 16, 4]
  const uint8_t* block_scales; // [nt, kt, 16, 4]
  const float* row_scales;     // [n]
  const float* codebook;       // [2^bits]
  void* out;                   // [m, n], dtype `dtype`
  float* workspace;            // [splits, m, n] partial sums when splits > 1, else unused
  int64_t m, n, k;
  int bits;
  int dtype;
  // Plan (filled by plan_gemv): a CTA covers `row_tiles` row tiles and `chunk_kt` K tiles.
  int splits, chunk_kt, row_tiles, k_warps;
};

// ---- GEMV geometry (host plan and kernel agree on these) ----
constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kGemvMaxM = 8;              // beyond this the weight is dequantized for cuBLAS
constexpr int kXStride = kTileK + 4;      // floats per staged K tile: +4 moves the two half-warps
                                          // (adjacent K tiles) onto different banks
constexpr int kGemvXSmemBytes = 34 * 1024;  // activation staging budget per CTA
constexpr int kGemvCtasPerSm = 2;           // 64 KB pair table + 34 KB staging each fit twice

// Pair table of codebook values (float2), one copy per lane group so lookups never conflict.
// k <= 4: pair index = i0 | i1 << 4 (the byte the SWAR extraction yields): 16 * 2^k entries,
//         32 copies -> 256 bytes per entry, so index * 256 + lane * 8 is one byte permute.
// k = 5:  pair index = low nibbles | hi0 << 8 | hi1 << 9: 1024 entries, 8 copies (64 KB).
// Entries are half2 (kGemvHalfTable, default: half the shared-memory traffic per lookup; the
// codebook values round to float16, ~2^-12 relative, far below the bf16/fp16 output rounding)
// or float2; k <= 4: 32 lane-private copies, so an entry spans 128 or 256 bytes.
#ifndef KBIT_GEMV_HALF_TABLE
#define KBIT_GEMV_HALF_TABLE 1
#endif
constexpr bool kGemvHalfTable = KBIT_GEMV_HALF_TABLE != 0;
constexpr int pair_table_entries(int bits) { return bits <= 4 ? (16 << bits) : 1024; }
constexpr int pair_table_copies(int bits) { return bits <= 4 ? 32 : 8; }
constexpr int pair_table_bytes(int bits) {
  return pair_table_entries(bits) * pair_table_copies(bits) * (kGemvHalfTable ? 4 : 8);
}
// Resident CTAs per SM the kernel is compiled for (register cap: 3 -> 85 registers) and the
// plane-load stages per lane (kDepth - 1 K tiles in flight while one is decoded). Measured on
// H100 (benchmarks/results/h100.md): 3 CTAs help M = 1 for k <= 4 and M = 2 for k = 4; k = 5
// and M = 2 at k = 2, 3 lose more to the register cap than they gain. A third stage pays
// where registers allow it without spills.
constexpr int gemv_min_ctas(int bits, int m) { return (m == 1 && bits <= 4) || (m == 2 && bits == 4) ? 3 : 2; }
constexpr int gemv_depth(int bits, int m) {
  return m <= 2 && bits <= 4 && !(gemv_min_ctas(bits, m) == 3 && bits == 4) ? 3 : 2;
}
constexpr int gemv_smem_bytes(int bits, int m, int sub_kt) {
  return pair_table_bytes(bits) + m * sub_kt * kXStride * 4 + kGemvWarps * m * kTileN * 4;
}

}  // namespace kbit
