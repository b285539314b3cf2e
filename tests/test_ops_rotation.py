"""The kbit ops with ``signs`` (format v3, a rotated layer) against a slow, obviously correct reference: the packed
weight dequantized in its rotated basis, turned back by the dense rotation matrix of tests/test_rotation.py (built
element by element in float64), and an explicit float64 matmul in the original basis."""

import pytest
import torch

from hf_kbit import _ops, rotation
from hf_kbit import format as fmt
from test_rotation import dense_rotation
from tolerance import close_rel

BITS = pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS, ids=lambda b: f"k{b}")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
SEED = 3
N, K = 40, 192  # N not a multiple of the 16-row tile, K a multiple of 64 but not of the 128-column tile
# Op output against the float64 reference, relative to its max |value|: float32 butterflies and accumulation,
# one rounding of x R to x's dtype (bf16: 2**-8 per element) and one of the result.
ROT_ATOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# dequantize: the float32 reconstruction turned back by float32 butterflies, then one rounding to dtype.
DEQUANT_ATOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3}
# gradcheck in float32 (the ops take no float64 activations): as tests/test_ops_autograd.py.
GRADCHECK = dict(eps=1e-2, atol=1e-3, rtol=1e-3, fast_mode=True)


def rotated_packed(bits, lead=(), n=N, k=K):
    """A weight quantized in its rotated basis: ``(packed tensors, sign words, W_hat [.., n, k] float64 in the
    original basis)``, W_hat by the dense matrix: dequantize(W R quantized) @ R^T."""
    torch.manual_seed(bits)
    w = torch.randn(*lead, n, k)
    words = rotation.sign_words(k, SEED)
    cb = fmt.make_codebook(None, bits)
    packed = (*torch.ops.kbit.quantize(rotation.rotate_words(w, words), cb), cb)
    r = dense_rotation(k, fmt.ROTATION_BLOCK, SEED)
    return packed, words, fmt.dequantize(*packed, k, torch.float64) @ r.T


@BITS
@DTYPES
def test_dequantize_with_signs_is_the_original_basis(bits, dtype):
    packed, words, w = rotated_packed(bits)
    out = torch.ops.kbit.dequantize(*packed, K, dtype, words)
    assert out.dtype == dtype and out.shape == (N, K)
    close_rel(out, w, DEQUANT_ATOL[dtype])
    assert torch.equal(torch.ops.kbit.dequantize(*packed, K, dtype, None), torch.ops.kbit.dequantize(*packed, K, dtype))


@BITS
@DTYPES
def test_mm_with_signs_is_x_times_the_original_weight(bits, dtype):
    packed, words, w = rotated_packed(bits)
    x = torch.randn(2, 5, K).to(dtype)
    out = torch.ops.kbit.mm(x, *packed, K, words)
    assert out.dtype == dtype and out.shape == (2, 5, N)
    close_rel(out, x.double() @ w.T, ROT_ATOL[dtype])


@DTYPES
def test_mm_rotates_x_in_float32_and_rounds_it_once(dtype):
    """The reference's exact semantics: x R in float32, rounded to x's dtype, times the rotated weight."""
    packed, words, _ = rotated_packed(4)
    x = torch.randn(3, K).to(dtype)
    staged = rotation.rotate(x.float(), fmt.ROTATION_BLOCK, SEED).to(dtype)
    assert torch.equal(torch.ops.kbit.mm(x, *packed, K, words), torch.ops.kbit.mm(staged, *packed, K))


@BITS
@DTYPES
def test_prologue_ops_with_signs(bits, dtype):
    packed, words, w = rotated_packed(bits)
    x, residual, up = (torch.randn(3, K).to(dtype) for _ in range(3))
    norm = (1 + 0.1 * torch.randn(K)).to(dtype)
    out = torch.ops.kbit.mm_rmsnorm(x, norm, 1e-6, *packed, K, words)
    close_rel(out, _ops.rms_norm(x, norm, 1e-6).double() @ w.T, ROT_ATOL[dtype])
    out, total = torch.ops.kbit.mm_add_rmsnorm(x, residual, norm, 1e-6, *packed, K, words)
    assert torch.equal(total, x + residual)
    close_rel(out, _ops.rms_norm(x + residual, norm, 1e-6).double() @ w.T, ROT_ATOL[dtype])
    out = torch.ops.kbit.mm_silu_mul(x, up, *packed, K, words)
    close_rel(out, _ops.silu_mul(x, up).double() @ w.T, ROT_ATOL[dtype])


@BITS
@DTYPES
@pytest.mark.parametrize("routing", ["own", "precomputed"])
def test_grouped_mm_with_signs(bits, dtype, routing):
    packed, words, w = rotated_packed(bits, lead=(4,), n=24)
    ids = torch.tensor([3, 3, 0, -1, 1, 3, 2])
    extra = _ops.expert_offsets(ids, 4) if routing == "precomputed" else (None, None)
    x = torch.randn(7, K).to(dtype)
    out = torch.ops.kbit.grouped_mm(x, ids, *packed, K, *extra, words)
    expected = torch.stack([w[e] @ x[s].double() if 0 <= e < 4 else torch.zeros(24, dtype=torch.float64)
                            for s, e in enumerate(ids.tolist())])
    close_rel(out, expected, ROT_ATOL[dtype])


@BITS
@DTYPES
def test_grad_x_ops_with_signs(bits, dtype):
    packed, words, w = rotated_packed(bits)
    grad = torch.randn(2, 3, N).to(dtype)
    out = torch.ops.kbit.mm_grad_x(grad, *packed, K, words)
    assert out.dtype == dtype and out.shape == (2, 3, K)
    close_rel(out, grad.double() @ w, ROT_ATOL[dtype])
    packed, words, w = rotated_packed(bits, lead=(3,), n=24)
    ids = torch.tensor([2, 0, -1, 2, 1])
    grad = torch.randn(5, 24).to(dtype)
    out = torch.ops.kbit.grouped_mm_grad_x(grad, ids, *packed, K, None, None, words)
    expected = torch.stack([grad[s].double() @ w[e] if 0 <= e < 3 else torch.zeros(K, dtype=torch.float64)
                            for s, e in enumerate(ids.tolist())])
    close_rel(out, expected, ROT_ATOL[dtype])


@BITS
def test_backward_through_mm_and_grouped_mm_with_signs(bits):
    packed, words, w = rotated_packed(bits)
    x = torch.randn(4, K, requires_grad=True)
    grad = torch.randn(4, N)
    torch.ops.kbit.mm(x, *packed, K, words).backward(grad)
    close_rel(x.grad, grad.double() @ w, ROT_ATOL[torch.float32])
    assert torch.autograd.gradcheck(lambda x: torch.ops.kbit.mm(x, *packed, K, words), (x.detach().requires_grad_(),),
                                    **GRADCHECK)
    packed, words, w = rotated_packed(bits, lead=(3,), n=24)
    ids = torch.tensor([2, 0, -1, 2, 1])
    fn = lambda x: torch.ops.kbit.grouped_mm(x, ids, *packed, K, None, None, words)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (torch.randn(5, K, requires_grad=True),), **GRADCHECK)


@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"k{b}")
def test_opcheck_with_signs(bits):
    packed, words, _ = rotated_packed(bits)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    norm = torch.ones(K, dtype=torch.bfloat16)
    checks = [
        (torch.ops.kbit.dequantize.default, (*packed, K, torch.bfloat16, words)),
        (torch.ops.kbit.mm.default, (x, *packed, K, words)),
        (torch.ops.kbit.mm_rmsnorm.default, (x, norm, 1e-6, *packed, K, words)),
        (torch.ops.kbit.mm_add_rmsnorm.default, (x, x.clone(), norm, 1e-6, *packed, K, words)),
        (torch.ops.kbit.mm_silu_mul.default, (x, x.clone(), *packed, K, words)),
        (torch.ops.kbit.mm_grad_x.default, (torch.randn(3, N), *packed, K, words)),
    ]
    epacked, ewords, _ = rotated_packed(bits, lead=(3,), n=24)
    ids = torch.tensor([2, 0, 2, 1])
    order, offsets = _ops.expert_offsets(ids, 3)
    checks += [
        (torch.ops.kbit.grouped_mm.default, (torch.randn(4, K), ids, *epacked, K, None, None, ewords)),
        (torch.ops.kbit.grouped_mm.default, (torch.randn(4, K), ids, *epacked, K, order, offsets, ewords)),
        (torch.ops.kbit.grouped_mm_grad_x.default, (torch.randn(4, 24), ids, *epacked, K, None, None, ewords)),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args)


BAD_SIGNS = {
    "dtype": (lambda words: words.long(), "signs must be int32 sign words"),
    "shape": (lambda words: words[:-1], r"signs must be \[6\] \(in_features / 32\)"),
}


@pytest.mark.parametrize("bad", list(BAD_SIGNS), ids=list(BAD_SIGNS))
def test_bad_signs_are_refused_naming_the_argument(bad):
    packed, words, _ = rotated_packed(3)
    change, message = BAD_SIGNS[bad]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kbit.mm(torch.randn(2, K), *packed, K, change(words))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kbit.dequantize(*packed, K, torch.float32, change(words))


def test_signs_need_in_features_a_multiple_of_64():
    cb = fmt.make_codebook(None, 3)
    k = 96  # whole 32-element blocks, but not whole 64-element rotation segments
    packed = (*torch.ops.kbit.quantize(torch.randn(16, k), cb), cb)
    with pytest.raises(RuntimeError, match="signs: a rotated layer needs in_features a multiple of 64, got 96"):
        torch.ops.kbit.mm(torch.randn(2, k), *packed, k, rotation.sign_words(k))


def test_signs_on_another_device_are_refused():
    packed, words, _ = rotated_packed(3)
    with pytest.raises(RuntimeError, match="signs must be on the packed weight's device"):
        _ops._check_signs(words.to("meta"), K, packed[0])
