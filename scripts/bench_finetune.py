"""Training step of LoRA on a real-size model with random weights: bf16 LoRA, kbit QLoRA, bitsandbytes NF4 QLoRA.

    python scripts/bench_finetune.py --device cuda                          # H100: Llama-3-8B shape, 32 layers
    python scripts/bench_finetune.py --device cuda --variants bf16,kbit4 --rounds 3 --steps 8   # the issue-37 pair
    python scripts/bench_finetune.py --preset tiny-llama --device cpu --variants bf16,kbit4 --steps 1 --warmup 1

Every variant is the model of ``--preset`` (hf_kbit.eval.presets' published configs, random weights, same seed)
with LoRA of rank ``--rank`` (alpha 2 x rank, no dropout) on every linear layer of the decoder (q, k, v, o,
gate, up, down; the LM head and embeddings stay frozen bf16), gradient checkpointing on every layer
(non-reentrant), AdamW on the adapters (float32, peft's default), one sequence of ``--seq-len`` tokens per
step, the loss computed by hf_kbit.loss.causal_lm_loss (``--loss transformers``: the model's own; the same
value, with float32 logits held) (hf_kbit.eval.finetune). ``bf16``: LoRA on the bf16 weights. ``kbit<k>``: the
decoder's linear layers quantized with hf_kbit.quantize_model (q/k/v and gate/up fused, as on load), LoRA through
hf_kbit.lora. ``nf4``: bitsandbytes' ``Linear4bit`` (NF4, blocks of 64, bf16 compute, no double quantization)
with peft's own bitsandbytes LoRA layer; skipped with the reason recorded when bitsandbytes does not import.

Per variant: the step time (forward, backward, optimizer step, synchronized) over ``--steps`` timed steps after
``--warmup``, split into the host's share (until the step's Python returns, before the synchronize) and the
GPU's (CUDA events around the step), and the peak memory allocated by torch from after the model is built to the
end of the timed steps (weights + adapters + optimizer state + activations). Ratios are to bf16 of the same run.

At batch 1 a LoRA step issues thousands of small launches, and on an H100 its host time is close to its step
time (``host_share`` near 1): the GPU then waits on Python, and the step time follows the host's speed, which
drifts (results/bench_finetune_llama3-8b_h200.json: one variant's round medians differ by up to 70%). So the
variants are measured in ``--rounds`` rounds, each round building and timing every variant once in turn, so that
a slow phase of the machine falls on one round of one variant rather than on a whole variant: ``step_s_median``
is the median over every timed step of every round, ``step_s_best_round`` the fastest round's median (the
quiet-machine value), and ``step_time_vs_bf16`` / ``step_time_vs_bf16_best_round`` the ratios of each. The JSON
goes to ``--out`` (default results/bench_finetune_<preset>_<gpu>.json).

``scripts/profile_lora_host.py`` measures the host time of the same step on the CPU, without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

from hf_kbit.eval import finetune as _finetune, models as _models, report as _report  # the eval harness
from hf_kbit.eval.presets import PRESETS, make_config

SCHEMA = "hf_kbit.bench_finetune/3"


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b", help=f"one of {', '.join(PRESETS)} (default llama3-8b)")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default all)")
    parser.add_argument("--variants", default="bf16,kbit2,kbit3,kbit4,kbit5,nf4",
                        help="comma-separated: bf16, kbit<k>, nf4 (default all)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, each round (default 2)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of every variant in turn (default 2; see the module doc)")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--loss", choices=_finetune.LOSSES, default="chunked",
                        help="chunked (default): hf_kbit.loss.causal_lm_loss, no float32 logits held; transformers: "
                             "the model's own loss (every variant computes the same one)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    parser.add_argument("--out", default=None, help="JSON path (default results/bench_finetune_<preset>_<gpu>.json)")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        _finetune.check_variant(v)
    for name in ("seq_len", "batch_size", "rank", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def measure(variant: str, args, config, device: str) -> dict[str, Any]:
    """One round of ``variant``: build it, ``args.warmup`` untimed steps, ``args.steps`` timed ones."""
    import torch

    cuda = device.startswith("cuda")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    model, opt, ids = _finetune.training_setup(config, variant, device, args.rank, not args.no_gradient_checkpointing,
                                               args.batch_size, args.seq_len, args.loss)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    times, host_times, gpu_times, losses = [], [], [], []
    for step in range(args.warmup + args.steps):
        sync()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        loss = _finetune.train_step(model, opt, ids)
        if cuda:
            end.record()
        issued = time.perf_counter()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            # Host: until the step's Python returns, before the synchronize (launch-bound when it nears the step
            # time). GPU: between events recorded around the step on the stream (the device's busy time and its gaps).
            host_times.append(issued - start)
            if cuda:
                gpu_times.append(begin.elapsed_time(end) / 1000)
        losses.append(loss.item())
    result = {"step_s_all": times, "host_s_all": host_times, "gpu_s_all": gpu_times, "loss": losses,
              "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if cuda:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["resident_before_first_step_gib"] = resident / 2**30
    del model, opt
    return result


def combine(variant: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's result from its rounds (see the module doc)."""
    steps = [t for r in rounds for t in r["step_s_all"]]
    host = [t for r in rounds for t in r["host_s_all"]]
    gpu = [t for r in rounds for t in r["gpu_s_all"]]
    out = {
        "variant": variant,
        "step_s_median": statistics.median(steps),
        "step_s_best_round": min(statistics.median(r["step_s_all"]) for r in rounds),
        "step_s_round_medians": [statistics.median(r["step_s_all"]) for r in rounds],
        "step_s_all": steps,
        "host_s_median": statistics.median(host),
        "gpu_s_median": statistics.median(gpu) if gpu else None,
        # host time / step time: near 1, the GPU waits on the host (a launch-bound step)
        "host_share": statistics.median(host) / statistics.median(steps),
        "loss": rounds[0]["loss"],
        "trainable_params": rounds[0]["trainable_params"],
    }
    if "peak_memory_gib" in rounds[0]:
        out["peak_memory_gib"] = max(r["peak_memory_gib"] for r in rounds)
        out["resident_before_first_step_gib"] = rounds[0]["resident_before_first_step_gib"]
    return out


def add_ratios(results: list[dict[str, Any]]) -> None:
    base = next((r for r in results if r["variant"] == "bf16"), None)
    if base is None:
        return
    for r in results:
        r["step_time_vs_bf16"] = r["step_s_median"] / base["step_s_median"]
        r["step_time_vs_bf16_best_round"] = r["step_s_best_round"] / base["step_s_best_round"]
        if "peak_memory_gib" in r:
            r["peak_memory_vs_bf16"] = r["peak_memory_gib"] / base["peak_memory_gib"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = _models.pick_device(args.device)
    config = make_config(args.preset, args.layers)
    skipped = {}
    variants = list(args.variants)
    if "nf4" in variants:
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # ImportError, or a wheel without this GPU's library
            skipped["nf4"] = f"bitsandbytes does not import: {type(e).__name__}: {e}"
            print(f"nf4: skipped ({skipped['nf4']})", flush=True)
            variants.remove("nf4")
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for index in range(args.rounds):
        for variant in variants:
            r = measure(variant, args, config, device)
            rounds[variant].append(r)
            gpu = f", GPU {statistics.median(r['gpu_s_all']) * 1000:.0f} ms" if r["gpu_s_all"] else ""
            print(f"round {index + 1}/{args.rounds} {variant}: {statistics.median(r['step_s_all']) * 1000:.0f} ms/step "
                  f"(host {statistics.median(r['host_s_all']) * 1000:.0f} ms{gpu}), "
                  f"peak {r.get('peak_memory_gib', float('nan')):.2f} GiB", flush=True)
    results = [combine(v, rounds[v]) for v in variants]
    add_ratios(results)
    gpu = _report.environment().get("gpu", "cpu")
    payload = {
        "schema": SCHEMA,
        "preset": args.preset,
        "title": PRESETS[args.preset]["title"],
        "layers": config.num_hidden_layers,
        "settings": {"seq_len": args.seq_len, "batch_size": args.batch_size, "rank": args.rank,
                     "lora_targets": list(_finetune.LINEARS),
                     "gradient_checkpointing": not args.no_gradient_checkpointing, "loss": args.loss,
                     "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "device": device,
                     "optimizer": "AdamW (adapters)"},
        "results": results,
        "skipped": skipped,
        "command": _report.command_line(),
        "environment": _report.environment(),
    }
    try:
        import peft

        payload["environment"]["peft"] = peft.__version__
        import bitsandbytes

        payload["environment"]["bitsandbytes"] = bitsandbytes.__version__
    except Exception:
        pass
    slug = "cpu" if gpu == "cpu" else gpu.lower().replace("nvidia ", "").split()[0]
    out = args.out or f"results/bench_finetune_{args.preset}_{slug}.json"
    _report.write_json(out, payload)
    rows = [[r["variant"], r["step_s_median"] * 1000, r.get("step_time_vs_bf16"), r["step_s_best_round"] * 1000,
             r.get("step_time_vs_bf16_best_round"), r["host_s_median"] * 1000, r["host_share"],
             None if r["gpu_s_median"] is None else r["gpu_s_median"] * 1000, r.get("peak_memory_gib"),
             r.get("peak_memory_vs_bf16")] for r in results]
    print(_report.format_table(["variant", "step ms", "x bf16", "best round ms", "x bf16", "host ms", "host share",
                                "GPU ms", "peak GiB", "x bf16"], rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
