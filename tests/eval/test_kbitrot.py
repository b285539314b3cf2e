"""kbitrot<k>: the fitted kbit format on the weight rotated along K, rotated back (hf_kbit.rotation)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_kbit import fitting, rotation
from hf_kbit import format as fmt
from hf_kbit.eval import anchors
from hf_kbit.eval.variants import parse_variant

# On heavy-tailed rows (Student t, 3 degrees of freedom: outliers every few blocks) rotating in
# blocks of 64 spreads each outlier over its segment; at k = 3 that gains ~2.3 dB of weight SQNR.
MIN_ROTATION_GAIN_DB_K3 = 1.0


def sqnr_db(w: torch.Tensor, approx: torch.Tensor) -> float:
    return 10 * math.log10(float(w.square().sum() / (approx - w).square().sum()))


def test_kbitrot_is_rotate_fit_dequantize_unrotate():
    torch.manual_seed(0)
    w = torch.randn(48, 200) * torch.rand(48, 1)  # K = 200: three segments of 64 and a tail of 8
    anchor = anchors.Anchor("kbitrot", 3, fmt.BLOCK_SIZE, (("block", 64), ("lloyd_iters", 2), ("seed", 5)))
    approx, bits = anchor.fake_quantize(w)
    settings = fitting.DEFAULT_SETTINGS[3]
    packed = fitting.fit_quantize(rotation.rotate(w, 64, 5), 3,
                                  fitting.FitSettings(settings.codes_below, settings.codes_above, 2))
    assert torch.equal(approx, rotation.unrotate(fmt.dequantize(*packed, 200), 64, 5))
    assert approx.dtype == torch.float32 and approx.shape == w.shape
    assert bits == fmt.bits_per_weight(48, 200, 3)  # the rotation stores nothing per weight
    assert anchor.rotation() == rotation.BlockHadamard(64, 5)


def test_kbitrot_defaults_and_description():
    anchor = anchors.Anchor("kbitrot", 4, fmt.BLOCK_SIZE)
    assert anchor.rotation() == rotation.BlockHadamard(rotation.DEFAULT_BLOCK, rotation.DEFAULT_SEED)
    assert anchor.fit_settings() == fitting.DEFAULT_SETTINGS[4]
    assert "block Hadamard (block 64, seed 0)" in anchor.describe()


def test_rotation_lowers_the_error_of_heavy_tailed_weights_at_k3():
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((32, 256))
    fit = (("lloyd_iters", 2),)
    plain, _ = anchors.Anchor("kbitfit", 3, fmt.BLOCK_SIZE, fit).fake_quantize(w)
    rotated, _ = anchors.Anchor("kbitrot", 3, fmt.BLOCK_SIZE, fit).fake_quantize(w)
    assert sqnr_db(w, rotated) > sqnr_db(w, plain) + MIN_ROTATION_GAIN_DB_K3


def test_variant_spec_carries_rotation_and_fit_options():
    spec = parse_variant("kbitrot3:block=32:seed=7:codes_below=4")
    anchor = spec.anchor()
    assert (spec.method, spec.bits) == ("kbitrot", 3)
    assert anchor.rotation() == rotation.BlockHadamard(32, 7)
    assert anchor.fit_settings().codes_below == 4


@pytest.mark.parametrize(("text", "match"), [
    ("kbitrot3:block=48", "power of two"),
    ("kbitrot3:seed=-1", "seed must be"),
    ("kbitrot3:group_size=64", "unknown option"),
    ("kbitfit3:block=64", "unknown option"),  # kbitfit has no rotation
    ("kbitrot4:lloyd_iter=2", "unknown option"),
])
def test_bad_kbitrot_specs_name_the_variant(text, match):
    with pytest.raises(ValueError, match=match):
        parse_variant(text)
