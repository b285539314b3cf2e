// Launch templates, declared here and instantiated per (bits, dtype) in instantiations/*.cu
// so that the host API compiles without the kernels and a kernel edit rebuilds few files.
#pragma once

#include <cuda_runtime.h>

#include "kbit_params.h"

namespace kbit {

// A launch of `grid` CTAs of `block` threads in clusters of `cluster` CTAs along x, for
// cudaLaunchKernelEx and cudaOccupancyMaxActiveClusters (config points at attr: not copyable).
struct ClusterLaunch {
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t config{};
  ClusterLaunch(int grid, int block, int smem, cudaStream_t stream, int cluster) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(cluster);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    config.gridDim = dim3(static_cast<unsigned>(grid));
    config.blockDim = dim3(static_cast<unsigned>(block));
    config.dynamicSmemBytes = static_cast<size_t>(smem);
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

template <typename T, int BITS>
cudaError_t launch_quantize(const QuantizeParams& p, cudaStream_t stream);

template <typename T, int BITS>
cudaError_t launch_dequantize(const DequantizeParams& p, cudaStream_t stream);

template <int BITS, typename T, int M>
cudaError_t launch_gemv(const MmParams& p, int grid, cudaStream_t stream);

template <int BITS, typename T, int NT>
cudaError_t launch_gemm(const MmParams& p, dim3 grid, cudaStream_t stream);

template <int BITS, typename T, int NB>
cudaError_t launch_wgmma_gemm(const MmParams& p, dim3 grid, cudaStream_t stream);

template <int BITS, typename T, int NT>
cudaError_t launch_grouped_gemv(const GroupedParams& p, int grid, cudaStream_t stream);

}  // namespace kbit
