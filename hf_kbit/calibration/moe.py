"""Calibration of fused MoE experts: each expert's Hessian from the tokens routed to it (forward pre-hooks on the
experts module) and the experts quantized stacked, a few at a time, with one shared codebook."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .. import fitting
from .. import format as fmt
from .gptq import CalibrationSettings, _check_pair, gptq_quantize

# Experts calibrated at once: their inverse-Hessian factors and working weights, at most this many float32
# elements (1 GB), whatever the expert count.
EXPERT_CHUNK_ELEMENTS = 1 << 28


def calibrate_experts(
    weight: torch.Tensor, hessian: torch.Tensor, bits: int, settings: CalibrationSettings | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused MoE projection ``weight [E, N, K]`` (Linear layout), each expert with the Hessian of its own
    inputs, ``hessian [E, K, K]``: ``(planes [E, ...], block_scales [E, ...], row_scales [E, N], codebook)``, as
    :meth:`hf_kbit.nn.KbitExperts.pack` returns them data-free.

    The experts share the codebook quantization without data gives them (fitted on all experts' rows; the
    ``weighted_codebook`` option does not apply), then :func:`gptq_quantize` runs on a few experts at a time,
    stacked. An expert no token reached has ``H = 0`` and is thus quantized as without data.
    """
    settings = CalibrationSettings() if settings is None else settings
    if weight.dim() != 3:
        raise ValueError(f"weight must be a stack of expert weights [E, N, K], got shape {tuple(weight.shape)}")
    _check_pair(weight, hessian)
    fit = settings.fit_settings(fitting.check_bits(bits), offsets=False)  # experts keep uint8 scales
    codebook = fitting.group_codebook([weight], bits, fit, settings.initial_codebook())
    below, above = (fit.codes_below, fit.codes_above) if fit is not None else (0, 0)
    n_pad, k_pad = fmt.padded_shape(*weight.shape[1:])
    chunk = max(1, EXPERT_CHUNK_ELEMENTS // (k_pad * (k_pad + n_pad)))
    parts = [gptq_quantize(w, h, codebook, below, above, settings.damp, settings.lazy_columns)
             for w, h in zip(weight.split(chunk), hessian.split(chunk))]
    planes, block_scales, rows = (torch.cat(tensors) for tensors in zip(*parts))
    return planes, block_scales, rows, codebook



def data_free_experts(
    weight: torch.Tensor, bits: int, settings: CalibrationSettings | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`calibrate_experts` without data (every ``H = 0``): the same shared codebook, each expert quantized
    as :func:`hf_kbit.fitting.quantize_fitted` does, without the column loop. What ``rotation="auto"`` compares."""
    settings = CalibrationSettings() if settings is None else settings
    fit = settings.fit_settings(fitting.check_bits(bits), offsets=False)  # experts keep uint8 scales
    codebook = fitting.group_codebook([weight], bits, fit, settings.initial_codebook())
    below, above = (fit.codes_below, fit.codes_above) if fit is not None else (0, 0)
    return (*fitting.quantize_fitted(weight, codebook, below, above), codebook)


class _ExpertsHessians:
    """Forward pre-hooks on fused MoE experts modules, called as ``experts(hidden_states [T, H], top_k_index
    [T, k], top_k_weights)``: per expert, the float32 sums of ``x^T x`` over the tokens routed to it (the
    gate/up projection's input) and over its gated activations computed from its current weights (the down
    projection's input, through the module's own gating), and how many tokens it got."""

    def __init__(self, modules: Mapping[str, nn.Module]):
        from ..nn.experts import fused_experts_layout

        self.layouts = {name: fused_experts_layout(m, name) for name, m in modules.items()}
        self.sums: dict[str, dict[str, torch.Tensor]] = {name: {} for name in modules}
        self.tokens = {name: [0] * self.layouts[name].num_experts for name in modules}
        self._handles = [m.register_forward_pre_hook(self._hook(name), with_kwargs=True) for name, m in modules.items()]

    def parameters(self, name: str, module: nn.Module) -> dict[str, nn.Parameter]:
        """The module's ``{"gate_up_proj": ..., "down_proj": ...}`` expert weights (in the model's layout)."""
        return {projection: getattr(module, projection) for projection in ("gate_up_proj", "down_proj")}

    def _hook(self, name):
        def hook(module, args, kwargs):
            from ..nn.experts import apply_gate

            layout = self.layouts[name]
            x = args[0] if args else kwargs["hidden_states"]
            index = args[1] if len(args) > 1 else next(kwargs[k] for k in ("top_k_index", "router_indices") if k in kwargs)
            x = x.detach().reshape(-1, layout.hidden_size).float()
            index = index.reshape(x.shape[0], -1)
            experts = layout.num_experts
            flat = index.reshape(-1).long()
            expert = torch.where((flat >= 0) & (flat < experts), flat, experts)  # ids outside [0, E): no expert
            order = torch.argsort(expert, stable=True)
            counts = torch.bincount(expert, minlength=experts + 1)[:experts].tolist()  # one wait per call
            routed = x[(order // index.shape[1])[: sum(counts)]].split(counts)
            weights = self.parameters(name, module)
            gate_up = weights["gate_up_proj"].detach()
            gate_up = gate_up if layout.is_transposed else gate_up.transpose(-1, -2)  # [E, H, 2I]: x @ it
            bias = getattr(module, "gate_up_proj_bias", None)
            sums = self.sums[name]
            if not sums:
                for projection, param in weights.items():
                    k = layout.linear_shape(projection)[1]
                    sums[projection] = torch.zeros(experts, k, k, dtype=torch.float32, device=x.device)
            for e, xe in enumerate(routed):
                if not counts[e]:
                    continue
                sums["gate_up_proj"][e] += xe.T @ xe
                h = xe @ gate_up[e].float()
                if bias is not None:
                    h = h + bias[e].float()
                act = apply_gate(module, h)
                sums["down_proj"][e] += act.T @ act
                self.tokens[name][e] += counts[e]
        return hook

    def hessian(self, name: str, projection: str) -> torch.Tensor:
        """``[E, K, K]``: each expert's ``X^T X / tokens`` (zeros for an expert that got none)."""
        if projection not in self.sums[name]:  # the module never ran on this text
            layout = self.layouts[name]
            k = layout.linear_shape(projection)[1]
            return torch.zeros(layout.num_experts, k, k)
        tokens = torch.tensor(self.tokens[name], dtype=torch.float32).clamp(min=1)
        return self.sums[name][projection] / tokens.to(self.sums[name][projection].device)[:, None, None]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

