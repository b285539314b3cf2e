"""bench_moe.py on the CPU: a --smoke run end to end (JSON and markdown), the real presets'
configs and experts modules (built on the meta device, nothing allocated), argument checks,
and the cold-L2 copy count. No timing assertions."""

from __future__ import annotations

import json

import pytest
import torch

import bench_moe as bench


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("bench_moe") / "smoke"
    argv = ["--smoke", "--device", "cpu", "--bits", "3", "4", "--tokens", "1", "5", "--budget-s", "0.02",
            "--out", str(prefix)]
    bench.main(argv)
    return prefix, argv


def test_smoke_writes_json_with_every_field(smoke):
    prefix, argv = smoke
    payload = json.loads(prefix.with_suffix(".json").read_text())
    meta = payload["meta"]
    assert meta["schema"] == bench.SCHEMA and meta["command"] == "python scripts/bench_moe.py " + " ".join(argv)
    for key in ("device", "torch", "transformers", "hf_kbit", "kbit_grouped_mm_cuda_kernel", "cold_l2", "routing"):
        assert meta[key] not in (None, ""), key
    assert meta["torch"] == torch.__version__ and meta["bits"] == [3, 4] and meta["tokens"] == [1, 5]

    (info,) = payload["presets"]
    assert info["preset"] == bench.SMOKE_PRESET and info["num_experts"] == 8 and info["top_k"] == 2
    baseline = info["bf16_baseline"]
    assert baseline["experts_implementation"] == "grouped_mm"
    assert baseline["forward"] == "transformers.integrations.moe.grouped_mm_experts_forward"
    assert baseline["is_grouped_mm_path"] and bench.GROUPED_MM_OP in baseline["observed_ops"]
    assert set(info["variants"]) == {"bf16", "k3", "k4"}
    for label in ("k3", "k4"):
        assert bench.KBIT_OP in info["variants"][label]["observed_ops"]
        assert bench.GROUPED_MM_OP not in info["variants"][label]["observed_ops"]
    sizes = [info["variants"][label]["layer_bytes"] for label in ("k3", "k4", "bf16")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3

    assert [r["T"] for r in payload["results"]] == [1, 5]
    for r in payload["results"]:
        assert 1 <= r["active_experts"] <= 8
        assert r["bf16_timing"] == "wall_clock"
        for b in (3, 4):
            assert r[f"k{b}_us"] > 0 and r[f"k{b}_timing"] == "wall_clock"
            assert r[f"k{b}_x_bf16"] == pytest.approx(r["bf16_us"] / r[f"k{b}_us"])
        # The same layer at 4 bits: quantization noise only (tests/nn/test_experts.py: 0.20 bound).
        assert r["k4_rel_err"] < 0.25


def test_smoke_writes_markdown_table(smoke):
    prefix, argv = smoke
    md = prefix.with_suffix(".md").read_text()
    assert "`python scripts/bench_moe.py " + " ".join(argv) + "`" in md
    assert "| T | active experts | bf16 us | k=3 us (x bf16) | k=3 rel err | k=4 us (x bf16) | k=4 rel err |" in md
    rows = [line for line in md.splitlines() if line.startswith("| 1 |") or line.startswith("| 5 |")]
    assert len(rows) == 2 and all(line.count("|") == 9 for line in rows)
    assert "grouped_mm_experts_forward" in md


@pytest.mark.parametrize(
    "preset, shapes, cls",
    [
        ("qwen3-30b-a3b", ((128, 1536, 2048), (128, 2048, 768)), "Qwen3MoeExperts"),
        ("qwen3-next", ((512, 1024, 2048), (512, 2048, 512)), "Qwen3NextExperts"),
    ],
)
def test_real_presets_build_the_familys_experts_on_meta(preset, shapes, cls):
    config = bench.make_config(preset)
    assert config.num_hidden_layers == 1
    assert config.num_experts_per_tok == {"qwen3-30b-a3b": 8, "qwen3-next": 10}[preset]
    name, experts = bench.skeleton_experts(config)
    assert name == "model.layers.0.mlp.experts" and type(experts).__name__ == cls
    assert (tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape)) == shapes
    assert experts.gate_up_proj.device.type == "meta" and experts.gate_up_proj.dtype == torch.bfloat16
    assert experts.config._experts_implementation == "grouped_mm"


def test_routing_is_seeded_top_k_of_a_softmax():
    config = bench.make_config(bench.SMOKE_PRESET)
    x, index, weights = bench.routing(config, 6, "cpu")
    x2, index2, weights2 = bench.routing(config, 6, "cpu")
    assert torch.equal(x, x2) and torch.equal(index, index2) and torch.equal(weights, weights2)
    assert x.shape == (6, 64) and index.shape == weights.shape == (6, 2) and weights.dtype == torch.bfloat16
    assert all(len(set(row)) == 2 for row in index.tolist())
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(6), rtol=0, atol=1e-2)  # norm_topk_prob


def test_copies_cover_the_cold_bytes_within_the_memory_budget():
    mib, gib = 2**20, 2**30
    assert bench.copies_for(75 * mib, 1.2 * gib, 40 * gib, cold=True) == 6  # Qwen3-30B-A3B bf16, T = 1
    assert bench.copies_for(2 * gib, 3.2 * gib, 40 * gib, cold=True) == 2  # at least 2
    assert bench.copies_for(75 * mib, 1.2 * gib, 3 * gib, cold=True) == 2  # capped by the budget
    assert bench.copies_for(1, 1, 40 * gib, cold=True) == bench.MAX_COPIES
    assert bench.copies_for(75 * mib, 1.2 * gib, 40 * gib, cold=False) == 1
    with pytest.raises(MemoryError, match="--copy-mem-gb"):
        bench.copies_for(75 * mib, 1.2 * gib, 2 * gib, cold=True)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bits", "6"], "--bits must be in"),
        (["--tokens", "0"], "--tokens must be"),
        (["--smoke", "--presets", "qwen3-next"], "--smoke runs the tiny preset"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_real_presets_refused_on_cpu():
    with pytest.raises(ValueError, match="--smoke"):
        bench.run(bench.parse_args(["--device", "cpu"]), ["--device", "cpu"])


def test_block_smoke_times_the_whole_block(tmp_path):
    """--block: the family's sparse MoE block (router + experts), the kbit side as quantize_model leaves it."""
    prefix = tmp_path / "block"
    bench.main(["--smoke", "--block", "--device", "cpu", "--bits", "4", "--tokens", "1", "3", "--budget-s", "0.02",
                "--out", str(prefix)])
    payload = json.loads(prefix.with_suffix(".json").read_text())
    (info,) = payload["presets"]
    assert payload["meta"]["block"] and info["block"] and info["module"] == "model.layers.0.mlp"
    assert prefix.with_suffix(".md").read_text().startswith("# MoE block (router + experts)")
    ops = info["variants"]["k4"]["observed_ops"]
    assert bench.KBIT_OP in ops and "aten.linear" in ops  # the router's matmul, then its routing and the experts
    assert [r["T"] for r in payload["results"]] == [1, 3] and all(r["k4_us"] > 0 for r in payload["results"])


def test_make_kbit_block_fuses_the_router():
    from hf_kbit.nn import KbitExperts
    from hf_kbit.nn.routing import KbitSoftmaxTopKRouter

    _, block = bench.build_bf16_experts(bench.make_config(bench.SMOKE_PRESET), "cpu", block=True)
    kbit = bench.make_kbit_block(block, 3)
    assert isinstance(kbit.experts, KbitExperts) and isinstance(kbit.gate, KbitSoftmaxTopKRouter)
    assert type(block.gate).__name__ == "Qwen3MoeTopKRouter"  # the bf16 block is left as it was
