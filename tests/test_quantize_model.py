"""hf_kbit.quantize_model: in-memory quantization of dense and MoE models (CPU).

The tiny MoE models are built from transformers' config classes (no downloads). The
in-memory result must be the quantize-on-load result, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import hf_kbit
from hf_kbit import KbitConfig, KbitExperts, KbitLinear, head_rotation
from hf_kbit.nn.routing import RULES as ROUTING_RULES, KbitRouter
from tiny_models import tiny_dense_model

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

PROJECTIONS = ("gate_up_proj", "down_proj")
# moe_intermediate_size 40: the down projection's K is not a multiple of the 32-element block.
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=40, num_experts=8)),
    # transposed [E, in, out] expert weights, interleaved gate/up, biases
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=8, intermediate_size=40, sliding_window=16)),
}
# Relative error of a whole tiny MoE model's logits vs its bf16 weights, k=4 (every Linear and
# expert quantized, LM head kept): tests/nn/test_experts.py measured 0.06-0.13.
LOGITS_REL_ERROR_K4 = 0.25
INPUT_IDS = torch.tensor([[3, 17, 99, 5, 64, 1, 127, 42], [8, 8, 120, 33, 7, 0, 12, 90]])


def tiny_moe_model(family: str, seed: int = 0) -> torch.nn.Module:
    class_name, extra = MOE_FAMILIES[family]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=64,
        num_experts_per_tok=2,
    )
    config = config_class(**{**common, **extra})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _experts(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if name.endswith(".experts")}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS).logits.float()


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_quantizes_experts_like_quantize_on_load(family, tmp_path):
    model = tiny_moe_model(family)
    model.save_pretrained(tmp_path)
    float_logits = _logits(model)
    routers = {
        n: (type(m), m.weight.clone()) for n, m in model.named_modules() if n.endswith(("mlp.gate", "mlp.router"))
    }
    assert _experts(model) and routers

    out = hf_kbit.quantize_model(model, KbitConfig(bits=4), modules_to_not_convert=["lm_head"])

    assert out is model
    experts = _experts(model)
    assert all(isinstance(m, KbitExperts) for m in experts.values()), {n: type(m).__name__ for n, m in experts.items()}
    assert all(m.bits == {"gate_up_proj": 4, "down_proj": 4} for m in experts.values())
    assert not [n for n, p in model.named_parameters() if p.dim() == 3], "float 3-D expert weights remain"
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears == ["lm_head"], f"unquantized Linear layers: {linears}"
    for name, (cls, weight) in routers.items():  # routers are not Linear layers: their weight stays as it is
        router = model.get_submodule(name)
        assert isinstance(router, cls) and torch.equal(router.weight, weight), name
        # softmax-top-k routers are fused in place (hf_kbit.nn.routing), the others keep their class
        assert isinstance(router, KbitRouter) == (cls.__name__ in ROUTING_RULES), name

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(bits=4))
    expected = loaded.state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert _rel(_logits(model), float_logits) < LOGITS_REL_ERROR_K4


def test_expert_bits_follow_module_bits_patterns():
    model = tiny_moe_model("qwen3_moe")
    config = KbitConfig(bits=4, module_bits={r"experts\.down_proj$": 2, r"self_attn\.o_proj$": 5})
    hf_kbit.quantize_model(model, config)
    for module in _experts(model).values():
        assert module.bits == {"gate_up_proj": 4, "down_proj": 2}
        assert module.down_planes.shape[-3] == 2 and module.gate_up_planes.shape[-3] == 4
    assert model.model.layers[0].self_attn.o_proj.bits == 5
    assert model.model.layers[0].self_attn.q_proj.bits == 4


def test_modules_to_not_convert_keeps_experts_in_full_precision():
    model = tiny_moe_model("qwen3_moe")
    before = {n: p.clone() for n, p in model.named_parameters() if ".experts." in n}
    hf_kbit.quantize_model(model, KbitConfig(bits=4), modules_to_not_convert=["experts", "lm_head"])
    assert not any(isinstance(m, KbitExperts) for m in model.modules())
    for name, value in before.items():
        assert torch.equal(model.get_parameter(name), value), name
    assert isinstance(model.model.layers[0].self_attn.q_proj, KbitLinear)


def test_dense_model_unchanged_behaviour():
    """A model without experts: every Linear (the LM head too, unless listed) becomes a KbitLinear."""
    model = tiny_dense_model("llama")
    hf_kbit.quantize_model(model, KbitConfig(bits=3))
    assert not [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert isinstance(model.lm_head, KbitLinear) and model.lm_head.bits == 3


@pytest.mark.parametrize("built_with,config,expected", [
    ("sdpa", {}, "kbit_decode"),
    ("eager", {}, "eager"),  # kbit_decode falls back to sdpa, which such a model did not ask for
    ("sdpa", {"decode_attention": False}, "sdpa"),
])
def test_attention_default(built_with, config, expected):
    """KbitConfig.decode_attention: a model that attends with sdpa attends with kbit_decode after quantize_model."""
    model = tiny_dense_model("llama", attn_implementation=built_with)
    assert model.config._attn_implementation == built_with
    hf_kbit.quantize_model(model, KbitConfig(bits=4, **config))
    assert model.config._attn_implementation == expected


def test_tied_lm_head_stays_full_precision():
    """An LM head that shares the input embedding's weight is kept (and stays tied), listed or not."""
    model = tiny_dense_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf_kbit.quantize_model(model, KbitConfig(bits=4))
    assert type(model.lm_head) is torch.nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.model.layers[0].mlp.down_proj, KbitLinear)


# ---------------------------------------------------------------------------- calibration


def _calibration_config(**kwargs) -> KbitConfig:
    from tiny_models import TINY_TEXT, char_tokenizer

    return KbitConfig(calibration_data=TINY_TEXT, calibration_samples=2, calibration_seq_len=64,
                      calibration_tokenizer=char_tokenizer(TINY_TEXT), **kwargs)


def test_calibration_packs_what_calibrate_model_gives_with_siblings_sharing_a_codebook():
    """quantize_model with calibration_data: every Linear holds the bytes hf_kbit.calibration.calibrate_model
    produces for it, q/k/v and gate/up calibrated with one codebook each (so they still fuse)."""
    from hf_kbit import calibration

    config = _calibration_config(bits=3)
    model = hf_kbit.quantize_model(tiny_dense_model("llama", dtype=torch.float32), config, ["lm_head"], progress=False)
    reference = tiny_dense_model("llama", dtype=torch.float32)
    groups = [[f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in range(2)]
    groups += [[f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up")] for i in range(2)]
    # the Linears with block records (KbitConfig's default), as quantize_model asks for them
    want = calibration.calibrate_model(reference, calibration.config_batches(config, reference), 3,
                                       settings=calibration.CalibrationSettings(block_offsets=True), progress=False,
                                       groups=groups)
    assert sorted(want) == sorted(n for n, m in model.named_modules() if isinstance(m, KbitLinear))
    for name, tensors in want.items():
        module = model.get_submodule(name)
        for tensor_name, expected in zip(("planes", "block_scales", "row_scales", "codebook"), tensors):
            assert torch.equal(getattr(module, tensor_name), expected), f"{name}.{tensor_name}"
    assert all(hasattr(layer.self_attn, "qkv_proj") for layer in model.model.layers)  # gate/up: N = 200, no fusion
    assert torch.equal(model.model.layers[1].mlp.gate_proj.codebook, model.model.layers[1].mlp.up_proj.codebook)
    assert type(model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_calibration_packs_moe_experts_with_calibrate_model(family):
    """Fused experts are calibrated too (each expert on the tokens routed to it): their KbitExperts buffers hold
    what calibrate_model gives them (gpt_oss: transposed weights, interleaved gate/up, biases)."""
    from hf_kbit import calibration

    config = _calibration_config(bits=4)
    model = hf_kbit.quantize_model(tiny_moe_model(family), config, ["lm_head"], progress=False)
    reference = tiny_moe_model(family)
    if head_rotation.resolve(config, reference):  # as quantize_model turns v and o first (hf_kbit.head_rotation)
        head_rotation.apply(reference)
    linears = [n for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    experts = list(_experts(reference))
    want = calibration.calibrate_model(reference, calibration.config_batches(config, reference), 4, linears,
                                       calibration.CalibrationSettings(block_offsets=True), progress=False,
                                       groups=_sibling_groups(linears), experts=experts)
    for name in experts:
        module = model.get_submodule(name)
        assert isinstance(module, KbitExperts)
        for projection, prefix in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            for tensor_name, expected in zip(("planes", "block_scales", "row_scales", "codebook"),
                                             want[f"{name}.{projection}"]):
                assert torch.equal(getattr(module, f"{prefix}_{tensor_name}"), expected), f"{name}.{projection}"
    data_free = hf_kbit.quantize_model(tiny_moe_model(family), KbitConfig(bits=4), ["lm_head"])
    assert not torch.equal(model.model.layers[1].mlp.experts.down_planes, data_free.model.layers[1].mlp.experts.down_planes)
    assert _rel(_logits(model), _logits(tiny_moe_model(family))) < LOGITS_REL_ERROR_K4


def _sibling_groups(linears: list[str]) -> list[tuple[str, ...]]:
    from hf_kbit.nn.fused import codebook_siblings

    return list(dict.fromkeys(codebook_siblings(dict.fromkeys(linears, (0, 4))).values()))
