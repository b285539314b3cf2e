"""Single-token attention for grouped-query models without ``repeat_kv``.

transformers' ``sdpa`` attention hands a compiled decode step's grouped-query attention to
``scaled_dot_product_attention`` after ``repeat_kv`` has copied each key/value head once per query
head it serves: at batch 1 on an H100 that copy is one of the largest non-GEMM kernels of a
Llama-3-8B decode step (docs/kernels.md). Decoding one token, the query heads of a key/value head
share its keys, values and mask row, so they can be served as one (group x head_dim) query block
against the unrepeated cache. This module registers that as an attention implementation::

    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kbit_decode")
    model.set_attn_implementation("kbit_decode")  # or on a loaded model

A kbit model takes it by default (``KbitConfig.decode_attention``, :func:`use_as_default`) where it would
otherwise attend with ``sdpa``: when ``from_pretrained`` names no attention implementation, and in
``quantize_model`` on a model that attends with ``sdpa``.

Single-token calls (decode) take it; everything else (prefill, dropout, soft-capping, sinks,
position biases, per-head masks) runs transformers' ``sdpa`` unchanged, and masks are built as for
``sdpa``. The decode runs the op ``kbit::decode_attention`` (hf_kbit/_ops.py: its reference is
:func:`packed_sdpa`; on CUDA with Triton, hf_kbit/backends/triton_kernels.py). Nothing here depends
on kbit weights: bf16 models take it as well, which is how the benchmarks compare like with like.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ._ops import packed_sdpa  # noqa: F401  (the op's reference)

ATTN_IMPLEMENTATION = "kbit_decode"
# Attention keywords whose effect the packed path does not reproduce: those calls run ``sdpa``.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def packed_group(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, **kwargs) -> int | None:
    """Query heads per key/value head if this call can run packed, else None (the call takes ``sdpa``)."""
    if query.dim() != 4 or query.shape[2] != 1 or dropout:
        return None
    if kwargs.get("output_attentions") or any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS):
        return None
    b, hq, _, d = query.shape
    if key.shape[0] != b or key.shape[1] == 0 or hq % key.shape[1] or key.shape[-1] != d:
        return None
    if value.shape[:3] != key.shape[:3]:
        return None
    if attention_mask is not None and (
        attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[2] != 1
        or attention_mask.shape[0] not in (1, b) or attention_mask.shape[-1] != key.shape[2]
    ):
        return None  # a per-head or per-row mask, or one cut to another length: sdpa handles it
    return hq // key.shape[1]


def decode_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers attention function (``attn_implementation="kbit_decode"``): see the module doc."""
    group = packed_group(query, key, value, attention_mask, dropout, **kwargs)
    if group is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.is_cuda:  # a backend kernel may serve it
        return torch.ops.kbit.decode_attention(query, key, value, attention_mask, scale), None
    # Elsewhere the op is its reference: called inline, it stays differentiable and traceable.
    return packed_sdpa(query, key, value, attention_mask, scale), None


def register() -> None:
    """Register ``"kbit_decode"`` with transformers' attention and attention-mask interfaces (masks as for sdpa)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, decode_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _attention_configs(config):
    """``config`` and its sub-configs, at any depth."""
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        if (sub := getattr(config, key, None)) is not None:
            yield from _attention_configs(sub)


def use_as_default(model) -> bool:
    """Attend with ``"kbit_decode"`` where ``model`` attends with transformers' ``sdpa``
    (``KbitConfig.decode_attention``); returns whether it now does. A model (or any of its sub-models) on another
    implementation, or one whose attention cannot be set after it is built, is left as it is: ``kbit_decode``
    falls back to ``sdpa``, which would be wrong for a model built for ``eager`` or a flash kernel."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        return config is not None
    if any(getattr(c, "_attn_implementation", None) != "sdpa" for c in _attention_configs(config)):
        return False
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not callable(can_set) or not can_set():
        return False
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return True
