"""Shared fixtures of the evaluation-script tests: a tiny config-built model and a tiny text, all offline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

# A few lines of Pride and Prejudice (public domain), enough for several windows of a char-level tokenizer.
TINY_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.\n\nHowever little known the feelings or views of such a man may be on his "
    "first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, "
    "that he is considered the rightful property of some one or other of their daughters.\n"
)


def char_tokenizer(text: str):
    """A character-level fast tokenizer over the characters of ``text`` (built offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for ch in sorted(set(text)):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random Llama saved as a transformers folder with a char-level tokenizer (bf16 weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer(TINY_TEXT)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
