"""hf_kbit.head_rotation (KbitConfig.head_rotation): v and o turned per attention head leave a model's function
unchanged; quantize-on-load, quantize_model and kbit-convert turn to the same bytes; the checkpoint reloads as
saved; dequantize() turns back; attention it is not exact for is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import hf_kbit
from hf_kbit import head_rotation
from hf_kbit.convert import convert
from hf_kbit.nn.linear import KbitLinear
from test_convert import assert_same_state
from tiny_models import tiny_dense_model, tiny_moe_model

transformers.utils.logging.set_verbosity_error()
IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
# float32 logits of a turned model against the model: the turn rounds each weight once (float64 -> float32).
TURNED_LOGITS_ATOL = 1e-4
# A k = 5 weight against the weight it was quantized from, relative Frobenius error: well under this in the
# original basis, and far over it when compared in the wrong (turned) basis.
K5_RELATIVE_ERROR_MAX = 0.1
HEAD_DIM = 32  # a power of 2: hidden 128 over 4 heads


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def qwen2(dtype=torch.float32) -> torch.nn.Module:
    """A tiny Qwen2 (v_proj has a bias) with heads of HEAD_DIM."""
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.to(dtype).eval()


SUPPORTED = {
    "llama": lambda: tiny_dense_model("llama", torch.float32, hidden_size=128),
    "qwen2": qwen2,
    "qwen3": lambda: tiny_dense_model("qwen3", torch.float32, hidden_size=128, head_dim=HEAD_DIM),
    "mistral": lambda: tiny_dense_model("mistral", torch.float32, hidden_size=128),
    "qwen3_moe": lambda: tiny_moe_model("qwen3_moe", torch.float32, hidden_size=128, head_dim=HEAD_DIM),
    "mixtral": lambda: tiny_moe_model("mixtral", torch.float32, hidden_size=128),
}


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    qwen2().save_pretrained(path)
    return path


def test_the_turn_is_orthogonal_and_undone_through_attention_output():
    q = head_rotation.matrix(HEAD_DIM)
    torch.testing.assert_close(q @ q.T, torch.eye(HEAD_DIM, dtype=torch.float64), rtol=0, atol=1e-15)
    g = torch.Generator().manual_seed(1)
    x, wv, bv, wo = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, 96), (64, 96), (64,), (96, 128)))
    # 4 query heads over 2 kv heads: query heads 2h and 2h + 1 read kv head h
    v = x @ wv.T + bv
    heads = v.reshape(5, 2, HEAD_DIM).repeat_interleave(2, dim=1).reshape(5, 128)
    turned_v = x @ head_rotation.turn(wv, "v", HEAD_DIM).T + head_rotation.turn(bv, "v_bias", HEAD_DIM)
    turned_heads = turned_v.reshape(5, 2, HEAD_DIM).repeat_interleave(2, dim=1).reshape(5, 128)
    torch.testing.assert_close(turned_heads @ head_rotation.turn(wo, "o", HEAD_DIM).T, heads @ wo.T)
    for role, t in (("v", wv), ("v_bias", bv), ("o", wo)):
        back = head_rotation.turn(head_rotation.turn(t, role, HEAD_DIM), role, HEAD_DIM, inverse=True)
        torch.testing.assert_close(back, t)


@pytest.mark.parametrize("family", list(SUPPORTED))
def test_a_turned_model_computes_the_same(family):
    model = SUPPORTED[family]()
    expected = logits(model)
    targets = head_rotation.targets(model)
    assert len([n for n, (role, _) in targets.items() if role == "o"]) == 2  # both layers
    head_rotation.apply(model)
    assert not torch.equal(model.model.layers[0].self_attn.o_proj.weight, SUPPORTED[family]().model.layers[0]
                           .self_attn.o_proj.weight)
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=TURNED_LOGITS_ATOL)


@pytest.mark.parametrize(("model", "match"), [
    (lambda: tiny_dense_model("gemma3_text", torch.float32, head_dim=HEAD_DIM), r"is a Gemma3Attention, where turning"),
    (lambda: tiny_moe_model("gpt_oss", torch.float32, hidden_size=128), r"is a GptOssAttention"),
    (lambda: tiny_moe_model("deepseek_v3", torch.float32), r"no attention module with v_proj and o_proj"),
    (lambda: tiny_dense_model("llama", torch.float32), r"needs a power-of-2 head dim, got 24"),
], ids=["gemma3", "gpt_oss", "deepseek_v3", "head_dim_24"])
def test_attention_it_is_not_exact_for_is_refused(model, match):
    with pytest.raises(ValueError, match=match):
        hf_kbit.quantize_model(model(), hf_kbit.KbitConfig(bits=4, head_rotation=True))


def test_quantize_on_load_quantize_model_and_convert_write_the_same(qwen2_folder, tmp_path):
    config = hf_kbit.KbitConfig(bits=3, head_rotation=True)
    loaded = AutoModelForCausalLM.from_pretrained(qwen2_folder, quantization_config=config, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(qwen2_folder, dtype=torch.float32)
    skip = hf_kbit.quantizer.KbitHfQuantizer(config).skipped_modules(plain)
    hf_kbit.quantize_model(plain, copy.deepcopy(config), skip)
    assert_same_state(loaded, plain)
    result = convert(qwen2_folder, tmp_path / "out", config, progress=False)
    converted = AutoModelForCausalLM.from_pretrained(result.out, dtype=torch.float32)
    assert_same_state(converted, loaded)
    assert json.loads((result.out / "config.json").read_text())["quantization_config"]["head_rotation"] is True
    assert "v_proj and o_proj turned per attention head" in (result.out / "README.md").read_text()
    # the v bias is turned with the rows (as the float model's turn gives it), once
    turned = qwen2()
    head_rotation.apply(turned)
    torch.testing.assert_close(loaded.model.layers[1].self_attn.v_proj.bias, turned.model.layers[1].self_attn.v_proj.bias,
                               rtol=0, atol=0)


def test_checkpoint_reloads_as_saved_and_dequantize_turns_back(qwen2_folder, tmp_path):
    original = qwen2()
    model = AutoModelForCausalLM.from_pretrained(qwen2_folder, quantization_config=hf_kbit.KbitConfig(
        bits=5, head_rotation=True), dtype=torch.float32)
    quantized_logits = logits(model)
    model.save_pretrained(tmp_path / "kbit")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)
    assert_same_state(again, model)  # a pre-quantized load turns nothing again (the v bias included)
    assert isinstance(again.model.layers[0].self_attn.o_proj, KbitLinear)
    again.dequantize()
    torch.testing.assert_close(logits(again), quantized_logits, rtol=0, atol=TURNED_LOGITS_ATOL)
    for name in ("o_proj", "v_proj"):
        got = getattr(again.model.layers[0].self_attn, name).weight.detach()
        want = getattr(original.model.layers[0].self_attn, name).weight.detach()
        assert float((got - want).norm() / want.norm()) < K5_RELATIVE_ERROR_MAX, name
    bias, want = again.model.layers[0].self_attn.v_proj.bias, original.model.layers[0].self_attn.v_proj.bias
    torch.testing.assert_close(bias, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("fields", "model", "pre_quantized", "expected"), [
    ({"bits": 3, "block_offsets": False}, "qwen2", False, True),
    ({"bits": 4, "block_offsets": False}, "qwen2", False, True),
    ({"bits": 3, "fitting": "absmax"}, "qwen2", False, True),  # the plain rule gives no block offsets either
    ({"bits": 3}, "qwen2", False, False),  # block offsets (the default) measured worse turned
    ({"bits": 4}, "qwen2", False, False),
    ({"bits": 5, "block_offsets": False}, "qwen2", False, False),  # measured worse at k = 5
    ({"bits": 3, "rotation": "inputs"}, "qwen2", False, False),  # and with rotation along K, in most cells
    ({"bits": 3, "rotation": True}, "qwen2", False, False),
    ({"bits": 3, "block_offsets": False, "calibration_data": "some text"}, "qwen2", False, False),  # unmeasured
    ({"bits": 3, "block_offsets": False}, "gemma3", False, False),  # attention the turn is not exact for
    ({"bits": 3, "block_offsets": False}, "head_dim_24", False, False),
    ({"bits": 3, "block_offsets": False}, "qwen2", True, False),  # a checkpoint without the field: not turned
    ({"bits": 5, "rotation": True, "head_rotation": True}, "qwen2", False, True),
    ({"bits": 3, "head_rotation": False}, "qwen2", False, False),
])
def test_resolve_turns_by_default_at_k_up_to_4_data_free_without_rotation_or_offsets(fields, model, pre_quantized, expected):
    models = {"qwen2": qwen2, "gemma3": lambda: tiny_dense_model("gemma3_text", torch.float32, head_dim=HEAD_DIM),
              "head_dim_24": lambda: tiny_dense_model("llama", torch.float32)}
    config = hf_kbit.KbitConfig(**fields)
    assert head_rotation.resolve(config, models[model](), pre_quantized) is expected


def test_the_default_is_recorded_and_a_checkpoint_without_it_is_not_turned(qwen2_folder, tmp_path):
    v1 = AutoModelForCausalLM.from_pretrained(qwen2_folder, quantization_config=hf_kbit.KbitConfig(
        bits=3, block_offsets=False), dtype=torch.float32)
    explicit = AutoModelForCausalLM.from_pretrained(qwen2_folder, quantization_config=hf_kbit.KbitConfig(
        bits=3, block_offsets=False, head_rotation=True), dtype=torch.float32)
    assert v1.config.quantization_config.head_rotation is True
    assert_same_state(v1, explicit)
    for fields in ({"bits": 3}, {"bits": 5, "block_offsets": False}):
        model = AutoModelForCausalLM.from_pretrained(qwen2_folder, quantization_config=hf_kbit.KbitConfig(**fields),
                                                     dtype=torch.float32)
        assert model.config.quantization_config.head_rotation is False, fields
    # A checkpoint of a model quantized unturned (as every checkpoint written before the default) has no field:
    # it loads as saved and dequantize() turns nothing back.
    unturned = AutoModelForCausalLM.from_pretrained(qwen2_folder, quantization_config=hf_kbit.KbitConfig(
        bits=3, head_rotation=False), dtype=torch.float32)
    expected = logits(unturned)
    unturned.save_pretrained(tmp_path / "kbit")
    assert "head_rotation" not in json.loads((tmp_path / "kbit" / "config.json").read_text())["quantization_config"]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)
    assert again.config.quantization_config.head_rotation is False
    again.dequantize()
    torch.testing.assert_close(logits(again), expected, rtol=0, atol=TURNED_LOGITS_ATOL)


def test_v_and_o_kept_in_float_are_turned_on_load_too(qwen2_folder):
    """A skip list that keeps o_proj (or v_proj) in float: quantize-on-load turns it after loading, so the float o
    undoes the quantized v's turn (as quantize_model and kbit-convert turn it)."""
    config = hf_kbit.KbitConfig(bits=3, head_rotation=True, modules_to_not_convert=["lm_head", "o_proj"])
    model = AutoModelForCausalLM.from_pretrained(qwen2_folder, quantization_config=config, dtype=torch.float32)
    turned = qwen2()
    head_rotation.apply(turned)
    o_proj = model.model.layers[0].self_attn.o_proj
    assert type(o_proj) is torch.nn.Linear
    torch.testing.assert_close(o_proj.weight, turned.model.layers[0].self_attn.o_proj.weight, rtol=0, atol=0)


def test_a_config_settles_per_model_and_stays_as_given(qwen2_folder, tmp_path):
    """Loading and kbit-convert settle head_rotation on their own copy of the config (saved with the model): the
    caller's config keeps None, so it can quantize a model whose attention the turn does not support next."""
    config = hf_kbit.KbitConfig(bits=3, block_offsets=False)
    model = AutoModelForCausalLM.from_pretrained(qwen2_folder, quantization_config=config, dtype=torch.float32)
    assert model.config.quantization_config.head_rotation is True and config.head_rotation is None
    gemma = hf_kbit.quantize_model(tiny_dense_model("gemma3_text", torch.float32, head_dim=HEAD_DIM), config)
    assert isinstance(gemma.model.layers[0].self_attn.o_proj, KbitLinear) and config.head_rotation is None
    result = convert(qwen2_folder, tmp_path / "out", config, progress=False)
    assert json.loads((result.out / "config.json").read_text())["quantization_config"]["head_rotation"] is True
    assert config.head_rotation is None
