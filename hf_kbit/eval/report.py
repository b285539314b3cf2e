"""What an evaluation writes: the environment and command of a run, JSON files, markdown tables, and the
parsing of ``--bits``-style lists."""

from __future__ import annotations

import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    """Versions of Python, torch, transformers and hf_kbit, torch's CPU threads and the GPU (where one is seen)."""
    import torch
    import transformers

    import hf_kbit

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_kbit": hf_kbit.__version__,
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def command_line() -> str:
    """The command that produced a result, as a user would type it from the repository root: the running script
    named by its folder and file (``scripts/eval_perplexity.py``), then its arguments."""
    script = Path(sys.argv[0]).resolve()
    return shlex.join(["python", script.relative_to(script.parent.parent).as_posix(), *sys.argv[1:]])


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table (also readable as plain text)."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_bits(text: str, flag: str = "--bits") -> list[int]:
    """``--bits 2,3,4,5`` -> [2, 3, 4, 5], validated against the supported set (errors name ``flag``)."""
    from hf_kbit import SUPPORTED_BITS

    try:
        bits = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    bad = [b for b in bits if b not in SUPPORTED_BITS]
    if bad:
        raise ValueError(f"{flag}: {bad} not in the supported {SUPPORTED_BITS}")
    return bits
