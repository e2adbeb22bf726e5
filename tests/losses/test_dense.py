"""The dense path (contrastkit/losses/dense.py): the whole matrix in one autograd Function with its backward
written out, what "auto" takes at the batch sizes people train with per device. Against the float64 references
(tests/losses/reference.py) in values and gradients for every objective, both settings, a learnable scale, every
reduction, with and without normalisation, on fresh random inputs; F.normalize's semantics for rows of norm
below eps; no host read on the path of CUDA; autocast; its memory at CUDA's bound; and the operators it
launches, held exactly (benchmarks/fixed_cost.py counts them beside open_clip's ClipLoss and lightly's
NTXentLoss)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from settings import call, inputs
from test_device_path import no_host_data_on_the_device  # noqa: F401  (a fixture)
from test_memory import MiB, count

import reference
from contrastkit.losses import base, build_loss, plan

pytestmark = pytest.mark.quick

OPTIONS = {"infonce": {"tau": 0.1}, "dcl": {"tau": 0.1}, "dclw": {"tau": 0.1, "sigma": 0.5},
           "eqco": {"tau": 0.1, "alpha": 256.0}, "cacr": {"t_pos": 1.0, "t_neg": 2.0}}
KINDS = list(OPTIONS)
SETTINGS = ["two_views", "image_text", "image_text_scale", "query_key", "hard_negatives", "queue"]


def _loss_options(kind):
    names = {"tau": "temperature"}
    return {names.get(k, k): v for k, v in OPTIONS[kind].items()}


def _inputs(seed, setting, n=9, d=7, dtype=torch.float64, size=1.0, device="cpu"):
    """The call's tensors (tests/losses/settings.py), each needing a gradient: two [n, d] (views, image and text,
    query and key), then a learnable scale of 7.5, two hard negatives per query [n, 2, d] or a queue [11, d]
    where the setting has them."""
    return inputs(setting, n, d, dtype=dtype, device=device, seed=seed, size=size, queue=11, hard=2, scale=7.5)


@pytest.mark.parametrize("setting", SETTINGS)
def test_auto_takes_the_dense_function_at_small_sizes(setting):
    x = _inputs(0, setting, n=64, d=32, dtype=torch.float32)
    loss = call(build_loss("dcl"), setting, x)
    node = loss.grad_fn.next_functions[0][0]  # the mean's input
    assert type(node).__name__ == "_DenseLossBackward"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind, normalize", [(k, True) for k in KINDS] + [(k, False) for k in KINDS if k != "cacr"])
def test_matches_float64_reference(kind, setting, reduction, normalize, monkeypatch):
    """Values and gradients (features and the learnable scale) against the references written from the
    formulas, per anchor or reduced; without normalisation the features are the vectors (the references'
    unit() the identity, features of norm ~0.3 so that the logits stay moderate). CACR is defined on unit
    vectors (its cost |u - v|^2 = 2 - 2 cos): its reference's distances are another function off the sphere."""
    seed = hash((kind, setting, reduction, normalize, "dense")) % 2**31
    x = _inputs(seed, setting, size=1.0 if normalize else 0.3 / 7**0.5)
    if not normalize:
        monkeypatch.setattr(reference, "unit", lambda v: v)
    fn = build_loss(kind, normalize=normalize, reduction=reduction, backend="dense", **_loss_options(kind))
    got = call(fn, setting, x)
    want = reference.loss(kind, setting, x, mean=reduction == "mean", **OPTIONS[kind])
    if reduction == "sum":
        want = want.sum()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    weights = torch.rand(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(seed))
    for g, w in zip(torch.autograd.grad((got * weights).sum(), x), torch.autograd.grad((want * weights).sum(), x)):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-11, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "dclw"])  # DCLW's weights are detached by design
@pytest.mark.parametrize("setting", ["two_views", "image_text_scale", "hard_negatives", "queue"])
def test_gradcheck(kind, setting):
    """Finite differences through the hand-written backward: features and the scale, per-anchor outputs."""
    x = _inputs(hash((kind, setting)) % 2**31, setting, n=4, d=3)
    fn = build_loss(kind, backend="dense", reduction="none", **_loss_options(kind))
    torch.autograd.gradcheck(lambda *t: call(fn, setting, t), x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
def test_rows_of_norm_below_eps_as_f_normalize(kind, setting):
    """A zero row and a row of norm 1e-13 (below F.normalize's eps): the loss and its gradient are those of
    autograd through F.normalize (a constant divisor, no projection, for the clamped rows). Image-text at a
    constant scale of 1 / tau (CACR: 4)."""
    x = _inputs(hash((kind, setting, "eps")) % 2**31, setting)
    with torch.no_grad():
        x[0][1].zero_()
        x[1][2].mul_(1e-13 / x[1][2].norm())
    if setting == "image_text_scale":
        x[2] = torch.tensor(1.0 / OPTIONS.get(kind, {}).get("tau", 0.25), dtype=torch.float64)
    got = call(build_loss(kind, backend="dense", **_loss_options(kind)), setting, x)
    want = reference.plain(kind, setting, x, **OPTIONS[kind])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, x[:2]), torch.autograd.grad(want, x[:2])):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("kind", KINDS)
def test_output_dict_diagnostics_equal_the_blockwise_ones(kind):
    """The diagnostics, made only where asked (from the detached statistics), are the blockwise path's."""
    x = _inputs(5, "image_text_scale")
    got = call(build_loss(kind, backend="dense"), "image_text_scale", x, output_dict=True)
    want = call(build_loss(kind, backend="torch"), "image_text_scale", x, output_dict=True)
    assert got.keys() == want.keys()
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", SETTINGS)
def test_no_host_read_on_the_path_of_cuda(kind, setting, device_path, no_host_data_on_the_device):  # noqa: F811
    """Meta tensors (any host read raises) and no tensor made from host data: forward and backward run
    through, so a CUDA step on the dense path has no sync."""
    x = _inputs(0, setting, dtype=torch.float32, device="meta")
    loss = call(build_loss(kind, backend="dense"), setting, x)
    grads = torch.autograd.grad(loss, x)
    assert loss.device.type == "meta" and all(g.shape == t.shape for g, t in zip(grads, x))


@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
def test_autocast_and_low_precision_features(setting):
    """Under bf16 autocast the Function computes in float32 (float32 features: the very loss of no autocast); bf16
    features give a float32 loss, their gradients in bf16, both those of their float64 values to bf16's
    rounding; backward called inside the autocast block changes nothing."""
    x = _inputs(6, setting, n=16, d=8, dtype=torch.float32)
    fn = build_loss("dcl")
    plain = call(fn, setting, x)
    want_grads = torch.autograd.grad(plain, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = call(fn, setting, x)
        grads = torch.autograd.grad(loss, x)
    assert torch.equal(loss, plain) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    low = [t.detach().bfloat16().requires_grad_() if t.dim() else t for t in x]
    loss = call(fn, setting, low)
    ref = [t.detach().double().requires_grad_() for t in low]
    want = call(fn, setting, ref)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    for g, w in zip(torch.autograd.grad(loss, low[:2]), torch.autograd.grad(want, ref[:2])):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), w, rtol=2**-7, atol=2**-7 * float(w.abs().max()))


def test_one_sample_is_an_error():
    for setting in ("two_views", "image_text"):
        with pytest.raises(ValueError, match="a batch of 1"):
            call(build_loss("dcl"), setting, _inputs(0, setting, n=1))


def test_positions_are_made_once_per_shape():
    """A call's index tensors (base.positions) are made on its first call of a shape, then found: the fused
    call's (with its flat indices) and a blockwise call's apart; the cache stays bounded."""
    base._PER_SHAPE.clear()
    x = _inputs(0, "two_views", n=5)
    for _ in range(3):
        build_loss("dcl")(*x)
        build_loss("dcl", backend="torch")(*x)
    assert sorted((key[:2], key[-1]) for key in base._PER_SHAPE) == [(("positions", "views"), False),
                                                                    (("positions", "views"), True)]
    for n in range(2, 2 + base._MAX_PER_SHAPE + 1):
        base.positions("keys", 1, n, n, 0, torch.device("cpu"), fused=True)
    assert len(base._PER_SHAPE) <= base._MAX_PER_SHAPE


@pytest.mark.parametrize("setting", ["two_views", "image_text"])
def test_memory_at_cudas_bound(setting):
    """At DENSE_AUTO_LOGITS (two views N = 4096, image-text N = 8192; D = 512, bf16 features), counted on the
    meta device: the float32 matrix (4 M K bytes) and the float32 unit vectors kept from forward to backward,
    at most four matrices' worth at any time (plan.DENSE_AUTO_LOGITS: 1 GiB)."""
    n = 4096 if setting == "two_views" else 8192
    logits = (2 * n) ** 2 if setting == "two_views" else n**2
    assert logits == plan.DENSE_AUTO_LOGITS
    x = inputs(setting, n, 512, dtype=torch.bfloat16, device="meta")
    fn = build_loss("dcl", backend="dense")
    kept, _, peak = count(lambda *t: call(fn, setting, t), x)
    matrix = 4 * logits
    assert matrix <= kept <= matrix + 2 * 4 * 2 * n * 512 + MiB, kept / MiB
    assert peak <= 4 * matrix + 64 * MiB, peak / MiB


# ----------------------------------------------------------------------------- operators: the fixed cost


def _fixed_cost():
    path = Path(__file__).parents[2] / "benchmarks" / "fixed_cost.py"
    spec = importlib.util.spec_from_file_location("fixed_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Top-level operators of one forward + backward at N = 64, D = 512 (torch 2.14; benchmarks/fixed_cost.py): on
# the CPU (one host read for a learnable scale, one for the loss's finiteness) and on the path of CUDA (none).
# One operator more on the path fails this: say why in docs/performance.md and count again.
OPERATORS = {("image-text", "infonce"): (64, 60), ("image-text", "dcl"): (61, 57), ("image-text", "dclw"): (72, 68),
             ("image-text", "eqco"): (65, 61), ("image-text", "cacr"): (87, 83),
             ("two views", "infonce"): (42, 40), ("two views", "dcl"): (39, 37), ("two views", "dclw"): (50, 48),
             ("two views", "eqco"): (43, 41), ("two views", "cacr"): (48, 46)}


@pytest.mark.parametrize("setting", ["image-text", "two views"])
def test_operators_per_call_below_the_peers(setting):
    """Each objective's call at N = 64 launches the counted operators, InfoNCE and DCL no more top-level
    operators than open_clip's ClipLoss (image-text, with its normalisation and a learnable scale) or lightly's
    NTXentLoss (two views), DCLW, EqCo and CACR at most 1.2 times as many; the same on the path of CUDA."""
    pytest.importorskip("open_clip")
    pytest.importorskip("lightly")
    fixed_cost = _fixed_cost()
    import argparse

    args = argparse.Namespace(device="cpu", dtype="float32")
    counts = {}
    for name, method in fixed_cost.methods(setting).items():
        call = next(iter(fixed_cost._step(method, 64, 512, args).values()))
        with fixed_cost.device_path():
            on_device = fixed_cost.operators(call)[1]
        counts[name] = (fixed_cost.operators(call)[1], on_device)
    peer = counts.pop("peer")
    assert counts == {k: OPERATORS[setting, k] for k in counts}
    for name, (cpu, on_device) in counts.items():
        bound = 1.0 if name in ("infonce", "dcl") else 1.2
        assert cpu <= bound * peer[0] and on_device <= bound * peer[1], (name, cpu, on_device, peer)
