"""Data-free fitting (hf_kbit.fitting): each step against a slow reference, error never above
format.quantize's, determinism, experts, edge cases."""

import dataclasses
import math

import pytest
import torch

from hf_kbit import fitting
from hf_kbit import format as fmt

BITS = list(fmt.SUPPORTED_BITS)
# Float32 sums over a block in a different order (vectorised vs the reference's loop) may differ by
# a few ulps; a code choice may then differ only where two candidates' errors are that close.
ERROR_RTOL = 1e-5
# The decoded offset added to and taken from a weight of magnitude <= 2 (float32 rounding, twice).
OFFSET_ATOL = 1e-6


def heavy_tailed(shape, seed=0):
    """Student-t (3 degrees of freedom) weights with per-row scales: heavy tails, as real layers have."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    chi = torch.randn((*shape, 3), generator=g).square().sum(-1) / 3
    return z / chi.sqrt() * torch.rand((*shape[:-1], 1), generator=g).add(0.1)


def gaussian(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


WEIGHTS = {"gaussian": gaussian, "heavy": heavy_tailed}


def reconstruct(packed, codebook, k):
    planes, scales, rows = packed
    return fmt.dequantize(planes, scales, rows, codebook, k)


def sq_error(w, w_hat):
    return float((w.double() - w_hat.double()).square().sum())


# ---------------------------------------------------------------------------- slow references


def reference_codes(w, rows, codebook, below, above):
    """Loop over blocks and candidate codes: the least squared error; ties go to the absmax code,
    then to the larger code."""
    table = fmt.e4m4_table()
    n, k = w.shape
    n_blocks = math.ceil(k / fmt.BLOCK_SIZE)
    out = torch.zeros(n, n_blocks, dtype=torch.int64)
    for r in range(n):
        for b in range(n_blocks):
            block = w[r, b * fmt.BLOCK_SIZE : (b + 1) * fmt.BLOCK_SIZE]
            ratio = (block.abs().max() / rows[r]).reshape(1)
            absmax_code = min(int(torch.searchsorted(table, ratio)), 255)
            if absmax_code == 0:
                continue  # an all-zero block keeps code 0
            candidates = [absmax_code] + list(range(absmax_code + above, absmax_code - below - 1, -1))
            best, best_err = None, math.inf
            for c in dict.fromkeys(min(max(c, 1), 255) for c in candidates):
                scale = float(table[c]) * float(rows[r])
                err = sum(min((float(v) - float(level) * scale) ** 2 for level in codebook) for v in block)
                if err < best_err:
                    best, best_err = c, err
            out[r, b] = best
    return out


def block_error(w, codes, rows, codebook):
    """Per-block squared error of nearest-level quantization at the given codes, float64."""
    table = fmt.e4m4_table().double()
    n, k = w.shape
    err = torch.zeros(codes.shape, dtype=torch.float64)
    for r in range(n):
        for b in range(codes.shape[1]):
            block = w[r, b * fmt.BLOCK_SIZE : (b + 1) * fmt.BLOCK_SIZE].double()
            scale = table[codes[r, b]] * float(rows[r])
            levels = codebook.double() * scale
            err[r, b] = (block[:, None] - levels[None, :]).square().amin(-1).sum()
    return err


def reference_lloyd_step(w, codes, rows, codebook, row_weights=None):
    """Hand-rolled Lloyd update: per level, sum(r * s * w) / sum(r * s * s) over the elements nearest to it
    (r: the row's weight, 1 without ``row_weights``)."""
    table = fmt.e4m4_table()
    num = [0.0] * codebook.numel()
    den = [0.0] * codebook.numel()
    n, k = w.shape
    for r in range(n):
        for col in range(k):
            s = float(table[codes[r, col // fmt.BLOCK_SIZE]]) * float(rows[r])
            if s == 0:
                continue
            x = float(w[r, col]) / s
            dist = [abs(x - float(c)) for c in codebook]
            i = dist.index(min(dist))  # first of equal distances: the lower level, as format.quantize
            weight = 1.0 if row_weights is None else float(row_weights[r])
            num[i] += weight * s * float(w[r, col])
            den[i] += weight * s * s
    values = [num[i] / den[i] if den[i] > 0 else float(codebook[i]) for i in range(codebook.numel())]
    values = sorted(values)
    peak = max(abs(v) for v in values)
    return torch.tensor([v / peak for v in values], dtype=torch.float32)


# ---------------------------------------------------------------------------- code search


@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"k{b}")
@pytest.mark.parametrize("kind", sorted(WEIGHTS))
@pytest.mark.parametrize("window", [(0, 0), (6, 0), (5, 3)], ids=lambda w: f"below{w[0]}-above{w[1]}")
def test_code_search_matches_loop(bits, kind, window):
    w = WEIGHTS[kind]((6, 70), seed=bits)  # 70 = 2 blocks + a partial one
    w[2, 40:64] = 0.0  # a zero block
    rows = fitting.row_scales(w)
    cb = fmt.make_codebook(None, bits)
    got = fitting.search_block_codes(w, rows, cb, *window)
    want = reference_codes(w, rows, cb, *window)
    # Equal codes, or (float32 rounding ties) codes of equal error.
    err_got, err_want = block_error(w, got, rows, cb), block_error(w, want, rows, cb)
    assert torch.allclose(err_got, err_want, rtol=ERROR_RTOL, atol=0)
    assert float((got != want).float().mean()) <= 0.05


def test_code_search_window_zero_is_absmax_rule():
    w = heavy_tailed((33, 300))
    cb = fmt.make_codebook(None, 4)
    planes, scales, rows = fmt.quantize(w, cb)
    codes = fitting.search_block_codes(w, rows, cb, 0, 0)
    assert torch.equal(codes.to(torch.uint8), fmt.untile(scales)[:33, : codes.shape[1]])


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_quantize_fitted_without_search_is_format_quantize(bits):
    w = heavy_tailed((37, 300), seed=bits)
    cb = fmt.make_codebook(None, bits)
    for got, want in zip(fitting.quantize_fitted(w, cb, 0, 0), fmt.quantize(w, cb)):
        assert got.dtype == want.dtype and torch.equal(got, want)


# ---------------------------------------------------------------------------- Lloyd


@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"k{b}")
def test_one_lloyd_step_matches_loop(bits):
    w = heavy_tailed((5, 64), seed=bits)
    settings = fitting.FitSettings(codes_below=4, codes_above=1, lloyd_iters=1)
    got = fitting.fit_codebook(w, bits, settings)
    rows = fitting.row_scales(w)
    start = fmt.make_codebook(None, bits)
    codes = fitting.search_block_codes(w, rows, start, 4, 1)
    want = reference_lloyd_step(w, codes, rows, start)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"k{b}")
def test_weighted_lloyd_step_matches_loop(bits):
    w = heavy_tailed((6, 64), seed=bits)
    row_weights = torch.tensor([0.5, 3.0, 1.0, 0.25, 2.0, 1.5])
    settings = fitting.FitSettings(codes_below=4, codes_above=1, lloyd_iters=1)
    got = fitting.fit_codebook(w, bits, settings, row_weights=row_weights)
    rows = fitting.row_scales(w)
    start = fmt.make_codebook(None, bits)
    codes = fitting.search_block_codes(w, rows, start, 4, 1)
    want = reference_lloyd_step(w, codes, rows, start, row_weights)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(got, fitting.fit_codebook(w, bits, settings), rtol=0, atol=1e-6)  # the weights act


# Siblings' shapes as in Qwen2.5-0.5B's attention, scaled down: q has 4x the rows of k and of v.
SIBLINGS = {"q": (64, 128), "k": (16, 128), "v": (16, 128)}


def siblings(seed=0):
    return [heavy_tailed(shape, seed=seed + i) * (1 + i) for i, shape in enumerate(SIBLINGS.values())]


@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"k{b}")
def test_balanced_members_weigh_like_repeated_rows(bits):
    """Balanced members equal the plain fit on the members' rows repeated in inverse proportion to their
    counts (q once, k and v four times each): every member then has as many rows as the others."""
    settings = fitting.DEFAULT_SETTINGS[bits]
    assert settings.balance_members
    q, k, v = siblings(seed=bits)
    got = fitting.group_codebook([q, k, v], bits, settings)
    plain = dataclasses.replace(settings, balance_members=False)
    want = fitting.group_codebook([q, k.repeat(4, 1), v.repeat(4, 1)], bits, plain)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(got, fitting.group_codebook([q, k, v], bits, plain), rtol=0, atol=1e-4)


def test_balanced_members_leave_single_layers_and_absmax_alone():
    settings = fitting.DEFAULT_SETTINGS[3]
    plain = dataclasses.replace(settings, balance_members=False)
    q, k, _ = siblings()
    assert torch.equal(fitting.group_codebook([q], 3, settings), fitting.group_codebook([q], 3, plain))
    assert torch.equal(fitting.group_codebook([q, k], 3, None), fmt.make_codebook(None, 3))
    assert not fitting.DEFAULT_SETTINGS[5].balance_members  # k = 5 measured better without (fitting.DEFAULT_SETTINGS)


@pytest.mark.parametrize("row_weights", [torch.ones(5), torch.tensor([1.0, 0.0, 1.0, 1.0]), -torch.ones(4)],
                         ids=["wrong-length", "zero", "negative"])
def test_row_weights_checked(row_weights):
    with pytest.raises(ValueError, match="row_weights must be positive"):
        fitting.fit_codebook(heavy_tailed((4, 64)), 3, row_weights=row_weights)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_fitted_codebook_is_valid(bits):
    cb = fitting.fit_codebook(heavy_tailed((64, 256)), bits)
    fmt.validate_codebook(cb, bits)
    assert float(cb.abs().max()) == 1.0


def test_lloyd_lowers_error_of_a_fixed_search():
    w = heavy_tailed((128, 512))
    start = fmt.make_codebook(None, 3)
    fitted = fitting.fit_codebook(w, 3, fitting.FitSettings(codes_below=8, lloyd_iters=4))
    err = [sq_error(w, reconstruct(fitting.quantize_fitted(w, cb, 8), cb, 512)) for cb in (start, fitted)]
    assert err[1] < err[0]


# ---------------------------------------------------------------------------- never worse


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_never_worse_than_format_quantize(bits, kind):
    w = WEIGHTS[kind]((96, 384), seed=bits)
    w[7, 100] = 60 * float(w.abs().max())  # a single huge outlier
    cb = fmt.make_codebook(None, bits)
    base = sq_error(w, reconstruct(fmt.quantize(w, cb), cb, 384))
    same_codebook = sq_error(w, reconstruct(fitting.quantize_fitted(w, cb, 8, 2), cb, 384))
    planes, scales, rows, fitted = fitting.fit_quantize(w, bits)
    assert same_codebook <= base
    assert sq_error(w, reconstruct((planes, scales, rows), fitted, 384)) <= base


# ---------------------------------------------------------------------------- determinism, experts


@pytest.mark.parametrize("bits", [3, 5], ids=lambda b: f"k{b}")
def test_identical_bytes_on_repeated_calls(bits):
    w = heavy_tailed((48, 200))
    first = fitting.fit_quantize(w, bits)
    second = fitting.fit_quantize(w.clone(), bits)
    for a, b in zip(first, second):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_experts_fit_per_expert():
    w = torch.stack([heavy_tailed((40, 96), seed=e) * (e + 1) for e in range(3)])
    planes, scales, rows, cb = fitting.fit_quantize(w, 3)
    shapes = fmt.packed_shapes(40, 96, 3)
    assert planes.shape == (3, *shapes["planes"]) and scales.shape == (3, *shapes["block_scales"])
    assert rows.shape == (3, 40) and cb.shape == (3, 8)
    w_hat = fmt.dequantize(planes, scales, rows, cb, 96)
    for e in range(3):
        alone = fitting.fit_quantize(w[e], 3)
        for stacked, single in zip((planes[e], scales[e], rows[e], cb[e]), alone):
            assert torch.equal(stacked, single)
        assert torch.equal(w_hat[e], fmt.dequantize(*alone, 96))


def test_codebook_shape_checked():
    w = gaussian((2, 16, 64))
    with pytest.raises(ValueError, match="codebook"):
        fitting.quantize_fitted(w, fmt.make_codebook(None, 3).expand(3, 8), 4)


# ---------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("magnitude", [1e-8, 1e-4, 1.0, 1e4], ids=lambda m: f"mag{m:g}")
def test_edge_cases(bits, magnitude):
    w = gaussian((40, 300), seed=1) * magnitude
    w[3, :] = 0.0  # an all-zero row
    w[5, 64:96] = 0.0  # an all-zero block
    w[7, 10] = magnitude * 1e4  # a single huge outlier
    w[9, :] *= 1e-6  # a row far below the others
    planes, scales, rows, cb = fitting.fit_quantize(w, bits)
    w_hat = fmt.dequantize(planes, scales, rows, cb, 300)
    assert bool(torch.isfinite(w_hat).all())
    assert bool((w_hat[3] == 0).all()) and bool((w_hat[5, 64:96] == 0).all())
    assert bool((rows > 0).all())
    base = sq_error(w, reconstruct(fmt.quantize(w, fmt.make_codebook(None, bits)), fmt.make_codebook(None, bits), 300))
    assert sq_error(w, w_hat) <= base * (1 + ERROR_RTOL)
    # The tiny row keeps its shape rather than collapsing to zero.
    assert sq_error(w[9:10], w_hat[9:10]) < float(w[9].double().square().sum())


@pytest.mark.parametrize("shape", [(1, 1), (1, 33), (17, 1), (16, 128)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_small_and_zero_weights(shape):
    for w in (gaussian(shape), torch.zeros(shape)):
        planes, scales, rows, cb = fitting.fit_quantize(w, 4)
        fmt.validate_codebook(cb, 4)
        w_hat = fmt.dequantize(planes, scales, rows, cb, shape[1])
        assert w_hat.shape == w.shape and bool(torch.isfinite(w_hat).all())
        if not bool(w.any()):
            assert bool((w_hat == 0).all())


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="bits"):
        fitting.fit_quantize(gaussian((4, 32)), 6)
    with pytest.raises(ValueError, match="codes_below"):
        fitting.FitSettings(codes_below=-1)
    with pytest.raises(ValueError, match="2 dims"):
        fitting.fit_quantize(torch.randn(32), 4)


# ---------------------------------------------------------------------------- block offsets


def offset_grid_weight(n=32, k=200, seed=0):
    """Blocks on 16-level grids with an offset each (as a Q4_1 GGUF stores them): min + d * q."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-k // fmt.BLOCK_SIZE)
    lo = (torch.randn(n, blocks, 1, generator=g) * 0.5).expand(-1, -1, fmt.BLOCK_SIZE)
    step = (torch.rand(n, blocks, 1, generator=g) * 0.1 + 0.01).expand(-1, -1, fmt.BLOCK_SIZE)
    q = torch.randint(0, 16, (n, blocks, fmt.BLOCK_SIZE), generator=g).float()
    return (lo + step * q).reshape(n, blocks * fmt.BLOCK_SIZE)[:, :k].contiguous()


def reference_offsets(w, rows):
    """Loop over blocks: the midrange of the block's real elements in steps of OFFSET_STEP row scales, rounded as
    torch.round rounds (half to even), clamped to +-OFFSET_MAX."""
    n, k = w.shape
    out = torch.zeros(n, math.ceil(k / fmt.BLOCK_SIZE), dtype=torch.int64)
    for r in range(n):
        for b in range(out.shape[1]):
            block = w[r, b * fmt.BLOCK_SIZE : (b + 1) * fmt.BLOCK_SIZE]
            mid = (block.max() + block.min()) / 2
            code = torch.round(mid / (fmt.OFFSET_STEP * rows[r]))
            out[r, b] = int(code.clamp(-fmt.OFFSET_MAX, fmt.OFFSET_MAX))
    return out


def test_block_offsets_match_loop():
    w = offset_grid_weight()
    w[3] = 0.0  # a zero row: row scale 1, zero offsets
    w[5, :32] = 40.0  # a block far above zero: its offset clamps at OFFSET_MAX steps
    rows = fitting.row_scales(w)
    blocks = fitting._blocks(w[None])
    got = fitting.block_offsets(blocks, rows[None], fitting.element_mask(w.shape[1], blocks.shape[2], w.device))[0]
    assert torch.equal(got, reference_offsets(w, rows))
    assert not got[3].any()
    assert int(got.abs().max()) <= fmt.OFFSET_MAX


def offset_shift(offsets, rows, k):
    """The weight-space shift [N, k] of offset codes [N, blocks] under row scales [N]."""
    return (offsets.float() * fmt.OFFSET_STEP * rows[:, None]).repeat_interleave(fmt.BLOCK_SIZE, 1)[:, :k]


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_quantize_fitted_with_offsets_keeps_the_better_of_offset_and_none(bits):
    """Each block's offset is its midrange code or none, whichever quantizes it with the smaller squared error (a
    loop over blocks and candidate codes; near-ties, where float32 and float64 may disagree, accept either); its
    codes and indices are the fit of the weight less that offset, under the weight's own row scales."""
    w = offset_grid_weight(k=200)
    w[:, 64:128] = gaussian((w.shape[0], 64)) * 0.1  # zero-centred blocks, where an offset seldom pays
    cb = fmt.make_codebook(None, bits)
    planes, records, rows = fitting.quantize_fitted(w, cb, 4, 2, offsets=True, offset_choice=True)
    assert records.dtype == fmt.RECORD_DTYPE and records.shape == fmt.packed_shapes(*w.shape, bits)["block_scales"]
    assert torch.equal(rows, fitting.row_scales(w))
    codes, offsets = fmt.block_records(records)
    n_blocks = math.ceil(200 / fmt.BLOCK_SIZE)
    offsets = fmt.untile(offsets)[: w.shape[0]]
    assert not offsets[:, n_blocks:].any()  # whole padding blocks
    got = offsets[:, :n_blocks]
    mid = reference_offsets(w, rows)
    with_mid = w - offset_shift(mid, rows, 200)
    err_mid = block_error(with_mid, reference_codes(with_mid, rows, cb, 4, 2), rows, cb)
    err_none = block_error(w, reference_codes(w, rows, cb, 4, 2), rows, cb)
    want = torch.where(err_mid < err_none, mid, 0)
    decided = (err_mid - err_none).abs() > 1e-4 * (err_mid + err_none)
    assert torch.equal(got[decided], want[decided])
    assert bool(((got == mid) | (got == 0)).all())
    assert bool((got != 0).any()) and bool(((got == 0) & (mid != 0)).any())  # both choices occur
    residual = w - offset_shift(got, rows, 200)
    ref_codes = reference_codes(residual, rows, cb, 4, 2)
    assert torch.equal(fmt.untile(codes)[: w.shape[0], :n_blocks], ref_codes)
    without_offsets = fmt.dequantize(planes, codes.to(torch.uint8), rows, cb, 200)
    torch.testing.assert_close(fmt.dequantize(planes, records, rows, cb, 200) - offset_shift(got, rows, 200),
                               without_offsets, rtol=0, atol=OFFSET_ATOL)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_quantize_fitted_with_every_offset_keeps_each_midrange(bits):
    """``offset_choice=False``: every block keeps its midrange offset code (a loop over blocks), its codes are the
    search on the weight less it, and the records decode to the codes' weight plus the offsets."""
    w = offset_grid_weight(k=200)
    w[:, 64:128] = gaussian((w.shape[0], 64)) * 0.1
    cb = fmt.make_codebook(None, bits)
    planes, records, rows = fitting.quantize_fitted(w, cb, 4, 2, offsets=True, offset_choice=False)
    codes, offsets = fmt.block_records(records)
    n_blocks = math.ceil(200 / fmt.BLOCK_SIZE)
    offsets = fmt.untile(offsets)[: w.shape[0]]
    mid = reference_offsets(w, rows)
    assert torch.equal(offsets[:, :n_blocks], mid) and not offsets[:, n_blocks:].any()
    residual = w - offset_shift(mid, rows, 200)
    assert torch.equal(fmt.untile(codes)[: w.shape[0], :n_blocks], reference_codes(residual, rows, cb, 4, 2))
    torch.testing.assert_close(fmt.dequantize(planes, records, rows, cb, 200) - offset_shift(mid, rows, 200),
                               fmt.dequantize(planes, codes.to(torch.uint8), rows, cb, 200), rtol=0, atol=OFFSET_ATOL)


def test_default_offset_rule_per_k():
    """Every block's offset at k <= 4, the choice by error at k = 5 (measured in docs/format.md#block-offsets);
    quantize_fitted without offset_choice and the absmax rule with offsets follow the k's default."""
    assert [fitting.DEFAULT_SETTINGS[b].offset_choice for b in (2, 3, 4, 5)] == [False, False, False, True]
    w = offset_grid_weight(k=200)
    w[:, 64:128] = gaussian((w.shape[0], 64)) * 0.1
    for b in (4, 5):
        cb = fmt.make_codebook(None, b)
        shipped = fitting.quantize_fitted(w, cb, 4, 2, offsets=True)
        choice = fitting.DEFAULT_SETTINGS[b].offset_choice
        rule = fitting.quantize_fitted(w, cb, 4, 2, offsets=True, offset_choice=choice)
        other = fitting.quantize_fitted(w, cb, 4, 2, offsets=True, offset_choice=not choice)
        assert all(torch.equal(x, y) for x, y in zip(shipped, rule))
        assert not torch.equal(shipped[1], other[1])
    for b in (3, 5):
        want = fitting.DEFAULT_SETTINGS[b].offset_choice
        assert fitting.settings_for("absmax", b, offsets=True).offset_choice == want
        assert fitting.settings_for(None, b, offsets=True).offset_choice == want


@pytest.mark.parametrize("bits", [3, 4, 5], ids=lambda b: f"k{b}")
def test_offsets_fit_offset_grids_better(bits):
    w = offset_grid_weight(n=64, k=256)
    plain = fitting.fit_quantize(w, bits)
    with_offsets = fitting.fit_quantize(w, bits, dataclasses.replace(fitting.DEFAULT_SETTINGS[bits], offsets=True))
    err_plain = sq_error(w, fmt.dequantize(*plain[:3], plain[3], 256))
    err_offsets = sq_error(w, fmt.dequantize(*with_offsets[:3], with_offsets[3], 256))
    assert err_offsets < 0.5 * err_plain
    assert with_offsets[1].dtype == fmt.RECORD_DTYPE and plain[1].dtype == torch.uint8


def test_offsets_on_symmetric_blocks_change_little():
    """Zero-mean Gaussian blocks: offsets near 0, error no worse than a few percent of the plain fit's."""
    w = gaussian((64, 256))
    plain = fitting.fit_quantize(w, 4)
    with_offsets = fitting.fit_quantize(w, 4, dataclasses.replace(fitting.DEFAULT_SETTINGS[4], offsets=True))
    assert sq_error(w, fmt.dequantize(*with_offsets[:3], with_offsets[3], 256)) < 1.05 * sq_error(
        w, fmt.dequantize(*plain[:3], plain[3], 256))
