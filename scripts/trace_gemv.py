"""Where a GEMV call's time goes, warp by warp: a diagnostic that needs a KBIT_TRACE=1 build of the library.

    HF_KBIT_CUDA_ARCHS=90a cmake -S . -B build/trace -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DCMAKE_CUDA_FLAGS=-DKBIT_TRACE=1 && cmake --build build/trace -j16
    HF_KBIT_LIBRARY=$PWD/build/trace/csrc/libhf_kbit_cuda.so python scripts/trace_gemv.py
    ... python scripts/trace_gemv.py --shapes 4096x4096 --bits 2 4 --between elementwise
    ... python scripts/trace_gemv.py --records --prologue add_rmsnorm --shapes 4096x6144 4096x28672

`--records` traces the block-records GEMV (int16 block records, the default format's kernel) and `--prologue` the
GEMV with a fused prologue (kbit::mm_add_rmsnorm or kbit::mm_silu_mul), as a compiled decode step runs them.

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


def summarize(records: list[list[int]], weights: list[int], nbytes: int) -> dict[str, float]:
    """Phase stamps of the GEMV calls, in microseconds from the end of the call before.

    ``records``: trace records (weight address, CTA << 32 | warp, SM, entry, wait, staged, exit, items;
    times in ns), ``weights``: the weight address of each call in launch order, ``nbytes``: the bytes
    one call reads. Calls from the third on (the first has no GEMV before it) give, per phase, the
    earliest / median / latest warp; the result is the median over calls, plus ``stream_GBps``: nbytes
    over the time from the median warp's staging to the last exit, ``balanced_exit`` (:func:`balanced_exit`;
    None where the records count no items), and ``cta_spread`` and ``cta_tail`` (:func:`cta_split`).
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
    for w in weights[2:]:
        recs = by_weight[w]
        col = {name: [(r[i] - previous_end) / 1000 for r in recs]
               for name, i in (("entry", 3), ("wait", 4), ("staged", 5), ("exit", 6))}
        row = {f"{name}_{q}": f(col[name]) for name in col
               for q, f in (("min", min), ("median", statistics.median), ("max", max))}
        row["exit_p90"] = _quantile(col["exit"], 0.9)
        row["stream_GBps"] = nbytes / 1e3 / max(row["exit_max"] - row["staged_median"], 1e-3)
        row["balanced_exit"] = balanced_exit(col["staged"], col["exit"], [r[7] for r in recs])
        row["cta_spread"], row["cta_tail"] = cta_split(recs)
        rows.append(row)
        previous_end = max(r[6] for r in recs)
    summary = {key: None if any(row[key] is None for row in rows) else statistics.median(row[key] for row in rows)
               for key in rows[0]}
    return summary | {"calls": len(rows), "warps": statistics.median(len(by_weight[w]) for w in weights[2:])}


def trace_shape(k: int, n: int, bits: int, m: int, between: str, trace, lib, records: bool = False,
                prologue: str = "none") -> dict[str, Any]:
    import torch
    from bench_kernels import packed_bytes, random_packed, with_records

    from hf_kbit.backends import cuda as kbit_cuda
    from hf_kbit.eval.timing import capture_cuda_graph

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

    def call(x, x2, packed):
        if prologue == "add_rmsnorm":
            return torch.ops.kbit.mm_add_rmsnorm(x, x2, norm_weight, 1e-5, *packed, k)
        if prologue == "silu_mul":
            return torch.ops.kbit.mm_silu_mul(x, x2, *packed, k)
        return kbit_cuda.run_path("gemv", x, *packed, k)

    def body():
        for x, x2, packed in zip(xs, second, weights):
            if between == "elementwise":
                x.mul_(1.0)
            call(x, x2, packed)

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
    stamps = trace[TRACE_WORDS:TRACE_WORDS * (count + 1)].view(count, TRACE_WORDS).tolist()
    result = summarize(stamps, [packed[0].data_ptr() for packed in weights], nbytes)
    return {"K": k, "N": n, "bits": bits, "M": m, "format": "records" if records else "codes", "prologue": prologue,
            "between": between, "MB": nbytes / 1e6, **result}


def render(rows: list[dict[str, Any]]) -> str:
    from hf_kbit.eval.report import format_table

    def three(r, phase):
        return f"{r[phase + '_min']:.2f} / {r[phase + '_median']:.2f} / {r[phase + '_max']:.2f}"

    def balanced(r):
        return "-" if r.get("balanced_exit") is None else f"{r['balanced_exit']:.2f}"

    def cta(r):
        return "-" if r.get("cta_spread") is None else f"{r['cta_spread']:.2f} / {r['cta_tail']:.2f}"

    headers = ["K x N", "k", "M", "format", "prologue", "between", "MB", "entry us", "wait us", "staged us (median)",
               "exit us", "exit p90 us", "balanced exit us", "CTA spread / tail us", "stream GB/s"]
    table = [[f"{r['K']}x{r['N']}", r["bits"], r["M"], r.get("format", "codes"), r.get("prologue", "none"),
              r["between"], f"{r['MB']:.1f}", three(r, "entry"),
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
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
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
    rows = []
    for k, n in shapes:
        for bits in args.bits:
            for between in args.between:
                rows.append(trace_shape(k, n, bits, args.m, between, trace, lib, args.records, args.prologue))
                print(f"{k}x{n} k={bits} {between}: exit max {rows[-1]['exit_max']:.2f} us", flush=True)
    print(f"{torch.cuda.get_device_name()}: us from the end of the previous GEMV, earliest / median / latest warp")
    print(render(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
