"""One storage per kbit module: buffers are views into it, state dicts and checkpoints are unchanged,
and a compiled forward lifts one input per module (CPU; dynamo's part of the host cost of a decode step)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import hf_kbit
from hf_kbit import KbitConfig, KbitLinear
from hf_kbit.eval.timing import cache_argument
from hf_kbit.nn import KbitExperts, KbitFusedProjections
from hf_kbit.nn.linear import FORMAT_TENSORS, KbitModule, quantize_layer
from tiny_models import tiny_dense_model

EXACT = dict(atol=0, rtol=0)  # same kernels (the reference), same tensors: equal


def _storage_views(module: KbitModule, names) -> bool:
    base = module._storage.data_ptr()
    end = base + module._storage.numel()
    return all(base <= t.data_ptr() < end for t in (module._format_sources()[n] for n in names))


def _linear(bias: bool = True) -> tuple[KbitLinear, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 48, bias=bias)
    packed = quantize_layer(linear.weight.detach(), 4)
    return KbitLinear.from_linear(linear, 4, packed=packed), packed


def test_linear_keeps_its_format_tensors_in_one_storage_and_saves_them_unchanged():
    layer, packed = _linear()
    assert layer._storage is not None and layer._storage.dtype == torch.uint8
    assert _storage_views(layer, FORMAT_TENSORS)
    state = layer.state_dict()
    assert sorted(state) == sorted([*FORMAT_TENSORS, "bias"])
    for name, expected in zip(FORMAT_TENSORS, packed):  # byte-identical, and tensors of their own (safetensors)
        assert state[name].dtype == expected.dtype and torch.equal(state[name], expected)
        assert state[name].untyped_storage().data_ptr() != layer._storage.data_ptr()
    assert sum(b.numel() * b.element_size() for b in layer.buffers()) <= layer._storage.numel()


def test_copying_into_a_buffer_writes_the_storage_and_replacing_one_drops_it():
    layer, packed = _linear()
    storage = layer._storage
    layer.load_state_dict({**layer.state_dict(), "row_scales": 2 * packed[2]})
    assert layer._storage is storage and torch.equal(layer.row_scales, 2 * packed[2])
    layer.row_scales = packed[2].clone()
    assert layer._storage is None
    x = torch.randn(3, 200)
    expected = torch.ops.kbit.mm(x, *packed, 200) + layer.bias
    torch.testing.assert_close(layer(x), expected, **EXACT)
    assert layer.pack_storage() and _storage_views(layer, FORMAT_TENSORS)
    torch.testing.assert_close(layer(x), expected, **EXACT)


def test_moves_casts_and_copies_keep_one_storage():
    layer, packed = _linear()
    layer = layer.to(torch.float16)  # casts the bias only
    assert layer.bias.dtype == torch.float16 and layer.planes.dtype == torch.int32
    assert _storage_views(layer, FORMAT_TENSORS)
    for twin in (copy.deepcopy(layer), torch.load(io.BytesIO(_saved(layer)), weights_only=False)):
        assert twin._storage is not None and _storage_views(twin, FORMAT_TENSORS)
        for name, expected in zip(FORMAT_TENSORS, packed):
            assert torch.equal(getattr(twin, name), expected)
    layer.to_empty(device="meta")
    assert layer._storage.is_meta and layer.planes.is_meta and layer.planes.shape == packed[0].shape


def _saved(module) -> bytes:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return buffer.getvalue()


def test_quantized_models_keep_one_storage_per_module():
    model = tiny_dense_model("llama", torch.float32, intermediate_size=192)
    hf_kbit.quantize_model(model, KbitConfig(bits=4))
    kbit = [m for m in model.modules() if isinstance(m, KbitModule)]
    fused = [m for m in kbit if isinstance(m, KbitFusedProjections)]
    assert fused and all(m._storage is not None for m in fused)
    for m in fused:  # the members' rows are views into the fused storage; a member has none of its own
        assert all(_storage_views(m, ("planes",)) for _ in [0])
        for member in m.members:  # and nothing of its former storage stays alive
            assert member._storage is None
            assert member.codebook.untyped_storage().nbytes() == member.codebook.nbytes
            assert m._storage.data_ptr() <= member.planes.data_ptr() < m._storage.data_ptr() + m._storage.numel()
    assert all(m._storage is not None for m in kbit if isinstance(m, KbitLinear) and m.fused_into is None)


def _graph_inputs(model) -> int:
    """Inputs dynamo lifts into the graph of one compiled decode step of ``model``."""
    from transformers import StaticCache

    inputs = []

    def backend(gm, example_inputs):
        inputs.append(sum(1 for n in gm.graph.nodes if n.op == "placeholder"))
        return gm

    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=True, **{cache_argument(model): cache})
        torch._dynamo.reset()
        step = torch.compile(model, backend=backend, fullgraph=True)
        step(input_ids=torch.zeros(1, 1, dtype=torch.long), position_ids=torch.full((1, 1), 4), use_cache=True,
             **{cache_argument(model): cache})
    torch._dynamo.reset()
    assert len(inputs) == 1
    return inputs[0]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_a_compiled_step_lifts_no_more_inputs_than_the_bf16_models(fuse):
    """Each lifted input is fetched and checked at every call of the compiled step: a kbit model lifts one
    storage per module where bf16 lifts one weight per Linear (measured on this tiny Llama, 2 layers, LM head
    bf16: 30 inputs for bf16; kbit 48 fused and 72 unfused with four buffers per module, 24 and 30 with one
    storage)."""
    model = tiny_dense_model("llama", torch.float32, intermediate_size=192)
    bf16 = _graph_inputs(model)
    hf_kbit.quantize_model(model, KbitConfig(bits=4, fuse_projections=fuse), modules_to_not_convert=["lm_head"])
    assert _graph_inputs(model) <= bf16


def test_experts_keep_one_storage():
    from tiny_models import tiny_moe_model

    model = tiny_moe_model("qwen3_moe", torch.float32)
    hf_kbit.quantize_model(model, KbitConfig(bits=4))
    experts = [m for m in model.modules() if isinstance(m, KbitExperts)]
    assert experts and all(m._storage is not None and _storage_views(m, list(m.format_layout())) for m in experts)


def test_a_rotated_layer_keeps_its_sign_words_in_its_storage():
    torch.manual_seed(0)
    layer = KbitLinear.from_linear(torch.nn.Linear(128, 48), 4, rotation=True)
    names = (*FORMAT_TENSORS, "rotation_signs")
    assert list(layer.format_layout()) == list(names) and _storage_views(layer, names)
    signs = layer.rotation_signs
    assert signs.is_contiguous() and signs.data_ptr() % 16 == 0  # kernels read it as int32 (4-byte aligned)
    x = torch.randn(3, 128)
    expected = layer(x)
    for twin in (copy.deepcopy(layer), torch.load(io.BytesIO(_saved(layer)), weights_only=False)):
        assert twin.rotated and _storage_views(twin, names)
        torch.testing.assert_close(twin(x), expected, **EXACT)
    layer = layer.to(torch.float16)  # casts the bias only; the sign words stay int32 in the one storage
    assert layer.rotation_signs.dtype == torch.int32 and torch.equal(layer.rotation_signs, signs)
    assert _storage_views(layer, names)


def test_a_compiled_step_of_a_rotated_model_lifts_no_more_inputs():
    """The sign words ride in the module's storage: rotation adds no graph input (and the compiled step runs the
    rotated ops)."""
    model = tiny_dense_model("llama", torch.float32, hidden_size=128, intermediate_size=192)
    bf16 = _graph_inputs(model)
    hf_kbit.quantize_model(model, KbitConfig(bits=4, rotation=True), modules_to_not_convert=["lm_head"])
    assert all(m.rotated for m in model.modules() if isinstance(m, (KbitLinear, KbitFusedProjections)))
    assert _graph_inputs(model) <= bf16
