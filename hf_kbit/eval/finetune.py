"""The LoRA training step that the fine-tuning benchmarks time: a random-weight model (hf_kbit.eval.presets or
any transformers config) as bf16, kbit QLoRA or bitsandbytes NF4 QLoRA, LoRA on every linear layer of the
decoder, and one optimizer step. ``scripts/bench_finetune.py`` times it on the GPU; ``scripts/profile_lora_host.py``
measures its host time on the CPU."""

from __future__ import annotations

# The decoder's linear layers that LoRA adapts (the LM head and embeddings stay frozen).
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_variant(variant: str) -> None:
    from ..kernel_table import SUPPORTED_BITS

    if variant not in ("bf16", "nf4") and not (
        variant.startswith("kbit") and variant[4:].isdigit() and int(variant[4:]) in SUPPORTED_BITS
    ):
        raise ValueError(f"--variants: {variant!r} is not bf16, nf4 or kbit<k> with k in {SUPPORTED_BITS}")


def build_variant(config, variant: str, device: str, seed: int = 0):
    """The random-weight bf16 model of ``config`` (same seed, same weights), its decoder linears converted for
    ``variant`` (``bf16``, ``kbit<k>``: hf_kbit.quantize_model with q/k/v and gate/up fused as on load, ``nf4``),
    on ``device``, without a KV cache."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_kbit

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    if variant.startswith("kbit"):
        hf_kbit.quantize_model(model, hf_kbit.KbitConfig(bits=int(variant[4:])), modules_to_not_convert=["lm_head"])
    elif variant == "nf4":
        to_nf4(model)
    return model


def to_nf4(model) -> None:
    """Every decoder nn.Linear -> bitsandbytes Linear4bit (NF4, bf16 compute), as BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bfloat16) loads them; the model is marked as peft expects."""
    import bitsandbytes as bnb
    import torch

    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or name.rpartition(".")[2] not in LINEARS:
            continue
        q = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        weight = module.weight.data
        q.weight = bnb.nn.Params4bit(weight.cpu() if weight.is_cuda else weight, requires_grad=False,
                                     quant_type="nf4").to(weight.device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, q)
        del module, weight
    model.is_loaded_in_4bit = True  # what peft's bitsandbytes dispatch and prepare helpers read


def add_lora(model, variant: str, rank: int):
    """LoRA of rank ``rank`` (alpha 2 x rank, no dropout) on :data:`LINEARS`: through hf_kbit.lora for kbit
    variants, peft's own layers otherwise."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LINEARS),
                             task_type="CAUSAL_LM")
    if variant.startswith("kbit"):
        from .. import lora

        return lora.get_peft_model(model, config)
    return peft.get_peft_model(model, config)


LOSSES = ("chunked", "transformers")  # the loss the step computes: hf_kbit.loss.causal_lm_loss or transformers' own


def training_setup(config, variant: str, device: str, rank: int = 16, gradient_checkpointing: bool = True,
                   batch_size: int = 1, seq_len: int = 2048, loss: str = "chunked"):
    """``(model, optimizer, input_ids)`` of one variant: :func:`build_variant` with :func:`add_lora`, gradient
    checkpointing on every layer (non-reentrant) unless turned off, in train mode; AdamW on the adapters (float32,
    peft's default); one batch of random token ids (seeded). ``loss``: ``"chunked"`` computes the loss with
    :func:`hf_kbit.loss.causal_lm_loss` (same value, no float32 logits held), ``"transformers"`` with the model's
    own."""
    import torch

    from .. import loss as _loss
    from ..lora import enable_checkpointing

    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    model = add_lora(build_variant(config, variant, device), variant, rank)
    if loss == "chunked":
        _loss.use_chunked_loss(model)
    if gradient_checkpointing:
        enable_checkpointing(model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=gen).to(device)
    return model, opt, ids


def train_step(model, opt, ids):
    """Forward (loss on ``ids`` as labels), backward, optimizer step; returns the loss (not read: no host sync)."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
