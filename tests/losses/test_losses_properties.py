"""Property-based tests of the loss core (hypothesis): on random shapes, views, dtypes, memory layouts,
magnitudes, temperatures, chunk sizes and reductions, every objective in every form gives the values and
gradients of the float64 references (tests/losses/reference.py, written from the formulas).

Deterministic and bounded for CI: ``derandomize=True`` (the same examples on every run) and a fixed
number of examples per test; no example database is written.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference
from contrastkit.losses import build_loss

pytestmark = pytest.mark.quick

PROFILE = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
SCORE = ["infonce", "dcl", "dclw", "eqco", "cacr"]
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tolerances of a computation in float32 (what the kernels use for every dtype but float64), relative to the
# size of the logits (1 / tau); float64 inputs are computed in float64.
RTOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}


@st.composite
def features(draw, n, d, dtype, salt=0):
    """[n, d] features of ``dtype``, contiguous, transposed or strided, scaled by a magnitude from 1e-6
    (1e-3 in float16, whose smallest normal number is 6e-5) to 300; and the same values in float64. (Rows of
    norm below 1e-12 are divided by 1e-12, not by their norm: F.normalize's convention, which open_clip's
    features follow too, so they are left out.)"""
    seed = draw(st.integers(0, 2**31 - 1))
    low = -3 if dtype == torch.float16 else -6
    magnitude = 10.0 ** draw(st.sampled_from([low, -1, 0, 1, math.log10(300)]))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    g = torch.Generator().manual_seed(seed + salt)  # salt: views differ even where hypothesis draws one seed
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * magnitude
    if layout == "transposed":
        x = x.T.contiguous().to(dtype).T
    elif layout == "strided":
        x = torch.stack([x, torch.zeros_like(x)], 1).reshape(2 * n, d).to(dtype)[::2]
    else:
        x = x.to(dtype)
    return x.requires_grad_(), x.detach().double().requires_grad_()


def _close(got, expected, dtype, scale, what):
    # a gradient comes back in its input's dtype: rounded to that dtype's precision
    rtol = max(RTOL[dtype], 2 * torch.finfo(dtype).eps) if what == "gradient" else RTOL[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=rtol * max(1.0, scale), atol=rtol * max(1.0, scale),
                               msg=lambda m: f"{what}: {m}")


def _reduce(losses, reduction):
    return losses.mean() if reduction == "mean" else losses.sum() if reduction == "sum" else losses


def _check(got, expected, inputs, ref_inputs, dtype, scale):
    """Values, then gradients of a random weighting of the per-anchor losses (any reduction)."""
    _close(got, expected, dtype, scale, "value")
    weights = torch.rand(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((got.double() * weights).sum(), inputs, retain_graph=True)
    ref = torch.autograd.grad((expected * weights).sum(), ref_inputs, retain_graph=True)
    for g, r, x in zip(grads, ref, ref_inputs):
        norm = x.detach().norm(dim=1, keepdim=True)  # the gradient of a normalised input scales as 1/|x|
        _close(g.double() * norm, r * norm, dtype, scale, "gradient")


def _options(kind, tau, chunk):
    opts = {"chunk_size": chunk}
    ref = {"t_pos": 1.0, "t_neg": 2.0} if kind == "cacr" else {"tau": tau, "sigma": 0.5, "alpha": 256.0}
    if kind != "cacr":
        opts["temperature"] = tau
    if kind in ("dclw", "eqco"):
        opts.update({"sigma": 0.5} if kind == "dclw" else {"alpha": 256.0})
    return opts, ref


@PROFILE
@given(data=st.data(), kind=st.sampled_from(SCORE), n=st.integers(2, 6), d=st.integers(2, 8),
       v=st.integers(2, 3), dtype=st.sampled_from(list(DTYPES.values())),
       tau=st.sampled_from([0.005, 0.05, 0.1, 0.5, 1.0]), chunk=st.sampled_from([None, 0, 1, 3]),
       reduction=st.sampled_from(["mean", "sum", "none"]))
def test_views(data, kind, n, d, v, dtype, tau, chunk, reduction):
    """loss_fn(z1, ..., zV): SimCLR's setting with V views."""
    pairs = [data.draw(features(n, d, dtype, i)) for i in range(v)]
    opts, ref = _options(kind, tau, chunk)
    got = build_loss(kind, reduction=reduction, **opts)(*(z for z, _ in pairs))
    expected = _reduce(reference.per_anchor([z for _, z in pairs], kind, mean=False, **ref), reduction)
    _check(got, expected, [z for z, _ in pairs], [z for _, z in pairs], dtype, 1.0 / tau if kind != "cacr" else 4.0)


@PROFILE
@given(data=st.data(), kind=st.sampled_from(SCORE), n=st.integers(1, 5), q=st.integers(1, 7),
       d=st.integers(2, 8), dtype=st.sampled_from(list(DTYPES.values())), tau=st.sampled_from([0.005, 0.1, 1.0]),
       chunk=st.sampled_from([None, 0, 2]), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_query_key_queue(data, kind, n, q, d, dtype, tau, chunk, reduction):
    """loss_fn.query_key(q, k, queue): MoCo's setting."""
    (query, query64), (key, key64) = data.draw(features(n, d, dtype)), data.draw(features(n, d, dtype, 1))
    queue, queue64 = data.draw(features(q, d, dtype, 2))
    opts, ref = _options(kind, tau, chunk)
    got = build_loss(kind, reduction=reduction, **opts).query_key(query, key, queue)
    expected = _reduce(reference.query_key(query64, key64, queue64, kind, mean=False, **ref), reduction)
    _check(got, expected, [query, key, queue], [query64, key64, queue64], dtype, 1.0 / tau if kind != "cacr" else 4.0)


@PROFILE
@given(data=st.data(), kind=st.sampled_from(SCORE), n=st.integers(2, 6), d=st.integers(2, 8),
       dtype=st.sampled_from(list(DTYPES.values())), scale=st.sampled_from([None, 1.0, 14.3, 100.0]),
       chunk=st.sampled_from([None, 0, 1, 4]), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_cross_modal(data, kind, n, d, dtype, scale, chunk, reduction):
    """loss_fn.cross_modal(image, text, logit_scale=s): CLIP's setting (s a learnable tensor, or the loss's
    own 1 / temperature)."""
    (image, image64), (text, text64) = data.draw(features(n, d, dtype)), data.draw(features(n, d, dtype, 1))
    opts, ref = _options(kind, 0.1, chunk)
    loss_fn = build_loss(kind, reduction=reduction, **opts)
    scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # a model's parameter
    s = None if scale is None else torch.tensor(scale, dtype=scale_dtype, requires_grad=True)
    got = loss_fn.cross_modal(image, text, logit_scale=s)
    s64 = None if scale is None else torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
    expected = _reduce(reference.cross_modal(image64, text64, kind, scale=s64, mean=False, **ref), reduction)
    size = 10.0 if scale is None else scale
    _check(got, expected, [image, text], [image64, text64], dtype, size)
    if scale is not None:  # the scale's gradient too
        weights = torch.ones_like(expected)
        g = torch.autograd.grad((got.double() * weights).sum(), s)[0]
        r = torch.autograd.grad((expected * weights).sum(), s64)[0]
        _close(g, r, dtype, size, "logit_scale gradient")


@PROFILE
@given(data=st.data(), n=st.integers(1, 6), d=st.integers(2, 8), dtype=st.sampled_from(list(DTYPES.values())),
       lam=st.sampled_from([0.5, 10.0, 100.0]), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_unigrad(data, n, d, dtype, lam, reduction):
    """UniGradLoss()(z1, z2) on its first batch: F is the batch's target correlation (Eq. 14-15)."""
    (z1, z1_64), (z2, z2_64) = data.draw(features(n, d, dtype)), data.draw(features(n, d, dtype, 1))
    got = build_loss("unigrad", lam=lam, reduction=reduction)(z1, z2)
    u1, u2 = reference.unit(z1_64.detach()), reference.unit(z2_64.detach())
    correlation = (u1.T @ u1 + u2.T @ u2) / (2 * n)
    expected = _reduce(reference.unigrad(z1_64, z2_64, correlation, lam, mean=False), reduction)
    _check(got, expected, [z1, z2], [z1_64, z2_64], dtype, lam)


def test_the_profile_is_deterministic_and_bounded():
    assert PROFILE.derandomize and PROFILE.max_examples <= 100 and PROFILE.database is None
