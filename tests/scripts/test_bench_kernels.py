"""bench_kernels.py's CPU-side pieces: the --gemm-kernels table (one column per kernel, its ratio to cuBLAS bf16
from the same row), the --offsets table and the refusal of unknown kernel names. The timing itself needs a GPU
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


def test_offsets_table_keeps_the_prologue_rows_out_of_the_cost_by_m():
    """--offsets: the plain GEMV's and the prologue GEMV's rows at the same (shape, k, M) each keep their cost; the
    cost-by-M summary takes the plain ones, the prologue rows get a table of their own."""
    base = {"shape": "s 4096x4096", "K": 4096, "N": 4096, "M": 1, "bits": 4, "bf16_us": 10.0, "bytes_pct": 5.9}
    rows = [{**base, "path": "gemv", "us": 4.0, "records_us": 4.1, "cost_pct": 2.5},
            {**base, "path": "gemv+add_rmsnorm", "us": 5.0, "records_us": 5.2, "cost_pct": 4.0}]
    meta = {"device": "GPU", "command": "python scripts/bench_kernels.py --offsets", "torch": "x"}
    lines = bench_kernels.markdown_offsets(rows, meta).splitlines()
    assert "| s 4096x4096 | 4 | 1 | gemv+add_rmsnorm | 10.0 | 5.0 | 5.2 | +4.0% | +5.9% |" in lines
    summary = lines.index("Cost by M (records / codes - 1):")
    assert lines[summary + 2] == "| shape (K x N) | k | M=1 |"
    assert lines[summary + 4] == "| s 4096x4096 | 4 | +2.5% |"
    fused = lines.index("With a prologue (records / codes - 1):")
    assert lines[fused + 4] == "| s 4096x4096 | 4 | 1 | gemv+add_rmsnorm | +4.0% |"


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
