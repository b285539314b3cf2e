// Host API: argument checks, launch plans, dispatch to the kernel table's instantiations
// (kbit_kernel_table.h, generated from hf_kbit/kernel_table.py).
// No allocation, no host sync: everything runs on the caller's stream.
#include "kbit_api.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "kbit_kernel_table.h"

namespace {

using namespace kbit;

// Unchanged by the block-records entries (kbit_gemv_offsets*, kbit_gemv_prologue_offsets, kbit_gemm_offsets*,
// kbit_dequantize_records): they are new symbols, which a caller looks up before it declares them
// (hf_kbit/backends/cuda.py), as it does the other optional entries.
constexpr int kAbiVersion = 11;

thread_local char g_error[512] = "";

int fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, args);
  va_end(args);
  return KBIT_INVALID_ARGUMENT;
}

// A (kernel, bits, dtype) outside the kernel table.
int unsupported(KernelId kernel, int bits, int dtype) {
  return fail("unsupported kernel=%s, bits=%d, dtype=%s (the library holds hf_kbit/kernel_table.py's list)",
              kKernelNames[kernel], bits, dtype >= 0 && dtype <= 2 ? kDTypeNames[dtype] : "?");
}

int cuda_fail(cudaError_t err, const char* what) {
  snprintf(g_error, sizeof(g_error), "%s: CUDA error %d (%s)", what, static_cast<int>(err), cudaGetErrorString(err));
  return KBIT_CUDA_ERROR;
}

// Makes `device` current for the call and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) {
      err_ = cudaSetDevice(device);
      changed_ = err_ == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  cudaError_t error() const { return err_; }

 private:
  int prev_ = 0;
  bool changed_ = false;
  cudaError_t err_ = cudaSuccess;
};

int sm_count(int device) {
  static int cache[kMaxDevices] = {0};
  if (device < 0 || device >= kMaxDevices) return 132;
  if (cache[device] == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || v <= 0) v = 132;
    cache[device] = v;
  }
  return cache[device];
}

bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct GemvPlan {
  int splits, chunk_kt, grid;
  bool cluster;    // split-K through a thread-block cluster (MmParams::cluster)
  bool balanced;   // equal shares of each CTA's items per warp (MmParams::balanced)
  bool abs_table;  // the pair table at a fixed shared-window address (MmParams::abs_table)

  // Floats of split-K workspace the plan needs.
  int64_t workspace(int64_t m, int64_t n) const { return splits > 1 && !cluster ? int64_t{splits} * m * n : 0; }
};

int device_attribute(int device, cudaDeviceAttr attr, int fallback) {
  int v = 0;
  return cudaDeviceGetAttribute(&v, attr, device) == cudaSuccess && v > 0 ? v : fallback;
}

constexpr int kReservedSmem = 1024;  // per-CTA system shared memory

// Shared-memory limits of a device (queried once: the GEMV launch plans run on every call).
struct SmemLimits {
  int per_block, per_sm;
};

SmemLimits smem_limits(int device) {
  static SmemLimits cache[kMaxDevices] = {};
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && cache[device].per_block) return cache[device];
  const SmemLimits r{device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, 48 * 1024),
                     device_attribute(device, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 64 * 1024)};
  if (cached) cache[device] = r;
  return r;
}

// Shared memory a GEMV CTA may use on this device and the CTAs per SM that leaves room for.
struct GemvSmem {
  int x_budget, ctas_per_sm;
  bool abs_table;
};

GemvSmem gemv_smem(int device, int64_t m) {
  static GemvSmem cache[kMaxDevices][kGemvMaxM + 1] = {};
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && cache[device][m].ctas_per_sm) return cache[device][m];
  const SmemLimits lim = smem_limits(device);
  GemvSmem r{};
  // Absolute table addressing (no add per lookup) where the padding still leaves the full
  // staging budget (sm_90: 227 KB per block); else relative, with the largest staging budget
  // that keeps kGemvCtasPerSm CTAs resident, or one CTA where that is not possible.
  const int abs_fixed = gemv_smem_bytes(static_cast<int>(m), 0, true);
  if (kGemvCtasPerSm == 1 && lim.per_block - abs_fixed >= kGemvXSmemBytes) {
    r = GemvSmem{kGemvXSmemBytes, 1, true};
  } else {
    const int fixed = gemv_smem_bytes(static_cast<int>(m), 0);
    int budget = std::min(kGemvXSmemBytes, lim.per_sm / kGemvCtasPerSm - kReservedSmem - fixed);
    int ctas = kGemvCtasPerSm;
    if (budget < 4 * gemv_x_tile_bytes(static_cast<int>(m))) {
      budget = std::min(kGemvXSmemBytes, lim.per_block - fixed);
      ctas = 1;
    }
    r = GemvSmem{std::max(budget, 0), ctas, false};
  }
  if (cached) cache[device][m] = r;
  return r;
}

__global__ void cluster_probe_kernel() {}

// CTAs that run at once as clusters of 2..kGemvClusterMax CTAs of one per SM (the GEMV's shared
// memory), by cluster size: the GPCs have different SM counts, so not every SM takes part.
// All zero where clusters are unavailable: before sm_90, or a library without sm_90+ code for
// this device (the cluster instructions would trap).
struct ClusterCtas {
  int ctas[kGemvClusterMax + 1];
};

ClusterCtas cluster_ctas(int device) {
  static ClusterCtas cache[kMaxDevices] = {};
  static bool known[kMaxDevices] = {};
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && known[device]) return cache[device];
  ClusterCtas r{};
  DeviceGuard guard(device);  // the occupancy query asks the current device
  cudaFuncAttributes fa{};
  const SmemLimits lim = smem_limits(device);
  if (guard.error() == cudaSuccess && device_attribute(device, cudaDevAttrComputeCapabilityMajor, 0) >= 9 &&
      cudaFuncGetAttributes(&fa, cluster_probe_kernel) == cudaSuccess && fa.ptxVersion >= 90) {
    // More than half an SM's shared memory per CTA: one CTA per SM, as the GEMV.
    if (2 * lim.per_block > lim.per_sm &&
        cudaFuncSetAttribute(cluster_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lim.per_block) ==
            cudaSuccess) {
      for (int size = 2; size <= kGemvClusterMax; ++size) {
        const KernelLaunch launch(size, kGemvThreads, lim.per_block, nullptr, size);
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, cluster_probe_kernel, &launch.config) == cudaSuccess)
          r.ctas[size] = clusters * size;
      }
    }
  }
  cudaGetLastError();  // a failed query leaves no sticky error behind: clusters are just not used
  if (cached) {
    cache[device] = r;
    known[device] = true;
  }
  return r;
}

// Work split of the GEMV (gemv_kernel.cuh): K is cut into `splits` ranges whose activations
// fit the CTA's staging budget; the persistent grid (a multiple of splits, at most the resident
// CTA slots) gives each range grid / splits CTAs, whose warps take that range's row tiles
// round-robin. Splits sum through a workspace and a second kernel or, where every warp has at
// most one row tile and the device runs clusters, through a thread-block cluster (no workspace,
// no second kernel). Balanced plans (each warp an equal share of its CTA's (row tile, K tile)
// items; one split, K splits through the workspace, or K splits in a cluster) compete with those.
// Every plan is costed in K tiles of its busiest warp plus its x staging and split summing; the
// weights below were fitted to same-session H100 measurements so that every measured shape
// (docs/kernels.md) takes its fastest plan.
constexpr double kWorkspaceSplitCost = 1 / 0.95;  // per K tile, against 1 for a single split
constexpr double kClusterSplitCost = 0.75;  // per K tile: no second kernel, no workspace traffic
// A cluster plan must keep this share of the best workspace plan's CTAs: large weights are
// bandwidth-bound, and fewer SMs cost more than the second kernel saves.
constexpr int kClusterMinCtaPercent = 85;
constexpr double kStagingTilesPerKb = 0.02;  // x a CTA stages before its first multiply
constexpr double kReduceKernelTiles = 3.0;   // the split-K reduce kernel's launch and tail
constexpr double kClusterTileCost = 0.95;
constexpr double kPartialTilesPerMb = 0.25;  // float32 partials written and read back
constexpr int64_t kBalancedMaxSplits = 8;
constexpr double kBalancedSplitMargin = 0.1;  // K-split balanced plans must win by this much
constexpr double kBalancedClusterTiles = 1.7;  // cluster barrier and distributed shared-memory sums

// kbit_set_gemv_plan's mode and splits, -1 and 0 for the cost's choice (tests and benchmarks).
int g_gemv_mode = -1, g_gemv_splits = 0;

GemvPlan plan_gemv(int64_t m, int64_t n, int64_t k, int sms, const GemvSmem& smem, const ClusterCtas& clusters) {
  // A forced plan (kbit_set_gemv_plan) takes only candidates of its mode and splits, whatever they cost.
  const bool forced = g_gemv_mode >= 0;
  const auto wanted = [&](int mode, int64_t splits) {
    return !forced || (mode == g_gemv_mode && (g_gemv_splits == 0 || splits == g_gemv_splits));
  };
  const int64_t k_tiles = ceil_div(k, kTileK), n_tiles = ceil_div(n, kTileN);
  const int64_t slots = static_cast<int64_t>(sms) * smem.ctas_per_sm;
  const int64_t x_tile = gemv_x_tile_bytes(static_cast<int>(m));
  const int64_t max_chunk = std::max<int64_t>(1, smem.x_budget / x_tile);
  const int64_t min_splits = ceil_div(k_tiles, max_chunk);
  GemvPlan best{}, best_cluster{};
  double best_cost = 0.0, best_cluster_cost = 0.0;
  const auto consider = [&](GemvPlan& into, double& into_cost, int64_t splits, int64_t chunk, int64_t per_split,
                            double weight, bool cluster) {
    const double cost = static_cast<double>(ceil_div(n_tiles, per_split * kGemvWarps) * chunk) * weight;
    if (!wanted(cluster ? 1 : 0, splits) || (into.splits != 0 && cost >= into_cost - 1e-9)) return;
    into_cost = cost;
    into.splits = static_cast<int>(splits);
    into.chunk_kt = static_cast<int>(chunk);
    into.cluster = cluster;
    // No more CTAs per split than it has row tiles for.
    into.grid = static_cast<int>(std::min<int64_t>(per_split, ceil_div(n_tiles, kGemvWarps)) * splits);
  };
  for (int64_t splits = min_splits; splits <= std::max<int64_t>(min_splits, std::min<int64_t>(k_tiles, 64)); ++splits) {
    const int64_t chunk = ceil_div(k_tiles, splits);
    if (ceil_div(k_tiles, chunk) != splits || chunk > max_chunk) continue;  // an empty split / too much x
    consider(best, best_cost, splits, chunk, std::max<int64_t>(1, slots / splits),
             splits == 1 ? 1.0 : kWorkspaceSplitCost, false);
    const int64_t per_cluster = splits > 1 && splits <= kGemvClusterMax ? clusters.ctas[splits] / splits : 0;
    if (per_cluster > 0 && smem.ctas_per_sm == 1 && n_tiles <= per_cluster * kGemvWarps &&
        chunk * x_tile + gemv_cluster_bytes(static_cast<int>(m), static_cast<int>(splits)) <= smem.x_budget)
      consider(best_cluster, best_cluster_cost, splits, chunk, per_cluster, kClusterSplitCost, true);
  }
  if (forced && g_gemv_mode <= 1) return g_gemv_mode == 1 ? best_cluster : best;
  if (best_cluster.splits != 0 && best_cluster_cost < best_cost - 1e-9 &&
      best_cluster.grid * 100 >= kClusterMinCtaPercent * best.grid)
    best = best_cluster;
  const auto cost = [&](double tiles, int64_t chunk) {
    return tiles + kStagingTilesPerKb * static_cast<double>(chunk * x_tile) / 1024;
  };
  // The reduce kernel, and the float32 partials it reads back.
  const auto sum_splits = [&](int64_t splits) {
    return splits > 1 ? kReduceKernelTiles + kPartialTilesPerMb * static_cast<double>(splits * m * n * 4) / (1 << 20)
                      : 0.0;
  };
  double chosen = std::numeric_limits<double>::infinity();
  if (forced) {
    best = GemvPlan{};
  } else {
    const int64_t per_split = best.grid / best.splits;
    const double tiles = static_cast<double>(ceil_div(n_tiles, per_split * kGemvWarps) * best.chunk_kt);
    chosen = best.cluster ? cost(kClusterTileCost * tiles, best.chunk_kt)
                          : cost(tiles, best.chunk_kt) + sum_splits(best.splits);
  }
  const auto take_balanced = [&](double c, int64_t splits, int64_t chunk, int64_t ctas_per_split, bool cluster) {
    chosen = c;
    best = GemvPlan{};
    best.splits = static_cast<int>(splits);
    best.chunk_kt = static_cast<int>(chunk);
    best.grid = static_cast<int>(ctas_per_split * splits);
    best.balanced = true;
    best.cluster = cluster;
  };
  for (int64_t splits = min_splits; splits <= std::min<int64_t>(k_tiles, kBalancedMaxSplits); ++splits) {
    const int64_t chunk = ceil_div(k_tiles, splits);
    if (ceil_div(k_tiles, chunk) != splits || chunk > max_chunk) continue;
    const int64_t ctas = std::min(slots / splits, n_tiles);  // per split
    const double c = cost(static_cast<double>(ceil_div(ceil_div(n_tiles, ctas) * chunk, kGemvWarps)), chunk) +
                     sum_splits(splits);
    if (wanted(2, splits) && c < chosen - (splits > 1 ? kBalancedSplitMargin : 0.0) - 1e-9)
      take_balanced(c, splits, chunk, ctas, false);
  }
  // Balanced cluster plans: the K splits of a row range sum through distributed shared memory.
  for (int64_t splits = std::max<int64_t>(2, min_splits);
       (forced || best.splits > 1) && splits <= std::min<int64_t>(k_tiles, kGemvClusterMax); ++splits) {
    const int64_t chunk = ceil_div(k_tiles, splits);
    if (ceil_div(k_tiles, chunk) != splits || chunk > max_chunk || smem.ctas_per_sm != 1) continue;
    const int64_t ctas = std::min<int64_t>(clusters.ctas[splits] / splits, n_tiles);  // per split
    if (ctas < 1) continue;
    const int64_t rows = ceil_div(n_tiles, ctas);
    const int recv_slots = gemv_balanced_cluster_slots(static_cast<int>(splits), static_cast<int>(rows));
    if (chunk * x_tile + gemv_slot_bytes(static_cast<int>(m), recv_slots) > smem.x_budget) continue;
    const double c = cost(static_cast<double>(ceil_div(rows * chunk, kGemvWarps)), chunk) + kBalancedClusterTiles;
    if (wanted(3, splits) && c < chosen - 1e-9) take_balanced(c, splits, chunk, ctas, true);
  }
  return best;
}

// The GEMV plan for this problem on `device`.
GemvPlan device_gemv_plan(int device, int64_t m, int64_t n, int64_t k) {
  const GemvSmem smem = gemv_smem(device, m);
  GemvPlan plan = plan_gemv(m, n, k, sm_count(device), smem, cluster_ctas(device));
  plan.abs_table = smem.abs_table;
  return plan;
}

// The GEMV plan with the GLU epilogue (MmParams::glu): balanced, one split, each CTA whole pairs of row tiles
// (a gate tile and its up tile), the table at its absolute address; splits 0 where there is none (K too long to
// stage at once, or a GPU without the absolute table).
GemvPlan glu_gemv_plan(int device, int64_t m, int64_t n, int64_t k) {
  const GemvSmem smem = gemv_smem(device, m);
  const int64_t k_tiles = ceil_div(k, kTileK), pairs = ceil_div(n, kTileN) / 2;
  const int64_t ctas = std::min<int64_t>(static_cast<int64_t>(sm_count(device)) * smem.ctas_per_sm, pairs);
  GemvPlan plan{};
  if (!smem.abs_table || ctas < 1) return plan;
  const int slots = gemv_glu_slots(static_cast<int>(pairs / ctas));
  if (k_tiles * gemv_x_tile_bytes(static_cast<int>(m)) + gemv_slot_bytes(static_cast<int>(m), slots) > smem.x_budget)
    return plan;
  plan.splits = 1;
  plan.chunk_kt = static_cast<int>(k_tiles);
  plan.grid = static_cast<int>(ctas);
  plan.balanced = true;
  plan.abs_table = true;
  return plan;
}

// mma token tiles of the GEMV: one serves 8 tokens.
int gemv_tiles(int64_t m) { return m <= 8 ? 1 : 2; }

// The GEMM kernels, by the planner's codes (crossovers.json's "mm" keys, hf_kbit.backends.crossovers):
// the mma.sync GEMM (any sm_80+), the wgmma GEMM (sm_90a: the default there) and the warp-specialized
// wgmma GEMM (sm_90a, HF_KBIT_GEMM_KERNEL=wgmma_ws).
enum GemmKernel : int { kGemmMma = 0, kGemmWgmma = 1, kGemmWgmmaWs = 2, kNumGemmKernels = 3 };
constexpr const char* kGemmKernelNames[] = {"mma.sync", "wgmma", "wgmma_ws"};
constexpr KernelId kGemmKernelIds[] = {kGemm, kWgmmaGemm, kWgmmaWsGemm};

// GEMM plans: the wgmma GEMM (wgmma_kernel.cuh: 64 NB tokens x 128 rows per CTA) and the
// mma.sync GEMM (gemm_kernel.cuh: 8 NT tokens x 256 rows); grid (token blocks, row blocks, K
// splits). Splits are added only while the CTAs do not fill the GPU: the split whose waves are
// fullest wins, and a split-K plan (a workspace write, read and a second kernel) must be 3%
// better. Every split keeps >= 4 K tiles so that the pipelines fill. The warp-specialized GEMM
// (wgmma_ws_kernel.cuh) has a plan of its own (plan_wgmma_ws).
struct GemmPlan {
  int kernel;  // GemmKernel
  int tile;    // NT (mma.sync GEMM) or NB (wgmma GEMMs)
  int splits, chunk_kt, smem;
  dim3 grid;
  // wgmma: x rewritten into the stage layout; wgmma_ws: x at a 16-byte row pitch (K % 8 != 0) or a
  // rotated layer's x R, for its tensor map; mma.sync with a rotated weight: x R (rotation.cuh, the
  // standalone rotation) for the GEMM to read. At the head of the workspace.
  int64_t x_perm_floats;

  int64_t workspace(int64_t m, int64_t n) const { return x_perm_floats + (splits > 1 ? int64_t{splits} * m * n : 0); }
};

int gemm_nt(int64_t m) { return m <= 16 ? 2 : m <= 32 ? 4 : m <= 64 ? 8 : 16; }

// The warp-specialized GEMM: persistent CTAs over tiles of 128 rows x 64 NB tokens x one of `splits` K
// ranges; NB and splits by a cost in cycles of the busiest CTA: its tiles (rounds of tiles over the SMs)
// x (K tiles per tile x a K tile's cycles + a tile's fill and epilogue), plus a split-K plan's partials
// written, reduced and read; the larger token block on a tie (fewer weight reads). A K tile's cycles are
// a fixed part (the operand feed and the decode, whatever NB) and a part per 64 tokens, fitted to H200
// timings of every plan (set_wgmma_ws_plan) on the Llama-3-8B/70B shapes at M = 32..4096, k = 4: the
// model's plan is the fastest measured in 29 of 30 cells and 2% off in the other. Refit after a change to
// the feed or the decode (time every plan with set_wgmma_ws_plan).
constexpr double kWsStepPerNb = 460.0;
constexpr double kWsStepFixed = 1150.0;
constexpr double kWsTileFixed = 1500.0;         // first loads' latency and the epilogue's stores
constexpr double kSplitBytesPerCycle = 1700.0;  // chip-wide HBM bytes per SM cycle
constexpr double kSplitFixed = 3000.0;          // the reduce kernel's launch and tail

// kbit_set_wgmma_ws_plan's token block (NB) and splits, 0 for the cost's choice (tests and benchmarks).
int g_ws_nb = 0, g_ws_splits = 0;

GemmPlan plan_wgmma_ws(int64_t m, int64_t n, int64_t k, int bits, int sms, bool rotated) {
  GemmPlan plan{};
  plan.kernel = kGemmWgmmaWs;
  const int64_t k_tiles = ceil_div(k, kTileK), row_blocks = ceil_div(n, kWsRows);
  double best = -1.0;
  for (const int nb : kWsNbs) {
    if (g_ws_nb ? nb != g_ws_nb : nb > 1 && m <= int64_t{nb / 2} * kWgmmaTokens) continue;  // a smaller block covers m
    const int64_t tiles = ceil_div(m, int64_t{nb} * kWgmmaTokens) * row_blocks;
    const double step = kWsStepFixed + kWsStepPerNb * nb;
    for (int64_t splits = 1; splits <= 8; ++splits) {
      const int64_t chunk = ceil_div(k_tiles, splits);
      if (g_ws_splits ? splits != std::min<int64_t>(g_ws_splits, k_tiles)
                      : ceil_div(k_tiles, chunk) != splits || (splits > 1 && chunk < 4))
        continue;
      const double rounds = static_cast<double>(ceil_div(tiles * splits, sms));
      double cost = rounds * (static_cast<double>(chunk) * step + kWsTileFixed);
      if (splits > 1)
        cost += kSplitFixed + static_cast<double>(splits * m * n * 8 + m * n * 2) / kSplitBytesPerCycle;
      if (best < 0.0 || cost <= best * (1.0 + 1e-9)) {
        best = cost;
        plan.tile = nb;
        plan.splits = static_cast<int>(splits);
        plan.chunk_kt = static_cast<int>(chunk);
        plan.grid = dim3(static_cast<unsigned>(std::min<int64_t>(tiles * splits, sms)));
      }
      if (!g_ws_splits && tiles * splits >= sms) break;  // the GPU is full: more splits only add traffic
    }
  }
  plan.smem = ws_smem_bytes(bits, plan.tile);
  plan.x_perm_floats = rotated || k % 8 != 0 ? ceil_div(m * ceil_div(k, 8) * 8 * 2, 16) * 4 : 0;
  return plan;
}

GemmPlan plan_gemm(int64_t m, int64_t n, int64_t k, int bits, int sms, int kernel, bool rotated) {
  if (kernel == kGemmWgmmaWs) return plan_wgmma_ws(m, n, k, bits, sms, rotated);
  const bool wgmma = kernel == kGemmWgmma;
  GemmPlan plan{};
  plan.kernel = kernel;
  plan.tile = wgmma ? wgmma_nb(m) : gemm_nt(m);
  const int64_t block_m = wgmma ? int64_t{plan.tile} * kWgmmaTokens : gemm_block_m(plan.tile);
  const int64_t token_blocks = ceil_div(m, block_m), row_blocks = ceil_div(n, wgmma ? kWgmmaRows : kGemmRows);
  const int64_t k_tiles = ceil_div(k, kTileK), ctas = token_blocks * row_blocks;
  const int64_t slots = int64_t{sms} * (wgmma ? wgmma_ctas_per_sm(plan.tile) : 1);
  plan.splits = 1;
  plan.chunk_kt = static_cast<int>(k_tiles);
  double best = -1.0;
  for (int64_t splits = 1; splits <= 8; ++splits) {
    const int64_t chunk = ceil_div(k_tiles, splits);
    if (ceil_div(k_tiles, chunk) != splits || (splits > 1 && chunk < 4)) continue;
    const int64_t total = ctas * splits;
    const double score = static_cast<double>(total) / static_cast<double>(ceil_div(total, slots) * slots) *
                         (splits > 1 ? 0.97 : 1.0);
    if (score > best + 1e-9) {
      best = score;
      plan.splits = static_cast<int>(splits);
      plan.chunk_kt = static_cast<int>(chunk);
    }
    if (total >= slots) break;  // the GPU is full: more splits only add workspace traffic
  }
  plan.grid = dim3(static_cast<unsigned>(token_blocks), static_cast<unsigned>(row_blocks),
                   static_cast<unsigned>(plan.splits));
  plan.smem = wgmma ? wgmma_smem_bytes(plan.tile) : gemm_smem_bytes(bits, plan.tile);
  // x R in 16-bit (the GEMM's dtypes), a whole number of 16-byte units so the partials stay aligned.
  plan.x_perm_floats = wgmma ? token_blocks * k_tiles * (wgmma_stage_bytes(plan.tile) / 4)
                       : rotated ? ceil_div(m * k * 2, 16) * 4 : 0;
  return plan;
}

// Static shared memory of this kernel: 2 KB where the device code holds sm_90a instructions
// (wgmma), 1 KB elsewhere. The host reads it with cudaFuncGetAttributes (no launch).
__global__ void wgmma_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kWords = 512;
#else
  constexpr int kWords = 256;
#endif
  __shared__ int s[kWords];
  s[threadIdx.x % kWords] = static_cast<int>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % kWords];
}

// kbit_set_gemm_kernel's choice (GemmKernel), -1 for the environment's.
int g_gemm_kernel = -1;

// kbit_set_gemm_kernel's choice, else HF_KBIT_GEMM_KERNEL, read once: "mma" (the mma.sync GEMM that GPUs
// before sm_90 run, so that an H100 can test it and measure its crossovers), "wgmma_ws" (the
// warp-specialized GEMM on sm_90a), or unset / anything else (the default).
int requested_gemm_kernel() {
  if (g_gemm_kernel >= 0) return g_gemm_kernel;
  static const int requested = [] {
    const char* v = std::getenv("HF_KBIT_GEMM_KERNEL");
    return !v ? kGemmWgmma : std::strcmp(v, "mma") == 0 ? kGemmMma : std::strcmp(v, "wgmma_ws") == 0 ? kGemmWgmmaWs
                                                                                                      : kGemmWgmma;
  }();
  return requested;
}

// Whether `device` is an sm_90 GPU the library holds sm_90a code for (the wgmma GEMMs).
bool has_wgmma(int device) {
  static int cache[kMaxDevices] = {0};  // 0: not asked yet, 1: no, 2: yes
  if (device < 0 || device >= kMaxDevices) return false;
  if (cache[device] == 0) {
    int major = 0, minor = -1;
    bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
              cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
              major == 9 && minor == 0;
    if (ok) {
      DeviceGuard guard(device);
      cudaFuncAttributes attr{};
      ok = guard.error() == cudaSuccess && cudaFuncGetAttributes(&attr, wgmma_probe_kernel) == cudaSuccess &&
           attr.sharedSizeBytes >= 2048;
    }
    cache[device] = ok ? 2 : 1;
  }
  return cache[device] == 2;
}

// The GEMM kernel of `device`: on sm_90a the wgmma GEMM, or the one HF_KBIT_GEMM_KERNEL asks for; the
// mma.sync GEMM elsewhere.
int gemm_kernel(int device) {
  const int requested = requested_gemm_kernel();
  return requested == kGemmMma || !has_wgmma(device) ? kGemmMma : requested;
}

GemmPlan device_gemm_plan(int device, int64_t m, int64_t n, int64_t k, int bits, bool rotated) {
  int kernel = gemm_kernel(device);
  // The wgmma GEMM indexes tiles in 32 bits (as the GEMV): larger weights take the mma.sync GEMM.
  if (kernel == kGemmWgmma && ceil_div(n, kTileN) * ceil_div(k, kTileK) * bits * 64 >= (int64_t{1} << 31))
    kernel = kGemmMma;
  return plan_gemm(m, n, k, bits, sm_count(device), kernel, rotated);
}

// Measured path crossovers (kbit_set_mm_crossovers), by GEMM kernel (GemmKernel) and bits.
constexpr int kMaxPlanBits = 8;
constexpr int kMaxWeightClasses = 8;
enum MmPath : int { kPathGemv = 0, kPathGemm = 1, kPathDequant = 2 };
struct MmCrossovers {
  int gemv_max_m, classes;  // classes == 0: not set
  int64_t min_weight[kMaxWeightClasses], gemm_max_m[kMaxWeightClasses];
};
MmCrossovers g_crossovers[kNumGemmKernels][kMaxPlanBits + 1] = {};

// The GEMM plans (no dtype yet) take the bit widths the GEMM has for some dtype.
bool gemm_has_bits(int bits) { return in_kernel_table(kGemm, bits, kFloat16) || in_kernel_table(kGemm, bits, kBFloat16); }

// Rotated layers (rot_signs given): K a multiple of kRotMultiple (kbit_params.h, rotation.cuh).
int check_rotation(const uint32_t* rot_signs, int64_t k) {
  if (!rot_signs) return KBIT_OK;
  if (k % kRotMultiple != 0)
    return fail("rot_signs given for in_features=%lld: rotated layers need in_features %% %d == 0",
                static_cast<long long>(k), kRotMultiple);
  if (!aligned(rot_signs, 4)) return fail("rot_signs must be 4-byte aligned (int32 words)");
  return KBIT_OK;
}

// Rotated GEMV crossover (kbit_set_gemv_rotate_crossover), by bits: a rotated layer's GEMV stages x R
// itself up to this M (every CTA rotates its split of x: cost grows with M), above it the standalone
// rotation writes x R into the workspace's head first (one extra dependent kernel). 0 until set: the
// standalone rotation everywhere.
int g_rotate_staging_max_m[kMaxPlanBits + 1] = {};

// x R for the GEMV at the workspace's head: 16-bit elements in whole 16-byte units (float4), so that
// the split-K partials after it stay aligned.
int64_t rotated_x_floats(int64_t m, int64_t k) { return ceil_div(m * k * 2, 16) * 4; }

// How a rotated layer's GEMV of m rows runs (kbit_gemv_rotate_plan): the rotated instantiation, which
// stages x R (a prologue must: its output exists only in the staging), where the kernel table has one
// for m and, without a prologue, m is within the crossover; else the standalone rotation, then the
// unrotated GEMV on x R (kGemvRotateNone: a prologue beyond the rotated instantiations).
enum GemvRotate : int { kGemvRotateStandalone = 0, kGemvRotateStaging = 1, kGemvRotateNone = -1 };
GemvRotate gemv_rotate_mode(int bits, int dtype, int64_t m, bool prologue) {
  const bool staged = find_gemv(bits, dtype, gemv_tiles(m), true) != nullptr;
  if (prologue) return staged ? kGemvRotateStaging : kGemvRotateNone;
  const int max_m = bits >= 0 && bits <= kMaxPlanBits ? g_rotate_staging_max_m[bits] : 0;
  return staged && m <= max_m ? kGemvRotateStaging : kGemvRotateStandalone;
}

int check_common(KernelId kernel, int bits, int dtype, int64_t n, int64_t k) {
  if (dtype < kFloat32 || dtype > kBFloat16) return fail("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16), got %d", dtype);
  if (!in_kernel_table(kernel, bits, dtype)) return unsupported(kernel, bits, dtype);
  if (n < 0 || k < 0) return fail("shape must be non-negative, got n=%lld k=%lld", static_cast<long long>(n), static_cast<long long>(k));
  return KBIT_OK;
}

// kbit_dequantize and kbit_dequantize_records (`records`: block_scales points at int16 block records).
int dequantize_call(int device, void* stream, const int32_t* planes, const uint8_t* block_scales,
                    const float* row_scales, const float* codebook, int64_t codebook_stride, int bits, int64_t batch,
                    int64_t n, int64_t k, void* out, int dtype, const uint32_t* rot_signs, bool records) {
  if (int rc = check_common(kDequantize, bits, dtype, n, k)) return rc;
  if (int rc = check_rotation(rot_signs, k)) return rc;
  if (batch < 0 || batch > 65535) return fail("batch must be in [0, 65535], got %lld", static_cast<long long>(batch));
  if (codebook_stride != 0 && codebook_stride != (1 << bits))
    return fail("codebook_stride must be 0 or %d, got %lld", 1 << bits, static_cast<long long>(codebook_stride));
  if (!planes || !block_scales || !row_scales || !codebook || (batch * n * k > 0 && !out))
    return fail("planes, block_scales, row_scales, codebook and out must be device pointers");
  if (batch * n * k == 0) return KBIT_OK;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");
  DequantizeParams p{planes, block_scales, row_scales, codebook, out, batch, n, k, codebook_stride, bits, dtype,
                     rot_signs, records};
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = find_dequantize(bits, dtype)(p, s);
  return err == cudaSuccess ? KBIT_OK
                            : cuda_fail(err, records ? "kbit_dequantize_records launch" : "kbit_dequantize launch");
}

}  // namespace

extern "C" {

int kbit_abi_version(void) { return kAbiVersion; }

const char* kbit_last_error(void) { return g_error; }

int kbit_gemv_max_m(void) { return kGemvMaxM; }

int kbit_kernel_table_size(void) { return kKernelTableSize; }

int kbit_kernel_table_entry(int i, const char** kernel, int* bits, int* dtype) {
  if (!kernel || !bits || !dtype) return fail("kernel, bits and dtype must be host pointers");
  if (i < 0 || i >= kKernelTableSize) return fail("entry %d is outside the table's %d", i, kKernelTableSize);
  *kernel = kKernelNames[kKernelTable[i].kernel];
  *bits = kKernelTable[i].bits;
  *dtype = kKernelTable[i].dtype;
  return KBIT_OK;
}

int kbit_quantize(int device, void* stream, const void* weight, int dtype, const float* codebook, int bits,
                  int64_t batch, int64_t n, int64_t k, int32_t* planes, uint8_t* block_scales, float* row_scales) {
  if (int rc = check_common(kQuantize, bits, dtype, n, k)) return rc;
  if (batch < 0) return fail("batch must be non-negative, got %lld", static_cast<long long>(batch));
  if (batch * n * k > 0 && !weight) return fail("weight is a null pointer");
  if (!codebook || !planes || !block_scales || (batch * n > 0 && !row_scales))
    return fail("codebook, planes, block_scales and row_scales must be device pointers");
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");
  QuantizeParams p{weight, codebook, planes, block_scales, row_scales, batch, n, k, bits, dtype};
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = find_quantize(bits, dtype)(p, s);
  return err == cudaSuccess ? KBIT_OK : cuda_fail(err, "kbit_quantize launch");
}

int kbit_dequantize(int device, void* stream, const int32_t* planes, const uint8_t* block_scales,
                    const float* row_scales, const float* codebook, int64_t codebook_stride, int bits, int64_t batch,
                    int64_t n, int64_t k, void* out, int dtype, const uint32_t* rot_signs) {
  return dequantize_call(device, stream, planes, block_scales, row_scales, codebook, codebook_stride, bits, batch, n, k,
                         out, dtype, rot_signs, false);
}

int kbit_dequantize_records(int device, void* stream, const int32_t* planes, const int16_t* block_records,
                            const float* row_scales, const float* codebook, int64_t codebook_stride, int bits,
                            int64_t batch, int64_t n, int64_t k, void* out, int dtype) {
  if (!aligned(block_records, 2)) return fail("block_records must be 2-byte aligned (int16)");
  return dequantize_call(device, stream, planes, reinterpret_cast<const uint8_t*>(block_records), row_scales, codebook,
                         codebook_stride, bits, batch, n, k, out, dtype, nullptr, true);
}

int kbit_rotate(int device, void* stream, const void* x, int64_t x_stride, int dtype, int64_t m, int64_t k,
                const uint32_t* rot_signs, int inverse, void* out) {
  if (dtype < kFloat32 || dtype > kBFloat16) return fail("dtype code must be 0, 1 or 2, got %d", dtype);
  if (m < 0 || k < 0) return fail("shape must be non-negative, got m=%lld k=%lld", static_cast<long long>(m),
                                  static_cast<long long>(k));
  if (!rot_signs) return fail("rot_signs must be a device pointer");
  if (int rc = check_rotation(rot_signs, k)) return rc;
  if (m * k == 0) return KBIT_OK;
  if (!x || !out) return fail("x and out must be device pointers");
  if (m > 1 && x_stride < k)
    return fail("x_stride (%lld) must be at least in_features (%lld)", static_cast<long long>(x_stride),
                static_cast<long long>(k));
  if (!aligned(out, 16)) return fail("out must be 16-byte aligned");
  if (inverse != 0 && inverse != 1) return fail("inverse must be 0 (x R) or 1 (x R^T), got %d", inverse);
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");
  const RotateParams p{x, out, rot_signs, m, k, m > 1 ? x_stride : k, dtype, inverse};
  cudaError_t err = find_rotate(dtype)(p, static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? KBIT_OK : cuda_fail(err, "kbit_rotate launch");
}

int64_t kbit_gemv_workspace_size(int device, int64_t m, int64_t n, int64_t k, int bits, int rotated) {
  (void)bits;
  if (m <= 0 || n <= 0 || k <= 0 || m > kGemvMaxM) return 0;
  // Rotated: room for x R too, whichever way the call rotates (a few KB: m <= 16).
  return device_gemv_plan(device, m, n, k).workspace(m, n) + (rotated ? rotated_x_floats(m, k) : 0);
}

int kbit_set_gemv_rotate_crossover(int bits, int in_staging_max_m) {
  if (bits < 0 || bits > kMaxPlanBits) return fail("bits must be in 0..%d, got %d", kMaxPlanBits, bits);
  if (in_staging_max_m < 0) return fail("in_staging_max_m must be >= 0, got %d", in_staging_max_m);
  g_rotate_staging_max_m[bits] = in_staging_max_m;
  return KBIT_OK;
}

int kbit_gemv_rotate_plan(int bits, int dtype, int64_t m, int prologue, int* mode) {
  if (!mode) return fail("mode must be a host pointer");
  if (m < 1 || m > kGemvMaxM) return fail("m must be in 1..%d, got %lld", kGemvMaxM, static_cast<long long>(m));
  if (dtype < kFloat32 || dtype > kBFloat16) return fail("dtype code must be 0, 1 or 2, got %d", dtype);
  *mode = gemv_rotate_mode(bits, dtype, m, prologue != 0);
  return KBIT_OK;
}

}  // extern "C"

namespace {

// The weight and problem of a GEMV or GEMM call; x, out and workspace are set per launch.
MmParams mm_params(int dtype, const int32_t* planes, const uint8_t* block_scales, const float* row_scales,
                   const float* codebook, int bits, int64_t m, int64_t n, int64_t k, int splits, int chunk_kt) {
  MmParams p{};
  p.planes = planes;
  p.block_scales = block_scales;
  p.row_scales = row_scales;
  p.codebook = codebook;
  p.m = m;
  p.n = n;
  p.k = k;
  p.bits = bits;
  p.dtype = dtype;
  p.splits = splits;
  p.chunk_kt = chunk_kt;
  return p;
}

// The fields every grouped call fills (kbit_grouped_gemv, kbit_grouped_gemm).
GroupedParams grouped_params(const void* x, int dtype, const int64_t* order, const int64_t* offsets,
                             const int32_t* planes, const uint8_t* block_scales, const float* row_scales,
                             const float* codebook, int bits, int64_t s, int64_t e, int64_t n, int64_t k, void* out) {
  GroupedParams p{};
  p.x = x;
  p.order = order;
  p.offsets = offsets;
  p.planes = planes;
  p.block_scales = block_scales;
  p.row_scales = row_scales;
  p.codebook = codebook;
  p.out = out;
  p.s = s;
  p.e = e;
  p.n = n;
  p.k = k;
  p.bits = bits;
  p.dtype = dtype;
  p.x_repeat = 1;
  return p;
}

#if KBIT_TRACE
unsigned long long* g_trace = nullptr;  // kbit_trace_set: every GEMV launch records into it
#endif

struct GemvCall {
  int device;
  int grid;
  GemvLaunch launch;
  // A rotated layer's call above its in-staging crossover: the standalone rotation writes x R into the
  // workspace's head (xr_floats), which the unrotated GEMV then reads as its x (its programmatic
  // dependent: the weight's first tiles load while the rotation runs).
  RotateLaunch rotate;
  int64_t xr_floats;
  MmParams p;
};

// Checks of the weight and the problem shared by kbit_gemv, kbit_gemv_prologue, kbit_gemv_prepare and their
// block-records forms (`offsets`: block_scales points at int16 records; unrotated: their callers pass no
// rot_signs); fills the call.
int gemv_setup(int device, int dtype, const int32_t* planes, const uint8_t* block_scales, const float* row_scales,
               const float* codebook, int bits, int64_t m, int64_t n, int64_t k, const uint32_t* rot_signs,
               bool prologue, GemvCall* call, int64_t* need, bool offsets = false, bool glu = false) {
  if (int rc = check_common(kGemv, bits, dtype, n, k)) return rc;
  if (int rc = check_rotation(rot_signs, k)) return rc;
  if (m < 1 || m > kGemvMaxM) return fail("x has %lld rows, the GEMV takes 1..%d", static_cast<long long>(m), kGemvMaxM);
  if (k == 0) return fail("in_features must be positive (an empty product is all zeros: handle it before the call)");
  if (n > 0 && (!planes || !block_scales || !row_scales || !codebook))
    return fail("planes, block_scales, row_scales and codebook must be device pointers");
  if (!aligned(planes, 16)) return fail("planes must be 16-byte aligned");
  if (offsets ? !aligned(block_scales, 2) : !aligned(block_scales, 4))
    return fail(offsets ? "block_records must be 2-byte aligned (int16)" : "block_scales must be 4-byte aligned");
  if (ceil_div(n, kTileN) * ceil_div(k, kTileK) * bits * 64 >= (int64_t{1} << 31))
    return fail("weight of %lld x %lld is too large for the GEMV's 32-bit tile indexing", static_cast<long long>(n),
                static_cast<long long>(k));
  if (glu && (!offsets || rot_signs || n % (2 * kTileN) != 0))
    return fail("the GLU epilogue takes unrotated block records with out_features a multiple of %d, got %sn=%lld",
                2 * kTileN, !offsets ? "uint8 codes, " : rot_signs ? "a rotated layer, " : "", static_cast<long long>(n));
  const GemvPlan plan = glu ? glu_gemv_plan(device, m, n, k) : device_gemv_plan(device, m, n, k);
  if (plan.splits == 0 && glu)
    return fail("the GLU epilogue has no plan for m=%lld n=%lld k=%lld on device %d (kbit_gemv_glu_serves)",
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), device);
  if (plan.splits == 0)
    return fail("kbit_set_gemv_plan's mode %d with %d splits has no plan for m=%lld n=%lld k=%lld", g_gemv_mode,
                g_gemv_splits, static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k));
  const GemvRotate rotate = rot_signs ? gemv_rotate_mode(bits, dtype, m, prologue) : kGemvRotateStaging;
  if (rotate == kGemvRotateNone)
    return fail("a rotated layer's GEMV with a prologue takes m <= 8 (the rotated instantiations), got m=%lld: "
                "run the prologue, then kbit_gemv", static_cast<long long>(m));
  call->rotate = rotate == kGemvRotateStandalone ? find_rotate(dtype) : nullptr;
  call->xr_floats = call->rotate ? rotated_x_floats(m, k) : 0;
  *need = plan.workspace(m, n) + call->xr_floats;
  MmParams& p = call->p;
  p = mm_params(dtype, planes, block_scales, row_scales, codebook, bits, m, n, k, plan.splits, plan.chunk_kt);
  p.abs_table = plan.abs_table;
  p.cluster = plan.cluster;
  p.balanced = plan.balanced;
  p.cta_rows = plan.balanced ? static_cast<int>(ceil_div(n, kTileN) / (plan.grid / plan.splits)) : 0;
  if (glu) p.cta_rows = static_cast<int>(n / (2 * kTileN) / plan.grid);  // pairs of row tiles
  p.glu = glu;
  p.rot_signs = rot_signs;
  call->device = device;
  call->grid = plan.grid;
  if (offsets) {
    call->launch = find_gemv_offsets(bits, dtype, gemv_tiles(m));
    if (!call->launch)
      return fail("block records: the library has no offsets GEMV for bits=%d, dtype=%s at m=%lld "
                  "(kbit_gemv_offsets_max_m): dequantize them instead", bits, kDTypeNames[dtype],
                  static_cast<long long>(m));
    return KBIT_OK;
  }
  call->launch = find_gemv(bits, dtype, gemv_tiles(m), rot_signs && !call->rotate);
  return call->launch ? KBIT_OK : unsupported(kGemv, bits, dtype);
}

// The caller's workspace against what the call's plan needs (gemv_setup).
int check_gemv_workspace(int64_t need, const float* workspace, int64_t workspace_size) {
  if (workspace_size < need || (need > 0 && !workspace))
    return fail("workspace has %lld floats, this problem needs %lld (kbit_gemv_workspace_size)",
                static_cast<long long>(workspace_size), static_cast<long long>(need));
  return KBIT_OK;
}

int gemv_launch(const GemvCall& call, const void* x, void* out, float* workspace, void* stream) {
  if (call.p.n == 0) return KBIT_OK;
  MmParams p = call.p;
  p.x = x;
  p.out = out;
  p.workspace = workspace;
#if KBIT_TRACE
  p.trace = g_trace;
#endif
  DeviceGuard guard(call.device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");
  const auto s = static_cast<cudaStream_t>(stream);
  if (call.rotate) {  // x (contiguous: no prologue here) -> x R at the workspace's head
    const RotateParams r{x, workspace, p.rot_signs, p.m, p.k, p.k, p.dtype, 0};
    cudaError_t err = call.rotate(r, s);
    if (err != cudaSuccess) return cuda_fail(err, "kbit_gemv launch (rotation)");
    p.x = workspace;
    p.workspace = workspace + call.xr_floats;
    p.rot_signs = nullptr;
  }
  cudaError_t err = call.launch(p, call.grid, s);
  return err == cudaSuccess ? KBIT_OK : cuda_fail(err, "kbit_gemv launch");
}

// kbit_gemv_prologue and kbit_gemv_prologue_offsets (`offsets`: block_scales points at int16 block records;
// unrotated, rot_signs null).
int gemv_prologue_call(int device, void* stream, int prologue, const void* x, int64_t x_stride, const void* x2,
                       int64_t x2_stride, const void* norm_weight, float eps, void* sum_out, int dtype,
                       const int32_t* planes, const uint8_t* block_scales, const float* row_scales,
                       const float* codebook, int bits, int64_t m, int64_t n, int64_t k, void* out, float* workspace,
                       int64_t workspace_size, const uint32_t* rot_signs, bool offsets) {
  const bool glu = (prologue & kGemvGlu) != 0;
  prologue &= ~kGemvGlu;
  if (prologue < kPrologueSiluMul || prologue > kPrologueAddNorm)
    return fail("prologue must be 1 (silu_mul), 2 (rmsnorm) or 3 (add_rmsnorm), with or without kGemvGlu (%d), got %d",
                kGemvGlu, prologue | (glu ? kGemvGlu : 0));
  GemvCall call{};
  int64_t need = 0;
  if (int rc = gemv_setup(device, dtype, planes, block_scales, row_scales, codebook, bits, m, n, k, rot_signs, true,
                          &call, &need, offsets, glu))
    return rc;
  if (n == 0) return KBIT_OK;
  const bool uses_x2 = prologue != kPrologueNorm, norm = prologue != kPrologueSiluMul;
  if (!x || !out || (uses_x2 && !x2)) return fail("x, out%s must be device pointers", uses_x2 ? " and x2" : "");
  if (norm && !norm_weight) return fail("norm_weight must be a device pointer for the rmsnorm prologues");
  if (prologue == kPrologueAddNorm && !sum_out) return fail("sum_out must be a device pointer for add_rmsnorm");
  if (x_stride < k || (uses_x2 && x2_stride < k))
    return fail("x_stride (%lld) and x2_stride (%lld) must be at least in_features (%lld)",
                static_cast<long long>(x_stride), static_cast<long long>(x2_stride), static_cast<long long>(k));
  if (int rc = check_gemv_workspace(need, workspace, workspace_size)) return rc;
  MmParams& p = call.p;
  p.prologue = prologue;
  p.x2 = x2;
  p.norm_weight = norm_weight;
  p.eps = eps;
  p.sum_out = sum_out;
  p.x_stride = x_stride;
  p.x2_stride = x2_stride;
  return gemv_launch(call, x, out, workspace, stream);
}

// kbit_gemm and kbit_gemm_offsets (`offsets`: block_scales points at int16 block records, which only the wgmma
// GEMM reads: the problem's plan must be the wgmma GEMM's).
int gemm_call(int device, void* stream, const void* x, int dtype, const int32_t* planes, const uint8_t* block_scales,
              const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n, int64_t k, void* out,
              float* workspace, int64_t workspace_size, const uint32_t* rot_signs, bool offsets) {
  if (int rc = check_common(offsets ? kWgmmaGemm : kGemm, bits, dtype, n, k)) return rc;
  if (int rc = check_rotation(rot_signs, k)) return rc;
  if (m < 1 || m > (int64_t{1} << 31)) return fail("x has %lld rows, the GEMM takes 1..2^31", static_cast<long long>(m));
  if (k == 0) return fail("in_features must be positive (an empty product is all zeros: handle it before the call)");
  if (n == 0) return KBIT_OK;
  if (!x || !out || !planes || !block_scales || !row_scales || !codebook)
    return fail(offsets ? "x, out, planes, block_records, row_scales and codebook must be device pointers"
                        : "x, out, planes, block_scales, row_scales and codebook must be device pointers");
  if (offsets ? !aligned(planes, 16) || !aligned(block_scales, 2) : !aligned(planes, 16) || !aligned(block_scales, 16))
    return fail(offsets ? "planes must be 16-byte aligned and block_records 2-byte aligned (int16)"
                        : "planes and block_scales must be 16-byte aligned");
  const GemmPlan plan = device_gemm_plan(device, m, n, k, bits, rot_signs != nullptr);
  if (offsets && plan.kernel != kGemmWgmma)
    return fail("block records: only the wgmma GEMM (sm_90a) reads them, and this problem's GEMM on device %d is the "
                "%s GEMM (kbit_gemm_offsets_serves): dequantize them instead", device, kGemmKernelNames[plan.kernel]);
  const GemmLaunch launch = offsets                       ? find_wgmma_gemm_offsets(bits, dtype, plan.tile)
                            : plan.kernel == kGemmWgmmaWs ? find_wgmma_ws_gemm(bits, dtype, plan.tile)
                            : plan.kernel == kGemmWgmma   ? find_wgmma_gemm(bits, dtype, plan.tile)
                                                          : find_gemm(bits, dtype, plan.tile);
  if (!launch) return unsupported(kGemmKernelIds[plan.kernel], bits, dtype);
  if (plan.kernel == kGemmWgmmaWs
          ? ceil_div(m, kWgmmaTokens) * ceil_div(n, kWsRows) * plan.splits >= (int64_t{1} << 31)
          : ceil_div(n, plan.kernel == kGemmWgmma ? kWgmmaRows : kGemmRows) > 65535)
    return fail("out_features %lld is too large for the GEMM grid", static_cast<long long>(n));
  if (plan.kernel == kGemmWgmmaWs && !aligned(x, 16))
    return fail("x must be 16-byte aligned for the warp-specialized GEMM (its tensor map reads x as stored)");
  if (plan.smem > smem_limits(device).per_block)
    return fail("the GEMM needs %d bytes of shared memory per block, this GPU allows %d (kbit_gemm_workspace_size "
                "returns -1 here: dequantize + matmul instead)", plan.smem, smem_limits(device).per_block);
  const int64_t need = plan.workspace(m, n);
  if (workspace_size < need || (need > 0 && !workspace))
    return fail("workspace has %lld floats, this problem needs %lld (kbit_gemm_workspace_size)",
                static_cast<long long>(workspace_size), static_cast<long long>(need));
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");
  MmParams p = mm_params(dtype, planes, block_scales, row_scales, codebook, bits, m, n, k, plan.splits, plan.chunk_kt);
  p.x = x;
  p.out = out;
  p.x_perm = reinterpret_cast<char*>(workspace);
  p.workspace = workspace ? workspace + plan.x_perm_floats : nullptr;
  p.rot_signs = rot_signs;
  const auto st = static_cast<cudaStream_t>(stream);
  cudaError_t err = launch(p, plan.grid, st);
  return err == cudaSuccess ? KBIT_OK : cuda_fail(err, offsets ? "kbit_gemm_offsets launch" : "kbit_gemm launch");
}

}  // namespace

extern "C" {

int kbit_gemv(int device, void* stream, const void* x, int dtype, const int32_t* planes, const uint8_t* block_scales,
              const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n, int64_t k, void* out,
              float* workspace, int64_t workspace_size, const uint32_t* rot_signs) {
  GemvCall call{};
  int64_t need = 0;
  if (int rc = gemv_setup(device, dtype, planes, block_scales, row_scales, codebook, bits, m, n, k, rot_signs, false,
                          &call, &need))
    return rc;
  if (n == 0) return KBIT_OK;
  if (!x || !out) return fail("x and out must be device pointers");
  if (int rc = check_gemv_workspace(need, workspace, workspace_size)) return rc;
  return gemv_launch(call, x, out, workspace, stream);
}

#if KBIT_TRACE
void kbit_trace_set(void* buffer) { g_trace = static_cast<unsigned long long*>(buffer); }
#endif

int kbit_gemv_prologue(int device, void* stream, int prologue, const void* x, int64_t x_stride, const void* x2,
                       int64_t x2_stride, const void* norm_weight, float eps, void* sum_out, int dtype,
                       const int32_t* planes, const uint8_t* block_scales, const float* row_scales,
                       const float* codebook, int bits, int64_t m, int64_t n, int64_t k, void* out, float* workspace,
                       int64_t workspace_size, const uint32_t* rot_signs) {
  return gemv_prologue_call(device, stream, prologue, x, x_stride, x2, x2_stride, norm_weight, eps, sum_out, dtype,
                            planes, block_scales, row_scales, codebook, bits, m, n, k, out, workspace, workspace_size,
                            rot_signs, false);
}

int kbit_gemv_plan(int device, int64_t m, int64_t n, int64_t k, int* splits, int* chunk_kt, int* grid, int* mode) {
  if (!splits || !chunk_kt || !grid || !mode) return fail("splits, chunk_kt, grid and mode must be host pointers");
  if (m < 1 || m > kGemvMaxM || n < 1 || k < 1)
    return fail("need 1 <= m <= %d, n >= 1 and k >= 1, got m=%lld n=%lld k=%lld", kGemvMaxM,
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k));
  const GemvPlan plan = device_gemv_plan(device, m, n, k);
  *splits = plan.splits;
  *chunk_kt = plan.chunk_kt;
  *grid = plan.grid;
  *mode = plan.balanced ? (plan.cluster ? 3 : 2) : plan.cluster ? 1 : 0;
  return KBIT_OK;
}

int64_t kbit_gemv_call_size(void) { return static_cast<int64_t>(sizeof(GemvCall)); }

int kbit_gemv_prepare(int device, int dtype, const int32_t* planes, const uint8_t* block_scales,
                      const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n, int64_t k,
                      const uint32_t* rot_signs, void* call, int64_t* workspace_size) {
  if (!call || !workspace_size) return fail("call and workspace_size must be host pointers");
  GemvCall c{};
  int64_t need = 0;
  if (int rc = gemv_setup(device, dtype, planes, block_scales, row_scales, codebook, bits, m, n, k, rot_signs, false,
                          &c, &need))
    return rc;
  *static_cast<GemvCall*>(call) = c;
  *workspace_size = need;
  return KBIT_OK;
}

int kbit_gemv_run(const void* call, const void* x, void* out, float* workspace, void* stream) {
  if (!call) return fail("call is a null pointer (kbit_gemv_prepare)");
  const GemvCall& c = *static_cast<const GemvCall*>(call);
  if (c.p.n > 0 && (!x || !out || ((c.rotate || (c.p.splits > 1 && !c.p.cluster)) && !workspace)))
    return fail("x, out (and the workspace of a split-K plan or a standalone rotation) must be device pointers");
  return gemv_launch(c, x, out, workspace, stream);
}

int kbit_gemv_offsets_max_m(int bits, int dtype) {
  for (int64_t m = kGemvMaxM; m >= 1; --m)
    if (find_gemv_offsets(bits, dtype, gemv_tiles(m))) return static_cast<int>(m);
  return 0;
}

int kbit_gemv_glu_serves(int device, int64_t m, int64_t n, int64_t k, int bits, int dtype) {
  if (m < 1 || m > kbit_gemv_offsets_max_m(bits, dtype) || n < 1 || n % (2 * kTileN) != 0 || k < 1) return 0;
  return glu_gemv_plan(device, m, n, k).splits == 1 ? 1 : 0;
}

int kbit_gemv_offsets(int device, void* stream, const void* x, int dtype, const int32_t* planes,
                      const int16_t* block_records, const float* row_scales, const float* codebook, int bits, int64_t m,
                      int64_t n, int64_t k, void* out, float* workspace, int64_t workspace_size) {
  GemvCall call{};
  int64_t need = 0;
  if (int rc = gemv_setup(device, dtype, planes, reinterpret_cast<const uint8_t*>(block_records), row_scales, codebook,
                          bits, m, n, k, nullptr, false, &call, &need, true))
    return rc;
  if (n == 0) return KBIT_OK;
  if (!x || !out) return fail("x and out must be device pointers");
  if (int rc = check_gemv_workspace(need, workspace, workspace_size)) return rc;
  return gemv_launch(call, x, out, workspace, stream);
}

int kbit_gemv_prepare_offsets(int device, int dtype, const int32_t* planes, const int16_t* block_records,
                              const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n, int64_t k,
                              void* call, int64_t* workspace_size) {
  if (!call || !workspace_size) return fail("call and workspace_size must be host pointers");
  GemvCall c{};
  int64_t need = 0;
  if (int rc = gemv_setup(device, dtype, planes, reinterpret_cast<const uint8_t*>(block_records), row_scales, codebook,
                          bits, m, n, k, nullptr, false, &c, &need, true))
    return rc;
  *static_cast<GemvCall*>(call) = c;
  *workspace_size = need;
  return KBIT_OK;
}

int kbit_gemv_prologue_offsets(int device, void* stream, int prologue, const void* x, int64_t x_stride,
                               const void* x2, int64_t x2_stride, const void* norm_weight, float eps, void* sum_out,
                               int dtype, const int32_t* planes, const int16_t* block_records,
                               const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n,
                               int64_t k, void* out, float* workspace, int64_t workspace_size) {
  return gemv_prologue_call(device, stream, prologue, x, x_stride, x2, x2_stride, norm_weight, eps, sum_out, dtype,
                            planes, reinterpret_cast<const uint8_t*>(block_records), row_scales, codebook, bits, m, n,
                            k, out, workspace, workspace_size, nullptr, true);
}

// kbit_grouped_gemv and kbit_grouped_gemv_silu_mul (`up` set: x is the gate, x_stride both rows' pitch).
static int grouped_gemv_call(int device, void* stream, const void* x, const void* up, int64_t x_stride, int dtype,
                             const int64_t* expert_ids, const int64_t* order, const int64_t* offsets,
                             const int32_t* planes, const uint8_t* block_scales, const float* row_scales,
                             const float* codebook, int bits, int64_t s, int64_t e, int64_t n, int64_t k, void* out,
                             const uint32_t* rot_signs, int64_t x_repeat) {
  if (int rc = check_common(kGroupedGemv, bits, dtype, n, k)) return rc;
  if (up && order) return fail("the SiLU-gated grouped GEMV serves per-row mode: give expert_ids, no order/offsets");
  if (up && x_stride < k)
    return fail("x_stride must be >= in_features (%lld), got %lld", static_cast<long long>(k),
                static_cast<long long>(x_stride));
  if (int rc = check_rotation(rot_signs, k)) return rc;
  if (s < 0 || e < 1 || e > (1 << 20)) return fail("need s >= 0 and 1 <= e <= 2^20, got s=%lld e=%lld",
                                                    static_cast<long long>(s), static_cast<long long>(e));
  if (x_repeat < 1 || s % x_repeat != 0)
    return fail("x_repeat must be >= 1 and divide s (x holds s / x_repeat rows), got s=%lld x_repeat=%lld",
                static_cast<long long>(s), static_cast<long long>(x_repeat));
  if (k == 0) return fail("in_features must be positive");
  if (s == 0 || n == 0) return KBIT_OK;
  if (!x || !out || !planes || !block_scales || !row_scales || !codebook)
    return fail("x, out, planes, block_scales, row_scales and codebook must be device pointers");
  if (order ? !offsets : !expert_ids)
    return fail("give expert_ids (per-row mode) or order and offsets (grouped mode)");
  // Grouped mode would rotate a row once per unit of its expert: there x R comes from the standalone
  // rotation, once (the rotated instantiations are per-row mode's, generate_kernels.py).
  if (rot_signs && order)
    return fail("rot_signs takes per-row mode (expert_ids, no order/offsets); in grouped mode pass x R "
                "(kbit_rotate) and no rot_signs");
  if (!aligned(planes, 16)) return fail("planes must be 16-byte aligned");
  if (ceil_div(n, kTileN) * ceil_div(k, kTileK) * bits * 64 >= (int64_t{1} << 31))
    return fail("expert weight of %lld x %lld is too large for 32-bit tile indexing", static_cast<long long>(n),
                static_cast<long long>(k));
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");

  GroupedParams p = grouped_params(x, dtype, order, offsets, planes, block_scales, row_scales, codebook, bits, s, e, n,
                                   k, out);
  p.expert_ids = expert_ids;
  p.rot_signs = rot_signs;
  p.x_repeat = x_repeat;
  p.x2 = up;
  p.x_stride = up ? x_stride : k;
  const int64_t k_tiles = ceil_div(k, kTileK);
  const SmemLimits lim = smem_limits(device);
  int ctas = 0;
  int64_t grid = 0;
  // Grouped mode where its shared memory fits, else per-row mode (needs expert_ids).
  for (int grouped = order ? 1 : 0; grouped >= 0 && ctas == 0; --grouped) {
    if (!grouped && !expert_ids) break;
    if (!grouped) {
      // Per-row mode's balanced plan (grouped_gemv_rows_kernel): the s * n_tiles row tiles in equal
      // contiguous ranges over the SMs, where a range touches at most kGroupedRowSpanMax problem rows
      // and their x, staged over all of K, fits in shared memory (else the units below).
      const int64_t n_tiles = ceil_div(n, kTileN), row_tiles = s * n_tiles;
      const int64_t g = std::min<int64_t>(sm_count(device), row_tiles);
      const int64_t longest = ceil_div(row_tiles, g);
      const int64_t span = std::min<int64_t>(s, (longest - 1) / n_tiles + 2);
      if (span <= kGroupedRowSpanMax && k_tiles <= lim.per_block / gemv_x_tile_bytes(1) &&
          longest * k_tiles < (int64_t{1} << 31) &&
          grouped_rows_smem_bytes(static_cast<int>(span), static_cast<int>(k_tiles)) + kGroupedRowsStaticSmem <=
              lim.per_block) {
        ctas = 1;
        grid = g;
        p.order = p.offsets = nullptr;
        p.cta_rows = row_tiles / g;
        p.row_span = static_cast<int>(span);
        break;
      }
    }
    // Per-row mode in units (where the balanced plan does not fit): few units, so the warps split K
    // (at least 4 K tiles each) to keep more loads in flight. Grouped mode: one warp per row tile
    // over all of K (16 row tiles per unit): longer runs per warp beat finer units of 2 or 4 K
    // slices per row tile.
    int k_warps = 1;
    if (!grouped)
      while (k_warps < kGemvWarps && k_tiles >= 8 * k_warps) k_warps *= 2;
    const int nt = grouped ? kGroupedNt : 1;
    const int fixed = grouped_smem_bytes(nt, 0, grouped ? e : 0);
    const int x_tile = gemv_x_tile_bytes(8 * nt);
    // As much activation staging as the CTAs per SM leave room for (fewer K passes per unit).
    int budget = std::min(lim.per_sm / kGemvCtasPerSm - kReservedSmem, lim.per_block) - fixed;
    int c = kGemvCtasPerSm;
    if (budget < x_tile * k_warps) {
      budget = lim.per_block - fixed;
      c = 1;
    }
    if (budget < x_tile * k_warps) continue;
    ctas = c;
    p.order = grouped ? order : nullptr;
    p.offsets = grouped ? offsets : nullptr;
    p.k_warps = k_warps;
    p.sub_kt = static_cast<int>(
        std::min<int64_t>(budget / x_tile / k_warps * k_warps, ceil_div(k_tiles, k_warps) * k_warps));
  }
  if (ctas == 0)
    return fail("the grouped GEMV does not fit this GPU's shared memory (e=%lld; give expert_ids for per-row mode)",
                static_cast<long long>(e));
  if (grid == 0) grid = int64_t{sm_count(device)} * ctas;
  const auto st = static_cast<cudaStream_t>(stream);
  const GroupedGemvLaunch launch = find_grouped_gemv(bits, dtype, p.order ? kGroupedNt : 1, rot_signs != nullptr);
  if (!launch) return unsupported(kGroupedGemv, bits, dtype);
  cudaError_t err = launch(p, static_cast<int>(grid), st);
  return err == cudaSuccess ? KBIT_OK : cuda_fail(err, "kbit_grouped_gemv launch");
}

int kbit_grouped_gemv(int device, void* stream, const void* x, int dtype, const int64_t* expert_ids,
                      const int64_t* order, const int64_t* offsets, const int32_t* planes,
                      const uint8_t* block_scales, const float* row_scales, const float* codebook, int bits,
                      int64_t s, int64_t e, int64_t n, int64_t k, void* out, const uint32_t* rot_signs,
                      int64_t x_repeat) {
  return grouped_gemv_call(device, stream, x, nullptr, k, dtype, expert_ids, order, offsets, planes, block_scales,
                           row_scales, codebook, bits, s, e, n, k, out, rot_signs, x_repeat);
}

int kbit_grouped_gemv_silu_mul(int device, void* stream, const void* gate, const void* up, int64_t x_stride,
                               int dtype, const int64_t* expert_ids, const int64_t* order, const int64_t* offsets,
                               const int32_t* planes, const uint8_t* block_scales, const float* row_scales,
                               const float* codebook, int bits, int64_t s, int64_t e, int64_t n, int64_t k, void* out,
                               const uint32_t* rot_signs) {
  if (!up) return fail("up must be a device pointer");
  return grouped_gemv_call(device, stream, gate, up, x_stride, dtype, expert_ids, order, offsets, planes,
                           block_scales, row_scales, codebook, bits, s, e, n, k, out, rot_signs, 1);
}

int64_t kbit_grouped_gemm_workspace_size(int64_t s, int64_t e) {
  return s < 0 || e < 1 ? -1 : ws_group_tiles_words(s, e);
}

int kbit_grouped_gemm(int device, void* stream, const void* x, int64_t x_stride, int dtype, const int64_t* order,
                      const int64_t* offsets, const int32_t* planes, const uint8_t* block_scales,
                      const float* row_scales, const float* codebook, int bits, int64_t s, int64_t e, int64_t n,
                      int64_t k, void* out, float* workspace, int64_t workspace_size) {
  if (int rc = check_common(kWgmmaWsGrouped, bits, dtype, n, k)) return rc;
  if (s < 0 || s >= (int64_t{1} << 31) || e < 1 || e > (1 << 20))
    return fail("need 0 <= s < 2^31 and 1 <= e <= 2^20, got s=%lld e=%lld", static_cast<long long>(s),
                static_cast<long long>(e));
  if (k == 0) return fail("in_features must be positive");
  if (s == 0 || n == 0) return KBIT_OK;
  if (!has_wgmma(device))
    return fail("the warp-specialized grouped GEMM needs an sm_90 GPU and the library's sm_90a code");
  if (!x || !out || !order || !offsets || !planes || !block_scales || !row_scales || !codebook)
    return fail("x, out, order, offsets, planes, block_scales, row_scales and codebook must be device pointers");
  if (!aligned(x, 16) || x_stride < k || (x_stride * 2) % 16 != 0)
    return fail("x (sorted by expert) must be 16-byte aligned at a row pitch x_stride >= in_features of whole 16-byte "
                "units, got x_stride=%lld for in_features=%lld", static_cast<long long>(x_stride),
                static_cast<long long>(k));
  if (!aligned(planes, 16) || !aligned(block_scales, 16)) return fail("planes and block_scales must be 16-byte aligned");
  const int64_t need = ws_group_tiles_words(s, e);
  if (workspace_size < need || !workspace || !aligned(workspace, 16))
    return fail("workspace has %lld 16-byte aligned words, this call needs %lld (kbit_grouped_gemm_workspace_size)",
                static_cast<long long>(workspace ? workspace_size : 0), static_cast<long long>(need));
  // Token blocks of 64 NB rows of one expert: by the mean rows per expert, since the counts are on the
  // device (a block's rows past its expert's are computed and not stored).
  const int64_t mean = s / e;
  const int nb = mean >= 192 ? 4 : mean >= 96 ? 2 : 1;
  const WgmmaWsGroupedLaunch launch = find_wgmma_ws_grouped(bits, dtype, nb);
  if (!launch) return unsupported(kWgmmaWsGrouped, bits, dtype);
  if ((s / 64 + e + 1) * ceil_div(n, kWsRows) >= (int64_t{1} << 31))
    return fail("out_features %lld is too large for the grouped GEMM's tiles", static_cast<long long>(n));
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");
  GroupedParams p = grouped_params(x, dtype, order, offsets, planes, block_scales, row_scales, codebook, bits, s, e, n,
                                   k, out);
  p.x_stride = x_stride;
  p.tile_list = reinterpret_cast<int32_t*>(workspace);
  cudaError_t err = launch(p, sm_count(device), static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? KBIT_OK : cuda_fail(err, "kbit_grouped_gemm launch");
}

int64_t kbit_gemm_workspace_size(int device, int64_t m, int64_t n, int64_t k, int bits, int rotated) {
  if (!gemm_has_bits(bits)) return -1;
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  const GemmPlan plan = device_gemm_plan(device, m, n, k, bits, rotated != 0);
  if (plan.smem > smem_limits(device).per_block) return -1;
  return plan.workspace(m, n);
}

int kbit_gemm_plan(int device, int64_t m, int64_t n, int64_t k, int bits, int* wgmma, int* block_m, int* splits,
                   int* ctas) {
  if (!wgmma || !block_m || !splits || !ctas) return fail("wgmma, block_m, splits and ctas must be host pointers");
  if (!gemm_has_bits(bits)) return unsupported(kGemm, bits, kBFloat16);
  if (m < 1 || n < 1 || k < 1)
    return fail("need m, n and k >= 1, got m=%lld n=%lld k=%lld", static_cast<long long>(m), static_cast<long long>(n),
                static_cast<long long>(k));
  const GemmPlan plan = device_gemm_plan(device, m, n, k, bits, false);
  *wgmma = plan.kernel;
  *block_m = plan.kernel == kGemmMma ? gemm_block_m(plan.tile) : plan.tile * kWgmmaTokens;
  *splits = plan.splits;
  *ctas = static_cast<int>(plan.grid.x * plan.grid.y * plan.grid.z);
  return KBIT_OK;
}

int kbit_set_gemv_plan(int mode, int splits) {
  if (mode < -1 || mode > 3)
    return fail("mode must be -1 (the planner's) or 0..3 (kbit_gemv_plan's modes), got %d", mode);
  if (splits < 0 || splits > 64) return fail("splits must be 0 (any) or 1..64, got %d", splits);
  g_gemv_mode = mode;
  g_gemv_splits = mode < 0 ? 0 : splits;
  return KBIT_OK;
}

int kbit_set_wgmma_ws_plan(int nb, int splits) {
  if (nb != 0 && nb != 1 && nb != 2 && nb != 4) return fail("nb must be 0 (the planner's), 1, 2 or 4, got %d", nb);
  if (splits < 0 || splits > 8) return fail("splits must be 0 (the planner's) or 1..8, got %d", splits);
  g_ws_nb = nb;
  g_ws_splits = splits;
  return KBIT_OK;
}

int kbit_gemm_kernel(int device) { return gemm_kernel(device); }

int kbit_set_gemm_kernel(int gemm) {
  if (gemm < -1 || gemm >= kNumGemmKernels)
    return fail("gemm must be -1 (HF_KBIT_GEMM_KERNEL's), 0 (mma.sync), 1 (wgmma) or 2 (wgmma_ws), got %d", gemm);
  g_gemm_kernel = gemm;
  return KBIT_OK;
}

int kbit_set_mm_crossovers(int gemm, int bits, int gemv_max_m, int classes, const int64_t* min_weight,
                           const int64_t* gemm_max_m) {
  if (gemm < 0 || gemm >= kNumGemmKernels)
    return fail("gemm must be 0 (mma.sync), 1 (wgmma) or 2 (wgmma_ws), got %d", gemm);
  if (bits < 0 || bits > kMaxPlanBits) return fail("bits must be in 0..%d, got %d", kMaxPlanBits, bits);
  if (classes < 1 || classes > kMaxWeightClasses || !min_weight || !gemm_max_m)
    return fail("need 1..%d weight classes (min_weight and gemm_max_m host arrays), got %d", kMaxWeightClasses,
                classes);
  for (int i = 0; i < classes; ++i)
    if ((i > 0 && min_weight[i] >= min_weight[i - 1]) || (i == classes - 1 && min_weight[i] != 0))
      return fail("min_weight must descend to 0 (the last class takes every weight)");
  MmCrossovers c{};
  c.gemv_max_m = gemv_max_m;
  c.classes = classes;
  for (int i = 0; i < classes; ++i) {
    c.min_weight[i] = min_weight[i];
    c.gemm_max_m[i] = gemm_max_m[i];
  }
  g_crossovers[gemm][bits] = c;
  return KBIT_OK;
}

int kbit_mm_plan(int device, int64_t m, int64_t n, int64_t k, int bits, int dtype, int rotated, int* path, int* gemm,
                 int64_t* workspace) {
  if (!path || !gemm || !workspace) return fail("path, gemm and workspace must be host pointers");
  if (m < 1 || n < 1 || k < 1)
    return fail("need m, n and k >= 1, got m=%lld n=%lld k=%lld", static_cast<long long>(m), static_cast<long long>(n),
                static_cast<long long>(k));
  if (dtype < kFloat32 || dtype > kBFloat16) return fail("dtype code must be 0, 1 or 2, got %d", dtype);
  *gemm = gemm_kernel(device);
  *path = kPathDequant;
  *workspace = 0;
  const MmCrossovers* c = bits >= 0 && bits <= kMaxPlanBits ? &g_crossovers[*gemm][bits] : nullptr;
  if (!c || c->classes == 0)
    return fail("no crossovers for the %s GEMM at bits=%d (kbit_set_mm_crossovers; hf_kbit/backends/crossovers.json)",
                kGemmKernelNames[*gemm], bits);
  if (m <= std::min(c->gemv_max_m, kGemvMaxM) && in_kernel_table(kGemv, bits, dtype)) {
    *path = kPathGemv;
    *workspace = device_gemv_plan(device, m, n, k).workspace(m, n) + (rotated ? rotated_x_floats(m, k) : 0);
    return KBIT_OK;
  }
  int cls = 0;
  while (cls + 1 < c->classes && n * k < c->min_weight[cls]) ++cls;
  if (m <= c->gemm_max_m[cls] && in_kernel_table(kGemm, bits, dtype) &&
      in_kernel_table(kGemmKernelIds[*gemm], bits, dtype)) {
    const GemmPlan plan = device_gemm_plan(device, m, n, k, bits, rotated != 0);
    if (plan.smem <= smem_limits(device).per_block) {  // else this GPU lacks the GEMM's shared memory
      *path = kPathGemm;
      *workspace = plan.workspace(m, n);
    }
  }
  return KBIT_OK;
}

int kbit_gemm(int device, void* stream, const void* x, int dtype, const int32_t* planes, const uint8_t* block_scales,
              const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n, int64_t k, void* out,
              float* workspace, int64_t workspace_size, const uint32_t* rot_signs) {
  return gemm_call(device, stream, x, dtype, planes, block_scales, row_scales, codebook, bits, m, n, k, out, workspace,
                   workspace_size, rot_signs, false);
}

int kbit_gemm_offsets_serves(int device, int64_t m, int64_t n, int64_t k, int bits, int dtype) {
  if (m < 1 || n < 1 || k < 1 || dtype < kFloat32 || dtype > kBFloat16 || !in_kernel_table(kWgmmaGemm, bits, dtype))
    return 0;
  const GemmPlan plan = device_gemm_plan(device, m, n, k, bits, false);
  return plan.kernel == kGemmWgmma && plan.smem <= smem_limits(device).per_block &&
                 find_wgmma_gemm_offsets(bits, dtype, plan.tile) != nullptr
             ? 1
             : 0;
}

int kbit_gemm_offsets(int device, void* stream, const void* x, int dtype, const int32_t* planes,
                      const int16_t* block_records, const float* row_scales, const float* codebook, int bits, int64_t m,
                      int64_t n, int64_t k, void* out, float* workspace, int64_t workspace_size) {
  return gemm_call(device, stream, x, dtype, planes, reinterpret_cast<const uint8_t*>(block_records), row_scales,
                   codebook, bits, m, n, k, out, workspace, workspace_size, nullptr, true);
}

}  // extern "C"
