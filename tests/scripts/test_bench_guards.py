"""bench_guards.py on the CPU: each variant's compiled decode step reports its guards and host time (positive and
finite, no timing assertions), and bad arguments are named."""

from __future__ import annotations

import json
import math

import bench_guards as bench
import pytest


def test_run_reports_guards_and_host_time():
    payload = bench.run("tiny-llama", 2, ["bf16", "kbit4", "kbit4-unfused"], calls=3, rounds=1, log=lambda *_: None)
    assert [r["variant"] for r in payload["results"]] == ["bf16", "kbit4", "kbit4-unfused"]
    for r in payload["results"]:
        assert r["compiled_entries"] == 1 and r["leaf_guards"][0] > 0
        assert math.isfinite(r["call_us"]) and r["call_us"] > 0 and r["cache_lookup_us"] > 0
    assert payload["results"][0]["call_us_over_bf16"] == 0 and payload["layers"] == 2


def test_main_writes_json(tmp_path):
    out = tmp_path / "guards.json"
    assert bench.main(["--layers", "1", "--variants", "kbit4", "--calls", "2", "--rounds", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == bench.SCHEMA and data["results"][0]["call_us_over_bf16"] is None


@pytest.mark.parametrize("argv", [["--variants", "fp8"], ["--calls", "0"], ["--preset", "gpt9"], ["--layers", "0"]])
def test_bad_arguments_are_named(argv):
    with pytest.raises(SystemExit):
        bench.main(argv)
