"""What every CUDA backend module passes to the kbit C ABI alongside the tensors: the caller's stream and
activation rows with unit element stride. Shared by :mod:`hf_kbit.backends.cuda` and
:mod:`hf_kbit.backends.cuda_rotation` (which the former imports)."""

from __future__ import annotations

import torch

try:  # the raw pointer without building a Stream object: ~1 us instead of several
    _raw_stream = torch._C._cuda_getCurrentRawStream

    def stream(device: torch.device) -> int:
        return _raw_stream(device.index)

except AttributeError:  # pragma: no cover - older torch

    def stream(device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream


def rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t [..., k]`` as ``[m, k]`` rows with unit element stride (a view where possible, e.g. a slice of a
    fused gate/up output)."""
    t2 = t.reshape(-1, k)
    return t2 if t2.stride(-1) == 1 and (t2.shape[0] <= 1 or t2.stride(0) >= k) else t2.contiguous()
