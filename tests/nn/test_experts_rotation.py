"""KbitExperts with rotation (format v3): all experts of a projection share one basis and one set of sign words, the
grouped op computes in the original basis, "auto" decides per projection, and packing in chunks changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_kbit
from hf_kbit import KbitConfig, rotation
from hf_kbit import format as fmt
from hf_kbit.nn import KbitExperts
from hf_kbit.nn import experts as experts_module
from hf_kbit.nn.experts import replace_kbit_experts_with_float
from tiny_models import tiny_moe_model

# The kbit model against the same model with every KbitExperts swapped for the model's experts holding its weights
# dequantized in the original basis: float32 butterflies on x and on the weights, float32 accumulation.
LOGIT_ATOL = 1e-4
ROTATABLE = dict(hidden_size=128, moe_intermediate_size=64)  # gate_up's K = 128 and down's K = 64 may rotate
IDS = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))


def moe(family="qwen3_moe"):
    sizes = ROTATABLE if family != "gpt_oss" else dict(hidden_size=128, intermediate_size=64)
    return tiny_moe_model(family, torch.float32, **sizes)


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_rotated_experts_compute_with_their_weights_in_the_original_basis(family):
    model = hf_kbit.quantize_model(moe(family), KbitConfig(bits=4, rotation=True, rotation_seed=3))
    experts = [m for m in model.modules() if isinstance(m, KbitExperts)]
    assert experts and all(m.rotated == {"gate_up_proj": True, "down_proj": True} for m in experts)
    e = experts[0]
    assert torch.equal(e.gate_up_rotation_signs, rotation.sign_words(128, 3))
    assert torch.equal(e.down_rotation_signs, rotation.sign_words(64, 3))
    assert {"gate_up_rotation_signs", "down_rotation_signs"} <= set(e.state_dict())
    assert e.packed_shapes()["down_rotation_signs"] == (2,)
    dense = replace_kbit_experts_with_float(copy.deepcopy(model))
    torch.testing.assert_close(logits(model), logits(dense), atol=LOGIT_ATOL, rtol=0)
    n, k = e.layout.linear_shape("gate_up_proj")
    w_rot = fmt.dequantize(e.gate_up_planes, e.gate_up_block_scales, e.gate_up_row_scales, e.gate_up_codebook, k)
    want = rotation.unrotate_words(w_rot, e.gate_up_rotation_signs)
    got = e.dequantize_weight("gate_up_proj")
    assert torch.equal(got.transpose(-1, -2) if e.layout.is_transposed else got, want)


def with_outliers(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = 0.1 * torch.randn(*shape, generator=g)
    cols = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return w.scatter_(-1, cols[..., None], 4.0)


def on_the_grid(shape, seed=0):
    cb = fmt.make_codebook("nf", 4)
    w = 0.1 * cb[torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(seed))]
    w[..., :: fmt.BLOCK_SIZE] = 0.1
    return w


def test_auto_decides_per_projection_over_all_experts():
    model = moe()
    for layer in model.model.layers:
        experts = layer.mlp.experts
        with torch.no_grad():
            experts.gate_up_proj.copy_(with_outliers(experts.gate_up_proj.shape))  # rotation spreads the outliers
            experts.down_proj.copy_(on_the_grid(experts.down_proj.shape))  # already on the grid: stays
    hf_kbit.quantize_model(model, KbitConfig(bits=4, codebook="nf", fitting="absmax", rotation="auto"))
    for e in (m for m in model.modules() if isinstance(m, KbitExperts)):
        assert e.rotated == {"gate_up_proj": True, "down_proj": False}
        assert e.down_rotation_signs is None and "down_rotation_signs" not in e.state_dict()
        assert "gate_up_rotated=True" in repr(e) and "down_rotated" not in repr(e)


@pytest.mark.parametrize("rotation_choice", [True, "auto"], ids=str)
def test_packing_in_chunks_of_experts_changes_nothing(monkeypatch, rotation_choice):
    model = moe()
    experts = model.model.layers[0].mlp.experts
    whole = KbitExperts.from_experts(experts, 3, 3, rotation=rotation_choice, rotation_seed=1)
    monkeypatch.setattr(experts_module, "_QUANTIZE_CHUNK_ELEMENTS", 3 * 128 * 128)  # 3 experts of gate_up at a time
    chunked = KbitExperts.from_experts(experts, 3, 3, rotation=rotation_choice, rotation_seed=1)
    assert whole.rotated == chunked.rotated
    for name, t in whole.state_dict().items():
        assert torch.equal(t, chunked.state_dict()[name]), name


def test_rotated_projection_placeholder_needs_a_rotatable_in_features():
    layout = experts_module.ExpertsLayout(4, 96, 64, False, False)
    with pytest.raises(ValueError, match=r"KbitExperts.gate_up_proj: in_features=96 is not a multiple of 64"):
        KbitExperts(layout, rotated={"gate_up_proj": True})
    assert KbitExperts(layout, rotated={"down_proj": True}).rotated == {"gate_up_proj": False, "down_proj": True}
