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

// Programmatic dependent launch (sm_90+): a split-K kernel lets its reduce kernel launch early
// (launch_dependents at its start), and the reduce waits in griddepcontrol.wait until the split-K
// grid has completed and its writes are visible, so the reduce's launch latency overlaps the
// split-K kernel's tail. Elsewhere both are no-ops and the launch is an ordinary one.
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

}  // namespace kbit
