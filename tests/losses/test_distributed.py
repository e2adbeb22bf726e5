"""P processes (gloo, CPU) with gathered negatives give the loss and gradients of one process on the
concatenated batch, for every objective, also when processes hold different numbers of samples."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch import end_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from contrastkit.losses import available_losses, build_loss

OPTIONS = {"unigrad": {"lam": 10.0, "rho": 0.5}}


def _batch(seed, n, d=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(4)]  # z1, z2, z3, queue-ish


def _make(name, gather=True):
    opts = dict(OPTIONS.get(name, {}))
    if name != "unigrad":
        opts["gather_distributed"] = gather
    return build_loss(name, **opts).double()


def _run(rank, world, sizes, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    total = sum(sizes)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    gather = True if len(set(sizes)) == 1 else "uneven"  # equal sizes: checked on the device, no host round trip
    results = {}
    for name in available_losses():
        views = [z[lo:hi].clone().requires_grad_() for z in _batch(0, total)[:2]]
        loss_fn = _make(name, gather)
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
        loss = _make(name, gather).cross_modal(a, b)
        (sizes[rank] / total * loss).backward()
        results[name + "/cross_modal"] = (float(loss) * sizes[rank] / total, [a.grad, b.grad], None)
    for name in ("dcl", "cacr"):  # several views, the query/key form without a queue, with hard negatives
        z = [x[lo:hi].clone().requires_grad_() for x in _batch(2, total)[:3]]
        loss = _make(name, gather)(*z)
        (sizes[rank] / total * loss).backward()
        results[name + "/3views"] = (float(loss) * sizes[rank] / total, [x.grad for x in z], None)
        q, k = (x[lo:hi].clone().requires_grad_() for x in _batch(3, total)[:2])
        loss = _make(name, gather).query_key(q, k)
        (sizes[rank] / total * loss).backward()
        results[name + "/query_key"] = (float(loss) * sizes[rank] / total, [q.grad, k.grad], None)
        q, k, hard = (x[lo:hi].clone().requires_grad_() for x in _batch(5, total)[:3])
        loss = _make(name, gather).query_key(q, k, negatives=hard)
        (sizes[rank] / total * loss).backward()
        results[name + "/hard_negatives"] = (float(loss) * sizes[rank] / total, [q.grad, k.grad, hard.grad], None)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


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
        q, k, hard = (x.clone().requires_grad_() for x in _batch(5, total)[:3])
        loss = build_loss(name).double().query_key(q, k, negatives=hard)
        expected[name + "/hard_negatives"] = (float(loss), torch.autograd.grad(loss, (q, k, hard)), None)
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


COMPILED = [("dclw", "two_views"), ("infonce", "image_text"), ("dcl", "query_key")]


def _compiled_call(name, setting, x, compiled):
    fn = build_loss(name, gather_distributed=compiled is not None).double()

    def call(a, b, scale):
        if setting == "two_views":
            return fn(a, b)
        if setting == "image_text":
            return fn.cross_modal(a, b, logit_scale=scale)
        return fn.query_key(a, b)

    if compiled:
        call = torch.compile(call, fullgraph=True, backend=compiled)
    leaves = [t.clone().requires_grad_() for t in x]
    loss = call(*leaves)
    return loss, leaves


def _run_compiled(rank, world, n, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, setting in COMPILED:
        x = [t[rank * n : (rank + 1) * n] for t in _batch(7, world * n)[:2]] + [torch.tensor(10.0, dtype=torch.float64)]
        torch._dynamo.reset()
        loss, leaves = _compiled_call(name, setting, x, "aot_eager")
        (loss / world).backward()
        results[name, setting] = (float(loss) / world, [t.grad for t in leaves])
    seen = []  # (collective, dtype, row width) of a bf16 step's gathers and their backward

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_gather" in str(func) or "reduce_scatter" in str(func):
                seen.append((str(func), args[0].dtype, args[0].shape[-1]))
            return func(*args, **(kwargs or {}))

    z = [t[rank * n : (rank + 1) * n].bfloat16().requires_grad_() for t in _batch(9, world * n)[:2]]
    with Collectives():
        build_loss("dcl", gather_distributed=True)(*z).backward()
    results["collectives"] = seen
    bad = build_loss("dcl", gather_distributed=True).double()
    z = [t[: n + rank] for t in _batch(8, 2 * n + 1)[:2]]  # n and n + 1 rows
    try:
        bad(*z)
        results["uneven"] = None
    except RuntimeError as e:
        results["uneven"] = str(e)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


def test_compiled_gather_on_two_processes_equals_one_process(tmp_path):
    """torch.compile(fullgraph=True) of the whole gathered loss (equal batch sizes: the sizes checked on the
    device, a functional all_gather whose backward is a reduce-scatter) on 2 gloo processes: the loss and
    every gradient of one process on the concatenated batch; unequal sizes without gather_distributed=
    'uneven' stop with an error that says so; bf16 features are gathered, and their gradient reduce-scattered,
    in bf16."""
    n, world = 5, 2
    mp.start_processes(_run_compiled, args=(world, n, str(tmp_path / "init"), str(tmp_path)), nprocs=world,
                       start_method="spawn", join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name, setting in COMPILED:
        x = _batch(7, world * n)[:2] + [torch.tensor(10.0, dtype=torch.float64)]
        loss, leaves = _compiled_call(name, setting, x, None)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        assert sum(r[name, setting][0] for r in ranks) == pytest.approx(float(loss), rel=1e-10), (name, setting)
        for i in range(2):
            torch.testing.assert_close(torch.cat([r[name, setting][1][i] for r in ranks]), grads[i], rtol=1e-9,
                                       atol=1e-12)
        if setting == "image_text":  # the scale's gradient: each process's share, summed (as DDP would)
            torch.testing.assert_close(sum(r[name, setting][1][2] for r in ranks), grads[2], rtol=1e-9, atol=1e-12)
    for r in ranks:
        assert r["uneven"] is not None and "gather_distributed='uneven'" in r["uneven"], r["uneven"]
        features = [(op, dtype) for op, dtype, width in r["collectives"] if width == 2 * 6]  # both views' rows
        assert any("all_gather" in op for op, _ in features) and any("reduce_scatter" in op for op, _ in features)
        assert all(dtype == torch.bfloat16 for _, dtype in features), features  # in the input dtype


def _gather_without_warnings(rank, world, init_file):
    import warnings

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch 2.13+: all_gather_tensor warns, all_gather_single not
        warnings.simplefilter("error", DeprecationWarning)
        for gather in (True, "uneven"):
            z1, z2 = (x[rank * 3:(rank + 1) * 3].clone().requires_grad_() for x in _batch(0, 3 * world)[:2])
            build_loss("dcl", gather_distributed=gather)(z1, z2).backward()
    end_process_group()


def test_gather_uses_the_collectives_current_names(tmp_path):
    """Two processes gathering with and without gradient, equal and uneven sizes: no FutureWarning or
    DeprecationWarning from contrastkit's collectives (torch 2.13 renamed all_gather_tensor to
    all_gather_single; the old name warns twice a process a step)."""
    mp.start_processes(_gather_without_warnings, args=(2, str(tmp_path / "init")), nprocs=2, start_method="spawn",
                       join=True)


LABELLED = [("infonce", "positive", "two_views"), ("dcl", "mask", "three_views"), ("eqco", "positive", "image_text"),
            ("dclw", "positive", "query_key"), ("cacr", "mask", "hard_negatives"), ("eqco", "mask", "two_views"),
            ("dclw", "mask", "image_text"), ("infonce", "positive", "hard_negatives"),
            ("cacr", "positive", "image_text")]


def _labelled_call(name, mode, setting, x, labels, gather=False):
    """The loss of a labelled setting on inputs x (three [n, D] tensors) and its leaves."""
    fn = build_loss(name, gather_distributed=gather, same_label=mode, chunk_size=3).double()
    leaves = [t.clone().requires_grad_() for t in x]
    if setting == "two_views":
        return fn(*leaves[:2], labels=labels), leaves[:2]
    if setting == "three_views":
        return fn(*leaves, labels=labels), leaves
    if setting == "image_text":
        return fn.cross_modal(*leaves[:2], labels=labels), leaves[:2]
    if setting == "query_key":
        return fn.query_key(*leaves[:2], labels=labels), leaves[:2]
    return fn.query_key(*leaves[:2], negatives=leaves[2], labels=labels), leaves


def _labels(total):
    labels = torch.randint(3, (total,), generator=torch.Generator().manual_seed(1))
    labels[:2] = torch.tensor([0, 1])
    return labels


def _run_labelled(rank, world, sizes, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    total, lo, hi = sum(sizes), sum(sizes[:rank]), sum(sizes[: rank + 1])
    gather = True if len(set(sizes)) == 1 else "uneven"
    results = {}
    for case in LABELLED:
        x = [t[lo:hi] for t in _batch(6, total)[:3]]
        loss, leaves = _labelled_call(*case, x, _labels(total)[lo:hi], gather)
        (loss * sizes[rank] / total).backward()
        results[case] = (float(loss.detach()) * sizes[rank] / total, [t.grad for t in leaves])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


@pytest.mark.parametrize("sizes", [(4, 4), (3, 5)], ids=["2proc", "2proc-uneven"])
def test_labels_are_gathered_with_the_features(sizes, tmp_path):
    """Labels gathered as the features are (equal sizes and 'uneven'): 2 processes give the loss and gradients
    of one process on the concatenated batch, for both same_label modes and every setting."""
    world = len(sizes)
    mp.start_processes(_run_labelled, args=(world, list(sizes), str(tmp_path / "init"), str(tmp_path)),
                       nprocs=world, start_method="spawn", join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for case in LABELLED:
        loss, leaves = _labelled_call(*case, _batch(6, sum(sizes))[:3], _labels(sum(sizes)))
        grads = torch.autograd.grad(loss, leaves)
        assert sum(r[case][0] for r in ranks) == pytest.approx(float(loss.detach()), rel=1e-10, abs=1e-12), case
        for i, g in enumerate(grads):
            torch.testing.assert_close(torch.cat([r[case][1][i] for r in ranks]), g, rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"{case} grad {i}: {m}")
