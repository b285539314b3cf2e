"""torch.ops.kbit: schemas, fake impls (opcheck), reference semantics, early shape checks."""

import pytest
import torch

import hf_kbit  # noqa: F401
from hf_kbit import format as fmt

# float32 reference matmul vs an independent float64 computation
MM_ATOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def packed(n, k, bits, lead=()):
    torch.manual_seed(0)
    w = torch.randn(*lead, n, k)
    cb = fmt.make_codebook(None, bits)
    return w, (*torch.ops.kbit.quantize(w, cb), cb)


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("shape", [(1, 33), (20, 130)], ids=str)
def test_opcheck_all_ops(shape, bits):
    n, k = shape
    w, (planes, scales, rows, cb) = packed(n, k, bits)
    torch.library.opcheck(torch.ops.kbit.quantize.default, (w, cb))
    torch.library.opcheck(torch.ops.kbit.dequantize.default, (planes, scales, rows, cb, k, torch.bfloat16))
    x = torch.randn(3, k, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.kbit.mm.default, (x, planes, scales, rows, cb, k))
    _, (ep, es, er, ecb) = packed(n, k, bits, lead=(3,))
    ids = torch.tensor([2, 0, 2, 1])
    torch.library.opcheck(torch.ops.kbit.grouped_mm.default, (torch.randn(4, k), ids, ep, es, er, ecb, k))
    torch.library.opcheck(torch.ops.kbit.expert_offsets.default, (torch.tensor([2, -1, 0, 2, 3, 1]), 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mm_matches_dequantized_matmul(dtype):
    n, k = 37, 300
    _, (planes, scales, rows, cb) = packed(n, k, 4)
    x = torch.randn(2, 5, k).to(dtype)
    out = torch.ops.kbit.mm(x, planes, scales, rows, cb, k)
    assert out.shape == (2, 5, n) and out.dtype == dtype
    w = fmt.dequantize(planes, scales, rows, cb, k, torch.float64)
    ref = x.double() @ w.T
    torch.testing.assert_close(out.double(), ref, atol=MM_ATOL[dtype] * ref.abs().max().item(), rtol=0)


def test_grouped_mm_matches_per_expert():
    k = 70
    _, (planes, scales, rows, cb) = packed(24, k, 3, lead=(4,))
    x = torch.randn(6, k)
    ids = torch.tensor([3, 3, 0, 1, 3, 2])
    out = torch.ops.kbit.grouped_mm(x, ids, planes, scales, rows, cb, k)
    w = fmt.dequantize(planes, scales, rows, cb, k)
    for t in range(6):
        torch.testing.assert_close(out[t], w[ids[t]] @ x[t], atol=1e-4, rtol=1e-4)


def test_grouped_mm_takes_precomputed_routing():
    """order/offsets from expert_offsets give the op's own result; malformed ones are refused."""
    from hf_kbit import _ops

    k = 70
    _, (planes, scales, rows, cb) = packed(24, k, 3, lead=(4,))
    x = torch.randn(7, k)
    ids = torch.tensor([3, 3, 0, -1, 1, 3, 2])
    order, offsets = _ops.expert_offsets(ids, 4)
    out = torch.ops.kbit.grouped_mm(x, ids, planes, scales, rows, cb, k, order, offsets)
    assert torch.equal(out, torch.ops.kbit.grouped_mm(x, ids, planes, scales, rows, cb, k))
    assert torch.equal(out[3], torch.zeros(24))
    torch.library.opcheck(torch.ops.kbit.grouped_mm.default, (x, ids, planes, scales, rows, cb, k, order, offsets))
    with pytest.raises(RuntimeError, match="offsets must be int64 \\[5\\]"):
        torch.ops.kbit.grouped_mm(x, ids, planes, scales, rows, cb, k, order, offsets[:4])
    with pytest.raises(RuntimeError, match="give both order and offsets"):
        torch.ops.kbit.grouped_mm(x, ids, planes, scales, rows, cb, k, order, None)


def test_shape_mismatch_raises_before_compute():
    _, (planes, scales, rows, cb) = packed(16, 128, 4)
    with pytest.raises(RuntimeError, match="in_features=128"):
        torch.ops.kbit.mm(torch.randn(2, 100), planes, scales, rows, cb, 128)
    with pytest.raises(RuntimeError, match="planes has shape"):
        torch.ops.kbit.mm(torch.randn(2, 256), planes, scales, rows, cb, 256)
    with pytest.raises(RuntimeError, match="x must be bfloat16, float16 or float32"):
        torch.ops.kbit.mm(torch.randn(2, 128).double(), planes, scales, rows, cb, 128)
    with pytest.raises(RuntimeError, match="codebook has"):
        torch.ops.kbit.mm(torch.randn(2, 128), planes, scales, rows, cb[:8], 128)
    with pytest.raises(RuntimeError, match="planes must be int32"):
        torch.ops.kbit.mm(torch.randn(2, 128), planes.long(), scales, rows, cb, 128)


def test_fake_mode_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(50, 300)
        cb = torch.empty(8)
        planes, scales, rows = torch.ops.kbit.quantize(w, cb)
        assert planes.shape == fmt.packed_shapes(50, 300, 3)["planes"]
        out = torch.ops.kbit.mm(torch.empty(7, 300, dtype=torch.bfloat16), planes, scales, rows, cb, 300)
        assert out.shape == (7, 50) and out.dtype == torch.bfloat16


EMPTY = [(0, 33), (20, 0), (0, 0)]


@pytest.mark.parametrize("shape", EMPTY, ids=lambda s: f"{s[0]}x{s[1]}")
def test_ops_on_empty_weights(shape):
    """out_features or in_features 0: the reference returns empty / all-zero results of the right shape."""
    n, k = shape
    w, (planes, scales, rows, cb) = packed(n, k, 3)
    assert torch.equal(torch.ops.kbit.dequantize(planes, scales, rows, cb, k, torch.bfloat16), w.bfloat16())
    x = torch.randn(4, k)
    assert torch.equal(torch.ops.kbit.mm(x, planes, scales, rows, cb, k), torch.zeros(4, n))
    torch.library.opcheck(torch.ops.kbit.mm.default, (x, planes, scales, rows, cb, k))
    _, (ep, es, er, ecb) = packed(n, k, 3, lead=(2,))
    out = torch.ops.kbit.grouped_mm(x, torch.tensor([1, 0, 1, 1]), ep, es, er, ecb, k)
    assert torch.equal(out, torch.zeros(4, n))


@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_decode_attention_reference_and_opcheck(mask):
    """kbit::decode_attention is defined with the other ops; its reference (no Triton needed) is
    scaled_dot_product_attention over the packed query heads, i.e. sdpa with repeat_kv."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 16, generator=g)
    k, v = torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    keep = torch.tensor([[True] * 5, [True, True, False, True, False]])[:, None, None, :]
    m = {"none": None, "bool": keep, "additive": torch.where(keep, 0.0, float("-inf"))}[mask]
    out = torch.ops.kbit.decode_attention(q, k, v, m, 0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=m, scale=0.25)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=0)
    torch.library.opcheck(torch.ops.kbit.decode_attention.default, (q, k, v, m, 0.25))


# ---------------------------------------------------------------------------- experts layer ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_glu_reference_is_silu_of_the_first_half_times_the_second(dtype):
    gate_up = (torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    out = torch.ops.kbit.silu_glu(gate_up)
    assert torch.equal(out, torch.nn.functional.silu(gate_up[:, :24]) * gate_up[:, 24:])
    torch.library.opcheck(torch.ops.kbit.silu_glu.default, (gate_up,))
    with pytest.raises(ValueError, match=r"gate_up must be \[S, 2I\], got shape \(5, 7\)"):
        torch.ops.kbit.silu_glu(torch.randn(5, 7))


def _combine_expected(y, ids, weights, num_experts):
    """float64, one pair at a time: each weight rounded to y's dtype, zero for a sentinel id."""
    num_tokens, top_k = weights.shape
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(top_k):
            if 0 <= ids[t * top_k + j] < num_experts:
                out[t] += weights[t, j].to(y.dtype).double() * y[t * top_k + j].double()
    return out


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_experts_combine_reference_weighs_each_tokens_experts(weights_dtype):
    """out[t] = sum_j w[t, j] y[t k + j]; sentinel ids (outside [0, E)) weigh 0 whatever their weight."""
    g = torch.Generator().manual_seed(1)
    num_tokens, top_k, num_experts = 3, 4, 6
    y = torch.randn(num_tokens * top_k, 40, generator=g).bfloat16()
    ids = torch.randint(0, num_experts, (num_tokens * top_k,), generator=g)
    ids[[1, 6, 11]] = torch.tensor([-1, num_experts, num_experts + 9])
    weights = torch.rand(num_tokens, top_k, generator=g).to(weights_dtype)
    weights[0, 1], weights[1, 2] = float("nan"), float("inf")  # the sentinels' weights
    out = torch.ops.kbit.experts_combine(y, ids, weights, num_experts)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, 40)
    torch.testing.assert_close(out.double(), _combine_expected(y, ids, weights, num_experts), atol=0, rtol=2**-8)
    torch.library.opcheck(torch.ops.kbit.experts_combine.default, (y, ids, weights, num_experts))
    with pytest.raises(RuntimeError, match=r"need y \[T\*k, N\], expert_ids \[T\*k\] and weights \[T, k\]"):
        torch.ops.kbit.experts_combine(y[:-1], ids[:-1], weights, num_experts)
