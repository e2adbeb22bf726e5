"""Means with 95 % intervals over seeds, and paired verdicts between objectives.

Every comparison in the project reports a result as mean ± half-width of the two-sided 95 % Student-t
interval over seeds (mean ± t_{0.975, n-1} s / sqrt(n)), and a difference between two objectives as
the same interval over the per-seed differences (paired: both objectives ran with the same seeds).
A difference is *resolved* when its interval excludes 0.

>>> interval([0.81, 0.83, 0.80])            # mean 0.813, half_width 0.038 (t_{0.975, 2} = 4.303)
>>> verdict("dcl", [0.84, 0.85, 0.83], "infonce", [0.81, 0.83, 0.80])["text"]
'dcl - infonce = +0.027 ± 0.014 (95 % CI, 3 seeds): resolved'
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Two-sided 95 % quantiles t_{0.975, df} of Student's t, df = 1..30 (standard tables).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the table up to 30, beyond it the Cornish-Fisher expansion around z = 1.95996
    (error < 1e-3 there)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 values (df >= 1), got df = {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def interval(values: Sequence[float]) -> dict:
    """Mean and 95 % t-interval of ``values`` (one per seed). One value: half_width, low, high are None."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        raise ValueError("interval: no values")
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"interval: non-finite values {values}")
    mean = sum(values) / n
    if n == 1:
        return {"mean": mean, "half_width": None, "n": 1, "low": None, "high": None}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "half_width": half, "n": n, "low": mean - half, "high": mean + half}


def format_interval(values: Sequence[float], scale: float = 1.0, digits: int = 3) -> str:
    """'0.913 ± 0.012' (or '0.913 (1 seed)'), values times ``scale``."""
    ci = interval([scale * v for v in values])
    if ci["n"] == 1:
        return f"{ci['mean']:.{digits}f} (1 seed)"
    return f"{ci['mean']:.{digits}f} ± {ci['half_width']:.{digits}f}"


def verdict(name_a: str, values_a: Sequence[float], name_b: str, values_b: Sequence[float], *,
            scale: float = 1.0, digits: int = 3) -> dict:
    """Paired comparison of A and B over the same seeds: the interval of A - B and whether it excludes 0.

    Returns the interval's fields plus ``resolved`` (True / False; None with one seed) and ``text``,
    e.g. 'dcl - infonce = +0.027 ± 0.019 (95 % CI, 3 seeds): resolved'."""
    if len(values_a) != len(values_b):
        raise ValueError(f"verdict: {name_a} has {len(values_a)} seeds but {name_b} has {len(values_b)}; "
                         "a paired comparison needs the same seeds")
    ci = interval([scale * (a - b) for a, b in zip(values_a, values_b)])
    if ci["n"] == 1:
        resolved, tail = None, "1 seed: no interval, not resolved"
    else:
        resolved = not (ci["low"] <= 0.0 <= ci["high"])
        tail = (f"± {ci['half_width']:.{digits}f} (95 % CI, {ci['n']} seeds): "
                f"{'resolved' if resolved else 'not resolved'}")
    text = f"{name_a} - {name_b} = {ci['mean']:+.{digits}f} {tail}"
    return {**ci, "a": name_a, "b": name_b, "resolved": resolved, "text": text}


def pairwise_verdicts(results: dict[str, Sequence[float]], reference: str | None = None, **kwargs) -> list[dict]:
    """Verdicts of every objective against ``reference`` (default: 'infonce' if present), or of every
    pair when ``reference`` is None and there is no 'infonce'. ``results``: name -> per-seed values."""
    names = list(results)
    if reference is None and "infonce" in results:
        reference = "infonce"
    if reference is not None:
        if reference not in results:
            raise ValueError(f"pairwise_verdicts: reference {reference!r} not among {names}")
        pairs = [(a, reference) for a in names if a != reference]
    else:
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    return [verdict(a, results[a], b, results[b], **kwargs) for a, b in pairs]


def grouped_verdicts(rows: Sequence[dict], *, name_key: str, metric: str, group_key: str | None = None,
                     seed_key: str = "seed", reference: str = "infonce", scale: float = 1.0, digits: int = 3) -> list[dict]:
    """Paired verdicts of every name against ``reference`` within each group (e.g. each batch size), over
    the seeds both have. ``rows``: one dict per run with the name, the metric, the seed and the group.
    Each verdict's ``text`` starts with the group, e.g. 'batch_size 32: dcl - infonce = +0.012 ± 0.030 ...'."""
    groups: dict = {}
    for r in rows:
        if r.get(metric) is None:
            continue
        groups.setdefault(r[group_key] if group_key else None, {}).setdefault(r[name_key], {})[r[seed_key]] = r[metric]
    out = []
    for group, by_name in groups.items():
        ref = by_name.get(reference)
        if ref is None:
            continue
        for name, by_seed in by_name.items():
            seeds = sorted(set(by_seed) & set(ref))
            if name == reference or not seeds:
                continue
            v = verdict(name, [by_seed[s] for s in seeds], reference, [ref[s] for s in seeds], scale=scale,
                        digits=digits)
            prefix = f"{group_key} {group}: " if group_key else ""
            out.append({**v, "group": group, "text": prefix + v["text"]})
    return out
