"""Anchors: other weight formats, applied as fake quantization (quantize, dequantize, put back into the Linear).

An anchor changes a Linear's weight to exactly what its format would reconstruct, so the model runs the
usual float forward; only quality is measured here, never speed. Each anchor states its storage cost in
bits per weight, metadata included:

- ``rtn<b>``: asymmetric round-to-nearest integers, groups of ``group_size`` (default 128) consecutive
  elements along K (the input dim) of each row. Per group: ``scale = (max - min) / (2**b - 1)`` and
  ``zero = min``, both rounded to fp16 (that is what is stored and what dequantizes); ``q = clamp(round((w -
  zero) / scale), 0, 2**b - 1)``, ``w ~= q * scale + zero``. A row whose K is not a multiple of the group size
  ends with a shorter group. Bits: ``b + 2 * 16 * ceil(K / group) / K``.
- ``nf4``: bitsandbytes' NF4 (4-bit normal-float levels, :func:`hf_kbit.format.normal_float_codebook` at k = 4
  reproduces its table), blocks of ``group_size`` (default 64) consecutive elements of the flattened weight
  as bitsandbytes cuts them, absmax per block stored as float32, each element to the nearest level (ties to
  the lower). No double quantization of the absmax (transformers' default ``bnb_4bit_use_double_quant=False``):
  ``4 + 32 * ceil(N * K / block) / (N * K)``, 4.5 at K a multiple of 64.
- ``hqq<b>``: HQQ (the ``hqq`` package) with its defaults, ``BaseQuantizeConfig(nbits=b, group_size=64)``
  (axis 1: groups along K; the half-quadratic zero-point optimizer; zero rounded at 4 bits), fp16 scale and
  zero per group (HQQ's default compute dtype), the weight HQQLinear.dequantize() returns. Bits: ``b + 2 * 16
  / group``; ``stored_bits_per_weight`` also counts HQQ's packing as it is (3-bit codes go 10 to an int32:
  3.2 bits each).

- ``kbitfit<k>``: the kbit format itself (v1: blocks of 32, E4M4 block codes, float32 row scales, a
  per-layer codebook) with its free choices fitted by :mod:`hf_kbit.fitting` (block codes searched by
  reconstruction error, codebook by Lloyd iterations; options ``codes_below``, ``codes_above``,
  ``lloyd_iters`` override ``fitting.DEFAULT_SETTINGS[k]``), dequantized with :func:`hf_kbit.format.dequantize`:
  what the kbit kernels would compute with, before that quantizer is wired into quantize-on-load. Bits:
  :func:`hf_kbit.format.bits_per_weight`, the same as ``kbit<k>``.
  ``offsets=1`` (the default, as ``KbitConfig``'s): format v4's block offsets (``FitSettings.offsets``: each
  block's midrange in steps of 1/8 row scale, on every block or where it lowers the block's error as the k's
  ``FitSettings.offset_choice`` says, int16 block records; what ``kbit<k>`` quantizes on load, here without
  sibling codebooks or the v/o turn); ``offsets=0``: none (format v1, ``kbit<k>:block_offsets=false``). Bits:
  :func:`hf_kbit.format.bits_per_weight` with ``offsets``, 8 more per block.

Rotation (format v3) is not an anchor: ``kbit<k>:rotation=true`` (or ``=auto``) quantizes through the shipped
path, ``KbitConfig(rotation=...)``, whose modules rotate the activations as the kernels do.

All functions take a 2-D weight ``[N, K]`` of any float dtype on any device and return float32 on that device.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .. import format as fmt

ANCHORS = ("hqq", "rtn", "nf", "kbitfit")
ANCHOR_BITS = {"hqq": (2, 3, 4, 5, 8), "rtn": (2, 3, 4, 5, 8), "nf": (4,), "kbitfit": fmt.SUPPORTED_BITS}
DEFAULT_GROUP_SIZE = {"hqq": 64, "rtn": 128, "nf": 64, "kbitfit": fmt.BLOCK_SIZE}
FIT_OPTIONS = ("codes_below", "codes_above", "lloyd_iters")  # kbitfit's overrides of fitting.FitSettings
OFFSET_OPTION = "offsets"  # kbitfit: 1 gives each block an offset (module docstring; FitSettings.offsets); 0: none
DEFAULT_OFFSETS = 1  # as KbitConfig.block_offsets=None quantizes unrotated weights
KBIT_OPTIONS = {"kbitfit": (*FIT_OPTIONS, OFFSET_OPTION)}  # options per fitted method
FP16_BITS = 16  # scale and zero of RTN and HQQ
FP32_BITS = 32  # NF4 absmax


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D float weight [N, K], got {weight.dtype} of shape {tuple(weight.shape)}")


def _check_group(group_size: int, what: str = "group_size") -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"{what} must be a positive int, got {group_size!r}")


def _row_groups(weight: torch.Tensor, size: int) -> torch.Tensor:
    """``weight [N, K]`` in float32 as ``[N, ceil(K / size), size]`` groups along K; a row's last element repeats to
    fill its last group, so that group's min and max stay its own."""
    n, k = weight.shape
    groups = math.ceil(k / size)
    w = weight.float()
    pad = groups * size - k
    if pad:
        w = torch.cat([w, w[:, -1:].expand(n, pad)], dim=1)
    return w.reshape(n, groups, size)


# ----------------------------------------------------------------------------- RTN


def rtn_fake_quantize(weight: torch.Tensor, bits: int, group_size: int = 128) -> torch.Tensor:
    """Asymmetric round-to-nearest with min/max per group of ``group_size`` along K (module docstring)."""
    _check_weight(weight)
    _check_group(group_size)
    n, k = weight.shape
    x = _row_groups(weight, group_size)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).half().float()
    zero = lo.half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group reconstructs as its zero
    q = ((x - zero) / safe).round().clamp(0, levels) * (scale > 0)
    return (q * scale + zero).reshape(n, -1)[:, :k]


def rtn_bits_per_weight(n: int, k: int, bits: int, group_size: int = 128) -> float:
    """``bits`` plus an fp16 scale and an fp16 zero per group (ceil(K / group) groups per row)."""
    return bits + 2 * FP16_BITS * math.ceil(k / group_size) / k


# ----------------------------------------------------------------------------- NF4


def nf4_levels() -> torch.Tensor:
    """bitsandbytes' 16 NF4 levels, float32, sorted (built by formula: hf_kbit.format's "nf" codebook at k = 4)."""
    return fmt.normal_float_codebook(4, zero=True)


def nf4_fake_quantize(weight: torch.Tensor, block_size: int = 64) -> torch.Tensor:
    """NF4 with a float32 absmax per block of ``block_size`` elements of the flattened weight (module docstring)."""
    _check_weight(weight)
    _check_group(block_size, "block_size")
    flat = weight.float().reshape(-1)
    blocks = math.ceil(flat.numel() / block_size)
    x = torch.nn.functional.pad(flat, (0, blocks * block_size - flat.numel())).reshape(blocks, block_size)
    absmax = x.abs().amax(-1, keepdim=True)
    normed = x / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    levels = nf4_levels().to(weight.device)
    index = torch.bucketize(normed, (levels[1:] + levels[:-1]) / 2)  # nearest level; a tie goes to the lower
    return (levels[index] * absmax).reshape(-1)[: flat.numel()].reshape(weight.shape)


def nf4_bits_per_weight(n: int, k: int, block_size: int = 64) -> float:
    """4 bits plus a float32 absmax per block of the flattened weight, without double quantization."""
    return 4 + FP32_BITS * math.ceil(n * k / block_size) / (n * k)


# ----------------------------------------------------------------------------- HQQ


def require_hqq():
    """hqq.core.quantize, or ImportError saying how to install it."""
    try:
        from hqq.core import quantize
    except ImportError as e:
        raise ImportError(
            "the hqq anchors need the hqq package: `pip install hf-kbit[eval]` (or `pip install hqq`; set "
            "DISABLE_CUDA=1 while installing it to skip its optional CUDA extension build)"
        ) from e
    return quantize


def hqq_fake_quantize(weight: torch.Tensor, bits: int, group_size: int = 64) -> tuple[torch.Tensor, int]:
    """HQQ's own quantize + dequantize with ``BaseQuantizeConfig(nbits=bits, group_size=group_size)``.

    Runs on the weight's device (HQQ optimizes in fp16 on CUDA, fp32 on CPU). Returns ``(weight float32,
    stored bytes)``: the bytes of HQQLinear's packed codes, scales and zeros as it holds them.
    """
    _check_weight(weight)
    n, k = weight.shape
    if k % group_size:
        # HQQ groups the flattened weight: with K not a multiple of the group, groups would straddle rows.
        raise ValueError(f"hqq: in_features {k} is not a multiple of group_size {group_size}")
    hqq = require_hqq()
    layer = hqq.HQQLinear.from_weights(
        weight.detach(), None, hqq.BaseQuantizeConfig(nbits=bits, group_size=group_size),
        compute_dtype=torch.float16, device=str(weight.device), del_orig=True,
    )
    stored = sum(t.numel() * t.element_size() for t in (layer.W_q, layer.meta["scale"], layer.meta["zero"]))
    return layer.dequantize().float().reshape(n, k), stored


def hqq_bits_per_weight(n: int, k: int, bits: int, group_size: int = 64) -> float:
    """``bits`` plus HQQ's fp16 scale and fp16 zero per group."""
    return bits + 2 * FP16_BITS / group_size


# ----------------------------------------------------------------------------- kbit, fitted


def kbit_fit_fake_quantize(weight: torch.Tensor, bits: int, settings=None) -> torch.Tensor:
    """``weight`` through :func:`hf_kbit.fitting.fit_quantize` and :func:`hf_kbit.format.dequantize`."""
    from .. import fitting

    _check_weight(weight)
    planes, block_scales, row_scales, codebook = fitting.fit_quantize(weight, bits, settings)
    return fmt.dequantize(planes, block_scales, row_scales, codebook, weight.shape[1])


# ----------------------------------------------------------------------------- one interface


@dataclass(frozen=True)
class Anchor:
    """One anchor format: ``method`` in ANCHORS, ``bits``, ``group_size`` (the NF4 block size for ``nf``; fixed
    at the format's block for ``kbitfit``), ``fit`` (``kbitfit`` only: ``(name, value)`` overrides of
    :class:`hf_kbit.fitting.FitSettings`)."""

    method: str
    bits: int
    group_size: int
    fit: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if self.method not in ANCHORS:
            raise ValueError(f"anchor method must be one of {ANCHORS}, got {self.method!r}")
        if self.bits not in ANCHOR_BITS[self.method]:
            raise ValueError(f"{self.method} anchors take bits in {ANCHOR_BITS[self.method]}, got {self.bits!r}")
        _check_group(self.group_size)
        if self.method == "hqq" and self.group_size % 8:
            raise ValueError(f"hqq: group_size must be a multiple of 8 (HQQ's rule), got {self.group_size}")
        if self.method in KBIT_OPTIONS:
            if self.group_size != fmt.BLOCK_SIZE:
                raise ValueError(f"{self.method}: the format's block is {fmt.BLOCK_SIZE} elements, "
                                 f"got group_size={self.group_size}")
            offset = dict(self.fit).get(OFFSET_OPTION, DEFAULT_OFFSETS)
            if offset not in (0, 1) or isinstance(offset, bool):
                raise ValueError(f"{self.method}: {OFFSET_OPTION} must be 0 (none) or 1 (an offset per block), "
                                 f"got {offset!r}")
            self.fit_settings()  # validates the overrides
        elif self.fit:
            raise ValueError(f"{self.method} anchors take no fit options, got {dict(self.fit)}")

    def fit_settings(self):
        """kbitfit: ``fitting.DEFAULT_SETTINGS[bits]`` with this anchor's overrides."""
        from .. import fitting

        allowed = KBIT_OPTIONS[self.method]
        unknown = sorted(set(dict(self.fit)) - set(allowed))
        if unknown:
            raise ValueError(f"{self.method}: unknown option(s) {unknown}; it takes {list(allowed)}")
        overrides = {k: v for k, v in self.fit if k in FIT_OPTIONS}
        return dataclasses.replace(fitting.DEFAULT_SETTINGS[self.bits], offsets=self.offsets, **overrides)

    @property
    def offsets(self) -> bool:
        """kbitfit: whether each block gets an offset (module docstring)."""
        return bool(dict(self.fit).get(OFFSET_OPTION, DEFAULT_OFFSETS))

    def fake_quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``(reconstructed weight float32, stored bits per weight as the format would hold it)``."""
        n, k = weight.shape
        if self.method == "hqq":
            out, stored = hqq_fake_quantize(weight, self.bits, self.group_size)
            return out, 8 * stored / (n * k)
        if self.method == "rtn":
            return rtn_fake_quantize(weight, self.bits, self.group_size), self.bits_per_weight(n, k)
        if self.method == "kbitfit":
            return kbit_fit_fake_quantize(weight, self.bits, self.fit_settings()), self.bits_per_weight(n, k)
        return nf4_fake_quantize(weight, self.group_size), self.bits_per_weight(n, k)

    def bits_per_weight(self, n: int, k: int) -> float:
        """Codes plus every byte of metadata per weight of an ``[n, k]`` matrix (module docstring)."""
        if self.method == "hqq":
            return hqq_bits_per_weight(n, k, self.bits, self.group_size)
        if self.method == "rtn":
            return rtn_bits_per_weight(n, k, self.bits, self.group_size)
        if self.method in KBIT_OPTIONS:
            return fmt.bits_per_weight(n, k, self.bits, offsets=self.offsets)
        return nf4_bits_per_weight(n, k, self.group_size)

    def describe(self) -> str:
        """What the anchor is and what its bits/weight count, for the JSON."""
        if self.method == "hqq":
            return (f"HQQ BaseQuantizeConfig(nbits={self.bits}, group_size={self.group_size}) defaults, fp16 "
                    f"scale + fp16 zero per group: {self.bits} + 32/{self.group_size} bits/weight")
        if self.method == "rtn":
            return (f"asymmetric RTN int{self.bits}, min/max per group of {self.group_size} along K, fp16 scale + "
                    f"fp16 zero per group: {self.bits} + 32/{self.group_size} bits/weight (tail groups included)")
        if self.method in KBIT_OPTIONS:
            settings = self.fit_settings()
            version = fmt.OFFSETS_VERSION if self.offsets else 1
            return (f"kbit format v{version}, k = {self.bits}, fitted by hf_kbit.fitting (block codes searched "
                    f"{settings.codes_below} below / {settings.codes_above} above the absmax code, "
                    f"{settings.lloyd_iters} Lloyd iterations of the per-layer codebook)"
                    + (", an offset per block (format v4's int16 block records: 8-bit codes in steps of 1/8 row "
                       "scale)" if self.offsets else "")
                    + ", dequantized: bits/weight as format.bits_per_weight")
        return (f"NF4 (bitsandbytes levels), float32 absmax per block of {self.group_size}, no double "
                f"quantization: 4 + 32/{self.group_size} bits/weight")
