"""The comparison's report: the table averages seeds per loss and batch size, and the plot is written."""

from __future__ import annotations

import json

from contrastkit.clip.compare import report


def test_report_table_and_plot(tmp_path):
    rows = [{"loss": loss, "batch_size": b, "seed": s, "steps": 8192 // b, "top1": top1, "top5": 1.0,
             "mean_per_class_recall": top1, "final_loss": 1.0, "train_seconds": 1.0}
            for loss, b, s, top1 in [("infonce", 8, 0, 0.2), ("infonce", 8, 1, 0.4), ("dcl", 8, 0, 0.5),
                                     ("dcl", 8, 1, 0.5), ("infonce", 16, 0, 0.3), ("dcl", 16, 0, 0.6)]]
    report(rows, tmp_path, samples=8192)
    table = (tmp_path / "results.md").read_text().splitlines()
    assert "| loss | batch 8 | batch 16 |" in table
    assert "| infonce | 0.300 (0.300) | 0.300 (0.300) |" in table
    assert "| dcl | 0.500 (0.500) | 0.600 (0.600) |" in table
    assert json.loads((tmp_path / "results.json").read_text())["samples"] == 8192
    assert (tmp_path / "results.png").stat().st_size > 1000
