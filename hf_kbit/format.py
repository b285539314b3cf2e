"""The kbit weight format, version 4, as executable pure-PyTorch reference.

This module is the specification: every kernel is tested against it (bit-exactly for the
packed tensors, within named tolerances for matmuls). ``docs/format.md`` explains it for
people. Nothing here knows about transformers.

A weight ``W`` of shape ``[..., N, K]`` (PyTorch Linear layout, out x in; leading dims stack
experts) is stored as four tensors:

- ``planes``: int32 ``[..., N_tiles, K_tiles, bits, TILE_N, BLOCKS_PER_TILE]``. Entry
  ``[..., nt, kt, j, r, q]`` is bit-plane ``j`` of block ``kt * BLOCKS_PER_TILE + q`` of
  row ``nt * TILE_N + r``: one 32-bit word holding bit ``j`` of the 32 codebook indices of
  that block, element ``ELEMENT_OF_BIT[p]`` at bit ``p``.
- ``block_scales``: uint8 ``[..., N_tiles, K_tiles, TILE_N, BLOCKS_PER_TILE]``, E4M4 codes
  of the block absmax relative to the row scale, same tiling.
- ``row_scales``: float32 ``[..., N]``, one per output row.
- ``codebook``: float32 ``[..., 2**bits]``, sorted, within [-1, 1].

``W[n, k] ~= codebook[index] * e4m4(block_scales[block]) * row_scales[n]``.

Version 3 adds rotation: a layer may store ``W R`` instead of ``W`` (``R``: the seeded block Hadamard of
:mod:`hf_kbit.rotation`, segments of :data:`ROTATION_BLOCK` = 8 along K), quantized as above, with a fifth tensor

- ``rotation_signs``: int32 ``[K / 32]``, the signs of ``R`` (:func:`hf_kbit.rotation.sign_words`).

Only layers with K a multiple of :data:`ROTATION_MULTIPLE` rotate (:func:`rotatable`). ``x W^T = (x R) (W R)^T``,
so the ops rotate the activations; :func:`hf_kbit.rotation.unrotate_words` of the reconstruction is ``W``
again. A checkpoint with no rotated layer is version 1, unchanged. Version 2 rotated in segments of 64; it is
refused on read (:data:`UNREADABLE_VERSIONS`).

Version 4 adds block offsets: a layer's ``block_scales`` may be int16 instead of uint8, each entry a block record
whose low byte is the E4M4 code and whose high byte a signed offset code ``o`` in ``[-OFFSET_MAX, OFFSET_MAX]``; the
block's elements are then ``(codebook[index] * e4m4(code) + OFFSET_STEP * o) * row_scales[n]``
(:func:`block_records`, :func:`dequantize`; :func:`hf_kbit.fitting.block_offsets` chooses them). A checkpoint is
version 4 once a layer holds records, else version 3 with a rotated layer, else version 1 (:func:`version_of`).
"""

from __future__ import annotations

import functools
import math

import torch

from .kernel_table import SUPPORTED_BITS  # noqa: F401  (the bit widths the kernels are built for)
from .rotation import DEFAULT_BLOCK, WORD_BITS

# 3: rotated layers (rotation_signs), segments of 8; 4: block offsets (int16 block records). A checkpoint is written
# as the lowest version that describes it (version_of).
FORMAT_VERSION = 4
ROTATION_VERSION = 3  # the version of a checkpoint with a rotated layer and no block records
OFFSETS_VERSION = 4  # the version of a checkpoint with block records
# Versions this library refuses to read, with why. Version 2 stored W R with segments of 64: its layers would
# compute wrong outputs under version 3's segments of 8.
UNREADABLE_VERSIONS = {2: "rotated in segments of 64, which this library no longer runs"}
ROTATION_BLOCK = DEFAULT_BLOCK  # Hadamard segment of a rotated layer along K: 8 (3 butterfly stages)
# K of a rotated layer is a multiple of this: whole 64-element halves of a 128-column tile, so the kernels' partial
# last tile rotates all of a half or none of it.
ROTATION_MULTIPLE = 64
ROTATION_SIGNS = "rotation_signs"  # the sign words of a rotated layer (KbitExperts: "<projection>_rotation_signs")
ROTATION_SIGNS_DTYPE = torch.int32
BLOCK_SIZE = 32  # elements along K sharing one scale; also the bits of one plane word
TILE_N = 16  # rows per tile: one tensor-core m16 fragment, 16 x 16 B = 256 B per plane
BLOCKS_PER_TILE = 4  # 4 plane words = one 16-byte vector load per (row, plane)
TILE_K = BLOCK_SIZE * BLOCKS_PER_TILE

# Block offsets (module docstring): an int16 block record holds the E4M4 code (low byte) and a signed offset code
# (high byte); the offset adds OFFSET_STEP * o row scales to each element of its block. A step of 1/8 row scale spans
# +-15.9 row scales (half the top block's range) at 8 bits; on SmolLM2-135M it measured as well as a float32 step
# per row (docs/format.md#block-offsets).
OFFSET_STEP = 0.125
OFFSET_MAX = 127
RECORD_DTYPE = torch.int16

# E4M4 block scale: 4 exponent bits, 4 mantissa bits, exponent bias 11, subnormals at e = 0.
E4M4_BIAS = 11
E4M4_MANTISSA_BITS = 4


def _element_of_bit() -> torch.Tensor:
    """Bit position p = 8b + 4h + s of a plane word holds block element 8b + 2s + h.

    Why: a kernel extracts 8 four-bit indices at once with one shift and one mask per plane,
    ``((plane_j >> s) & 0x11111111) << j``; byte ``b`` of the result then holds the indices
    of elements ``8b + 2s`` and ``8b + 2s + 1`` -- two neighbours, so one 256-entry table of
    codebook value pairs and one paired activation load serve both.
    """
    p = torch.arange(BLOCK_SIZE, device="cpu")
    b, h, s = p // 8, (p % 8) // 4, p % 4
    return 8 * b + 2 * s + h


ELEMENT_OF_BIT = _element_of_bit()
BIT_OF_ELEMENT = torch.argsort(ELEMENT_OF_BIT)


def e4m4_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 256 decoded E4M4 values, float32, non-decreasing in the code (code 0 is 0.0).

    With ``device``: one cached copy per device, to be read, never written (quantizers look it up once per
    block; a fresh copy each time would be a host-to-device transfer, which waits for the GPU). Without: a
    new CPU tensor.
    """
    if device is not None:
        return _e4m4_table_on(torch.device(device))
    code = torch.arange(256, dtype=torch.int64, device="cpu")
    exponent, mantissa = code >> E4M4_MANTISSA_BITS, code & ((1 << E4M4_MANTISSA_BITS) - 1)
    frac = mantissa.double() / (1 << E4M4_MANTISSA_BITS)
    normal = (1.0 + frac) * torch.pow(2.0, (exponent - E4M4_BIAS).double())
    subnormal = frac * 2.0 ** (1 - E4M4_BIAS)
    return torch.where(exponent == 0, subnormal, normal).float()


@functools.cache
def _e4m4_table_on(device: torch.device) -> torch.Tensor:
    return e4m4_table().to(device)


E4M4_MAX = float(e4m4_table()[-1])  # 31.0


def _row_scale_max() -> float:
    """The largest float32 ``r`` with ``float32(E4M4_MAX * r)`` finite."""
    r = torch.tensor(torch.finfo(torch.float32).max / E4M4_MAX, dtype=torch.float32, device="cpu")
    while not bool(torch.isfinite(r * E4M4_MAX)):
        r = torch.nextafter(r, torch.zeros_like(r))
    return float(r)


# Row scales above this would decode a top block scale (31 x row scale) to inf; quantize clamps to
# it (only rows whose max is within ~1e-7 of float32's max reach it) and loaders refuse larger ones.
ROW_SCALE_MAX = _row_scale_max()


def rotatable(k: int) -> bool:
    """Whether a weight with ``k`` columns (in_features) may be stored rotated: K a positive multiple of
    :data:`ROTATION_MULTIPLE`, so that the Hadamard segments tile it (and the kernels' tiles hold whole halves)."""
    return k > 0 and k % ROTATION_MULTIPLE == 0


def rotation_signs_shape(k: int) -> tuple[int]:
    """Shape of the ``rotation_signs`` of a rotated weight with ``k`` columns: one int32 word per 32."""
    return (k // WORD_BITS,)


def version_of(rotated: bool, offsets: bool) -> int:
    """The format version of a checkpoint with (or without) a rotated layer and a layer holding block records."""
    return OFFSETS_VERSION if offsets else ROTATION_VERSION if rotated else 1


def padded_shape(n: int, k: int) -> tuple[int, int]:
    """Rows and columns after padding to whole tiles (padding is zeros, never visible)."""
    return math.ceil(n / TILE_N) * TILE_N, math.ceil(k / TILE_K) * TILE_K


def packed_shapes(n: int, k: int, bits: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the packed tensors of one [n, k] weight (prepend expert dims as needed)."""
    n_pad, k_pad = padded_shape(n, k)
    n_tiles, k_tiles = n_pad // TILE_N, k_pad // TILE_K
    return {
        "planes": (n_tiles, k_tiles, bits, TILE_N, BLOCKS_PER_TILE),
        "block_scales": (n_tiles, k_tiles, TILE_N, BLOCKS_PER_TILE),
        "row_scales": (n,),
        "codebook": (1 << bits,),
    }


PACKED_DTYPES = {
    "planes": torch.int32,
    "block_scales": torch.uint8,
    "row_scales": torch.float32,
    "codebook": torch.float32,
}


def packed_dtypes(offsets: bool = False) -> dict[str, torch.dtype]:
    """dtype of each of the four packed tensors: :data:`PACKED_DTYPES`, with int16 block records (``offsets``)."""
    return {**PACKED_DTYPES, **({"block_scales": RECORD_DTYPE} if offsets else {})}


def bits_per_weight(n: int, k: int, bits: int, rotated: bool = False, offsets: bool = False) -> float:
    """Stored bits per original weight element, padding, all scales, (``rotated``) the sign words and (``offsets``)
    the block records' offset bytes included."""
    shapes = packed_shapes(n, k, bits)
    dtypes = packed_dtypes(offsets)
    nbytes = sum(math.prod(s) * dtypes[name].itemsize for name, s in shapes.items())
    if rotated:
        nbytes += math.prod(rotation_signs_shape(k)) * ROTATION_SIGNS_DTYPE.itemsize
    return 8 * nbytes / (n * k)


# ---------------------------------------------------------------------------- codebooks

CODEBOOKS = ("nf", "nf-sym")


def normal_float_codebook(bits: int, zero: bool = True) -> torch.Tensor:
    """Normal-float levels for ``bits``, sorted, normalised so max |c| = 1.

    ``zero=True`` (name ``"nf"``): an exact zero, 2**(bits-1) positive and 2**(bits-1) - 1
    negative levels at normal quantiles, the construction of bitsandbytes' NF4 table
    generalised to any k (for k = 4 it reproduces that table).
    ``zero=False`` (name ``"nf-sym"``): the expected value of N(0, 1) within each of 2**bits
    equiprobable bins; symmetric, no zero.
    """
    levels = 1 << bits
    if zero:
        half = levels // 2
        # Outermost quantile: halfway between 1 - 1/(2L) and 1 - 1/(2L - 2), as NF4 does for L = 16.
        offset = 1.0 - 0.5 * (1.0 / (2 * levels) + 1.0 / (2 * levels - 2))
        pos = torch.special.ndtri(torch.linspace(offset, 0.5, half + 1, dtype=torch.float64, device="cpu")[:-1])
        neg = -torch.special.ndtri(torch.linspace(offset, 0.5, half, dtype=torch.float64, device="cpu")[:-1])
        values = torch.cat([pos, torch.zeros(1, dtype=torch.float64, device="cpu"), neg])
    else:
        edges = torch.special.ndtri(torch.linspace(0.0, 1.0, levels + 1, dtype=torch.float64, device="cpu"))
        pdf = torch.exp(-0.5 * edges.square()) / math.sqrt(2 * math.pi)
        pdf = torch.nan_to_num(pdf, nan=0.0)  # pdf(+-inf) = 0
        values = (pdf[:-1] - pdf[1:]) * levels  # E[X | bin] = (pdf(a) - pdf(b)) / P(bin)
    values = values / values.abs().max()
    return torch.sort(values).values.float()


# Chosen per k by reconstruction SQNR on real weights (scripts/choose_codebooks.py, docs/format.md).
DEFAULT_CODEBOOK = {2: "nf-sym", 3: "nf-sym", 4: "nf", 5: "nf"}


def make_codebook(codebook: str | torch.Tensor | list[float] | None, bits: int, name: str = "codebook") -> torch.Tensor:
    """Resolve a codebook name, ``None`` (the default for ``bits``) or explicit values; ``name`` is the argument's
    name in errors."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if codebook is None:
        codebook = DEFAULT_CODEBOOK[bits]
    if isinstance(codebook, str):
        if codebook not in CODEBOOKS:
            raise ValueError(f"{name} must be one of {CODEBOOKS} or a list of values, got {codebook!r}")
        return normal_float_codebook(bits, zero=codebook == "nf")
    values = torch.as_tensor(codebook, dtype=torch.float32, device="cpu").flatten()
    validate_codebook(values, bits, name)
    return values


def validate_codebook(values: torch.Tensor, bits: int, name: str = "codebook") -> None:
    """Raise ValueError unless ``values`` is a valid codebook for ``bits``."""
    if values.dtype != torch.float32 or values.shape != (1 << bits,):
        raise ValueError(
            f"{name} must be float32 of shape ({1 << bits},) for bits={bits}, "
            f"got {values.dtype} of shape {tuple(values.shape)}"
        )
    bad = ~(torch.isfinite(values) & (values.abs() <= 1.0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name} values must be finite and within [-1, 1], got {values[i].item()} at index {i}")
    rising = values[1:] > values[:-1]
    if not bool(rising.all()):
        i = int((~rising).nonzero()[0])
        raise ValueError(f"{name} values must be strictly increasing, got {values[i].item()} at index {i} and "
                         f"{values[i + 1].item()} at index {i + 1}")


# ---------------------------------------------------------------------------- bit-planes


def pack_bitplanes(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., 32] indices (element order) -> [..., bits] int32 plane words."""
    at_bit = indices.long()[..., ELEMENT_OF_BIT.to(indices.device)]
    weights = torch.pow(2, torch.arange(BLOCK_SIZE, device=indices.device, dtype=torch.int64))
    planes = [(((at_bit >> j) & 1) * weights).sum(-1) for j in range(bits)]
    words = torch.stack(planes, dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_bitplanes(planes: torch.Tensor) -> torch.Tensor:
    """[..., bits] int32 plane words -> [..., 32] int64 indices (element order)."""
    if planes.numel() == 0:  # an empty tensor cannot be viewed as bytes
        return torch.zeros(*planes.shape[:-1], BLOCK_SIZE, dtype=torch.int64, device=planes.device)
    if planes.device.type == "cpu":
        return _unpack_bitplanes_numpy(planes)
    return _unpack_bitplanes_torch(planes)


def _unpack_bitplanes_torch(planes: torch.Tensor) -> torch.Tensor:
    *lead, bits = planes.shape
    # Little-endian bytes of each word, then a 256 x 8 table of their bits: bit p = 8 * byte + t.
    as_bytes = planes.contiguous().view(torch.uint8).reshape(*lead, bits, 4)
    at_bit = _BYTE_BITS.to(planes.device)[as_bytes.long()].reshape(*lead, bits, BLOCK_SIZE)
    indices = at_bit[..., 0, :].clone()
    for j in range(1, bits):
        indices |= at_bit[..., j, :] << j
    return indices[..., BIT_OF_ELEMENT.to(planes.device)].long()


def _unpack_bitplanes_numpy(planes: torch.Tensor) -> torch.Tensor:
    # Same result as the torch version, ~7x faster on the CPU (numpy's unpackbits is vectorised).
    import numpy as np

    *lead, bits = planes.shape
    as_bytes = planes.contiguous().view(torch.uint8).reshape(*lead, bits, 4).numpy()
    at_bit = np.unpackbits(as_bytes, axis=-1, bitorder="little")  # [..., bits, 32]
    indices = at_bit[..., 0, :].copy()
    for j in range(1, bits):
        indices |= at_bit[..., j, :] << j
    return torch.from_numpy(indices[..., BIT_OF_ELEMENT.numpy()]).long()


_BYTE_BITS = ((torch.arange(256, device="cpu")[:, None] >> torch.arange(8, device="cpu")) & 1).to(torch.uint8)


# ---------------------------------------------------------------------------- tiling


def tile(per_block: torch.Tensor) -> torch.Tensor:
    """[..., N_pad, K_pad / 32] per-block data -> [..., N_tiles, K_tiles, TILE_N, BLOCKS_PER_TILE]."""
    *lead, n_pad, n_blocks = per_block.shape
    x = per_block.reshape(*lead, n_pad // TILE_N, TILE_N, n_blocks // BLOCKS_PER_TILE, BLOCKS_PER_TILE)
    return x.transpose(-3, -2).contiguous()


def untile(tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`tile`."""
    *lead, n_tiles, k_tiles, _, _ = tiled.shape
    return tiled.transpose(-3, -2).reshape(*lead, n_tiles * TILE_N, k_tiles * BLOCKS_PER_TILE)


def tile_planes(per_block: torch.Tensor) -> torch.Tensor:
    """[..., N_pad, K_pad / 32, bits] plane words -> [..., N_tiles, K_tiles, bits, TILE_N, BLOCKS_PER_TILE]."""
    return tile(per_block.movedim(-1, -3)).movedim(-5, -3).contiguous()


def untile_planes(planes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`tile_planes`."""
    return untile(planes.movedim(-3, -5)).movedim(-3, -1)


# ---------------------------------------------------------------------------- quantize


def quantize(weight: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``weight [..., N, K]`` -> ``(planes, block_scales, row_scales)``.

    The arithmetic, in float32 and in this order, is part of the format (the GPU quantize
    kernel reproduces it bit for bit):

    1. ``row_scale = min(nextafter(rowmax / 31, inf), ROW_SCALE_MAX)`` (``1.0`` for an
       all-zero row), so every block ratio below is <= 31 and encodes without clipping, and
       ``31 * row_scale`` is finite (at float32's edge the top block clips by a few ulp).
    2. ``ratio = blockmax / row_scale``; the block code is the *smallest* E4M4 code whose
       value is >= ratio (round up, so ``|w| / scale <= 1``), clamped to 255, and at least 1
       for a block that is not all zeros (its ratio may underflow to 0).
    3. ``scale = e4m4(code) * row_scale``; ``x = w / scale`` (``0`` where ``scale == 0``).
    4. index = number of codebook midpoints ``(c[i] + c[i+1]) / 2`` strictly below ``x``
       (nearest level, ties to the lower one).
    Padding rows/columns are zeros.
    """
    *lead, n, k = weight.shape
    bits = int(codebook.numel()).bit_length() - 1
    n_pad, k_pad = padded_shape(n, k)
    w = weight.float()
    row_scale = row_scales(w)

    w = torch.nn.functional.pad(w, (0, k_pad - k, 0, n_pad - n))
    blocks = w.reshape(*lead, n_pad, k_pad // BLOCK_SIZE, BLOCK_SIZE)
    rs = torch.nn.functional.pad(row_scale, (0, n_pad - n), value=1.0)[..., None]  # [..., n_pad, 1]
    table = e4m4_table(w.device)
    codes = absmax_codes(blocks, rs[..., 0])
    scale = table[codes] * rs
    x = torch.where(scale[..., None] > 0, blocks / scale[..., None], torch.zeros_like(blocks))
    cb = codebook.to(device=w.device, dtype=torch.float32)
    mids = (cb[1:] + cb[:-1]) / 2
    indices = torch.searchsorted(mids, x.contiguous(), right=False)

    planes = tile_planes(pack_bitplanes(indices, bits))
    block_scales = tile(codes.to(torch.uint8))
    return planes, block_scales, row_scale.contiguous()


def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """Step 1 of :func:`quantize`: float32 row scales ``[..., N]`` of ``weight [..., N, K]``."""
    w = weight.float()
    rowmax = w.abs().amax(-1) if w.shape[-1] > 0 else torch.zeros(w.shape[:-1], device=w.device)
    # The division on the CPU whatever the weight's device: CUDA divides by a scalar through its
    # reciprocal, which rounds differently; N values are cheap to move.
    rowmax = rowmax.cpu()
    row_scale = torch.where(rowmax > 0, rowmax / E4M4_MAX, torch.ones_like(rowmax))
    row_scale = torch.where(rowmax > 0, torch.nextafter(row_scale, torch.full_like(row_scale, math.inf)), row_scale)
    return row_scale.clamp(max=ROW_SCALE_MAX).to(w.device)


def absmax_codes(blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Step 2 of :func:`quantize`: int64 E4M4 codes ``[..., N, B]`` of ``blocks [..., N, B, 32]`` under row
    scales ``rows [..., N]``."""
    table = e4m4_table(blocks.device)
    blockmax = blocks.abs().amax(-1)
    codes = torch.searchsorted(table, (blockmax / rows[..., None]).contiguous()).clamp_(max=255)
    return torch.where(blockmax > 0, codes.clamp(min=1), codes)  # code 0 would zero a non-zero block


def unpack_indices(planes: torch.Tensor) -> torch.Tensor:
    """planes [..., nt, kt, bits, 16, 4] -> indices [..., N_pad, K_pad] int64."""
    return unpack_bitplanes(untile_planes(planes)).flatten(-2)


def block_records(block_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``block_scales`` (tiled) -> int64 ``(E4M4 codes, offset codes)``, still tiled; the offsets are None for
    uint8 scales (no offsets) and the high byte of int16 records (module docstring)."""
    if block_scales.dtype == torch.uint8:
        return block_scales.long(), None
    if block_scales.dtype != RECORD_DTYPE:
        raise TypeError(f"block_scales must be uint8 (E4M4 codes) or int16 (block records), got {block_scales.dtype}")
    records = block_scales.long()
    return records & 0xFF, records >> 8


def pack_records(codes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """E4M4 ``codes`` (0..255) and offset codes (``[-OFFSET_MAX, OFFSET_MAX]``) of the same shape -> int16 block
    records (module docstring)."""
    return (codes.long() | (offsets.long() << 8)).to(RECORD_DTYPE)


def block_scale_values(block_scales: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """Decoded per-block scales ``e4m4(code) * row_scale``, [..., N, K_pad / 32] float32."""
    n = row_scales.shape[-1]
    codes = untile(block_records(block_scales)[0])[..., :n, :]
    return e4m4_table(codes.device)[codes] * row_scales[..., None]


def block_offset_values(block_scales: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor | None:
    """Decoded per-block offsets ``OFFSET_STEP * o * row_scale``, [..., N, K_pad / 32] float32; None without them."""
    offsets = block_records(block_scales)[1]
    if offsets is None:
        return None
    n = row_scales.shape[-1]
    return untile(offsets)[..., :n, :].float() * OFFSET_STEP * row_scales[..., None]


def dequantize(
    planes: torch.Tensor,
    block_scales: torch.Tensor,
    row_scales: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Packed tensors -> weight ``[..., N, K]`` in ``dtype`` (N is ``row_scales.shape[-1]``); int16 ``block_scales``
    add their blocks' offsets (module docstring)."""
    n = row_scales.shape[-1]
    indices = unpack_indices(planes)[..., :n, :]
    scale = block_scale_values(block_scales, row_scales)
    values = codebook.float()[..., indices] if codebook.dim() == 1 else _gather_codebook(codebook, indices)
    values = values.reshape(*values.shape[:-1], values.shape[-1] // BLOCK_SIZE, BLOCK_SIZE) * scale[..., None]
    offsets = block_offset_values(block_scales, row_scales)
    if offsets is not None:
        values = values + offsets[..., None]
    return values.flatten(-2)[..., :k].to(dtype)


def _gather_codebook(codebook: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per-expert codebooks [..., L] indexed by [..., N, K] indices."""
    flat = indices.flatten(-2)
    out = torch.gather(codebook.float(), -1, flat)
    return out.reshape(indices.shape)


def error_bound(codebook: torch.Tensor, block_scales: torch.Tensor, row_scales: torch.Tensor, k: int) -> torch.Tensor:
    """Per-element bound on |W - dequantize(quantize(W))|: half the widest codebook gap times
    the decoded block scale, [..., N, K]. (The outermost levels are +-1 only when the
    codebook reaches them; the distance from an end level to the range edge counts too.)"""
    cb = codebook.float()
    gaps = torch.cat([cb[..., 1:] - cb[..., :-1], 2 * (1 + cb[..., :1]), 2 * (1 - cb[..., -1:])], dim=-1)
    half_gap = gaps.amax(-1) / 2
    scale = block_scale_values(block_scales, row_scales)
    per_elem = scale.repeat_interleave(BLOCK_SIZE, dim=-1)[..., :k]
    return per_elem * (half_gap[..., None, None] if half_gap.dim() else half_gap)
