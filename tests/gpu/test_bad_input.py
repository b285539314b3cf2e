"""GPU tests: bad inputs to ``torch.ops.kbit.mm`` and ``KbitLinear`` on CUDA fail clearly, before any launch.

Wrong activation dtype, activations and weights on different devices, mismatched shapes and
malformed packed tensors must raise an exception whose message names the argument at fault,
without calling a kernel of the library (checked with a spy on the ctypes library). Inputs
that are merely laid out unusually (non-contiguous, offset views) must give the right answer.

Run on the GPU machine with ``scripts/run_gpu_tests.sh`` (or ``pytest -m gpu tests/gpu``).
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import hf_kbit
from hf_kbit import _lib
from hf_kbit import format as fmt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)"),
]

DEVICE = "cuda"
N, K, BITS = 300, 700, 4  # partial row tile (300 % 16) and partial K tile/block (700 % 128, 700 % 32)
# ||out - ref|| / ||ref|| against a float64 product with the reference-dequantized weight
# (as tests/gpu/test_cuda_kernels.py): one rounding of the output, or of the dequantized
# weight too above the GEMV's M, in the activation dtype.
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# Library functions that launch nothing (queries); any other kbit_* call counts as a launch.
_QUERY = re.compile(r"(_size|_last_error|_max_m|_abi_version|_plan)$")


def _backend():
    from hf_kbit.backends import cuda as backend

    return backend


class _LibrarySpy:
    """Stands in for the ctypes library: records every ``kbit_*`` call, then forwards it."""

    def __init__(self, lib):
        self._lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not name.startswith("kbit_") or not callable(fn):
            return fn

        def call(*args):
            self.calls.append(name)
            return fn(*args)

        return call

    def launches(self) -> list[str]:
        return [c for c in self.calls if not _QUERY.search(c)]


@contextlib.contextmanager
def spy_library():
    """Every library call made inside, including the eager fast path's bound ``kbit_gemv_run``."""
    backend = _backend()
    spy = _LibrarySpy(backend._LIB)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "_LIB", spy)
        if getattr(backend, "_run", None) is not None:
            run = backend._run

            def spied_run(*args):
                spy.calls.append("kbit_gemv_run")
                return run(*args)

            mp.setattr(backend, "_run", spied_run)
        yield spy


def assert_rejected(fn, exc, *patterns):
    """``fn()`` raises ``exc`` whose message matches every pattern, and nothing was launched."""
    with spy_library() as spy:
        with pytest.raises(exc) as info:
            fn()
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in the error message: {message}"
    assert spy.launches() == [], f"launched {spy.launches()} before rejecting the input"
    torch.cuda.synchronize()  # and the context is healthy (no asynchronous launch error)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(K, N, bias=True, device=DEVICE, dtype=torch.bfloat16)
    return hf_kbit.KbitLinear.from_linear(linear, bits=BITS).requires_grad_(False)


def packed(layer):
    return layer.planes, layer.block_scales, layer.row_scales, layer.codebook


def reference(layer, x, bias=False):
    """float64 ``x @ W.T (+ bias)`` with W dequantized by the PyTorch reference (on the CPU)."""
    w = fmt.dequantize(*(t.cpu() for t in packed(layer)), K, torch.float32).to(DEVICE)
    out = x.double() @ w.double().T
    return out + layer.bias.double() if bias else out


# ---------------------------------------------------------------------------- activation dtype


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.float64, torch.bool], ids=str)
def test_mm_rejects_activation_dtype(layer, dtype):
    x = torch.ones(2, K, device=DEVICE, dtype=dtype)
    assert_rejected(
        lambda: torch.ops.kbit.mm(x, *packed(layer), K), RuntimeError, r"\bx must be", re.escape(str(dtype))
    )


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64], ids=str)
def test_linear_rejects_activation_dtype(layer, dtype):
    x = torch.ones(1, K, device=DEVICE, dtype=dtype)
    assert_rejected(lambda: layer(x), TypeError, "KbitLinear input", re.escape(str(dtype)))


# ---------------------------------------------------------------------------- devices


@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"M{m}")
def test_mm_rejects_cpu_activations_with_cuda_weights(layer, m):
    x = torch.randn(m, K, dtype=torch.bfloat16)  # CPU
    assert_rejected(lambda: torch.ops.kbit.mm(x, *packed(layer), K), ValueError, r"\bx is on cpu", r"planes is on cuda")


@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"M{m}")
def test_linear_rejects_cpu_activations_with_cuda_weights(layer, m):
    x = torch.randn(m, K, dtype=torch.bfloat16)
    assert_rejected(lambda: layer(x), ValueError, r"\bx is on cpu", r"planes is on cuda")


def test_linear_rejects_cuda_activations_with_cpu_weights():
    torch.manual_seed(0)
    cpu_layer = hf_kbit.KbitLinear.from_linear(torch.nn.Linear(K, N, dtype=torch.bfloat16), bits=BITS)
    x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16)
    assert_rejected(lambda: cpu_layer(x), ValueError, r"\bx is on cuda", r"planes is on cpu")
    assert_rejected(
        lambda: torch.ops.kbit.mm(x, *packed(cpu_layer), K), ValueError, r"\bx is on cuda", r"planes is on cpu"
    )


@pytest.mark.parametrize("name", ["block_scales", "row_scales", "codebook"])
def test_mm_rejects_one_packed_tensor_on_cpu(layer, name):
    tensors = dict(zip(("planes", "block_scales", "row_scales", "codebook"), packed(layer)))
    tensors[name] = tensors[name].cpu()
    x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16)
    assert_rejected(lambda: torch.ops.kbit.mm(x, *tensors.values(), K), ValueError, rf"\b{name} is on cpu")


def test_dequantize_rejects_mixed_devices(layer):
    planes, block_scales, row_scales, codebook = packed(layer)
    assert_rejected(
        lambda: torch.ops.kbit.dequantize(planes, block_scales, row_scales.cpu(), codebook, K, torch.bfloat16),
        ValueError,
        r"row_scales is on cpu but planes is on cuda",
    )


# ---------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("features", [K - 1, K + 1, 2 * K], ids=lambda f: f"K{f}")
@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"M{m}")
def test_mm_rejects_activation_width(layer, m, features):
    x = torch.randn(m, features, device=DEVICE, dtype=torch.bfloat16)
    assert_rejected(
        lambda: torch.ops.kbit.mm(x, *packed(layer), K),
        RuntimeError,
        rf"\bx has {features} features",
        f"in_features={K}",
    )


@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"M{m}")
def test_linear_rejects_activation_width(layer, m):
    x = torch.randn(2, m, K + 128, device=DEVICE, dtype=torch.bfloat16)
    assert_rejected(lambda: layer(x), RuntimeError, rf"\bx has {K + 128} features", f"in_features={K}")


def test_mm_rejects_weight_packed_for_another_in_features(layer):
    """x and in_features agree with each other but not with the packed weight (K=700 -> 6 K tiles)."""
    other = 1000  # 8 K tiles
    x = torch.randn(1, other, device=DEVICE, dtype=torch.bfloat16)
    assert_rejected(
        lambda: torch.ops.kbit.mm(x, *packed(layer), other), RuntimeError, r"planes has shape", f"in_features={other}"
    )


def _bad_packed(layer, case):
    planes, block_scales, row_scales, codebook = packed(layer)
    if case == "planes_shape":
        return (planes[:, :-1], block_scales, row_scales, codebook), r"planes has shape"
    if case == "block_scales_shape":
        return (planes, block_scales[:-1], row_scales, codebook), r"block_scales has shape"
    if case == "row_scales_shape":  # N=300 -> 19 row tiles; 400 rows need 25
        return (planes, block_scales, torch.ones(400, device=DEVICE), codebook), r"planes has shape"
    if case == "codebook_size":
        return (planes, block_scales, row_scales, fmt.make_codebook(None, 3).to(DEVICE)), r"codebook has 8 entries"
    if case == "bits":
        planes6 = torch.zeros(*planes.shape[:-3], 6, *planes.shape[-2:], dtype=planes.dtype, device=DEVICE)
        return (planes6, block_scales, row_scales, codebook), r"planes\.shape\[-3\] \(bits\)"
    if case == "planes_dtype":
        return (planes.view(torch.uint8), block_scales, row_scales, codebook), r"planes must be int32"
    if case == "block_scales_dtype":
        return (planes, block_scales.to(torch.int32), row_scales, codebook), r"block_scales must be uint8"
    if case == "row_scales_dtype":
        return (planes, block_scales, row_scales.to(torch.bfloat16), codebook), r"row_scales must be float32"
    if case == "codebook_dtype":
        return (planes, block_scales, row_scales, codebook.half()), r"codebook must be float32"
    if case == "stacked":  # experts-style [E, ...] packed tensors are for grouped_mm
        stacked = tuple(t.unsqueeze(0).expand(2, *t.shape) for t in (planes, block_scales, row_scales))
        return (*stacked, codebook), r"row_scales"
    raise AssertionError(case)


BAD_PACKED = [
    "planes_shape",
    "block_scales_shape",
    "row_scales_shape",
    "codebook_size",
    "bits",
    "planes_dtype",
    "block_scales_dtype",
    "row_scales_dtype",
    "codebook_dtype",
    "stacked",
]


@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("case", BAD_PACKED)
def test_mm_rejects_malformed_packed_weight(layer, case, m):
    tensors, pattern = _bad_packed(layer, case)
    x = torch.randn(m, K, device=DEVICE, dtype=torch.bfloat16)
    assert_rejected(lambda: torch.ops.kbit.mm(x, *tensors, K), (RuntimeError, ValueError), pattern)


# ---------------------------------------------------------------------------- unusual layouts give the right answer


def _layouts(m: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The same kind of activations [m, K] in several non-standard memory layouts. (Only a tolerance
    holds: above the GEMV's M, cuBLAS reads a strided x as it is, in another summation order.)"""
    g = torch.Generator(device=DEVICE).manual_seed(m)
    base = torch.randn(m, K, device=DEVICE, generator=g).to(dtype)
    offset = torch.empty(m * K + 1, device=DEVICE, dtype=dtype)
    offset[1:].copy_(base.reshape(-1))
    wide = torch.zeros(m, 2 * K, device=DEVICE, dtype=dtype)
    wide[:, ::2] = base
    return {
        "transposed": base.T.contiguous().T,  # column-major
        "strided": wide[:, ::2],  # every other element
        "offset": offset[1:].view(m, K),  # contiguous, data pointer not 16-byte aligned
        "broadcast": base[:1].expand(m, K),  # stride 0 over rows
        "sliced_rows": torch.cat([base, base]).view(2, m, K)[1],  # contiguous, storage offset of m*K
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m", [1, 3, 8, 33], ids=lambda m: f"M{m}")
def test_unusual_activation_layouts_give_the_right_answer(layer, m, dtype):
    for name, x in _layouts(m, dtype).items():
        assert x.shape == (m, K)
        dense = x.contiguous()
        ref = reference(layer, dense)
        out = torch.ops.kbit.mm(x, *packed(layer), K)
        assert out.shape == (m, N) and out.dtype == dtype, name
        assert rel_err(out, ref) < REL_TOL[dtype], f"{name}: mm rel. error {rel_err(out, ref):.2e}"
        with torch.inference_mode():
            y = layer(x)
        assert rel_err(y, reference(layer, dense, bias=True)) < REL_TOL[dtype], f"{name}: KbitLinear"


@pytest.mark.parametrize("m", [1, 3, 64], ids=lambda m: f"M{m}")
def test_non_contiguous_packed_tensors_give_the_right_answer(layer, m):
    """Packed tensors that are views with the right shape but other strides (e.g. a slice of a
    larger buffer) are read by their strides, not as if contiguous."""
    views = []
    for t in packed(layer):
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=DEVICE)
        wide[..., 1::2] = t
        views.append(wide[..., 1::2])
    assert not any(v.is_contiguous() for v in views)
    x = torch.randn(m, K, device=DEVICE, dtype=torch.bfloat16)
    expected = torch.ops.kbit.mm(x, *packed(layer), K)
    assert torch.equal(torch.ops.kbit.mm(x, *views, K), expected)
    assert torch.equal(torch.ops.kbit.dequantize(*views, K, torch.bfloat16), layer.dequantize_weight(torch.bfloat16))
