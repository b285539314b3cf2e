"""hf_kbit.eval.timing on the CPU: the greedy decode step chains the tokens ``generate`` picks (eager and traced
by dynamo with fullgraph=True), the decode loop's token check catches a loop that feeds back the wrong tokens, and
bad arguments are named. No timing assertions beyond "positive and finite"."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from tiny_models import tiny_llama as tiny_model

from hf_kbit.eval.timing import GreedyDecodeStep, measure_decode_loop, measure_speed, random_prompt

PROMPT_LEN, NEW_TOKENS = 8, 5


def greedy_generate(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, disable_compile=True)
    return out[:, prompt.shape[1]:]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "dynamo-fullgraph"])
@pytest.mark.parametrize(
    "dtype, bits", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 4)], ids=["fp32", "bf16", "kbit4"]
)
def test_step_chains_generates_greedy_tokens(dtype, bits, traced, fresh_dynamo):
    model = tiny_model(dtype, bits)
    prompt = random_prompt(model.config.vocab_size, 2, PROMPT_LEN, "cpu")
    expected = greedy_generate(model, prompt, NEW_TOKENS)
    assert len(set(expected.flatten().tolist())) > 2, "the test needs a model whose greedy tokens vary"

    step = GreedyDecodeStep(model, prompt, PROMPT_LEN + NEW_TOKENS)
    if traced:  # what the CUDA path compiles, traced here without inductor: no graph breaks allowed
        step.forward = torch.compile(step.forward, fullgraph=True, backend="eager")
    assert torch.equal(step.tokens(NEW_TOKENS), expected)
    # rewind() restores token, position and the cache's write position: a second pass repeats the first.
    assert torch.equal(step.tokens(NEW_TOKENS), expected)
    assert step.position.item() == PROMPT_LEN + NEW_TOKENS - 1
    assert all(layer.cumulative_length.item() == PROMPT_LEN + NEW_TOKENS - 1 for layer in step.cache.layers)


def test_step_passes_the_cache_under_the_name_the_forward_takes():
    """transformers >= 5.24 calls it ``cache`` and warns on ``past_key_values`` (removed in 5.40)."""
    model = tiny_model(torch.float32)
    step = GreedyDecodeStep(model, random_prompt(model.config.vocab_size, 1, PROMPT_LEN, "cpu"),
                                   PROMPT_LEN + 2)
    assert step.cache_arg in inspect.signature(model.forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        step()
    assert step.position.item() == PROMPT_LEN + 1


def test_step_rejects_bad_arguments():
    model = tiny_model(torch.float32)
    prompt = random_prompt(model.config.vocab_size, 1, PROMPT_LEN, "cpu")
    with pytest.raises(ValueError, match="max_cache_len must exceed prompt_len"):
        GreedyDecodeStep(model, prompt, PROMPT_LEN)
    with pytest.raises(ValueError, match="prompt must be int64"):
        GreedyDecodeStep(model, prompt.float(), PROMPT_LEN + 2)
    step = GreedyDecodeStep(model, prompt, PROMPT_LEN + 2)
    with pytest.raises(ValueError, match=r"n must be in \[1, 3\]"):
        step.tokens(4)


@pytest.mark.parametrize("dtype, bits", [(torch.float32, None), (torch.float32, 4)], ids=["fp32", "kbit4"])
def test_decode_loop_decodes_the_greedy_tokens(dtype, bits):
    model = tiny_model(dtype, bits)
    out = measure_decode_loop(model, 2, PROMPT_LEN, NEW_TOKENS, "cpu", repeats=1, warmup=0)
    assert out["loop_steps"] == NEW_TOKENS - 1
    assert out["loop_tokens_argmax_match"] == 1.0
    assert out["loop_decode_tok_s"] == pytest.approx(2 * 1000 / out["loop_step_ms"])


def test_decode_loop_check_sees_tokens_the_model_did_not_pick(monkeypatch):
    """The teacher-forced check is what vouches for the loop's tokens: a loop that feeds back another token
    than the argmax (here: the argmax + 1) must score below 1."""
    model = tiny_model(torch.float32)
    step_call = GreedyDecodeStep.__call__

    def off_by_one(self):
        step_call(self)
        with torch.inference_mode():
            self.ids.add_(1).remainder_(model.config.vocab_size)

    monkeypatch.setattr(GreedyDecodeStep, "__call__", off_by_one)
    out = measure_decode_loop(model, 2, PROMPT_LEN, NEW_TOKENS, "cpu", repeats=1, warmup=0)
    assert out["loop_tokens_argmax_match"] == pytest.approx(1 / NEW_TOKENS)  # only the prefill's token is right


def test_decode_loop_rejects_bad_arguments():
    model = tiny_model(torch.float32)
    with pytest.raises(ValueError, match="new_tokens must be >= 2 to time a decode loop, got 1"):
        measure_decode_loop(model, 1, PROMPT_LEN, 1, "cpu")
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        measure_decode_loop(model, 1, PROMPT_LEN, 2, "cpu", repeats=0)


def test_generate_speed_counts_every_token():
    model = tiny_model(torch.float32, 4)
    out = measure_speed(model, 2, PROMPT_LEN, 3, "cpu", static_compile=False, repeats=1, warmup=0)
    assert (out["batch"], out["prompt_len"], out["new_tokens"], out["compiled"]) == (2, PROMPT_LEN, 3, False)
    assert out["decode_tok_s"] > 0 and out["prefill_tok_s"] > 0
    assert 0 < out["token_ms_median"] <= out["token_ms_max"] < 1000 * out["generate_s"]
    with pytest.raises(ValueError, match="new_tokens must be >= 2 to time decoding, got 1"):
        measure_speed(model, 1, PROMPT_LEN, 1, "cpu", static_compile=False)
