"""hf_kbit.attention on the CPU: the packed single-token path against transformers' sdpa attention,
which calls take it, and generation with ``attn_implementation="kbit_decode"``.

The CUDA kernel is held to ``packed_sdpa`` by tests/gpu/test_attention_gpu.py.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_dense_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import AttentionInterface

import hf_kbit  # noqa: F401  (registers kbit_decode)
from hf_kbit import attention
from hf_kbit.backends import decode_attention

ATOL = 1e-5  # float32: the same math in another order


class _Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(batch, q_heads, kv_heads, kv_len, head_dim, mask_kind, mask_batch=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, 1, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g)
    rows = batch if mask_batch is None else mask_batch
    keep = torch.arange(kv_len)[None, :] < torch.randint(1, kv_len + 1, (rows,), generator=g)[:, None]
    keep = keep[:, None, None, :]
    mask = {"none": None, "bool": keep, "additive": torch.where(keep, 0.0, torch.finfo(torch.float32).min)}[mask_kind]
    return q, k, v, mask


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("batch,q_heads,kv_heads,kv_len,head_dim,mask_batch",
                         [(1, 32, 8, 40, 16, None), (3, 14, 2, 17, 8, None), (2, 6, 6, 9, 8, None),
                          (3, 8, 2, 12, 8, 1)])
def test_packed_path_matches_sdpa(batch, q_heads, kv_heads, kv_len, head_dim, mask_batch, mask_kind):
    q, k, v, mask = _inputs(batch, q_heads, kv_heads, kv_len, head_dim, mask_kind, mask_batch)
    layer = _Layer(q_heads // kv_heads)
    expected, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)
    assert attention.packed_group(q, k, v, mask) == q_heads // kv_heads
    out, weights = attention.decode_attention_forward(layer, q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == expected.shape == (batch, 1, q_heads, head_dim)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["prefill", "dropout", "softcap", "sinks", "per-head mask", "per-query mask",
                                  "cut mask", "uneven heads"])
def test_calls_the_packed_path_cannot_serve_go_to_sdpa(case, monkeypatch):
    q, k, v, mask = _inputs(2, 8, 2, 10, 8, "bool")
    kwargs = {}
    if case == "prefill":
        q = torch.randn(2, 8, 3, 8)
        mask = mask.expand(2, 1, 3, 10)
    elif case == "dropout":
        kwargs["dropout"] = 0.1
    elif case == "softcap":
        kwargs["softcap"] = 30.0
    elif case == "sinks":
        kwargs["s_aux"] = torch.zeros(8)
    elif case == "per-head mask":
        mask = mask.expand(2, 8, 1, 10)
    elif case == "per-query mask":
        q = torch.randn(2, 8, 2, 8)
        mask = mask.expand(2, 1, 2, 10)
    elif case == "cut mask":
        mask = mask[..., :9]
    elif case == "uneven heads":
        q = torch.randn(2, 9, 1, 8)
    assert attention.packed_group(q, k, v, mask, **kwargs) is None
    sentinel = (torch.zeros(1), None)
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **kw: sentinel)
    assert attention.decode_attention_forward(_Layer(4), q, k, v, mask, **kwargs) is sentinel


def test_registered_with_transformers():
    assert AttentionInterface()[attention.ATTN_IMPLEMENTATION] is attention.decode_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[attention.ATTN_IMPLEMENTATION] is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "phi3"])
def test_generate_matches_sdpa(family, monkeypatch):
    """Greedy tokens with kbit_decode equal sdpa's (static cache, batch 2; gemma3's sliding window comes in
    through the mask), and every decoded token went through the packed path."""
    model = tiny_dense_model(family, dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=12, do_sample=False, cache_implementation="static", pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    calls = []
    packed = attention.packed_sdpa
    monkeypatch.setattr(attention, "packed_sdpa", lambda *a: calls.append(1) or packed(*a))
    model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    assert len(calls) == 11 * model.config.num_hidden_layers  # every token after the prefill's, every layer


@pytest.mark.parametrize("batch,kv_len,expected", [
    (1, 16384, 33),  # 2 x 132 SMs / 8 key/value heads
    (8, 8192, 4),
    (1, 256, 4),  # one block of keys per slice at most
    (1, 1, 1),
    (64, 4096, 1),  # more (batch, head) pairs than the target: no slicing
])
def test_plan_splits_aims_at_two_programs_per_sm(batch, kv_len, expected):
    assert decode_attention.plan_splits(batch, 8, kv_len, 132) == expected


@pytest.mark.parametrize("case", ["no hook, transformers first", "no hook, hf_kbit first"])
def test_registered_whatever_imports_first(case):
    """kbit_decode is registered by ``import hf_kbit`` before or after transformers, without the .pth
    hook (hf_kbit on PYTHONPATH); tests/test_autoload.py covers the hook."""
    repo = Path(hf_kbit.__file__).resolve().parent.parent
    imports = {
        "no hook, transformers first": "from transformers import LlamaForCausalLM; import hf_kbit",
        "no hook, hf_kbit first": "import hf_kbit; from transformers import LlamaForCausalLM",
    }[case]
    script = f"""
import sys
sys.path.extend({site.getsitepackages()!r})  # started with -S: site-packages without their .pth files
{imports}
from transformers import LlamaConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
assert "hf_kbit" in sys.modules
config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM._from_config(config, attn_implementation="kbit_decode")
assert model.config._attn_implementation == "kbit_decode"
assert ALL_ATTENTION_FUNCTIONS["kbit_decode"].__module__ == "hf_kbit.attention"
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-S", "-c", script], check=True, env=env, timeout=300)


def _fake_model(top: str, sub: str | None = None, can_set: bool = True):
    from types import SimpleNamespace

    subs = {} if sub is None else {"vision_config": SimpleNamespace(_attn_implementation=sub, sub_configs={})}
    config = SimpleNamespace(_attn_implementation=top, sub_configs=dict.fromkeys(subs, None), **subs)
    calls = []
    model = SimpleNamespace(config=config, _can_set_attn_implementation=lambda: can_set,
                            set_attn_implementation=calls.append)
    return model, calls


@pytest.mark.parametrize("top,sub,can_set,switched", [
    ("sdpa", None, True, True),
    ("sdpa", "sdpa", True, True),
    ("sdpa", "eager", True, False),  # a sub-model on another attention: kbit_decode's sdpa fallback would be wrong
    ("eager", None, True, False),
    ("sdpa", None, False, False),  # a class whose attention cannot be set after it is built
])
def test_use_as_default_switches_only_models_wholly_on_sdpa(top, sub, can_set, switched):
    model, calls = _fake_model(top, sub, can_set)
    assert attention.use_as_default(model) is switched
    assert calls == ([attention.ATTN_IMPLEMENTATION] if switched else [])
