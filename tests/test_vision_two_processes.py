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
    # Two SGD steps. One process normalises with torch's batch norm, two with the gathered two-pass formula:
    # two computations whose float32 rounding, amplified by the second step through the small batch's
    # normalisations, parts the weights' displacements by up to 1 % (measured: 1.0e-2 at most, backbone.9).
    # A gradient scaled by 1/2 (or 2) parts them by 50 % (100 %).
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
    for name, value in weights_one.items():
        if not value.is_floating_point() or "running_" in name:
            torch.testing.assert_close(weights_two[name], value, rtol=1e-4, atol=1e-6, msg=name)
            continue
        moved = (value - initial[name]).abs().max()
        assert moved > 1e-3, (name, moved)  # SGD moved every weight far beyond the tolerance below
        parted = (weights_two[name] - value).abs().max()
        assert parted < 0.05 * moved, (name, parted / moved)
