"""hf_kbit.convert: streaming conversion == quantize-on-load, bit for bit; safety; validation; card."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hf_kbit
from hf_kbit import convert as convert_mod
from hf_kbit.convert import ConversionError, ConversionPlan, convert
from hf_kbit.nn.linear import KbitLinear

from convert_helpers import llama_bf16_tied, llama_fp32, make_llama, subprocess_env  # noqa: F401

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
    assert config["quantization_config"] == hf_kbit.KbitConfig(bits=4).to_dict()
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

    monkeypatch.setattr(convert_mod._ShardWriter, "flush", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        convert(llama_fp32, out, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # the old output is untouched
    monkeypatch.undo()
    convert(llama_fp32, out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_midway_leaves_nothing(llama_fp32, tmp_path, monkeypatch):
    calls = []
    real = convert_mod._ShardWriter.add

    def add_then_fail(self, key, tensor):
        calls.append(key)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return real(self, key, tensor)

    monkeypatch.setattr(convert_mod._ShardWriter, "add", add_then_fail)
    with pytest.raises(KeyboardInterrupt):
        convert(llama_fp32, tmp_path / "out", max_shard_size="10KB", progress=False)
    assert list(tmp_path.iterdir()) == []


KILL_SCRIPT = """
import os, signal, sys
from hf_kbit import convert as c
real, n = c._ShardWriter.add, [0]
def add(self, key, tensor):
    n[0] += 1
    if n[0] == 12:  # some shards are on disk by now
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, key, tensor)
c._ShardWriter.add = add
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
    with pytest.raises(ConversionError, match="not empty"):
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
