"""P processes (gloo, CPU) with gathered negatives give the loss and gradients of one process on the
concatenated batch, for every objective, also when processes hold different numbers of samples."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from launch import end_process_group, fork_ranks
from settings import SCORE_LOSSES, SETTINGS, call, fresh, fresh_call, inputs, labels, shard
from torch.utils._python_dispatch import TorchDispatchMode

from contrastkit.losses import available_losses, build_loss

OPTIONS = {"unigrad": {"lam": 10.0, "rho": 0.5}}
# Each objective in two views, the score objectives in image-text, two of them in several views, with in-batch keys
# and with a hard negative per query.
CASES = ([(name, "two_views") for name in available_losses()] + [(name, "image_text") for name in SCORE_LOSSES]
         + [(name, setting) for name in ("dcl", "cacr") for setting in ("three_views", "query_key", "hard_negatives")])


def _inputs(setting, total, seed=0, **options):
    """The whole batch's tensors in ``setting`` (tests/losses/settings.py), the same in every process: D = 6, one
    hard negative per query ([N, D]), seeded by ``seed`` and the setting."""
    return inputs(setting, total, 6, seed=10 * seed + SETTINGS.index(setting), hard=None, **options)


def _make(name, gather=True):
    opts = dict(OPTIONS.get(name, {}))
    if name != "unigrad":
        opts["gather_distributed"] = gather
    return build_loss(name, **opts).double()


def _steps(name):
    return 2 if name == "unigrad" else 1  # a second step, so that UniGrad's running correlation is used after an update


def _run(rank, world, sizes, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    total = sum(sizes)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    gather = True if len(set(sizes)) == 1 else "uneven"  # equal sizes: checked on the device, no host round trip
    weight = sizes[rank] / total  # the global mean is the size-weighted mean of local means
    results = {}
    for name, setting in CASES:
        loss_fn = _make(name, gather)
        for step in range(_steps(name)):
            x = shard(setting, _inputs(setting, total, step), lo, hi)
            loss = call(loss_fn, setting, x)
            (weight * loss).backward()
        results[name, setting] = (float(loss.detach()) * weight, [t.grad for t in x],
                                  getattr(loss_fn, "correlation", None))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


def _single(sizes):
    expected = {}
    for name, setting in CASES:
        loss_fn = build_loss(name, **OPTIONS.get(name, {})).double()
        for step in range(_steps(name)):
            x = _inputs(setting, sum(sizes), step)
            loss = call(loss_fn, setting, x)
            if step < _steps(name) - 1:
                loss.backward()
        expected[name, setting] = (float(loss), torch.autograd.grad(loss, x), getattr(loss_fn, "correlation", None))
    return expected


@pytest.mark.parametrize("sizes", [(4, 4), (3, 3, 3), (2, 5, 3)], ids=["2proc", "3proc", "3proc-uneven"])
def test_gathered_processes_equal_one_process(sizes, tmp_path):
    world = len(sizes)
    fork_ranks(_run, (world, list(sizes), str(tmp_path / "init"), str(tmp_path)), world)
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


COMPILED = [("dclw", "two_views"), ("infonce", "image_text_scale"), ("dcl", "query_key")]


def _compiled_call(name, setting, x, compiled):
    fn = build_loss(name, gather_distributed=compiled is not None).double()

    def loss_of(*x):
        return call(fn, setting, x)

    if compiled:
        loss_of = torch.compile(loss_of, fullgraph=True, backend=compiled)
    leaves = fresh(x)
    return loss_of(*leaves), leaves


def _run_compiled(rank, world, n, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, setting in COMPILED:
        x = shard(setting, _inputs(setting, world * n, 7, scale=10.0), rank * n, (rank + 1) * n)
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

    z = shard("two_views", _inputs("two_views", world * n, 9, dtype=torch.bfloat16), rank * n, (rank + 1) * n)
    with Collectives():
        build_loss("dcl", gather_distributed=True)(*z).backward()
    results["collectives"] = seen
    bad = build_loss("dcl", gather_distributed=True).double()
    z = shard("two_views", _inputs("two_views", 2 * n + 1, 8), 0, n + rank)  # n and n + 1 rows
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
    fork_ranks(_run_compiled, (world, n, str(tmp_path / "init"), str(tmp_path)), world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name, setting in COMPILED:
        loss, leaves = _compiled_call(name, setting, _inputs(setting, world * n, 7, scale=10.0), None)
        grads = torch.autograd.grad(loss, leaves)
        assert sum(r[name, setting][0] for r in ranks) == pytest.approx(float(loss), rel=1e-10), (name, setting)
        for i, g in enumerate(grads):  # the scale's gradient: each process's share, summed (as DDP would)
            parts = [r[name, setting][1][i] for r in ranks]
            torch.testing.assert_close(sum(parts) if g.dim() == 0 else torch.cat(parts), g, rtol=1e-9, atol=1e-12)
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
            z1, z2 = shard("two_views", _inputs("two_views", 3 * world), rank * 3, (rank + 1) * 3)
            build_loss("dcl", gather_distributed=gather)(z1, z2).backward()
    end_process_group()


def test_gather_uses_the_collectives_current_names(tmp_path):
    """Two processes gathering with and without gradient, equal and uneven sizes: no FutureWarning or
    DeprecationWarning from contrastkit's collectives (torch 2.13 renamed all_gather_tensor to
    all_gather_single; the old name warns twice a process a step)."""
    fork_ranks(_gather_without_warnings, (2, str(tmp_path / "init")))


LABELLED = [("infonce", "positive", "two_views"), ("dcl", "mask", "three_views"), ("eqco", "positive", "image_text"),
            ("dclw", "positive", "query_key"), ("cacr", "mask", "hard_negatives"), ("eqco", "mask", "two_views"),
            ("dclw", "mask", "image_text"), ("infonce", "positive", "hard_negatives"),
            ("cacr", "positive", "image_text")]


def _labelled_call(name, mode, setting, x, given, gather=False):
    """The loss of a labelled setting on fresh leaves of inputs x, with labels ``given``, and those leaves."""
    fn = build_loss(name, gather_distributed=gather, same_label=mode, chunk_size=3).double()
    return fresh_call(fn, setting, x, **given)


def _labelled_inputs(setting, total):
    """The whole batch's tensors and labels (three classes, two at least), the same in every process."""
    x = _inputs(setting, total, 6)
    return x, labels(setting, x, seed=1)


def _run_labelled(rank, world, sizes, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    total, lo, hi = sum(sizes), sum(sizes[:rank]), sum(sizes[: rank + 1])
    gather = True if len(set(sizes)) == 1 else "uneven"
    results = {}
    for case in LABELLED:
        x, given = _labelled_inputs(case[2], total)
        local = {k: v[lo:hi] for k, v in given.items()}
        loss, leaves = _labelled_call(*case, shard(case[2], x, lo, hi), local, gather)
        (loss * sizes[rank] / total).backward()
        results[case] = (float(loss.detach()) * sizes[rank] / total, [t.grad for t in leaves])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


@pytest.mark.parametrize("sizes", [(4, 4), (3, 5)], ids=["2proc", "2proc-uneven"])
def test_labels_are_gathered_with_the_features(sizes, tmp_path):
    """Labels gathered as the features are (equal sizes and 'uneven'): 2 processes give the loss and gradients
    of one process on the concatenated batch, for both same_label modes and every setting."""
    world = len(sizes)
    fork_ranks(_run_labelled, (world, list(sizes), str(tmp_path / "init"), str(tmp_path)), world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for case in LABELLED:
        loss, leaves = _labelled_call(*case, *_labelled_inputs(case[2], sum(sizes)))
        grads = torch.autograd.grad(loss, leaves)
        assert sum(r[case][0] for r in ranks) == pytest.approx(float(loss.detach()), rel=1e-10, abs=1e-12), case
        for i, g in enumerate(grads):
            torch.testing.assert_close(torch.cat([r[case][1][i] for r in ranks]), g, rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"{case} grad {i}: {m}")
