"""fuse_projections: q/k/v and gate/up as one kbit weight each; outputs, launches, state dicts, moves, undo.

CPU only: the op's reference path computes the fused weight exactly as the members' weights
(rows are independent), so fused and unfused models agree to float32 rounding.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_kbit
from hf_kbit import KbitConfig
from hf_kbit.nn import KbitFusedProjections, KbitLinear, fuse_projections, unfuse_projections
from hf_kbit.nn import linear as linear_module
from hf_kbit.nn.fused import codebook_siblings as fusion_siblings
from tiny_models import tiny_dense_model

# Fused and unfused compute every output row with the same reference dequantize + matmul; only
# the GEMM's blocking over N may differ. Measured max |diff| 0 on these models.
LOGIT_ATOL = 1e-5
FAMILIES = ("llama", "qwen3", "mistral", "gemma3_text")


def quantized_pair(family: str):
    """(unfused, fused) float32 k=4 models of ``family`` with intermediate_size 192 (gate/up fusable)."""
    model = tiny_dense_model(family, torch.float32, intermediate_size=192)
    plain = hf_kbit.quantize_model(copy.deepcopy(model), KbitConfig(bits=4, fuse_projections=False))
    return plain, hf_kbit.quantize_model(model, KbitConfig(bits=4))


def fused_modules(model) -> dict[str, KbitFusedProjections]:
    return {n: m for n, m in model.named_modules() if isinstance(m, KbitFusedProjections)}


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_model_matches_unfused_with_one_launch_per_group(family):
    plain, fused = quantized_pair(family)
    groups = fused_modules(fused)
    assert sorted(groups) == [f"model.layers.{i}.{g}" for i in (0, 1) for g in ("mlp.gate_up_proj", "self_attn.qkv_proj")]
    assert not fused_modules(plain)
    launches = []
    hooks = [m.register_forward_hook(lambda *_, n=n: launches.append(n)) for n, m in groups.items()]
    torch.testing.assert_close(logits(fused, IDS), logits(plain, IDS), atol=LOGIT_ATOL, rtol=0)
    for hook in hooks:
        hook.remove()
    assert sorted(launches) == sorted(groups), "each fused weight runs once per forward"


def test_compiled_graph_has_one_kbit_mm_per_group():
    plain, fused = quantized_pair("llama")
    counts = {}

    def counting_backend(name):
        def backend(gm, example_inputs):
            counts[name] = sum(node.target in (torch.ops.kbit.mm, torch.ops.kbit.mm.default) for node in gm.graph.nodes)
            return gm

        return backend

    for name, model in (("plain", plain), ("fused", fused)):
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=counting_backend(name))
        torch.testing.assert_close(logits(compiled, IDS), logits(plain, IDS), atol=LOGIT_ATOL, rtol=0)
    # per layer q k v o gate up down -> qkv o gate_up down; and the LM head (quantize_model converts it)
    assert counts == {"plain": 2 * 7 + 1, "fused": 2 * 4 + 1}, counts
    torch._dynamo.reset()


def test_members_called_with_other_inputs_get_their_own_outputs():
    layer = torch.nn.Module()
    for name, n in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        setattr(layer, name, KbitLinear.from_linear(torch.nn.Linear(96, n, bias=name != "q_proj"), bits=3, fitting="absmax"))
    reference = copy.deepcopy(layer)
    assert fuse_projections(layer) == ["qkv_proj"]
    x, y = torch.randn(5, 96), torch.randn(5, 96)
    with torch.no_grad():
        # k on another input than q (as cross-attention), q twice, v out of order
        calls = [("q_proj", x), ("k_proj", y), ("q_proj", x), ("q_proj", x), ("v_proj", y), ("v_proj", x)]
        for name, inp in calls:
            torch.testing.assert_close(getattr(layer, name)(inp), getattr(reference, name)(inp), atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="input must be one of"):  # as an unfused KbitLinear says it
        layer.k_proj(x.double())
    pending = linear_module._PENDING[2]
    assert pending is None or all(p is None or p.shape[-1] in (32, 64) for p in pending)


def test_state_dict_footprint_and_save_reload_are_those_of_the_unfused_model(tmp_path):
    tiny_dense_model("qwen3", intermediate_size=192).save_pretrained(tmp_path / "bf16")
    fused = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=KbitConfig(bits=4))
    plain = AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", quantization_config=KbitConfig(bits=4, fuse_projections=False)
    )
    assert len(fused_modules(fused)) == 4 and not fused_modules(plain)
    a, b = plain.state_dict(), fused.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert fused.get_memory_footprint() == plain.get_memory_footprint()
    torch.testing.assert_close(logits(fused, IDS), logits(plain, IDS), atol=0, rtol=0)
    fused.save_pretrained(tmp_path / "kbit")  # safetensors refuses tensors that share storage: members save their own
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "kbit")
    assert len(fused_modules(reloaded)) == 4, "a pre-quantized load fuses too (the config's default)"
    assert torch.equal(logits(reloaded, IDS), logits(fused, IDS))


def test_cast_move_and_deepcopy_keep_members_as_views():
    plain, fused = quantized_pair("llama")
    original = fused
    fused = copy.deepcopy(fused).to(torch.bfloat16).to("cpu")
    group = fused.model.layers[0].self_attn.qkv_proj
    assert group.members[0] is fused.model.layers[0].self_attn.q_proj, "the copy's group serves the copy's members"
    assert group.planes.data_ptr() != original.model.layers[0].self_attn.qkv_proj.planes.data_ptr()
    for group in fused_modules(fused).values():
        for member in group.members:
            assert member.planes.untyped_storage().data_ptr() == group.planes.untyped_storage().data_ptr()
            assert member.planes.dtype == torch.int32 and member.row_scales.dtype == torch.float32
    torch.testing.assert_close(logits(fused, IDS), logits(plain.to(torch.bfloat16), IDS), atol=0, rtol=0)


def qkv_layer():
    layer = torch.nn.Module()
    for name, n in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        setattr(layer, name, KbitLinear.from_linear(torch.nn.Linear(96, n, bias=False), bits=4, fitting="absmax"))
    assert fuse_projections(layer) == ["qkv_proj"]
    return layer


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "old pickle"])
def test_a_copy_never_takes_the_originals_pending_outputs(how):
    """A copy's group has its own name in the pending slot: its k_proj, called after the original's q_proj on
    the same input, launches its own weight (here scaled by 2) instead of taking the original's slice."""
    layer = qkv_layer()
    if how == "deepcopy":
        twin = copy.deepcopy(layer)
    else:
        members = (layer.q_proj, layer.k_proj, layer.v_proj)
        links = {m: {k: m.__dict__[k] for k in ("fused_into", "fused_index", "fused_group")} for m in members}
        if how == "old pickle":  # written when the link was one tuple: (fused, index), before the group
            for member, link in links.items():
                del member.__dict__["fused_index"], member.__dict__["fused_group"]
                member.__dict__["fused_into"] = (link["fused_into"], link["fused_index"])
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        for member, link in links.items():
            member.__dict__.update(link)
        twin = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    groups = {m.fused_group for m in (twin.q_proj, twin.k_proj, twin.v_proj)}
    assert len(groups) == 1 and groups != {layer.q_proj.fused_group}
    assert [m.fused_index for m in (twin.q_proj, twin.k_proj, twin.v_proj)] == [0, 1, 2]
    assert twin.k_proj.fused_into is twin.qkv_proj
    with torch.no_grad():
        twin.qkv_proj.row_scales.mul_(2)  # the members' row scales are views of it
        x = torch.randn(3, 96)
        reference = layer.k_proj(x.clone())  # k alone: its pending siblings are for the clone, not for x
        layer.q_proj(x)  # leaves the original's k and v slices for x
        torch.testing.assert_close(twin.k_proj(x), 2 * reference, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.k_proj(x), reference, atol=1e-5, rtol=0)


def test_compiled_forward_reaches_each_fused_module_through_one_member():
    """Siblings take their slices from the module-level slot: no guard of the compiled forward goes through
    k_proj / v_proj / up_proj to the fused module (each such path cost guards at every call)."""
    _, fused = quantized_pair("llama")
    names = []

    def record(entries):
        names.extend(e.name for e in entries)
        return [True] * len(entries)

    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, options={"guard_filter_fn": record})
    logits(compiled, IDS)
    assert any("'q_proj'].fused_into." in n for n in names), "the launching member's path is guarded"
    siblings = [n for n in names if any(f"'{m}'].fused_into." in n for m in ("k_proj", "v_proj", "up_proj"))]
    assert not siblings, siblings[:5]
    torch._dynamo.reset()


def test_unfuse_restores_independent_members_and_dequantize_unfuses():
    plain, fused = quantized_pair("llama")
    with pytest.raises(RuntimeError, match="unfuse_projections"):
        fused.model.layers[0].self_attn.k_proj.load_packed(*[torch.empty(0)] * 4)
    assert len(unfuse_projections(fused)) == 4 and not fused_modules(fused)
    attn = fused.model.layers[0].self_attn
    q = attn.q_proj
    assert q.fused_into is None and q.planes.untyped_storage().data_ptr() == q._storage.data_ptr()  # its own again
    assert attn.k_proj.planes.untyped_storage().data_ptr() != q._storage.data_ptr()
    torch.testing.assert_close(logits(fused, IDS), logits(plain, IDS), atol=LOGIT_ATOL, rtol=0)

    fused = quantized_pair("llama")[1]
    hf_kbit.nn.replace_kbit_with_linear(fused)  # what model.dequantize() runs
    assert not fused_modules(fused)
    assert not [m for m in fused.modules() if isinstance(m, KbitLinear)]


def test_groups_that_cannot_fuse_are_left_alone():
    # intermediate_size 200: gate/up out_features not a multiple of 16 (rows of a partial tile)
    model = hf_kbit.quantize_model(tiny_dense_model("llama", torch.float32), KbitConfig(bits=4))
    assert sorted(fused_modules(model)) == [f"model.layers.{i}.self_attn.qkv_proj" for i in (0, 1)]
    # different bits per member
    model = tiny_dense_model("llama", torch.float32, intermediate_size=192)
    model = hf_kbit.quantize_model(model, KbitConfig(bits=4, module_bits={r"k_proj": 3}))
    assert sorted(fused_modules(model)) == [f"model.layers.{i}.mlp.gate_up_proj" for i in (0, 1)]
    assert fuse_projections(model) == [], "fusing again finds nothing new"


def test_codebook_siblings_are_complete_groups_of_equal_shape_and_bits():
    layers = {
        "a.q_proj": (96, 4), "a.k_proj": (96, 4), "a.v_proj": (96, 4), "a.o_proj": (96, 4),
        "b.q_proj": (96, 4), "b.k_proj": (96, 3), "b.v_proj": (96, 4),  # another k: each alone
        "c.gate_proj": (64, 4), "c.up_proj": (64, 4),
        "d.gate_proj": (64, 4),  # no up_proj: alone
    }
    got = fusion_siblings(layers)
    qkv, gate_up = ("a.q_proj", "a.k_proj", "a.v_proj"), ("c.gate_proj", "c.up_proj")
    assert got == {**dict.fromkeys(qkv, qkv), **dict.fromkeys(gate_up, gate_up)}


@pytest.mark.parametrize("fitting", ["fit", "absmax"])
def test_siblings_share_a_codebook_and_fuse_on_load(fitting, tmp_path):
    """Fitted codebooks are fitted per group of siblings, so quantize-on-load still fuses them, and
    quantize_model writes the same tensors."""
    model = tiny_dense_model("llama", intermediate_size=192)
    model.save_pretrained(tmp_path)
    config = KbitConfig(bits=3, fitting=fitting)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    groups = fused_modules(loaded)
    assert sorted(groups) == [f"model.layers.{i}.{g}" for i in (0, 1) for g in ("mlp.gate_up_proj", "self_attn.qkv_proj")]
    for fused in groups.values():
        assert all(torch.equal(m.codebook, fused.members[0].codebook) for m in fused.members)
    layer = loaded.model.layers[0]
    assert fitting == "absmax" or not torch.equal(layer.self_attn.q_proj.codebook, layer.self_attn.o_proj.codebook)
    in_memory = hf_kbit.quantize_model(model, config, modules_to_not_convert=["lm_head"]).state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(in_memory[key], value), key


# ---------------------------------------------------------------------------- rotation (format v3)


@pytest.mark.parametrize("rotation", [True, "auto"], ids=str)
def test_rotated_siblings_fuse_and_match_the_unfused_members(rotation):
    """q/k/v and gate/up read one x, so they share one rotation (decided per group): they fuse, the fused module
    carries their sign words, and the fused model computes what the unfused one does."""
    model = tiny_dense_model("llama", torch.float32, hidden_size=128, intermediate_size=192)
    config = dict(bits=3, rotation=rotation, modules_to_not_convert=["lm_head"])
    plain = hf_kbit.quantize_model(copy.deepcopy(model), KbitConfig(**config, fuse_projections=False))
    fused = hf_kbit.quantize_model(model, KbitConfig(**config))
    groups = fused_modules(fused)
    assert len(groups) == 4
    for name, module in groups.items():
        assert all(m.rotated == module.rotated for m in module.members)
        if module.rotated:
            assert all(torch.equal(m.rotation_signs, module.rotation_signs) for m in module.members)
            assert module.rotation_signs.data_ptr() != module.members[0].rotation_signs.data_ptr()
    if rotation is True:
        assert all(m.rotated for m in groups.values())
    torch.testing.assert_close(logits(fused, IDS), logits(plain, IDS), atol=LOGIT_ATOL, rtol=0)
    unfuse_projections(fused)
    torch.testing.assert_close(logits(fused, IDS), logits(plain, IDS), atol=LOGIT_ATOL, rtol=0)


def test_siblings_in_different_bases_do_not_fuse():
    model = tiny_dense_model("llama", torch.float32, hidden_size=128, intermediate_size=192)
    hf_kbit.quantize_model(model, KbitConfig(bits=4, rotation=True, fuse_projections=False),
                           modules_to_not_convert=["lm_head"])
    attention = model.model.layers[0].self_attn
    attention.k_proj.rotation_signs = hf_kbit.rotation.sign_words(128, 1)  # another seed: another x R
    mlp = model.model.layers[0].mlp
    mlp.up_proj.load_packed(mlp.up_proj.planes, mlp.up_proj.block_scales, mlp.up_proj.row_scales, mlp.up_proj.codebook)
    assert not mlp.up_proj.rotated
    assert fuse_projections(model) == ["model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"]


def test_fused_members_hold_their_link_as_plain_attributes():
    """No tuple in a fused member's attributes: torch 2.11's dynamo skips the guards of a module whose __dict__ is
    unchanged only when its attributes are modules, tensors and constants, and a tuple link made every decoder
    layer's guards run at every compiled call (bench_guards.py: 32 layers, 247 against 120 us per call)."""
    layer = qkv_layer()
    for index, member in enumerate((layer.q_proj, layer.k_proj, layer.v_proj)):
        assert member.fused_into is layer.qkv_proj and member.fused_index == index
        assert not [k for k, v in vars(member).items() if isinstance(v, tuple)]
