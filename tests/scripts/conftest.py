"""Shared fixtures of the evaluation-script tests: a tiny config-built model and a tiny text, all offline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tiny_models import TINY_TEXT, save_tiny_text_model  # noqa: F401  (TINY_TEXT: the scripts' tests import it here)

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random Llama saved as a transformers folder with a char-level tokenizer (bf16 weights)."""
    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_llama"))
