"""hf_kbit.eval.models: the device and dtype of a run, a ``--model`` resolved to a folder, and bf16 / kbit
variants of a folder loaded for measuring (all offline, on a tiny saved model)."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_models import TINY_TEXT, save_tiny_text_model

from hf_kbit.eval.models import (
    OFFLINE_MODELS,
    check_attention,
    dtype_name,
    load_bits_variant,
    pick_device,
    pick_dtype,
    resolve_model,
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_llama"))


def test_device_and_dtype_choices():
    assert pick_device("cpu") == "cpu"
    assert pick_dtype("auto", "cpu") == torch.float32 and pick_dtype("auto", "cuda") == torch.bfloat16
    assert dtype_name(pick_dtype("bf16", "cpu")) == "bfloat16"
    with pytest.raises(ValueError, match="--dtype must be auto or one of"):
        pick_dtype("int8", "cpu")
    with pytest.raises(ValueError, match="--attention must be one of default, sdpa, kbit_decode, got 'eager'"):
        check_attention("eager")


def test_resolve_model_takes_a_folder_and_names_what_it_expects(tiny_folder, tmp_path):
    folder, info = resolve_model(str(tiny_folder))
    assert folder == tiny_folder and info["source"] == "transformers folder"
    with pytest.raises(FileNotFoundError, match=re.escape(f"expected one of {sorted(OFFLINE_MODELS)}")):
        resolve_model(str(tmp_path / "missing"))


def test_kbit_reference_forward_matches_dequantized(tiny_folder):
    """Dequantizing on CPU is a speed shortcut only: the kbit reference forward gives the same loss."""
    from transformers import AutoTokenizer

    from hf_kbit.eval import perplexity as pp

    ids = pp.tokenize(AutoTokenizer.from_pretrained(tiny_folder), TINY_TEXT, 48)
    windows = pp.make_windows(len(ids), 48, 48)
    ref, info = load_bits_variant(tiny_folder, 4, "cpu", torch.float32, dequantize_on_cpu=False)
    deq, _ = load_bits_variant(tiny_folder, 4, "cpu", torch.float32, dequantize_on_cpu=True)
    assert info["kbit_forward"] == "reference"
    assert pp.score_windows(ref, ids, windows)[0] == pytest.approx(pp.score_windows(deq, ids, windows)[0], rel=1e-4)


def test_lm_head_bits_refuses_a_tied_head_and_bf16(tiny_folder, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tied = AutoModelForCausalLM.from_pretrained(tiny_folder, tie_word_embeddings=True)
    tied.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--lm-head-bits: the LM head of .* is tied to its input embedding"):
        load_bits_variant(tmp_path, 4, "cpu", torch.float32, lm_head_bits=4)
    with pytest.raises(ValueError, match="lm_head_bits quantizes the LM head of a kbit variant; bits is None"):
        load_bits_variant(tiny_folder, None, "cpu", torch.float32, lm_head_bits=4)
