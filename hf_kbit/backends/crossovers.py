"""The measured path crossovers of ``kbit::mm`` (``crossovers.json``), as data.

``scripts/bench_kernels.py --paths`` measures every path (GEMV, GEMM, dequantize + cuBLAS) per
shape, M and k and writes the file (``--write-crossovers``); the CUDA backend hands it to the
library's planner (``kbit_mm_plan``) at load. ``rotated_gemv`` holds, per bits, the largest M at
which a rotated layer's GEMV stages ``x R`` itself rather than running the standalone rotation
first (``kbit_set_gemv_rotate_crossover``; ``bench_kernels.py --rotation --write-crossovers``). No
crossover is typed anywhere else.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..kernel_table import SUPPORTED_BITS

FILE = Path(__file__).with_name("crossovers.json")
ABOUT = ("Path crossovers of kbit::mm, read by the library's planner (kbit_mm_plan): per GEMM kernel and bits, the "
         "GEMV serves M <= gemv_max_m, the GEMM M <= the m of the first [min_weight, m] pair whose min_weight <= N * K, "
         "dequantize + cuBLAS the rest. Measured on an H100, cold L2; the mma.sync entries with "
         "HF_KBIT_GEMM_KERNEL=mma on the same GPU; the wgmma_ws entries (HF_KBIT_GEMM_KERNEL=wgmma_ws) are not "
         "measured yet and send every M above the GEMV to the GEMM. Rewrite with "
         "`python scripts/bench_kernels.py --paths --write-crossovers`. rotated_gemv: per bits, a rotated layer's "
         "GEMV stages x R up to M <= in_staging_max_m and runs the standalone rotation first above it "
         "(`python scripts/bench_kernels.py --rotation --write-crossovers`).")
# The planner's GEMM kernel codes: 0 mma.sync (any sm_80+), 1 wgmma (sm_90a, the default there), 2 the
# warp-specialized wgmma GEMM (sm_90a, HF_KBIT_GEMM_KERNEL=wgmma_ws).
GEMM_KERNELS = ("mma", "wgmma", "wgmma_ws")


def read(path: Path = FILE) -> dict[str, dict[int, tuple[int, tuple[tuple[int, int], ...]]]]:
    """``{gemm kernel: {bits: (gemv_max_m, ((min_weight, gemm_max_m), ...) by descending min_weight)}}``;
    raises ValueError naming what is missing or malformed."""
    data = json.loads(Path(path).read_text())
    out = {}
    for kernel in GEMM_KERNELS:
        by_bits = data.get("mm", {}).get(kernel)
        if by_bits is None:
            raise ValueError(f"{path}: no crossovers for the {kernel} GEMM (mm.{kernel})")
        out[kernel] = {}
        for bits in SUPPORTED_BITS:
            entry = by_bits.get(str(bits))
            if entry is None:
                raise ValueError(f"{path}: no crossovers for mm.{kernel} at bits={bits}")
            classes = tuple(sorted(((int(w), int(m)) for w, m in entry["gemm_max_m_by_weight"]), reverse=True))
            if not classes or classes[-1][0] != 0 or len({w for w, _ in classes}) != len(classes):
                raise ValueError(f"{path}: mm.{kernel}.{bits}.gemm_max_m_by_weight needs distinct min_weight "
                                 f"values down to 0, got {entry['gemm_max_m_by_weight']}")
            out[kernel][bits] = (int(entry["gemv_max_m"]), classes)
    return out


def read_rotated(path: Path = FILE) -> dict[int, int]:
    """``{bits: in_staging_max_m}`` of the rotated GEMV (``rotated_gemv``); raises ValueError naming what
    is missing or malformed."""
    section = json.loads(Path(path).read_text()).get("rotated_gemv")
    if section is None:
        raise ValueError(f"{path}: no rotated GEMV crossovers (rotated_gemv)")
    out = {}
    for bits in SUPPORTED_BITS:
        value = section.get(str(bits), {}).get("in_staging_max_m")
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: rotated_gemv.{bits}.in_staging_max_m must be an integer >= 0, got {value!r}")
        out[bits] = value
    return out


def write(crossovers: dict, about: str, path: Path = FILE, rotated: dict[int, int] | None = None) -> None:
    """Write ``crossovers`` (as :func:`read` returns, for one or both GEMM kernels: the others keep the
    file's values) and ``rotated`` (as :func:`read_rotated` returns; None keeps the file's, or the shipped
    file's for a new one) to ``path``."""
    exists = Path(path).is_file()
    merged = read(path) if exists else {}
    merged.update(crossovers)
    if rotated is None:
        rotated = read_rotated(path if exists else FILE)
    mm = {kernel: {str(bits): {"gemv_max_m": gemv, "gemm_max_m_by_weight": [list(c) for c in classes]}
                   for bits, (gemv, classes) in sorted(by_bits.items())}
          for kernel, by_bits in merged.items()}
    # One line per (kernel, bits): the file reads as a table.
    kernels = ",\n".join(
        f'  "{kernel}": {{\n' + ",\n".join(f'   "{bits}": {json.dumps(entry)}' for bits, entry in by_bits.items())
        + "\n  }" for kernel, by_bits in mm.items())
    rot = ",\n".join(f'  "{bits}": {json.dumps({"in_staging_max_m": m})}' for bits, m in sorted(rotated.items()))
    Path(path).write_text(f'{{\n "about": {json.dumps(about)},\n "mm": {{\n{kernels}\n }},\n'
                          f' "rotated_gemv": {{\n{rot}\n }}\n}}\n')
