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


def tiny_dense_model(family: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer model of ``family`` with random weights; ``overrides`` replace config fields."""
    config_cls, model_cls, extra = DENSE_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    # Random init is N(0, 0.02): scale up so logits are not dominated by the embedding alone.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return model.to(dtype).eval()



def tiny_llama(dtype: torch.dtype = torch.bfloat16, bits: int | None = None, fuse_projections: bool = True,
               **overrides):
    """The tiny Llama of tiny_dense_model, quantized in memory at ``bits`` (LM head kept) when given."""
    import hf_kbit

    model = tiny_dense_model("llama", dtype, **overrides)
    if bits:
        config = hf_kbit.KbitConfig(bits=bits, fuse_projections=fuse_projections)
        model = hf_kbit.quantize_model(model, config, modules_to_not_convert=["lm_head"])
    return model


# MoE families (transformers v5 fused `*.experts` modules). moe_intermediate_size 40: the down
# projection's K is not a multiple of the 32-element block.
_DEEPSEEK_MOE = dict(n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
_MLA = dict(
    num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16,
)
MOE_FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 24, "moe_intermediate_size": 40, "num_experts": 8}
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "intermediate_size": 40}),
    "deepseek_v3": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM", {"moe_intermediate_size": 40, **_DEEPSEEK_MOE, **_MLA}
    ),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {"head_dim": 24, "moe_intermediate_size": 40, **_DEEPSEEK_MOE}),
    "gpt_oss": (
        "GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 8, "intermediate_size": 40, "sliding_window": 16}
    ),
}


def tiny_moe_model(family: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer MoE model of ``family`` (8 experts, top-2) with random weights; ``overrides`` replace config fields."""
    config_cls, model_cls, extra = MOE_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, "num_experts_per_tok": 2, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # as tiny_dense_model; expert weights (3-D) and routers too
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    return model.to(dtype).eval()


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


def save_tiny_text_model(folder):
    """A tiny random Llama (bf16 weights, untied LM head) with a char-level tokenizer over TINY_TEXT, saved as a
    transformers folder; returns the folder. K = 128 and 256: every anchor's group size divides it."""
    tokenizer = char_tokenizer(TINY_TEXT)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
