"""KbitConfig.block_offsets (format v4: int16 block records) through transformers and quantize_model: which layers
hold records, the bytes against the fitting rule, fusion, saving and reloading to the same logits, what the
config refuses."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_kbit
from hf_kbit import KbitConfig, KbitLinear, fitting
from hf_kbit import format as fmt
from hf_kbit.checkpoint import KbitCheckpointError
from hf_kbit.nn import KbitExperts, KbitFusedProjections
from tiny_models import tiny_dense_model, tiny_moe_model

transformers.utils.logging.set_verbosity_error()
IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Saved float32 tiny models, their weights shifted off zero per block of 32 (as GGUF Q4_1 blocks sit)."""
    out = {}
    for name, model in (
        ("llama", tiny_dense_model("llama", torch.float32, hidden_size=128, intermediate_size=200)),
        ("qwen3_moe", tiny_moe_model("qwen3_moe", torch.float32, hidden_size=128, moe_intermediate_size=64)),
    ):
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    w = module.weight
                    shift = torch.randn(w.shape[0], -(-w.shape[1] // 32), 1, generator=g) * w.std()
                    w.add_(shift.expand(-1, -1, 32).reshape(w.shape[0], -1)[:, : w.shape[1]])
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = path
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_linears_hold_records_experts_do_not_and_reload_to_the_same_logits(sources, tmp_path, family):
    config = KbitConfig(bits=3, block_offsets=True)
    model = AutoModelForCausalLM.from_pretrained(sources[family], quantization_config=config, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, KbitLinear)]
    assert linears and all(m.block_offsets and m.block_scales.dtype == fmt.RECORD_DTYPE for m in linears)
    assert all(m.block_offsets for m in model.modules() if isinstance(m, KbitFusedProjections))
    for m in model.modules():
        if isinstance(m, KbitExperts):
            assert all(t.dtype == torch.uint8 for name, t in m.named_buffers() if name.endswith("block_scales"))
    assert "block_offsets=True" in repr(linears[0])
    expected = logits(model)
    model.save_pretrained(tmp_path / "kbit")
    qc = json.loads((tmp_path / "kbit" / "config.json").read_text())["quantization_config"]
    assert qc["block_offsets"] is True and qc["format_version"] == fmt.OFFSETS_VERSION
    with safe_open(tmp_path / "kbit" / "model.safetensors", "pt") as f:
        records = [k for k in f.keys() if k.endswith(".block_scales") and f.get_slice(k).get_dtype() == "I16"]
    assert len(records) == len(linears)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)
    assert all(m.block_offsets for m in again.modules() if isinstance(m, KbitLinear))
    torch.testing.assert_close(logits(again), expected, rtol=0, atol=0)


def test_records_are_the_fitting_rule_and_beat_plain_scales_on_shifted_blocks(sources):
    source = AutoModelForCausalLM.from_pretrained(sources["llama"], dtype=torch.float32)
    w = source.model.layers[0].mlp.down_proj.weight.detach()  # a layer of its own (K = 200), not turned per head
    model = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(
        bits=3, block_offsets=True, fuse_projections=False), dtype=torch.float32)
    down = model.model.layers[0].mlp.down_proj
    settings = fitting.settings_for(None, 3, None, offsets=True)
    cb = fitting.group_codebook([w], 3, settings)
    planes, records, rows = fitting.quantize_fitted(w, cb, settings.codes_below, settings.codes_above, True)
    for got, want in zip((down.planes, down.block_scales, down.row_scales, down.codebook), (planes, records, rows, cb)):
        assert torch.equal(got, want)
    plain = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(
        bits=3, block_offsets=False, fuse_projections=False), dtype=torch.float32).model.layers[0].mlp.down_proj
    err = (down.dequantize_weight() - w).square().sum()
    assert err < 0.7 * (plain.dequantize_weight() - w).square().sum()  # blocks shifted by one std: about half


def test_quantize_model_matches_quantize_on_load(sources):
    config = KbitConfig(bits=4, block_offsets=True)
    loaded = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=config, dtype=torch.float32)
    model = hf_kbit.quantize_model(AutoModelForCausalLM.from_pretrained(sources["llama"], dtype=torch.float32),
                                   KbitConfig(bits=4, block_offsets=True), modules_to_not_convert=["lm_head"])
    got = dict(model.named_buffers())
    for name, t in loaded.named_buffers():
        if name.endswith("block_scales"):
            assert torch.equal(got[name], t)
    torch.testing.assert_close(logits(model), logits(loaded), rtol=0, atol=0)


def test_absmax_fitting_with_offsets():
    """fitting="absmax": each block less its offset, absmax code, the configured codebook."""
    w = torch.randn(48, 160, generator=torch.Generator().manual_seed(2)) + 0.5
    layer = torch.nn.Linear(160, 48, bias=False)
    layer.weight.data.copy_(w)
    q = KbitLinear.from_linear(layer, bits=4, fitting="absmax", block_offsets=True)
    cb = fmt.make_codebook(None, 4)
    want = fitting.quantize_fitted(w, cb, 0, 0, offsets=True)
    assert torch.equal(q.codebook, cb)
    for got, ref in zip((q.planes, q.block_scales, q.row_scales), want):
        assert torch.equal(got, ref)


def test_siblings_fuse_only_with_the_same_scales_dtype(sources):
    model = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(
        bits=4, block_offsets=True, fuse_projections=False), dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    plain = KbitLinear.from_linear(torch.nn.Linear(128, attn.v_proj.out_features, bias=False), bits=4,
                                   codebook=attn.q_proj.codebook.tolist())
    attn.v_proj = plain
    assert hf_kbit.fuse_projections(model) and not isinstance(getattr(attn, "qkv_proj", None), KbitFusedProjections)


@pytest.mark.parametrize("kwargs", [dict(block_offsets=1), dict(block_offsets="yes")])
def test_config_refuses_non_bool(kwargs):
    with pytest.raises(TypeError, match="block_offsets must be a bool or None"):
        KbitConfig(**kwargs)


def test_config_round_trip_and_default():
    assert KbitConfig().block_offsets is None and "block_offsets" not in KbitConfig().to_dict()
    config = KbitConfig(bits=3, block_offsets=True)
    assert KbitConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(("kwargs", "want"), [
    ({}, True),
    ({"bits": 2}, True),
    ({"bits": 5}, True),
    ({"calibration_data": "some text"}, True),
    ({"rotation": True}, False),
    ({"rotation": "inputs"}, False),
    ({"rotation": "auto"}, False),
    ({"fitting": "absmax"}, False),
    ({"block_offsets": False}, False),
    ({"block_offsets": True, "rotation": True}, True),
    ({"block_offsets": True, "fitting": "absmax"}, True),
])
def test_default_gives_offsets_unless_rotated_or_absmax(kwargs, want):
    assert KbitConfig(**kwargs).resolved_block_offsets() is want
    assert KbitConfig(**kwargs).resolved_block_offsets(pre_quantized=True) is bool(kwargs.get("block_offsets"))


def test_default_quantizes_with_records_and_records_it(sources, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(bits=4),
                                                 dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, KbitLinear)]
    assert linears and all(m.block_offsets and m.block_scales.dtype == torch.int16 for m in linears)
    assert model.config.quantization_config.block_offsets is True
    model.save_pretrained(tmp_path / "kbit")
    saved = json.loads((tmp_path / "kbit" / "config.json").read_text())["quantization_config"]
    assert saved["block_offsets"] is True and saved["format_version"] == fmt.OFFSETS_VERSION
    rotated = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(
        bits=4, rotation=True), dtype=torch.float32)
    assert not any(m.block_offsets for m in rotated.modules() if isinstance(m, KbitLinear))


def test_a_checkpoint_without_the_field_loads_without_records(sources, tmp_path):
    """A format v1 checkpoint (written before block offsets were the default, or with block_offsets=False) has
    no field: pre-quantized, None means none."""
    model = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(
        bits=4, block_offsets=False), dtype=torch.float32)
    model.save_pretrained(tmp_path / "kbit")
    saved = json.loads((tmp_path / "kbit" / "config.json").read_text())["quantization_config"]
    assert "block_offsets" not in saved and saved["format_version"] == 1
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)
    assert not any(m.block_offsets for m in again.modules() if isinstance(m, KbitLinear))
    torch.testing.assert_close(logits(again), logits(model), rtol=0, atol=0)


def test_checkpoint_without_records_under_a_records_config_is_refused(sources, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(
        bits=4, block_offsets=False), dtype=torch.float32)
    model.save_pretrained(tmp_path / "kbit")
    config_path = tmp_path / "kbit" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["block_offsets"] = True
    config_path.write_text(json.dumps(config))
    with pytest.raises(KbitCheckpointError, match="block_scales' in .* is U8 .* expects torch.int16"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)


def test_record_with_offset_code_minus_128_is_refused(sources, tmp_path):
    from safetensors.torch import load_file, save_file

    model = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(
        bits=4, block_offsets=True), dtype=torch.float32)
    model.save_pretrained(tmp_path / "kbit")
    path = tmp_path / "kbit" / "model.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("down_proj.block_scales"))
    tensors[key][0, 0, 0, 0] = -128 * 256 + 5  # offset code -128, E4M4 code 5
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(KbitCheckpointError, match="block offsets below -127"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)
