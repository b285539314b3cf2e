"""KbitExperts: transformers' fused MoE experts module with its 3-D expert weights stored k-bit.

transformers v5 keeps all routed experts of a layer in one ``*.experts`` module holding
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (gpt_oss: transposed,
``[E, H, 2I]`` / ``[E, I, H]``, gate and up interleaved, with biases) and calls it as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.
Such modules are recognised by those parameters, not by class, and replaced by
:class:`KbitExperts`, which keeps the model's own gating (``_apply_gate``: SwiGLU,
gpt_oss's clamped GLU, ...) and activation by taking them over from the original module.

Nothing here knows about the transformers loading lifecycle; ``hf_kbit.quantizer`` calls
:func:`replace_experts_with_kbit` and :func:`quantize_experts_on_load`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import transformers.activations
from torch import nn

from .. import _ops
from .. import fitting
from .. import format as fmt
from .. import rotation_policy
from ..config import KbitConfig
from .linear import (
    COMPUTE_DTYPES,
    FORMAT_TENSORS,
    ROTATION_SIGNS,
    KbitModule,
    check_weight,
    format_layout,
    quantize_checked,
    rotation_signs_placeholder,
)
from .routing import fuse_routers, unfuse_routers
from .selection import _set_submodule, should_convert, swap_modules

# Fused checkpoint parameter -> prefix of its packed tensors. The packed names must not start
# with the parameter name: transformers' expert converters match ``experts.gate_up_proj*``.
PROJECTIONS = {"gate_up_proj": "gate_up", "down_proj": "down"}
BIASES = ("gate_up_proj_bias", "down_proj_bias")

# Quantize-on-load packs at most this many weight elements at once (the float32 and int64
# temporaries of the reference quantizer are ~20 B per element): rows are independent, so
# chunking over experts gives the same bits and bounds the peak memory.
_QUANTIZE_CHUNK_ELEMENTS = 1 << 26

_MODULE_INTERNALS = frozenset(vars(nn.Module()))


@dataclass(frozen=True)
class ExpertsLayout:
    """Shape facts of a fused experts module, read from its parameters."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    is_transposed: bool  # weights stored [E, in, out] (gpt_oss) rather than Linear's [E, out, in]
    has_bias: bool

    def weight_shape(self, projection: str) -> tuple[int, int, int]:
        """Shape of ``projection`` as the model (and its checkpoint) stores it."""
        n, k = self.linear_shape(projection)
        return (self.num_experts, k, n) if self.is_transposed else (self.num_experts, n, k)

    def linear_shape(self, projection: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of one expert's ``projection``."""
        return linear_shape(projection, self.hidden_size, self.intermediate_size)


def linear_shape(projection: str, hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    """``(out_features, in_features)`` of one expert's ``projection`` in an experts module of these sizes."""
    if projection == "gate_up_proj":
        return 2 * intermediate_size, hidden_size
    return hidden_size, intermediate_size


def fused_experts_layout(module: nn.Module, name: str = "experts") -> ExpertsLayout | None:
    """The layout of ``module`` if it holds fused 3-D expert weights, else ``None``.

    Raises ``ValueError`` naming the module when it has such weights in a layout that cannot
    be read unambiguously, and ``NotImplementedError`` when its gating is unknown.
    """
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return None
    (e, a, b), (e2, c, d) = gate_up.shape, down.shape
    standard = e == e2 and b == c and a == 2 * d  # [E, 2I, H], [E, H, I]
    transposed = e == e2 and a == d and b == 2 * c  # [E, H, 2I], [E, I, H]
    declared = getattr(module, "is_transposed", None)
    if isinstance(declared, bool):
        standard, transposed = standard and not declared, transposed and declared
    if standard == transposed:
        raise ValueError(
            f"{name}: cannot read the expert layout from gate_up_proj {tuple(gate_up.shape)} and down_proj "
            f"{tuple(down.shape)}; expected [E, 2I, H] and [E, H, I] (or transposed: [E, H, 2I] and [E, I, H]). "
            f"Add {name!r} to modules_to_not_convert to keep it unquantized."
        )
    hidden, inter = (b, d) if standard else (a, c)
    layout = ExpertsLayout(e, hidden, inter, transposed, "gate_up_proj_bias" in params or "down_proj_bias" in params)
    expected = {"gate_up_proj", "down_proj"} | (set(BIASES) if layout.has_bias else set())
    if set(params) != expected:
        raise NotImplementedError(
            f"{name}: a fused experts module with parameters {sorted(params)} is not supported by kbit (expected "
            f"{sorted(expected)}); add {name!r} to modules_to_not_convert to keep it unquantized."
        )
    if layout.has_bias:
        for bias, (n, _) in zip(BIASES, (layout.linear_shape(p) for p in PROJECTIONS)):
            if tuple(params[bias].shape) != (e, n):
                raise ValueError(f"{name}.{bias} has shape {tuple(params[bias].shape)}, expected {(e, n)}")
    if getattr(type(module), "_apply_gate", None) is None and not hasattr(module, "act_fn"):
        raise NotImplementedError(
            f"{name}: {type(module).__name__} has neither `_apply_gate` nor `act_fn`, so kbit cannot reproduce its "
            f"gating; add {name!r} to modules_to_not_convert to keep it unquantized."
        )
    return layout


class KbitExperts(KbitModule):
    """All routed experts of one MoE layer, ``gate_up`` and ``down`` weights stored k-bit.

    Made from the model's own experts module (:meth:`from_experts`), whose gating
    (``_apply_gate``), activation (``act_fn``) and other attributes it takes over, so the
    forward is the model's: ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])
    -> [T, H]``. Expert ids outside ``[0, E)`` contribute nothing.

    Buffers (format v1, see ``docs/format.md``; E experts, H = hidden_size, I =
    intermediate_size; weights in Linear layout [out, in] whatever the model's layout, gate/up
    rows in the model's order):
        gate_up_planes: int32 ``[E, ceil(2I/16), ceil(H/128), bits, 16, 4]``.
        gate_up_block_scales: uint8 ``[E, ceil(2I/16), ceil(H/128), 16, 4]``.
        gate_up_row_scales: float32 ``[E, 2I]``.
        gate_up_codebook: float32 ``[2**bits]``.
        down_planes, down_block_scales, down_row_scales, down_codebook: the same for
        ``[E, H, I]``.
        gate_up_rotation_signs: int32 ``[H/32]``, down_rotation_signs: int32 ``[I/32]`` (format v3), for
        a projection stored rotated (``rotated[projection]``): its experts hold ``W R`` and share these
        sign words (they read the same x), which every op call passes as ``signs``. None (no state-dict
        entry) for an unrotated projection.
    Parameters ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]`` (when the model
    has them) keep the model's dtype and names.

    While a model is quantized on load, placeholders ``gate_up_proj`` / ``down_proj`` (meta,
    the model's shape and layout) receive the fused checkpoint tensors, which
    :func:`quantize_experts_on_load` packs and then removes.
    """

    rotated = dict.fromkeys(PROJECTIONS, False)  # per projection; replaced (never changed in place) when it rotates

    def __init__(
        self,
        layout: ExpertsLayout,
        gate_up_bits: int = 4,
        down_bits: int = 4,
        codebook: str | list[float] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        weight_placeholder: bool = False,
        rotated: dict[str, bool] | None = None,
    ):
        super().__init__()
        self.layout = layout
        self.num_experts = layout.num_experts
        self.hidden_size, self.intermediate_size = layout.hidden_size, layout.intermediate_size
        self.bits = {"gate_up_proj": gate_up_bits, "down_proj": down_bits}
        self.rotated = dict.fromkeys(PROJECTIONS, False)
        self._model_apply_gate = None
        for projection, prefix in PROJECTIONS.items():
            bits = self.bits[projection]
            n, k = layout.linear_shape(projection)
            shapes = fmt.packed_shapes(n, k, bits)
            for t in FORMAT_TENSORS:
                lead = () if t == "codebook" else (layout.num_experts,)
                buffer = torch.empty(lead + shapes[t], dtype=fmt.PACKED_DTYPES[t], device=device)
                self.register_buffer(f"{prefix}_{t}", buffer)
            with torch.no_grad():
                setattr(self, f"{prefix}_codebook", fmt.make_codebook(codebook, bits).to(device))
            self.register_buffer(f"{prefix}_{ROTATION_SIGNS}", None)
            if rotated and rotated.get(projection):
                placeholder = rotation_signs_placeholder(k, device, f"KbitExperts.{projection}")
                setattr(self, f"{prefix}_{ROTATION_SIGNS}", placeholder)
            if weight_placeholder:
                placeholder = torch.empty(layout.weight_shape(projection), dtype=dtype, device="meta")
                self.register_parameter(projection, nn.Parameter(placeholder, requires_grad=False))
        for bias, projection in zip(BIASES, PROJECTIONS):
            value = None
            if layout.has_bias:
                value = nn.Parameter(
                    torch.empty(layout.num_experts, layout.linear_shape(projection)[0], dtype=dtype, device=device),
                    requires_grad=False,
                )
            self.register_parameter(bias, value)

    @classmethod
    def from_experts(
        cls,
        experts: nn.Module,
        gate_up_bits: int = 4,
        down_bits: int = 4,
        codebook: str | list[float] | None = None,
        weight_placeholder: bool = False,
        name: str = "experts",
        fitting_rule: str | None = None,
        packed: dict[str, tuple[torch.Tensor, ...]] | None = None,
        rotation: bool | str = False,
        rotation_seed: int = 0,
    ) -> "KbitExperts":
        """A KbitExperts taking over ``experts``' gating, activation and attributes.

        On the meta device (model skeleton) nothing is quantized; otherwise the weights are
        packed now (``codebook``, ``fitting_rule``, ``rotation`` and ``rotation_seed`` as the
        KbitConfig fields), or taken from ``packed`` (``{projection: (planes, block_scales, row_scales,
        codebook[, rotation_signs])}``, e.g. calibrated), and the biases copied.
        """
        layout = fused_experts_layout(experts, name)
        if layout is None:
            raise ValueError(f"{name}: {type(experts).__name__} has no 3-D gate_up_proj / down_proj expert weights")
        weight = experts.gate_up_proj
        module = cls(layout, gate_up_bits, down_bits, codebook, weight.dtype, weight.device, weight_placeholder)
        module._take_over_behaviour(experts)
        if weight.device.type != "meta" and not weight_placeholder:
            with torch.no_grad():
                for projection, prefix in PROJECTIONS.items():
                    if packed is not None:
                        names = (f"{prefix}_{t}" for t in (*FORMAT_TENSORS, ROTATION_SIGNS))
                        tensors = dict(zip(names, packed[projection]))
                    else:
                        tensors = module.pack(projection, getattr(experts, projection), codebook, name, fitting_rule,
                                              rotation, rotation_seed)
                    module.load_packed(projection, **tensors)
                for bias in BIASES if layout.has_bias else ():
                    getattr(module, bias).copy_(getattr(experts, bias))
        return module

    def _take_over_behaviour(self, experts: nn.Module) -> None:
        """Adopt the model's gating function, submodules (act_fn, norms) and plain attributes."""
        for key, value in vars(experts).items():
            if key in _MODULE_INTERNALS or isinstance(value, torch.Tensor) or key in vars(self):
                continue
            setattr(self, key, value)
        for child_name, child in experts.named_children():
            self.add_module(child_name, child)
        self._model_apply_gate = model_gating(type(experts))
        self.source_class = type(experts)

    # ------------------------------------------------------------------ format contract

    def linear_shape(self, projection: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of one expert's ``projection``, from the module's own ints. The forward
        reads these rather than ``layout``'s: dynamo cannot tell that an object such as ``layout`` stays unchanged,
        and one it must check makes every compiled call evaluate this module's guards, where plain ints and dicts
        let it skip them while the module's dicts are unchanged (torch's recursive dict tags)."""
        return linear_shape(projection, self.hidden_size, self.intermediate_size)

    def packed_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each format tensor (the checkpoint contract, see hf_kbit.checkpoint)."""
        return {name: shape for name, (_, shape) in self.format_layout().items()}

    def _set_rotated(self, name: str, rotated: bool) -> None:
        prefix = name[: -len(ROTATION_SIGNS) - 1]
        projection = next((p for p, q in PROJECTIONS.items() if q == prefix), None)
        if projection is not None:
            self.rotated = {**self.rotated, projection: rotated}

    def rotation_in_features(self) -> dict[str, int]:
        return {f"{prefix}_{ROTATION_SIGNS}": self.linear_shape(p)[1] for p, prefix in PROJECTIONS.items()}

    def rotation_signs(self, projection: str) -> torch.Tensor | None:
        """``projection``'s sign words (the buffer ``<prefix>_rotation_signs``), None when it is not rotated."""
        return getattr(self, f"{PROJECTIONS[projection]}_{ROTATION_SIGNS}")

    def placeholders(self) -> list[str]:
        """Full-precision placeholders still waiting for quantize-on-load."""
        return [p for p in PROJECTIONS if p in self._parameters]

    def linear_weight(self, projection: str, value: torch.Tensor, name: str = "experts") -> torch.Tensor:
        """The fused weight of ``projection`` (in the model's shape and layout) as ``[E, out, in]``,
        its shape checked; errors name ``<name>.<projection>``."""
        expected = self.layout.weight_shape(projection)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"{name}.{projection}: the fused expert weight has shape {tuple(value.shape)}, the model expects "
                f"{expected} (num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size})"
            )
        return value.transpose(-1, -2) if self.layout.is_transposed else value

    def pack(
        self,
        projection: str,
        value: torch.Tensor,
        codebook: str | list[float] | torch.Tensor | None = None,
        name: str = "experts",
        fitting_rule: str | None = None,
        rotation: bool | str = False,
        rotation_seed: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Pack the fused weight of ``projection`` (in the model's shape and layout) into
        ``{"<prefix>_planes" | "_block_scales" | "_row_scales" | "_codebook" [| "_rotation_signs"]: tensor}``,
        checking it first; errors name ``<name>.<projection>``.

        ``codebook``, ``fitting_rule``, ``rotation`` and ``rotation_seed`` mean what the KbitConfig fields do;
        the experts share one codebook, fitted on all of them (:func:`hf_kbit.nn.quantize_layer`), and one basis
        (:mod:`hf_kbit.rotation_policy`). A codebook tensor is kept as given: a caller packing the experts in
        pieces passes the whole's (:func:`experts_candidates`, :func:`pack_experts_chunk`).
        """
        full_name = f"{name}.{projection}"
        weight = self.linear_weight(projection, value, name)
        check_weight(weight, full_name)
        bits = self.bits[projection]
        settings = fitting.settings_for(fitting_rule, bits, codebook)
        sample = fitting.codebook_sample(weight, settings)
        candidates = experts_candidates(sample, bits, settings, codebook,
                                        rotation_policy.for_weights(rotation, [full_name]), rotation_seed)
        pack_experts_chunk(weight, candidates, settings)
        return chosen_basis(candidates).packed(PROJECTIONS[projection])

    @torch.no_grad()
    def load_packed(self, projection: str, **packed: torch.Tensor) -> None:
        """Take ``projection``'s packed tensors (from :meth:`pack` or a checkpoint); without
        ``<prefix>_rotation_signs`` the projection is unrotated."""
        prefix = PROJECTIONS[projection]
        device = getattr(self, f"{prefix}_planes").device
        packed.setdefault(f"{prefix}_{ROTATION_SIGNS}", None)
        for key, value in packed.items():
            setattr(self, key, None if value is None else value.to(device))
        self._parameters.pop(projection, None)
        self.pack_storage()

    def format_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        layout = {}
        for projection, prefix in PROJECTIONS.items():
            n, k = self.linear_shape(projection)
            for t, (dtype, shape) in format_layout(n, k, self.bits[projection], self.rotated[projection]).items():
                lead = (self.num_experts,) if t in FORMAT_TENSORS[:3] else ()
                layout[f"{prefix}_{t}"] = (dtype, lead + shape)
        return layout

    # ------------------------------------------------------------------ forward

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The model's gating of ``gate_up [S, 2I] -> [S, I]`` (default: ``act_fn(gate) * up``)."""
        return apply_gate(self, gate_up)

    def _project(self, projection: str, x: torch.Tensor, expert_ids: torch.Tensor, routing,
                 x_repeat: int = 1, up: torch.Tensor | None = None) -> torch.Tensor:
        """``projection`` of each (token, expert) row; ``up`` given, of ``silu(x) * up`` (x the gate half)."""
        prefix = PROJECTIONS[projection]
        names, signs = tuple(f"{prefix}_{t}" for t in FORMAT_TENSORS), None
        if self.rotated[projection]:  # its experts share x, and so the sign words
            *tensors, signs = self.format_tensors((*names, f"{prefix}_{ROTATION_SIGNS}"), x.device)
        else:
            tensors = self.format_tensors(names, x.device)
        in_features, routing = self.linear_shape(projection)[1], routing or (None, None)
        if up is None:
            out = torch.ops.kbit.grouped_mm(x, expert_ids, *tensors, in_features, *routing, signs, x_repeat)
        else:
            out = torch.ops.kbit.grouped_mm_silu_mul(x, up, expert_ids, *tensors, in_features, *routing, signs)
        bias = getattr(self, f"{projection}_bias")
        if bias is not None:
            out = out + bias[expert_ids.clamp(0, self.num_experts - 1)].to(out.dtype)
        return out

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if hidden_states.dtype not in COMPUTE_DTYPES:
            raise TypeError(f"KbitExperts input must be one of {COMPUTE_DTYPES}, got {hidden_states.dtype}")
        num_tokens, top_k = top_k_index.shape
        # S = T * k (token, expert) pairs; pair s is token s // k. The grouped op groups the rows
        # by expert on the device (no host sync, no data-dependent shapes).
        expert_ids = top_k_index.reshape(-1)
        # Many rows: group them by expert once, for both projections (few rows: none needed).
        routing = ()
        if expert_ids.shape[0] > _ops.GROUP_ROWS_ABOVE.get(expert_ids.device.type, 0):
            routing = _ops.expert_offsets(expert_ids, self.num_experts)
        # gate_up reads token s // k for row s itself (x_repeat): no copy of the tokens k times.
        gate_up = self._project("gate_up_proj", hidden_states, expert_ids, routing, top_k)
        if not routing and self._model_apply_gate is None and _is_silu(self.act_fn) and not gate_up.requires_grad:
            # Few rows (decode): transformers' default SiLU gating staged by the down projection itself, one launch
            # less (the grouped GEMV's per-row mode); many rows: the gating's own op, then the grouped mode.
            gate, up = gate_up.chunk(2, dim=-1)
            out = self._project("down_proj", gate, expert_ids, routing, up=up)
        else:
            out = self._project("down_proj", self._apply_gate(gate_up), expert_ids, routing)
        if getattr(self, "has_post_expert_norm", False):
            out = self.post_expert_norm(out)
        # Each token's weighted sum of its k experts (sentinel ids weigh 0), float32 accumulation.
        if out.requires_grad or top_k_weights.requires_grad:  # the op has no backward: its reference's torch ops
            out = _ops._experts_combine_ref(out, expert_ids, top_k_weights, self.num_experts)
        else:
            out = torch.ops.kbit.experts_combine(out, expert_ids, top_k_weights, self.num_experts)
        return out.to(hidden_states.dtype)

    # ------------------------------------------------------------------ back to floats

    @torch.no_grad()
    def dequantize_weight(self, projection: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``projection``'s fused weight in the model's shape and layout."""
        prefix = PROJECTIONS[projection]
        w = torch.ops.kbit.dequantize(
            getattr(self, f"{prefix}_planes"),
            getattr(self, f"{prefix}_block_scales"),
            getattr(self, f"{prefix}_row_scales"),
            getattr(self, f"{prefix}_codebook"),
            self.linear_shape(projection)[1],
            dtype,
            self.rotation_signs(projection),
        )
        return w.transpose(-1, -2).contiguous() if self.layout.is_transposed else w

    def to_experts(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The model's own experts module holding the dequantized weights."""
        if dtype is None:
            dtype = self.gate_up_proj_bias.dtype if self.layout.has_bias else torch.float32
        experts = self.source_class.__new__(self.source_class)
        nn.Module.__init__(experts)
        for key, value in vars(self).items():
            if key in _MODULE_INTERNALS or key in ("layout", "bits", "rotated", "_model_apply_gate", "source_class"):
                continue
            setattr(experts, key, value)
        for child_name, child in self.named_children():
            experts.add_module(child_name, child)
        for projection in PROJECTIONS:
            experts.register_parameter(projection, nn.Parameter(self.dequantize_weight(projection, dtype), False))
        for bias in BIASES if self.layout.has_bias else ():
            experts.register_parameter(bias, nn.Parameter(getattr(self, bias).detach().to(dtype), False))
        return experts

    def extra_repr(self) -> str:
        bits = ", ".join(f"{PROJECTIONS[p]}_bits={b}" for p, b in self.bits.items())
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, {bits}, bias={self.layout.has_bias}"
            + "".join(f", {PROJECTIONS[p]}_rotated=True" for p, r in self.rotated.items() if r)
        )


@dataclass
class Basis:
    """One basis a fused experts projection may be packed in: its sign words (None: unrotated) and codebook, the
    packed chunks so far (``parts``) and, when another basis competes, their :func:`hf_kbit.rotation_policy.error_sums`."""

    words: torch.Tensor | None
    codebook: torch.Tensor
    parts: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    errors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def packed(self, prefix: str) -> dict[str, torch.Tensor]:
        """The projection's packed tensors by buffer name (``<prefix>_planes``, ...), the chunks concatenated."""
        out = {f"{prefix}_{t}": torch.cat(ts) for t, ts in zip(FORMAT_TENSORS, zip(*self.parts))}
        out[f"{prefix}_codebook"] = self.codebook
        if self.words is not None:
            out[f"{prefix}_{ROTATION_SIGNS}"] = self.words
        return out


def experts_candidates(sample: torch.Tensor, bits: int, settings: fitting.FitSettings | None, codebook,
                       rotation: bool | str, rotation_seed: int) -> list[Basis]:
    """The bases a fused experts projection is tried in under ``KbitConfig.rotation`` (unrotated, rotated or both,
    :mod:`hf_kbit.rotation_policy`), each with its codebook fitted on ``sample`` (:func:`hf_kbit.fitting.codebook_sample`
    of the whole projection, ``[R, K]``; rotated rows for the rotated basis)."""
    words = rotation_policy.layer_words(sample.shape[-1], rotation, rotation_seed, sample.device)
    bases = [None] if words is None else [words] if rotation is True else [None, words]
    return [Basis(w, fitting.layer_codebook(sample if w is None else rotation_policy.rotate_weight(sample, w), bits,
                                            settings, codebook)) for w in bases]


def pack_experts_chunk(weight: torch.Tensor, candidates: list[Basis], settings: fitting.FitSettings | None) -> None:
    """Pack experts ``weight [e, N, K]`` (Linear layout, checked) in every candidate basis, appending to their
    ``parts``; with several, measure each basis's error per expert. At most ``_QUANTIZE_CHUNK_ELEMENTS`` weight
    elements (whole experts) at a time: rows are independent, so chunking gives the same bits and bounds the
    float32 and int64 temporaries of the quantizer (~20 B per element)."""
    chunk = max(1, _QUANTIZE_CHUNK_ELEMENTS // max(math.prod(weight.shape[1:]), 1))
    for part in weight.split(chunk):
        for basis in candidates:
            w = part if basis.words is None else rotation_policy.rotate_weight(part, basis.words)
            packed = quantize_checked(w, basis.codebook, settings)
            basis.parts.append(packed)
            if len(candidates) > 1:
                basis.errors.append(rotation_policy.error_sums(part, (*packed, basis.codebook), basis.words))


def chosen_basis(candidates: list[Basis]) -> Basis:
    """The candidate a fused experts projection keeps: the only one, or the rotated one when its relative error
    over all experts is lower (:mod:`hf_kbit.rotation_policy`)."""
    if len(candidates) == 1:
        return candidates[0]
    plain, rotated = candidates

    def error(basis: Basis) -> float:
        err, norm = (torch.cat(t) for t in zip(*basis.errors))
        return rotation_policy.relative_error(err, norm)

    return rotated if rotation_policy.keeps_rotated(error(rotated), error(plain)) else plain


def model_gating(cls: type):
    """``cls``'s own ``_apply_gate`` (gpt_oss's clamped, interleaved GLU), or None where it has none or has
    transformers' default, ``act_fn(gate) * up``."""
    gate = getattr(cls, "_apply_gate", None)
    return None if gate is None or _is_default_gate(gate) else gate


def apply_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The gating of an experts module (the model's own or a :class:`KbitExperts`) on ``gate_up [S, 2I]`` (the
    gate/up projection's output in Linear layout) -> ``[S, I]``: its class's own ``_apply_gate`` (a KbitExperts
    keeps the model's, :func:`model_gating` when built), else ``act_fn(gate) * up`` (transformers' default
    ``_apply_gate``), which a SiLU ``act_fn`` computes as one op, ``kbit::silu_glu``."""
    gate = module._model_apply_gate if isinstance(module, KbitExperts) else model_gating(type(module))
    if gate is not None:
        return gate(module, gate_up)
    if _is_silu(module.act_fn) and gate_up.dim() == 2 and not gate_up.requires_grad:
        return torch.ops.kbit.silu_glu(gate_up)  # one launch on CUDA, the same roundings
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


# By qualified name, not by import: torch.compile traces these checks as constants.
def _is_default_gate(fn) -> bool:
    """``fn`` is transformers' ``_default_apply_gate`` (``act_fn(gate) * up``), which its MoE decorator gives the
    experts classes that define no gating of their own."""
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == (
        "transformers.integrations.moe", "_default_apply_gate")


_SILU_CLASSES = (nn.SiLU, transformers.activations.SiLUActivation)


def _is_silu(act_fn) -> bool:
    """``act_fn`` computes ``F.silu``: torch's ``nn.SiLU`` or transformers' ``SiLUActivation`` (``ACT2FN["silu"]``).
    By class (an isinstance check traces as a guard on the type alone, which dynamo's recursive dict tags can skip;
    one on the class's ``__qualname__`` cannot be)."""
    return isinstance(act_fn, _SILU_CLASSES)


# ---------------------------------------------------------------------- model-level helpers


def expert_bits(config: KbitConfig, name: str) -> tuple[int, int]:
    """Bits of ``name``'s projections: ``module_bits`` patterns see ``<name>.gate_up_proj`` /
    ``<name>.down_proj``, so a pattern for the module matches both and ``down_proj`` can differ."""
    return config.bits_for(f"{name}.gate_up_proj"), config.bits_for(f"{name}.down_proj")


def replace_experts_with_kbit(
    model: nn.Module, config: KbitConfig, modules_to_not_convert: list[str], weight_placeholder: bool
) -> list[str]:
    """Replace every convertible fused experts module of ``model`` in place; returns their names.

    Runs on the meta skeleton before weights load, so nothing is quantized here.
    """

    def make(name: str, module: nn.Module) -> KbitExperts | None:
        if isinstance(module, KbitExperts) or fused_experts_layout(module, name) is None:
            return None
        gate_up_bits, down_bits = expert_bits(config, name)
        return KbitExperts.from_experts(
            module, gate_up_bits, down_bits, config.codebook, weight_placeholder=weight_placeholder, name=name
        )

    names = swap_modules(model, modules_to_not_convert, make)
    fuse_routers(model, names, modules_to_not_convert)
    return names


def quantize_experts_on_load(
    module: KbitExperts, projection: str, value: torch.Tensor, config: KbitConfig, full_name: str
) -> dict[str, torch.Tensor]:
    """Quantize-on-load of the fused tensor ``full_name`` (``<module>.gate_up_proj`` or
    ``<module>.down_proj``): returns the packed tensors by state-dict key, removes the placeholder."""
    if projection not in module.placeholders():
        raise ValueError(f"{full_name}: not a quantize-on-load placeholder of {type(module).__name__}")
    module_name = full_name.rpartition(".")[0]
    packed = module.pack(projection, value, config.codebook, module_name, config.fitting, config.rotation,
                         config.rotation_seed)
    del module._parameters[projection]
    signs = f"{PROJECTIONS[projection]}_{ROTATION_SIGNS}"
    if signs not in packed and module.rotated[projection]:
        setattr(module, signs, None)  # "auto" kept this projection unrotated: no placeholder waits for its signs
    return {f"{module_name}.{key}": tensor for key, tensor in packed.items()}


def quantize_experts(
    model: nn.Module,
    config: KbitConfig | None = None,
    modules_to_not_convert: list[str] | None = None,
    packed: dict[str, tuple[torch.Tensor, ...]] | None = None,
) -> nn.Module:
    """Quantize the fused experts of a model already in memory (outside ``from_pretrained``).

    ``packed``: ``{"<experts module>.<projection>": (planes, block_scales, row_scales, codebook)}`` of modules
    already quantized (calibrated, :func:`hf_kbit.calibration.calibrate_model`); the others are packed here."""
    config = config or KbitConfig()
    skip = modules_to_not_convert if modules_to_not_convert is not None else (config.modules_to_not_convert or [])
    names = []
    for name, module in list(model.named_modules()):
        if isinstance(module, KbitExperts) or not should_convert(name, skip):
            continue
        if fused_experts_layout(module, name) is not None:
            gate_up_bits, down_bits = expert_bits(config, name)
            given = {p: packed[f"{name}.{p}"] for p in PROJECTIONS} if packed and f"{name}.down_proj" in packed else None
            _set_submodule(model, name, KbitExperts.from_experts(
                module, gate_up_bits, down_bits, config.codebook, name=name, fitting_rule=config.fitting, packed=given,
                rotation=config.rotation, rotation_seed=config.rotation_seed,
            ))
            names.append(name)
    fuse_routers(model, names, skip)
    return model


def replace_kbit_experts_with_float(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every KbitExperts with the model's experts module holding dequantized weights, and give fused
    routers their model's class back."""
    for name, module in list(model.named_modules()):
        if isinstance(module, KbitExperts):
            _set_submodule(model, name, module.to_experts(dtype))
    return unfuse_routers(model)
