// Instantiations for bits=2, dtype=__half (one file per (bits, dtype) keeps rebuilds small).
#include "../dequantize_kernel.cuh"
#include "../gemm_kernel.cuh"
#include "../gemv_kernel.cuh"
#include "../grouped_gemv_kernel.cuh"
#include "../quantize_kernel.cuh"
#include "../wgmma_kernel.cuh"

namespace kbit {
template cudaError_t launch_quantize<__half, 2>(const QuantizeParams&, cudaStream_t);
template cudaError_t launch_dequantize<__half, 2>(const DequantizeParams&, cudaStream_t);
template cudaError_t launch_gemv<2, __half, 1>(const MmParams&, int, cudaStream_t);
template cudaError_t launch_grouped_gemv<2, __half, 1>(const GroupedParams&, int, cudaStream_t);
template cudaError_t launch_gemv<2, __half, 2>(const MmParams&, int, cudaStream_t);
template cudaError_t launch_grouped_gemv<2, __half, 4>(const GroupedParams&, int, cudaStream_t);
template cudaError_t launch_gemm<2, __half, 2>(const MmParams&, dim3, cudaStream_t);
template cudaError_t launch_gemm<2, __half, 4>(const MmParams&, dim3, cudaStream_t);
template cudaError_t launch_gemm<2, __half, 8>(const MmParams&, dim3, cudaStream_t);
template cudaError_t launch_gemm<2, __half, 16>(const MmParams&, dim3, cudaStream_t);
template cudaError_t launch_wgmma_gemm<2, __half, 1>(const MmParams&, dim3, cudaStream_t);
template cudaError_t launch_wgmma_gemm<2, __half, 2>(const MmParams&, dim3, cudaStream_t);
template cudaError_t launch_wgmma_gemm<2, __half, 4>(const MmParams&, dim3, cudaStream_t);
}  // namespace kbit
