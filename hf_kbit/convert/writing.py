"""Writing a planned conversion: sources read tensor by tensor (fused experts a few experts at a time),
quantized, and added to output shards; then the output config.json."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .. import fitting, head_rotation, rotation_policy
from .. import format as fmt
from .._paths import (
    ConversionError,
)
from ..config import KbitConfig
from ..nn.experts import PROJECTIONS, KbitExperts, chosen_basis, experts_candidates, pack_experts_chunk
from .plan import ConversionPlan, TensorPlan
from .sources import _first_line


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

    from ..nn.fused import codebook_siblings
    from ..nn.linear import check_weight, quantize_siblings

    writer = _ShardWriter(folder, shard_bytes)
    q_numel = q_bytes = rotated = 0
    # In the order the source shards hold the tensors (a plan comes when its last source is reached).
    order = sorted(plan.tensors, key=lambda p: max(plan.locations[k] for k in p.sources))
    bar = tqdm(total=len(order), desc="Converting", unit="tensor", disable=not progress)
    config = plan.kbit_config
    # Siblings that share a codebook fitted on all of them, or a rotation decided on all of them ("auto"), as
    # quantize-on-load: held until the last arrives.
    siblings = codebook_siblings({
        p.prefix: (p.shape[-1], p.bits)
        for p in plan.tensors
        if p.bits is not None and p.experts is None and (
            fitting.codebook_needs_data(config.fitting, p.bits, config.codebook) or config.rotation == "auto")
    })
    waiting: dict[tuple[str, ...], dict[str, tuple[TensorPlan, torch.Tensor]]] = {}
    with contextlib.ExitStack() as stack:
        reader = _SourceReader(plan, stack)
        for p in order:
            if p.bits is None:
                writer.add(plan.output_key(p.name), _turned(plan, p.name, reader.tensor(p)))
                bar.update(1)
                continue
            try:
                if p.experts is None:
                    group = siblings.get(p.prefix, (p.prefix,))
                    tensor = _turned(plan, p.name, reader.tensor(p).to(device))
                    check_weight(tensor, p.name)  # errors name this tensor's sources, before it waits for siblings
                    waiting.setdefault(group, {})[p.prefix] = (p, tensor)
                    del tensor
                    if len(waiting[group]) < len(group):
                        continue
                    members = [waiting[group][name] for name in group]
                    del waiting[group]
                    packed = quantize_siblings(
                        [t for _, t in members], p.bits, config.codebook, config.fitting, [m.name for m, _ in members],
                        config.rotation, config.rotation_seed, config.block_offsets,
                    )
                    done = [(m, _outputs(m, tensors)) for (m, _), tensors in zip(members, packed)]
                    del members, packed
                else:
                    done = [(p, _quantize_experts(p, reader, config, device))]
            except ConversionError:
                raise
            except (ValueError, TypeError) as e:  # quantize_weight's checks (NaN/Inf, ...) name the model tensor
                raise ConversionError(f"{e} ({_sources_of(plan, p)}); fix the source weights, or keep "
                                      f"'{p.prefix}' in full precision with --skip-modules") from None
            for member, outputs in done:
                for key, t in outputs.items():
                    writer.add(plan.output_key(key), t)
                    q_bytes += t.numel() * t.element_size()
                q_numel += math.prod(member.shape)
                rotated += member.signs_key() in outputs
                bar.update(1)
            del done
    bar.close()
    return _written_stats(plan, writer, folder, q_numel, q_bytes, rotated)


def _outputs(p: TensorPlan, packed: tuple) -> dict[str, torch.Tensor]:
    """The output tensors of the quantized weight ``p`` by key, on the CPU: ``packed`` is ``(planes, block_scales,
    row_scales, codebook, rotation_signs or None)``."""
    *tensors, signs = packed
    keys = [key for key in p.outputs() if key != p.signs_key()]
    outputs = dict(zip(keys, (t.cpu() for t in tensors)))
    if signs is not None:
        outputs[p.signs_key()] = signs.cpu()
    return outputs


def _turned(plan: ConversionPlan, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` turned per attention head when ``head_rotation`` turns the parameter ``name``, as quantize-on-load
    turns it (:mod:`hf_kbit.head_rotation`)."""
    turn = plan.head_turns.get(name)
    return tensor if turn is None else head_rotation.turn(tensor, *turn)


@torch.no_grad()
def _write_calibrated(plan: ConversionPlan, folder: Path, device: torch.device, shard_bytes: int, progress: bool) -> dict:
    """:func:`_write` for a config with ``calibration_data``: calibration runs the model, so the source is loaded
    whole (unquantized, in ``plan.dtype``, onto ``device``) and quantized by :func:`hf_kbit.nn.quantize_model` with
    the modules quantize-on-load keeps (what ``from_pretrained(src, quantization_config=cfg)`` runs); its packed
    tensors are written, and the unquantized tensors copied from the sources as :func:`_write` does."""
    from tqdm.auto import tqdm

    from ..nn.replace import quantize_model
    from ..quantizer import KbitHfQuantizer
    from .sources import _load_architecture

    _, model_cls = _load_architecture(plan.source)
    model = model_cls.from_pretrained(plan.source, dtype=plan.dtype, device_map={"": device}, trust_remote_code=False)
    config = plan.kbit_config
    try:
        quantize_model(model, config, KbitHfQuantizer(config).skipped_modules(model), progress=progress)
    except ValueError as e:  # the calibration text or tokenizer (the message names the KbitConfig field)
        raise ConversionError(str(e)) from None
    state = model.state_dict()
    del model
    writer = _ShardWriter(folder, shard_bytes)
    q_numel = q_bytes = rotated = 0
    order = sorted(plan.tensors, key=lambda p: max(plan.locations[k] for k in p.sources))
    bar = tqdm(total=len(order), desc="Writing", unit="tensor", disable=not progress)
    with contextlib.ExitStack() as stack:
        reader = _SourceReader(plan, stack)
        for p in order:
            if p.bits is None:
                writer.add(plan.output_key(p.name), reader.tensor(p))
            else:
                signs = p.signs_key()  # in the state when quantize_model stored the weight rotated
                keys = [*(k for k in p.outputs() if k != signs), *([signs] if signs in state else [])]
                for key in keys:
                    t = state.pop(key).cpu()
                    writer.add(plan.output_key(key), t)
                    q_bytes += t.numel() * t.element_size()
                q_numel += math.prod(p.shape)
                rotated += signs in keys
            bar.update(1)
    bar.close()
    return _written_stats(plan, writer, folder, q_numel, q_bytes, rotated)


def _written_stats(plan: ConversionPlan, writer: _ShardWriter, folder: Path, q_numel: int, q_bytes: int,
                   rotated: int) -> dict:
    """The plan's statistics with the sizes measured on what ``writer`` wrote (its shards finished here), how
    many quantized tensors are stored rotated (format v3) and the format version (v4 with block records)."""
    shards = writer.finish()
    return {
        **plan.stats(),
        "size_after_bytes": writer.total_bytes,
        "files_bytes_after": sum((folder / s).stat().st_size for s in shards),
        "bits_per_quantized_weight": 8 * q_bytes / q_numel if q_numel else None,
        "shards": len(shards),
        "rotated_tensors": rotated,
        "format_version": fmt.version_of(bool(rotated), any(p.block_offsets for p in plan.tensors)),
    }


def _quantize_experts(p: TensorPlan, reader: _SourceReader, config: KbitConfig, device) -> dict[str, torch.Tensor]:
    """The packed tensors of the fused experts weight ``p``, built a chunk of experts at a time as
    ``KbitExperts.pack`` builds them (what quantize-on-load runs). The experts share one codebook, fitted first
    on the rows quantize-on-load samples from the whole weight (read once more, chunk by chunk), and one basis:
    under ``rotation="auto"`` every chunk is packed both ways (the packed chunks wait on the CPU) and the basis
    of lower error over all experts is kept."""
    from ..nn.linear import check_weight

    module_name, _, projection = p.name.rpartition(".")
    num_experts, step = p.shape[0], _expert_chunk(p)
    bits = p.bits
    settings = fitting.settings_for(config.fitting, bits, config.codebook)
    # A meta KbitExperts of all experts, and one of a chunk's: they check each chunk's shape.
    whole = KbitExperts(p.experts, gate_up_bits=bits, down_bits=bits, device="meta")
    total_rows = num_experts * whole.layout.linear_shape(projection)[0]
    chunks = [(start, min(start + step, num_experts)) for start in range(0, num_experts, step)]

    def chunk_weight(start, stop):
        rows = None if (start, stop) == (0, num_experts) else (start, stop)
        packer = KbitExperts(replace(p.experts, num_experts=stop - start), bits, bits, device="meta")
        return packer.linear_weight(projection, reader.tensor(p, rows).to(device), module_name)

    sample = []
    for start, stop in chunks if settings is not None and settings.lloyd_iters else ():
        weight = chunk_weight(start, stop)
        first = start * whole.layout.linear_shape(projection)[0]
        sample.append(fitting.codebook_sample(weight, settings, total_rows, first).float())
        del weight
    k = whole.layout.linear_shape(projection)[1]
    sample = torch.cat(sample) if sample else torch.empty(0, k, device=device)
    rotation = rotation_policy.for_weights(config.rotation, [f"{module_name}.{projection}"])
    candidates = experts_candidates(sample, bits, settings, config.codebook, rotation, config.rotation_seed)
    for start, stop in chunks:
        weight = chunk_weight(start, stop)
        check_weight(weight, f"{module_name}.{projection}")
        pack_experts_chunk(weight, candidates, settings)
        del weight
        for basis in candidates:
            basis.parts[-1] = tuple(t.cpu() for t in basis.parts[-1])
    packed = chosen_basis(candidates).packed(PROJECTIONS[projection])
    return {f"{module_name}.{name}": t.cpu() for name, t in packed.items()}


def output_config(source: Path, plan: ConversionPlan, format_version: int = 1) -> dict[str, Any]:
    """The source's config.json with the kbit ``quantization_config`` and the output dtype; ``format_version``:
    what was written (``stats["format_version"]``, :func:`hf_kbit.format.version_of`)."""
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {**plan.kbit_config.to_dict(), "format_version": format_version}
    config["dtype"] = str(plan.dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    return config


def _write_config(folder: Path, config: dict[str, Any]) -> None:
    tmp = folder / "config.json.partial"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.rename(folder / "config.json")
