"""bench_grouped_gemv.py on the CPU: a --smoke run end to end (JSON and markdown), the bytes it counts per
expert, its routing, and its argument checks. No timing assertions."""

from __future__ import annotations

import json

import pytest
import torch

import bench_grouped_gemv as bench
from hf_kbit import format as fmt


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("bench_grouped_gemv") / "smoke"
    argv = ["--smoke", "--device", "cpu", "--bits", "3", "4", "--tokens", "1", "3", "--out", str(prefix)]
    bench.main(argv)
    return prefix, argv


def test_smoke_writes_json_with_every_field(smoke):
    prefix, argv = smoke
    payload = json.loads(prefix.with_suffix(".json").read_text())
    meta = payload["meta"]
    assert meta["schema"] == bench.SCHEMA and meta["command"] == "python scripts/bench_grouped_gemv.py " + " ".join(argv)
    assert meta["torch"] == torch.__version__ and meta["bits"] == [3, 4] and meta["tokens"] == [1, 3]
    assert meta["bandwidth_GBps"] is None and "no claims" in meta["method"]
    hidden, inter, experts, top_k = bench.SMOKE_SHAPE
    cells = [(r["projection"], r["bits"], r["T"]) for r in payload["results"]]
    assert cells == [(p, b, t) for p in ("gate_up", "down", "down_gated") for b in (3, 4) for t in (1, 3)]
    for r in payload["results"]:
        n, k = (2 * inter, hidden) if r["projection"] == "gate_up" else (hidden, inter)
        assert (r["N"], r["K"], r["experts"], r["top_k"], r["rows"]) == (n, k, experts, top_k, r["T"] * top_k)
        assert 1 <= r["distinct_experts"] <= min(experts, r["rows"])
        assert r["bytes_per_call"] == pytest.approx(r["distinct_experts"] * bench.expert_bytes(n, k, r["bits"]))
        assert r["us"] > 0 and r["timing"] == "wall_clock" and "roofline_pct" not in r and "floor_pct" not in r
        assert r["TBps"] == pytest.approx(r["bytes_per_call"] / r["us"] / 1e6)


def test_smoke_writes_markdown_table(smoke):
    prefix, argv = smoke
    md = prefix.with_suffix(".md").read_text()
    assert "`python scripts/bench_grouped_gemv.py " + " ".join(argv) + "`" in md
    assert md.count("| tiny | gate_up (80 x 96) |") == 4 and md.count("| tiny | down (96 x 40) |") == 4
    assert md.count("| tiny | down_gated (96 x 40) |") == 4
    assert md.count("| n/a | n/a |") == 12  # no bandwidth and no size floor on the CPU


def test_expert_bytes_count_planes_scales_and_row_scales():
    n, k, bits = 100, 300, 3  # 7 row tiles x 3 K tiles (padded)
    planes, scales, rows = 7 * 3 * bits * 16 * 4 * 4, 7 * 3 * 16 * 4, 100 * 4
    assert bench.expert_bytes(n, k, bits) == planes + scales + rows
    # the format's own count, which adds the codebook: the same bytes within a codebook
    assert bench.expert_bytes(n, k, bits) <= fmt.bits_per_weight(n, k, bits) * n * k / 8


def test_routed_ids_give_each_token_distinct_experts():
    ids = bench.routed_ids(5, 16, 4, torch.Generator().manual_seed(0))
    assert ids.shape == (20,) and ids.dtype == torch.int64
    for row in ids.view(5, 4):
        assert row.unique().numel() == 4 and 0 <= int(row.min()) and int(row.max()) < 16


@pytest.mark.parametrize("argv,message", [
    (["--bits", "6", "--smoke", "--device", "cpu"], "--bits"),
    (["--tokens", "0", "--smoke", "--device", "cpu"], "--tokens"),
    (["--device", "cpu"], "--smoke"),
    (["--smoke", "--device", "cpu", "--families", "deepseek-v3"], "--families"),
    (["--device", "tpu", "--smoke"], "--device"),
])
def test_bad_arguments_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
