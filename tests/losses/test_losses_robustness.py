"""Numerical safety under autocast and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch
from settings import call

from contrastkit.losses import available_losses, build_loss, functional

pytestmark = pytest.mark.quick

LOW_PRECISION = [torch.bfloat16, torch.float16]


def _project(seed=0, n=64, d_in=32, d=16):
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(d_in, d)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(d, d_in, generator=g) / d_in**0.5)
        layer.bias.zero_()
    x1, x2 = torch.randn(n, d_in, generator=g), torch.randn(n, d_in, generator=g)
    x2 = x1 + 0.3 * x2  # correlated views, so the loss is not at its random value
    return layer, x1, x2


def _loss_and_grad(name, dtype, temperature=None, collapsed=False, **size):
    layer, x1, x2 = _project(**size)
    if dtype == torch.float64:
        layer, x1, x2 = layer.double(), x1.double(), x2.double()
    if collapsed:
        x1 = x2 = torch.ones_like(x1)
    opts = {"temperature": temperature} if temperature and name not in ("cacr", "unigrad") else {}
    loss_fn = build_loss(name, **opts)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype in LOW_PRECISION):
        z1, z2 = layer(x1), layer(x2)
        assert z1.dtype == dtype
        loss = loss_fn(z1, z2)
    loss.backward()
    return loss.detach(), layer.weight.grad


@pytest.mark.parametrize("name", available_losses())
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_autocast_loss_is_the_float32_loss_of_the_same_features(name, dtype):
    """The loss runs in float32 whatever the autocast dtype: on the low-precision features a model
    gives, value and gradient equal the float32 computation on those features (the gradient up to its
    final rounding to the features' dtype). A matrix product left in the autocast dtype fails this."""
    layer, x1, x2 = _project(n=128, d_in=128, d=128)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        low = [layer(x).requires_grad_() for x in (x1, x2)]
    full = [z.detach().float().requires_grad_() for z in low]
    with torch.autocast("cpu", dtype=dtype):
        got = build_loss(name)(*low)
    expected = build_loss(name)(*full)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    info = torch.finfo(dtype)  # one rounding: eps relative, or float16's subnormal step (GradScaler's concern)
    for g, e in zip(torch.autograd.grad(got, low), torch.autograd.grad(expected, full)):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), e, rtol=info.eps, atol=info.tiny * info.eps)


@pytest.mark.parametrize("name", available_losses())
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_autocast_training_step_close_to_float32(name, dtype):
    """A whole autocast step (the projection in low precision too) against float32 at a realistic width:
    the loss within 0.1% and the weight gradient within 1.5% (measured: at most 3e-4 and 1e-2; the
    gradient's error is the projection's own low-precision product)."""
    size = dict(n=256, d_in=256, d=128)
    full, full_grad = _loss_and_grad(name, torch.float32, **size)
    low, low_grad = _loss_and_grad(name, dtype, **size)
    assert low.dtype == torch.float32
    assert abs(float(low - full)) <= 1e-3 * abs(float(full))
    assert float((low_grad - full_grad).norm()) <= 0.015 * float(full_grad.norm())


@pytest.mark.parametrize("name", available_losses())
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("temperature,collapsed", [(0.02, False), (0.02, True), (0.1, True)])
def test_low_temperature_and_collapse_match_float64(name, dtype, temperature, collapsed):
    """At temperature 0.02 (logits up to 50) and with every feature equal, the loss and the weight
    gradient match the same step in float64: within 1e-5 in float32, 2% (float16) and 5% (bfloat16),
    whose projections round the features (measured: 2e-6, 1.3e-2, 3.5e-2). Collapsed features have an
    exact gradient of 0 (every direction is symmetric); what is left must be rounding (norm < 1e-3,
    against 0.1-10 for the others)."""
    loss, grad = _loss_and_grad(name, dtype, temperature, collapsed)
    ref_loss, ref_grad = _loss_and_grad(name, torch.float64, temperature, collapsed)
    tol = {torch.float32: 1e-5, torch.float16: 0.02, torch.bfloat16: 0.05}[dtype]
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss)) + 1e-6, f"{name} {dtype} loss {loss}"
    if collapsed:
        assert float(grad.norm()) < 1e-3, f"{name} {dtype} grad {grad.norm()}"
    else:
        assert float((grad.double() - ref_grad).norm()) <= tol * float(ref_grad.norm()), f"{name} {dtype} grad"


def test_collapsed_dcl_value_is_the_analytic_one():
    """All embeddings equal: every similarity is 1, so DCL = -1/t + log(2N - 2) + 1/t = log(2N - 2)."""
    z = torch.ones(8, 4)
    torch.testing.assert_close(build_loss("dcl", temperature=0.02)(z, z), torch.log(torch.tensor(14.0)))
    torch.testing.assert_close(build_loss("infonce", temperature=0.02)(z, z), torch.log(torch.tensor(15.0)))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", ["dcl", "cacr"])
@pytest.mark.parametrize("setting", ["two_views", "image_text"])
@pytest.mark.parametrize("backend", ["dense", "torch", "triton"])
def test_a_tiny_row_takes_f_normalize_s_gradient(name, setting, backend):
    """A feature row whose norm is under F.normalize's eps (1e-12; an all-zero row is the common case, but there
    the projection that clamping drops is 0 anyway): x / eps, and its gradient that of a constant divisor, 1 / eps
    times the unit vector's, without the projection onto it, as autograd through F.normalize gives it, on
    every backend (the Triton path's positives' cosines and inverse norms included). Float32 against float64."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)
    a[3], b[7] = a[3] / a[3].norm() * 5e-13, b[7] / b[7].norm() * 2e-13  # unit vectors of norm 0.5 and 0.2
    leaves = [t.double().requires_grad_() for t in (a, b)]
    reference = build_loss(name, backend="dense", normalize=False)
    want = call(reference, setting, [torch.nn.functional.normalize(t, dim=-1) for t in leaves])
    want_grads = torch.autograd.grad(want, leaves)
    ours = [t.clone().requires_grad_() for t in (a, b)]
    got = call(build_loss(name, backend=backend), setting, ours)
    got_grads = torch.autograd.grad(got, ours)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    for gg, w in zip(got_grads, want_grads):
        assert w.abs().max() > 1e9  # the zero row's gradient: 1 / eps times its unit vector's
        torch.testing.assert_close(gg.double(), w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))


@pytest.mark.parametrize("name", available_losses())
def test_batch_of_one_is_an_error_that_says_why(name):
    z = torch.randn(1, 8)
    if name == "unigrad":  # no negatives: a batch of one is fine for UniGrad: F = u u^T, so -1 + lam / 2
        torch.testing.assert_close(build_loss(name, lam=100.0)(z, z), torch.tensor(49.0))
        return
    with pytest.raises(ValueError, match="batch of 1.*no negatives"):
        build_loss(name)(z, torch.randn(1, 8))


@pytest.mark.parametrize("name", available_losses())
@pytest.mark.parametrize("case,match", [
    ("shape", "z2 has shape \\(4, 6\\) but z1 has \\(4, 8\\)"),
    ("rank", "must be \\[N, D\\], got shape \\(4,\\)"),
    ("dtype", "floating-point.*torch.int64"),
    ("nan", "non-finite"),
    ("inf", "non-finite"),
    ("empty", "empty batch"),
])
def test_bad_features(name, case, match):
    z1 = torch.randn(4, 8)
    z2 = {"shape": torch.randn(4, 6), "rank": torch.randn(4), "dtype": torch.ones(4, 8, dtype=torch.long),
          "nan": z1.clone().index_fill_(0, torch.tensor([2]), float("nan")),
          "inf": z1.clone().index_fill_(0, torch.tensor([1]), float("inf")), "empty": torch.randn(0, 8)}[case]
    if case == "rank":
        z1, z2 = z2, z1
        match = match.replace("got", "got")  # z1 is the bad one here
    if case == "empty":
        z1 = z2
    with pytest.raises(ValueError, match=match):
        build_loss(name)(z1, z2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (runs where CUDA is present)")
def test_mismatched_devices():
    with pytest.raises(ValueError, match="is on cuda"):
        build_loss("dcl")(torch.randn(4, 8), torch.randn(4, 8, device="cuda"))


def test_mismatched_devices_meta():
    """Device mismatch is caught before any computation (the meta device stands in for a second one)."""
    with pytest.raises(ValueError, match="z2 is on meta but z1 is on cpu"):
        build_loss("dcl")(torch.randn(4, 8), torch.empty(4, 8, device="meta"))


@pytest.mark.parametrize("kernel", ["infonce", "dcl", "dclw", "eqco", "cacr"])
def test_functional_bad_scores(kernel):
    f = getattr(functional, kernel)
    pos, neg = torch.rand(4), torch.rand(4, 6)
    with pytest.raises(ValueError, match="pos has 4 anchors but neg has 3"):
        f(pos, torch.rand(3, 6))
    with pytest.raises(ValueError, match="no negatives"):
        f(pos, torch.rand(4, 0))
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2] = False
    with pytest.raises(ValueError, match="1 of 4 anchors have no valid negative"):
        f(pos, neg, neg_mask=mask)
    with pytest.raises(ValueError, match="neg_mask must be a bool tensor"):
        f(pos, neg, neg_mask=mask.float())
    with pytest.raises(ValueError, match="neg has 1 non-finite"):
        f(pos, neg.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan"))))
    # a non-finite value where the mask says invalid is ignored
    masked = neg.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("-inf")))
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 0] = False
    torch.testing.assert_close(f(pos, masked, neg_mask=mask), f(pos, neg, neg_mask=mask), rtol=0, atol=0)
    with pytest.raises(ValueError, match="pos has non-finite"):
        f(pos.index_fill(0, torch.tensor([1]), float("inf")), neg)
    with pytest.raises(ValueError, match="floating-point.*torch.int64"):
        f(pos, torch.ones(4, 6, dtype=torch.long))


@pytest.mark.parametrize("name,option", [("dcl", {"temperature": 0.0}), ("infonce", {"temperature": -1.0}),
                                         ("dclw", {"sigma": 0.0}), ("eqco", {"alpha": 0}), ("cacr", {"t_neg": -2.0}),
                                         ("unigrad", {"rho": 1.0})])
def test_bad_options(name, option):
    with pytest.raises(ValueError, match=next(iter(option))):
        build_loss(name, **option)


def test_masked_negatives_equal_dropped_negatives():
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.rand(5, generator=g, dtype=torch.float64), torch.rand(5, 9, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 9, dtype=torch.bool)
    mask[:, -3:] = False
    for name in ("infonce", "dcl", "dclw", "eqco", "cacr"):
        f = getattr(functional, name)
        torch.testing.assert_close(f(pos, neg, neg_mask=mask), f(pos, neg[:, :6]))


# ----------------------------------------------------------------------------- issue 29: scale and types


SCALED = ["infonce", "dcl", "dclw", "eqco"]  # CACR's cross_modal uses the scale too; UniGrad has no such form


@pytest.mark.parametrize("name", SCALED + ["cacr"])
@pytest.mark.parametrize("scale,error,match", [
    (float("nan"), ValueError, "logit_scale must be finite"),
    (float("inf"), ValueError, "logit_scale must be finite"),
    (torch.tensor(float("nan")), ValueError, "logit_scale has non-finite"),
    (torch.tensor(float("-inf")), ValueError, "logit_scale has non-finite"),
    (-3.0, ValueError, "logit_scale must be > 0"),
    (torch.tensor(0.0), ValueError, "logit_scale must be > 0"),
    ("10", TypeError, "logit_scale must be a tensor or a number"),
    (torch.tensor(10), TypeError, "logit_scale must be a floating-point"),
])
def test_bad_logit_scale_is_named(name, scale, error, match):
    """A diverged (NaN/inf) or negative scale is refused with an error naming it, not a NaN (or a loss that
    rewards misalignment) and a later error blaming the features."""
    image, text = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(error, match=match):
        build_loss(name).cross_modal(image, text, logit_scale=scale)
    fine = build_loss(name).cross_modal(image, text, logit_scale=torch.tensor(20.0))
    assert torch.isfinite(fine)


def test_open_clip_adapter_refuses_a_non_finite_scale():
    from contrastkit.adapters.open_clip import build_clip_loss

    with pytest.raises(ValueError, match="logit_scale has non-finite"):
        build_clip_loss("dcl")(torch.randn(4, 8), torch.randn(4, 8), torch.tensor(float("nan")))


@pytest.mark.parametrize("name", available_losses())
def test_types_are_checked_before_anything_else(name):
    z = torch.randn(4, 8)
    loss_fn = build_loss(name)
    for bad in ([[0.0] * 8] * 4, 3.0, None):
        with pytest.raises(TypeError, match="z1 must be a torch.Tensor"):
            loss_fn(bad, z)
        with pytest.raises(TypeError, match="z2 must be a torch.Tensor"):
            loss_fn(z, bad)
    if name == "unigrad":
        with pytest.raises(TypeError, match="target1 must be a torch.Tensor"):
            loss_fn(z, z, [1.0], [2.0])
        return
    calls = [(lambda b: loss_fn.query_key(b, z), "query"), (lambda b: loss_fn.query_key(z, b), "key"),
             (lambda b: loss_fn.query_key(z, z, [b]), "queue"), (lambda b: loss_fn.cross_modal(b, z), "image")]
    for call, arg in calls:
        with pytest.raises(TypeError, match=f"{arg} must be a torch.Tensor"):
            call([[0.0] * 8] * 4)
