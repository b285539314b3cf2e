"""What a conversion will do, known before any tensor data is read: the planned output tensors
(:class:`TensorPlan`), the whole plan (:class:`ConversionPlan`, what ``--dry-run`` prints) and key rules."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import format as fmt
from ..config import KbitConfig
from ..hub import format_bytes
from ..nn.experts import PROJECTIONS as EXPERT_PROJECTIONS
from ..nn.experts import ExpertsLayout
from ..nn.linear import FORMAT_TENSORS, ROTATION_SIGNS


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
    # Stored rotated for certain (KbitConfig.rotation=True, in_features a multiple of 64): its sign words are an
    # output too. Under "auto" that is known only once quantized (the writer adds them then).
    rotated: bool = False
    # Its block scales are int16 block records (KbitConfig.block_offsets; Linear weights, not fused experts).
    block_offsets: bool = False

    @property
    def prefix(self) -> str:
        return self.name.rpartition(".")[0]

    def in_features(self) -> int:
        """K of the weight (of each expert), whatever the model's layout."""
        if self.experts is not None:
            return self.experts.linear_shape(self.name.rpartition(".")[2])[1]
        return self.shape[-1]

    def signs_key(self) -> str:
        """The output key of this weight's sign words, when it is stored rotated."""
        if self.experts is not None:
            return f"{self.prefix}.{EXPERT_PROJECTIONS[self.name.rpartition('.')[2]]}_{ROTATION_SIGNS}"
        return f"{self.prefix}.{ROTATION_SIGNS}"

    def outputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{output key: (shape, dtype)}`` this tensor becomes (model naming), the sign words last when ``rotated``."""
        if self.bits is None:
            return {self.name: (self.shape, self.dtype)}
        outputs = self._format_outputs()
        if self.rotated:
            outputs[self.signs_key()] = (fmt.rotation_signs_shape(self.in_features()), fmt.ROTATION_SIGNS_DTYPE)
        return outputs

    def _format_outputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
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
        dtypes = fmt.packed_dtypes(self.block_offsets)
        return {f"{self.prefix}.{t}": ((*lead, *shapes[t]), dtypes[t]) for t in FORMAT_TENSORS}

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
    # KbitConfig.head_rotation: parameter name -> (role, head dim) of the v/o tensors turned before writing.
    head_turns: dict[str, tuple[str, int]] = field(default_factory=dict)

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
        rotation = self.kbit_config.rotation
        if rotation is not False:
            eligible = [t for t in self.quantized if fmt.rotatable(t.in_features())]
            how = {True: "every one", "auto": "where it lowers the weight error (auto)",
                   "inputs": "the input projections (not o/down)"}[rotation]
            lines.append(f"rotation:      block Hadamard (block {fmt.ROTATION_BLOCK}, seed "
                         f"{self.kbit_config.rotation_seed}), {how} of {len(eligible)} tensors with in_features a "
                         f"multiple of {fmt.ROTATION_MULTIPLE}")
        record = self.kbit_config.calibration_record() if self.kbit_config.calibrates else None
        if record is not None:
            lines.append(
                f"calibration:   GPTQ-style error feedback on {record['samples']} x {record['seq_len']} = "
                f"{record['tokens']:,} tokens (the model is loaded whole, unquantized, on the device)"
            )
        if self.dropped:
            lines.append(
                f"not written:   {len(self.dropped)} checkpoint tensor(s) (tied or unused), e.g. {self.dropped[0]}"
            )
        return "\n".join(lines)
