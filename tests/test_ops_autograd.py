"""Backward of the kbit ops: dX = dY @ W for kbit::mm and kbit::grouped_mm, against the dequantized weight.

The ops take bfloat16, float16 and float32 activations (no float64), so gradcheck runs in float32;
the ops are linear in x, so central differences are exact up to rounding and the float32 check is
sharp with the tolerances below.
"""

import pytest
import torch

import hf_kbit  # noqa: F401
from hf_kbit import _ops
from hf_kbit import format as fmt
from tolerance import close_rel

BITS = pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS, ids=lambda b: f"k{b}")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
# dX from the op against grad.double() @ W.double(), relative to max |dX|: float32 accumulation,
# then one rounding of the result to the activation dtype.
GRAD_ATOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# torch.autograd.gradcheck in float32 on a linear op: eps large, rounding of f(x +- eps) only; fast mode
# (random projections of the Jacobian) keeps the reference's evaluations few.
GRADCHECK = dict(eps=1e-2, atol=1e-3, rtol=1e-3, fast_mode=True)


def packed(n, k, bits, lead=()):
    torch.manual_seed(0)
    w = torch.randn(*lead, n, k)
    cb = fmt.make_codebook(None, bits)
    return (*torch.ops.kbit.quantize(w, cb), cb)


@BITS
@DTYPES
def test_mm_grad_x_is_grad_times_dequantized_weight(bits, dtype):
    n, k = 40, 300  # N not a multiple of the 16-row tile, K not of the 128-column tile
    planes, scales, rows, cb = packed(n, k, bits)
    x = torch.randn(2, 5, k).to(dtype).requires_grad_()
    grad = torch.randn(2, 5, n).to(dtype)
    torch.ops.kbit.mm(x, planes, scales, rows, cb, k).backward(grad)
    w = fmt.dequantize(planes, scales, rows, cb, k, torch.float64)
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    close_rel(x.grad, grad.double() @ w, GRAD_ATOL[dtype])


@BITS
def test_mm_gradcheck(bits):
    planes, scales, rows, cb = packed(20, 130, bits)
    x = torch.randn(3, 130, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: torch.ops.kbit.mm(x, planes, scales, rows, cb, 130), (x,), **GRADCHECK)


@BITS
def test_grouped_mm_gradcheck(bits):
    planes, scales, rows, cb = packed(24, 70, bits, lead=(4,))
    ids = torch.tensor([3, 3, 0, -1, 1, 3, 2])
    x = torch.randn(7, 70, requires_grad=True)
    fn = lambda x: torch.ops.kbit.grouped_mm(x, ids, planes, scales, rows, cb, 70)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), **GRADCHECK)


@BITS
@DTYPES
@pytest.mark.parametrize("routing", ["own", "precomputed"])
def test_grouped_mm_grad_x_per_row(bits, dtype, routing):
    k, n = 70, 24
    planes, scales, rows, cb = packed(n, k, bits, lead=(4,))
    ids = torch.tensor([3, 3, 0, -1, 1, 3, 2, 4])  # -1 and 4: rows of no expert (expert-parallel sentinels)
    extra = _ops.expert_offsets(ids, 4) if routing == "precomputed" else ()
    x = torch.randn(8, k).to(dtype).requires_grad_()
    grad = torch.randn(8, n).to(dtype)
    torch.ops.kbit.grouped_mm(x, ids, planes, scales, rows, cb, k, *extra).backward(grad)
    w = fmt.dequantize(planes, scales, rows, cb, k, torch.float64)
    expected = torch.stack([grad[s].double() @ w[e] if 0 <= e < 4 else torch.zeros(k, dtype=torch.float64)
                            for s, e in enumerate(ids.tolist())])
    close_rel(x.grad, expected, GRAD_ATOL[dtype])
    assert torch.equal(x.grad[3], torch.zeros(k, dtype=dtype)) and torch.equal(x.grad[7], torch.zeros(k, dtype=dtype))


@BITS
def test_opcheck_with_autograd(bits):
    """opcheck with x requiring grad covers the autograd registration and the compiled (aot) backward."""
    n, k = 20, 130
    planes, scales, rows, cb = packed(n, k, bits)
    x = torch.randn(3, k, dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.kbit.mm.default, (x, planes, scales, rows, cb, k))
    torch.library.opcheck(torch.ops.kbit.mm_grad_x.default, (torch.randn(3, n), planes, scales, rows, cb, k))
    ep, es, er, ecb = packed(n, k, bits, lead=(3,))
    ids = torch.tensor([2, 0, 2, 1])
    xg = torch.randn(4, k, requires_grad=True)
    torch.library.opcheck(torch.ops.kbit.grouped_mm.default, (xg, ids, ep, es, er, ecb, k))
    order, offsets = _ops.expert_offsets(ids, 3)
    torch.library.opcheck(torch.ops.kbit.grouped_mm.default, (xg, ids, ep, es, er, ecb, k, order, offsets))
    torch.library.opcheck(torch.ops.kbit.grouped_mm_grad_x.default, (torch.randn(4, n), ids, ep, es, er, ecb, k))


def test_packed_tensors_take_no_gradient():
    planes, scales, rows, cb = packed(16, 64, 4)
    rows, cb = rows.clone().requires_grad_(), cb.clone().requires_grad_()
    x = torch.randn(2, 64, requires_grad=True)
    torch.ops.kbit.mm(x, planes, scales, rows, cb, 64).sum().backward()
    assert x.grad is not None and rows.grad is None and cb.grad is None


def test_grad_shape_mismatch_raises():
    planes, scales, rows, cb = packed(16, 128, 4)
    with pytest.raises(RuntimeError, match="out_features=16"):
        torch.ops.kbit.mm_grad_x(torch.randn(2, 15), planes, scales, rows, cb, 128)


def test_compiled_backward_matches_eager():
    """Forward and backward through torch.compile (aot_autograd: the backward graph holds kbit::mm_grad_x)."""
    n, k = 40, 300
    planes, scales, rows, cb = packed(n, k, 4)
    fn = lambda x: torch.ops.kbit.mm(torch.nn.functional.silu(x), planes, scales, rows, cb, k).square().sum()  # noqa: E731
    x = torch.randn(6, k, requires_grad=True)
    fn(x).backward()
    eager = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    torch.compile(fn, backend="aot_eager", fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, eager, atol=1e-5, rtol=1e-5)
