"""scripts/bench_quantize.py on CPU with the tiny preset: it times every rule, the bf16 load and a calibrated load."""

import argparse
import json

import pytest

import bench_quantize


def test_times_bf16_and_every_fitting_rule(tmp_path):
    out = tmp_path / "q.json"
    assert bench_quantize.main(["--preset", "tiny-llama", "--device", "cpu", "--bits", "3", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [r.get("fitting") for r in payload["results"]] == [None, *bench_quantize.RULES]
    assert all(r["seconds"] > 0 for r in payload["results"])
    assert payload["command"].startswith("python scripts/bench_quantize.py --preset tiny-llama")


def test_times_a_calibrated_load(tmp_path):
    out = tmp_path / "q.json"
    argv = ["--preset", "tiny-llama", "--device", "cpu", "--bits", "3", "--calibration", "2x32", "--out", str(out)]
    assert bench_quantize.main(argv) == 0
    last = json.loads(out.read_text())["results"][-1]
    assert last["calibration"] == {"method": "gptq", "samples": 2, "seq_len": 32, "tokens": 64} and last["seconds"] > 0


def test_calibration_argument_form():
    assert bench_quantize.parse_calibration("128x2048") == (128, 2048)
    with pytest.raises(argparse.ArgumentTypeError, match="SAMPLESxSEQ_LEN"):
        bench_quantize.parse_calibration("128")


def test_times_rotated_loads(tmp_path):
    out = tmp_path / "q.json"
    argv = ["--preset", "tiny-llama", "--device", "cpu", "--bits", "4", "--rotation", "on,auto", "--out", str(out)]
    assert bench_quantize.main(argv) == 0
    rotated = [r for r in json.loads(out.read_text())["results"] if "rotation" in r]
    assert [r["rotation"] for r in rotated] == [True, "auto"] and all(r["seconds"] > 0 for r in rotated)
    assert rotated[0]["rotated_modules"] == 2 * 7 >= rotated[1]["rotated_modules"]  # K = 256 and 512: every Linear
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list"):
        bench_quantize.parse_rotations("sometimes")


def test_times_a_load_without_block_offsets(tmp_path):
    out = tmp_path / "q.json"
    assert bench_quantize.main(["--preset", "tiny-llama", "--device", "cpu", "--bits", "4", "--without-offsets",
                                "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = [r for r in payload["results"] if r.get("block_offsets") is False]
    assert len(rows) == 2 and rows[-1] == {"variant": "kbit4", "seconds": rows[-1]["seconds"], "block_offsets": False}
    assert rows[0]["fitting"] == "absmax" and rows[-1]["seconds"] > 0  # absmax: the plain rule, no offsets
    assert "--without-offsets" in payload["command"]


def test_rules_pick_the_fitting_rules_timed(tmp_path):
    out = tmp_path / "q.json"
    argv = ["--preset", "tiny-llama", "--device", "cpu", "--bits", "4", "--rules", "fit", "--without-offsets",
            "--out", str(out)]
    assert bench_quantize.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["variant"], r.get("fitting"), r.get("block_offsets")) for r in results] == [
        ("bf16", None, None), ("kbit4", "fit", True), ("kbit4", None, False)]
    assert bench_quantize.parse_rules("") == [] and bench_quantize.parse_rules("fit, absmax") == ["fit", "absmax"]
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list"):
        bench_quantize.parse_rules("gptq")
