"""Tiny config-built models of real architectures (random weights, no downloads)."""

from __future__ import annotations

import torch
import transformers

# Sizes chosen so that K is not a multiple of 128 and N not of 16 somewhere (padding paths).
_COMMON = dict(
    vocab_size=256,
    hidden_size=96,
    intermediate_size=200,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

DENSE_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 24, "sliding_window": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}


def tiny_dense_model(family: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = DENSE_FAMILIES[family]
    config = getattr(transformers, config_cls)(**_COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    # Random init is N(0, 0.02): scale up so logits are not dominated by the embedding alone.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return model.to(dtype).eval()
