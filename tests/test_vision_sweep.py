"""The sweep builds the DCL / EqCo grids, runs them, resumes, and writes the table and both plots."""

from pathlib import Path

from contrastkit.vision.sweep import negatives, plot, run_sweep, sweep_configs, table
from contrastkit.vision.train import VisionConfig


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
