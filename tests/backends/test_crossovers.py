"""hf_kbit/backends/crossovers.json: the planner's only crossover data, complete and well formed, and
scripts/bench_kernels.py's derivation of it from measured paths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hf_kbit.backends import crossovers
from hf_kbit.kernel_table import SUPPORTED_BITS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_kernels  # noqa: E402


def test_file_covers_every_gemm_kernel_and_supported_bits():
    data = crossovers.read()
    assert set(data) == set(crossovers.GEMM_KERNELS)
    for by_bits in data.values():
        assert set(by_bits) == set(SUPPORTED_BITS)
        for gemv_max_m, classes in by_bits.values():
            assert gemv_max_m >= 1 and classes[-1][0] == 0
            assert [w for w, _ in classes] == sorted((w for w, _ in classes), reverse=True)


def test_write_then_read_round_trips(tmp_path):
    path = tmp_path / "crossovers.json"
    data = crossovers.read()
    crossovers.write(data, "about", path)
    assert crossovers.read(path) == data
    changed = {"mma": {b: (8, ((0, 64),)) for b in SUPPORTED_BITS}}
    crossovers.write(changed, "about", path)  # one kernel rewritten, the other kept
    assert crossovers.read(path) == {**data, **changed}
    assert crossovers.read_rotated(path) == crossovers.read_rotated()  # kept too
    rotated = {b: 4 for b in SUPPORTED_BITS}
    crossovers.write({}, "about", path, rotated=rotated)
    assert crossovers.read_rotated(path) == rotated and crossovers.read(path) == {**data, **changed}


def test_rotated_crossover_is_read_and_derived(tmp_path):
    assert set(crossovers.read_rotated()) == set(SUPPORTED_BITS)
    raw = json.loads(crossovers.FILE.read_text())
    raw["rotated_gemv"]["3"]["in_staging_max_m"] = -1
    path = tmp_path / "crossovers.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rotated_gemv.3"):
        crossovers.read_rotated(path)
    # Staging wins at M = 1 and 2 on both shapes, loses at M = 4 on one: the crossover is 2; bits 5 has no rows.
    rows = [{"shape": s, "M": m, "bits": 4, "path": p, "rotated_us": t}
            for s in ("a", "b") for m in (1, 2, 4)
            for p, t in (("gemv-staged", 1.0 if m < 4 or s == "a" else 3.0), ("gemv-standalone", 2.0))]
    assert bench_kernels.derive_rotated_crossover(rows, {4: 0, 5: 7}) == {4: 2, 5: 7}


def test_malformed_file_names_the_entry(tmp_path):
    path = tmp_path / "crossovers.json"
    raw = json.loads(crossovers.FILE.read_text())
    raw["mm"]["wgmma"]["4"]["gemm_max_m_by_weight"] = [[100, 5]]  # no class down to 0
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="mm.wgmma.4"):
        crossovers.read(path)
    del raw["mm"]["mma"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="mma"):
        crossovers.read(path)


def _row(n, k, m, bits, gemv, gemm, dequant):
    row = {"N": n, "K": k, "M": m, "bits": bits, "dequant_us": dequant}
    if gemv is not None:
        row["gemv_us"] = gemv
    if gemm is not None:
        row["gemm_us"] = gemm
    times = {p: row[f"{p}_us"] for p in ("gemv", "gemm", "dequant") if f"{p}_us" in row}
    row["fastest"] = min(times, key=times.get)
    return row


def test_bench_derives_crossovers_from_measured_paths():
    large, tiny = (4096, 14336), (512, 2048)
    rows = []
    for n, k in (large, tiny):
        for m in (1, 16, 32, 64, 256, 1024):
            gemv = 1.0 if m <= 16 else None
            gemm = 2.0
            # The GEMM beats dequantize + cuBLAS up to M = 256 on the large weight, never on the tiny one.
            dequant = 3.0 if (n, k) == large and m <= 256 else 1.5
            rows.append(_row(n, k, m, 4, gemv, gemm, dequant))
    current = {4: (16, ((16 * 2**20, 512), (2 * 2**20, 128), (0, 16))), 5: (16, ((0, 32),))}
    derived = bench_kernels.derive_crossovers(rows, current)
    # No 2-16 Mi weight was measured: that class keeps its value; bits=5 had no rows at all.
    assert derived == {4: (16, ((16 * 2**20, 256), (2 * 2**20, 128), (0, 16))), 5: current[5]}
    # A GEMM that wins at every measured M keeps the larger current value (nothing measured says where it stops).
    wins = [_row(*large, m, 4, 1.0 if m <= 16 else None, 2.0, 3.0) for m in (1, 16, 64, 1024)]
    assert bench_kernels.derive_crossovers(wins, {4: (16, ((0, 2**31),))}) == {4: (16, ((0, 2**31),))}
    assert bench_kernels.derive_crossovers(wins, {4: (16, ((0, 512),))}) == {4: (16, ((0, 1024),))}
