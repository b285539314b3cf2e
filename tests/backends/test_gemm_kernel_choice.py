"""The GEMM kernel choice of the library's planner (kbit_set_gemm_kernel, set_gemm_kernel) and the C ABI's
refusals of the warp-specialized grouped GEMM, checked before any CUDA call: these run without a GPU
wherever the library loads."""

from __future__ import annotations

import pytest

from hf_kbit import _lib, kernel_table

pytestmark = pytest.mark.skipif(not _lib.available(),
                                reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)")


def test_set_gemm_kernel_takes_the_planner_codes():
    lib = _lib.load()
    for code in (0, 1, 2, -1):
        _lib.check(lib.kbit_set_gemm_kernel(code), "set_gemm_kernel")
    with pytest.raises(ValueError, match=r"gemm must be -1 .*got 3"):
        _lib.check(lib.kbit_set_gemm_kernel(3), "set_gemm_kernel")


def test_backend_set_gemm_kernel_names_the_kernels():
    from hf_kbit.backends import crossovers, cuda

    for name in (*crossovers.GEMM_KERNELS, None):
        cuda.set_gemm_kernel(name)
    with pytest.raises(ValueError, match="set_gemm_kernel: name must be one of"):
        cuda.set_gemm_kernel("cutlass")


def test_set_mm_crossovers_takes_the_warp_specialized_kernel():
    import ctypes

    lib = _lib.load()
    weights, max_m = (ctypes.c_int64 * 1)(0), (ctypes.c_int64 * 1)(1 << 31)
    _lib.check(lib.kbit_set_mm_crossovers(2, 4, 16, 1, weights, max_m), "set_mm_crossovers")
    with pytest.raises(ValueError, match="gemm must be 0 .*got 3"):
        _lib.check(lib.kbit_set_mm_crossovers(3, 4, 16, 1, weights, max_m), "set_mm_crossovers")
    from hf_kbit.backends import cuda

    cuda.load_crossovers()  # back to the file's values


def test_grouped_gemm_workspace_size():
    lib = _lib.load()
    assert lib.kbit_grouped_gemm_workspace_size(4096, 128) == 4 + 4 * (4096 // 64 + 128 + 1)
    assert lib.kbit_grouped_gemm_workspace_size(0, 1) == 4 + 4 * 2
    assert lib.kbit_grouped_gemm_workspace_size(10, 0) == -1


def _grouped(lib, bits=4, s=100, e=8, n=64, k=128, x_stride=128, ptr=16):
    return lib.kbit_grouped_gemm(0, None, ptr, x_stride, 2, ptr, ptr, ptr, ptr, ptr, ptr, bits, s, e, n, k, ptr, ptr,
                                 1 << 20)


def test_grouped_gemm_refusals_name_the_argument():
    lib = _lib.load()
    bits = max(kernel_table.BITS) + 1
    with pytest.raises(ValueError, match=f"unsupported kernel=wgmma_ws_grouped, bits={bits}, dtype=bfloat16"):
        _lib.check(_grouped(lib, bits=bits), "grouped_gemm")
    with pytest.raises(ValueError, match="need 0 <= s < 2.31 and 1 <= e <= 2.20, got s=-1 e=8"):
        _lib.check(_grouped(lib, s=-1), "grouped_gemm")
    with pytest.raises(ValueError, match="in_features must be positive"):
        _lib.check(_grouped(lib, k=0), "grouped_gemm")
    _lib.check(_grouped(lib, s=0), "grouped_gemm")  # nothing to do: no GPU needed
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        with pytest.raises(ValueError, match="needs an sm_90 GPU"):
            _lib.check(_grouped(lib), "grouped_gemm")


def test_set_wgmma_ws_plan_names_bad_values():
    from hf_kbit.backends import cuda

    cuda.set_wgmma_ws_plan(4, 3)
    cuda.set_wgmma_ws_plan(None, None)
    with pytest.raises(ValueError, match="nb must be 0 .*got 3"):
        cuda.set_wgmma_ws_plan(3)
    with pytest.raises(ValueError, match="splits must be 0 .*got 9"):
        cuda.set_wgmma_ws_plan(1, 9)


def test_gemm_kernel_follows_the_choice_where_the_gpu_has_sm90a_code():
    import torch

    from hf_kbit.backends import cuda

    sm90a = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    try:
        cuda.set_gemm_kernel("wgmma_ws")
        assert cuda.gemm_kernel(0) == ("wgmma_ws" if sm90a else "mma")
        cuda.set_gemm_kernel("mma")
        assert cuda.gemm_kernel(0) == "mma"
    finally:
        cuda.set_gemm_kernel(None)
