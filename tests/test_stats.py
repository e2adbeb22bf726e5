"""Intervals over seeds and paired verdicts, checked against values computed by hand from the formulas."""

import math

import pytest

from contrastkit.evaluation.stats import grouped_verdicts, interval, pairwise_verdicts, t_quantile_975, verdict

pytestmark = pytest.mark.quick


def test_t_quantiles_match_tables():
    # t_{0.975, df} from standard tables (the expansion is used beyond df = 30)
    for df, value in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042), (40, 2.021), (60, 2.000),
                      (120, 1.980)]:
        assert t_quantile_975(df) == pytest.approx(value, abs=1.5e-3)
    with pytest.raises(ValueError, match="at least 2 values"):
        t_quantile_975(0)


def test_interval_by_hand():
    values = [0.81, 0.83, 0.80, 0.86]
    mean = sum(values) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    ci = interval(values)
    assert ci["mean"] == pytest.approx(mean, abs=1e-12)
    assert ci["half_width"] == pytest.approx(3.182 * sd / 2, abs=1e-12)
    assert ci["low"] < mean < ci["high"] and ci["n"] == 4
    assert interval([0.5]) == {"mean": 0.5, "half_width": None, "n": 1, "low": None, "high": None}
    with pytest.raises(ValueError, match="no values"):
        interval([])
    with pytest.raises(ValueError, match="non-finite"):
        interval([0.1, float("nan")])


def test_verdict_is_paired_and_says_resolved_only_when_the_interval_excludes_zero():
    # A is B plus a constant 0.02 (+-0.001): unpaired intervals would overlap, the paired one is narrow
    b = [0.50, 0.70, 0.60]
    a = [0.521, 0.719, 0.620]
    v = verdict("dcl", a, "infonce", b)
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert v["mean"] == pytest.approx(mean) and v["half_width"] == pytest.approx(4.303 * sd / math.sqrt(3))
    assert v["resolved"] is True
    assert v["text"] == f"dcl - infonce = +0.020 ± {4.303 * sd / math.sqrt(3):.3f} (95 % CI, 3 seeds): resolved"
    noisy = verdict("dcl", [0.52, 0.68, 0.63], "infonce", b)
    assert noisy["resolved"] is False and noisy["text"].endswith("not resolved")
    one = verdict("dcl", [0.6], "infonce", [0.5])
    assert one["resolved"] is None and "1 seed" in one["text"]
    with pytest.raises(ValueError, match="same seeds"):
        verdict("dcl", [0.1, 0.2], "infonce", [0.1])


def test_grouped_and_pairwise_verdicts():
    rows = [{"loss": loss, "batch_size": bs, "seed": s, "acc": acc}
            for loss, bs, s, acc in [("infonce", 8, 0, 0.5), ("infonce", 8, 1, 0.6), ("dcl", 8, 0, 0.7),
                                     ("dcl", 8, 1, 0.8), ("dcl", 8, 2, 0.9), ("infonce", 16, 0, 0.5)]]
    out = grouped_verdicts(rows, name_key="loss", metric="acc", group_key="batch_size")
    assert len(out) == 1 and out[0]["group"] == 8 and out[0]["n"] == 2  # seed 2 has no InfoNCE partner
    assert out[0]["text"].startswith("batch_size 8: dcl - infonce = +0.200")
    pairs = pairwise_verdicts({"infonce": [0.5, 0.6], "dcl": [0.7, 0.8], "dclw": [0.7, 0.9]})
    assert [(p["a"], p["b"]) for p in pairs] == [("dcl", "infonce"), ("dclw", "infonce")]
    assert len(pairwise_verdicts({"a": [1, 2], "b": [1, 3], "c": [2, 2]})) == 3
