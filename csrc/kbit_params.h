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
// format.ROW_SCALE_MAX: the largest float32 r with 31 * r finite, so a decoded block scale
// (e4m4(code) * row_scale) never overflows; quantize clamps row scales to it.
constexpr float kRowScaleMax = 0x1.08420ep+123f;
static_assert(kRowScaleMax * 31.0f <= 0x1.fffffep+127f, "31 x the largest row scale must be a finite float");

// Rotated layers (rotation.cuh): the Hadamard segment of K (rotation.DEFAULT_BLOCK), 8 consecutive
// elements, which a thread holds in its registers wherever the kernels stage x; and the multiple of K a
// rotated layer has (format.ROTATION_MULTIPLE): whole 64-element halves of a K tile, so a partial last
// tile's rotated half is all in K or all past it (zeros, no sign word read).
constexpr int kRotBlock = 8;
constexpr int kRotMultiple = 64;

// Block records (format.py, format v4): block_scales as int16, the E4M4 code in the low
// byte and a signed offset code o (|o| <= 127) in the high byte; the block's elements are
// (codebook[index] * e4m4(code) + kOffsetStep * o) * row_scale (format.OFFSET_STEP). Read by the kOffsets
// instantiations of the GEMV (its prologues included), the wgmma GEMM and dequantize (kbit_gemv_offsets,
// kbit_gemv_prologue_offsets, kbit_gemm_offsets, kbit_dequantize_records); the other kernels read uint8 codes only.
constexpr float kOffsetStep = 0.125f;

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
  // Rotated layers (rotation.cuh): the sign words [k / 32] of R, and each row comes out unrotated,
  // W' R^T; nullptr: the stored weight as it is.
  const uint32_t* rot_signs;
  // Block records (format.py): block_scales points at int16 records [batch, nt, kt, 16, 4] (the E4M4 code in the
  // low byte, a signed offset code in the high byte) and each block adds its offset; unrotated layers only.
  bool records;
};

// x R (or, inverse, x R^T) of x [m, k] (rotation.cuh, the standalone rotation): k % 64 == 0.
struct RotateParams {
  const void* x;               // [m, k], rows x_stride elements apart, dtype `dtype`
  void* out;                   // [m, k] contiguous, 16-byte aligned, dtype `dtype`, not overlapping x
  const uint32_t* rot_signs;   // [k / 32]: bit e % 32 of word e / 32 set <=> s_e = -1
  int64_t m, k, x_stride;
  int dtype;
  int inverse;                 // 0: x R (sign, then the transform); 1: x R^T (the transform, then the sign)
};

// out[m, n] = sum_k x[m, k] * W[n, k] for the small-M GEMV (gemv_kernel.cuh) and the mid-M
// GEMM (gemm_kernel.cuh).
// MmParams::prologue: what the GEMV's x staging reads instead of x (gemv_kernel.cuh, XPrologue).
enum XPrologueKind : int { kPrologueNone = 0, kPrologueSiluMul = 1, kPrologueNorm = 2, kPrologueAddNorm = 3 };
// The GLU epilogue (MmParams::glu), or-ed into kbit_gemv_prologue_offsets' prologue argument.
constexpr int kGemvGlu = 16;

struct MmParams {
  const void* x;               // [m, k] row-major, dtype `dtype`
  const int32_t* planes;       // [nt, kt, bits, 16, 4]
  const uint8_t* block_scales; // [nt, kt, 16, 4]; kOffsets GEMV and wgmma GEMM: int16 block records in that layout
  const float* row_scales;     // [n]
  const float* codebook;       // [2^bits]
  void* out;                   // [m, n], dtype `dtype`
  float* workspace;            // [splits, m, n] partial sums when splits > 1, else unused
  int64_t m, n, k;
  int bits;
  int dtype;
  // Plan: K is cut into `splits` ranges of `chunk_kt` K tiles (split s covers K tiles
  // [s * chunk_kt, min(k_tiles, (s + 1) * chunk_kt))). GEMV (plan_gemv): CTA c serves range
  // c % splits. GEMM (plan_gemm): grid = (token blocks, row blocks, splits).
  int splits, chunk_kt;
  // GEMV only: the pair table sits at a fixed shared-window address (gemv_kernel.cuh,
  // absolute mode) where the GPU's shared memory allows the padding.
  bool abs_table;
  // GEMV only (sm_90+): the `splits` CTAs of a row-tile group form a thread-block cluster and
  // sum their partials through distributed shared memory: no workspace, no second kernel.
  // Plans where every warp has at most one row tile, or balanced plans (`balanced`).
  bool cluster;
  // GEMV only: each CTA of a split a contiguous range of floor(n_tiles / (grid / splits)) row
  // tiles, the first n_tiles % (grid / splits) CTAs one more, and its warps equal contiguous
  // shares of their (row tile, K tile) items (gemv_kernel.cuh). With `cluster`, the splits' CTAs
  // of a row range form a cluster and sum each row tile in one of them.
  bool balanced;
  int cta_rows;  // balanced plans: floor(n_tiles / (grid / splits)), from the host (no division before the first loads)
  // wgmma GEMM only: x rewritten into the GEMM's shared-memory stage layout (wgmma_kernel.cuh),
  // the first bytes of the caller's workspace; `workspace` then points past it.
  char* x_perm;
  // GEMV only (XPrologueKind): none; silu_mul: silu(x) * x2; rmsnorm: norm_weight * x, each token's
  // rsqrt(mean(x^2) + eps) applied to its sums; add_rmsnorm: the same of s = x + x2, which CTA 0 also
  // writes to sum_out [m, k].
  int prologue;
  const void* x2;
  const void* norm_weight;  // [k], dtype `dtype`
  float eps;
  void* sum_out;
  int64_t x_stride, x2_stride;  // row strides (elements) of x and x2 under a prologue
  // GEMV only, balanced one-split plans (glu_gemv_plan): rows [0, n/2) of the weight are a gated MLP's gate
  // projection and rows [n/2, n) its up projection; out [m, n/2] is silu(gate) * up, each rounded as the
  // unfused ops round (gemv_kernel.cuh). cta_rows then counts pairs of row tiles.
  bool glu;
  // Rotated layers (rotation.cuh): the sign words [k / 32] of R; the kernels multiply x R (after the
  // prologue), rounded once to the activation dtype. nullptr: x as it is.
  const uint32_t* rot_signs;
#if KBIT_TRACE
  unsigned long long* trace;  // GEMV only: the trace buffer of kbit_trace_set (gemv_kernel.cuh, GemvTrace)
#endif
};

// Grouped MoE GEMV: out[s] = x[s] @ W[expert of s].T (grouped_gemv_kernel.cuh).
struct GroupedParams {
  const void* x;                // [s / x_repeat, k] row-major, dtype `dtype`: row r of the problem is x row r / x_repeat
  const int64_t* expert_ids;    // [s]: per-row mode (order == nullptr)
  const int64_t* order;         // [s]: rows grouped by expert (grouped mode), or nullptr
  const int64_t* offsets;       // [e + 1]: rows of expert i are order[offsets[i] : offsets[i + 1]]
  const int32_t* planes;        // [e, nt, kt, bits, 16, 4]
  const uint8_t* block_scales;  // [e, nt, kt, 16, 4]
  const float* row_scales;      // [e, n]
  const float* codebook;        // [2^bits], shared by the experts
  void* out;                    // [s, n], dtype `dtype`; grouped GEMV: rows of no expert written as zeros
  int64_t s, e, n, k;
  int64_t x_repeat;             // grouped GEMV: rows per x row (an experts layer's top-k), else 1
  int bits;
  int dtype;
  // Plan: warps per row tile along K, and K tiles of activations staged per pass.
  int k_warps, sub_kt;
  // Per-row mode's balanced plan (grouped_gemv_rows_kernel), else 0: row tiles per CTA, and the most
  // problem rows a CTA's range touches (its staged x rows).
  int64_t cta_rows;
  int row_span;
  const uint32_t* rot_signs;    // rotated experts: the sign words [k / 32] of R (rotation.cuh), else nullptr
  // Grouped GEMV in per-row mode, SiLU-gated input (kbit_grouped_gemv_silu_mul), else nullptr: element i
  // of x row r is silu(x[r, i]) * x2[r, i] (GatedX), x and x2 rows at a pitch of x_stride elements.
  const void* x2;
  // x2 set, and the warp-specialized grouped GEMM (wgmma_ws_kernel.cuh), whose x is sorted by expert
  // (row r of x is row order[r] of the call's x, out row order[r]): x's row pitch in elements. The
  // GEMM's tile_list (ws_group_tiles_words(s, e) words of workspace) receives its tiles.
  int64_t x_stride;
  int32_t* tile_list;
};
// The tile list of a warp-specialized grouped call: a count, padded to 16 bytes, then at most
// s / 64 + e token blocks of 4 words.
constexpr int64_t ws_group_tiles_words(int64_t s, int64_t e) { return 4 + 4 * (s / 64 + e + 1); }

constexpr int kMaxDevices = 64;  // per-device host caches (launch plans, raised shared-memory limits)

// ---- GEMV geometry (host plan and kernel agree on these) ----
#ifndef KBIT_TRACE  // 1: the GEMV stamps the global timer per warp (a diagnostic build: scripts/trace_gemv.py)
#define KBIT_TRACE 0
#endif
constexpr int kGemvThreads = 512;  // 16 warps share one pair table per SM
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kGemvMaxM = 16;              // two mma token tiles; beyond this the weight is dequantized for cuBLAS
constexpr int kGemvTableBytes = 64 * 1024; // codebook pair table: 256 slots x 256 bytes (gemv_kernel.cuh)
constexpr int kGemvXSmemBytes = 96 * 1024;  // activation staging cap per CTA (less where the GPU has less)
constexpr int kGemvCtasPerSm = 1;  // one CTA of 16 warps per SM shares one table
constexpr int kGemvDepth = 3;  // plane-load stages per lane: 2 K tiles in flight hide HBM latency without spills
constexpr int gemv_x_tile_bytes(int m) { return 256 * m; }  // staged activations per K tile
// After the staged K tiles: room for the records of the last tile's tokens m .. 8 ceil(m / 8) - 1,
// which mma_tile's lanes of those tokens read (and never use).
constexpr int gemv_x_tail_bytes(int m) { return 256 * ((8 - m % 8) % 8); }
constexpr int kGemvScaleBytes = 1024;      // the 256 block scales as activation-dtype pairs
// Absolute table mode pads dynamic shared memory so the table starts at window address 64 KB.
constexpr int kGemvTablePad = 64 * 1024;
// Cluster split-K: CTA r of a cluster sums the row tiles of its warps w with w % splits == r,
// receiving one slot per (such warp, split): 32 lanes x 16 bytes per mma token tile.
constexpr int kGemvClusterMax = 8;  // portable cluster size
constexpr int gemv_cluster_slots(int splits) { return splits > 1 ? (kGemvWarps + splits - 1) / splits * splits : 0; }
// Balanced cluster plans: CTA r receives the row tiles j of the cluster's range (at most `rows`)
// with j % splits == r, one slot per (such row tile, split).
constexpr int gemv_balanced_cluster_slots(int splits, int rows) { return (rows + splits - 1) / splits * splits; }
constexpr int gemv_slot_bytes(int m, int slots) { return slots * 32 * 16 * (m <= 8 ? 1 : 2); }
constexpr int gemv_cluster_bytes(int m, int splits) { return gemv_slot_bytes(m, gemv_cluster_slots(splits)); }
// GLU plans (MmParams::glu): a CTA's scaled row tiles, at most two per pair of its range, until the pairs
// are complete.
constexpr int gemv_glu_slots(int cta_pairs) { return 2 * (cta_pairs + 1); }
// Balanced plans: each warp's head segment (32 lanes x 16 bytes per mma token tile), in the
// pair table's place once the main loop is done.
static_assert(kGemvWarps * 2 * 32 * 16 <= kGemvTableBytes, "the balanced GEMV's head sums fit the table");
// cluster_slots: the receive slots of a cluster plan, else 0.
constexpr int gemv_smem_bytes(int m, int chunk_kt, bool abs_table = false, int cluster_slots = 0) {
  return (abs_table ? kGemvTablePad : 0) + kGemvTableBytes + kGemvScaleBytes + chunk_kt * gemv_x_tile_bytes(m) +
         gemv_x_tail_bytes(m) + gemv_slot_bytes(m, cluster_slots);
}
// ---- GEMM geometry ----
// A CTA is kGemmWarps warps, each owning kGemmRowTiles row tiles (16 rows each) and all 8 * NT
// tokens of the CTA's token block, so every weight pair is decoded once per token block and
// each B fragment read from shared memory feeds kGemmRowTiles mma. One CTA per SM (the 64 KB
// pair table). 8 warps x 2 row tiles: half the B-fragment traffic of 16 x 1; 16 x 2 spills.
constexpr int kGemmWarps = 8;
constexpr int kGemmRowTiles = 2;
constexpr int kGemmThreads = 32 * kGemmWarps;
constexpr int kGemmTiles = kGemmWarps * kGemmRowTiles;  // row tiles per CTA
constexpr int kGemmRows = kGemmTiles * kTileN;
constexpr int gemm_block_m(int nt) { return 8 * nt; }  // tokens per CTA
// cp.async stages: 2 K tiles in flight; 1 for the largest token block (shared memory).
constexpr int gemm_stages(int nt) { return nt >= 16 ? 2 : 3; }
constexpr int gemm_stage_bytes(int bits, int nt) {
  return kGemmTiles * (bits * 256 + 64) + gemm_block_m(nt) * kTileK * 2;  // packed tiles + x tile
}
constexpr int gemm_smem_bytes(int bits, int nt) {
  return kGemvTableBytes + kGemvScaleBytes + gemm_stages(nt) * gemm_stage_bytes(bits, nt);
}
// ---- wgmma GEMM geometry (sm_90a, wgmma_kernel.cuh) ----
// A CTA is 2 warpgroups: 8 warps, one 16-row tile each (128 rows), and NB sub-blocks of 64
// tokens (the wgmma N). x comes in parts of a K tile through shared-memory slots: NB = 1 in
// whole K tiles (2 swizzle atoms, 16 KB) and 3 slots; NB >= 2 in half K tiles (one atom,
// NB x 8 KB) and 4 slots: halves pay off at large M, whole tiles (half the barriers) at small M.
constexpr int kWgmmaThreads = 256;
constexpr int kWgmmaTiles = kWgmmaThreads / 32;
constexpr int kWgmmaRows = kWgmmaTiles * kTileN;
constexpr int kWgmmaTokens = 64;
constexpr int wgmma_nb(int64_t m) { return m <= 64 ? 1 : m <= 128 ? 2 : 4; }
constexpr int wgmma_parts(int nb) { return nb == 1 ? 1 : 2; }  // x parts per K tile
constexpr int wgmma_slots(int nb) { return nb == 1 ? 3 : 4; }
constexpr int wgmma_atom_bytes(int nb) { return nb * kWgmmaTokens * 128; }  // 64 K of every token
constexpr int wgmma_stage_bytes(int nb) { return 2 * wgmma_atom_bytes(nb); }  // x_perm per K tile
// The pair table and scale pairs (65 KB: the slots after them stay on 1 KB swizzle atoms),
// then the slots.
constexpr int wgmma_smem_bytes(int nb) {
  return kGemvTableBytes + kGemvScaleBytes + wgmma_slots(nb) * wgmma_stage_bytes(nb) / wgmma_parts(nb);
}
constexpr int wgmma_ctas_per_sm(int nb) { return nb == 1 ? 2 : 1; }
// ---- warp-specialized wgmma GEMM geometry (sm_90a, wgmma_ws_kernel.cuh) ----
// A CTA is 3 warpgroups: 2 consumers (8 warps, one 16-row tile each: 128 weight rows) and a
// producer. A tile is those 128 rows x NB sub-blocks of 64 tokens (the wgmma N); x streams in
// slots of half a K tile (64 K: one 128-byte swizzle row per token), the packed weight in slots of
// whole K tiles (8 row tiles' planes, then their scale codes). One persistent CTA per SM.
constexpr int kWsThreads = 384;
constexpr int kWsConsumerWarps = 8;
constexpr int kWsRows = kWsConsumerWarps * kTileN;
constexpr int kWsXHalfK = 64;
constexpr int kWsTableBytes = kGemvTableBytes + kGemvScaleBytes;  // the GEMV's pair table and scale pairs
constexpr int kWsNbs[] = {1, 2, 4};  // the instantiated token blocks (generate_kernels.py)
constexpr int ws_x_slot_bytes(int nb) { return nb * kWgmmaTokens * kWsXHalfK * 2; }
constexpr int ws_w_slot_bytes(int bits) { return kWsConsumerWarps * (bits * 256 + 64); }
// Slots: about 4 K tiles of x in flight where a K tile is short (HBM latency at NB = 1), fewer at
// NB = 4, whose slots are 32 KB; weight tiles 3-4 deep.
constexpr int ws_x_slots(int nb) { return nb == 1 ? 8 : nb == 2 ? 6 : 4; }
constexpr int ws_w_slots(int nb) { return nb == 4 ? 3 : 4; }
constexpr int ws_barrier_bytes(int nb) { return 16 * (ws_x_slots(nb) + ws_w_slots(nb)); }  // full + empty
constexpr int ws_smem_bytes(int bits, int nb) {
  return kWsTableBytes + ws_x_slots(nb) * ws_x_slot_bytes(nb) + ws_w_slots(nb) * ws_w_slot_bytes(bits) +
         ws_barrier_bytes(nb);
}
static_assert(kWsTableBytes % 1024 == 0, "x slots after the table stay on 1 KB swizzle atoms");
static_assert(ws_smem_bytes(5, 1) <= 227 * 1024 && ws_smem_bytes(5, 2) <= 227 * 1024 &&
                  ws_smem_bytes(5, 4) <= 227 * 1024,
              "every (bits, NB) fits sm_90's 227 KB of dynamic shared memory per block");
// Per-row mode's balanced plan: a CTA stages x over all of K for the <= 8 problem rows (one mma token
// tile) its range of row tiles touches.
constexpr int kGroupedRowSpanMax = 8;
constexpr int kGroupedRowsStaticSmem = kGroupedRowSpanMax * 8;  // the range's experts (int64)
constexpr int grouped_rows_smem_bytes(int row_span, int k_tiles) {
  return kGemvTableBytes + kGemvScaleBytes + k_tiles * gemv_x_tile_bytes(row_span) + gemv_x_tail_bytes(row_span);
}
constexpr int kGroupedNt = 4;  // grouped mode: an expert's rows in chunks of up to 32 (4 mma token tiles)
// Grouped GEMV: table, `sub_kt` K tiles of x for 8 * nt rows, the k_warps reduction, the
// unit's row indices and the per-expert chunk prefix sum (grouped mode).
constexpr int grouped_smem_bytes(int nt, int sub_kt, int64_t num_experts) {
  return kGemvTableBytes + kGemvScaleBytes + sub_kt * gemv_x_tile_bytes(8 * nt) + kGemvWarps * 8 * nt * kTileN * 4 +
         8 * nt * 8 + static_cast<int>(num_experts + 1) * 4;
}

}  // namespace kbit
