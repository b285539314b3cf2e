"""kbit-convert with KbitConfig.rotation (format v3): the same tensors as quantize-on-load (dense and MoE, streamed
experts included, with calibration too), config.json and the card say what was rotated, the plan predicts sizes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import hf_kbit
from hf_kbit.convert import convert, writing
from convert_helpers import llama_fp32, make_moe  # noqa: F401
from test_convert import assert_same_state, calibration_config, load, quantize_on_load

ROTATIONS = pytest.mark.parametrize("rotation", [True, "inputs", "auto"], ids=["on", "inputs", "auto"])


def saved_keys(folder) -> set[str]:
    keys = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            keys |= set(f.keys())
    return keys


@pytest.fixture(scope="module")
def rotatable_moe(tmp_path_factory):
    """A tiny Qwen3-MoE whose expert projections may rotate (K = 128 and 64), experts saved one by one."""
    return make_moe(tmp_path_factory.mktemp("moe-rot") / "model", hidden_size=128, moe_intermediate_size=64)


@ROTATIONS
def test_dense_convert_matches_quantize_on_load(llama_fp32, tmp_path, rotation):  # noqa: F811
    config = hf_kbit.KbitConfig(bits=3, rotation=rotation, rotation_seed=11)
    plan = convert(llama_fp32, tmp_path / "out", config, dry_run=True)
    result = convert(llama_fp32, tmp_path / "out", config, max_shard_size="40KB", progress=False)
    converted, reference = load(result.out), quantize_on_load(llama_fp32, config)
    assert_same_state(converted, reference)
    keys = saved_keys(result.out)
    rotated = sorted(k for k in keys if k.endswith("rotation_signs"))
    assert not any(".down_proj." in k for k in rotated)  # in_features 96: not a multiple of 64, never rotated
    assert len(rotated) == result.stats["rotated_tensors"]
    qc = json.loads((result.out / "config.json").read_text())["quantization_config"]
    assert qc["rotation"] == rotation and qc["rotation_seed"] == 11
    assert qc["format_version"] == (3 if rotated else 1) == reference.config.quantization_config.format_version
    if rotation is True:  # every q, k, v, o, gate, up of both layers; the plan knew it
        assert len(rotated) == 2 * 6 and plan.stats()["size_after_bytes"] == result.stats["size_after_bytes"]
        assert "rotation:      block Hadamard (block 8, seed 11), every one of 12 tensors" in plan.describe()
    if rotation == "inputs":  # q, k, v, gate, up of both layers (not o); the plan knew it
        assert len(rotated) == 2 * 5 and not any(".o_proj." in k for k in rotated)
        assert plan.stats()["size_after_bytes"] == result.stats["size_after_bytes"]
        assert "the input projections (not o/down) of 12 tensors" in plan.describe()
    card = (result.out / "README.md").read_text()
    assert "| Rotation | seeded block Hadamard along K (block 8, seed 11)" in card
    assert f"{len(rotated)} of {result.stats['quantized_tensors']} tensors are stored rotated" in card
    ids = torch.tensor([[1, 5, 9, 40, 7]])
    torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=0)


@ROTATIONS
def test_moe_convert_streaming_experts_matches_quantize_on_load(rotatable_moe, tmp_path, monkeypatch, rotation):
    monkeypatch.setattr(writing, "_EXPERT_CHUNK_ELEMENTS", 3 * 128 * 128)  # 3 experts of gate_up at a time
    config = hf_kbit.KbitConfig(bits=4, rotation=rotation)
    result = convert(rotatable_moe, tmp_path / "out", config, progress=False)
    converted, reference = load(result.out), quantize_on_load(rotatable_moe, config)
    assert_same_state(converted, reference)
    experts = converted.model.layers[0].mlp.experts
    assert experts.rotated == reference.model.layers[0].mlp.experts.rotated
    if rotation is True:
        assert experts.rotated == {"gate_up_proj": True, "down_proj": True}
    if rotation == "inputs":
        assert experts.rotated == {"gate_up_proj": True, "down_proj": False}


def test_unrotated_convert_is_format_v1_without_rotation_fields(llama_fp32, tmp_path):  # noqa: F811
    result = convert(llama_fp32, tmp_path / "out", hf_kbit.KbitConfig(bits=4, head_rotation=False, block_offsets=False),
                     progress=False)
    qc = json.loads((result.out / "config.json").read_text())["quantization_config"]
    assert qc["format_version"] == 1 and "rotation" not in qc and "rotation_seed" not in qc
    assert not any(k.endswith("rotation_signs") for k in saved_keys(result.out))
    assert "| Rotation | none |" in (result.out / "README.md").read_text()


@pytest.mark.parametrize("rotation,rotated", [(True, 2 * 6), ("inputs", 2 * 5)], ids=["on", "inputs"])
def test_calibrated_convert_with_rotation_matches_calibrated_quantize_on_load(
        llama_fp32, tmp_path, rotation, rotated):  # noqa: F811
    config = calibration_config(bits=3, rotation=rotation)
    result = convert(llama_fp32, tmp_path / "out", config, dtype="float32", progress=False)
    reference = quantize_on_load(llama_fp32, config, dtype=torch.float32)
    assert_same_state(load(result.out, dtype=torch.float32), reference)
    assert result.stats["rotated_tensors"] == rotated and result.stats["format_version"] == 3
