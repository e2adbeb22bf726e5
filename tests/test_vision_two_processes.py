"""Two processes equal one in the vision recipe under SGD, whose update is proportional to the gradient.

tests/test_vision_train.py's two-process runs train with AdamW, which divides a constant factor on the gradients
out (up to its eps): they pass with every gradient halved, e.g. a loss divided by the number of processes on top
of DDP's own averaging (tools/bugs.py: two-process-loss-averaged-twice). In the quick tier: its two ranks are
forked from the test's process (launch.run_ranks), a few seconds in all."""

from __future__ import annotations

import pytest
import torch

from contrastkit.vision.train import build_model, train
from test_vision_train import as_flags, final_model, launch, records, tiny


@pytest.mark.quick
def test_two_processes_match_one_with_sgd(tmp_path):
    # One update, small enough that the two runs' rounding stays far below the tolerances (1 against 2 processes:
    # losses within 1e-6, weights within 1e-6 here; a 2x larger lr already parts them by 2e-4 after two steps).
    cfg = tiny(tmp_path, "simclr", "dcl", steps=2, optimizer="sgd", lr=0.005, warmup=0, weight_decay=0.0)
    train(cfg)
    launch(as_flags(cfg), tmp_path / "two")
    one, two = ([r for r in records(out) if "loss" in r] for out in (cfg.out_dir, tmp_path / "two"))  # not kNN's
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    # step 2's loss follows step 1's update: the same gradients give the same loss
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg).state_dict()
    weights_one, weights_two = final_model(cfg.out_dir), final_model(tmp_path / "two")
    moved = (weights_one["backbone.0.weight"] - initial["backbone.0.weight"]).abs().max()
    assert moved > 1e-3, moved  # SGD moved the weights far beyond the tolerance below
    for name, value in weights_one.items():
        torch.testing.assert_close(weights_two[name], value, rtol=1e-4, atol=1e-5, msg=name)
