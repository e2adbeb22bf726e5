"""The open_clip adapter: ClipLoss-compatible losses equal the core kernels (and open_clip's ClipLoss for
infonce), reproduce ClipLoss's four distributed modes on 2 gloo processes, and the entry point trains
open_clip_train with a contrastkit loss on 1 CPU process (in the test's own process, through its main(argv))
and 2 (torchrun, `python -m contrastkit.adapters.open_clip`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import reference
from launch import end_process_group, fork_ranks, free_port, logging_kept

open_clip = pytest.importorskip("open_clip")

from contrastkit.adapters.open_clip import (CLIP_LOSSES, active_objective, build_clip_loss,  # noqa: E402
                                            check_open_clip_version, patch, uses_tasks)
from contrastkit.losses import functional  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"infonce": functional.infonce, "dcl": functional.dcl, "dclw": functional.dclw,
           "eqco": functional.eqco}


def _features(n=6, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(n, d, generator=g, dtype=torch.float64)
    text = torch.randn(n, d, generator=g, dtype=torch.float64)
    return image, text


def _kernel_loss(name, image, text, scale):
    """Both directions from the score-level kernel: pos [N], neg [N, N-1] (the other captions/images)."""
    a, b = F.normalize(image, dim=-1), F.normalize(text, dim=-1)
    sim = a @ b.T
    n = sim.shape[0]
    off = ~torch.eye(n, dtype=torch.bool)
    losses = []
    for s in (sim, sim.T):
        pos, neg = s.diagonal(), s[off].reshape(n, n - 1)
        if name == "cacr":
            losses.append(functional.cacr(pos, neg))
        else:
            losses.append(KERNELS[name](pos, neg, temperature=1.0 / scale))
    return torch.cat(losses).mean()


@pytest.mark.quick
@pytest.mark.parametrize("name", CLIP_LOSSES)
def test_adapter_equals_core_kernel(name):
    image, text = (x.requires_grad_() for x in _features())
    scale = torch.tensor(7.5, dtype=torch.float64, requires_grad=True)
    loss = build_clip_loss(name)(image, text, scale)
    grads = torch.autograd.grad(loss, (image, text, scale))
    image2, text2 = (x.detach().clone().requires_grad_() for x in (image, text))
    expected = _kernel_loss(name, image2, text2, scale.item())
    expected_grads = torch.autograd.grad(expected, (image2, text2))
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads[:2], expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if name == "cacr":  # CACR keeps its own t_neg: the CLIP scale gets a zero gradient, but a gradient
        assert grads[2] is not None and grads[2].item() == 0.0
    else:  # the learnable scale stands in for 1/tau and keeps its gradient
        assert grads[2].abs().item() > 1e-6


@pytest.mark.quick
def test_infonce_equals_open_clip_cliploss_with_gradients():
    """open_clip's models normalise their features before ClipLoss; the adapter normalises inside, so the
    same function of the raw features, with the same gradients, is ClipLoss after F.normalize."""
    image, text = (x.requires_grad_() for x in _features(n=8, d=7, seed=1))
    scale = torch.tensor(12.0, dtype=torch.float64, requires_grad=True)
    ours = build_clip_loss("infonce")(image, text, scale, output_dict=True)
    assert set(ours) == {"contrastive_loss"}
    ours_grads = torch.autograd.grad(ours["contrastive_loss"], (image, text, scale))
    ref = open_clip.ClipLoss()(F.normalize(image, dim=-1), F.normalize(text, dim=-1), scale)
    ref_grads = torch.autograd.grad(ref, (image, text, scale))
    torch.testing.assert_close(ours["contrastive_loss"], ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(ours_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.quick
def test_logit_bias_cancels_in_softmax_losses():
    image, text = _features()
    scale = torch.tensor(10.0, dtype=torch.float64)
    bias = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    for name in ("infonce", "dcl"):
        loss_fn = build_clip_loss(name)
        with_bias = loss_fn(image, text, scale, logit_bias=bias)
        torch.testing.assert_close(with_bias, loss_fn(image, text, scale))
        ref = open_clip.ClipLoss()(F.normalize(image, dim=-1), F.normalize(text, dim=-1), scale, logit_bias=bias)
        if name == "infonce":
            torch.testing.assert_close(with_bias, ref)
        assert torch.autograd.grad(with_bias, bias)[0].item() == 0.0


@pytest.mark.parametrize("name", CLIP_LOSSES)
def test_called_the_open_clip_4_way_compiles_whole_and_keeps_no_state(name):
    """open_clip 4's tasks call ``loss(**model_out, output_dict=True)`` (logit_bias among the keys for some models)
    inside the graph that --torchcompile-strategy task|step captures: the loss is one graph (fullgraph, no host
    read), equals eager with its gradients, and a call changes none of its attributes."""
    import copy

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    model_out = {"image_features": torch.randn(8, 16, generator=g), "text_features": torch.randn(8, 16, generator=g),
                 "logit_scale": torch.tensor(14.0), "logit_bias": torch.tensor(-2.0)}
    loss_fn = build_clip_loss(name, chunk_size=3)  # several blocks and a ragged last one

    def run(fn):
        leaves = {k: v.clone().requires_grad_() for k, v in model_out.items()}
        out = fn(**leaves, output_dict=True)
        return out, torch.autograd.grad(out["contrastive_loss"], list(leaves.values()), allow_unused=True)

    def state():  # every attribute of the loss and of the objective inside it
        return [{k: v for k, v in vars(m).items() if k != "_modules"} for m in loss_fn.modules()]

    def same(a, b):
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    before = copy.deepcopy(state())
    want, want_grads = run(loss_fn)
    assert all(same(a, b) for a, b in zip(state(), before, strict=True))
    got, got_grads = run(torch.compile(loss_fn, fullgraph=True, backend="aot_eager"))
    assert set(got) == {"contrastive_loss"}
    torch.testing.assert_close(got["contrastive_loss"], want["contrastive_loss"], rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.quick
def test_bad_names_and_versions():
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        build_clip_loss("nope")
    with pytest.raises(ValueError, match="unigrad has no image-text form"):
        build_clip_loss("unigrad")
    for version in ("2.32.0", "4.3.0", "5.0.0"):
        with pytest.raises(RuntimeError, match=f"supports open_clip_torch >=3.0,<4.3 .*found {version}"):
            check_open_clip_version(version)
    assert check_open_clip_version().startswith("3.") and not uses_tasks()
    assert check_open_clip_version("4.2.0.dev0") == "4.2.0.dev0" and uses_tasks("4.2.0.dev0")
    with pytest.raises(ValueError, match="must be \\[N, D\\]"):
        build_clip_loss("dcl")(torch.randn(4), torch.randn(4), 10.0)


@pytest.mark.quick
def test_patch_makes_create_loss_return_the_loss():
    import argparse

    args = argparse.Namespace(distill=False, model="ViT-B-32", siglip=False, local_loss=False,
                              gather_with_grad=False, rank=0, world_size=1, horovod=False)
    original = open_clip.create_loss
    with patch("dclw", sigma=0.3) as handle:
        loss = open_clip.create_loss(args)
        assert loss.name == "dclw" and loss.loss.sigma == 0.3
        assert active_objective() is handle.objective and active_objective().name == "dclw"
        with pytest.raises(ValueError, match="replaces ClipLoss only; this run uses SigLIP"):
            open_clip.create_loss(argparse.Namespace(**{**vars(args), "siglip": True}))
        patch("dcl")  # a second patch replaces the first
        assert active_objective().name == "dcl"
    assert open_clip.create_loss is original  # leaving the block restored open_clip
    handle.undo()  # nothing left to undo: a no-op
    assert isinstance(open_clip.create_loss(args), open_clip.ClipLoss) and active_objective() is None


# ---------------------------------------------------------------------------- 2 processes

MODES = [(False, False), (False, True), (True, False), (True, True)]  # (local_loss, gather_with_grad)


def _worker(rank, world, init_file, out_dir):
    """One of the two gloo processes that both two-process tests read (one spawn for the two: each spawned
    process's start-up, torch and open_clip, paid once): the four modes' results, then the sample ids'."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {"modes": _modes(rank, world), "ids": _ids(rank, world)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Each rank's results (_worker), spawned once for the module."""
    tmp = tmp_path_factory.mktemp("two_processes")
    fork_ranks(_worker, (2, str(tmp / "init"), str(tmp)))
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


def _modes(rank, world):
    image, text = _features(n=8, d=5, seed=3)
    n = image.shape[0] // world
    results = {}
    for local_loss, gwg in MODES:
        for name in (*CLIP_LOSSES, "open_clip"):
            a = image[rank * n:(rank + 1) * n].clone().requires_grad_()
            b = text[rank * n:(rank + 1) * n].clone().requires_grad_()
            scale = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
            opts = dict(local_loss=local_loss, gather_with_grad=gwg, rank=rank, world_size=world)
            if name == "open_clip":
                loss = open_clip.ClipLoss(**opts)(F.normalize(a, dim=-1), F.normalize(b, dim=-1), scale)
            else:
                loss = build_clip_loss(name, **opts)(a, b, scale)
            loss.backward()
            results[(local_loss, gwg, name)] = (loss.item(), a.grad, b.grad, scale.grad)
    return results


def test_two_processes_reproduce_open_clip_modes_and_equal_one_process(two_processes):
    world = 2
    ranks = [r["modes"] for r in two_processes]
    image, text = _features(n=8, d=5, seed=3)

    def gathered(key):
        loss = [r[key][0] for r in ranks]
        grads = [torch.cat([r[key][i] for r in ranks]) / world for i in (1, 2)]  # DDP averages over processes
        return loss, grads, sum(r[key][3] for r in ranks) / world

    for local_loss, gwg in MODES:
        # infonce reproduces open_clip's ClipLoss in every mode, including the detached parts.
        ours, ref = gathered((local_loss, gwg, "infonce")), gathered((local_loss, gwg, "open_clip"))
        assert ours[0] == pytest.approx(ref[0], rel=1e-12)
        for got, want in zip(ours[1] + [ours[2]], ref[1] + [ref[2]]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        if not gwg:
            continue
        # With gradients through the gather, 2 processes equal 1 process on the whole batch.
        for name in CLIP_LOSSES:
            a, b = image.clone().requires_grad_(), text.clone().requires_grad_()
            scale = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
            single = build_clip_loss(name)(a, b, scale)
            single_grads = torch.autograd.grad(single, (a, b, scale))
            losses, grads, scale_grad = gathered((local_loss, gwg, name))
            global_loss = sum(losses) / world if local_loss else losses[0]
            assert global_loss == pytest.approx(single.item(), rel=1e-12), (name, local_loss)
            if not local_loss:
                assert losses[1] == pytest.approx(losses[0], rel=1e-12)
            for got, want in zip(grads + [scale_grad], single_grads):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} local_loss={local_loss} {m}")


# ---------------------------------------------------------------------------- the entry point


@pytest.fixture(scope="module")
def tiny_csv(tmp_path_factory):
    from contrastkit.data.image_text import make_shapes_clip

    root = make_shapes_clip(tmp_path_factory.mktemp("data"), num_train=32, num_zeroshot_per_class=1, progress=False)
    return root / "train.csv"


def _open_clip_train(launcher, tiny_csv, tmp, extra=()):
    """``python -m contrastkit.adapters.open_clip --loss dcl <open_clip_train's arguments>``: under ``launcher``
    (torchrun), or with none in this process, through the module's main(argv) as ``python -m`` calls it (its
    imports paid once; the root logger's handlers and the loggers' levels, which open_clip_train sets, put back
    after: logging_kept). The module's ``__main__`` line is the two-process run's."""
    args = ["--loss", "dcl", "--train-data", str(tiny_csv), "--dataset-type", "csv", "--csv-separator", "\t",
            "--model", "contrastkit-tiny", "--batch-size", "8", "--epochs", "1", "--workers", "0",
            "--precision", "fp32", "--device", "cpu", "--lr", "1e-3", "--warmup", "1", "--log-every-n-steps", "1",
            "--name", "run", "--report-to", "", *extra]
    # open_clip_train writes under ./logs (torchrun's parser would take "--logs" for its own --logs-specs)
    if launcher is None:
        from contrastkit.adapters.open_clip import main

        with logging_kept(), pytest.MonkeyPatch.context() as m:
            m.chdir(tmp)
            assert main(args) in (0, None)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([*launcher, "-m", "contrastkit.adapters.open_clip", *args], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    logs = tmp / "logs" / "run"
    log = (logs / "out.log").read_text()
    assert "contrastkit loss dcl replaces open_clip's ClipLoss" in log
    assert (logs / "checkpoints" / "epoch_1.pt").exists()
    return log


def _losses(log):
    import re

    return [float(m) for m in re.findall(r"Contrastive_loss: ([0-9.]+)", log)]


def test_entry_point_trains_open_clip_train_one_process(tiny_csv, tmp_path):
    log = _open_clip_train(None, tiny_csv, tmp_path)
    losses = _losses(log)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))


def test_entry_point_trains_open_clip_train_two_processes(tiny_csv, tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    log = _open_clip_train(launcher, tiny_csv, tmp_path, ["--local-loss", "--gather-with-grad"])
    assert "world size: 2" in log.lower() or "Running in distributed mode" in log
    assert len(_losses(log)) == 2  # 32 pairs, a global batch of 16 per step


# ---------------------------------------------------------------------------- sample ids (duplicates)

IDS = torch.tensor([0, 1, 0, 2, 3, 1, 4, 5])  # pairs 0 and 2, 1 and 5: one image with two captions


def _ids(rank, world):
    image, text = _features(n=8, d=5, seed=4)
    n = image.shape[0] // world
    results = {}
    for local_loss, gwg in MODES:
        for name, mode in (("dcl", "mask"), ("infonce", "positive")):
            a, b = (x[rank * n:(rank + 1) * n].clone().requires_grad_() for x in (image, text))
            scale = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
            loss_fn = build_clip_loss(name, same_label=mode, local_loss=local_loss, gather_with_grad=gwg, rank=rank,
                                      world_size=world)
            loss = loss_fn(a, b, scale, sample_ids=IDS[rank * n:(rank + 1) * n])
            loss.backward()
            results[(local_loss, gwg, name)] = (loss.item(), a.grad, b.grad)
    return results


def test_sample_ids_in_every_open_clip_mode(two_processes):
    """sample_ids: one process equals the core's cross_modal with the ids as labels (against the float64
    reference); on 2 processes every mode (local_loss x gather_with_grad) gathers them with the features: the
    loss equals one process's on the whole batch, and with gradients through the gather the gradients too."""
    image, text = _features(n=8, d=5, seed=4)
    world = 2
    ranks = [r["ids"] for r in two_processes]
    for name, mode in (("dcl", "mask"), ("infonce", "positive")):
        a, b = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = torch.tensor(6.0, dtype=torch.float64)
        single = build_clip_loss(name, same_label=mode)(a, b, scale, sample_ids=IDS)
        expected = reference.labelled_cross_modal(a, b, IDS, name, mode, tau=1 / 6.0)
        torch.testing.assert_close(single, expected, rtol=1e-10, atol=1e-12)
        single_grads = torch.autograd.grad(single, (a, b))
        assert build_clip_loss(name, same_label=mode)(a, b, scale, sample_ids=torch.arange(8)) != single
        for local_loss, gwg in MODES:
            losses = [r[(local_loss, gwg, name)][0] for r in ranks]
            global_loss = sum(losses) / world if local_loss else losses[0]
            assert global_loss == pytest.approx(single.item(), rel=1e-12), (name, local_loss, gwg)
            if gwg:
                for i in (1, 2):
                    got = torch.cat([r[(local_loss, gwg, name)][i] for r in ranks]) / world
                    torch.testing.assert_close(got, single_grads[i - 1], rtol=1e-10, atol=1e-12)
