"""Benchmark the grouped MoE GEMV alone (``torch.ops.kbit.grouped_mm``) on the expert shapes of the
MoE families at decode: the fraction of HBM bandwidth it reaches on the expert bytes a call reads.

For each family (published config values: hidden size, expert intermediate size, experts, top-k), each
projection as an experts layer calls it (gate_up: [2 I, H] reading the T tokens once for their top-k rows,
``x_repeat`` = top-k; down: [H, I] on the T * top-k rows; down_gated: the same weight as a SiLU-gated layer calls it
at decode, ``torch.ops.kbit.grouped_mm_silu_mul`` on the two halves of a gate_up output, the gating staged by the
GEMV in per-row mode and its own kernel before it in grouped mode) and each T: T tokens routed to top-k distinct
random experts each (seeded), the op timed alone.

* Bytes per call: the packed bytes (planes, block scales, row scales) of the distinct experts the call
  routes to, each read once from HBM (a row of an expert repeated in a call hits the L2).
* Cold L2: the experts' weights in enough random packed copies (``copies`` = max(2, ceil(600 MB / one
  copy))) that consecutive calls read different copies with fresh routing.
* Timing: the calls (one per copy, at least 24, each with its own routing) captured in one CUDA graph,
  replayed 7 times, median per call (scripts/bench_kernels.py's ``time_calls``); back to back, so a call's
  prologue overlaps the previous call's tail (programmatic dependent launch), as in an experts layer.
* ``roofline_pct``: bytes per call / measured copy bandwidth (read + write bytes per second, the same
  process) / time, as scripts/bench_kernels.py reports its kernels.
* Mode: per-row (T * top-k <= the CUDA backend's GROUP_ROWS_ABOVE rows) or grouped (rows sorted by expert).
* Size floor (``floor_us``, ``floor_pct``): the same bytes moved by two of torch's streaming kernels, timed the same
  way (cold copies, one per call, back to back in a CUDA graph): a float32 sum reading them and a device-to-device
  copy of half of them (read + write, as the copy bandwidth counts), the faster of the two. They do nothing but
  stream and pay the launch, ramp-up and tail any kernel of that size pays, so ``floor_pct`` is a measured
  reference for the share of the copy bandwidth a call that moves that many bytes reaches; a grouped GEMV call also
  waits for its routing before its first weight load.

    python scripts/bench_grouped_gemv.py --out benchmarks/results/h200_grouped_gemv
    python scripts/bench_grouped_gemv.py --bits 2 3 4 5 --tokens 1 --families qwen3-30b-a3b
    python scripts/bench_grouped_gemv.py --smoke --device cpu --out /tmp/gg   # CPU reference, wall clock
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import MIN_CALLS, measure_bandwidth, random_packed, time_calls  # noqa: E402

from hf_kbit import format as fmt  # noqa: E402
from hf_kbit.kernel_table import SUPPORTED_BITS  # noqa: E402

SCHEMA = "hf_kbit.bench_grouped_gemv/1"

# (hidden size, expert intermediate size, routed experts, top-k): config.json values of the Hub models.
FAMILIES: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-next": (2048, 512, 512, 10),  # Qwen3-Next-80B-A3B
    "deepseek-v3": (7168, 2048, 256, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
SMOKE_FAMILY = "tiny"
SMOKE_SHAPE = (96, 40, 8, 2)  # partial tiles and blocks
TOKENS = (1, 2, 4, 8)
COLD_BYTES = 600 * 10**6
SEED = 0


def projections(hidden: int, inter: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of an experts layer's two grouped calls, and of its down projection on the gated halves."""
    return [("gate_up", 2 * inter, hidden), ("down", hidden, inter), ("down_gated", hidden, inter)]


def expert_bytes(n: int, k: int, bits: int) -> int:
    """Packed bytes of one [n, k] expert: planes, block scales and row scales."""
    shapes = fmt.packed_shapes(n, k, bits)
    return sum(math.prod(shapes[name]) * fmt.PACKED_DTYPES[name].itemsize
               for name in ("planes", "block_scales", "row_scales"))


def routed_ids(tokens: int, num_experts: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """[tokens * top_k] expert ids: top_k distinct experts per token, token-major (an experts layer's rows)."""
    return torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)]).reshape(-1)


def size_floor_us(nbytes: float) -> dict[str, float]:
    """Microseconds per call of two of torch's streaming kernels moving ``nbytes`` (cold L2, back to back in a CUDA
    graph, one cold buffer per call): ``read_us`` sums them (float32), ``copy_us`` copies half of them to another
    buffer."""
    words = max(1, int(nbytes) // 4)
    copies = max(MIN_CALLS, math.ceil(COLD_BYTES / (4 * words)))
    src = [torch.empty(words, dtype=torch.float32, device="cuda").normal_() for _ in range(copies)]
    dst = torch.empty(max(1, words // 2), dtype=torch.float32, device="cuda")
    total = torch.empty((), dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    time.sleep(0.2)
    read_us = time_calls([lambda a=a: torch.sum(a, 0, out=total) for a in src])
    time.sleep(0.2)
    copy_us = time_calls([lambda a=a, d=dst: d.copy_(a[:d.numel()]) for a in src])
    del src, dst
    torch.cuda.empty_cache()
    return {"read_us": read_us, "copy_us": copy_us}


def _wall_us(calls: list[Callable]) -> float:
    for fn in calls[:2]:
        fn()
    t0 = time.perf_counter()
    for fn in calls:
        fn()
    return (time.perf_counter() - t0) * 1e6 / len(calls)


def bench_projection(family: str, proj: str, n: int, k: int, num_experts: int, top_k: int, tokens: list[int],
                     bits: int, device: str, bandwidth: float | None, group_rows_above: int, log) -> list[dict]:
    one = expert_bytes(n, k, bits)
    cuda = device == "cuda"
    copies = max(2, math.ceil(COLD_BYTES / (num_experts * one))) if cuda else 1
    packs = random_packed(n, k, bits, copies, experts=num_experts, device=device)
    g = torch.Generator().manual_seed(SEED + 1000 * bits + n + k)
    rows = []
    for t in tokens:
        ncalls = max(MIN_CALLS, copies) if cuda else 3
        calls, distinct = [], []
        for i in range(ncalls):
            ids = routed_ids(t, num_experts, top_k, g)
            distinct.append(ids.unique().numel())
            repeat = top_k if proj == "gate_up" else 1  # gate_up reads each token once for its top-k rows
            width = 2 * k if proj == "down_gated" else k  # gate and up: the halves of a gate_up output
            x = torch.randn(t * top_k // repeat, width, generator=g).to(torch.bfloat16).to(device)
            if proj == "down_gated":
                calls.append(lambda p=packs[i % copies], ids=ids.to(device), x=x:
                             torch.ops.kbit.grouped_mm_silu_mul(*x.chunk(2, dim=-1), ids, *p, k))
            else:
                calls.append(lambda p=packs[i % copies], ids=ids.to(device), x=x, r=repeat:
                             torch.ops.kbit.grouped_mm(x, ids, *p, k, None, None, None, r))
        if cuda:
            torch.cuda.synchronize()
            time.sleep(0.2)  # settle the clocks between cells (bench_kernels.py: the power cap)
            us, timing = time_calls(calls), "cuda_graph"
        else:
            us, timing = _wall_us(calls), "wall_clock"
        nbytes = statistics.fmean(distinct) * one
        row = {"family": family, "projection": proj, "N": n, "K": k, "experts": num_experts, "top_k": top_k, "T": t,
               "rows": t * top_k, "mode": "per-row" if t * top_k <= group_rows_above else "grouped",
               "distinct_experts": statistics.fmean(distinct), "bytes_per_call": nbytes, "bits": bits,
               "us": us, "timing": timing, "TBps": nbytes / us / 1e6}
        if bandwidth:
            row["roofline_pct"] = 100 * nbytes / bandwidth / (us * 1e-6)
        if cuda:
            row.update(size_floor_us(nbytes))
            row["floor_us"] = min(row["read_us"], row["copy_us"])
            row["floor_pct"] = 100 * nbytes / bandwidth / (row["floor_us"] * 1e-6)
        log(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}))
        rows.append(row)
    del packs
    if cuda:
        torch.cuda.empty_cache()
    return rows


def markdown(payload: dict) -> str:
    meta = payload["meta"]
    bw = meta.get("bandwidth_GBps")
    lines = [f"# Grouped MoE GEMV at decode — {meta['device']}", "", f"Command: `{meta['command']}`  ",
             f"torch {meta['torch']}, hf_kbit {meta['hf_kbit']}"
             + (f", measured copy bandwidth {bw:.0f} GB/s (read+write)" if bw else "") + ". " + meta["method"], "",
             ("Size floor: the same bytes summed (float32) or half of them copied by torch, cold, back to back in a "
              "CUDA graph, the faster of the two: what a kernel that only streams that many bytes reaches."), "",
             ("| family | projection (N x K) | T | rows | mode | k | experts read | MB | us | TB/s | % of copy bw "
              "| size floor us (% of copy bw) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        pct = f"{r['roofline_pct']:.0f}%" if "roofline_pct" in r else "n/a"
        floor = f"{r['floor_us']:.1f} ({r['floor_pct']:.0f}%)" if "floor_pct" in r else "n/a"
        lines.append(f"| {r['family']} | {r['projection']} ({r['N']} x {r['K']}) | {r['T']} | {r['rows']} | {r['mode']} "
                     f"| {r['bits']} | {r['distinct_experts']:.1f} | {r['bytes_per_call'] / 1e6:.1f} | {r['us']:.1f} "
                     f"| {r['TBps']:.2f} | {pct} | {floor} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="path prefix: writes PREFIX.json and PREFIX.md (default: print only)")
    ap.add_argument("--families", nargs="+", default=None, choices=list(FAMILIES), help="default: all")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="tokens per call (default 1 2 4 8)")
    ap.add_argument("--bits", type=int, nargs="+", default=[4], help="k values in 2..5 (default 4)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu (--smoke only)")
    ap.add_argument("--smoke", action="store_true", help="a tiny layer through the op on --device (no claims)")
    args = ap.parse_args(argv)
    for b in args.bits:
        if b not in SUPPORTED_BITS:
            ap.error(f"--bits: expected values in {list(SUPPORTED_BITS)}, got {b}")
    if any(t < 1 for t in args.tokens):
        ap.error(f"--tokens: expected positive token counts, got {args.tokens}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device not in ("cuda", "cpu"):
        ap.error(f"--device: expected cuda or cpu, got {args.device!r}")
    if args.device == "cpu" and not args.smoke:
        ap.error("--device cpu times the PyTorch reference: pass --smoke (no bandwidth claims on the CPU)")
    if args.smoke and args.families:
        ap.error("--smoke runs its tiny layer only; drop --families")
    return args


def run(argv: list[str] | None = None, log: Callable[[str], None] = print) -> dict:
    args = parse_args(argv)
    import hf_kbit
    from hf_kbit import _ops

    if args.device == "cuda":
        import hf_kbit.backends.cuda  # noqa: F401  (registers the CUDA kernels)
    bandwidth = measure_bandwidth() if args.device == "cuda" else None
    families = {SMOKE_FAMILY: SMOKE_SHAPE} if args.smoke else {f: FAMILIES[f] for f in (args.families or FAMILIES)}
    group_rows_above = _ops.GROUP_ROWS_ABOVE.get(args.device, 0)
    results = []
    for family, (hidden, inter, num_experts, top_k) in families.items():
        for proj, n, k in projections(hidden, inter):
            for bits in args.bits:
                results += bench_projection(family, proj, n, k, num_experts, top_k, args.tokens, bits, args.device,
                                            bandwidth, group_rows_above, log)
    method = ("Smoke run: wall clock over eager calls of the op on a tiny layer; no claims." if args.smoke else
              f"Cold L2: weight copies >= {COLD_BYTES // 10**6} MB per graph, each call its own routing; CUDA-graph "
              "replays of at least 24 back-to-back calls, median of 7.")
    meta = {"schema": SCHEMA, "command": "python scripts/bench_grouped_gemv.py " + shlex.join(argv or []),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "hf_kbit": hf_kbit.__version__, "python": platform.python_version(),
            "bandwidth_GBps": bandwidth / 1e9 if bandwidth else None, "families": families, "tokens": args.tokens,
            "bits": args.bits, "group_rows_above": group_rows_above, "seed": SEED, "method": method}
    payload = {"meta": meta, "results": results}
    if args.out:
        prefix = Path(args.out)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        prefix.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
        prefix.with_suffix(".md").write_text(markdown(payload))
        log(f"wrote {prefix.with_suffix('.json')} and {prefix.with_suffix('.md')}")
    return payload


def main(argv: list[str] | None = None) -> dict:
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
