"""Checks that a kbit checkpoint is what the model expects, before and after loading.

A corrupt file must fail with an error naming the tensor -- never a native crash and never
silently wrong weights. Safetensors headers are read directly (JSON, no tensor data), so the
checks cost nothing on big checkpoints.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable

import torch
from torch import nn

from . import format as fmt

_SAFETENSORS_DTYPES = {"I32": torch.int32, "I16": torch.int16, "U8": torch.uint8, "F32": torch.float32}


class KbitCheckpointError(ValueError):
    """A kbit checkpoint tensor is missing, truncated or of the wrong shape/dtype."""


def expected_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{state_dict key: (shape, dtype)}`` for every format tensor of every kbit module.

    A kbit module is one with ``packed_shapes() -> {tensor name: shape}``; a tensor's dtype is the module's
    (``packed_dtypes()``, where it has one: KbitLinear's block scales may be int16 block records), else follows
    its name's suffix (``planes``, ``block_scales``, ``row_scales``, ``codebook``, ``rotation_signs``).
    """
    expected = {}
    for name, module in model.named_modules():
        packed_shapes = getattr(module, "packed_shapes", None)
        if packed_shapes is None:
            continue
        for tensor_name, shape in packed_shapes().items():
            expected[f"{name}.{tensor_name}"] = (shape, _module_dtype(module, tensor_name))
    return expected


_TENSOR_DTYPES = {**fmt.PACKED_DTYPES, fmt.ROTATION_SIGNS: fmt.ROTATION_SIGNS_DTYPE}


def _module_dtype(module: nn.Module, tensor_name: str) -> torch.dtype:
    dtypes = getattr(module, "packed_dtypes", None)
    return dtypes()[tensor_name] if dtypes is not None else _dtype_of(tensor_name)


def _dtype_of(tensor_name: str) -> torch.dtype:
    for base, dtype in _TENSOR_DTYPES.items():
        if tensor_name == base or tensor_name.endswith("_" + base):
            return dtype
    raise KeyError(tensor_name)


def _is_packed_name(tensor_name: str) -> bool:
    """Whether ``tensor_name`` is named like a format tensor (``planes``, ``gate_up_row_scales``, ...)."""
    return any(tensor_name == base or tensor_name.endswith("_" + base) for base in _TENSOR_DTYPES)


def is_rotation_signs(key: str) -> bool:
    """Whether the state-dict key ``key`` is a rotated layer's sign words (``<module>.rotation_signs``,
    ``<experts>.gate_up_rotation_signs``)."""
    name = key.rpartition(".")[2]
    return name == fmt.ROTATION_SIGNS or name.endswith("_" + fmt.ROTATION_SIGNS)


def rotation_signs_keys(
    files: Iterable[str | os.PathLike], rename: Callable[[str], str] | None = None
) -> list[str]:
    """The sign-word keys (:func:`is_rotation_signs`) the safetensors ``files`` hold, in the model's naming
    (``rename``, as :func:`validate_files`): the layers the checkpoint stores rotated (format v3)."""
    keys = []
    for path in files:
        if not str(path).endswith(".safetensors"):
            continue
        keys += [rename(key) if rename is not None else key for key in read_safetensors_header(path)
                 if key != "__metadata__" and is_rotation_signs(key)]
    return keys


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file, with every entry checked to be well formed and every
    tensor's data to lie inside the file; errors name the file and the key."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise KbitCheckpointError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise KbitCheckpointError(f"{path}: header claims {header_len} bytes but the file has {size} (truncated?)")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError) as e:
            raise KbitCheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise KbitCheckpointError(
            f"{path}: the safetensors header is a JSON {_json_type(header)}, expected an object of tensor "
            "entries: the file is corrupt"
        )
    data_size = size - 8 - header_len
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict):
                raise KbitCheckpointError(f"{path}: '__metadata__' is a JSON {_json_type(info)}, expected an object")
            continue
        start, end = _check_header_entry(path, key, info)
        if end > data_size:
            raise KbitCheckpointError(
                f"{path}: tensor '{key}' ends at byte {end} of the data section, which has only {data_size} "
                "bytes: the file is truncated; download or convert it again"
            )
    return header


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_header_entry(path, key: str, info) -> tuple[int, int]:
    """``(start, end)`` of a header entry ``{"dtype": str, "shape": [int], "data_offsets": [start, end]}``."""
    where = f"{path}: tensor '{key}'"
    if not isinstance(info, dict):
        raise KbitCheckpointError(
            f"{where} has a header entry that is a JSON {_json_type(info)}, expected an object with dtype, shape "
            "and data_offsets: the file is corrupt"
        )
    if not isinstance(info.get("dtype"), str):
        raise KbitCheckpointError(f"{where}: header 'dtype' must be a string, got {info.get('dtype')!r}")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise KbitCheckpointError(f"{where}: header 'shape' must be a list of non-negative ints, got {shape!r}")
    offsets = info.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise KbitCheckpointError(
            f"{where}: header 'data_offsets' must be [start, end] of non-negative ints, got {offsets!r}"
        )
    start, end = offsets
    if start > end:
        raise KbitCheckpointError(f"{where}: header 'data_offsets' {offsets} start after they end")
    return start, end


def validate_files(
    files: Iterable[str | os.PathLike], model: nn.Module, rename: Callable[[str], str] | None = None
) -> None:
    """Check every safetensors file's kbit tensors against ``model``'s kbit modules.

    ``rename`` maps a saved key to the model's name for it (the model's conversion mapping,
    e.g. Mixtral saves ``.mlp.`` as ``.block_sparse_moe.``); identity when ``None``.
    """
    expected = expected_tensors(model)
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "")
    found = set()
    for path in files:
        if not str(path).endswith(".safetensors"):
            if not expected:
                continue
            raise KbitCheckpointError(
                f"{os.path.basename(path)}: kbit checkpoints are safetensors only and this file is not one; re-save "
                "the quantized model with save_pretrained (safetensors is its default) or convert the original "
                "model again (kbit-convert)"
            )
        for key, info in read_safetensors_header(path).items():
            if key == "__metadata__":
                continue
            renamed = rename(key) if rename is not None else key
            candidates = (renamed, key, f"{prefix}.{renamed}", f"{prefix}.{key}")
            name = next((c for c in candidates if c in expected), None)
            if name is None:
                _check_not_stray(key, path, candidates, modules)
                continue
            found.add(name)
            shape, dtype = expected[name]
            got_dtype = _SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"])
            if got_dtype != dtype or tuple(info["shape"]) != shape:
                raise KbitCheckpointError(
                    f"checkpoint tensor '{key}' in {os.path.basename(path)} is {info['dtype']} {tuple(info['shape'])}, "
                    f"the kbit module expects {dtype} {shape}; the file is corrupt or was written with a different "
                    "quantization_config"
                )
    missing = sorted(set(expected) - found)
    if missing:
        raise KbitCheckpointError(
            f"kbit checkpoint lacks {len(missing)} packed tensor(s), e.g. '{missing[0]}': its files are incomplete "
            "or corrupt, or were saved with a different quantization_config (bits, modules_to_not_convert)"
        )


def _check_not_stray(key: str, path, candidates: Iterable[str], modules: dict[str, nn.Module]) -> None:
    """Refuse a packed tensor for a module of the model that is not a kbit module (or lacks that tensor).

    Without this, loading would skip it as unexpected and leave the module's weight randomly
    initialised. Packed tensors of modules the model does not have at all (checkpoint layers the
    model drops on purpose) stay transformers' business.
    """
    for candidate in candidates:
        module_name, _, tensor_name = candidate.rpartition(".")
        module = modules.get(module_name)
        if module is None or not _is_packed_name(tensor_name):
            continue
        if tensor_name in module._parameters or tensor_name in module._buffers:
            return  # the module's own tensor that happens to be named like a format tensor
        if getattr(module, "packed_shapes", None) is None:
            raise KbitCheckpointError(
                f"checkpoint tensor '{key}' in {os.path.basename(path)} is a packed kbit tensor, but the "
                f"quantization_config in config.json keeps '{module_name}' ({type(module).__name__}) in full "
                "precision: config and tensors disagree; remove it from modules_to_not_convert (or use the "
                "config.json the checkpoint was saved with)"
            )
        raise KbitCheckpointError(
            f"checkpoint tensor '{key}' in {os.path.basename(path)} is not a tensor of the kbit module "
            f"'{module_name}' (expected {sorted(module.packed_shapes())}); the file is corrupt or was written "
            "with a different quantization_config"
        )


@torch.no_grad()
def validate_loaded(model: nn.Module) -> None:
    """After loading: every kbit module holds packed tensors of the right shape, dtype and values."""
    for name, module in model.named_modules():
        packed_shapes = getattr(module, "packed_shapes", None)
        if packed_shapes is None:
            continue
        placeholders = module.placeholders()
        if placeholders:
            raise KbitCheckpointError(f"'{name}.{placeholders[0]}' was never loaded: the checkpoint has no such weight")
        for tensor_name, shape in packed_shapes().items():
            t = getattr(module, tensor_name)
            dtype = _module_dtype(module, tensor_name)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise KbitCheckpointError(
                    f"'{name}.{tensor_name}' is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}"
                )
            if t.device.type == "meta":
                continue
            if tensor_name.endswith("codebook"):
                cb = t.reshape(-1, shape[-1])
                if not bool(torch.isfinite(cb).all()) or not bool((cb[:, 1:] > cb[:, :-1]).all()) or float(cb.abs().max()) > 1:
                    raise KbitCheckpointError(f"'{name}.{tensor_name}' is not a sorted codebook within [-1, 1]")
            elif tensor_name.endswith("block_scales") and t.dtype == fmt.RECORD_DTYPE:
                if bool((fmt.block_records(t)[1] < -fmt.OFFSET_MAX).any()):
                    raise KbitCheckpointError(f"'{name}.{tensor_name}' holds block offsets below -{fmt.OFFSET_MAX} "
                                              f"(format v4 records use -{fmt.OFFSET_MAX}..{fmt.OFFSET_MAX})")
            elif tensor_name.endswith("row_scales"):
                if not bool(((t > 0) & (t <= fmt.ROW_SCALE_MAX)).all()):  # NaN fails both
                    raise KbitCheckpointError(
                        f"'{name}.{tensor_name}' holds non-finite, non-positive or too large scales (at most "
                        f"{fmt.ROW_SCALE_MAX:.7g}, above which 31 x the scale overflows float32)"
                    )
