"""KbitConfig: validation naming the field, JSON round-trip, versioning, registration."""

import json
import re
import time

import pytest

import hf_kbit
from hf_kbit import KbitConfig
from hf_kbit.format import FORMAT_VERSION


def test_defaults_and_json_roundtrip():
    cfg = KbitConfig(
        bits=3,
        codebook="nf",
        module_bits={r"mlp\.down_proj": 5},
        modules_to_not_convert=["lm_head"],
        fitting="absmax",
        fuse_projections=False,
        fusion_pass=False,
        decode_attention=False,
    )
    d = json.loads(cfg.to_json_string())
    # nothing asks for rotation: the checkpoint is format v1, and the rotation fields are not written
    assert d["quant_method"] == "kbit" and d["format_version"] == 1 and d["block_size"] == 32
    assert "rotation" not in d and "rotation_seed" not in d
    again = KbitConfig.from_dict(d)
    assert again == cfg and again.to_dict() == cfg.to_dict() and again.fitting == "absmax"
    assert again.fusion_pass is False and KbitConfig.from_dict({"bits": 4}).fusion_pass is True  # older configs: on
    assert again.decode_attention is False and KbitConfig.from_dict({"bits": 4}).decode_attention is True
    # runtime choices are written only off their default, so checkpoints stay readable by versions without them
    assert "decode_attention" not in KbitConfig(bits=4).to_dict() and "fusion_pass" not in KbitConfig(bits=4).to_dict()


def test_a_config_without_fitting_takes_the_measured_default():
    """Checkpoints written before the field existed read it as None: each k's default."""
    d = KbitConfig(bits=4).to_dict()
    del d["fitting"]
    assert KbitConfig.from_dict(d).fitting is None


def test_calibration_roundtrip_records_the_calibration_not_the_text(tmp_path):
    """The text and the tokenizer are inputs of the quantization, not of the checkpoint: config.json records only
    the method and the token counts, and reads back as a config that loads without calibrating again."""
    tokenizer = lambda text, **kwargs: {"input_ids": list(text.encode())}  # noqa: E731 -- any callable serves
    cfg = KbitConfig(bits=3, calibration_data="some text", calibration_samples=16, calibration_tokenizer=tokenizer)
    d = json.loads(cfg.to_json_string())
    assert d["calibration"] == {"method": "gptq", "samples": 16, "seq_len": 2048, "tokens": 16 * 2048}
    assert not any(k.startswith("calibration_") for k in d) and "some text" not in cfg.to_json_string()
    again = KbitConfig.from_dict(d)
    assert again == cfg and not again.calibrates and again.calibration == d["calibration"]
    assert "calibration" not in KbitConfig(bits=3).to_dict()  # data-free checkpoints: as before the field existed
    assert KbitConfig(calibration_data="t").calibration_shape() == (128, 2048)


def test_calibration_data_forms(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("from a file\nwith two lines", encoding="utf-8")
    assert KbitConfig(calibration_data=path).calibration_text() == "from a file\nwith two lines"
    assert KbitConfig(calibration_data=str(path)).calibration_text() == "from a file\nwith two lines"
    assert KbitConfig(calibration_data="just text").calibration_text() == "just text"
    assert KbitConfig(calibration_data=["one", "two"]).calibration_text() == "one\n\ntwo"
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="calibration_data: .* is not UTF-8"):
        KbitConfig(calibration_data=tmp_path / "latin1.txt").calibration_text()


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
        ({"bits": 2, "codebook": [-1.0, 0.5, 0.5, 1.0]}, "codebook"),
        ({"module_bits": {"mlp": 7}}, "module_bits"),
        ({"module_bits": {"(": 4}}, "module_bits"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
        ({"format_version": 0}, "format_version"),
        ({"fuse_projections": "yes"}, "fuse_projections"),
        ({"fusion_pass": 1}, "fusion_pass"),
        ({"decode_attention": "kbit_decode"}, "decode_attention"),
        ({"fitting": "gptq"}, "fitting"),
        ({"calibration_data": 123}, "calibration_data"),
        ({"calibration_data": []}, "calibration_data"),
        ({"calibration_data": ["text", 1]}, "calibration_data"),
        ({"calibration_data": "  \n "}, "calibration_data"),
        ({"calibration_data": __import__("pathlib").Path("no-such-file.txt")}, "calibration_data"),
        ({"calibration_data": "text", "calibration_samples": 0}, "calibration_samples"),
        ({"calibration_data": "text", "calibration_seq_len": "2048"}, "calibration_seq_len"),
        ({"calibration_data": "text", "calibration_tokenizer": 5}, "calibration_tokenizer"),
        ({"calibration_samples": 16}, "calibration_samples"),
        ({"calibration_tokenizer": "org/model"}, "calibration_tokenizer"),
        ({"calibration": {"method": "awq", "samples": 1, "seq_len": 1, "tokens": 1}}, "calibration"),
        ({"calibration": {"method": "gptq", "samples": 0, "seq_len": 1, "tokens": 1}}, "calibration"),
        ({"calibration": {"method": "gptq", "samples": 1, "seq_len": 1, "tokens": 1}, "calibration_data": "t"},
         "calibration"),
        ({"rotation": "on"}, "rotation"),
        ({"rotation": 1}, "rotation"),
        ({"rotation": None}, "rotation"),
        ({"rotation": True, "rotation_seed": -1}, "rotation_seed"),
        ({"rotation": True, "rotation_seed": 2**64}, "rotation_seed"),
        ({"rotation": "auto", "rotation_seed": 1.5}, "rotation_seed"),
        ({"rotation_seed": 3}, "rotation_seed"),
        ({"format_version": True}, "format_version"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_invalid_fields_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=rf"KbitConfig\.{field}\b"):
        KbitConfig(**kwargs)


@pytest.mark.parametrize("rotation", [True, "auto"], ids=str)
def test_rotation_fields_round_trip_and_are_written_only_when_set(rotation):
    cfg = KbitConfig(bits=3, rotation=rotation, rotation_seed=7)
    d = json.loads(cfg.to_json_string())
    assert d["rotation"] == rotation and d["rotation_seed"] == 7
    assert d["format_version"] == 1  # raised to 3 by quantization once a layer is stored rotated
    again = KbitConfig.from_dict(d)
    assert again == cfg and again.rotation == rotation and again.rotation_seed == 7
    assert "rotation_seed" not in KbitConfig(rotation=rotation).to_dict()
    assert KbitConfig.from_dict({"bits": 4}).rotation is False  # configs from before the field: unrotated
    assert KbitConfig(format_version=3).format_version == 3  # rotated checkpoints (version 4 adds block records)
    assert KbitConfig(format_version=FORMAT_VERSION).format_version == 4 == FORMAT_VERSION


def test_version_2_is_refused_naming_why_and_what_to_do():
    with pytest.raises(ValueError, match=r"format v2 \(rotated in segments of 64.*Convert the source model again"):
        KbitConfig.from_dict({"bits": 4, "format_version": 2, "rotation": True})


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


# ---------------------------------------------------------------------------- untrusted patterns

# A refused pattern must fail at once, never after matching (catastrophic patterns run for hours).
MAX_REFUSAL_SECONDS = 1.0
# The worst accepted pattern on a long module name (measured ~2 ms; generous for a loaded CI core).
MAX_ACCEPTED_MATCH_SECONDS = 0.1
LONG_NAME = "model.language_model.layers.123.block_sparse_moe.experts.shared_expert.gate_up_proj_" + "x" * 14

LEGIT_PATTERNS = [
    (r"mlp\.down_proj$", "model.layers.3.mlp.down_proj"),
    (r"layers\.\d+\.self_attn\.(q|k|v)_proj", "model.layers.12.self_attn.k_proj"),
    ("^lm_head$", "lm_head"),
    (r"model\.layers\.(0|1|2|3|4|5|6|7|8|9|10|11)\.mlp", "model.layers.10.mlp.up_proj"),
    (r".*\.shared_experts?\..*", "model.layers.1.mlp.shared_experts.down_proj"),
    (r"(?=.*attn)layers\.\d+\.", "model.layers.2.self_attn.o_proj"),
]


@pytest.mark.parametrize("pattern, name", LEGIT_PATTERNS, ids=[p for p, _ in LEGIT_PATTERNS])
def test_legit_patterns_are_accepted(pattern, name):
    fields = {"quant_method": "kbit", "module_bits": {pattern: 2}, "modules_to_not_convert": [pattern]}
    cfg = KbitConfig.from_dict(fields)
    assert cfg.bits_for(name) == 2 and cfg.bits_for("model.embed_tokens") == 4
    assert cfg.modules_to_not_convert == [pattern]


HANG_PATTERNS = {
    "(.*)*#": "another repeat",
    "(a+)+$": "another repeat",
    "(a?)*b": "another repeat",
    "(?:.*){3}#": "another repeat",
    r"(ab|a)*c": "alternation",
    r"(\w)\1*#": "backreference",
    r"\w*\w*\w*#": "paths per match",
    "(.|.)" * 12 + "#": "through alternations",
    "a" * 300: "characters",
}


@pytest.mark.parametrize("field", ["module_bits", "modules_to_not_convert"])
@pytest.mark.parametrize("pattern", list(HANG_PATTERNS), ids=lambda p: p if len(p) < 40 else p[:20] + "...")
def test_catastrophic_patterns_are_refused_at_once(pattern, field):
    value = {pattern: 5} if field == "module_bits" else ["lm_head", pattern]
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"KbitConfig\.{field} .*{re.escape(HANG_PATTERNS[pattern])}"):
        KbitConfig.from_dict({"quant_method": "kbit", "bits": 4, field: value})
    assert time.perf_counter() - start < MAX_REFUSAL_SECONDS


def test_accepted_patterns_match_fast():
    from hf_kbit.config import MAX_PATTERN_PATHS, check_pattern

    worst = [r".*.*.?#", "(?:.|.)" * 8 + "#", "(?:.|.)" * 6 + r"\w*\w?#"]
    for pattern in worst:
        assert check_pattern(pattern) <= MAX_PATTERN_PATHS
        start = time.perf_counter()
        assert re.search(pattern, LONG_NAME) is None and re.fullmatch(pattern, LONG_NAME) is None
        assert time.perf_counter() - start < MAX_ACCEPTED_MATCH_SECONDS, pattern


def test_pattern_budget_is_per_config():
    many = {rf".*{i}.*x.?#": 5 for i in range(8)}  # each within the per-pattern bound
    with pytest.raises(ValueError, match="together cost"):
        KbitConfig(module_bits=many)
    with pytest.raises(TypeError, match="modules_to_not_convert"):
        KbitConfig(modules_to_not_convert=["lm_head", 3])
