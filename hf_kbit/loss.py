"""A causal-LM loss that never holds float32 logits: transformers' ``ForCausalLMLoss``, computed in row chunks.

transformers' loss upcasts the whole ``[tokens, vocab]`` logits to float32, and its cross-entropy keeps the
float32 log-softmax for backward, whose gradients are two more float32 tensors of that size. At 2048 tokens and a
128256-token vocabulary that is about 3.4 GiB at once, as much as a 4-bit 8B model's decoder weights take
(docs/finetuning.md#memory-the-loss). :func:`causal_lm_loss` returns the same loss, and its backward the same
gradient, holding instead one gradient in the logits' dtype, filled chunk by chunk during the forward (float32
inside a chunk of ``chunk_rows`` rows), and nothing of float32 size ``[tokens, vocab]``.

:func:`use_chunked_loss` makes a causal LM compute its loss with it (``model.loss_function``, which the model's
own forward and transformers' Trainer call); the logits the model returns are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

IGNORE_INDEX = -100  # transformers' label for tokens that carry no loss
CHUNK_BYTES = 64 << 20  # float32 bytes of logits one chunk upcasts (its only temporary of that size)


def chunk_rows_for(vocab_size: int) -> int:
    """Rows per chunk such that one chunk's float32 logits take about :data:`CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


class _CrossEntropy(torch.autograd.Function):
    """``sum_i nll_i x scale`` over the rows of ``logits [R, V]`` whose target is not ``ignore_index``, in float32
    (float64 for float64 logits); the gradient with respect to ``logits`` (``(softmax - onehot) x scale`` on those
    rows, zero elsewhere) is computed in the forward, chunk by chunk, and stored in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, targets, scale, ignore_index: int, chunk_rows: int):
        needs_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits) if needs_grad else None
        compute = torch.promote_types(logits.dtype, torch.float32)
        total = torch.zeros((), dtype=compute, device=logits.device)
        for start in range(0, logits.shape[0], chunk_rows):
            stop = min(start + chunk_rows, logits.shape[0])
            total += _CrossEntropy.chunk(logits[start:stop], targets[start:stop], scale, ignore_index, compute,
                                         grad[start:stop] if needs_grad else None)
        ctx.save_for_backward(grad)
        ctx.backward_done = False
        return total * scale

    @staticmethod
    def chunk(logits, targets, scale, ignore_index: int, compute: torch.dtype, grad):
        """The summed nll of a chunk's valid rows (unscaled); its scaled gradient into ``grad`` (None: none). A
        function of its own so that the chunk's float32 copy is freed before the next chunk's is made."""
        x = logits.to(compute, copy=True)  # the chunk's one temporary: exp and softmax in place
        valid = targets != ignore_index
        index = torch.where(valid, targets, 0).unsqueeze(1)
        picked = x.gather(1, index).squeeze(1)
        top = x.amax(dim=1, keepdim=True)
        sums = x.sub_(top).exp_().sum(dim=1, keepdim=True)
        nll = ((top + sums.log()).squeeze(1) - picked).mul_(valid).sum()
        if grad is not None:
            keep = valid.to(x.dtype).unsqueeze(1)
            p = x.div_(sums)  # softmax
            grad.copy_(p.scatter_add_(1, index, -keep).mul_(keep * scale))
        return nll

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.backward_done:
            raise RuntimeError("hf_kbit.loss.causal_lm_loss: its backward ran twice (retain_graph); the stored "
                               "gradient was scaled in place by the first. Compute the loss again instead")
        ctx.backward_done = True
        grad, = ctx.saved_tensors
        return grad.mul_(grad_output.to(grad.dtype)), None, None, None, None


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (same arguments, same value): mean next-token cross-entropy over the
    labels that are not ``ignore_index`` (or their sum over ``num_items_in_batch``, as gradient accumulation in
    transformers' Trainer passes it), in float32 (float64 for float64 logits, which transformers computes in
    float32), computed ``chunk_rows`` rows at a time (default :func:`chunk_rows_for`). Its gradient is the float32
    one rounded once to the logits' dtype (when the loss's own gradient is 1, as in ``loss.backward()``). Its
    backward may run once (no ``retain_graph`` reuse)."""
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"causal_lm_loss: logits' last dim is {logits.shape[-1]}, vocab_size is {vocab_size}")
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss: give labels or shift_labels")
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    rows = logits.reshape(-1, vocab_size)
    if targets.shape[0] != rows.shape[0]:
        raise ValueError(f"causal_lm_loss: {rows.shape[0]} rows of logits and {targets.shape[0]} labels")
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum()
    elif torch.is_tensor(num_items_in_batch):
        denominator = num_items_in_batch.to(logits.device)
    else:
        denominator = torch.tensor(float(num_items_in_batch), device=logits.device)
    denominator = denominator.to(torch.promote_types(logits.dtype, torch.float32))
    chunk = chunk_rows if chunk_rows is not None else chunk_rows_for(vocab_size)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"causal_lm_loss: chunk_rows must be a positive int, got {chunk!r}")
    return _CrossEntropy.apply(rows, targets, 1.0 / denominator, ignore_index, chunk)


def use_chunked_loss(model: nn.Module) -> nn.Module:
    """Make the causal LM ``model`` (a transformers ``*ForCausalLM``, or a peft model around one) compute its
    loss with :func:`causal_lm_loss`; returns ``model``. ValueError for a model whose loss is not transformers'
    causal-LM loss, which this would change."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    current = getattr(base, "loss_function", None)
    if current is not causal_lm_loss and current is not ForCausalLMLoss:
        raise ValueError(f"use_chunked_loss: {type(base).__name__} computes its loss with "
                         f"{getattr(current, '__name__', current)!r}, not transformers' ForCausalLMLoss; its loss "
                         "stays as it is")
    base.loss_function = causal_lm_loss
    return model
