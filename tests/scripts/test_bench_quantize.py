"""scripts/bench_quantize.py on CPU with the tiny preset: it times every rule and the bf16 load."""

import json

import bench_quantize


def test_times_bf16_and_every_fitting_rule(tmp_path):
    out = tmp_path / "q.json"
    assert bench_quantize.main(["--preset", "tiny-llama", "--device", "cpu", "--bits", "3", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [r.get("fitting") for r in payload["results"]] == [None, *bench_quantize.RULES]
    assert all(r["seconds"] > 0 for r in payload["results"])
    assert payload["command"].startswith("python scripts/bench_quantize.py --preset tiny-llama")
