"""Where a GEMV call's time goes, warp by warp: a diagnostic that needs a KBIT_TRACE=1 build of the library.

    HF_KBIT_CUDA_ARCHS=90a cmake -S . -B build/trace -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DCMAKE_CUDA_FLAGS=-DKBIT_TRACE=1 && cmake --build build/trace -j16
    HF_KBIT_LIBRARY=$PWD/build/trace/csrc/libhf_kbit_cuda.so python scripts/trace_gemv.py
    ... python scripts/trace_gemv.py --shapes 4096x4096 --bits 2 4 --between elementwise
    ... python scripts/trace_gemv.py --records --prologue add_rmsnorm --shapes 4096x6144 4096x28672
    ... python scripts/trace_gemv.py --rotation --shapes 4096x4096 --between none

`--records` traces the block-records GEMV (int16 block records, the default format's kernel) and `--prologue` the
GEMV with a fused prologue (kbit::mm_add_rmsnorm or kbit::mm_silu_mul), as a compiled decode step runs them.
`--rotation` traces each shape twice, as an unrotated layer and as a rotated one (random sign words, the GEMV
staging x R up to its rotated crossover, docs/kernels.md#rotation), so that the rotation's cost shows per phase.
`--chain` traces the four GEMVs of a Llama-3-8B decode layer in their order instead (block records, k = 4: q/k/v and
gate/up with add_rmsnorm, o, down with silu_mul; `--glu`: gate/up with its GLU epilogue and down plain), over cold
layer copies, each call timed from the end of the GEMV before it in the chain, whichever that is: what each kernel
costs after its real predecessor rather than after a copy of itself.

    ... python scripts/trace_gemv.py --chain
    ... python scripts/trace_gemv.py --chain --glu

In that build every warp of the GEMV stamps the GPU's global timer at entry, after griddepcontrol.wait
(its predecessor has completed and its writes are visible), after staging x and at exit, and appends
the stamps and its item count (row tile, K tile) to a trace buffer (csrc/gemv_kernel.cuh, GemvTrace).
A CUDA graph runs GEMVs over cold copies of a weight (DESIGN.md section 6), back to back (`none` between
them: the next one's prologue overlaps the previous one's tail through programmatic dependent launch) or
each after an elementwise kernel on its x (`elementwise`: torch's, an ordinary launch). Each call from the third on is timed from the end of
the GEMV before it (its last warp's exit); the table gives, per phase, the median over those calls of
the earliest / median / latest warp, in microseconds, and the rate at which the weight streamed from the
median warp's staging to the last exit. It also gives the balanced exit: when the call would end if the same
items were shared so that every warp finished together, each warp streaming from its staging at the rate it
measured (items over its staging-to-exit time); the latest exit less that is what the static shares cost. The
CTA split says where that tail lies: the median CTA's spread of warp exits (which sharing items among a
CTA's own warps could recover) and how long after the median CTA the latest one ends (which only sharing
across CTAs could). The global timer ticks every 32 ns on an H100 (every stamp of a trace there is a multiple of
32 ns), so differences below that are noise.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_kbit.kernel_table import SUPPORTED_BITS  # noqa: E402

SHAPES = ("4096x6144", "4096x4096", "4096x28672", "14336x4096")  # Llama-3-8B decode: qkv, o, gate_up, down
BETWEEN = ("none", "elementwise")
PROLOGUES = ("none", "add_rmsnorm", "silu_mul")
TRACE_WORDS = 8  # words per record, and the record count's slot (GemvTrace): weight, CTA << 32 | warp, SM,
#                 entry, wait, staged, exit (ns), items
TRACE_RECORDS = 1 << 16  # the kernel's kTraceRecords
COLD_BYTES = 200e6  # weight copies per graph: 4x the H100's 50 MB L2
MAX_CALLS = 30  # records of 2112 warps each fit the buffer


def parse_shape(text: str) -> tuple[int, int]:
    """'KxN' (in_features x out_features) -> (K, N)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shapes takes KxN with positive integers (in_features x out_features), got {text!r}")
    return int(parts[0]), int(parts[1])


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def balanced_exit(staged: list[float], exits: list[float], items: list[int]) -> float | None:
    """The time T at which warps starting at ``staged`` and streaming at their own measured rates
    (items / (exit - staged)) would have done all the items together: sum over warps of rate * max(0, T - staged)
    equals the items' sum. None where no warp has items (a trace build that does not count them)."""
    warps = sorted((s, i / (e - s)) for s, e, i in zip(staged, exits, items) if i > 0 and e > s)
    total = sum(items)
    if not warps:
        return None
    rate = start_work = 0.0  # sum of the started warps' rates, and of rate * staged
    for j, (s, r) in enumerate(warps):
        rate += r
        start_work += r * s
        t = (total + start_work) / rate
        if j + 1 == len(warps) or t <= warps[j + 1][0]:
            return t
    raise AssertionError("unreachable: the last warp's interval is unbounded")


def cta_split(records: list[list[int]]) -> tuple[float, float]:
    """Where a call's tail lies, in microseconds: the median over CTAs of the spread of their warps' exits (what
    sharing items among a CTA's own warps could recover), and how long after the median CTA's last warp the latest
    CTA's last warp exits (what only sharing across CTAs could)."""
    by_cta: dict[int, list[int]] = {}
    for r in records:
        by_cta.setdefault(r[1] >> 32, []).append(r[6])
    ends = [max(exits) for exits in by_cta.values()]
    spread = statistics.median(max(exits) - min(exits) for exits in by_cta.values())
    return spread / 1000, (max(ends) - statistics.median(ends)) / 1000


def call_rows(records: list[list[int]], weights: list[int], nbytes: list[int]) -> list[dict[str, float]]:
    """Phase stamps of each GEMV call from the third on, in microseconds from the end of the call before.

    ``records``: trace records (weight address, CTA << 32 | warp, SM, entry, wait, staged, exit, items;
    times in ns), ``weights``: the weight address of each call in launch order, ``nbytes``: the bytes
    each call reads. A call (the first has no GEMV before it) gives, per phase, the earliest / median /
    latest warp, plus ``stream_GBps``: its bytes over the time from the median warp's staging to the last
    exit, ``balanced_exit`` (:func:`balanced_exit`; None where the records count no items), ``cta_spread``
    and ``cta_tail`` (:func:`cta_split`) and its ``warps``.
    """
    if len(weights) < 3:
        raise ValueError(f"summarize needs at least 3 calls, got {len(weights)}")
    by_weight: dict[int, list[list[int]]] = {w: [] for w in weights}
    for r in records:
        if r[0] in by_weight:
            by_weight[r[0]].append(r)
    missing = [i for i, w in enumerate(weights) if not by_weight[w]]
    if missing:
        raise RuntimeError(f"no trace records for calls {missing}: is the library a KBIT_TRACE=1 build?")
    rows: list[dict[str, float]] = []
    previous_end = max(r[6] for r in by_weight[weights[1]])
    for w, size in zip(weights[2:], nbytes[2:]):
        recs = by_weight[w]
        col = {name: [(r[i] - previous_end) / 1000 for r in recs]
               for name, i in (("entry", 3), ("wait", 4), ("staged", 5), ("exit", 6))}
        row = {f"{name}_{q}": f(col[name]) for name in col
               for q, f in (("min", min), ("median", statistics.median), ("max", max))}
        row["exit_p90"] = _quantile(col["exit"], 0.9)
        row["stream_GBps"] = size / 1e3 / max(row["exit_max"] - row["staged_median"], 1e-3)
        row["balanced_exit"] = balanced_exit(col["staged"], col["exit"], [r[7] for r in recs])
        row["cta_spread"], row["cta_tail"] = cta_split(recs)
        row["warps"] = len(recs)
        rows.append(row)
        previous_end = max(r[6] for r in recs)
    return rows


def median_row(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median over calls of each of :func:`call_rows`' columns (None where a call has None), and ``calls``."""
    summary = {key: None if any(row[key] is None for row in rows) else statistics.median(row[key] for row in rows)
               for key in rows[0]}
    return summary | {"calls": len(rows)}


def summarize(records: list[list[int]], weights: list[int], nbytes: int) -> dict[str, float]:
    """:func:`call_rows` of calls of one weight shape (``nbytes`` each), the median over calls (:func:`median_row`)."""
    return median_row(call_rows(records, weights, [nbytes] * len(weights)))


def summarize_chain(records: list[list[int]], calls: list[tuple[str, int, int]]) -> dict[str, dict[str, float]]:
    """``calls``: (role, weight address, bytes) of each call of a chain in launch order. Each call from the third on
    is timed from the end of the call before it, whatever its role (:func:`call_rows`); per role, in the order
    the roles first appear, the median over that role's calls (:func:`median_row`)."""
    rows = call_rows(records, [c[1] for c in calls], [c[2] for c in calls])
    roles = [c[0] for c in calls[2:]]
    return {role: median_row([row for r, row in zip(roles, rows) if r == role]) for role in dict.fromkeys(roles)}


def trace_shape(k: int, n: int, bits: int, m: int, between: str, trace, lib, records: bool = False,
                prologue: str = "none", rotated: bool = False) -> dict[str, Any]:
    import torch
    from bench_kernels import packed_bytes, random_packed, random_signs, with_records

    from hf_kbit.backends import cuda as kbit_cuda

    nbytes = packed_bytes(n, k, bits, offsets=records)
    calls = min(MAX_CALLS, max(8, math.ceil(COLD_BYTES / nbytes)))
    weights = random_packed(n, k, bits, calls)
    if records:
        weights = with_records(weights)
    xs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(calls)]
    # The prologue's second input (residual or up); a plain GEMV reads none.
    second = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(calls)] if prologue != "none" \
        else xs
    norm_weight = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16) if prologue == "add_rmsnorm" else None
    signs = random_signs(k) if rotated else None

    def call(x, x2, packed):
        if prologue == "add_rmsnorm":
            return torch.ops.kbit.mm_add_rmsnorm(x, x2, norm_weight, 1e-5, *packed, k, signs)
        if prologue == "silu_mul":
            return torch.ops.kbit.mm_silu_mul(x, x2, *packed, k, signs)
        return kbit_cuda.run_path("gemv", x, *packed, k, None, signs)

    def body():
        for x, x2, packed in zip(xs, second, weights):
            if between == "elementwise":
                x.mul_(1.0)
            call(x, x2, packed)

    stamps = run_traced(body, trace, lib)
    result = summarize(stamps, [packed[0].data_ptr() for packed in weights], nbytes)
    return {"K": k, "N": n, "bits": bits, "M": m, "format": "records" if records else "codes", "prologue": prologue,
            "rotated": rotated, "between": between, "MB": nbytes / 1e6, **result}


# --chain: the Llama-3-8B decode layer's GEMVs in launch order, (K, N) each.
CHAIN = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CHAIN_LAYERS = 7  # 4 calls of 2112 warps per layer: 7 layers fit the buffer; 0.8 GB of weights, cold


def trace_chain(layers: int, glu: bool, trace, lib) -> list[dict[str, Any]]:
    """The rows of :func:`summarize_chain` for ``layers`` cold copies of the decode layer's GEMVs (block records,
    k = 4, M = 1), gate/up with its GLU epilogue and down plain where ``glu``, else down with silu_mul. The q slice
    of q/k/v goes to o through a copy kernel (attention's place)."""
    import torch
    from bench_kernels import packed_bytes, random_packed, with_records

    from hf_kbit.backends import cuda as kbit_cuda

    bits, hidden, inter, eps = 4, CHAIN["o"][0], CHAIN["down"][0], 1e-5
    if glu and not kbit_cuda.glu_serves(1, CHAIN["gate_up"][1], hidden, bits, torch.cuda.current_device(),
                                        torch.bfloat16):
        raise RuntimeError("--glu: the library or GPU has no GLU epilogue for gate/up (kbit_gemv_glu_serves)")
    packs = {role: with_records(random_packed(n, k, bits, layers)) for role, (k, n) in CHAIN.items()}
    nbytes = {role: packed_bytes(n, k, bits, offsets=True) for role, (k, n) in CHAIN.items()}
    norm_weight = (torch.rand(hidden, device="cuda") + 0.5).to(torch.bfloat16)
    h, residual = (torch.randn(1, hidden, dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def body():
        x, r = h, residual
        for i in range(layers):
            qkv, r = torch.ops.kbit.mm_add_rmsnorm(x, r, norm_weight, eps, *packs["qkv"][i], hidden)
            o = kbit_cuda.run_path("gemv", qkv[:, :hidden].contiguous(), *packs["o"][i], hidden)
            if glu:
                act, r = torch.ops.kbit.mm_add_rmsnorm(o, r, norm_weight, eps, *packs["gate_up"][i], hidden, glu=True)
                x = kbit_cuda.run_path("gemv", act, *packs["down"][i], inter)
            else:
                gate_up, r = torch.ops.kbit.mm_add_rmsnorm(o, r, norm_weight, eps, *packs["gate_up"][i], hidden)
                x = torch.ops.kbit.mm_silu_mul(gate_up[:, :inter], gate_up[:, inter:], *packs["down"][i], inter)

    stamps = run_traced(body, trace, lib)
    calls = [(role, packs[role][i][0].data_ptr(), nbytes[role]) for i in range(layers) for role in CHAIN]
    prologues = {"qkv": "add_rmsnorm", "o": "none", "gate_up": "add_rmsnorm+glu" if glu else "add_rmsnorm",
                 "down": "none" if glu else "silu_mul"}
    return [{"K": CHAIN[role][0], "N": CHAIN[role][1], "bits": bits, "M": 1, "format": "records",
             "prologue": prologues[role], "between": "chain", "MB": nbytes[role] / 1e6, **summary}
            for role, summary in summarize_chain(stamps, calls).items()]


def run_traced(body, trace, lib) -> list[list[int]]:
    """The trace records of the last of three replays of ``body`` captured in a CUDA graph."""
    import torch

    from hf_kbit.eval.timing import capture_cuda_graph

    # The launches read the buffer's address at capture: set it first.
    lib.kbit_trace_set(ctypes.c_void_p(trace.data_ptr()))
    try:
        graph, _ = capture_cuda_graph(body)
        for _ in range(3):  # the last replay's records are kept
            trace.zero_()
            graph.replay()
        torch.cuda.synchronize()
    finally:
        lib.kbit_trace_set(None)
    count = int(trace[0].item())
    if count > TRACE_RECORDS:
        raise RuntimeError(f"{count} trace records, the buffer holds {TRACE_RECORDS}: fewer calls")
    return trace[TRACE_WORDS:TRACE_WORDS * (count + 1)].view(count, TRACE_WORDS).tolist()


def render(rows: list[dict[str, Any]]) -> str:
    from hf_kbit.eval.report import format_table

    def three(r, phase):
        return f"{r[phase + '_min']:.2f} / {r[phase + '_median']:.2f} / {r[phase + '_max']:.2f}"

    def balanced(r):
        return "-" if r.get("balanced_exit") is None else f"{r['balanced_exit']:.2f}"

    def cta(r):
        return "-" if r.get("cta_spread") is None else f"{r['cta_spread']:.2f} / {r['cta_tail']:.2f}"

    headers = ["K x N", "k", "M", "format", "prologue", "rotated", "between", "MB", "entry us", "wait us",
               "staged us (median)", "exit us", "exit p90 us", "balanced exit us", "CTA spread / tail us", "stream GB/s"]
    table = [[f"{r['K']}x{r['N']}", r["bits"], r["M"], r.get("format", "codes"), r.get("prologue", "none"),
              "yes" if r.get("rotated") else "no", r["between"], f"{r['MB']:.1f}", three(r, "entry"),
              three(r, "wait"), f"{r['staged_median']:.2f}", three(r, "exit"), f"{r['exit_p90']:.2f}", balanced(r),
              cta(r), f"{r['stream_GBps']:.0f}"] for r in rows]
    return format_table(headers, table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="KxN (in_features x out_features)")
    ap.add_argument("--bits", type=int, nargs="+", choices=SUPPORTED_BITS, default=[4])
    ap.add_argument("--m", type=int, default=1, help="tokens per call (default 1)")
    ap.add_argument("--between", nargs="+", choices=BETWEEN, default=list(BETWEEN))
    ap.add_argument("--records", action="store_true", help="int16 block records (the default format) for uint8 codes")
    ap.add_argument("--prologue", choices=PROLOGUES, default="none", help="the GEMV with this fused prologue")
    ap.add_argument("--rotation", action="store_true",
                    help="trace each shape unrotated and rotated (the GEMV staging x R where its crossover stages)")
    ap.add_argument("--chain", action="store_true",
                    help="the decode layer's four GEMVs in order (block records, k = 4, M = 1; see this file's top)")
    ap.add_argument("--glu", action="store_true", help="--chain: gate/up with its GLU epilogue, down plain")
    ap.add_argument("--layers", type=int, default=CHAIN_LAYERS, help=f"--chain: layer copies (default {CHAIN_LAYERS})")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.glu and not args.chain:
        ap.error("--glu takes --chain")
    if args.rotation and (args.chain or args.records):
        ap.error("--rotation traces single shapes in uint8 codes (not with --chain or --records: no kernel reads "
                 "block records rotated)")
    if args.chain and not 3 <= args.layers <= CHAIN_LAYERS:
        ap.error(f"--layers takes 3..{CHAIN_LAYERS} (the trace buffer holds {CHAIN_LAYERS} layers), got {args.layers}")
    try:
        shapes = [parse_shape(s) for s in args.shapes]
    except ValueError as e:
        ap.error(str(e))

    import torch

    from hf_kbit import _lib

    if not torch.cuda.is_available():
        sys.exit("trace_gemv.py needs a CUDA GPU")
    lib = _lib.load()
    if not hasattr(lib, "kbit_trace_set"):
        sys.exit("trace_gemv.py needs a KBIT_TRACE=1 build of the library (see the top of this file) in "
                 "HF_KBIT_LIBRARY; the loaded one has no kbit_trace_set")
    lib.kbit_trace_set.argtypes = [ctypes.c_void_p]
    trace = torch.zeros(TRACE_WORDS * (TRACE_RECORDS + 1), dtype=torch.int64, device="cuda")
    rows = trace_chain(args.layers, args.glu, trace, lib) if args.chain else []
    for k, n in shapes if not args.chain else ():
        for bits in args.bits:
            for between in args.between:
                for rotated in (False, True) if args.rotation else (False,):
                    rows.append(trace_shape(k, n, bits, args.m, between, trace, lib, args.records, args.prologue,
                                            rotated))
                    print(f"{k}x{n} k={bits} {between}{' rotated' if rotated else ''}: exit max "
                          f"{rows[-1]['exit_max']:.2f} us", flush=True)
    print(f"{torch.cuda.get_device_name()}: us from the end of the previous GEMV, earliest / median / latest warp"
          + (f"; a chain of {args.layers} decode layers" if args.chain else ""))
    print(render(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
