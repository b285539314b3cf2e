"""Swapping a model's Linear layers for KbitLinear and back (no transformers lifecycle here)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import format as fmt
from .. import head_rotation
from ..config import KbitConfig
from .experts import expert_bits, fused_experts_layout, quantize_experts
from .fused import codebook_siblings, fuse_projections, unfuse_projections
from .linear import KbitLinear, check_weight, quantize_siblings
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
            block_offsets=config.block_offsets,
        )

    return swap_modules(model, modules_to_not_convert, make)


def replace_kbit_with_linear(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every KbitLinear with an ``nn.Linear`` holding its dequantized weight."""
    unfuse_projections(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, KbitLinear):
            _set_submodule(model, name, module.to_linear(dtype))
    return model


def check_quantizable(config: KbitConfig) -> None:
    """Refuse to quantize a model with a config that records a calibration it would not run (one read from a
    calibrated checkpoint's config.json): the output would claim a calibration it did not have."""
    if config.calibration is not None and not config.calibrates:
        raise ValueError(
            f"KbitConfig.calibration={config.calibration!r} records the calibration of an existing checkpoint; to "
            "quantize a model, pass calibration_data (the text to calibrate on), or drop calibration for data-free"
        )


def quantize_model(
    model: nn.Module,
    config: KbitConfig | None = None,
    modules_to_not_convert: list[str] | None = None,
    progress: bool = True,
) -> nn.Module:
    """Quantize a model already in memory (outside ``from_pretrained``), in place; returns it.

    Every ``nn.Linear`` becomes a :class:`KbitLinear` and every fused MoE experts module
    (transformers v5 ``*.experts`` with 3-D ``gate_up_proj`` / ``down_proj``) a
    :class:`~hf_kbit.nn.KbitExperts`, as quantize-on-load does. ``modules_to_not_convert``
    (default: ``config.modules_to_not_convert``, else nothing) lists modules to keep in full
    precision; unlike ``from_pretrained`` there is no default skip of the LM head here, except
    that tied modules (an LM head sharing the input embedding's weight) are always kept
    (:func:`tied_modules`).
    With ``config.head_rotation`` (``None``: as :func:`hf_kbit.head_rotation.resolve` decides for ``model``) the
    attention's v and o are first turned per head, in place (:mod:`hf_kbit.head_rotation`).
    With ``config.rotation`` each group of siblings (q/k/v, gate/up: they share one codebook and one basis) and
    each experts projection is quantized rotated where the config says (:mod:`hf_kbit.rotation_policy`).
    The Linears' blocks get offsets as :meth:`KbitConfig.resolved_block_offsets` says (the default: unless rotated).
    With ``config.calibration_data`` the Linears are calibrated (:func:`hf_kbit.calibration.calibrate_model`, on
    the model's device, a tqdm bar unless ``progress`` is False), the fused experts of the decoder layers too;
    what quantize-on-load with calibration and ``kbit-convert --calibration-data`` run.
    With ``config.fuse_projections`` (default) sibling projections are then fused
    (:func:`~hf_kbit.nn.fuse_projections`); with ``config.fusion_pass`` (default) ``generate()`` compiles
    with :func:`hf_kbit.fusion.compile_config` (:func:`hf_kbit.fusion.use_as_default`); with
    ``config.decode_attention`` (default) a model that attends with ``sdpa`` attends with ``"kbit_decode"``
    (:func:`hf_kbit.attention.use_as_default`).
    """
    config = copy.copy(config or KbitConfig())
    check_quantizable(config)
    config.block_offsets = config.resolved_block_offsets()
    if head_rotation.resolve(config, model):  # in place, before calibration reads the activations
        head_rotation.apply(model)
    skip = modules_to_not_convert if modules_to_not_convert is not None else (config.modules_to_not_convert or [])
    skip = [*skip, *tied_modules(model)]
    linears = {
        name: module for name, module in model.named_modules() if isinstance(module, nn.Linear) and should_convert(name, skip)
    }
    siblings = codebook_siblings({name: (m.in_features, config.bits_for(name)) for name, m in linears.items()})
    groups = list(dict.fromkeys(siblings.get(name, (name,)) for name in linears))  # each group once, in model order
    calibrated = _calibrate(model, config, linears, groups, skip, progress) if config.calibrates else {}
    for group in groups:
        members = [linears[name] for name in group]
        if config.calibrates:
            packed = [calibrated.pop(name) for name in group]
        else:
            with torch.no_grad():
                weights = [m.weight.detach() for m in members]
                packed = quantize_siblings(weights, config.bits_for(group[0]), config.codebook, config.fitting,
                                           list(group), config.rotation, config.rotation_seed, config.block_offsets)
        for name, module, tensors in zip(group, members, packed):
            _set_submodule(model, name, KbitLinear.from_linear(module, config.bits_for(name), packed=tensors))
    model = quantize_experts(model, config, modules_to_not_convert, packed=calibrated)
    if config.fuse_projections:
        fuse_projections(model)
    if config.fusion_pass:
        from .. import fusion

        fusion.use_as_default(model)
    if config.decode_attention:
        from .. import attention

        attention.use_as_default(model)
    return model


def _calibrate(
    model, config: KbitConfig, linears: dict[str, nn.Linear], groups, skip: list[str], progress: bool
) -> dict[str, tuple]:
    """The format tensors of ``linears`` and of the fused MoE experts inside the decoder layers, calibrated on
    ``config.calibration_data`` (siblings in ``groups`` share a codebook, as without calibration)."""
    from .. import calibration

    for name, module in linears.items():
        check_weight(module.weight.detach(), f"{name}.weight")
    prefix, layers = calibration.decoder_layers(model)
    experts = {
        name: module for name, module in model.named_modules()
        if name.startswith(f"{prefix}.") and should_convert(name, skip) and fused_experts_layout(module, name) is not None
    }
    bits = {name: config.bits_for(name) for name in linears}
    for name, module in experts.items():
        bits[f"{name}.gate_up_proj"], bits[f"{name}.down_proj"] = expert_bits(config, name)
        for projection in ("gate_up_proj", "down_proj"):
            check_weight(getattr(module, projection).detach(), f"{name}.{projection}")
    batches = calibration.config_batches(config, model)
    settings = calibration.CalibrationSettings(fitting=config.fitting, codebook=config.codebook,
                                               block_offsets=config.block_offsets, rotation=config.rotation,
                                               rotation_seed=config.rotation_seed)
    shared = [group for group in groups if len(group) > 1]
    return calibration.calibrate_model(model, batches, bits, list(linears), settings, progress, groups=shared,
                                       experts=list(experts))
