"""The ``kbit`` torch.library ops: one schema and fake (meta) impl each, implemented per backend.

The default implementation (``CompositeExplicitAutograd``, any device) is the pure-PyTorch
reference in :mod:`hf_kbit.format`; it is what the tests trust. A backend registers a
faster kernel for its dispatch key (``hf_kbit/backends/cuda.py`` for ``CUDA``), which then
takes precedence on tensors of that device. Ops never know about transformers.
"""

from __future__ import annotations

import torch

from . import format as fmt

_lib = torch.library.Library("kbit", "DEF")

_lib.define("quantize(Tensor weight, Tensor codebook) -> (Tensor planes, Tensor block_scales, Tensor row_scales)")
_lib.define(
    "dequantize(Tensor planes, Tensor block_scales, Tensor row_scales, Tensor codebook, SymInt in_features, "
    "ScalarType dtype) -> Tensor"
)
_lib.define(
    "mm(Tensor x, Tensor planes, Tensor block_scales, Tensor row_scales, Tensor codebook, SymInt in_features) "
    "-> Tensor"
)
_lib.define(
    "grouped_mm(Tensor x, Tensor expert_ids, Tensor planes, Tensor block_scales, Tensor row_scales, "
    "Tensor codebook, SymInt in_features) -> Tensor"
)


def _bits(planes: torch.Tensor) -> int:
    return planes.shape[-3]


def _check_packed(planes, block_scales, row_scales, codebook, in_features) -> None:
    """Shape/dtype agreement of the four packed tensors; raises before any compute or launch."""
    torch._check(planes.dtype == torch.int32, lambda: f"planes must be int32, got {planes.dtype}")
    torch._check(block_scales.dtype == torch.uint8, lambda: f"block_scales must be uint8, got {block_scales.dtype}")
    torch._check(row_scales.dtype == torch.float32, lambda: f"row_scales must be float32, got {row_scales.dtype}")
    torch._check(codebook.dtype == torch.float32, lambda: f"codebook must be float32, got {codebook.dtype}")
    bits = _bits(planes)
    torch._check(bits in fmt.SUPPORTED_BITS, lambda: f"planes.shape[-3] (bits) must be in {fmt.SUPPORTED_BITS}")
    n = row_scales.shape[-1]
    expected = fmt.packed_shapes(n, in_features, bits)
    lead = tuple(row_scales.shape[:-1])
    for name, t in (("planes", planes), ("block_scales", block_scales)):
        torch._check(
            tuple(t.shape) == lead + expected[name],
            lambda: f"{name} has shape {tuple(t.shape)}, expected {lead + expected[name]} for "
            f"out_features={n}, in_features={in_features}, bits={bits}",
        )
    torch._check(
        codebook.shape[-1] == 1 << bits,
        lambda: f"codebook has {codebook.shape[-1]} entries, expected {1 << bits} for bits={bits}",
    )


# ---------------------------------------------------------------------------- quantize


@torch.library.impl(_lib, "quantize", "CompositeExplicitAutograd")
def _quantize_ref(weight: torch.Tensor, codebook: torch.Tensor):
    return fmt.quantize(weight, codebook)


@torch.library.register_fake("kbit::quantize")
def _quantize_fake(weight, codebook):
    bits = int(codebook.shape[-1]).bit_length() - 1
    *lead, n, k = weight.shape
    shapes = fmt.packed_shapes(n, k, bits)
    return (
        weight.new_empty((*lead, *shapes["planes"]), dtype=torch.int32),
        weight.new_empty((*lead, *shapes["block_scales"]), dtype=torch.uint8),
        weight.new_empty((*lead, n), dtype=torch.float32),
    )


# ---------------------------------------------------------------------------- dequantize


@torch.library.impl(_lib, "dequantize", "CompositeExplicitAutograd")
def _dequantize_ref(planes, block_scales, row_scales, codebook, in_features, dtype):
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    return fmt.dequantize(planes, block_scales, row_scales, codebook, in_features, dtype)


@torch.library.register_fake("kbit::dequantize")
def _dequantize_fake(planes, block_scales, row_scales, codebook, in_features, dtype):
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    return planes.new_empty((*row_scales.shape, in_features), dtype=dtype)


# ---------------------------------------------------------------------------- mm


def _check_mm_input(x: torch.Tensor, in_features) -> None:
    torch._check(
        x.dtype in (torch.bfloat16, torch.float16, torch.float32),
        lambda: f"x must be bfloat16, float16 or float32, got {x.dtype}",
    )
    torch._check(
        x.shape[-1] == in_features,
        lambda: f"x has {x.shape[-1]} features in its last dim, the layer expects in_features={in_features}",
    )


@torch.library.impl(_lib, "mm", "CompositeExplicitAutograd")
def _mm_ref(x, planes, block_scales, row_scales, codebook, in_features):
    """``x [..., K] @ W.T -> [..., N]`` in x's dtype, accumulating in float32."""
    _check_mm_input(x, in_features)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    w = fmt.dequantize(planes, block_scales, row_scales, codebook, in_features, torch.float32)
    return (x.float() @ w.T).to(x.dtype)


@torch.library.register_fake("kbit::mm")
def _mm_fake(x, planes, block_scales, row_scales, codebook, in_features):
    _check_mm_input(x, in_features)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    return x.new_empty((*x.shape[:-1], row_scales.shape[-1]))


# ---------------------------------------------------------------------------- grouped_mm


@torch.library.impl(_lib, "grouped_mm", "CompositeExplicitAutograd")
def _grouped_mm_ref(x, expert_ids, planes, block_scales, row_scales, codebook, in_features):
    """Row ``t`` of ``x [T, K]`` times expert ``expert_ids[t]``'s weight: ``[T, N]`` in x's dtype.

    Packed tensors carry a leading expert dim ``E``; codebook is ``[E, L]`` or ``[L]``.
    """
    _check_mm_input(x, in_features)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    torch._check(x.dim() == 2 and expert_ids.shape == x.shape[:1], lambda: "x must be [T, K], expert_ids [T]")
    w = fmt.dequantize(planes, block_scales, row_scales, codebook, in_features, torch.float32)  # [E, N, K]
    out = torch.bmm(w[expert_ids.long()], x.float()[:, :, None])[:, :, 0]
    return out.to(x.dtype)


@torch.library.register_fake("kbit::grouped_mm")
def _grouped_mm_fake(x, expert_ids, planes, block_scales, row_scales, codebook, in_features):
    _check_mm_input(x, in_features)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    return x.new_empty((x.shape[0], row_scales.shape[-1]))
