"""GPU tests: ``kbit::decode_attention`` (hf_kbit/backends/triton_kernels.py) against the reference.

The reference is ``packed_sdpa`` (scaled_dot_product_attention on the packed query) in float32 on
the same inputs; the CPU tests hold ``packed_sdpa`` to transformers' own sdpa attention.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_dense_model

import importlib.util

import hf_kbit  # noqa: F401  (registers kbit_decode)
from hf_kbit import _ops, attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]

DEVICE = "cuda"
# Output tolerance against the float32 reference: the kernel rounds the probabilities to the input
# dtype for the tensor-core product with V, and the output to it.
ATOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def make_inputs(batch, q_heads, kv_heads, kv_len, head_dim, dtype, mask_kind, mask_batch=None, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, q_heads, 1, head_dim, device=DEVICE, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, device=DEVICE, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, device=DEVICE, generator=g).to(dtype)
    mask_batch = batch if mask_batch is None else mask_batch
    lengths = torch.randint(1, kv_len + 1, (mask_batch,), device=DEVICE, generator=g)
    lengths[0] = kv_len  # one row attends everywhere
    keep = torch.arange(kv_len, device=DEVICE)[None, :] < lengths[:, None]
    keep = keep[:, None, None, :]
    if mask_kind == "none":
        return q, k, v, None
    if mask_kind == "bool":
        return q, k, v, keep
    return q, k, v, torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)  # additive, as transformers builds


def reference(q, k, v, mask, scale):
    m = mask if mask is None or mask.dtype == torch.bool else mask.float()
    return attention.packed_sdpa(q.float(), k.float(), v.float(), m, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,kv_len,head_dim",
    [
        (1, 32, 8, 256, 128),  # Llama-3-8B
        (3, 32, 8, 1000, 128),
        (2, 14, 2, 77, 64),  # Qwen2.5-0.5B: group 7
        (1, 16, 16, 300, 64),  # no grouping
        (2, 8, 1, 4100, 96),  # multi-query, head_dim not a power of two
        (1, 64, 4, 130, 256),  # group 16
        (1, 4, 2, 1, 32),  # one key
    ],
)
@pytest.mark.parametrize("slices", [0, 1, 3, 40])
def test_kernel_matches_reference(batch, q_heads, kv_heads, kv_len, head_dim, dtype, mask_kind, slices):
    q, k, v, mask = make_inputs(batch, q_heads, kv_heads, kv_len, head_dim, dtype, mask_kind)
    scale = head_dim**-0.5
    out = torch.ops.kbit.decode_attention(q, k, v, mask, scale, slices)
    assert out.shape == (batch, 1, q_heads, head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(q, k, v, mask, scale), atol=ATOL[dtype], rtol=0)


def test_kernel_takes_a_broadcast_mask_and_strided_query():
    q, k, v, mask = make_inputs(3, 32, 8, 200, 128, torch.bfloat16, "bool", mask_batch=1)
    q = torch.cat([q, torch.zeros_like(q)], dim=-1)[..., :128]  # heads 256 elements apart, as in a q/k/v slice
    assert q.stride(1) == 256
    out = torch.ops.kbit.decode_attention(q, k, v, mask, 0.1)
    torch.testing.assert_close(out.float(), reference(q, k, v, mask, 0.1), atol=ATOL[torch.bfloat16], rtol=0)


def test_kernel_is_deterministic_and_replays_in_a_cuda_graph():
    q, k, v, mask = make_inputs(1, 32, 8, 2048, 128, torch.bfloat16, "bool")
    eager = torch.ops.kbit.decode_attention(q, k, v, mask, 0.088)
    assert torch.equal(eager, torch.ops.kbit.decode_attention(q, k, v, mask, 0.088))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.kbit.decode_attention(q, k, v, mask, 0.088)  # warm up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.kbit.decode_attention(q, k, v, mask, 0.088)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def greedy(model, ids, compiled: bool):
    kwargs = dict(max_new_tokens=24, do_sample=False, cache_implementation="static", return_dict_in_generate=True,
                  output_logits=True)
    if not compiled:
        kwargs["disable_compile"] = True
    out = model.generate(ids, **kwargs)
    return out.sequences, torch.stack(out.logits, 1).float()


@pytest.mark.parametrize("compiled", [False, True])
def test_generate_matches_sdpa(compiled):
    """A Llama with 4 query heads per key/value head decodes the same tokens with kbit_decode as with sdpa,
    eagerly and with generate's static-cache compile (CUDA graphs), and the kernel is what ran."""
    torch._dynamo.reset()
    model = tiny_dense_model("llama", dtype=torch.float16, hidden_size=256, num_attention_heads=8,
                             num_key_value_heads=2).to(DEVICE)
    ids = torch.randint(0, 256, (2, 11), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    ref_tokens, ref_logits = greedy(model, ids, compiled)
    torch._dynamo.reset()
    model.set_attn_implementation("kbit_decode")
    calls = []
    original = _ops.packed_sdpa  # the op's reference, which the CUDA implementation falls back to
    _ops.packed_sdpa = attention.packed_sdpa = lambda *a: calls.append(1) or original(*a)  # the kernel must serve
    try:
        tokens, logits = greedy(model, ids, compiled)
    finally:
        _ops.packed_sdpa = attention.packed_sdpa = original
        torch._dynamo.reset()
    assert not calls
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=2e-2, rtol=0)
