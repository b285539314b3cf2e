"""Real-size models without a download: published config values of the benchmarked architectures (``PRESETS``),
their transformers config with the first N decoder layers (``make_config``) and a random-weight model built from
it (``build_model``), the same weights for the same seed. The benchmarks (bench_generate, bench_finetune,
bench_quantize, bench_moe) time these; ``tiny-*`` are small stand-ins for CPU smoke tests."""

from __future__ import annotations

from typing import Any

# Published config values (the models' config.json); tiny-* are small stand-ins for CPU smoke tests.
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "model_type": "llama",
        "title": "Llama-3-8B",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "title": "Qwen3-30B-A3B",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
    },
    "tiny-llama": {
        "model_type": "llama",
        "title": "tiny Llama (smoke test)",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe",
        "title": "tiny Qwen3-MoE (smoke test)",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
}


def make_config(preset: str, layers: int | None = None):
    """The transformers config of ``preset``, with the first ``layers`` decoder layers only."""
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    values = {k: v for k, v in PRESETS[preset].items() if k != "title"}
    full = values["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= full:
            raise ValueError(f"--layers must be in [1, {full}] for {preset}, got {layers}")
        values["num_hidden_layers"] = layers
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)


def build_model(config, device: str, dtype, seed: int = 0, attention: str = "default"):
    """Random-weight model from ``config`` on ``device`` (same seed, same weights), with transformers
    attention implementation ``attention`` (``"default"``: none named, transformers picks)."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_kbit  # noqa: F401  (registers "kbit_decode")

    torch.manual_seed(seed)
    with torch.device(device):
        named = {} if attention == "default" else {"attn_implementation": attention}
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **named)
    return model.eval()
