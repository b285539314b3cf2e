"""Rotated layers on the CUDA backend (hf_kbit.rotation; docs/kernels.md, "Rotation"): the standalone
rotation kernel (``x R`` and ``y R^T``) and the rotated GEMV's plan.

A rotated layer stores the quantized ``W' = W R``; its kernels multiply ``x R``. Where no kernel stages
``x R`` itself, :func:`rotate` makes it (dequantize + cuBLAS), and the gradient ``dX = (dY W') R^T``
goes through :func:`unrotate`. ``hf_kbit.backends.cuda`` re-exports these names.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import _lib
from .cuda_calls import rows as _rows
from .cuda_calls import stream as _stream

_LIB = _lib.load()
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ROTATE_MODES = {1: "staged", 0: "standalone", -1: None}  # kbit_gemv_rotate_plan's modes


def signs_ptr(signs, k: int, device: torch.device):
    """The C ABI's rot_signs for ``signs`` (None: no rotation), after checking it."""
    if signs is None:
        return None
    if signs.dtype != torch.int32 or tuple(signs.shape) != (k // 32,) or k % 64:
        raise ValueError(f"signs must be int32 [in_features // 32] = [{k // 32}] with in_features % 64 == 0 "
                         f"(in_features={k}), got {signs.dtype} {tuple(signs.shape)}")
    if signs.device != device:
        raise ValueError(f"signs is on {signs.device} but the weight is on {device} "
                         "(all kbit tensors must be on one device)")
    if not signs.is_contiguous():
        raise ValueError("signs must be contiguous")
    return signs.data_ptr()


def rotate(x: torch.Tensor, signs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x [..., K] @ R`` (``inverse``: ``@ R^T``) in x's dtype, float32 arithmetic rounded once: the
    standalone rotation kernel, bit-exact with ``rotation.rotate`` (``unrotate``) rounded to x's dtype."""
    k = x.shape[-1]
    sp = signs_ptr(signs, k, x.device)
    if sp is None:
        raise ValueError("rotate needs the sign words (signs)")
    if x.dtype not in _DTYPE_CODE:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    x2 = _rows(x, k)
    out = torch.empty((x2.shape[0], k), dtype=x.dtype, device=x.device)
    rc = _LIB.kbit_rotate(x.device.index, _stream(x.device), x2.data_ptr(), x2.stride(0) if x2.shape[0] > 1 else k,
                          _DTYPE_CODE[x.dtype], x2.shape[0], k, sp, int(inverse), out.data_ptr())
    _lib.check(rc, "rotate")
    return out.reshape(x.shape)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``y [..., K] @ R^T`` (:func:`rotate` with ``inverse``): e.g. dX = (dY W') R^T of a rotated layer."""
    return rotate(y, signs, inverse=True)


@functools.cache
def gemv_rotate_plan(m: int, bits: int, dtype: torch.dtype = torch.bfloat16, prologue: bool = False):
    """How a rotated layer's GEMV of ``m`` rows runs, as the library plans it from the measured crossover
    (``rotated_gemv`` in crossovers.json): ``"staged"`` (the GEMV stages ``x R``), ``"standalone"`` (the
    standalone rotation into its workspace first), or None (a prologue beyond the rotated
    instantiations: run it unfused). Cleared when the crossovers are reloaded."""
    mode = ctypes.c_int()
    _lib.check(_LIB.kbit_gemv_rotate_plan(bits, _DTYPE_CODE[dtype], m, int(prologue), ctypes.byref(mode)),
               "gemv_rotate_plan")
    return ROTATE_MODES[mode.value]
