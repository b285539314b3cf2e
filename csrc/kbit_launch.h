// Launch templates, declared here and instantiated per (bits, dtype) in instantiations/*.cu
// so that the host API compiles without the kernels and a kernel edit rebuilds few files.
#pragma once

#include <cuda_runtime.h>

#include "kbit_params.h"

namespace kbit {

// A launch of a `grid` of CTAs of `block` threads for cudaLaunchKernelEx (config points at attrs:
// not copyable): in clusters of `cluster` CTAs along x where cluster > 1 (also the query of
// cudaOccupancyMaxActiveClusters), and as a programmatic dependent launch of the stream's
// previous kernel where `pdl`.
struct KernelLaunch {
  cudaLaunchAttribute attrs[2]{};
  cudaLaunchConfig_t config{};
  KernelLaunch(dim3 grid, int block, int smem, cudaStream_t stream, int cluster, bool pdl = false) {
    config.gridDim = grid;
    config.blockDim = dim3(static_cast<unsigned>(block));
    config.dynamicSmemBytes = static_cast<size_t>(smem);
    config.stream = stream;
    config.attrs = attrs;
    if (cluster > 1) {
      cudaLaunchAttribute& a = attrs[config.numAttrs++];
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = static_cast<unsigned>(cluster);
      a.val.clusterDim.y = 1;
      a.val.clusterDim.z = 1;
    }
    if (pdl) {
      cudaLaunchAttribute& a = attrs[config.numAttrs++];
      a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      a.val.programmaticStreamSerializationAllowed = 1;
    }
  }
  KernelLaunch(const KernelLaunch&) = delete;
  KernelLaunch& operator=(const KernelLaunch&) = delete;
};

template <typename T, int BITS>
cudaError_t launch_quantize(const QuantizeParams& p, cudaStream_t stream);

template <typename T, int BITS>
cudaError_t launch_dequantize(const DequantizeParams& p, cudaStream_t stream);

// kRotate: a rotated layer's instantiation, which rotates x as it stages it (rotation.cuh).
template <int BITS, typename T, int M, bool kRotate>
cudaError_t launch_gemv(const MmParams& p, int grid, cudaStream_t stream);

// Block records (int16 block_scales with offsets, format.py): the GEMV, unrotated, with or without a prologue.
template <int BITS, typename T, int NT>
cudaError_t launch_gemv_offsets(const MmParams& p, int grid, cudaStream_t stream);

template <int BITS, typename T, int NT>
cudaError_t launch_gemm(const MmParams& p, dim3 grid, cudaStream_t stream);

template <int BITS, typename T, int NB>
cudaError_t launch_wgmma_gemm(const MmParams& p, dim3 grid, cudaStream_t stream);

// Block records (int16 block_scales with offsets, format.py): the wgmma GEMM on x as it is (unrotated).
template <int BITS, typename T, int NB>
cudaError_t launch_wgmma_gemm_offsets(const MmParams& p, dim3 grid, cudaStream_t stream);

template <int BITS, typename T, int NB>
cudaError_t launch_wgmma_ws_gemm(const MmParams& p, dim3 grid, cudaStream_t stream);

template <int BITS, typename T, int NB>
cudaError_t launch_wgmma_ws_grouped(const GroupedParams& p, int grid, cudaStream_t stream);

template <int BITS, typename T, int NT, bool kRotate>
cudaError_t launch_grouped_gemv(const GroupedParams& p, int grid, cudaStream_t stream);

template <typename T>
cudaError_t launch_rotate(const RotateParams& p, cudaStream_t stream);

}  // namespace kbit
