"""Coming from lightly (docs/ecosystems/lightly.md): each "same value" of the page's table computed against lightly's
own classes, and lightly's SimCLR example for PyTorch Lightning with DCL swapped in (tests/scripts/lightly_simclr.py,
the page's LightningModule) learning on one process and giving one process's losses on two (``strategy="ddp"``,
gloo), where lightly's DCLW gathered does not."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from contrastkit.losses import build_loss

lightly_loss = pytest.importorskip("lightly.loss")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "lightly_simclr.py"
PAGE = ROOT / "docs" / "ecosystems" / "lightly.md"
STEPS = 40  # the one-process run's (4 epochs); the two-process run compares its first COMPARED steps
COMPARED = 4
IMAGES = ["--num-images", "320"]  # both runs: the order of the images is drawn from their number
# The one-process run must lower DCL on a fixed batch of 64 views (τ 0.1, 126 negatives each) by this much from
# its untrained start: 40 steps at a batch of 32 (4 epochs of 320 images, Adam at 1e-3) lowered it by 0.82 to 1.26
# over seeds 0-5 (from 4.59-4.74 to 3.46-3.89). A model that does not learn (lr 0) keeps it to the float; one that
# collapses to a point raises it to log 126 = 4.84.
MARGIN = 0.5


def _views(seed, n=16, d=32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2)]


def _value_and_grads(loss_fn, seed):
    z = _views(seed)
    loss = loss_fn(*z)
    loss.backward()
    return loss.detach(), [v.grad for v in z]


def _lightly(make):
    with warnings.catch_warnings():  # lightly's DCLW weights copy-construct a tensor
        warnings.simplefilter("ignore", UserWarning)
        return make()


@pytest.mark.quick
@pytest.mark.parametrize("theirs,ours", [
    (lambda: lightly_loss.NTXentLoss(), lambda: build_loss("infonce", temperature=0.5)),
    (lambda: lightly_loss.NTXentLoss(temperature=0.2), lambda: build_loss("infonce", 0.2)),
    (lambda: lightly_loss.DCLLoss(), lambda: build_loss("dcl")),
    (lambda: lightly_loss.DCLLoss(temperature=0.07), lambda: build_loss("DCLLoss", temperature=0.07)),
    (lambda: lightly_loss.DCLWLoss(), lambda: build_loss("dclw")),
    (lambda: lightly_loss.DCLWLoss(temperature=0.2, sigma=1.5), lambda: build_loss("DCLWLoss", 0.2, sigma=1.5)),
], ids=["ntxent-default", "ntxent-0.2", "dcl-default", "dcl-0.07", "dclw-default", "dclw-0.2-1.5"])
def test_same_value_and_gradient_as_lightly_on_one_process(theirs, ours):
    for seed in (0, 1):
        want, want_grads = _lightly(lambda: _value_and_grads(theirs(), seed))
        got, got_grads = _value_and_grads(ours(), seed)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.quick
def test_the_default_temperatures_differ_as_the_page_says():
    """lightly's NTXentLoss() is τ 0.5, contrastkit's infonce τ 0.1 (so neither "ntxent" alias would be the same
    value by default); lightly's DCLLoss and DCLWLoss share contrastkit's τ 0.1 and σ 0.5."""
    assert lightly_loss.NTXentLoss().temperature == 0.5 and build_loss("infonce").temperature == 0.1
    assert lightly_loss.DCLLoss().temperature == build_loss("dcl").temperature == 0.1
    z = [v.detach() for v in _views(0, 32, 64)]
    theirs, ours = float(lightly_loss.NTXentLoss()(*z)), float(build_loss("infonce")(*z))
    assert (round(theirs, 2), round(ours, 2)) == (4.15, 4.75)  # the page's numbers


@pytest.mark.quick
def test_the_memory_bank_is_query_key_with_the_bank_as_queue():
    """NTXentLoss(memory_bank_size=(Q, D)): each query (out0) against its key (out1) and the bank as it was before
    the call, which then takes the batch's keys: query_key(out0, out1, queue) with the queue the caller keeps."""
    theirs = lightly_loss.NTXentLoss(temperature=0.5, memory_bank_size=(48, 32)).double()
    # lightly starts from random unit vectors (float32's: renormalised in float64, as contrastkit takes a queue)
    theirs.memory_bank.bank = torch.nn.functional.normalize(theirs.memory_bank.bank, dim=1)
    ours = build_loss("infonce", temperature=0.5)
    queue = theirs.memory_bank.bank.clone()
    for seed in range(3):
        z0, z1 = _views(seed)
        want = theirs(z0, z1)
        got = ours.query_key(z0, z1, queue)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        queue = torch.cat([queue, torch.nn.functional.normalize(z1.detach(), dim=1)])[16:]  # first in, first out
        torch.testing.assert_close(queue.sort(0).values, theirs.memory_bank.bank.sort(0).values)


@pytest.mark.quick
def test_the_page_shows_the_scripts_lightning_module():
    """The LightningModule of docs/ecosystems/lightly.md is the one the Lightning runs below train."""
    source = SCRIPT.read_text()
    module = re.search(r"^class SimCLR\(pl\.LightningModule\):\n(?:(?:    .*)?\n)+", source, flags=re.M).group(0)
    assert module.strip() in PAGE.read_text()


@pytest.mark.quick
def test_print_and_lightnings_summary_show_the_settings():
    from pytorch_lightning.utilities.model_summary import ModelSummary

    model = _script().SimCLR(gather_distributed=True)
    assert "(criterion): DCLLoss(temperature=0.1, gather_distributed=True, same_label='mask')" in str(model)
    summary = str(ModelSummary(model, max_depth=1))
    row = next(line for line in summary.splitlines() if "criterion" in line)
    assert re.search(r"criterion\s*\|\s*DCLLoss\s*\|\s*0\s*\|", row), summary


def _script():
    """tests/scripts/lightly_simclr.py as a module."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import lightly_simclr
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return lightly_simclr


def _run(out: Path, devices: int, steps: int, *extra: str) -> dict:
    """The script as a user starts it (Lightning starts the other processes by running it again)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--devices", str(devices),
                           "--steps", str(steps), *extra], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "losses.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The script's run on one process, in this one (its imports are paid here once), leaving the global random
    states and PL_GLOBAL_SEED (seed_everything's) as they were."""
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PL_GLOBAL_SEED", raising=False)
        try:
            return _script().main(["--out", str(tmp_path_factory.mktemp("one")), "--steps", str(STEPS), *IMAGES])
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])


def test_one_process_learns(one_process):
    assert one_process["processes"] == 1 and len(one_process["losses"]) == STEPS
    assert one_process["after"] < one_process["before"] - MARGIN, one_process


def test_two_processes_give_one_processs_losses_and_lightlys_dclw_differs(one_process, tmp_path):
    """strategy="ddp" on 2 gloo processes at a batch of 16 each, DCL with gather_distributed=True: the losses of
    the first steps are one process's at 32 (the same views, Lightning's DistributedSampler splitting each global
    batch). lightly's gathered NTXentLoss and DCLLoss equal contrastkit's per process; its gathered DCLWLoss does
    not: it weighs each process's pairs over its own batch, contrastkit over the gathered one."""
    two = _run(tmp_path, 2, COMPARED, *IMAGES, "--compare-lightly")
    assert two["processes"] == 2
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one_process["losses"][:COMPARED]),
                               rtol=1e-5, atol=1e-5)
    measured = json.loads((tmp_path / "lightly.json").read_text())
    for name in ("infonce", "dcl"):
        assert max(measured[name]["loss_difference"]) < 1e-12 and max(measured[name]["grad_difference"]) < 1e-12
        assert abs(measured[name]["lightly_mean_minus_one_process"]) < 1e-12
    for name in ("infonce", "dcl", "dclw"):
        assert abs(measured[name]["contrastkit_mean_minus_one_process"]) < 1e-12, measured[name]
    dclw = measured["dclw"]
    assert min(dclw["loss_difference"]) > 1e-4 and abs(dclw["lightly_mean_minus_one_process"]) > 1e-5, dclw
    assert max(dclw["grad_difference"]) > 1e-6, dclw
