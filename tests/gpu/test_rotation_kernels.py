"""GPU tests of the kernels' side of rotation (issue 34 item 3, hf_kbit/rotation.py) against the PyTorch
reference: the standalone rotation kernel, dequantize with the sign words, and every path of kbit::mm,
its prologues and grouped_mm on a rotated layer.

A rotated layer stores the quantized ``rotate(W)`` (``W R``, ``R = diag(s) B``, ``B`` = H64 / 8 on
64-element segments of K); the kernels multiply ``x R`` rounded once to x's dtype, so the reference
of a matmul is ``rotate(x).to(dtype) @ W'^T`` with ``W'`` the rotated weight as stored, and that of
dequantize is ``unrotate(W')``.

TODO(merge): hf_kbit/_ops.py gains the trailing ``signs`` argument of the op schemas in parallel (the
Python side of issue 34). Until the merge these tests call the CUDA backend's functions
(``backend._mm_cuda`` and the like, the ops' CUDA implementations) with ``signs=`` directly; each such
call is marked ``# op:`` with the op it stands for, to be switched to ``torch.ops.kbit.*``.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu -q``.
"""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch

from hf_kbit import _lib, rotation
from hf_kbit import format as fmt
from kernel_cases import table_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)"),
]

DEVICE = "cuda"
BLOCK = 64  # the kernels' Hadamard segment (rotation.DEFAULT_BLOCK)
SEED = 12345  # not the default seed: the kernels know only the sign words
# ||out - ref|| / ||ref|| of a matmul against a float64 product of the rounded x R with the
# reference weight: the output's rounding and the weight's in the activation dtype (as
# tests/gpu/test_cuda_kernels.py's MM_REL_TOL; x R itself is rounded exactly as the reference's).
MM_REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def backend():
    from hf_kbit.backends import cuda

    return cuda


def sign_words(k: int, seed: int = SEED, device=DEVICE) -> torch.Tensor:
    """The kernels' sign words of ``rotation.signs(k, seed)``: int32 [k / 32], bit e % 32 of word e // 32
    set where s_e = -1 (built here independently of the backend's ``sign_words``)."""
    negative = (rotation.signs(k, seed) < 0).nonzero().flatten()
    words = torch.zeros(k // 32, dtype=torch.int64)
    words.index_add_(0, negative // 32, torch.ones_like(negative) << (negative % 32))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(device)


def rotate_ref(x: torch.Tensor, seed: int = SEED) -> torch.Tensor:
    """``x R`` rounded once to x's dtype: the activation every rotated matmul multiplies."""
    return rotation.rotate(x, BLOCK, seed).to(x.dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@functools.lru_cache(maxsize=None)
def rotated_packed(n: int, k: int, bits: int, seed: int = SEED, experts: int = 0):
    """A rotated layer on the GPU: ``((planes, block_scales, row_scales, codebook), W', signs)`` with
    ``W'`` the float32 dequantization of the stored (rotated) weight; ``experts`` > 0 stacks that many
    weights on a leading dim (one shared codebook). Quantized by the GPU kernel (bit-exact with the
    reference: test_cuda_kernels.py), the rotation by the reference."""
    g = torch.Generator().manual_seed(seed + 1000 * bits + n + 7 * k + 31 * experts)
    shape = (experts, n, k) if experts else (n, k)
    w = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g).add(0.1)
    cb = fmt.make_codebook(None, bits).to(DEVICE)
    planes, scales, rs = torch.ops.kbit.quantize(rotation.rotate(w, BLOCK, seed).to(DEVICE), cb)
    wq = torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.float32)
    return (planes, scales, rs, cb), wq, sign_words(k, seed)


def test_sign_words_helper_matches_the_backend():
    assert torch.equal(sign_words(4096, 7), backend().sign_words(4096, 7, DEVICE))


# ---------------------------------------------------------------------------- the standalone rotation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k", [(1, 64), (3, 4096), (17, 192), (600, 576), (5, 14336)], ids=lambda v: str(v))
def test_rotate_kernel_bit_exact(dtype, m, k):
    """kbit_rotate: float32 in the reference's order, one rounding: bit-exact with rotate(x).to(dtype)."""
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    got = backend().rotate(x, sign_words(k))
    assert got.dtype == dtype and got.shape == (m, k)
    assert torch.equal(got, rotate_ref(x))


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned-rows", "unaligned-rows"])
def test_rotate_kernel_strided_rows(offset):
    """Rows of a wider buffer (16-byte vector loads) and at an odd element offset (scalar loads)."""
    m, k = 9, 320
    wide = torch.randn(m, k + 64 + offset, device=DEVICE, dtype=torch.bfloat16)
    x = wide[:, offset:offset + k]
    assert not x.is_contiguous()
    assert torch.equal(backend().rotate(x, sign_words(k)), rotate_ref(x.contiguous()))


def test_rotation_refuses_bad_signs_before_launch():
    be = backend()
    x = torch.randn(2, 100, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in_features % 64"):
        be.rotate(x, torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"signs must be int32 \[in_features // 32\]"):
        be.rotate(torch.randn(2, 128, device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE))
    # The C ABI checks K itself (rot_signs is never read before the check).
    lib = _lib.load()
    fake = ctypes.c_void_p(16)
    rc = lib.kbit_rotate(0, None, ctypes.c_void_p(16), 100, 2, 1, 100, fake, ctypes.c_void_p(16))
    with pytest.raises(ValueError, match="in_features % 64 == 0"):
        _lib.check(rc, "rotate")


# ---------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("shape", [(257, 576), (16, 128), (5, 64), (33, 4160)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bits,dtype", table_cases("dequantize"))
def test_dequantize_unrotates_bit_exact(bits, dtype, shape):
    """dequantize with the sign words returns W' R^T: the reference's float32 unrotate of the float32
    dequantization, rounded once to dtype, bit for bit (the same float32 operations in the same order).
    4160: a last K tile of one segment."""
    n, k = shape
    (planes, scales, rs, cb), wq, signs = rotated_packed(n, k, bits)
    ref = rotation.unrotate(wq, BLOCK, SEED).to(dtype)
    got = backend()._dequantize_cuda(planes, scales, rs, cb, k, dtype, signs)  # op: kbit::dequantize
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, ref)


def test_dequantize_unrotates_experts():
    """A stacked [E, N, K] weight (MoE experts share K and so the rotation)."""
    e, n, k, bits = 3, 40, 320, 4
    (planes, scales, rs, cb), wq, signs = rotated_packed(n, k, bits, experts=e)
    got = backend()._dequantize_cuda(planes, scales, rs, cb, k, torch.bfloat16, signs)  # op: kbit::dequantize
    assert torch.equal(got, rotation.unrotate(wq, BLOCK, SEED).to(torch.bfloat16))


def test_dequantize_without_signs_is_unchanged():
    """signs=None: the stored weight as it is (today's kernel), bit-exact with the reference."""
    n, k, bits = 100, 640, 3
    (planes, scales, rs, cb), wq, _ = rotated_packed(n, k, bits)
    got = backend()._dequantize_cuda(planes, scales, rs, cb, k, torch.bfloat16, None)
    assert torch.equal(got, wq.to(torch.bfloat16))
    assert torch.equal(got, torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.bfloat16))
