"""Fused routing for the MoE routers of a kbit model.

transformers' routers compute ``logits = x W^T`` and then the family's rule in five to fifteen small launches; at
decode the top-k alone (a sort) costs more than the router's matmul. In a kbit model a router of :data:`RULES`
becomes, in place, an instance of a subclass of its own class and of :class:`KbitRouter` (:func:`fuse_router`: the
same ``weight`` and attributes, so state-dict keys do not change, and transformers' output recorders, which match
routers by class, still record its logits). Its rule then runs as one op, a Triton kernel on CUDA:

- softmax-top-k (Qwen3-MoE, Qwen3-Next, Qwen2-MoE, OLMoE, Mixtral; :class:`KbitSoftmaxTopKRouter`): the float32
  softmax, its top k, their renormalization by the family's rule, ``torch.ops.kbit.softmax_topk``, here with the
  matmul before it in the same op, ``torch.ops.kbit.router_softmax_topk`` (one launch at one token, decode at
  batch 1; more tokens, cuBLAS's matmul and then softmax_topk's launch);
- grouped sigmoid top-k (DeepSeek-V3, GLM-4 MoE; :class:`KbitGroupedTopKRouter`): sigmoid scores, the correction
  bias, the best expert groups, the top k within them, renormalization and scaling, ``kbit::sigmoid_group_topk``;
- top-k softmax (GPT-OSS; :class:`KbitTopKSoftmaxRouter`): the top k logits and their softmax,
  ``kbit::topk_softmax``.

The result is the family's: the same rule, the same dtypes; float32 sums may differ in their last bit from torch's
reduction order (the fused matmul's too: its float32 sums are rounded once, where cuBLAS's bf16 GEMV may sum in
bf16, so a logit may differ from cuBLAS's in its last bits), and of equal scores the lower expert index goes first.
On the CPU, and whenever gradients flow, the router runs its family's own forward.
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
    """How a softmax-top-k family's router turns its top-k probabilities into scores.

    Args:
        family: the transformers model type whose ``modeling_<family>`` module defines the router class.
        renormalize_attr: the router's attribute that says whether the k probabilities are divided by their sum;
            ``None``: always divided.
        cast_to_logits_dtype: the scores are cast back to the logits' dtype (else they stay float32).
    """

    family: str
    renormalize_attr: str | None
    cast_to_logits_dtype: bool


@dataclass(frozen=True)
class GroupedTopKRule:
    """DeepSeek-V3's routing (and GLM-4 MoE's): the router's own ``e_score_correction_bias``, ``num_group``,
    ``topk_group``, ``norm_topk_prob`` and ``routed_scaling_factor`` say the rest."""

    family: str


@dataclass(frozen=True)
class TopKSoftmaxRule:
    """GPT-OSS's routing: the router's matmul has a bias; the softmax runs over the k largest logits."""

    family: str


# Router class name -> its rule, read from transformers' forwards (5.17 .. 5.24; tests/nn/test_routing.py checks
# each against the class's own forward).
RULES: dict[str, SoftmaxTopKRule | GroupedTopKRule | TopKSoftmaxRule] = {
    "Qwen3MoeTopKRouter": SoftmaxTopKRule("qwen3_moe", "norm_topk_prob", True),
    "Qwen3NextTopKRouter": SoftmaxTopKRule("qwen3_next", "norm_topk_prob", True),
    "Qwen2MoeTopKRouter": SoftmaxTopKRule("qwen2_moe", "norm_topk_prob", True),
    "OlmoeTopKRouter": SoftmaxTopKRule("olmoe", "norm_topk_prob", True),
    "MixtralTopKRouter": SoftmaxTopKRule("mixtral", None, False),
    "DeepseekV3TopkRouter": GroupedTopKRule("deepseek_v3"),
    "Glm4MoeTopkRouter": GroupedTopKRule("glm4_moe"),
    "GptOssTopKRouter": TopKSoftmaxRule("gpt_oss"),
}
_PREFIX = "Kbit"  # a fused router's class is "Kbit" + its source class's name, in this module
_OWN_ATTRS = ("kbit_renormalize", "kbit_cast_scores")


class KbitRouter(nn.Module):
    """A router of :data:`RULES` with its rule fused, mixed (through the rule's subclass of this) into a subclass of
    its class (:func:`fused_router_class`); ``forward(hidden_states) -> (router_logits, scores, indices)`` as the
    family's. :func:`fuse_router` makes a router one, :func:`unfuse_router` gives it its class back."""

    source_class: type  # the family's router class (set on each fused class)

    def forward(self, hidden_states: torch.Tensor):
        grads = torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)
        if not hidden_states.is_cuda or grads:
            return self.source_class.forward(self, hidden_states)
        return self.route(hidden_states)

    def route(self, hidden_states: torch.Tensor):
        """The fused routing on any device (``forward`` takes it for CUDA tensors when no gradient flows)."""
        raise NotImplementedError

    def _configure(self, rule) -> None:
        """Set what :meth:`route` reads that the router does not hold itself (at :func:`fuse_router`)."""


class KbitSoftmaxTopKRouter(KbitRouter):
    """The fused routing of a :class:`SoftmaxTopKRule` router."""

    def route(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        return torch.ops.kbit.router_softmax_topk(hidden_states, self.weight, self.top_k, self.kbit_renormalize,
                                                  self.kbit_cast_scores)

    def _configure(self, rule: SoftmaxTopKRule) -> None:
        self.kbit_renormalize = True if rule.renormalize_attr is None else bool(getattr(self, rule.renormalize_attr))
        self.kbit_cast_scores = rule.cast_to_logits_dtype

    def extra_repr(self) -> str:
        return (f"num_experts={self.weight.shape[0]}, top_k={self.top_k}, renormalize={self.kbit_renormalize}, "
                f"fused softmax-top-k")


class KbitGroupedTopKRouter(KbitRouter):
    """The fused routing of a :class:`GroupedTopKRule` router (float32 logits, as the family computes them)."""

    def route(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())
        scores, indices = torch.ops.kbit.sigmoid_group_topk(
            logits, self.e_score_correction_bias, self.top_k, self.num_group, self.topk_group,
            bool(self.norm_topk_prob), float(self.routed_scaling_factor))
        return logits, scores, indices

    def extra_repr(self) -> str:
        return (f"num_experts={self.weight.shape[0]}, top_k={self.top_k}, groups={self.num_group}, "
                f"topk_groups={self.topk_group}, fused grouped sigmoid top-k")


class KbitTopKSoftmaxRouter(KbitRouter):
    """The fused routing of a :class:`TopKSoftmaxRule` router."""

    def route(self, hidden_states: torch.Tensor):
        if hidden_states.dim() != 2:  # the family takes [T, H] (its softmax runs over dim 1)
            return self.source_class.forward(self, hidden_states)
        logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        scores, indices = torch.ops.kbit.topk_softmax(logits, self.top_k)
        return logits, scores, indices

    def extra_repr(self) -> str:
        return f"num_experts={self.weight.shape[0]}, top_k={self.top_k}, fused top-k softmax"


# Each rule's KbitRouter, mixed into the fused subclass of a router of that rule.
_MIXINS: dict[type, type] = {
    SoftmaxTopKRule: KbitSoftmaxTopKRouter,
    GroupedTopKRule: KbitGroupedTopKRouter,
    TopKSoftmaxRule: KbitTopKSoftmaxRouter,
}


@functools.cache
def fused_router_class(source: type) -> type:
    """``Kbit<source name>``: a subclass of its rule's :class:`KbitRouter` and of ``source``, kept in this module's
    namespace so that pickles of fused routers find it (:func:`__getattr__` makes it again in a new process)."""
    if source.__name__ not in RULES:
        raise ValueError(f"router must be one of {sorted(RULES)}, got {source.__name__}")
    name = _PREFIX + source.__name__
    mixin = _MIXINS[type(RULES[source.__name__])]
    cls = type(name, (mixin, source), {"__module__": __name__, "__qualname__": name, "source_class": source})
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
    if isinstance(router, KbitRouter):
        raise ValueError(f"router is already fused ({type(router).__name__})")
    rule = RULES.get(type(router).__name__)
    if rule is None:
        raise ValueError(f"router must be one of {sorted(RULES)}, got {type(router).__name__}")
    router.__class__ = fused_router_class(type(router))
    router._configure(rule)
    return router


def unfuse_router(router: KbitRouter) -> nn.Module:
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
            if (type(child).__name__ in RULES and not isinstance(child, KbitRouter)
                    and should_convert(full, modules_to_not_convert)):
                fuse_router(child)
                fused.append(full)
    return fused


def unfuse_routers(model: nn.Module) -> nn.Module:
    """Give every fused router of ``model`` its family's class back."""
    for module in model.modules():
        if isinstance(module, KbitRouter):
            unfuse_router(module)
    return model
