"""Checkpoint conversion: a Hugging Face model (folder, Hub repo or GGUF file) -> a kbit checkpoint.

The conversion streams the source safetensors shard by shard: only one source tensor group
and one output shard are in memory at a time. Which weights are quantized, and with how many
bits, is decided by the quantizer itself (:class:`~hf_kbit.quantizer.KbitHfQuantizer`) applied
to the model's skeleton on the meta device, so the output is bit-identical to quantize-on-load
(``from_pretrained(src, quantization_config=cfg).save_pretrained(out)``) with the same config.

Output is written into a hidden temporary folder next to ``out`` and renamed into place only
when complete; ``config.json`` is the last file written there, so an interrupted run never
leaves a folder that looks loadable.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checkpoint
from . import format as fmt
from .config import KbitConfig
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
_TMP_SUFFIX = ".kbit-tmp-"

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


class ConversionError(ValueError):
    """The input, output or options of a conversion are not usable; the message says why and what to do."""


# ---------------------------------------------------------------------------- plan


@dataclass
class TensorPlan:
    """One tensor of the output model and the checkpoint tensors it is made from.

    ``sources`` are checkpoint keys; ``combine`` turns their tensors (in ``sources`` order)
    into the one model tensor (``None``: the single source as is). A hook that merges
    per-expert checkpoint keys into a fused experts tensor returns plans with several
    sources and a ``combine``.
    """

    name: str  # model state-dict key (a quantized weight: "<module>.weight")
    sources: tuple[str, ...]
    shape: tuple[int, ...]  # shape of the combined tensor
    dtype: torch.dtype  # dtype it is cast to (before quantization, or for storage)
    bits: int | None = None  # None: stored unquantized
    source_nbytes: int = 0
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None

    @property
    def prefix(self) -> str:
        return self.name.rpartition(".")[0]

    def outputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{output key: (shape, dtype)}`` this tensor becomes."""
        if self.bits is None:
            return {self.name: (self.shape, self.dtype)}
        *lead, n, k = self.shape
        shapes = fmt.packed_shapes(n, k, self.bits)
        return {f"{self.prefix}.{t}": ((*lead, *shapes[t]), fmt.PACKED_DTYPES[t]) for t in FORMAT_TENSORS}

    def output_nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.outputs().values())


# A key rule claims checkpoint keys before the 1:1 default: it receives the checkpoint's
# {key: (shape, dtype)} not yet claimed, the meta skeleton and the planning context, and
# returns TensorPlans for the keys it handles (e.g. per-expert keys -> fused experts).
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

    @property
    def quantized(self) -> list[TensorPlan]:
        return [t for t in self.tensors if t.bits is not None]

    def stats(self) -> dict[str, Any]:
        """Sizes and bits per weight of the planned output (exact: computed from the format's shapes)."""
        q = self.quantized
        q_numel = sum(math.prod(t.shape) for t in q)
        q_nbytes = sum(t.output_nbytes() for t in q)
        bits_hist: dict[int, int] = {}
        for t in q:
            bits_hist[t.bits] = bits_hist.get(t.bits, 0) + 1
        return {
            "architecture": self.architecture,
            "dtype": str(self.dtype).removeprefix("torch."),
            "tensors": len(self.tensors),
            "quantized_tensors": len(q),
            "quantized_by_bits": dict(sorted(bits_hist.items())),
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
            f"size:          {format_bytes(s['size_before_bytes'])} -> {format_bytes(s['size_after_bytes'])}",
        ]
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
    files = _safetensors_files(source)
    headers = {path: checkpoint.read_safetensors_header(path) for path in files}
    ckpt: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    ckpt_nbytes: dict[str, int] = {}
    for header in headers.values():
        for key, info in header.items():
            if key == "__metadata__":
                continue
            ckpt[key] = (tuple(info["shape"]), _SAFETENSORS_DTYPES.get(info["dtype"]) or info["dtype"])
            ckpt_nbytes[key] = info["data_offsets"][1] - info["data_offsets"][0]
    dtype = _resolve_dtype(dtype, hf_config, ckpt)

    model = _skeleton(model_cls, hf_config, dtype, kbit_config)
    quantizer = model._kbit_quantizer
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    model_tensors = {k: (tuple(t.shape), t.dtype) for k, t in _model_tensors(model).items()}
    quantized = {
        name: model.get_submodule(name.rpartition(".")[0]).bits
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

    prefix = getattr(model, "base_model_prefix", "")
    dropped = []
    for key, (shape, src_dtype) in unclaimed.items():
        name = key if key in model_tensors else f"{prefix}.{key}" if f"{prefix}.{key}" in model_tensors else None
        if name is None or name in tied:
            dropped.append(key)
            continue
        want_shape, want_dtype = model_tensors[name]
        if shape != want_shape:
            raise ConversionError(
                f"checkpoint tensor '{key}' has shape {shape} but {hf_config.architectures or model_cls.__name__} "
                f"expects {want_shape} from config.json; the checkpoint and config.json do not match"
            )
        is_float = isinstance(src_dtype, torch.dtype) and src_dtype.is_floating_point
        if not is_float:
            if name in quantized:
                raise ConversionError(f"checkpoint tensor '{key}' is {src_dtype}; kbit quantizes floating-point weights")
            if isinstance(src_dtype, torch.dtype):
                want_dtype = src_dtype  # integer tensors load as they are stored
        plans.append(
            TensorPlan(name, (key,), shape, want_dtype, bits=quantized.get(name), source_nbytes=ckpt_nbytes[key])
        )

    planned = {p.name for p in plans}
    missing = sorted(set(model_tensors) - planned - tied)
    if missing:
        if any(re.search(r"\.experts\.\d+\.", key) for key in dropped):
            raise ConversionError(
                f"{source} stores MoE experts per expert (e.g. '{next(k for k in dropped if '.experts.' in k)}'), "
                f"while {model_cls.__name__} holds fused experts; converting per-expert checkpoints is not "
                "supported yet"
            )
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
        dropped=sorted(dropped),
    )


def _load_architecture(source: Path):
    import transformers

    if not (source / "config.json").is_file():
        raise ConversionError(f"{source} is not a model folder: it has no config.json")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(source)
    except (ValueError, KeyError) as e:
        raise ConversionError(
            f"unsupported architecture in {source}/config.json: transformers {transformers.__version__} cannot "
            f"read it ({e}). Upgrade transformers or check model_type."
        ) from None
    if getattr(hf_config, "quantization_config", None):
        method = _get(hf_config.quantization_config, "quant_method")
        raise ConversionError(
            f"{source} is already quantized (quant_method={method!r}); convert the full-precision model instead"
        )
    archs = getattr(hf_config, "architectures", None) or []
    model_cls = getattr(transformers, archs[0], None) if archs else None
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


def _safetensors_files(source: Path) -> list[Path]:
    files = sorted(source.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in source.glob("*.bin")) + sorted(p.name for p in source.glob("*.pt*"))
        hint = (
            f" It has {other[0]}: kbit-convert reads safetensors only (pickle files can run code); "
            "convert them with transformers' save_pretrained(safe_serialization=True) first."
            if other
            else ""
        )
        raise ConversionError(f"{source} has no *.safetensors weights.{hint}")
    index = source / "model.safetensors.index.json"
    if index.is_file():
        listed = sorted({source / f for f in json.loads(index.read_text())["weight_map"].values()})
        absent = [p.name for p in listed if not p.is_file()]
        if absent:
            raise ConversionError(f"{source} lacks shard(s) listed in its index, e.g. {absent[0]}; download them first")
        return listed
    return files


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
        packed = set(FORMAT_TENSORS) if hasattr(module, "packed_shapes") else set()
        for bname, buf in module.named_buffers(recurse=False):
            if buf is not None and bname not in module._non_persistent_buffers_set and bname not in packed:
                tensors[f"{name}.{bname}" if name else bname] = buf
    return tensors


# ---------------------------------------------------------------------------- sources


def resolve_source(
    model: str | os.PathLike, workdir: Path, revision: str | None = None
) -> tuple[Path, dict[str, Any]]:
    """A local model folder for ``model`` (folder, ``.gguf`` file or Hub repo id) and facts for the card."""
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
    return _download(str(model), revision), {"kind": "hub", "name": str(model), "revision": revision}


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS))
    except RevisionNotFoundError:
        raise ConversionError(f"{repo_id}: revision {revision!r} not found on {constants.ENDPOINT}") from None
    except RepositoryNotFoundError:
        raise ConversionError(
            f"{repo_id}: not a local folder, and no such repo on {constants.ENDPOINT} (or it is private/gated: "
            "log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ConversionError(
            f"{repo_id}: not a local folder, and {constants.ENDPOINT} could not be reached "
            f"({type(e).__name__}). Check the network or HF_ENDPOINT, or pass a local folder."
        ) from None


def _dequantize_gguf(path: Path, workdir: Path) -> Path:
    """GGUF -> a plain Hugging Face folder (transformers dequantizes; the whole model is in memory here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = workdir / "gguf-dequantized"
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except ImportError as e:
        raise ConversionError(f"reading GGUF needs the gguf package: `pip install gguf` ({e})") from None
    except (ValueError, KeyError, RuntimeError) as e:
        raise ConversionError(f"{path}: transformers cannot load this GGUF file ({e})") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # transformers >= 5.2x loads GGUF through a (dequantizing) quantizer
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return out


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
    if not dry_run:
        check_output(out, overwrite)
    if eval_text is not None and not eval_text.strip():
        raise ConversionError("eval_text is empty")

    workdir = Path(tempfile.mkdtemp(prefix="kbit-convert-"))
    try:
        source, source_info = resolve_source(model, workdir, revision)
        if source_info["kind"] == "hub" and base_model is None:
            base_model = source_info["name"]
        if not dry_run and out.resolve() == source.resolve():
            raise ConversionError(f"out ({out}) is the source folder; choose another output folder")
        plan = plan_conversion(source, kbit_config, dtype, key_rules)
        if dry_run:
            return plan
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{_TMP_SUFFIX}", dir=_parent(out)))
        try:
            stats = _write(plan, tmp, device, shard_bytes, progress)
            _copy_extras(source, tmp)
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
            _write_config(source, tmp, plan)  # last: its presence marks a complete checkpoint
            _replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return ConversionResult(out=out, plan=plan, stats=stats, eval=eval_result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty ``out`` unless ``overwrite``; check its parent is writable. Cheap, run first."""
    if out.exists() and not out.is_dir():
        raise ConversionError(f"out={out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConversionError(f"out={out} is not empty; pass --overwrite (overwrite=True) to replace it")
    parent = _parent(out)
    if not parent.is_dir():
        raise ConversionError(f"the parent folder of out={out} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConversionError(f"cannot write to {parent} (needed for out={out})")


def _parent(out: Path) -> Path:
    return out.resolve().parent


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
        from safetensors.torch import save_file

        if not self.current:
            return
        name = f"part-{len(self.shards):05d}.safetensors"
        save_file(self.current, self.folder / name, metadata={"format": "pt"})
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


@torch.no_grad()
def _write(plan: ConversionPlan, folder: Path, device: torch.device, shard_bytes: int, progress: bool) -> dict:
    """Stream the source shards into kbit output shards; returns sizes measured on what was written."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    from .nn.linear import quantize_weight

    by_source = {key: p for p in plan.tensors for key in p.sources}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    writer = _ShardWriter(folder, shard_bytes)
    codebooks = {}
    q_numel = q_bytes = 0
    bar = tqdm(total=len(plan.tensors), desc="Converting", unit="tensor", disable=not progress)
    for path in plan.files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                p = by_source.get(key)
                if p is None:
                    continue
                group = pending.setdefault(p.name, {})
                group[key] = f.get_tensor(key)
                if len(group) < len(p.sources):
                    continue
                del pending[p.name]
                parts = [group[k] for k in p.sources]
                tensor = p.combine(parts) if p.combine is not None else parts[0]
                del group, parts
                tensor = tensor.to(p.dtype)
                if p.bits is None:
                    writer.add(p.name, tensor)
                else:
                    if p.bits not in codebooks:
                        codebooks[p.bits] = fmt.make_codebook(plan.kbit_config.codebook, p.bits)
                    codebook = codebooks[p.bits]
                    packed = quantize_weight(tensor.to(device), codebook.to(device), name=p.name)
                    packed = (*(t.cpu() for t in packed), codebook.clone())
                    for t_name, t in zip(FORMAT_TENSORS, packed):
                        writer.add(f"{p.prefix}.{t_name}", t)
                        q_bytes += t.numel() * t.element_size()
                    q_numel += tensor.numel()
                del tensor
                bar.update(1)
    bar.close()
    if pending:
        name, group = next(iter(pending.items()))
        raise ConversionError(f"'{name}' is incomplete: the checkpoint files hold only {sorted(group)} of its sources")
    shards = writer.finish()
    return {
        **plan.stats(),
        "size_after_bytes": writer.total_bytes,
        "files_bytes_after": sum((folder / s).stat().st_size for s in shards),
        "bits_per_quantized_weight": 8 * q_bytes / q_numel if q_numel else None,
        "shards": len(shards),
    }


def _copy_extras(source: Path, folder: Path) -> None:
    for name in COPIED_FILE_PATTERNS:
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)


def output_config(source: Path, plan: ConversionPlan) -> dict[str, Any]:
    """The source's config.json with the kbit ``quantization_config`` and the output dtype."""
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = plan.kbit_config.to_dict()
    config["dtype"] = str(plan.dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    return config


def _write_config(source: Path, folder: Path, plan: ConversionPlan) -> None:
    tmp = folder / "config.json.partial"
    tmp.write_text(json.dumps(output_config(source, plan), indent=2, sort_keys=True) + "\n")
    tmp.rename(folder / "config.json")


def _replace(tmp: Path, out: Path) -> None:
    """Move the complete ``tmp`` to ``out``; an existing ``out`` is removed only after the swap."""
    # mkdtemp (and some writers) create owner-only modes; give the output the usual umask modes.
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.kbit-old-", dir=_parent(out)))
        out.rename(old / "out")
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def _python_call(model, out, cfg: KbitConfig) -> str:
    return f"hf_kbit.convert({str(model)!r}, {str(out)!r}, KbitConfig(bits={cfg.bits}))"


def command_line(argv: Sequence[str]) -> str:
    """The command as typed, for the card (argv[0] shortened to the program name)."""
    return shlex.join(["kbit-convert", *argv])


def format_bytes(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    raise AssertionError


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
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    except (OSError, ValueError) as e:
        raise ConversionError(f"--eval needs a tokenizer in the model folder ({e})") from None
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens].to(device)
    if ids.shape[1] < 2:
        raise ConversionError("the eval text has fewer than 2 tokens")
    result = {"text": name, "tokens": int(ids.shape[1]), "dtype": str(dtype).removeprefix("torch.")}
    config_dict = dict(converted_config)
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    for label, folder, kwargs in (("base", source, {}), ("kbit", converted, {"config": config})):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(device).eval()
        loss = model(ids, labels=ids).loss
        result[f"{label}_perplexity"] = float(torch.exp(loss.float()))
        del model
    return result

