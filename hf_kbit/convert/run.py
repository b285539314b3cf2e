"""``convert()``: a source resolved, planned, written into a hidden temporary folder with its card and config,
and published in place of ``out``."""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._paths import (
    ConversionError,
    OutputTarget,
    check_output,
    extra_files,
    publish,
    refuse_protected,
    scratch_dir,
    source_paths,
    temp_output,
)
from ..config import KbitConfig
from ..nn.replace import check_quantizable
from ..hub import format_bytes
from .check import measure_perplexity
from .plan import ConversionPlan, KeyRule
from .planner import plan_conversion
from .sources import resolve_source
from .writing import _write, _write_calibrated, _write_config, output_config

# Files copied verbatim from the source folder (tokenizer, generation and chat-template files).
COPIED_FILE_PATTERNS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)


_GGUF_SCRATCH = ".gguf-source"  # inside the hidden output folder: the dequantized GGUF model, removed before the rename


class OutputWriteError(OSError):
    """Writing the output failed (e.g. the disk is full); the partial output was removed."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


@dataclass
class ConversionResult:
    out: Path
    plan: ConversionPlan
    stats: dict[str, Any]  # measured on the written files
    eval: dict[str, Any] | None = None
    repo_url: str | None = None


def convert(
    model: str | os.PathLike,
    out: str | os.PathLike,
    quantization_config: KbitConfig | None = None,
    *,
    revision: str | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    dry_run: bool = False,
    eval: bool = False,
    eval_text: str | None = None,
    eval_max_tokens: int = 512,
    base_model: str | None = None,
    repo_id: str | None = None,
    command: str | None = None,
    key_rules: Sequence[KeyRule] = (),
    progress: bool = True,
) -> ConversionResult | ConversionPlan:
    """Convert ``model`` (a folder, a ``.gguf`` file or a Hub repo id) into a kbit checkpoint at ``out``.

    Args:
        quantization_config: the :class:`KbitConfig` (default: 4 bits). With ``calibration_data`` the model is
            not streamed: it is loaded whole, unquantized, onto ``device`` and calibrated as quantize-on-load does.
        revision: branch, tag or commit of a Hub repo.
        dtype: dtype of unquantized tensors and of weights before quantization;
            ``None``/``"auto"`` does what ``from_pretrained`` does (config.json's dtype).
        device: where to quantize (default: ``"cuda"`` when available, else ``"cpu"``).
        max_shard_size: output shard size limit (bytes or a string like ``"5GB"``).
        overwrite: replace a non-empty ``out`` (only once the new output is complete).
        dry_run: plan only; returns the :class:`ConversionPlan` and writes nothing.
        eval: measure perplexity of the source and the converted model on ``eval_text``
            (default: a short built-in passage) and record it in the model card.
        base_model: Hub repo id recorded as the card's ``base_model`` (default: the input
            when it is a repo id).
        repo_id: the Hub repo the output will be pushed to (for the card's usage snippet).
        command: the command line recorded in the card (the CLI passes its own).
        key_rules: extra planning rules claiming checkpoint keys (see :data:`KeyRule`).
    """
    from .. import hub

    kbit_config = quantization_config or KbitConfig()
    if not isinstance(kbit_config, KbitConfig):
        raise TypeError(f"quantization_config must be a KbitConfig, got {type(kbit_config).__name__}")
    check_quantizable(kbit_config)
    out = Path(out).expanduser()
    shard_bytes = parse_size(max_shard_size)
    device = _resolve_device(device)
    if eval_text is not None and not eval_text.strip():
        raise ConversionError("eval_text is empty")
    if dry_run:
        scratch = scratch_dir()  # a GGUF input is dequantized here; a dry run writes nothing beside out
        try:
            source, _ = resolve_source(model, scratch, revision)
            return plan_conversion(source, kbit_config, dtype, key_rules)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    target = check_output(out, overwrite, source_paths(model))
    tmp = temp_output(target)
    plan = None
    try:
        source, source_info = resolve_source(model, tmp / _GGUF_SCRATCH, revision)
        refuse_protected(out, target.path, [source])  # a Hub snapshot's place is known only now
        if source_info["kind"] == "hub" and base_model is None:
            base_model = source_info["name"]
        plan = plan_conversion(source, kbit_config, dtype, key_rules)
        extras = extra_files(source, COPIED_FILE_PATTERNS)  # checked before the long part
        write = _write_calibrated if kbit_config.calibrates else _write
        stats = write(plan, tmp, device, shard_bytes, progress)
        for f in extras:
            shutil.copy2(f, tmp / f.name)
        eval_result = None
        if eval:
            eval_result = measure_perplexity(
                source, tmp, output_config(source, plan, stats["format_version"]), plan.dtype, eval_text,
                eval_max_tokens, device
            )
        card = hub.render_card(
            plan=plan,
            stats=stats,
            source_info=source_info,
            base_model=base_model,
            command=command or _python_call(model, out, kbit_config),
            eval=eval_result,
            repo_id=repo_id,
        )
        card.save(tmp / "README.md")
        config = output_config(source, plan, stats["format_version"])
        shutil.rmtree(tmp / _GGUF_SCRATCH, ignore_errors=True)
        _write_config(tmp, config)  # last: its presence marks a complete checkpoint
        publish(tmp, target)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(e, target, plan) from None
        raise
    return ConversionResult(out=out, plan=plan, stats=stats, eval=eval_result)


def _disk_full(e: OSError, target: OutputTarget, plan: ConversionPlan | None) -> OutputWriteError:
    what = "no space left" if e.errno == errno.ENOSPC else "disk quota exceeded"
    need = f"; the output needs about {format_bytes(plan.stats()['size_after_bytes'])}" if plan is not None else ""
    try:
        free = f", {format_bytes(shutil.disk_usage(target.path.parent).free)} is free there"
    except OSError:
        free = ""
    return OutputWriteError(
        e.errno,
        f"{what} on the device of {target.path.parent} while writing out={target.path}{need}{free}; the partial "
        "output was removed. Free some space or pass another --out",
    )


def parse_size(size: int | str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or an int number of bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
        if not m:
            raise ConversionError(f"max_shard_size must be bytes or like '5GB'/'500MB', got {size!r}")
        unit = (m.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        value = int(float(m.group(1)) * base ** "BKMGT".index(unit[0]))
    if value <= 0:
        raise ConversionError(f"max_shard_size must be positive, got {size!r}")
    return value


def _resolve_device(device) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConversionError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConversionError(f"device={device} requested but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConversionError(f"device must be cpu or cuda, got {device}")
    return device


def _python_call(model, out, cfg: KbitConfig) -> str:
    return f"hf_kbit.convert({str(model)!r}, {str(out)!r}, KbitConfig(bits={cfg.bits}))"


def command_line(argv: Sequence[str]) -> str:
    """The command as typed, for the card (argv[0] shortened to the program name)."""
    return shlex.join(["kbit-convert", *argv])
