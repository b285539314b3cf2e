"""The opt-in ``--eval`` check of a conversion: perplexity of the source and the converted model on a short text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .._paths import (
    ConversionError,
)

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
