"""Benchmark the kbit CUDA kernels against cuBLAS bf16 (and torch's int4 tinygemm) on this GPU.

DESIGN.md section 6: shapes x k x M, cold L2 (every timed call reads a different copy of the
weights; the copies together are several times the L2), CUDA-graph replays timed with events,
ratios against cuBLAS bf16 measured in the same run, % of the HBM roofline (the device-to-
device copy bandwidth measured in the same run). Writes JSON and a markdown table.

    python scripts/bench_kernels.py --out benchmarks/results/h100
    python scripts/bench_kernels.py --quick      # a few shapes, for a smoke run
    python scripts/bench_kernels.py --paths --out benchmarks/results/h100_paths
                                                 # every kernel path per (shape, M, k): the crossovers
    python scripts/bench_kernels.py --paths --write-crossovers
                                                 # ... and rewrite hf_kbit/backends/crossovers.json from them
                                                 # (--gemm-kernel mma / wgmma_ws: that GEMM's entries)
    python scripts/bench_kernels.py --gemm-kernel wgmma_ws --ms 32 64 128 256 1024 4096 --out benchmarks/results/h200_ws
                                                 # the table with the warp-specialized GEMM above the GEMV
    python scripts/bench_kernels.py --gemm-kernels wgmma,wgmma_ws --shapes llama3 --ms 32 64 128 256 1024 4096 --bits 4
                                                 # each GEMM kernel's GEMM path against cuBLAS bf16, one process
    python scripts/bench_kernels.py --rotation --out benchmarks/results/h100_rotation
                                                 # each path on a rotated layer (random sign words) vs the
                                                 # same layer unrotated, Llama-3-8B shapes, M 1..1024
    python scripts/bench_kernels.py --rotation --write-crossovers
                                                 # ... and rewrite crossovers.json's rotated_gemv from the
                                                 # GEMV's two ways of rotating
    python scripts/bench_kernels.py --offsets --out benchmarks/results/h200_offsets
                                                 # the GEMV on block records (int16 block_scales, random
                                                 # offsets) vs the same weight with uint8 codes, Llama-3-8B
                                                 # shapes, k = 3..5, M 1..16 (at M = 1 also the GEMV with
                                                 # the add_rmsnorm prologue); add --ms 1 16 64 256 512 for
                                                 # the wgmma GEMM on records beyond the GEMV
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

import torch

from hf_kbit.eval.timing import capture_cuda_graph
from hf_kbit.backends.crossovers import GEMM_KERNELS
from hf_kbit.kernel_table import SUPPORTED_BITS

SHAPES = {  # name: (K = in_features, N = out_features)
    "llama3-8b gate/up 4096x14336": (4096, 14336),
    "llama3-8b down 14336x4096": (14336, 4096),
    "llama3-8b qkv 4096x6144": (4096, 6144),
    "llama3-8b q/o 4096x4096": (4096, 4096),
    "llama3-8b fused gate_up 4096x28672": (4096, 28672),
    "llama3-70b gate/up 8192x28672": (8192, 28672),
    "h2048 2048x5120": (2048, 5120),
    "h2048 5120x2048": (5120, 2048),
    "h2048 2048x4096": (2048, 4096),
    "h2048 2048x512": (2048, 512),
    "h2048 4096x2048": (4096, 2048),
}
MS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)
# --rotation: Llama-3-8B's projections and the M of issue 34's budget (within 3% of the unrotated
# kernel at M = 1, 2% at M >= 256).
ROTATION_SHAPES = {
    "llama3-8b q/o 4096x4096": (4096, 4096),
    "llama3-8b gate/up 4096x14336": (4096, 14336),
    "llama3-8b down 14336x4096": (14336, 4096),
    "llama3-8b k/v 4096x1024": (4096, 1024),
}
ROTATION_MS = (1, 2, 4, 8, 16, 64, 256, 1024)
ROTATION_ROUNDS = 2  # unrotated and rotated timed alternately, the least of each: clock drift hits both
# --offsets: Llama-3-8B's projections (fused q/k/v as one), the decode M the block-records GEMV serves, the bit
# widths block offsets are screened at (docs/format.md); codes and records timed alternately as --rotation does.
OFFSETS_SHAPES = {
    "llama3-8b q/o 4096x4096": (4096, 4096),
    "llama3-8b qkv 4096x6144": (4096, 6144),
    "llama3-8b gate/up 4096x14336": (4096, 14336),
    "llama3-8b down 14336x4096": (14336, 4096),
}
OFFSETS_MS = (1, 2, 4, 8, 16)
OFFSETS_BITS = (3, 4, 5)
OFFSETS_ROUNDS = ROTATION_ROUNDS
# --offsets: the fused decode step's prologue timed on codes and records too (kbit::mm_add_rmsnorm, the GEMV with the
# add_rmsnorm prologue), at the decode's M = 1.
OFFSETS_PROLOGUE, OFFSETS_PROLOGUE_M = "add_rmsnorm", 1
BITS = SUPPORTED_BITS
COLD_BYTES = 400 * 2**20  # weight copies per timed graph: 8x the H100's 50 MB L2
MIN_CALLS = 24
WALL_CALLS, WALL_ROUNDS = 2000, 7  # eager wall time: the least of WALL_ROUNDS rounds of WALL_CALLS calls


def write_results(prefix: str | None, meta: dict, results: list, md: str) -> None:
    """``prefix``.json (meta and results) and ``prefix``.md; nothing without a prefix."""
    if prefix:
        with open(prefix + ".json", "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        with open(prefix + ".md", "w") as f:
            f.write(md)


def measure_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 512 * 2**20
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        b.copy_(a)
    e1.record()
    e1.synchronize()
    return 2 * n * 20 / (e0.elapsed_time(e1) / 1e3)


def time_calls(calls, replays: int = 7) -> float:
    """Median microseconds per call of a CUDA graph that runs `calls` once each."""
    graph, _ = capture_cuda_graph(lambda: [fn() for fn in calls])
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


# Pause before each block of timings. The large-M cells (cuBLAS near peak) drive the GPU into
# its power cap: an H100 run logged 1320-1410 MHz SM clocks at ~700 W (throttle reason
# SW power cap) against 1980 MHz idle, recovering within a second after the load stopped.
# cuBLAS bf16 at small M is HBM-bound and hardly moves (+2%), but the kbit GEMV is SM-bound:
# 4096x14336 M=1 k=3 took 15.6 us at full clock and 19.1-20.4 us right after such load.
SETTLE_S = 1.0


def settle() -> None:
    torch.cuda.synchronize()
    time.sleep(SETTLE_S)


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(COLD_BYTES / max(nbytes, 1)))


def cold_packs(n: int, k: int, bits: int) -> tuple[list, int]:
    """Enough random packed copies of an [n, k] weight that a timed graph reads them cold from HBM, and the
    calls per graph; the GPU idles a moment first (settle)."""
    ncopy = copies_for(packed_bytes(n, k, bits))
    packs = random_packed(n, k, bits, ncopy)
    settle()
    return packs, max(MIN_CALLS, ncopy)


def random_packed(n: int, k: int, bits: int, copies: int, experts: int | None = None, device: str = "cuda"):
    """``copies`` random packed [n, k] weights (``experts``: [experts, n, k] each): any plane bits, block-scale codes
    120..179, row scales ~0.005, the default codebook. The kernels' speed does not depend on the values."""
    from hf_kbit import format as fmt

    shapes = fmt.packed_shapes(n, k, bits)
    lead = () if experts is None else (experts,)
    cb = fmt.make_codebook(None, bits).to(device)
    out = []
    for _ in range(copies):
        planes = torch.randint(-(2**31), 2**31 - 1, (*lead, *shapes["planes"]), dtype=torch.int32, device=device)
        scales = torch.randint(120, 180, (*lead, *shapes["block_scales"]), dtype=torch.uint8, device=device)
        rs = torch.rand(*lead, n, device=device) * 0.01 + 0.001
        out.append((planes, scales, rs, cb))
    return out


def random_signs(k: int, device: str = "cuda") -> torch.Tensor:
    """Random sign words of a rotated layer (int32 ``[k / 32]``, hf_kbit.rotation.sign_words' form): the kernels'
    speed does not depend on which elements flip."""
    return torch.randint(-(2**31), 2**31 - 1, (k // 32,), dtype=torch.int32, device=device)


def with_records(packs):
    """``random_packed``'s weights with their uint8 codes made int16 block records: the codes and random offset
    codes over [-OFFSET_MAX, OFFSET_MAX]."""
    from hf_kbit import format as fmt

    return [(planes, fmt.pack_records(codes, torch.randint(-fmt.OFFSET_MAX, fmt.OFFSET_MAX + 1, codes.shape,
                                                          device=codes.device)), rs, cb)
            for planes, codes, rs, cb in packs]


def packed_bytes(n: int, k: int, bits: int, offsets: bool = False) -> int:
    from hf_kbit import format as fmt

    return int(fmt.bits_per_weight(n, k, bits, offsets=offsets) * n * k / 8)


def bench_shape(name, k, n, ms, bits_list, bw, results, int4=True):
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
    w_bytes = 2 * n * k
    ncopy = copies_for(w_bytes)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(ncopy)]
    ncalls = max(MIN_CALLS, ncopy)
    rows = {m: {"shape": name, "K": k, "N": n, "M": m} for m in ms}
    settle()
    for m in ms:
        x = xs[m]
        calls = [lambda w=ws[i % ncopy], x=x: torch.nn.functional.linear(x, w) for i in range(ncalls)]
        rows[m]["bf16_us"] = time_calls(calls)
    del ws
    if int4:
        try:
            ncopy4 = copies_for(n * k // 2)
            packs = []
            for _ in range(ncopy4):
                wq = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
                packs.append(torch.ops.aten._convert_weight_to_int4pack(wq, 8))
            sz = torch.rand(k // 128, n, 2, device="cuda", dtype=torch.bfloat16)
            ncalls4 = max(MIN_CALLS, ncopy4)
            settle()
            for m in ms:
                x = xs[m]
                calls = [lambda p=packs[i % ncopy4], x=x: torch.ops.aten._weight_int4pack_mm(x, p, 128, sz)
                         for i in range(ncalls4)]
                rows[m]["int4pack_us"] = time_calls(calls)
            del packs
        except Exception as exc:  # not every torch build/GPU has it
            print(f"  int4pack unavailable: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
    for bits in bits_list:
        kb = packed_bytes(n, k, bits)
        packs, ncalls = cold_packs(n, k, bits)
        ncopy = len(packs)
        for m in ms:
            x = xs[m]
            calls = [lambda p=packs[i % ncopy], x=x: torch.ops.kbit.mm(x, *p, k) for i in range(ncalls)]
            t = time_calls(calls)
            ideal_us = (kb + 2 * m * (k + n)) / bw * 1e6
            rows[m][f"k{bits}_us"] = t
            rows[m][f"k{bits}_x_bf16"] = rows[m]["bf16_us"] / t
            rows[m][f"k{bits}_roofline_pct"] = 100 * ideal_us / t
        del packs
    torch.cuda.empty_cache()
    for m in ms:
        results.append(rows[m])
        r = rows[m]
        line = "  ".join(f"k{b}={r[f'k{b}_us']:7.1f}us {r[f'k{b}_x_bf16']:4.2f}x" for b in bits_list)
        print(f"{name:34s} M={m:5d} bf16={r['bf16_us']:7.1f}us  {line}", flush=True)


def bench_paths(name, k, n, ms, bits_list, results):
    """Time each kernel path of kbit::mm (GEMV, GEMM, dequantize + cuBLAS) for every M and k,
    cold L2, to set the dispatch crossovers (hf_kbit/backends/crossovers.json)."""
    from hf_kbit.backends import cuda as backend

    for bits in bits_list:
        packs, ncalls = cold_packs(n, k, bits)
        ncopy = len(packs)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dispatch, gemm_kernel, _ = backend.mm_plan(m, n, k, bits, x.device.index, x.dtype)
            row = {"shape": name, "K": k, "N": n, "M": m, "bits": bits, "dispatch": dispatch,
                   "gemm_kernel": gemm_kernel}
            for path in backend.PATHS:
                if path == "gemv" and m > backend.GEMV_MAX_M:
                    continue
                if path == "gemm" and backend.gemm_workspace(x.device.index, m, n, k, bits) < 0:
                    continue
                calls = [lambda p=packs[i % ncopy], x=x, path=path: backend.run_path(path, x, *p, k)
                         for i in range(ncalls)]
                row[f"{path}_us"] = time_calls(calls)
            best = min((p for p in backend.PATHS if f"{p}_us" in row), key=lambda p: row[f"{p}_us"])
            row["fastest"] = best
            results.append(row)
            cells = "  ".join(f"{p}={row[f'{p}_us']:7.1f}us" for p in backend.PATHS if f"{p}_us" in row)
            print(f"{name:34s} k={bits} M={m:5d} {cells}  fastest={best} dispatch={row['dispatch']}", flush=True)
        del packs
        torch.cuda.empty_cache()


def bf16_times(xs: dict, n: int, k: int) -> dict:
    """cuBLAS bf16 microseconds per call of x [m, k] @ W.T for each ``xs[m]``, cold L2 (random [n, k] copies)."""
    ncopy = copies_for(2 * n * k)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(ncopy)]
    settle()
    return {m: time_calls([lambda w=ws[i % ncopy], x=x: torch.nn.functional.linear(x, w)
                           for i in range(max(MIN_CALLS, ncopy))]) for m, x in xs.items()}


def bench_gemm_kernels(name, k, n, ms, bits_list, kernels, results):
    """The GEMM path of each of ``kernels`` (crossovers.GEMM_KERNELS names, each with its planner's plan) and
    cuBLAS bf16 on the same x, cold L2, for every M and k: the A/B of two GEMM kernels in one process."""
    from hf_kbit.backends import cuda as backend

    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
    bf16 = bf16_times(xs, n, k)
    try:
        for bits in bits_list:
            packs, ncalls = cold_packs(n, k, bits)
            for m in ms:
                row = {"shape": name, "K": k, "N": n, "M": m, "bits": bits, "bf16_us": bf16[m]}
                for kernel in kernels:
                    backend.set_gemm_kernel(kernel)
                    calls = [lambda p=packs[i % len(packs)], x=xs[m]: backend.run_path("gemm", x, *p, k)
                             for i in range(ncalls)]
                    row[f"{kernel}_us"] = time_calls(calls)
                results.append(row)
                print(f"{name:34s} k={bits} M={m:5d} bf16={bf16[m]:7.1f}us  " +
                      "  ".join(f"{kn}={row[f'{kn}_us']:7.1f}us {bf16[m] / row[f'{kn}_us']:4.2f}x" for kn in kernels),
                      flush=True)
            del packs
    finally:
        backend.set_gemm_kernel(None)
    torch.cuda.empty_cache()


def markdown_gemm_kernels(results, kernels, meta) -> str:
    lines = [f"# kbit GEMM kernels against cuBLAS bf16 — {meta['device']}", "", f"Command: `{meta['command']}`  ",
             (f"torch {meta['torch']}, cold L2, CUDA-graph replays, median of 7; us per call (x cuBLAS bf16 in the "
              "same run), bf16 activations; each kernel's GEMM path with its own plan."), "",
             "| shape (K x N) | k | M | bf16 us | " + " | ".join(f"{kn} us (x)" for kn in kernels) + " |",
             "|---|---|---|---|" + "---|" * len(kernels)]
    for r in results:
        cells = [f"{r[f'{kn}_us']:.1f} ({r['bf16_us'] / r[f'{kn}_us']:.2f}x)" for kn in kernels]
        lines.append(f"| {r['shape']} | {r['bits']} | {r['M']} | {r['bf16_us']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bench_rotation(name, k, n, ms, bits_list, results):
    """Each kernel path of kbit::mm (and the planner's choice) on a rotated layer (random sign words)
    against the same packed weights unrotated, cold L2, cuBLAS bf16 in the same run. The GEMV both
    ways, forced through the rotated crossover: "gemv-staged" (x R staged by the GEMV, M <= 8) and
    "gemv-standalone" (the standalone rotation into the workspace, then the unrotated GEMV as its
    programmatic dependent); the wgmma GEMM rotates in its x rewrite, the mma.sync GEMM
    (HF_KBIT_GEMM_KERNEL=mma) runs the standalone rotation first, dequantize + cuBLAS multiplies the
    stored weight by the standalone rotation's x R (docs/kernels.md)."""
    from hf_kbit import _lib
    from hf_kbit.backends import cuda as backend

    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
    bf16 = bf16_times(xs, n, k)
    signs = random_signs(k)
    lib = _lib.load()
    for bits in bits_list:
        packs, ncalls = cold_packs(n, k, bits)
        ncopy = len(packs)
        for m in ms:
            x = xs[m]
            plan = backend.mm_plan(m, n, k, bits, x.device.index, x.dtype, True)
            planned = plan[0]
            if planned == "gemv":
                planned = f"gemv-{backend.gemv_rotate_plan(m, bits, x.dtype)}"
            for path in ("gemv-staged", "gemv-standalone", "gemm", "dequant"):
                # Beyond the GEMV, or beyond its rotated instantiations (where a prologue, which only
                # the staging can rotate, has no GEMV).
                if path.startswith("gemv") and (m > backend.GEMV_MAX_M or (
                        path == "gemv-staged" and backend.gemv_rotate_plan(m, bits, x.dtype, True) is None)):
                    continue
                if path == "gemm" and backend.gemm_workspace(x.device.index, m, n, k, bits, True) < 0:
                    continue
                if path.startswith("gemv"):  # the crossover forces the GEMV's way of rotating
                    lib.kbit_set_gemv_rotate_crossover(bits, backend.GEMV_MAX_M if path == "gemv-staged" else 0)
                calls = {rot: [lambda p=packs[i % ncopy], s=(signs if rot else None), kp=path.split("-")[0]:
                               backend.run_path(kp, x, *p, k, None, s) for i in range(ncalls)]
                         for rot in (False, True)}
                times = {False: [], True: []}
                for _ in range(ROTATION_ROUNDS):
                    for rot in (False, True):
                        times[rot].append(time_calls(calls[rot]))
                row = {"shape": name, "K": k, "N": n, "M": m, "bits": bits, "path": path, "gemm_kernel": plan[1],
                       "dispatch": path == planned, "bf16_us": bf16[m], "us": min(times[False]),
                       "rotated_us": min(times[True])}
                row["cost_pct"] = 100 * (row["rotated_us"] / row["us"] - 1)
                results.append(row)
                print(f"{name:30s} k={bits} M={m:5d} {path:15s}{'*' if row['dispatch'] else ' '} "
                      f"bf16={row['bf16_us']:7.1f}us  unrotated={row['us']:7.1f}us  "
                      f"rotated={row['rotated_us']:7.1f}us  cost={row['cost_pct']:+5.1f}%", flush=True)
        backend.load_crossovers()  # the file's rotated crossover again
        del packs
        torch.cuda.empty_cache()


def markdown_rotation(results, meta) -> str:
    lines = [f"# kbit::mm on rotated layers — {meta['device']}", "", f"Command: `{meta['command']}`  ",
             (f"torch {meta['torch']}, cold L2, CUDA-graph replays, median of 7, the least of {ROTATION_ROUNDS} "
              "alternating rounds; us per call (bf16 activations). The same packed weights unrotated and rotated "
              "(random sign words); cost = rotated / unrotated - 1. `*`: the path kbit::mm takes for a rotated layer. "
              "gemv-staged / gemv-standalone: the GEMV staging x R / after the standalone rotation (both forced; the "
              f"unrotated GEMV is the same). GEMM kernel: {meta.get('gemm_kernel', 'mma')}."), "",
             "| shape (K x N) | k | M | path | bf16 us | unrotated us | rotated us | cost |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['shape']} | {r['bits']} | {r['M']} | {r['path']}{' *' if r['dispatch'] else ''} | "
                     f"{r['bf16_us']:.1f} | {r['us']:.1f} | {r['rotated_us']:.1f} | {r['cost_pct']:+.1f}% |")
    return "\n".join(lines) + "\n"


def bench_offsets(name, k, n, ms, bits_list, results):
    """The GEMV on the same packed weights with uint8 E4M4 codes and with int16 block records (the codes and
    random offset codes over [-127, 127]), cold L2, cuBLAS bf16 in the same run: the price of offsets at decode.
    Both through run_path("gemv"): the uint8 GEMV and the block-records GEMV (kOffsets) on the same plan. M above
    the GEMV: both through run_path("gemm") where the block-records wgmma GEMM serves (sm_90a), else skipped. At
    M = OFFSETS_PROLOGUE_M also kbit::mm_add_rmsnorm (path "gemv+add_rmsnorm": the GEMV with the prologue on codes
    and on records), where both fuse."""
    from hf_kbit import format as fmt
    from hf_kbit.backends import cuda as backend

    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
    residual = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
    norm_weight = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    bf16 = bf16_times(xs, n, k)
    for bits in bits_list:
        packs, ncalls = cold_packs(n, k, bits)
        records = with_records(packs)
        ncopy = len(packs)
        extra_bytes = fmt.bits_per_weight(n, k, bits, offsets=True) / fmt.bits_per_weight(n, k, bits) - 1
        for m in ms:
            x = xs[m]
            if m <= backend.gemv_offsets_max_m(bits, x.dtype):
                path = "gemv"
            elif backend.gemm_offsets_serves(m, n, k, bits, x.device.index, x.dtype):
                path = "gemm"
            else:
                continue
            runs = {path: lambda p, x=x: backend.run_path(path, x, *p, k)}
            if m == OFFSETS_PROLOGUE_M and backend.offsets_prologue_serves(m, bits, x.dtype) and \
                    backend.mm_path(m, n, k, bits, x.device.index, x.dtype) == "gemv":  # fused on codes and records
                runs[f"gemv+{OFFSETS_PROLOGUE}"] = lambda p, x=x, r=residual[m]: torch.ops.kbit.mm_add_rmsnorm(
                    x, r, norm_weight, 1e-5, *p, k)
            for label, run in runs.items():
                calls = {kind: [lambda p=weights[i % ncopy], run=run: run(p) for i in range(ncalls)]
                         for kind, weights in (("codes", packs), ("records", records))}
                times = {kind: [] for kind in calls}
                for _ in range(OFFSETS_ROUNDS):
                    for kind in calls:
                        times[kind].append(time_calls(calls[kind]))
                row = {"shape": name, "K": k, "N": n, "M": m, "bits": bits, "path": label, "bf16_us": bf16[m],
                       "us": min(times["codes"]),
                       "records_us": min(times["records"]), "bytes_pct": 100 * extra_bytes}
                row["cost_pct"] = 100 * (row["records_us"] / row["us"] - 1)
                results.append(row)
                print(f"{name:30s} k={bits} M={m:3d} {label} bf16={row['bf16_us']:7.1f}us  codes={row['us']:7.1f}us  "
                      f"records={row['records_us']:7.1f}us  cost={row['cost_pct']:+5.1f}%  "
                      f"bytes={row['bytes_pct']:+5.1f}%", flush=True)
        del packs, records
        torch.cuda.empty_cache()


def markdown_offsets(results, meta) -> str:
    lines = [f"# The GEMV and GEMM on block records (offsets) — {meta['device']}", "", f"Command: `{meta['command']}`  ",
             (f"torch {meta['torch']}, cold L2, CUDA-graph replays, median of 7, the least of {OFFSETS_ROUNDS} "
              "alternating rounds; us per call (bf16 activations). The same packed weights with uint8 E4M4 codes "
              "(the GEMV; above its M the wgmma GEMM) and with int16 block records, the codes and random offset codes "
              "(their kOffsets instantiations, csrc/gemv_kernel.cuh and wgmma_kernel.cuh); cost = records / codes - 1; "
              "bytes = the records' extra packed bytes (format.bits_per_weight). gemv+add_rmsnorm: "
              "kbit::mm_add_rmsnorm, the GEMV with the add_rmsnorm prologue (bf16 us: the plain product's)."), "",
             "| shape (K x N) | k | M | path | bf16 us | codes us | records us | cost | bytes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['shape']} | {r['bits']} | {r['M']} | {r['path']} | {r['bf16_us']:.1f} | {r['us']:.1f} | "
                     f"{r['records_us']:.1f} | {r['cost_pct']:+.1f}% | {r['bytes_pct']:+.1f}% |")
    plain = [r for r in results if r["path"] in ("gemv", "gemm")]
    fused = [r for r in results if r["path"] not in ("gemv", "gemm")]
    shapes = list(dict.fromkeys(r["shape"] for r in plain))
    bits = sorted({r["bits"] for r in plain})
    ms = sorted({r["M"] for r in plain})
    cost = {(r["shape"], r["bits"], r["M"]): r["cost_pct"] for r in plain}
    lines += ["", "Cost by M (records / codes - 1):", "",
              "| shape (K x N) | k | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|---|" + "---|" * len(ms)]
    for shape in shapes:
        for b in bits:
            cells = [f"{cost[shape, b, m]:+.1f}%" if (shape, b, m) in cost else "-" for m in ms]
            lines.append(f"| {shape} | {b} | " + " | ".join(cells) + " |")
    if fused:
        lines += ["", "With a prologue (records / codes - 1):", "", "| shape (K x N) | k | M | path | cost |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['bits']} | {r['M']} | {r['path']} | {r['cost_pct']:+.1f}% |" for r in fused]
    return "\n".join(lines) + "\n"


def derive_rotated_crossover(results: list, current: dict) -> dict:
    """``rotated_gemv`` (hf_kbit.backends.crossovers.read_rotated's form) from ``--rotation`` rows: per
    bits, the largest measured M at which the GEMV staging x R was no slower than the standalone
    rotation + GEMV on every shape, at every M up to it (0: never). A bits without rows keeps
    ``current``'s value."""
    out = {}
    for bits, now in current.items():
        rows = {(r["shape"], r["M"]): r["rotated_us"] for r in results if r["bits"] == bits and r["path"] == "gemv-staged"}
        alone = {(r["shape"], r["M"]): r["rotated_us"] for r in results
                 if r["bits"] == bits and r["path"] == "gemv-standalone"}
        pairs = [key for key in rows if key in alone]
        if not pairs:
            out[bits] = now
            continue
        best = 0
        for m in sorted({m for _, m in pairs}):
            if not all(rows[key] <= alone[key] for key in pairs if key[1] == m):
                break
            best = m
        out[bits] = best
    return out


def derive_crossovers(results: list, current: dict) -> dict:
    """Crossovers (hf_kbit.backends.crossovers.read's form, for one GEMM kernel) from ``--paths`` rows,
    keeping ``current``'s weight classes: the GEMV serves M up to the largest measured M at which it
    was fastest on every shape at every M up to it; the GEMM, per weight class, up to the largest
    measured M at which it beat dequantize + cuBLAS on every shape of the class at every M from the
    GEMV's crossover up to it, or ``current``'s larger value where it won at every measured M (no
    measurement says where it stops winning). A bits or class without rows keeps ``current``'s value."""
    out = {}
    for bits, (gemv_now, classes) in current.items():
        rows = [r for r in results if r["bits"] == bits]
        if not rows:
            out[bits] = (gemv_now, classes)
            continue
        ms = sorted({r["M"] for r in rows})
        gemv = 0
        for m in ms:
            if not all(r["fastest"] == "gemv" for r in rows if r["M"] == m):
                break
            gemv = m
        derived = []
        for i, (min_weight, gemm_now) in enumerate(classes):
            upper = classes[i - 1][0] if i else None
            in_class = [r for r in rows if r["N"] * r["K"] >= min_weight and (upper is None or r["N"] * r["K"] < upper)]
            if not in_class:
                derived.append((min_weight, gemm_now))
                continue
            gemm, lost = gemv, False
            for m in (m for m in ms if m > gemv):
                if not all("gemm_us" in r and r["gemm_us"] <= r["dequant_us"] for r in in_class if r["M"] == m):
                    lost = True
                    break
                gemm = m
            derived.append((min_weight, gemm if lost else max(gemm, gemm_now)))
        out[bits] = (gemv, tuple(derived))
    return out


def markdown_paths(results, meta) -> str:
    lines = [f"# kbit::mm kernel paths — {meta['device']}", "", f"Command: `{meta['command']}`  ",
             (f"torch {meta['torch']}, cold L2, CUDA-graph replays, median of 7; us per call (bf16 activations). "
              f"GEMM kernel: {meta.get('gemm_kernel', 'mma')}. "
              "`dispatch` is the path kbit::mm takes with the crossovers in hf_kbit/backends/crossovers.json."), "",
             "| shape (K x N) | k | M | GEMV us | GEMM us | dequant + cuBLAS us | fastest | dispatch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        cell = [f"{r[f'{p}_us']:.1f}" if f"{p}_us" in r else "-" for p in ("gemv", "gemm", "dequant")]
        lines.append(f"| {r['shape']} | {r['bits']} | {r['M']} | " + " | ".join(cell) + f" | {r['fastest']} | {r['dispatch']} |")
    return "\n".join(lines) + "\n"


def _wall_us(fns: dict, n: int = WALL_CALLS, rounds: int = WALL_ROUNDS) -> dict:
    """Wall microseconds per call of each of ``fns`` (name -> callable): the least over ``rounds``
    rounds, each timing ``n`` calls of every function in turn. The host of a shared GPU machine is
    noisy over seconds (single runs of one build varied 13-29 us); interleaving gives every
    function the same spells of interference, and the least run is the call's own cost."""
    for fn in fns.values():
        for _ in range(200):
            fn()
    torch.cuda.synchronize()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return best


def _kernel_us(fn, calls: int = 200) -> float:
    """GPU time of one eager call: the summed durations of its kernels (CUPTI, through
    torch.profiler) over ``calls`` eager calls. Not a CUDA graph of back-to-back calls: there each
    kbit kernel, a programmatic dependent launch on sm_90, overlaps the previous call's tail,
    which eager calls spaced by the host's launch time do not."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls


def eager_overhead(bw) -> dict:
    """Wall time per eager call minus its GPU time (the kernels' durations in eager calls), on a
    small layer: KbitLinear.forward, the torch.ops.kbit.mm op, and the CUDA backend function
    without the dispatcher."""
    import hf_kbit
    from hf_kbit.backends import cuda as backend

    lin = torch.nn.Linear(1024, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = hf_kbit.KbitLinear.from_linear(lin, bits=4)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    args = (x, layer.planes, layer.block_scales, layer.row_scales, layer.codebook, 1024)
    settle()
    graph_us = time_calls([lambda: layer(x)] * 50)
    with torch.inference_mode():
        gpu_us = _kernel_us(lambda: layer(x))
        if not gpu_us > 0:
            raise RuntimeError("torch.profiler recorded no kernel time for the eager calls")
        fns = {"wall_us": lambda: layer(x), "op_wall_us": lambda: torch.ops.kbit.mm(*args),
               "backend_wall_us": lambda: backend.mm_direct(*args),
               # The host's own pace: the same wall time of a bf16 nn.Linear (one cuBLAS launch).
               "bf16_linear_wall_us": lambda: lin(x)}
        if getattr(backend, "linear_fast", None) is not None:
            fns["fast_wall_us"] = lambda: backend.linear_fast(layer, x)
        out = {"layer": "KbitLinear 1024x1024 k=4, M=1, bf16, inference_mode", "gpu_us": gpu_us,
               "graph_us": graph_us, **_wall_us(fns)}
    out["overhead_us"] = max(out["wall_us"] - gpu_us, 0.0)
    return out


def markdown(results, bits_list, meta) -> str:
    lines = [f"# kbit kernels vs cuBLAS bf16 — {meta['device']}", "",
             f"Command: `{meta['command']}`  ", f"torch {meta['torch']}, measured copy bandwidth "
             f"{meta['bandwidth_GBps']:.0f} GB/s (read+write), cold L2 (weight copies >= {COLD_BYTES >> 20} MiB per "
             f"graph), CUDA-graph replays, median of 7; {SETTLE_S:g} s idle before each block of a shape's cells "
             "(ascending M) so that the power cap reached by the large-M cells does not lower the clocks of the next. "
             f"GEMM kernel: {meta.get('gemm_kernel', 'mma')}.", "",
             "Cells: time in us, speed-up over bf16 (x), % of the HBM roofline for the kbit bytes. On sm_90 the "
             "kbit GEMV and the wgmma GEMM's first kernel are programmatic dependent launches, so back to back "
             "(as here) a call's prologue overlaps the previous call's tail; docs/kernels.md gives the gain with "
             "another kernel in between, as in a model.", ""]
    head = "| shape (K x N) | M | bf16 us | int4pack us (x) | " + " | ".join(f"k={b}" for b in bits_list) + " |"
    lines += [head, "|" + "---|" * (4 + len(bits_list))]
    for r in results:
        i4 = f"{r['int4pack_us']:.1f} ({r['bf16_us'] / r['int4pack_us']:.2f}x)" if "int4pack_us" in r else "n/a"
        cells = [f"{r[f'k{b}_us']:.1f} ({r[f'k{b}_x_bf16']:.2f}x, {r[f'k{b}_roofline_pct']:.0f}%)" for b in bits_list]
        lines.append(f"| {r['shape']} | {r['M']} | {r['bf16_us']:.1f} | {i4} | " + " | ".join(cells) + " |")
    ov = meta.get("eager_overhead")
    if ov:
        lines += ["", f"Eager overhead ({ov['layer']}; wall: least of {WALL_ROUNDS} rounds of {WALL_CALLS} calls, the "
                  "functions interleaved; GPU: kernel durations of 200 eager calls, CUPTI): "
                  f"wall {ov['wall_us']:.1f} us/call, GPU {ov['gpu_us']:.1f} us"
                  f" ({ov['graph_us']:.1f} us per call in a CUDA graph of back-to-back calls), "
                  f"overhead {ov['overhead_us']:.1f} us (wall of torch.ops.kbit.mm alone {ov['op_wall_us']:.1f} us, "
                  f"of the backend function without the dispatcher {ov['backend_wall_us']:.1f} us"
                  + (f", of the eager fast path KbitLinear.forward takes {ov['fast_wall_us']:.1f} us" if "fast_wall_us" in ov else "")
                  + ")."
                  + (f" On this host a bf16 nn.Linear of the same shape takes {ov['bf16_linear_wall_us']:.1f} us wall per call:"
                     " host speed varied up to ~1.8x between sessions on the same machine kind, so compare the two."
                     if "bf16_linear_wall_us" in ov else "")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="path prefix for .json and .md (default: print only)")
    ap.add_argument("--quick", action="store_true", help="two shapes, M in {1, 16, 256}")
    ap.add_argument("--shapes", nargs="*", default=None, help="subset of shape names (substring match)")
    ap.add_argument("--ms", type=int, nargs="*", default=None)
    ap.add_argument("--bits", type=int, nargs="*", default=None,
                    help=f"bit widths (default: {' '.join(map(str, BITS))}; with --offsets "
                         f"{' '.join(map(str, OFFSETS_BITS))})")
    ap.add_argument("--no-int4", action="store_true")
    ap.add_argument("--paths", action="store_true",
                    help="time every kernel path (GEMV, GEMM, dequantize + cuBLAS) instead of kbit::mm vs bf16")
    ap.add_argument("--write-crossovers", action="store_true",
                    help="with --paths: rewrite this GPU's GEMM kernel's entries of hf_kbit/backends/crossovers.json; "
                         "with --rotation: its rotated_gemv entries")
    ap.add_argument("--rotation", action="store_true",
                    help="each path on a rotated layer vs the same layer unrotated (Llama-3-8B shapes, M 1..1024)")
    ap.add_argument("--offsets", action="store_true",
                    help="the GEMV on block records (random offsets) vs the same weights with uint8 codes "
                         "(Llama-3-8B shapes, M 1..16; --ms above 16: the wgmma GEMM on records, sm_90a)")
    ap.add_argument("--gemm-kernel", default=None, choices=GEMM_KERNELS,
                    help="the GEMM kernel the planner takes (hf_kbit.backends.cuda.set_gemm_kernel; default: the "
                         "device's, or HF_KBIT_GEMM_KERNEL's)")
    ap.add_argument("--gemm-kernels", default=None,
                    help=f"comma-separated among {', '.join(GEMM_KERNELS)}: time each kernel's GEMM path against "
                         "cuBLAS bf16 in one process instead of kbit::mm's table")
    args = ap.parse_args()
    if args.offsets and (args.rotation or args.paths or args.gemm_kernels):
        ap.error("--offsets runs on its own (not with --rotation, --paths or --gemm-kernels)")
    if args.bits is None:
        args.bits = list(OFFSETS_BITS if args.offsets else BITS)
    kernels = args.gemm_kernels.split(",") if args.gemm_kernels else []
    if any(kn not in GEMM_KERNELS for kn in kernels):
        ap.error(f"--gemm-kernels: each must be one of {', '.join(GEMM_KERNELS)}, got {args.gemm_kernels!r}")

    import hf_kbit
    from hf_kbit import _lib

    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    _lib.load()  # clear error if the library is missing
    if args.gemm_kernel:
        from hf_kbit.backends import cuda as backend

        backend.set_gemm_kernel(args.gemm_kernel)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    shapes = ROTATION_SHAPES if args.rotation else OFFSETS_SHAPES if args.offsets else SHAPES
    ms = args.ms or (ROTATION_MS if args.rotation else OFFSETS_MS if args.offsets else MS)
    if args.quick:
        shapes = {k: v for k, v in shapes.items() if k.startswith(("llama3-8b gate", "h2048 2048x5120"))}
        ms = args.ms or (1, 16, 256)
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if any(s in k for s in args.shapes)}
    bw = measure_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    results = []
    for name, (k, n) in shapes.items():
        if args.rotation:
            bench_rotation(name, k, n, ms, args.bits, results)
        elif args.offsets:
            bench_offsets(name, k, n, ms, args.bits, results)
        elif kernels:
            bench_gemm_kernels(name, k, n, ms, args.bits, kernels, results)
        elif args.paths:
            bench_paths(name, k, n, ms, args.bits, results)
        else:
            bench_shape(name, k, n, ms, args.bits, bw, results, int4=not args.no_int4)
    meta = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "hf_kbit": hf_kbit.__version__,
        "python": platform.python_version(), "bandwidth_GBps": bw / 1e9,
        "command": shlex.join(["python", "scripts/bench_kernels.py", *sys.argv[1:]]), "cold_l2_bytes": COLD_BYTES,
        "gemv_max_m": getattr(sys.modules.get("hf_kbit.backends.cuda"), "GEMV_MAX_M", None),
    }
    if args.rotation:
        meta["gemm_kernel"] = results[0]["gemm_kernel"] if results else None
        md = markdown_rotation(results, meta)
        if args.write_crossovers and results:
            from hf_kbit.backends import crossovers

            derived = derive_rotated_crossover(results, crossovers.read_rotated())
            crossovers.write({}, about=crossovers.ABOUT, rotated=derived)
            print(f"wrote the rotated GEMV crossover to {crossovers.FILE}: {derived}", flush=True)
    elif args.offsets:
        md = markdown_offsets(results, meta)
    elif kernels:
        md = markdown_gemm_kernels(results, kernels, meta)
    elif args.paths:
        meta["gemm_kernel"] = results[0]["gemm_kernel"] if results else None
        md = markdown_paths(results, meta)
        if args.write_crossovers and results:
            from hf_kbit.backends import crossovers

            kernel = meta["gemm_kernel"]
            derived = derive_crossovers(results, crossovers.read()[kernel])
            crossovers.write({kernel: derived}, about=crossovers.ABOUT)
            print(f"wrote the {kernel} GEMM's crossovers to {crossovers.FILE}: {derived}", flush=True)
    else:
        meta["eager_overhead"] = eager_overhead(bw)
        print(f"eager overhead: {meta['eager_overhead']}", flush=True)
        md = markdown(results, args.bits, meta)
    print(md)
    write_results(args.out, meta, results, md)


if __name__ == "__main__":
    main()
