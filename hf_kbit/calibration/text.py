"""Calibration tokens: the end of a text, tokenized, in batches of consecutive sequences."""

from __future__ import annotations

import torch
from torch import nn

def calibration_batches(tokenizer, text: str, samples: int, seq_len: int, batch_size: int = 8) -> list[torch.Tensor]:
    """The last ``samples * seq_len`` tokens of ``text`` (no special tokens), as int64 batches
    ``[<= batch_size, seq_len]`` of consecutive, non-overlapping sequences.

    The end of the text, not its start: an evaluation that scores a corpus's first tokens can calibrate on
    its other end (the caller checks that the two do not meet).
    """
    for name, value in (("samples", samples), ("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"calibration {name} must be a positive int, got {value!r}")
    need = samples * seq_len
    chars = 8 * need  # no tokenizer here averages 8 characters per token, on prose or code
    while True:
        piece = text[-chars:] if chars < len(text) else text
        ids = tokenizer(piece, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        ids = ids[1:] if piece is not text else ids  # the first token may be a cut word
        if len(ids) >= need or piece is text:
            break
        chars *= 2
    if len(ids) < need:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than samples x seq_len = "
                         f"{samples} x {seq_len} = {need}")
    tokens = torch.tensor(ids[-need:], dtype=torch.int64).reshape(samples, seq_len)
    return list(tokens.split(batch_size))


def config_batches(config, model: nn.Module) -> list[torch.Tensor]:
    """The calibration token batches a :class:`hf_kbit.KbitConfig` with ``calibration_data`` asks for
    (:func:`calibration_batches` of its text), tokenized by its ``calibration_tokenizer`` or else by the
    tokenizer of ``model``'s folder or Hub repo (``model.config.name_or_path``)."""
    tokenizer = _load_tokenizer(config.calibration_tokenizer, model)
    samples, seq_len = config.calibration_shape()
    text = config.calibration_text()
    try:
        return calibration_batches(tokenizer, text, samples, seq_len)
    except ValueError as e:
        how = "" if not isinstance(config.calibration_data, str) or "\n" in config.calibration_data else (
            " (calibration_data was read as the text itself, not as a file name: no such file)")
        raise ValueError(f"KbitConfig.calibration_data: {e}{how}; pass more text, or lower calibration_samples "
                         "or calibration_seq_len") from None


def _load_tokenizer(tokenizer, model: nn.Module):
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    source = tokenizer or getattr(getattr(model, "config", None), "name_or_path", None)
    if not source:
        raise ValueError("KbitConfig.calibration_tokenizer: the model was not loaded from a folder or Hub repo, so its "
                         "tokenizer is unknown; pass calibration_tokenizer (a tokenizer, a repo id or a folder)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError) as e:
        what = "KbitConfig.calibration_tokenizer" if tokenizer else "the model's folder or repo"
        raise ValueError(f"calibration needs a tokenizer: {what} {source!r} has none that loads ({e}); pass "
                         "KbitConfig(calibration_tokenizer=...)") from None

