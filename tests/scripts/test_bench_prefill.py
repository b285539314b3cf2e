"""bench_prefill.py on the CPU: every (variant, shape) cell is timed with bf16's ratio beside it, the JSON is
complete, and bad arguments are named. No timing assertions beyond "positive and finite"."""

from __future__ import annotations

import json
import math

import bench_prefill as bench
import pytest
import torch


@pytest.fixture(scope="module")
def payload():
    return bench.run("tiny-llama", [4], "cpu", torch.float32, [(1, 16), (2, 8)], warmup=0, repeats=1,
                     log=lambda *_: None)


def test_run_times_every_variant_and_shape(payload):
    cells = [(r["variant"], r["batch"], r["tokens"]) for r in payload["results"]]
    assert cells == [("bf16", 1, 16), ("bf16", 2, 8), ("kbit4", 1, 16), ("kbit4", 2, 8)]
    for r in payload["results"]:
        assert math.isfinite(r["ms"]) and r["ms"] > 0
        assert r["tok_s"] == pytest.approx(r["batch"] * r["tokens"] / r["ms"] * 1e3)
        assert r["gemm_kernel"] is None and r["logits_rel_diff"] is None  # one kernel: nothing to compare
    bf16 = {(r["batch"], r["tokens"]): r["ms"] for r in payload["results"] if r["variant"] == "bf16"}
    for r in payload["results"]:
        assert r["speedup_vs_bf16"] == pytest.approx(bf16[(r["batch"], r["tokens"])] / r["ms"])
    assert payload["complete"] is True and payload["layers"] == 2
    assert "markdown" not in payload and "| kbit4 | default | 2x8 |" in bench.render_table(payload)


def test_main_writes_json(tmp_path):
    out = tmp_path / "prefill.json"
    assert bench.main(["--preset", "tiny-llama", "--layers", "1", "--device", "cpu", "--dtype", "fp32", "--shapes",
                       "1x8", "--warmup", "0", "--repeats", "1", "--no-bf16", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == bench.SCHEMA and data["complete"] and data["command"] and data["environment"]
    assert [r["variant"] for r in data["results"]] == ["kbit4"] and data["results"][0]["speedup_vs_bf16"] is None


@pytest.mark.parametrize("text", ["1x", "0x8", "2x8,", "4*8", ""])
def test_bad_shapes_are_named(text):
    with pytest.raises(ValueError, match="--shapes"):
        bench.parse_shapes(text)


def test_bad_gemm_kernels_are_named():
    assert bench.parse_gemm_kernels(None) == [None]
    assert bench.parse_gemm_kernels("wgmma, wgmma_ws") == ["wgmma", "wgmma_ws"]
    with pytest.raises(ValueError, match="--gemm-kernels"):
        bench.parse_gemm_kernels("cutlass")


def test_gemm_kernels_need_cuda():
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny-llama", "--device", "cpu", "--gemm-kernels", "wgmma_ws"])
