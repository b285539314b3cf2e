"""KbitLinear: edge shapes (the model-level behaviour is covered end to end in tests/test_quantizer.py)."""

import dataclasses

import pytest
import torch
from torch import nn

from hf_kbit import KbitLinear, fitting
from hf_kbit import format as fmt
from hf_kbit.fitting import codebook_sample
from hf_kbit.nn.linear import FORMAT_TENSORS, quantize_group, quantize_layer

EMPTY_SHAPES = [(0, 8), (8, 0), (0, 0)]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # nn.Linear's own init
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("in_features, out_features", EMPTY_SHAPES, ids=[f"in{i}-out{o}" for i, o in EMPTY_SHAPES])
def test_zero_sized_linear_works_like_nn_linear(in_features, out_features, bias, dtype):
    """An empty product is zeros (plus the bias), as nn.Linear gives."""
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    if bias:
        nn.init.normal_(linear.bias)
    kbit = KbitLinear.from_linear(linear, bits=4)
    x = torch.randn(2, 3, in_features, dtype=dtype)
    out = kbit(x)
    assert out.shape == (2, 3, out_features) and out.dtype == dtype
    torch.testing.assert_close(out, linear(x), rtol=0, atol=0)
    back = kbit.to_linear(dtype)
    assert back.weight.shape == (out_features, in_features)
    torch.testing.assert_close(back(x), linear(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------- quantize_layer: KbitConfig.fitting


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) + 0.05 * torch.randn(n, k, generator=g) ** 3


@pytest.mark.parametrize("bits", [2, 3, 4, 5], ids=lambda b: f"k{b}")
def test_quantize_layer_fit_is_fitting_fit_quantize(bits):
    """The "fit" rule (the default) writes exactly what hf_kbit.fitting.fit_quantize computes."""
    w = _weight(48, 200)
    got = quantize_layer(w, bits)
    want = fitting.fit_quantize(w, bits)
    for name, a, b in zip(FORMAT_TENSORS, got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"k{b}")
def test_quantize_layer_absmax_is_format_quantize(bits):
    """The "absmax" rule is format.quantize with the configured codebook, unchanged."""
    w = _weight(40, 96)
    cb = fmt.make_codebook("nf-sym", bits)
    got = quantize_layer(w, bits, "nf-sym", "absmax")
    for name, a, b in zip(FORMAT_TENSORS, got, (*fmt.quantize(w, cb), cb)):
        assert torch.equal(a, b), name


def test_quantize_layer_samples_large_layers_every_mth_row():
    """A layer over MAX_FIT_BLOCKS blocks fits its codebook on every m-th row, as fit_codebook does."""
    settings = fitting.settings_for(None, 3)
    small = dataclasses.replace(settings, max_fit_blocks=20)
    w = _weight(64, 96)  # 64 rows x 3 blocks: m = 10
    sample = codebook_sample(w, small)
    assert torch.equal(sample, w[::10])
    assert torch.equal(fitting.layer_codebook(sample, 3, small), fitting.fit_codebook(w, 3, small))
    pieces = [codebook_sample(w[a:b], small, total_rows=64, first_row=a) for a, b in ((0, 23), (23, 41), (41, 64))]
    assert torch.equal(torch.cat(pieces), sample)


def test_quantize_layer_keeps_an_explicit_codebook():
    """Explicit levels are kept as given; "fit" then only searches the block codes."""
    levels = [-1.0, -0.4, 0.1, 1.0]
    w = _weight(32, 64)
    planes, scales, rows, cb = quantize_layer(w, 2, levels)
    assert torch.equal(cb, torch.tensor(levels))
    codes = fitting.search_block_codes(w, rows, cb, fitting.DEFAULT_SETTINGS[2].codes_below, fitting.DEFAULT_SETTINGS[2].codes_above)
    assert torch.equal(fmt.untile(scales)[: w.shape[0], : codes.shape[1]].long(), codes)


def test_from_linear_follows_fitting():
    """KbitLinear.from_linear quantizes as quantize_layer does, with either rule."""
    linear = nn.Linear(96, 40)
    for rule in ("absmax", "fit"):
        layer = KbitLinear.from_linear(linear, bits=3, fitting=rule)
        want = quantize_layer(linear.weight.detach(), 3, None, rule)
        for name, b in zip(FORMAT_TENSORS, want):
            assert torch.equal(getattr(layer, name), b), (rule, name)


def test_quantize_layer_refuses_a_bad_fitting():
    with pytest.raises(ValueError, match=r"fitting must be one of \('absmax', 'fit'\) or None, got 'gptq'"):
        quantize_layer(_weight(16, 32), 4, fitting_rule="gptq")


def test_quantize_group_is_one_weight_cut_into_members():
    """Siblings sharing a codebook are quantized as their rows stacked into one weight, with the group's codebook
    (fitting.group_codebook: the members weigh alike in its fit, not as one weight's rows would)."""
    a, b = _weight(48, 160, seed=1), _weight(32, 160, seed=2)
    settings = fitting.settings_for(None, 3)
    codebook = fitting.group_codebook([a, b], 3, settings)
    assert not torch.equal(codebook, quantize_layer(torch.cat([a, b]), 3)[3])  # balance_members acts at k = 3
    whole = fitting.quantize_fitted(torch.cat([a, b]), codebook, settings.codes_below, settings.codes_above)
    got = quantize_group([a, b], 3)
    for packed, rows in zip(got, (slice(0, 3), slice(3, 5))):  # row tiles of 16
        assert torch.equal(packed[3], codebook)
        assert torch.equal(packed[0], whole[0][rows]) and torch.equal(packed[1], whole[1][rows])
    assert torch.equal(torch.cat([got[0][2], got[1][2]]), whole[2])


# ---------------------------------------------------------------------------- rotation (format v3)

# The rotated layer's forward against x @ W_hat^T with W_hat its dequantized weight in the original basis: float32
# butterflies on x and on the reconstruction, float32 accumulation.
ROTATED_ATOL = 1e-4


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS, ids=lambda b: f"k{b}")
def test_rotated_linear_computes_in_the_original_basis(bits):
    from hf_kbit import rotation

    torch.manual_seed(bits)
    linear = nn.Linear(192, 40)
    kbit = KbitLinear.from_linear(linear, bits, rotation=True, rotation_seed=9)
    words = rotation.sign_words(192, 9)
    assert kbit.rotated and torch.equal(kbit.rotation_signs, words)
    assert "rotated=True" in repr(kbit)
    w_rot = fmt.dequantize(kbit.planes, kbit.block_scales, kbit.row_scales, kbit.codebook, 192)
    w_hat = kbit.dequantize_weight()
    torch.testing.assert_close(w_hat, rotation.unrotate_words(w_rot, words), rtol=0, atol=0)
    assert (w_hat - linear.weight).square().sum() < (w_rot - linear.weight).square().sum()  # the original basis
    x = torch.randn(3, 192)
    ref = x.double() @ w_hat.double().T + linear.bias.double()
    torch.testing.assert_close(kbit(x).double(), ref, atol=ROTATED_ATOL * float(ref.detach().abs().max()), rtol=0)
    torch.testing.assert_close(kbit.to_linear(torch.float32)(x), x @ w_hat.T + linear.bias, rtol=0, atol=1e-5)


def test_rotated_linear_state_dict_carries_the_sign_words():
    torch.manual_seed(0)
    kbit = KbitLinear.from_linear(nn.Linear(128, 32), 4, rotation=True)
    state = kbit.state_dict()
    assert state["rotation_signs"].dtype == torch.int32 and state["rotation_signs"].shape == (4,)
    assert kbit.packed_shapes()["rotation_signs"] == (4,)
    empty = KbitLinear(128, 32, bits=4, rotated=True)
    empty.load_state_dict(state)
    x = torch.randn(2, 128)
    assert empty.rotated and torch.equal(empty(x), kbit(x))
    plain = KbitLinear(128, 32, bits=4)
    assert plain.rotation_signs is None and "rotation_signs" not in plain.state_dict()
    with pytest.raises(RuntimeError, match="rotation_signs"):
        plain.load_state_dict(state)  # an unexpected key: the layer is not rotated
    plain.rotation_signs = None  # setting the sign words (or removing them) is what rotates a layer
    assert not plain.rotated


def test_layers_that_cannot_rotate_say_so():
    linear = nn.Linear(96, 16)  # whole 32-blocks, not whole 64-segments
    assert not KbitLinear.from_linear(linear, 4, rotation=True).rotated  # rotation=True skips it
    with pytest.raises(ValueError, match="in_features=96 is not a multiple of 64"):
        KbitLinear(96, 16, bits=4, rotated=True)
    kbit = KbitLinear.from_linear(linear, 4)
    packed = quantize_layer(linear.weight.detach(), 4)
    with pytest.raises(ValueError, match="in_features=96 is not a multiple of 64"):
        kbit.load_packed(*packed, torch.zeros(3, dtype=torch.int32))
