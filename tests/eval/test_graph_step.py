"""hf_kbit.eval.graph_step's argument checks on the CPU (the CUDA graph itself runs on the GPU machine only); on the
CPU the same steps run eagerly."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama as tiny_model

from hf_kbit.eval.graph_step import measure_graph_step

PROMPT_LEN = 8


def test_graph_step_runs_the_steps_eagerly_on_the_cpu():
    model = tiny_model(torch.float32, 4)
    out = measure_graph_step(model, 2, PROMPT_LEN, 3, "cpu", repeats=1, warmup=0)
    assert out["graph_steps"] == 3 and out["graph_replay_tokens_match"] is None
    assert out["graph_kernel_breakdown"] is None
    assert out["graph_decode_tok_s"] == pytest.approx(2 * 1000 / out["graph_step_ms"])


def test_graph_step_rejects_bad_arguments():
    model = tiny_model(torch.float32)
    with pytest.raises(ValueError, match="steps_per_graph must be >= 1"):
        measure_graph_step(model, 1, PROMPT_LEN, 2, "cpu", steps_per_graph=0)
    with pytest.raises(ValueError, match="new_tokens must be >= 1 to time a decode step, got 0"):
        measure_graph_step(model, 1, PROMPT_LEN, 0, "cpu")
    with pytest.raises(ValueError, match="the kernel breakdown profiles CUDA kernels; device is 'cpu'"):
        measure_graph_step(model, 1, PROMPT_LEN, 2, "cpu", breakdown=True)
