"""Format v1 reference: bounds, SQNR, extremes, packing and tiling invariants."""

import hashlib
import math
import re
from pathlib import Path

import pytest
import torch

from hf_kbit import format as fmt
from hf_kbit.nn import quantize_weight

BITS = list(fmt.SUPPORTED_BITS)
SHAPES = [(1, 33), (5, 1), (17, 129), (100, 200), (768, 3000)]

# Reconstruction SQNR on N(0, 1) weights [512, 2048] with the default codebooks. Measured
# 7.3 / 14.7 / 21.0 / 26.1 dB for k = 2 / 3 / 4 / 5 (roughly 6 dB per bit beyond k = 2,
# less the E4M4 scale rounding); the floors sit ~1 dB below to absorb seed variation.
MIN_SQNR_DB = {2: 6.3, 3: 13.7, 4: 20.0, 5: 25.0}
# Relative slack on the per-element bound for float32 rounding in w / scale.
BOUND_RTOL = 1e-5


def roundtrip(w, bits, codebook=None):
    cb = fmt.make_codebook(codebook, bits)
    planes, scales, rows = quantize_weight(w, cb)
    return fmt.dequantize(planes, scales, rows, cb, w.shape[-1]), fmt.error_bound(cb, scales, rows, w.shape[-1])


def sqnr_db(w, w_hat):
    return 10 * math.log10(float(w.double().square().sum() / (w_hat - w).double().square().sum()))


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_roundtrip_within_bound(shape, bits):
    torch.manual_seed(0)
    w = torch.randn(shape)
    w_hat, bound = roundtrip(w, bits)
    assert w_hat.shape == w.shape
    excess = (w_hat - w).abs() - bound * (1 + BOUND_RTOL)
    assert float(excess.max()) <= 0, f"error exceeds bound by {float(excess.max())}"


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_sqnr_gaussian(bits):
    torch.manual_seed(0)
    w = torch.randn(512, 2048)
    w_hat, _ = roundtrip(w, bits)
    assert sqnr_db(w, w_hat) >= MIN_SQNR_DB[bits]


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("magnitude", [1e-8, 1e-4, 1.0, 1e4], ids=lambda m: f"mag{m:g}")
def test_extreme_magnitudes(magnitude, bits):
    torch.manual_seed(1)
    w = torch.randn(40, 300) * magnitude
    w[3, :] = 0.0  # an all-zero row
    w[5, 64:96] = 0.0  # an all-zero block
    w[7, 10] = magnitude * 1e4  # a single huge outlier
    w[9, :] *= 1e-6  # a row far below the others
    w_hat, bound = roundtrip(w, bits)
    assert bool(torch.isfinite(w_hat).all())
    assert float(((w_hat - w).abs() - bound * (1 + BOUND_RTOL)).max()) <= 0
    assert bool((w_hat[3] == 0).all()) and bool((w_hat[5, 64:96] == 0).all())
    # the outlier is reproduced, not clipped
    assert abs(float(w_hat[7, 10]) - float(w[7, 10])) <= float(bound[7, 10]) * (1 + BOUND_RTOL)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["max", "-max"])
def test_weight_at_float32_max_stays_finite(sign, bits):
    """31 x row_scale must not overflow: a weight at float32's max used to dequantize to NaN."""
    w = torch.randn(20, 200, generator=torch.Generator().manual_seed(0))
    w[2, 5] = sign * torch.finfo(torch.float32).max
    w[4, :] = torch.finfo(torch.float32).max / 2  # a whole row near the edge
    cb = fmt.make_codebook(None, bits)
    planes, scales, rows = quantize_weight(w, cb)
    w_hat, bound = fmt.dequantize(planes, scales, rows, cb, 200), fmt.error_bound(cb, scales, rows, 200)
    assert bool(torch.isfinite(w_hat).all())
    assert float(((w_hat - w).abs() - bound * (1 + BOUND_RTOL)).max()) <= 0
    assert bool(torch.isfinite(fmt.block_scale_values(scales, rows)).all())
    assert float(rows.max()) <= fmt.ROW_SCALE_MAX


def test_row_scale_max_is_the_float32_edge():
    top = torch.tensor(fmt.ROW_SCALE_MAX, dtype=torch.float32)
    assert bool(torch.isfinite(top * fmt.E4M4_MAX))
    assert not bool(torch.isfinite(torch.nextafter(top, torch.tensor(math.inf)) * fmt.E4M4_MAX))


def test_cuda_quantize_uses_the_same_row_scale_max():
    """csrc/kbit_params.h restates ROW_SCALE_MAX for the GPU quantize kernel; they must agree."""
    header = (Path(__file__).parents[1] / "csrc" / "kbit_params.h").read_text()
    literal = re.search(r"constexpr float kRowScaleMax = (\S+)f;", header)
    assert literal is not None and float.fromhex(literal.group(1)) == fmt.ROW_SCALE_MAX


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("tiny", [1e-44, 1e-40], ids=lambda t: f"block{t:g}")
def test_block_whose_ratio_underflows_keeps_a_scale(tiny, bits):
    """blockmax / row_scale underflowing to 0 must not give code 0 (scale 0: error above error_bound)."""
    w = torch.zeros(3, 64)
    w[0, :32] = tiny
    w[0, 40] = 3e36
    w[1, :32] = tiny  # alone in its row: row scale tiny, a normal code
    cb = fmt.make_codebook(None, bits)
    planes, scales, rows = quantize_weight(w, cb)
    codes = fmt.untile(scales)[:3, :2]
    assert int(codes[0, 0]) >= 1 and int(codes[1, 0]) >= 1 and int(codes[2, 0]) == 0  # an all-zero block keeps 0
    w_hat, bound = fmt.dequantize(planes, scales, rows, cb, 64), fmt.error_bound(cb, scales, rows, 64)
    assert float(((w_hat - w).abs() - bound * (1 + BOUND_RTOL)).max()) <= 0


# Digest of the packed bytes of seeded weights (magnitudes 1e-8 .. 1e4, zero rows and blocks, outliers)
# as format v1 has always written them: edge-case fixes must not change any ordinary weight's bytes.
ORDINARY_PACKED_SHA256 = "542f8f5105ffcb79ac772860d3ad0e219df9c68338d471a72f231c01bac301e8"


def test_ordinary_weights_pack_to_the_same_bytes():
    h = hashlib.sha256()
    for bits in BITS:
        for magnitude in (1e-8, 1.0, 1e4):
            w = torch.randn(37, 300, generator=torch.Generator().manual_seed(bits)) * magnitude
            w[3] = 0.0
            w[5, 64:96] = 0.0
            w[7, 10] = magnitude * 1e4
            w[9] *= 1e-6
            for t in fmt.quantize(w, fmt.make_codebook(None, bits)):
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    assert h.hexdigest() == ORDINARY_PACKED_SHA256


@pytest.mark.parametrize("shape", [(0, 40), (40, 0), (0, 0)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_empty_weight_roundtrip(shape):
    cb = fmt.make_codebook(None, 4)
    planes, scales, rows = quantize_weight(torch.zeros(shape), cb)
    assert tuple(planes.shape) == fmt.packed_shapes(*shape, 4)["planes"]
    w_hat = fmt.dequantize(planes, scales, rows, cb, shape[1])
    assert w_hat.shape == shape and w_hat.dtype == torch.float32
    assert fmt.error_bound(cb, scales, rows, shape[1]).shape == shape


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_raises_naming_tensor(bad):
    w = torch.randn(8, 64)
    w[2, 3] = bad
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj"):
        quantize_weight(w, fmt.make_codebook(None, 4), name="model.layers.0.mlp.up_proj")


def test_non_2d_weight_raises():
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.randn(64), fmt.make_codebook(None, 4), name="w")


def test_stacked_experts_equal_per_expert():
    torch.manual_seed(0)
    w = torch.randn(3, 40, 300)
    cb = fmt.make_codebook(None, 3)
    stacked = fmt.quantize(w, cb)
    for e in range(3):
        single = fmt.quantize(w[e], cb)
        for a, b in zip(stacked, single):
            assert torch.equal(a[e], b)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_bitplane_pack_unpack_roundtrip(bits):
    torch.manual_seed(0)
    idx = torch.randint(0, 1 << bits, (7, 32))
    assert torch.equal(fmt.unpack_bitplanes(fmt.pack_bitplanes(idx, bits)), idx)


def test_unpack_paths_agree():
    torch.manual_seed(0)
    planes = torch.randint(-(2**31), 2**31 - 1, (5, 3, 4), dtype=torch.int32)
    assert torch.equal(fmt._unpack_bitplanes_numpy(planes), fmt._unpack_bitplanes_torch(planes))


def test_bit_order_gives_adjacent_pairs_per_byte():
    """The documented contract kernels rely on: byte b of OR_j ((plane_j >> s) & 0x11111111) << j
    holds the 4-bit indices of elements 8b + 2s (low nibble) and 8b + 2s + 1 (high nibble)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 16, (32,))
    words = fmt.pack_bitplanes(idx, 4).long() & 0xFFFFFFFF
    for s in range(4):
        nib = 0
        for j in range(4):
            nib |= ((int(words[j]) >> s) & 0x11111111) << j
        for b in range(4):
            byte = (nib >> (8 * b)) & 0xFF
            assert byte & 0xF == int(idx[8 * b + 2 * s]) and byte >> 4 == int(idx[8 * b + 2 * s + 1])


def test_tile_untile_roundtrip_and_layout():
    x = torch.arange(32 * 8).reshape(32, 8)  # [n_pad, n_blocks]
    t = fmt.tile(x)
    assert t.shape == (2, 2, fmt.TILE_N, fmt.BLOCKS_PER_TILE)
    assert torch.equal(fmt.untile(t), x)
    # [nt, kt, r, q] is block kt * 4 + q of row nt * 16 + r
    assert int(t[1, 1, 3, 2]) == int(x[16 + 3, 4 + 2])


def test_packed_shapes_and_padding():
    shapes = fmt.packed_shapes(33, 200, 3)
    assert shapes["planes"] == (3, 2, 3, 16, 4)
    assert shapes["block_scales"] == (3, 2, 16, 4)
    assert shapes["row_scales"] == (33,)
    cb = fmt.make_codebook(None, 3)
    planes, scales, rows = fmt.quantize(torch.randn(33, 200), cb)
    assert tuple(planes.shape) == shapes["planes"] and planes.dtype == torch.int32
    assert tuple(scales.shape) == shapes["block_scales"] and scales.dtype == torch.uint8
    assert tuple(rows.shape) == shapes["row_scales"] and rows.dtype == torch.float32
    # padding rows are all-zero blocks
    assert int(fmt.untile(scales)[33:].max()) == 0


def test_e4m4_table():
    table = fmt.e4m4_table()
    assert table.shape == (256,) and float(table[0]) == 0.0
    assert bool((table[1:] > table[:-1]).all()), "E4M4 codes must decode monotonically"
    assert fmt.E4M4_MAX == 31.0
    assert math.isclose(float(table[1]), 2.0**-14)


def test_nf4_matches_published_table():
    # bitsandbytes' published NF4 levels (a reference point for the "nf" construction at k = 4)
    published = [-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0.0,
                 0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0]
    assert torch.allclose(fmt.normal_float_codebook(4, zero=True), torch.tensor(published), atol=1e-6)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("name", fmt.CODEBOOKS)
def test_codebooks_valid(name, bits):
    cb = fmt.make_codebook(name, bits)
    fmt.validate_codebook(cb, bits)
    assert float(cb[0]) == -1.0 and float(cb[-1]) == 1.0


def test_custom_codebook_and_errors():
    cb = fmt.make_codebook([-1.0, -0.3, 0.3, 1.0], 2)
    assert cb.dtype == torch.float32
    with pytest.raises(ValueError, match=r"strictly increasing, got 0.3.* at index 1 and -0.3.* at index 2"):
        fmt.make_codebook([-1.0, 0.3, -0.3, 1.0], 2)
    with pytest.raises(ValueError, match=r"finite and within \[-1, 1\], got nan at index 2"):
        fmt.make_codebook([-1.0, 0.3, float("nan"), 1.0], 2)
    with pytest.raises(ValueError, match=r"^KbitConfig.codebook values must be finite and within \[-1, 1\], got 1.5 "):
        fmt.make_codebook([-1.0, 0.3, 0.5, 1.5], 2, "KbitConfig.codebook")
    with pytest.raises(ValueError, match="shape"):
        fmt.make_codebook([-1.0, 1.0], 2)
    with pytest.raises(ValueError, match="codebook must be one of"):
        fmt.make_codebook("uniform", 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        fmt.make_codebook(None, 6)


def test_bits_per_weight():
    assert fmt.bits_per_weight(4096, 4096, 4) == pytest.approx(4.25, abs=0.01)
    assert fmt.bits_per_weight(4096, 4096, 2) == pytest.approx(2.25, abs=0.01)


def test_block_records_dequantize_adds_offsets():
    """int16 block records: low byte the E4M4 code, high byte the signed offset code; the decoded element is
    (codebook[index] * e4m4(code) + OFFSET_STEP * offset) * row_scale, checked element by element."""
    g = torch.Generator().manual_seed(0)
    n, k, bits = 20, 150, 3
    planes, scales, rows = fmt.quantize(torch.randn(n, k, generator=g), fmt.make_codebook(None, bits))
    offsets = torch.randint(-fmt.OFFSET_MAX, fmt.OFFSET_MAX + 1, scales.shape, generator=g)
    records = fmt.pack_records(scales.long(), offsets)
    assert records.dtype == fmt.RECORD_DTYPE
    codes_back, offsets_back = fmt.block_records(records)
    assert torch.equal(codes_back, scales.long()) and torch.equal(offsets_back, offsets)
    assert fmt.block_records(scales)[1] is None
    cb = fmt.make_codebook(None, bits)
    got = fmt.dequantize(planes, records, rows, cb, k)
    idx = fmt.unpack_indices(planes)
    codes, offs = fmt.untile(scales.long()), fmt.untile(offsets)
    table = fmt.e4m4_table()
    for r in (0, 7, 19):
        for col in (0, 31, 32, 100, 149):
            b = col // fmt.BLOCK_SIZE
            level = float(cb[idx[r, col]]) * float(table[codes[r, b]])
            want = (level + fmt.OFFSET_STEP * int(offs[r, b])) * float(rows[r])
            assert float(got[r, col]) == pytest.approx(want, rel=1e-6, abs=1e-7)
    with pytest.raises(TypeError, match="uint8 .* or int16"):
        fmt.dequantize(planes, scales.to(torch.int32), rows, cb, k)


def test_bits_per_weight_with_offsets():
    assert fmt.bits_per_weight(4096, 4096, 4, offsets=True) - fmt.bits_per_weight(4096, 4096, 4) == pytest.approx(0.25)
