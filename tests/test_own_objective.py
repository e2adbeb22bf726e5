"""An objective of one's own, written as its formula (docs/own-objective.md, whose code block this file runs:
Chuang et al.'s debiased contrastive loss), in every setting, on every path, with labels, compiled and on two
processes: its value and gradients equal a float64 autograd of the plain formula, anchor by anchor."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch import end_process_group

import contrastkit.losses.registry as registry
from contrastkit.losses import build_loss

pytestmark = pytest.mark.quick

PAGE = Path(__file__).resolve().parents[1] / "docs" / "own-objective.md"
_namespace: dict = {}
exec(re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)[0], _namespace)  # the page's example, as written
DebiasedLoss = _namespace["DebiasedLoss"]
registry.LOSSES.pop("debiased")  # registered by the page's decorator; each test that wants the name adds it back


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def _anchor_loss(fn, a, positives, negatives, scale):
    """The formula for one anchor, from its plain sums: mean over its positives of f(p, l, k)."""
    l = torch.log(sum(torch.exp(scale * (a * n).sum()) for n in negatives)).reshape(1)
    k = torch.tensor([float(len(negatives))], dtype=a.dtype)
    return torch.stack([fn.formula(scale * (a * b).sum().reshape(1), l, k) for b in positives]).mean()


def reference(fn, setting, x, labels=None, scale=None):
    """The mean per-anchor loss of ``setting`` on float64 inputs ``x``, each anchor's positives and negatives
    listed one by one (labels: the candidates sharing an anchor's label left out of its negatives)."""
    scale = 1.0 / fn.temperature if scale is None else scale
    n = x[0].shape[0]
    same = (lambda i, j: labels is not None and bool(labels[i] == labels[j]))
    losses = []
    if setting in ("two_views", "three_views"):
        u = [_unit(z) for z in x]
        for v, i in [(v, i) for v in range(len(u)) for i in range(n)]:
            positives = [u[w][i] for w in range(len(u)) if w != v]
            negatives = [u[w][j] for w in range(len(u)) for j in range(n) if j != i and not same(i, j)]
            losses.append(_anchor_loss(fn, u[v][i], positives, negatives, scale))
    elif setting == "queue":
        q, k, queue = (_unit(t) for t in x)
        losses = [_anchor_loss(fn, q[i], [k[i]], list(queue), scale) for i in range(n)]
    elif setting == "hard_negatives":
        q, k, hard = (_unit(t) for t in x)
        for i in range(n):
            negatives = [k[j] for j in range(n) if j != i and not same(i, j)] + list(hard)
            losses.append(_anchor_loss(fn, q[i], [k[i]], negatives, scale))
    else:  # image-text: each image against the texts, each text against the images
        img, txt = (_unit(t) for t in x)
        for a, b in ((img, txt), (txt, img)):
            for i in range(n):
                negatives = [b[j] for j in range(n) if j != i and not same(i, j)]
                losses.append(_anchor_loss(fn, a[i], [b[i]], negatives, scale))
    return torch.stack(losses).mean()


def call(fn, setting, x, labels=None, scale=None):
    if setting in ("two_views", "three_views"):
        return fn(*x, labels=labels)
    if setting == "queue":
        return fn.query_key(x[0], x[1], x[2])
    if setting == "hard_negatives":
        return fn.query_key(x[0], x[1], negatives=x[2], labels=labels)
    return fn.cross_modal(x[0], x[1], logit_scale=scale, labels=labels)


def plan(fn, setting, x):
    if setting in ("two_views", "three_views"):
        return fn.plan(*x)
    if setting == "queue":
        return fn.plan(*x, call="query_key")
    if setting == "hard_negatives":
        return fn.plan(x[0], x[1], negatives=x[2], call="query_key")
    return fn.plan(*x, call="cross_modal")


def inputs(setting, n=7, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = {"queue": [n, n, 11], "three_views": [n] * 3}.get(setting, [n, n])
    if setting == "hard_negatives":
        sizes = [n, n, n]
    return [torch.randn(m, d, generator=g, dtype=torch.float64) for m in sizes]


SETTINGS = ["two_views", "three_views", "queue", "hard_negatives", "image_text"]
PATHS = {"dense": {}, "torch": {"chunk_size": 3}, "triton": {"backend": "triton"}}


def _check(fn, setting, x, labels=None, scale=None, rtol=1e-10, atol=1e-12, dtype=torch.float64):
    leaves = [t.clone().requires_grad_() for t in x]
    given = [t.to(dtype).detach().requires_grad_() for t in x]
    s_leaf = None if scale is None else scale.clone().requires_grad_()
    s_given = None if scale is None else scale.to(dtype).detach().requires_grad_()
    want = reference(fn, setting, leaves, labels, s_leaf)
    got = call(fn, setting, given, labels, s_given)
    assert float(got) == pytest.approx(float(want), rel=rtol, abs=atol)
    want_grads = torch.autograd.grad(want, leaves + ([s_leaf] if scale is not None else []))
    got_grads = torch.autograd.grad(got, given + ([s_given] if scale is not None else []))
    for w, g in zip(want_grads, got_grads):
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("setting", SETTINGS)
def test_formula_equals_float64_reference(setting, path):
    if path == "triton":
        pytest.importorskip("triton")
    fn = DebiasedLoss(temperature=0.5, tau_plus=0.1, **PATHS[path])
    x = inputs(setting)
    if path == "triton":  # the kernels compute in float32
        _check(fn, setting, x, rtol=2e-4, atol=2e-5, dtype=torch.float32)
    else:
        _check(fn, setting, x)
    assert plan(fn, setting, [t.float() for t in x]).path == path  # the path the test is named for is the one the call took


@pytest.mark.parametrize("path", ["dense", "torch"])
@pytest.mark.parametrize("setting", ["two_views", "hard_negatives", "image_text"])
def test_labels_leave_same_label_candidates_out(setting, path):
    fn = DebiasedLoss(temperature=0.5, tau_plus=0.1, **PATHS[path])
    _check(fn, setting, inputs(setting, n=8), labels=torch.tensor([0, 1, 0, 2, 1, 3, 3, 4]))


def test_learnable_logit_scale():
    fn = DebiasedLoss(temperature=0.5, tau_plus=0.1)
    for path in ({}, {"chunk_size": 3}):
        _check(DebiasedLoss(**path), "image_text", inputs("image_text"), scale=torch.tensor(2.5, dtype=torch.float64))
    assert fn.plan(*inputs("image_text"), call="cross_modal").route == "fused"  # the written-out dense Function


def test_without_the_class_prior_it_is_infonce():
    """Chuang et al.: tau_plus = 0 gives the standard contrastive loss back (where the floor e^{-1/t} does not
    bind, as it does not for these logits)."""
    x = inputs("two_views")
    debiased = DebiasedLoss(temperature=0.5, tau_plus=0.0)(*x)
    assert float(debiased) == pytest.approx(float(build_loss("infonce", temperature=0.5)(*x)), rel=1e-12)


def test_registered_by_name_and_refused_where_it_has_no_form(monkeypatch):
    monkeypatch.setitem(registry.LOSSES, "debiased", DebiasedLoss)
    fn = build_loss("debiased", tau_plus=0.2, gather_distributed=True)
    assert isinstance(fn, DebiasedLoss) and fn.tau_plus == 0.2
    assert registry.register_loss(DebiasedLoss) is DebiasedLoss  # the same class again: no error
    other = type("Other", (DebiasedLoss,), {})
    with pytest.raises(ValueError, match="taken by DebiasedLoss"):
        registry.register_loss(other)
    with pytest.raises(ValueError, match="another library"):
        registry.register_loss(type("NT", (DebiasedLoss,), {"name": "ntxent"}))
    with pytest.raises(ValueError, match="same_label='positive' needs"):
        DebiasedLoss(same_label="positive")


def test_compiles_whole():
    """The partial derivatives come from torch.func, which torch.compile traces: one graph (fullgraph)."""
    fn = DebiasedLoss(temperature=0.5)
    x = [t.float().requires_grad_() for t in inputs("two_views", n=16)]
    compiled = torch.compile(fn, fullgraph=True)
    eager, traced = fn(*x), compiled(*x)
    assert float(traced) == pytest.approx(float(eager), rel=1e-5)
    for a, b in zip(torch.autograd.grad(eager, x), torch.autograd.grad(traced, x)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def _rank(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for setting in ("two_views", "image_text"):
        x = inputs(setting, n=8)
        local = [t[rank * 4:(rank + 1) * 4].clone().requires_grad_() for t in x]
        loss = call(DebiasedLoss(temperature=0.5, tau_plus=0.1, gather_distributed=True), setting, local)
        (loss / world).backward()  # DDP averages the processes' gradients
        results[setting] = (float(loss) / world, [t.grad for t in local])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


def test_two_processes_equal_one_on_the_whole_batch(tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    fn = DebiasedLoss(temperature=0.5, tau_plus=0.1)
    for setting in ("two_views", "image_text"):
        x = [t.clone().requires_grad_() for t in inputs(setting, n=8)]
        want = reference(fn, setting, x)
        assert sum(r[setting][0] for r in ranks) == pytest.approx(float(want), rel=1e-10)
        for i, grad in enumerate(torch.autograd.grad(want, x)):
            torch.testing.assert_close(torch.cat([r[setting][1][i] for r in ranks]), grad, rtol=1e-9, atol=1e-12)
    assert math.isfinite(float(want))
