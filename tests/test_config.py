"""KbitConfig: validation naming the field, JSON round-trip, versioning, registration."""

import json

import pytest

import hf_kbit
from hf_kbit import KbitConfig
from hf_kbit.format import FORMAT_VERSION


def test_defaults_and_json_roundtrip():
    cfg = KbitConfig(
        bits=3, codebook="nf", module_bits={r"mlp\.down_proj": 5}, modules_to_not_convert=["lm_head"], fuse_projections=False
    )
    d = json.loads(cfg.to_json_string())
    assert d["quant_method"] == "kbit" and d["format_version"] == FORMAT_VERSION and d["block_size"] == 32
    again = KbitConfig.from_dict(d)
    assert again == cfg and again.to_dict() == cfg.to_dict()


def test_custom_codebook_roundtrip():
    cfg = KbitConfig(bits=2, codebook=[-1.0, -0.25, 0.25, 1.0])
    assert KbitConfig.from_dict(json.loads(cfg.to_json_string())).codebook == [-1.0, -0.25, 0.25, 1.0]


def test_module_bits_pattern():
    cfg = KbitConfig(bits=4, module_bits={r"\.down_proj$": 5, r"layers\.0\.": 2})
    assert cfg.bits_for("model.layers.3.mlp.down_proj") == 5
    assert cfg.bits_for("model.layers.0.self_attn.q_proj") == 2
    assert cfg.bits_for("model.layers.3.self_attn.q_proj") == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"bits": 6}, "bits"),
        ({"bits": 4.0}, "bits"),
        ({"bits": True}, "bits"),
        ({"codebook": "uniform"}, "codebook"),
        ({"codebook": [-1.0, 1.0]}, "codebook"),
        ({"module_bits": {"mlp": 7}}, "module_bits"),
        ({"module_bits": {"(": 4}}, "module_bits"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
        ({"format_version": 0}, "format_version"),
        ({"fuse_projections": "yes"}, "fuse_projections"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_invalid_fields_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        KbitConfig(**kwargs)


def test_newer_format_version_is_refused_with_upgrade_hint():
    with pytest.raises(ValueError, match="pip install -U hf-kbit"):
        KbitConfig(format_version=FORMAT_VERSION + 1)


def test_unknown_field_and_fixed_facts():
    with pytest.raises(TypeError, match="group_size"):
        KbitConfig(group_size=64)
    with pytest.raises(ValueError, match="block_size"):
        KbitConfig.from_dict({"quant_method": "kbit", "bits": 4, "block_size": 64})


def test_registered_with_transformers():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    from hf_kbit.quantizer import KbitHfQuantizer

    assert AUTO_QUANTIZATION_CONFIG_MAPPING["kbit"] is KbitConfig
    assert AUTO_QUANTIZER_MAPPING["kbit"] is KbitHfQuantizer
    hf_kbit.register()  # idempotent
