"""eval_generation and bench_generate's library (hf_kbit.eval.decode_bench, presets) on tiny config-built models
(CPU, eager; no timing asserts)."""

from __future__ import annotations

import json

import eval_generation as eg
import pytest
import torch

from hf_kbit.eval import decode_bench as decode, presets

SPEED_KEYS = {"batch", "prompt_len", "new_tokens", "prefill_tok_s", "decode_tok_s", "ms_per_decode_step", "compiled"}


def test_load_prompts(tmp_path):
    assert eg.load_prompts(None) == list(eg.DEFAULT_PROMPTS)
    path = tmp_path / "p.txt"
    path.write_text("# comment\nfirst prompt\n\nsecond prompt\n")
    assert eg.load_prompts(str(path)) == ["first prompt", "second prompt"]
    path.write_text("# only a comment\n")
    with pytest.raises(ValueError, match="no prompts"):
        eg.load_prompts(str(path))


@pytest.fixture(scope="module")
def generation_payload(tiny_folder):
    return eg.run(
        tiny_folder, {"name": "tiny", "spec": "tiny", "slug": "tiny", "source": "test"}, ["It is a truth", "a wife"],
        [5], "cpu", torch.float32, max_new_tokens=6, chat="off", batch_sizes=(1, 2), prompt_len=8,
        speed_new_tokens=3, repeats=1, decode_loop=True, log=lambda *_: None,
    )


def test_generation_side_by_side(generation_payload):
    p = generation_payload
    assert p["schema"] == eg.SCHEMA and [v["variant"] for v in p["variants"]] == ["bf16", "kbit5"]
    for v in p["variants"]:
        assert [g["prompt"] for g in v["generations"]] == p["prompts"]
        assert all(isinstance(g["greedy"], str) and isinstance(g["sampled"], str) for g in v["generations"])
        assert all(0 < g["greedy_tokens"] <= 6 for g in v["generations"])
        assert [s["batch"] for s in v["speed"]] == [1, 2]
        assert all(SPEED_KEYS <= s.keys() and s["decode_tok_s"] > 0 for s in v["speed"])
        # the decode loop beside generate(): CPU eager steps, the greedy tokens (fp32: equal to the eager argmax)
        assert all(s["loop_decode_tok_s"] > 0 and s["loop_steps"] == 2 for s in v["speed"])
        assert all(s["loop_tokens_argmax_match"] == 1.0 for s in v["speed"])
        assert all(s["loop_decode_speedup_vs_bf16"] is None for s in v["speed"])  # CPU: no speed-ups
    assert p["speed_setup"]["decode_loop"] is True
    assert "| prompt | bf16 | kbit5 |" in p["markdown"] and "decode tok/s" in p["markdown"]
    assert "loop tok/s" in p["markdown"] and "Loop: 2 greedy steps" in p["markdown"]
    json.dumps(p)  # the payload is JSON-serialisable


def test_decode_loop_is_cuda_only_by_default(tiny_folder):
    p = eg.run(  # decode_loop=None: on CUDA only
        tiny_folder, {"name": "tiny", "spec": "tiny", "slug": "tiny", "source": "test"}, ["It is"], [4], "cpu",
        torch.float32, max_new_tokens=2, chat="off", batch_sizes=(1,), prompt_len=8, speed_new_tokens=2, repeats=1,
        log=lambda *_: None,
    )
    assert p["speed_setup"]["decode_loop"] is False
    assert all("loop_decode_tok_s" not in s for v in p["variants"] for s in v["speed"])
    assert "loop tok/s" not in p["markdown"] and "Loop:" not in p["markdown"]
    loop_needs_two = r"--speed-new-tokens must be >= 2 to time the decode loop \(or pass --decode-loop off\), got 1"
    with pytest.raises(ValueError, match=loop_needs_two):
        eg.run(tiny_folder, {"name": "tiny"}, ["x"], [4], "cpu", torch.float32, speed_new_tokens=1, decode_loop=True)


def test_attention_builds_every_variant_with_it(tiny_folder, monkeypatch):
    from hf_kbit import attention

    calls = []
    packed = attention.packed_sdpa
    monkeypatch.setattr(attention, "packed_sdpa", lambda *a: calls.append(1) or packed(*a))
    p = eg.run(
        tiny_folder, {"name": "tiny", "spec": "tiny", "slug": "tiny", "source": "test"}, ["It is"], [4], "cpu",
        torch.float32, max_new_tokens=3, chat="off", batch_sizes=(1,), prompt_len=8, speed_new_tokens=2, repeats=1,
        attention="kbit_decode", log=lambda *_: None,
    )
    assert p["attention"] == "kbit_decode" and "attn_implementation='kbit_decode' in every variant" in p["markdown"]
    assert calls  # both variants decoded through it
    assert [v["attention"] for v in p["variants"]] == ["kbit_decode", "kbit_decode"]
    default = eg.run(
        tiny_folder, {"name": "tiny", "spec": "tiny", "slug": "tiny", "source": "test"}, ["It is"], [4], "cpu",
        torch.float32, max_new_tokens=3, chat="off", batch_sizes=(1,), prompt_len=8, speed_new_tokens=2, repeats=1,
        log=lambda *_: None,
    )
    assert [v["attention"] for v in default["variants"]] == ["sdpa", "kbit_decode"]  # as each loads by default
    assert "bf16 sdpa, kbit4 kbit_decode" in default["markdown"]
    with pytest.raises(ValueError, match="--attention must be one of default, sdpa, kbit_decode, got 'eager'"):
        eg.run(tiny_folder, {"name": "tiny"}, ["x"], [4], "cpu", torch.float32, attention="eager")


def test_greedy_is_deterministic(tiny_folder):
    from transformers import AutoTokenizer

    from hf_kbit.eval.models import load_bits_variant

    model, _ = load_bits_variant(tiny_folder, None, "cpu", torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_folder)
    a = eg.generate_texts(model, tok, ["It is"], 5, chat=False, seed=3)
    b = eg.generate_texts(model, tok, ["It is"], 5, chat=False, seed=3)
    assert a == b


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-30b-a3b"])
def test_real_presets_build_configs_without_downloads(preset):
    config = presets.make_config(preset, layers=2)
    assert config.num_hidden_layers == 2
    assert config.hidden_size == presets.PRESETS[preset]["hidden_size"]
    with pytest.raises(ValueError, match="--layers"):
        presets.make_config(preset, layers=1000)


def test_bench_tiny_cpu_schema():
    payload = decode.run("tiny-llama", [5], "cpu", torch.bfloat16, layers=1, batch_sizes=(1, 2), prompt_len=4,
                         new_tokens=3, repeats=1, log=lambda *_: None)
    assert payload["schema"] == decode.SCHEMA and payload["layers"] == 1 and payload["layers_full"] == 2
    assert [(r["variant"], r["batch"]) for r in payload["results"]] == [("bf16", 1), ("bf16", 2), ("kbit5", 1), ("kbit5", 2)]
    assert all(SPEED_KEYS <= r.keys() and r["decode_speedup_vs_bf16"] > 0 for r in payload["results"])
    assert payload["checks"] == {}  # the acceptance bar applies to Llama-3-8B on CUDA only
    assert "| kbit5 |" in decode.render_table(payload)
    json.dumps(payload)


def test_bench_plot_and_markdown(tmp_path):
    import plot_results

    payload = decode.run("tiny-llama", [4, 5], "cpu", torch.bfloat16, layers=1, batch_sizes=(1, 2), prompt_len=4,
                         new_tokens=3, repeats=1, log=lambda *_: None)
    payload.update({"command": "python scripts/bench_generate.py", "_file": "b.json", "environment": {}})
    png = plot_results.plot_bench(payload, tmp_path / "b.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = plot_results.bench_markdown(payload)
    for r in payload["results"]:
        assert f"{r['decode_tok_s']:.1f}" in text
    assert "; k = 4, 5; batch 1, 2" in text
    assert "--kernel-breakdown" not in text  # no breakdown measured: no breakdown table
    kbit5 = payload["results"][-1]
    assert (f"kbit5 batch 2 {kbit5['token_ms_median']:.2f} ({kbit5['token_ms_max']:.1f})" in text
            and f"kbit5 batch 2 {kbit5['token_ms_median'] - kbit5['graph_step_ms']:.2f} ms" in text)
    assert "| graph-step tok/s | ms/step | x bf16 | loop tok/s | ms/step | x bf16 |" in text
    assert f"| {kbit5['loop_decode_tok_s']:.1f} | {kbit5['loop_step_ms']:.2f} |" in text
    assert "Decode loop: wall clock of 2 greedy steps" in text and "kbit5 batch 2 100%" in text


def test_bench_markdown_shows_the_kernel_breakdown():
    import plot_results

    from hf_kbit.eval.breakdown import kernel_breakdown

    payload = decode.run("tiny-llama", [4], "cpu", torch.bfloat16, layers=1, batch_sizes=(1,), prompt_len=4,
                         new_tokens=3, repeats=1, log=lambda *_: None)
    payload.update({"command": "python scripts/bench_generate.py", "_file": "b.json", "environment": {}})
    kernels = [("void kbit::gemv_kernel<4>", 0.0, 2400.0), ("nvjet_tst", 2400.0, 2780.0),
               ("triton_poi_fused_add_0", 2790.0, 3310.0)]
    payload["results"][1]["graph_kernel_breakdown"] = kernel_breakdown(
        kernels, steps=1, kbit_calls=["model.layers.0.mlp.down_proj"])
    text = plot_results.bench_markdown(payload)
    assert ("| variant | batch | graph step us | profiled us | kbit us | cublas us | triton us | attention us | "
            "other us | idle us | kernels |") in text
    graph_us = 1000 * payload["results"][1]["graph_step_ms"]
    assert f"| kbit4 | 1 | {graph_us:.0f} | 3310 | 2400 | 380 | 520 | 0 | 0 | 10 | 3 |" in text
    assert "| bf16 | 1 |" not in text.split("--kernel-breakdown")[1]  # rows without a breakdown are left out
    per_call = ("exposed microseconds per call (mean over layers and steps, same profile): "
                "kbit4 batch 1: mlp.down_proj 2400.0.")
    assert per_call in text


def test_bench_markdown_acceptance_lines_and_rotation_label():
    """The docs state issue 36's three bars from the run's checks (a Qwen3-MoE run has no graph-step bar and
    no issue 6 keys), and a run whose kbit variants are rotated says so in its heading."""
    import plot_results

    payload = decode.run("tiny-llama", [4], "cpu", torch.bfloat16, layers=1, batch_sizes=(1,), prompt_len=4,
                         new_tokens=3, repeats=1, log=lambda *_: None)
    payload.update({"command": "python scripts/bench_generate.py", "_file": "b.json", "environment": {}})
    k4 = payload["results"][1]
    k4.update(decode_speedup_vs_bf16=1.88, graph_decode_speedup_vs_bf16=2.19)
    payload["checks"] = {"issue36": {"generate_target": 2.0, "host_time_vs_bf16": 1.25, "generate_passed": False,
                                     "host_passed": False}}
    text = plot_results.bench_markdown(payload)
    assert ("Issue 36's acceptance (kbit4 batch 1): generate() 1.88x bf16 (>= 2.0x): NOT met; host time per token "
            "1.25x bf16's (<= 1.10x): NOT met.") in text
    assert "Issue 6's bar" not in text and "rotation" not in text
    payload["checks"]["issue36"].update(generate_target=1.8, generate_passed=True, host_time_vs_bf16=0.77,
                                        host_passed=True, graph_passed=False)
    payload["rotation"] = True
    text = plot_results.bench_markdown(payload)
    assert ("generate() 1.88x bf16 (>= 1.8x): met; host time per token 0.77x bf16's (<= 1.10x): met; graph step "
            "2.19x (>= 2.6x, LM head bf16): NOT met.") in text
    assert "kbit rotation=True" in text.splitlines()[0]


def test_bench_plot_one_batch_size_and_names(tmp_path):
    """A file of one batch size plots throughput vs bits only; each result file names its own plot."""
    import plot_results

    payload = decode.run("tiny-llama", [4], "cpu", torch.bfloat16, layers=1, batch_sizes=(1,), prompt_len=4,
                         new_tokens=3, repeats=1, log=lambda *_: None)
    payload.update({"command": "python scripts/bench_generate.py", "_file": "bench_generate_tiny_cpu_bits.json",
                    "environment": {}})
    assert plot_results.bench_plot_name(payload) == "decode_speed_tiny_cpu_bits.png"
    png = plot_results.plot_bench(payload, tmp_path / plot_results.bench_plot_name(payload))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "; k = 4; batch 1" in plot_results.bench_markdown(payload)
