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
from launch import end_process_group, fork_ranks
from settings import call, fresh, inputs, plan, shard

import contrastkit.losses.registry as registry
from contrastkit.losses import build_loss

pytestmark = pytest.mark.quick

PAGE = Path(__file__).resolve().parents[2] / "docs" / "own-objective.md"
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


def reference(fn, setting, x, labels=None):
    """The mean per-anchor loss of ``setting`` on float64 inputs ``x`` (tests/losses/settings.py's), each anchor's
    positives and negatives listed one by one (labels: the candidates sharing an anchor's label left out)."""
    scale = x[2] if setting == "image_text_scale" else 1.0 / fn.temperature
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
    elif setting == "hard_negatives":  # every sample's key and hard negatives but its own key
        q, k, hard = (_unit(t) for t in x)
        for i in range(n):
            negatives = [k[j] for j in range(n) if j != i and not same(i, j)] + list(hard.reshape(-1, q.shape[1]))
            losses.append(_anchor_loss(fn, q[i], [k[i]], negatives, scale))
    else:  # image-text: each image against the texts, each text against the images
        img, txt = (_unit(t) for t in x[:2])
        for a, b in ((img, txt), (txt, img)):
            for i in range(n):
                negatives = [b[j] for j in range(n) if j != i and not same(i, j)]
                losses.append(_anchor_loss(fn, a[i], [b[i]], negatives, scale))
    return torch.stack(losses).mean()


SETTINGS = ["two_views", "three_views", "queue", "hard_negatives", "image_text", "image_text_scale"]
PATHS = {"dense": {}, "torch": {"chunk_size": 3}, "triton": {"backend": "triton"}}


def _check(fn, setting, x, labels=None, rtol=1e-10, atol=1e-12, dtype=torch.float64):
    """The call's value and gradients on x in ``dtype`` against the float64 reference on x."""
    want, got = reference(fn, setting, x, labels), call(fn, setting, given := [t.to(dtype) for t in fresh(x)],
                                                          **({} if labels is None else {"labels": labels}))
    assert float(got) == pytest.approx(float(want), rel=rtol, abs=atol)
    for w, g in zip(torch.autograd.grad(want, x), torch.autograd.grad(got, given)):
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("setting", SETTINGS)
def test_formula_equals_float64_reference(setting, path):
    if path == "triton":
        pytest.importorskip("triton")
    fn = DebiasedLoss(temperature=0.5, tau_plus=0.1, **PATHS[path])
    x = inputs(setting, n=7, d=5, scale=2.5)
    if path == "triton":  # the kernels compute in float32
        _check(fn, setting, x, rtol=2e-4, atol=2e-5, dtype=torch.float32)
    else:
        _check(fn, setting, x)
    assert plan(fn, setting, [t.float() for t in x]).path == path  # the path the test is named for is the one taken


@pytest.mark.parametrize("path", ["dense", "torch"])
@pytest.mark.parametrize("setting", ["two_views", "hard_negatives", "image_text"])
def test_labels_leave_same_label_candidates_out(setting, path):
    fn = DebiasedLoss(temperature=0.5, tau_plus=0.1, **PATHS[path])
    labels = torch.tensor([0, 1, 0, 2, 1, 3, 3, 4])
    _check(fn, setting, inputs(setting, n=8, d=5), labels=labels)
    assert plan(fn, setting, inputs(setting, n=8, d=5), labels=labels).route == ("autograd" if path == "dense" else "fast")


def test_the_dense_path_takes_the_written_out_function():
    """One positive per anchor, no labels: the dense path's one autograd Function, its backward from the
    formula's partial derivatives (two views, image-text with a learnable scale, a queue)."""
    fn = DebiasedLoss(temperature=0.5, tau_plus=0.1)
    for setting in ("two_views", "image_text_scale", "queue"):
        assert plan(fn, setting, inputs(setting)).route == "fused"


def test_without_the_class_prior_it_is_infonce():
    """Chuang et al.: tau_plus = 0 gives the standard contrastive loss back (where the floor e^{-1/t} does not
    bind, as it does not for these logits)."""
    x = inputs("two_views", n=7, d=5)
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
    """The partial derivatives come from torch.func, which torch.compile traces: one graph (fullgraph), forward and
    backward through AOTAutograd (aot_eager: where a graph would break; inductor's code generation is
    tests/losses/test_compile.py's, 15 s of C++ compilation here)."""
    fn = DebiasedLoss(temperature=0.5)
    x = inputs("two_views", n=16, d=5, dtype=torch.float32)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager, traced = fn(*x), compiled(*x)
    assert float(traced) == pytest.approx(float(eager), rel=1e-5)
    for a, b in zip(torch.autograd.grad(eager, x), torch.autograd.grad(traced, x)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def _rank(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for setting in ("two_views", "image_text"):
        local = shard(setting, inputs(setting, n=8, d=5), rank * 4, (rank + 1) * 4)
        loss = call(DebiasedLoss(temperature=0.5, tau_plus=0.1, gather_distributed=True), setting, local)
        (loss / world).backward()  # DDP averages the processes' gradients
        results[setting] = (float(loss) / world, [t.grad for t in local])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


def test_two_processes_equal_one_on_the_whole_batch(tmp_path):
    fork_ranks(_rank, (2, str(tmp_path / "init"), str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    fn = DebiasedLoss(temperature=0.5, tau_plus=0.1)
    for setting in ("two_views", "image_text"):
        x = inputs(setting, n=8, d=5)
        want = reference(fn, setting, x)
        assert sum(r[setting][0] for r in ranks) == pytest.approx(float(want), rel=1e-10)
        for i, grad in enumerate(torch.autograd.grad(want, x)):
            torch.testing.assert_close(torch.cat([r[setting][1][i] for r in ranks]), grad, rtol=1e-9, atol=1e-12)
    assert math.isfinite(float(want))


def test_wav2vec2_frames_take_it_by_name(monkeypatch):
    """wav2vec 2.0's frames (the adapters' FrameObjective) with the objective registered: each kept frame's loss
    the formula of its positive against its valid distractors, summed, equal to a float64 autograd frame by
    frame (a frame without a valid distractor counts 0); an option it does not take is one clear error."""
    from contrastkit.losses.frames import FrameObjective, frame_losses

    monkeypatch.setitem(registry.LOSSES, "debiased", DebiasedLoss)
    assert "debiased" in frame_losses() and "unigrad" not in frame_losses()
    g = torch.Generator().manual_seed(11)
    pos, neg = torch.rand(6, generator=g, dtype=torch.float64), torch.rand(6, 5, generator=g, dtype=torch.float64)
    valid = torch.rand(6, 5, generator=g) > 0.3
    valid[:, 0], valid[4] = True, False  # frame 4: no valid distractor
    leaves = [pos.clone().requires_grad_(), neg.clone().requires_grad_()]
    total, dropped = FrameObjective("debiased", tau_plus=0.1).summed(*leaves, valid, model_temperature=0.5)
    fn, plain = DebiasedLoss(temperature=0.5, tau_plus=0.1), [pos.clone().requires_grad_(), neg.clone().requires_grad_()]
    want = sum(fn.formula(2.0 * plain[0][i].reshape(1), torch.logsumexp(2.0 * plain[1][i][valid[i]], 0).reshape(1),
                          valid[i].sum().double().reshape(1)).sum() for i in range(6) if i != 4)
    assert float(total) == pytest.approx(float(want), rel=1e-12) and int(dropped) == 1
    for got, expected in zip(torch.autograd.grad(total, leaves), torch.autograd.grad(want, plain)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"loss 'debiased' takes options \['temperature', 'tau_plus'\]"):
        FrameObjective("debiased", sigma=0.5)
