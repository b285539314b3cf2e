"""Turning v and o per attention head (``KbitConfig(head_rotation=True)``): an exact reparametrisation that
quantizes better, at no inference cost.

Attention is linear in v: a head's output is ``sum_t a_t v_t`` with weights ``a_t`` that do not depend on v. Turning
every value head by one orthogonal ``Q`` (``v_h -> v_h Q``) therefore turns each head's output the same way, and
o_proj undoes it with its input columns of that head turned by ``Q``. So the model computes the same function with

- v_proj's rows of kv head ``h``: ``W_h -> Q^T W_h``, its bias ``b_h -> b_h Q``;
- o_proj's input columns of query head ``h``: ``W[:, h] -> W[:, h] Q`` (grouped-query heads share one ``Q``).

Quantized in the turned basis, each block of o_proj's K (32 channels of one head) holds mixed values instead of a
few outlier channels, and v's rows likewise (docs/format.md#head-rotation for what it measured). The checkpoint stores
the turned weights in format v1; no reader or kernel changes.

``KbitConfig(head_rotation=None)`` (the default) turns where :func:`resolve` says: at k <= :data:`DEFAULT_MAX_BITS`,
data-free, without rotation along K and without block offsets, on models whose attention it supports: where it
measured better on both offline models (docs/format.md#head-rotation). Block offsets are the default, so by default
nothing is turned.

``Q = diag(s) H_d / sqrt(d)``: ``H_d`` the Sylvester Hadamard matrix of the head dim ``d`` (a power of 2), ``s`` the
sign vector :func:`hf_kbit.rotation.signs` ``(d, SEED)``. The turn is computed in float64 and rounded once to the
tensor's dtype, so every quantizer (quantize-on-load, ``quantize_model``, ``kbit-convert``) turns to the same bytes.
Only attention classes where it is exact are turned (:data:`ATTENTION_CLASSES`: one softmax over plain value
heads; not gated outputs, MLA or value norms).
"""

from __future__ import annotations

import torch
from torch import nn

from . import rotation

# Attention modules whose output is o_proj(softmax(...) v) per head, with v = v_proj(x): the turn is exact there.
ATTENTION_CLASSES = frozenset({
    "LlamaAttention", "MistralAttention", "MixtralAttention", "Qwen2Attention", "Qwen3Attention",
    "Qwen2MoeAttention", "Qwen3MoeAttention",
})
ROLES = ("v", "v_bias", "o")  # v_proj's weight rows, v_proj's bias, o_proj's weight columns
SEED = 7  # the signs' seed: the turn docs/format.md#head-rotation measured (any seed turns exactly)
DEFAULT_MAX_BITS = 4  # head_rotation=None turns at k <= 4: lower perplexity there, higher at k = 5 (docs/format.md)


def check_head_dim(head_dim: int) -> int:
    """``head_dim``, or ValueError unless it is a power of 2 (the Sylvester Hadamard matrix's sizes)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"head_rotation needs a power-of-2 head dim, got {head_dim}")
    return head_dim


def matrix(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``Q`` ``[d, d]`` in float64 on ``device`` (module docstring); ValueError unless ``head_dim`` is a power of 2."""
    check_head_dim(head_dim)  # one segment of hf_kbit.rotation's block Hadamard, applied to the identity
    return rotation.rotate(torch.eye(head_dim, dtype=torch.float64, device=device), head_dim, SEED)


def turn(tensor: torch.Tensor, role: str, head_dim: int, inverse: bool = False) -> torch.Tensor:
    """``tensor`` turned as ``role`` (:data:`ROLES`) with heads of ``head_dim``, or turned back (``inverse``), in
    float64 and returned in ``tensor``'s dtype."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    heads_dim = tensor.shape[-1] if role == "o" else tensor.shape[0]
    if heads_dim % head_dim:
        raise ValueError(f"head_rotation: a {role} tensor of shape {tuple(tensor.shape)} does not split into heads of "
                         f"{head_dim}")
    q = matrix(head_dim, tensor.device)
    q = q.T if inverse else q
    t = tensor.to(torch.float64)
    if role == "o":  # [N, heads * d]: each head's columns times Q
        out = (t.reshape(t.shape[0], -1, head_dim) @ q).reshape(t.shape)
    elif role == "v":  # [kv * d, K]: each head's rows, Q^T W_h
        out = (q.T @ t.reshape(-1, head_dim, t.shape[-1])).reshape(t.shape)
    else:  # v's bias [kv * d]: b_h Q
        out = (t.reshape(-1, head_dim) @ q).reshape(t.shape)
    return out.to(tensor.dtype)


def targets(model: nn.Module) -> dict[str, tuple[str, int]]:
    """``{parameter name: (role, head dim)}`` of every v_proj weight and bias and o_proj weight that
    ``head_rotation`` turns in ``model`` (full or a skeleton whose attention modules hold v_proj and o_proj). ValueError
    naming the class when the model has attention modules of another class, or a head dim that is not a power of 2."""
    out = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "v_proj") and hasattr(module, "o_proj")):
            continue
        kind = type(module).__name__
        if kind not in ATTENTION_CLASSES:
            raise ValueError(f"head_rotation: {name} is a {kind}, where turning v and o per head is not known to be "
                             f"exact; supported: {sorted(ATTENTION_CLASSES)}")
        d = check_head_dim(module.head_dim)
        out[f"{name}.v_proj.weight"] = ("v", d)
        if getattr(module.v_proj, "bias", None) is not None:
            out[f"{name}.v_proj.bias"] = ("v_bias", d)
        out[f"{name}.o_proj.weight"] = ("o", d)
    if not out:
        raise ValueError("head_rotation: the model has no attention module with v_proj and o_proj")
    return out


def turns_by_default(config) -> bool:
    """Whether ``head_rotation=None`` turns under ``config`` on a model :func:`targets` accepts: at ``bits <=
    DEFAULT_MAX_BITS``, data-free, without rotation along K and without block offsets."""
    return (config.bits <= DEFAULT_MAX_BITS and config.rotation is False and not config.calibrates
            and not config.resolved_block_offsets())


def resolve(config, model: nn.Module, pre_quantized: bool = False) -> bool:
    """Whether to turn ``model``'s v and o for the :class:`~hf_kbit.KbitConfig` ``config``. ``head_rotation`` ``True``
    or ``False`` as given (``True`` on a model :func:`targets` refuses raises its ValueError when quantizing); ``None``:
    on at ``bits <= DEFAULT_MAX_BITS``, data-free, without rotation along K and without block offsets
    (:meth:`~hf_kbit.KbitConfig.resolved_block_offsets`), for a model :func:`targets` accepts; else off (with rotation
    along K or with block offsets the turn measured worse in most cells; with calibration it is unmeasured). A
    pre-quantized checkpoint without the field was not turned: ``None`` is ``False`` there."""
    if config.head_rotation is not None or pre_quantized:
        return bool(config.head_rotation)
    if not turns_by_default(config):
        return False
    try:
        targets(model)
    except ValueError:
        return False
    return True


@torch.no_grad()
def apply(model: nn.Module, inverse: bool = False) -> None:
    """Turn (or turn back) the v/o parameters of :func:`targets` of a model whose Linears are float, in place."""
    for name, (role, d) in targets(model).items():
        param = model.get_parameter(name)
        param.data.copy_(turn(param.data, role, d, inverse))
