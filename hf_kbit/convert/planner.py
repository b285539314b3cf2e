"""Planning a conversion: the model's skeleton on the meta device with the quantizer applied, the checkpoint's
safetensors headers, and transformers' conversion mapping turned into one
:class:`~hf_kbit.convert.plan.TensorPlan` per tensor."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import checkpoint, head_rotation, rotation_policy
from .. import format as fmt
from .._paths import (
    ConversionError,
    weight_files,
)
from ..config import KbitConfig
from ..nn.experts import ExpertsLayout, KbitExperts
from .plan import ConversionPlan, KeyRule, PlanContext, TensorPlan
from .sources import _first_line, _load_architecture

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def plan_conversion(
    source: str | os.PathLike,
    kbit_config: KbitConfig,
    dtype: torch.dtype | str | None = None,
    key_rules: Sequence[KeyRule] = (),
) -> ConversionPlan:
    """Plan the conversion of the model folder ``source`` (reads only config and safetensors headers)."""
    source = Path(source)
    hf_config, model_cls = _load_architecture(source)
    files = weight_files(source)
    ckpt: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    ckpt_nbytes: dict[str, int] = {}
    locations: dict[str, tuple[int, int]] = {}
    for index, path in enumerate(files):
        try:
            for key, info in checkpoint.read_safetensors_header(path).items():
                if key == "__metadata__":
                    continue
                ckpt[key] = (tuple(info["shape"]), _SAFETENSORS_DTYPES.get(info["dtype"]) or info["dtype"])
                ckpt_nbytes[key] = info["data_offsets"][1] - info["data_offsets"][0]
                locations[key] = (index, info["data_offsets"][0])
        except checkpoint.KbitCheckpointError as e:  # names the file and what is wrong with it
            raise ConversionError(f"{e}") from None
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise ConversionError(
                f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); download or save it again"
            ) from None
    dtype = _resolve_dtype(dtype, hf_config, ckpt)

    try:
        model = _skeleton(model_cls, hf_config, dtype, kbit_config)
    except Exception as e:  # noqa: BLE001 -- any failure here comes from the values in config.json
        raise ConversionError(
            f"{source}/config.json: transformers cannot build {model_cls.__name__} from it "
            f"({type(e).__name__}: {_first_line(e)}); fix or download config.json again"
        ) from None
    quantizer = model._kbit_quantizer
    # The plan's own config, with head_rotation and block_offsets as quantize-on-load settles them (the caller's
    # stays as given).
    kbit_config = copy.copy(kbit_config)
    kbit_config.head_rotation = quantizer.quantization_config.head_rotation
    kbit_config.block_offsets = quantizer.quantization_config.block_offsets
    model_tensors = {k: (tuple(t.shape), t.dtype) for k, t in _model_tensors(model).items()}
    quantized = {
        name: _bits_of(model, name)
        for name, _ in model.named_parameters()
        if quantizer.param_needs_quantization(model, name)
    }
    ctx = PlanContext(quantized=quantized, model_tensors=model_tensors)

    plans: list[TensorPlan] = []
    unclaimed = dict(ckpt)
    for rule in key_rules:
        for plan in rule(dict(unclaimed), model, ctx):
            plan.source_nbytes = plan.source_nbytes or sum(ckpt_nbytes[k] for k in plan.sources)
            plans.append(plan)
            for key in plan.sources:
                unclaimed.pop(key, None)
    planner = _DefaultPlanner(model, ctx, unclaimed, ckpt_nbytes, model_cls.__name__, dtype)
    plans += planner.plan()
    for plan in plans:
        plan.rotated = (plan.bits is not None and rotation_policy.for_weights(kbit_config.rotation, [plan.name]) is True
                        and fmt.rotatable(plan.in_features()))
        plan.block_offsets = kbit_config.block_offsets and plan.bits is not None and plan.experts is None

    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = sorted(set(model_tensors) - {p.name for p in plans} - planner.covered - tied)
    if missing:
        raise ConversionError(
            f"the checkpoint in {source} lacks {len(missing)} tensor(s) the model needs, e.g. '{missing[0]}'; "
            "is it complete (all shards downloaded)?"
        )
    return ConversionPlan(
        source=source,
        files=files,
        architecture=model_cls.__name__,
        dtype=dtype,
        kbit_config=kbit_config,
        tensors=plans,
        dropped=sorted(planner.dropped),
        locations=locations,
        output_renamings=planner.output_renamings(),
        head_turns=dict(quantizer.head_turns),
    )


def _is_float(dtype: torch.dtype | str) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _bits_of(model: torch.nn.Module, name: str) -> int:
    """Bits the quantizer chose for the weight ``name`` (KbitExperts: per projection)."""
    module_name, _, tensor_name = name.rpartition(".")
    bits = model.get_submodule(module_name).bits
    return bits[tensor_name] if isinstance(bits, dict) else bits


class _DefaultPlanner:
    """Plans checkpoint keys the way ``from_pretrained`` loads them: the model's conversion mapping
    (``transformers.conversion_mapping``: renamings, then at most one converter per key, e.g.
    ``experts.*.gate_proj.weight`` + ``experts.*.up_proj.weight`` -> ``experts.gate_up_proj``), the
    base-model prefix added or stripped, everything else 1:1."""

    def __init__(self, model, ctx: PlanContext, ckpt, ckpt_nbytes: dict[str, int], arch_name: str, dtype):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.model, self.ctx, self.ckpt, self.ckpt_nbytes, self.arch_name = model, ctx, ckpt, ckpt_nbytes, arch_name
        # The same call from_pretrained makes (with the quantizer, which may adjust converters).
        mapping = get_model_conversion_mapping(model, None, model._kbit_quantizer)
        self.renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        self.converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self.tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
        # keep_in_fp32 modules: from_pretrained loads them in float32 whatever the model dtype.
        self.dtype_plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
        if self.dtype_plan:
            from transformers.core_model_loading import build_glob_alternation

            self.dtype_pattern, self.dtype_groups, _ = build_glob_alternation(list(self.dtype_plan))
        self.covered: set[str] = set()  # model keys filled by plans named otherwise (unquantized merges)
        self.dropped: list[str] = []

    def output_renamings(self) -> list:
        return [r.reverse_transform() for r in self.renamings[::-1] if r.was_used()]

    def plan(self) -> list[TensorPlan]:
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        model_tensors = self.ctx.model_tensors
        prefix = getattr(self.model, "base_model_prefix", "")
        by_pattern = {p: c for c in self.converters for p in c.source_patterns}
        plans, merges = [], {}
        # Sorted as the loader sorts them: the order of per-expert tensors in a merge is this order.
        for key in sorted(self.ckpt, key=dot_natural_key):
            name, pattern = rename_source_key(key, self.renamings, self.converters, prefix, model_tensors)
            if name not in model_tensors and key in model_tensors:
                name, pattern = key, None
            if name not in model_tensors or name in self.tied:
                self.dropped.append(key)
            elif pattern is None:
                plans.append(self._plan_one(key, name))
            else:
                converter, keys = merges.setdefault(name, (by_pattern[pattern], {}))
                keys[key] = pattern
        for name, (converter, keys) in merges.items():
            plans += self._plan_merge(name, converter, keys)
        return plans

    def _model_tensor(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and load dtype of the model tensor ``name`` (the skeleton's, or the dtype plan's)."""
        shape, dtype = self.ctx.model_tensors[name]
        if self.dtype_plan:
            match = self.dtype_pattern.search(name)
            if match is not None:
                dtype = self.dtype_plan[self.dtype_groups[match.lastgroup]]
        return shape, dtype

    def _experts_layout(self, name: str) -> ExpertsLayout | None:
        module = self.model.get_submodule(name.rpartition(".")[0])
        return module.layout if isinstance(module, KbitExperts) else None

    def _plan_one(self, key: str, name: str) -> TensorPlan:
        shape, src_dtype = self.ckpt[key]
        want_shape, want_dtype = self._model_tensor(name)
        if shape != want_shape:
            raise ConversionError(
                f"checkpoint tensor '{key}' has shape {shape} but {self.arch_name} expects {want_shape} from "
                "config.json; the checkpoint and config.json do not match"
            )
        bits = self.ctx.quantized.get(name)
        if not _is_float(src_dtype):
            if bits is not None:
                raise ConversionError(
                    f"checkpoint tensor '{key}' is {src_dtype}; kbit quantizes floating-point weights"
                )
            if isinstance(src_dtype, torch.dtype):
                want_dtype = src_dtype  # integer tensors load as they are stored
        experts = self._experts_layout(name) if bits is not None else None
        return TensorPlan(name, (key,), shape, want_dtype, bits, self.ckpt_nbytes[key], experts=experts)

    def _plan_merge(self, name: str, converter, keys: dict[str, str]) -> list[TensorPlan]:
        """Checkpoint tensors ``keys`` ({key: matched source pattern}, in load order) that the
        converter merges into the model tensor ``name``."""
        want_shape, want_dtype = self._model_tensor(name)
        bits = self.ctx.quantized.get(name)
        first = next(iter(keys))
        if len(converter.target_patterns) > 1:  # one checkpoint tensor split into several (e.g. qkv -> q, k, v)
            targets = [name.replace(converter.target_patterns[0], t) for t in converter.target_patterns]
            quantized = [t for t in targets if t in self.ctx.quantized]
            if quantized:
                raise ConversionError(
                    f"transformers splits checkpoint tensor '{first}' into {targets} on load; kbit-convert cannot "
                    f"quantize split tensors such as '{quantized[0]}' yet. Quantize on load instead: "
                    "from_pretrained(..., quantization_config=KbitConfig(...)).save_pretrained(out)"
                )
            self.covered.update(targets)
            return self._plan_as_stored(keys, want_dtype)
        combine = _MergeOps(converter, keys, name, self.model)
        experts = self._experts_layout(name) if bits is not None else None
        expert_sources = None
        if experts is not None:
            expert_sources = _expert_sources(name, converter, keys, self.renamings, experts.num_experts)
        not_float = [k for k in keys if not _is_float(self.ckpt[k][1])]
        if not_float and bits is not None:
            raise ConversionError(
                f"checkpoint tensor '{not_float[0]}' is {self.ckpt[not_float[0]][1]}; "
                "kbit quantizes floating-point weights"
            )
        try:  # the merge on meta tensors: its shape, with no data read
            meta = {k: torch.empty(self.ckpt[k][0], dtype=want_dtype, device="meta") for k in keys}
            shape = tuple(combine(meta).shape)
        except (RuntimeError, ValueError, IndexError) as e:
            raise ConversionError(
                f"{len(keys)} checkpoint tensors (e.g. '{first}') should merge into '{name}' "
                f"({converter.source_patterns} -> {converter.target_patterns}) but cannot: {e}"
            ) from None
        if shape != want_shape:
            counts = {p: sum(1 for v in keys.values() if v == p) for p in dict.fromkeys(keys.values())}
            raise ConversionError(
                f"checkpoint tensors {counts} (e.g. '{first}') merge into '{name}' with shape {shape}, but "
                f"{self.arch_name} expects {want_shape} from config.json; the checkpoint and config.json do not match "
                "(missing or extra experts?)"
            )
        if bits is None:
            self.covered.add(name)
            return self._plan_as_stored(keys, want_dtype)
        sources = tuple(k for group in expert_sources for k in group) if expert_sources else tuple(keys)
        nbytes = sum(self.ckpt_nbytes[k] for k in keys)
        return [TensorPlan(name, sources, want_shape, want_dtype, bits, nbytes, combine, experts, expert_sources)]


    def _plan_as_stored(self, keys: dict[str, str], dtype: torch.dtype) -> list[TensorPlan]:
        """Unquantized tensors that a converter makes from ``keys``: written as stored, one output
        tensor per checkpoint tensor (in ``dtype``). Loading converts them again; this is what
        save_pretrained writes for them."""
        from transformers.core_model_loading import rename_source_key

        plans = []
        for key in keys:
            renamed, _ = rename_source_key(key, self.renamings, [])
            shape, src_dtype = self.ckpt[key]
            stored = src_dtype if isinstance(src_dtype, torch.dtype) and not src_dtype.is_floating_point else dtype
            plans.append(TensorPlan(renamed, (key,), shape, stored, None, self.ckpt_nbytes[key]))
        return plans


class _MergeOps:
    """``combine`` of a merge: the converter's own operations (transformers' MergeModulelist,
    Concatenate, ...) applied to ``{key: tensor}`` grouped by matched source pattern, exactly as
    ``WeightConverter.convert`` does while loading."""

    def __init__(self, converter, patterns: dict[str, str], name: str, model):
        self.converter, self.patterns, self.name, self.model = converter, patterns, name, model

    def __call__(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        collected: dict[str, list[torch.Tensor]] = {}
        for key in list(tensors):
            collected.setdefault(self.patterns[key], []).append(tensors.pop(key))
        for op in self.converter.operations:
            collected = op.convert(
                collected,
                source_patterns=self.converter.source_patterns,
                target_patterns=self.converter.target_patterns,
                full_layer_name=self.name,
                model=self.model,
                config=self.model.config,
                missing_keys=None,
            )
        if len(collected) != 1:
            raise ValueError(f"the merge gives {len(collected)} tensors ({sorted(collected)}), expected one")
        value = next(iter(collected.values()))
        return value[0] if isinstance(value, list) else value


def _expert_sources(
    name: str, converter, keys: dict[str, str], renamings, num_experts: int
) -> tuple[tuple[str, ...], ...] | None:
    """The checkpoint keys of each expert of the fused experts tensor ``name``, when the merge can be
    done a few experts at a time (the experts stacked on dim 0, then only concatenations along
    later dims: rows e0..e1 of the result come from experts e0..e1 alone), else ``None``.

    First checks that each merged source pattern holds experts ``0..num_experts-1`` once each
    (the loader stacks them in key order, so a gap would shift every later expert)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, rename_source_key

    by_pattern: dict[str, list[str]] = {}
    for key, pattern in keys.items():
        by_pattern.setdefault(pattern, []).append(key)
    module = name.rpartition(".")[0] + "."
    for pattern, pattern_keys in by_pattern.items():
        ids = []
        for key in pattern_keys:
            renamed, _ = rename_source_key(key, renamings, [])
            head = renamed[len(module) :].partition(".")[0] if renamed.startswith(module) else ""
            ids.append(int(head) if head.isdigit() else None)
        if None in ids or ids == list(range(num_experts)):
            continue
        missing = sorted(set(range(num_experts)) - set(ids))
        extra = sorted({i for i in ids if not 0 <= i < num_experts} | {i for i in ids if ids.count(i) > 1})
        raise ConversionError(
            f"'{name}' merges {num_experts} experts (config.json), but the checkpoint's '{pattern}' tensors "
            f"(e.g. '{pattern_keys[0]}') lack expert(s) {missing} and have unexpected or repeated expert(s) {extra}; "
            "is the checkpoint complete?"
        )
    ops = converter.operations
    streams = (
        isinstance(ops[0], MergeModulelist)
        and ops[0].dim == 0
        and all(isinstance(op, Concatenate) and op.dim >= 1 for op in ops[1:])
        and all(len(v) == num_experts for v in by_pattern.values())
    )
    return tuple(zip(*by_pattern.values())) if streams else None


def _resolve_dtype(dtype, hf_config, ckpt) -> torch.dtype:
    """The dtype from_pretrained would load in: explicit, else config.json's, else the checkpoint's."""
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ConversionError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
        dtype = DTYPES[dtype]
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConversionError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
        return dtype
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = DTYPES.get(cfg_dtype)
    if cfg_dtype in DTYPES.values():
        return cfg_dtype
    for _, t in ckpt.values():
        if isinstance(t, torch.dtype) and t in DTYPES.values():
            return t
    return torch.float32


def _skeleton(model_cls, hf_config, dtype: torch.dtype, kbit_config: KbitConfig) -> torch.nn.Module:
    """The model on the meta device, with the quantizer's module replacement applied."""
    from ..quantizer import KbitHfQuantizer

    with torch.device("meta"):
        model = model_cls._from_config(hf_config, dtype=dtype)
    planned = kbit_config
    if kbit_config.calibrates:  # the same modules are quantized, only later (after loading): plan them as such
        planned = KbitConfig.from_dict({k: v for k, v in kbit_config.to_dict().items() if k != "calibration"})
        planned.head_rotation = head_rotation.resolve(kbit_config, model)  # as calibrating, not data-free
        planned.block_offsets = kbit_config.resolved_block_offsets()
    quantizer = KbitHfQuantizer(planned)
    quantizer.pre_quantized = False
    quantizer._process_model_before_weight_loading(model)
    model._kbit_quantizer = quantizer
    return model


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent tensors of ``model`` as ``from_pretrained`` loads them (quantize placeholders included,
    packed buffers excluded: those are produced, not loaded)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    for name, module in model.named_modules():
        packed = set(module.packed_shapes()) if hasattr(module, "packed_shapes") else set()
        for bname, buf in module.named_buffers(recurse=False):
            if buf is not None and bname not in module._non_persistent_buffers_set and bname not in packed:
                tensors[f"{name}.{bname}" if name else bname] = buf
    return tensors
