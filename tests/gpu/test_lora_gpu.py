"""GPU tests of training through kbit layers: the CUDA backward ops (kbit::mm_grad_x, grouped_mm_grad_x)
against the CPU reference, and a LoRA training step of a tiny model on CUDA (bf16, fp16, gradient
checkpointing, torch.compile) against the same step on CPU. Run with scripts/run_gpu_tests.sh."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_kbit
from hf_kbit import KbitConfig, _lib, _ops
from hf_kbit import format as fmt
from tiny_models import tiny_dense_model, tiny_moe_model

peft = pytest.importorskip("peft", reason="LoRA tests need peft")
from hf_kbit import lora  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)"),
]
DEVICE = "cuda"
# CUDA dX (weight dequantized to the activation dtype, cuBLAS) against the CPU reference (float32 weight and
# accumulation), relative to max |dX|: one rounding of the weight and of the result to bf16 / fp16.
GRAD_REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# A LoRA step's adapter gradients on CUDA against CPU float32, relative to max |grad| (bf16 compute on CUDA).
STEP_REL_TOL = {torch.bfloat16: 6e-2, torch.float16: 1e-2}


def rel_close(actual, expected, tol):
    scale = expected.abs().max().item() or 1.0
    err = (actual.float().cpu() - expected.float().cpu()).abs().max().item() / scale
    assert err <= tol, f"relative error {err:.2e} > {tol:.1e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("shape", [(257, 515, 3), (4096, 1024, 2048)], ids=lambda s: "N{}K{}M{}".format(*s))
def test_mm_grad_x_matches_reference(shape, bits, dtype):
    n, k, m = shape
    torch.manual_seed(0)
    cb = fmt.make_codebook(None, bits)
    packed = torch.ops.kbit.quantize(torch.randn(n, k), cb)
    grad = torch.randn(m, n).to(dtype)
    expected = _ops._mm_grad_x_ref(grad, *packed, cb, k)
    cuda = [t.to(DEVICE) for t in (*packed, cb)]
    out = torch.ops.kbit.mm_grad_x(grad.to(DEVICE), *cuda, k)
    assert out.dtype == dtype and out.shape == (m, k)
    rel_close(out, expected, GRAD_REL_TOL[dtype])
    x = torch.randn(m, k, dtype=dtype, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.kbit.mm.default, (x, *cuda, k), test_utils=("test_autograd_registration",))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [12, 300], ids=lambda r: f"S{r}")
def test_grouped_mm_grad_x_matches_reference(rows, dtype):
    torch.manual_seed(0)
    e, n, k = 8, 96, 200
    cb = fmt.make_codebook(None, 4)
    packed = torch.ops.kbit.quantize(torch.randn(e, n, k), cb)
    ids = torch.randint(-1, e, (rows,))
    grad = torch.randn(rows, n).to(dtype)
    expected = _ops._grouped_mm_grad_x_ref(grad, ids, *packed, cb, k)
    out = torch.ops.kbit.grouped_mm_grad_x(grad.to(DEVICE), ids.to(DEVICE), *[t.to(DEVICE) for t in (*packed, cb)], k)
    rel_close(out, expected, GRAD_REL_TOL[dtype])


def adapter_grads(pm, ids):
    pm(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().float().cpu() for n, p in pm.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["eager", "checkpointing", "compile"])
def test_lora_step_on_cuda_matches_cpu(mode, dtype):
    model = hf_kbit.quantize_model(tiny_dense_model("llama", torch.float32, intermediate_size=192),
                                   KbitConfig(bits=4, modules_to_not_convert=["lm_head"]))
    torch.manual_seed(0)
    pm = lora.get_peft_model(model, peft.LoraConfig(target_modules="all-linear", r=8, lora_alpha=16))
    for p in pm.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    expected = adapter_grads(copy.deepcopy(pm), ids)
    gpu = pm.to(DEVICE)
    for p in gpu.get_base_model().parameters():  # the frozen non-kbit weights in the compute dtype
        if not p.requires_grad:
            p.data = p.data.to(dtype)
    gpu.train()
    if mode == "checkpointing":
        lora.enable_checkpointing(gpu)
    run = torch.compile(gpu) if mode == "compile" else gpu
    run(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE)).loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in gpu.named_parameters() if p.requires_grad}
    assert grads.keys() == expected.keys()
    for name in expected:
        rel_close(grads[name], expected[name], STEP_REL_TOL[dtype])


def test_moe_lora_step_on_cuda():
    model = hf_kbit.quantize_model(tiny_moe_model("qwen3_moe", torch.bfloat16), KbitConfig(bits=4)).to(DEVICE)
    pm = lora.get_peft_model(model, peft.LoraConfig(target_modules="all-linear", r=4))
    ids = torch.randint(0, 256, (2, 64), device=DEVICE)
    loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pm.parameters() if p.requires_grad)


def layer_training_step(device: str):
    """One training step of decoder layer 0 of a tiny bf16 kbit Llama with LoRA on every linear layer (q/k/v and
    gate/up fused), driven directly (transformers' mask code reads the positions on the host, outside kbit):
    forward under non-reentrant gradient checkpointing, backward, an AdamW step on the adapters. Returns
    ``step`` (a closure) after one step outside it, which made the optimizer's state."""
    model = hf_kbit.quantize_model(tiny_dense_model("llama", torch.bfloat16, intermediate_size=192),
                                   KbitConfig(bits=4, modules_to_not_convert=["lm_head"])).to(device)
    pm = lora.get_peft_model(model, peft.LoraConfig(target_modules="all-linear", r=8, lora_alpha=16))
    base = pm.get_base_model().model
    layer = base.layers[0]
    assert hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj")
    hidden = torch.randn(2, 64, base.config.hidden_size, device=device, dtype=torch.bfloat16)
    position_embeddings = base.rotary_emb(hidden, torch.arange(64, device=device)[None].expand(2, -1))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3)

    def step():
        out = torch.utils.checkpoint.checkpoint(layer, hidden, position_embeddings=position_embeddings,
                                                attention_mask=None, use_reentrant=False)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return step


def test_lora_training_step_makes_no_host_sync():
    """A batch-1 LoRA step is launch-bound: a host sync in its kbit path (``.item()``, ``.tolist()``, a
    device-to-host copy, a data-dependent shape) would stall every launch behind the GPU."""
    step = layer_training_step(DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
