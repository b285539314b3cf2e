"""Host cost of a compiled single-token decode step: dynamo's guard check and the call around it, bf16 vs kbit.

Issue 36's host time per token, measured apart from any kernel: the step (a config-built model's forward over a
StaticCache, ``torch.compile(fullgraph=True)``) is compiled with a backend whose graph does nothing (it returns
zeros of the graph's outputs), so a call is dynamo's guard check, the frame's bytecode and the side effects it
replays, with no compute. The guards are the ones ``generate()``'s compile installs (dynamo's, whatever the
backend), so the difference between variants is the host time a kbit model adds per decode step. Runs on the CPU
(no GPU needed); the numbers are this machine's host, the ratios carry over. Guard evaluation differs between
torch versions: the JSON records torch's.

    python scripts/bench_guards.py --layers 32                      # tiny Llama's layer, 32 times
    python scripts/bench_guards.py --preset tiny-qwen3-moe --layers 8 --variants bf16,kbit4

The guards depend on the modules' structure, not their sizes, so the tiny presets stand in for the real models
(``--layers`` repeats their decoder layer: Llama-3-8B has 32).

Per variant: ``cache_lookup_us`` (median of torch profiler's "TorchDynamo Cache Lookup" events: the guard check)
and ``call_us`` (wall clock per call, median of ``--rounds`` rounds of ``--calls`` calls), and the number of leaf
guards of the compiled entry.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

SCHEMA = "hf_kbit.bench_guards/1"
VARIANTS = ("bf16", "kbit4", "kbit4-unfused")


def _leaf_guards(manager) -> int:
    return len(manager.get_leaf_guards()) + sum(_leaf_guards(c) for c in manager.get_child_managers())


def _noop_backend(gm, example_inputs):
    outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
    import torch

    zeros = [torch.zeros(()) for _ in outputs]
    return lambda *args: zeros


def measure(model, config, calls: int, rounds: int) -> dict[str, Any]:
    """Guard count, guard-check and per-call host microseconds of ``model``'s compiled decode step."""
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.profiler import ProfilerActivity, profile
    from transformers import StaticCache

    from hf_kbit.eval.timing import cache_argument

    cache = StaticCache(config=config, max_cache_len=64)
    cache_kwarg = {cache_argument(model): cache}
    ids = torch.tensor([[1]])
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), cache_position=torch.arange(3), use_cache=True, **cache_kwarg)
    torch._dynamo.reset()
    step = torch.compile(model.forward, fullgraph=True, backend=_noop_backend)
    position = [3]

    def call():
        if position[0] >= 60:
            cache.reset()
            position[0] = 3
        with torch.no_grad():
            step(input_ids=ids, cache_position=torch.tensor([position[0]]), use_cache=True, **cache_kwarg)
        position[0] += 1

    for _ in range(3):
        call()
    entries = _debug_get_cache_entry_list(model.forward.__func__.__code__)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            call()
    lookups = [e.cpu_time_total for e in prof.events() if e.name == "TorchDynamo Cache Lookup"]
    walls = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        walls.append((time.perf_counter() - t0) / calls * 1e6)
    torch._dynamo.reset()
    return {"compiled_entries": len(entries), "leaf_guards": [_leaf_guards(e.guard_manager.root) for e in entries],
            "cache_lookup_us": statistics.median(lookups) if lookups else None, "call_us": statistics.median(walls)}


def run(preset: str, layers: int | None, variants: list[str], calls: int = 200, rounds: int = 3,
        log=print) -> dict[str, Any]:
    import torch

    from hf_kbit.eval import decode_bench, presets

    config = presets.make_config(preset)
    if layers is not None:
        config.num_hidden_layers = layers
    results = []
    for name in variants:
        model = presets.build_model(config, "cpu", torch.bfloat16)
        if name != "bf16":
            model = decode_bench.quantize(model, 4, fuse_projections=name == "kbit4")
        row = {"variant": name, **measure(model, config, calls, rounds)}
        results.append(row)
        log(f"{name}: {row['leaf_guards']} leaf guards, guard check {row['cache_lookup_us']:.1f} us, "
            f"call {row['call_us']:.1f} us")
    base = next((r for r in results if r["variant"] == "bf16"), None)
    for r in results:
        r["call_us_over_bf16"] = r["call_us"] - base["call_us"] if base else None
    return {"schema": SCHEMA, "preset": preset, "layers": config.num_hidden_layers, "torch": torch.__version__,
            "timed": "compiled decode step (noop graph): guards, bytecode and side effects, no compute",
            "results": results}


def main(argv: list[str] | None = None) -> int:
    from hf_kbit.eval.presets import PRESETS
    from hf_kbit.eval.report import command_line, environment, write_json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-llama", help=f"one of {', '.join(PRESETS)} (default tiny-llama)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers, any number (default: the preset's)")
    parser.add_argument("--variants", default="bf16,kbit4,kbit4-unfused", help=f"comma-separated among {VARIANTS}")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed round (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, median reported (default 3)")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants: names among {VARIANTS}, got {args.variants!r}")
    if args.calls < 1 or args.rounds < 1:
        parser.error(f"--calls and --rounds must be >= 1, got {args.calls} and {args.rounds}")
    if args.preset not in PRESETS:
        parser.error(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    payload = run(args.preset, args.layers, variants, args.calls, args.rounds)
    payload["command"] = command_line()
    payload["environment"] = environment()
    if args.out:
        write_json(args.out, payload)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
