// Host API: argument checks, launch plans, dispatch to the (bits, dtype) instantiations.
// No allocation, no host sync: everything runs on the caller's stream.
#include "kbit_api.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>

#include "kbit_launch.h"

namespace {

using namespace kbit;

constexpr int kAbiVersion = 1;
constexpr int kMaxDevices = 64;

thread_local char g_error[512] = "";

int fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, args);
  va_end(args);
  return KBIT_INVALID_ARGUMENT;
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
  int splits, chunk_kt, row_tiles, k_warps, sub_kt, grid;
};

// Work split of the GEMV. A CTA's 8 warps cover row_tiles x k_warps (row tile, K lane)
// pairs; each warp's half-warps take alternate K tiles, so one step covers 2 * k_warps K
// tiles. Long K: one row tile per CTA and all 16 half-warps on K, so every lane walks a
// contiguous run of K tiles with its plane loads issued a few tiles ahead (and the first ones
// before the activation staging). Short K: several row tiles per CTA so each half-warp still
// owns at least one K tile. One CTA per unit (row group, K split): the hardware schedules
// them as others finish. Split-K (partials to a workspace, reduced in split order) only
// when the row groups alone would leave resident CTA slots idle.
GemvPlan plan_gemv(int64_t m, int64_t n, int64_t k, int sms) {
  const int64_t k_tiles = ceil_div(k, kTileK), n_tiles = ceil_div(n, kTileN);
  const int64_t x_tile_bytes = m * kXStride * 4;
  GemvPlan p{};
  p.k_warps = k_tiles >= 16 ? 8 : k_tiles >= 8 ? 4 : k_tiles >= 4 ? 2 : 1;
  p.row_tiles = kGemvWarps / p.k_warps;
  const int step = 2 * p.k_warps;
  p.sub_kt = step * static_cast<int>(std::max<int64_t>(1, kGemvXSmemBytes / (x_tile_bytes * step)));
  const int64_t groups = ceil_div(n_tiles, p.row_tiles);
  const int64_t slots = static_cast<int64_t>(sms) * kGemvCtasPerSm;
  int64_t splits = 1;
  if (4 * groups < 3 * slots) {
    splits = std::min<int64_t>(ceil_div(slots, groups), std::max<int64_t>(1, k_tiles / step));
  }
  const int64_t chunk = ceil_div(k_tiles, splits);
  splits = ceil_div(k_tiles, chunk);
  // Stage no more of x than one split needs: less shared memory, more resident CTAs.
  p.sub_kt = static_cast<int>(std::min<int64_t>(p.sub_kt, ceil_div(chunk, step) * step));
  p.splits = static_cast<int>(splits);
  p.chunk_kt = static_cast<int>(chunk);
  p.grid = static_cast<int>(std::min<int64_t>(groups * splits, 0x7fffffff));
  return p;
}

template <int BITS, typename T>
cudaError_t gemv_m(const GemvParams& p, int sub, int grid, cudaStream_t s) {
  switch (p.m) {
    case 1: return launch_gemv<BITS, T, 1>(p, sub, grid, s);
    case 2: return launch_gemv<BITS, T, 2>(p, sub, grid, s);
    case 3: return launch_gemv<BITS, T, 3>(p, sub, grid, s);
    case 4: return launch_gemv<BITS, T, 4>(p, sub, grid, s);
    case 5: return launch_gemv<BITS, T, 5>(p, sub, grid, s);
    case 6: return launch_gemv<BITS, T, 6>(p, sub, grid, s);
    case 7: return launch_gemv<BITS, T, 7>(p, sub, grid, s);
    default: return launch_gemv<BITS, T, 8>(p, sub, grid, s);
  }
}

template <typename T>
cudaError_t gemv_bits(const GemvParams& p, int sub, int grid, cudaStream_t s) {
  switch (p.bits) {
    case 2: return gemv_m<2, T>(p, sub, grid, s);
    case 3: return gemv_m<3, T>(p, sub, grid, s);
    case 4: return gemv_m<4, T>(p, sub, grid, s);
    default: return gemv_m<5, T>(p, sub, grid, s);
  }
}

template <typename T>
cudaError_t quantize_bits(const QuantizeParams& p, cudaStream_t s) {
  switch (p.bits) {
    case 2: return launch_quantize<T, 2>(p, s);
    case 3: return launch_quantize<T, 3>(p, s);
    case 4: return launch_quantize<T, 4>(p, s);
    default: return launch_quantize<T, 5>(p, s);
  }
}

template <typename T>
cudaError_t dequantize_bits(const DequantizeParams& p, cudaStream_t s) {
  switch (p.bits) {
    case 2: return launch_dequantize<T, 2>(p, s);
    case 3: return launch_dequantize<T, 3>(p, s);
    case 4: return launch_dequantize<T, 4>(p, s);
    default: return launch_dequantize<T, 5>(p, s);
  }
}

int check_common(int bits, int dtype, int64_t n, int64_t k) {
  if (bits < 2 || bits > 5) return fail("bits must be 2, 3, 4 or 5, got %d", bits);
  if (dtype < kFloat32 || dtype > kBFloat16) return fail("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16), got %d", dtype);
  if (n < 0 || k < 0) return fail("shape must be non-negative, got n=%lld k=%lld", static_cast<long long>(n), static_cast<long long>(k));
  return KBIT_OK;
}

}  // namespace

extern "C" {

int kbit_abi_version(void) { return kAbiVersion; }

const char* kbit_last_error(void) { return g_error; }

int kbit_gemv_max_m(void) { return kGemvMaxM; }

int kbit_quantize(int device, void* stream, const void* weight, int dtype, const float* codebook, int bits,
                  int64_t batch, int64_t n, int64_t k, int32_t* planes, uint8_t* block_scales, float* row_scales) {
  if (int rc = check_common(bits, dtype, n, k)) return rc;
  if (batch < 0) return fail("batch must be non-negative, got %lld", static_cast<long long>(batch));
  if (batch * n * k > 0 && !weight) return fail("weight is a null pointer");
  if (!codebook || !planes || !block_scales || (batch * n > 0 && !row_scales))
    return fail("codebook, planes, block_scales and row_scales must be device pointers");
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");
  QuantizeParams p{weight, codebook, planes, block_scales, row_scales, batch, n, k, bits, dtype};
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = dtype == kFloat32 ? quantize_bits<float>(p, s)
                  : dtype == kFloat16 ? quantize_bits<__half>(p, s)
                                      : quantize_bits<__nv_bfloat16>(p, s);
  return err == cudaSuccess ? KBIT_OK : cuda_fail(err, "kbit_quantize launch");
}

int kbit_dequantize(int device, void* stream, const int32_t* planes, const uint8_t* block_scales,
                    const float* row_scales, const float* codebook, int64_t codebook_stride, int bits, int64_t batch,
                    int64_t n, int64_t k, void* out, int dtype) {
  if (int rc = check_common(bits, dtype, n, k)) return rc;
  if (batch < 0 || batch > 65535) return fail("batch must be in [0, 65535], got %lld", static_cast<long long>(batch));
  if (codebook_stride != 0 && codebook_stride != (1 << bits))
    return fail("codebook_stride must be 0 or %d, got %lld", 1 << bits, static_cast<long long>(codebook_stride));
  if (!planes || !block_scales || !row_scales || !codebook || (batch * n * k > 0 && !out))
    return fail("planes, block_scales, row_scales, codebook and out must be device pointers");
  if (batch * n * k == 0) return KBIT_OK;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");
  DequantizeParams p{planes, block_scales, row_scales, codebook, out, batch, n, k, codebook_stride, bits, dtype};
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = dtype == kFloat32 ? dequantize_bits<float>(p, s)
                  : dtype == kFloat16 ? dequantize_bits<__half>(p, s)
                                      : dequantize_bits<__nv_bfloat16>(p, s);
  return err == cudaSuccess ? KBIT_OK : cuda_fail(err, "kbit_dequantize launch");
}

int64_t kbit_gemv_workspace_size(int device, int64_t m, int64_t n, int64_t k, int bits) {
  (void)bits;
  if (m <= 0 || n <= 0 || k <= 0 || m > kGemvMaxM) return 0;
  const GemvPlan plan = plan_gemv(m, n, k, sm_count(device));
  return plan.splits > 1 ? static_cast<int64_t>(plan.splits) * m * n : 0;
}

}  // extern "C"

namespace {

struct GemvCall {
  int device;
  int sub_kt, grid;
  GemvParams p;
};

// Checks of the weight and the problem shared by kbit_gemv and kbit_gemv_prepare; fills the call.
int gemv_setup(int device, int dtype, const int32_t* planes, const uint8_t* block_scales, const float* row_scales,
               const float* codebook, int bits, int64_t m, int64_t n, int64_t k, GemvCall* call, int64_t* need) {
  if (int rc = check_common(bits, dtype, n, k)) return rc;
  if (dtype == kFloat32) return fail("x must be float16 or bfloat16 for the GEMV (float32 goes through dequantize)");
  if (m < 1 || m > kGemvMaxM) return fail("x has %lld rows, the GEMV takes 1..%d", static_cast<long long>(m), kGemvMaxM);
  if (k == 0) return fail("in_features must be positive (an empty product is all zeros: handle it before the call)");
  if (n > 0 && (!planes || !block_scales || !row_scales || !codebook))
    return fail("planes, block_scales, row_scales and codebook must be device pointers");
  if (!aligned(planes, 16)) return fail("planes must be 16-byte aligned");
  if (!aligned(block_scales, 4)) return fail("block_scales must be 4-byte aligned");
  const GemvPlan plan = plan_gemv(m, n, k, sm_count(device));
  *need = plan.splits > 1 ? static_cast<int64_t>(plan.splits) * m * n : 0;
  GemvParams& p = call->p;
  p = GemvParams{};
  p.planes = planes;
  p.block_scales = block_scales;
  p.row_scales = row_scales;
  p.codebook = codebook;
  p.m = m;
  p.n = n;
  p.k = k;
  p.bits = bits;
  p.dtype = dtype;
  p.splits = plan.splits;
  p.chunk_kt = plan.chunk_kt;
  p.row_tiles = plan.row_tiles;
  p.k_warps = plan.k_warps;
  call->device = device;
  call->sub_kt = plan.sub_kt;
  call->grid = plan.grid;
  return KBIT_OK;
}

int gemv_launch(const GemvCall& call, const void* x, void* out, float* workspace, void* stream) {
  if (call.p.n == 0) return KBIT_OK;
  GemvParams p = call.p;
  p.x = x;
  p.out = out;
  p.workspace = workspace;
  DeviceGuard guard(call.device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "selecting the device");
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = p.dtype == kFloat16 ? gemv_bits<__half>(p, call.sub_kt, call.grid, s)
                                        : gemv_bits<__nv_bfloat16>(p, call.sub_kt, call.grid, s);
  return err == cudaSuccess ? KBIT_OK : cuda_fail(err, "kbit_gemv launch");
}

}  // namespace

extern "C" {

int kbit_gemv(int device, void* stream, const void* x, int dtype, const int32_t* planes, const uint8_t* block_scales,
              const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n, int64_t k, void* out,
              float* workspace, int64_t workspace_size) {
  GemvCall call{};
  int64_t need = 0;
  if (int rc = gemv_setup(device, dtype, planes, block_scales, row_scales, codebook, bits, m, n, k, &call, &need))
    return rc;
  if (n == 0) return KBIT_OK;
  if (!x || !out) return fail("x and out must be device pointers");
  if (workspace_size < need || (need > 0 && !workspace))
    return fail("workspace has %lld floats, this problem needs %lld (kbit_gemv_workspace_size)",
                static_cast<long long>(workspace_size), static_cast<long long>(need));
  return gemv_launch(call, x, out, workspace, stream);
}

int64_t kbit_gemv_call_size(void) { return static_cast<int64_t>(sizeof(GemvCall)); }

int kbit_gemv_prepare(int device, int dtype, const int32_t* planes, const uint8_t* block_scales,
                      const float* row_scales, const float* codebook, int bits, int64_t m, int64_t n, int64_t k,
                      void* call, int64_t* workspace_size) {
  if (!call || !workspace_size) return fail("call and workspace_size must be host pointers");
  GemvCall c{};
  int64_t need = 0;
  if (int rc = gemv_setup(device, dtype, planes, block_scales, row_scales, codebook, bits, m, n, k, &c, &need)) return rc;
  *static_cast<GemvCall*>(call) = c;
  *workspace_size = need;
  return KBIT_OK;
}

int kbit_gemv_run(const void* call, const void* x, void* out, float* workspace, void* stream) {
  if (!call) return fail("call is a null pointer (kbit_gemv_prepare)");
  const GemvCall& c = *static_cast<const GemvCall*>(call);
  if (c.p.n > 0 && (!x || !out || (c.p.splits > 1 && !workspace)))
    return fail("x, out (and the workspace of a split-K plan) must be device pointers");
  return gemv_launch(c, x, out, workspace, stream);
}

}  // extern "C"
