"""bench_generate.py's graph step and decode loop on the CPU: the step chains the tokens ``generate`` picks
greedily (eager and traced by dynamo with fullgraph=True), the loop's token check catches a loop that feeds
back the wrong tokens, ``run`` reports both beside generate() end to end, the acceptance dict shows every
speedup, and bad arguments are named. The CUDA graphs themselves run on the GPU machine only.
No timing assertions beyond "positive and finite"."""

from __future__ import annotations

import inspect
import json
import math
import warnings

import _eval_common as common
import bench_generate as bench
import pytest
import torch

GRAPH_KEYS = ("graph_step_ms", "graph_decode_tok_s", "graph_decode_speedup_vs_bf16")
LOOP_KEYS = ("loop_step_ms", "loop_decode_tok_s", "loop_decode_speedup_vs_bf16", "loop_tokens_argmax_match")
PROMPT_LEN, NEW_TOKENS = 8, 5


def tiny_model(dtype, bits=None):
    config = bench.make_config("tiny-llama")
    config.initializer_range = 0.1  # the default 0.02 makes a tiny random model repeat one token
    model = bench.build_model(config, "cpu", dtype)
    return bench.quantize(model, bits) if bits else model


def greedy_generate(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, disable_compile=True)
    return out[:, prompt.shape[1]:]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "dynamo-fullgraph"])
@pytest.mark.parametrize(
    "dtype, bits", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 4)], ids=["fp32", "bf16", "kbit4"]
)
def test_step_chains_generates_greedy_tokens(dtype, bits, traced, fresh_dynamo):
    model = tiny_model(dtype, bits)
    prompt = common.random_prompt(model.config.vocab_size, 2, PROMPT_LEN, "cpu")
    expected = greedy_generate(model, prompt, NEW_TOKENS)
    assert len(set(expected.flatten().tolist())) > 2, "the test needs a model whose greedy tokens vary"

    step = common.GreedyDecodeStep(model, prompt, PROMPT_LEN + NEW_TOKENS)
    if traced:  # what the CUDA path compiles, traced here without inductor: no graph breaks allowed
        step.forward = torch.compile(step.forward, fullgraph=True, backend="eager")
    assert torch.equal(step.tokens(NEW_TOKENS), expected)
    # rewind() restores token, position and the cache's write position: a second pass repeats the first.
    assert torch.equal(step.tokens(NEW_TOKENS), expected)
    assert step.position.item() == PROMPT_LEN + NEW_TOKENS - 1
    assert all(layer.cumulative_length.item() == PROMPT_LEN + NEW_TOKENS - 1 for layer in step.cache.layers)


def test_step_passes_the_cache_under_the_name_the_forward_takes():
    """transformers >= 5.24 calls it ``cache`` and warns on ``past_key_values`` (removed in 5.40)."""
    model = tiny_model(torch.float32)
    step = common.GreedyDecodeStep(model, common.random_prompt(model.config.vocab_size, 1, PROMPT_LEN, "cpu"),
                                   PROMPT_LEN + 2)
    assert step.cache_arg in inspect.signature(model.forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        step()
    assert step.position.item() == PROMPT_LEN + 1


def test_step_rejects_bad_arguments():
    model = tiny_model(torch.float32)
    prompt = common.random_prompt(model.config.vocab_size, 1, PROMPT_LEN, "cpu")
    with pytest.raises(ValueError, match="max_cache_len must exceed prompt_len"):
        common.GreedyDecodeStep(model, prompt, PROMPT_LEN)
    with pytest.raises(ValueError, match="prompt must be int64"):
        common.GreedyDecodeStep(model, prompt.float(), PROMPT_LEN + 2)
    step = common.GreedyDecodeStep(model, prompt, PROMPT_LEN + 2)
    with pytest.raises(ValueError, match=r"n must be in \[1, 3\]"):
        step.tokens(4)
    with pytest.raises(ValueError, match="steps_per_graph must be >= 1"):
        common.measure_graph_step(model, 1, PROMPT_LEN, 2, "cpu", steps_per_graph=0)


@pytest.mark.parametrize("dtype, bits", [(torch.float32, None), (torch.float32, 4)], ids=["fp32", "kbit4"])
def test_decode_loop_decodes_the_greedy_tokens(dtype, bits):
    model = tiny_model(dtype, bits)
    out = common.measure_decode_loop(model, 2, PROMPT_LEN, NEW_TOKENS, "cpu", repeats=1, warmup=0)
    assert out["loop_steps"] == NEW_TOKENS - 1
    assert out["loop_tokens_argmax_match"] == 1.0
    assert out["loop_decode_tok_s"] == pytest.approx(2 * 1000 / out["loop_step_ms"])


def test_decode_loop_check_sees_tokens_the_model_did_not_pick(monkeypatch):
    """The teacher-forced check is what vouches for the loop's tokens: a loop that feeds back another token
    than the argmax (here: the argmax + 1) must score below 1."""
    model = tiny_model(torch.float32)
    step_call = common.GreedyDecodeStep.__call__

    def off_by_one(self):
        step_call(self)
        with torch.inference_mode():
            self.ids.add_(1).remainder_(model.config.vocab_size)

    monkeypatch.setattr(common.GreedyDecodeStep, "__call__", off_by_one)
    out = common.measure_decode_loop(model, 2, PROMPT_LEN, NEW_TOKENS, "cpu", repeats=1, warmup=0)
    assert out["loop_tokens_argmax_match"] == pytest.approx(1 / NEW_TOKENS)  # only the prefill's token is right


def test_decode_loop_rejects_bad_arguments():
    model = tiny_model(torch.float32)
    with pytest.raises(ValueError, match="new_tokens must be >= 2 to time a decode loop, got 1"):
        common.measure_decode_loop(model, 1, PROMPT_LEN, 1, "cpu")
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        common.measure_decode_loop(model, 1, PROMPT_LEN, 2, "cpu", repeats=0)


@pytest.fixture(scope="module")
def payload():
    return bench.run("tiny-llama", [4], "cpu", torch.bfloat16, batch_sizes=(1,), prompt_len=PROMPT_LEN,
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
    assert payload["fusion_pass"] is False
    assert payload["fused_projections"] is True
    assert all(r["graph_kernel_breakdown"] is None for r in payload["results"])
    assert common.kernel_breakdown_table(payload["results"]) == ""
    assert payload["checks"] == {}  # the acceptance bar applies to Llama-3-8B on CUDA only
    assert payload["inductor_pdl"] in (False, None)  # TORCHINDUCTOR_ENABLE_PDL is not set here
    table = bench.render_table(payload)
    assert "| graph tok/s | graph ms/step | graph x bf16 | loop tok/s | loop ms/step | loop x bf16 |" in table
    assert "| kbit4 |" in table
    json.dumps(payload)


def test_no_graph_step_and_no_loop_leave_the_keys_empty():
    p = bench.run("tiny-llama", [4], "cpu", torch.bfloat16, layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=2,
                  repeats=1, graph_step=False, decode_loop=False, log=lambda *_: None)
    assert p["graph_step"] is None and p["decode_loop"] is None
    assert all(r[key] is None for r in p["results"] for key in GRAPH_KEYS + LOOP_KEYS + ("graph_replay_tokens_match",))
    assert all(r["decode_tok_s"] > 0 for r in p["results"])
    assert "| - | - | - | - | - | - |" in bench.render_table(p)


def test_quantize_lm_head_converts_the_head_too():
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=2, repeats=1, graph_step=False,
                  decode_loop=False, include_bf16=False, log=lambda *_: None)
    kept = bench.run("tiny-llama", [4], "cpu", torch.bfloat16, **kwargs)
    converted = bench.run("tiny-llama", [4], "cpu", torch.bfloat16, quantize_lm_head=True, **kwargs)
    assert kept["lm_head_quantized"] is False and converted["lm_head_quantized"] is True
    assert converted["results"][0]["quantized_fraction"] > kept["results"][0]["quantized_fraction"]
    model = bench.quantize(bench.build_model(bench.make_config("tiny-llama", 1), "cpu", torch.bfloat16), 4, lm_head=True)
    assert type(model.lm_head).__name__ == "KbitLinear"


def test_reset_compiled_lets_generate_compile_again():
    model = tiny_model(torch.float32)
    first = model.get_compiled_call(None)
    bench.reset_compiled(model)
    again = model.get_compiled_call(None)
    assert callable(again) and again is not first


def test_acceptance_shows_generate_graph_and_loop_speedups():
    def row(bits, decode, graph, loop):
        return {"bits": bits, "batch": 1, "decode_tok_s": decode, "prefill_tok_s": 1.0, "graph_decode_tok_s": graph,
                "loop_decode_tok_s": loop}

    results = [row(None, 100.0, 120.0, 110.0), row(4, 150.0, 360.0, 264.0)]
    bench.add_speedups(results)
    checks = bench.acceptance({"preset": "llama3-8b", "device": "cuda", "results": results})
    assert checks == {
        "llama3-8b_kbit4_batch1_decode_speedup": 1.5, "target": 2.5, "passed": False,
        "llama3-8b_kbit4_batch1_graph_decode_speedup": 3.0, "graph_passed": True,
        "llama3-8b_kbit4_batch1_loop_decode_speedup": pytest.approx(2.4), "loop_passed": False,
    }
    results = [row(None, 100.0, None, None), row(4, 300.0, None, None)]  # --no-graph-step --no-decode-loop
    bench.add_speedups(results)
    checks = bench.acceptance({"preset": "llama3-8b", "device": "cuda", "results": results})
    assert checks["passed"] is True and checks["llama3-8b_kbit4_batch1_graph_decode_speedup"] is None
    assert checks["graph_passed"] is None and checks["loop_passed"] is None


def test_cli_names_a_bad_steps_per_graph():
    with pytest.raises(ValueError, match="--steps-per-graph must be >= 1, got 0"):
        bench.main(["--preset", "tiny-llama", "--device", "cpu", "--steps-per-graph", "0"])


@pytest.mark.parametrize("name, group", [
    ("void kbit::gemv_kernel<__nv_bfloat16, 4, 0>(kbit::MmParams)", "kbit"),  # holds "gemv", is still ours
    ("void kbit::splitk_reduce_kernel<__nv_bfloat16>(float const*, __nv_bfloat16*, long, int)", "kbit"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "cublas"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>(...)", "cublas"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "cublas"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>(Flash_fwd_params)",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x128_4x1x1_cga1x1x1_kernel0_0",
     "attention"),
    ("_decode_attention_slice_kernel", "attention"),  # hf_kbit.attention's Triton kernels
    ("_decode_attention_merge_kernel", "attention"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "triton"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_add_cat_1", "triton"),  # fused around SDPA
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>>(int, ...)", "other"),
])
def test_kernel_group_by_origin(name, group):
    assert common.kernel_group(name) == group


def test_kernel_breakdown_charges_each_kernel_its_exposed_time():
    # Two steps. The second kbit kernel starts before the triton kernel ends (a programmatic dependent
    # launch): its duration (12) counts 2 us the triton kernel is charged. An idle gap of 1 us before the
    # cuBLAS kernel is charged to no group. Exposed times and idle add up to the span (0 .. 35).
    kernels = [("void kbit::gemv_kernel<a>", 0.0, 10.0), ("triton_poi_fused_add_0", 9.0, 12.0),
               ("void kbit::gemv_kernel<a>", 10.0, 22.0), ("nvjet_tst_x", 23.0, 29.0),
               ("void at::native::reduce_kernel<b>", 29.0, 30.0), ("triton_poi_fused_add_0", 30.0, 35.0)]
    split = common.kernel_breakdown(kernels, steps=2, top=2)
    assert split["us_per_step"] == {"kbit": 10.0, "cublas": 3.0, "triton": 3.5, "attention": 0.0, "other": 0.5}
    assert split["kernel_us_per_step"] == {"kbit": 11.0, "cublas": 3.0, "triton": 4.0, "attention": 0.0, "other": 0.5}
    assert split["kernels_per_step"] == {"kbit": 1.0, "cublas": 0.5, "triton": 1.0, "attention": 0.0, "other": 0.5}
    assert split["idle_us_per_step"] == pytest.approx(0.5)
    assert split["total_us_per_step"] == pytest.approx(17.5)  # (35 - 0) / 2
    assert split["top"] == [{"kernel": "void kbit::gemv_kernel<a>", "group": "kbit", "us_per_step": 10.0},
                            {"kernel": "triton_poi_fused_add_0", "group": "triton", "us_per_step": 3.5}]
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        common.kernel_breakdown(kernels, steps=0)
    with pytest.raises(ValueError, match="kernel 'triton_x' ends before it starts"):
        common.kernel_breakdown([("triton_x", 5.0, 4.0)], steps=1)


def test_kernel_breakdown_charges_nothing_to_a_kernel_hidden_behind_another():
    # A kernel that ends before the kernel before it (it ran beside it) adds no exposed time.
    kernels = [("void kbit::gemv_kernel<a>", 0.0, 10.0), ("triton_a", 2.0, 6.0), ("triton_b", 10.0, 11.0)]
    split = common.kernel_breakdown(kernels, steps=1)
    assert split["us_per_step"]["triton"] == 1.0
    assert split["kernel_us_per_step"]["triton"] == 5.0
    assert split["total_us_per_step"] == 11.0


def test_kernel_breakdown_needs_cuda_and_the_graph_step():
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=2, repeats=1, log=lambda *_: None)
    needs = "--kernel-breakdown .* needs a CUDA device and the graph step, got device 'cpu'"
    with pytest.raises(ValueError, match=needs):
        bench.run("tiny-llama", [4], "cpu", torch.bfloat16, kernel_breakdown=True, **kwargs)
    model = tiny_model(torch.float32)
    with pytest.raises(ValueError, match="the kernel breakdown profiles CUDA kernels; device is 'cpu'"):
        common.measure_graph_step(model, 1, PROMPT_LEN, 2, "cpu", breakdown=True)


def test_fusion_pass_needs_cuda():
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=2, repeats=1, log=lambda *_: None)
    with pytest.raises(ValueError, match="--fusion-pass .* needs a CUDA device .* got device 'cpu'"):
        bench.run("tiny-llama", [4], "cpu", torch.bfloat16, fusion_pass=True, **kwargs)


def test_attention_builds_every_variant_with_it(monkeypatch):
    from hf_kbit import attention

    calls = []
    packed = attention.packed_sdpa
    monkeypatch.setattr(attention, "packed_sdpa", lambda *a: calls.append(a[0].dtype) or packed(*a))
    kwargs = dict(layers=1, batch_sizes=(1,), prompt_len=4, new_tokens=3, repeats=1, log=lambda *_: None)
    payload = bench.run("tiny-llama", [4], "cpu", torch.float32, attention="kbit_decode", **kwargs)
    assert payload["attention"] == "kbit_decode"
    assert calls  # generate() and the graph step decoded through it
    assert bench.run("tiny-llama", [4], "cpu", torch.float32, graph_step=False, **kwargs)["attention"] == "sdpa"
    with pytest.raises(ValueError, match="--attention must be one of sdpa, kbit_decode, got 'flash'"):
        bench.run("tiny-llama", [4], "cpu", torch.float32, attention="flash", **kwargs)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_kbit_call_order_names_the_launching_kbit_modules_in_forward_order(fused):
    model = tiny_model(torch.float32)
    model = bench.quantize(model, 4, fuse_projections=fused)
    prompt = common.random_prompt(model.config.vocab_size, 1, PROMPT_LEN, "cpu")
    step = common.GreedyDecodeStep(model, prompt, PROMPT_LEN + 3)
    per_layer = (["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"] if fused else
                 ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    layers = model.config.num_hidden_layers
    assert common.kbit_call_order(step) == [f"model.layers.{i}.{m}" for i in range(layers) for m in per_layer]
    assert step.position.item() == PROMPT_LEN  # rewound: the step is unchanged
    assert not any(m._forward_hooks for m in model.modules())  # the hooks are gone
    assert common.kbit_call_order(common.GreedyDecodeStep(tiny_model(torch.float32), prompt, PROMPT_LEN + 3)) == []


def test_kernel_breakdown_pools_each_module_over_layers():
    calls = ["model.layers.0.q", "model.layers.0.mlp", "model.layers.1.q", "model.layers.1.mlp"]
    gemv, reduce = "void kbit::gemv_kernel<4>", "void kbit::splitk_reduce_kernel<bf16>"
    durations = [(gemv, 4.0), ("triton_a", 1.0), (gemv, 10.0), (reduce, 2.0), (gemv, 6.0), (gemv, 12.0)] * 2
    kernels, t = [], 0.0
    for name, us in durations:  # back to back
        kernels.append((name, t, t + us))
        t += us
    split = common.kernel_breakdown(kernels, steps=2, kbit_calls=calls)
    assert split["kbit_us_by_module"] == {"model.layers.N.q": 5.0, "model.layers.N.mlp": 11.0}  # reduce: not a call
    assert common.kbit_module_summary(split) == "q 5.0, mlp 11.0"
    assert common.kernel_breakdown(kernels, steps=2)["kbit_us_by_module"] is None
    assert common.kernel_breakdown(kernels, steps=2, kbit_calls=calls[:3])["kbit_us_by_module"] is None  # 8 vs 6


def test_a_stopped_run_keeps_its_variants_and_resume_finishes_it(tmp_path, monkeypatch, capsys):
    import plot_results

    out = tmp_path / "bench_generate_tiny.json"
    argv = ["--preset", "tiny-llama", "--device", "cpu", "--layers", "1", "--bits", "4,5", "--batch-sizes", "1",
            "--prompt-len", "4", "--new-tokens", "2", "--repeats", "1", "--no-graph-step", "--no-decode-loop",
            "--out", str(out)]
    quantize = bench.quantize

    def stop_at_kbit5(model, bits, **kwargs):
        if bits == 5:
            raise RuntimeError("stopped")
        return quantize(model, bits, **kwargs)

    monkeypatch.setattr(bench, "quantize", stop_at_kbit5)
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

    monkeypatch.setattr(bench, "quantize", quantize)
    built = []
    build_model = bench.build_model
    monkeypatch.setattr(bench, "build_model", lambda *a, **k: built.append(1) or build_model(*a, **k))
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
