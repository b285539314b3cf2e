"""Calibration of a model, decoder layer by decoder layer, the way GPTQ runs (the package docstring)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from .. import rotation_policy
from .gptq import CalibrationSettings, calibrate_group
from .moe import _ExpertsHessians, calibrate_experts, data_free_experts

class _StopForward(Exception):
    """Raised by a pre-hook once every decoder layer's arguments are recorded: the rest of the model is skipped."""


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, module list)`` of the model's decoder layers: the first ModuleList of
    ``num_hidden_layers`` modules (``model.layers`` in transformers' causal LMs)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = getattr(config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return name, module
    raise ValueError(f"{type(model).__name__}: no ModuleList of num_hidden_layers={count} decoder layers found; "
                     "calibration runs decoder layer by decoder layer")


def _record_layer_calls(model, layers: nn.ModuleList, batches: list[torch.Tensor]):
    """Per batch: the hidden states entering layer 0, and per layer the other arguments it is called with
    (attention masks and position embeddings depend on the token positions only, not on the weights)."""
    hidden: list[torch.Tensor] = []
    calls: list[list[tuple[tuple, dict]]] = [[] for _ in layers]

    def hook_for(i):
        def hook(module, args, kwargs):
            states = args[0] if args else kwargs["hidden_states"]
            if i == 0:
                hidden.append(states.detach())
            rest = {key: value for key, value in kwargs.items() if key != "hidden_states"}
            calls[i].append((tuple(args[1:]), rest))
            if i == len(layers) - 1:
                raise _StopForward
        return hook

    handles = [layer.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(layers)]
    device = next(model.parameters()).device
    try:
        for batch in batches:
            try:
                model(input_ids=batch.to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return hidden, calls


def _layer_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class _HessianHooks:
    """Forward hooks that add ``x^T x`` of each hooked Linear's input into that Linear's ``H`` (float32, summed
    over tokens). Linears fed the same tensor in one forward (q/k/v, gate/up) share one product."""

    def __init__(self, linears: Mapping[str, nn.Linear]):
        self.sums = {name: None for name in linears}
        self.tokens = {name: 0 for name in linears}
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in linears.items()]

    def _hook(self, name):
        def hook(module, args, output):
            x = args[0].detach()
            product = next((p for seen, p in self._seen if seen is x), None)
            if product is None:
                flat = x.reshape(-1, x.shape[-1]).float()
                product = flat.T @ flat
                self._seen.append((x, product))
            self.sums[name] = product.clone() if self.sums[name] is None else self.sums[name].add_(product)
            self.tokens[name] += x.numel() // x.shape[-1]
        return hook

    def next_forward(self) -> None:
        self._seen.clear()

    def hessian(self, name: str) -> torch.Tensor | None:
        """``X^T X / tokens`` of ``name``'s inputs, or None if it never ran."""
        if self.sums[name] is None:
            return None
        return self.sums[name] / max(self.tokens[name], 1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._seen.clear()


def calibrate_model(
    model: nn.Module,
    batches: list[torch.Tensor],
    bits: int | Mapping[str, int],
    modules: list[str] | None = None,
    settings: CalibrationSettings | None = None,
    progress: bool = True,
    on_quantized: Callable[[str, nn.Linear, tuple], None] | None = None,
    groups: Sequence[Sequence[str]] = (),
    experts: Sequence[str] = (),
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Quantize ``modules`` of ``model`` with :func:`calibrate_group`, decoder layer by decoder layer, in place.

    Args:
        model: a transformers causal LM (its decoder layers found by :func:`decoder_layers`).
        batches: int64 token ids ``[batch, seq_len]`` (:func:`calibration_batches`).
        bits: one k for every module, or ``{module name: k}``.
        modules: names of the nn.Linear modules to quantize (default: every nn.Linear inside the decoder
            layers). Modules outside the decoder layers are quantized data-free (:func:`calibrate_group` without
            Hessians).
        settings: :class:`CalibrationSettings`.
        progress: show a tqdm bar over the modules.
        on_quantized: called as ``on_quantized(name, linear, packed)`` after each module is quantized, before
            its weight is overwritten (e.g. to measure the error against the original weight).
        groups: modules (each in ``modules``, of one decoder layer and one k) that share one codebook
            (:func:`hf_kbit.nn.codebook_siblings`); every other module has its own.
        experts: names of fused MoE experts modules inside the decoder layers (3-D ``gate_up_proj`` /
            ``down_proj``, :func:`hf_kbit.nn.experts.fused_experts_layout`) to calibrate too, by
            :func:`calibrate_experts`: each expert with the Hessian of the tokens routed to it. ``bits`` of a
            mapping is looked up as ``"<experts>.gate_up_proj"`` and ``"<experts>.down_proj"``.
    Returns:
        ``{name: (planes, block_scales, row_scales, codebook, rotation_signs)}`` (format tensors on the module's
        device; ``rotation_signs`` None unless ``settings.rotation`` rotated the module's group: its tensors then
        hold ``W R``, calibrated with ``R^T H R``), in the order the modules were quantized; an experts module's
        projections as ``"<experts>.gate_up_proj"`` and ``"<experts>.down_proj"``, stacked over the experts
        (``row_scales [E, N]``, one codebook, one basis). Each quantized weight is replaced by its dequantized value
        in the original basis (in its dtype), so the model afterwards is the fake-quantized model that the
        calibration saw.
    """
    from tqdm.auto import tqdm

    settings = CalibrationSettings() if settings is None else settings
    prefix, layers = decoder_layers(model)
    if modules is None:
        modules = [f"{prefix}.{i}.{name}" for i, layer in enumerate(layers)
                   for name, m in layer.named_modules() if isinstance(m, nn.Linear)]
    linears = {name: model.get_submodule(name) for name in modules}
    for name, m in linears.items():
        if not isinstance(m, nn.Linear):
            raise TypeError(f"calibrate_model: {name!r} is a {type(m).__name__}, not an nn.Linear")
    bits_of = (lambda name: bits) if isinstance(bits, int) else bits.__getitem__
    if not batches:
        raise ValueError("calibrate_model needs at least one batch of calibration tokens")
    units = _units(list(linears), groups, bits_of, prefix, len(layers))
    moe = {name: model.get_submodule(name) for name in experts}
    outside = [name for name in moe if _units([name], (), bits_of, prefix, len(layers))[0][1] is None]
    if outside:
        raise ValueError(f"calibrate_model: experts {outside[0]!r} are not inside a decoder layer")

    results: dict[str, tuple] = {}

    def quantize_experts(name: str, hessians: _ExpertsHessians) -> None:
        module = moe[name]
        for projection, param in hessians.parameters(name, module).items():
            weight = param.detach().transpose(-1, -2) if hessians.layouts[name].is_transposed else param.detach()
            bits_here, hessian = bits_of(f"{name}.{projection}"), hessians.hessian(name, projection)
            words = settings.rotation_words([weight], lambda ws: [data_free_experts(ws[0], bits_here, settings)],
                                            [f"{name}.{projection}"])
            if words is not None:
                weight, hessian = rotation_policy.rotate_weight(weight, words), rotation_policy.rotate_hessian(
                    hessian, words)
            packed = (*calibrate_experts(weight, hessian, bits_here, settings), words)
            approx = rotation_policy.reconstruction(packed[:4], weight.shape[-1], words).to(param.dtype)
            param.data.copy_(approx.transpose(-1, -2) if hessians.layouts[name].is_transposed else approx)
            results[f"{name}.{projection}"] = packed
            bar.update(1)

    def quantize(unit: tuple[str, ...], hessians: list[torch.Tensor | None]) -> None:
        weights = [linears[name].weight.detach() for name in unit]
        bits_here = bits_of(unit[0])
        words = settings.rotation_words(weights, lambda ws: calibrate_group(ws, [None] * len(ws), bits_here, settings),
                                        unit)
        if words is not None:  # the group is calibrated as W R, with the Hessian of the rotated inputs x R
            weights = [rotation_policy.rotate_weight(w, words) for w in weights]
            hessians = [None if h is None else rotation_policy.rotate_hessian(h, words) for h in hessians]
        for name, packed in zip(unit, calibrate_group(weights, hessians, bits_here, settings)):
            linear = linears[name]
            packed = (*packed, None if words is None else words.clone())
            if on_quantized is not None:
                on_quantized(name, linear, packed)
            approx = rotation_policy.reconstruction(packed[:4], linear.in_features, words)
            linear.weight.data.copy_(approx.to(linear.weight.dtype))
            results[name] = packed
            bar.update(1)

    was_training = model.training
    model.eval()
    bar = tqdm(total=len(linears) + 2 * len(moe), desc="calibrating", unit="weight", disable=not progress)
    try:
        with torch.no_grad():
            hidden, calls = _record_layer_calls(model, layers, batches)
            for i, layer in enumerate(layers):
                inside = [unit for unit in units if unit[1] == i]
                inside_moe = {name: m for name, m in moe.items() if name.startswith(f"{prefix}.{i}.")}
                bar.set_postfix_str(f"layer {i + 1}/{len(layers)}")
                if inside or inside_moe:
                    hooks = _HessianHooks({name: linears[name] for unit, _ in inside for name in unit})
                    moe_hooks = _ExpertsHessians(inside_moe)
                    try:
                        for states, (args, kwargs) in zip(hidden, calls[i]):
                            layer(states, *args, **kwargs)
                            hooks.next_forward()
                    finally:
                        hooks.remove()
                        moe_hooks.remove()
                    for unit, _ in inside:  # a module never called on this text (an unused branch): data-free
                        quantize(unit, [hooks.hessian(name) for name in unit])
                    for name in inside_moe:
                        quantize_experts(name, moe_hooks)
                    del hooks, moe_hooks
                hidden = [_layer_output(layer(states, *args, **kwargs))
                          for states, (args, kwargs) in zip(hidden, calls[i])]
            for unit, _ in [u for u in units if u[1] is None]:  # outside the decoder layers
                quantize(unit, [None] * len(unit))
    finally:
        bar.close()
        model.train(was_training)
    return results


def _units(
    names: list[str], groups: Sequence[Sequence[str]], bits_of, prefix: str, num_layers: int
) -> list[tuple[tuple[str, ...], int | None]]:
    """``(members, decoder layer index or None)`` of every group of ``names`` quantized together, in the order of
    their first member; a name in no group is a group of its own."""
    layer_re = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")

    def layer_of(name: str) -> int | None:
        match = layer_re.match(name)
        return int(match.group(1)) if match and int(match.group(1)) < num_layers else None

    group_of: dict[str, tuple[str, ...]] = {}
    for group in groups:
        group = tuple(group)
        unknown = [name for name in group if name not in names]
        if unknown:
            raise ValueError(f"calibrate_model: group {group} names {unknown}, not among the modules to quantize")
        if len({layer_of(name) for name in group}) != 1 or len({bits_of(name) for name in group}) != 1:
            raise ValueError(f"calibrate_model: the members of group {group} must sit in one decoder layer and "
                             "have one k, since they share a codebook")
        group_of.update(dict.fromkeys(group, group))
    units = dict.fromkeys(group_of.get(name, (name,)) for name in names)
    return [(unit, layer_of(unit[0])) for unit in units]
