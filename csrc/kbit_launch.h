// Launch templates, declared here and instantiated per (bits, dtype) in instantiations/*.cu
// so that the host API compiles without the kernels and a kernel edit rebuilds few files.
#pragma once

#include <cuda_runtime.h>

#include "kbit_params.h"

namespace kbit {

template <typename T, int BITS>
cudaError_t launch_quantize(const QuantizeParams& p, cudaStream_t stream);

template <typename T, int BITS>
cudaError_t launch_dequantize(const DequantizeParams& p, cudaStream_t stream);

template <int BITS, typename T, int M>
cudaError_t launch_gemv(const MmParams& p, int grid, cudaStream_t stream);

template <int BITS, typename T, int NT>
cudaError_t launch_gemm(const MmParams& p, dim3 grid, cudaStream_t stream);

template <int BITS, typename T, int NT>
cudaError_t launch_grouped_gemv(const GroupedParams& p, int grid, cudaStream_t stream);

}  // namespace kbit
