"""Side-by-side generations and generation speed of a model in bf16 and kbit.

For each prompt (a built-in set, or ``--prompts FILE`` with one prompt per line) the script
writes the greedy and the sampled continuation of every variant, then times prefill and
decode tokens/s at ``--batch-sizes`` (default 1 and 8) on random prompts of ``--prompt-len``
tokens. On CUDA the timing uses a static KV cache, so transformers compiles the decode step
(torch.compile); on CPU it is plain eager, and the kbit variants run as dequantized nn.Linear
(the same weights; the pure-PyTorch kbit forward is a reference, not a speed path), so CPU
speeds only show that the pipeline works. Each variant attends as it loads when no attention is named
(bf16: transformers' sdpa; kbit: hf_kbit's kbit_decode, ``KbitConfig.decode_attention``); ``--attention
kbit_decode`` or ``sdpa`` builds every variant, bf16 too, with that attention.

Beside generate()'s decode tokens/s each batch size also gets the decode loop's (``hf_kbit.eval.timing.
measure_decode_loop``, as in ``bench_generate.py``): the host drives greedy steps one token at a time
through the decode step compiled as generate() compiles it (CUDA), feeds the argmax back on the device
and syncs once after the last step, where generate() syncs every token. It is the reading a serving
loop that does not wait for each token sees. ``--decode-loop auto`` (the default) times it on CUDA
only: on the CPU its eager steps over a static cache add minutes and no kernel speed.

    python scripts/eval_generation.py --model smollm2-135m --bits 4
    python scripts/eval_generation.py --model qwen2.5-coder-0.5b --bits 2,3,4,5 --device cuda

Outputs: a table on stdout, ``results/generation_<model>.json`` and the markdown block
(``.md`` beside the JSON) ready for a model card.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from hf_kbit.eval.models import (ATTENTIONS, add_device_arguments, dtype_name, load_bits_variant, pick_device,
                                 pick_dtype, resolve_model)
from hf_kbit.eval.report import command_line, environment, format_table, parse_bits, write_json
from hf_kbit.eval.timing import measure_decode_loop, measure_speed

SCHEMA = "hf_kbit.eval_generation/1"

DEFAULT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "The three most important things to check before a long hike are",
    "Translate to French: The library opens at nine in the morning.",
    "It is a truth universally acknowledged, that",
    "List four prime numbers greater than 50.",
)

SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 50}


def load_prompts(path: str | None) -> list[str]:
    """The built-in prompts, or one prompt per non-empty line of ``path`` (``#`` starts a comment line)."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts found (one per line expected)")
    return prompts


def encode_prompt(tokenizer, prompt: str, chat: bool):
    """Token ids ``[1, T]``: through the tokenizer's chat template when ``chat``, else the raw text."""
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    return ids


def generate_texts(model, tokenizer, prompts: list[str], max_new_tokens: int, chat: bool, seed: int) -> list[dict]:
    """Greedy and sampled continuation (seeded per prompt, same seed in every variant) of each prompt."""
    import torch

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt, chat).to(device)
        texts = {}
        for mode in ("greedy", "sampled"):
            kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "pad_token_id": pad, "disable_compile": True}
            kwargs.update({"do_sample": True, **SAMPLING} if mode == "sampled" else {"do_sample": False})
            torch.manual_seed(seed + i)
            with torch.inference_mode():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            texts[mode] = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True).strip()
            texts[f"{mode}_tokens"] = int(gen.shape[1] - ids.shape[1])
        out.append({"prompt": prompt, **texts})
    return out


def run(
    folder: Path,
    model_info: dict[str, Any],
    prompts: list[str],
    bits_list: list[int],
    device: str,
    dtype,
    max_new_tokens: int = 48,
    chat: str = "auto",
    seed: int = 0,
    batch_sizes: tuple[int, ...] = (1, 8),
    prompt_len: int = 128,
    speed_new_tokens: int = 64,
    repeats: int = 3,
    include_bf16: bool = True,
    attention: str = "default",
    decode_loop: bool | None = None,
    log=print,
) -> dict[str, Any]:
    """Generations and speed of every variant, each built with transformers attention ``attention`` (``"default"``:
    none named, each variant's own), with the decode loop's tokens/s beside generate()'s where ``decode_loop`` says
    (None: on CUDA); returns the JSON payload."""
    from transformers import AutoTokenizer

    if decode_loop is None:
        decode_loop = device.startswith("cuda")
    if decode_loop and speed_new_tokens < 2:
        raise ValueError(f"--speed-new-tokens must be >= 2 to time the decode loop (or pass --decode-loop off), "
                         f"got {speed_new_tokens}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    use_chat = tokenizer.chat_template is not None if chat == "auto" else chat == "on"
    static_compile = device.startswith("cuda")
    variants = []
    for bits in ([None] if include_bf16 else []) + list(bits_list):
        model, info = load_bits_variant(folder, bits, device, dtype, attention=attention)
        info["attention"] = model.config._attn_implementation
        start = time.perf_counter()
        generations = generate_texts(model, tokenizer, prompts, max_new_tokens, use_chat, seed)
        info["generation_seconds"] = round(time.perf_counter() - start, 2)
        speed = []
        for batch in batch_sizes:
            s = measure_speed(model, batch, prompt_len, speed_new_tokens, device, static_compile, repeats)
            line = (f"{info['variant']:>6} batch {batch}: prefill {s['prefill_tok_s']:.1f} tok/s, "
                    f"decode {s['decode_tok_s']:.1f} tok/s")
            if decode_loop:
                s.update(measure_decode_loop(model, batch, prompt_len, speed_new_tokens, device, repeats))
                line += (f", decode loop {s['loop_decode_tok_s']:.1f} tok/s (tokens at the eager argmax "
                         f"{s['loop_tokens_argmax_match']:.0%})")
            speed.append(s)
            log(line)
        variants.append({**info, "generations": generations, "speed": speed})
        del model
    if static_compile:
        add_speedups(variants)
    else:  # on CPU kbit runs as dequantized nn.Linear: a "speedup" would be noise between equal models
        for v in variants:
            for s in v["speed"]:
                s["decode_speedup_vs_bf16"] = s["prefill_speedup_vs_bf16"] = None
                if decode_loop:
                    s["loop_decode_speedup_vs_bf16"] = None
    payload = {
        "schema": SCHEMA,
        "model": model_info,
        "device": device,
        "compute_dtype": dtype_name(dtype),
        # transformers attention implementation of every variant ("default": each its own; each variant records it)
        "attention": attention,
        "chat_template": use_chat,
        "max_new_tokens": max_new_tokens,
        "sampling": {"seed": seed, **SAMPLING},
        "speed_setup": {
            "prompt_len": prompt_len,
            "new_tokens": speed_new_tokens,
            "batch_sizes": list(batch_sizes),
            "repeats": repeats,
            "static_cache_and_compile": static_compile,
            "decode_loop": decode_loop,
        },
        "prompts": prompts,
        "variants": variants,
    }
    payload["markdown"] = render_markdown(payload)
    return payload


def add_speedups(variants: list[dict[str, Any]]) -> None:
    base = next((v for v in variants if v["bits"] is None), None)
    for v in variants:
        for s in v["speed"]:
            ref = next((b for b in base["speed"] if b["batch"] == s["batch"]), None) if base else None
            s["decode_speedup_vs_bf16"] = s["decode_tok_s"] / ref["decode_tok_s"] if ref else None
            s["prefill_speedup_vs_bf16"] = s["prefill_tok_s"] / ref["prefill_tok_s"] if ref else None
            if "loop_decode_tok_s" in s:
                s["loop_decode_speedup_vs_bf16"] = s["loop_decode_tok_s"] / ref["loop_decode_tok_s"] if ref else None


def speed_table(payload: dict[str, Any]) -> str:
    loop = payload["speed_setup"].get("decode_loop", False)
    rows = [
        [v["variant"], v["bits_per_weight"], s["batch"], s["prefill_tok_s"], s["decode_tok_s"], s.get("decode_speedup_vs_bf16")]
        + ([s["loop_decode_tok_s"], s.get("loop_decode_speedup_vs_bf16")] if loop else [])
        for v in payload["variants"]
        for s in v["speed"]
    ]
    headers = ["variant", "bits/weight", "batch", "prefill tok/s", "decode tok/s", "decode x bf16"]
    headers += ["loop tok/s", "loop x bf16"] if loop else []
    return format_table(headers, rows)


def render_markdown(payload: dict[str, Any]) -> str:
    """A model-card block: generations side by side, then the speed table with its setup."""
    names = [v["variant"] for v in payload["variants"]]
    model = payload["model"]["name"]
    parts = [f"### Generations: {model}, " + " vs ".join(names), ""]
    for mode in ("greedy", "sampled"):
        setup = "greedy" if mode == "greedy" else "sampled (temperature {temperature}, top-p {top_p}, top-k {top_k}, seed {seed})".format(
            **payload["sampling"]
        )
        parts += [f"**{setup}**, up to {payload['max_new_tokens']} new tokens", ""]
        rows = [[p] + [v["generations"][i][mode] for v in payload["variants"]] for i, p in enumerate(payload["prompts"])]
        parts += [format_table(["prompt", *names], rows), ""]
    sp = payload["speed_setup"]
    how = "static KV cache + torch.compile" if sp["static_cache_and_compile"] else "eager, dynamic cache"
    attention = payload.get("attention", "sdpa")  # runs before "default" named sdpa for every variant
    if attention == "default":
        how += ", " + ", ".join(f"{v['variant']} {v.get('attention')}" for v in payload["variants"])
    elif attention != "sdpa":
        how += f", attn_implementation={attention!r} in every variant"
    parts += [
        f"### Generation speed ({payload['device']}, {payload['compute_dtype']}, {how})",
        "",
        f"Random prompts of {sp['prompt_len']} tokens, {sp['new_tokens']} new tokens, median of {sp['repeats']} runs.",
        "",
        speed_table(payload),
    ]
    if sp.get("decode_loop"):
        how_loop = ("the decode step compiled as generate() compiles it" if sp["static_cache_and_compile"]
                    else "eager decode steps")
        parts += ["", "Decode tok/s: `generate()`, which waits for the device after every token. Loop: "
                      f"{sp['new_tokens'] - 1} greedy steps that the host drives one token at a time ({how_loop}, the "
                      "argmax fed back on the device), waiting once after the last; it shows what the model decodes "
                      "at when the host keeps ahead of the device."]
    if not payload["device"].startswith("cuda"):
        parts += ["", "CPU: kbit runs as dequantized nn.Linear here, so these speeds are not kbit kernel speeds."]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="offline model key, .gguf file or transformers folder")
    parser.add_argument("--prompts", default=None, help="file with one prompt per line (default: built-in set)")
    parser.add_argument("--bits", default="4", help="comma-separated kbit widths (default 4)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 baseline")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    parser.add_argument("--chat", choices=("auto", "on", "off"), default="auto", help="use the chat template (auto: if any)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    parser.add_argument("--batch-sizes", default="1,8", help="batch sizes for the speed table (default 1,8)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens in the speed runs (default 128)")
    parser.add_argument("--speed-new-tokens", type=int, default=64, help="new tokens per speed run (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, median reported")
    parser.add_argument("--attention", default="default", choices=ATTENTIONS,
                        help="'default': each variant's own (bf16: transformers' sdpa; kbit: hf_kbit's kbit_decode, "
                             "KbitConfig.decode_attention); 'sdpa' or 'kbit_decode': that attention in every variant")
    parser.add_argument("--decode-loop", choices=("auto", "on", "off"), default="auto",
                        help="time the decode loop (greedy steps driven by the host, one sync at the end) beside "
                             "generate(); auto: on CUDA only")
    add_device_arguments(parser)
    parser.add_argument("--out", default=None, help="JSON path (default: results/generation_<model>.json)")
    args = parser.parse_args(argv)

    bits_list = parse_bits(args.bits)
    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    prompts = load_prompts(args.prompts)
    folder, model_info = resolve_model(args.model)
    payload = run(
        folder, model_info, prompts, bits_list, device, dtype, args.max_new_tokens, args.chat, args.seed,
        batch_sizes, args.prompt_len, args.speed_new_tokens, args.repeats, include_bf16=not args.no_bf16,
        attention=args.attention, decode_loop=None if args.decode_loop == "auto" else args.decode_loop == "on",
    )
    payload["command"] = command_line()
    payload["environment"] = environment()
    out = Path(args.out or f"results/generation_{model_info['slug']}.json")
    write_json(out, payload)
    out.with_suffix(".md").write_text(payload["markdown"], encoding="utf-8")
    print()
    print(speed_table(payload))
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
