"""bench_kernels.py's CPU-side pieces: the --gemm-kernels table (one column per kernel, its ratio to cuBLAS bf16
from the same row) and the refusal of unknown kernel names. The timing itself needs a GPU
(tests/gpu, and the committed results under benchmarks/results)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import bench_kernels
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


def test_gemm_kernels_table_has_a_column_per_kernel_with_its_ratio():
    rows = [{"shape": "s 4096x14336", "K": 4096, "N": 14336, "M": 64, "bits": 4, "bf16_us": 33.6,
             "wgmma_us": 30.4, "wgmma_ws_us": 29.5},
            {"shape": "s 4096x14336", "K": 4096, "N": 14336, "M": 256, "bits": 4, "bf16_us": 44.2,
             "wgmma_us": 64.4, "wgmma_ws_us": 59.0}]
    meta = {"device": "GPU", "command": "python scripts/bench_kernels.py --gemm-kernels wgmma,wgmma_ws", "torch": "x"}
    md = bench_kernels.markdown_gemm_kernels(rows, ["wgmma", "wgmma_ws"], meta)
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| shape"))
    assert header == "| shape (K x N) | k | M | bf16 us | wgmma us (x) | wgmma_ws us (x) |"
    assert "| s 4096x14336 | 4 | 64 | 33.6 | 30.4 (1.11x) | 29.5 (1.14x) |" in lines
    assert "| s 4096x14336 | 4 | 256 | 44.2 | 64.4 (0.69x) | 59.0 (0.75x) |" in lines
    assert meta["command"] in md


def test_unknown_gemm_kernel_is_named():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gemm-kernels", "wgmma,cutlass"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "--gemm-kernels: each must be one of" in proc.stderr and "'wgmma,cutlass'" in proc.stderr


@pytest.mark.parametrize("kernels", ["wgmma", "mma,wgmma_ws"])
def test_known_gemm_kernels_pass_the_argument_check(kernels):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gemm-kernels", kernels], capture_output=True, text=True,
                          timeout=120)
    assert "--gemm-kernels: each must be one of" not in proc.stderr
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr  # this machine: no GPU, refused after parsing
