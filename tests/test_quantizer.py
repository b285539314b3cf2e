"""End to end through transformers: quantize-on-load, save, reload, misuse, corrupt checkpoints."""

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_kbit
from hf_kbit import KbitConfig, KbitLinear
from hf_kbit import format as fmt
from hf_kbit.checkpoint import KbitCheckpointError
from hf_kbit.kernel_table import SUPPORTED_BITS
from tiny_models import DENSE_FAMILIES, tiny_dense_model

BITS = SUPPORTED_BITS
# Relative L2 error of the logits vs bf16 on the tiny 2-layer models (weights N(0, 0.1)).
# Per-weight relative error is 10^(-SQNR/20) = 0.43 / 0.18 / 0.09 / 0.05 for k = 2..5 and two
# layers amplify it roughly 2.5-3x; measured worst family 1.08 / 0.57 / 0.30 / 0.17.
MAX_LOGIT_REL_ERR = {2: 1.4, 3: 0.75, 4: 0.4, 5: 0.22}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """One saved bf16 folder per family, with its reference logits."""
    out = {}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for family in DENSE_FAMILIES:
        model = tiny_dense_model(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        with torch.no_grad():
            out[family] = (path, ids, model(ids).logits.float())
    return out


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", list(DENSE_FAMILIES))
def test_quantize_on_load_save_reload(family, saved_models, tmp_path):
    path, ids, ref = saved_models[family]
    errors = {}
    for bits in BITS:
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(bits=bits))
        linears = {
            n: m for n, m in model.named_modules()
            if n.rpartition(".")[2] in PROJECTIONS and not isinstance(m, hf_kbit.nn.KbitFusedProjections)
        }
        assert linears and all(isinstance(m, KbitLinear) and m.bits == bits for m in linears.values())
        assert isinstance(model.lm_head, torch.nn.Linear), "the LM head stays full precision by default"
        with torch.no_grad():
            logits = model(ids).logits.float()
        errors[bits] = rel_err(logits, ref)
        assert errors[bits] <= MAX_LOGIT_REL_ERR[bits], f"k={bits}: logits rel. error {errors[bits]:.3f}"
    assert errors[2] > errors[3] > errors[4] > errors[5], f"error must shrink with bits: {errors}"

    # save (from the last model, k=5): no full-precision projection weights, reload is bit-identical
    out = tmp_path / "kbit"
    model.save_pretrained(out)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert not [k for k in keys if k.rpartition(".")[0].rpartition(".")[2] in PROJECTIONS and k.endswith(".weight")]
    assert any(k.endswith(".planes") for k in keys)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "kbit"
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    # loaded kbit models keep one storage per module and compile generate() with hf_kbit's pass by default
    assert all(m._storage is not None for m in reloaded.modules() if isinstance(m, KbitLinear) and m.fused_into is None)
    assert hf_kbit.fusion.is_kbit_compile_config(hf_kbit.fusion.generate_compile_config(reloaded))
    assert "compile_config" not in json.loads((out / "generation_config.json").read_text())


def test_module_bits_and_modules_to_not_convert(saved_models):
    path, ids, _ = saved_models["llama"]
    cfg = KbitConfig(bits=4, module_bits={r"down_proj$": 5}, modules_to_not_convert=["lm_head", "model.layers.1.self_attn"])
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
    assert model.model.layers[0].mlp.down_proj.bits == 5
    assert model.model.layers[0].mlp.up_proj.bits == 4
    assert isinstance(model.model.layers[1].self_attn.q_proj, torch.nn.Linear)
    # a module name component excludes everything below it
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(modules_to_not_convert=["mlp"]))
    assert isinstance(model.model.layers[0].mlp.up_proj, torch.nn.Linear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, KbitLinear)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_compute_dtypes(saved_models, dtype):
    path, ids, ref = saved_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(bits=4), dtype=dtype)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == dtype
    assert rel_err(logits.float(), ref) <= MAX_LOGIT_REL_ERR[4]


@pytest.mark.parametrize("requested,config,expected", [
    (None, {}, "kbit_decode"),  # the default: kbit_decode where transformers would pick sdpa
    ("sdpa", {}, "sdpa"),  # an implementation the user names is kept
    ("eager", {}, "eager"),
    (None, {"decode_attention": False}, "sdpa"),
])
def test_attention_default_on_load(saved_models, tmp_path, requested, config, expected):
    """KbitConfig.decode_attention: quantize-on-load and the saved checkpoint's load attend with kbit_decode unless
    from_pretrained names an attention implementation; the checkpoint itself records no attention."""
    path, _, _ = saved_models["llama"]
    kwargs = {} if requested is None else {"attn_implementation": requested}
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(bits=4, **config), **kwargs)
    assert model.config._attn_implementation == expected
    assert {layer.self_attn.config._attn_implementation for layer in model.model.layers} == {expected}
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "_attn_implementation" not in saved and "attn_implementation" not in saved
    assert AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs).config._attn_implementation == expected


def test_device_map_auto_and_dequantize(saved_models):
    path, ids, ref = saved_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(bits=4), device_map="auto")
    with torch.no_grad():
        q_logits = model(ids).logits.float()
    assert rel_err(q_logits, ref) <= MAX_LOGIT_REL_ERR[4]
    model.dequantize()
    assert not any(isinstance(m, KbitLinear) for m in model.modules())
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert getattr(model.config, "quantization_config", None) is None
    with torch.no_grad():
        # same weights, now bf16 Linear: equal to the kbit forward up to bf16 rounding of W
        assert rel_err(model(ids).logits.float(), q_logits) < 0.02


def test_half_is_rejected_on_model_and_safe_on_module(saved_models):
    path, ids, _ = saved_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(bits=4), dtype=torch.float32)
    with pytest.raises(ValueError, match="half"):  # transformers refuses casting quantized models
        model.half()
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, layer.in_features)
    ref = layer(x)
    layer.half()  # a bare module may be cast: only the bias follows, the format tensors keep their dtypes
    assert layer.row_scales.dtype == torch.float32 and layer.codebook.dtype == torch.float32
    assert layer.planes.dtype == torch.int32
    out = layer(x.half())
    assert out.dtype == torch.float16 and rel_err(out.float(), ref) < 2e-3


def test_misuse_errors(saved_models):
    path, _, _ = saved_models["llama"]
    with pytest.raises(ValueError, match="dtype"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(bits=4), dtype=torch.float64)
    with pytest.raises(ValueError, match="bits"):
        KbitConfig(bits=8)
    with pytest.raises(ValueError, match="codebook"):
        KbitConfig(codebook="int4")
    layer = KbitLinear.from_linear(torch.nn.Linear(64, 32), bits=4)
    with pytest.raises(TypeError, match="input must be one of"):
        layer(torch.ones(2, 64, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="in_features=64"):
        layer(torch.ones(2, 65))


# ---------------------------------------------------------------------------- corrupt checkpoints


@pytest.fixture
def kbit_checkpoint(saved_models, tmp_path):
    path, ids, _ = saved_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(bits=3))
    out = tmp_path / "kbit"
    model.save_pretrained(out)
    return out


def _rewrite(path: Path, key: str, fn) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors[key] = fn(tensors[key])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "key, corrupt",
    [
        ("model.layers.0.self_attn.q_proj.planes", lambda t: t[:-1].clone()),
        ("model.layers.1.mlp.down_proj.planes", lambda t: t.to(torch.int64)),
        ("model.layers.0.mlp.up_proj.block_scales", lambda t: t.to(torch.int32)),
        ("model.layers.0.mlp.up_proj.row_scales", lambda t: t[:10].clone()),
        ("model.layers.0.self_attn.v_proj.codebook", lambda t: torch.cat([t, t])),
    ],
    ids=["planes-shape", "planes-dtype", "scales-dtype", "row-scales-shape", "codebook-shape"],
)
def test_corrupt_tensor_error_names_it(kbit_checkpoint, key, corrupt):
    _rewrite(kbit_checkpoint, key, corrupt)
    with pytest.raises(KbitCheckpointError, match=key.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(kbit_checkpoint)


def test_corrupt_codebook_values(kbit_checkpoint):
    key = "model.layers.0.self_attn.v_proj.codebook"
    _rewrite(kbit_checkpoint, key, lambda t: t.flip(0).contiguous())
    with pytest.raises(KbitCheckpointError, match=key.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(kbit_checkpoint)


@pytest.mark.parametrize(
    "value", [float("nan"), 0.0, -1.0, 1e38], ids=["nan", "zero", "negative", "overflows-31x"]
)
def test_corrupt_row_scale_values(kbit_checkpoint, value):
    """A row scale whose decoded block scale (up to 31 x) would overflow float32 is refused like a NaN one."""
    key = "model.layers.0.mlp.gate_proj.row_scales"

    def corrupt(t):
        t = t.clone()
        t[5] = value
        return t

    _rewrite(kbit_checkpoint, key, corrupt)
    with pytest.raises(KbitCheckpointError, match=key.replace(".", r"\.") + ".* scales"):
        AutoModelForCausalLM.from_pretrained(kbit_checkpoint)


def test_missing_tensor(kbit_checkpoint):
    tensors = load_file(kbit_checkpoint / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.row_scales"]
    save_file(tensors, kbit_checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KbitCheckpointError, match=r"model\.layers\.1\.self_attn\.o_proj\.row_scales"):
        AutoModelForCausalLM.from_pretrained(kbit_checkpoint)


def test_truncated_file_names_a_tensor(kbit_checkpoint):
    f = kbit_checkpoint / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(KbitCheckpointError, match=r"tensor '.+' .*truncated"):
        AutoModelForCausalLM.from_pretrained(kbit_checkpoint)


def test_bin_checkpoint_is_refused_saying_why(kbit_checkpoint):
    torch.save(load_file(kbit_checkpoint / "model.safetensors"), kbit_checkpoint / "pytorch_model.bin")
    (kbit_checkpoint / "model.safetensors").unlink()
    with pytest.raises(KbitCheckpointError, match=r"pytorch_model\.bin: kbit checkpoints are safetensors only"):
        AutoModelForCausalLM.from_pretrained(kbit_checkpoint)


def test_header_that_is_a_json_list_is_refused_naming_the_file(kbit_checkpoint):
    f = kbit_checkpoint / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.dumps(list(json.loads(data[8 : 8 + n]).items())).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n :])
    with pytest.raises(KbitCheckpointError, match=r"model\.safetensors: the safetensors header is a JSON array"):
        AutoModelForCausalLM.from_pretrained(kbit_checkpoint)


# ---------------------------------------------------------------------------- no silent garbage


def test_loads_without_import_hf_kbit(kbit_checkpoint):
    """An installed hf-kbit registers itself through its .pth hook: a plain transformers
    script that never imports hf_kbit still loads the right weights (here the hook is
    activated from the source tree exactly as site-packages would: site.addsitedir)."""
    repo = Path(hf_kbit.__file__).resolve().parent.parent
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(kbit_checkpoint)(ids).logits
    torch.save(ids, kbit_checkpoint / "ids.pt")
    script = f"""
import site, sys
site.addsitedir({str(repo / 'python')!r})
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(kbit_checkpoint)!r})
assert "hf_kbit" in sys.modules  # registered by the hook, not by the script
with torch.no_grad():
    torch.save(model(torch.load({str(kbit_checkpoint / 'ids.pt')!r})).logits, {str(kbit_checkpoint / 'out.pt')!r})
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    assert torch.equal(torch.load(kbit_checkpoint / "out.pt"), expected)


def _set_quantization_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(fields)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("skip", ["q_proj", "self_attn", "model.layers.1.mlp.down_proj"], ids=lambda s: s)
def test_packed_tensors_of_unconverted_module_are_refused(kbit_checkpoint, skip):
    """A config.json that keeps a module in full precision while the file holds its packed tensors
    must not load (the module's weight would be missing and randomly initialised)."""
    _set_quantization_config(kbit_checkpoint, modules_to_not_convert=["lm_head", skip])
    packed_key = r"'model\.layers\.\d\.\S+\.(planes|block_scales|row_scales|codebook)'"
    with pytest.raises(KbitCheckpointError, match=packed_key + r".*full precision.*modules_to_not_convert"):
        AutoModelForCausalLM.from_pretrained(kbit_checkpoint)


# A catastrophic regex from config.json is refused before anything is matched (it would run for hours).
MAX_REFUSAL_SECONDS = 1.0


@pytest.mark.parametrize(
    "field, value",
    [("module_bits", {"(.*)*#": 5}), ("modules_to_not_convert", ["lm_head", "(.*)*#"])],
    ids=["module_bits", "modules_to_not_convert"],
)
def test_catastrophic_regex_in_config_json_fails_fast(kbit_checkpoint, field, value):
    _set_quantization_config(kbit_checkpoint, **{field: value})
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"{field} \w* ?'\(\.\*\)\*#' has a repeat .* containing another repeat"):
        AutoModelForCausalLM.from_pretrained(kbit_checkpoint)
    assert time.perf_counter() - start < MAX_REFUSAL_SECONDS


def test_a_sibling_missing_from_the_checkpoint_is_named(tmp_path):
    """q/k/v wait for each other to share a codebook; when k_proj never arrives, q and v are still
    quantized and the error names the missing weight."""
    tiny_dense_model("llama", intermediate_size=192).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.0.self_attn.k_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KbitCheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' was never loaded"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(bits=4))


# ---------------------------------------------------------------------------- calibration


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny Llama saved with its (char-level) tokenizer: calibration takes the tokenizer from the folder."""
    from tiny_models import save_tiny_text_model

    return save_tiny_text_model(tmp_path_factory.mktemp("text_model"))


@pytest.mark.parametrize("block_offsets", [False, True], ids=["scales", "records"])
def test_calibration_on_load_is_quantize_model_of_the_unquantized_model_and_round_trips(text_model, tmp_path,
                                                                                        block_offsets):
    """from_pretrained with calibration_data loads the model unquantized, then calibrates and quantizes it: the
    bytes of quantize_model on the same unquantized model (LM head kept, as on load). Saved, it loads back as an
    ordinary kbit checkpoint with identical logits, its config.json recording the calibration. With
    block_offsets the Linears hold int16 block records (format v4)."""
    from tiny_models import TINY_TEXT

    config = KbitConfig(bits=3, calibration_data=TINY_TEXT, calibration_samples=2, calibration_seq_len=64,
                        block_offsets=block_offsets)
    model = AutoModelForCausalLM.from_pretrained(text_model, quantization_config=config, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    reference.config.name_or_path = str(text_model)  # the tokenizer comes from the folder either way
    hf_kbit.quantize_model(reference, config, ["lm_head"], progress=False)
    got, want = model.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(want) and any(key.endswith(".planes") for key in got)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key

    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["calibration"] == {"method": "gptq", "samples": 2, "seq_len": 64, "tokens": 128}
    linears = [m for m in model.modules() if isinstance(m, KbitLinear)]
    assert linears and all(m.block_offsets == block_offsets for m in linears)
    assert saved.get("block_offsets", False) == block_offsets
    assert saved["format_version"] == (fmt.OFFSETS_VERSION if block_offsets else 1)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert loaded.config.quantization_config.calibration == saved["calibration"]

    # The config of the saved checkpoint describes a calibration it cannot run again: refused, not data-free.
    with pytest.raises(ValueError, match="calibration_data"):
        AutoModelForCausalLM.from_pretrained(text_model, quantization_config=KbitConfig.from_dict(saved))
