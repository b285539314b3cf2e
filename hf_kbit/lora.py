"""LoRA fine-tuning (QLoRA) of kbit models through peft.

The kbit weights stay frozen and packed; peft's LoRA adapters train beside them, and gradients
reach the activations through the backward of ``kbit::mm`` / ``kbit::grouped_mm``.

What peft needs, and where it gets it here:

* **Which layer wraps a KbitLinear.** peft picks the LoRA layer for a target module through a fixed
  list of dispatchers (bitsandbytes, HQQ, torchao, ...); the one open to other packages is a mapping on
  the config, ``LoraConfig._register_custom_module`` (peft's "custom models" guide). :func:`lora_config`
  registers :class:`KbitLoraLinear` for :class:`~hf_kbit.nn.KbitLinear` there.
* **What ``target_modules="all-linear"`` means.** peft expands it to the modules that are
  ``nn.Linear`` by class, which KbitLinear is not (on purpose: transformers' initialisers must never
  touch its ``.weight``), so :func:`lora_config` expands it itself, to every KbitLinear and
  ``nn.Linear`` except the output embedding, as peft does.
* **The device of the packed weight.** peft looks for ``qweight`` on quantized layers, which KbitLinear
  provides (its ``planes``).

So: ``hf_kbit.lora.get_peft_model(model, LoraConfig(...))`` in place of ``peft.get_peft_model`` (or
``peft.get_peft_model(model, hf_kbit.lora.lora_config(config, model))``), and
:func:`load_adapter` in place of ``PeftModel.from_pretrained`` (the registration is not saved with the
adapter). ``peft.get_peft_model`` on the bare config cannot find KbitLinear layers.

Fused projections (q/k/v, gate/up) stay fused: each member is wrapped, its base call still takes its
slice of the one fused launch. MoE experts (:class:`~hf_kbit.nn.KbitExperts`) stay frozen kbit: LoRA
on attention and dense layers trains through them; LoRA on the experts themselves (peft's
``target_parameters``, which wraps 3-D ``nn.Parameter`` expert weights) is not supported, because kbit
experts hold packed buffers, not parameters.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from . import head_rotation
from .nn import KbitExperts, KbitLinear
from .nn.experts import PROJECTIONS, replace_kbit_experts_with_float
from .nn.fused import unfuse_projections
from .nn.replace import replace_kbit_with_linear

try:
    import peft
    from peft import LoraConfig, PeftConfig, PeftModel
    from peft.tuners.lora import Linear as _LoraLinear
except ImportError as e:  # pragma: no cover - exercised only without peft
    raise ImportError("hf_kbit.lora needs peft: `pip install peft`") from e

__all__ = ["KbitLoraLinear", "get_peft_model", "load_adapter", "lora_config", "merge_and_dequantize"]

# init_lora_weights schemes that read or rewrite the base weight (peft computes them from ``base_layer.weight``).
_WEIGHT_INITS = ("pissa", "olora", "loftq", "corda", "eva")

_MERGE_MESSAGE = (
    "a LoRA delta cannot be merged into packed kbit weights without requantizing them. For a full-precision "
    "model with the adapters merged, use `hf_kbit.lora.merge_and_dequantize(peft_model)`; to keep the kbit "
    "model, keep the adapter separate (`peft_model.save_pretrained(...)`, `hf_kbit.lora.load_adapter(...)`)."
)


class KbitLoraLinear(_LoraLinear):
    """peft's LoRA ``Linear`` over a frozen :class:`~hf_kbit.nn.KbitLinear`:
    ``y = base(x) + lora_B(lora_A(dropout(x))) * scaling``.

    The forward is peft's own; what needs the base weight as a dense tensor is refused with a message:
    merging into the kbit weight (see :func:`merge_and_dequantize`), DoRA, and the initialisations that
    decompose the base weight (PiSSA, OLoRA, LoftQ, CorDA, EVA). Once :func:`merge_and_dequantize` has
    replaced the base layer with a dequantized ``nn.Linear``, merging is peft's.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, **kwargs):
        config = kwargs.get("config")
        init = getattr(config, "init_lora_weights", kwargs.get("init_lora_weights", True))
        if getattr(config, "use_dora", kwargs.get("use_dora", False)):
            raise NotImplementedError("DoRA on kbit layers is not supported (it needs the dense base weight); use LoRA")
        if isinstance(init, str) and init.split("_")[0].lower() in _WEIGHT_INITS:
            raise NotImplementedError(
                f"init_lora_weights={init!r} decomposes the base weight, which kbit layers hold packed; use "
                "init_lora_weights=True (default), 'gaussian' or False"
            )
        super().__init__(base_layer, adapter_name, **kwargs)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        # peft resolves the features of layer types it knows and warns on others
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if isinstance(base, KbitLinear):
            return base.in_features, base.out_features
        return super()._get_in_out_features(module)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        if isinstance(self.get_base_layer(), KbitLinear):
            raise NotImplementedError(f"{type(self).__name__}.merge: {_MERGE_MESSAGE}")
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def __repr__(self) -> str:
        return "kbit_lora." + super().__repr__().removeprefix("lora.")


def lora_config(config: LoraConfig, model: nn.Module) -> LoraConfig:
    """A copy of ``config`` that peft can apply to the kbit ``model``.

    KbitLinear layers get :class:`KbitLoraLinear` (registered on the copy), and
    ``target_modules="all-linear"`` becomes the names of every KbitLinear and ``nn.Linear`` of
    ``model`` except its output embedding (peft's rule for that shorthand). Raises
    ``NotImplementedError`` when ``config.target_parameters`` names kbit experts' weights.
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a peft.LoraConfig, got {type(config).__name__}")
    config = copy.deepcopy(config)
    config._register_custom_module({KbitLinear: KbitLoraLinear})
    if isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear":
        config.target_modules = all_linear_names(model)
    targets = getattr(config, "target_parameters", None) or []  # peft >= 0.17: suffixes of parameter names
    expert_weights = [f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, KbitExperts) for p in PROJECTIONS]
    hit = sorted({t for t in targets for w in expert_weights if w == t or w.endswith("." + t)})
    if hit:
        raise NotImplementedError(
            f"target_parameters {hit} name weights of kbit MoE experts ({expert_weights[0]}, ...), which are packed "
            "buffers, not parameters, so peft cannot wrap them. Train LoRA on the attention and dense layers "
            "(the experts stay frozen kbit), or load the model unquantized for LoRA on the experts."
        )
    return config


def all_linear_names(model: nn.Module) -> list[str]:
    """Names of every KbitLinear and ``nn.Linear`` of ``model`` except its output embedding (LM head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = sorted(
        name for name, m in model.named_modules() if isinstance(m, (KbitLinear, nn.Linear)) and m is not head
    )
    if not names:
        raise ValueError(f"{type(model).__name__} has no KbitLinear or nn.Linear layers to put LoRA adapters on")
    return names


def get_peft_model(model: nn.Module, config: LoraConfig, **kwargs) -> PeftModel:
    """``peft.get_peft_model`` for a kbit model: ``config`` through :func:`lora_config` first.

    ``kwargs`` go to ``peft.get_peft_model`` (``adapter_name``, ``autocast_adapter_dtype``, ...).
    """
    return peft.get_peft_model(model, lora_config(config, model), **kwargs)


def enable_checkpointing(model: nn.Module, use_reentrant: bool = False) -> None:
    """Activation (gradient) checkpointing on a transformers ``model`` (or a PeftModel around one), under the
    name the installed transformers gives it: ``activation_checkpointing_enable`` where it exists (its older
    name, ``gradient_checkpointing_enable``, warns there and goes in v6), ``gradient_checkpointing_enable``
    before. A reentrant checkpoint also needs ``model.enable_input_require_grads()``, as for any frozen base.
    """
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_adapter(model: nn.Module, adapter: str, is_trainable: bool = False, **kwargs) -> PeftModel:
    """``PeftModel.from_pretrained(model, adapter)`` for a kbit ``model`` (the adapter's saved config
    through :func:`lora_config`). ``kwargs`` go to ``PeftModel.from_pretrained`` (``adapter_name``, ...)
    and to ``PeftConfig.from_pretrained`` (``revision``, ``subfolder``, ...).
    """
    config = PeftConfig.from_pretrained(
        adapter, **{k: v for k, v in kwargs.items() if k in ("revision", "subfolder", "cache_dir", "token")}
    )
    if not isinstance(config, LoraConfig):
        raise TypeError(f"{adapter}: a {type(config).__name__} adapter; hf_kbit.lora loads LoRA adapters only")
    return PeftModel.from_pretrained(
        model, adapter, is_trainable=is_trainable, config=lora_config(config, model), **kwargs
    )


def merge_and_dequantize(peft_model: PeftModel, dtype: torch.dtype | None = None) -> nn.Module:
    """The base model in full precision with the adapters merged: every kbit layer dequantized (to
    ``dtype``, default the model's ``config.dtype``), the LoRA deltas added, peft's wrappers removed and
    the model's quantization config dropped; v and o turned back when the model was quantized with
    ``head_rotation`` (the adapters were trained in the turned basis, so they are merged before). ``peft_model`` is
    consumed (its layers are reused).
    """
    base = peft_model.get_base_model()
    dtype = dtype or getattr(getattr(base, "config", None), "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    unfuse_projections(base)
    for module in base.modules():
        if isinstance(module, KbitLoraLinear) and isinstance(module.base_layer, KbitLinear):
            module.base_layer = module.base_layer.to_linear(dtype)
    merged = peft_model.merge_and_unload()
    replace_kbit_with_linear(merged, dtype)  # layers without adapters
    replace_kbit_experts_with_float(merged, dtype)
    quantizer = getattr(merged, "hf_quantizer", None)
    if getattr(getattr(quantizer, "quantization_config", None), "head_rotation", False):
        head_rotation.apply(merged, inverse=True)
    if quantizer is not None:
        quantizer.remove_quantization_config(merged)
    return merged
