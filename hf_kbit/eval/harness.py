"""Every variant on the same windows of one corpus: the payload of ``scripts/eval_perplexity.py``.

One run tokenizes the corpus once, cuts the windows once, and scores bf16, kbit variants and anchors on
them (fingerprints of the token ids and windows go into the JSON, so two runs can be compared). Each
variant's per-window NLL sums are kept, and its delta to bf16 comes with a paired standard error
(hf_kbit.eval.perplexity.paired_delta).
"""

from __future__ import annotations

import gc
import math
import time
from pathlib import Path
from typing import Any

from .corpus import Corpus
from .perplexity import fingerprint, make_windows, paired_delta, perplexity, score_windows, tokenize_prefix
from .variants import VariantSpec, load_variant, reference_weights

SCHEMA = "hf_kbit.eval_perplexity/2"


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _check_same_linears(results: list[dict[str, Any]], result: dict[str, Any]) -> None:
    """Every quantized variant must quantize the same Linears, or the comparison between formats is not like for
    like; variants that choose their modules on purpose (``lm_head_bits``, ``modules_to_not_convert``) are exempt."""

    def compared(r: dict[str, Any]) -> bool:
        chosen = r.get("lm_head_bits") is not None or "modules_to_not_convert" in r.get("options", {})
        return r["method"] != "bf16" and not chosen

    if not compared(result):
        return
    first = next((r for r in results if compared(r)), None)
    if first and first["quantized_modules_sha256"] != result["quantized_modules_sha256"]:
        raise RuntimeError(
            f"{result['variant']} quantized {result['quantized_modules']} modules ({result['quantized_params']} "
            f"weights), {first['variant']} {first['quantized_modules']} ({first['quantized_params']}): the anchors "
            f"quantize nn.Linear modules only (a model with fused MoE experts is not supported for them)"
        )


def add_deltas(results: list[dict[str, Any]], tokens: list[int]) -> None:
    """Paired deltas to the first bf16 result (None without one)."""
    base = next((r for r in results if r["method"] == "bf16"), None)
    for r in results:
        delta = paired_delta(r["window_nll"], base["window_nll"], tokens) if base else {}
        r.update({key: delta.get(key) for key in ("delta_ppl", "delta_ppl_se", "delta_ppl_pct", "delta_ppl_pct_se",
                                                    "delta_nll", "delta_nll_se")})
        # The names of schema 1, which scripts/plot_results.py reads.
        r["ppl_ratio_vs_bf16"] = r["ppl"] / base["ppl"] if base else None
        r["delta_ppl_pct_vs_bf16"] = r["delta_ppl_pct"]


def evaluate(
    folder: Path,
    model_info: dict[str, Any],
    corpus: Corpus,
    variants: list[VariantSpec],
    window: int,
    stride: int,
    max_tokens: int | None,
    device: str,
    dtype,
    batch_size: int = 1,
    dequantize_on_cpu: bool = True,
    log=print,
) -> dict[str, Any]:
    """Score every variant on identical windows; returns the JSON payload (schema ``SCHEMA``)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    token_ids, chars = tokenize_prefix(tokenizer, corpus.text, max_tokens)
    windows = make_windows(len(token_ids), window, stride)
    tokens = [w.targets for w in windows]
    # The kbit variants' weight SQNR needs the checkpoint's weights beside the quantized model.
    reference = reference_weights(folder) if any(v.method == "kbit" for v in variants) else None
    # The characters the scoring reads (tokenize_prefix cuts the text to 16 per token when it gives no offsets):
    # kbitcal variants calibrate on text after them.
    read = chars if chars is not None else len(corpus.text) if not max_tokens else min(len(corpus.text), 16 * max_tokens)
    results: list[dict[str, Any]] = []
    for spec in variants:
        model, info = load_variant(folder, spec, device, dtype, dequantize_on_cpu, reference=reference,
                                   evaluated=(corpus, read))
        _check_same_linears(results, info)
        start = time.perf_counter()
        nll = score_windows(model, token_ids, windows, batch_size)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        ppl = perplexity(nll, tokens)
        results.append({**info, "nll_per_token": sum(nll) / sum(tokens), "ppl": ppl, "scored_tokens": sum(tokens),
                        "seconds": round(seconds, 2), "window_nll": nll})
        sqnr = info["weight_sqnr_db"]
        log(f"{spec.name:>16}: ppl {ppl:.4f}, {info['bits_per_weight'] or 16:.3f} bits/weight, SQNR "
            f"{'-' if sqnr is None else f'{sqnr:.2f} dB'} (load {info['load_seconds']:.0f}s, score {seconds:.0f}s)")
        del model
        _free(device)
    del reference
    add_deltas(results, tokens)
    corpus_info = dict(corpus.info)
    if corpus.segments and chars is not None:
        corpus_info["files_in_prefix"] = corpus.segments_within(chars)
    packages = {}
    if any(v.method == "hqq" for v in variants):
        from importlib.metadata import version

        packages["hqq"] = version("hqq")
    return {
        "schema": SCHEMA,
        "model": model_info,
        "corpus": corpus_info,
        "tokenization": {"add_special_tokens": False, "max_tokens": max_tokens, "n_tokens": len(token_ids),
                         "chars": chars},
        "windows": {"window": window, "stride": stride, "count": len(windows), "batch_size": batch_size,
                    **fingerprint(token_ids, windows)},
        "device": device,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "statistics": "delta vs bf16: paired over windows, delta-method standard errors "
                      "(hf_kbit.eval.perplexity.paired_delta)",
        "anchor_packages": packages,
        "results": results,
    }


# Methods compared with HQQ at their own k (vs_hqq): the kbit format, quantized on load, fitted or calibrated.
KBIT_METHODS = ("kbit", "kbitfit", "kbitcal")


def window_tokens(payload: dict[str, Any]) -> list[int]:
    """The scored tokens of each window of a payload, as its windows were cut."""
    w = payload["windows"]
    return [window.targets for window in make_windows(payload["tokenization"]["n_tokens"], w["window"], w["stride"])]


def vs_hqq(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{variant: paired_delta(variant, hqq<k>)}`` for every kbit-format variant (:data:`KBIT_METHODS`) at a k
    whose HQQ anchor (``hqq<k>``, group 64) the same run scored: how far its perplexity is from HQQ's on the same
    windows, with the standard error of the paired per-window differences (what issue 34's acceptance compares)."""
    rows = payload["results"]
    hqq = {r["bits"]: r for r in rows if r.get("method") == "hqq" and r["variant"] == f"hqq{r['bits']}"}
    tokens = window_tokens(payload) if hqq else []
    return {r["variant"]: paired_delta(r["window_nll"], hqq[r["bits"]]["window_nll"], tokens)
            for r in rows if r.get("method") in KBIT_METHODS and r["bits"] in hqq and r.get("lm_head_bits") is None}


def _num(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v) or abs(v) >= 1e4:
        return f"{v:.3g}"
    return f"{v:.{digits}f}"


def _pm(v: float | None, se: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    return f"{'+' if v >= 0 else ''}{_num(v, digits)}" + ("" if se is None else f" ± {_num(se, digits)}")


def render_table(payload: dict[str, Any]) -> str:
    """Markdown table of a payload: one row per variant."""
    headers = ["variant", "bits/weight", "perplexity", "Δppl vs bf16 (± SE)", "Δ% (± SE)", "Δppl vs HQQ same k (± SE)",
               "weight SQNR dB", "load s", "score s"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    against_hqq = vs_hqq(payload)
    for r in payload["results"]:
        base = r["method"] == "bf16"
        hqq = against_hqq.get(r["variant"], {})
        row = [r["variant"], _num(r["bits_per_weight"]), _num(r["ppl"]),
               "-" if base else _pm(r["delta_ppl"], r["delta_ppl_se"]),
               "-" if base else _pm(r["delta_ppl_pct"], r["delta_ppl_pct_se"], 2),
               _pm(hqq.get("delta_ppl"), hqq.get("delta_ppl_se")),
               _num(r["weight_sqnr_db"], 2), _num(r["load_seconds"], 1), _num(r["seconds"], 1)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
