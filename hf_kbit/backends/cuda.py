"""CUDA implementations of ``kbit::quantize``, ``kbit::dequantize`` and ``kbit::mm``.

Imported by ``hf_kbit/__init__.py`` only when the compiled library loads; registered for the
``CUDA`` dispatch key, so CPU tensors keep the reference and CUDA tensors take these.
Every launch goes on torch's current stream; outputs and workspaces come from torch's
allocator; nothing here synchronizes, so the ops are CUDA-graph safe.

Dispatch of ``mm`` by M (rows of x after flattening the leading dims):
  * ``M <= GEMV_MAX_M``: the GEMV kernel (no tensor cores, weight decoded once for all rows);
  * larger M, or float32 x: dequantize into a torch-allocated weight in x's dtype, then
    ``torch.matmul`` (cuBLAS).
"""

from __future__ import annotations

import torch

from .. import _lib
from .. import _ops
from .. import format as fmt

_LIB = _lib.load()

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# Largest M for which the GEMV beats dequantize + cuBLAS (H100 measurement, benchmarks/results).
GEMV_MAX_M = int(_LIB.kbit_gemv_max_m())

_workspace_sizes: dict[tuple, int] = {}
_checked_shapes: set[tuple] = set()


try:  # the raw pointer without building a Stream object: ~1 us instead of several
    _raw_stream = torch._C._cuda_getCurrentRawStream

    def _stream(device: torch.device) -> int:
        return _raw_stream(device.index)

except AttributeError:  # pragma: no cover - older torch

    def _stream(device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream


def _same_device(x: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected {x.device} (all kbit tensors must be on one device)")


def _check_packed_once(planes, block_scales, row_scales, codebook, in_features) -> None:
    # The shape check costs several microseconds of Python; a layer repeats one signature.
    key = (tuple(planes.shape), planes.dtype, tuple(block_scales.shape), block_scales.dtype,
           tuple(row_scales.shape), row_scales.dtype, tuple(codebook.shape), codebook.dtype, in_features)
    if key not in _checked_shapes:
        _ops._check_packed(planes, block_scales, row_scales, codebook, in_features)
        _checked_shapes.add(key)


# ---------------------------------------------------------------------------- quantize


@torch.library.impl(_ops._lib, "quantize", "CUDA")
def _quantize_cuda(weight: torch.Tensor, codebook: torch.Tensor):
    if codebook.dim() != 1:
        return fmt.quantize(weight, codebook)
    if weight.dim() < 2:
        raise ValueError(f"weight must be [..., N, K], got shape {tuple(weight.shape)}")
    bits = int(codebook.numel()).bit_length() - 1
    if bits not in fmt.SUPPORTED_BITS or codebook.numel() != 1 << bits:
        raise ValueError(f"codebook must have 2**bits entries for bits in {fmt.SUPPORTED_BITS}, got {codebook.numel()}")
    if weight.dtype not in _DTYPE_CODE:
        weight = weight.float()
    weight = weight.contiguous()
    cb = codebook.to(device=weight.device, dtype=torch.float32).contiguous()
    *lead, n, k = weight.shape
    shapes = fmt.packed_shapes(n, k, bits)
    planes = torch.empty((*lead, *shapes["planes"]), dtype=torch.int32, device=weight.device)
    block_scales = torch.empty((*lead, *shapes["block_scales"]), dtype=torch.uint8, device=weight.device)
    row_scales = torch.empty((*lead, n), dtype=torch.float32, device=weight.device)
    batch = 1
    for d in lead:
        batch *= d
    rc = _LIB.kbit_quantize(
        weight.device.index, _stream(weight.device), weight.data_ptr(), _DTYPE_CODE[weight.dtype], cb.data_ptr(),
        bits, batch, n, k, planes.data_ptr(), block_scales.data_ptr(), row_scales.data_ptr(),
    )
    _lib.check(rc, "quantize")
    return planes, block_scales, row_scales


# ---------------------------------------------------------------------------- dequantize


def _dequantize_into(planes, block_scales, row_scales, codebook, in_features, out: torch.Tensor) -> torch.Tensor:
    bits = planes.shape[-3]
    n = row_scales.shape[-1]
    batch = row_scales.numel() // n if n else 0
    cb_stride = 0 if codebook.dim() == 1 else codebook.shape[-1]
    planes, block_scales = planes.contiguous(), block_scales.contiguous()
    row_scales, codebook = row_scales.contiguous(), codebook.contiguous()
    rc = _LIB.kbit_dequantize(
        planes.device.index, _stream(planes.device), planes.data_ptr(), block_scales.data_ptr(),
        row_scales.data_ptr(), codebook.data_ptr(), cb_stride, bits, batch, n, in_features,
        out.data_ptr(), _DTYPE_CODE[out.dtype],
    )
    _lib.check(rc, "dequantize")
    return out


@torch.library.impl(_ops._lib, "dequantize", "CUDA")
def _dequantize_cuda(planes, block_scales, row_scales, codebook, in_features, dtype):
    _check_packed_once(planes, block_scales, row_scales, codebook, in_features)
    _same_device(planes, block_scales=block_scales, row_scales=row_scales, codebook=codebook)
    kernel_dtype = dtype if dtype in _DTYPE_CODE else torch.float32
    out = torch.empty((*row_scales.shape, in_features), dtype=kernel_dtype, device=planes.device)
    if out.numel():
        _dequantize_into(planes, block_scales, row_scales, codebook, in_features, out)
    return out if kernel_dtype == dtype else out.to(dtype)


# ---------------------------------------------------------------------------- mm


@torch.library.impl(_ops._lib, "mm", "CUDA")
def _mm_cuda(x, planes, block_scales, row_scales, codebook, in_features):
    _ops._check_mm_input(x, in_features)
    _check_packed_once(planes, block_scales, row_scales, codebook, in_features)
    _same_device(x, planes=planes, block_scales=block_scales, row_scales=row_scales, codebook=codebook)
    if row_scales.dim() != 1:
        raise ValueError(f"kbit::mm takes one 2-D weight (row_scales [N]), got row_scales of shape {tuple(row_scales.shape)}")
    n, k = row_scales.shape[0], in_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or n == 0 or k == 0:
        return x.new_zeros((*lead, n))
    if m > GEMV_MAX_M or x.dtype == torch.float32:
        w = torch.empty((n, k), dtype=x.dtype, device=x.device)
        _dequantize_into(planes, block_scales, row_scales, codebook, k, w)
        return torch.matmul(x2, w.t()).reshape(*lead, n)
    x2 = x2.contiguous()
    bits = planes.shape[-3]
    device = x.device
    key = (device.index, m, n, k, bits)
    ws_size = _workspace_sizes.get(key)
    if ws_size is None:
        ws_size = _workspace_sizes[key] = int(_LIB.kbit_gemv_workspace_size(device.index, m, n, k, bits))
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    ws = torch.empty(ws_size, dtype=torch.float32, device=device) if ws_size else None
    rc = _LIB.kbit_gemv(
        device.index, _stream(device), x2.data_ptr(), _DTYPE_CODE[x.dtype], planes.data_ptr(),
        block_scales.data_ptr(), row_scales.data_ptr(), codebook.data_ptr(), bits, m, n, k, out.data_ptr(),
        ws.data_ptr() if ws is not None else None, ws_size,
    )
    _lib.check(rc, "mm")
    return out.reshape(*lead, n)
