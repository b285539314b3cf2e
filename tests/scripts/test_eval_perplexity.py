"""eval_perplexity: the command line end to end on a tiny model, the older flags, the JSON and its rendering."""

from __future__ import annotations

import json
import math

import eval_perplexity as ep
import pytest
import torch
from conftest import TINY_TEXT

from hf_kbit.eval import harness

# A random tiny model has perplexity near its vocabulary size; 5-bit weights move it by well under this.
KBIT5_MAX_PPL_RATIO = 1.05


def run_cli(tiny_folder, tmp_path, *args: str) -> dict:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text(TINY_TEXT)
    out = tmp_path / "p.json"
    assert ep.main(["--model", str(tiny_folder), "--corpus", str(corpus), "--window", "64", "--stride", "32",
                    "--max-tokens", "200", "--device", "cpu", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def payload(tiny_folder, tmp_path_factory):
    hqq = ",hqq4" if _has_hqq() else ""
    return run_cli(tiny_folder, tmp_path_factory.mktemp("cli"), "--variants", f"bf16,kbit5,kbit4:codebook=nf,rtn4,nf4{hqq}")


def _has_hqq() -> bool:
    try:
        import hqq  # noqa: F401
    except ImportError:
        return False
    return True


def test_every_variant_on_the_same_windows(payload):
    results = {r["variant"]: r for r in payload["results"]}
    bf16, k5 = results["bf16"], results["kbit5"]
    assert math.isfinite(bf16["ppl"]) and bf16["ppl"] > 1 and bf16["delta_ppl"] == 0
    assert k5["ppl"] / bf16["ppl"] < KBIT5_MAX_PPL_RATIO and 5 < k5["bits_per_weight"] < 7
    assert k5["kbit_forward"] == "dequantized-to-nn.Linear" and k5["weight_sqnr_db"] > 20
    assert results["kbit4:codebook=nf"]["options"] == {"codebook": "nf"}
    assert results["rtn4"]["bits_per_weight"] == 4.25 and results["nf4"]["bits_per_weight"] == 4.5
    n = payload["tokenization"]["n_tokens"]
    for r in payload["results"]:
        assert r["scored_tokens"] == n - 1 and len(r["window_nll"]) == payload["windows"]["count"]
        assert r["method"] == "bf16" or r["delta_ppl_se"] is not None
    quantized = {r["quantized_modules_sha256"] for r in payload["results"] if r["method"] != "bf16"}
    assert len(quantized) == 1  # kbit and every anchor quantized the same Linears


def test_json_schema_and_table(payload):
    assert payload["schema"] == harness.SCHEMA
    assert {"model", "corpus", "tokenization", "windows", "device", "compute_dtype", "results", "command",
            "environment"} <= payload.keys()
    assert {"window", "stride", "count", "tokens_sha256", "windows_sha256", "batch_size"} <= payload["windows"].keys()
    assert payload["corpus"]["name"] == "tiny.txt" and payload["corpus"]["kind"] == "file"
    for r in payload["results"]:
        assert {"variant", "method", "bits", "bits_per_weight", "ppl", "nll_per_token", "scored_tokens", "delta_ppl",
                "delta_ppl_se", "delta_ppl_pct", "delta_ppl_pct_se", "weight_sqnr_db", "delta_ppl_pct_vs_bf16",
                "ppl_ratio_vs_bf16"} <= r.keys()
    table = harness.render_table(payload)
    assert "| kbit5 |" in table and "| nf4 |" in table and " ± " in table


def test_same_inputs_give_same_fingerprints(tiny_folder, tmp_path, payload):
    again = run_cli(tiny_folder, tmp_path, "--variants", "bf16", "--batch-size", "3")
    assert {k: v for k, v in again["windows"].items() if k != "batch_size"} == {
        k: v for k, v in payload["windows"].items() if k != "batch_size"}
    assert again["results"][0]["ppl"] == pytest.approx(payload["results"][0]["ppl"], rel=1e-5)


def test_results_markdown_matches_json(payload, tmp_path):
    import plot_results

    p = {**payload, "_file": "p.json"}
    text = plot_results.render_results_md({"perplexity": [p], "generation": [], "bench": []}, [])
    for r in payload["results"]:
        assert f"| {r['variant']} | {r['bits_per_weight']:.3f} |" in text
        assert plot_results._ppl(r["ppl"]) in text
    assert "Δppl (± SE)" in text and "hf_kbit.eval" in text
    assert all(r["block_records_weights"] > 0 for r in payload["results"] if r["method"] == "kbit")  # the default
    assert "Rows quantized before block offsets" not in text
    # a run from before block offsets were the default (no count of records) says what its kbit rows hold
    old = {**p, "results": [{k: v for k, v in r.items() if k != "block_records_weights"} for r in p["results"]]}
    assert "(`kbit5`, `kbit4:codebook=nf`) hold uint8 block scales" in plot_results.perplexity_markdown(old)
    png = plot_results.plot_perplexity([p], tmp_path / "ppl.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_turned_by_the_older_default_are_told_apart(payload):
    """kbit rows record whether v/o were turned; a row of the offsets era without the record was turned at k <= 4
    by the default of its day, so the table says so and the plot's default line takes the `:head_rotation=false` row
    (what KbitConfig(bits=k) quantizes to now) instead."""
    import plot_results

    kbit = [r for r in payload["results"] if r["method"] == "kbit"]
    assert kbit and all(r["head_rotation"] is False for r in kbit)  # block offsets (the default): nothing turned
    assert plot_results._today_default(next(r for r in kbit if r["variant"] == "kbit5"))
    row = next(r for r in kbit if r["variant"] == "kbit5")
    unrecorded = {k: v for k, v in row.items() if k != "head_rotation"}
    old_k4 = {**unrecorded, "variant": "kbit4", "bits": 4}
    off_k4 = {**unrecorded, "variant": "kbit4:head_rotation=false", "bits": 4, "options": {"head_rotation": False}}
    assert plot_results._turned_by_an_older_default(old_k4) and not plot_results._today_default(old_k4)
    assert plot_results._turned_alternative(old_k4)
    assert plot_results._today_default(off_k4) and not plot_results._turned_by_an_older_default(off_k4)
    assert plot_results._today_default(unrecorded)  # k = 5 was never turned by default
    old = {**payload, "_file": "p.json", "results": [*payload["results"], old_k4, off_k4]}
    assert "per head with block offsets (`kbit4`) hold turned v/o" in plot_results.perplexity_markdown(old)
    assert "hold turned v/o" not in plot_results.perplexity_markdown({**payload, "_file": "p.json"})


def test_older_flags_choose_bf16_and_kbit_variants(tiny_folder, tmp_path):
    import plot_results

    from hf_kbit.eval.models import load_bits_variant

    p = run_cli(tiny_folder, tmp_path, "--bits", "4", "--lm-head-bits", "4,5")
    _, k4, head4, head5 = p["results"]
    assert [r["variant"] for r in p["results"]] == ["bf16", "kbit4", "kbit4-head4", "kbit4-head5"]
    assert (k4["lm_head_bits"], head4["lm_head_bits"], head5["lm_head_bits"]) == (None, 4, 5)
    assert k4["quantized_fraction"] < head4["quantized_fraction"] == head5["quantized_fraction"]
    assert k4["bits_per_weight"] < head5["bits_per_weight"]  # the k = 5 head raises the average
    assert head4["ppl"] != k4["ppl"] and len({r["scored_tokens"] for r in p["results"]}) == 1
    p.update({"_file": "p.json"})
    text = plot_results.perplexity_markdown(p)
    assert "### tiny_llama" in text and "with the LM head quantized" in text and "| kbit4-head5 |" in text
    png = plot_results.plot_perplexity([p], tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    model, _ = load_bits_variant(tiny_folder, 4, "cpu", torch.float32, dequantize_on_cpu=False, lm_head_bits=5)
    assert model.lm_head.bits == 5 and model.model.layers[0].mlp.down_proj.bits == 4


@pytest.mark.parametrize(("args", "match"), [
    (["--lm-head-bits", "6"], r"--lm-head-bits: \[6\] not in the supported"),
    (["--variants", "bf16,kbit4", "--bits", "4"], "--variants replaces --bits"),
    (["--variants", "kbit4:codebook=xx"], "codebook must be one of"),
    (["--batch-size", "0"], "--batch-size must be auto or a positive integer"),
    (["--window", "64", "--stride", "65"], "--stride"),
])
def test_bad_arguments_fail_before_loading(args, match):
    with pytest.raises(ValueError, match=match):
        ep.main(["--model", "no-such-model", "--device", "cpu", *args])


def test_default_output_names():
    assert ep.default_out("m", "janeausten", False) == "results/perplexity_m.json"
    assert ep.default_out("m", "python-stdlib", True) == "results/perplexity_m_python-stdlib_lmhead.json"
    assert ep.default_out("m", "some/dir/code.txt", False) == "results/perplexity_m_code.json"
