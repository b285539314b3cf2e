"""Time one benchmark under two or more builds of the kernel library, alternated on one GPU lease, and pair the cells.

    python scripts/ab_libraries.py --build main=. --build old=build/trees/old --out $OUT/ab -- \\
        scripts/bench_kernels.py --offsets --shapes llama3-8b --ms 1 4 16 --bits 4 3
    python scripts/ab_libraries.py --lib main=build/gpu/csrc/libhf_kbit_cuda.so --lib new=/path/to/lib.so \\
        --rounds 3 -- scripts/bench_grouped_gemv.py --families qwen3-30b-a3b

A kernel change is judged against its baseline measured in the same lease (timings move between machines and
leases). Each `--lib NAME=PATH` (or `--build NAME=SOURCE_TREE`, whose library this builds for this GPU under
build/ab/NAME, all builds at once) runs the benchmark in its own process with `HF_KBIT_LIBRARY` set, `--rounds`
times, the order reversed every other round (A B, B A, ...) so that a drift of the machine's clocks falls on both.
The first library is the baseline; the Python package is this tree's. The benchmark is a script whose
`--out PREFIX` writes PREFIX.json with a `results` list (bench_kernels.py, bench_grouped_gemv.py); rows are paired
by their text and integer fields, and each float field named `us` or `*_us` is a timing. Per cell and timing, the
table gives each library's least time over the rounds and its change against the baseline's, and the baseline's
spread over its rounds (max / min - 1): a change inside that spread is noise.

A tree of another commit (for `--build`), exported on the machine that has the repository:

    mkdir -p build/trees/old
    git archive REV csrc CMakeLists.txt pyproject.toml python model_cards | tar -x -C build/trees/old
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = ROOT / "build" / "ab"  # --build NAME builds under BUILD_DIR / NAME


def parse_named(values: list[str], flag: str) -> list[tuple[str, Path]]:
    """``NAME=PATH`` pairs; ValueError naming ``flag`` for a malformed one."""
    pairs = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{flag}: expected NAME=PATH, got {v!r}")
        pairs.append((name, Path(path)))
    return pairs


def without_out(args: list[str]) -> list[str]:
    """``args`` less ``--out PREFIX`` / ``--out=PREFIX``."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            out.append(a)
    return out


def round_order(names: list[str], r: int) -> list[str]:
    """The names in the order round ``r`` runs them: as given, reversed every other round."""
    return names if r % 2 == 0 else names[::-1]


def run_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, name) in the order they run."""
    return [(r, n) for r in range(rounds) for n in round_order(names, r)]


def build_libraries(sources: list[tuple[str, Path]], arch: str, jobs: int,
                    into: Path = BUILD_DIR) -> dict[str, Path]:
    """Build each source tree's library for ``arch`` under ``into``/NAME, all at once; name -> library path."""
    procs = {}
    for name, src in sources:
        out = into / name
        out.mkdir(parents=True, exist_ok=True)
        cmd = (f"(cmake -S '{src.resolve()}' -B '{out}' -G Ninja -DCMAKE_BUILD_TYPE=Release && "
               f"cmake --build '{out}' -j{jobs}) > '{out / 'build.log'}' 2>&1")
        procs[name] = (subprocess.Popen(cmd, shell=True, env={**os.environ, "HF_KBIT_CUDA_ARCHS": arch}), out)
    libs = {}
    for name, (proc, out) in procs.items():
        rc = proc.wait()
        if rc != 0:
            tail = (out / "build.log").read_text().splitlines()[-30:]
            raise RuntimeError(f"--build {name}: the build failed (exit {rc}); the end of {out / 'build.log'}:\n"
                               + "\n".join(tail))
        libs[name] = out / "csrc" / "libhf_kbit_cuda.so"
    return libs


def timing_fields(row: dict) -> list[str]:
    return [k for k, v in row.items() if isinstance(v, float) and (k == "us" or k.endswith("_us"))]


def cell_key(row: dict) -> tuple:
    """A row's identity: its text, integer and boolean fields (floats are measurements)."""
    return tuple((k, v) for k, v in row.items() if isinstance(v, (str, int, bool)))


def pair(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """Per cell (in the baseline's first run's order) and timing field: each library's least time over its
    rounds, its change against the baseline's, and the baseline's spread. ValueError where the libraries'
    runs did not produce the same cells."""
    names = list(runs)
    base = names[0]
    order = [cell_key(r) for r in runs[base][0]]
    cells: dict[str, dict[tuple, list[dict]]] = {}
    for name, rounds in runs.items():
        for i, rows in enumerate(rounds):
            keys = [cell_key(r) for r in rows]
            if sorted(keys, key=repr) != sorted(order, key=repr):
                raise ValueError(f"{name}, round {i + 1}: its cells differ from {base}'s first run "
                                 f"({len(keys)} against {len(order)} rows): the benchmarks must run the same cells")
            for key, row in zip(keys, rows):
                cells.setdefault(name, {}).setdefault(key, []).append(row)
    out = []
    for key in order:
        first = cells[base][key][0]
        for field in timing_fields(first):
            base_times = [r[field] for r in cells[base][key]]
            entry = {"cell": dict(key), "field": field, "spread_pct": 100 * (max(base_times) / min(base_times) - 1),
                     "us": {}, "change_pct": {}}
            for name in names:
                best = min(r[field] for r in cells[name][key])
                entry["us"][name] = best
                if name != base:
                    entry["change_pct"][name] = 100 * (best / min(base_times) - 1)
            out.append(entry)
    return out


def markdown(paired: list[dict], names: list[str], meta: dict) -> str:
    head = ["cell", "timing", *(f"{n} us" for n in names), *(f"{n} vs {names[0]}" for n in names[1:]),
            f"{names[0]} spread"]
    lines = [f"# {meta['benchmark']} under {len(names)} libraries",
             "",
             f"Command: `{meta['command']}`  ",
             (f"{meta['rounds']} rounds, alternated ({' / '.join(' '.join(o) for o in meta['order_by_round'])}); "
              f"least time per library; libraries: {', '.join(f'{n} = {p}' for n, p in meta['libraries'].items())}."),
             "",
             "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for e in paired:
        cell = ", ".join(f"{k} {v}" for k, v in e["cell"].items())
        lines.append("| " + " | ".join([cell, e["field"], *(f"{e['us'][n]:.2f}" for n in names),
                                         *(f"{e['change_pct'][n]:+.1f}%" for n in names[1:]),
                                         f"{e['spread_pct']:.1f}%"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", action="append", default=[], metavar="NAME=PATH", help="a built library")
    ap.add_argument("--build", action="append", default=[], metavar="NAME=SOURCE_TREE",
                    help="build this tree's library for this GPU (under build/ab/NAME) and use it")
    ap.add_argument("--rounds", type=int, default=2, help="runs per library (default 2)")
    ap.add_argument("--arch", default=None, help="HF_KBIT_CUDA_ARCHS for --build (default: this GPU's, 90a on sm_90)")
    ap.add_argument("--jobs", type=int, default=8, help="build jobs per library (default 8)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per benchmark run (default 300)")
    ap.add_argument("--out", default=None, help="path prefix: PREFIX.json and PREFIX.md (default: print only)")
    args = ap.parse_args(argv[:split])
    bench = argv[split + 1:]
    if not bench or not bench[0].endswith(".py"):
        ap.error(f"after --: a benchmark script and its arguments (e.g. -- scripts/bench_kernels.py --quick), "
                 f"got {bench!r}")
    if "--out" in bench:
        ap.error("the benchmark's --out is this script's to set (one per run); give --out before --")
    if args.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {args.rounds}")
    try:
        libs = parse_named(args.lib, "--lib")
        sources = parse_named(args.build, "--build")
    except ValueError as e:
        ap.error(str(e))
    names = [n for n, _ in libs] + [n for n, _ in sources]
    if len(names) < 2 or len(set(names)) != len(names):
        ap.error(f"--lib / --build: expected two or more distinct names, got {names}")
    missing = [f"{n}={p}" for n, p in libs if not p.is_file()]
    if missing:
        ap.error(f"--lib: no such library: {', '.join(missing)}")
    for name, src in sources:
        if not (src / "CMakeLists.txt").is_file() or not (src / "csrc").is_dir():
            ap.error(f"--build {name}={src}: expected a source tree (CMakeLists.txt and csrc/)")
        if (BUILD_DIR / name).resolve() == src.resolve():
            ap.error(f"--build {name}={src}: that is where its library is built (build/ab/{name}); "
                     f"keep source trees elsewhere, e.g. build/trees/{name}")
    paths = {n: p.resolve() for n, p in libs}
    if sources:
        arch = args.arch
        if arch is None:
            import torch

            major, minor = torch.cuda.get_device_capability()
            arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        paths |= build_libraries(sources, arch, args.jobs)
    paths = {n: paths[n] for n in names}

    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r, name in run_order(names, args.rounds):
            prefix = Path(tmp) / f"run{r}_{names.index(name)}"  # no dot: scripts differ in how they add .json
            cmd = [sys.executable, *bench, "--out", str(prefix)]
            print(f"== round {r + 1}, {name}: {' '.join(bench)}", flush=True)
            env = {**os.environ, "HF_KBIT_LIBRARY": str(paths[name]),  # this tree's hf_kbit, the named library
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).splitlines()[-30:]
                raise SystemExit(f"ab_libraries.py: round {r + 1}, {name}: the benchmark exited {proc.returncode}:\n"
                                 + "\n".join(tail))
            runs[name].append(json.loads(prefix.with_suffix(".json").read_text())["results"])
    # As given (the output prefix left out): machine paths stay out of committed results.
    given = {n: str(p) for n, p in libs} | {n: f"built from {src}" for n, src in sources}
    command = without_out(argv[:split])
    meta = {"benchmark": Path(bench[0]).name, "rounds": args.rounds,
            "command": shlex.join(["python", "scripts/ab_libraries.py", *command, "--", *bench]),
            "order_by_round": [round_order(names, r) for r in range(args.rounds)],
            "libraries": {n: given[n] for n in names}}
    paired = pair(runs)
    md = markdown(paired, names, meta)
    print(md)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"meta": meta, "cells": paired, "runs": runs}, indent=1))
        Path(args.out + ".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
