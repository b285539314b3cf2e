"""hf_kbit.loss: the chunked causal-LM loss against transformers' ForCausalLMLoss (the reference), what it keeps
for backward, and use_chunked_loss on a tiny kbit model with LoRA. CPU."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.loss.loss_utils import ForCausalLMLoss

import hf_kbit
from hf_kbit import KbitConfig
from hf_kbit.loss import causal_lm_loss, chunk_rows_for, use_chunked_loss
from tiny_models import tiny_dense_model

transformers.utils.logging.set_verbosity_error()

# float64 logits (computed in float64; the reference is torch's cross-entropy in float64): sums in another order.
F64_ATOL = 1e-12
# bf16 logits: both round the float32 gradient once to bf16, from float32 values computed in another order, so
# an element may land one bf16 step (2^-8 relative) apart; the loss is float32 either way.
BF16_GRAD_RTOL = 2**-7
F32_LOSS_ATOL = 1e-5
# float32 logits: gradients of magnitude <= 1 / rows (~0.014 here), float32 rounding in another order.
F32_GRAD_ATOL = 1e-8
# A LoRA model's loss and adapter gradients, float32, the two losses: float32 reduction order.
MODEL_ATOL = 1e-5

VOCAB = 101


def logits_and_labels(dtype, batch=2, tokens=37, seed=0, ignored=5):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, tokens, VOCAB, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (batch, tokens), generator=gen)
    labels[0, :ignored] = -100
    return logits, labels


def reference_loss(logits, labels=None, vocab_size=VOCAB, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None):
    """The causal-LM loss in the logits' own dtype: torch's cross-entropy on the shifted labels (what
    ForCausalLMLoss computes, without its upcast to float32)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def loss_and_grad(fn, logits, **kwargs):
    loss = fn(logits, vocab_size=VOCAB, **kwargs)
    grad, = torch.autograd.grad(loss, logits)
    return loss, grad


@pytest.mark.parametrize("chunk_rows", [1, 7, 74, 1000])
@pytest.mark.parametrize("items", [None, 50, "tensor"])
def test_equals_transformers_loss_in_float64(chunk_rows, items):
    logits, labels = logits_and_labels(torch.float64)
    n = torch.tensor(50) if items == "tensor" else items
    want, want_grad = loss_and_grad(reference_loss, logits, labels=labels, num_items_in_batch=n)
    got, got_grad = loss_and_grad(causal_lm_loss, logits, labels=labels, num_items_in_batch=n, chunk_rows=chunk_rows)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=F64_ATOL, rtol=0)
    torch.testing.assert_close(got_grad, want_grad, atol=F64_ATOL, rtol=0)


def test_shift_labels_and_a_custom_ignore_index():
    logits, labels = logits_and_labels(torch.float64)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=7)[..., 1:].clone()
    shifted[shifted == -100] = 7
    want, want_grad = loss_and_grad(reference_loss, logits, shift_labels=shifted, ignore_index=7)
    got, got_grad = loss_and_grad(causal_lm_loss, logits, labels=None, shift_labels=shifted, ignore_index=7,
                                  chunk_rows=5)
    torch.testing.assert_close(got, want, atol=F64_ATOL, rtol=0)
    torch.testing.assert_close(got_grad, want_grad, atol=F64_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_transformers_loss(dtype):
    """The loss in float32 and its gradient rounded once to the logits' dtype, as transformers' loss."""
    logits, labels = logits_and_labels(dtype)
    want, want_grad = loss_and_grad(ForCausalLMLoss, logits, labels=labels)
    got, got_grad = loss_and_grad(causal_lm_loss, logits, labels=labels, chunk_rows=9)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got, want, atol=F32_LOSS_ATOL, rtol=0)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=BF16_GRAD_RTOL, atol=0)


def test_keeps_no_float32_logits_for_backward():
    """What autograd saves from the loss: one gradient in the logits' dtype, nothing of float32 [rows, vocab]."""
    logits, labels = logits_and_labels(torch.bfloat16, tokens=64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = causal_lm_loss(logits, labels, VOCAB, chunk_rows=16)
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert [(t.dtype, tuple(t.shape)) for t in big] == [(torch.bfloat16, (2 * 64, VOCAB))]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        reference = ForCausalLMLoss(logits, labels, VOCAB)
    assert any(t.dtype == torch.float32 and t.numel() >= logits.numel() for t in saved)  # what it replaces
    loss.backward()
    reference.backward()


def test_backward_scales_by_the_outer_gradient_and_runs_once():
    logits, labels = logits_and_labels(torch.float64)
    loss = causal_lm_loss(logits, labels, VOCAB)
    (3 * loss).backward(retain_graph=True)
    _, want_grad = loss_and_grad(reference_loss, logits.detach().requires_grad_(), labels=labels)
    torch.testing.assert_close(logits.grad, 3 * want_grad, atol=F64_ATOL, rtol=0)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_bad_arguments_are_named():
    logits, labels = logits_and_labels(torch.float32)
    with pytest.raises(ValueError, match="vocab_size is 100"):
        causal_lm_loss(logits, labels, 100)
    with pytest.raises(ValueError, match="give labels or shift_labels"):
        causal_lm_loss(logits, None, VOCAB)
    with pytest.raises(ValueError, match="74 rows of logits and 36 labels"):
        causal_lm_loss(logits, None, VOCAB, shift_labels=labels[0, 1:])
    with pytest.raises(ValueError, match="chunk_rows must be a positive int, got 0"):
        causal_lm_loss(logits, labels, VOCAB, chunk_rows=0)
    assert chunk_rows_for(128256) == 130 and chunk_rows_for(1 << 40) == 1


def test_no_gradient_without_grad():
    logits, labels = logits_and_labels(torch.float32)
    with torch.no_grad():
        got = causal_lm_loss(logits, labels, VOCAB)
    torch.testing.assert_close(got, ForCausalLMLoss(logits.detach(), labels, VOCAB), atol=F32_LOSS_ATOL, rtol=0)


def test_use_chunked_loss_on_a_kbit_lora_model_gives_the_same_loss_and_adapter_gradients():
    peft = pytest.importorskip("peft", reason="LoRA needs peft")
    from hf_kbit import lora

    def run(chunked: bool):
        torch.manual_seed(0)
        model = hf_kbit.quantize_model(tiny_dense_model("llama", torch.float32, intermediate_size=192),
                                       KbitConfig(bits=4, modules_to_not_convert=["lm_head"], fitting="absmax"))
        pm = lora.get_peft_model(model, peft.LoraConfig(target_modules="all-linear", r=4, lora_alpha=8,
                                                        init_lora_weights="gaussian"))
        if chunked:
            assert use_chunked_loss(pm) is pm and pm.get_base_model().loss_function is causal_lm_loss
        ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in pm.named_parameters() if p.requires_grad}

    want, want_grads = run(False)
    got, got_grads = run(True)
    torch.testing.assert_close(got, want, atol=MODEL_ATOL, rtol=0)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=MODEL_ATOL, rtol=0, msg=name)


def test_use_chunked_loss_refuses_a_model_with_another_loss():
    from transformers import LlamaForSequenceClassification

    model = tiny_dense_model("llama", torch.float32)
    classifier = LlamaForSequenceClassification(model.config)
    with pytest.raises(ValueError, match="not transformers' ForCausalLMLoss"):
        use_chunked_loss(classifier)
    assert use_chunked_loss(use_chunked_loss(model)).loss_function is causal_lm_loss  # idempotent


def test_under_torch_compile():
    logits, labels = logits_and_labels(torch.float32)
    want, want_grad = loss_and_grad(ForCausalLMLoss, logits, labels=labels)
    compiled = torch.compile(lambda x, y: causal_lm_loss(x, y, VOCAB, chunk_rows=16))
    got, got_grad = loss_and_grad(lambda x, vocab_size, labels: compiled(x, labels), logits, labels=labels)
    torch.testing.assert_close(got, want, atol=F32_LOSS_ATOL, rtol=0)
    torch.testing.assert_close(got_grad, want_grad, atol=F32_GRAD_ATOL, rtol=0)
