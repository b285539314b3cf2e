"""KbitLinear: a Linear layer whose weight lives in the kbit format."""

from __future__ import annotations

import itertools
import math
import weakref

import torch
from torch import nn

from .. import _ops, fitting, rotation_policy
from .. import format as fmt

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

FORMAT_TENSORS = ("planes", "block_scales", "row_scales", "codebook")
ROW_TENSORS = FORMAT_TENSORS[:3]  # one entry per output row (or row tile); the codebook is the layer's
ROTATION_SIGNS = fmt.ROTATION_SIGNS  # format v3: a rotated layer's sign words, the last tensor of its storage
BLOCK_SCALES = "block_scales"  # format v4: uint8 E4M4 codes, or int16 block records (codes and offsets)


# Bytes at which each format tensor of a module's one storage starts (vector loads, any dtype).
STORAGE_ALIGN = 16


Shape = tuple[int, ...]


def storage_layout(tensors: dict[str, tuple[torch.dtype, Shape]]) -> dict[str, tuple[int, int, torch.dtype, Shape]]:
    """Where each tensor ``{name: (dtype, shape)}`` sits in one uint8 storage, in the given order:
    ``{name: (byte offset, bytes, dtype, shape)}``, every offset a multiple of :data:`STORAGE_ALIGN`."""
    layout, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * dtype.itemsize
        layout[name] = (offset, nbytes, dtype, shape)
        offset += -(-nbytes // STORAGE_ALIGN) * STORAGE_ALIGN
    return layout


def storage_bytes(layout: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]]) -> int:
    return max((-(-(o + n) // STORAGE_ALIGN) * STORAGE_ALIGN for o, n, _, _ in layout.values()), default=0)


def storage_view(storage: torch.Tensor, entry: tuple[int, int, torch.dtype, tuple[int, ...]]) -> torch.Tensor:
    """The tensor that ``entry`` (from :func:`storage_layout`) places in ``storage``, as a view."""
    offset, nbytes, dtype, shape = entry
    return storage[offset : offset + nbytes].view(dtype).view(shape)


class KbitModule(nn.Module):
    """Base of kbit modules, whose buffers are all format tensors.

    Casting a model (``.half()``, ``.to(torch.bfloat16)``) must not touch them: they keep
    their dtype and follow the device; parameters (biases) cast as usual.

    One storage: once its format tensors are final (quantized, loaded, moved), a module keeps them
    in one uint8 tensor (``_storage``: not a buffer, no state-dict entry, counted once) and its
    buffers become views into it (:meth:`pack_storage`). A compiled forward reads that one tensor
    and takes the views inside the graph (:meth:`format_tensors`), so that dynamo lifts one input
    per module instead of one per format tensor: each lifted input costs host time at every call of
    the compiled step (the generated code fetches it through the module path, the wrappers check
    it). Eager forwards read the buffers. Replacing a buffer (``module.planes = t``,
    ``load_state_dict(assign=True)``) drops the storage until :meth:`pack_storage` runs again;
    copying into one (``load_state_dict``) writes into the storage.
    """

    _storage = None

    def format_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``{name: (dtype, shape)}`` of the format tensors, in storage order, derived from the module's
        int attributes only (a compiled forward then adds no guards for it)."""
        raise NotImplementedError

    def _format_sources(self) -> dict[str, torch.Tensor | None]:
        """Where the format tensors live outside the storage (the buffers)."""
        return self._buffers

    def _set_format_tensor(self, name: str, value: torch.Tensor | None) -> None:
        self._buffers[name] = value

    def __setattr__(self, name, value):
        buffers = self.__dict__.get("_buffers", ())
        if self._storage is not None and name in buffers:
            self.__dict__["_storage"] = None  # a buffer of its own now: the storage no longer holds it
        super().__setattr__(name, value)
        if name.endswith(ROTATION_SIGNS) and name in buffers:
            self._set_rotated(name, value is not None)  # a loader (or anyone) set the sign words or removed them
        if name == BLOCK_SCALES and name in buffers and isinstance(value, torch.Tensor):
            self._set_records(value.dtype == fmt.RECORD_DTYPE)  # uint8 codes, or int16 block records (format v4)

    def _set_rotated(self, name: str, rotated: bool) -> None:
        """Record whether the sign words ``name`` are there (an attribute, so that :meth:`format_layout` reads no
        tensor): a module with rotation overrides this."""

    def _set_records(self, records: bool) -> None:
        """Record whether ``block_scales`` holds int16 block records (an attribute, as :meth:`_set_rotated`): a module
        with block offsets overrides this."""

    def rotation_in_features(self) -> dict[str, int]:
        """``{sign-words buffer name: in_features of its weight}`` for every weight of the module (format v3)."""
        return {}

    def stores_rotated(self, name: str | None = None) -> bool:
        """Whether the weight of the sign words ``name`` (by default any of the module's own weights) is stored
        rotated: its sign words are there."""
        names = self.rotation_in_features() if name is None else (name,)
        return any(self._buffers.get(n) is not None for n in names)

    def expect_rotation(self, name: str) -> None:
        """Give the sign words ``name`` an empty placeholder (int32 ``[K / 32]``, on the format tensors' device) for a
        loader to fill: the weight is stored rotated. ValueError when it cannot be (K not a multiple of 64)."""
        k = self.rotation_in_features()[name]
        device = next(t.device for t in self._format_sources().values() if t is not None)
        setattr(self, name, rotation_signs_placeholder(k, device, f"{type(self).__name__}.{name}"))

    def drop_storage(self) -> None:
        """Forget the one storage (the buffers keep their values, as views into it)."""
        self.__dict__["_storage"] = None

    @torch.no_grad()
    def pack_storage(self) -> bool:
        """Move the format tensors into one storage, the buffers becoming views into it; False (and no
        storage) where they are not all there, on one device, in the shapes and dtypes of
        :meth:`format_layout` (placeholders still waiting, meta tensors, a checkpoint of another layout)."""
        self.drop_storage()
        wanted = self.format_layout()
        sources = self._format_sources()
        tensors = [sources.get(name) for name in wanted]
        if any(t is None or t.is_meta for t in tensors) or len({t.device for t in tensors}) != 1:
            return False
        expected = wanted.values()
        if any(t.dtype != dtype or tuple(t.shape) != tuple(shape) for t, (dtype, shape) in zip(tensors, expected)):
            return False
        layout = storage_layout(wanted)
        storage = torch.empty(storage_bytes(layout), dtype=torch.uint8, device=tensors[0].device)
        for (name, entry), t in zip(layout.items(), tensors):
            view = storage_view(storage, entry)
            view.copy_(t)
            self._set_format_tensor(name, view)
        self.__dict__["_storage"] = storage
        return True

    def format_tensors(self, names: tuple[str, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
        """The format tensors ``names`` for a forward on ``device``: views of the one storage when compiling
        (one graph input for the module), the buffers otherwise."""
        storage = self._storage
        if storage is not None and storage.device == device and torch.compiler.is_compiling():
            layout = storage_layout(self.format_layout())
            return tuple(storage_view(storage, layout[name]) for name in names)
        sources = self._format_sources()
        return tuple(sources[name] for name in names)

    def _apply(self, fn, recurse=True):
        storage = self._storage
        if storage is not None:  # move the storage once; the buffers follow as views
            moved = fn(storage)
            moved = storage.to(moved.device) if moved.dtype != storage.dtype else moved
            names = list(self.format_layout())
            for name in names:
                self._set_format_tensor(name, None)
        keep = {id(t) for t in self._buffers.values() if t is not None}

        def apply_keeping_format(t):
            out = fn(t)
            if id(t) in keep and out.dtype != t.dtype:
                return t.to(out.device)
            return out

        out = super()._apply(apply_keeping_format, recurse)
        if storage is not None:
            layout = storage_layout(self.format_layout())
            for name in names:
                self._set_format_tensor(name, storage_view(moved, layout[name]))
            self.__dict__["_storage"] = moved
        return out

    def _shares_storage(self) -> bool:
        return self._storage is not None or getattr(self, "fused_into", None) is not None

    def __getstate__(self):
        state = super().__getstate__()
        if self._shares_storage():
            # pickle cannot write views of one storage as tensors of several dtypes: each its own copy
            # (the copy packs its storage again, KbitModule.__setstate__)
            sources = self._format_sources()
            copies = {name: t.clone() for name, t in sources.items() if t is not None}
            state["_storage"] = None
            if sources is self._buffers:
                state["_buffers"] = {**self._buffers, **copies}
            else:
                state.update(copies)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.pack_storage()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._shares_storage():
            # views into one storage: saved (safetensors) as tensors of their own
            for name in self._buffers:
                if prefix + name in destination:
                    destination[prefix + name] = destination[prefix + name].clone()


def pack_storages(model: nn.Module) -> int:
    """:meth:`KbitModule.pack_storage` for every kbit module of ``model``; returns how many have one storage."""
    return sum(m.pack_storage() for m in model.modules() if isinstance(m, KbitModule))


class KbitLinear(KbitModule):
    """``y = x @ W.T + bias`` with ``W [out_features, in_features]`` stored k-bit.

    Not an ``nn.Linear`` subclass on purpose: model initialisers must never touch ``.weight``.

    Buffers (format v1, see ``docs/format.md``; N = out_features, K = in_features):
        planes: int32 ``[ceil(N/16), ceil(K/128), bits, 16, 4]`` bit-plane words.
        block_scales: uint8 ``[ceil(N/16), ceil(K/128), 16, 4]`` E4M4 block scale codes.
        row_scales: float32 ``[N]`` per-row scale.
        codebook: float32 ``[2**bits]`` sorted levels in [-1, 1].
        block_scales may instead be int16 block records ``[ceil(N/16), ceil(K/128), 16, 4]`` (format v4,
            ``block_offsets``): the E4M4 code in the low byte, a signed offset code in the high byte.
        rotation_signs: int32 ``[K/32]`` (format v3) when the layer is rotated (``rotated``): the packed
            tensors then hold ``W R`` (hf_kbit.rotation, segments of 8 along K; K a multiple of 64) and every op
            call passes these sign words as ``signs``, so that outputs and :meth:`dequantize_weight` are in
            the original basis. ``None`` (no state-dict entry) when not rotated.
    Parameter ``bias`` ``[N]`` (optional) keeps the model's dtype. The forward computes in
    the dtype of its input (bf16, fp16 or fp32) with float32 accumulation; ``.half()`` or
    ``.to(dtype)`` cast the bias only, the format tensors keep their dtypes.

    While a model is quantized on load, a ``weight`` placeholder (meta) receives the
    checkpoint's full-precision weight, which the quantize op packs and then removes.

    ``fused_into``: the ``KbitFusedProjections`` once :func:`hf_kbit.nn.fuse_projections` has joined this
    layer with its siblings (its row tensors are then views into the fused ones), ``fused_index`` its slice
    there and ``fused_group`` the int that names the fused module in the pending slot (:func:`fused_output`).
    Three plain attributes, not one tuple: under torch.compile a module whose attributes are all modules,
    tensors and constants keeps dynamo's guards on it skippable while its ``__dict__`` is unchanged, and a
    tuple attribute made each member's (and so each decoder layer's) guards run in full at every call.
    """

    fused_into = None
    fused_index = 0
    fused_group = -1
    rotated = False
    block_offsets = False

    def __setstate__(self, state):
        # deepcopy and unpickling make a new fused module: its members' group follows it
        super().__setstate__(state)
        link = self.__dict__.get("fused_into")
        if isinstance(link, tuple):  # pickles from before: fused_into = (fused, index[, group])
            self.__dict__["fused_into"], self.__dict__["fused_index"] = link[:2]
        if self.fused_into is not None:
            self.__dict__["fused_group"] = group_id(self.fused_into)
            self.fused_into.link_when_ready()

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits: int = 4,
        codebook: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        weight_placeholder: bool = False,
        rotated: bool = False,
        block_offsets: bool = False,
    ):
        super().__init__()
        if bits not in fmt.SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {fmt.SUPPORTED_BITS}, got {bits!r}")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        shapes = fmt.packed_shapes(out_features, in_features, bits)
        self.__dict__["block_offsets"] = block_offsets
        dtypes = fmt.packed_dtypes(block_offsets)
        for name in FORMAT_TENSORS:
            self.register_buffer(name, torch.empty(shapes[name], dtype=dtypes[name], device=device))
        self.register_buffer(ROTATION_SIGNS, None)
        if rotated:
            self.rotation_signs = rotation_signs_placeholder(in_features, device, "KbitLinear")
        if codebook is None:
            codebook = fmt.make_codebook(None, bits)
        with torch.no_grad():
            self.codebook = codebook.to(device=self.codebook.device, dtype=torch.float32).clone()
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        if weight_placeholder:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=dtype, device="meta"), requires_grad=False
            )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        bits: int = 4,
        codebook: str | list[float] | torch.Tensor | None = None,
        fitting: str | None = None,
        packed: tuple[torch.Tensor, ...] | None = None,
        rotation: bool | str = False,
        rotation_seed: int = 0,
        block_offsets: bool = False,
    ) -> "KbitLinear":
        """Quantize an existing ``nn.Linear`` (same device, bias kept in its dtype).

        ``codebook``, ``fitting``, ``rotation``, ``rotation_seed`` and ``block_offsets`` mean what they mean in
        :class:`hf_kbit.KbitConfig`; ``packed``: its weight's format tensors when already quantized
        (:func:`quantize_siblings`: ``(planes, block_scales, row_scales, codebook[, rotation_signs])``).
        A fitted codebook is this layer's own, so siblings quantized one by one do not fuse
        (:func:`hf_kbit.nn.fuse_projections` needs one codebook): ``quantize_model`` and
        quantize-on-load fit one per group of siblings.
        """
        weight = linear.weight.detach()
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            bits=bits,
            dtype=weight.dtype,
            device=weight.device,
        )
        if packed is None:
            packed = quantize_siblings([weight], bits, codebook, fitting, ["weight"], rotation, rotation_seed,
                                       block_offsets)[0]
        module.load_packed(*packed)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def packed_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each format tensor (the checkpoint contract, see hf_kbit.checkpoint)."""
        shapes = fmt.packed_shapes(self.out_features, self.in_features, self.bits)
        if self.rotated:
            shapes[ROTATION_SIGNS] = fmt.rotation_signs_shape(self.in_features)
        return shapes

    def _set_rotated(self, name: str, rotated: bool) -> None:
        self.__dict__["rotated"] = rotated

    def _set_records(self, records: bool) -> None:
        self.__dict__["block_offsets"] = records

    def packed_dtypes(self) -> dict[str, torch.dtype]:
        """dtype of each format tensor (block_scales: uint8 codes, or int16 block records under ``block_offsets``)."""
        dtypes = fmt.packed_dtypes(self.block_offsets)
        if self.rotated:
            dtypes[ROTATION_SIGNS] = fmt.ROTATION_SIGNS_DTYPE
        return dtypes

    def rotation_in_features(self) -> dict[str, int]:
        return {ROTATION_SIGNS: self.in_features}

    @property
    def qweight(self) -> torch.Tensor:
        """``planes``, under the name by which adapter libraries (peft) find the packed weight of a quantized
        linear layer, and from it the device for its adapters. Not a tensor of its own (no state-dict entry)."""
        return self.planes

    def placeholders(self) -> list[str]:
        """Full-precision placeholders still waiting for quantize-on-load."""
        return ["weight"] if "weight" in self._parameters else []

    def format_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return format_layout(self.out_features, self.in_features, self.bits, self.rotated, self.block_offsets)

    def pack_storage(self) -> bool:
        if self.fused_into is not None:  # its row tensors are views into the fused module's storage
            return False
        return super().pack_storage()

    @torch.no_grad()
    def load_packed(self, planes, block_scales, row_scales, codebook, rotation_signs=None) -> None:
        """Take packed tensors (from :func:`quantize_siblings` or a checkpoint); ``rotation_signs`` None: unrotated."""
        if self.fused_into is not None:
            raise RuntimeError(
                f"load_packed: this KbitLinear is fused into {self.fused_into.names}; "
                "call hf_kbit.unfuse_projections(model) first"
            )
        if rotation_signs is not None and not fmt.rotatable(self.in_features):
            raise ValueError(f"load_packed: rotation_signs given, but in_features={self.in_features} is not a multiple "
                             f"of {fmt.ROTATION_MULTIPLE}, so this layer cannot be rotated")
        for name, value in zip(FORMAT_TENSORS, (planes, block_scales, row_scales, codebook)):
            setattr(self, name, value.to(self.planes.device))
        self.rotation_signs = None if rotation_signs is None else rotation_signs.to(self.planes.device)
        if "weight" in self._parameters:
            del self._parameters["weight"]
        self.pack_storage()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fused_group, not fused_into: the siblings reach one fused module, and reading it through each of them
        # would make dynamo guard that they are the same object (a Python guard per sibling, run at every call).
        out = packed_matmul(self, x) if self.fused_group < 0 else fused_output(self, x)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @torch.no_grad()
    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out_features, in_features]`` as the format reconstructs it, in the original basis."""
        return torch.ops.kbit.dequantize(
            self.planes, self.block_scales, self.row_scales, self.codebook, self.in_features, dtype, self.rotation_signs
        )

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """An ``nn.Linear`` holding the dequantized weight (``dtype`` defaults to the bias's or float32)."""
        if dtype is None:
            dtype = self.bias.dtype if self.bias is not None else torch.float32
        elif isinstance(dtype, str):  # transformers may pass config.dtype by name
            dtype = getattr(torch, dtype)
        linear = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, dtype=dtype, device=self.planes.device
        )
        with torch.no_grad():
            linear.weight.copy_(self.dequantize_weight(dtype))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        rotated = ", rotated=True" if self.rotated else ""
        offsets = ", block_offsets=True" if self.block_offsets else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"bias={self.bias is not None}{rotated}{offsets}")


def format_layout(n: int, k: int, bits: int, rotated: bool,
                  block_offsets: bool = False) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of the format tensors of one ``[n, k]`` weight, in storage order (the sign words
    last, when ``rotated``; int16 block records under ``block_offsets``)."""
    shapes = fmt.packed_shapes(n, k, bits)
    dtypes = fmt.packed_dtypes(block_offsets)
    layout = {name: (dtypes[name], shapes[name]) for name in FORMAT_TENSORS}
    if rotated:
        layout[ROTATION_SIGNS] = (fmt.ROTATION_SIGNS_DTYPE, fmt.rotation_signs_shape(k))
    return layout


def rotation_signs_placeholder(k: int, device, owner: str) -> torch.Tensor:
    """An empty ``rotation_signs`` buffer ``[k / 32]`` (int32) for a loader to fill; ValueError naming ``owner`` when
    ``k`` cannot rotate."""
    if not fmt.rotatable(k):
        raise ValueError(f"{owner}: in_features={k} is not a multiple of {fmt.ROTATION_MULTIPLE}, so it cannot be rotated")
    return torch.empty(fmt.rotation_signs_shape(k), dtype=fmt.ROTATION_SIGNS_DTYPE, device=device)


def packed_matmul(module: KbitModule, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a module holding format tensors (KbitLinear, KbitFusedProjections), no bias; a rotated
    module's sign words go to the op as ``signs``."""
    eager = not torch.compiler.is_compiling()
    training = eager and x.requires_grad and torch.is_grad_enabled() and type(x) is torch.Tensor
    out = None
    fast = _ops.eager_mm
    if fast is not None and eager and not training:
        out = fast(module, x)  # a backend's eager shortcut (CUDA: one lean launch), None where the op must serve
    if out is None:
        if x.dtype not in COMPUTE_DTYPES:
            raise TypeError(f"KbitLinear input must be one of {COMPUTE_DTYPES}, got {x.dtype}")
        if module.rotated:
            *tensors, signs = module.format_tensors((*FORMAT_TENSORS, ROTATION_SIGNS), x.device)
        else:
            tensors, signs = module.format_tensors(FORMAT_TENSORS, x.device), None
        if training:  # the op's gradient at a fraction of its eager host cost (hf_kbit._ops.KbitMatmul)
            out = _ops.KbitMatmul.apply(x, *tensors, module.in_features, signs)
        else:
            out = torch.ops.kbit.mm(x, *tensors, module.in_features, signs)
    return out


# The fused launch whose sibling outputs are not all taken yet: [group, x, outputs (None where taken)].
# One slot for all fused modules, which every member reaches by the same name: under torch.compile, a
# stash reached through each member's own path (q_proj.fused_into..., k_proj.fused_into...) cost
# guards on every path and alias guards between them, evaluated at every call.
_PENDING: list = [None, None, None]
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NEXT_GROUP = itertools.count()


def group_id(fused: nn.Module) -> int:
    """The int that names ``fused`` in the pending slot: one per fused module object, never reused."""
    if fused not in _GROUPS:
        _GROUPS[fused] = next(_NEXT_GROUP)
    return _GROUPS[fused]


def fused_output(member: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fused member's output (its slice ``fused_index`` of the fused module ``fused_into``) on ``x`` (see
    hf_kbit.nn.fused).

    A sibling's launch on this same ``x`` (identity) left it in the pending slot: taken without a
    launch, and without touching the fused module. Otherwise the fused weight runs and the other
    members' slices wait in the slot, replacing whatever was there (a member that then misses its
    slice launches again: only launches depend on the call pattern, never results).
    """
    index, group = member.fused_index, member.fused_group
    pending_group, pending_x, outputs = _PENDING  # one unpack: another thread's store cannot split it
    if pending_group == group and pending_x is x and outputs[index] is not None:
        out, outputs[index] = outputs[index], None
        if all(o is None for o in outputs) and _PENDING[2] is outputs:
            _PENDING[:] = [None, None, None]
        return out
    fused = member.fused_into
    outputs = list(fused(x).split(fused.sizes, dim=-1))
    out, outputs[index] = outputs[index], None
    _PENDING[:] = [group, x, outputs]
    return out


def check_weight(weight: torch.Tensor, name: str) -> None:
    """Refuse what kbit cannot quantize (not [..., N, K], not floating point, NaN/Inf), naming ``name``."""
    if weight.dim() < 2:
        raise ValueError(f"{name}: kbit quantizes 2-D weights [out, in] (or stacked [E, out, in]), got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point weight, got {weight.dtype}")
    if not bool(torch.isfinite(weight).all()):
        bad = int((~torch.isfinite(weight)).sum())
        raise ValueError(f"{name}: {bad} non-finite value(s) (NaN/Inf) in the weight; refusing to quantize")


def quantize_weight(
    weight: torch.Tensor, codebook: torch.Tensor, name: str = "weight", settings: fitting.FitSettings | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``weight [..., N, K]`` with ``codebook`` to (planes, block_scales, row_scales), checking it first.

    ``settings`` ``None`` rounds each block's absmax up (``kbit::quantize``, a CUDA kernel on GPU);
    otherwise block codes are searched as :func:`hf_kbit.fitting.quantize_fitted` does.
    ``name`` goes into errors so that a user learns which tensor is at fault.
    """
    check_weight(weight, name)
    return quantize_checked(weight, codebook, settings)


def quantize_checked(
    weight: torch.Tensor, codebook: torch.Tensor, settings: fitting.FitSettings | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_weight` of a weight :func:`check_weight` has already passed."""
    if settings is None:
        return torch.ops.kbit.quantize(weight, codebook)
    return fitting.quantize_fitted(weight, codebook, settings.codes_below, settings.codes_above, settings.offsets,
                                   settings.offset_choice)


def quantize_layer(
    weight: torch.Tensor,
    bits: int,
    codebook: str | list[float] | torch.Tensor | None = None,
    fitting_rule: str | None = None,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``weight [..., N, K]`` (experts stacked on the leading dims share one codebook) as
    ``KbitConfig(bits, codebook, fitting=fitting_rule)`` asks: ``(planes, block_scales, row_scales, codebook)``.

    The codebook is fitted on every m-th row of the weight's rows ``[-1, K]``
    (:func:`hf_kbit.fitting.sample_stride`), so a caller quantizing pieces of a larger weight
    (chunks of experts) passes the codebook of the whole to :func:`quantize_weight` instead.
    """
    return quantize_group([weight], bits, codebook, fitting_rule, [name])[0]


def quantize_group(
    weights: list[torch.Tensor],
    bits: int,
    codebook: str | list[float] | torch.Tensor | None = None,
    fitting_rule: str | None = None,
    names: list[str] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`quantize_layer` for layers that share one codebook (siblings that
    :func:`hf_kbit.nn.fuse_projections` runs as one weight: q/k/v, gate/up), fitted on their rows
    stacked in the given order, as if they were one weight ``[sum(N), K]``."""
    _check_members(weights, names)
    return _quantize_checked_group(weights, bits, codebook, fitting_rule)


def _check_members(weights: list[torch.Tensor], names: list[str] | None) -> list[str]:
    """:func:`check_weight` of each member under its name (default ``weights[i]``); returns the names."""
    names = names or [f"weights[{i}]" for i in range(len(weights))]
    for weight, name in zip(weights, names):
        check_weight(weight, name)
    return names


def _quantize_checked_group(
    weights: list[torch.Tensor], bits: int, codebook: str | list[float] | torch.Tensor | None, fitting_rule: str | None,
    block_offsets: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`quantize_group` of members :func:`check_weight` has already passed."""
    settings = fitting.settings_for(fitting_rule, bits, codebook, block_offsets)
    cb = fitting.group_codebook(weights, bits, settings, codebook)
    # Each member its own copy of the codebook: tensors sharing storage cannot be saved as separate entries.
    return [
        (*quantize_checked(w, cb, settings), cb if i == 0 else cb.clone()) for i, w in enumerate(weights)
    ]


def quantize_siblings(
    weights: list[torch.Tensor],
    bits: int,
    codebook: str | list[float] | torch.Tensor | None = None,
    fitting_rule: str | None = None,
    names: list[str] | None = None,
    rotation: bool | str = False,
    rotation_seed: int = 0,
    block_offsets: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """:func:`quantize_group` in the basis ``KbitConfig(rotation=rotation, rotation_seed=rotation_seed)`` picks for
    the group (:mod:`hf_kbit.rotation_policy`): ``[(planes, block_scales, row_scales, codebook, rotation_signs)]``,
    ``rotation_signs`` None where the group stays unrotated (each member its own copy otherwise). The members
    must share in_features (siblings do). ``block_offsets``: int16 block records (``KbitConfig.block_offsets``)."""
    names = _check_members(weights, names)
    if len({w.shape[-1] for w in weights}) > 1:
        raise ValueError(f"quantize_siblings: {names} have different in_features {[w.shape[-1] for w in weights]}")

    def quantize(group: list[torch.Tensor]):  # the members, or their rotations (finite as they are)
        return _quantize_checked_group(group, bits, codebook, fitting_rule, block_offsets)

    packed, words = rotation_policy.choose(weights, rotation_policy.for_weights(rotation, names), rotation_seed, quantize)
    return [(*p, None if words is None else words.clone()) for p in packed]
