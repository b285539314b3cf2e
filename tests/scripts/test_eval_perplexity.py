"""eval_perplexity core: windows, identical inputs across variants, finite bf16, kbit5 near bf16, JSON schema."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TINY_TEXT

import eval_perplexity as ep

# A random tiny model has perplexity near its vocabulary size; 5-bit weights move it by well under this.
KBIT5_MAX_PPL_RATIO = 1.05


@pytest.mark.parametrize(("n", "window", "stride"), [(10, 4, 2), (10, 4, 4), (11, 5, 3), (3, 8, 8), (100, 16, 1)])
def test_windows_score_every_token_once(n, window, stride):
    windows = ep.make_windows(n, window, stride)
    scored = [t for w in windows for t in range(w.target_begin, w.end)]
    assert scored == list(range(1, n))
    assert all(w.end - w.begin <= window and w.begin < w.target_begin for w in windows)


@pytest.mark.parametrize(("window", "stride"), [(1, 1), (4, 0), (4, 5)], ids=["window<2", "stride0", "stride>window"])
def test_windows_reject_bad_arguments(window, stride):
    with pytest.raises(ValueError, match="--window|--stride"):
        ep.make_windows(10, window, stride)


def test_score_windows_matches_full_sequence_loss(tiny_folder):
    """One window covering the text scores exactly the model's mean next-token loss."""
    import _eval_common as common
    from transformers import AutoTokenizer

    model, _ = common.load_variant(tiny_folder, None, "cpu", torch.float32)
    ids = ep.tokenize(AutoTokenizer.from_pretrained(tiny_folder), TINY_TEXT, 64)
    nll_sum, count = ep.score_windows(model, ids, ep.make_windows(len(ids), 64, 64))
    with torch.no_grad():
        loss = model(input_ids=ids[None], labels=ids[None]).loss
    assert count == len(ids) - 1
    assert nll_sum / count == pytest.approx(float(loss), rel=1e-4)


@pytest.fixture(scope="module")
def payload(tiny_folder):
    return ep.run(
        tiny_folder, {"name": "tiny", "spec": "tiny", "slug": "tiny", "source": "test"}, "tiny text", TINY_TEXT,
        [5], window=64, stride=32, max_tokens=200, device="cpu", dtype=torch.float32, log=lambda *_: None,
    )


def test_bf16_finite_and_kbit5_close(payload):
    bf16, k5 = payload["results"]
    assert bf16["variant"] == "bf16" and k5["variant"] == "kbit5"
    assert math.isfinite(bf16["ppl"]) and bf16["ppl"] > 1
    assert k5["ppl"] / bf16["ppl"] < KBIT5_MAX_PPL_RATIO
    assert k5["scored_tokens"] == bf16["scored_tokens"] == payload["tokenization"]["n_tokens"] - 1
    assert k5["kbit_forward"] == "dequantized-to-nn.Linear" and 5 < k5["bits_per_weight"] < 7


def test_identical_inputs_between_runs(tiny_folder, payload):
    again = ep.run(
        tiny_folder, payload["model"], "tiny text", TINY_TEXT, [], window=64, stride=32, max_tokens=200,
        device="cpu", dtype=torch.float32, log=lambda *_: None,
    )
    assert again["windows"] == payload["windows"]
    assert again["results"][0]["ppl"] == pytest.approx(payload["results"][0]["ppl"], rel=1e-6)


def test_kbit_reference_forward_matches_dequantized(tiny_folder):
    """Dequantizing on CPU is a speed shortcut only: the kbit reference forward gives the same loss."""
    import _eval_common as common
    from transformers import AutoTokenizer

    ids = ep.tokenize(AutoTokenizer.from_pretrained(tiny_folder), TINY_TEXT, 48)
    windows = ep.make_windows(len(ids), 48, 48)
    ref, info = common.load_variant(tiny_folder, 4, "cpu", torch.float32, dequantize_on_cpu=False)
    deq, _ = common.load_variant(tiny_folder, 4, "cpu", torch.float32, dequantize_on_cpu=True)
    assert info["kbit_forward"] == "reference"
    assert ep.score_windows(ref, ids, windows)[0] == pytest.approx(ep.score_windows(deq, ids, windows)[0], rel=1e-4)


def test_json_schema(payload, tmp_path):
    import _eval_common as common

    path = common.write_json(tmp_path / "p.json", payload)
    data = json.loads(path.read_text())
    assert data["schema"] == ep.SCHEMA
    assert {"model", "corpus", "tokenization", "windows", "device", "compute_dtype", "results"} <= data.keys()
    assert {"window", "stride", "count", "tokens_sha256", "windows_sha256"} <= data["windows"].keys()
    for r in data["results"]:
        assert {"variant", "bits", "bits_per_weight", "ppl", "nll_per_token", "scored_tokens",
                "delta_ppl_pct_vs_bf16", "ppl_ratio_vs_bf16"} <= r.keys()
    assert "| kbit5 |" in ep.render_table(data)


def test_results_markdown_matches_json(payload, tmp_path):
    import plot_results

    common_payload = {**payload, "command": "python scripts/eval_perplexity.py", "_file": "p.json"}
    text = plot_results.render_results_md({"perplexity": [common_payload], "generation": [], "bench": []}, [])
    for r in payload["results"]:
        assert f"| {r['variant']} | {r['bits_per_weight']:.3f} |" in text
        assert plot_results._ppl(r["ppl"]) in text
    png = plot_results.plot_perplexity([common_payload], tmp_path / "ppl.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lm_head_variants_quantize_the_head_too(tiny_folder, tmp_path):
    import _eval_common as common
    import plot_results

    info = {"name": "tiny", "spec": "tiny", "slug": "tiny", "source": "test"}
    p = ep.run(tiny_folder, info, "tiny text", TINY_TEXT, [4], window=64, stride=32, max_tokens=200, device="cpu",
               dtype=torch.float32, lm_head_bits=[4, 5], log=lambda *_: None)
    bf16, k4, head4, head5 = p["results"]
    assert [r["variant"] for r in p["results"]] == ["bf16", "kbit4", "kbit4-head4", "kbit4-head5"]
    assert (k4["lm_head_bits"], head4["lm_head_bits"], head5["lm_head_bits"]) == (None, 4, 5)
    assert k4["quantized_fraction"] < head4["quantized_fraction"] == head5["quantized_fraction"]
    assert k4["bits_per_weight"] < head5["bits_per_weight"]  # the k = 5 head raises the average
    assert head4["ppl"] != k4["ppl"] and all(math.isfinite(r["ppl"]) for r in p["results"])
    assert len({r["scored_tokens"] for r in p["results"]}) == 1
    p.update({"command": "python scripts/eval_perplexity.py", "_file": "p.json", "environment": {}})
    text = plot_results.perplexity_markdown(p)
    assert "### tiny with the LM head quantized" in text and "| kbit4-head5 |" in text
    png = plot_results.plot_perplexity([p], tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    model, _ = common.load_variant(tiny_folder, 4, "cpu", torch.float32, dequantize_on_cpu=False, lm_head_bits=5)
    assert model.lm_head.bits == 5 and model.model.layers[0].mlp.down_proj.bits == 4


def test_lm_head_bits_refuses_a_tied_head_and_bf16(tiny_folder, tmp_path):
    import _eval_common as common
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tied = AutoModelForCausalLM.from_pretrained(tiny_folder, tie_word_embeddings=True)
    tied.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--lm-head-bits: the LM head of .* is tied to its input embedding"):
        common.load_variant(tmp_path, 4, "cpu", torch.float32, lm_head_bits=4)
    with pytest.raises(ValueError, match="lm_head_bits quantizes the LM head of a kbit variant; bits is None"):
        common.load_variant(tiny_folder, None, "cpu", torch.float32, lm_head_bits=4)
    with pytest.raises(ValueError, match=r"--lm-head-bits: \[6\] not in the supported"):
        ep.main(["--model", str(tiny_folder), "--lm-head-bits", "6"])
