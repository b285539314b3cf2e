"""Where a conversion reads from: a local folder, a Hub repo (downloaded) or a GGUF file (dequantized by
hf_kbit.gguf), and the architecture its config.json names."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .._paths import (
    ConversionError,
    source_file,
)

# What is fetched from a Hub repo: weights, configs, tokenizer files.
HUB_ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.model", "*.txt", "*.jinja"]


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


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

    from ..hub import redact

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
    from ..gguf import save_gguf_as_folder

    try:
        return save_gguf_as_folder(path, workdir / "gguf-dequantized")
    except ImportError as e:
        raise ConversionError(f"reading GGUF needs the gguf package: `pip install gguf` ({e})") from None
    except (ValueError, KeyError, RuntimeError) as e:
        raise ConversionError(f"{path}: transformers cannot load this GGUF file ({e})") from None
