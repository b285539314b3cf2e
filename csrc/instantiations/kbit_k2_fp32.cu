// Instantiations for bits=2, dtype=float (one file per (bits, dtype) keeps rebuilds small).
#include "../dequantize_kernel.cuh"
#include "../gemv_kernel.cuh"
#include "../quantize_kernel.cuh"

namespace kbit {
template cudaError_t launch_quantize<float, 2>(const QuantizeParams&, cudaStream_t);
template cudaError_t launch_dequantize<float, 2>(const DequantizeParams&, cudaStream_t);
}  // namespace kbit
