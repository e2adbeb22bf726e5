"""P processes (gloo, CPU) with gathered negatives give the loss and gradients of one process on the
concatenated batch, for every objective, also when processes hold different numbers of samples."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from contrastkit.losses import available_losses, build_loss

OPTIONS = {"unigrad": {"lam": 10.0, "rho": 0.5}}


def _batch(seed, n, d=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(4)]  # z1, z2, z3, queue-ish


def _make(name):
    opts = dict(OPTIONS.get(name, {}))
    if name != "unigrad":
        opts["gather_distributed"] = True
    return build_loss(name, **opts).double()


def _run(rank, world, sizes, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    total = sum(sizes)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    results = {}
    for name in available_losses():
        views = [z[lo:hi].clone().requires_grad_() for z in _batch(0, total)[:2]]
        loss_fn = _make(name)
        weight = sizes[rank] / total  # the global mean is the size-weighted mean of local means
        loss = loss_fn(*views)
        (weight * loss).backward()
        if name == "unigrad":  # a second step, so the running correlation is used after an update
            views2 = [z[lo:hi].clone().requires_grad_() for z in _batch(1, total)[:2]]
            loss = loss_fn(*views2)
            (weight * loss).backward()
            views = views2
        results[name] = (float(loss.detach()) * weight, [v.grad for v in views],
                         getattr(loss_fn, "correlation", None))
    for name in ("infonce", "dcl", "dclw", "eqco", "cacr"):  # image-text
        a, b = (x[lo:hi].clone().requires_grad_() for x in _batch(4, total)[:2])
        loss = _make(name).cross_modal(a, b)
        (sizes[rank] / total * loss).backward()
        results[name + "/cross_modal"] = (float(loss) * sizes[rank] / total, [a.grad, b.grad], None)
    for name in ("dcl", "cacr"):  # several views and the query/key form without a queue
        z = [x[lo:hi].clone().requires_grad_() for x in _batch(2, total)[:3]]
        loss = _make(name)(*z)
        (sizes[rank] / total * loss).backward()
        results[name + "/3views"] = (float(loss) * sizes[rank] / total, [x.grad for x in z], None)
        q, k = (x[lo:hi].clone().requires_grad_() for x in _batch(3, total)[:2])
        loss = _make(name).query_key(q, k)
        (sizes[rank] / total * loss).backward()
        results[name + "/query_key"] = (float(loss) * sizes[rank] / total, [q.grad, k.grad], None)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _single(sizes):
    total = sum(sizes)
    expected = {}
    for name in available_losses():
        loss_fn = build_loss(name, **OPTIONS.get(name, {})).double()
        views = [z.clone().requires_grad_() for z in _batch(0, total)[:2]]
        loss = loss_fn(*views)
        if name == "unigrad":
            loss.backward()
            views = [z.clone().requires_grad_() for z in _batch(1, total)[:2]]
            loss = loss_fn(*views)
        grads = torch.autograd.grad(loss, views)
        expected[name] = (float(loss), grads, getattr(loss_fn, "correlation", None))
    for name in ("infonce", "dcl", "dclw", "eqco", "cacr"):
        a, b = (x.clone().requires_grad_() for x in _batch(4, total)[:2])
        loss = build_loss(name).double().cross_modal(a, b)
        expected[name + "/cross_modal"] = (float(loss), torch.autograd.grad(loss, (a, b)), None)
    for name in ("dcl", "cacr"):
        z = [x.clone().requires_grad_() for x in _batch(2, total)[:3]]
        loss = build_loss(name).double()(*z)
        expected[name + "/3views"] = (float(loss), torch.autograd.grad(loss, z), None)
        q, k = (x.clone().requires_grad_() for x in _batch(3, total)[:2])
        loss = build_loss(name).double().query_key(q, k)
        expected[name + "/query_key"] = (float(loss), torch.autograd.grad(loss, (q, k)), None)
    return expected


@pytest.mark.parametrize("sizes", [(4, 4), (3, 3, 3), (2, 5, 3)], ids=["2proc", "3proc", "3proc-uneven"])
def test_gathered_processes_equal_one_process(sizes, tmp_path):
    world = len(sizes)
    mp.start_processes(_run, args=(world, list(sizes), str(tmp_path / "init"), str(tmp_path)), nprocs=world,
                       start_method="spawn", join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    expected = _single(sizes)
    bounds = [sum(sizes[:r]) for r in range(world + 1)]
    for name, (loss, grads, corr) in expected.items():
        got_loss = sum(r[name][0] for r in ranks)
        assert got_loss == pytest.approx(loss, rel=1e-10, abs=1e-12), name
        for i, g in enumerate(grads):
            got = torch.cat([r[name][1][i] for r in ranks])
            torch.testing.assert_close(got, g, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name} grad {i}: {m}")
        if corr is not None:
            for r in ranks:
                torch.testing.assert_close(r[name][2], corr)
    assert bounds[-1] == sum(sizes)
