"""Gradients through frozen kbit modules: dX of KbitLinear (plain and fused members) and KbitExperts
against the same module dequantized (nn.Linear / the model's own experts holding the dequantized
weights), for every k; packed tensors never require grad.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_kbit
from hf_kbit import KbitConfig
from hf_kbit import format as fmt
from hf_kbit.nn import KbitExperts, KbitLinear
from tiny_models import tiny_dense_model, tiny_moe_model

BITS = pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS, ids=lambda b: f"k{b}")
# dX against the dequantized module's, relative to max |dX|: both accumulate in float32 (float32:
# summation order only), bf16/fp16 round the weight (reference) or not (kbit) before the product.
DX_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def assert_rel_close(actual, expected, atol):
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * scale, rtol=0)


@BITS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kbit_linear_dx_matches_dequantized_linear(bits, dtype):
    torch.manual_seed(0)
    layer = KbitLinear.from_linear(torch.nn.Linear(200, 72).to(dtype), bits=bits)
    reference = layer.to_linear(torch.float32)
    x = torch.randn(3, 7, 200)
    grad = torch.randn(3, 7, 72)
    xk = x.to(dtype).requires_grad_()
    layer(xk).backward(grad.to(dtype))
    xr = x.to(dtype).float().requires_grad_()
    reference(xr).backward(grad.to(dtype).float())
    assert xk.grad.dtype == dtype
    assert_rel_close(xk.grad, xr.grad, DX_ATOL[dtype])
    assert not any(t.requires_grad for t in layer.buffers())
    assert layer.bias.grad is not None  # the bias is an ordinary parameter (frozen only by peft / the caller)


@BITS
def test_fused_members_dx_matches_unfused(bits):
    """q/k/v fused into one launch: a loss over all three outputs gives x the unfused model's gradient."""
    model = tiny_dense_model("llama", torch.float32)
    # fitting "absmax": one codebook for all layers, which fusion needs
    fused = hf_kbit.quantize_model(copy.deepcopy(model), KbitConfig(bits=bits, fitting="absmax"))
    plain = hf_kbit.quantize_model(model, KbitConfig(bits=bits, fuse_projections=False, fitting="absmax"))
    grads = []
    for m in (fused, plain):
        attn = m.model.layers[0].self_attn
        x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(1)).requires_grad_()
        (attn.q_proj(x).square().sum() + attn.k_proj(x).sum() + 2 * attn.v_proj(x).sum()).backward()
        grads.append(x.grad)
    assert hasattr(fused.model.layers[0].self_attn, "qkv_proj")
    assert_rel_close(grads[0], grads[1], DX_ATOL[torch.float32])


@BITS
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_kbit_experts_dx_matches_dequantized_experts(bits, family):
    model = tiny_moe_model(family, torch.float32)
    hf_kbit.quantize_model(model, KbitConfig(bits=bits))
    experts = next(m for m in model.modules() if isinstance(m, KbitExperts))
    reference = experts.to_experts(torch.float32)
    torch.manual_seed(0)
    tokens = 70  # 140 (token, expert) rows: past GROUP_ROWS_ABOVE, so the grouped routing is used too
    x = torch.randn(tokens, experts.hidden_size)
    index = torch.randint(0, experts.num_experts, (tokens, 2))
    weights = torch.rand(tokens, 2)
    grad = torch.randn(tokens, experts.hidden_size)
    xk, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    experts(xk, index, weights).backward(grad)
    reference(xr, index, weights).backward(grad)
    assert_rel_close(xk.grad, xr.grad, 1e-4)  # float32, gating nonlinearity between the two products
    assert not any(t.requires_grad for t in experts.buffers())


@pytest.mark.parametrize("rotation", [False, True], ids=["plain", "rotated"])
def test_eager_training_saves_no_packed_tensor(rotation):
    """A training forward keeps the frozen packed tensors (and sign words) out of autograd's saved tensors,
    which gradient checkpointing packs and unpacks through Python hooks at every call (hf_kbit._ops.KbitMatmul)."""
    torch.manual_seed(0)
    layer = KbitLinear.from_linear(torch.nn.Linear(64, 48), bits=4, rotation=rotation)
    assert layer.rotated == rotation
    reference = layer.to_linear(torch.float32)
    saved = []
    x = torch.randn(5, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        layer(x).square().sum().backward()
    assert not {torch.int32, torch.uint8} & set(saved), saved
    xr = x.detach().clone().requires_grad_()
    reference(xr).square().sum().backward()
    assert_rel_close(x.grad, xr.grad, DX_ATOL[torch.float32])
