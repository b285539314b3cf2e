"""KbitHfQuantizer: transformers lifecycle hooks only. Modules live in hf_kbit.nn, math in ops."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

from . import attention, checkpoint, fitting, fusion, head_rotation, rotation_policy
from . import format as fmt
from .config import KbitConfig
from .nn.experts import (
    PROJECTIONS,
    KbitExperts,
    quantize_experts_on_load,
    replace_experts_with_kbit,
    replace_kbit_experts_with_float,
)
from .nn.fused import codebook_siblings, fuse_projections
from .nn.linear import (
    COMPUTE_DTYPES,
    FORMAT_TENSORS,
    ROTATION_SIGNS,
    KbitLinear,
    KbitModule,
    pack_storages,
    quantize_siblings,
)
from .nn.replace import check_quantizable, quantize_model, replace_kbit_with_linear, replace_linear_with_kbit, tied_modules


class KbitHfQuantizer(HfQuantizer):
    """Quantize-on-load and pre-quantized loading of ``quant_method="kbit"`` models."""

    requires_calibration = False
    quantization_config: KbitConfig

    def __init__(self, quantization_config: KbitConfig, **kwargs: Any):
        # A copy: loading settles fields on it (head_rotation, block_offsets, format_version) that the caller's config,
        # which may load another model next, must not inherit. transformers saves this copy as the model's config.
        super().__init__(copy.copy(quantization_config), **kwargs)
        self.modules_to_not_convert: list[str] = []
        # Quantize-on-load of siblings that share a codebook fitted on all of them (nn.fused.codebook_siblings):
        # layer name -> its group, and the weights of groups not yet complete.
        self.codebook_siblings: dict[str, tuple[str, ...]] = {}
        self.pending: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        # KbitConfig.head_rotation on load: parameter name -> (role, head dim) of the v/o tensors to turn, and those
        # turned as they were quantized (the others, kept in float, are turned after loading).
        self.head_turns: dict[str, tuple[str, int]] = {}
        self.head_turned: set[str] = set()
        # Whether from_pretrained was given an attn_implementation (KbitConfig.decode_attention keeps one given).
        self.attn_requested = False

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("kbit models cannot be offloaded to disk; use device_map with 'cpu' or GPUs only")

    def update_attn_implementation(self, config):  # transformers >= 5.18: before the model is built
        self.attn_requested = config._attn_implementation is not None
        return config

    def update_tp_plan(self, config):  # transformers 5.17 shows the config here, before the model is built
        return self.update_attn_implementation(config)

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        if dtype is None:
            return torch.bfloat16
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"kbit models compute in one of {COMPUTE_DTYPES}; got dtype={dtype}")
        return dtype

    def param_needs_quantization(self, model, param_name: str, **kwargs: Any) -> bool:
        if self.pre_quantized:
            return False
        module, tensor_name = get_module_from_name(model, param_name)
        if isinstance(module, KbitExperts):  # fused MoE experts (hf_kbit.nn.experts)
            return tensor_name in module.placeholders()
        return isinstance(module, KbitLinear) and tensor_name == "weight"

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        # The weight placeholder costs nothing: its packed buffers are already counted.
        if self.param_needs_quantization(model, param_name):
            return 0
        return param.element_size()

    def get_new_dtype(self, converter, param, dtype):  # transformers >= 5.18
        # Format tensors keep the dtype they were stored in; validation checks it after load.
        return None if not getattr(param, "get_dtype", lambda: "F")().startswith(("F", "BF")) else dtype

    def skipped_modules(self, model) -> list[str]:
        """The modules of ``model`` kept in full precision: the config's list (default: the LM head), those
        transformers keeps in float32, and tied ones (an explicit list may omit a tied LM head: it stays)."""
        return self.get_modules_to_not_convert(
            model,
            self.quantization_config.modules_to_not_convert,
            getattr(model, "_keep_in_fp32_modules", None),
            add_default_skips=self.quantization_config.modules_to_not_convert is None,
        ) + tied_modules(model)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs: Any):
        self.modules_to_not_convert = self.skipped_modules(model)
        config = self.quantization_config
        config.head_rotation = head_rotation.resolve(config, model, self.pre_quantized)
        config.block_offsets = config.resolved_block_offsets(self.pre_quantized)
        if not self.pre_quantized:
            check_quantizable(config)
        if self.calibrates:  # loaded unquantized; _process_model_after_weight_loading calibrates and quantizes
            return model
        replace_linear_with_kbit(
            model, self.quantization_config, self.modules_to_not_convert, weight_placeholder=not self.pre_quantized
        )
        replace_experts_with_kbit(  # fused MoE experts (hf_kbit.nn.experts)
            model, self.quantization_config, self.modules_to_not_convert, weight_placeholder=not self.pre_quantized
        )
        if self.pre_quantized and checkpoint_files:
            rename = _checkpoint_key_renamer(model, self)
            expect_stored_rotation(model, checkpoint.rotation_signs_keys(checkpoint_files, rename), self.quantization_config)
            checkpoint.validate_files(checkpoint_files, model, rename=rename)
        if not self.pre_quantized:
            if config.head_rotation:
                self.head_turns = head_rotation.targets(model)
            if config.rotation is not False:  # placeholders for the sign words of whatever may rotate
                for module_name, module in model.named_modules():
                    if isinstance(module, KbitModule):
                        for name, k in module.rotation_in_features().items():
                            weight = _signed_weight(module_name, module, name)
                            if fmt.rotatable(k) and rotation_policy.for_weights(config.rotation, [weight]) is not False:
                                module.expect_rotation(name)
            # Siblings wait for each other when they share what is decided on all of them: a fitted codebook, or
            # whether to rotate ("auto").
            self.codebook_siblings = codebook_siblings({
                name: (m.in_features, m.bits)
                for name, m in model.named_modules()
                if isinstance(m, KbitLinear) and (
                    fitting.codebook_needs_data(config.fitting, m.bits, config.codebook) or config.rotation == "auto")
            })
        return model

    @property
    def calibrates(self) -> bool:
        """Quantize-on-load with calibration: the model loads unquantized, then is calibrated and quantized."""
        return not self.pre_quantized and self.quantization_config.calibrates

    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        if self.calibrates:  # on the model's device, as loaded
            quantize_model(model, self.quantization_config, self.modules_to_not_convert)
        # A group some of whose members the checkpoint lacks: those that arrived share a codebook (the missing
        # ones keep their placeholders, which validate_loaded reports).
        for waiting in self.pending.values():
            packed = _quantize_siblings(model, self.quantization_config, list(waiting.items()))
            for key, tensor in packed.items():
                module, name = key.rsplit(".", 1)
                setattr(model.get_submodule(module), name, tensor)
        self.pending.clear()
        for name, (role, head_dim) in self.head_turns.items():  # what loaded in float: v's bias, skipped v/o weights
            if name not in self.head_turned and (param := _parameter(model, name)) is not None:
                param.data.copy_(head_rotation.turn(param.data, role, head_dim))
        checkpoint.validate_loaded(model)
        if not self.pre_quantized:  # what was quantized decides the version (format.version_of)
            self.quantization_config.format_version = format_version_of(model)
        pack_storages(model)
        if self.quantization_config.fuse_projections:
            fuse_projections(model)
        if self.quantization_config.fusion_pass:
            fusion.use_as_default(model)
        if self.quantization_config.decode_attention and not self.attn_requested:
            attention.use_as_default(model)
        return model

    def _dequantize(self, model, dtype=None):
        replace_kbit_experts_with_float(model, dtype)  # fused MoE experts (hf_kbit.nn.experts)
        model = replace_kbit_with_linear(model, dtype)
        if self.quantization_config.head_rotation:  # back to the checkpoint's own v and o
            head_rotation.apply(model, inverse=True)
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        # Adapters (LoRA, hf_kbit.lora) train beside the frozen packed weights; training the packed weights
        # themselves is refused by transformers' Trainer for every quantized model without adapters.
        return True

    @property
    def is_compileable(self) -> bool:
        return True

    def get_quantize_ops(self):
        return KbitQuantize(self)


class KbitQuantize(ConversionOps):
    """Quantize-on-load: the checkpoint's ``<module>.weight`` -> the module's packed buffers."""

    def __init__(self, hf_quantizer: KbitHfQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, model=None, full_layer_name=None, missing_keys=None, **kwargs):
        target_key, value = next(iter(input_dict.items()))
        value = value[0] if isinstance(value, list) else value
        full_layer_name = full_layer_name or target_key
        module, tensor_name = get_module_from_name(model, full_layer_name)
        prefix = full_layer_name.rpartition(".")[0]
        if isinstance(module, KbitExperts):  # fused MoE experts (hf_kbit.nn.experts)
            packed = quantize_experts_on_load(
                module, tensor_name, value, self.hf_quantizer.quantization_config, full_layer_name
            )
            if missing_keys is not None:  # the weight, and the sign words of a projection that stayed unrotated
                missing_keys.difference_update((full_layer_name, f"{prefix}.{PROJECTIONS[tensor_name]}_{ROTATION_SIGNS}"))
            return packed
        del module._parameters["weight"]
        if full_layer_name in self.hf_quantizer.head_turns:
            value = head_rotation.turn(value, *self.hf_quantizer.head_turns[full_layer_name])
            self.hf_quantizer.head_turned.add(full_layer_name)
        if missing_keys is not None:
            missing_keys.difference_update((full_layer_name, f"{prefix}.{ROTATION_SIGNS}"))
        group = self.hf_quantizer.codebook_siblings.get(prefix)
        if group is None:
            members = [(prefix, value)]
        else:  # wait for the siblings: their codebook is fitted on all of them
            waiting = self.hf_quantizer.pending.setdefault(group, {})
            waiting[prefix] = value
            if len(waiting) < len(group):
                return {}
            del self.hf_quantizer.pending[group]
            members = [(name, waiting[name]) for name in group]
        return _quantize_siblings(model, self.hf_quantizer.quantization_config, members)


def _quantize_siblings(model, config: KbitConfig, members: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Quantize the weights of KbitLinear ``members`` (``[(name, weight)]``) with one codebook and in one basis;
    returns their format tensors (and sign words, when rotated) by state-dict key. A member whose placeholder for
    sign words stays unfilled ("auto" kept the group unrotated) loses it."""
    bits = model.get_submodule(members[0][0]).bits
    device = members[0][1].device
    packed = quantize_siblings(
        [w.to(device) for _, w in members], bits, config.codebook, config.fitting, [f"{name}.weight" for name, _ in members],
        config.rotation, config.rotation_seed, config.block_offsets,
    )
    out = {}
    for (name, _), (*tensors, signs) in zip(members, packed):
        out.update({f"{name}.{t}": tensor for t, tensor in zip(FORMAT_TENSORS, tensors)})
        if signs is not None:
            out[f"{name}.{ROTATION_SIGNS}"] = signs
        elif model.get_submodule(name).rotated:
            model.get_submodule(name).rotation_signs = None
    return out


def _parameter(model, name: str) -> torch.nn.Parameter | None:
    """``model``'s parameter ``name``, or None where there is none (a quantized weight's placeholder, once packed)."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def _signed_weight(module_name: str, module, signs: str) -> str:
    """The name of the weight whose sign words are the buffer ``signs`` of ``module``: the module itself, or
    ``<experts>.<projection>`` for a fused experts module."""
    if isinstance(module, KbitExperts):
        return next(f"{module_name}.{p}" for p, prefix in PROJECTIONS.items() if signs == f"{prefix}_{ROTATION_SIGNS}")
    return module_name


def expect_stored_rotation(model, keys: list[str], config: KbitConfig) -> None:
    """Before a pre-quantized load: give each layer whose sign words the checkpoint holds (``keys``, model naming,
    :func:`hf_kbit.checkpoint.rotation_signs_keys`) a placeholder for them, so that it loads rotated. A
    checkpoint whose config.json says ``rotation`` is off but which holds sign words is refused, and so is one
    that lacks the sign words of a weight its ``rotation`` (``True`` or ``"inputs"``, which decide by name and
    in_features alone) stores rotated: without them that weight would load as unrotated ``W R``, and compute a
    wrong product without an error. ``"auto"`` decided by the weights' values, which the checkpoint no longer
    has, but one decision for each group of siblings (q/k/v, gate/up): a group stored partly rotated is refused."""
    if keys and config.rotation is False:
        raise checkpoint.KbitCheckpointError(
            f"the checkpoint holds sign words of rotated layers (e.g. '{keys[0]}'), but its quantization_config has "
            "no rotation: config.json and tensors disagree; use the config.json the checkpoint was saved with"
        )
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "")
    for key in keys:
        for candidate in (key, f"{prefix}.{key}"):
            module_name, _, name = candidate.rpartition(".")
            module = modules.get(module_name)
            if isinstance(module, KbitModule) and name in module.rotation_in_features():
                try:
                    module.expect_rotation(name)
                except ValueError as e:
                    raise checkpoint.KbitCheckpointError(f"checkpoint tensor '{key}': {e}") from None
                break
    if config.rotation is True or config.rotation == "inputs":
        for module_name, module in modules.items():
            if not isinstance(module, KbitModule):
                continue
            for name, k in module.rotation_in_features().items():
                weight = _signed_weight(module_name, module, name)
                if fmt.rotatable(k) and rotation_policy.for_weights(config.rotation, [weight]) and \
                        not module.stores_rotated(name):
                    raise checkpoint.KbitCheckpointError(
                        f"checkpoint tensor '{module_name}.{name}' is missing: the quantization_config's "
                        f"rotation={config.rotation!r} stores '{weight}' (in_features {k}) rotated, with its sign "
                        "words, and without them it would compute a wrong product; the file is incomplete or "
                        "config.json is not the one it was saved with"
                    )
    elif config.rotation == "auto":
        linears = {name: m for name, m in modules.items() if isinstance(m, KbitLinear) and fmt.rotatable(m.in_features)}
        for group in set(codebook_siblings({name: (m.in_features, m.bits) for name, m in linears.items()}).values()):
            rotated = [linears[name].stores_rotated() for name in group]
            if any(rotated) and not all(rotated):
                missing = next(name for name, r in zip(group, rotated) if not r)
                raise checkpoint.KbitCheckpointError(
                    f"checkpoint tensor '{missing}.{ROTATION_SIGNS}' is missing: its siblings {list(group)} share one "
                    "rotation decision (rotation='auto'), and the checkpoint stores the others rotated"
                )


def format_version_of(model) -> int:
    """The format version a checkpoint of ``model`` is (:func:`hf_kbit.format.version_of`): 4 once one of its weights
    holds block records, else 3 once one is stored rotated, else 1."""
    modules = [m for m in model.modules() if isinstance(m, KbitModule)]
    offsets = any(getattr(m, "block_offsets", False) for m in modules)
    return fmt.version_of(any(m.stores_rotated() for m in modules), offsets)


def _checkpoint_key_renamer(model, hf_quantizer):
    """Saved key -> the model's name for it, by the model's own conversion mapping (as loading does)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model, hf_quantizer=hf_quantizer)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    return lambda key: rename_source_key(key, renamings, converters, prefix, state)[0]
