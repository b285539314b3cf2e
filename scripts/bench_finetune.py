"""Training step of LoRA on a real-size model with random weights: bf16 LoRA, kbit QLoRA, bitsandbytes NF4 QLoRA.

    python scripts/bench_finetune.py --device cuda                          # H100: Llama-3-8B shape, 32 layers
    python scripts/bench_finetune.py --preset tiny-llama --device cpu --variants bf16,kbit4 --steps 1 --warmup 1

Every variant is the model of ``--preset`` (hf_kbit.eval.presets' published configs, random weights, same seed)
with LoRA of rank ``--rank`` (alpha 2 x rank, no dropout) on every linear layer of the decoder (q, k, v, o,
gate, up, down; the LM head and embeddings stay frozen bf16), gradient checkpointing on every layer
(non-reentrant), AdamW on the adapters (float32, peft's default), one sequence of ``--seq-len`` tokens per
step. ``bf16``: LoRA on the bf16 weights. ``kbit<k>``: the decoder's linear layers quantized with
hf_kbit.quantize_model (q/k/v and gate/up fused, as on load), LoRA through hf_kbit.lora. ``nf4``:
bitsandbytes' ``Linear4bit`` (NF4, blocks of 64, bf16 compute, no double quantization) with peft's own
bitsandbytes LoRA layer; skipped with the reason recorded when bitsandbytes does not import.

Per variant: the median step time over ``--steps`` timed steps after ``--warmup`` (forward, backward,
optimizer step, synchronized), split into the host's share (until the step's Python returns, before the
synchronize: a step whose host time nears its step time is bound by launches, not by the GPU) and the GPU's
(CUDA events around the step), and the peak memory allocated by torch from after the model is built to the
end of the timed steps (weights + adapters + optimizer state + activations). Ratios are to bf16 of the same
run. The JSON goes to ``--out`` (default results/bench_finetune_<preset>_<gpu>.json).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

from hf_kbit.eval import models as _models, report as _report  # the eval harness
from hf_kbit.eval.presets import PRESETS, make_config

SCHEMA = "hf_kbit.bench_finetune/1"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b", help=f"one of {', '.join(PRESETS)} (default llama3-8b)")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default all)")
    parser.add_argument("--variants", default="bf16,kbit2,kbit3,kbit4,kbit5,nf4",
                        help="comma-separated: bf16, kbit<k>, nf4 (default all)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    parser.add_argument("--out", default=None, help="JSON path (default results/bench_finetune_<preset>_<gpu>.json)")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in ("bf16", "nf4") and not (v.startswith("kbit") and v[4:].isdigit() and int(v[4:]) in (2, 3, 4, 5)):
            raise ValueError(f"--variants: {v!r} is not bf16, nf4 or kbit2..kbit5")
    for name in ("seq_len", "batch_size", "rank", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def build(config, variant: str, device: str):
    """The random-weight bf16 model, its decoder linears converted for ``variant``, on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_kbit

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    if variant.startswith("kbit"):
        hf_kbit.quantize_model(model, hf_kbit.KbitConfig(bits=int(variant[4:])), modules_to_not_convert=["lm_head"])
    elif variant == "nf4":
        to_nf4(model)
    return model


def to_nf4(model) -> None:
    """Every decoder nn.Linear -> bitsandbytes Linear4bit (NF4, bf16 compute), as BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bfloat16) loads them; the model is marked as peft expects."""
    import bitsandbytes as bnb
    import torch

    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or name.rpartition(".")[2] not in LINEARS:
            continue
        q = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        weight = module.weight.data
        q.weight = bnb.nn.Params4bit(weight.cpu() if weight.is_cuda else weight, requires_grad=False,
                                     quant_type="nf4").to(weight.device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, q)
        del module, weight
    model.is_loaded_in_4bit = True  # what peft's bitsandbytes dispatch and prepare helpers read


def add_lora(model, variant: str, rank: int):
    import peft

    from hf_kbit import lora

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LINEARS),
                             task_type="CAUSAL_LM")
    if variant.startswith("kbit"):
        return lora.get_peft_model(model, config)
    return peft.get_peft_model(model, config)


def measure(variant: str, args, config, device: str) -> dict[str, Any]:
    import torch

    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    model = add_lora(build(config, variant, device), variant, args.rank)
    if not args.no_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=gen).to(device)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    cuda = device.startswith("cuda")
    times, host_times, gpu_times, losses = [], [], [], []
    for step in range(args.warmup + args.steps):
        sync()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            end.record()
        issued = time.perf_counter()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            host_times.append(issued - start)
            if cuda:
                gpu_times.append(begin.elapsed_time(end) / 1000)
        losses.append(loss.item())
    result = {
        "variant": variant,
        "step_s_median": _median(times),
        "step_s_all": times,
        # Host: until the step's Python returns, before the synchronize (launch-bound when it nears the step
        # time). GPU: between events recorded around the step on the stream (the device's busy time and its gaps).
        "host_s_median": _median(host_times),
        "gpu_s_median": _median(gpu_times) if gpu_times else None,
        "loss": losses,
        "trainable_params": sum(p.numel() for p in adapters),
    }
    if device.startswith("cuda"):
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["resident_before_first_step_gib"] = resident / 2**30
    del model, opt, adapters
    return result


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = _models.pick_device(args.device)
    config = make_config(args.preset, args.layers)
    results, skipped = [], {}
    for variant in args.variants:
        if variant == "nf4":
            try:
                import bitsandbytes  # noqa: F401
            except Exception as e:  # ImportError, or a wheel without this GPU's library
                skipped[variant] = f"bitsandbytes does not import: {type(e).__name__}: {e}"
                print(f"nf4: skipped ({skipped[variant]})", flush=True)
                continue
        results.append(measure(variant, args, config, device))
        r = results[-1]
        gpu = f", GPU {r['gpu_s_median'] * 1000:.0f} ms" if r["gpu_s_median"] is not None else ""
        print(f"{variant}: {r['step_s_median'] * 1000:.0f} ms/step (host {r['host_s_median'] * 1000:.0f} ms{gpu}), "
              f"peak {r.get('peak_memory_gib', float('nan')):.2f} GiB", flush=True)
    base = next((r for r in results if r["variant"] == "bf16"), None)
    for r in results:
        if base is not None:
            r["step_time_vs_bf16"] = r["step_s_median"] / base["step_s_median"]
            if "peak_memory_gib" in r:
                r["peak_memory_vs_bf16"] = r["peak_memory_gib"] / base["peak_memory_gib"]
    gpu = _report.environment().get("gpu", "cpu")
    payload = {
        "schema": SCHEMA,
        "preset": args.preset,
        "title": PRESETS[args.preset]["title"],
        "layers": config.num_hidden_layers,
        "settings": {"seq_len": args.seq_len, "batch_size": args.batch_size, "rank": args.rank,
                     "lora_targets": list(LINEARS), "gradient_checkpointing": not args.no_gradient_checkpointing,
                     "steps": args.steps, "warmup": args.warmup, "device": device, "optimizer": "AdamW (adapters)"},
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
    rows = [[r["variant"], r["step_s_median"] * 1000, r.get("step_time_vs_bf16"), r["host_s_median"] * 1000,
             None if r["gpu_s_median"] is None else r["gpu_s_median"] * 1000, r.get("peak_memory_gib"),
             r.get("peak_memory_vs_bf16")] for r in results]
    print(_report.format_table(["variant", "step ms", "x bf16", "host ms", "GPU ms", "peak GiB", "x bf16"], rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
