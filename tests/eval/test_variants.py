"""Variant specs, the Linears the anchors quantize, and loading every kind of variant."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_text_model

from hf_kbit.eval import variants as V

# Weight SQNR of a k = 4 model quantized with head_rotation against without: the same weights in another basis
# quantize within about a dB of each other.
TURNED_SQNR_DB_TOLERANCE = 1.5


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_llama"))


def test_parse_plain_specs():
    specs = V.parse_variants("bf16, kbit4,hqq3,rtn2,nf4")
    assert [(s.name, s.method, s.bits) for s in specs] == [
        ("bf16", "bf16", None), ("kbit4", "kbit", 4), ("hqq3", "hqq", 3), ("rtn2", "rtn", 2), ("nf4", "nf", 4)]
    assert specs[2].anchor().group_size == 64 and specs[3].anchor().group_size == 128


def test_options_go_to_kbitconfig_as_json_values():
    cb = [-1.0, -0.25, 0.25, 1.0]
    spec, other = V.parse_variants(f"kbit2:codebook={cb}:fuse_projections=false:name=kbit2-mine,kbit3:codebook=nf")
    assert (spec.name, spec.options) == ("kbit2-mine", {"codebook": cb, "fuse_projections": False})
    config = spec.kbit_config()
    assert config.codebook == cb and config.fuse_projections is False
    assert other.kbit_config().codebook == "nf" and other.name == "kbit3:codebook=nf"


def test_lm_head_option():
    spec = V.parse_variant("kbit4:lm_head_bits=5")
    assert spec.lm_head_bits == 5 and spec.options == {}
    config = spec.kbit_config()
    assert config.modules_to_not_convert == [] and config.module_bits == {"^lm_head$": 5}
    assert [s.name for s in V.bits_variants([4], [5])] == ["bf16", "kbit4", "kbit4-head5"]


@pytest.mark.parametrize(("text", "match"), [
    ("int4", "METHOD one of"), ("kbit", "needs its bits"), ("kbit6", "must be one of"),
    ("kbit4:codebook_fit=lloyd", "unexpected field"), ("kbit4:codebook=xx", "codebook must be one of"),
    ("rtn4:block=3", "unknown option"), ("nf3", "nf anchors take bits"), ("bf16:x=1", "no bits and no options"),
    ("kbit4:codebook=[1,2", "unbalanced"), ("kbit4:nonsense", "not KEY=VALUE"), ("hqq4:lm_head_bits=4", "kbit"),
])
def test_bad_specs_name_the_variant(text, match):
    with pytest.raises(ValueError, match=match):
        V.parse_variant(text)


def test_duplicate_labels_are_refused():
    with pytest.raises(ValueError, match="duplicate"):
        V.parse_variants("kbit4,kbit4")


def test_anchors_quantize_the_linears_kbit_quantizes(tiny_folder, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_kbit
    from hf_kbit.nn import KbitLinear

    for folder, tied in ((tiny_folder, False), (tmp_path, True)):
        if tied:
            AutoModelForCausalLM.from_pretrained(tiny_folder, tie_word_embeddings=True).save_pretrained(tmp_path)
            AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(tmp_path)
        plain = AutoModelForCausalLM.from_pretrained(folder)
        config = hf_kbit.KbitConfig(bits=4, fuse_projections=False)
        kbit = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config)
        kbit_names = [n for n, m in kbit.named_modules() if isinstance(m, KbitLinear)]
        assert V.quantizable_linears(plain) == kbit_names
        assert "lm_head" not in kbit_names and len(kbit_names) == 2 * 7


@pytest.mark.parametrize("text", ["rtn3", "nf4", "hqq4"])
def test_anchor_variant_rewrites_decoder_linears_only(tiny_folder, text):
    if text.startswith("hqq"):
        pytest.importorskip("hqq", reason="hqq is an optional dependency (pip install hf-kbit[eval])")
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    model, info = V.load_variant(tiny_folder, V.parse_variant(text), "cpu", torch.float32)
    names = V.quantizable_linears(plain)
    for name, p in plain.named_parameters():
        changed = not torch.equal(p, model.get_parameter(name))
        assert changed == (name.removesuffix(".weight") in names), name
    assert info["quantized_modules"] == len(names) and 10 < info["weight_sqnr_db"] < 40
    # every K here (128, 256) is a multiple of every group size: all layers cost the same bits/weight
    assert info["bits_per_weight"] == pytest.approx(V.parse_variant(text).anchor().bits_per_weight(256, 128))


def test_kbit_variant_reports_sqnr_against_the_checkpoint(tiny_folder):
    reference = V.reference_weights(tiny_folder)
    assert "lm_head" in reference  # untied: kept for the -head variants
    _, k4 = V.load_variant(tiny_folder, V.parse_variant("kbit4"), "cpu", torch.float32, reference=reference)
    _, k5 = V.load_variant(tiny_folder, V.parse_variant("kbit5"), "cpu", torch.float32, reference=reference)
    _, head = V.load_variant(tiny_folder, V.parse_variant("kbit4:lm_head_bits=5"), "cpu", torch.float32,
                             reference=reference)
    assert 15 < k4["weight_sqnr_db"] < k5["weight_sqnr_db"] and head["weight_sqnr_db"] is not None
    assert k4["kbit_forward"] == "dequantized-to-nn.Linear" and head["quantized_modules"] == k4["quantized_modules"] + 1
    # head_rotation: v and o are compared in the basis they were quantized in (a weight compared turned against
    # unturned would score near 0 dB)
    _, turned = V.load_variant(tiny_folder, V.parse_variant("kbit4:head_rotation=true"), "cpu", torch.float32,
                               reference=reference)
    assert abs(turned["weight_sqnr_db"] - k4["weight_sqnr_db"]) < TURNED_SQNR_DB_TOLERANCE


def test_run_refuses_variants_that_quantize_different_linears():
    from hf_kbit.eval.harness import _check_same_linears

    def result(variant, sha, **extra):
        return {"variant": variant, "method": "kbit", "quantized_modules": 3, "quantized_params": 30,
                "quantized_modules_sha256": sha, "options": {}, **extra}

    done = [{"variant": "bf16", "method": "bf16"}, result("kbit4", "a")]
    _check_same_linears(done, result("rtn4", "a"))
    _check_same_linears(done, result("kbit4-head5", "b", lm_head_bits=5))  # chosen on purpose
    _check_same_linears(done, result("kbit4:skip", "b", options={"modules_to_not_convert": ["model.layers.0"]}))
    with pytest.raises(RuntimeError, match="nf4 quantized 3 modules .* kbit4 3"):
        _check_same_linears(done, result("nf4", "c"))


def test_kbit_summary_counts_fused_experts():
    """A MoE model's routed experts are most of its weights: bits/weight and the share quantized count them, at
    their own bits (down_proj at 5 here), with one codebook per projection, not per expert, and plain scales (the
    Linears take block records by default)."""
    from tiny_models import tiny_moe_model

    import hf_kbit
    from hf_kbit import format as fmt

    model = tiny_moe_model("qwen3_moe", torch.float32)
    linears = {n: m.weight.shape for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    experts = {n: (m.gate_up_proj.shape, m.down_proj.shape) for n, m in model.named_modules() if n.endswith(".experts")}
    assert experts, "the tiny MoE has fused experts"
    config = hf_kbit.KbitConfig(bits=4, module_bits={r"experts\.down_proj$": 5}, fuse_projections=False)
    hf_kbit.quantize_model(model, config, modules_to_not_convert=["lm_head"])

    elems = sum(n * k for n, k in linears.values())
    bits = sum(fmt.bits_per_weight(n, k, 4, offsets=True) * n * k for n, k in linears.values())
    for (e, two_i, h), (_, _, i) in experts.values():
        for (n, k), b in (((two_i, h), 4), ((h, i), 5)):
            elems += e * n * k
            bits += e * fmt.bits_per_weight(n, k, b) * n * k - (e - 1) * 32 * 2**b  # the codebook is stored once
    summary = V.kbit_summary(model)
    assert summary["quantized_params"] == elems
    assert summary["bits_per_weight"] == pytest.approx(bits / elems)
    assert summary["quantized_modules"] == len(linears) + len(experts)
    total = elems + sum(p.numel() for p in model.parameters())
    assert summary["quantized_fraction"] == pytest.approx(elems / total)


def test_kbitcal_specs():
    spec = V.parse_variant("kbitcal3:samples=4:seq_len=64:lloyd_iters=1")
    assert (spec.method, spec.bits, spec.options) == ("kbitcal", 3, {"samples": 4, "seq_len": 64, "lloyd_iters": 1})
    for text, match in [("kbitcal6", "kbitfit anchors take bits"), ("kbitcal3:group_size=64", "unknown option"),
                        ("kbitcal3:samples=0", "samples must be a positive int"), ("kbitcal3:damp=2", "damp")]:
        with pytest.raises(ValueError, match=match):
            V.parse_variant(text)


def test_kbitcal_calibrates_on_text_the_scoring_does_not_read(tiny_folder):
    from tiny_models import TINY_TEXT

    from hf_kbit.eval.corpus import Corpus

    corpus = Corpus("tiny", TINY_TEXT, {"name": "tiny"})
    spec = V.parse_variant("kbitcal3:samples=2:seq_len=64:lloyd_iters=1")
    with pytest.raises(ValueError, match="fewer than samples x seq_len"):
        V.load_variant(tiny_folder, spec, "cpu", torch.float32, evaluated=(corpus, len(TINY_TEXT) - 100))
    with pytest.raises(ValueError, match="needs it"):
        V.load_variant(tiny_folder, spec, "cpu", torch.float32)
    _, info = V.load_variant(tiny_folder, spec, "cpu", torch.float32, evaluated=(corpus, 100))
    _, fit_info = V.load_variant(tiny_folder, V.parse_variant("kbitfit3:lloyd_iters=1"), "cpu", torch.float32)
    assert info["calibration"]["text"] == "the last 128 tokens of the corpus, after the first 100 characters (the evaluated part)"
    for key in ("quantized_modules", "quantized_modules_sha256", "bits_per_weight", "quantized_params"):
        assert info[key] == fit_info[key], key
    # the same format and codebook as kbitfit, other indices: its weight error is a little higher
    assert fit_info["weight_sqnr_db"] - 3 < info["weight_sqnr_db"] < fit_info["weight_sqnr_db"]


def test_kbitcal_offsets_count_the_records_as_kbitfit_offsets_does(tiny_folder):
    from tiny_models import TINY_TEXT

    from hf_kbit.eval.corpus import Corpus

    corpus = Corpus("tiny", TINY_TEXT, {"name": "tiny"})
    spec = V.parse_variant("kbitcal3:samples=2:seq_len=64:lloyd_iters=1:offsets=1")
    _, info = V.load_variant(tiny_folder, spec, "cpu", torch.float32, evaluated=(corpus, 100))
    _, fit_info = V.load_variant(tiny_folder, V.parse_variant("kbitfit3:lloyd_iters=1:offsets=1"), "cpu", torch.float32)
    _, plain_info = V.load_variant(tiny_folder, V.parse_variant("kbitfit3:lloyd_iters=1:offsets=0"), "cpu",
                                   torch.float32)
    _, default_info = V.load_variant(tiny_folder, V.parse_variant("kbitfit3:lloyd_iters=1"), "cpu", torch.float32)
    assert default_info["bits_per_weight"] == fit_info["bits_per_weight"]  # offsets by default
    assert info["bits_per_weight"] == fit_info["bits_per_weight"] > plain_info["bits_per_weight"]
    assert info["anchor"].startswith("kbit format v4, k = 3, calibrated")


def test_kbit_variants_take_the_rotation_through_kbitconfig(tiny_folder):
    """``kbit<k>:rotation=...`` quantizes through the shipped path (KbitConfig, the rotated modules), not a fake
    quantization: the summary counts the weights stored rotated and their sign words, the SQNR is measured on the
    weights dequantized back into the original basis. The tiny Llama's K (128, 256) all rotate."""
    spec, seeded = V.parse_variants("kbit3:rotation=auto,kbit3:rotation=true:rotation_seed=2")
    assert spec.kbit_config().rotation == "auto" and seeded.kbit_config().rotation is True
    assert seeded.kbit_config().rotation_seed == 2
    with pytest.raises(ValueError, match="rotation must be one of"):
        V.parse_variant("kbit3:rotation=sometimes")
    reference = V.reference_weights(tiny_folder)
    _, plain = V.load_variant(tiny_folder, V.parse_variant("kbit3:block_offsets=false"), "cpu", torch.float32,
                              reference=reference)
    _, rotated = V.load_variant(tiny_folder, seeded, "cpu", torch.float32, reference=reference)
    assert plain["rotated_weights"] == 0 and rotated["rotated_weights"] == rotated["quantized_modules"] == 14
    assert rotated["bits_per_weight"] > plain["bits_per_weight"]  # the sign words: K/8 bytes per weight
    assert rotated["weight_sqnr_db"] > 10 and rotated["kbit_forward"] == "dequantized-to-nn.Linear"
