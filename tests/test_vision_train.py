"""The vision recipe: every method with every objective trains; 2 processes equal 1; resume is exact; bad setups fail."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import run_ranks
from contrastkit.losses import available_losses
from contrastkit.training import StepBatches
from contrastkit.vision.augment import MultiViewDataset, simclr_augment
from contrastkit.vision.methods import check_setup
from contrastkit.vision.train import VisionConfig, build_model, train

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(train_images=64, test_images=32, batch_size=8, width=8, proj_hidden=32, proj_dim=16, threads=1,
            progress=False, log_every=1)
COMBOS = [(m, loss) for m in ("simclr", "moco", "simo") for loss in available_losses()
          if not (m == "moco" and loss == "unigrad")]


def tiny(tmp_path, method, loss, **overrides):
    options = {**TINY, "method": method, "loss": loss, "out_dir": str(tmp_path / f"{method}_{loss}"), "steps": 2,
               "queue_size": 16 if method == "moco" else None, "views": 3 if loss == "cacr" else 2, **overrides}
    return VisionConfig(**options)


def records(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def final_model(out_dir):
    return load_file(str(sorted((Path(out_dir) / "checkpoints").glob("checkpoint_*"))[-1] / "model.safetensors"))


@pytest.mark.parametrize("method,loss", COMBOS)
def test_every_method_trains_with_every_objective(tmp_path, method, loss):
    cfg = tiny(tmp_path, method, loss)
    summary = train(cfg)
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["final_loss"]))
    assert 0.0 <= summary["knn_top1"] <= 1.0
    out = Path(cfg.out_dir)
    for name in ("metrics.jsonl", "metrics.png", "summary.json", "config.json", "backbone.pt"):
        assert (out / name).exists(), name
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg).state_dict()
    trained = final_model(out)
    assert not torch.equal(initial["backbone.0.weight"], trained["backbone.0.weight"])  # gradients reached it
    if method != "simclr" and loss != "unigrad":
        assert not torch.equal(initial["momentum_backbone.0.weight"], trained["momentum_backbone.0.weight"])
    if method == "moco":
        assert not torch.equal(initial["queue"], trained["queue"]) and int(trained["queue_ptr"]) == 16 % 16
    if loss == "unigrad":
        assert trained["loss_fn.correlation"].shape == (16, 16)


def launch(args, out_dir, processes=2):
    """The vision recipe on ``processes`` gloo ranks forked from this process (launch.run_ranks: each a real
    process with its process group, torch's variables as srun gives a job's tasks, the imports already paid).
    `accelerate launch` of this recipe is test_recipe_runs.py's two-process test's."""
    ranks = run_ranks(ROOT / "recipes/vision/train.py", [*args, "--out-dir", out_dir], processes)
    assert [r.returncode for r in ranks] == [0] * processes, "\n".join(r.stdout[-3000:] for r in ranks)


def as_flags(cfg: VisionConfig):
    flags = []
    for key, value in vars(cfg).items():
        if key == "out_dir" or value is None:
            continue
        if isinstance(value, dict):  # loss options: one --loss-option KEY=VALUE each
            flags += [f for k, v in value.items() for f in ("--loss-option", f"{k}={v}")]
            continue
        flag = "--" + key.replace("_", "-")
        flags += [flag if value else "--no-" + key.replace("_", "-")] if isinstance(value, bool) else [flag, str(value)]
    return flags


@pytest.mark.parametrize("method,loss,labels", [("moco", "dclw", False), ("simclr", "cacr", False),
                                                ("simo", "unigrad", False), ("moco", "infonce", True)])
def test_two_processes_match_one(tmp_path, method, loss, labels):
    """labels: SupCon with a queue, whose labels are enqueued from every process with the keys."""
    cfg = tiny(tmp_path, method, loss, steps=4, queue_size=12 if method == "moco" else None, labels=labels)
    train(cfg)
    launch(as_flags(cfg), tmp_path / "two")
    one, two = records(cfg.out_dir), records(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        for key in a:
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key)
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["processes"] == 2
    weights_one, weights_two = final_model(cfg.out_dir), final_model(tmp_path / "two")
    for name, value in weights_one.items():
        torch.testing.assert_close(weights_two[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("method,loss", [("moco", "eqco"), ("simo", "unigrad")])
def test_resume_continues_exactly(tmp_path, method, loss):
    straight = tiny(tmp_path / "straight", method, loss, steps=6)
    train(straight)
    interrupted = tiny(tmp_path / "interrupted", method, loss, steps=6, save_every=3)
    train(interrupted)
    shutil.rmtree(Path(interrupted.out_dir) / "checkpoints" / "checkpoint_6")  # as if the run had stopped after step 3
    interrupted.resume = True
    train(interrupted)
    a, b = records(straight.out_dir), records(interrupted.out_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra == pytest.approx(rb, rel=1e-6), ra["step"]
    weights_a, weights_b = final_model(straight.out_dir), final_model(interrupted.out_dir)
    for name, value in weights_a.items():
        torch.testing.assert_close(weights_b[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.quick
def test_views_and_batches_depend_only_on_seed_epoch_index():
    from contrastkit.data.images import ShapesImages

    images = ShapesImages("train", size=16, num_images=24)
    views = MultiViewDataset(images, simclr_augment(16), views=2, seed=3)
    assert torch.equal(views[(1, 5)][0], views[(1, 5)][0])
    assert not torch.equal(views[(1, 5)][0], views[(2, 5)][0])
    whole = list(StepBatches(24, 8, stop=5, tag_epoch=True))
    halves = [list(StepBatches(24, 8, rank=r, world=2, stop=5, tag_epoch=True)) for r in (0, 1)]
    assert [a + b for a, b in zip(*halves)] == whole
    assert list(StepBatches(24, 8, start=3, stop=5, tag_epoch=True)) == whole[3:]
    assert sorted(i for batch in whole[:3] for _, i in batch) == list(range(24))  # one epoch covers the data once


@pytest.mark.quick
def test_bad_setups_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'byol'"):
        check_setup("byol", "dcl", 32)
    with pytest.raises(ValueError, match="unknown loss"):
        check_setup("simclr", "ntxent", 32)
    with pytest.raises(ValueError, match="batch-size 1 is too small for simclr with dcl"):
        train(tiny(tmp_path, "simclr", "dcl", batch_size=1))
    with pytest.raises(ValueError, match="too small for simo"):
        check_setup("simo", "infonce", 1)
    with pytest.raises(ValueError, match="unigrad has no queue form"):
        check_setup("moco", "unigrad", 32, queue_size=64)
    with pytest.raises(ValueError, match="moco needs a queue"):
        check_setup("moco", "dcl", 32)
    with pytest.raises(ValueError, match="simclr has no queue"):
        check_setup("simclr", "dcl", 32, queue_size=64)
    with pytest.raises(ValueError, match="unigrad takes no labels"):
        train(tiny(tmp_path, "simclr", "unigrad", labels=True))
    with pytest.raises(ValueError, match="larger than the dataset"):
        train(tiny(tmp_path, "simclr", "dcl", batch_size=128))
    assert not (tmp_path / "simclr_dcl" / "checkpoints").exists()


# Measured (the default recipe, SimCLR + InfoNCE, on 2000 embedded images, width 16, 150 steps; seeds 0-2; 36 s
# each here): linear probe 0.438, 0.412, 0.386 against 0.342, 0.316, 0.270 at random init (gains 0.096, 0.096,
# 0.116; 500 test images, a standard error of ~0.022); kNN gains only 0.006, 0.068, 0.072 at this length, so kNN
# is not asserted here (nor in the supervised test below, where it is as unsteady; the full default's kNN against
# random init and raw pixels, seeds 0-2, is in docs/evidence.md, section 3). The margin is about half the smallest
# gain. Re-measured since one process trains with torch's batch norm (seeds 0-4): probe gains 0.116, 0.094, 0.144,
# 0.160, 0.100, kNN 0.012, 0.058, 0.070, 0.070, 0.048. Shorter runs do not hold the margin: 100 steps gave probe
# gains 0.056, 0.026, 0.110, 0.126, 0.000 (seeds 0-4), 70 steps 0.000 at seed 0.
LEARN = dict(train_images=2000, test_images=500, width=16, batch_size=64, steps=150, margin=0.05)


@pytest.mark.slow  # 45-63 s here, 26 of them torchvision's augmentations (1.4 ms a view); the supervised run below
def test_short_default_run_learns(tmp_path):  # shows in the default tier that the recipe trains its backbone
    """A short run of the default recipe on the embedded shapes: its frozen features beat the same backbone at
    initialisation in the L-BFGS linear probe (same splits) by LEARN's margin."""
    from contrastkit.vision.baselines import frozen_scores, initial_backbone
    from contrastkit.vision.train import load_backbone

    options = {k: v for k, v in LEARN.items() if k != "margin"}
    train(VisionConfig(out_dir=str(tmp_path / "run"), threads=1, progress=False, log_every=10, **options))
    backbone, cfg = load_backbone(tmp_path / "run")
    trained, random_init = frozen_scores(backbone, cfg), frozen_scores(initial_backbone(cfg), cfg)
    print(json.dumps({"trained": trained, "random_init": random_init}))
    assert trained["probe_top1"] > random_init["probe_top1"] + LEARN["margin"], (trained, random_init)


@pytest.mark.parametrize("method,loss,same_label", [("simclr", "eqco", "positive"), ("moco", "dcl", "positive"),
                                                     ("simo", "cacr", "mask")])
def test_every_method_trains_with_labels(tmp_path, method, loss, same_label):
    summary = train(tiny(tmp_path, method, loss, labels=True, same_label=same_label))
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["final_loss"]))
    model = build_model(tiny(tmp_path, method, loss, labels=True, same_label=same_label))
    with pytest.raises(ValueError, match="built with labels=True"):
        model(torch.zeros(4, model.views, 3, 32, 32))


# Measured (this config, supervised contrastive: InfoNCE with same_label="positive", SupCon's L_out, at
# temperature 0.5, 100 steps; ~25 CPU-s of training and ~3 of evaluation here), the gain over the same backbone at
# initialisation on 1000 test images, seeds 0-7 (the test runs seed 0):
#   probe  +17.0 +16.9  +5.8 +13.3 +11.7  +9.9 +11.1  +9.7 points (worst +5.8, seed 2)
#   kNN    +10.7  +5.3  +0.7  +7.4  +6.8  +4.9  +3.8  +5.0 points (worst +0.7, seed 2)
# A run that does not learn (lr 1e-9: only batch norm's running statistics move) scores probe -1.8, -5.8 and kNN
# +1.1, -2.3 (seeds 0, 2): the floor, and the noise of a paired difference on 1000 test images (~2 points).
# Probe margin 0.03: half the worst seed's gain, 4.8 points over the highest no-learning score. kNN is printed,
# not asserted: its gain is within that noise at seed 2 (+0.7), so no margin above noise holds at every seed (the
# earlier kNN margin 0.07 failed at 6 of these 8 seeds and the probe's 0.09 at seed 2: they held by seed 0's luck).
# Nothing tried at about this cost made kNN steady (kNN gain at the worst seeds): lighter augmentation (crop 0.6,
# no blur; seed 1 +0.7), with 160 steps (seed 1 +2.7), lr 2e-2 / 4e-2 (seed 2 +1.4, -0.8), SGD at lr 0.1 (seeds 1,
# 2: +3.0, +2.8), batch 32 x 200 steps (seed 2 -4.4), temperature 0.2 / 1.0 (seed 1 -0.8, +3.3). In the runs
# inspected the projection collapses within the warm-up (positive and negative cosines both ~0.9, the loss stays
# near the all-equal log(2N - 1) = 4.84), and the labels barely matter here (without --labels, seed 0: probe
# +19.5, kNN +6.3; seed 2: +1.3, +0.3): this test shows that a --labels run trains its backbone, not that the
# labels help.
SUPERVISED = dict(train_images=1000, test_images=1000, batch_size=64, width=8, proj_hidden=128, proj_dim=64,
                  steps=100, knn_k=50, lr=1e-2, temperature=0.5, labels=True, same_label="positive",
                  margins={"probe_top1": 0.03})


def test_supervised_contrastive_with_labels_learns(tmp_path):
    """--labels (SupCon) on the embedded shapes: frozen features beat the same backbone at initialisation in the
    linear probe by SUPERVISED's margin (kNN printed only: see the measurements above SUPERVISED)."""
    from contrastkit.vision.baselines import frozen_scores, initial_backbone
    from contrastkit.vision.train import load_backbone

    options = {k: v for k, v in SUPERVISED.items() if k != "margins"}
    train(VisionConfig(out_dir=str(tmp_path / "run"), threads=1, progress=False, log_every=10, **options))
    backbone, cfg = load_backbone(tmp_path / "run")
    trained, untrained = frozen_scores(backbone, cfg), frozen_scores(initial_backbone(cfg), cfg)
    print(json.dumps({"trained": trained, "random_init": untrained}))
    for metric, margin in SUPERVISED["margins"].items():
        assert trained[metric] > untrained[metric] + margin, (metric, trained, untrained)


@pytest.mark.quick
def test_random_init_floor_is_the_backbone_an_untrained_run_saves(tmp_path):
    """``baselines``' random-init floor is the weights a run starts from: ``--steps 0`` (the suite's untrained
    row) saves a backbone that scores exactly the same; the pixel floor is the same data flattened."""
    from torch import nn

    from contrastkit.vision.baselines import baselines, frozen_scores
    from contrastkit.vision.train import load_backbone

    cfg = VisionConfig(out_dir=str(tmp_path), train_images=64, test_images=32, width=8, batch_size=8, steps=0,
                       knn_k=5, seed=3, threads=1, progress=False)
    train(cfg)
    untrained, cfg = load_backbone(cfg.out_dir)
    floors = baselines(cfg)
    assert floors["random_init"] == frozen_scores(untrained, cfg)
    assert floors["pixels"] == frozen_scores(nn.Flatten(), cfg)
