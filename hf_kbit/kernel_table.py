"""The kernel table: every (kernel, bits, dtype) the CUDA library is built for.

This list is the one source of what is supported. ``csrc/generate_kernels.py`` turns it into
the instantiation files (``csrc/instantiations/``) and the dispatch header
(``csrc/kbit_kernel_table.h``), through which the C ABI refuses anything else with
"unsupported kernel=..., bits=..., dtype=...". :data:`SUPPORTED_BITS` (the bit widths
``KbitConfig``, the CLI and the format accept), the tests' parametrizations and the benchmarks
read it too. tests/test_kernel_table.py fails when the generated files, the compiled library
or the Python constants disagree with it.

Pure Python, no torch: the generator and ``kbit-convert --help`` import it on their own.
"""

from __future__ import annotations

BITS = (2, 3, 4, 5)
# Activation / weight dtypes by C ABI code (the index): 0 float32, 1 float16, 2 bfloat16.
DTYPES = ("float32", "float16", "bfloat16")
HALF_DTYPES = DTYPES[1:]

# Kernel -> the dtypes it is built for, at every bit width of BITS. The matmul kernels stage x
# for the tensor cores in 16-bit, so float32 activations take dequantize + matmul.
KERNEL_DTYPES = {
    "quantize": DTYPES,
    "dequantize": DTYPES,
    "gemv": HALF_DTYPES,  # small M (csrc/gemv_kernel.cuh)
    "gemm": HALF_DTYPES,  # mid M, mma.sync (csrc/gemm_kernel.cuh)
    "wgmma_gemm": HALF_DTYPES,  # mid M on sm_90a (csrc/wgmma_kernel.cuh)
    "wgmma_ws_gemm": HALF_DTYPES,  # mid and large M on sm_90a, warp-specialized (csrc/wgmma_ws_kernel.cuh)
    "wgmma_ws_grouped": HALF_DTYPES,  # MoE prefill on sm_90a: its grouped calls (csrc/wgmma_ws_kernel.cuh)
    "grouped_gemv": HALF_DTYPES,  # MoE, all experts in one launch (csrc/grouped_gemv_kernel.cuh)
}
KERNELS = tuple(KERNEL_DTYPES)

TABLE: tuple[tuple[str, int, str], ...] = tuple(
    (kernel, bits, dtype) for kernel, dtypes in KERNEL_DTYPES.items() for bits in BITS for dtype in dtypes
)

def bits_of(kernel: str) -> tuple[int, ...]:
    """The bit widths ``kernel`` is built for, ascending."""
    return tuple(sorted({b for k, b, _ in TABLE if k == kernel}))


def dtypes_of(kernel: str) -> tuple[str, ...]:
    """The dtype names ``kernel`` is built for, in C ABI code order."""
    found = {d for k, _, d in TABLE if k == kernel}
    return tuple(d for d in DTYPES if d in found)


def supports(kernel: str, bits: int, dtype: str) -> bool:
    return (kernel, bits, dtype) in TABLE


# A bit width is supported when every kernel has it: a model then runs at that width on any path.
SUPPORTED_BITS = tuple(b for b in BITS if all(b in bits_of(kernel) for kernel in KERNELS))
