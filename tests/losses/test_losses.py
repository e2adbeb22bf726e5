"""The loss core against float64 references written from the formulas, and the papers' identities."""

from __future__ import annotations

import pytest
import torch

import reference
from contrastkit.losses import (CACRLoss, DCLLoss, DCLWLoss, EqCoLoss, InfoNCELoss, UniGradLoss, available_losses,
                                build_loss, functional)

pytestmark = pytest.mark.quick

SCORE_LOSSES = {
    "infonce": (InfoNCELoss, {"temperature": 0.1}, {"tau": 0.1}),
    "dcl": (DCLLoss, {"temperature": 0.1}, {"tau": 0.1}),
    "dclw": (DCLWLoss, {"temperature": 0.1, "sigma": 0.5}, {"tau": 0.1, "sigma": 0.5}),
    "eqco": (EqCoLoss, {"temperature": 0.1, "alpha": 256.0}, {"tau": 0.1, "alpha": 256.0}),
    "cacr": (CACRLoss, {"t_pos": 1.0, "t_neg": 2.0}, {"t_pos": 1.0, "t_neg": 2.0}),
}


def _params(kind, tau):
    cls, opts, ref = SCORE_LOSSES[kind]
    if "temperature" in opts:
        opts, ref = {**opts, "temperature": tau}, {**ref, "tau": tau}
    return cls, opts, ref


def _views(seed, n, d, v=2, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=dtype).to(device).requires_grad_() for _ in range(v)]


def _grads(loss, views):
    return torch.autograd.grad(loss, views)


@pytest.mark.parametrize("kind", list(SCORE_LOSSES))
@pytest.mark.parametrize("n,d,v,tau", [(2, 3, 2, 0.1), (7, 16, 2, 0.5), (12, 5, 2, 0.05), (5, 8, 3, 0.2), (4, 6, 4, 1.0)])
def test_module_matches_float64_reference(kind, n, d, v, tau, device):
    seed = hash((kind, n, d, v)) % 2**31
    cls, opts, ref = _params(kind, tau)
    z = _views(seed, n, d, v, device=device)
    expected = reference.per_anchor(z, kind, **ref)
    got = cls(**opts)(*z)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for g, e in zip(_grads(got, z), _grads(expected, z)):
        torch.testing.assert_close(g, e, rtol=1e-7, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("kind", list(SCORE_LOSSES))
# tau 0.01 at d = 8: logit gaps past 88, where the exponential overflows float32
@pytest.mark.parametrize("tau,d", [(0.1, 32), (0.01, 8)])
def test_float32_inputs_close_to_float64_reference(kind, tau, d, device):
    cls, opts, ref = _params(kind, tau)
    z64 = _views(3, 16, d, device=device)
    z32 = [z.detach().float().requires_grad_() for z in z64]
    got = cls(**opts)(*z32)
    assert got.dtype == torch.float32
    expected = reference.per_anchor(z64, kind, **ref)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(_grads(got, z32), _grads(expected, z64)):
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["infonce", "dcl"])
def test_query_key_queue_matches_reference(kind):
    g = torch.Generator().manual_seed(11)
    q, k = (torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    queue = torch.randn(20, 8, generator=g, dtype=torch.float64)
    cls, opts, ref = _params(kind, 0.2)
    got = cls(**opts).query_key(q, k, queue)
    expected = reference.query_key(q, k, queue, kind, **ref)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, k)), torch.autograd.grad(expected, (q, k))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", list(SCORE_LOSSES))
def test_query_key_without_queue_uses_the_other_keys(kind):
    """SiMo: no queue, each query's negatives are the batch's other keys; equals the kernel on those scores."""
    cls, opts, _ = _params(kind, 0.1)
    q, k = _views(5, 6, 8)
    got = cls(**opts).query_key(q, k)
    u, w = reference.unit(q), reference.unit(k)
    sims = u @ w.T
    pos = sims.diagonal()
    neg = sims.masked_select(~torch.eye(6, dtype=torch.bool)).reshape(6, 5)
    kernel = getattr(functional, kind)
    expected = kernel(pos, neg, **opts).mean()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", list(SCORE_LOSSES))
def test_functional_kernel_equals_module_on_the_same_scores(kind):
    """The two-view module is the kernel applied to the scores it builds, with a mask for own views."""
    cls, opts, _ = _params(kind, 0.1)
    z = _views(21, 5, 7)
    u = reference.unit(torch.cat(z))
    n = 5
    sims = u @ u.T
    idx = torch.arange(2 * n)
    partner = (idx + n) % (2 * n)
    pos = sims[idx, partner]
    mask = torch.ones(2 * n, 2 * n, dtype=torch.bool)
    mask[idx, idx] = False
    mask[idx, partner] = False
    kernel = getattr(functional, kind)
    expected = kernel(pos, sims, neg_mask=mask, **opts).mean()
    torch.testing.assert_close(cls(**opts)(*z), expected, rtol=1e-10, atol=1e-12)


def test_eqco_with_alpha_equal_to_k_is_infonce():
    z = _views(1, 9, 12)
    k = 2 * 9 - 2
    torch.testing.assert_close(EqCoLoss(temperature=0.2, alpha=k)(*z), InfoNCELoss(temperature=0.2)(*z),
                               rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(2)
    pos, neg = torch.rand(6, generator=g, dtype=torch.float64), torch.rand(6, 10, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 10, generator=g) > 0.3
    mask[:, 0] = True
    # per-anchor K = that anchor's valid negatives, so alpha = K row by row is InfoNCE row by row
    for i in range(6):
        k_i = int(mask[i].sum())
        torch.testing.assert_close(
            functional.eqco(pos[i:i + 1], neg[i:i + 1], alpha=k_i, neg_mask=mask[i:i + 1]),
            functional.infonce(pos[i:i + 1], neg[i:i + 1], neg_mask=mask[i:i + 1]), rtol=1e-12, atol=1e-12)
    # and a different alpha is not InfoNCE
    assert not torch.allclose(EqCoLoss(alpha=256.0)(*z), InfoNCELoss()(*z))


def test_eqco_is_invariant_to_the_number_of_negatives_in_expectation():
    """EqCo's point (Eq. 5): with K i.i.d. negatives scaled by alpha/K the loss estimates the same
    quantity whatever K; plain InfoNCE grows with log K."""
    g = torch.Generator().manual_seed(0)
    pos = torch.full((4000,), 0.8, dtype=torch.float64)
    values, plain = [], []
    for k in (16, 256, 4096):
        neg = torch.rand(4000, k, generator=g, dtype=torch.float64) * 2 - 1
        values.append(float(functional.eqco(pos, neg, temperature=0.5, alpha=256.0).mean()))
        plain.append(float(functional.infonce(pos, neg, temperature=0.5).mean()))
    assert max(values) - min(values) < 0.05
    assert plain[2] - plain[0] > 2.0


def test_dclw_tends_to_dcl_as_sigma_grows():
    z = _views(4, 10, 8)
    dcl = DCLLoss(temperature=0.1)(*z)
    gaps = [float((DCLWLoss(temperature=0.1, sigma=s)(*z) - dcl).abs().detach()) for s in (0.5, 5.0, 50.0, 5e4)]
    assert gaps[0] > 1e-3
    assert gaps == sorted(gaps, reverse=True)
    assert gaps[-1] < 1e-4
    grads = [_grads(f(*z), z) for f in (DCLWLoss(temperature=0.1, sigma=1e7), DCLLoss(temperature=0.1))]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_dclw_weight_is_detached_and_has_mean_one():
    pos = torch.rand(32, dtype=torch.float64, requires_grad=True)
    w = functional.dclw_weights(pos, 0.5)
    assert not w.requires_grad
    torch.testing.assert_close(w.mean(), torch.tensor(1.0, dtype=torch.float64))
    assert w[pos.argmin()] == w.max()  # the hardest positive gets the largest weight


def test_infonce_gradient_is_npc_multiplier_times_decoupled_gradient():
    """DCL paper, Prop. 1: per anchor, grad L_NCE = q_B grad L_DC, for scores and for embeddings."""
    g = torch.Generator().manual_seed(7)
    pos = torch.rand(8, generator=g, dtype=torch.float64, requires_grad=True)
    neg = torch.rand(8, 30, generator=g, dtype=torch.float64, requires_grad=True)
    q = functional.npc_multiplier(pos, neg, temperature=0.1)
    gi = torch.autograd.grad(functional.infonce(pos, neg, temperature=0.1).sum(), (pos, neg))
    gd = torch.autograd.grad(functional.dcl(pos, neg, temperature=0.1).sum(), (pos, neg))
    torch.testing.assert_close(gi[0], q * gd[0])
    torch.testing.assert_close(gi[1], q[:, None] * gd[1])
    # embedding level, for one anchor of the two-view batch: d L_i / d z = q_i d L_DC,i / d z for every z
    z = _views(8, 6, 5)
    u = reference.unit(torch.cat(z))
    s = u[0] @ u.T
    p_, n_ = s[6:7], torch.cat([s[1:6], s[7:]])[None]
    li = functional.infonce(p_, n_, temperature=0.1).sum()
    ld = functional.dcl(p_, n_, temperature=0.1).sum()
    qi = functional.npc_multiplier(p_.detach(), n_.detach(), temperature=0.1)
    for a, b in zip(torch.autograd.grad(li, z, retain_graph=True), torch.autograd.grad(ld, z)):
        torch.testing.assert_close(a, qi * b)
    # q_B matches its definition 1 - e^{p/t} / (e^{p/t} + sum e^{n/t})
    e_p, e_n = torch.exp(pos / 0.1), torch.exp(neg / 0.1).sum(1)
    torch.testing.assert_close(q, (1 - e_p / (e_p + e_n)).detach())


def test_npc_multiplier_grows_with_batch_size():
    """DCL paper, Fig. 1: q_B tends to 1 as the batch grows (random features here)."""
    means = []
    for n in (4, 64, 1024):
        z = torch.randn(n, 32), torch.randn(n, 32)
        means.append(float(InfoNCELoss(temperature=0.5)(*z, output_dict=True)["npc_multiplier"]))
    assert means[0] < means[1] < means[2] and means[2] > 0.99


def test_unigrad_matches_reference_and_eq14_gradient():
    z = _views(9, 10, 6)
    loss_fn = UniGradLoss(lam=100.0, rho=0.9).double()
    got = loss_fn(*z)
    u1, u2 = (reference.unit(x.detach()) for x in z)
    expected_f = (u1.T @ u1 + u2.T @ u2) / 20  # first batch initialises F
    torch.testing.assert_close(loss_fn.correlation, expected_f)
    expected = reference.unigrad(*z, expected_f, 100.0)
    torch.testing.assert_close(got, expected)
    for a, b in zip(_grads(got, z), _grads(expected, z)):
        torch.testing.assert_close(a, b)
    # second batch: F = rho F + (1 - rho) batch
    z_next = _views(10, 10, 6)
    loss_fn(*z_next)
    v1, v2 = (reference.unit(x.detach()) for x in z_next)
    torch.testing.assert_close(loss_fn.correlation, 0.9 * expected_f + 0.1 * (v1.T @ v1 + v2.T @ v2) / 20)

    # Eq. 14 on unit inputs (normalize=False): dL/du1 = (-u2 + lam F u1) / (2N) per anchor
    f = loss_fn.correlation.clone()
    unit_loss = UniGradLoss(lam=100.0, normalize=False).double().eval()
    unit_loss.correlation = f
    a1, a2 = (reference.unit(x.detach()).requires_grad_() for x in z)
    g1, _ = torch.autograd.grad(unit_loss(a1, a2), (a1, a2))
    torch.testing.assert_close(g1, (-a2.detach() + 100.0 * a1.detach() @ f) / 20)
    # and with normalisation inside: the same gradient projected onto the sphere's tangent, divided by |z|
    raw = z[0].detach().clone().requires_grad_()
    unit_loss.normalize = True
    (gz,) = torch.autograd.grad(unit_loss(raw, a2.detach()), (raw,))
    u = reference.unit(raw.detach())
    eq14 = (-a2.detach() + 100.0 * u @ f) / 20
    projected = (eq14 - (eq14 * u).sum(-1, keepdim=True) * u) / raw.detach().norm(dim=-1, keepdim=True)
    torch.testing.assert_close(gz, projected)


def test_unigrad_uses_momentum_targets_and_resumes_from_state_dict():
    z1, z2, t1, t2 = _views(12, 8, 4, v=4)
    loss_fn = UniGradLoss().double()
    loss_fn(z1, z2, t1, t2)
    v1, v2 = reference.unit(t1.detach()), reference.unit(t2.detach())
    torch.testing.assert_close(loss_fn.correlation, (v1.T @ v1 + v2.T @ v2) / 16)
    g = torch.autograd.grad(loss_fn(z1, z2, t1, t2), (t1, t2), allow_unused=True)
    assert g == (None, None)  # targets carry no gradient
    restored = UniGradLoss().double()
    restored.load_state_dict(loss_fn.state_dict())
    torch.testing.assert_close(restored.correlation, loss_fn.correlation)
    assert loss_fn.correlation.dtype == torch.float32 or loss_fn.correlation.dtype == torch.float64


def test_several_positives_cacr_weights_hard_positives_more():
    z = _views(13, 6, 8, v=4)
    loss_fn = CACRLoss(t_pos=1.0, t_neg=2.0)
    out = loss_fn(*z, output_dict=True)
    torch.testing.assert_close(out["loss"], reference.per_anchor(z, "cacr", t_pos=1.0, t_neg=2.0))
    assert set(out) == {"loss", "attraction", "repulsion"}


def test_output_dict_terms_add_up():
    z = _views(14, 8, 8)
    for kind in ("dcl", "dclw"):
        out = build_loss(kind)(*z, output_dict=True)
        torch.testing.assert_close(out["loss"].detach(), out["pos_term"] + out["neg_term"])
        assert 0 < float(out["npc_multiplier"]) < 1


def test_registry():
    assert available_losses() == ["infonce", "dcl", "dclw", "eqco", "cacr", "unigrad"]
    assert isinstance(build_loss("DCL", temperature=0.2), DCLLoss)
    assert build_loss("dcl", temperature=0.2).temperature == 0.2
    with pytest.raises(ValueError, match="unknown loss 'ntxent'.*infonce, dcl"):
        build_loss("ntxent")
    with pytest.raises(TypeError, match="build_loss\\('dcl'\\).*sigma"):
        build_loss("dcl", sigma=0.5)


def test_modules_save_no_state_but_unigrad():
    for name in available_losses():
        keys = set(build_loss(name).state_dict())
        assert keys == ({"correlation"} if name == "unigrad" else set())


def test_temperature_matters():
    z = _views(15, 8, 8)
    assert not torch.allclose(DCLLoss(temperature=0.1)(*z), DCLLoss(temperature=0.5)(*z))


@pytest.mark.parametrize("kind", list(SCORE_LOSSES))
def test_cross_modal_is_the_mean_of_both_directions(kind):
    """Image-text: an image's negatives are the other captions and vice versa; the kernel on each side."""
    cls, opts, _ = _params(kind, 0.1)
    img, txt = _views(30, 7, 9)
    got = cls(**opts).cross_modal(img, txt)
    sims = reference.unit(img) @ reference.unit(txt).T
    off = ~torch.eye(7, dtype=torch.bool)
    kernel = getattr(functional, kind)
    directions = [kernel(sims.diagonal(), s.masked_select(off).reshape(7, 6), **opts).mean() for s in (sims, sims.T)]
    torch.testing.assert_close(got, sum(directions) / 2, rtol=1e-10, atol=1e-12)


def test_cross_modal_infonce_is_clip_loss_and_scale_gets_gradient():
    img, txt = _views(31, 8, 5)
    scale = torch.tensor(14.0, dtype=torch.float64, requires_grad=True)
    got = InfoNCELoss().cross_modal(img, txt, logit_scale=scale)
    logits = scale * reference.unit(img) @ reference.unit(txt).T
    labels = torch.arange(8)
    expected = (torch.nn.functional.cross_entropy(logits, labels) + torch.nn.functional.cross_entropy(logits.T, labels)) / 2
    torch.testing.assert_close(got, expected)
    (g,) = torch.autograd.grad(got, scale)
    (e,) = torch.autograd.grad(expected, scale)
    torch.testing.assert_close(g, e)
    assert float(g.abs()) > 0


def test_normalize_rows_matches_f_normalize_values_and_gradients():
    """The hand-written backward against autograd through F.normalize, float64, including a zero row and
    a row below the 1e-12 clamp (whose gradient is grad / 1e-12, the norm being a constant there)."""
    g = torch.Generator().manual_seed(32)
    x = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    x[0, 1] = 0.0
    x[1, 2] *= 1e-14
    x.requires_grad_()
    upstream = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    got = functional.normalize_rows(x)
    expected = torch.nn.functional.normalize(x, dim=-1)
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=0)
    (dg,) = torch.autograd.grad(got, x, upstream)
    (de,) = torch.autograd.grad(expected, x, upstream)
    torch.testing.assert_close(dg, de, rtol=1e-12, atol=0)
    fresh = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(functional.normalize_rows, (fresh,))
    # Not twice differentiable: a second derivative is an error, never a silently wrong number.
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        (d,) = torch.autograd.grad(functional.normalize_rows(fresh).sum(), fresh, create_graph=True)
        d.sum().backward()


@pytest.mark.parametrize("kind", ["infonce", "eqco"])
def test_softmax_losses_exact_in_float64_past_softplus_threshold(kind):
    """A positive 20+ logits below its negatives' logsumexp: F.softplus would return the gap itself there
    (off by e^-gap ~ 1e-9, its gradient too); the loss must match logsumexp - p to float64 rounding."""
    tau = 0.05
    pos = torch.tensor([-0.5, -0.6, 0.2], dtype=torch.float64, requires_grad=True)
    neg = torch.tensor([[0.5, 0.45, 0.4, 0.5], [0.55, 0.5, 0.3, 0.2], [0.1, 0.0, -0.1, 0.3]], dtype=torch.float64,
                       requires_grad=True)
    opts = {"temperature": tau, **({"alpha": 4.0} if kind == "eqco" else {})}  # alpha = K: InfoNCE exactly
    got = getattr(functional, kind)(pos, neg, **opts)
    logits = torch.cat([pos[:, None], neg], dim=1) / tau
    want = torch.logsumexp(logits, dim=1) - logits[:, 0]
    gap = (torch.logsumexp(neg / tau, dim=1) - pos / tau).detach()
    assert bool((gap[:2] > 20).all()) and float(gap[2]) < 20  # two rows past the threshold, one before
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    upstream = torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64)
    for g, w in zip(torch.autograd.grad(got, (pos, neg), upstream), torch.autograd.grad(want, (pos, neg), upstream)):
        torch.testing.assert_close(g, w, rtol=1e-14, atol=0)


@pytest.mark.parametrize("kind", list(SCORE_LOSSES))
@pytest.mark.parametrize("n,h", [(5, 1), (4, 3), (1, 2)])
def test_query_key_hard_negatives_match_reference(kind, n, h, device):
    """query_key(q, k, negatives=...): every sample's keys and extra candidates are the negatives, the
    query's own key excepted; values and gradients (of q, k and the negatives) against the float64 reference."""
    cls, opts, ref = _params(kind, 0.2)
    q, k, *hard = _views(31 + n + h, n, 6, v=2 + h, device=device)
    got = cls(**opts).query_key(q, k, negatives=torch.stack(hard, dim=1))
    expected = reference.ranking(q, [k, *hard], kind, **ref)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for a, b in zip(_grads(got, [q, k, *hard]), _grads(expected, [q, k, *hard])):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11)


def test_query_key_negatives_errors():
    q, k, hn = _views(2, 4, 6, v=3)
    with pytest.raises(ValueError, match="queue or negatives"):
        DCLLoss().query_key(q, k, torch.randn(5, 6, dtype=torch.float64), negatives=hn)
    with pytest.raises(ValueError, match="negatives has 3"):
        DCLLoss().query_key(q, k, negatives=hn[:3])
    with pytest.raises(ValueError, match="dimension"):
        DCLLoss().query_key(q, k, negatives=torch.randn(4, 5, dtype=torch.float64))
