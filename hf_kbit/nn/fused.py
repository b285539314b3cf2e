"""Sibling projections that read the same input (q/k/v, gate/up) served by one kbit launch.

At batch 1 a GEMV's fixed cost (launch, ramp-up, the last wave) is a large share of a small
projection's time: k_proj of Llama-3-8B moves 2 MB. :func:`fuse_projections` concatenates the
packed rows of such siblings into one weight; the members keep their names, their state-dict
keys and their module calls, and their buffers become views into the fused weight.

How the call site stays untouched: the first member called on an input ``x`` runs the fused
GEMV and keeps the other members' output slices; a sibling called next with the *same tensor*
``x`` (identity, ``is``) takes its slice without a launch. A sibling called with another input
runs the fused weight again, so results never depend on the call pattern, only the launches
saved do. The one assumption: nobody writes into ``x`` in place between sibling calls. The
slices wait in one module-level slot (``hf_kbit.nn.linear.fused_output``), not in the fused
module, so that a compiled forward reaches the fused module through the launching member only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import format as fmt
from .linear import ROTATION_SIGNS, ROW_TENSORS, KbitLinear, KbitModule, format_layout, group_id, packed_matmul

# Fused module name -> the sibling projections it serves (they must share their input).
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def codebook_siblings(
    layers: dict[str, tuple[int, int]], groups: dict[str, tuple[str, ...]] | None = None
) -> dict[str, tuple[str, ...]]:
    """Which layers share one codebook, so that :func:`fuse_projections` can join them.

    ``layers``: ``{module name: (in_features, bits)}`` of the layers being quantized. Returns, for
    every layer of a complete group of ``groups`` (default :data:`FUSED_GROUPS`) whose members have
    equal ``in_features`` and bits, the members' full names in group order (``q, k, v``); a layer
    not in such a group is absent. Decided by names alone, so quantize-on-load, ``quantize_model``
    and kbit-convert group alike, whether or not the model is fused afterwards.
    """
    out = {}
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        for members in (groups or FUSED_GROUPS).values():
            full = tuple(f"{parent}.{m}" if parent else m for m in members)
            if leaf in members and all(f in layers for f in full) and len({layers[f] for f in full}) == 1:
                out[name] = full
    return out


class KbitFusedProjections(KbitModule):
    """One weight ``[sum(out_features), in_features]`` for sibling KbitLinear members.

    Registered in the members' parent (``self_attn.qkv_proj``) so that ``.to()`` / ``.cuda()``
    reach it; it owns the fused format tensors as plain attributes (not buffers: the members'
    views are the buffers, so state dicts and memory footprints count every byte once), all four
    views into its one storage (:class:`~hf_kbit.nn.linear.KbitModule`), and re-points the members'
    views after a move. It has no state-dict entries of its own. Rotated members (equal sign words: they
    read the same x) make a rotated fused module: ``rotation_signs`` (a copy, in its storage) and ``rotated``.
    Members with block records (format v4) make a fused module with them (``block_offsets``).
    """

    rotated = False
    block_offsets = False

    def __init__(self, members: Sequence[KbitLinear], names: Sequence[str]):
        super().__init__()
        first = members[0]
        self.in_features, self.bits = first.in_features, first.bits
        self.sizes = tuple(m.out_features for m in members)
        self.out_features = sum(self.sizes)
        self.names = tuple(names)
        self.rotated = first.rotated
        self.block_offsets = first.block_offsets
        with torch.no_grad():
            for name in ROW_TENSORS:  # concatenated along N (dim 0)
                self.__dict__[name] = torch.cat([getattr(m, name) for m in members])
            self.__dict__["codebook"] = first.codebook.clone()
            self.__dict__[ROTATION_SIGNS] = first.rotation_signs.clone() if self.rotated else None
        self.__dict__["members"] = tuple(members)
        for index, member in enumerate(members):
            member.__dict__.update(fused_into=self, fused_index=index, fused_group=group_id(self))
            # a view into the member's own storage would keep all of it alive once the rows move here
            member._buffers["codebook"] = member.codebook.clone()
            if member.rotated:
                member._buffers[ROTATION_SIGNS] = member.rotation_signs.clone()
        self.pack_storage()
        self._link()

    def format_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return format_layout(self.out_features, self.in_features, self.bits, self.rotated, self.block_offsets)

    def _format_sources(self) -> dict[str, torch.Tensor | None]:
        return {name: self.__dict__.get(name) for name in self.format_layout()}

    def _set_format_tensor(self, name: str, value: torch.Tensor | None) -> None:
        self.__dict__[name] = value

    def _link(self) -> None:
        """Point every member's row tensors at its rows of the fused ones."""
        tiles = [n // fmt.TILE_N for n in self.sizes]  # whole tiles: _fusable checks
        for name in ROW_TENSORS:
            parts = self.__dict__[name].split(tiles if name != "row_scales" else list(self.sizes))
            for member, part in zip(self.members, parts):
                member._buffers[name] = part
        for member in self.members:
            member.drop_storage()  # its own storage, if it had one, no longer holds its rows

    def link_when_ready(self) -> None:
        """:meth:`_link` once this module and all its members are unpickled (in whichever order pickle
        restores them: each of them calls this when its own state is set)."""
        ready = [self.__dict__.get("members"), *(self.__dict__.get(name) for name in ROW_TENSORS)]
        if all(r is not None for r in ready) and all("_buffers" in m.__dict__ for m in self.members):
            self._link()

    def __setstate__(self, state):
        super().__setstate__(state)
        self.link_when_ready()

    def _apply(self, fn, recurse=True):
        if self._storage is not None:
            super()._apply(fn, recurse)
        else:
            for name in self.format_layout():
                t = self.__dict__[name]
                out = fn(t)
                self.__dict__[name] = t.to(out.device) if out.dtype != t.dtype else out  # format dtypes stay
        self._link()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_fused.T`` (the members' outputs side by side, biases not added)."""
        return packed_matmul(self, x)

    def extra_repr(self) -> str:
        rotated = ", rotated=True" if self.rotated else ""
        offsets = ", block_offsets=True" if self.block_offsets else ""
        return (f"members={self.names}, in_features={self.in_features}, out_features={self.sizes}, "
                f"bits={self.bits}{rotated}{offsets}")


def _fusable(parent: nn.Module, names: Sequence[str]) -> list[KbitLinear] | None:
    members = [getattr(parent, n, None) for n in names]
    if not all(type(m) is KbitLinear and m.fused_into is None and not m.placeholders() for m in members):
        return None
    first = members[0]
    if first.planes.is_meta or any(
        m.in_features != first.in_features
        or m.bits != first.bits
        or m.planes.device != first.planes.device
        or m.out_features % fmt.TILE_N  # rows of a partial tile would shift every row after it
        or not torch.equal(m.codebook, first.codebook)
        or m.block_offsets != first.block_offsets  # one dtype of block scales
        or m.rotated != first.rotated  # one launch turns x once: the same sign words or none
        or (m.rotated and not torch.equal(m.rotation_signs, first.rotation_signs))
        for m in members
    ):
        return None
    return members


def fuse_projections(model: nn.Module, groups: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """Fuse sibling KbitLinear projections of ``model`` in place; returns the fused modules' names.

    ``groups`` (default :data:`FUSED_GROUPS`): ``{fused name: member names}``. A group is fused
    where a module has every member as a KbitLinear of the same ``in_features``, bits, device,
    codebook and rotation (none, or equal sign words) with ``out_features`` a multiple of 16, and no
    attribute of the fused name.
    Encoder-decoder models are left alone (cross-attention feeds k/v another input than q).
    Undo with :func:`unfuse_projections` (which is not needed to save: the members' state-dict
    entries are written as tensors of their own).
    """
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return []
    fused, groups = [], groups or FUSED_GROUPS
    for parent_name, parent in list(model.named_modules()):
        for fused_name, names in groups.items():
            if hasattr(parent, fused_name):
                continue
            members = _fusable(parent, names)
            if members is None:
                continue
            setattr(parent, fused_name, KbitFusedProjections(members, names))
            fused.append(f"{parent_name}.{fused_name}" if parent_name else fused_name)
    return fused


def unfuse_projections(model: nn.Module) -> list[str]:
    """Give every fused member its own tensors again and remove the fused modules; returns their names."""
    removed = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, KbitFusedProjections):
            continue
        with torch.no_grad():
            for member in module.members:
                for tensor_name in ROW_TENSORS:
                    member._buffers[tensor_name] = member._buffers[tensor_name].clone()
                member.__dict__["fused_into"] = None
                for attr in ("fused_index", "fused_group"):
                    member.__dict__.pop(attr, None)
                member.pack_storage()
        parent_name, _, child = name.rpartition(".")
        delattr(model.get_submodule(parent_name) if parent_name else model, child)
        removed.append(name)
    return removed
