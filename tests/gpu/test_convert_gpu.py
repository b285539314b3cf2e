"""GPU tests: ``hf_kbit.convert`` quantizes with the CUDA kernel when a GPU is present, and its
output is bit-identical to the CPU conversion (the PyTorch reference) of the same model.

``convert(..., device=None)`` picks ``cuda`` when ``torch.cuda.is_available()`` and moves each
weight there before ``kbit::quantize``; a spy on the ctypes library counts the kernel calls.

Run on the GPU machine with ``scripts/run_gpu_tests.sh`` (or ``pytest -m gpu tests/gpu``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_kbit import KbitConfig, _lib
from hf_kbit.convert import convert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)"),
]

# 2 layers x 7 projections; the LM head and embeddings stay unquantized by default.
QUANTIZED_PER_MODEL = 14


def make_model(folder: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """A config-built 2-layer Llama with sizes off every tile (K % 128, K % 32 and N % 16 != 0),
    an all-zero weight row and rows of tiny and large magnitude, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=160,
        intermediate_size=333,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
        mlp = model.model.layers[0].mlp
        mlp.down_proj.weight[3].zero_()
        mlp.up_proj.weight[5].mul_(1e-6)
        mlp.gate_proj.weight[7].mul_(1e3)
    model.to(dtype).save_pretrained(folder, max_shard_size="500KB")
    return folder


class _QuantizeSpy:
    def __init__(self, lib):
        self._lib, self.calls = lib, 0

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if name != "kbit_quantize":
            return fn

        def call(*args):
            self.calls += 1
            return fn(*args)

        return call


def convert_counting_kernel_calls(*args, **kwargs):
    """``convert(*args, **kwargs)`` and the number of ``kbit_quantize`` kernel calls it made."""
    from hf_kbit.backends import cuda as backend

    spy = _QuantizeSpy(backend._LIB)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "_LIB", spy)
        result = convert(*args, progress=False, **kwargs)
    return result, spy.calls


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


# The absmax rule: the CUDA quantize kernel, bit-exact with the CPU reference.
CONFIGS = {
    "k4": KbitConfig(bits=4, fitting="absmax"),
    "k2": KbitConfig(bits=2, fitting="absmax"),
    "k3-mixed": KbitConfig(bits=3, module_bits={r"mlp\.down_proj$": 5, r"self_attn\.v_proj$": 2}, fitting="absmax"),
    "k5-nf-sym": KbitConfig(bits=5, codebook="nf-sym", fitting="absmax"),
}
# The fitted rule (the default) is PyTorch on the weight's device: CUDA and the CPU may pick
# another block code where two candidates' errors tie to rounding (tests/gpu/test_fitting_gpu.py).
FIT_MAX_DIFFERENT = 1e-3  # fraction of plane words / block codes
FIT_CODEBOOK_ATOL = 1e-5


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gpu_conversion_is_bit_identical_to_cpu(tmp_path, dtype, config):
    source = make_model(tmp_path / "src", dtype)

    gpu, gpu_calls = convert_counting_kernel_calls(source, tmp_path / "gpu", config)  # device: auto
    cpu, cpu_calls = convert_counting_kernel_calls(source, tmp_path / "cpu", config, device="cpu")

    assert gpu_calls == QUANTIZED_PER_MODEL, "the default device on a CUDA machine must quantize with the kernel"
    assert cpu_calls == 0
    assert len(gpu.plan.quantized) == QUANTIZED_PER_MODEL
    got, expected = tensors(gpu.out), tensors(cpu.out)
    assert sorted(got) == sorted(expected)
    assert any(key.endswith(".planes") for key in got)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key], value), f"{key} differs between the GPU and CPU conversions"
    assert json.loads((gpu.out / "config.json").read_text()) == json.loads((cpu.out / "config.json").read_text())
    assert gpu.stats["size_after_bytes"] == cpu.stats["size_after_bytes"]


@pytest.mark.parametrize("bits", [3, 4])
def test_gpu_fitted_conversion_matches_cpu_up_to_ties(tmp_path, bits):
    source = make_model(tmp_path / "src", torch.bfloat16)
    config = KbitConfig(bits=bits)
    got = tensors(convert(source, tmp_path / "gpu", config, progress=False).out)
    expected = tensors(convert(source, tmp_path / "cpu", config, device="cpu", progress=False).out)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        if key.endswith("codebook"):
            torch.testing.assert_close(got[key], value, rtol=0, atol=FIT_CODEBOOK_ATOL)
        elif key.endswith((".planes", ".block_scales")):
            different = (got[key] != value).float().mean().item()
            assert different <= FIT_MAX_DIFFERENT, f"{key}: {different:.2e} differ"
        else:
            assert torch.equal(got[key], value), key


def test_explicit_cuda_device_and_reload_on_gpu(tmp_path):
    """``device="cuda"`` works too, and the checkpoint loads onto the GPU and runs there."""
    from transformers import AutoModelForCausalLM

    import hf_kbit

    source = make_model(tmp_path / "src", torch.bfloat16)
    result, calls = convert_counting_kernel_calls(source, tmp_path / "out", KbitConfig(bits=4), device="cuda")
    assert calls == 0, "the fitted rule (the default) does not use the absmax kernel"
    model = AutoModelForCausalLM.from_pretrained(result.out, device_map="cuda", dtype=torch.bfloat16)
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, hf_kbit.KbitLinear) and layer.planes.is_cuda
    ids = torch.tensor([[1, 5, 7, 250, 3]], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, 300) and torch.isfinite(logits).all()
