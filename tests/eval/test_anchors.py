"""Anchors against slow, obviously correct per-group loops; HQQ against RTN; bits/weight arithmetic."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from hf_kbit import format as fmt
from hf_kbit.eval import anchors

# The fast paths and the loops run the same float32 operations per element: they agree exactly.
EXACT = {"atol": 0.0, "rtol": 0.0}
# Weight SQNR floors (dB) on N(0, 1) matrices: 4-bit formats at 64-128 elements per scale reach ~20 dB.
MIN_SQNR_4BIT = {"rtn": 19.5, "nf": 20.0, "hqq": 20.5}


def sqnr_db(w: torch.Tensor, approx: torch.Tensor) -> float:
    return 10 * math.log10(float(w.square().sum() / (approx - w).square().sum()))


def rtn_loop(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per row, per group of ``group`` along K (the last one shorter): min/max, fp16 scale and zero, round."""
    out = torch.empty_like(w, dtype=torch.float32)
    levels = 2**bits - 1
    for r in range(w.shape[0]):
        for g0 in range(0, w.shape[1], group):
            x = w[r, g0 : g0 + group].float()
            lo, hi = x.min(), x.max()
            scale, zero = ((hi - lo) / levels).half().float(), lo.half().float()
            for j, v in enumerate(x):
                q = torch.clamp(torch.round((v - zero) / scale), 0, levels) if scale > 0 else torch.tensor(0.0)
                out[r, g0 + j] = q * scale + zero
    return out


def nf4_loop(w: torch.Tensor, block: int) -> torch.Tensor:
    """Per block of ``block`` elements of the flattened weight: absmax, nearest NF4 level (first of a tie)."""
    flat, levels = w.float().reshape(-1), anchors.nf4_levels()
    out = torch.empty_like(flat)
    for b0 in range(0, flat.numel(), block):
        x = flat[b0 : b0 + block]
        absmax = x.abs().max()
        for j, v in enumerate(x):
            normed = v / absmax if absmax > 0 else torch.tensor(0.0)
            out[b0 + j] = levels[int(torch.argmin((levels - normed).abs()))] * absmax
    return out.reshape(w.shape)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize(("shape", "group"), [((3, 256), 128), ((4, 200), 128), ((2, 96), 32)],
                         ids=["whole-groups", "tail-group", "group32"])
def test_rtn_matches_per_group_loop(bits, shape, group):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(bits))
    torch.testing.assert_close(anchors.rtn_fake_quantize(w, bits, group), rtn_loop(w, bits, group), **EXACT)


def test_rtn_constant_group_and_dtypes():
    w = torch.full((2, 128), 0.3, dtype=torch.bfloat16)
    out = anchors.rtn_fake_quantize(w, 4, 128)
    assert out.dtype == torch.float32 and out.shape == w.shape
    torch.testing.assert_close(out, w.float().half().float(), **EXACT)  # the zero, stored in fp16
    x = torch.randn(4, 128)
    levels = torch.unique(anchors.rtn_fake_quantize(x, 3, 128)[0])
    assert len(levels) <= 8  # one group: at most 2**3 values


@pytest.mark.parametrize(("shape", "block"), [((4, 128), 64), ((3, 100), 64), ((5, 48), 32)],
                         ids=["whole-blocks", "blocks-straddle-rows", "block32"])
def test_nf4_matches_per_block_loop(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    w[0, :5] = 0.0  # exact zeros must map to the zero level
    torch.testing.assert_close(anchors.nf4_fake_quantize(w, block), nf4_loop(w, block), **EXACT)


def test_nf4_levels_are_bitsandbytes_table_by_formula():
    levels = anchors.nf4_levels()
    assert levels.shape == (16,) and levels.dtype == torch.float32
    torch.testing.assert_close(levels, fmt.normal_float_codebook(4, zero=True), **EXACT)  # checked vs bnb in test_format
    assert levels[0] == -1 and levels[-1] == 1 and 0.0 in levels.tolist()


@pytest.mark.parametrize("method", ["rtn", "nf", "hqq"])
def test_4bit_quality_floor(method):
    if method == "hqq":
        pytest.importorskip("hqq", reason="hqq is an optional dependency (pip install hf-kbit[eval])")
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(2))
    approx, _ = anchors.Anchor(method, 4, anchors.DEFAULT_GROUP_SIZE[method]).fake_quantize(w)
    assert sqnr_db(w, approx) > MIN_SQNR_4BIT[method]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_hqq_beats_rtn_of_the_same_bits_and_group(bits):
    pytest.importorskip("hqq", reason="hqq is an optional dependency (pip install hf-kbit[eval])")
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out, stored = anchors.hqq_fake_quantize(w, bits, 64)
    assert out.dtype == torch.float32 and out.shape == w.shape and out.device == w.device
    assert sqnr_db(w.float(), out) > sqnr_db(w.float(), anchors.rtn_fake_quantize(w, bits, 64))
    groups = 64 * 512 // 64
    # HQQ's packing: 2 and 4 bits pack whole bytes; 3 bits go 10 to an int32 (rows of 64 codes, padded to 10)
    codes = {2: 64 * 512 // 4, 3: math.ceil(groups / 10) * 64 * 4, 4: 64 * 512 // 2}[bits]
    assert stored == codes + 2 * 2 * groups  # fp16 scale + fp16 zero per group


def test_hqq_refuses_groups_across_rows():
    pytest.importorskip("hqq", reason="hqq is an optional dependency (pip install hf-kbit[eval])")
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of group_size 64"):
        anchors.hqq_fake_quantize(torch.randn(4, 96), 4, 64)


def test_missing_hqq_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "hqq.core", None)  # import hqq.core now raises ImportError
    with pytest.raises(ImportError, match=r"pip install hf-kbit\[eval\]"):
        anchors.require_hqq()


def test_bits_per_weight_arithmetic():
    assert anchors.rtn_bits_per_weight(10, 4096, 4, 128) == 4 + 32 / 128
    assert anchors.rtn_bits_per_weight(10, 576, 3, 128) == 3 + 32 * 5 / 576  # 4 whole groups + a tail of 64
    assert anchors.nf4_bits_per_weight(10, 4096, 64) == 4.5
    assert anchors.nf4_bits_per_weight(3, 100, 64) == 4 + 32 * 5 / 300
    assert [anchors.hqq_bits_per_weight(10, 4096, b, 64) for b in (2, 3, 4)] == [2.5, 3.5, 4.5]
    assert anchors.Anchor("rtn", 2, 128).bits_per_weight(8, 256) == 2.25


@pytest.mark.parametrize(("method", "bits", "group", "match"), [
    ("nf", 3, 64, "nf anchors take bits in"), ("rtn", 6, 128, "rtn anchors take bits in"),
    ("hqq", 4, 12, "multiple of 8"), ("rtn", 4, 0, "group_size must be a positive int"), ("gptq", 4, 128, "one of"),
])
def test_anchor_rejects_bad_arguments(method, bits, group, match):
    with pytest.raises(ValueError, match=match):
        anchors.Anchor(method, bits, group)


def test_kbitfit_is_the_fitted_format_dequantized():
    from hf_kbit import fitting
    from hf_kbit import format as fmt

    torch.manual_seed(0)
    w = torch.randn(48, 200) * torch.rand(48, 1)
    anchor = anchors.Anchor("kbitfit", 3, fmt.BLOCK_SIZE, (("lloyd_iters", 2), ("offsets", 0)))
    approx, bits = anchor.fake_quantize(w)
    settings = fitting.DEFAULT_SETTINGS[3]
    packed = fitting.fit_quantize(w, 3, fitting.FitSettings(settings.codes_below, settings.codes_above, 2))
    assert torch.equal(approx, fmt.dequantize(*packed, 200))
    assert bits == fmt.bits_per_weight(48, 200, 3)
    absmax = fmt.dequantize(*fmt.quantize(w, fmt.make_codebook(None, 3)), fmt.make_codebook(None, 3), 200)
    assert (approx - w).square().sum() < (absmax - w).square().sum()


@pytest.mark.parametrize(("fit", "match"), [
    ((("lloyd_iter", 2),), "unknown option"), ((("codes_below", -1),), "non-negative"),
])
def test_kbitfit_rejects_bad_options(fit, match):
    with pytest.raises(ValueError, match=match):
        anchors.Anchor("kbitfit", 4, 32, fit)


def test_kbitfit_with_offsets_is_the_fitted_format_with_offsets_and_counts_their_bits():
    import dataclasses

    from hf_kbit import fitting
    from hf_kbit import format as fmt

    w = torch.randn(32, 200, generator=torch.Generator().manual_seed(0)) + 0.3
    plain = anchors.Anchor("kbitfit", 4, fmt.BLOCK_SIZE, (("offsets", 0),))
    anchor = anchors.Anchor("kbitfit", 4, fmt.BLOCK_SIZE)  # offsets by default, as KbitConfig's
    assert anchor.offsets and anchor.fit_settings() == dataclasses.replace(fitting.DEFAULT_SETTINGS[4], offsets=True)
    assert anchors.Anchor("kbitfit", 4, fmt.BLOCK_SIZE, (("offsets", 1),)).fit_settings() == anchor.fit_settings()
    approx, bits = anchor.fake_quantize(w)
    planes, records, rows, cb = fitting.fit_quantize(w, 4, anchor.fit_settings())
    assert records.dtype == fmt.RECORD_DTYPE
    assert torch.equal(approx, fmt.dequantize(planes, records, rows, cb, 200))
    # a byte per stored block: 2 row tiles x 2 K tiles x 64 blocks
    assert bits == pytest.approx(plain.bits_per_weight(32, 200) + 8 * 2 * 2 * 64 / (32 * 200))
    assert "offset per block" in anchor.describe() and "offset" not in plain.describe()
    assert (approx - w).square().sum() < (plain.fake_quantize(w)[0] - w).square().sum()


@pytest.mark.parametrize("value", [2, -1, True, 0.5])
def test_kbitfit_rejects_bad_offsets(value):
    with pytest.raises(ValueError, match="offsets must be 0"):
        anchors.Anchor("kbitfit", 4, 32, (("offsets", value),))
