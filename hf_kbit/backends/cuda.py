"""CUDA implementations of ``kbit::quantize``, ``kbit::dequantize``, ``kbit::mm`` and ``kbit::grouped_mm``.

Imported by ``hf_kbit/__init__.py`` only when the compiled library loads; registered for the
``CUDA`` dispatch key, so CPU tensors keep the reference and CUDA tensors take these.
Every launch goes on torch's current stream; outputs and workspaces come from torch's
allocator; nothing here synchronizes, so the ops are CUDA-graph safe.

Eager fast path: :func:`linear_fast` serves ``KbitLinear.forward`` outside torch.compile /
tracing with a per-module call record (validated once by ``kbit_gemv_prepare``), so a call
costs one output allocation and one short ctypes call; everything else goes through
``torch.ops.kbit.mm``.

Dispatch of ``mm`` by M (rows of x after flattening the leading dims): the library's planner
(``kbit_mm_plan``) picks the path from the measured crossovers in ``crossovers.json``
(docs/kernels.md), and each kernel call plans its own tiles and splits:
  * small M: the GEMV kernel (weight decoded once for all rows by the CUDA cores, multiply-adds
    on the tensor cores, all of x staged once);
  * mid M: a GEMM kernel (the weight is decoded into tensor-core operands, never written out):
    on sm_90 the wgmma GEMM (csrc/wgmma_kernel.cuh), elsewhere the mma.sync GEMM
    (csrc/gemm_kernel.cuh); :func:`set_gemm_kernel` (or ``HF_KBIT_GEMM_KERNEL``) picks another, such
    as the warp-specialized wgmma GEMM (csrc/wgmma_ws_kernel.cuh);
  * large M, float32 x, or a GPU without the GEMM's shared memory: dequantize into a
    torch-allocated weight in x's dtype, then ``torch.matmul`` (cuBLAS).

Rotated layers (hf_kbit.rotation): every function that computes with a weight takes ``signs``, the
layer's sign words (int32 ``[in_features // 32]`` on the weight's device, bit ``e % 32`` of word
``e // 32`` set where ``s_e = -1``; :func:`hf_kbit.rotation.sign_words` builds them), or None. The kernels then multiply
``x R`` by the stored ``W'``: the GEMV stages ``x R`` up to its measured crossover (``rotated_gemv`` in
crossovers.json) and above it runs the standalone rotation into its workspace first, as the mma.sync
GEMM does; the wgmma GEMM rotates in its x rewrite; dequantize + cuBLAS multiplies the stored weight by
the standalone rotation's ``x R``, and the gradient ``dX = (dY W') R^T`` is unrotated after the matmul.
Only ``dequantize`` itself returns the weight unrotated, ``W' R^T``. The eager fast path reads
``module.rotation_signs``.

Block records (``block_scales`` int16, format v4, :mod:`hf_kbit.format`: an offset per block):
``mm`` takes :func:`records_plan`'s path: the GEMV on records (``kbit_gemv_offsets``: unrotated, M up to
:func:`gemv_offsets_max_m`) whatever the planner would take for uint8 codes; above it the wgmma GEMM on records
(``kbit_gemm_offsets``: unrotated, sm_90a) where the planner takes the wgmma GEMM for uint8 codes; else
dequantize + matmul. The prologue ops (``mm_silu_mul``, ``mm_rmsnorm``, ``mm_add_rmsnorm``) take the GEMV on records
with their prologue (``kbit_gemv_prologue_offsets``) over the same M, and above it (or in a library without that
entry) run unfused (the reference's prologue, then ``mm``). With ``glu=True`` the norm ops' SiLU-gated product is
the GEMV's GLU epilogue where :func:`glu_serves` (its own plan), else ``silu_mul_halves`` after the product. The dequantize kernel on records
(``kbit_dequantize_records``, bit-exact with ``format.dequantize``) serves ``dequantize``, the dequantize + matmul
path (a rotated layer's too: ``x R`` times the stored weight) and the gradient. What no kernel reads records for
(``dequantize`` of a rotated layer, ``grouped_mm``) takes the reference (``format.dequantize`` as torch ops on the
GPU) and warns once; no kernel that reads uint8 codes is ever handed records.
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import torch

from .. import _lib
from .. import _ops
from .. import format as fmt
from . import crossovers
from .cuda_calls import rows as _rows
from .cuda_calls import stream as _stream
from .cuda_rotation import gemv_rotate_plan, rotate, unrotate
from .cuda_rotation import signs_ptr as _signs_ptr

_LIB = _lib.load()

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# The GEMV kernel's own limit on M.
GEMV_MAX_M = int(_LIB.kbit_gemv_max_m())

PATHS = ("gemv", "gemm", "dequant")  # kbit_mm_plan's path codes 0, 1, 2


def load_crossovers(path=crossovers.FILE) -> None:
    """Hand the measured path crossovers to the library's planner, ``kbit_mm_plan``: the one place that
    picks a path, a kernel, its tiles and splits."""
    for kernel, by_bits in crossovers.read(path).items():
        for bits, (gemv_max_m, classes) in by_bits.items():
            weights = (ctypes.c_int64 * len(classes))(*(w for w, _ in classes))
            gemm_max = (ctypes.c_int64 * len(classes))(*(m for _, m in classes))
            rc = _LIB.kbit_set_mm_crossovers(crossovers.GEMM_KERNELS.index(kernel), bits, gemv_max_m, len(classes),
                                             weights, gemm_max)
            _lib.check(rc, f"set_mm_crossovers ({kernel}, bits={bits})")
    for bits, in_staging_max_m in crossovers.read_rotated(path).items():
        _lib.check(_LIB.kbit_set_gemv_rotate_crossover(bits, in_staging_max_m), f"set_gemv_rotate_crossover ({bits})")
    _mm_plans.clear()
    gemv_rotate_plan.cache_clear()


_mm_plans: dict[tuple, tuple[str, str, int]] = {}


def mm_plan(m: int, n: int, k: int, bits: int, device: int, dtype: torch.dtype = torch.bfloat16,
            rotated: bool = False) -> tuple:
    """``(path, gemm kernel, workspace floats)`` of ``kbit::mm`` for ``x [m, k]`` in ``dtype`` and a
    ``[n, k]`` weight (``rotated``: a rotated layer's) on CUDA device index ``device``, as the library
    plans it (cached: a layer repeats one problem)."""
    key = (device, m, n, k, bits, dtype, rotated)
    plan = _mm_plans.get(key)
    if plan is None:
        path, gemm, ws = ctypes.c_int(), ctypes.c_int(), ctypes.c_int64()
        rc = _LIB.kbit_mm_plan(device, m, n, k, bits, _DTYPE_CODE[dtype], int(rotated), ctypes.byref(path),
                               ctypes.byref(gemm), ctypes.byref(ws))
        _lib.check(rc, "mm_plan")
        plan = _mm_plans[key] = (PATHS[path.value], crossovers.GEMM_KERNELS[gemm.value], int(ws.value))
    return plan


def _forget_plans() -> None:
    """Drop the cached plans, workspaces and kernel choices: the planner's overrides changed."""
    _mm_plans.clear()
    gemm_workspace.cache_clear()
    gemm_kernel.cache_clear()
    gemm_offsets_serves.cache_clear()
    _gemv_workspace.cache_clear()


def set_gemm_kernel(name: str | None) -> None:
    """Plan every later ``kbit::mm`` with the GEMM kernel ``name``, process-wide (tests and benchmarks):
    ``"mma"`` (mma.sync, any sm_80+), ``"wgmma"`` (sm_90a, the default there) or ``"wgmma_ws"`` (the
    warp-specialized GEMM, sm_90a); ``None`` returns to ``HF_KBIT_GEMM_KERNEL``'s choice. A GPU without
    sm_90a code runs the mma.sync GEMM whatever is asked. Each kernel keeps its own crossovers."""
    if name is not None and name not in crossovers.GEMM_KERNELS:
        raise ValueError(f"set_gemm_kernel: name must be one of {crossovers.GEMM_KERNELS} or None, got {name!r}")
    code = -1 if name is None else crossovers.GEMM_KERNELS.index(name)
    _lib.check(_LIB.kbit_set_gemm_kernel(code), "set_gemm_kernel")
    _forget_plans()


@functools.cache
def gemm_kernel(device: int) -> str:
    """The GEMM kernel the planner takes on CUDA device index ``device`` (a name of crossovers.GEMM_KERNELS)."""
    return crossovers.GEMM_KERNELS[_LIB.kbit_gemm_kernel(device)]


def set_wgmma_ws_plan(nb: int | None = None, splits: int | None = None) -> None:
    """Plan the warp-specialized GEMM with token blocks of ``64 * nb`` tokens (1, 2 or 4) and ``splits`` K splits
    (1..8) from now on, process-wide, instead of its cost model's choice (``None``: the model's): tests cover
    every tile with it, benchmarks time each plan to fit the model."""
    _lib.check(_LIB.kbit_set_wgmma_ws_plan(nb or 0, splits or 0), "set_wgmma_ws_plan")
    _forget_plans()


def set_gemv_plan(mode: int | None = None, splits: int | None = None) -> None:
    """Plan the GEMV in ``mode`` (``kbit_gemv_plan``'s: 0 one split or splits through a workspace, 1 splits
    through a cluster, 2 balanced, 3 balanced in a cluster) with ``splits`` K splits (``None``: the cheapest of
    that mode) from now on, process-wide, instead of its cost model's choice (``mode=None``: the model's): a
    problem with no such plan fails to launch. Calls prepared before (a module's eager fast path, whose call record
    holds its plan) keep theirs. For tests and benchmarks that time every plan."""
    _lib.check(_LIB.kbit_set_gemv_plan(-1 if mode is None else mode, splits or 0), "set_gemv_plan")
    _forget_plans()


def mm_path(m: int, n: int, k: int, bits: int, device: int, dtype: torch.dtype = torch.bfloat16,
            rotated: bool = False) -> str:
    """The kernel path ``kbit::mm`` takes (:func:`mm_plan`)."""
    return mm_plan(m, n, k, bits, device, dtype, rotated)[0]


def gemv_wins(m: int, n: int, k: int, bits: int, device: int, dtype: torch.dtype = torch.bfloat16,
              rotated: bool = False) -> bool:
    """True when the GEMV serves this problem (the eager fast path covers only the GEMV)."""
    return mm_plan(m, n, k, bits, device, dtype, rotated)[0] == "gemv"


load_crossovers()


_checked_shapes: set[tuple] = set()


@functools.cache  # a layer repeats one problem
def gemm_workspace(device: int, m: int, n: int, k: int, bits: int, rotated: bool = False) -> int:
    """Floats of workspace the GEMM needs on CUDA device index ``device`` (``rotated``: for a rotated
    layer); -1 where it cannot run."""
    return int(_LIB.kbit_gemm_workspace_size(device, m, n, k, bits, int(rotated)))


_gemm_workspace = gemm_workspace  # the name before it was public


@functools.cache
def _gemv_workspace(device: int, m: int, n: int, k: int, bits: int, rotated: bool = False) -> int:
    """Floats of workspace the GEMV needs on CUDA device index ``device`` (``rotated``: a rotated layer's)."""
    return int(_LIB.kbit_gemv_workspace_size(device, m, n, k, bits, int(rotated)))


# ---------------------------------------------------------------------------- block records

# The block-records kernels (optional: a library without them takes the reference on records). Declared here, where
# they are used, as the entries are looked up by name (kbit_api.h): ctypes would otherwise pass pointers as C ints.
_c_int, _c_i64, _c_vp = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_HAS_DEQUANTIZE_RECORDS = hasattr(_LIB, "kbit_dequantize_records")
if _HAS_DEQUANTIZE_RECORDS:
    _LIB.kbit_dequantize_records.argtypes = [_c_int, _c_vp, _c_vp, _c_vp, _c_vp, _c_vp, _c_i64, _c_int, _c_i64, _c_i64,
                                             _c_i64, _c_vp, _c_int]
    _LIB.kbit_dequantize_records.restype = _c_int
_HAS_OFFSETS = hasattr(_LIB, "kbit_gemv_offsets")
if _HAS_OFFSETS:
    _LIB.kbit_gemv_offsets_max_m.argtypes = [_c_int, _c_int]
    _LIB.kbit_gemv_offsets_max_m.restype = _c_int
    _LIB.kbit_gemv_offsets.argtypes = [_c_int, _c_vp, _c_vp, _c_int, _c_vp, _c_vp, _c_vp, _c_vp, _c_int, _c_i64,
                                       _c_i64, _c_i64, _c_vp, _c_vp, _c_i64]
    _LIB.kbit_gemv_offsets.restype = _c_int
    _LIB.kbit_gemv_prepare_offsets.argtypes = [_c_int, _c_int, _c_vp, _c_vp, _c_vp, _c_vp, _c_int, _c_i64, _c_i64,
                                               _c_i64, _c_vp, ctypes.POINTER(_c_i64)]
    _LIB.kbit_gemv_prepare_offsets.restype = _c_int
# The block-records GEMV with a prologue (a later entry than kbit_gemv_offsets: a library may hold that one alone).
_HAS_PROLOGUE_OFFSETS = hasattr(_LIB, "kbit_gemv_prologue_offsets")
if _HAS_PROLOGUE_OFFSETS:
    _LIB.kbit_gemv_prologue_offsets.argtypes = [_c_int, _c_vp, _c_int, _c_vp, _c_i64, _c_vp, _c_i64, _c_vp,
                                                ctypes.c_float, _c_vp, _c_int, _c_vp, _c_vp, _c_vp, _c_vp, _c_int,
                                                _c_i64, _c_i64, _c_i64, _c_vp, _c_vp, _c_i64]
    _LIB.kbit_gemv_prologue_offsets.restype = _c_int
# The GLU epilogue of the records GEMV with a prologue (a later entry again).
_HAS_GLU = _HAS_PROLOGUE_OFFSETS and hasattr(_LIB, "kbit_gemv_glu_serves")
if _HAS_GLU:
    _LIB.kbit_gemv_glu_serves.argtypes = [_c_int, _c_i64, _c_i64, _c_i64, _c_int, _c_int]
    _LIB.kbit_gemv_glu_serves.restype = _c_int
_HAS_GEMM_OFFSETS = hasattr(_LIB, "kbit_gemm_offsets")
if _HAS_GEMM_OFFSETS:
    _LIB.kbit_gemm_offsets_serves.argtypes = [_c_int, _c_i64, _c_i64, _c_i64, _c_int, _c_int]
    _LIB.kbit_gemm_offsets_serves.restype = _c_int
    _LIB.kbit_gemm_offsets.argtypes = [_c_int, _c_vp, _c_vp, _c_int, _c_vp, _c_vp, _c_vp, _c_vp, _c_int, _c_i64,
                                       _c_i64, _c_i64, _c_vp, _c_vp, _c_i64]
    _LIB.kbit_gemm_offsets.restype = _c_int


def has_records(block_scales: torch.Tensor) -> bool:
    """True for int16 block records (an offset per block), False for uint8 E4M4 codes."""
    return block_scales.dtype == fmt.RECORD_DTYPE


@functools.cache
def gemv_offsets_max_m(bits: int, dtype: torch.dtype) -> int:
    """The largest M the block-records GEMV serves at ``bits`` for x in ``dtype`` (0: none)."""
    if not _HAS_OFFSETS or dtype not in (torch.float16, torch.bfloat16):
        return 0
    return int(_LIB.kbit_gemv_offsets_max_m(bits, _DTYPE_CODE[dtype]))


def offsets_gemv_serves(m: int, bits: int, dtype: torch.dtype, signs=None) -> bool:
    """True when the block-records GEMV serves ``x [m, k]`` in ``dtype``: unrotated, M within its tiles."""
    return signs is None and 1 <= m <= gemv_offsets_max_m(bits, dtype)


def offsets_prologue_serves(m: int, bits: int, dtype: torch.dtype, signs=None) -> bool:
    """True when the block-records GEMV with a prologue (``kbit_gemv_prologue_offsets``) serves ``x [m, k]`` in
    ``dtype``: where the plain one does (:func:`offsets_gemv_serves`) and the library has the entry."""
    return _HAS_PROLOGUE_OFFSETS and offsets_gemv_serves(m, bits, dtype, signs)


@functools.cache  # a layer repeats one problem
def glu_serves(m: int, n: int, k: int, bits: int, device: int, dtype: torch.dtype) -> bool:
    """True when the records GEMV with a prologue serves ``glu=True`` itself (``kbit_gemv_glu_serves``: its GLU
    plan, balanced and one split, exists for ``x [m, k]`` times the fused ``[n, k]`` gate/up weight on device index
    ``device``); elsewhere the prologue GEMV runs and :func:`hf_kbit._ops.silu_mul_halves` after it."""
    if not _HAS_GLU or dtype not in (torch.float16, torch.bfloat16):
        return False
    return bool(_LIB.kbit_gemv_glu_serves(device, m, n, k, bits, _DTYPE_CODE[dtype]))


@functools.cache  # a layer repeats one problem; set_gemm_kernel and set_wgmma_ws_plan clear it (_forget_plans)
def gemm_offsets_serves(m: int, n: int, k: int, bits: int, device: int, dtype: torch.dtype) -> bool:
    """True when the block-records wgmma GEMM serves ``x [m, k]`` in ``dtype`` times an unrotated ``[n, k]`` weight
    on CUDA device index ``device``: this problem's GEMM there is the wgmma GEMM (sm_90a, not overridden by
    :func:`set_gemm_kernel`) and the library holds its records instantiation. The crossovers are not consulted:
    :func:`records_plan` does that."""
    if not _HAS_GEMM_OFFSETS or dtype not in (torch.float16, torch.bfloat16):
        return False
    return bool(_LIB.kbit_gemm_offsets_serves(device, m, n, k, bits, _DTYPE_CODE[dtype]))


def records_plan(m: int, n: int, k: int, bits: int, device: int, dtype: torch.dtype,
                 signs=None) -> tuple[str, int | None]:
    """``(path, workspace floats or None)`` of ``kbit::mm`` on a layer with block records: "gemv" (the block-records
    GEMV) where it serves, "gemm" (the block-records wgmma GEMM) where the planner takes the wgmma GEMM for uint8
    codes (:func:`mm_plan`) and it serves, else "dequant" (the records dequantize kernel, then torch.matmul). A
    rotated layer (``signs``) always dequantizes: no GEMV or GEMM instantiation reads records rotated."""
    if signs is not None:
        return "dequant", None
    if offsets_gemv_serves(m, bits, dtype):
        return "gemv", None
    path, gemm, ws_size = mm_plan(m, n, k, bits, device, dtype)
    if path == "gemm" and gemm == "wgmma" and gemm_offsets_serves(m, n, k, bits, device, dtype):
        return "gemm", ws_size
    return "dequant", None


@functools.cache
def _warn_records_fallback(what: str) -> None:
    """Warns once per ``what``: a call on block records that no kernel serves takes the reference."""
    warnings.warn(f"kbit: {what} on a layer with block records (KbitConfig.block_offsets=True) has no CUDA kernel; "
                  "it runs the torch reference, which dequantizes the weight first (docs/kernels.md, 'Block records')",
                  stacklevel=4)


def _records_weight(planes, block_scales, row_scales, codebook, k: int, dtype: torch.dtype, signs=None):
    """The weight of block records in ``dtype`` (``signs``: unrotated), by the reference: format.dequantize as torch
    ops on the records' device in float32, rounded once (where the dequantize kernel does not serve)."""
    _warn_records_fallback("dequantize of a rotated layer" if signs is not None else "dequantize")
    return _ops._dequantize_ref(planes, block_scales, row_scales, codebook, k, dtype, signs)


def _dense(planes, block_scales, row_scales, codebook) -> tuple:
    """The packed tensors as the kernels read them, dense arrays: strided views (e.g. slices of a larger
    buffer) copied."""
    return tuple(t.contiguous() for t in (planes, block_scales, row_scales, codebook))


def _same_device(x: torch.Tensor, x_name: str = "x", /, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(
                f"{name} is on {t.device} but {x_name} is on {x.device} (all kbit tensors must be on one device)"
            )


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


def _dequantize_into(planes, block_scales, row_scales, codebook, in_features, out: torch.Tensor,
                     signs=None) -> torch.Tensor:
    records = has_records(block_scales)
    if records and (signs is not None or not _HAS_DEQUANTIZE_RECORDS):  # no kernel unrotates records: the reference
        return out.copy_(_records_weight(planes, block_scales, row_scales, codebook, in_features, out.dtype, signs))
    sp = _signs_ptr(signs, in_features, planes.device)
    bits = planes.shape[-3]
    n = row_scales.shape[-1]
    batch = row_scales.numel() // n if n else 0
    cb_stride = 0 if codebook.dim() == 1 else codebook.shape[-1]
    planes, block_scales = planes.contiguous(), block_scales.contiguous()
    row_scales, codebook = row_scales.contiguous(), codebook.contiguous()
    args = (planes.device.index, _stream(planes.device), planes.data_ptr(), block_scales.data_ptr(),
            row_scales.data_ptr(), codebook.data_ptr(), cb_stride, bits, batch, n, in_features, out.data_ptr(),
            _DTYPE_CODE[out.dtype])
    rc = _LIB.kbit_dequantize_records(*args) if records else _LIB.kbit_dequantize(*args, sp)
    _lib.check(rc, "dequantize")
    return out


@torch.library.impl(_ops._lib, "dequantize", "CUDA")
def _dequantize_cuda(planes, block_scales, row_scales, codebook, in_features, dtype, signs=None):
    _check_packed_once(planes, block_scales, row_scales, codebook, in_features)
    _same_device(planes, "planes", block_scales=block_scales, row_scales=row_scales, codebook=codebook)
    _signs_ptr(signs, in_features, planes.device)
    kernel_dtype = dtype if dtype in _DTYPE_CODE else torch.float32
    out = torch.empty((*row_scales.shape, in_features), dtype=kernel_dtype, device=planes.device)
    if out.numel():
        _dequantize_into(planes, block_scales, row_scales, codebook, in_features, out, signs)
    return out if kernel_dtype == dtype else out.to(dtype)


# ---------------------------------------------------------------------------- mm


@torch.library.impl(_ops._lib, "mm", "CUDA")
def _mm_cuda(x, planes, block_scales, row_scales, codebook, in_features, signs=None):
    _ops._check_mm_input(x, in_features)
    _check_packed_once(planes, block_scales, row_scales, codebook, in_features)
    _same_device(x, planes=planes, block_scales=block_scales, row_scales=row_scales, codebook=codebook)
    _signs_ptr(signs, in_features, x.device)
    if row_scales.dim() != 1:
        raise ValueError(f"kbit::mm takes one 2-D weight (row_scales [N]), got row_scales of shape {tuple(row_scales.shape)}")
    n, k = row_scales.shape[0], in_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or n == 0 or k == 0:
        return x.new_zeros((*lead, n))
    if has_records(block_scales):
        path, ws_size = records_plan(m, n, k, planes.shape[-3], x.device.index, x.dtype, signs)
        return run_path(path, x2, planes, block_scales, row_scales, codebook, k, ws_size, signs).reshape(*lead, n)
    path, _, ws_size = mm_plan(m, n, k, planes.shape[-3], x.device.index, x.dtype, signs is not None)
    return run_path(path, x2, planes, block_scales, row_scales, codebook, k, ws_size, signs).reshape(*lead, n)


mm_direct = _mm_cuda  # kbit::mm's CUDA implementation without the dispatcher (benchmarks time the dispatcher's share)


def _dequant_matmul(x2, planes, block_scales, row_scales, codebook, k: int, signs=None) -> torch.Tensor:
    # Whole-weight dequantize, then one cuBLAS call: measured faster than working through the
    # weight in L2-sized row chunks (smaller cuBLAS calls lose more than the L2 saves). A rotated
    # layer: the stored W' times the standalone rotation's x R (2 M K bytes each way), not the weight
    # unrotated in the dequantize, which turned that kernel ALU-bound (+15-31% on the H100).
    if signs is not None:
        x2 = rotate(x2, signs)
    w = torch.empty((row_scales.shape[0], k), dtype=x2.dtype, device=x2.device)
    _dequantize_into(planes, block_scales, row_scales, codebook, k, w)
    return torch.matmul(x2, w.t())


def run_path(path: str, x2, planes, block_scales, row_scales, codebook, k: int,
             ws_size: int | None = None, signs=None) -> torch.Tensor:
    """``x2 [m, k] @ W.T`` through one kernel path (``PATHS``; ``ws_size``: its workspace floats when
    known; ``signs``: a rotated layer's sign words); ``kbit::mm`` takes the planner's (:func:`mm_plan`),
    benchmarks force each to measure the crossovers. Block records (int16 ``block_scales``) take "gemv" (the
    block-records GEMV, where :func:`offsets_gemv_serves`), "gemm" (the block-records wgmma GEMM, where
    :func:`gemm_offsets_serves`, whatever the crossovers) or "dequant" (:func:`records_plan` picks)."""
    m, n, bits = x2.shape[0], row_scales.shape[0], planes.shape[-3]
    if path == "dequant":
        return _dequant_matmul(x2, planes, block_scales, row_scales, codebook, k, signs)
    if path not in ("gemv", "gemm"):
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    records = has_records(block_scales)
    if records and not (offsets_gemv_serves(m, bits, x2.dtype, signs) if path == "gemv" else
                        signs is None and gemm_offsets_serves(m, n, k, bits, x2.device.index, x2.dtype)):
        raise ValueError(
            f"block records (int16 block_scales) take the block-records GEMV (unrotated, 16-bit x, M <= "
            f"{gemv_offsets_max_m(bits, x2.dtype)}), the block-records wgmma GEMM (unrotated, 16-bit x, sm_90a, the "
            f"wgmma GEMM planned) or 'dequant', got path {path!r} for M={m}, x {x2.dtype}"
            f"{', rotated' if signs is not None else ''} on the {gemm_kernel(x2.device.index)} GEMM kernel"
        )
    x2 = x2.contiguous()
    planes, block_scales, row_scales, codebook = _dense(planes, block_scales, row_scales, codebook)
    device = x2.device
    sp = _signs_ptr(signs, k, device)
    if path == "gemm":
        # The GEMM copies 16-byte units of the packed tiles and (wgmma) reads x through a tensor map:
        # realign offset views.
        x2, planes, block_scales = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (x2, planes, block_scales))
        ws_size = _gemm_workspace(device.index, m, n, k, bits, sp is not None) if ws_size is None else ws_size
        launch = _LIB.kbit_gemm_offsets if records else _LIB.kbit_gemm
    else:
        ws_size = _gemv_workspace(device.index, m, n, k, bits, sp is not None) if ws_size is None else ws_size
        launch = _LIB.kbit_gemv_offsets if records else _LIB.kbit_gemv
    out = torch.empty((m, n), dtype=x2.dtype, device=device)
    ws = torch.empty(ws_size, dtype=torch.float32, device=device) if ws_size > 0 else None
    args = (device.index, _stream(device), x2.data_ptr(), _DTYPE_CODE[x2.dtype], planes.data_ptr(),
            block_scales.data_ptr(), row_scales.data_ptr(), codebook.data_ptr(), bits, m, n, k, out.data_ptr(),
            ws.data_ptr() if ws is not None else None, ws_size)
    rc = launch(*args) if records else launch(*args, sp)  # the records' entries take no rot_signs
    _lib.check(rc, "mm")
    return out


# ---------------------------------------------------------------------------- mm with a prologue

_PROLOGUES = {"silu_mul": 1, "rmsnorm": 2, "add_rmsnorm": 3}
_GLU = 16  # or-ed into the prologue: the GLU epilogue (kbit_gemv_glu_serves)
_HAS_PROLOGUE = hasattr(_LIB, "kbit_gemv_prologue")


def _gemv_prologue(kind, x, x2, norm_weight, eps, planes, block_scales, row_scales, codebook, k, signs=None,
                   glu=False):
    """``(out, sum)`` from the GEMV with prologue ``kind`` when it serves this call, else None (a norm
    weight of another dtype than x, e.g. kept in float32, takes the reference: its product is float32). Block
    records take the block-records GEMV with the prologue (``kbit_gemv_prologue_offsets``) up to
    :func:`gemv_offsets_max_m`, whatever the planner takes for uint8 codes (as :func:`records_plan` does); beyond
    it, rotated, or in a library without that entry, the reference (its prologue, then kbit::mm). ``glu``: out is
    ``silu_mul_halves`` of the product, from the GEMV's GLU epilogue where :func:`glu_serves`, else from the
    product after the kernel."""
    if not _HAS_PROLOGUE or x.dtype not in _GEMV_DTYPES or row_scales.dim() != 1:
        return None
    if norm_weight is not None and norm_weight.dtype != x.dtype:
        return None
    records = has_records(block_scales)
    n, bits = row_scales.shape[0], planes.shape[-3]
    lead = x.shape[:-1]
    xr = _rows(x, k)
    m = xr.shape[0]
    if m == 0 or n == 0 or k == 0:
        return None
    if records:
        if not offsets_prologue_serves(m, bits, x.dtype, signs):
            return None
    elif mm_path(m, n, k, bits, x.device.index, x.dtype, signs is not None) != "gemv":
        return None
    elif signs is not None and gemv_rotate_plan(m, bits, x.dtype, True) is None:
        return None  # only the staging sees the prologue's output: beyond the rotated GEMV, unfused
    _check_packed_once(planes, block_scales, row_scales, codebook, k)
    _same_device(x, planes=planes, block_scales=block_scales, row_scales=row_scales, codebook=codebook)
    fold = glu and records and glu_serves(m, n, k, bits, x.device.index, x.dtype)
    sp = _signs_ptr(signs, k, x.device)
    x2r = _rows(x2, k) if x2 is not None else None
    weight = norm_weight.contiguous() if norm_weight is not None else None
    planes, block_scales, row_scales, codebook = _dense(planes, block_scales, row_scales, codebook)
    total = torch.empty((m, k), dtype=x.dtype, device=x.device) if kind == "add_rmsnorm" else None
    ws_size = _gemv_workspace(x.device.index, m, n, k, bits, sp is not None)
    out = torch.empty((m, n // 2 if fold else n), dtype=x.dtype, device=x.device)
    ws = torch.empty(ws_size, dtype=torch.float32, device=x.device) if ws_size > 0 else None
    args = (
        x.device.index, _stream(x.device), _PROLOGUES[kind] | (_GLU if fold else 0), xr.data_ptr(),
        xr.stride(0) if m > 1 else k,
        x2r.data_ptr() if x2r is not None else None, (x2r.stride(0) if m > 1 else k) if x2r is not None else k,
        weight.data_ptr() if weight is not None else None, float(eps),
        total.data_ptr() if total is not None else None, _DTYPE_CODE[x.dtype], planes.data_ptr(),
        block_scales.data_ptr(), row_scales.data_ptr(), codebook.data_ptr(), bits, m, n, k, out.data_ptr(),
        ws.data_ptr() if ws is not None else None, ws_size,
    )
    # The records' entry takes no rot_signs (no rotated layer reaches it).
    rc = _LIB.kbit_gemv_prologue_offsets(*args) if records else _LIB.kbit_gemv_prologue(*args, sp)
    _lib.check(rc, f"mm_{kind}")
    if glu and not fold:
        out = _ops.silu_mul_halves(out)
    return out.reshape(*lead, out.shape[-1]), (total.reshape(x.shape) if total is not None else None)


# Where the GEMV does not serve, the references run the unfused prologue (their roundings) and then kbit::mm,
# with the layer's signs.


@torch.library.impl(_ops._lib, "mm_silu_mul", "CUDA")
def _mm_silu_mul_cuda(gate, up, planes, block_scales, row_scales, codebook, in_features, signs=None):
    _ops._check_prologue("up", gate, up)
    served = _gemv_prologue("silu_mul", gate, up, None, 0.0, planes, block_scales, row_scales, codebook, in_features,
                            signs)
    if served is not None:
        return served[0]
    return _ops._mm_silu_mul_ref(gate, up, planes, block_scales, row_scales, codebook, in_features, signs)


@torch.library.impl(_ops._lib, "mm_rmsnorm", "CUDA")
def _mm_rmsnorm_cuda(x, norm_weight, eps, planes, block_scales, row_scales, codebook, in_features, signs=None,
                     glu=False):
    _ops._check_norm_weight(norm_weight, in_features)
    if glu:
        _ops._check_glu(row_scales)
    served = _gemv_prologue("rmsnorm", x, None, norm_weight, eps, planes, block_scales, row_scales, codebook,
                            in_features, signs, glu)
    if served is not None:
        return served[0]
    return _ops._mm_rmsnorm_ref(x, norm_weight, eps, planes, block_scales, row_scales, codebook, in_features, signs,
                                glu)


@torch.library.impl(_ops._lib, "mm_add_rmsnorm", "CUDA")
def _mm_add_rmsnorm_cuda(x, residual, norm_weight, eps, planes, block_scales, row_scales, codebook, in_features,
                         signs=None, glu=False):
    _ops._check_prologue("residual", x, residual)
    _ops._check_norm_weight(norm_weight, in_features)
    if glu:
        _ops._check_glu(row_scales)
    served = _gemv_prologue("add_rmsnorm", x, residual, norm_weight, eps, planes, block_scales, row_scales, codebook,
                            in_features, signs, glu)
    if served is not None:
        return served
    return _ops._mm_add_rmsnorm_ref(x, residual, norm_weight, eps, planes, block_scales, row_scales, codebook,
                                    in_features, signs, glu)


# ---------------------------------------------------------------------------- eager fast path

_HAS_FAST = hasattr(_LIB, "kbit_gemv_run")
_run = _LIB.kbit_gemv_run if _HAS_FAST else None
_CALL_SIZE = int(_LIB.kbit_gemv_call_size()) if _HAS_FAST else 0
_GEMV_DTYPES = {torch.float16: 1, torch.bfloat16: 2}
try:
    _raw_stream_of = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older torch
    _raw_stream_of = None


def _prepare(module, x, m, signs):
    """Validate the module's packed tensors (and its rotation's sign words, ``signs``) once for (device,
    dtype, M) and build its call record."""
    b = module._buffers or module.__dict__  # KbitFusedProjections holds its tensors as attributes
    planes, block_scales, row_scales, codebook = b["planes"], b["block_scales"], b["row_scales"], b["codebook"]
    k = module.in_features
    _check_packed_once(planes, block_scales, row_scales, codebook, k)
    _same_device(x, planes=planes, block_scales=block_scales, row_scales=row_scales, codebook=codebook)
    sp = _signs_ptr(signs, k, x.device)
    tensors = (planes, block_scales, row_scales, codebook)
    n, bits = row_scales.shape[-1], planes.shape[-3]
    records = has_records(block_scales)
    if records:  # the block-records GEMV where it serves
        serves = offsets_gemv_serves(m, bits, x.dtype, signs)
    else:
        serves = gemv_wins(m, n, k, bits, x.device.index, x.dtype, signs is not None)
    if row_scales.dim() != 1 or not all(t.is_contiguous() for t in tensors) or n == 0 or not serves:
        return (*tensors, None, None, 0, n, signs)  # not for the fast path: the op serves it

    call = ctypes.create_string_buffer(_CALL_SIZE)
    ws = ctypes.c_int64(0)
    if records:
        rc = _LIB.kbit_gemv_prepare_offsets(
            x.device.index, _GEMV_DTYPES[x.dtype], planes.data_ptr(), block_scales.data_ptr(), row_scales.data_ptr(),
            codebook.data_ptr(), bits, m, n, k, call, ctypes.byref(ws),
        )
    else:
        rc = _LIB.kbit_gemv_prepare(
            x.device.index, _GEMV_DTYPES[x.dtype], planes.data_ptr(), block_scales.data_ptr(), row_scales.data_ptr(),
            codebook.data_ptr(), bits, m, n, k, sp, call, ctypes.byref(ws),
        )
    _lib.check(rc, "mm")
    # The record holds raw pointers: keep the tensors it was built for and re-prepare when a
    # buffer is replaced (module.to(), load_state_dict with assign=True, ...).
    return (planes, block_scales, row_scales, codebook, ctypes.addressof(call), call, int(ws.value), n, signs)


# Split-K workspaces of the eager fast path, one per (device, stream), shared by every layer:
# kernels on one stream run in order. One that grows is replaced, and the old one is kept
# alive, because a CUDA graph captured from eager code may still point at it.
_stream_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_retired_workspaces: list[torch.Tensor] = []


def _stream_workspace(device: int, stream: int, floats: int) -> torch.Tensor:
    key = (device, stream)
    ws = _stream_workspaces.get(key)
    if ws is None or ws.numel() < floats:
        if ws is not None:
            _retired_workspaces.append(ws)
            floats = max(floats, 2 * ws.numel())
        ws = _stream_workspaces[key] = torch.empty(floats, dtype=torch.float32, device=torch.device("cuda", device))
    return ws


def linear_fast(module, x: torch.Tensor):
    """``x @ W.T`` for a KbitLinear (or KbitFusedProjections) on CUDA in eager mode, or None when the op path must serve
    (compiling/tracing, tensor subclasses, autograd on x, float32, non-contiguous x, M past
    the GEMV crossover): the caller then calls ``torch.ops.kbit.mm``."""
    if type(x) is not torch.Tensor:
        return None
    dt = _GEMV_DTYPES.get(x.dtype)
    dev = x.get_device()
    if dt is None or dev < 0 or not x.is_contiguous() or (x.requires_grad and torch.is_grad_enabled()):
        return None
    k = module.in_features
    shape = x.shape
    if not shape or shape[-1] != k or k == 0:
        return None
    m = x.numel() // k
    if m == 0 or m > GEMV_MAX_M:
        return None
    cache = module.__dict__.get("_kbit_fast")
    if cache is None:
        cache = module.__dict__["_kbit_fast"] = {}
    key = (dev, dt, m)
    entry = cache.get(key)
    b = module._buffers or module.__dict__  # as in _prepare
    signs = getattr(module, "rotation_signs", None)  # a rotated layer's sign words, else None
    if entry is None or entry[0] is not b["planes"] or entry[1] is not b["block_scales"] \
            or entry[2] is not b["row_scales"] or entry[3] is not b["codebook"] or entry[8] is not signs:
        entry = cache[key] = _prepare(module, x, m, signs)
    if entry[4] is None:
        return None
    out = x.new_empty((*shape[:-1], entry[7]))  # cheaper on the host than torch.empty(..., dtype=, device=)
    stream = _raw_stream_of(dev) if _raw_stream_of is not None else torch.cuda.current_stream(dev).cuda_stream
    ws = _stream_workspace(dev, stream, entry[6]).data_ptr() if entry[6] else None
    rc = _run(entry[4], x.data_ptr(), out.data_ptr(), ws, stream)
    if rc:
        _lib.check(rc, "mm")
    return out


if _HAS_FAST:
    _ops.register_eager_mm(linear_fast)


# ---------------------------------------------------------------------------- grouped_mm

# Rows (token, expert pairs) up to which the grouped GEMV serves each row on its own (per-row
# mode, no sort: decode); above, rows grouped by expert decode each weight tile once for up to
# 32 rows of its expert. Experts layers read it to sort once for both projections.
GROUP_ROWS_ABOVE = 64
_ops.register_group_rows_above("cuda", GROUP_ROWS_ABOVE)

@torch.library.impl(_ops._lib, "grouped_mm", "CUDA")
def _grouped_mm_cuda(x, expert_ids, planes, block_scales, row_scales, codebook, in_features, order=None, offsets=None,
                     signs=None, x_repeat=1):
    """Rows up to ``GROUP_ROWS_ABOVE``: each row its expert's GEMV (decode, no sort);
    beyond it the rows grouped by expert on the device, so that a weight tile is decoded once
    for up to 32 rows of its expert (``order``/``offsets`` when given, else sorted here).
    ``signs``: the experts' shared rotation (they all read x): staged as x R in per-row mode, the
    standalone rotation's x R in grouped mode. ``x_repeat``: the GEMV reads row s of the problem from
    x row s // x_repeat (no copy); the warp-specialized GEMM's sort gathers those rows."""
    _ops._check_mm_input(x, in_features)
    _check_packed_once(planes, block_scales, row_scales, codebook, in_features)
    _ops._check_grouped(x, expert_ids, row_scales, codebook, x_repeat)
    _ops._check_routing(expert_ids, order, offsets, row_scales.shape[0])
    _same_device(x, expert_ids=expert_ids, planes=planes, block_scales=block_scales, row_scales=row_scales,
                 codebook=codebook)
    sp = _signs_ptr(signs, in_features, x.device)
    if has_records(block_scales):
        _warn_records_fallback("grouped_mm")
    if codebook.dim() != 1 or x.dtype not in _GEMV_DTYPES or has_records(block_scales):
        # Per-expert codebooks, float32 activations and block records: the reference (it syncs the host), on x R
        # for a rotated layer (the standalone rotation kernel).
        if signs is not None and x.numel():
            x = rotate(x, signs)
        return _ops._grouped_mm_ref(x, expert_ids, planes, block_scales, row_scales, codebook, in_features,
                                    order, offsets, x_repeat=x_repeat)
    s = expert_ids.shape[0]
    num_experts, n = row_scales.shape
    if s == 0 or n == 0 or in_features == 0:  # an empty product is all zeros
        return torch.zeros((s, n), dtype=x.dtype, device=x.device)
    # The grouped GEMV writes every row (zeros for ids outside [0, E)); the warp-specialized GEMM skips those.
    ws = s > GROUP_ROWS_ABOVE and gemm_kernel(x.device.index) == "wgmma_ws"
    out = (torch.zeros if ws else torch.empty)((s, n), dtype=x.dtype, device=x.device)
    x = x.contiguous()
    ids = expert_ids.to(torch.int64).contiguous()
    planes, block_scales = planes.contiguous(), block_scales.contiguous()
    row_scales, codebook = row_scales.contiguous(), codebook.contiguous()
    if s <= GROUP_ROWS_ABOVE:
        ids_ptr, order_ptr, offsets_ptr = ids.data_ptr(), None, None
    else:
        if order is None:
            order, offsets = _ops.expert_offsets(ids, num_experts)
        order, offsets = order.contiguous(), offsets.contiguous()
        _same_device(x, order=order, offsets=offsets)
        ids_ptr, order_ptr, offsets_ptr = ids.data_ptr(), order.data_ptr(), offsets.data_ptr()
        if sp is not None:  # grouped mode: x R once (the kernel would rotate a row in every unit)
            x, sp = rotate(x, signs), None
        if ws:
            _grouped_gemm_ws(x, order, offsets, planes, block_scales, row_scales, codebook, in_features, out, x_repeat)
            return out
    rc = _LIB.kbit_grouped_gemv(
        x.device.index, _stream(x.device), x.data_ptr(), _GEMV_DTYPES[x.dtype], ids_ptr, order_ptr, offsets_ptr,
        planes.data_ptr(), block_scales.data_ptr(), row_scales.data_ptr(), codebook.data_ptr(), planes.shape[-3],
        s, num_experts, n, in_features, out.data_ptr(), sp, x_repeat,
    )
    _lib.check(rc, "grouped_mm")
    return out


# The grouped GEMV with a SiLU-gated input (a later entry than kbit_grouped_gemv: a library may lack it).
_HAS_GROUPED_SILU_MUL = hasattr(_LIB, "kbit_grouped_gemv_silu_mul")
if _HAS_GROUPED_SILU_MUL:
    _LIB.kbit_grouped_gemv_silu_mul.argtypes = [_c_int, _c_vp, _c_vp, _c_vp, _c_i64, _c_int, _c_vp, _c_vp, _c_vp,
                                                _c_vp, _c_vp, _c_vp, _c_vp, _c_int, _c_i64, _c_i64, _c_i64, _c_i64,
                                                _c_vp, _c_vp]
    _LIB.kbit_grouped_gemv_silu_mul.restype = _c_int


@torch.library.impl(_ops._lib, "grouped_mm_silu_mul", "CUDA")
def _grouped_mm_silu_mul_cuda(gate, up, expert_ids, planes, block_scales, row_scales, codebook, in_features,
                              order=None, offsets=None, signs=None):
    """Rows up to ``GROUP_ROWS_ABOVE`` (per-row mode, decode): the grouped GEMV staging silu(gate) * up itself
    (``kbit_grouped_gemv_silu_mul``), where ``grouped_mm`` would take the GEMV and gate and up share a row pitch.
    Elsewhere (grouped mode, what ``grouped_mm`` serves with the reference) the unfused ops."""
    _ops._check_prologue("up", gate, up)
    s = expert_ids.shape[0]
    num_experts, n = row_scales.shape
    fused = (_HAS_GROUPED_SILU_MUL and 0 < s <= GROUP_ROWS_ABOVE and n > 0 and in_features > 0
             and codebook.dim() == 1 and gate.dtype in _GEMV_DTYPES and not has_records(block_scales)
             and gate.dim() == 2 and gate.stride(-1) == up.stride(-1) == 1 and gate.stride(0) == up.stride(0))
    if not fused:
        return torch.ops.kbit.grouped_mm(_ops.silu_mul(gate, up), expert_ids, planes, block_scales, row_scales,
                                         codebook, in_features, order, offsets, signs)
    _ops._check_mm_input(gate, in_features)
    _check_packed_once(planes, block_scales, row_scales, codebook, in_features)
    _ops._check_grouped(gate, expert_ids, row_scales, codebook)
    _ops._check_routing(expert_ids, order, offsets, num_experts)
    _same_device(gate, up=up, expert_ids=expert_ids, planes=planes, block_scales=block_scales, row_scales=row_scales,
                 codebook=codebook)
    sp = _signs_ptr(signs, in_features, gate.device)
    out = torch.empty((s, n), dtype=gate.dtype, device=gate.device)
    ids = expert_ids.to(torch.int64).contiguous()
    planes, block_scales, row_scales, codebook = _dense(planes, block_scales, row_scales, codebook)
    rc = _LIB.kbit_grouped_gemv_silu_mul(
        gate.device.index, _stream(gate.device), gate.data_ptr(), up.data_ptr(), gate.stride(0),
        _GEMV_DTYPES[gate.dtype], ids.data_ptr(), None, None, planes.data_ptr(), block_scales.data_ptr(),
        row_scales.data_ptr(), codebook.data_ptr(), planes.shape[-3], s, num_experts, n, in_features, out.data_ptr(),
        sp,
    )
    _lib.check(rc, "grouped_mm_silu_mul")
    return out


def _grouped_gemm_ws(x, order, offsets, planes, block_scales, row_scales, codebook, in_features, out,
                     x_repeat: int = 1) -> None:
    """Grouped mode on the warp-specialized GEMM (set_gemm_kernel("wgmma_ws")): the problem's rows sorted by
    expert into a buffer at a 16-byte row pitch (row r from x row order[r] // x_repeat), which its tensor map
    reads; the kernel stores row r at out row order[r]."""
    s, num_experts = order.shape[0], row_scales.shape[0]
    pitch = -(-in_features // 8) * 8
    xs = x.index_select(0, order if x_repeat == 1 else order // x_repeat)
    if pitch != in_features:
        xs = torch.nn.functional.pad(xs, (0, pitch - in_features))
    words = int(_LIB.kbit_grouped_gemm_workspace_size(s, num_experts))
    ws = torch.empty(words, dtype=torch.float32, device=x.device)
    rc = _LIB.kbit_grouped_gemm(
        x.device.index, _stream(x.device), xs.data_ptr(), pitch, _GEMV_DTYPES[x.dtype], order.data_ptr(),
        offsets.data_ptr(), planes.data_ptr(), block_scales.data_ptr(), row_scales.data_ptr(), codebook.data_ptr(),
        planes.shape[-3], s, num_experts, row_scales.shape[1], in_features, out.data_ptr(), ws.data_ptr(), words,
    )
    _lib.check(rc, "grouped_mm")


# ---------------------------------------------------------------------------- gradients (training)

# dX = dY @ W at training shapes (M = batch x sequence, thousands of rows): the weight dequantized
# into dY's dtype and one cuBLAS call, the path the forward's own table takes past its GEMM
# crossover (docs/kernels.md); no transposed kbit kernel exists yet. float32 gradients take the
# reference (dequantize to float32, same cuBLAS). A rotated layer: dX = (dY W') R^T, the stored W'
# dequantized as it is and the product unrotated by the standalone kernel (2 M K bytes each way,
# where unrotating the weight in the dequantize made that kernel ALU-bound).


@torch.library.impl(_ops._lib, "mm_grad_x", "CUDA")
def _mm_grad_x_cuda(grad, planes, block_scales, row_scales, codebook, in_features, signs=None):
    _ops._check_grad_input(grad, row_scales)
    _check_packed_once(planes, block_scales, row_scales, codebook, in_features)
    _same_device(grad, "grad", planes=planes, block_scales=block_scales, row_scales=row_scales, codebook=codebook)
    _signs_ptr(signs, in_features, grad.device)
    if grad.dtype not in _GEMV_DTYPES and signs is None:
        return _ops._mm_grad_x_ref(grad, planes, block_scales, row_scales, codebook, in_features)
    compute = grad.dtype if grad.dtype in _GEMV_DTYPES else torch.float32
    w = torch.empty((row_scales.shape[0], in_features), dtype=compute, device=grad.device)
    if w.numel():
        _dequantize_into(planes, block_scales, row_scales, codebook, in_features, w)
    out = torch.matmul(grad.to(compute), w)
    if signs is not None and out.numel():
        out = unrotate(out, signs)
    return out.to(grad.dtype)


_ops.register_eager_train("cuda", _mm_cuda, _mm_grad_x_cuda)


@torch.library.impl(_ops._lib, "grouped_mm_grad_x", "CUDA")
def _grouped_mm_grad_x_cuda(grad, expert_ids, planes, block_scales, row_scales, codebook, in_features, order=None,
                            offsets=None, signs=None):
    # One expert's weight at a time in grad's dtype (never all E dequantized at once); the group
    # sizes are read on the host, as in the forward reference. Rotated experts share R (they all
    # read x): the rows' products with the stored weights, then one unrotation of them all.
    _signs_ptr(signs, in_features, grad.device)
    compute = grad.dtype if grad.dtype in _GEMV_DTYPES else torch.float32
    out = _ops._grouped_grad_x(grad, expert_ids, planes, block_scales, row_scales, codebook, in_features, order,
                               offsets, compute)
    return unrotate(out, signs) if signs is not None and out.numel() else out
