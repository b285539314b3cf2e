"""GPU test of hf_kbit.loss: on CUDA the chunked causal-LM loss equals transformers' and takes a fraction of its
memory (the allocator's peak over one forward and backward). Run with scripts/run_gpu_tests.sh."""

from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_kbit.loss import CHUNK_BYTES, causal_lm_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICE = "cuda"
TOKENS, VOCAB = 4096, 32000
# bf16 logits: both round a float32 gradient once to bf16 (computed in another order: one bf16 step apart).
BF16_GRAD_RTOL = 2**-7
LOSS_ATOL = 1e-4
# Beside the gradient and one chunk's float32 copy: the chunk's row vectors (targets, index, maxima, sums: tens of
# bytes a row, a few KB) and the scalars.
SMALL_BYTES = 1 << 20


def peak_and_result(fn, logits, labels):
    """The loss, the logits' gradient, and the peak bytes allocated above the logits while computing both."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = fn(logits, labels, VOCAB)
    grad, = torch.autograd.grad(loss, logits)
    torch.cuda.synchronize()
    return loss.detach(), grad, torch.cuda.max_memory_allocated() - before


def test_chunked_loss_equals_transformers_and_holds_no_float32_logits():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(1, TOKENS, VOCAB, device=DEVICE, generator=gen) * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCAB, (1, TOKENS), device=DEVICE, generator=gen)
    labels[0, :100] = -100
    want, want_grad, want_peak = peak_and_result(ForCausalLMLoss, logits, labels)
    got, got_grad, got_peak = peak_and_result(causal_lm_loss, logits, labels)
    torch.testing.assert_close(got, want, atol=LOSS_ATOL, rtol=0)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=BF16_GRAD_RTOL, atol=0)
    logits_bytes = logits.numel() * logits.element_size()
    # The gradient (logits' size, bf16) and one chunk's float32 copy at a time (the next chunk's is made after the
    # last one is freed); transformers' holds float32 logits, their log-softmax and two float32 gradients (about
    # 8 x the bf16 logits).
    assert got_peak <= logits_bytes + CHUNK_BYTES + SMALL_BYTES, (got_peak, logits_bytes)
    assert want_peak >= 4 * logits_bytes, (want_peak, logits_bytes)
