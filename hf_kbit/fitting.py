"""Data-free fitting of the choices format v1 leaves to the quantizer.

:func:`hf_kbit.format.quantize` is the simple rule: each block's scale code rounds its absmax up
and the codebook is fixed per k. Kernels read only the codes, the indices, the row scales and the
layer's codebook, so *how* those are chosen costs nothing at inference. This module chooses them
to lower the squared reconstruction error of the weight, without calibration data:

- **block-scale codes** (:func:`search_block_codes`): each block tries the E4M4 codes from
  ``codes_below`` under its absmax code (clipping its largest elements) to ``codes_above`` over
  it, and keeps the code of least squared error. 16 codes are one octave.
- **codebook** (:func:`fit_codebook`): Lloyd iterations on the block-normalised weights,
  alternating with the code search, started from the default codebook of ``bits``. A level's
  new value is its least-squares value given the block scales, ``sum(s * w) / sum(s * s)`` over
  the elements nearest to it (weight-space error), and the codebook is then rescaled to
  ``max |c| = 1`` (the scale search absorbs the factor).

:func:`quantize_fitted` packs the result into the format v1 tensors, which
:func:`hf_kbit.format.dequantize` reads unchanged; :func:`fit_quantize` does both with the
settings measured best per k (:data:`DEFAULT_SETTINGS`).

Everything is plain PyTorch on the weight's device. It is deterministic: no random numbers and no
atomic accumulation, so the same weight on the same device and thread count gives the same bytes
(CPU and CUDA may differ where two candidate codes tie to rounding). The absmax code is always a
candidate and wins ties, so the reconstruction error never exceeds format.quantize's with the same
codebook and row scales. Leading dims stack experts: a weight ``[E, N, K]`` gets a codebook
``[E, 2**bits]``, fitted per expert (a fused experts module stores one codebook per projection: fit that
one on the experts stacked as rows, ``[E * N, K]``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import format as fmt

__all__ = [
    "DEFAULT_FITTING",
    "DEFAULT_SETTINGS",
    "FITTINGS",
    "FitSettings",
    "absmax_codes",
    "block_offsets",
    "check_bits",
    "choose_offsets",
    "codebook_groups",
    "codebook_needs_data",
    "codebook_sample",
    "element_mask",
    "fit_codebook",
    "fit_quantize",
    "group_codebook",
    "pack_groups",
    "layer_codebook",
    "offset_blocks",
    "quantize_fitted",
    "remove_offsets",
    "row_scales",
    "sample_stride",
    "search_block_codes",
    "search_codes",
    "settings_for",
]

# Elements per temporary tensor of the code search ([rows, blocks, candidates, 32] floats): 2**24
# is 64 MB in float32, small next to a GPU and to a CPU's memory, large enough to keep either busy.
CHUNK_ELEMENTS = 1 << 24
# Blocks per layer (per expert) the codebook is fitted on; a larger layer contributes every
# m-th row. 2**16 blocks are 2M weights, 65536 samples per level at k = 5: plenty for 32 means.
MAX_FIT_BLOCKS = 1 << 16


@dataclass(frozen=True)
class FitSettings:
    """How :func:`fit_quantize` chooses the free parts of format v1 for one k.

    Args:
        codes_below: E4M4 codes under each block's absmax code that the code search tries.
        codes_above: E4M4 codes over it that the search tries.
        lloyd_iters: Lloyd iterations of the codebook (0 keeps the initial codebook).
        codebook: initial codebook, a :func:`hf_kbit.format.make_codebook` name or ``None`` for
            the format's default for this k.
        max_fit_blocks: blocks per layer (per expert) the codebook is fitted on.
        balance_members: in a codebook that siblings share (:func:`group_codebook`: q/k/v, gate/up), each
            member's blocks weigh as much in the Lloyd update as another's, whatever its row count (k and v
            count as much as a q several times their size). ``False``: every row the same weight.
        offsets: give blocks an offset (format v4's int16 block records, ``KbitConfig.block_offsets``) and fit
            the rest.
        offset_choice: with ``offsets``, a block keeps its offset only where that lowers its squared error
            (:func:`choose_offsets`); ``False``: every block keeps its midrange offset (:func:`offset_blocks`).
    """

    codes_below: int
    codes_above: int = 0
    lloyd_iters: int = 0
    codebook: str | None = None
    max_fit_blocks: int = MAX_FIT_BLOCKS
    balance_members: bool = False
    offsets: bool = False
    offset_choice: bool = True

    def __post_init__(self):
        for name in ("codes_below", "codes_above", "lloyd_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"FitSettings.{name} must be a non-negative int, got {value!r}")
        if self.codes_below + self.codes_above > 255:
            raise ValueError(f"FitSettings: codes_below + codes_above must be <= 255, got "
                             f"{self.codes_below} + {self.codes_above}")
        if not isinstance(self.max_fit_blocks, int) or self.max_fit_blocks < 1:
            raise ValueError(f"FitSettings.max_fit_blocks must be a positive int, got {self.max_fit_blocks!r}")


# Per k, the levers screened by perplexity on SmolLM2-135M (a Lloyd codebook and codes above the absmax code
# helped at every k; more codes below than these did not). Measured against the anchors as `kbitfit<k>` in
# results/perplexity_*.json (docs/results.md). balance_members, against every row weighing alike, paired on the
# same 32768 Jane Austen tokens (quantize-on-load, kernels): Qwen2.5-Coder-0.5B k = 3 -1.35 +- 0.15, k = 4
# -0.74 +- 0.04, k = 5 +0.09 +- 0.01 perplexity; SmolLM2-135M k = 3 -3.33 +- 0.22, k = 4 -0.03 +- 0.01, k = 5
# -0.07 +- 0.01. So on at k = 3 and 4 (k = 2 follows k = 3), off at k = 5 (where the two models disagree).
# Reproduce: set it False here and compare with eval_perplexity on the same windows.
DEFAULT_SETTINGS = {
    2: FitSettings(codes_below=24, codes_above=4, lloyd_iters=4, balance_members=True, offset_choice=False),
    3: FitSettings(codes_below=12, codes_above=4, lloyd_iters=4, balance_members=True, offset_choice=False),
    4: FitSettings(codes_below=8, codes_above=2, lloyd_iters=4, balance_members=True, offset_choice=False),
    5: FitSettings(codes_below=6, codes_above=2, lloyd_iters=4),
}
# offset_choice (used only with offsets), on Qwen2.5-Coder-0.5B quantized on load (8192 tokens, windows of 512,
# docs/format.md#block-offsets): every block's offset measured better at k = 3 and 4 (prose k = 4 +0.84 against
# +2.87 with the choice; SmolLM2, whose weights sit on GGUF Q4_1 zero-points, prefers the choice by less, k = 4
# +0.18 +- 0.05), the choice at k = 5 (code: +0.029 against +0.103, where an offset on every block was worse than
# none). k = 2 follows k = 3.


# How a layer's free parts are chosen (KbitConfig.fitting): "absmax" is format.quantize's rule with the
# configured codebook; "fit" searches block codes and fits the codebook with DEFAULT_SETTINGS[bits].
FITTINGS = ("absmax", "fit")
# Per k, what quantize-on-load and kbit-convert use when KbitConfig.fitting is None: "fit" lowered
# perplexity against "absmax" at every k on both offline models and corpora (docs/results.md).
DEFAULT_FITTING = dict.fromkeys(fmt.SUPPORTED_BITS, "fit")


def settings_for(fitting: str | None, bits: int, codebook: object = None, offsets: bool = False) -> FitSettings | None:
    """The FitSettings of ``fitting`` (``None``: this k's default) at ``bits``; ``None`` for "absmax" (with
    ``offsets``: the absmax rule on each block less its offset, no search, the codebook as configured).

    An explicit codebook (a list or tensor of levels) is kept as given: only block codes are searched.
    ``offsets``: blocks get offsets (:func:`offset_blocks`, by this k's ``offset_choice``; int16 block records).
    """
    fitting = DEFAULT_FITTING[check_bits(bits)] if fitting is None else fitting
    if fitting not in FITTINGS:
        raise ValueError(f"fitting must be one of {FITTINGS} or None, got {fitting!r}")
    if fitting == "absmax":
        return FitSettings(codes_below=0, codebook=codebook if isinstance(codebook, str) else None, offsets=True,
                           offset_choice=DEFAULT_SETTINGS[bits].offset_choice) if offsets else None
    settings = dataclasses.replace(DEFAULT_SETTINGS[bits], offsets=offsets)
    if codebook is not None and not isinstance(codebook, str):
        return dataclasses.replace(settings, lloyd_iters=0)
    return dataclasses.replace(settings, codebook=codebook)


def codebook_needs_data(fitting: str | None, bits: int, codebook: object = None) -> bool:
    """Whether the codebook of a layer depends on its weights (so siblings sharing one must wait for each other)."""
    settings = settings_for(fitting, bits, codebook)
    return settings is not None and settings.lloyd_iters > 0


# ---------------------------------------------------------------------------- layout helpers


def _as_groups(weight: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """weight [..., N, K] -> float32 [G, N, K] (G = prod of the leading dims) and the leading shape."""
    if weight.dim() < 2:
        raise ValueError(f"weight must be [..., N, K] with at least 2 dims, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point, got {weight.dtype}")
    lead = tuple(weight.shape[:-2])
    return weight.float().reshape(math.prod(lead), *weight.shape[-2:]), lead


def _blocks(w: torch.Tensor, n_pad: int | None = None, k_pad: int | None = None) -> torch.Tensor:
    """[G, N, K] -> [G, n_pad, k_pad / 32, 32], zero-padded (default: K to whole blocks, N as is)."""
    g, n, k = w.shape
    n_pad = n if n_pad is None else n_pad
    k_pad = math.ceil(k / fmt.BLOCK_SIZE) * fmt.BLOCK_SIZE if k_pad is None else k_pad
    return torch.nn.functional.pad(w, (0, k_pad - k, 0, n_pad - n)).reshape(g, n_pad, k_pad // fmt.BLOCK_SIZE, fmt.BLOCK_SIZE)


def element_mask(k: int, n_blocks: int, device: torch.device) -> torch.Tensor | None:
    """Of a weight with ``k`` columns in ``n_blocks`` blocks: [n_blocks, 32] float32, 1 on real elements and 0 on K padding; None when no block is partial
    (whole padding blocks are all zero: they keep code 0 and add no error)."""
    if k % fmt.BLOCK_SIZE == 0:
        return None
    col = torch.arange(n_blocks * fmt.BLOCK_SIZE, device=device).reshape(n_blocks, fmt.BLOCK_SIZE)
    return (col < k).float()


def codebook_groups(codebook: torch.Tensor, lead: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A codebook [L] (shared) or [*lead, L] (one per expert of a weight [*lead, N, K]) -> float32 [G, L] on
    ``device``, validated (:func:`hf_kbit.format.validate_codebook`)."""
    cb = codebook.to(device=device, dtype=torch.float32)
    levels = cb.shape[-1]
    bits = levels.bit_length() - 1
    if bits not in fmt.SUPPORTED_BITS or levels != 1 << bits:
        raise ValueError(f"codebook must have 2**bits entries for bits in {fmt.SUPPORTED_BITS}, got {levels}")
    if cb.dim() == 1:
        cb = cb.expand(math.prod(lead), levels)
    elif tuple(cb.shape[:-1]) != lead:
        raise ValueError(f"codebook must be [{levels}] or [*{list(lead)}, {levels}] for this weight, "
                         f"got {tuple(codebook.shape)}")
    cb = cb.reshape(-1, levels).contiguous()
    for row in cb.cpu():
        fmt.validate_codebook(row, bits)
    return cb


def _nearest(x: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level (ties to the lower one, as format.quantize) of x [G, ...] in cb [G, L]."""
    mids = (cb[:, 1:] + cb[:, :-1]) / 2
    return torch.searchsorted(mids, x.reshape(x.shape[0], -1).contiguous()).reshape(x.shape)


def _levels(cb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """cb [G, L] gathered at idx [G, ...]."""
    return torch.gather(cb, 1, idx.reshape(idx.shape[0], -1)).reshape(idx.shape)


# ---------------------------------------------------------------------------- scales


# format.quantize's steps 1 and 2, the starting point of every search here.
row_scales = fmt.row_scales
absmax_codes = fmt.absmax_codes


def search_codes(
    blocks: torch.Tensor,
    rows: torch.Tensor,
    cb: torch.Tensor,
    codes_below: int,
    codes_above: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`search_block_codes` on weights already in blocks: float32 ``blocks [G, N, B, 32]``, row scales
    ``rows [G, N]``, codebooks ``cb [G, L]`` (:func:`codebook_groups`) and ``mask`` ``[B, 32]`` (each element's
    weight in the squared error, e.g. :func:`element_mask`; None: all 1) -> int64 codes ``[G, N, B]``."""
    if codes_below == 0 and codes_above == 0:
        return absmax_codes(blocks, rows)
    return _search(blocks, rows, cb, codes_below, codes_above, mask)[0]


def _search(blocks, rows, cb, codes_below, codes_above, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`search_codes`'s search, also where its window is empty: ``(codes [G, N, B], their squared errors
    [G, N, B] float32)`` (a code-0 block is all zero: error 0)."""
    c0 = absmax_codes(blocks, rows)
    table = fmt.e4m4_table(blocks.device)
    # Candidate offsets, the absmax code first: argmin keeps the first of equal errors, so the
    # absmax code wins ties and the result is never worse than format.quantize.
    # (Made on the device without a boolean mask: calibration searches once per block, and a data-dependent
    # shape would wait for the GPU each time.)
    device = blocks.device
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.arange(-codes_above, 0, device=device),
                         torch.arange(1, codes_below + 1, device=device)])
    g, n, n_blocks, _ = blocks.shape
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, n_blocks * offsets.numel() * fmt.BLOCK_SIZE))
    codes = torch.empty_like(c0)
    errors = torch.empty(c0.shape, dtype=torch.float32, device=device)
    for start in range(0, n, rows_per_chunk):
        rows_here = slice(start, start + rows_per_chunk)
        base = c0[:, rows_here, :, None]
        # An all-zero block keeps code 0; any other block keeps a non-zero code (code 0 would zero it).
        cand = torch.where(base == 0, 0, (base - offsets).clamp(1, 255))  # [G, n, B, C]
        scale = table[cand] * rows[:, rows_here, None, None]
        x = blocks[:, rows_here, :, None, :] / torch.where(scale > 0, scale, 1.0)[..., None]
        d = _levels(cb, _nearest(x, cb)).sub_(x).square_()
        if mask is not None:
            d.mul_(mask[:, None, :])
        err = d.sum(-1) * scale.square()
        best = err.argmin(-1, keepdim=True)
        codes[:, rows_here] = cand.gather(-1, best)[..., 0]
        errors[:, rows_here] = err.gather(-1, best)[..., 0]
    return codes, errors


def search_block_codes(
    weight: torch.Tensor,
    rows: torch.Tensor,
    codebook: torch.Tensor,
    codes_below: int,
    codes_above: int = 0,
) -> torch.Tensor:
    """Per block, the E4M4 code of least squared reconstruction error.

    Args:
        weight: ``[..., N, K]`` floating point.
        rows: row scales ``[..., N]`` float32, positive.
        codebook: ``[2**bits]`` or one per leading index ``[..., 2**bits]``.
        codes_below / codes_above: the window of codes tried around each block's absmax code
            (:func:`absmax_codes`), clamped to 1..255.
    Returns:
        int64 codes ``[..., N, ceil(K / 32)]`` (block order, untiled). An all-zero block gets 0.
    The error of a block is ``sum((w - c[nearest(w / s)] * s)**2)`` over its real elements, with
    ``s = e4m4(code) * row_scale``; ties go to the absmax code, then to the larger code.
    """
    w, lead = _as_groups(weight)
    cb = codebook_groups(codebook, lead, w.device)
    rs = rows.to(device=w.device, dtype=torch.float32).reshape(w.shape[0], w.shape[1])
    blocks = _blocks(w)
    codes = search_codes(blocks, rs, cb, codes_below, codes_above, element_mask(w.shape[-1], blocks.shape[2], w.device))
    return codes.reshape(*lead, *codes.shape[1:])


# ---------------------------------------------------------------------------- offsets


def block_offsets(blocks: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Offset codes of ``blocks [G, N, B, 32]`` under row scales ``rows [G, N]`` (format.OFFSET_STEP): each
    block's midrange ``(max + min) / 2`` over its real elements (``mask [B, 32]``, as :func:`element_mask`; None:
    all), in steps of ``OFFSET_STEP * row_scale``, rounded to nearest and clamped to ``+-OFFSET_MAX``; int64
    ``[G, N, B]``, 0 for a block without real elements."""
    real = torch.ones(blocks.shape[-2:], dtype=torch.bool, device=blocks.device) if mask is None else mask > 0
    high = torch.where(real, blocks, -math.inf).amax(-1)
    low = torch.where(real, blocks, math.inf).amin(-1)
    mid = torch.where(real.any(-1), (high + low) / 2, 0.0)
    codes = (mid / (fmt.OFFSET_STEP * rows[..., None])).round().clamp_(-fmt.OFFSET_MAX, fmt.OFFSET_MAX)
    return codes.long()


def remove_offsets(blocks: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """``blocks [G, N, B, 32]`` less their decoded offsets (codes ``offsets [G, N, B]`` under ``rows [G, N]``); K
    padding (``mask`` 0) stays 0, so that it sets no block's absmax."""
    residual = blocks - (offsets.float() * fmt.OFFSET_STEP * rows[..., None])[..., None]
    return residual if mask is None else residual * (mask > 0)


def choose_offsets(blocks: torch.Tensor, rows: torch.Tensor, cb: torch.Tensor, codes_below: int, codes_above: int,
                   mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block, its :func:`block_offsets` code or none, whichever quantizes it with the smaller squared error
    (:func:`search_codes` both ways; ties keep none). ``(offset codes [G, N, B], the blocks less their chosen
    offsets, E4M4 codes [G, N, B])``."""
    offsets = block_offsets(blocks, rows, mask)
    shifted = remove_offsets(blocks, rows, offsets, mask)
    codes_shifted, errors_shifted = _search(shifted, rows, cb, codes_below, codes_above, mask)
    codes_plain, errors_plain = _search(blocks, rows, cb, codes_below, codes_above, mask)
    keep = errors_shifted < errors_plain
    return (torch.where(keep, offsets, 0), torch.where(keep[..., None], shifted, blocks),
            torch.where(keep, codes_shifted, codes_plain))


def offset_blocks(blocks: torch.Tensor, rows: torch.Tensor, cb: torch.Tensor, codes_below: int, codes_above: int,
                  mask: torch.Tensor | None, choice: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(offset codes, the blocks less their offsets, E4M4 codes)``, each ``[G, N, B]`` but the blocks: with
    ``choice`` :func:`choose_offsets`, else every block's :func:`block_offsets` and :func:`search_codes` on the
    rest; ``None``: the ``offset_choice`` of ``DEFAULT_SETTINGS`` at the codebook's k."""
    if choice is None:
        choice = DEFAULT_SETTINGS[cb.shape[-1].bit_length() - 1].offset_choice
    if choice:
        return choose_offsets(blocks, rows, cb, codes_below, codes_above, mask)
    offsets = block_offsets(blocks, rows, mask)
    shifted = remove_offsets(blocks, rows, offsets, mask)
    return offsets, shifted, search_codes(shifted, rows, cb, codes_below, codes_above, mask)


# ---------------------------------------------------------------------------- codebook


def _lloyd_step(blocks, scales, cb, mask, row_weights=None):
    """One Lloyd update of cb [G, L] from blocks [G, n, B, 32] at block scales [G, n, B]; ``row_weights [n]``
    (or None: all 1) weigh each row's squared errors."""
    s = scales[..., None].expand_as(blocks)
    x = blocks / torch.where(s > 0, s, 1.0)
    idx = _nearest(x, cb).reshape(cb.shape[0], -1)
    # Weight-space least squares per level: sum(s * w) / sum(s * s). Zero blocks (s = 0) and K
    # padding carry no weight. Sums per level are plain reductions (deterministic on every
    # device, unlike scatter_add's atomics on CUDA), in float64.
    keep = s if mask is None else s * mask
    if row_weights is not None:
        keep = keep * row_weights[:, None, None]
    sw = (keep * blocks).reshape(cb.shape[0], -1).double()
    ss = (keep * s).reshape(cb.shape[0], -1).double()
    num = torch.stack([torch.where(idx == i, sw, 0.0).sum(-1) for i in range(cb.shape[1])], -1)
    den = torch.stack([torch.where(idx == i, ss, 0.0).sum(-1) for i in range(cb.shape[1])], -1)
    new = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), cb.double())
    return _normalise(new)


def _normalise(values: torch.Tensor) -> torch.Tensor:
    """[G, L] float64 -> a valid codebook per row: sorted, max |c| = 1, strictly increasing."""
    values = torch.sort(values, dim=-1).values
    peak = values.abs().amax(-1, keepdim=True)
    values = torch.where(peak > 0, values / torch.where(peak > 0, peak, 1.0), values).float().clamp(-1.0, 1.0)
    # Two levels can only coincide when a cell is empty; nudge upward (and back down from 1) so
    # the codebook stays strictly increasing, as format v1 requires.
    levels = values.shape[-1]
    min_gap = 2.0 ** -20
    for i in range(1, levels):
        values[:, i] = torch.maximum(values[:, i], values[:, i - 1] + min_gap)
    for i in range(levels - 1, -1, -1):
        top = 1.0 - (levels - 1 - i) * min_gap
        values[:, i] = torch.minimum(values[:, i], torch.full_like(values[:, i], top))
    return values


def sample_stride(rows: int, k: int, max_fit_blocks: int = MAX_FIT_BLOCKS) -> int:
    """m such that every m-th of ``rows`` rows of length ``k`` keeps at most ``max_fit_blocks`` blocks."""
    return max(1, math.ceil(rows * math.ceil(k / fmt.BLOCK_SIZE) / max_fit_blocks))


def fit_codebook(
    weight: torch.Tensor,
    bits: int,
    settings: FitSettings | None = None,
    init: str | torch.Tensor | list[float] | None = None,
    column_weights: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """A codebook for ``weight [..., N, K]`` at ``bits``: ``[2**bits]`` for a 2-D weight, ``[..., 2**bits]``
    (one per expert) for a stacked one.

    Starts from ``init`` (default: ``settings.codebook``, else the format's default for ``bits``)
    and alternates the code search with Lloyd updates ``settings.lloyd_iters`` times, on at most
    ``settings.max_fit_blocks`` blocks per layer (every m-th row). The result is sorted, strictly
    increasing, within [-1, 1] and reaches +-1 at one end.

    ``column_weights [K]`` (non-negative; calibration passes ``diag(H)``, each input channel's mean square
    activation) weights each element's squared error by its column's entry, in the code search and in the
    Lloyd update alike; all-equal weights give the unweighted codebook, all-zero ones the initial codebook.
    ``row_weights [N]`` (positive; 2-D weights only) weighs each row's squared errors in the Lloyd update (a
    block's code does not depend on them): :func:`group_codebook`'s balanced members.
    """
    settings = DEFAULT_SETTINGS[check_bits(bits)] if settings is None else settings
    w, lead = _as_groups(weight)
    start = fmt.make_codebook(init if init is not None else settings.codebook, bits)
    cb = start.to(w.device).expand(w.shape[0], -1).contiguous()
    blocks = _blocks(w)
    mask = element_mask(w.shape[-1], blocks.shape[2], w.device)
    if column_weights is not None:
        mask = _column_mask(column_weights, w.shape[-1], blocks.shape[2], w.device)
    if settings.lloyd_iters == 0 or w.numel() == 0 or (mask is not None and not bool(mask.any())):
        return cb.reshape(*lead, -1) if lead else cb[0]
    rows_sel = slice(None, None, sample_stride(w.shape[1], w.shape[2], settings.max_fit_blocks))
    if row_weights is not None:
        row_weights = row_weights.to(device=w.device, dtype=torch.float32)
        if lead or row_weights.shape != (w.shape[1],) or not bool((row_weights > 0).all()):
            raise ValueError(f"row_weights must be positive, of shape ({w.shape[1]},), for a 2-D weight; got "
                             f"{tuple(row_weights.shape)} for a weight of shape {tuple(weight.shape)}")
        row_weights = row_weights[rows_sel]
    fit_blocks = blocks[:, rows_sel]
    rows = row_scales(w)[:, rows_sel]
    table = fmt.e4m4_table(w.device)
    for _ in range(settings.lloyd_iters):
        if settings.offsets:
            _, residual, codes = offset_blocks(fit_blocks, rows, cb, settings.codes_below, settings.codes_above, mask,
                                               settings.offset_choice)
        else:
            residual = fit_blocks
            codes = search_codes(fit_blocks, rows, cb, settings.codes_below, settings.codes_above, mask)
        cb = _lloyd_step(residual, table[codes] * rows[..., None], cb, mask, row_weights)
    return cb.reshape(*lead, -1) if lead else cb[0]


def _column_mask(column_weights: torch.Tensor, k: int, n_blocks: int, device: torch.device) -> torch.Tensor:
    """``column_weights [K]`` as a [n_blocks, 32] mask, scaled to mean 1 over its non-zero entries, 0 on K padding."""
    cw = column_weights.to(device=device, dtype=torch.float32)
    if cw.shape != (k,) or not bool((cw >= 0).all()) or not bool(torch.isfinite(cw).all()):
        raise ValueError(f"column_weights must be finite, non-negative and of shape ({k},), got {tuple(cw.shape)}")
    positive = cw > 0
    if bool(positive.any()):
        cw = cw / cw[positive].mean()
    return torch.nn.functional.pad(cw, (0, n_blocks * fmt.BLOCK_SIZE - k)).reshape(n_blocks, fmt.BLOCK_SIZE)


def layer_codebook(
    sample: torch.Tensor,
    bits: int,
    settings: FitSettings | None,
    codebook: str | torch.Tensor | list[float] | None = None,
    column_weights: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one codebook ``[2**bits]`` of a layer (or of a fused experts projection), fitted on ``sample``.

    ``sample`` is ``[R, K]``: the layer's rows ``[::sample_stride(rows, K, settings.max_fit_blocks)]``,
    experts stacked as rows (``[E * N, K]``), so a caller that reads a weight in pieces gathers the
    same rows and gets the same codebook. ``settings`` ``None`` ("absmax") returns the configured
    ``codebook`` (:func:`hf_kbit.format.make_codebook`) unchanged. ``column_weights``, ``row_weights [R]``: as
    :func:`fit_codebook`.
    """
    if settings is None or settings.lloyd_iters == 0:
        return fmt.make_codebook(codebook, bits).to(sample.device)
    whole = dataclasses.replace(settings, max_fit_blocks=max(1, sample.shape[0] * math.ceil(sample.shape[1] / fmt.BLOCK_SIZE)))
    return fit_codebook(sample, bits, whole, init=codebook, column_weights=column_weights, row_weights=row_weights)


def group_codebook(
    weights: Sequence[torch.Tensor],
    bits: int,
    settings: FitSettings | None,
    codebook: str | torch.Tensor | list[float] | None = None,
    column_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one codebook ``[2**bits]`` of layers that share it (siblings run as one weight: q/k/v, gate/up; or a
    single layer), fitted on their rows stacked in the given order as if they were one weight ``[sum(N), K]``
    (:func:`codebook_sample` of each, :func:`layer_codebook` of all). Under ``settings.balance_members`` each
    member's sampled rows weigh ``1 / (members x its sampled rows)`` of the total, so every member counts alike."""
    total = sum(math.prod(w.shape[:-1]) for w in weights)
    starts = itertools.accumulate((math.prod(w.shape[:-1]) for w in weights), initial=0)
    sample = [codebook_sample(w, settings, total, start).float() for w, start in zip(weights, starts)]
    return layer_codebook(torch.cat(sample), bits, settings, codebook, column_weights, _member_weights(sample, settings))


def _member_weights(sample: Sequence[torch.Tensor], settings: FitSettings | None) -> torch.Tensor | None:
    """Row weights ``[sum of rows]`` of siblings' stacked samples under ``settings.balance_members``: each
    member's rows share an equal part of the total weight (mean 1); ``None`` when it is off or fewer than two
    members have sampled rows."""
    counts = [s.shape[0] for s in sample]
    present = [c for c in counts if c]
    if settings is None or not settings.balance_members or len(present) < 2:
        return None
    total = sum(present)
    return torch.cat([torch.full((c,), total / (len(present) * c), device=s.device) for s, c in zip(sample, counts)])


def codebook_sample(
    weight: torch.Tensor, settings: FitSettings | None, total_rows: int | None = None, first_row: int = 0
) -> torch.Tensor:
    """The rows of ``weight [..., K]`` (flattened to ``[R, K]``) the layer's codebook is fitted on:
    every m-th row of the whole weight (:func:`sample_stride`); none when nothing is fitted.

    A caller reading the weight in pieces passes the whole weight's row count ``total_rows`` and
    where this piece starts, ``first_row``; the pieces' samples, concatenated, are the whole's.
    """
    rows = weight.reshape(math.prod(weight.shape[:-1]), weight.shape[-1])
    if settings is None or settings.lloyd_iters == 0:
        return rows[:0]
    m = sample_stride(rows.shape[0] if total_rows is None else total_rows, rows.shape[1], settings.max_fit_blocks)
    return rows[-first_row % m :: m]


# ---------------------------------------------------------------------------- quantize


def quantize_fitted(
    weight: torch.Tensor,
    codebook: torch.Tensor,
    codes_below: int,
    codes_above: int = 0,
    offsets: bool = False,
    offset_choice: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``weight [..., N, K]`` with ``codebook`` and searched block codes -> format v1 tensors.

    Returns ``(planes, block_scales, row_scales)`` with the shapes and dtypes of
    :func:`hf_kbit.format.quantize` (``planes`` int32 ``[..., N_tiles, K_tiles, bits, 16, 4]``,
    ``block_scales`` uint8 ``[..., N_tiles, K_tiles, 16, 4]``, ``row_scales`` float32 ``[..., N]``);
    :func:`hf_kbit.format.dequantize` with the same codebook reads them. Row scales follow the
    format's rule; block codes come from :func:`search_block_codes`; each index is the nearest
    level, as in format.quantize. With ``codes_below = codes_above = 0`` the bytes equal
    format.quantize's. ``offsets``: each block first gets its :func:`block_offsets` (with ``offset_choice``, only where
    it quantizes the block with less error: :func:`choose_offsets`, under the same row scales; ``None``: this k's
    ``DEFAULT_SETTINGS``), the rest is quantized as above, and ``block_scales`` holds int16 block records
    (:func:`hf_kbit.format.block_records`).
    """
    w, lead = _as_groups(weight)
    cb = codebook_groups(codebook, lead, w.device)
    g, n, k = w.shape
    bits = cb.shape[1].bit_length() - 1
    n_pad, k_pad = fmt.padded_shape(n, k)
    # Work on the padded weight, as format.quantize does: padding rows get row scale 1.0, padding
    # blocks code 0, every padding element the index of the level nearest to 0.
    rows = row_scales(w)
    rows_pad = torch.nn.functional.pad(rows, (0, n_pad - n), value=1.0)
    blocks = _blocks(w, n_pad, k_pad)
    mask = element_mask(k, blocks.shape[2], w.device)
    offset_codes = None
    if offsets:
        offset_codes, blocks, codes = offset_blocks(blocks, rows_pad, cb, codes_below, codes_above, mask, offset_choice)
    else:
        codes = search_codes(blocks, rows_pad, cb, codes_below, codes_above, mask)
    scale = fmt.e4m4_table(w.device)[codes] * rows_pad[..., None]
    x = torch.where(scale[..., None] > 0, blocks / torch.where(scale > 0, scale, 1.0)[..., None], 0.0)
    return pack_groups(_nearest(x, cb), codes, rows, bits, lead, offset_codes)


def pack_groups(
    indices: torch.Tensor, codes: torch.Tensor, rows: torch.Tensor, bits: int, lead: tuple[int, ...],
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Format v1 tensors ``(planes, block_scales, row_scales)`` of ``G = prod(lead)`` weights from their padded
    int64 ``indices [G, N_pad, K_pad / 32, 32]``, block ``codes [G, N_pad, K_pad / 32]`` and float32 ``rows [G, N]``
    (bit-planes packed and tiled, codes tiled, the leading dims ``lead`` restored); with offset codes ``offsets``
    (shaped as ``codes``) the block scales are int16 block records (:func:`hf_kbit.format.pack_records`)."""
    planes = fmt.tile_planes(fmt.pack_bitplanes(indices, bits))
    block_scales = fmt.tile(codes.to(torch.uint8) if offsets is None else fmt.pack_records(codes, offsets))
    return (
        planes.reshape(*lead, *planes.shape[1:]),
        block_scales.reshape(*lead, *block_scales.shape[1:]),
        rows.reshape(*lead, rows.shape[-1]).contiguous(),
    )


def fit_quantize(
    weight: torch.Tensor, bits: int, settings: FitSettings | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fit_codebook` then :func:`quantize_fitted`: ``(planes, block_scales, row_scales, codebook)``.

    ``settings`` defaults to ``DEFAULT_SETTINGS[bits]``, the levers measured best at that k.
    """
    settings = DEFAULT_SETTINGS[check_bits(bits)] if settings is None else settings
    codebook = fit_codebook(weight, bits, settings)
    planes, block_scales, rows = quantize_fitted(weight, codebook, settings.codes_below, settings.codes_above,
                                                 settings.offsets, settings.offset_choice)
    return planes, block_scales, rows, codebook


def check_bits(bits: int) -> int:
    """``bits`` if it is one of format v1's k, else ValueError."""
    if bits not in fmt.SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {fmt.SUPPORTED_BITS}, got {bits!r}")
    return bits
