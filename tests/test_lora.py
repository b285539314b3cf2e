"""hf_kbit.lora: peft LoRA on kbit models. Wrapping, training steps, gradient checkpointing, compile,
adapter save/load on a kbit checkpoint, merging, MoE, transformers' Trainer. CPU, tiny models."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import hf_kbit
from hf_kbit import KbitConfig
from hf_kbit.nn import KbitExperts, KbitFusedProjections, KbitLinear
from hf_kbit.nn.replace import replace_kbit_with_linear
from tiny_models import tiny_dense_model, tiny_moe_model

peft = pytest.importorskip("peft", reason="LoRA tests need peft (the test extra installs it)")
from hf_kbit import lora  # noqa: E402  (needs peft)

transformers.utils.logging.set_verbosity_error()

# Logits of a reloaded adapter on a reloaded kbit checkpoint: the same float32 ops on the same tensors.
RELOAD_ATOL = 0.0
# merge_and_dequantize against the kbit model with adapters: W + BA once, against W x + B(A x).
MERGE_ATOL = 1e-4
# A merged k = 4 weight against the original, relative Frobenius error: quantization plus two small adapter steps stay
# well under it in the original basis; a weight left turned is about sqrt(2) away.
HEAD_ROTATION_MERGED_ERROR_MAX = 0.3


def kbit_model(dtype=torch.float32, bits=4, rotation=False, **overrides):
    """Tiny Llama, k-bit but for the LM head (as quantize-on-load), q/k/v and gate/up fused (intermediate 192:
    a multiple of 16; fitting "absmax": one codebook for all layers, which fusion needs)."""
    model = tiny_dense_model("llama", dtype, intermediate_size=192, **overrides)
    return hf_kbit.quantize_model(model, KbitConfig(bits=bits, modules_to_not_convert=["lm_head"], fitting="absmax",
                                                    rotation=rotation))


def lora_model(model, r=4, **kwargs):
    config = peft.LoraConfig(target_modules="all-linear", r=r, lora_alpha=2 * r, **kwargs)
    return lora.get_peft_model(model, config)


def batch(seed=0, n=2, t=24):
    ids = torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def train_steps(model, steps=2, lr=1e-2):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        loss = model(**batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_all_linear_wraps_every_kbit_linear_and_keeps_fusion():
    model = kbit_model()
    kbit_names = {n for n, m in model.named_modules() if isinstance(m, KbitLinear)}
    pm = lora_model(model)
    wrapped = {n.removeprefix("base_model.model.") for n, m in pm.named_modules() if isinstance(m, lora.KbitLoraLinear)}
    assert wrapped == kbit_names and len(wrapped) == 2 * 7
    assert not isinstance(pm.get_base_model().lm_head, peft.tuners.lora.LoraLayer)  # peft's all-linear rule
    fused = [m for m in pm.modules() if isinstance(m, KbitFusedProjections)]
    assert len(fused) == 4  # qkv and gate/up of both layers stay one launch each
    assert all(isinstance(m.get_base_layer(), KbitLinear) for m in pm.modules() if isinstance(m, lora.KbitLoraLinear))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_training_step_updates_only_adapters(dtype):
    pm = lora_model(kbit_model(dtype))
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    losses = train_steps(pm, steps=3)
    assert all(torch.isfinite(torch.tensor(losses)))
    after = pm.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)
    assert any(".lora_A." in k for k in changed) and any(".lora_B." in k for k in changed)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant):
    pm = lora_model(kbit_model())
    for p in pm.parameters():  # non-zero B so that every adapter gets a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    checkpointed = copy.deepcopy(pm)
    with warnings.catch_warnings():  # under the name the installed transformers does not deprecate
        warnings.simplefilter("error", FutureWarning)
        lora.enable_checkpointing(checkpointed, use_reentrant=reentrant)
    renamed = hasattr(pm, "activation_checkpointing_enable")
    on = "is_activation_checkpointing" if renamed else "is_gradient_checkpointing"
    assert getattr(checkpointed, on) and not getattr(pm, on)
    if reentrant:  # inputs of a reentrant checkpoint must require grad for the adapters inside to get one
        checkpointed.enable_input_require_grads()
    checkpointed.train()
    pm.train()
    grads = []
    for m in (pm, checkpointed):
        m(**batch()).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert grads[1][name] is not None, name
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4)


def test_compiled_training_step_matches_eager():
    pm = lora_model(kbit_model())
    for p in pm.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    compiled = copy.deepcopy(pm)
    grads = []
    torch._dynamo.reset()
    for m, fn in ((pm, pm), (compiled, torch.compile(compiled, backend="aot_eager"))):
        fn(**batch()).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4)


def loaded_kbit_model(folder):
    """The tiny Llama of kbit_model, quantized on load by transformers (k = 4, LM head in float32)."""
    tiny_dense_model("llama", torch.float32, intermediate_size=192).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=KbitConfig(bits=4), dtype=torch.float32)


def test_adapters_save_and_load_on_a_kbit_checkpoint(tmp_path):
    model = loaded_kbit_model(tmp_path / "full")
    model.save_pretrained(tmp_path / "base")
    pm = lora_model(model)
    train_steps(pm, steps=2)
    pm.save_pretrained(tmp_path / "adapter")
    pm.eval()
    ids = batch(seed=9)["input_ids"]
    with torch.no_grad():
        expected = pm(input_ids=ids).logits

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert isinstance(base.model.layers[0].self_attn.q_proj, KbitLinear)
    loaded = lora.load_adapter(base, str(tmp_path / "adapter"))
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, atol=RELOAD_ATOL, rtol=0)
    assert not any(p.requires_grad for p in loaded.parameters())  # inference unless is_trainable=True
    trainable = lora.load_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), str(tmp_path / "adapter"),
                                  is_trainable=True)
    assert any(p.requires_grad for p in trainable.parameters())


def test_merge_and_unload_names_the_alternative_and_merge_and_dequantize_merges():
    pm = lora_model(kbit_model())
    train_steps(pm, steps=2, lr=5e-2)
    pm.eval()
    ids = batch(seed=3)["input_ids"]
    with torch.no_grad():
        expected = pm(input_ids=ids).logits
    with pytest.raises(NotImplementedError, match="merge_and_dequantize"):
        pm.merge_and_unload()
    merged = lora.merge_and_dequantize(pm)
    assert not any(isinstance(m, (KbitLinear, KbitFusedProjections, peft.tuners.lora.LoraLayer)) for m in merged.modules())
    with torch.no_grad():
        logits = merged(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, atol=MERGE_ATOL, rtol=0)


def test_merge_and_dequantize_turns_v_and_o_back_after_head_rotation(tmp_path):
    """KbitConfig(head_rotation=True): adapters train in the turned basis; the merged model computes what the model
    with adapters did, and its v/o weights are back in the checkpoint's basis (near the original, not turned)."""
    original = tiny_dense_model("llama", torch.float32, intermediate_size=192, hidden_size=128)  # heads of 32
    original.save_pretrained(tmp_path / "full")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full", quantization_config=KbitConfig(
        bits=4, head_rotation=True), dtype=torch.float32)
    pm = lora_model(model)
    train_steps(pm, steps=2)
    pm.eval()
    ids = batch(seed=3)["input_ids"]
    with torch.no_grad():
        expected = pm(input_ids=ids).logits
        merged = lora.merge_and_dequantize(pm)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=MERGE_ATOL, rtol=0)
        for name in ("v_proj", "o_proj"):
            got = getattr(merged.model.layers[0].self_attn, name).weight
            want = getattr(original.model.layers[0].self_attn, name).weight
            assert float((got - want).norm() / want.norm()) < HEAD_ROTATION_MERGED_ERROR_MAX, name


def test_weight_based_inits_and_dora_are_refused():
    with pytest.raises(NotImplementedError, match="DoRA"):
        lora_model(kbit_model(), use_dora=True)
    with pytest.raises(NotImplementedError, match="decomposes the base weight"):
        lora_model(kbit_model(), init_lora_weights="pissa")


def test_moe_lora_on_attention_trains_through_frozen_kbit_experts():
    model = hf_kbit.quantize_model(tiny_moe_model("qwen3_moe", torch.float32), KbitConfig(bits=4))
    pm = lora.get_peft_model(model, peft.LoraConfig(target_modules="all-linear", r=4))
    assert any(isinstance(m, KbitExperts) for m in pm.modules())
    layer0 = pm.get_base_model().model.layers[0].self_attn.o_proj
    assert isinstance(layer0, lora.KbitLoraLinear)
    torch.nn.init.normal_(layer0.lora_B["default"].weight, std=0.05)
    pm(**batch()).loss.backward()  # layer 0's adapter gets its gradient through layer 1's kbit experts
    assert layer0.lora_A["default"].weight.grad.abs().sum() > 0
    with pytest.raises(NotImplementedError, match="packed buffers"):
        lora.lora_config(peft.LoraConfig(target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"]), model)


def test_prepare_model_for_kbit_training_then_lora():
    model = peft.prepare_model_for_kbit_training(kbit_model(torch.bfloat16), use_gradient_checkpointing=False)
    pm = lora_model(model)
    assert all(torch.isfinite(torch.tensor(train_steps(pm, steps=1))))


def test_trainer_runs_on_a_kbit_model_with_lora(tmp_path):
    kbit = loaded_kbit_model(tmp_path / "full")
    assert kbit.hf_quantizer.is_trainable
    data = [{k: v[0] for k, v in batch(seed=s, n=1).items()} for s in range(4)]
    # transformers 5.25 renamed the option (the old name warns until v6)
    fields = transformers.TrainingArguments.__dataclass_fields__
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, **{checkpointing: True},
    )
    with pytest.raises(ValueError, match="purely quantized"):  # the packed weights themselves cannot train
        transformers.Trainer(model=kbit, args=args, train_dataset=data)
    pm = lora_model(kbit)
    before = {k: v.clone() for k, v in pm.state_dict().items() if ".lora_B." in k}
    result = transformers.Trainer(model=pm, args=args, train_dataset=data).train()
    assert result.global_step == 2
    assert any(not torch.equal(v, pm.state_dict()[k]) for k, v in before.items())


# LoRA gradients through a rotated kbit base (x R in float32, dX turned back) against the same adapters on nn.Linear
# layers holding the kbit weights dequantized in the original basis: float32 butterflies and accumulation.
ROTATED_GRAD_ATOL = 1e-4


def test_lora_on_a_rotated_model_trains_with_the_gradients_of_its_dequantized_weights():
    model = kbit_model(hidden_size=128, rotation=True)
    rotated = [m for m in model.modules() if isinstance(m, KbitLinear) and m.rotated]
    assert len(rotated) == 2 * 7  # every Linear of both layers: K = 128 and 192
    dense = replace_kbit_with_linear(copy.deepcopy(model))
    grads, pms = [], []
    for m in (model, dense):
        pm = lora_model(m)
        pms.append(pm)
        for name, p in sorted(pm.named_parameters()):  # the same non-zero adapters in both
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(name)))
        pm.train()
        pm(**batch()).loss.backward()
        grads.append({n: p.grad for n, p in pm.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, atol=ROTATED_GRAD_ATOL * float(g.abs().max()), rtol=0)
    losses = train_steps(pms[0], steps=3)
    assert all(torch.isfinite(torch.tensor(losses)))
