"""Quantize-on-load with KbitConfig.rotation, through transformers: what is rotated, saving (format v3, the sign words
in the checkpoint), reloading to the same logits, and checkpoints whose config and tensors disagree."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_kbit
from hf_kbit import KbitConfig, KbitLinear
from hf_kbit.checkpoint import KbitCheckpointError
from hf_kbit.nn import KbitExperts, KbitFusedProjections
from tiny_models import tiny_dense_model, tiny_moe_model

transformers.utils.logging.set_verbosity_error()
IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
ROTATIONS = pytest.mark.parametrize("rotation", [True, "inputs", "auto"], ids=["on", "inputs", "auto"])


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Saved float32 tiny models whose in_features may rotate: a Llama (K = 128; down_proj's 200 may not, nor can
    gate/up fuse) and a Qwen3-MoE (experts' K = 128 and 64)."""
    out = {}
    for name, model in (
        ("llama", tiny_dense_model("llama", torch.float32, hidden_size=128, intermediate_size=200)),
        ("qwen3_moe", tiny_moe_model("qwen3_moe", torch.float32, hidden_size=128, moe_intermediate_size=64)),
    ):
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = path
    return out


def rotated_names(model) -> list[str]:
    names = []
    for name, m in model.named_modules():
        if isinstance(m, KbitLinear) and m.rotated:
            names.append(name)
        elif isinstance(m, KbitExperts):
            names += [f"{name}.{p}" for p, r in m.rotated.items() if r]
    return names


@ROTATIONS
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_save_and_reload_round_trip_the_logits(sources, tmp_path, family, rotation):
    model = AutoModelForCausalLM.from_pretrained(sources[family], quantization_config=KbitConfig(
        bits=3, rotation=rotation, rotation_seed=4), dtype=torch.float32)
    rotated = rotated_names(model)
    assert not any(name.endswith("mlp.down_proj") for name in rotated)  # the Llama's K = 200 stays unrotated
    if rotation is True:
        assert all(m.rotated for m in model.modules() if isinstance(m, KbitFusedProjections))
        # the Llama: q, k, v, o, gate, up; the MoE: q, k, v (o_proj reads 4 heads x 24 = 96) and both expert projections
        assert len(rotated) == (2 * 6 if family == "llama" else 2 * (3 + 2))
    if rotation == "inputs":  # the input projections: q, k, v, gate, up (the Llama), q, k, v and the experts' gate_up
        inputs = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "gate_up_proj")
        assert all(name.rpartition(".")[2] in inputs for name in rotated)
        assert len(rotated) == (2 * 5 if family == "llama" else 2 * (3 + 1))
    expected = logits(model)
    model.save_pretrained(tmp_path / "kbit")
    qc = json.loads((tmp_path / "kbit" / "config.json").read_text())["quantization_config"]
    assert qc["rotation"] == rotation and qc["rotation_seed"] == 4
    assert qc["format_version"] == (3 if rotated else 1)
    with safe_open(tmp_path / "kbit" / "model.safetensors", "pt") as f:
        signs = sorted(k for k in f.keys() if k.endswith("rotation_signs"))
    assert len(signs) == len(rotated)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)
    assert rotated_names(again) == rotated
    assert again.config.quantization_config.format_version == qc["format_version"]
    torch.testing.assert_close(logits(again), expected, rtol=0, atol=0)


@ROTATIONS
def test_quantize_on_load_is_quantize_model(sources, rotation):
    config = KbitConfig(bits=4, rotation=rotation)
    loaded = AutoModelForCausalLM.from_pretrained(sources["qwen3_moe"], quantization_config=config,
                                                  dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(sources["qwen3_moe"], dtype=torch.float32)
    skip = hf_kbit.quantizer.KbitHfQuantizer(config).skipped_modules(plain)
    hf_kbit.quantize_model(plain, copy.deepcopy(config), skip)
    a, b = loaded.state_dict(), plain.state_dict()
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_without_rotation_the_checkpoint_is_format_v1(sources, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(bits=4,
                                                                                                block_offsets=False))
    assert not rotated_names(model) and all(m.rotation_signs is None for m in model.modules() if isinstance(m, KbitLinear))
    model.save_pretrained(tmp_path / "kbit")
    qc = json.loads((tmp_path / "kbit" / "config.json").read_text())["quantization_config"]
    assert qc["format_version"] == 1 and "rotation" not in qc


def test_auto_that_rotates_nothing_stays_format_v1(sources, tmp_path, monkeypatch):
    from hf_kbit import rotation_policy

    monkeypatch.setattr(rotation_policy, "keeps_rotated", lambda *args: False)
    model = AutoModelForCausalLM.from_pretrained(sources["qwen3_moe"], quantization_config=KbitConfig(
        bits=4, rotation="auto"))
    assert not rotated_names(model)
    assert not any(k.endswith("rotation_signs") for k in model.state_dict())
    model.save_pretrained(tmp_path / "kbit")
    qc = json.loads((tmp_path / "kbit" / "config.json").read_text())["quantization_config"]
    assert qc["format_version"] == 1 and qc["rotation"] == "auto"
    AutoModelForCausalLM.from_pretrained(tmp_path / "kbit")


def test_sign_words_under_a_config_without_rotation_are_refused(sources, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(
        bits=4, rotation=True))
    model.save_pretrained(tmp_path / "kbit")
    path = tmp_path / "kbit" / "config.json"
    config = json.loads(path.read_text())
    del config["quantization_config"]["rotation"]
    path.write_text(json.dumps(config))
    with pytest.raises(KbitCheckpointError, match=r"sign words of rotated layers \(e\.g\. 'model\.layers\.\d\.\S+"
                       r"\.rotation_signs'\), but its quantization_config has no rotation"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "kbit")


@pytest.mark.parametrize("family, rotation, key", [
    ("llama", True, "model.layers.1.self_attn.o_proj.rotation_signs"),
    ("llama", "inputs", "model.layers.0.mlp.up_proj.rotation_signs"),
    ("qwen3_moe", True, "model.layers.1.mlp.experts.down_rotation_signs"),
    ("qwen3_moe", "inputs", "model.layers.0.mlp.experts.gate_up_rotation_signs"),
], ids=["llama-on", "llama-inputs", "moe-on", "moe-inputs"])
def test_a_missing_sign_word_tensor_is_refused_naming_it(sources, tmp_path, family, rotation, key):
    """Without its sign words a rotated weight would load as an unrotated W R and compute a wrong product."""
    from safetensors.torch import load_file, save_file

    model = AutoModelForCausalLM.from_pretrained(sources[family], quantization_config=KbitConfig(
        bits=3, rotation=rotation), dtype=torch.float32)
    model.save_pretrained(tmp_path / "kbit")
    AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)  # complete: loads
    path = tmp_path / "kbit" / "model.safetensors"
    tensors = load_file(path)
    del tensors[key]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(KbitCheckpointError, match=rf"checkpoint tensor '{key.replace('.', '[.]')}' is missing: the "
                       rf"quantization_config's rotation={rotation!r} stores .* rotated"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)


def test_under_auto_a_sibling_group_stored_partly_rotated_is_refused(sources, tmp_path):
    """'auto' decides per group of siblings, so q/k/v are all rotated or none; a rotation=True checkpoint is one
    of its outcomes (every group rotated)."""
    from safetensors.torch import load_file, save_file

    model = AutoModelForCausalLM.from_pretrained(sources["llama"], quantization_config=KbitConfig(
        bits=3, rotation=True), dtype=torch.float32)
    model.save_pretrained(tmp_path / "kbit")
    config_path = tmp_path / "kbit" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["rotation"] = "auto"
    config_path.write_text(json.dumps(config))
    AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)  # complete: loads
    path = tmp_path / "kbit" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.self_attn.k_proj.rotation_signs"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(KbitCheckpointError, match=r"checkpoint tensor 'model[.]layers[.]0[.]self_attn[.]k_proj[.]"
                       r"rotation_signs' is missing: its siblings \['model.layers.0.self_attn.q_proj', "):
        AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.float32)
