// Device helpers shared by every kbit kernel: scale decoding, bit-plane index extraction,
// activation dtype conversion.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kbit_params.h"

namespace kbit {

// E4M4: 4 exponent bits, 4 mantissa bits, bias 11, subnormal at e = 0 (format.e4m4_table).
__device__ __forceinline__ float e4m4_decode(uint32_t code) {
  const uint32_t e = (code >> 4) & 15u, m = code & 15u;
  if (e == 0) return static_cast<float>(m) * 0x1p-14f;  // m/16 * 2^(1 - 11), exact
  return __uint_as_float(((e + 127u - kE4M4Bias) << 23) | (m << 19));
}

// Plane bit position of block element e: p = 8b + 4h + s for e = 8b + 2s + h (format.py).
__host__ __device__ constexpr int bit_of_element(int e) {
  return 8 * (e / 8) + 4 * (e % 2) + (e % 8) / 2;
}

template <typename T> struct TypeOf;
template <> struct TypeOf<float> { static constexpr int value = kFloat32; };
template <> struct TypeOf<__half> { static constexpr int value = kFloat16; };
template <> struct TypeOf<__nv_bfloat16> { static constexpr int value = kBFloat16; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Two 16-bit values packed as they lie in memory (element lo first), each rounded like
// from_float.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Asks L1 for elements [e0, e1) of `base`, one instruction per 128-byte line, the block's threads in
// turn. The GEMV issues it before griddepcontrol.wait for constants that its x staging reads after the
// wait (rotation sign words, a norm prologue's weight), so that those loads hit L1 instead of adding a
// trip to HBM to the staging's latency.
template <typename E> __device__ __forceinline__ void prefetch_l1(const E* base, int64_t e0, int64_t e1) {
  constexpr int64_t kLine = 128 / sizeof(E);
  for (int64_t e = e0 + kLine * static_cast<int64_t>(threadIdx.x); e < e1; e += kLine * static_cast<int64_t>(blockDim.x))
    asm volatile("prefetch.global.L1 [%0];" ::"l"(base + e));
}

// Programmatic dependent launch (sm_90+): a kernel lets the next one launch early
// (launch_dependents), and the next waits in griddepcontrol.wait until this grid has completed
// and its writes are visible, so the next kernel's launch latency and prologue overlap this
// kernel's tail. Elsewhere both are no-ops and the launch is an ordinary one.
// A kernel launched as a programmatic dependent calls launch_dependents only after its own
// griddepcontrol.wait: then a launch implies that every earlier kernel of the stream has
// completed, which other programmatic dependents may rely on. Inductor's Triton kernels
// (TORCHINDUCTOR_ENABLE_PDL=1) do: they wait only before touching the previous kernel's buffers
// and read older ones at once. A kernel launched the ordinary way (the mma.sync GEMM) may call it
// at its start.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Thread-block clusters (sm_90+). A cluster barrier is arrive + wait, executed by every thread
// of every CTA of the cluster; wait acquires what the other CTAs wrote before their
// (releasing) arrive. Remote shared memory may be written only after a barrier phase that
// every CTA entered (they have all started), and read by its owner after the next.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}
// Stores v at `local` (a shared-memory pointer of this CTA's layout) in CTA `rank` of the cluster.
__device__ __forceinline__ void st_cluster(const void* local, int rank, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w)
               : "memory");
#else
  __trap();
#endif
}

// Host: raises kKernel's dynamic shared-memory limit to `smem` on the current device, once per
// device (and again if a larger launch needs more): a driver call per launch costs about a
// microsecond of eager time.
template <auto kKernel>
cudaError_t raise_smem_limit(int smem) {
  static int raised[kMaxDevices] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached && raised[dev] >= smem) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess && cached) raised[dev] = smem;
  return err;
}

// Host: whether the current device takes programmatic dependent launches (compute capability >= 9).
inline bool device_has_pdl() {
  static int cache[kMaxDevices] = {0};  // 0: not asked yet, 1: no, 2: yes
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return false;
  if (cache[dev] == 0) {
    int major = 0;
    cache[dev] = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9 ? 2 : 1;
  }
  return cache[dev] == 2;
}
// Host: whether the GEMVs and the wgmma GEMM's x rewrite launch as programmatic dependents of
// the stream's previous kernel (sm_90+).
inline bool use_pdl() { return device_has_pdl(); }

}  // namespace kbit
