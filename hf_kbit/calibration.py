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
``H``, computed once. Fused MoE experts are not Linears: :func:`hf_kbit.nn.quantize_model` quantizes them
data-free afterwards.

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
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor [N, K], got {weight.dtype} of shape {tuple(weight.shape)}")
    k = weight.shape[1]
    if hessian.shape != (k, k) or not hessian.is_floating_point():
        raise ValueError(f"hessian must be a float [K, K] = [{k}, {k}] tensor for this weight, got {hessian.dtype} "
                         f"of shape {tuple(hessian.shape)}")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("hessian has non-finite entries (inf or NaN in the calibration activations?)")


def inverse_cholesky(hessian: torch.Tensor, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)^-1`` (float32, or float64 for a float64
    ``H``; on ``H``'s device).

    Columns that never saw a non-zero input (``H[i, i] == 0``) get ``H[i, i] = 1``: they are then quantized
    to the nearest level and pass no error on (GPTQ zeroes them; here they keep their weight, since held-out
    text may use them). If the factorisation fails the damping grows (x10, a few times) before giving up.
    """
    h = hessian.to(torch.float64 if hessian.dtype == torch.float64 else torch.float32).clone()
    diag = torch.diagonal(h)
    dead = diag == 0
    diag[dead] = 1.0
    mean = float(diag.mean()) if diag.numel() else 1.0
    for attempt in range(DAMP_RETRIES + 1):
        damped = h + (damp * DAMP_GROWTH**attempt) * mean * torch.eye(h.shape[0], device=h.device, dtype=h.dtype)
        chol, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
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
    """Quantize ``weight [N, K]`` to format v1 with ``codebook``, error feedback through ``hessian [K, K]``.

    Returns ``(planes, block_scales, row_scales)`` with the shapes and dtypes of
    :func:`hf_kbit.format.quantize` (``planes`` int32 ``[N_tiles, K_tiles, bits, 16, 4]``, ``block_scales``
    uint8 ``[N_tiles, K_tiles, 16, 4]``, ``row_scales`` float32 ``[N]``); :func:`hf_kbit.format.dequantize`
    with ``codebook`` reads them. Row scales follow the format's rule on the original weight; each block's
    code is searched over ``codes_below`` / ``codes_above`` codes around its absmax code (as
    :func:`hf_kbit.fitting.search_block_codes`) on the block's weights as the error feedback left them when
    its first column is reached (``weighted_codes``: each element's squared error weighted by ``1 / U[j, j]**2``);
    each index is the nearest level to the updated weight over its block scale.
    Runs on ``weight``'s device in float32 (float64 for a float64 weight, as the tests' references do; the code
    search always sees float32 weights). The module docstring has the algorithm.
    """
    _check_pair(weight, hessian)
    if lazy_columns < 1 or lazy_columns % fmt.BLOCK_SIZE:
        raise ValueError(f"lazy_columns must be a positive multiple of {fmt.BLOCK_SIZE}, got {lazy_columns}")
    device = weight.device
    cb = fitting.codebook_groups(codebook, (), device)  # [1, L], validated
    bits = cb.shape[1].bit_length() - 1
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.to(dtype)
    n, k = w.shape
    n_pad, k_pad = fmt.padded_shape(n, k)
    rows = fmt.row_scales(w)
    # Padding columns: zero weights uncoupled from the real ones (identity), so they receive no error and
    # quantize as format.quantize's padding does. The damping is relative to the real columns' H alone.
    upper = torch.eye(k_pad, device=device, dtype=dtype)
    if k:
        upper[:k, :k] = inverse_cholesky(hessian.to(device=device, dtype=dtype), damp)
    work = torch.nn.functional.pad(w, (0, k_pad - k))
    mask = fitting.element_mask(k, k_pad // fmt.BLOCK_SIZE, device)
    if weighted_codes:
        weights = torch.diagonal(upper).float().square().reciprocal()
        weights = (weights / weights[:k].mean()).reshape(-1, fmt.BLOCK_SIZE)
        mask = weights if mask is None else weights * mask
    table = fmt.e4m4_table(device)
    mids = ((cb[0, 1:] + cb[0, :-1]) / 2).to(dtype)
    codes = torch.zeros(n, k_pad // fmt.BLOCK_SIZE, dtype=torch.int64, device=device)
    indices = torch.empty(n, k_pad, dtype=torch.int64, device=device)
    scale = safe = None
    step = min(lazy_columns, k_pad)
    for start in range(0, k_pad, step):
        stop = min(start + step, k_pad)
        batch = work[:, start:stop].clone()
        errors = torch.zeros_like(batch)
        u = upper[start:stop, start:stop]
        for j in range(stop - start):
            col = start + j
            if col % fmt.BLOCK_SIZE == 0:
                blk = col // fmt.BLOCK_SIZE
                block = batch[:, j : j + fmt.BLOCK_SIZE].float().reshape(1, n, 1, fmt.BLOCK_SIZE)
                block_mask = None if mask is None else mask[blk : blk + 1]
                codes[:, blk] = fitting.search_codes(block, rows[None], cb, codes_below, codes_above, block_mask)[0, :, 0]
                scale = table[codes[:, blk]] * rows
                safe = torch.where(scale > 0, scale, 1.0)
            x = torch.where(scale > 0, batch[:, j] / safe, 0.0)
            idx = torch.searchsorted(mids, x.contiguous())
            indices[:, col] = idx
            err = (batch[:, j] - (cb[0][idx] * scale).to(dtype)) / u[j, j]
            batch[:, j:] -= err[:, None] * u[j, j:][None, :]
            errors[:, j] = err
        work[:, stop:] -= errors @ upper[start:stop, stop:]
    # Padding rows: row scale 1.0, code 0, the level nearest 0 (format.quantize's padding).
    pad_index = torch.searchsorted(mids, torch.zeros(1, device=device, dtype=dtype))
    indices = torch.cat([indices, pad_index.expand(n_pad - n, k_pad)])
    codes = torch.nn.functional.pad(codes, (0, 0, 0, n_pad - n))
    planes = fmt.tile_planes(fmt.pack_bitplanes(indices.reshape(n_pad, -1, fmt.BLOCK_SIZE), bits))
    return planes, fmt.tile(codes.to(torch.uint8)), rows.contiguous()


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


def calibrate_model(
    model: nn.Module,
    batches: list[torch.Tensor],
    bits: int | Mapping[str, int],
    modules: list[str] | None = None,
    settings: CalibrationSettings | None = None,
    progress: bool = True,
    on_quantized: Callable[[str, nn.Linear, tuple], None] | None = None,
    groups: Sequence[Sequence[str]] = (),
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
    Returns:
        ``{name: (planes, block_scales, row_scales, codebook)}`` (format v1 tensors on the module's device), in
        the order the modules were quantized. Each quantized module's weight is replaced by its dequantized value
        (in its dtype), so the model afterwards is the fake-quantized model that the calibration saw.
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

    results: dict[str, tuple] = {}

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
    bar = tqdm(total=len(linears), desc="calibrating", unit="linear", disable=not progress)
    try:
        with torch.no_grad():
            hidden, calls = _record_layer_calls(model, layers, batches)
            for i, layer in enumerate(layers):
                inside = [unit for unit in units if unit[1] == i]
                bar.set_postfix_str(f"layer {i + 1}/{len(layers)}")
                if inside:
                    hooks = _HessianHooks({name: linears[name] for unit, _ in inside for name in unit})
                    try:
                        for states, (args, kwargs) in zip(hidden, calls[i]):
                            layer(states, *args, **kwargs)
                            hooks.next_forward()
                    finally:
                        hooks.remove()
                    for unit, _ in inside:  # a module never called on this text (an unused branch): data-free
                        quantize(unit, [hooks.hessian(name) for name in unit])
                    del hooks
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
