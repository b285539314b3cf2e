"""bench_generate.py and its library (hf_kbit.eval.decode_bench) on the CPU: ``run`` reports the graph step and
the decode loop (hf_kbit.eval.timing, hf_kbit.eval.graph_step) beside generate() end to end, the acceptance dict
shows every speedup, a stopped run resumes, and bad arguments are named. The CUDA graphs themselves run on the GPU
machine only. No timing assertions beyond "positive and finite"."""

from __future__ import annotations

import json
import math

import bench_generate as bench
import pytest
import torch

from hf_kbit.eval import decode_bench as decode, presets
from hf_kbit.eval.breakdown import kernel_breakdown_table

GRAPH_KEYS = ("graph_step_ms", "graph_decode_tok_s", "graph_decode_speedup_vs_bf16")
LOOP_KEYS = ("loop_step_ms", "loop_decode_tok_s", "loop_decode_speedup_vs_bf16", "loop_tokens_argmax_match")
PROMPT_LEN = 8


def tiny_model(dtype, bits=None):
    config = presets.make_config("tiny-llama")
    config.initializer_range = 0.1  # the default 0.02 makes a tiny random model repeat one token
    model = presets.build_model(config, "cpu", dtype)
    return decode.quantize(model, bits) if bits else model


@pytest.fixture(scope="module")
def payload():
    return decode.run("tiny-llama", [4], "cpu", torch.bfloat16, batch_sizes=(1,), prompt_len=PROMPT_LEN,
                      new_tokens=4, repeats=1, log=lambda *_: None)


def test_run_reports_graph_step_and_loop_beside_generate(payload):
    assert [r["variant"] for r in payload["results"]] == ["bf16", "kbit4"]
    for r in payload["results"]:
        for key in GRAPH_KEYS + LOOP_KEYS + ("decode_tok_s", "decode_speedup_vs_bf16"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (r["variant"], key)
        assert r["graph_decode_tok_s"] == pytest.approx(r["batch"] * 1000 / r["graph_step_ms"])
        assert r["loop_decode_tok_s"] == pytest.approx(r["batch"] * 1000 / r["loop_step_ms"])
        assert r["loop_tokens_argmax_match"] == 1.0
        assert r["graph_replay_tokens_match"] is None  # a CUDA-graph check; the CPU runs the steps eagerly
        # generate()'s decode steps one by one: inside the one timed run (repeats=1)
        assert 0 < r["token_ms_median"] <= r["token_ms_max"] < 1000 * r["generate_s"], r
    assert payload["results"][0]["graph_decode_speedup_vs_bf16"] == 1.0
    assert payload["results"][0]["loop_decode_speedup_vs_bf16"] == 1.0
    assert payload["decode_loop"] == {"timing": "wall_clock", "compiled": False, "steps": 3}
    assert payload["graph_step"] == {"timing": "eager_wall_clock", "submission_hidden": False, "compiled": False,
                                     "steps_per_graph": 4, "kernel_breakdown": False}
    assert payload["fusion_pass"] is None  # each variant as its generate() compiles by default
    assert [r["fusion_pass"] for r in payload["results"]] == [False, False]  # nothing compiles on CPU
    for r in payload["results"]:  # host and device time per token apart (the module doc says how)
        assert r["device_ms_per_token"] == r["graph_step_ms"]
        assert r["host_ms_per_token"] == pytest.approx(r["token_ms_median"] - r["graph_step_ms"])
        assert r["loop_host_ms_per_token"] == pytest.approx(r["loop_step_ms"] - r["graph_step_ms"])
    assert payload["fused_projections"] is True
    assert all(r["graph_kernel_breakdown"] is None for r in payload["results"])
    assert kernel_breakdown_table(payload["results"]) == ""
    assert payload["checks"] == {}  # the acceptance bar applies to Llama-3-8B on CUDA only
    assert payload["inductor_pdl"] in (False, None)  # TORCHINDUCTOR_ENABLE_PDL is not set here
    table = decode.render_table(payload)
    assert "| graph tok/s | graph ms/step | graph x bf16 | loop tok/s | loop ms/step | loop x bf16 |" in table
    assert "| kbit4 |" in table
    json.dumps(payload)


def test_no_graph_step_and_no_loop_leave_the_keys_empty():
    p = decode.run("tiny-llama", [4], "cpu", torch.bfloat16, layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=2,
                   repeats=1, graph_step=False, decode_loop=False, log=lambda *_: None)
    assert p["graph_step"] is None and p["decode_loop"] is None
    assert all(r[key] is None for r in p["results"] for key in GRAPH_KEYS + LOOP_KEYS + ("graph_replay_tokens_match",))
    assert all(r["decode_tok_s"] > 0 for r in p["results"])
    assert "| - | - | - | - | - | - |" in decode.render_table(p)


def test_quantize_lm_head_converts_the_head_too():
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=2, repeats=1, graph_step=False,
                  decode_loop=False, include_bf16=False, log=lambda *_: None)
    kept = decode.run("tiny-llama", [4], "cpu", torch.bfloat16, **kwargs)
    converted = decode.run("tiny-llama", [4], "cpu", torch.bfloat16, quantize_lm_head=True, **kwargs)
    assert kept["lm_head_quantized"] is False and converted["lm_head_quantized"] is True
    assert converted["results"][0]["quantized_fraction"] > kept["results"][0]["quantized_fraction"]
    model = presets.build_model(presets.make_config("tiny-llama", 1), "cpu", torch.bfloat16)
    model = decode.quantize(model, 4, lm_head=True)
    assert type(model.lm_head).__name__ == "KbitLinear"


def test_reset_compiled_lets_generate_compile_again():
    model = tiny_model(torch.float32)
    first = model.get_compiled_call(None)
    decode.reset_compiled(model)
    again = model.get_compiled_call(None)
    assert callable(again) and again is not first


def test_acceptance_shows_generate_graph_and_loop_speedups():
    def row(bits, decode, graph, loop):
        return {"bits": bits, "batch": 1, "decode_tok_s": decode, "prefill_tok_s": 1.0, "graph_decode_tok_s": graph,
                "loop_decode_tok_s": loop}

    results = [row(None, 100.0, 120.0, 110.0), row(4, 150.0, 360.0, 264.0)]
    results[0]["host_ms_per_token"], results[1]["host_ms_per_token"] = 2.0, 2.1
    decode.add_speedups(results)
    checks = decode.acceptance({"preset": "llama3-8b", "device": "cuda", "results": results,
                                "lm_head_quantized": False})
    assert checks == {
        "issue36": {"generate_target": 1.8, "generate_passed": False, "host_time_vs_bf16": pytest.approx(1.05),
                    "host_passed": True, "graph_passed": True},
        "llama3-8b_kbit4_batch1_decode_speedup": 1.5, "target": 2.5, "passed": False,
        "llama3-8b_kbit4_batch1_graph_decode_speedup": 3.0, "graph_passed": True,
        "llama3-8b_kbit4_batch1_loop_decode_speedup": pytest.approx(2.4), "loop_passed": False,
    }
    results = [row(None, 100.0, None, None), row(4, 300.0, None, None)]  # --no-graph-step --no-decode-loop
    decode.add_speedups(results)
    checks = decode.acceptance({"preset": "llama3-8b", "device": "cuda", "results": results, "lm_head_quantized": True})
    assert checks["passed"] is True and checks["llama3-8b_kbit4_batch1_graph_decode_speedup"] is None
    assert checks["graph_passed"] is None and checks["loop_passed"] is None
    assert checks["issue36"] == {"generate_target": 1.8, "generate_passed": True, "host_time_vs_bf16": None,
                                 "host_passed": None}
    checks = decode.acceptance({"preset": "qwen3-30b-a3b", "device": "cuda", "results": results,
                                "lm_head_quantized": False})
    assert checks == {"issue36": {"generate_target": 2.0, "generate_passed": True, "host_time_vs_bf16": None,
                                  "host_passed": None}}


def test_recommended_smoke_run_on_a_moe_model(tmp_path, capsys):
    """What the GPU commands run, on CPU: --recommended (kbit_decode attention, LM head quantized), MoE,
    batch 1 and 2."""
    out = tmp_path / "bench.json"
    assert bench.main(["--preset", "tiny-qwen3-moe", "--device", "cpu", "--recommended", "--bits", "4",
                       "--batch-sizes", "1,2", "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1",
                       "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["attention"] == "kbit_decode" and payload["lm_head_quantized"] is True
    assert [(r["variant"], r["batch"]) for r in payload["results"]] == [("bf16", 1), ("bf16", 2), ("kbit4", 1),
                                                                        ("kbit4", 2)]
    assert all(isinstance(r["host_ms_per_token"], float) for r in payload["results"])
    assert "host ms/token" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny-llama", "--device", "cpu", "--fusion-pass", "--no-fusion-pass"])


def test_cli_names_a_bad_steps_per_graph():
    with pytest.raises(ValueError, match="--steps-per-graph must be >= 1, got 0"):
        bench.main(["--preset", "tiny-llama", "--device", "cpu", "--steps-per-graph", "0"])


def test_kernel_breakdown_needs_cuda_and_the_graph_step():
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=2, repeats=1, log=lambda *_: None)
    needs = "--kernel-breakdown .* needs a CUDA device and the graph step, got device 'cpu'"
    with pytest.raises(ValueError, match=needs):
        decode.run("tiny-llama", [4], "cpu", torch.bfloat16, kernel_breakdown=True, **kwargs)


def test_fusion_pass_needs_cuda():
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=2, repeats=1, log=lambda *_: None)
    with pytest.raises(ValueError, match="--fusion-pass .* needs a CUDA device .* got device 'cpu'"):
        decode.run("tiny-llama", [4], "cpu", torch.bfloat16, fusion_pass=True, **kwargs)


def test_attention_builds_every_variant_with_it(monkeypatch):
    import plot_results

    from hf_kbit import attention

    calls = []
    packed = attention.packed_sdpa
    monkeypatch.setattr(attention, "packed_sdpa", lambda *a: calls.append(a[0].dtype) or packed(*a))
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=3, repeats=1, log=lambda *_: None)
    payload = decode.run("tiny-llama", [4], "cpu", torch.float32, attention="kbit_decode", **kwargs)
    assert payload["attention"] == "kbit_decode"
    assert calls  # generate() and the graph step decoded through it
    assert {r["variant"]: r["attention"] for r in payload["results"]} == {"bf16": "kbit_decode", "kbit4": "kbit_decode"}
    # by default each variant attends as it would for a user who names none: bf16 sdpa, kbit kbit_decode
    default = decode.run("tiny-llama", [4], "cpu", torch.float32, graph_step=False, **kwargs)
    assert default["attention"] == "default"
    assert {r["variant"]: r["attention"] for r in default["results"]} == {"bf16": "sdpa", "kbit4": "kbit_decode"}
    assert "kbit default attention" in plot_results.bench_labels(default)
    forced = decode.run("tiny-llama", [4], "cpu", torch.float32, graph_step=False, attention="sdpa", **kwargs)
    assert {r["variant"]: r["attention"] for r in forced["results"]} == {"bf16": "sdpa", "kbit4": "sdpa"}
    with pytest.raises(ValueError, match="--attention must be one of default, sdpa, kbit_decode, got 'flash'"):
        decode.run("tiny-llama", [4], "cpu", torch.float32, attention="flash", **kwargs)


def test_rotation_quantizes_the_kbit_variants_rotated():
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=3, repeats=1, log=lambda *_: None)
    payload = decode.run("tiny-llama", [4], "cpu", torch.float32, rotation=True, **kwargs)
    rows = {r["variant"]: r for r in payload["results"]}
    assert payload["rotation"] is True
    assert rows["kbit4"]["rotated_weights"] == 7  # hidden 256 and intermediate 512: every Linear of the layer
    assert decode.run("tiny-llama", [4], "cpu", torch.float32, **kwargs)["results"][1]["rotated_weights"] == 0
    with pytest.raises(ValueError, match="rotation must be one of"):
        decode.run("tiny-llama", [4], "cpu", torch.float32, rotation="on", **kwargs)


def test_block_offsets_quantize_the_kbit_variants_with_block_records():
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=3, repeats=1, log=lambda *_: None)
    with_offsets = decode.run("tiny-llama", [4], "cpu", torch.float32, **kwargs)  # KbitConfig's default
    plain = decode.run("tiny-llama", [4], "cpu", torch.float32, block_offsets=False, **kwargs)
    assert with_offsets["block_offsets"] is True and plain["block_offsets"] is False
    rotated = decode.settings("tiny-llama", ["kbit4"], "cpu", torch.float32, rotation=True, layers=1)
    assert rotated["block_offsets"] is False  # the default gives rotated weights none
    rows = {r["variant"]: r for r in with_offsets["results"]}
    plain_rows = {r["variant"]: r for r in plain["results"]}
    # one more byte per block of 32 weights: +0.25 bits/weight on every Linear of the layer
    assert rows["kbit4"]["bits_per_weight"] - plain_rows["kbit4"]["bits_per_weight"] == pytest.approx(0.25, abs=1e-9)


def test_a_stopped_run_keeps_its_variants_and_resume_finishes_it(tmp_path, monkeypatch, capsys):
    import plot_results

    out = tmp_path / "bench_generate_tiny.json"
    argv = ["--preset", "tiny-llama", "--device", "cpu", "--layers", "1", "--bits", "4,5", "--batch-sizes", "1",
            "--prompt-len", "4", "--new-tokens", "2", "--repeats", "1", "--no-graph-step", "--no-decode-loop",
            "--out", str(out)]
    quantize = decode.quantize

    def stop_at_kbit5(model, bits, **kwargs):
        if bits == 5:
            raise RuntimeError("stopped")
        return quantize(model, bits, **kwargs)

    monkeypatch.setattr(decode, "quantize", stop_at_kbit5)
    with pytest.raises(RuntimeError, match="stopped"):
        bench.main(argv)
    stopped = json.loads(out.read_text())
    assert stopped["complete"] is False and stopped["variants"] == ["bf16", "kbit4", "kbit5"]
    assert [r["variant"] for r in stopped["results"]] == ["bf16", "kbit4"]
    assert stopped["results"][1]["decode_speedup_vs_bf16"] > 0 and stopped["environment"]["torch"]
    assert plot_results.load_results(tmp_path)["bench"] == []  # a stopped run is not plotted
    assert "a stopped run" in capsys.readouterr().err

    with pytest.raises(ValueError, match=r"measured with setup = \{.*'batch_sizes': \[1\].*this run has setup = "):
        bench.main(argv + ["--batch-sizes", "1,2", "--resume"])
    with pytest.raises(ValueError, match=r"measured with variants = \['bf16', 'kbit4', 'kbit5'\], this run has"):
        bench.main(argv + ["--bits", "4", "--resume"])

    monkeypatch.setattr(decode, "quantize", quantize)
    built = []
    build_model = presets.build_model
    monkeypatch.setattr(decode, "build_model", lambda *a, **k: built.append(1) or build_model(*a, **k))
    assert bench.main(argv + ["--resume"]) == 0
    done = json.loads(out.read_text())
    assert len(built) == 1  # only kbit5 was measured
    assert done["complete"] is True and done["resumed_variants"] == ["bf16", "kbit4"]
    assert [r["variant"] for r in done["results"]] == ["bf16", "kbit4", "kbit5"]
    assert done["results"][:2] == stopped["results"]  # kept as measured
    assert done["results"][2]["decode_speedup_vs_bf16"] > 0
    (plotted,) = plot_results.load_results(tmp_path)["bench"]
    resumed = "Finished with `--resume`: bf16, kbit4 were measured by an earlier process"
    assert resumed in plot_results.bench_markdown(plotted)

    with pytest.raises(ValueError, match="holds a complete run, nothing to resume"):
        bench.main(argv + ["--resume"])
    with pytest.raises(ValueError, match="does not exist; run without --resume"):
        bench.main(argv[:-1] + [str(tmp_path / "other.json"), "--resume"])
