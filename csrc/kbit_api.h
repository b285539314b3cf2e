/* C ABI of the kbit CUDA library (loaded from Python with ctypes; no libtorch dependency).
 *
 * Every function takes the device index and the caller's stream (torch's current stream, so
 * CUDA graphs and multi-stream code work), performs no allocation and no host sync, and
 * returns 0 or an error code; kbit_last_error() then describes the failure, naming the
 * argument at fault. Tensors are raw device pointers to contiguous memory in the layouts of
 * hf_kbit/format.py (format v1). dtype codes: 0 float32, 1 float16, 2 bfloat16.
 *
 * Rotated layers (hf_kbit/rotation.py): every entry that computes with a weight takes rot_signs,
 * the sign words of R = diag(s) B (B = H64 / 8 on consecutive 64-element segments of K): [k / 32]
 * uint32 on the device, bit e % 32 of word e / 32 set <=> s_e = -1, k % 64 == 0. The stored
 * weight W' is then the quantized W R: the matmuls multiply x R (after any prologue, in float32,
 * rounded once to x's dtype) by W'^T, and dequantize returns W' R^T. NULL: no rotation. Where a
 * kernel does not stage x R itself, the call runs the standalone rotation (kbit_rotate) into its
 * workspace first; the caller's dequantize + matmul path multiplies W' by kbit_rotate's x R.
 */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KBIT_API __attribute__((visibility("default")))

enum { KBIT_OK = 0, KBIT_INVALID_ARGUMENT = 1, KBIT_CUDA_ERROR = 2 };

KBIT_API int kbit_abi_version(void);
KBIT_API const char* kbit_last_error(void);
KBIT_API int kbit_gemv_max_m(void);

/* The kernel table the library was built from (hf_kbit/kernel_table.py): entry i is
 * (kernel name, bits, dtype code). Every other (kernel, bits, dtype) fails with "unsupported". */
KBIT_API int kbit_kernel_table_size(void);
KBIT_API int kbit_kernel_table_entry(int i, const char** kernel, int* bits, int* dtype);

/* weight [batch, n, k] (dtype) -> planes, block_scales, row_scales [batch, n]. */
KBIT_API int kbit_quantize(int device, void* stream, const void* weight, int dtype, const float* codebook,
                           int bits, int64_t batch, int64_t n, int64_t k, int32_t* planes,
                           uint8_t* block_scales, float* row_scales);

/* packed -> out [batch, n, k] in dtype; codebook [batch, 2^bits] (codebook_stride = 2^bits) or shared (0).
 * With rot_signs, each row unrotated (W' R^T: float32, rounded once to dtype). */
KBIT_API int kbit_dequantize(int device, void* stream, const int32_t* planes, const uint8_t* block_scales,
                             const float* row_scales, const float* codebook, int64_t codebook_stride, int bits,
                             int64_t batch, int64_t n, int64_t k, void* out, int dtype, const uint32_t* rot_signs);

/* kbit_dequantize of block records (hf_kbit/format.py: block_records int16 [batch, nt, kt, 16, 4] in the layout of
 * block_scales, the E4M4 code in the low byte and a signed offset code o in the high byte): each element
 * codebook[idx] * (e4m4(code) * row_scale) + (0.125 o) * row_scale in float32, rounded once to dtype, bit-exact
 * with format.dequantize. Unrotated layers only (no rotated layer holds records). */
KBIT_API int kbit_dequantize_records(int device, void* stream, const int32_t* planes, const int16_t* block_records,
                                     const float* row_scales, const float* codebook, int64_t codebook_stride, int bits,
                                     int64_t batch, int64_t n, int64_t k, void* out, int dtype);

/* out [m, k] = x [m, k] R (inverse = 1: x R^T, e.g. dX = (dY W') R^T) in dtype, float32 arithmetic
 * rounded once (rows of x x_stride elements apart; out contiguous, 16-byte aligned, not overlapping
 * x): the standalone rotation, where no kernel fuses it. rot_signs required. */
KBIT_API int kbit_rotate(int device, void* stream, const void* x, int64_t x_stride, int dtype, int64_t m, int64_t k,
                         const uint32_t* rot_signs, int inverse, void* out);

/* Floats of float32 workspace kbit_gemv needs for this problem (0: none); rotated != 0: a rotated
 * layer's (room for x R at its head, whichever way the call rotates). */
KBIT_API int64_t kbit_gemv_workspace_size(int device, int64_t m, int64_t n, int64_t k, int bits, int rotated);

/* The rotated GEMV crossover of bits (hf_kbit/backends/crossovers.json, rotated_gemv): a rotated
 * layer's GEMV of m <= in_staging_max_m rows stages x R itself (where the library has that
 * instantiation), larger m take the standalone rotation into the workspace, then the unrotated GEMV
 * as its programmatic dependent. 0 (the value until set): the standalone rotation at every m. */
KBIT_API int kbit_set_gemv_rotate_crossover(int bits, int in_staging_max_m);

/* How a rotated layer's GEMV of m rows in dtype runs, into *mode: 1 x R staged by the GEMV, 0 the
 * standalone rotation first, -1 (prologue != 0 beyond the rotated instantiations) refused by
 * kbit_gemv_prologue (run the prologue unfused, then kbit_gemv). */
KBIT_API int kbit_gemv_rotate_plan(int bits, int dtype, int64_t m, int prologue, int* mode);

/* out [m, n] = x [m, k] @ W.T, m <= kbit_gemv_max_m(), x/out float16 or bfloat16. */
KBIT_API int kbit_gemv(int device, void* stream, const void* x, int dtype, const int32_t* planes,
                       const uint8_t* block_scales, const float* row_scales, const float* codebook, int bits,
                       int64_t m, int64_t n, int64_t k, void* out, float* workspace, int64_t workspace_size,
                       const uint32_t* rot_signs);

/* 4-byte words of workspace (16-byte aligned) kbit_grouped_gemm needs for s rows and e experts. */
KBIT_API int64_t kbit_grouped_gemm_workspace_size(int64_t s, int64_t e);

/* MoE prefill on sm_90a (the warp-specialized GEMM's grouped calls): out[order[r]] = x[r] @ W[e].T for the
 * rows offsets[e] <= r < offsets[e + 1] of each expert e, x [s, k] sorted by expert (x[r] the call's row
 * order[r]) at a row pitch of x_stride elements (16-byte aligned, whole 16-byte units), planes [e, nt, kt,
 * bits, 16, 4], row_scales [e, n], one codebook; rows outside every expert's range keep out's values. The
 * tiles are listed on the device (no host sync: graph-safe). Fails on GPUs without sm_90a code. */
KBIT_API int kbit_grouped_gemm(int device, void* stream, const void* x, int64_t x_stride, int dtype,
                               const int64_t* order, const int64_t* offsets, const int32_t* planes,
                               const uint8_t* block_scales, const float* row_scales, const float* codebook, int bits,
                               int64_t s, int64_t e, int64_t n, int64_t k, void* out, float* workspace,
                               int64_t workspace_size);

/* Floats of float32 workspace kbit_gemm needs for this problem (0: none): split-K partials and,
 * for the wgmma kernel, x rewritten into its stage layout (for the warp-specialized kernel, x at a
 * 16-byte row pitch where k % 8 != 0; for it and the mma.sync kernel with a rotated weight,
 * `rotated` != 0: x R); -1 when the GEMM cannot run on this GPU (too little shared memory per block:
 * use dequantize + matmul). */
KBIT_API int64_t kbit_gemm_workspace_size(int device, int64_t m, int64_t n, int64_t k, int bits, int rotated);

/* The GEMM's launch plan for this problem on `device` (for tests and benchmarks): *wgmma the GEMM
 * kernel (0 mma.sync, 1 wgmma, 2 warp-specialized wgmma; both wgmma kernels sm_90a), tokens per tile,
 * K splits and CTAs (the warp-specialized kernel's are persistent). */
KBIT_API int kbit_gemm_plan(int device, int64_t m, int64_t n, int64_t k, int bits, int* wgmma, int* block_m,
                            int* splits, int* ctas);

/* The GEMM kernel the planner takes from now on, process-wide (for tests and benchmarks): 0 mma.sync,
 * 1 wgmma, 2 warp-specialized wgmma, -1 HF_KBIT_GEMM_KERNEL's choice (the default). A GPU without sm_90a
 * code runs the mma.sync GEMM whatever is asked. */
KBIT_API int kbit_set_gemm_kernel(int gemm);

/* The GEMM kernel the planner takes on `device` now (the codes of kbit_set_gemm_kernel, without -1). */
KBIT_API int kbit_gemm_kernel(int device);

/* The warp-specialized GEMM's token block (nb 64-token blocks: 1, 2 or 4) and K splits (1..8; at most the K
 * tiles) from now on, process-wide, instead of its cost model's (0: the model's): tests cover every tile with
 * it, and benchmarks time each plan to fit the model. A split takes ceil(k_tiles / splits) K tiles; one left
 * without K tiles adds zeros. */
KBIT_API int kbit_set_wgmma_ws_plan(int nb, int splits);

/* The GEMV's plan from now on, process-wide, instead of its cost model's choice (tests and benchmarks): mode
 * as kbit_gemv_plan reports it (0..3; -1: the model's again) and splits (1..64; 0: the cheapest of that mode).
 * A problem with no plan of that mode and splits then reports splits 0 (kbit_gemv_plan) and fails to launch,
 * naming them. Call records written before (kbit_gemv_prepare) keep the plan they hold. */
KBIT_API int kbit_set_gemv_plan(int mode, int splits);

/* The path planner's data: measured crossovers (hf_kbit/backends/crossovers.json, written by
 * scripts/bench_kernels.py --paths, handed over once by the Python backend at load). For the GEMM
 * kernel `gemm` (0 mma.sync, 1 wgmma, 2 warp-specialized wgmma) at `bits`: the GEMV serves m <= gemv_max_m, the GEMM
 * m <= gemm_max_m[i] of the first weight class i with n * k >= min_weight[i] (min_weight descending
 * to 0), dequantize + matmul the rest. */
KBIT_API int kbit_set_mm_crossovers(int gemm, int bits, int gemv_max_m, int classes, const int64_t* min_weight,
                                   const int64_t* gemm_max_m);

/* The one path planner of out [m, n] = x [m, k] @ W.T, x in dtype: *path 0 the GEMV (kbit_gemv), 1 the
 * GEMM (kbit_gemm), 2 dequantize + the caller's matmul (float32 x, large m, or a GPU without the GEMM's
 * shared memory); *gemm the GEMM kernel of this device (as kbit_gemm_plan's); *workspace the floats of
 * workspace the path's kernel needs (`rotated` != 0: for a rotated weight). Tiles and splits are planned
 * by the kernel calls themselves. */
KBIT_API int kbit_mm_plan(int device, int64_t m, int64_t n, int64_t k, int bits, int dtype, int rotated, int* path,
                          int* gemm, int64_t* workspace);

/* Mid-M tensor-core GEMM: out [m, n] = x [m, k] @ W.T, any m >= 1, x/out float16 or bfloat16,
 * planes and block_scales 16-byte aligned (and x, for the warp-specialized kernel). The kernel is the
 * device's (kbit_gemm_plan): on sm_90a the wgmma GEMM, unless HF_KBIT_GEMM_KERNEL (read once per
 * process) is "mma" (the mma.sync GEMM of GPUs before sm_90) or "wgmma_ws" (the warp-specialized one). */
KBIT_API int kbit_gemm(int device, void* stream, const void* x, int dtype, const int32_t* planes,
                       const uint8_t* block_scales, const float* row_scales, const float* codebook, int bits,
                       int64_t m, int64_t n, int64_t k, void* out, float* workspace, int64_t workspace_size,
                       const uint32_t* rot_signs);

/* kbit_gemv of x after an elementwise prologue, folded into the GEMV's x staging (prologue 1
 * silu_mul: silu(x) * x2, SiLU in float32 rounded to dtype, as transformers' gated MLPs; 2 rmsnorm:
 * rms_norm(x) * norm_weight; 3 add_rmsnorm: the same of x + x2 (rounded to dtype), written to
 * sum_out [m, k] too). x and x2 rows are x_stride / x2_stride elements apart (>= k). The norm's
 * per-token rsqrt(mean(x^2) + eps) scales the token's sums, so results differ from the unfused
 * ops by rounding only. With rot_signs the GEMV multiplies the prologue's output rotated (the sum
 * of squares and sum_out stay unrotated: ||x R|| = ||x||), staged by the GEMV: m <= 8
 * (kbit_gemv_rotate_plan), since only the staging sees the prologue's output. */
KBIT_API int kbit_gemv_prologue(int device, void* stream, int prologue, const void* x, int64_t x_stride,
                                const void* x2, int64_t x2_stride, const void* norm_weight, float eps, void* sum_out,
                                int dtype, const int32_t* planes, const uint8_t* block_scales,
                                const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n,
                                int64_t k, void* out, float* workspace, int64_t workspace_size,
                                const uint32_t* rot_signs);

/* The GEMV's launch plan for this problem on `device` (for tests and benchmarks): K splits,
 * K tiles per split, CTAs, and its mode: 0 one split, or splits summed through a workspace and
 * a second kernel; 1 splits summed through a thread-block cluster; 2 balanced (each warp an
 * equal share of its CTA's items; splits summed through the workspace); 3 balanced, the splits
 * summed through a thread-block cluster. Returns KBIT_OK or an error code. */
KBIT_API int kbit_gemv_plan(int device, int64_t m, int64_t n, int64_t k, int* splits, int* chunk_kt, int* grid,
                            int* mode);

/* Eager fast path: kbit_gemv split in two. kbit_gemv_prepare validates the weight and the
 * problem once and writes an opaque call record (kbit_gemv_call_size() bytes, caller-owned)
 * plus the workspace floats it needs; kbit_gemv_run then launches with only the per-call
 * pointers (x, out, workspace, stream), checking nothing but null pointers. The record stays
 * valid while the packed tensors (and rot_signs) live at the same addresses. */
KBIT_API int64_t kbit_gemv_call_size(void);
KBIT_API int kbit_gemv_prepare(int device, int dtype, const int32_t* planes, const uint8_t* block_scales,
                               const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n,
                               int64_t k, const uint32_t* rot_signs, void* call, int64_t* workspace_size);
KBIT_API int kbit_gemv_run(const void* call, const void* x, void* out, float* workspace, void* stream);

/* Block records (hf_kbit/format.py: block_scales as int16 [nt, kt, 16, 4], the E4M4 code in the low byte and a
 * signed offset code o in the high byte, each block decoding to (codebook * e4m4 + 0.125 o) * row_scale). Only
 * the GEMV (unrotated, with or without a prologue, m <= kbit_gemv_offsets_max_m(bits, dtype); 0: none for that
 * bits and dtype), the wgmma GEMM (unrotated, sm_90a: kbit_gemm_offsets_serves) and kbit_dequantize_records read
 * them. Every other entry here takes uint8 codes only: dequantize records first. kbit_gemv_offsets is kbit_gemv on
 * records, its workspace kbit_gemv_workspace_size(..., 0); kbit_gemv_prepare_offsets writes a call record for
 * kbit_gemv_run as kbit_gemv_prepare does; kbit_gemv_prologue_offsets is kbit_gemv_prologue on records (no
 * rot_signs: no rotated layer holds records). */
KBIT_API int kbit_gemv_offsets_max_m(int bits, int dtype);
KBIT_API int kbit_gemv_offsets(int device, void* stream, const void* x, int dtype, const int32_t* planes,
                               const int16_t* block_records, const float* row_scales, const float* codebook, int bits,
                               int64_t m, int64_t n, int64_t k, void* out, float* workspace, int64_t workspace_size);
KBIT_API int kbit_gemv_prepare_offsets(int device, int dtype, const int32_t* planes, const int16_t* block_records,
                                       const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n,
                                       int64_t k, void* call, int64_t* workspace_size);
KBIT_API int kbit_gemv_prologue_offsets(int device, void* stream, int prologue, const void* x, int64_t x_stride,
                                        const void* x2, int64_t x2_stride, const void* norm_weight, float eps,
                                        void* sum_out, int dtype, const int32_t* planes, const int16_t* block_records,
                                        const float* row_scales, const float* codebook, int bits, int64_t m,
                                        int64_t n, int64_t k, void* out, float* workspace, int64_t workspace_size);

/* The GLU epilogue: kbit_gemv_prologue_offsets with prologue | 16 multiplies x by a gated MLP's fused gate/up weight
 * (rows [0, n/2) the gate projection, [n/2, n) the up projection: n % 32 == 0) and writes out [m, n/2] =
 * silu(gate) * up, the GEMV's outputs rounded to dtype, then silu_mul's roundings (the SiLU in float32, rounded,
 * times up, rounded). It serves where kbit_gemv_glu_serves is 1 (its own plan: balanced, one split; unrotated block
 * records, m <= kbit_gemv_offsets_max_m); elsewhere run the prologue GEMV, then silu_mul. */
KBIT_API int kbit_gemv_glu_serves(int device, int64_t m, int64_t n, int64_t k, int bits, int dtype);

/* 1 when kbit_gemm_offsets serves this problem on `device`: its GEMM plan there is the wgmma GEMM (kbit_gemm_plan's
 * kernel 1: sm_90a, not overridden by kbit_set_gemm_kernel or HF_KBIT_GEMM_KERNEL) and the library holds the
 * block-records instantiation for bits and dtype; else 0. */
KBIT_API int kbit_gemm_offsets_serves(int device, int64_t m, int64_t n, int64_t k, int bits, int dtype);
/* kbit_gemm on block records (the wgmma GEMM with the records' offsets, the plan kbit_gemm would take), its
 * workspace kbit_gemm_workspace_size(..., 0); fails, naming the planned kernel, where kbit_gemm_offsets_serves is 0.
 * block_records 2-byte aligned. */
KBIT_API int kbit_gemm_offsets(int device, void* stream, const void* x, int dtype, const int32_t* planes,
                               const int16_t* block_records, const float* row_scales, const float* codebook, int bits,
                               int64_t m, int64_t n, int64_t k, void* out, float* workspace, int64_t workspace_size);

/* Grouped MoE GEMV, all experts in one launch: out [s, n] row r = x [s, k] row r @ W[expert].T
 * with W [e, n, k] packed (leading expert dim) and one shared codebook. Per-row mode
 * (order = NULL): the expert of row r is expert_ids[r]. Grouped mode: rows grouped by expert,
 * order [s] and offsets [e + 1] on the device (rows of expert i are order[offsets[i] : offsets[i + 1]],
 * the others lie before offsets[0] and from offsets[e] on). Either way, every row of out is written:
 * rows with ids outside [0, e) as zeros. With expert_ids given too, a GPU whose shared memory cannot
 * hold the grouped mode's staging falls back to per-row mode. x/out float16 or bfloat16. rot_signs:
 * the experts' shared rotation (they all read the same x), per-row mode only (grouped mode: pass
 * kbit_rotate's x R instead, one rotation rather than one per unit). x_repeat: row r of the problem
 * reads x row r / x_repeat, so x holds s / x_repeat rows (an experts layer passes its tokens once for
 * their top-k (token, expert) rows instead of a copy repeated k times); 1: x is [s, k]. */
KBIT_API int kbit_grouped_gemv(int device, void* stream, const void* x, int dtype, const int64_t* expert_ids,
                               const int64_t* order, const int64_t* offsets, const int32_t* planes,
                               const uint8_t* block_scales, const float* row_scales, const float* codebook,
                               int bits, int64_t s, int64_t e, int64_t n, int64_t k, void* out,
                               const uint32_t* rot_signs, int64_t x_repeat);

/* kbit_grouped_gemv of a SiLU-gated input, as an experts layer's down projection reads its gate_up
 * output: row r of the problem multiplies silu(gate[r, :]) * up[r, :] (float32, the SiLU rounded to
 * the dtype, then the product, as the unfused ops round), gate and up [s, k] at a row pitch of
 * x_stride elements (the two halves of a [s, 2k] tensor: up = gate + k, x_stride = 2k), computed as the
 * kernel stages x. Per-row mode only (order and offsets NULL: decode's few rows; grouped mode: run the
 * gating, then kbit_grouped_gemv); otherwise kbit_grouped_gemv's arguments (x_repeat 1). */
KBIT_API int kbit_grouped_gemv_silu_mul(int device, void* stream, const void* gate, const void* up, int64_t x_stride,
                                        int dtype, const int64_t* expert_ids, const int64_t* order,
                                        const int64_t* offsets, const int32_t* planes, const uint8_t* block_scales,
                                        const float* row_scales, const float* codebook, int bits, int64_t s,
                                        int64_t e, int64_t n, int64_t k, void* out, const uint32_t* rot_signs);

#if KBIT_TRACE
/* KBIT_TRACE=1 builds only (a diagnostic: scripts/trace_gemv.py): every later GEMV launch appends
 * per-warp timer stamps to `buffer` (device memory, uint64: [0] the record count, zeroed by the
 * caller; records of 8 words from word 8; gemv_kernel.cuh, GemvTrace), or none when NULL. A launch
 * captured into a CUDA graph keeps the buffer that was set at capture. */
KBIT_API void kbit_trace_set(void* buffer);
#endif

#ifdef __cplusplus
}
#endif
