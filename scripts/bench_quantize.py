"""Quantize-on-load time of a real-size model, per ``KbitConfig.fitting`` rule, and with calibration.

A random-weight model of ``--preset`` (hf_kbit.eval.presets' published configs, nothing
downloaded) is saved once as a bf16 checkpoint; then, per rule, ``from_pretrained(folder,
quantization_config=KbitConfig(bits, fitting=rule), device_map=device)`` is timed on the wall clock
(CUDA synchronized), the bf16 load in the same run for reference. The checkpoint is read once
before the timed loads, so every load reads it from the page cache alike. ``--calibration SxL`` adds a
load with ``KbitConfig(bits, calibration_data=..., calibration_samples=S, calibration_seq_len=L)``
(the default fitting): the model has no tokenizer, so the calibration text is S x L tokens drawn at
random from the vocabulary (seeded), which costs what real text of that length costs. ``--rotation on,auto``
adds a load per value with ``KbitConfig(bits, rotation=...)`` (format v3; "auto" quantizes every group both
ways), counting the weights it stored rotated; ``--without-offsets`` a load with ``KbitConfig(bits, block_offsets=False)``
(format v1's uint8 scales; the default rule gives blocks offsets, format v4). Each entry records the block offsets
its load gave (``block_offsets``) and the peak GPU memory on CUDA. Results go to
``--out`` as JSON with the exact command. ``--rules`` picks the fitting rules timed (default all; ``--rules fit``
times the default rule only). With ``--device cuda`` the random model is built on
the GPU; each setup stage and each load is reported on stderr as it ends.

    python scripts/bench_quantize.py --preset llama3-8b --device cuda --out results/quantize_on_load_llama3-8b_h100.json
    python scripts/bench_quantize.py --preset llama3-8b --device cuda --bits 3 --calibration 128x2048 \
        --out results/calibrate_llama3-8b_h100.json
    python scripts/bench_quantize.py --preset llama3-8b --device cuda --rotation on,auto
    python scripts/bench_quantize.py --preset llama3-8b --device cuda --rules fit --without-offsets
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

from hf_kbit.eval.presets import build_model, make_config

RULES = ("absmax", "fit")
ROTATIONS = {"on": True, "auto": "auto"}  # --rotation's values: KbitConfig.rotation


def _read_all(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            while f.read(1 << 26):
                pass


class RandomTokens:
    """A stand-in tokenizer for a model without one: one token per character, drawn at random (seeded) from
    ``vocab_size`` ids, so the calibration tokens cover the vocabulary as real text does."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size, self.seed = vocab_size, seed

    def __call__(self, text: str, **kwargs) -> dict[str, list[int]]:
        import torch

        generator = torch.Generator().manual_seed(self.seed)
        return {"input_ids": torch.randint(self.vocab_size, (len(text),), generator=generator).tolist()}


def parse_calibration(value: str) -> tuple[int, int]:
    """``"128x2048"`` -> (samples, seq_len)."""
    samples, sep, seq_len = value.lower().partition("x")
    if not sep or not samples.isdigit() or not seq_len.isdigit() or int(samples) < 1 or int(seq_len) < 1:
        raise argparse.ArgumentTypeError(f"expected SAMPLESxSEQ_LEN such as 128x2048, got {value!r}")
    return int(samples), int(seq_len)


def _parse_names(value: str, allowed, allow_none: bool) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if (not names and not allow_none) or any(n not in allowed for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {sorted(allowed)}"
                                         f"{' (or none)' if allow_none else ''}, got {value!r}")
    return names


def parse_rules(value: str) -> list[str]:
    """``"absmax,fit"`` -> ["absmax", "fit"]; ``""`` -> [] (time no fitting rule, only the other loads asked for)."""
    return _parse_names(value, RULES, allow_none=True)


def parse_rotations(value: str) -> list[str]:
    """``"on,auto"`` -> ["on", "auto"]."""
    return _parse_names(value, ROTATIONS, allow_none=False)


def _timed_load(folder: Path, device: str, config) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map=device, dtype=torch.bfloat16)
    if cuda:
        torch.cuda.synchronize()
    result = {"seconds": round(time.perf_counter() - start, 2)}
    if cuda:
        result["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    if config is not None:  # as the load settled it (KbitConfig.block_offsets=None: the default rule)
        result["block_offsets"] = model.config.quantization_config.block_offsets
    if config is not None and config.rotation is not False:
        from hf_kbit.nn.linear import KbitModule

        result["rotated_modules"] = sum(m.stores_rotated() for m in model.modules() if isinstance(m, KbitModule))
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _report(what: str, seconds: float) -> None:
    print(f"{what}: {seconds:.1f} s", file=sys.stderr, flush=True)


def run(preset: str, layers: int | None, bits: int, device: str, workdir: Path,
        calibration: tuple[int, int] | None = None, rotations: list[str] = (), without_offsets: bool = False,
        rules: list[str] = RULES) -> dict:
    import torch

    import hf_kbit

    cuda = device.startswith("cuda")
    config = make_config(preset, layers)
    start = time.perf_counter()
    model = build_model(config, device if cuda else "cpu", torch.bfloat16)
    _report(f"built the random {preset} model ({config.num_hidden_layers} layers)", time.perf_counter() - start)
    folder = workdir / "bf16"
    start = time.perf_counter()
    model.save_pretrained(folder)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    _read_all(folder)
    _report("saved it as a bf16 checkpoint and read that once", time.perf_counter() - start)
    results = [{"variant": "bf16", **_timed_load(folder, device, None)}]
    _report("bf16", results[0]["seconds"])
    for rule in rules:
        timed = _timed_load(folder, device, hf_kbit.KbitConfig(bits=bits, fitting=rule))
        results.append({"variant": f"kbit{bits}", "fitting": rule, **timed})
        _report(f"kbit{bits} fitting={rule}", timed["seconds"])
    for name in rotations:
        timed = _timed_load(folder, device, hf_kbit.KbitConfig(bits=bits, rotation=ROTATIONS[name]))
        results.append({"variant": f"kbit{bits}", "rotation": ROTATIONS[name], **timed})
        _report(f"kbit{bits} rotation={name}", timed["seconds"])
    if without_offsets:
        timed = _timed_load(folder, device, hf_kbit.KbitConfig(bits=bits, block_offsets=False))
        results.append({"variant": f"kbit{bits}", **timed})
        _report(f"kbit{bits} block_offsets=False", timed["seconds"])
    if calibration is not None:
        samples, seq_len = calibration
        cal = hf_kbit.KbitConfig(bits=bits, calibration_data="x" * (samples * seq_len), calibration_samples=samples,
                                 calibration_seq_len=seq_len, calibration_tokenizer=RandomTokens(config.vocab_size))
        timed = _timed_load(folder, device, cal)
        results.append({"variant": f"kbit{bits}", "calibration": cal.calibration_record(), **timed})
        _report(f"kbit{bits} calibrated on {samples}x{seq_len} tokens", timed["seconds"])
    return {
        "schema": "hf_kbit.bench_quantize/1",
        "preset": preset,
        "layers": config.num_hidden_layers,
        "bits": bits,
        "device": torch.cuda.get_device_name() if cuda else device,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", help="an hf_kbit.eval.presets preset (default llama3-8b)")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    parser.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5), help="bits per weight (default 4)")
    parser.add_argument("--device", default="cuda", help="device_map of the loads (default cuda)")
    parser.add_argument("--rules", type=parse_rules, default=list(RULES), metavar="absmax,fit",
                        help=f"the fitting rules to time, comma-separated (default {','.join(RULES)}; '' for none)")
    parser.add_argument("--calibration", type=parse_calibration, default=None, metavar="SAMPLESxSEQ_LEN",
                        help="also time a load calibrated on this many random tokens, e.g. 128x2048 (default: none)")
    parser.add_argument("--rotation", type=parse_rotations, default=[], metavar="on,auto",
                        help="also time loads with KbitConfig(rotation=...) for each value (default: none)")
    parser.add_argument("--without-offsets", action="store_true",
                        help="also time a load with KbitConfig(block_offsets=False) (format v1; default: none)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (default: print it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        payload = run(args.preset, args.layers, args.bits, args.device, Path(tmp), args.calibration, args.rotation,
                      args.without_offsets, args.rules)
    payload["command"] = "python scripts/bench_quantize.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(payload, indent=2) + "\n"
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
