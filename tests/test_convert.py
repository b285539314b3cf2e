"""hf_kbit.convert: streaming conversion == quantize-on-load, bit for bit (dense and MoE); safety; validation; card."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_kbit
from hf_kbit import convert as convert_mod
from hf_kbit.convert import writing
from hf_kbit.convert import ConversionError, ConversionPlan, convert
from hf_kbit.nn.experts import KbitExperts
from hf_kbit.nn.linear import KbitLinear

from convert_helpers import (  # noqa: F401
    MOE_LAYOUTS, hub, llama_bf16_tied, llama_fp32, make_llama, moe_checkpoint, subprocess_env,
)

PPL_RTOL = 1e-4  # perplexity recomputed from the same weights, same dtype: only summation order may differ


def quantize_on_load(src: Path, config: hf_kbit.KbitConfig, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, quantization_config=config, **kwargs)


def load(folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


CONFIGS = {
    "bits4": dict(bits=4),
    "bits2": dict(bits=2),
    "bits3-module-bits": dict(bits=3, module_bits={r"mlp\.down_proj": 5, r"self_attn\.[qk]_proj": 2}),
    "nf-sym-skip": dict(bits=4, codebook="nf-sym", modules_to_not_convert=["lm_head", "o_proj"]),
}


@pytest.mark.parametrize("config_kwargs", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_quantize_on_load(llama_fp32, tmp_path, config_kwargs):
    config = hf_kbit.KbitConfig(**config_kwargs)
    result = convert(llama_fp32, tmp_path / "out", config, max_shard_size="40KB", progress=False)
    converted, reference = load(result.out), quantize_on_load(llama_fp32, config)
    assert_same_state(converted, reference)
    assert any(isinstance(m, KbitLinear) for m in converted.modules())
    ids = torch.tensor([[1, 5, 9, 40, 7]])
    torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_bf16_tied_embeddings_match_quantize_on_load(llama_bf16_tied, tmp_path):
    config = hf_kbit.KbitConfig(bits=4)
    out = convert(llama_bf16_tied, tmp_path / "out", config, progress=False).out
    converted = load(out)
    assert_same_state(converted, quantize_on_load(llama_bf16_tied, config))
    assert converted.lm_head.weight is converted.model.embed_tokens.weight
    keys = set()
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            keys |= set(sf.keys())
    assert "lm_head.weight" not in keys  # tied: written once, like save_pretrained


def test_skip_list_without_the_tied_lm_head_converts_and_loads(llama_bf16_tied, tmp_path):
    """An explicit skip list that omits a tied LM head: the head stays full precision and tied, in the
    converted checkpoint and on quantize-on-load alike (it used to be planned as kbit and then missing)."""
    config = hf_kbit.KbitConfig(bits=4, modules_to_not_convert=["o_proj"])
    converted = load(convert(llama_bf16_tied, tmp_path / "out", config, progress=False).out)
    reference = quantize_on_load(llama_bf16_tied, config)
    assert_same_state(converted, reference)
    for model in (converted, reference):
        assert type(model.lm_head) is torch.nn.Linear
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
        assert isinstance(model.model.layers[0].mlp.down_proj, KbitLinear)


def test_dtype_override_matches_quantize_on_load(llama_fp32, tmp_path):
    config = hf_kbit.KbitConfig(bits=4)
    out = convert(llama_fp32, tmp_path / "out", config, dtype="bfloat16", progress=False).out
    converted = load(out)
    assert converted.model.embed_tokens.weight.dtype == torch.bfloat16
    assert_same_state(converted, quantize_on_load(llama_fp32, config, dtype=torch.bfloat16))


def test_generate_after_convert(llama_fp32, tmp_path):
    config = hf_kbit.KbitConfig(bits=4)
    out = convert(llama_fp32, tmp_path / "out", config, progress=False).out
    ids = torch.tensor([[1, 10, 20, 30]])
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    got = load(out).generate(ids, **kwargs)
    want = quantize_on_load(llama_fp32, config).generate(ids, **kwargs)
    assert got.shape == (1, 10)
    assert torch.equal(got, want)


def test_output_layout(llama_fp32, tmp_path):
    out = convert(llama_fp32, tmp_path / "out", hf_kbit.KbitConfig(bits=4), max_shard_size="40KB", progress=False).out
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and all(n.startswith("model-") for n in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    for shard in shards:
        with safe_open(out / shard, "pt") as sf:
            assert sorted(sf.keys()) == sorted(k for k, v in index["weight_map"].items() if v == shard)
            # one shard holds at most the limit, unless a single tensor is bigger
            sizes = [sf.get_slice(k).get_shape() for k in sf.keys()]
            assert len(sizes) == 1 or (out / shard).stat().st_size <= 40_000 + 8_192
    config = json.loads((out / "config.json").read_text())
    # the defaults resolved on the model: its Linears' blocks take offsets (KbitConfig.resolved_block_offsets:
    # format v4), so its heads are not turned (hf_kbit.head_rotation.resolve)
    assert config["quantization_config"] == hf_kbit.KbitConfig(bits=4, head_rotation=False, block_offsets=True,
                                                               format_version=4).to_dict()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        assert name in names, name
    assert not [p for p in out.parent.iterdir() if ".kbit-" in p.name]  # no temp folder left


def test_dry_run_writes_nothing_and_predicts_sizes(llama_fp32, tmp_path):
    config = hf_kbit.KbitConfig(bits=3, module_bits={"down_proj": 5})
    plan = convert(llama_fp32, tmp_path / "out", config, dry_run=True, progress=False)
    assert isinstance(plan, ConversionPlan)
    assert not (tmp_path / "out").exists()
    text = plan.describe()
    assert "bits/weight" in text and "3 bits" in text and "5 bits" in text
    result = convert(llama_fp32, tmp_path / "out", config, progress=False)
    predicted, measured = plan.stats(), result.stats
    assert predicted["size_after_bytes"] == measured["size_after_bytes"]
    assert predicted["bits_per_quantized_weight"] == pytest.approx(measured["bits_per_quantized_weight"], rel=1e-12)


# ---------------------------------------------------------------------------- safety


def test_refuses_non_empty_output(llama_fp32, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty.*overwrite"):
        convert(llama_fp32, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"


def test_overwrite_replaces_only_when_complete(llama_fp32, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(writing._ShardWriter, "flush", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        convert(llama_fp32, out, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # the old output is untouched
    monkeypatch.undo()
    convert(llama_fp32, out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_midway_leaves_nothing(llama_fp32, tmp_path, monkeypatch):
    calls = []
    real = writing._ShardWriter.add

    def add_then_fail(self, key, tensor):
        calls.append(key)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return real(self, key, tensor)

    monkeypatch.setattr(writing._ShardWriter, "add", add_then_fail)
    with pytest.raises(KeyboardInterrupt):
        convert(llama_fp32, tmp_path / "out", max_shard_size="10KB", progress=False)
    assert list(tmp_path.iterdir()) == []


KILL_SCRIPT = """
import os, signal, sys
from hf_kbit import convert as c
from hf_kbit.convert import writing
real, n = writing._ShardWriter.add, [0]
def add(self, key, tensor):
    n[0] += 1
    if n[0] == 12:  # some shards are on disk by now
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, key, tensor)
writing._ShardWriter.add = add
c.convert(sys.argv[1], sys.argv[2], max_shard_size="10KB", progress=False)
"""


def test_killed_midway_leaves_no_loadable_output(llama_fp32, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(llama_fp32), str(out)], env=subprocess_env(), capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir()]
    assert leftovers, "the kill was meant to leave a partial temp folder"
    for p in leftovers:
        assert p.name.startswith(".out.kbit-tmp-")  # hidden, clearly temporary
        assert list(p.glob("*.safetensors")), "shards were being written"
        assert not (p / "config.json").exists()  # nothing makes it look like a model
        with pytest.raises((OSError, ValueError)):
            load(p)


# ---------------------------------------------------------------------------- validation


def test_missing_folder(tmp_path):
    with pytest.raises(ConversionError, match="no such folder"):
        convert(tmp_path / "nope", tmp_path / "out")


def test_folder_without_config(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(ConversionError, match="no config.json"):
        convert(tmp_path / "src", tmp_path / "out")


def test_unknown_architecture(llama_fp32, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    config = json.loads((llama_fp32 / "config.json").read_text())
    config.update(model_type="no_such_model", architectures=["NoSuchModelForCausalLM"])
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="unsupported architecture"):
        convert(src, tmp_path / "out")


def test_pickle_only_checkpoint_is_refused(llama_fp32, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((llama_fp32 / "config.json").read_text())
    (src / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConversionError, match="safetensors only"):
        convert(src, tmp_path / "out")


def test_already_quantized_is_refused(llama_fp32, tmp_path):
    out = convert(llama_fp32, tmp_path / "kbit", progress=False).out
    with pytest.raises(ConversionError, match="already quantized"):
        convert(out, tmp_path / "again")


def test_missing_shard_is_refused(llama_fp32, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(llama_fp32, src)
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ConversionError, match="lacks shard"):
        convert(src, tmp_path / "out")


def test_output_inside_source_is_refused(llama_fp32, tmp_path):
    with pytest.raises(ConversionError, match="is the source"):
        convert(llama_fp32, llama_fp32)


def test_bad_options(llama_fp32, tmp_path):
    with pytest.raises(ConversionError, match="max_shard_size"):
        convert(llama_fp32, tmp_path / "out", max_shard_size="lots")
    with pytest.raises(ConversionError, match="dtype"):
        convert(llama_fp32, tmp_path / "out", dtype="int8", progress=False)
    with pytest.raises(TypeError, match="KbitConfig"):
        convert(llama_fp32, tmp_path / "out", {"bits": 4})
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- card and eval


def test_card_shows_only_measured_numbers(llama_fp32, tmp_path):
    result = convert(llama_fp32, tmp_path / "out", hf_kbit.KbitConfig(bits=4), progress=False)
    card = (result.out / "README.md").read_text()
    assert f"{result.stats['bits_per_quantized_weight']:.3f}" in card
    assert "Perplexity" not in card and "## Speed" not in card  # not measured, not shown
    assert "kbit" in card and "from_pretrained" in card and "transformers " in card
    from huggingface_hub import ModelCard

    data = ModelCard.load(result.out / "README.md").data
    assert data.library_name == "transformers" and "4-bit" in data.tags


def test_eval_records_perplexity(llama_fp32, tmp_path):
    result = convert(llama_fp32, tmp_path / "out", hf_kbit.KbitConfig(bits=4), eval=True, progress=False)
    ev = result.eval
    assert ev["tokens"] > 100
    assert ev["base_perplexity"] > 1 and ev["kbit_perplexity"] > 1
    card = (result.out / "README.md").read_text()
    assert f"{ev['base_perplexity']:.3f}" in card and f"{ev['kbit_perplexity']:.3f}" in card
    # the recorded number is what the written checkpoint gives
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(result.out)(convert_mod.DEFAULT_EVAL_TEXT, return_tensors="pt").input_ids
    ids = ids[:, : ev["tokens"]]
    with torch.no_grad():
        loss = load(result.out)(ids, labels=ids).loss
    assert float(torch.exp(loss)) == pytest.approx(ev["kbit_perplexity"], rel=PPL_RTOL)


# ---------------------------------------------------------------------------- MoE

MOE_CASES = [(family, layout) for family, layouts in MOE_LAYOUTS.items() for layout in layouts]
MOE_IDS = [f"{family}-{layout}" for family, layout in MOE_CASES]
PER_EXPERT_KEY = re.compile(r"\.experts\.\d+\.")


def safetensors_in(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def assert_same_files(a: Path, b: Path) -> None:
    ta, tb = safetensors_in(a), safetensors_in(b)
    assert sorted(ta) == sorted(tb)
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key


def experts_modules(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if name.endswith(".experts")}


@pytest.mark.parametrize("family, layout", MOE_CASES, ids=MOE_IDS)
def test_moe_matches_quantize_on_load(moe_checkpoint, tmp_path, family, layout):
    """Per-expert or fused experts in; out the files save_pretrained writes after quantize-on-load,
    tensor for tensor (fused packed KbitExperts tensors, the checkpoint's naming kept)."""
    src = moe_checkpoint(family, layout)
    config = hf_kbit.KbitConfig(bits=4)
    result = convert(src, tmp_path / "out", config, max_shard_size="60KB", progress=False)
    reference = quantize_on_load(src, config)
    converted = load(result.out)
    assert_same_state(converted, reference)
    experts = experts_modules(converted)
    assert experts and all(isinstance(m, KbitExperts) and m.placeholders() == [] for m in experts.values())
    reference.save_pretrained(tmp_path / "reference")
    assert_same_files(result.out, tmp_path / "reference")
    assert not any(PER_EXPERT_KEY.search(k) for k in safetensors_in(result.out))
    ids = torch.tensor([[1, 5, 9, 40, 7, 200]])
    torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=0)


# config, experts layers kept in full precision
MOE_CONFIGS = {
    "bits3-down5": (dict(bits=3, module_bits={r"experts\.down_proj": 5}), []),
    "bits2-nf-sym": (dict(bits=2, codebook="nf-sym"), []),
    "skip-experts": (dict(bits=4, modules_to_not_convert=["lm_head", "experts"]), [0, 1]),
    "skip-layer1-experts": (dict(bits=4, modules_to_not_convert=["lm_head", "model.layers.1.mlp.experts"]), [1]),
}


@pytest.mark.parametrize("config_kwargs, kept", MOE_CONFIGS.values(), ids=MOE_CONFIGS.keys())
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_module_bits_and_skips_apply_to_experts(moe_checkpoint, tmp_path, family, config_kwargs, kept):
    src = moe_checkpoint(family, "per-expert")
    config = hf_kbit.KbitConfig(**config_kwargs)
    result = convert(src, tmp_path / "out", config, progress=False)
    converted, reference = load(result.out), quantize_on_load(src, config)
    assert_same_state(converted, reference)
    float_model = load(src)
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.experts"
        module = converted.get_submodule(name)
        if layer in kept:  # the float weights, untouched
            assert not isinstance(module, KbitExperts), name
            for projection in ("gate_up_proj", "down_proj"):
                want = float_model.get_submodule(name).get_parameter(projection)
                assert torch.equal(module.get_parameter(projection), want), f"{name}.{projection}"
        else:
            assert isinstance(module, KbitExperts), name
            down_bits = 5 if "module_bits" in config_kwargs else config.bits
            assert module.bits == {"gate_up_proj": config.bits, "down_proj": down_bits}
    expected_bits = {3: 8 + 2, 5: 2} if "module_bits" in config_kwargs else {config.bits: 8 + 4 - 2 * len(kept)}
    assert result.stats["quantized_by_bits"] == expected_bits  # 8 attention Linears + the expert tensors
    assert result.stats["quantized_expert_tensors"] == 4 - 2 * len(kept)


def test_moe_shared_experts_can_be_skipped(moe_checkpoint, tmp_path):
    src = moe_checkpoint("deepseek_v3", "per-expert")
    config = hf_kbit.KbitConfig(bits=4, modules_to_not_convert=["lm_head", "shared_experts"])
    converted = load(convert(src, tmp_path / "out", config, progress=False).out)
    assert_same_state(converted, quantize_on_load(src, config))
    shared = converted.model.layers[1].mlp.shared_experts
    assert not any(isinstance(m, KbitLinear) for m in shared.modules())
    assert isinstance(converted.model.layers[1].mlp.experts, KbitExperts)


@pytest.mark.parametrize("fitting", ["absmax", "fit"])
def test_moe_streams_a_few_experts_at_a_time(moe_checkpoint, tmp_path, monkeypatch, fitting):
    """Bounded memory: each pack sees at most a chunk of experts, and only that chunk's sources
    are read before it is packed (never a whole layer, let alone the model). A fitted codebook
    first reads the chunks once more, one at a time, for the rows it is fitted on."""
    chunk_elements = 3 * 80 * 96  # 3 experts of gate_up [80, 96]; 6 of down [96, 40]
    monkeypatch.setattr(writing, "_EXPERT_CHUNK_ELEMENTS", chunk_elements)
    events = []
    real_get, real_pack = writing._SourceReader.get, writing.pack_experts_chunk

    def get(self, key, rows=None):
        tensor = real_get(self, key, rows)
        if ".experts." in key:
            events.append(("read", tensor.numel()))
        return tensor

    def pack(weight, *args, **kwargs):  # what KbitExperts.pack packs, a chunk of experts at a time here
        events.append(("pack", weight.shape[0], weight.numel()))
        return real_pack(weight, *args, **kwargs)

    monkeypatch.setattr(writing._SourceReader, "get", get)
    monkeypatch.setattr(writing, "pack_experts_chunk", pack)
    config = hf_kbit.KbitConfig(bits=4, fitting=fitting)
    for layout in ("per-expert", "fused"):
        src = moe_checkpoint("qwen3_moe", layout)
        events.clear()
        out = convert(src, tmp_path / f"{layout}-{fitting}", config, progress=False).out
        packs = [e for e in events if e[0] == "pack"]
        assert len(packs) == 2 * (3 + 2), layout  # 2 layers x (gate_up: 3+3+2 experts, down: 6+2)
        assert max(e[1] for e in packs) <= 6 and max(e[2] for e in packs) <= chunk_elements
        assert all(e[1] <= chunk_elements for e in events if e[0] == "read"), layout
        read = 0
        for event in events if fitting == "absmax" else ():
            if event[0] == "read":
                read += event[1]
            else:
                assert read == event[2], layout  # exactly the chunk's sources, read just before
                read = 0
        total_read = sum(e[1] for e in events if e[0] == "read")
        assert total_read == sum(e[2] for e in packs) * (2 if fitting == "fit" else 1), layout
        assert_same_state(load(out), quantize_on_load(src, config))


def test_moe_dry_run_and_card_report_true_sizes(moe_checkpoint, tmp_path):
    src = moe_checkpoint("qwen3_moe", "per-expert")
    config = hf_kbit.KbitConfig(bits=3, module_bits={r"experts\.down_proj": 5})
    plan = convert(src, tmp_path / "out", config, dry_run=True, progress=False)
    assert not (tmp_path / "out").exists()
    result = convert(src, tmp_path / "out", config, progress=False)
    predicted, measured = plan.stats(), result.stats
    # Independently of the plan: counted on the float model and on the files.
    float_model = load(src)
    expert_params = sum(p.numel() for n, p in float_model.named_parameters()
                        if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    linear_params = sum(m.weight.numel() for n, m in float_model.named_modules()
                        if isinstance(m, torch.nn.Linear) and n != "lm_head")
    assert predicted["quantized_expert_params"] == expert_params
    assert predicted["quantized_params"] == expert_params + linear_params
    source_bytes = sum(t.numel() * t.element_size() for t in safetensors_in(src).values())
    assert predicted["size_before_bytes"] == source_bytes
    written = safetensors_in(result.out)
    assert predicted["size_after_bytes"] == measured["size_after_bytes"] == sum(
        t.numel() * t.element_size() for t in written.values())
    packed_bytes = sum(t.numel() * t.element_size() for k, t in written.items()
                       if k.endswith(("planes", "block_scales", "row_scales", "codebook")))
    bpw = 8 * packed_bytes / (expert_params + linear_params)
    assert predicted["bits_per_quantized_weight"] == pytest.approx(bpw, rel=1e-12)
    assert measured["bits_per_quantized_weight"] == pytest.approx(bpw, rel=1e-12)
    text = plan.describe()
    share = expert_params / (expert_params + linear_params)
    assert f"MoE experts:   4 quantized tensors are fused expert weights (8 experts each, {share:.1%} of" in text
    assert f"{bpw:.3f}" in text and "3 bits" in text and "5 bits" in text
    card = (result.out / "README.md").read_text()
    assert f"{bpw:.3f}" in card and "Linear and MoE expert weights" in card
    assert f"| Quantized tensors | {measured['quantized_tensors']} of {measured['tensors']} |" in card


def test_moe_convert_then_generate(moe_checkpoint, tmp_path):
    """The MoE end-to-end path: a config-built MoE checkpoint -> convert -> from_pretrained -> generate."""
    src = moe_checkpoint("qwen3_moe", "per-expert")
    config = hf_kbit.KbitConfig(bits=4)
    out = convert(src, tmp_path / "out", config, progress=False).out
    ids = torch.tensor([[1, 10, 20, 30]])
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    model = load(out)
    assert all(isinstance(m, KbitExperts) for m in experts_modules(model).values())
    got = model.generate(ids, **kwargs)
    assert got.shape == (1, 10)
    assert torch.equal(got, quantize_on_load(src, config).generate(ids, **kwargs))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_push_pull_same_logits(moe_checkpoint, hub, tmp_path, family):
    from huggingface_hub import snapshot_download

    repo = f"me/tiny-{family}-kbit4"
    src = moe_checkpoint(family, "per-expert")
    out = convert(src, tmp_path / "out", hf_kbit.KbitConfig(bits=4), repo_id=repo, progress=False).out
    hf_kbit.hub.push_to_hub(out, repo)
    pulled = snapshot_download(repo, cache_dir=hub.cache)
    ids = torch.tensor([[1, 7, 3, 40, 41]])
    with torch.no_grad():
        pulled_model = load(pulled)
        assert all(isinstance(m, KbitExperts) for m in experts_modules(pulled_model).values())
        torch.testing.assert_close(pulled_model(ids).logits, load(out)(ids).logits, rtol=0, atol=0)


def _drop_tensor(src: Path, dst: Path, key: str, replacement: torch.Tensor | None = None) -> None:
    """Copy the checkpoint ``src`` to ``dst`` without ``key`` (or with ``replacement`` for it)."""
    import shutil

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        if key in tensors:
            del tensors[key]
            if replacement is not None:
                tensors[key] = replacement
            save_file(tensors, f, metadata={"format": "pt"})
            return
    raise AssertionError(f"{key} not in {src}")


def test_moe_missing_expert_is_refused(moe_checkpoint, tmp_path):
    src = moe_checkpoint("qwen3_moe", "per-expert")
    _drop_tensor(src, tmp_path / "src", "model.layers.1.mlp.experts.3.up_proj.weight")
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj.*lack expert\(s\) \[3\]"):
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_moe_fused_experts_of_wrong_count_are_refused(moe_checkpoint, tmp_path):
    key = "model.layers.0.mlp.experts.gate_up_proj"
    seven_experts = torch.zeros(7, 80, 96, dtype=torch.bfloat16)
    _drop_tensor(moe_checkpoint("qwen3_moe", "fused"), tmp_path / "src", key, seven_experts)
    message = rf"'{re.escape(key)}' has shape \(7, 80, 96\) but .* expects \(8, 80, 96\)"
    with pytest.raises(ConversionError, match=message):
        convert(tmp_path / "src", tmp_path / "out", progress=False)


@pytest.fixture
def llama_split_mapping(monkeypatch):
    """A conversion mapping that splits a fused checkpoint tensor ``mlp.gate_up_proj.weight`` into
    the model's ``gate_proj`` and ``up_proj`` (one-to-many, like transformers' qkv splits)."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import Chunk, WeightConverter

    conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds the cache
    monkeypatch.setitem(conversion_mapping._checkpoint_conversion_mapping_cache, "LlamaForCausalLM", [
        WeightConverter("mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(dim=0)])
    ])


def test_split_tensors_are_written_as_stored_or_refused(llama_fp32, llama_split_mapping, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(llama_fp32, src)
    tensors = safetensors_in(src)
    for f in src.glob("*.safetensors"):
        f.unlink()
    (src / "model.safetensors.index.json").unlink()
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp"
        tensors[f"{mlp}.gate_up_proj.weight"] = torch.cat(
            [tensors.pop(f"{mlp}.gate_proj.weight"), tensors.pop(f"{mlp}.up_proj.weight")]
        )
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"splits checkpoint tensor 'model\.layers\.0\.mlp\.gate_up_proj\."):
        convert(src, tmp_path / "out", progress=False)
    config = hf_kbit.KbitConfig(bits=4, modules_to_not_convert=["lm_head", "gate_proj", "up_proj"])
    out = convert(src, tmp_path / "out", config, progress=False).out
    assert "model.layers.0.mlp.gate_up_proj.weight" in safetensors_in(out)
    converted = load(out)
    assert_same_state(converted, quantize_on_load(src, config))
    assert isinstance(converted.model.layers[0].mlp.down_proj, KbitLinear)
    assert not isinstance(converted.model.layers[0].mlp.gate_proj, KbitLinear)


# ---------------------------------------------------------------------------- errors of the environment and the input


def test_custom_code_is_never_run(llama_fp32, tmp_path, monkeypatch):
    """A config.json with auto_map for a model type transformers does not know: refused, never imported,
    even for a user who would answer yes to transformers' "run the custom code?" prompt."""
    import shutil

    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    src = tmp_path / "src"
    shutil.copytree(llama_fp32, src)
    marker = tmp_path / "code-ran"
    (src / "configuration_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="kbit_test_custom", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="custom code"):
        convert(src, tmp_path / "out", progress=False)
    assert not marker.exists()


def test_safetensors_write_error_keeps_its_cause(llama_fp32, tmp_path, monkeypatch):
    """safetensors reports a full disk as SafetensorError("... (os error 28)"): it becomes the same clear error."""
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(convert_mod.OutputWriteError, match="no space left") as e:
        convert(llama_fp32, tmp_path / "out", progress=False)
    assert e.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- calibration

CALIBRATION_TEXT = (Path(__file__).parent / "tiny_models.py").read_text()  # any text the char tokenizer reads


def calibration_config(**kwargs) -> hf_kbit.KbitConfig:
    return hf_kbit.KbitConfig(calibration_data=CALIBRATION_TEXT, calibration_samples=2, calibration_seq_len=48,
                              **kwargs)


@pytest.mark.parametrize(("source", "block_offsets"), [("llama", False), ("qwen3_moe", False), ("llama", True)],
                         ids=["llama", "qwen3_moe", "llama-offsets"])
def test_calibrated_convert_writes_what_calibrated_quantize_on_load_saves(llama_fp32, moe_checkpoint, tmp_path, source,
                                                                         block_offsets):
    """Same model, text and settings, on CPU: kbit-convert with calibration writes the tensors that quantize-on-load
    with calibration saves (MoE experts calibrated too; with block offsets, int16 block records), and the card says
    it was calibrated, on how many tokens."""
    src = llama_fp32 if source == "llama" else moe_checkpoint("qwen3_moe")
    config = calibration_config(bits=3, block_offsets=block_offsets)
    result = convert(src, tmp_path / "out", config, dtype="float32", max_shard_size="40KB", progress=False)
    reference = quantize_on_load(src, config, dtype=torch.float32)
    reference.save_pretrained(tmp_path / "reference")
    assert_same_files(result.out, tmp_path / "reference")
    saved = json.loads((result.out / "config.json").read_text())["quantization_config"]
    assert saved["calibration"] == {"method": "gptq", "samples": 2, "seq_len": 48, "tokens": 96}
    assert saved["format_version"] == (4 if block_offsets else 1) and saved.get("block_offsets", False) == block_offsets
    assert "head_rotation" not in saved  # the default turns v and o only data-free (hf_kbit.head_rotation.resolve)
    card = (result.out / "README.md").read_text()
    assert "| Calibration | GPTQ-style error feedback (hf_kbit.calibration) on 96 tokens" in card
    assert "| Calibration | none (data-free) |" in (convert(src, tmp_path / "free", hf_kbit.KbitConfig(bits=3),
                                                            progress=False).out / "README.md").read_text()
    assert_same_state(load(result.out, dtype=torch.float32), reference)


def test_calibrated_dry_run_and_errors(llama_fp32, tmp_path):
    plan = convert(llama_fp32, tmp_path / "out", calibration_config(bits=3), dry_run=True)
    assert plan.quantized and "calibration:   GPTQ-style error feedback on 2 x 48 = 96 tokens" in plan.describe()
    too_much = hf_kbit.KbitConfig(bits=3, calibration_data="too short", calibration_samples=4)
    with pytest.raises(ConversionError, match="calibration_data: .*fewer than samples x seq_len"):
        convert(llama_fp32, tmp_path / "out", too_much, progress=False)
    assert not (tmp_path / "out").exists()
    record = json.loads(calibration_config(bits=3).to_json_string())
    with pytest.raises(ValueError, match="calibration_data"):
        convert(llama_fp32, tmp_path / "out", hf_kbit.KbitConfig.from_dict(record), progress=False)
