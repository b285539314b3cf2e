"""Loads the compiled kbit CUDA library (``libhf_kbit_cuda.so``, C ABI, ctypes).

The library depends on the CUDA driver only (the runtime is linked statically), not on a
torch version, so one prebuilt wheel serves every torch. It is looked up at
``$HF_KBIT_LIBRARY`` if set, else next to this file (where a wheel installs it), else in the
``hf_kbit/`` folder of the environment's site-packages: an editable install (scikit-build-core)
keeps the Python files in the source tree and installs the built library there. Never in the
current directory or another ``sys.path`` entry: a library found there would run its
constructor in every program that imports hf_kbit from that directory.
Nothing here imports torch's CUDA state: :func:`available` is cheap and never raises.
"""

from __future__ import annotations

import ctypes
import os
import site
import sysconfig
from pathlib import Path

LIBRARY_NAME = "libhf_kbit_cuda.so"
LIBRARY_ENV = "HF_KBIT_LIBRARY"  # an explicit path to the library; no search when set
_PACKAGE_DIR = Path(__file__).resolve().parent
ABI_VERSION = 11

DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

KBIT_OK, KBIT_INVALID_ARGUMENT, KBIT_CUDA_ERROR = 0, 1, 2


class KbitLibraryError(RuntimeError):
    """The kbit CUDA library is missing, unloadable, or a call into it failed."""


_lib: ctypes.CDLL | None = None
_load_error: str | None = None


def library_candidates() -> list[Path]:
    """Where the library is searched when ``$HF_KBIT_LIBRARY`` is unset, in order, without
    duplicates: this package's folder, then ``<site-packages>/hf_kbit/`` for each of :func:`site_dirs`."""
    folders = [_PACKAGE_DIR] + [Path(entry) / "hf_kbit" for entry in site_dirs()]
    seen: set[Path] = set()
    candidates = []
    for folder in folders:
        try:
            folder = folder.resolve()
        except (OSError, RuntimeError):  # an unreadable or looping sys.path entry: not ours
            continue
        if folder not in seen:
            seen.add(folder)
            candidates.append(folder / LIBRARY_NAME)
    return candidates


def site_dirs() -> list[str]:
    """The environment's site-packages folders (absolute), where installs put files."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    dirs += [sysconfig.get_paths()[key] for key in ("purelib", "platlib")]
    return [d for d in dirs if isinstance(d, str) and os.path.isabs(d)]


def library_path() -> Path:
    """``$HF_KBIT_LIBRARY`` if set, else the first of :func:`library_candidates` that exists
    (the package-folder location when none does)."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return Path(override)
    candidates = library_candidates()
    return next((path for path in candidates if path.is_file()), candidates[0])


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_i64, c_vp = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.kbit_abi_version.restype = c_int
    lib.kbit_last_error.restype = ctypes.c_char_p
    lib.kbit_gemv_max_m.restype = c_int
    lib.kbit_kernel_table_size.restype = c_int
    lib.kbit_kernel_table_entry.argtypes = [c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(c_int),
                                            ctypes.POINTER(c_int)]
    lib.kbit_kernel_table_entry.restype = c_int
    lib.kbit_quantize.argtypes = [c_int, c_vp, c_vp, c_int, c_vp, c_int, c_i64, c_i64, c_i64, c_vp, c_vp, c_vp]
    lib.kbit_quantize.restype = c_int
    # rot_signs (the last argument of every entry that computes with a weight): a rotated layer's sign
    # words (int32 [in_features / 32] on the device), or None (kbit_api.h).
    lib.kbit_dequantize.argtypes = [c_int, c_vp, c_vp, c_vp, c_vp, c_vp, c_i64, c_int, c_i64, c_i64, c_i64, c_vp, c_int,
                                    c_vp]
    lib.kbit_dequantize.restype = c_int
    lib.kbit_rotate.argtypes = [c_int, c_vp, c_vp, c_i64, c_int, c_i64, c_i64, c_vp, c_int, c_vp]
    lib.kbit_rotate.restype = c_int
    lib.kbit_gemv_workspace_size.argtypes = [c_int, c_i64, c_i64, c_i64, c_int, c_int]
    lib.kbit_gemv_workspace_size.restype = c_i64
    lib.kbit_set_gemv_rotate_crossover.argtypes = [c_int, c_int]
    lib.kbit_set_gemv_rotate_crossover.restype = c_int
    lib.kbit_gemv_rotate_plan.argtypes = [c_int, c_int, c_i64, c_int, ctypes.POINTER(c_int)]
    lib.kbit_gemv_rotate_plan.restype = c_int
    lib.kbit_gemv.argtypes = [c_int, c_vp, c_vp, c_int, c_vp, c_vp, c_vp, c_vp, c_int, c_i64, c_i64, c_i64, c_vp, c_vp,
                              c_i64, c_vp]
    lib.kbit_gemv.restype = c_int
    lib.kbit_gemm_workspace_size.argtypes = [c_int, c_i64, c_i64, c_i64, c_int, c_int]
    lib.kbit_gemm_workspace_size.restype = c_i64
    lib.kbit_gemm.argtypes = [c_int, c_vp, c_vp, c_int, c_vp, c_vp, c_vp, c_vp, c_int, c_i64, c_i64, c_i64, c_vp, c_vp,
                              c_i64, c_vp]
    lib.kbit_gemm.restype = c_int
    lib.kbit_grouped_gemv.argtypes = [c_int, c_vp, c_vp, c_int, c_vp, c_vp, c_vp, c_vp, c_vp, c_vp, c_vp, c_int,
                                      c_i64, c_i64, c_i64, c_i64, c_vp, c_vp, c_i64]
    lib.kbit_grouped_gemv.restype = c_int
    lib.kbit_grouped_gemm_workspace_size.argtypes = [c_i64, c_i64]
    lib.kbit_grouped_gemm_workspace_size.restype = c_i64
    lib.kbit_grouped_gemm.argtypes = [c_int, c_vp, c_vp, c_i64, c_int, c_vp, c_vp, c_vp, c_vp, c_vp, c_vp, c_int, c_i64,
                                      c_i64, c_i64, c_i64, c_vp, c_vp, c_i64]
    lib.kbit_grouped_gemm.restype = c_int
    c_ip = ctypes.POINTER(c_int)
    lib.kbit_gemv_plan.argtypes = [c_int, c_i64, c_i64, c_i64, c_ip, c_ip, c_ip, c_ip]
    lib.kbit_gemv_plan.restype = c_int
    lib.kbit_gemm_plan.argtypes = [c_int, c_i64, c_i64, c_i64, c_int, c_ip, c_ip, c_ip, c_ip]
    lib.kbit_gemm_plan.restype = c_int
    c_i64p = ctypes.POINTER(c_i64)
    lib.kbit_set_gemm_kernel.argtypes = [c_int]
    lib.kbit_set_gemm_kernel.restype = c_int
    lib.kbit_gemm_kernel.argtypes = [c_int]
    lib.kbit_gemm_kernel.restype = c_int
    lib.kbit_set_wgmma_ws_plan.argtypes = [c_int, c_int]
    lib.kbit_set_wgmma_ws_plan.restype = c_int
    lib.kbit_set_gemv_plan.argtypes = [c_int, c_int]
    lib.kbit_set_gemv_plan.restype = c_int
    lib.kbit_set_mm_crossovers.argtypes = [c_int, c_int, c_int, c_int, c_i64p, c_i64p]
    lib.kbit_set_mm_crossovers.restype = c_int
    lib.kbit_mm_plan.argtypes = [c_int, c_i64, c_i64, c_i64, c_int, c_int, c_int, c_ip, c_ip, c_i64p]
    lib.kbit_mm_plan.restype = c_int
    # GEMV with an elementwise prologue (optional: without it the fused ops run their references).
    try:
        lib.kbit_gemv_prologue.argtypes = [c_int, c_vp, c_int, c_vp, c_i64, c_vp, c_i64, c_vp, ctypes.c_float, c_vp,
                                           c_int, c_vp, c_vp, c_vp, c_vp, c_int, c_i64, c_i64, c_i64, c_vp, c_vp, c_i64,
                                           c_vp]
        lib.kbit_gemv_prologue.restype = c_int
    except AttributeError:
        pass
    # Eager fast path (optional: a library without it still serves every op).
    try:
        lib.kbit_gemv_call_size.restype = c_i64
        lib.kbit_gemv_prepare.argtypes = [c_int, c_int, c_vp, c_vp, c_vp, c_vp, c_int, c_i64, c_i64, c_i64, c_vp, c_vp,
                                          ctypes.POINTER(c_i64)]
        lib.kbit_gemv_prepare.restype = c_int
        lib.kbit_gemv_run.argtypes = [c_vp, c_vp, c_vp, c_vp, c_vp]
        lib.kbit_gemv_run.restype = c_int
    except AttributeError:
        pass


def load() -> ctypes.CDLL:
    """The loaded library; raises :class:`KbitLibraryError` saying why it cannot be had."""
    global _lib, _load_error
    if _lib is not None:
        return _lib
    if _load_error is not None:
        raise KbitLibraryError(_load_error)
    path = library_path()
    if not path.is_file():
        if os.environ.get(LIBRARY_ENV):
            _load_error = f"{LIBRARY_ENV}={path} is not a file: point it at the built {LIBRARY_NAME} or unset it"
            raise KbitLibraryError(_load_error)
        searched = ", ".join(str(p.parent) for p in library_candidates())
        _load_error = (
            f"the kbit CUDA library ({LIBRARY_NAME}) was not found; searched: {searched}. hf-kbit was "
            "installed without it (no CUDA toolkit at build time, or HF_KBIT_BUILD_CUDA=0): reinstall on a "
            "machine with nvcc (`pip install --no-build-isolation .`), install a prebuilt wheel "
            f"(scripts/build_wheel.sh), or set {LIBRARY_ENV} to the built {LIBRARY_NAME}. "
            "Without it, the kbit ops run the (slow) PyTorch reference."
        )
        raise KbitLibraryError(_load_error)
    try:
        lib = ctypes.CDLL(str(path))
        lib.kbit_abi_version.restype = ctypes.c_int
        abi = lib.kbit_abi_version()
        if abi == ABI_VERSION:
            _declare(lib)
    except (OSError, AttributeError) as exc:
        _load_error = f"the kbit CUDA library at {path} could not be loaded: {exc}"
        raise KbitLibraryError(_load_error) from exc
    if abi != ABI_VERSION:
        _load_error = f"the kbit CUDA library at {path} has ABI version {abi}, this hf_kbit needs {ABI_VERSION}: rebuild it"
        raise KbitLibraryError(_load_error)
    _lib = lib
    return lib


def kernel_table() -> tuple[tuple[str, int, str], ...]:
    """The (kernel, bits, dtype name) entries the loaded library was built for (hf_kbit.kernel_table.TABLE
    when the library matches this package)."""
    lib = load()
    name, bits, dtype = ctypes.c_char_p(), ctypes.c_int(), ctypes.c_int()
    entries = []
    for i in range(lib.kbit_kernel_table_size()):
        check(lib.kbit_kernel_table_entry(i, ctypes.byref(name), ctypes.byref(bits), ctypes.byref(dtype)), "kernel_table")
        entries.append((name.value.decode(), bits.value, tuple(DTYPE_CODES)[dtype.value]))
    return tuple(entries)


def available() -> bool:
    """True when the library loads (a GPU may still be missing: see :func:`require_gpu`)."""
    try:
        load()
    except KbitLibraryError:
        return False
    return True


def require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise KbitLibraryError(
            "the kbit CUDA kernels need a CUDA GPU and a CUDA build of torch; "
            f"torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
        )


def check(rc: int, op: str) -> None:
    """Turn a library return code into an exception naming the op and the argument at fault."""
    if rc != KBIT_OK:
        message = (_lib.kbit_last_error() or b"").decode(errors="replace") if _lib is not None else ""
        kind = ValueError if rc == KBIT_INVALID_ARGUMENT else KbitLibraryError
        raise kind(f"kbit::{op} (CUDA): {message or f'error code {rc}'}")
