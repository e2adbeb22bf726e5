"""The comparison's report: mean ± 95 % interval over seeds per loss and batch size, paired verdicts, the plot."""

from __future__ import annotations

import json

import pytest

from contrastkit.clip.compare import report

pytestmark = pytest.mark.quick


def test_report_table_and_plot(tmp_path):
    rows = [{"loss": loss, "batch_size": b, "seed": s, "steps": 8192 // b, "top1": top1, "top5": 1.0,
             "mean_per_class_recall": top1, "final_loss": 1.0, "train_seconds": 1.0}
            for loss, b, s, top1 in [("infonce", 8, 0, 0.2), ("infonce", 8, 1, 0.4), ("dcl", 8, 0, 0.5),
                                     ("dcl", 8, 1, 0.5), ("infonce", 16, 0, 0.3), ("dcl", 16, 0, 0.6)]]
    report(rows, tmp_path, samples=8192)
    table = (tmp_path / "results.md").read_text().splitlines()
    assert "| loss | batch 8 | batch 16 |" in table
    # infonce at batch 8: 0.2, 0.4 -> mean 0.3, sd 0.1414, half-width 12.706 * 0.1414 / sqrt(2) = 1.271
    assert "| infonce | 0.300 ± 1.271 (0.300) | 0.300 (1 seed) (0.300) |" in table
    assert "| dcl | 0.500 ± 0.000 (0.500) | 0.600 (1 seed) (0.600) |" in table
    # dcl - infonce per seed: +0.3, +0.1 -> +0.200 ± 1.271: the interval contains 0
    assert "- batch_size 8: dcl - infonce = +0.200 ± 1.271 (95 % CI, 2 seeds): not resolved" in table
    assert "- batch_size 16: dcl - infonce = +0.300 1 seed: no interval, not resolved" in table
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["samples"] == 8192 and [v["resolved"] for v in saved["verdicts"]] == [False, None]
    assert (tmp_path / "results.png").stat().st_size > 1000
