"""GGUF files as plain (dequantized) transformers models: the one GGUF reader of kbit-convert, the demo and
hf_kbit.eval.

transformers reads GGUF (with the ``gguf`` package) and dequantizes every block to a dense tensor; newer
versions do that through a GGUF quantizer unless ``GgufConfig(dequantize=True)`` asks for a plain model, so
both are handled here and the model comes back without any quantization config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_gguf(path: str | Path, dtype=None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the GGUF file ``path``, dense and free of any quantization config.

    ``dtype``: the model's dtype (a torch dtype); None keeps transformers' default. Never runs code from the
    file's folder (``trust_remote_code=False``). Raises ImportError without the ``gguf`` package, and
    transformers' ValueError / KeyError / RuntimeError for a file it cannot read.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    kwargs: dict[str, Any] = {"gguf_file": path.name, "trust_remote_code": False}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:  # transformers >= 5.2x keeps GGUF blocks packed unless asked to dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(path.parent, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # a dequantizing GGUF quantizer: the saved folder must not name it
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def save_gguf_as_folder(path: str | Path, out: str | Path, dtype=None) -> Path:
    """Write the GGUF file ``path`` as a transformers folder ``out`` (config, safetensors, tokenizer): load_gguf,
    then ``save_pretrained``. The whole model is in memory meanwhile."""
    model, tokenizer = load_gguf(path, dtype)
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return out
