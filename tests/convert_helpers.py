"""Shared fixtures of the conversion, CLI and Hub tests: tiny config-built models (no downloads)
and the in-memory Hub test server. Import the fixtures you use into the test module."""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))

from hub_server import serve  # noqa: E402

TOKEN = "hf_TESTtoken0123456789secret"


def quiet_server_errors(server) -> None:
    """A client closing a connection early is normal; don't print tracebacks for it."""
    server.handle_error = lambda request, client_address: None


def make_tokenizer():
    """A character-level fast tokenizer built in memory (ids < 100)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_llama(folder: Path, dtype: torch.dtype = torch.float32, tie: bool = False, tokenizer: bool = True,
               max_shard_size: str = "60KB", seed: int = 0) -> Path:
    """A 2-layer Llama built from a config with random weights, saved sharded as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,  # not a multiple of the 128-wide tile: exercises padding
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if tokenizer:
        make_tokenizer().save_pretrained(folder)
    return folder


def make_moe(folder: Path, family: str = "qwen3_moe", layout: str = "per-expert", dtype: torch.dtype = torch.bfloat16,
             max_shard_size: str = "100KB", **sizes) -> Path:
    """A tiny MoE model (tests/tiny_models.py) saved sharded, its experts stored ``layout``:
    "per-expert" (``experts.3.gate_proj.weight``, ..., as Hub checkpoints and save_pretrained have
    them) or "fused" (``experts.gate_up_proj [E, 2I, H]``, save_pretrained(save_original_format=False);
    gpt_oss stores its experts fused either way). ``sizes`` replace config fields of the tiny model."""
    from tiny_models import tiny_moe_model

    model = tiny_moe_model(family, dtype, **sizes)
    model.save_pretrained(folder, max_shard_size=max_shard_size, save_original_format=layout == "per-expert")
    make_tokenizer().save_pretrained(folder)
    keys = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            keys |= set(sf.keys())
    per_expert = any(re.search(r"\.experts\.\d+\.", k) for k in keys)
    if per_expert != (layout == "per-expert"):
        raise AssertionError(f"{family}: save_pretrained wrote {'per-expert' if per_expert else 'fused'} experts")
    return folder


# Layouts transformers writes for each family: gpt_oss checkpoints hold fused experts only.
MOE_LAYOUTS = {
    "qwen3_moe": ("per-expert", "fused"),
    "mixtral": ("per-expert", "fused"),
    "deepseek_v3": ("per-expert", "fused"),
    "glm4_moe": ("per-expert", "fused"),
    "gpt_oss": ("fused",),
}


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """``moe_checkpoint(family, layout)``: a saved tiny MoE checkpoint, made once per session."""
    made = {}

    def get(family: str = "qwen3_moe", layout: str = "per-expert") -> Path:
        if (family, layout) not in made:
            made[family, layout] = make_moe(tmp_path_factory.mktemp(f"{family}-{layout}") / "model", family, layout)
        return made[family, layout]

    return get


@pytest.fixture(scope="session")
def llama_fp32(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama_fp32") / "model")


@pytest.fixture(scope="session")
def llama_bf16_tied(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama_bf16") / "model", dtype=torch.bfloat16, tie=True)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The in-memory Hub on 127.0.0.1, set as this process's endpoint, with a token in HF_TOKEN."""
    from huggingface_hub import constants

    url, state, server = serve(token=TOKEN)
    # huggingface_hub reads HF_ENDPOINT at import: point its constants at the server too.
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    quiet_server_errors(server)
    state.url = url
    state.cache = tmp_path / "hub-cache"
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def dead_endpoint(monkeypatch):
    """An endpoint on 127.0.0.1 where nothing listens (connection refused)."""
    from huggingface_hub import constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return url


def subprocess_env(endpoint: str | None = None, cache: Path | None = None) -> dict[str, str]:
    """Environment for a child Python process that imports this checkout's hf_kbit."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
        env["HF_TOKEN"] = TOKEN
    if cache:
        env["HF_HOME"] = str(cache)
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    return env
