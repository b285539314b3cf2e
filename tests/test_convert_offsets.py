"""kbit-convert with KbitConfig.block_offsets (format v4): the same tensors as quantize-on-load (dense and MoE:
experts keep uint8 scales), config.json, the card and the plan's sizes say so."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

import hf_kbit
from hf_kbit import format as fmt
from hf_kbit.convert import convert
from convert_helpers import llama_fp32, make_moe  # noqa: F401
from test_convert import assert_same_state, load, quantize_on_load


def scale_dtypes(folder) -> dict[str, str]:
    out = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            out |= {k: f.get_slice(k).get_dtype() for k in f.keys() if k.endswith("block_scales")}
    return out


def test_dense_convert_matches_quantize_on_load(llama_fp32, tmp_path):  # noqa: F811
    config = hf_kbit.KbitConfig(bits=3, block_offsets=True)
    plan = convert(llama_fp32, tmp_path / "out", config, dry_run=True)
    result = convert(llama_fp32, tmp_path / "out", config, max_shard_size="40KB", progress=False)
    converted, reference = load(result.out), quantize_on_load(llama_fp32, config)
    assert_same_state(converted, reference)
    dtypes = scale_dtypes(result.out)
    assert dtypes and set(dtypes.values()) == {"I16"}
    assert plan.stats()["size_after_bytes"] == result.stats["size_after_bytes"]
    qc = json.loads((result.out / "config.json").read_text())["quantization_config"]
    assert qc["block_offsets"] is True
    assert qc["format_version"] == fmt.OFFSETS_VERSION == reference.config.quantization_config.format_version
    assert "| Block offsets | an 8-bit offset per block of 32" in (result.out / "README.md").read_text()
    ids = torch.tensor([[1, 5, 9, 40, 7]])
    torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_moe_convert_keeps_plain_scales_for_experts(tmp_path):
    source = make_moe(tmp_path / "moe", hidden_size=128, moe_intermediate_size=64)
    config = hf_kbit.KbitConfig(bits=4, block_offsets=True)
    result = convert(source, tmp_path / "out", config, max_shard_size="40KB", progress=False)
    converted, reference = load(result.out), quantize_on_load(source, config)
    assert_same_state(converted, reference)
    dtypes = scale_dtypes(result.out)
    assert {d for k, d in dtypes.items() if ".experts." in k} == {"U8"}
    assert {d for k, d in dtypes.items() if ".experts." not in k} == {"I16"}


def test_cli_flag(llama_fp32, tmp_path):  # noqa: F811
    from hf_kbit import cli

    assert cli.main([str(llama_fp32), "--out", str(tmp_path / "out"), "--bits", "4", "--block-offsets"]) == 0
    assert set(scale_dtypes(tmp_path / "out").values()) == {"I16"}
