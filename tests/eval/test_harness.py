"""hf_kbit.eval.harness: the paired comparison of kbit-format variants with HQQ at their k, on a written-out payload."""

from __future__ import annotations

import math
import random

import pytest

from hf_kbit.eval import harness
from hf_kbit.eval.perplexity import make_windows

N_TOKENS, WINDOW, STRIDE = 100, 40, 20
# The delta method against the exact difference of two perplexities: both are the same formula here.
PPL_RTOL = 1e-12


def payload() -> dict:
    """Results on the same windows with made-up per-window NLL sums: bf16, kbit3 (lower than hqq3 on every window),
    kbitfit3, kbit4 and a kbit4 with its LM head quantized (no hqq4 in the run), hqq3, rtn3."""
    windows = make_windows(N_TOKENS, WINDOW, STRIDE)
    rng = random.Random(0)
    hqq3 = [2.0 * w.targets + rng.random() for w in windows]

    def row(variant, method, bits, nll, **extra):
        return {"variant": variant, "method": method, "bits": bits, "window_nll": nll, **extra}

    return {
        "tokenization": {"n_tokens": N_TOKENS}, "windows": {"window": WINDOW, "stride": STRIDE},
        "results": [
            row("bf16", "bf16", None, [1.5 * w.targets for w in windows]),
            row("kbit3", "kbit", 3, [x - 0.25 for x in hqq3]),
            row("kbitfit3", "kbitfit", 3, [x + 0.5 * rng.random() for x in hqq3]),
            row("kbit4", "kbit", 4, [1.8 * w.targets for w in windows]),
            row("kbit4-head4", "kbit", 4, [1.9 * w.targets for w in windows], lm_head_bits=4),
            row("hqq3", "hqq", 3, hqq3),
            row("rtn3", "rtn", 3, [2.5 * w.targets for w in windows]),
        ],
    }


def test_window_tokens_are_the_windows_scored_tokens():
    assert harness.window_tokens(payload()) == [w.targets for w in make_windows(N_TOKENS, WINDOW, STRIDE)]
    assert sum(harness.window_tokens(payload())) == N_TOKENS - 1


def test_vs_hqq_pairs_each_kbit_variant_with_hqq_at_its_k():
    p = payload()
    got = harness.vs_hqq(p)
    assert sorted(got) == ["kbit3", "kbitfit3"]  # no hqq4 in the run; anchors and bf16 are not compared
    rows = {r["variant"]: r for r in p["results"]}
    total = N_TOKENS - 1
    for variant, delta in got.items():
        want = math.exp(sum(rows[variant]["window_nll"]) / total) - math.exp(sum(rows["hqq3"]["window_nll"]) / total)
        assert delta["delta_ppl"] == pytest.approx(want, rel=PPL_RTOL)
        assert delta["delta_ppl_se"] > 0
    assert got["kbit3"]["delta_ppl"] < 0 < got["kbitfit3"]["delta_ppl"]  # kbit3 lower on every window, kbitfit3 higher


def test_render_table_has_the_hqq_column():
    p = payload()
    for r in p["results"]:
        r.update(bits_per_weight=4.0, ppl=10.0, delta_ppl=None, delta_ppl_se=None, delta_ppl_pct=None,
                 delta_ppl_pct_se=None, weight_sqnr_db=None, load_seconds=1.0, seconds=1.0)
    table = harness.render_table(p).splitlines()
    assert "Δppl vs HQQ same k (± SE)" in table[0]
    kbit3 = next(line for line in table if line.startswith("| kbit3 |")).split(" | ")
    assert kbit3[5].startswith("-") and " ± " in kbit3[5]
    assert next(line for line in table if line.startswith("| rtn3 |")).split(" | ")[5] == "-"
