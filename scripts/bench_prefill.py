"""Prefill speed of real-size models with random weights: one eager forward, bf16 vs kbit, several token shapes.

Issue 35's end-to-end benchmark (H100 or H200; the JSON names the GPU; bf16 in the same run):

    python scripts/bench_prefill.py --preset llama3-8b --layers 8 --bits 4
    python scripts/bench_prefill.py --preset llama3-8b --layers 8 --bits 4 --gemm-kernels wgmma,wgmma_ws
    python scripts/bench_prefill.py --preset qwen3-30b-a3b --layers 8 --bits 4 --shapes 1x512,1x4096
    python scripts/bench_prefill.py --preset tiny-llama --device cpu --shapes 1x16,2x8   # smoke test

What is timed: ``model(input_ids, logits_to_keep=1, use_cache=False)`` under ``torch.inference_mode()``, as the
prefill of ``generate()`` computes it (logits of the last position only, so the bf16 LM head does not dilute the
ratio), for each ``--shapes`` entry ``BxT`` (B sequences of T tokens). CUDA events around each call, the median
of ``--repeats`` calls after ``--warmup``. The weights of a Llama-3-8B layer (436 MB in bf16, ~120 MB at k = 4)
are far larger than the L2, so every call reads them from HBM (cold, as in a model).

Variants: ``bf16`` (transformers' own modules: cuBLAS, and for MoE models its default experts implementation)
and ``kbit<k>`` (``hf_kbit.quantize_model`` of the same weights, LM head bf16, fused projections as
``KbitConfig``'s default). ``--gemm-kernels`` times each kbit variant once per GEMM kernel of the planner
(``hf_kbit.backends.cuda.set_gemm_kernel``: ``wgmma`` the default on sm_90a, ``wgmma_ws`` the
warp-specialized one, ``mma`` the mma.sync one), on the same quantized model, and checks that their last-position
logits agree (``logits_rel_diff``, against the first kernel's). The JSON is written after every variant
(``"complete": false`` until the last), so a stopped run keeps what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

SCHEMA = "hf_kbit.bench_prefill/1"
DEFAULT_SHAPES = "1x2048,4x1024,16x512"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x2048,4x1024"`` -> ``[(1, 2048), (4, 1024)]``; ValueError naming the bad entry."""
    shapes = []
    for item in (s.strip() for s in text.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: each entry is BATCHxTOKENS with positive integers, got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    if not shapes:
        raise ValueError("--shapes: give at least one BATCHxTOKENS entry")
    return shapes


def parse_gemm_kernels(text: str | None) -> list[str | None]:
    """``"wgmma,wgmma_ws"`` -> the planner's kernel names; None -> ``[None]`` (the device's default)."""
    from hf_kbit.backends.crossovers import GEMM_KERNELS

    if text is None:
        return [None]
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in GEMM_KERNELS]
    if bad or not names:
        raise ValueError(f"--gemm-kernels: names must be among {GEMM_KERNELS}, got {text!r}")
    return names


def time_forward(model, input_ids, device: str, warmup: int, repeats: int) -> float:
    """Median milliseconds of one prefill forward."""
    import time

    import torch

    def call():
        return model(input_ids=input_ids, logits_to_keep=1, use_cache=False).logits

    with torch.inference_mode():
        for _ in range(warmup):
            call()
        times = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def last_logits(model, input_ids):
    import torch

    with torch.inference_mode():
        return model(input_ids=input_ids, logits_to_keep=1, use_cache=False).logits.float()


def run(preset: str, bits_list: list[int], device: str, dtype, shapes: list[tuple[int, int]], layers: int | None = None,
        gemm_kernels: list[str | None] = (None,), include_bf16: bool = True, warmup: int = 2, repeats: int = 5,
        on_variant=None, log=print) -> dict[str, Any]:
    """Times every (variant, GEMM kernel, shape); returns the JSON payload (``results``: one row per cell)."""
    import torch

    from hf_kbit.eval import decode_bench, presets
    from hf_kbit.eval.timing import random_prompt

    config = presets.make_config(preset, layers)
    prompts = {s: random_prompt(config.vocab_size, s[0], s[1], device, seed=i) for i, s in enumerate(shapes)}
    results: list[dict[str, Any]] = []
    payload = {"schema": SCHEMA, "model": presets.PRESETS[preset]["title"], "preset": preset,
               "layers": config.num_hidden_layers, "layers_full": presets.PRESETS[preset]["num_hidden_layers"],
               "device": device, "compute_dtype": str(dtype).replace("torch.", ""), "shapes": [list(s) for s in shapes],
               "warmup": warmup, "repeats": repeats, "timed": "model(input_ids, logits_to_keep=1, use_cache=False)",
               "results": results, "complete": False}
    bf16_ms: dict[tuple[int, int], float] = {}
    variants = ([None] if include_bf16 else []) + list(bits_list)
    for bits in variants:
        model = presets.build_model(config, device, dtype)
        if bits is not None:
            model = decode_bench.quantize(model, bits)
        kernels = [None] if bits is None else list(gemm_kernels)
        reference = {}
        for kernel in kernels:
            if device.startswith("cuda") and bits is not None:
                from hf_kbit.backends import cuda as backend

                backend.set_gemm_kernel(kernel)
            try:
                for shape in shapes:
                    ms = time_forward(model, prompts[shape], device, warmup, repeats)
                    logits = last_logits(model, prompts[shape])
                    diff = None
                    if shape in reference:
                        ref = reference[shape]
                        diff = float((logits - ref).norm() / ref.norm().clamp_min(1e-30))
                    else:
                        reference[shape] = logits
                    if bits is None:
                        bf16_ms[shape] = ms
                    name = "bf16" if bits is None else f"kbit{bits}"
                    row = {"variant": name, "bits": bits, "gemm_kernel": kernel, "batch": shape[0],
                           "tokens": shape[1], "ms": ms, "tok_s": shape[0] * shape[1] / ms * 1e3,
                           "speedup_vs_bf16": bf16_ms[shape] / ms if shape in bf16_ms else None,
                           "logits_rel_diff": diff}
                    results.append(row)
                    how = f" [{kernel}]" if kernel else ""
                    ratio = f"  {row['speedup_vs_bf16']:.3f}x bf16" if row["speedup_vs_bf16"] else ""
                    log(f"{name}{how} {shape[0]}x{shape[1]}: {ms:.2f} ms{ratio}"
                        + (f"  logits vs first kernel {diff:.2e}" if diff is not None else ""))
            finally:
                if device.startswith("cuda") and bits is not None:
                    backend.set_gemm_kernel(None)
        del model, reference
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        if on_variant:
            on_variant(payload)
    payload["complete"] = True
    return payload


def render_table(payload: dict[str, Any]) -> str:
    from hf_kbit.eval.report import format_table

    rows = [[r["variant"], r["gemm_kernel"] or "default", f"{r['batch']}x{r['tokens']}", r["ms"], r["tok_s"],
             r["speedup_vs_bf16"], r["logits_rel_diff"]] for r in payload["results"]]
    return format_table(["variant", "GEMM kernel", "shape", "ms", "tok/s", "x bf16", "logits vs first kernel"], rows)


def main(argv: list[str] | None = None) -> int:
    from hf_kbit.eval.models import add_device_arguments, pick_device, pick_dtype
    from hf_kbit.eval.presets import PRESETS, make_config
    from hf_kbit.eval.report import command_line, environment, parse_bits, write_json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b", help=f"one of {', '.join(PRESETS)} (default llama3-8b)")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep only the first N decoder layers (default 8, or all of a smaller preset)")
    parser.add_argument("--bits", default="4", help="comma-separated kbit widths (default 4)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 baseline")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"BATCHxTOKENS list (default {DEFAULT_SHAPES})")
    parser.add_argument("--gemm-kernels", default=None,
                        help="CUDA: time each kbit variant with each of these GEMM kernels (mma, wgmma, wgmma_ws; "
                             "default: the device's)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per cell (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per cell, median reported (default 5)")
    add_device_arguments(parser, dtype="bf16")
    parser.add_argument("--out", default=None, help="JSON path (default: results/bench_prefill_<preset>_<device>.json)")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
        kernels = parse_gemm_kernels(args.gemm_kernels)
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("warmup", "repeats"):
        if getattr(args, name) < (1 if name == "repeats" else 0):
            parser.error(f"--{name} must be >= {1 if name == 'repeats' else 0}, got {getattr(args, name)}")
    bits_list = parse_bits(args.bits)
    if args.layers is None and args.preset in PRESETS:
        args.layers = min(8, PRESETS[args.preset]["num_hidden_layers"])
    make_config(args.preset, args.layers)  # validate before touching the device
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if kernels != [None] and not device.startswith("cuda"):
        parser.error("--gemm-kernels needs a CUDA device (the CPU runs the references)")
    out = args.out or f"results/bench_prefill_{args.preset}_{device.split(':')[0]}.json"
    machine = environment()

    def write(payload: dict[str, Any]) -> None:
        payload["command"] = command_line()
        payload["environment"] = machine
        write_json(out, payload)

    payload = run(args.preset, bits_list, device, dtype, shapes, layers=args.layers, gemm_kernels=kernels,
                  include_bf16=not args.no_bf16, warmup=args.warmup, repeats=args.repeats, on_variant=write)
    write(payload)
    print()
    print(f"{payload['model']} ({payload['layers']} of {payload['layers_full']} layers, random weights) on {device}, "
          f"{payload['compute_dtype']}: {payload['timed']}")
    print(render_table(payload))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
