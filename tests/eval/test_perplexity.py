"""Windows, per-window scores and the paired statistics of hf_kbit.eval.perplexity."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tiny_models import TINY_TEXT, save_tiny_text_model

from hf_kbit.eval import perplexity as pp

# float32 logits: a window's NLL sum differs between batch shapes by rounding only.
BATCH_NLL_RTOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, token ids) of the tiny random Llama over TINY_TEXT."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = save_tiny_text_model(tmp_path_factory.mktemp("tiny_llama"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, pp.tokenize(AutoTokenizer.from_pretrained(folder), TINY_TEXT, 200)


@pytest.mark.parametrize(("n", "window", "stride"), [(10, 4, 2), (10, 4, 4), (11, 5, 3), (3, 8, 8), (100, 16, 1)])
def test_windows_score_every_token_once(n, window, stride):
    windows = pp.make_windows(n, window, stride)
    scored = [t for w in windows for t in range(w.target_begin, w.end)]
    assert scored == list(range(1, n))
    assert all(w.end - w.begin <= window and w.begin < w.target_begin for w in windows)
    assert sum(w.targets for w in windows) == n - 1


@pytest.mark.parametrize(("window", "stride"), [(1, 1), (4, 0), (4, 5)], ids=["window<2", "stride0", "stride>window"])
def test_windows_reject_bad_arguments(window, stride):
    with pytest.raises(ValueError, match="--window|--stride"):
        pp.make_windows(10, window, stride)


def test_batches_hold_one_shape():
    windows = pp.make_windows(100, 16, 8)
    batches = pp._batches(windows, 4)
    assert [w for b in batches for w in b] == windows
    for b in batches:
        assert len(b) <= 4 and len({(w.end - w.begin, w.targets) for w in b}) == 1
    assert len(batches[0]) == 1  # the first window scores more targets than the others


def test_one_window_is_the_models_mean_loss(tiny):
    model, ids = tiny
    ids = ids[:64]
    nll = pp.score_windows(model, ids, pp.make_windows(len(ids), 64, 64))
    with torch.no_grad():
        loss = model(input_ids=ids[None], labels=ids[None]).loss
    assert len(nll) == 1 and nll[0] / (len(ids) - 1) == pytest.approx(float(loss), rel=1e-4)


def test_batching_does_not_change_the_scores(tiny):
    model, ids = tiny
    windows = pp.make_windows(len(ids), 48, 16)
    one, batched = pp.score_windows(model, ids, windows, 1), pp.score_windows(model, ids, windows, 5)
    assert len(one) == len(windows)
    assert batched == pytest.approx(one, rel=BATCH_NLL_RTOL)
    with pytest.raises(ValueError, match="--batch-size"):
        pp.score_windows(model, ids, windows, 0)


def test_tokenize_prefix_reports_covered_chars():
    from tiny_models import char_tokenizer

    tok = char_tokenizer(TINY_TEXT)
    ids, chars = pp.tokenize_prefix(tok, TINY_TEXT, 10)
    assert len(ids) == 10 and chars == 10  # one character per token
    assert torch.equal(pp.tokenize(tok, TINY_TEXT, 10), ids)


def test_fingerprint_changes_with_tokens_and_windows():
    ids = torch.arange(20)
    a = pp.fingerprint(ids, pp.make_windows(20, 8, 4))
    assert a == pp.fingerprint(ids.clone(), pp.make_windows(20, 8, 4))
    assert a["windows_sha256"] != pp.fingerprint(ids, pp.make_windows(20, 8, 8))["windows_sha256"]
    assert a["tokens_sha256"] != pp.fingerprint(ids.flip(0), pp.make_windows(20, 8, 4))["tokens_sha256"]


def test_paired_delta_by_hand():
    base, variant, tokens = [2.0, 4.0, 3.0], [2.5, 4.1, 3.6], [1, 2, 1]
    out = pp.paired_delta(variant, base, tokens)
    # N = 4 tokens, m = 3 windows; A = 9 / 4 = 2.25, B = 10.2 / 4 = 2.55
    # residuals base:    2 - 2.25,  4 - 4.5,  3 - 2.25 = -0.25, -0.5, 0.75
    # residuals variant: 2.5 - 2.55, 4.1 - 5.1, 3.6 - 2.55 = -0.05, -1.0, 1.05
    # paired differences d_i: 0.2, -0.5, 0.3
    assert out["delta_nll"] == pytest.approx(0.3)
    assert out["delta_nll_se"] == pytest.approx(math.sqrt(3 / 2 * (0.2**2 + 0.5**2 + 0.3**2)) / 4)
    pa, pb = math.exp(2.25), math.exp(2.55)
    e = [pb * -0.05 - pa * -0.25, pb * -1.0 - pa * -0.5, pb * 1.05 - pa * 0.75]
    assert out["delta_ppl"] == pytest.approx(pb - pa)
    assert out["delta_ppl_se"] == pytest.approx(math.sqrt(3 / 2 * sum(x * x for x in e)) / 4)
    assert out["delta_ppl_pct"] == pytest.approx(100 * (math.exp(0.3) - 1))
    assert out["delta_ppl_pct_se"] == pytest.approx(100 * math.exp(0.3) * out["delta_nll_se"])


def test_paired_delta_matches_the_jackknife():
    """Delta method and jackknife estimate the same variance of the mean NLL difference (many windows)."""
    rng = random.Random(0)
    tokens = [rng.randint(200, 512) for _ in range(300)]
    base = [n * rng.uniform(2.5, 3.5) for n in tokens]
    variant = [b + n * rng.gauss(0.05, 0.02) for b, n in zip(base, tokens)]
    se = pp.paired_delta(variant, base, tokens)["delta_nll_se"]
    m = len(tokens)
    loo = [(sum(variant) - variant[i] - sum(base) + base[i]) / (sum(tokens) - tokens[i]) for i in range(m)]
    mean = sum(loo) / m
    jackknife = math.sqrt((m - 1) / m * sum((x - mean) ** 2 for x in loo))
    assert se == pytest.approx(jackknife, rel=0.05)


def test_paired_delta_of_identical_models_and_of_one_window():
    same = pp.paired_delta([3.0, 5.0], [3.0, 5.0], [2, 2])
    assert same["delta_ppl"] == 0 and same["delta_nll_se"] == 0 and same["delta_ppl_se"] == 0
    one = pp.paired_delta([3.0], [2.0], [2])
    assert one["delta_nll"] == 0.5 and one["delta_nll_se"] is None and one["delta_ppl_se"] is None
    with pytest.raises(ValueError, match="equal, non-zero length"):
        pp.paired_delta([1.0], [1.0, 2.0], [1, 1])
