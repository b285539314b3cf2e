"""Checkpoint conversion: a Hugging Face model (folder, Hub repo or GGUF file) -> a kbit checkpoint.

The conversion streams: one planned output tensor is read, quantized and added to the current
output shard at a time, so only its sources and one output shard are in memory. Which weights
are quantized, and with how many bits, is decided by the quantizer itself
(:class:`~hf_kbit.quantizer.KbitHfQuantizer`) applied to the model's skeleton on the meta device;
checkpoint keys are mapped onto the model with transformers' own conversion mapping (renamings,
and the merge of per-expert MoE keys into fused ``experts.gate_up_proj`` / ``down_proj``), so the
output is bit-identical to quantize-on-load
(``from_pretrained(src, quantization_config=cfg).save_pretrained(out)``) with the same config.
Fused MoE expert tensors are built and quantized a few experts at a time.

Output is written into a hidden temporary folder next to ``out`` and renamed into place only
when complete (:mod:`hf_kbit._paths`: the rename never replaces what it was not asked to);
``config.json`` is the last file written there, so an interrupted run never leaves a folder that
looks loadable.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shlex
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from . import checkpoint
from . import format as fmt
from ._paths import (  # noqa: F401 -- ConversionError, OutputConflictError and check_output are public here
    ConversionError,
    OutputConflictError,
    OutputTarget,
    check_output,
    extra_files,
    publish,
    refuse_protected,
    scratch_dir,
    source_file,
    source_paths,
    temp_output,
    weight_files,
)
from .config import KbitConfig
from .hub import format_bytes
from .nn.experts import PROJECTIONS as EXPERT_PROJECTIONS
from .nn.experts import ExpertsLayout, KbitExperts
from .nn.linear import FORMAT_TENSORS

# Files copied verbatim from the source folder (tokenizer, generation and chat-template files).
COPIED_FILE_PATTERNS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
# What is fetched from a Hub repo: weights, configs, tokenizer files.
HUB_ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.model", "*.txt", "*.jinja"]
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
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_GGUF_SCRATCH = ".gguf-source"  # inside the hidden output folder: the dequantized GGUF model, removed before the rename

# A few sentences of plain English for `--eval` when no text file is given. Written for this
# project; the card says the check is a smoke test on this text, not a benchmark.
DEFAULT_EVAL_TEXT = (
    "The river runs past the old mill and under a stone bridge before it reaches the town. "
    "In the spring, the water rises and the fields along the banks turn green. Farmers plant "
    "wheat and barley, and children walk to school along the path beside the river. The town "
    "has a market on Saturdays, where people sell bread, cheese, apples and honey. In the "
    "evening, the lights of the houses shine on the water, and the sound of the mill wheel "
    "can be heard from the square. Travellers who stop at the inn are told that the bridge "
    "is older than the church, and that the mill has ground flour for more than three hundred "
    "years. Most of them do not believe it, but they enjoy the story all the same."
)


class OutputWriteError(OSError):
    """Writing the output failed (e.g. the disk is full); the partial output was removed."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


# ---------------------------------------------------------------------------- plan


@dataclass
class TensorPlan:
    """One tensor of the output model and the checkpoint tensors it is made from.

    ``sources`` are checkpoint keys; ``combine`` turns ``{source key: tensor}`` (in ``sources``
    order; it may consume the dict) into the one model tensor (``None``: the single source as
    is). Per-expert checkpoint keys merged into a fused experts tensor are planned this way,
    with transformers' own conversion-mapping operations as ``combine``.

    A fused MoE experts weight (``experts`` set: ``<experts module>.gate_up_proj`` or
    ``.down_proj``, shape ``[E, ...]``) is built and quantized a few experts at a time when
    ``expert_sources`` lists each expert's sources (``combine`` applied to the sources of
    experts ``e0..e1`` gives rows ``e0..e1``), or when its single source is already fused (read
    by slices); otherwise it is built whole.
    """

    name: str  # model state-dict key (a quantized weight: "<module>.weight" or "<experts>.gate_up_proj")
    sources: tuple[str, ...]
    shape: tuple[int, ...]  # shape of the combined tensor
    dtype: torch.dtype  # dtype it is cast to (before quantization, or for storage)
    bits: int | None = None  # None: stored unquantized
    source_nbytes: int = 0
    combine: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
    experts: ExpertsLayout | None = None  # the KbitExperts layout when this is a fused experts weight
    expert_sources: tuple[tuple[str, ...], ...] | None = None  # the sources of each expert, expert-major

    @property
    def prefix(self) -> str:
        return self.name.rpartition(".")[0]

    def outputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{output key: (shape, dtype)}`` this tensor becomes (model naming)."""
        if self.bits is None:
            return {self.name: (self.shape, self.dtype)}
        if self.experts is not None:  # KbitExperts buffers: "<experts>.gate_up_planes", ... (docs/moe.md)
            projection = self.name.rpartition(".")[2]
            n, k = self.experts.linear_shape(projection)
            shapes = fmt.packed_shapes(n, k, self.bits)
            lead = (self.experts.num_experts,)
            return {
                f"{self.prefix}.{EXPERT_PROJECTIONS[projection]}_{t}": (
                    shapes[t] if t == "codebook" else (*lead, *shapes[t]),
                    fmt.PACKED_DTYPES[t],
                )
                for t in FORMAT_TENSORS
            }
        *lead, n, k = self.shape
        shapes = fmt.packed_shapes(n, k, self.bits)
        return {f"{self.prefix}.{t}": ((*lead, *shapes[t]), fmt.PACKED_DTYPES[t]) for t in FORMAT_TENSORS}

    def output_nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.outputs().values())


# A key rule claims checkpoint keys before the default rule (transformers' conversion mapping,
# then 1:1): it receives the checkpoint's {key: (shape, dtype)} not yet claimed, the meta
# skeleton and the planning context, and returns TensorPlans for the keys it handles.
KeyRule = Callable[[dict[str, tuple[tuple[int, ...], torch.dtype]], torch.nn.Module, "PlanContext"], list[TensorPlan]]


@dataclass
class PlanContext:
    """What a key rule needs to plan a tensor like the default rule does."""

    quantized: dict[str, int]  # model key of each weight the quantizer would quantize -> bits
    model_tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]  # model key -> (shape, dtype)


@dataclass
class ConversionPlan:
    """Everything a conversion will do, known before any tensor data is read."""

    source: Path
    files: list[Path]
    architecture: str
    dtype: torch.dtype
    kbit_config: KbitConfig
    tensors: list[TensorPlan]
    dropped: list[str] = field(default_factory=list)  # checkpoint keys not written (tied or unused)
    locations: dict[str, tuple[int, int]] = field(default_factory=dict)  # checkpoint key -> (file index, offset)
    # transformers' renamings that matched the checkpoint, reversed: output keys follow the
    # checkpoint's naming, as save_pretrained does after from_pretrained (Mixtral: .block_sparse_moe.)
    output_renamings: list[Any] = field(default_factory=list)

    @property
    def quantized(self) -> list[TensorPlan]:
        return [t for t in self.tensors if t.bits is not None]

    def output_key(self, key: str) -> str:
        """The name ``key`` (model naming) is saved under."""
        for renaming in self.output_renamings:
            key, _ = renaming.rename_source_key(key)
        return key

    def stats(self) -> dict[str, Any]:
        """Sizes and bits per weight of the planned output (exact: computed from the format's shapes)."""
        q = self.quantized
        q_numel = sum(math.prod(t.shape) for t in q)
        q_nbytes = sum(t.output_nbytes() for t in q)
        bits_hist: dict[int, int] = {}
        for t in q:
            bits_hist[t.bits] = bits_hist.get(t.bits, 0) + 1
        experts = [t for t in q if t.experts is not None]
        return {
            "architecture": self.architecture,
            "dtype": str(self.dtype).removeprefix("torch."),
            "tensors": len(self.tensors),
            "quantized_tensors": len(q),
            "quantized_by_bits": dict(sorted(bits_hist.items())),
            "quantized_expert_tensors": len(experts),  # fused [E, N, K] expert weights among quantized_tensors
            "quantized_expert_params": sum(math.prod(t.shape) for t in experts),
            "quantized_params": q_numel,
            "total_params": sum(math.prod(t.shape) for t in self.tensors),
            "size_before_bytes": sum(t.source_nbytes for t in self.tensors),
            "size_after_bytes": sum(t.output_nbytes() for t in self.tensors),
            "bits_per_quantized_weight": 8 * q_nbytes / q_numel if q_numel else None,
        }

    def describe(self) -> str:
        """A human-readable summary (what ``--dry-run`` prints)."""
        s = self.stats()
        lines = [
            f"source:        {self.source}",
            f"architecture:  {s['architecture']} (dtype {s['dtype']})",
            f"quantized:     {s['quantized_tensors']} of {s['tensors']} tensors, "
            + ", ".join(f"{n} at {b} bits" for b, n in s["quantized_by_bits"].items()),
        ]
        if s["quantized_expert_tensors"]:
            experts = {t.experts.num_experts for t in self.quantized if t.experts is not None}
            lines.append(
                f"MoE experts:   {s['quantized_expert_tensors']} quantized tensors are fused expert weights "
                f"({'/'.join(map(str, sorted(experts)))} experts each, "
                f"{s['quantized_expert_params'] / s['quantized_params']:.1%} of the quantized weights)"
            )
        lines.append(
            f"size:          {format_bytes(s['size_before_bytes'])} -> {format_bytes(s['size_after_bytes'])}"
        )
        if s["bits_per_quantized_weight"] is not None:
            bpw_all = 8 * s["size_after_bytes"] / s["total_params"]
            lines.append(
                f"bits/weight:   {s['bits_per_quantized_weight']:.3f} (quantized weights, scales included), "
                f"{bpw_all:.3f} (all parameters)"
            )
        if self.dropped:
            lines.append(
                f"not written:   {len(self.dropped)} checkpoint tensor(s) (tied or unused), e.g. {self.dropped[0]}"
            )
        return "\n".join(lines)


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


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _load_architecture(source: Path):
    import transformers

    if not (source / "config.json").is_file():
        raise ConversionError(f"{source} is not a model folder: it has no config.json")
    path = source_file(source, "config.json", "the model folder")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ConversionError(f"{path} is not valid JSON ({e}); fix or download it again") from None
    if not isinstance(raw, dict):
        raise ConversionError(f"{path} holds a JSON {type(raw).__name__}, expected an object; fix or download it again")
    try:
        # Never run code from the model folder; without False transformers may ask on the terminal.
        hf_config = transformers.AutoConfig.from_pretrained(source, trust_remote_code=False)
    except ValueError as e:
        if "auto_map" in raw and "trust_remote_code" in str(e):
            raise ConversionError(
                f"{path} needs custom code (auto_map: {raw['auto_map']}) for model_type {raw.get('model_type')!r}, "
                "which transformers does not implement; kbit-convert never runs code from a model folder"
            ) from None
        raise ConversionError(
            f"unsupported architecture in {path}: transformers {transformers.__version__} cannot read it "
            f"({_first_line(e)}). Upgrade transformers or check model_type."
        ) from None
    except Exception as e:  # noqa: BLE001 -- a field of the wrong type or value; the message names it
        raise ConversionError(
            f"{path}: transformers cannot read it ({type(e).__name__}: {' '.join(str(e).split())})"
        ) from None
    if getattr(hf_config, "quantization_config", None):
        method = _get(hf_config.quantization_config, "quant_method")
        raise ConversionError(
            f"{source} is already quantized (quant_method={method!r}); convert the full-precision model instead"
        )
    archs = getattr(hf_config, "architectures", None) or []
    model_cls = getattr(transformers, archs[0], None) if archs and isinstance(archs[0], str) else None
    if model_cls is not None and not (
        isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel)
    ):
        raise ConversionError(
            f"{path}: architectures names {archs[0]!r}, which is not a transformers model class; fix architectures"
        )
    if model_cls is None:
        try:
            model_cls = transformers.AutoModelForCausalLM._model_mapping[type(hf_config)]
        except KeyError:
            raise ConversionError(
                f"unsupported architecture {archs or hf_config.model_type!r}: transformers "
                f"{transformers.__version__} has no model class for it"
            ) from None
    return hf_config, model_cls


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


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
    from .quantizer import KbitHfQuantizer

    with torch.device("meta"):
        model = model_cls._from_config(hf_config, dtype=dtype)
    quantizer = KbitHfQuantizer(kbit_config)
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


# ---------------------------------------------------------------------------- sources


def resolve_source(
    model: str | os.PathLike, workdir: Path, revision: str | None = None
) -> tuple[Path, dict[str, Any]]:
    """A local model folder for ``model`` (folder, ``.gguf`` file or Hub repo id) and facts for the card.

    A GGUF file is dequantized into ``workdir`` (created; the caller removes it)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ConversionError(f"revision={revision!r} applies to Hub repos; {model} is a local folder")
        return path, {"kind": "folder", "name": path.resolve().name}
    if path.is_file() and path.suffix == ".gguf":
        return _dequantize_gguf(path, workdir), {"kind": "gguf", "name": path.name, "gguf_bytes": path.stat().st_size}
    if path.exists():
        raise ConversionError(
            f"{model} is a file but not a .gguf file; pass a model folder, a .gguf file or a Hub repo id"
        )
    if not _REPO_ID.match(str(model)):
        raise ConversionError(f"{model}: no such folder or file (and not a Hub repo id of the form 'org/name')")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(str(model))
    except HFValidationError as e:
        raise ConversionError(f"{model}: no such folder or file, and not a valid Hub repo id ({e})") from None
    return _download(str(model), revision), {"kind": "hub", "name": str(model), "revision": revision}


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    from .hub import redact

    endpoint = redact(constants.ENDPOINT)
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS))
    except RevisionNotFoundError:
        raise ConversionError(f"{repo_id}: revision {revision!r} not found on {endpoint}") from None
    except RepositoryNotFoundError:
        raise ConversionError(
            f"{repo_id}: not a local folder, and no such repo on {endpoint} (or it is private/gated: "
            "log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ConversionError(
            f"{repo_id}: not a local folder, and {endpoint} could not be reached "
            f"({type(e).__name__}). Check the network or HF_ENDPOINT, or pass a local folder."
        ) from None
    except ValueError as e:  # huggingface_hub refuses a file name of the repo (e.g. one with '..')
        raise ConversionError(
            f"{repo_id} on {endpoint}: huggingface_hub refuses to download it ({redact(_first_line(e))})"
        ) from None


def _dequantize_gguf(path: Path, workdir: Path) -> Path:
    """GGUF -> a plain Hugging Face folder (hf_kbit.gguf; the whole model is in memory meanwhile)."""
    from .gguf import save_gguf_as_folder

    try:
        return save_gguf_as_folder(path, workdir / "gguf-dequantized")
    except ImportError as e:
        raise ConversionError(f"reading GGUF needs the gguf package: `pip install gguf` ({e})") from None
    except (ValueError, KeyError, RuntimeError) as e:
        raise ConversionError(f"{path}: transformers cannot load this GGUF file ({e})") from None


# ---------------------------------------------------------------------------- convert


@dataclass
class ConversionResult:
    out: Path
    plan: ConversionPlan
    stats: dict[str, Any]  # measured on the written files
    eval: dict[str, Any] | None = None
    repo_url: str | None = None


def convert(
    model: str | os.PathLike,
    out: str | os.PathLike,
    quantization_config: KbitConfig | None = None,
    *,
    revision: str | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    dry_run: bool = False,
    eval: bool = False,
    eval_text: str | None = None,
    eval_max_tokens: int = 512,
    base_model: str | None = None,
    repo_id: str | None = None,
    command: str | None = None,
    key_rules: Sequence[KeyRule] = (),
    progress: bool = True,
) -> ConversionResult | ConversionPlan:
    """Convert ``model`` (a folder, a ``.gguf`` file or a Hub repo id) into a kbit checkpoint at ``out``.

    Args:
        quantization_config: the :class:`KbitConfig` (default: 4 bits).
        revision: branch, tag or commit of a Hub repo.
        dtype: dtype of unquantized tensors and of weights before quantization;
            ``None``/``"auto"`` does what ``from_pretrained`` does (config.json's dtype).
        device: where to quantize (default: ``"cuda"`` when available, else ``"cpu"``).
        max_shard_size: output shard size limit (bytes or a string like ``"5GB"``).
        overwrite: replace a non-empty ``out`` (only once the new output is complete).
        dry_run: plan only; returns the :class:`ConversionPlan` and writes nothing.
        eval: measure perplexity of the source and the converted model on ``eval_text``
            (default: a short built-in passage) and record it in the model card.
        base_model: Hub repo id recorded as the card's ``base_model`` (default: the input
            when it is a repo id).
        repo_id: the Hub repo the output will be pushed to (for the card's usage snippet).
        command: the command line recorded in the card (the CLI passes its own).
        key_rules: extra planning rules claiming checkpoint keys (see :data:`KeyRule`).
    """
    from . import hub

    kbit_config = quantization_config or KbitConfig()
    if not isinstance(kbit_config, KbitConfig):
        raise TypeError(f"quantization_config must be a KbitConfig, got {type(kbit_config).__name__}")
    out = Path(out).expanduser()
    shard_bytes = parse_size(max_shard_size)
    device = _resolve_device(device)
    if eval_text is not None and not eval_text.strip():
        raise ConversionError("eval_text is empty")
    if dry_run:
        scratch = scratch_dir()  # a GGUF input is dequantized here; a dry run writes nothing beside out
        try:
            source, _ = resolve_source(model, scratch, revision)
            return plan_conversion(source, kbit_config, dtype, key_rules)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    target = check_output(out, overwrite, source_paths(model))
    tmp = temp_output(target)
    plan = None
    try:
        source, source_info = resolve_source(model, tmp / _GGUF_SCRATCH, revision)
        refuse_protected(out, target.path, [source])  # a Hub snapshot's place is known only now
        if source_info["kind"] == "hub" and base_model is None:
            base_model = source_info["name"]
        plan = plan_conversion(source, kbit_config, dtype, key_rules)
        extras = extra_files(source, COPIED_FILE_PATTERNS)  # checked before the long part
        stats = _write(plan, tmp, device, shard_bytes, progress)
        for f in extras:
            shutil.copy2(f, tmp / f.name)
        eval_result = None
        if eval:
            eval_result = measure_perplexity(
                source, tmp, output_config(source, plan), plan.dtype, eval_text, eval_max_tokens, device
            )
        card = hub.render_card(
            plan=plan,
            stats=stats,
            source_info=source_info,
            base_model=base_model,
            command=command or _python_call(model, out, kbit_config),
            eval=eval_result,
            repo_id=repo_id,
        )
        card.save(tmp / "README.md")
        config = output_config(source, plan)
        shutil.rmtree(tmp / _GGUF_SCRATCH, ignore_errors=True)
        _write_config(tmp, config)  # last: its presence marks a complete checkpoint
        publish(tmp, target)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(e, target, plan) from None
        raise
    return ConversionResult(out=out, plan=plan, stats=stats, eval=eval_result)


def _disk_full(e: OSError, target: OutputTarget, plan: ConversionPlan | None) -> OutputWriteError:
    what = "no space left" if e.errno == errno.ENOSPC else "disk quota exceeded"
    need = f"; the output needs about {format_bytes(plan.stats()['size_after_bytes'])}" if plan is not None else ""
    try:
        free = f", {format_bytes(shutil.disk_usage(target.path.parent).free)} is free there"
    except OSError:
        free = ""
    return OutputWriteError(
        e.errno,
        f"{what} on the device of {target.path.parent} while writing out={target.path}{need}{free}; the partial "
        "output was removed. Free some space or pass another --out",
    )


def parse_size(size: int | str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or an int number of bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
        if not m:
            raise ConversionError(f"max_shard_size must be bytes or like '5GB'/'500MB', got {size!r}")
        unit = (m.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        value = int(float(m.group(1)) * base ** "BKMGT".index(unit[0]))
    if value <= 0:
        raise ConversionError(f"max_shard_size must be positive, got {size!r}")
    return value


def _resolve_device(device) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConversionError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConversionError(f"device={device} requested but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConversionError(f"device must be cpu or cuda, got {device}")
    return device


class _ShardWriter:
    """Writes output tensors into shards of at most ``max_bytes`` (a single bigger tensor gets its own)."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.max_bytes:
            self.flush()
        self.current[key] = tensor.contiguous()
        self.current_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        if not self.current:
            return
        name = f"part-{len(self.shards):05d}.safetensors"
        try:
            save_file(self.current, self.folder / name, metadata={"format": "pt"})
        except SafetensorError as e:  # an I/O error as text, "... (os error 28)": raise it as the OSError it is
            code = re.search(r"\(os error (\d+)\)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(self.folder / name)) from e
        self.shards.append((name, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def finish(self) -> list[str]:
        """Rename shards to transformers' names and write the index when there are several."""
        self.flush()
        n = len(self.shards)
        weight_map, names = {}, []
        for i, (tmp_name, keys) in enumerate(self.shards):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / tmp_name).rename(self.folder / name)
            names.append(name)
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


# Fused experts are built and quantized this many weight elements (whole experts) at a time:
# with the ~20 B/element temporaries of the quantizer that is ~1.3 GB, whatever the model size.
_EXPERT_CHUNK_ELEMENTS = 1 << 26


class _SourceReader:
    """Reads checkpoint tensors (or row ranges of them) from the source shards, each opened once."""

    def __init__(self, plan: ConversionPlan, stack: contextlib.ExitStack):
        self.plan, self.stack, self.handles = plan, stack, {}

    def _handle(self, key: str):
        from safetensors import safe_open

        index = self.plan.locations[key][0]
        if index not in self.handles:
            handle = safe_open(self.plan.files[index], framework="pt", device="cpu")
            self.handles[index] = self.stack.enter_context(handle)
        return self.handles[index]

    def get(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        from safetensors import SafetensorError

        try:
            if rows is None:
                return self._handle(key).get_tensor(key)
            return self._handle(key).get_slice(key)[rows[0] : rows[1]]
        except (SafetensorError, OSError, RuntimeError) as e:
            path = self.plan.files[self.plan.locations[key][0]]
            raise ConversionError(
                f"cannot read tensor '{key}' from {path} ({type(e).__name__}: {_first_line(e)}); the file is damaged "
                "or was changed during the conversion: download or save it again"
            ) from None

    def tensor(self, p: TensorPlan, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``p``'s tensor in ``p.dtype`` (``rows``: only experts ``rows[0]..rows[1]`` of a fused experts
        tensor, see :func:`_expert_chunk`). Sources are cast one by one, as the loader casts them."""
        if rows is not None and p.expert_sources is not None:
            keys = [k for group in p.expert_sources[rows[0] : rows[1]] for k in group]
            return p.combine({k: self.get(k).to(p.dtype) for k in keys})
        if rows is not None:
            return self.get(p.sources[0], rows).to(p.dtype)
        if p.combine is None:
            return self.get(p.sources[0]).to(p.dtype)
        return p.combine({k: self.get(k).to(p.dtype) for k in p.sources}).to(p.dtype)


def _sources_of(plan: ConversionPlan, p: TensorPlan) -> str:
    """Where ``p`` comes from, for errors: its checkpoint tensor(s) and file(s)."""
    files = sorted({plan.files[plan.locations[k][0]].name for k in p.sources})
    keys = f"checkpoint tensor '{p.sources[0]}'" + (f" and {len(p.sources) - 1} more" if len(p.sources) > 1 else "")
    return f"{keys} in {', '.join(files)}"


def _expert_chunk(p: TensorPlan) -> int:
    """Experts built and quantized at once for the fused experts plan ``p`` (all of them when its
    merge cannot be split by experts)."""
    num_experts = p.shape[0]
    if p.expert_sources is None and (p.combine is not None or len(p.sources) != 1):
        return num_experts
    return max(1, min(num_experts, _EXPERT_CHUNK_ELEMENTS // max(math.prod(p.shape[1:]), 1)))


@torch.no_grad()
def _write(plan: ConversionPlan, folder: Path, device: torch.device, shard_bytes: int, progress: bool) -> dict:
    """Read the sources of one planned tensor at a time (a fused experts tensor a few experts at a
    time), quantize, and write kbit output shards; returns sizes measured on what was written."""
    from tqdm.auto import tqdm

    from .nn.linear import quantize_weight

    writer = _ShardWriter(folder, shard_bytes)
    codebooks = {}
    q_numel = q_bytes = 0
    # In the order the source shards hold the tensors (a plan comes when its last source is reached).
    order = sorted(plan.tensors, key=lambda p: max(plan.locations[k] for k in p.sources))
    bar = tqdm(total=len(order), desc="Converting", unit="tensor", disable=not progress)
    with contextlib.ExitStack() as stack:
        reader = _SourceReader(plan, stack)
        for p in order:
            if p.bits is None:
                writer.add(plan.output_key(p.name), reader.tensor(p))
                bar.update(1)
                continue
            if p.bits not in codebooks:
                codebooks[p.bits] = fmt.make_codebook(plan.kbit_config.codebook, p.bits)
            codebook = codebooks[p.bits]
            try:
                if p.experts is None:
                    tensor = reader.tensor(p)
                    packed = quantize_weight(tensor.to(device), codebook.to(device), name=p.name)
                    outputs = dict(zip(p.outputs(), (*(t.cpu() for t in packed), codebook.clone())))
                    del tensor, packed
                else:
                    outputs = _quantize_experts(p, reader, codebook, device)
            except ConversionError:
                raise
            except (ValueError, TypeError) as e:  # quantize_weight's checks (NaN/Inf, ...) name the model tensor
                raise ConversionError(f"{e} ({_sources_of(plan, p)}); fix the source weights, or keep "
                                      f"'{p.prefix}' in full precision with --skip-modules") from None
            for key, t in outputs.items():
                writer.add(plan.output_key(key), t)
                q_bytes += t.numel() * t.element_size()
            q_numel += math.prod(p.shape)
            del outputs
            bar.update(1)
    bar.close()
    shards = writer.finish()
    return {
        **plan.stats(),
        "size_after_bytes": writer.total_bytes,
        "files_bytes_after": sum((folder / s).stat().st_size for s in shards),
        "bits_per_quantized_weight": 8 * q_bytes / q_numel if q_numel else None,
        "shards": len(shards),
    }


def _quantize_experts(p: TensorPlan, reader: _SourceReader, codebook: torch.Tensor, device) -> dict[str, torch.Tensor]:
    """The packed tensors of the fused experts weight ``p``, built a chunk of experts at a time with
    ``KbitExperts.pack`` (what quantize-on-load runs; experts are packed independently)."""
    module_name, _, projection = p.name.rpartition(".")
    outputs = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in p.outputs().items()}
    num_experts, step = p.shape[0], _expert_chunk(p)
    for start in range(0, num_experts, step):
        stop = min(start + step, num_experts)
        rows = None if (start, stop) == (0, num_experts) else (start, stop)
        chunk = reader.tensor(p, rows)
        # A meta KbitExperts of just these experts: pack() checks the chunk's shape against it.
        packer = KbitExperts(replace(p.experts, num_experts=stop - start), device="meta")
        packed = packer.pack(projection, chunk.to(device), codebook.to(device), module_name)
        del chunk
        for name, t in packed.items():
            key = f"{module_name}.{name}"
            if name.endswith("_codebook"):
                outputs[key].copy_(t)
            else:
                outputs[key][start:stop] = t
        del packed
    return outputs


def output_config(source: Path, plan: ConversionPlan) -> dict[str, Any]:
    """The source's config.json with the kbit ``quantization_config`` and the output dtype."""
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = plan.kbit_config.to_dict()
    config["dtype"] = str(plan.dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    return config


def _write_config(folder: Path, config: dict[str, Any]) -> None:
    tmp = folder / "config.json.partial"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.rename(folder / "config.json")


def _python_call(model, out, cfg: KbitConfig) -> str:
    return f"hf_kbit.convert({str(model)!r}, {str(out)!r}, KbitConfig(bits={cfg.bits}))"


def command_line(argv: Sequence[str]) -> str:
    """The command as typed, for the card (argv[0] shortened to the program name)."""
    return shlex.join(["kbit-convert", *argv])


# ---------------------------------------------------------------------------- eval


@torch.no_grad()
def measure_perplexity(
    source: Path,
    converted: Path,
    converted_config: dict[str, Any],
    dtype: torch.dtype,
    text: str | None = None,
    max_tokens: int = 512,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Perplexity of the source and the converted model on ``text`` (one window of ``max_tokens``).

    A smoke check that the conversion kept the model working, not a benchmark. Both models
    are loaded whole here (this step is opt-in). ``converted_config`` is passed explicitly
    because ``converted`` has no config.json yet (it is written last).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name = "built-in passage" if text is None else "user text"
    text = DEFAULT_EVAL_TEXT if text is None else text
    has_tokenizer = (converted / "tokenizer_config.json").is_file() or (converted / "tokenizer.json").is_file()
    tok_dir = converted if has_tokenizer else source
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConversionError(f"--eval needs a tokenizer in the model folder ({e})") from None
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens].to(device)
    if ids.shape[1] < 2:
        raise ConversionError("the eval text has fewer than 2 tokens")
    result = {"text": name, "tokens": int(ids.shape[1]), "dtype": str(dtype).removeprefix("torch.")}
    config_dict = dict(converted_config)
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    for label, folder, kwargs in (("base", source, {}), ("kbit", converted, {"config": config})):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=False, **kwargs)
        model = model.to(device).eval()
        loss = model(ids, labels=ids).loss
        result[f"{label}_perplexity"] = float(torch.exp(loss.float()))
        del model
    return result

