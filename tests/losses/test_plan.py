"""A call's route is decided once, by its plan (contrastkit/losses/plan.py): what each setting plans, that a call
makes exactly one plan and runs the route it shows, that plans are cached per key and never stale."""

from __future__ import annotations

import pytest
import torch

from settings import SETTINGS, call, inputs, labels, plan

import contrastkit.losses.base as base
import contrastkit.losses.plan as plan_module
from contrastkit.losses import build_loss

pytestmark = pytest.mark.quick


def _features(n, d=8, dtype=torch.float32, device="cpu"):
    return torch.randn(n, d, dtype=dtype, device=device)


@pytest.mark.parametrize("setting, labelled, expected", [
    ("two_views", False, ("two_views", 64, 64, "fused")),
    ("three_views", False, ("views", 96, 96, "autograd")),
    ("two_views", True, ("two_views", 64, 64, "autograd")),
    ("queue", False, ("queue", 32, 11, "fused")),
    ("query_key", False, ("batch_keys", 32, 32, "fused")),
    ("hard_negatives", False, ("batch_keys", 32, 96, "fused")),
    ("several_keys", False, ("batch_keys", 32, 64, "autograd")),
    ("image_text", False, ("image_text", 32, 32, "fused")),
    ("image_text_scale", False, ("image_text", 32, 32, "fused")),
])
def test_each_setting_plans_its_matrix(setting, labelled, expected):
    """Each setting's matrix (this process's anchors x every candidate) and the dense path's sub-path: "fused"
    (one autograd Function with its backward written out) where the setting's shape has that form, else the
    matrix through autograd (labels, several views or keys)."""
    x = inputs(setting, n=32, d=8, dtype=torch.float32)
    got = plan(build_loss("dcl"), setting, x, **(labels(setting, x) if labelled else {}))
    assert (got.setting, got.anchors, got.candidates, got.route) == expected
    assert got.path == "dense" and got.compute == torch.float32 and got.host_checks
    many = torch.ones(32, requires_grad=True)  # a logit scale per pair: the matrix through autograd
    assert build_loss("dcl").plan(x[0], x[1], call="cross_modal", logit_scale=many).route == "autograd"


def test_the_objectives_form_and_the_paths():
    x = _features(32)
    assert build_loss("dcl", chunk_size=8).plan(x, x)[1:4] == ("torch", "fast", torch.float32)
    assert build_loss("dcl", backend="torch").plan(x.double(), x)[1:4] == ("torch", "fast", torch.float64)
    meta = torch.empty(1024, 8, device="meta")  # no host reads off the CPU: the exact route
    assert build_loss("cacr", backend="torch").plan(meta, meta)[1:3] == ("torch", "exact")
    with pytest.raises(ValueError, match="call must be"):
        build_loss("dcl").plan(x, x, call="two_views")


def _counting(monkeypatch):
    made = []

    def counted(*args, **kwargs):
        made.append(plan_module.make_plan(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(base, "make_plan", counted)
    return made


@pytest.mark.parametrize("options", [{}, {"chunk_size": 4}], ids=["dense", "torch"])
@pytest.mark.parametrize("name", ["infonce", "dcl", "cacr"])
@pytest.mark.parametrize("labelled", [False, True], ids=["", "labels"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_one_plan_per_call(monkeypatch, setting, labelled, name, options):
    """A call makes its plan once, at its entry, whatever its setting, path and labels (same_label="positive":
    the positives' second pass too): nothing below it decides the route again."""
    made = _counting(monkeypatch)
    fn = build_loss(name, same_label="positive", **options)
    x = inputs(setting, n=12, d=8, dtype=torch.float32)
    call(fn, setting, x, **(labels(setting, x) if labelled else {})).backward()
    assert len(made) == 1
    assert made[0].path == ("torch" if options else "dense")


def test_the_call_runs_the_route_its_plan_shows(monkeypatch):
    """The route in the plan is the route taken: "fused" through dense.dense_loss, "autograd" not, and the torch
    path's "fast" or "exact" handed to the blockwise kernel."""
    seen = []
    dense_loss, negative_stats = base.dense_loss, base.negative_stats
    monkeypatch.setattr(base, "dense_loss", lambda *a, **k: seen.append("fused") or dense_loss(*a, **k))
    monkeypatch.setattr(base, "negative_stats", lambda *a, **k: seen.append(k["fast"]) or negative_stats(*a, **k))
    x = _features(16)
    fn = build_loss("dcl")
    fn(x, x.flip(0))
    fn(x, x.flip(0), x)
    assert seen == ["fused"]
    build_loss("dcl", chunk_size=4)(x, x.flip(0))
    assert seen == ["fused", True]


def test_plans_are_cached_and_never_stale(monkeypatch):
    """One plan per key (the same object again), a new one where anything it reads differs: dtypes, labels,
    autocast, and the path a patched choose_backend gives (tools that count a CUDA call's operators on the CPU)."""
    fn = build_loss("dcl")
    x = _features(16)
    first = fn.plan(x, x)
    assert fn.plan(_features(16), _features(16)) is first
    assert fn.plan(x.double(), x) is not first and fn.plan(x.double(), x).compute == torch.float64
    assert fn.plan(x, x, labels=torch.arange(16)).route == "autograd"
    monkeypatch.setattr(plan_module, "choose_backend", lambda *args: "torch")
    assert fn.plan(x, x).path == "torch"
    monkeypatch.undo()
    assert fn.plan(x, x) is first


def test_triton_plan_takes_autocast_and_its_route(monkeypatch):
    """On the Triton path (emulated here: its choice is CUDA's) the products take autocast's dtype or the
    features' bf16/fp16, and the forward's route is plan.triton_route's: the dense logits where the
    float32 matrix fits, the fused kernel for 16-bit operands beyond, cuBLAS's products for float32."""
    pytest.importorskip("triton")
    from contrastkit.losses import precision
    from contrastkit.losses.triton import stats as triton_stats

    monkeypatch.setattr(plan_module, "triton_available", lambda: True)
    fn = build_loss("dcl", backend="triton")
    small, large = torch.empty(64, 8, device="meta"), torch.empty(16384, 8, device="meta")
    assert fn.plan(small, small)[1:5] == ("triton", "dense", torch.float32, None)
    assert fn.plan(large.bfloat16(), large.bfloat16())[1:5] == ("triton", "kernel", torch.float32, torch.bfloat16)
    assert fn.plan(large, large)[1:5] == ("triton", "cublas", torch.float32, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(64, 8)
        assert fn.plan(x, x).operands == torch.bfloat16
    assert not fn.plan(large, large).tf32
    monkeypatch.setattr(precision, "tf32_matmul_allowed", lambda: True)  # as torch's setting, either API, gives it
    plan = fn.plan(large, large)  # float32 under TF32: the fused kernel on float16 unit vectors
    assert (plan.route, plan.tf32, plan.half_units) == ("kernel", True, True)
    assert not fn.plan(large.bfloat16(), large.bfloat16()).half_units
    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", "cublas")  # a module setting the tools patch
    assert fn.plan(small, small).route == "cublas"


def test_a_plan_prints_its_route():
    x = _features(16)
    assert str(build_loss("dcl").plan(x, x)) == "two_views 32 x 32: dense (fused), float32, host checks on"
    text = str(build_loss("dcl", chunk_size=4).plan(x, x.double()))
    assert text == "two_views 32 x 32: torch (fast), float64, blocks of 4 anchors, host checks on"
