"""Latent recovery (Zimmermann et al., ICML 2021): the generative process, the metrics, and a short run that learns;
benchmarks/latent_recovery.py's command lines run in this process (launch.run_here: the script as __main__)."""

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from launch import run_here

from contrastkit.evaluation.latent_recovery import (RecoveryConfig, cached_result, cell_name, hungarian, invertible_mlp, linear_r2, mcc,
                                                    run_grid, sample_sphere, sample_vmf, summarize, table,
                                                    train_recovery)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/latent_recovery.py"


@pytest.mark.parametrize("kappa", [1.0, 10.0, 50.0])
def test_vmf_mean_cosine_matches_the_density(kappa):
    """E<x, mu> under vMF(mu, kappa) on S^9, against the marginal density of w = <x, mu>,
    p(w) ∝ exp(kappa w) (1 - w^2)^((d - 3) / 2), integrated numerically in float64."""
    d, n = 10, 20000
    gen = torch.Generator().manual_seed(3)
    mu = sample_sphere(n, d, gen)
    x = sample_vmf(mu, kappa, gen)
    assert torch.allclose(x.norm(dim=1), torch.ones(n, dtype=torch.float64), atol=1e-12)
    w = (x * mu).sum(1)
    grid = torch.linspace(-1, 1, 400001, dtype=torch.float64)
    density = torch.exp(kappa * (grid - 1)) * (1 - grid**2).clamp_min(0) ** ((d - 3) / 2)
    expected = float((grid * density).sum() / density.sum())
    assert abs(float(w.mean()) - expected) < 4 * float(w.std()) / math.sqrt(n)
    # the rest of x is a uniform direction orthogonal to mu: no mean left after removing w mu
    rest = x - w[:, None] * mu
    assert float((rest * mu).sum(1).abs().max()) < 1e-12
    assert float(rest.mean(0).norm()) < 5 / math.sqrt(n)


def test_generator_is_invertible_with_bounded_condition():
    g = invertible_mlp(10, 3, 4.0, torch.Generator().manual_seed(0))
    for layer in g:
        if isinstance(layer, torch.nn.Linear):
            s = torch.linalg.svdvals(layer.weight)
            assert float(s.max() / s.min()) <= 4.0 + 1e-9
    z = sample_sphere(512, 10, torch.Generator().manual_seed(1))
    jac = torch.func.vmap(torch.func.jacrev(g))(z)  # [512, 10, 10]: nonsingular everywhere
    assert float(torch.linalg.svdvals(jac).min()) > 1e-3


@pytest.mark.quick
def test_linear_r2_against_the_formula():
    gen = torch.Generator().manual_seed(0)
    z, z_test = torch.randn(4000, 5, generator=gen, dtype=torch.float64), torch.randn(4000, 5, generator=gen,
                                                                                    dtype=torch.float64)
    a = torch.randn(5, 5, generator=gen, dtype=torch.float64)
    assert linear_r2(z @ a + 3.0, z, z_test @ a + 3.0, z_test) == pytest.approx(1.0, abs=1e-10)
    # latent = feature + noise of variance 0.25 with unit-variance features: R^2 = 1 / (1 + 0.25) = 0.8
    f, f_test = torch.randn(4000, 5, generator=gen, dtype=torch.float64), torch.randn(4000, 5, generator=gen,
                                                                                    dtype=torch.float64)
    noisy = f + 0.5 * torch.randn(4000, 5, generator=gen, dtype=torch.float64)
    noisy_test = f_test + 0.5 * torch.randn(4000, 5, generator=gen, dtype=torch.float64)
    assert linear_r2(f, noisy, f_test, noisy_test) == pytest.approx(0.8, abs=0.02)
    assert abs(linear_r2(f, z, f_test, z_test)) < 0.01  # independent features explain nothing


@pytest.mark.quick
def test_hungarian_against_brute_force():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        cost = torch.rand(6, 6, generator=gen)
        best = min(sum(float(cost[i, p[i]]) for i in range(6)) for p in itertools.permutations(range(6)))
        rows = hungarian(cost)
        assert sorted(rows) == list(range(6))
        assert sum(float(cost[i, j]) for i, j in enumerate(rows)) == pytest.approx(best, abs=1e-9)


@pytest.mark.quick
def test_mcc_is_one_for_a_signed_scaled_permutation_and_low_for_a_rotation():
    z = sample_sphere(4000, 10, torch.Generator().manual_seed(0))
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(1))
    assert mcc(-3.0 * z[:, perm] + 1.0, z) == pytest.approx(1.0, abs=1e-12)
    q, _ = torch.linalg.qr(torch.randn(10, 10, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    assert mcc(z @ q, z) < 0.9


@pytest.mark.quick
def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="unigrad has no queue form"):
        train_recovery(RecoveryConfig(loss="unigrad", form="queue"))
    with pytest.raises(ValueError, match="form must be one of"):
        train_recovery(RecoveryConfig(form="moco"))
    with pytest.raises(ValueError, match="batch_size must be >= 2"):
        train_recovery(RecoveryConfig(batch_size=1))
    with pytest.raises(ValueError, match="kappa must be > 0"):
        train_recovery(RecoveryConfig(kappa=0.0))


# A short run must recover the latents far better than the same encoder untrained. Measured (seed 0,
# d = 10, width 64, 300 steps): InfoNCE two views at batch 64 R^2 0.68 vs 0.45 untrained; DCL with a
# queue at batch 32, 0.57. The margins below are about half of those gains.
@pytest.mark.parametrize("loss, form, batch, margin", [("infonce", "two_view", 64, 0.12),
                                                        ("dcl", "queue", 32, 0.06)])
def test_short_run_recovers_the_latents(one_thread, loss, form, batch, margin):
    cfg = RecoveryConfig(loss=loss, form=form, batch_size=batch, steps=300, hidden=64, queue_size=256,
                         eval_samples=2048)
    result = train_recovery(cfg)
    assert result["r2"] > result["baseline_r2"] + margin, result
    assert math.isfinite(result["final_loss"])


def test_runs_are_deterministic(one_thread):
    cfg = RecoveryConfig(loss="cacr", batch_size=8, steps=5, hidden=16, eval_samples=256)
    a, b = train_recovery(cfg), train_recovery(cfg)
    # equal up to float summation order (LAPACK's least squares can differ in the last bit between calls)
    assert a["r2"] == pytest.approx(b["r2"], rel=1e-9) and a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-9)
    other = train_recovery(RecoveryConfig(loss="cacr", batch_size=8, steps=5, hidden=16, eval_samples=256, seed=1))
    assert other["r2"] != pytest.approx(a["r2"], rel=1e-6)  # and the seed does change the run


def test_summary_table_and_verdicts():
    runs = [{"loss": loss, "form": "two_view", "batch_size": 8, "seed": s, "r2": r2}
            for loss, s, r2 in [("infonce", 0, 0.80), ("infonce", 1, 0.82), ("infonce", 2, 0.81),
                                ("dcl", 0, 0.85), ("dcl", 1, 0.87), ("dcl", 2, 0.86)]]
    summary = summarize(runs)
    cell = summary["cells"][("dcl", "two_view")][8]
    assert cell["mean"] == pytest.approx(0.86) and cell["seeds"] == [0, 1, 2]
    assert "| dcl | two_view | 86.0 ± 2.5 |" in table(summary)  # 4.303 * 0.01 / sqrt(3) = 0.0248
    (v,) = summary["verdicts"]  # in points of R^2: +5, +5, +5
    assert v["resolved"] and v["mean"] == pytest.approx(5.0)
    assert v["text"].startswith("dcl (two view, B=8) - infonce (two view, B=8) = +5.0 ± 0.0")


def test_benchmark_script_writes_table_and_plot(tmp_path, one_thread):
    out = tmp_path / "grid"
    args = ["--out-dir", str(out), "--losses", "infonce,dcl", "--forms", "two_view,queue", "--batch-sizes", "4",
            "--queue-batch-sizes", "4", "--seeds", "0,1", "--steps", "3", "--hidden", "8", "--queue-sizes", "16"]
    done = run_here(SCRIPT, args, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (out / "results.md").read_text()
    assert "| dcl | queue |" in report and "- dcl (queue, B=4) - infonce (queue, B=4) = " in report
    assert len(json.loads((out / "results.json").read_text())["runs"]) == 8
    assert (out / "r2.png").stat().st_size > 1000
    assert len(list((out / "cells").glob("*.json"))) == 8


def test_benchmark_script_rejects_bad_input(tmp_path):
    bad = run_here(SCRIPT, ["--out-dir", str(tmp_path), "--losses", "infonce,nope"], cwd=ROOT)
    assert bad.returncode == 2 and "error: unknown losses ['nope']" in bad.stderr and "Traceback" not in bad.stderr


def test_queue_size_sweep_tabulates_over_k(tmp_path, one_thread):
    """EqCo's claim is about K at a fixed batch: --sweep queue_size runs the queue form over the queue sizes,
    with K as the table's columns and each objective's smallest-K against largest-K verdict."""
    out = tmp_path / "negatives"
    args = ["--out-dir", str(out), "--sweep", "queue_size", "--losses", "infonce,eqco,unigrad", "--batch-sizes", "4",
            "--queue-sizes", "8,32", "--seeds", "0,1", "--steps", "3", "--hidden", "8"]
    done = run_here(SCRIPT, args, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (out / "results.md").read_text()
    assert "| objective | form | K = 8 | K = 32 |" in report and "| eqco | queue |" in report
    assert "unigrad" not in report.split("Paired verdicts")[0].split("| objective")[1]  # no queue form: left out
    assert "- eqco (queue, K=8) - infonce (queue, K=8) = " in report
    assert "- eqco (queue, K=8) - eqco (queue, K=32) = " in report
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert sorted({(r["form"], r["batch_size"], r["queue_size"]) for r in runs}) == [("queue", 4, 8), ("queue", 4, 32)]


def test_sweep_errors_are_one_line(tmp_path):
    bad = run_here(SCRIPT, ["--out-dir", str(tmp_path), "--queue-sizes", "16,64"], cwd=ROOT)
    assert bad.returncode == 2 and "error: several --queue-sizes need --sweep queue_size" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_cached_cell_counts_only_for_its_own_config(tmp_path, one_thread):
    """The cache is keyed by name, and the name leaves out fields at their defaults: a cell run under another
    default (or edited) has the same name but must be rerun, never reported as this config's result."""
    cfg = RecoveryConfig(batch_size=4, steps=3, hidden=8, eval_samples=64)
    (first,) = run_grid([cfg], tmp_path, log=lambda *_: None)
    assert cached_result(cfg, tmp_path) == first
    path = tmp_path / "cells" / f"{cell_name(cfg)}.json"
    stale = {**first, "lr": 1e-3, "r2": -1.0}  # as if run when the default lr was 1e-3
    path.write_text(json.dumps(stale))
    assert cached_result(cfg, tmp_path) is None
    (again,) = run_grid([cfg], tmp_path, log=lambda *_: None)
    assert again["lr"] == cfg.lr and again["r2"] == pytest.approx(first["r2"], rel=1e-9)
