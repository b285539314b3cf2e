"""Perplexity on fixed token windows, and paired statistics between two models on the same windows.

The text is tokenized once, without special tokens, and cut to a token budget. Sliding windows: each holds
at most ``window`` tokens, consecutive windows start ``stride`` tokens apart, and every token from the
second on is scored exactly once, by the first window that contains it as a target after the previous
window's end (so each scored token outside the first window sees at least ``window - stride`` tokens of
context). A model's score is the sum of its token negative log-likelihoods (nats) per window.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` go into the model; tokens ``[target_begin, end)`` are scored."""

    begin: int
    end: int
    target_begin: int

    @property
    def targets(self) -> int:
        return self.end - self.target_begin


def make_windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    """Sliding windows that score every token in ``[1, n_tokens)`` exactly once."""
    if window < 2:
        raise ValueError(f"--window must be >= 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"--stride must be in [1, window={window}], got {stride}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, the corpus gave {n_tokens}")
    windows, begin, prev_end = [], 0, 0
    while True:
        end = min(begin + window, n_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        if end == n_tokens:
            return windows
        # Overlap by at least one token, so that the first token after this window has context.
        prev_end, begin = end, min(begin + stride, end - 1)


def tokenize_prefix(tokenizer, text: str, max_tokens: int | None):
    """``(token ids, chars)``: ids (1-D int64) of ``text`` without special tokens, cut to ``max_tokens``, and
    the number of characters of ``text`` those tokens cover (None where the tokenizer gives no offsets)."""
    import torch

    if max_tokens is not None and max_tokens > 0:
        # Tokenizing a whole corpus to keep a few thousand tokens is wasteful: cut the text first,
        # generously (no tokenizer here averages fewer than 1 character per token on prose or code).
        text = text[: 16 * max_tokens]
    fast = getattr(tokenizer, "is_fast", False)
    enc = tokenizer(text, add_special_tokens=False, return_attention_mask=False, return_offsets_mapping=fast)
    ids = torch.tensor(enc["input_ids"], dtype=torch.int64)
    ids = ids[:max_tokens] if max_tokens else ids
    chars = int(enc["offset_mapping"][len(ids) - 1][1]) if fast and len(ids) else None
    return ids, chars


def tokenize(tokenizer, text: str, max_tokens: int | None):
    """Token ids (1-D int64) of ``text`` without special tokens, cut to ``max_tokens``."""
    return tokenize_prefix(tokenizer, text, max_tokens)[0]


def fingerprint(token_ids, windows: list[Window]) -> dict[str, str]:
    """sha256 of the token ids and of the window spans: equal fingerprints, identical inputs."""
    import torch

    ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().numpy().tobytes()
    spans = ",".join(f"{w.begin}:{w.end}:{w.target_begin}" for w in windows).encode()
    return {"tokens_sha256": hashlib.sha256(ids).hexdigest(), "windows_sha256": hashlib.sha256(spans).hexdigest()}


def _batches(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Consecutive windows of the same length and target count, at most ``batch_size`` each (one shape each)."""
    batches: list[list[Window]] = []
    for w in windows:
        last = batches[-1] if batches else None
        if last and len(last) < batch_size and (last[0].end - last[0].begin, last[0].targets) == (
            w.end - w.begin, w.targets
        ):
            last.append(w)
        else:
            batches.append([w])
    return batches


def score_windows(model, token_ids, windows: list[Window], batch_size: int = 1) -> list[float]:
    """Sum of the token negative log-likelihoods (nats, float64) of each window's targets, in window order.

    Windows of the same shape run ``batch_size`` at a time (no padding); only the logits of the targets
    are computed (``logits_to_keep``), in float32 for the softmax.
    """
    import torch
    import torch.nn.functional as F

    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64)
    nll: list[float] = []
    with torch.inference_mode():
        for batch in _batches(windows, batch_size):
            first, n = batch[0], batch[0].targets
            ids = torch.stack([token_ids[w.begin : w.end] for w in batch]).to(device)
            # Logits at position p predict token p + 1: keep the n + 1 last positions, drop the final one.
            logits = model(input_ids=ids, logits_to_keep=n + 1, use_cache=False).logits[:, :-1]
            targets = ids[:, first.target_begin - first.begin :]
            losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                     reduction="none")
            nll += losses.view(len(batch), n).double().sum(-1).tolist()
    return nll


def perplexity(nll: list[float], tokens: list[int]) -> float:
    """exp of the mean token NLL over all windows."""
    return math.exp(sum(nll) / sum(tokens))


def paired_delta(variant_nll: list[float], base_nll: list[float], tokens: list[int]) -> dict[str, Any]:
    """How far a variant's perplexity is from the base's on the same windows, with standard errors.

    Windows are the sampling units. With ``s_i`` (variant) and ``b_i`` (base) the NLL sums of window i,
    ``n_i`` its scored tokens, ``N = sum n_i`` and ``m`` windows, the mean token NLLs are the ratio
    estimators ``B = sum s_i / N`` and ``A = sum b_i / N``; perplexities ``exp(B)``, ``exp(A)``.
    Standard errors by the delta method on the per-window residuals, paired (one residual per window
    carries both models, so the noise the windows share cancels):

    - mean NLL difference ``D = B - A``: ``SE(D) = sqrt(m / (m - 1) * sum d_i**2) / N`` with
      ``d_i = (s_i - B n_i) - (b_i - A n_i)``;
    - ``delta_ppl = exp(B) - exp(A)``: ``SE = sqrt(m / (m - 1) * sum e_i**2) / N`` with
      ``e_i = exp(B) (s_i - B n_i) - exp(A) (b_i - A n_i)`` (the gradient of exp(B) - exp(A) applied to each
      window's residuals);
    - ``delta_ppl_pct = 100 (exp(D) - 1)``: ``SE = 100 exp(D) SE(D)``.

    Windows overlap in context and neighbouring text is alike, so they are not quite independent: read the
    errors as approximate. ``None`` for every SE with a single window.
    """
    if not (len(variant_nll) == len(base_nll) == len(tokens)) or not tokens:
        raise ValueError(f"paired_delta needs per-window values of equal, non-zero length, got "
                         f"{len(variant_nll)}, {len(base_nll)}, {len(tokens)}")
    m, total = len(tokens), sum(tokens)
    a, b = sum(base_nll) / total, sum(variant_nll) / total
    ppl_a, ppl_b = math.exp(a), math.exp(b)
    res_a = [x - a * n for x, n in zip(base_nll, tokens)]
    res_b = [x - b * n for x, n in zip(variant_nll, tokens)]
    d = b - a
    out = {"delta_nll": d, "delta_ppl": ppl_b - ppl_a, "delta_ppl_pct": 100 * math.expm1(d),
           "delta_nll_se": None, "delta_ppl_se": None, "delta_ppl_pct_se": None}
    if m > 1:
        c = m / (m - 1)
        se_d = math.sqrt(c * sum((rb - ra) ** 2 for ra, rb in zip(res_a, res_b))) / total
        se_ppl = math.sqrt(c * sum((ppl_b * rb - ppl_a * ra) ** 2 for ra, rb in zip(res_a, res_b))) / total
        out.update(delta_nll_se=se_d, delta_ppl_se=se_ppl, delta_ppl_pct_se=100 * math.exp(d) * se_d)
    return out
