"""The sweep builds the DCL / EqCo grids, runs them, resumes, and writes the table and both plots."""

from pathlib import Path

import pytest

from contrastkit.vision.sweep import negatives, plot, run_sweep, summary_table, sweep_configs, table
from contrastkit.vision.train import VisionConfig

pytestmark = pytest.mark.quick


def test_sweep_grid_negatives_table_and_plots(tmp_path):
    base = VisionConfig(train_images=48, test_images=16, width=4, proj_hidden=16, proj_dim=8, samples=16, threads=1,
                        progress=False, log_every=1)
    runs = sweep_configs(base, tmp_path, [4, 8], ["infonce", "dcl"], [8, 32], ["eqco"], 8, ["eqco"])
    names = [name for name, _ in runs]
    assert names == ["simclr-infonce-b4", "simclr-infonce-b8", "simclr-dcl-b4", "simclr-dcl-b8", "moco-eqco-q8",
                     "moco-eqco-q32", "simo-eqco-b8"]
    assert [negatives(cfg) for _, cfg in runs] == [6, 14, 6, 14, 8, 32, 7]
    chosen = [runs[0], runs[3], runs[4], runs[6]]
    rows = run_sweep(chosen, tmp_path)
    assert [r["samples"] for r in rows] == [16, 16, 16, 16]  # same data seen at every batch size
    assert [r["steps"] for r in rows] == [4, 2, 2, 2]
    mtime = (Path(chosen[0][1].out_dir) / "summary.json").stat().st_mtime
    assert run_sweep(chosen, tmp_path) == rows  # finished runs are read back, not repeated
    assert (Path(chosen[0][1].out_dir) / "summary.json").stat().st_mtime == mtime
    text = table(rows)
    assert text.count("\n") == 6 and "| simo-eqco-b8 | simo | eqco | 8 | - | 7 |" in text
    assert all(0 <= r["probe_top1"] <= 1 for r in rows)
    assert [p.name for p in plot(rows, tmp_path, chance=1 / 8)] == ["batch_size.png", "negatives.png"]


def test_seeds_give_intervals_and_verdicts(tmp_path):
    base = VisionConfig(train_images=48, test_images=16, width=4, samples=16)
    runs = sweep_configs(base, tmp_path, [4], ["infonce", "dcl"], [], [], 8, [], seeds=[0, 1, 2])
    assert [name for name, _ in runs] == ["simclr-infonce-b4-s0", "simclr-dcl-b4-s0", "simclr-infonce-b4-s1",
                                          "simclr-dcl-b4-s1", "simclr-infonce-b4-s2", "simclr-dcl-b4-s2"]
    assert [cfg.seed for _, cfg in runs] == [0, 0, 1, 1, 2, 2]
    rows = [{"name": name, "seed": cfg.seed, "method": "simclr", "loss": cfg.loss, "batch_size": 4, "queue_size": None,
             "knn_top1": knn, "probe_top1": 0.5} for (name, cfg), knn in zip(runs, [0.30, 0.40, 0.32, 0.41, 0.31, 0.42])]
    text = summary_table(rows)
    # infonce kNN 30, 32, 31 %: mean 31.0, sd 1.0, half-width 4.303 / sqrt(3) = 2.48
    assert "| simclr b4 | infonce | 3 | 31.0 ± 2.5 | 50.0 ± 0.0 |" in text
    # dcl - infonce per seed: +10, +9, +11 points: +10.0 ± 2.5, resolved; the probes are equal: not resolved
    assert "- knn_top1, setting simclr b4: dcl - infonce = +10.0 ± 2.5 (95 % CI, 3 seeds): resolved" in text
    assert "- probe_top1, setting simclr b4: dcl - infonce = +0.0 ± 0.0 (95 % CI, 3 seeds): not resolved" in text
