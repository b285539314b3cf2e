"""Quantize-on-load time of a real-size model, per ``KbitConfig.fitting`` rule.

A random-weight model of ``--preset`` (scripts/bench_generate.py's published configs, nothing
downloaded) is saved once as a bf16 checkpoint; then, per rule, ``from_pretrained(folder,
quantization_config=KbitConfig(bits, fitting=rule), device_map=device)`` is timed on the wall clock
(CUDA synchronized), the bf16 load in the same run for reference. The checkpoint is read once
before the timed loads, so every load reads it from the page cache alike. Results go to ``--out``
as JSON with the exact command.

    python scripts/bench_quantize.py --preset llama3-8b --device cuda --out results/quantize_on_load_llama3-8b_h100.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_generate import build_model, make_config

RULES = ("absmax", "fit")


def _read_all(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            while f.read(1 << 26):
                pass


def _timed_load(folder: Path, device: str, config) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map=device, dtype=torch.bfloat16)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return seconds


def run(preset: str, layers: int | None, bits: int, device: str, workdir: Path) -> dict:
    import torch

    import hf_kbit

    config = make_config(preset, layers)
    model = build_model(config, "cpu", torch.bfloat16)
    folder = workdir / "bf16"
    model.save_pretrained(folder)
    del model
    gc.collect()
    _read_all(folder)
    results = [{"variant": "bf16", "seconds": round(_timed_load(folder, device, None), 2)}]
    for rule in RULES:
        seconds = _timed_load(folder, device, hf_kbit.KbitConfig(bits=bits, fitting=rule))
        results.append({"variant": f"kbit{bits}", "fitting": rule, "seconds": round(seconds, 2)})
        print(f"kbit{bits} fitting={rule}: {seconds:.1f} s", file=sys.stderr)
    return {
        "schema": "hf_kbit.bench_quantize/1",
        "preset": preset,
        "layers": config.num_hidden_layers,
        "bits": bits,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", help="a scripts/bench_generate.py preset (default llama3-8b)")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    parser.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5), help="bits per weight (default 4)")
    parser.add_argument("--device", default="cuda", help="device_map of the loads (default cuda)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (default: print it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        payload = run(args.preset, args.layers, args.bits, args.device, Path(tmp))
    payload["command"] = "python scripts/bench_quantize.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(payload, indent=2) + "\n"
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
