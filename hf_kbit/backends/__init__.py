"""Per-device implementations of the ``kbit`` ops (the default backend is the PyTorch reference in
``hf_kbit._ops``). A backend registers op implementations, and the kernel policy that goes with
them, through ``hf_kbit._ops``; nothing else imports it."""

from __future__ import annotations

import importlib.util


def load() -> None:
    """Register every backend this machine can run: the compiled CUDA library (``cuda``) and the Triton
    kernels (``triton_kernels``: decode attention; ``triton_moe``: MoE routing and the experts layer's elementwise
    ops). Without them the ops run their references."""
    from .. import _lib

    if _lib.available():
        from . import cuda  # noqa: F401
    if importlib.util.find_spec("triton") is not None:
        from . import triton_kernels, triton_moe  # noqa: F401
