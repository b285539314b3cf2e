"""bench_finetune.py (the LoRA step benchmark) and profile_lora_host.py (its host time on the CPU), on tiny
models: the rounds combine as the module doc says, and both run end to end. No timing assertions."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import bench_finetune as bench
import pytest

pytest.importorskip("peft", reason="LoRA benchmarks need peft")
SCRIPTS = Path(bench.__file__).resolve().parent


def test_rounds_combine_into_medians_best_round_and_host_share():
    rounds = [{"step_s_all": [0.5, 0.7, 0.6], "host_s_all": [0.45, 0.6, 0.5], "gpu_s_all": [], "loss": [1.0],
               "trainable_params": 10},
              {"step_s_all": [0.4, 0.4, 0.9], "host_s_all": [0.3, 0.35, 0.8], "gpu_s_all": [], "loss": [2.0],
               "trainable_params": 10}]
    r = bench.combine("kbit4", rounds)
    assert r["step_s_median"] == pytest.approx(0.55)  # over all six steps
    assert r["step_s_round_medians"] == [0.6, 0.4] and r["step_s_best_round"] == 0.4
    assert r["host_s_median"] == pytest.approx(0.475) and r["host_share"] == pytest.approx(0.475 / 0.55)
    assert r["gpu_s_median"] is None and r["loss"] == [1.0]
    base = bench.combine("bf16", [{**rounds[0], "step_s_all": [0.5, 0.5, 0.5]}])
    results = [base, r]
    bench.add_ratios(results)
    assert r["step_time_vs_bf16"] == pytest.approx(1.1) and r["step_time_vs_bf16_best_round"] == pytest.approx(0.8)


def test_cpu_run_writes_every_round(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--preset", "tiny-llama", "--layers", "1", "--device", "cpu", "--variants", "bf16,kbit4",
                       "--seq-len", "16", "--steps", "1", "--warmup", "1", "--rounds", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["schema"] == bench.SCHEMA and payload["settings"]["rounds"] == 2
    assert payload["settings"]["loss"] == "chunked"  # hf_kbit.loss for every variant, by default
    assert [r["variant"] for r in payload["results"]] == ["bf16", "kbit4"]
    for r in payload["results"]:
        assert len(r["step_s_all"]) == 2 and len(r["step_s_round_medians"]) == 2 and 0 < r["host_share"] <= 1
    assert payload["results"][0]["step_time_vs_bf16"] == 1.0
    with pytest.raises(ValueError, match="--variants: 'kbit9'"):
        bench.main(["--variants", "bf16,kbit9"])


@pytest.mark.skipif(shutil.which("cc") is None, reason="the kbit library stub needs a C compiler (cc)")
def test_profile_lora_host_times_the_cuda_path_over_the_stub():
    """In a process of its own: the stub must be in place before hf_kbit is imported."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "profile_lora_host.py"), "--layers", "1", "--steps", "1",
                           "--rounds", "1", "--seq-len", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| bf16 |" in proc.stdout and "| kbit4 |" in proc.stdout
