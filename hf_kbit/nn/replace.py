"""Swapping a model's Linear layers for KbitLinear and back (no transformers lifecycle here)."""

from __future__ import annotations

import torch
from torch import nn

from .. import format as fmt
from ..config import KbitConfig
from .experts import quantize_experts
from .fused import codebook_siblings, fuse_projections, unfuse_projections
from .linear import KbitLinear, quantize_group
from .selection import _set_submodule, should_convert, swap_modules, tied_modules


def replace_linear_with_kbit(
    model: nn.Module, config: KbitConfig, modules_to_not_convert: list[str], weight_placeholder: bool
) -> list[str]:
    """Replace every convertible ``nn.Linear`` of ``model`` in place; returns the converted names.

    Runs on the meta skeleton before weights load, so nothing is quantized here.
    """

    def make(name: str, module: nn.Module) -> KbitLinear | None:
        if not isinstance(module, nn.Linear):
            return None
        bits = config.bits_for(name)
        return KbitLinear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            bits=bits,
            codebook=fmt.make_codebook(config.codebook, bits),
            dtype=module.weight.dtype,
            device=module.weight.device,
            weight_placeholder=weight_placeholder,
        )

    return swap_modules(model, modules_to_not_convert, make)


def replace_kbit_with_linear(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every KbitLinear with an ``nn.Linear`` holding its dequantized weight."""
    unfuse_projections(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, KbitLinear):
            _set_submodule(model, name, module.to_linear(dtype))
    return model


def quantize_model(model: nn.Module, config: KbitConfig | None = None, modules_to_not_convert: list[str] | None = None) -> nn.Module:
    """Quantize a model already in memory (outside ``from_pretrained``), in place; returns it.

    Every ``nn.Linear`` becomes a :class:`KbitLinear` and every fused MoE experts module
    (transformers v5 ``*.experts`` with 3-D ``gate_up_proj`` / ``down_proj``) a
    :class:`~hf_kbit.nn.KbitExperts`, as quantize-on-load does. ``modules_to_not_convert``
    (default: ``config.modules_to_not_convert``, else nothing) lists modules to keep in full
    precision; unlike ``from_pretrained`` there is no default skip of the LM head here, except
    that tied modules (an LM head sharing the input embedding's weight) are always kept
    (:func:`tied_modules`).
    With ``config.fuse_projections`` (default) sibling projections are then fused
    (:func:`~hf_kbit.nn.fuse_projections`); with ``config.fusion_pass`` (default) ``generate()`` compiles
    with :func:`hf_kbit.fusion.compile_config` (:func:`hf_kbit.fusion.use_as_default`).
    """
    config = config or KbitConfig()
    skip = modules_to_not_convert if modules_to_not_convert is not None else (config.modules_to_not_convert or [])
    skip = [*skip, *tied_modules(model)]
    linears = {
        name: module for name, module in model.named_modules() if isinstance(module, nn.Linear) and should_convert(name, skip)
    }
    siblings = codebook_siblings({name: (m.in_features, config.bits_for(name)) for name, m in linears.items()})
    for group in dict.fromkeys(siblings.get(name, (name,)) for name in linears):  # each group once, in model order
        members = [linears[name] for name in group]
        with torch.no_grad():
            weights = [m.weight.detach() for m in members]
            packed = quantize_group(weights, config.bits_for(group[0]), config.codebook, config.fitting, list(group))
        for name, module, tensors in zip(group, members, packed):
            _set_submodule(model, name, KbitLinear.from_linear(module, config.bits_for(name), packed=tensors))
    model = quantize_experts(model, config, modules_to_not_convert)
    if config.fuse_projections:
        fuse_projections(model)
    if config.fusion_pass:
        from .. import fusion

        fusion.use_as_default(model)
    return model
