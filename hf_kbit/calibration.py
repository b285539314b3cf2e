"""Calibration: activation-aware choice of format v1's free parts from a small text sample.

Data-free fitting (:mod:`hf_kbit.fitting`) lowers the weight-space error ``||W - Q||^2``. What a layer's
output sees is ``||(W - Q) X||^2`` for its inputs ``X``, i.e. ``tr((W - Q) H (W - Q)^T)`` with
``H = X^T X / tokens``. Calibration lowers that, the way GPTQ does, inside format v1:

- The **row scales** follow the format's rule, and the **codebook** is the one quantization without data would
  choose (:func:`hf_kbit.fitting.group_codebook`: fitted on the original weight, or on the stacked weights of
  siblings that share a codebook so that they can still run fused). Both are fixed before the columns run.
- **Columns in K order** (:func:`gptq_quantize`). Each column's indices are the nearest codebook level to
  ``w / scale`` of its block; the column's error, divided by the diagonal of the upper Cholesky factor of
  ``H^-1``, is pushed onto the columns not yet quantized (``W[:, j:] -= err * U[i, j:]``). Updates within a
  lazy batch of ``lazy_columns`` columns are immediate; the rest of the matrix gets one matmul per batch.
- **Block codes when the block is first reached**: at the block's first column, its 32 (already updated)
  weights choose their E4M4 code by :func:`hf_kbit.fitting.search_block_codes`'s rule (least squared
  error over the window of codes around the absmax code), as GPTQ with group-wise scales does without
  act-order. The indices that follow may then differ from the nearest level of the original weight: the
  format allows any index.

With ``H`` diagonal nothing propagates, and the bytes equal :func:`hf_kbit.fitting.quantize_fitted`'s with
the same codebook and code window (tested).

:func:`calibrate_model` runs this over a model the way GPTQ does: decoder layer by decoder layer, each
layer's Linears collecting ``H`` from inputs that come through the already quantized layers before it, then
quantized, written back (dequantized) into the model, and the layer run again to give the next one its
inputs. A tqdm bar counts the Linears. Siblings (q/k/v, gate/up) read the same input, so they get the same
``H``, computed once. Fused MoE experts (``calibrate_model(experts=...)``) collect one ``H`` per expert from
the tokens routed to it, and are quantized stacked, a few experts at a time (:func:`calibrate_experts`).

Cost: one forward of the calibration tokens per decoder layer (twice: once with hooks), ``H`` in float32 on the
model's device (``K x K`` per distinct input), and a Python loop over columns whose steps are whole-row tensor
operations on the device, with one matmul per lazy batch for the rest of the matrix: no host synchronisation
per column (the E4M4 table is cached per device).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import fitting
from . import format as fmt

__all__ = [
    "DEFAULT_LAZY_COLUMNS",
    "CalibrationSettings",
    "calibrate_experts",
    "calibrate_group",
    "calibrate_model",
    "calibrate_quantize",
    "calibration_batches",
    "config_batches",
    "decoder_layers",
    "gptq_quantize",
    "inverse_cholesky",
]

# GPTQ's lazy batch: columns updated in place before the trailing matrix gets one matmul. A multiple of the
# format's block so a block never straddles two batches.
DEFAULT_LAZY_COLUMNS = 128
# Experts calibrated at once: their inverse-Hessian factors and working weights, at most this many float32
# elements (1 GB), whatever the expert count.
EXPERT_CHUNK_ELEMENTS = 1 << 28
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
    """

    damp: float = DEFAULT_DAMP
    lazy_columns: int = DEFAULT_LAZY_COLUMNS
    fit: fitting.FitSettings | None = None
    weighted_codebook: bool = False
    weighted_codes: bool = False
    fitting: str | None = None
    codebook: str | tuple[float, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.damp, (int, float)) or isinstance(self.damp, bool) or not 0 < self.damp < 1:
            raise ValueError(f"CalibrationSettings.damp must be a number in (0, 1), got {self.damp!r}")
        lazy = self.lazy_columns
        if not isinstance(lazy, int) or isinstance(lazy, bool) or lazy < 1 or lazy % fmt.BLOCK_SIZE:
            raise ValueError(f"CalibrationSettings.lazy_columns must be a positive multiple of {fmt.BLOCK_SIZE}, "
                             f"got {lazy!r}")
        if self.fit is not None and not isinstance(self.fit, fitting.FitSettings):
            raise TypeError(f"CalibrationSettings.fit must be a fitting.FitSettings or None, got {type(self.fit)}")
        for name in ("weighted_codebook", "weighted_codes"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CalibrationSettings.{name} must be a bool, got {getattr(self, name)!r}")
        if self.fitting is not None and self.fitting not in fitting.FITTINGS:
            raise ValueError(f"CalibrationSettings.fitting must be one of {fitting.FITTINGS} or None, got {self.fitting!r}")
        if isinstance(self.codebook, list):  # a frozen dataclass stays hashable with levels as a tuple
            object.__setattr__(self, "codebook", tuple(self.codebook))

    def fit_settings(self, bits: int) -> fitting.FitSettings | None:
        """The FitSettings at ``bits`` (codebook fit and code window), None for ``fitting="absmax"``."""
        if self.fit is not None:
            return self.fit
        return fitting.settings_for(self.fitting, bits, self.codebook)

    def initial_codebook(self) -> str | list[float] | None:
        """``codebook`` as :func:`hf_kbit.format.make_codebook` takes it."""
        return list(self.codebook) if isinstance(self.codebook, tuple) else self.codebook


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
    weight over its block scale. A stack gives what each of its weights gives alone (up to the summation order
    of the lazy batches' matmuls).
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
    indices = torch.empty(g, n, k_pad, dtype=torch.int64, device=device)
    scale = safe = None
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
                codes[..., blk] = fitting.search_codes(block, rows, cb, codes_below, codes_above, block_mask)[..., 0]
                scale = table[codes[..., blk]] * rows  # [G, N]
                safe = torch.where(scale > 0, scale, 1.0)
            x = torch.where(scale > 0, batch[..., j] / safe, 0.0)
            idx = torch.searchsorted(mids, x.contiguous())
            indices[..., col] = idx
            err = (batch[..., j] - (torch.gather(cb, 1, idx) * scale).to(dtype)) / u[:, j, j, None]
            batch[..., j:] -= err[..., None] * u[:, None, j, j:]
            errors[..., j] = err
        work[..., stop:] -= errors @ upper[:, start:stop, stop:]
    # Padding rows: row scale 1.0, code 0, the level nearest 0 (format.quantize's padding).
    pad_index = torch.searchsorted(mids, torch.zeros(g, 1, device=device, dtype=dtype))  # [G, 1]
    indices = torch.cat([indices, pad_index[:, :, None].expand(g, n_pad - n, k_pad)], dim=1)
    codes = torch.nn.functional.pad(codes, (0, 0, 0, n_pad - n))
    return fitting.pack_groups(indices.reshape(g, n_pad, -1, fmt.BLOCK_SIZE), codes, rows, bits, lead)


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
    :func:`gptq_quantize` with its own Hessian; a member whose Hessian is None (it never ran on the text) is
    quantized data-free (:func:`hf_kbit.fitting.quantize_fitted`) with the same codebook.
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
    out = []
    for i, (weight, hessian) in enumerate(zip(weights, hessians)):
        if hessian is None:
            planes, block_scales, rows = fitting.quantize_fitted(weight, codebook, below, above)
        else:
            planes, block_scales, rows = gptq_quantize(
                weight, hessian, codebook, below, above, settings.damp, settings.lazy_columns, settings.weighted_codes
            )
        # Each member its own copy of the codebook: tensors sharing storage cannot be saved as separate entries.
        out.append((planes, block_scales, rows, codebook if i == 0 else codebook.clone()))
    return out


def calibrate_experts(
    weight: torch.Tensor, hessian: torch.Tensor, bits: int, settings: CalibrationSettings | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused MoE projection ``weight [E, N, K]`` (Linear layout), each expert with the Hessian of its own
    inputs, ``hessian [E, K, K]``: ``(planes [E, ...], block_scales [E, ...], row_scales [E, N], codebook)``, as
    :meth:`hf_kbit.nn.KbitExperts.pack` returns them data-free.

    The experts share the codebook quantization without data gives them (fitted on all experts' rows; the
    ``weighted_codebook`` option does not apply), then :func:`gptq_quantize` runs on a few experts at a time,
    stacked. An expert no token reached has ``H = 0`` and is thus quantized as without data.
    """
    settings = CalibrationSettings() if settings is None else settings
    if weight.dim() != 3:
        raise ValueError(f"weight must be a stack of expert weights [E, N, K], got shape {tuple(weight.shape)}")
    _check_pair(weight, hessian)
    fit = settings.fit_settings(fitting.check_bits(bits))
    codebook = fitting.group_codebook([weight], bits, fit, settings.initial_codebook())
    below, above = (fit.codes_below, fit.codes_above) if fit is not None else (0, 0)
    n_pad, k_pad = fmt.padded_shape(*weight.shape[1:])
    chunk = max(1, EXPERT_CHUNK_ELEMENTS // (k_pad * (k_pad + n_pad)))
    parts = [gptq_quantize(w, h, codebook, below, above, settings.damp, settings.lazy_columns)
             for w, h in zip(weight.split(chunk), hessian.split(chunk))]
    planes, block_scales, rows = (torch.cat(tensors) for tensors in zip(*parts))
    return planes, block_scales, rows, codebook


def calibrate_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, bits: int, settings: CalibrationSettings | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`calibrate_group` of one layer: the data-free codebook of ``weight``, then :func:`gptq_quantize` with
    ``hessian``; ``(planes, block_scales, row_scales, codebook)``, as :func:`hf_kbit.fitting.fit_quantize`
    returns them."""
    return calibrate_group([weight], [hessian], bits, settings)[0]


# ---------------------------------------------------------------------------- text


def calibration_batches(tokenizer, text: str, samples: int, seq_len: int, batch_size: int = 8) -> list[torch.Tensor]:
    """The last ``samples * seq_len`` tokens of ``text`` (no special tokens), as int64 batches
    ``[<= batch_size, seq_len]`` of consecutive, non-overlapping sequences.

    The end of the text, not its start: an evaluation that scores a corpus's first tokens can calibrate on
    its other end (the caller checks that the two do not meet).
    """
    for name, value in (("samples", samples), ("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"calibration {name} must be a positive int, got {value!r}")
    need = samples * seq_len
    chars = 8 * need  # no tokenizer here averages 8 characters per token, on prose or code
    while True:
        piece = text[-chars:] if chars < len(text) else text
        ids = tokenizer(piece, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        ids = ids[1:] if piece is not text else ids  # the first token may be a cut word
        if len(ids) >= need or piece is text:
            break
        chars *= 2
    if len(ids) < need:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than samples x seq_len = "
                         f"{samples} x {seq_len} = {need}")
    tokens = torch.tensor(ids[-need:], dtype=torch.int64).reshape(samples, seq_len)
    return list(tokens.split(batch_size))


def config_batches(config, model: nn.Module) -> list[torch.Tensor]:
    """The calibration token batches a :class:`hf_kbit.KbitConfig` with ``calibration_data`` asks for
    (:func:`calibration_batches` of its text), tokenized by its ``calibration_tokenizer`` or else by the
    tokenizer of ``model``'s folder or Hub repo (``model.config.name_or_path``)."""
    tokenizer = _load_tokenizer(config.calibration_tokenizer, model)
    samples, seq_len = config.calibration_shape()
    text = config.calibration_text()
    try:
        return calibration_batches(tokenizer, text, samples, seq_len)
    except ValueError as e:
        how = "" if not isinstance(config.calibration_data, str) or "\n" in config.calibration_data else (
            " (calibration_data was read as the text itself, not as a file name: no such file)")
        raise ValueError(f"KbitConfig.calibration_data: {e}{how}; pass more text, or lower calibration_samples "
                         "or calibration_seq_len") from None


def _load_tokenizer(tokenizer, model: nn.Module):
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    source = tokenizer or getattr(getattr(model, "config", None), "name_or_path", None)
    if not source:
        raise ValueError("KbitConfig.calibration_tokenizer: the model was not loaded from a folder or Hub repo, so its "
                         "tokenizer is unknown; pass calibration_tokenizer (a tokenizer, a repo id or a folder)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError) as e:
        what = "KbitConfig.calibration_tokenizer" if tokenizer else "the model's folder or repo"
        raise ValueError(f"calibration needs a tokenizer: {what} {source!r} has none that loads ({e}); pass "
                         "KbitConfig(calibration_tokenizer=...)") from None


# ---------------------------------------------------------------------------- a model


class _StopForward(Exception):
    """Raised by a pre-hook once every decoder layer's arguments are recorded: the rest of the model is skipped."""


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, module list)`` of the model's decoder layers: the first ModuleList of
    ``num_hidden_layers`` modules (``model.layers`` in transformers' causal LMs)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = getattr(config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return name, module
    raise ValueError(f"{type(model).__name__}: no ModuleList of num_hidden_layers={count} decoder layers found; "
                     "calibration runs decoder layer by decoder layer")


def _record_layer_calls(model, layers: nn.ModuleList, batches: list[torch.Tensor]):
    """Per batch: the hidden states entering layer 0, and per layer the other arguments it is called with
    (attention masks and position embeddings depend on the token positions only, not on the weights)."""
    hidden: list[torch.Tensor] = []
    calls: list[list[tuple[tuple, dict]]] = [[] for _ in layers]

    def hook_for(i):
        def hook(module, args, kwargs):
            states = args[0] if args else kwargs["hidden_states"]
            if i == 0:
                hidden.append(states.detach())
            rest = {key: value for key, value in kwargs.items() if key != "hidden_states"}
            calls[i].append((tuple(args[1:]), rest))
            if i == len(layers) - 1:
                raise _StopForward
        return hook

    handles = [layer.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(layers)]
    device = next(model.parameters()).device
    try:
        for batch in batches:
            try:
                model(input_ids=batch.to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return hidden, calls


def _layer_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class _HessianHooks:
    """Forward hooks that add ``x^T x`` of each hooked Linear's input into that Linear's ``H`` (float32, summed
    over tokens). Linears fed the same tensor in one forward (q/k/v, gate/up) share one product."""

    def __init__(self, linears: Mapping[str, nn.Linear]):
        self.sums = {name: None for name in linears}
        self.tokens = {name: 0 for name in linears}
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in linears.items()]

    def _hook(self, name):
        def hook(module, args, output):
            x = args[0].detach()
            product = next((p for seen, p in self._seen if seen is x), None)
            if product is None:
                flat = x.reshape(-1, x.shape[-1]).float()
                product = flat.T @ flat
                self._seen.append((x, product))
            self.sums[name] = product.clone() if self.sums[name] is None else self.sums[name].add_(product)
            self.tokens[name] += x.numel() // x.shape[-1]
        return hook

    def next_forward(self) -> None:
        self._seen.clear()

    def hessian(self, name: str) -> torch.Tensor | None:
        """``X^T X / tokens`` of ``name``'s inputs, or None if it never ran."""
        if self.sums[name] is None:
            return None
        return self.sums[name] / max(self.tokens[name], 1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._seen.clear()


class _ExpertsHessians:
    """Forward pre-hooks on fused MoE experts modules, called as ``experts(hidden_states [T, H], top_k_index
    [T, k], top_k_weights)``: per expert, the float32 sums of ``x^T x`` over the tokens routed to it (the
    gate/up projection's input) and over its gated activations computed from its current weights (the down
    projection's input, through the module's own gating), and how many tokens it got."""

    def __init__(self, modules: Mapping[str, nn.Module]):
        from .nn.experts import fused_experts_layout

        self.layouts = {name: fused_experts_layout(m, name) for name, m in modules.items()}
        self.sums: dict[str, dict[str, torch.Tensor]] = {name: {} for name in modules}
        self.tokens = {name: [0] * self.layouts[name].num_experts for name in modules}
        self._handles = [m.register_forward_pre_hook(self._hook(name), with_kwargs=True) for name, m in modules.items()]

    def parameters(self, name: str, module: nn.Module) -> dict[str, nn.Parameter]:
        """The module's ``{"gate_up_proj": ..., "down_proj": ...}`` expert weights (in the model's layout)."""
        return {projection: getattr(module, projection) for projection in ("gate_up_proj", "down_proj")}

    def _hook(self, name):
        def hook(module, args, kwargs):
            from .nn.experts import apply_gate

            layout = self.layouts[name]
            x = args[0] if args else kwargs["hidden_states"]
            index = args[1] if len(args) > 1 else next(kwargs[k] for k in ("top_k_index", "router_indices") if k in kwargs)
            x = x.detach().reshape(-1, layout.hidden_size).float()
            index = index.reshape(x.shape[0], -1)
            experts = layout.num_experts
            flat = index.reshape(-1).long()
            expert = torch.where((flat >= 0) & (flat < experts), flat, experts)  # ids outside [0, E): no expert
            order = torch.argsort(expert, stable=True)
            counts = torch.bincount(expert, minlength=experts + 1)[:experts].tolist()  # one wait per call
            routed = x[(order // index.shape[1])[: sum(counts)]].split(counts)
            weights = self.parameters(name, module)
            gate_up = weights["gate_up_proj"].detach()
            gate_up = gate_up if layout.is_transposed else gate_up.transpose(-1, -2)  # [E, H, 2I]: x @ it
            bias = getattr(module, "gate_up_proj_bias", None)
            sums = self.sums[name]
            if not sums:
                for projection, param in weights.items():
                    k = layout.linear_shape(projection)[1]
                    sums[projection] = torch.zeros(experts, k, k, dtype=torch.float32, device=x.device)
            for e, xe in enumerate(routed):
                if not counts[e]:
                    continue
                sums["gate_up_proj"][e] += xe.T @ xe
                h = xe @ gate_up[e].float()
                if bias is not None:
                    h = h + bias[e].float()
                act = apply_gate(module, h)
                sums["down_proj"][e] += act.T @ act
                self.tokens[name][e] += counts[e]
        return hook

    def hessian(self, name: str, projection: str) -> torch.Tensor:
        """``[E, K, K]``: each expert's ``X^T X / tokens`` (zeros for an expert that got none)."""
        if projection not in self.sums[name]:  # the module never ran on this text
            layout = self.layouts[name]
            k = layout.linear_shape(projection)[1]
            return torch.zeros(layout.num_experts, k, k)
        tokens = torch.tensor(self.tokens[name], dtype=torch.float32).clamp(min=1)
        return self.sums[name][projection] / tokens.to(self.sums[name][projection].device)[:, None, None]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def calibrate_model(
    model: nn.Module,
    batches: list[torch.Tensor],
    bits: int | Mapping[str, int],
    modules: list[str] | None = None,
    settings: CalibrationSettings | None = None,
    progress: bool = True,
    on_quantized: Callable[[str, nn.Linear, tuple], None] | None = None,
    groups: Sequence[Sequence[str]] = (),
    experts: Sequence[str] = (),
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Quantize ``modules`` of ``model`` with :func:`calibrate_group`, decoder layer by decoder layer, in place.

    Args:
        model: a transformers causal LM (its decoder layers found by :func:`decoder_layers`).
        batches: int64 token ids ``[batch, seq_len]`` (:func:`calibration_batches`).
        bits: one k for every module, or ``{module name: k}``.
        modules: names of the nn.Linear modules to quantize (default: every nn.Linear inside the decoder
            layers). Modules outside the decoder layers are quantized data-free (:func:`calibrate_group` without
            Hessians).
        settings: :class:`CalibrationSettings`.
        progress: show a tqdm bar over the modules.
        on_quantized: called as ``on_quantized(name, linear, packed)`` after each module is quantized, before
            its weight is overwritten (e.g. to measure the error against the original weight).
        groups: modules (each in ``modules``, of one decoder layer and one k) that share one codebook
            (:func:`hf_kbit.nn.codebook_siblings`); every other module has its own.
        experts: names of fused MoE experts modules inside the decoder layers (3-D ``gate_up_proj`` /
            ``down_proj``, :func:`hf_kbit.nn.experts.fused_experts_layout`) to calibrate too, by
            :func:`calibrate_experts`: each expert with the Hessian of the tokens routed to it. ``bits`` of a
            mapping is looked up as ``"<experts>.gate_up_proj"`` and ``"<experts>.down_proj"``.
    Returns:
        ``{name: (planes, block_scales, row_scales, codebook)}`` (format v1 tensors on the module's device), in
        the order the modules were quantized; an experts module's projections as ``"<experts>.gate_up_proj"`` and
        ``"<experts>.down_proj"``, stacked over the experts (``row_scales [E, N]``, one codebook). Each quantized
        weight is replaced by its dequantized value (in its dtype), so the model afterwards is the
        fake-quantized model that the calibration saw.
    """
    from tqdm.auto import tqdm

    settings = CalibrationSettings() if settings is None else settings
    prefix, layers = decoder_layers(model)
    if modules is None:
        modules = [f"{prefix}.{i}.{name}" for i, layer in enumerate(layers)
                   for name, m in layer.named_modules() if isinstance(m, nn.Linear)]
    linears = {name: model.get_submodule(name) for name in modules}
    for name, m in linears.items():
        if not isinstance(m, nn.Linear):
            raise TypeError(f"calibrate_model: {name!r} is a {type(m).__name__}, not an nn.Linear")
    bits_of = (lambda name: bits) if isinstance(bits, int) else bits.__getitem__
    if not batches:
        raise ValueError("calibrate_model needs at least one batch of calibration tokens")
    units = _units(list(linears), groups, bits_of, prefix, len(layers))
    moe = {name: model.get_submodule(name) for name in experts}
    outside = [name for name in moe if _units([name], (), bits_of, prefix, len(layers))[0][1] is None]
    if outside:
        raise ValueError(f"calibrate_model: experts {outside[0]!r} are not inside a decoder layer")

    results: dict[str, tuple] = {}

    def quantize_experts(name: str, hessians: _ExpertsHessians) -> None:
        module = moe[name]
        for projection, param in hessians.parameters(name, module).items():
            weight = param.detach().transpose(-1, -2) if hessians.layouts[name].is_transposed else param.detach()
            packed = calibrate_experts(weight, hessians.hessian(name, projection), bits_of(f"{name}.{projection}"),
                                       settings)
            approx = fmt.dequantize(*packed, weight.shape[-1]).to(param.dtype)
            param.data.copy_(approx.transpose(-1, -2) if hessians.layouts[name].is_transposed else approx)
            results[f"{name}.{projection}"] = packed
            bar.update(1)

    def quantize(unit: tuple[str, ...], hessians: list[torch.Tensor | None]) -> None:
        weights = [linears[name].weight.detach() for name in unit]
        for name, packed in zip(unit, calibrate_group(weights, hessians, bits_of(unit[0]), settings)):
            linear = linears[name]
            if on_quantized is not None:
                on_quantized(name, linear, packed)
            planes, block_scales, rows, codebook = packed
            approx = fmt.dequantize(planes, block_scales, rows, codebook, linear.in_features)
            linear.weight.data.copy_(approx.to(linear.weight.dtype))
            results[name] = packed
            bar.update(1)

    was_training = model.training
    model.eval()
    bar = tqdm(total=len(linears) + 2 * len(moe), desc="calibrating", unit="weight", disable=not progress)
    try:
        with torch.no_grad():
            hidden, calls = _record_layer_calls(model, layers, batches)
            for i, layer in enumerate(layers):
                inside = [unit for unit in units if unit[1] == i]
                inside_moe = {name: m for name, m in moe.items() if name.startswith(f"{prefix}.{i}.")}
                bar.set_postfix_str(f"layer {i + 1}/{len(layers)}")
                if inside or inside_moe:
                    hooks = _HessianHooks({name: linears[name] for unit, _ in inside for name in unit})
                    moe_hooks = _ExpertsHessians(inside_moe)
                    try:
                        for states, (args, kwargs) in zip(hidden, calls[i]):
                            layer(states, *args, **kwargs)
                            hooks.next_forward()
                    finally:
                        hooks.remove()
                        moe_hooks.remove()
                    for unit, _ in inside:  # a module never called on this text (an unused branch): data-free
                        quantize(unit, [hooks.hessian(name) for name in unit])
                    for name in inside_moe:
                        quantize_experts(name, moe_hooks)
                    del hooks, moe_hooks
                hidden = [_layer_output(layer(states, *args, **kwargs))
                          for states, (args, kwargs) in zip(hidden, calls[i])]
            for unit, _ in [u for u in units if u[1] is None]:  # outside the decoder layers
                quantize(unit, [None] * len(unit))
    finally:
        bar.close()
        model.train(was_training)
    return results


def _units(
    names: list[str], groups: Sequence[Sequence[str]], bits_of, prefix: str, num_layers: int
) -> list[tuple[tuple[str, ...], int | None]]:
    """``(members, decoder layer index or None)`` of every group of ``names`` quantized together, in the order of
    their first member; a name in no group is a group of its own."""
    layer_re = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")

    def layer_of(name: str) -> int | None:
        match = layer_re.match(name)
        return int(match.group(1)) if match and int(match.group(1)) < num_layers else None

    group_of: dict[str, tuple[str, ...]] = {}
    for group in groups:
        group = tuple(group)
        unknown = [name for name in group if name not in names]
        if unknown:
            raise ValueError(f"calibrate_model: group {group} names {unknown}, not among the modules to quantize")
        if len({layer_of(name) for name in group}) != 1 or len({bits_of(name) for name in group}) != 1:
            raise ValueError(f"calibrate_model: the members of group {group} must sit in one decoder layer and "
                             "have one k, since they share a codebook")
        group_of.update(dict.fromkeys(group, group))
    units = dict.fromkeys(group_of.get(name, (name,)) for name in names)
    return [(unit, layer_of(unit[0])) for unit in units]
