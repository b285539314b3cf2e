"""Calibration of one weight, or of siblings that share a codebook, with the Hessians of their inputs: GPTQ's
error feedback inside format v1 (the package docstring has the algorithm)."""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass

import torch

from .. import fitting
from .. import format as fmt
from .. import rotation_policy

# GPTQ's lazy batch: columns updated in place before the trailing matrix gets one matmul. A multiple of the
# format's block so a block never straddles two batches.
DEFAULT_LAZY_COLUMNS = 128
DEFAULT_DAMP = 0.01  # GPTQ's percdamp: this fraction of mean(diag(H)) is added to H's diagonal
# Cholesky of a badly conditioned H can fail in float32: the damping grows by this factor, at most this often.
DAMP_GROWTH, DAMP_RETRIES = 10.0, 4


@dataclass(frozen=True)
class CalibrationSettings:
    """How :func:`calibrate_quantize` quantizes one weight with its Hessian.

    Args:
        damp: fraction of ``mean(diag(H))`` added to ``H``'s diagonal (GPTQ's percdamp).
        lazy_columns: GPTQ's lazy batch, a multiple of the format's 32-element block.
        fit: the data-free settings of the codebook fit and the block-code window, for every k (default: those
            of ``fitting`` and ``codebook`` at each k, :func:`hf_kbit.fitting.settings_for`).
        weighted_codebook: fit the codebook (Lloyd, :func:`hf_kbit.fitting.fit_codebook`'s ``column_weights``)
            with each element's squared error weighted by its input channel's mean square activation,
            ``diag(H)``, instead of data-free.
        weighted_codes: in the block-code search, weight each element's squared error by ``1 / U[j, j]**2``,
            the share of its error that the later columns cannot take over (GPTQ's own error measure).
        fitting: ``KbitConfig.fitting`` (``"fit"``, ``"absmax"``: the configured codebook as is and each block's
            absmax code, then error feedback; ``None``: the default of each k); used when ``fit`` is None.
        codebook: ``KbitConfig.codebook``: a codebook name, levels (a tuple), or None for each k's default; the
            codebook the fit starts from (``"absmax"`` and explicit levels: the codebook used as is).
        block_offsets: ``KbitConfig.block_offsets``: each block of a Linear gets an offset as well as a scale (int16
            block records, format v4), chosen when the error feedback reaches the block as the data-free rule
            chooses it (:func:`hf_kbit.fitting.offset_blocks`); used when ``fit`` is None (an explicit ``fit`` says
            it in its ``offsets``). Fused MoE experts keep uint8 scales either way.
        rotation, rotation_seed: ``KbitConfig.rotation`` / ``.rotation_seed``, applied by :func:`calibrate_model`:
            a group that rotates (``"auto"``: decided data-free, :mod:`hf_kbit.rotation_policy`) is calibrated as
            ``W R`` with the rotated inputs' Hessian ``R^T H R``.
    """

    damp: float = DEFAULT_DAMP
    lazy_columns: int = DEFAULT_LAZY_COLUMNS
    fit: fitting.FitSettings | None = None
    weighted_codebook: bool = False
    weighted_codes: bool = False
    fitting: str | None = None
    codebook: str | tuple[float, ...] | None = None
    block_offsets: bool = False
    rotation: bool | str = False
    rotation_seed: int = 0

    def __post_init__(self):
        if not isinstance(self.damp, (int, float)) or isinstance(self.damp, bool) or not 0 < self.damp < 1:
            raise ValueError(f"CalibrationSettings.damp must be a number in (0, 1), got {self.damp!r}")
        lazy = self.lazy_columns
        if not isinstance(lazy, int) or isinstance(lazy, bool) or lazy < 1 or lazy % fmt.BLOCK_SIZE:
            raise ValueError(f"CalibrationSettings.lazy_columns must be a positive multiple of {fmt.BLOCK_SIZE}, "
                             f"got {lazy!r}")
        if self.fit is not None and not isinstance(self.fit, fitting.FitSettings):
            raise TypeError(f"CalibrationSettings.fit must be a fitting.FitSettings or None, got {type(self.fit)}")
        for name in ("weighted_codebook", "weighted_codes", "block_offsets"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CalibrationSettings.{name} must be a bool, got {getattr(self, name)!r}")
        if self.fitting is not None and self.fitting not in fitting.FITTINGS:
            raise ValueError(f"CalibrationSettings.fitting must be one of {fitting.FITTINGS} or None, got {self.fitting!r}")
        rotation_policy.check_rotation(self.rotation, "CalibrationSettings.rotation")
        rotation_policy.check_seed(self.rotation_seed, "CalibrationSettings.rotation_seed")
        if isinstance(self.codebook, list):  # a frozen dataclass stays hashable with levels as a tuple
            object.__setattr__(self, "codebook", tuple(self.codebook))

    def fit_settings(self, bits: int, offsets: bool = True) -> fitting.FitSettings | None:
        """The FitSettings at ``bits`` (codebook fit, code window, block offsets), None for ``fitting="absmax"``
        without offsets. ``offsets=False``: without block offsets whatever the settings say (fused experts)."""
        if self.fit is not None:
            return self.fit if offsets or not self.fit.offsets else dataclasses.replace(self.fit, offsets=False)
        return fitting.settings_for(self.fitting, bits, self.codebook, offsets and self.block_offsets)

    def initial_codebook(self) -> str | list[float] | None:
        """``codebook`` as :func:`hf_kbit.format.make_codebook` takes it."""
        return list(self.codebook) if isinstance(self.codebook, tuple) else self.codebook

    def rotation_words(self, weights: Sequence[torch.Tensor], data_free, names: Sequence[str]) -> torch.Tensor | None:
        """The sign words a group of weights ``weights`` (named ``names``) is calibrated with (None: unrotated), as
        :func:`hf_kbit.rotation_policy.decide` picks them under :func:`hf_kbit.rotation_policy.for_weights`;
        ``data_free`` quantizes a list of weights without data (what ``"auto"`` compares)."""
        rotation = rotation_policy.for_weights(self.rotation, names)
        return rotation_policy.decide(weights, rotation, self.rotation_seed, data_free)



# ---------------------------------------------------------------------------- one weight


def _check_pair(weight: torch.Tensor, hessian: torch.Tensor) -> None:
    if weight.dim() < 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float tensor [..., N, K], got {weight.dtype} of shape {tuple(weight.shape)}")
    want = (*weight.shape[:-2], weight.shape[-1], weight.shape[-1])
    if tuple(hessian.shape) != want or not hessian.is_floating_point():
        raise ValueError(f"hessian must be a float {list(want)} tensor for this weight ([..., K, K]), got "
                         f"{hessian.dtype} of shape {tuple(hessian.shape)}")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("hessian has non-finite entries (inf or NaN in the calibration activations?)")


def inverse_cholesky(hessian: torch.Tensor, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)^-1`` (float32, or float64 for a float64
    ``H``; on ``H``'s device), for ``H [K, K]`` or a stack ``[..., K, K]`` (one per expert) at once.

    Columns that never saw a non-zero input (``H[i, i] == 0``) get ``H[i, i] = 1``: they are then quantized
    to the nearest level and pass no error on (GPTQ zeroes them; here they keep their weight, since held-out
    text may use them); an all-zero ``H`` (an expert no token reached) thus quantizes as without data. If the
    factorisation fails the damping grows (x10, a few times) before giving up.
    """
    h = hessian.to(torch.float64 if hessian.dtype == torch.float64 else torch.float32).clone()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    diag[diag == 0] = 1.0
    mean = diag.mean(-1) if diag.shape[-1] else torch.ones(diag.shape[:-1], dtype=h.dtype, device=h.device)
    eye = torch.eye(h.shape[-1], device=h.device, dtype=h.dtype)
    upper, done = torch.zeros_like(h), torch.zeros(h.shape[:-2], dtype=torch.bool, device=h.device)
    for attempt in range(DAMP_RETRIES + 1):
        chol, info = torch.linalg.cholesky_ex(h + (damp * DAMP_GROWTH**attempt) * mean[..., None, None] * eye)
        factor, info_inverse = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
        ok = (info == 0) & (info_inverse == 0) & ~done
        upper = torch.where(ok[..., None, None], factor, upper)
        done |= ok
        if bool(done.all()):
            return upper
    raise ValueError(f"the Hessian is not positive definite even with damping {damp * DAMP_GROWTH**DAMP_RETRIES:g} "
                     "x mean(diag): calibrate with more (or more varied) text")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    codebook: torch.Tensor,
    codes_below: int = 0,
    codes_above: int = 0,
    damp: float = DEFAULT_DAMP,
    lazy_columns: int = DEFAULT_LAZY_COLUMNS,
    weighted_codes: bool = False,
    offsets: bool = False,
    offset_choice: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``weight [N, K]`` to format v1 with ``codebook``, error feedback through ``hessian [K, K]``; or a
    stack of weights ``[..., N, K]`` (MoE experts) each with its own Hessian ``[..., K, K]``, at once.

    Returns ``(planes, block_scales, row_scales)`` with the shapes and dtypes of
    :func:`hf_kbit.format.quantize` (``planes`` int32 ``[..., N_tiles, K_tiles, bits, 16, 4]``, ``block_scales``
    uint8 ``[..., N_tiles, K_tiles, 16, 4]``, ``row_scales`` float32 ``[..., N]``); :func:`hf_kbit.format.dequantize`
    with ``codebook`` (``[2**bits]``, shared, or one per leading index) reads them. Row scales follow the
    format's rule on the original weight; each block's code is searched over ``codes_below`` / ``codes_above``
    codes around its absmax code (as :func:`hf_kbit.fitting.search_block_codes`) on the block's weights as the
    error feedback left them when its first column is reached (``weighted_codes``, 2-D weights only: each
    element's squared error weighted by ``1 / U[j, j]**2``); each index is the nearest level to the updated
    weight over its block scale. ``offsets``: each block first gets its offset from the same updated weights
    (:func:`hf_kbit.fitting.offset_blocks`, with ``offset_choice``; ``None``: this k's ``DEFAULT_SETTINGS``), its
    code is searched on the weights less the offset, and ``block_scales`` holds int16 block records
    (:func:`hf_kbit.format.block_records`). A stack gives what each of its weights gives alone (up to the
    summation order of the lazy batches' matmuls).
    Runs on ``weight``'s device in float32 (float64 for a float64 weight, as the tests' references do; the code
    search always sees float32 weights). The module docstring has the algorithm.
    """
    _check_pair(weight, hessian)
    if lazy_columns < 1 or lazy_columns % fmt.BLOCK_SIZE:
        raise ValueError(f"lazy_columns must be a positive multiple of {fmt.BLOCK_SIZE}, got {lazy_columns}")
    if weighted_codes and weight.dim() != 2:
        raise ValueError("weighted_codes needs a 2-D weight (one Hessian), got a stack of shape "
                         f"{tuple(weight.shape)}")
    device = weight.device
    lead = tuple(weight.shape[:-2])
    cb = fitting.codebook_groups(codebook, lead, device)  # [G, L], validated
    bits = cb.shape[1].bit_length() - 1
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    n, k = weight.shape[-2:]
    w = weight.to(dtype).reshape(-1, n, k)
    g = w.shape[0]
    n_pad, k_pad = fmt.padded_shape(n, k)
    rows = fmt.row_scales(w)  # [G, N]
    # Padding columns: zero weights uncoupled from the real ones (identity), so they receive no error and
    # quantize as format.quantize's padding does. The damping is relative to the real columns' H alone.
    upper = torch.eye(k_pad, device=device, dtype=dtype).repeat(g, 1, 1)
    if k:
        upper[:, :k, :k] = inverse_cholesky(hessian.to(device=device, dtype=dtype).reshape(g, k, k), damp)
    work = torch.nn.functional.pad(w, (0, k_pad - k))
    mask = fitting.element_mask(k, k_pad // fmt.BLOCK_SIZE, device)
    if weighted_codes:
        weights = torch.diagonal(upper[0]).float().square().reciprocal()
        weights = (weights / weights[:k].mean()).reshape(-1, fmt.BLOCK_SIZE)
        mask = weights if mask is None else weights * mask
    table = fmt.e4m4_table(device)
    mids = ((cb[:, 1:] + cb[:, :-1]) / 2).to(dtype)  # [G, L - 1]
    codes = torch.zeros(g, n, k_pad // fmt.BLOCK_SIZE, dtype=torch.int64, device=device)
    offset_codes = torch.zeros_like(codes) if offsets else None
    indices = torch.empty(g, n, k_pad, dtype=torch.int64, device=device)
    scale = safe = None
    shift = None  # with offsets, the block's decoded offset [G, N]
    rows32 = rows.float()  # the offset rule reads float32 row scales, as the data-free rule does
    step = min(lazy_columns, k_pad)
    for start in range(0, k_pad, step):
        stop = min(start + step, k_pad)
        batch = work[..., start:stop].clone()  # [G, N, step]
        errors = torch.zeros_like(batch)
        u = upper[:, start:stop, start:stop]
        for j in range(stop - start):
            col = start + j
            if col % fmt.BLOCK_SIZE == 0:
                blk = col // fmt.BLOCK_SIZE
                block = batch[..., j : j + fmt.BLOCK_SIZE].float().reshape(g, n, 1, fmt.BLOCK_SIZE)
                block_mask = None if mask is None else mask[blk : blk + 1]
                if offsets:
                    chosen, _, found = fitting.offset_blocks(block, rows32, cb, codes_below, codes_above,
                                                             block_mask, offset_choice)
                    offset_codes[..., blk] = chosen[..., 0]
                    shift = (chosen[..., 0] * fmt.OFFSET_STEP * rows).to(dtype)
                else:
                    found = fitting.search_codes(block, rows, cb, codes_below, codes_above, block_mask)
                codes[..., blk] = found[..., 0]
                scale = table[codes[..., blk]] * rows  # [G, N]
                safe = torch.where(scale > 0, scale, 1.0)
            # The weight less its block's offset; K padding stays 0 (the index nearest 0, as quantize_fitted's).
            value = batch[..., j] if shift is None or col >= k else batch[..., j] - shift
            x = torch.where(scale > 0, value / safe, 0.0)
            idx = torch.searchsorted(mids, x.contiguous())
            indices[..., col] = idx
            err = (value - (torch.gather(cb, 1, idx) * scale).to(dtype)) / u[:, j, j, None]
            batch[..., j:] -= err[..., None] * u[:, None, j, j:]
            errors[..., j] = err
        work[..., stop:] -= errors @ upper[:, start:stop, stop:]
    # Padding rows: row scale 1.0, code 0, the level nearest 0 (format.quantize's padding).
    pad_index = torch.searchsorted(mids, torch.zeros(g, 1, device=device, dtype=dtype))  # [G, 1]
    indices = torch.cat([indices, pad_index[:, :, None].expand(g, n_pad - n, k_pad)], dim=1)
    codes = torch.nn.functional.pad(codes, (0, 0, 0, n_pad - n))
    if offsets:
        offset_codes = torch.nn.functional.pad(offset_codes, (0, 0, 0, n_pad - n))
    return fitting.pack_groups(indices.reshape(g, n_pad, -1, fmt.BLOCK_SIZE), codes, rows, bits, lead, offset_codes)


def calibrate_group(
    weights: Sequence[torch.Tensor],
    hessians: Sequence[torch.Tensor | None],
    bits: int,
    settings: CalibrationSettings | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Layers that share one codebook (siblings run as one weight: q/k/v, gate/up; or one layer alone), each with
    the Hessian ``[K, K]`` of its inputs: ``[(planes, block_scales, row_scales, codebook)]`` in their order, as
    :func:`hf_kbit.nn.quantize_group` returns them data-free.

    The codebook is the data-free one of the group (:func:`hf_kbit.fitting.group_codebook`: fitted on the
    members' rows stacked, or the configured codebook under ``"absmax"``), as quantize-on-load without
    calibration would choose it, so that siblings still fuse; with ``settings.weighted_codebook`` each element's
    error in that fit is weighted by the mean over the members of ``diag(H)``. Then each member is quantized by
    :func:`gptq_quantize` with its own Hessian; members whose Hessians are equal (siblings fed one input) and whose
    rows are whole tiles run as one weight, their rows stacked: one column loop for the group, each row's result
    its own (up to the summation order of the lazy batches' matmuls). A member whose Hessian is None (it never ran
    on the text) is quantized data-free (:func:`hf_kbit.fitting.quantize_fitted`) with the same codebook. Block
    offsets as the settings say (``block_offsets``, or an explicit ``fit``'s ``offsets``), in the codebook fit as
    without data.
    """
    settings = CalibrationSettings() if settings is None else settings
    if len(weights) != len(hessians) or not weights:
        raise ValueError(f"calibrate_group needs one Hessian (or None) per weight, got {len(weights)} weights and "
                         f"{len(hessians)} Hessians")
    for weight, hessian in zip(weights, hessians):
        if hessian is not None:
            _check_pair(weight, hessian)
    fit = settings.fit_settings(fitting.check_bits(bits))
    column_weights = None
    if settings.weighted_codebook and all(h is not None for h in hessians):
        column_weights = torch.stack([torch.diagonal(h).float() for h in hessians]).mean(0)
    codebook = fitting.group_codebook(weights, bits, fit, settings.initial_codebook(), column_weights)
    below, above = (fit.codes_below, fit.codes_above) if fit is not None else (0, 0)
    offsets, choice = (fit.offsets, fit.offset_choice) if fit is not None else (False, None)

    def calibrated(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return gptq_quantize(weight, hessian, codebook, below, above, settings.damp, settings.lazy_columns,
                             settings.weighted_codes, offsets, choice)

    packed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(weights)
    together = _shared_hessian(weights, hessians)
    if together:  # one column loop for the members instead of one each (q/k/v: a third of the steps)
        stacked = calibrated(torch.cat([weights[i] for i in together]), hessians[together[0]])
        rows = [weights[i].shape[0] for i in together]
        tiles = [n // fmt.TILE_N for n in rows]
        pieces = zip(stacked[0].split(tiles), stacked[1].split(tiles), stacked[2].split(rows))
        for i, piece in zip(together, pieces):
            packed[i] = tuple(t.clone() for t in piece)  # own storage: each is saved as its own tensor
    for i, (weight, hessian) in enumerate(zip(weights, hessians)):
        if packed[i] is None:
            packed[i] = (fitting.quantize_fitted(weight, codebook, below, above, offsets, choice) if hessian is None
                         else calibrated(weight, hessian))
    # Each member its own copy of the codebook: tensors sharing storage cannot be saved as separate entries.
    return [(*p, codebook if i == 0 else codebook.clone()) for i, p in enumerate(packed)]


def _shared_hessian(weights: Sequence[torch.Tensor], hessians: Sequence[torch.Tensor | None]) -> list[int]:
    """The members :func:`calibrate_group` quantizes as one weight: every member with a Hessian, when there are
    two or more, their Hessians are equal (siblings fed one input) and each has whole tiles of rows; else []."""
    members = [i for i, h in enumerate(hessians) if h is not None]
    if len(members) < 2 or any(weights[i].dim() != 2 or weights[i].shape[0] % fmt.TILE_N for i in members):
        return []
    first = hessians[members[0]]
    return members if all(torch.equal(hessians[i], first) for i in members[1:]) else []


def calibrate_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, bits: int, settings: CalibrationSettings | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`calibrate_group` of one layer: the data-free codebook of ``weight``, then :func:`gptq_quantize` with
    ``hessian``; ``(planes, block_scales, row_scales, codebook)``, as :func:`hf_kbit.fitting.fit_quantize`
    returns them."""
    return calibrate_group([weight], [hessian], bits, settings)[0]

