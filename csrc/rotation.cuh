// Block-Hadamard rotation of the activations along K (hf_kbit/rotation.py, issue 34): a rotated
// layer stores the quantized W R, with R = diag(s) B and B = H8 / sqrt(8) on consecutive 8-element
// segments of K, so the kernels multiply x R instead of x (and dequantize unrotates: W' R^T).
//
// The signs reach the kernels as bit words (MmParams::rot_signs, ...): [k / 32] uint32, bit
// e % 32 of word e / 32 set <=> s_e = -1; nullptr = no rotation. Rotated layers have K % 64 == 0
// (kRotMultiple; the host API refuses others), so the half of a partial last K tile is all inside K
// or all past it, where x is zero and rotates to zeros.
//
// Why segments of 8: wherever the kernels stage x a thread holds 8 consecutive elements (the GEMM's
// x rewrite, dequantize, the standalone rotation, the GEMV's and grouped GEMV's staging), so the
// transform is 3 butterfly stages in registers; longer segments need a shuffle per further stage and
// measured no better by perplexity (docs/format.md#rotation).
//
// Arithmetic: float32, in the reference's order (rotation.rotate: sign, the butterfly stages of
// strides 1, 2, 4, each a + b / a - b of the lower and upper element, then * float32(1 / sqrt(8))),
// rounded once to the activation dtype: the rounded x R is bit-identical with rotate(x).to(dtype).
// Per element ~5 instructions (3 adds, a sign flip, a multiply) beside the conversions, paid once per
// element of x, never per weight element.
#pragma once

#include <algorithm>

#include "kbit_common.cuh"
#include "kbit_launch.h"

namespace kbit {

// 1 / sqrt(kRotBlock) rounded to float32, the constant rotation.fwht_segments multiplies by.
constexpr float kRotScale = 0.35355339059327373f;
static_assert(kRotBlock == 8, "the register transforms below are of 8-element segments");
static_assert(kTileK % kRotMultiple == 0 && kRotMultiple % kRotBlock == 0,
              "a K tile holds whole segments: K splits rotate their own range");

// v with its sign flipped where `bit` (0 or 1) is set: exact, and no multiply for the compiler to
// contract with the butterflies' adds.
__device__ __forceinline__ float flip_sign(float v, uint32_t bit) {
  return __uint_as_float(__float_as_uint(v) ^ (bit << 31));
}

// Butterfly stage of stride kH over a thread's registers: elements i and i + kH (i & kH == 0)
// become a + b and a - b (rotation._fwht).
template <int kH, int N>
__device__ __forceinline__ void butterfly_regs(float (&v)[N]) {
  static_assert(kH > 0 && kH < N && N % (2 * kH) == 0, "a register stage pairs elements within the array");
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if ((i & kH) == 0) {
      const float a = v[i], b = v[i + kH];
      v[i] = a + b;
      v[i + kH] = a - b;
    }
  }
}

// One 8-element segment in a thread's registers: the rotation of x (sign first) or the unrotation of
// a weight row (sign last); `sign_bits`: the segment's signs at bits 0..7.
__device__ __forceinline__ void hadamard8(float (&v)[8]) {
  butterfly_regs<1>(v);
  butterfly_regs<2>(v);
  butterfly_regs<4>(v);
}
__device__ __forceinline__ void rotate8(float (&v)[8], uint32_t sign_bits) {
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = flip_sign(v[e], (sign_bits >> e) & 1u);
  hadamard8(v);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(v[e], kRotScale);
}
__device__ __forceinline__ void unrotate8(float (&v)[8], uint32_t sign_bits) {
  hadamard8(v);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = flip_sign(__fmul_rn(v[e], kRotScale), (sign_bits >> e) & 1u);
}

// ---- the standalone rotation: x [m, k] -> x R (or y R^T) [m, k] in x's dtype ----
// Where no kernel fuses it: the GEMV above its in-staging crossover and the mma.sync GEMM (x R into
// their workspace), dequantize + cuBLAS (x R), and the gradients (dX = (dY W') R^T: the unrotation of
// dY W'); also the tests' reference point. A thread transforms 8 consecutive elements (one 16-byte
// load of 16-bit x), one segment (rotate8 / unrotate8); grid-stride over the 8-element vectors.
// It launches its dependents right after its own wait (kbit_common.cuh): the GEMV that reads its
// output then loads its first weight tiles and builds its table while the rotation runs.

constexpr int kRotateThreads = 256;

template <typename T, bool kInverse>
__global__ void __launch_bounds__(kRotateThreads) rotate_kernel(RotateParams p) {
  wait_for_primary_grid();  // a programmatic dependent launch (sm_90+): x may be the previous kernel's output
  allow_dependent_launch();
  union Vec { uint4 u[sizeof(T) / 2]; T e[8]; };
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  const int64_t per_row = p.k / 8, total = p.m * per_row;
  // 16-byte loads where every row start is aligned (out is contiguous and 16-byte aligned).
  const bool vec = p.x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row, col = (i - row * per_row) * 8;
    const T* src = x + row * p.x_stride + col;
    Vec in;
    if (vec) {
#pragma unroll
      for (int j = 0; j < static_cast<int>(sizeof(T)) / 2; ++j)
        in.u[j] = __ldg(reinterpret_cast<const uint4*>(src) + j);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) in.e[e] = src[e];
    }
    const uint32_t bits = __ldg(p.rot_signs + (col >> 5)) >> (col & 31);
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = to_float(in.e[e]);
    if constexpr (kInverse) unrotate8(v, bits);
    else rotate8(v, bits);
    Vec o;
#pragma unroll
    for (int e = 0; e < 8; ++e) o.e[e] = from_float<T>(v[e]);
#pragma unroll
    for (int j = 0; j < static_cast<int>(sizeof(T)) / 2; ++j) reinterpret_cast<uint4*>(out + i * 8)[j] = o.u[j];
  }
}

template <typename T>
cudaError_t launch_rotate(const RotateParams& p, cudaStream_t stream) {
  const int64_t threads = p.m * (p.k / 8);
  if (threads == 0) return cudaSuccess;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((threads + kRotateThreads - 1) / kRotateThreads, int64_t{1} << 20));
  const KernelLaunch launch(blocks, kRotateThreads, 0, stream, 1, use_pdl());
  return p.inverse ? cudaLaunchKernelEx(&launch.config, rotate_kernel<T, true>, p)
                   : cudaLaunchKernelEx(&launch.config, rotate_kernel<T, false>, p);
}

}  // namespace kbit
