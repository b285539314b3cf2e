import pytest

import trace_gemv


def record(weight, warp, entry, wait, staged, exit, items=0):
    return [weight, warp, 0, entry, wait, staged, exit, items]


def test_summarize_times_each_call_from_the_previous_calls_last_exit():
    # Three calls of two warps (ns); call 0 only precedes call 1, which ends at 10_000.
    records = [record(100, 0, 0, 500, 900, 9_000), record(100, 1, 0, 500, 900, 9_500),
               record(200, 0, 8_000, 11_000, 11_500, 10_000), record(200, 1, 9_000, 11_000, 11_500, 10_000),
               record(300, 0, 9_000, 11_000, 11_500, 16_000), record(300, 1, 10_000, 11_500, 12_500, 20_000)]
    s = trace_gemv.summarize(records, [100, 200, 300], nbytes=8_000_000)
    assert s["calls"] == 1 and s["warps"] == 2
    assert (s["entry_min"], s["entry_max"]) == pytest.approx((-1.0, 0.0))
    assert (s["wait_min"], s["wait_max"]) == pytest.approx((1.0, 1.5))
    assert s["staged_median"] == pytest.approx(2.0)
    assert (s["exit_min"], s["exit_median"], s["exit_max"]) == pytest.approx((6.0, 8.0, 10.0))
    assert s["stream_GBps"] == pytest.approx(8_000_000 / 1e3 / (10.0 - 2.0))


def test_balanced_exit_shares_the_items_so_that_every_warp_ends_together():
    # Two warps at one item per us, staged at 0 and 2, 4 items each: 4 and 2 us of streaming left to the first
    # once the second starts, so both end at 5 (5 + 3 = 8 items) instead of at 4 and 6.
    assert trace_gemv.balanced_exit([0.0, 2.0], [4.0, 6.0], [4, 4]) == pytest.approx(5.0)
    # A warp that starts after the others could have finished everything never starts.
    assert trace_gemv.balanced_exit([0.0, 9.0], [4.0, 10.0], [4, 1]) == pytest.approx(5.0)
    # Rates differ: 2 items/us from 0, 1 item/us from 1; 9 items end at 2 T + (T - 1) = 9, T = 10 / 3.
    assert trace_gemv.balanced_exit([0.0, 1.0], [3.0, 4.0], [6, 3]) == pytest.approx(10 / 3)
    # Warps without items (or a build that does not count them) give nothing to balance.
    assert trace_gemv.balanced_exit([0.0, 1.0], [2.0, 3.0], [0, 0]) is None


def test_summarize_reports_the_balanced_exit_from_the_previous_calls_end():
    records = [record(w, warp, 0, 0, 0, end) for w, end in ((1, 1_000), (2, 2_000)) for warp in (0, 1)]
    records += [record(3, 0, 2_000, 2_000, 2_000, 6_000, items=4), record(3, 1, 4_000, 4_000, 4_000, 8_000, items=4)]
    s = trace_gemv.summarize(records, [1, 2, 3], nbytes=1)
    assert (s["exit_max"], s["balanced_exit"]) == pytest.approx((6.0, 5.0))
    assert "| 5.00 |" in trace_gemv.render([{"K": 1, "N": 1, "bits": 4, "M": 1, "between": "none", "MB": 0.0} | s])


def test_cta_split_separates_the_spread_within_ctas_from_the_latest_cta():
    # CTA 0: warps exit at 1 and 3 us; CTA 1: 2 and 2.5; CTA 2: 6 and 6. Spreads 2, 0.5, 0: median 0.5; CTA ends
    # 3, 2.5, 6: the latest is 3 us after the median.
    exits = {(0, 0): 1_000, (0, 1): 3_000, (1, 0): 2_000, (1, 1): 2_500, (2, 0): 6_000, (2, 1): 6_000}
    records = [record(7, cta << 32 | warp, 0, 0, 0, end) for (cta, warp), end in exits.items()]
    assert trace_gemv.cta_split(records) == pytest.approx((0.5, 3.0))


def test_summarize_reports_the_cta_split_and_render_shows_it():
    records = [record(w, 0, 0, 0, 0, end) for w, end in ((1, 1_000), (2, 2_000))]
    records += [record(3, cta << 32, 0, 0, 0, end) for cta, end in ((0, 5_000), (1, 6_000), (2, 9_000))]
    s = trace_gemv.summarize(records, [1, 2, 3], nbytes=1)
    assert (s["cta_spread"], s["cta_tail"]) == pytest.approx((0.0, 3.0))
    assert "| 0.00 / 3.00 |" in trace_gemv.render([{"K": 1, "N": 1, "bits": 4, "M": 1, "between": "none", "MB": 0.0}
                                                   | s])


def test_summarize_takes_the_median_over_calls_and_ignores_other_records():
    records = [record(w, 0, 0, 0, 0, end) for w, end in ((1, 1_000), (2, 2_000), (3, 5_000), (4, 7_000))]
    records.append(record(99, 0, 0, 0, 0, 10**9))  # another weight's GEMV: not one of the calls
    s = trace_gemv.summarize(records, [1, 2, 3, 4], nbytes=1)
    assert s["calls"] == 2
    assert s["exit_max"] == pytest.approx(2.5)  # median of 3.0 (5000 - 2000) and 2.0 (7000 - 5000)
    assert s["balanced_exit"] is None  # the records count no items


def test_summarize_rejects_too_few_calls_and_untraced_calls():
    with pytest.raises(ValueError, match="at least 3 calls, got 2"):
        trace_gemv.summarize([], [1, 2], nbytes=1)
    with pytest.raises(RuntimeError, match=r"no trace records for calls \[2\]: is the library a KBIT_TRACE=1 build"):
        trace_gemv.summarize([record(1, 0, 0, 0, 0, 1), record(2, 0, 0, 0, 0, 2)], [1, 2, 3], nbytes=1)


def test_summarize_chain_times_each_call_from_its_predecessor_and_groups_by_role():
    # Two layers of (a, b), one warp each; the calls end at 1, 2, 5, 6, 10, 11 us, the first two unreported.
    ends = [1_000, 2_000, 5_000, 6_000, 10_000, 11_000]
    starts = [0, *ends[:-1]]  # each call staged when the one before it ends
    records = [record(w, 0, start, start, start, end, items=1)
               for w, (start, end) in enumerate(zip(starts, ends), start=1)]
    calls = [("a", 1, 10), ("b", 2, 20), ("a", 3, 10), ("b", 4, 20), ("a", 5, 10), ("b", 6, 20)]
    chain = trace_gemv.summarize_chain(records, calls)
    assert list(chain) == ["a", "b"]
    assert chain["a"]["calls"] == chain["b"]["calls"] == 2
    # a: 5 - 2 and 10 - 6 us after the call before it (b's); b: 1 us after a's, both times.
    assert chain["a"]["exit_max"] == pytest.approx(3.5) and chain["b"]["exit_max"] == pytest.approx(1.0)
    # Each call's bytes over its time from the median warp's staging (at the predecessor's end) to its exit.
    assert chain["b"]["stream_GBps"] == pytest.approx(20 / 1e3 / 1.0)
    assert chain["a"]["warps"] == 1


@pytest.mark.parametrize("argv, message", [(["--glu"], "--glu takes --chain"),
                                           (["--chain", "--layers", "8"], "--layers takes 3..7"),
                                           (["--chain", "--layers", "2"], "--layers takes 3..7"),
                                           (["--rotation", "--chain"], "--rotation traces single shapes"),
                                           (["--rotation", "--records"], "no kernel reads block records rotated")])
def test_main_refuses_chain_flags_out_of_place(argv, message, capsys):
    with pytest.raises(SystemExit):
        trace_gemv.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, shape", [("4096x14336", (4096, 14336)), ("2048X512", (2048, 512))])
def test_parse_shape(text, shape):
    assert trace_gemv.parse_shape(text) == shape


def test_main_refuses_an_unknown_prologue(capsys):
    with pytest.raises(SystemExit):
        trace_gemv.main(["--prologue", "rmsnorm_add"])
    assert "--prologue: invalid choice: 'rmsnorm_add'" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["4096", "4096x0", "ax4", "1x2x3"])
def test_parse_shape_names_the_flag(text):
    with pytest.raises(ValueError, match=f"--shapes takes KxN .* got '{text}'"):
        trace_gemv.parse_shape(text)


def test_render_has_a_row_per_case():
    row = {"K": 4096, "N": 4096, "bits": 4, "M": 1, "between": "none", "MB": 8.9, "exit_p90": 6.2,
           "stream_GBps": 1750.0}
    for phase in ("entry", "wait", "staged", "exit"):
        row |= {f"{phase}_min": 0.5, f"{phase}_median": 1.0, f"{phase}_max": 1.5}
    row["staged_median"] = 1.9
    text = trace_gemv.render([row])
    assert ("| 4096x4096 | 4 | 1 | codes | none | no | none | 8.9 | 0.50 / 1.00 / 1.50 | 0.50 / 1.00 / 1.50 | 1.90 "
            "| 0.50 / 1.00 / 1.50 | 6.20 | - | - | 1750 |") in text  # rows of older traces: no balanced exit, no CTA split
    row |= {"format": "records", "prologue": "add_rmsnorm"}
    assert "| 4096x4096 | 4 | 1 | records | add_rmsnorm | no | none | 8.9 |" in trace_gemv.render([row])
    row |= {"format": "codes", "rotated": True}
    assert "| 4096x4096 | 4 | 1 | codes | add_rmsnorm | yes | none | 8.9 |" in trace_gemv.render([row])
