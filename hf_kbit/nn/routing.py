"""Fused routing for the softmax-top-k MoE routers of a kbit model.

transformers' Qwen3-MoE, Qwen3-Next, Qwen2-MoE, OLMoE and Mixtral routers compute ``logits = x W^T``, a float32
softmax over the experts, its top k and (by the family's rule) their renormalization, in five or six launches; at
decode the top-k alone (a sort) costs more than the router's matmul. In a kbit model such a router becomes, in
place, an instance of a subclass of its own class and of :class:`KbitSoftmaxTopKRouter` (:func:`fuse_router`: the
same ``weight`` and attributes, so state-dict keys do not change, and transformers' output recorders, which match
routers by class, still record its logits). That runs the softmax, top-k and renormalization as one op,
``torch.ops.kbit.softmax_topk`` (a Triton kernel on CUDA). The result is the family's: the same rule, the same
dtypes; float32 sums may differ in their last bit from torch's reduction order, and equal probabilities go to the
lower expert index first. On the CPU, and whenever gradients flow, the router runs its family's own forward.

Routers of other rules (DeepSeek-V3 and GLM-4 MoE: sigmoid scores, a correction bias and expert groups; GPT-OSS:
top-k of the logits, then a softmax) keep their own module.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch
from torch import nn

from .selection import should_convert


@dataclass(frozen=True)
class SoftmaxTopKRule:
    """How a family's router turns its top-k probabilities into scores.

    Args:
        family: the transformers model type whose ``modeling_<family>`` module defines the router class.
        renormalize_attr: the router's attribute that says whether the k probabilities are divided by their sum;
            ``None``: always divided.
        cast_to_logits_dtype: the scores are cast back to the logits' dtype (else they stay float32).
    """

    family: str
    renormalize_attr: str | None
    cast_to_logits_dtype: bool


# Router class name -> its rule, read from transformers' forwards (5.17 .. 5.24; tests/nn/test_routing.py checks
# each against the class's own forward).
RULES: dict[str, SoftmaxTopKRule] = {
    "Qwen3MoeTopKRouter": SoftmaxTopKRule("qwen3_moe", "norm_topk_prob", True),
    "Qwen3NextTopKRouter": SoftmaxTopKRule("qwen3_next", "norm_topk_prob", True),
    "Qwen2MoeTopKRouter": SoftmaxTopKRule("qwen2_moe", "norm_topk_prob", True),
    "OlmoeTopKRouter": SoftmaxTopKRule("olmoe", "norm_topk_prob", True),
    "MixtralTopKRouter": SoftmaxTopKRule("mixtral", None, False),
}
_PREFIX = "Kbit"  # a fused router's class is "Kbit" + its source class's name, in this module
_OWN_ATTRS = ("kbit_renormalize", "kbit_cast_scores")


class KbitSoftmaxTopKRouter(nn.Module):
    """The fused routing of a softmax-top-k router of :data:`RULES`, mixed into a subclass of its class
    (:func:`fused_router_class`); ``forward(hidden_states) -> (router_logits, scores, indices)`` as the family's.
    :func:`fuse_router` makes a router one, :func:`unfuse_router` gives it its class back."""

    source_class: type  # the family's router class (set on each fused class)

    def forward(self, hidden_states: torch.Tensor):
        grads = torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)
        if not hidden_states.is_cuda or grads:
            return self.source_class.forward(self, hidden_states)
        return self.route(hidden_states)

    def route(self, hidden_states: torch.Tensor):
        """The fused routing on any device (``forward`` takes it for CUDA tensors when no gradient flows)."""
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        cast = self.kbit_cast_scores
        scores, indices = torch.ops.kbit.softmax_topk(logits, self.top_k, self.kbit_renormalize, cast)
        return logits, scores, indices

    def extra_repr(self) -> str:
        return (f"num_experts={self.weight.shape[0]}, top_k={self.top_k}, renormalize={self.kbit_renormalize}, "
                f"fused softmax-top-k")


@functools.cache
def fused_router_class(source: type) -> type:
    """``Kbit<source name>``: a subclass of :class:`KbitSoftmaxTopKRouter` and ``source``, kept in this module's
    namespace so that pickles of fused routers find it (:func:`__getattr__` makes it again in a new process)."""
    if source.__name__ not in RULES:
        raise ValueError(f"router must be one of {sorted(RULES)}, got {source.__name__}")
    name = _PREFIX + source.__name__
    cls = type(name, (KbitSoftmaxTopKRouter, source), {"__module__": __name__, "__qualname__": name,
                                                       "source_class": source})
    globals()[name] = cls
    return cls


def __getattr__(name: str):
    """``Kbit<router>`` classes are made on first use (unpickling a fused router in a new process)."""
    source_name = name[len(_PREFIX):] if name.startswith(_PREFIX) else None
    if source_name in RULES:
        family = RULES[source_name].family
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        return fused_router_class(getattr(module, source_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fuse_router(router: nn.Module) -> nn.Module:
    """Make ``router`` (a class of :data:`RULES`) fused, in place; returns it."""
    if isinstance(router, KbitSoftmaxTopKRouter):
        raise ValueError(f"router is already fused ({type(router).__name__})")
    rule = RULES.get(type(router).__name__)
    if rule is None:
        raise ValueError(f"router must be one of {sorted(RULES)}, got {type(router).__name__}")
    renormalize = True if rule.renormalize_attr is None else bool(getattr(router, rule.renormalize_attr))
    router.__class__ = fused_router_class(type(router))
    router.kbit_renormalize = renormalize
    router.kbit_cast_scores = rule.cast_to_logits_dtype
    return router


def unfuse_router(router: KbitSoftmaxTopKRouter) -> nn.Module:
    """Give a fused router its family's class back, in place; returns it."""
    router.__class__ = router.source_class
    for key in _OWN_ATTRS:
        router.__dict__.pop(key, None)
    return router


def fuse_routers(model: nn.Module, experts_names: list[str], modules_to_not_convert: list[str]) -> list[str]:
    """Fuse each router of :data:`RULES` beside the experts modules ``experts_names`` (children of the same block),
    unless ``modules_to_not_convert`` names it; returns their names."""
    fused = []
    for name in experts_names:
        block_name = name.rpartition(".")[0]
        block = model.get_submodule(block_name) if block_name else model
        for child_name, child in block.named_children():
            full = f"{block_name}.{child_name}" if block_name else child_name
            if (type(child).__name__ in RULES and not isinstance(child, KbitSoftmaxTopKRouter)
                    and should_convert(full, modules_to_not_convert)):
                fuse_router(child)
                fused.append(full)
    return fused


def unfuse_routers(model: nn.Module) -> nn.Module:
    """Give every fused router of ``model`` its family's class back."""
    for module in model.modules():
        if isinstance(module, KbitSoftmaxTopKRouter):
            unfuse_router(module)
    return model
