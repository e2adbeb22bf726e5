"""The Triton kernels of the negatives' statistics (losses/triton/stats.py) against dense float64 references
written from the formula: values and gradients of anchors, candidates and a learnable scale. On CPU they run
under Triton's interpreter (conftest.py sets TRITON_INTERPRET), on CUDA unchanged; small shapes and 16-wide
tiles keep the interpreter quick, and leave partial tiles in every dimension (37 = 16 + 16 + 5 rows,
53 = 3 * 16 + 5 columns, D = 24 = 16 + 8)."""

from __future__ import annotations

import pytest
import torch

from contrastkit.losses.triton.stats import negative_stats_triton

pytestmark = pytest.mark.legacy  # the kernels under triton 3.5.1 / torch 2.9.1 too

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILES = dict(block_m=16, block_n=16, block_d=16)


def reference(a, b, scale, exclude=None, with_mean=False, columns=False, labels=None, same_label=True):
    """Dense float64 statistics of L = scale a b^T, excluded pairs masked: rows' lse (and softmax-weighted
    mean of L / scale), then the columns' lse. labels (row ids, column ids): the pairs whose ids are equal
    masked too (same_label), or those whose ids differ."""
    logits = scale * a @ b.T
    mask = torch.zeros_like(logits, dtype=torch.bool)
    if exclude is not None:
        mask.scatter_(1, exclude.to(mask.device), True)
    if labels is not None:
        equal = labels[0].cpu()[:, None] == labels[1].cpu()[None, :]
        mask |= equal if same_label else ~equal
    masked = logits.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(masked, dim=1)
    stats = [lse]
    if with_mean:
        stats.append((torch.exp(masked - lse[:, None]) * logits.masked_fill(mask, 0)).sum(1) / scale)
    if columns:
        stats.append(torch.logsumexp(masked, dim=0))
    return torch.stack(stats)


# The scale's gradient after the fused forward: its statistics from the kernel's own float32 sums, the backward's
# logits from cuBLAS's, which round apart (~1e-7 of a logit), and the scale's gradient, a sum over M K terms that
# cancel, carries it: 2.4e-6 of its size measured where both passes' logits are cuBLAS's stay within 2e-6.
SCALE_TOL_FUSED = 5e-6


LOGITS = ["kernel", "cublas", "dense"]


@pytest.fixture(params=LOGITS)
def logits_from(request, monkeypatch):
    """Every place the forward's logits come from (triton_stats.LOGITS): computed by the fused Triton kernel,
    or written per band by cuBLAS in float32 and read by an elementwise kernel (the band design), each with
    backward's logits recomputed per block by cuBLAS (two views then take one product of dL + dL^T), or
    written whole once in forward and read back in backward (dense). Tests without it run the defaults
    ("auto": dense at these sizes)."""
    return _logits_from(monkeypatch, request.param)


def _logits_from(monkeypatch, route):
    from contrastkit.losses.triton import stats as triton_stats

    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", route)
    return route


def spread(*axes):
    """The full cross of ``axes`` (lists of values), each case with one of the forward's routes (LOGITS) in turn,
    for the band design's tests: the route decides the forward alone (the fused kernel, or cuBLAS's products in
    bands, or the whole matrix kept), and backward only whether a block's logits are recomputed by cuBLAS
    ("kernel", "cublas": the same backward) or read from the kept matrix ("dense"). Taken in turn, each route
    meets every value of every axis (checked in test_spread_meets_every_value) and every backward design, without
    the full cross (three times as many cases)."""
    import itertools

    return [(*case, LOGITS[i % len(LOGITS)]) for i, case in enumerate(itertools.product(*axes))]


def each_route(cases, alternate=(False, True)):
    """Each case (a tuple) on every forward route (LOGITS), the two values of one more axis (``alternate``: the
    features as given or unit vectors, or the buffer design) on alternate ones: for tests whose cases are too few
    for spread to take each of their values to every route (a value in fewer than three cases). Every case
    meets every route, and the alternating axis's values meet every case and every route (checked in
    test_each_route_meets_every_value), in half the full cross."""
    return [(*case, route, alternate[(i + j) % 2]) for i, case in enumerate(cases) for j, route in enumerate(LOGITS)]


def _spread_id(value):
    """Test ids of spread's cases: the features as given or unit vectors, a two-view case by its dtype and options."""
    if isinstance(value, bool):
        return "as_given" if value else "units"
    if isinstance(value, tuple):
        dtype, with_mean, labelled = value
        return str(dtype)[6:] + ("-mean" if with_mean else "") + ("-labels" if labelled else "")
    return str(value)[6:] if isinstance(value, torch.dtype) else None


def test_spread_meets_every_value():
    """spread's cases in the band tests: each route with every value of every axis, and each backward design
    (bands or blocks, triangle or full rows) with the logits both recomputed and kept."""
    for axes in ((BUFFERS, BACKWARDS, TWO_VIEW_CASES, [False, True]), (BUFFERS, [torch.float32, torch.bfloat16],
                 [False, True]), (BUFFERS, BACKWARDS, [False, True])):
        cases = spread(*axes)
        for i, axis in enumerate(axes):
            assert {(c[i], c[-1]) for c in cases} == {(v, r) for v in axis for r in LOGITS}
    designs = {(c[0], c[1], c[-1] == "dense") for c in spread(BUFFERS, BACKWARDS, TWO_VIEW_CASES, [False, True])}
    assert designs == {(b, w, kept) for b in BUFFERS for w in BACKWARDS for kept in (False, True)}
    for axes in (HALF_AXES, LABEL_AXES):
        cases = spread(*axes)
        assert len(cases) == len(set(cases)) == 8  # the 2 x 2 x 2 cross, once each (was 24 with every route)
        for i, axis in enumerate(axes):
            assert {(c[i], c[-1]) for c in cases} == {(v, r) for v in axis for r in LOGITS}


def test_each_route_meets_every_value():
    """each_route's cases: every case on every route; the alternating axis's two values with every case and
    every route; half the full cross. PRODUCTION_CASES is each_route's too."""
    assert PRODUCTION_CASES == each_route(PRODUCTION, (True, False))
    for entries, alternate in ((ROW_CASES, (False, True)), ([(True,), (False,)], (False, True)),
                               ([(False,), (True,)], (False, True)), (BUFFER_CASES, (False, True)),
                               (BUFFER_CASES, (True, False)),
                               (TF32_SETTINGS, BUFFERS), (PRODUCTION, (True, False))):
        cases = each_route(entries, alternate)
        assert len(cases) == len(set(cases)) == len(entries) * len(LOGITS)
        assert {c[:-1] for c in cases} == {(*e, r) for e in entries for r in LOGITS}
        assert {(c[:-2], c[-1]) for c in cases} == {(e, v) for e in entries for v in alternate}
        assert {(c[-2], c[-1]) for c in cases} == {(r, v) for r in LOGITS for v in alternate}
    # the band design's rows and one tensor as image and text: between them, the full cross
    halves = each_route(BUFFER_CASES) + each_route(BUFFER_CASES, (True, False))
    assert sorted(halves) == sorted((b, r, n) for b in BUFFERS for r in LOGITS for n in (False, True))


@pytest.fixture(params=[False, True], ids=["units", "as_given"])
def as_given(request):
    """normalize=True: the features as given (rows of norms 0.2 to 5), the kernels scaling their products by
    the inverse norms (the losses' calls), against the float64 reference of F.normalize of the same rows; else
    unit vectors in, normalize=False."""
    return request.param


def _features(g, rows, d, dtype=torch.float32):
    return torch.nn.functional.normalize(torch.randn(rows, d, generator=g, dtype=torch.float64), dim=1).to(dtype)


def _compare(a, b, scale, tol, grad_tol, *, scale_tol=None, same=False, **options):
    """Values and the gradients of sum(w * stats) for random w: kernel (inputs as given, 16-wide tiles)
    against the float64 reference of the same (rounded) inputs. Errors relative to the reference's largest
    entry; the scale's gradient (float32 whatever the inputs) within scale_tol (default grad_tol)."""
    _compare_at(a, b, scale, tol, grad_tol, scale_tol=scale_tol, same=same, tiles=TILES, **options)


def _compare_at(a, b, scale, tol, grad_tol, *, scale_tol=None, same=False, tiles, normalize=False, **options):
    """_compare with the given tiles ({}: the production configuration). normalize: the rows scaled to norms
    0.2 to 5 first (see as_given)."""
    if normalize:
        g = torch.Generator().manual_seed(99)
        a, b = ((x.double().cpu() * torch.empty(x.shape[0], 1, dtype=torch.float64).uniform_(0.2, 5.0, generator=g))
                .to(device=x.device, dtype=x.dtype) for x in (a, b))
        options["normalize"] = True
        # The normalisation's backward cancels the radial part of the unit vectors' gradient: in float32 it
        # costs ~1e-5 of the largest gradient, as torch's own (F.normalize then the dense loss in float32 was
        # 5.2e-6 off float64 against a largest entry of 0.50 in test_same_tensor_with_asymmetric_exclusions).
        grad_tol = max(grad_tol, 2e-5)
    a64, b64 = a.detach().double().cpu().requires_grad_(), b.detach().double().cpu().requires_grad_()
    s64 = torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
    a_k, b_k = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    s_k = torch.tensor(float(scale), device=a.device, requires_grad=True)
    unit = torch.nn.functional.normalize if normalize else (lambda x, dim: x)
    want = reference(unit(a64, dim=1), unit(a64 if same else b64, dim=1), s64,
                     **{k: v for k, v in options.items() if k != "normalize"})
    got = negative_stats_triton(a_k, a_k if same else b_k, s_k, **options, **tiles)
    assert got.dtype == torch.float32 and got.shape == want.shape
    _close(got, want, tol, "values")
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves64, leaves = ([a64, s64], [a_k, s_k]) if same else ([a64, b64, s64], [a_k, b_k, s_k])
    want_grads = torch.autograd.grad((want * w).sum(), leaves64)
    grads = torch.autograd.grad((got * w.to(got)).sum(), leaves)
    for name, g, wg, leaf in zip(["anchors", "candidates", "scale"][: len(leaves)], grads, want_grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
        _close(g, wg, (scale_tol or grad_tol) if name == "scale" else grad_tol, f"d {name}")


def _close(got, want, tol, what):
    error = float((got.detach().double().cpu() - want.detach()).abs().max())
    bound = tol * float(want.detach().abs().max())
    assert error <= bound, f"{what}: max error {error:.3g} > {bound:.3g}"


# (excluded columns per row, CACR's mean)
ROW_CASES = [(0, False), (1, True), (2, False), (3, True), (2, True)]


@pytest.mark.parametrize("views, with_mean, logits_from, as_given", each_route(ROW_CASES),
                         ids=[f"excluded{v}{'-mean' if m else ''}-{r}-{'as_given' if n else 'units'}"
                              for v, m, r, n in each_route(ROW_CASES)])
def test_rows_equal_float64_reference(monkeypatch, views, with_mean, logits_from, as_given):
    """Query/queue (no exclusion), one excluded column (a positive), two and three (several views or
    positives), with and without CACR's mean; ragged tiles, a learnable scale. Each entry on every forward
    route, the features as given on alternate ones (each_route)."""
    _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(10 + views)
    a, b = _features(g, 37, 24).to(DEVICE), _features(g, 53, 24).to(DEVICE)
    exclude = None
    if views:  # distinct columns per row, as a sample's views are
        exclude = torch.stack([torch.randperm(53, generator=g)[:views] for _ in range(37)]).to(DEVICE)
    _compare(a, b, 10.0, 2e-6, 2e-6, exclude=exclude, with_mean=with_mean, normalize=as_given)


@pytest.mark.parametrize("with_mean, logits_from, as_given", each_route([(False,), (True,)]),
                         ids=[f"{'mean' if m else 'lse'}-{r}-{'as_given' if n else 'units'}"
                              for m, r, n in each_route([(False,), (True,)])])
def test_two_views_same_tensor(monkeypatch, with_mean, logits_from, as_given):
    """Two views on one process: anchors are the candidates (one tensor), each row leaves out itself and its
    other view; the tensor's gradient is the sum of both roles. Each case on every forward route, the features
    as given on alternate ones (each_route)."""
    _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(2)
    n = 20
    z = _features(g, 2 * n, 24).to(DEVICE)
    own = torch.arange(2 * n)
    exclude = torch.stack([own, (own + n) % (2 * n)], dim=1).to(DEVICE)
    _compare(z, z, 10.0, 2e-6, 2e-6, same=True, exclude=exclude, with_mean=with_mean, normalize=as_given)


@pytest.mark.parametrize("forward", ["full rows", "triangle"])
def test_two_views_far_apart(monkeypatch, forward):
    """Scale 100, one sample of 20 opposite the others (both views): its row's lse ~200 below the tile
    maxima, past the forward's one-exp-per-logit window over the triangle (common.tile_exp), whose columns' partials (that sample's column) then take their own exps: exact still
    (one exp per logit there would overflow)."""
    from contrastkit.losses.triton import stats as triton_stats
    from contrastkit.losses.triton import stats_fwd

    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", "kernel")  # the default here is dense: no triangle
    monkeypatch.setattr(triton_stats, "FUSED_TRIANGLE", True)
    monkeypatch.setattr(stats_fwd, "TRIANGLE_BAND_ROWS", 16 if forward == "triangle" else 2**20)
    g = torch.Generator().manual_seed(18)
    u = _features(g, 1, 24)
    sign = torch.where(torch.arange(20) < 19, 1.0, -1.0)[:, None]
    views = [torch.nn.functional.normalize(sign * u + 0.05 * torch.randn(20, 24, generator=g), dim=1)
             for _ in range(2)]
    z = torch.cat(views).to(DEVICE)
    own = torch.arange(40)
    exclude = torch.stack([own, (own + 20) % 40], dim=1).to(DEVICE)
    _compare(z, z, 100.0, 2e-6, 2e-5, same=True, exclude=exclude)


def test_same_tensor_with_asymmetric_exclusions(as_given, logits_from):
    """One tensor as anchors and candidates, exclusions not symmetric (i leaves out k, k keeps i): the
    symmetric backward's dL_ki term (dlogits' SYMMETRIC) must read row k's own exclusions."""
    g = torch.Generator().manual_seed(13)
    z = _features(g, 37, 24).to(DEVICE)
    exclude = torch.stack([torch.randperm(37, generator=g)[:2] for _ in range(37)]).to(DEVICE)
    _compare(z, z, 10.0, 2e-6, 2e-6, same=True, exclude=exclude, with_mean=True, normalize=as_given)


def test_rows_with_many_excluded_columns():
    """17 of 20 columns excluded (and one of them twice): the whole first column tile for every row, so the
    online maximum starts on excluded pairs and must drop them when the valid ones come."""
    g = torch.Generator().manual_seed(3)
    a, b = _features(g, 21, 24).to(DEVICE), _features(g, 20, 24).to(DEVICE)
    last = torch.randint(16, 20, (21, 1), generator=g)
    exclude = torch.cat([torch.arange(16).expand(21, 16), last, last], dim=1).to(DEVICE)
    _compare(a, b, 10.0, 2e-6, 2e-6, exclude=exclude, with_mean=True)


def test_row_with_every_column_excluded(logits_from):
    """A row with no valid column: a hugely negative lse, mean 0, no gradient, nothing non-finite."""
    g = torch.Generator().manual_seed(12)
    a = _features(g, 5, 16).to(DEVICE).requires_grad_()
    b = _features(g, 18, 16).to(DEVICE).requires_grad_()
    exclude = torch.stack([torch.randperm(18, generator=g) for _ in range(5)])
    exclude[1:, 1:] = exclude[1:, :1]  # the other rows leave out only their first index (repeated)
    stats = negative_stats_triton(a, b, 3.0, exclude=exclude.to(DEVICE), with_mean=True, **TILES)
    assert float(stats[0, 0]) < -1e29 and float(stats[1, 0]) == 0.0
    want = reference(a.detach().double().cpu()[1:], b.detach().double().cpu(), 3.0, exclude[1:, :1], True)
    _close(stats[:, 1:], want, 2e-6, "other rows")
    da, db = torch.autograd.grad((stats * torch.rand(stats.shape, generator=g).to(DEVICE)).sum(), [a, b])
    assert torch.isfinite(da).all() and torch.isfinite(db).all() and float(da[0].abs().max()) == 0.0


@pytest.mark.quick
@pytest.mark.parametrize("diagonal, logits_from, as_given", each_route([(True,), (False,)]),
                         ids=[f"{'diagonal' if d else 'all'}-{r}-{'as_given' if n else 'units'}"
                              for d, r, n in each_route([(True,), (False,)])])
def test_columns_equal_float64_reference(monkeypatch, diagonal, logits_from, as_given):
    """Image-text on one process: the columns' lse too, the diagonal (each image's caption) excluded or not.
    Each case on every forward route, the features as given on alternate ones (each_route)."""
    _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(4)
    a, b = _features(g, 37, 24).to(DEVICE), _features(g, 37, 24).to(DEVICE)
    exclude = torch.arange(37, device=DEVICE)[:, None] if diagonal else None
    _compare(a, b, 10.0, 2e-6, 2e-6, exclude=exclude, columns=True, normalize=as_given)


def test_clip_scale_with_duplicate_pairs():
    """CLIP's largest scale (100) with duplicated pairs: logits spread over 200, ties at the maximum."""
    g = torch.Generator().manual_seed(5)
    a, b = _features(g, 19, 24), _features(g, 19, 24)
    a, b = torch.cat([a, a[:7]]).to(DEVICE), torch.cat([b, b[:7]]).to(DEVICE)
    _compare(a, b, 100.0, 2e-6, 2e-5, exclude=torch.arange(26, device=DEVICE)[:, None], columns=True)


def test_columns_far_below_zero():
    """Anti-aligned image and text features at scale 100: every logit near -100, so exp(0 - column lse)
    overflows float32; the rows past the end of the last tile (21 = 16 + 5) must not bring it into dB."""
    g = torch.Generator().manual_seed(11)
    u = _features(g, 1, 24)
    a = torch.nn.functional.normalize(u + 0.05 * torch.randn(21, 24, generator=g), dim=1).to(DEVICE)
    b = torch.nn.functional.normalize(-u + 0.05 * torch.randn(21, 24, generator=g), dim=1).to(DEVICE)
    _compare(a, b, 100.0, 2e-6, 2e-5, exclude=torch.arange(21, device=DEVICE)[:, None], columns=True)


def test_columns_far_apart():
    """Scale 100, every image near u, half the captions near u and half near -u: tiles whose columns' maxima
    lie ~200 apart, past the one-exp-per-logit window (triton/common.tile_exp): those take their own exps,
    exact still (one exp per logit there would overflow)."""
    g = torch.Generator().manual_seed(17)
    u = _features(g, 1, 24)
    a = torch.nn.functional.normalize(u + 0.05 * torch.randn(37, 24, generator=g), dim=1).to(DEVICE)
    sign = torch.where(torch.arange(37) < 18, 1.0, -1.0)[:, None]
    b = torch.nn.functional.normalize(sign * u + 0.05 * torch.randn(37, 24, generator=g), dim=1).to(DEVICE)
    _compare(a, b, 100.0, 2e-6, 2e-5, exclude=torch.arange(37, device=DEVICE)[:, None], columns=True)


# dtype, CACR's mean, the features as given
HALF_AXES = ([torch.bfloat16, torch.float16], [False, True], [False, True])


@pytest.mark.parametrize("dtype, with_mean, as_given, logits_from", spread(*HALF_AXES),
                         ids=[f"{str(t)[6:]}-{'mean' if m else 'lse'}-{'as_given' if n else 'units'}-{r}"
                              for t, m, n, r in spread(*HALF_AXES)])
def test_half_precision_inputs(monkeypatch, dtype, with_mean, as_given, logits_from):
    """bfloat16 / float16 features against the float64 reference of the same rounded features: the
    statistics are exact up to float32 sums; the gradients come back in the inputs' dtype (rounding
    2^-9 / 2^-12 relative) after dL meets b (or a) in bfloat16 (float32 for float16). Each case on one
    forward route (spread)."""
    _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(6)
    a, b = _features(g, 37, 24, dtype).to(DEVICE), _features(g, 53, 24, dtype).to(DEVICE)
    exclude = torch.randint(0, 53, (37, 2), generator=g).to(DEVICE)
    if dtype == torch.float16 and as_given:  # on float16 units (FLOAT16_UNITS)
        _compare_units(a, b, 14.0, exclude=exclude, with_mean=with_mean)
        return
    grad_tol = 1e-2 if dtype == torch.bfloat16 else 1e-3  # measured: 5e-3, 2.5e-4
    _compare(a, b, 14.0, 2e-6, grad_tol, scale_tol=2e-6, exclude=exclude, with_mean=with_mean, normalize=as_given)


def test_non_contiguous_inputs():
    """A transposed anchor matrix (stride 1 along rows) and every other row of the candidates."""
    g = torch.Generator().manual_seed(7)
    a = _features(g, 37, 24).to(DEVICE).T.contiguous().T
    b = _features(g, 106, 24).to(DEVICE)[::2]
    assert not a.is_contiguous() and not b.is_contiguous()
    _compare(a, b, 10.0, 2e-6, 2e-6, exclude=torch.randint(0, 53, (37, 1), generator=g).to(DEVICE))


def test_number_scale_and_no_grad():
    """A Python float scale (no gradient to return) and a call under no_grad."""
    g = torch.Generator().manual_seed(8)
    a, b = _features(g, 17, 24).to(DEVICE), _features(g, 18, 24).to(DEVICE)
    with torch.no_grad():
        got = negative_stats_triton(a, b, 7.5, **TILES)
    _close(got, reference(a.double().cpu(), b.double().cpu(), 7.5), 2e-6, "values")
    a.requires_grad_()
    (grad,) = torch.autograd.grad(negative_stats_triton(a, b, 7.5, **TILES).sum(), [a])
    a64 = a.detach().double().cpu().requires_grad_()
    (want,) = torch.autograd.grad(reference(a64, b.double().cpu(), 7.5).sum(), [a64])
    _close(grad, want, 2e-6, "d anchors")


_NEW_API = hasattr(torch.backends, "fp32_precision")
# How a user allows or forbids TF32 for float32 matmuls, and whether it is then allowed.
_SETTINGS = [("torch.backends.cuda.matmul.allow_tf32 = False", False),
             ("torch.backends.cuda.matmul.allow_tf32 = True", True),
             ("torch.set_float32_matmul_precision('high')", True),
             ("torch.set_float32_matmul_precision('highest')", False)]
if _NEW_API:  # torch >= 2.9: transformers 5's --tf32 sets the generic one
    _SETTINGS += [("torch.backends.fp32_precision = 'tf32'", True),
                  ("torch.backends.fp32_precision = 'ieee'", False),
                  ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", True),
                  ("torch.backends.fp32_precision = 'tf32'; torch.backends.cuda.matmul.fp32_precision = 'ieee'", False),
                  ("torch.backends.fp32_precision = 'ieee'; torch.backends.cuda.matmul.fp32_precision = 'tf32'", True)]


@pytest.mark.parametrize("setting, allowed", _SETTINGS, ids=[s for s, _ in _SETTINGS])
def test_dot_precision_follows_the_tf32_setting(monkeypatch, float32_precision, setting, allowed):
    """float32 inputs: TF32 products exactly when the user allows TF32 for float32 matmuls, through the legacy
    flag or torch >= 2.9's fp32_precision (after which reading the legacy flag raises: issue 23's crash);
    float16: float16 products, never TF32. The fused forward, the one kernel with products inside (the d logits
    kernel reads cuBLAS's, which follow torch's own setting). The kernels still run."""
    from contrastkit.losses.triton import launch
    from contrastkit.losses.precision import tf32_matmul_allowed

    seen, run = [], launch.run

    def spy(*args, **kwargs):
        if "PRECISION" in kwargs:
            seen.append(kwargs["PRECISION"])
        run(*args, **kwargs)

    monkeypatch.setattr(launch, "run", spy)
    exec(setting, {"torch": torch})
    assert tf32_matmul_allowed() is allowed
    a = torch.randn(16, 16, device=DEVICE)
    for dtype, want in ((torch.float32, "tf32" if allowed else "ieee"), (torch.float16, "ieee")):
        seen.clear()
        x = a.to(dtype).requires_grad_()
        negative_stats_triton(x, x, 1.0, forward_logits="kernel", **TILES).sum().backward()
        assert seen == [want]


def _ids(g, n, classes=4):
    return torch.randint(0, classes, (n,), generator=g).to(DEVICE)


# same_label, CACR's mean, the features as given
LABEL_AXES = ([True, False], [False, True], [False, True])


@pytest.mark.parametrize("same_label, with_mean, as_given, logits_from", spread(*LABEL_AXES),
                         ids=[f"{'same' if s else 'differing'}-{'mean' if m else 'lse'}-{'as_given' if n else 'units'}-{r}"
                              for s, m, n, r in spread(*LABEL_AXES)])
def test_labels_equal_float64_reference(monkeypatch, same_label, with_mean, as_given, logits_from):
    """Pairs left out by label (issue 41) on the Triton path: rows (query/queue, one excluded column besides)
    with 4 classes, same-label pairs left out (false negatives) or the differing ones (the statistics over
    same-label candidates); one excluded column per row as a positive is. Each case on one forward route
    (spread)."""
    _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(30 + same_label + 2 * with_mean)
    a, b = _features(g, 37, 24).to(DEVICE), _features(g, 53, 24).to(DEVICE)
    labels = (_ids(g, 37), _ids(g, 53))
    exclude = torch.randint(0, 53, (37, 1), generator=g).to(DEVICE)
    _compare(a, b, 10.0, 2e-6, 2e-6, scale_tol=SCALE_TOL_FUSED if logits_from == "kernel" else None,
             exclude=exclude, with_mean=with_mean, labels=labels, same_label=same_label, normalize=as_given)


@pytest.mark.parametrize("same_label, logits_from, as_given", each_route([(True,), (False,)]),
                         ids=[f"{'same' if s else 'differing'}-{r}-{'as_given' if n else 'units'}"
                              for s, r, n in each_route([(True,), (False,)])])
def test_labels_two_views_same_tensor(same_label, logits_from, as_given, monkeypatch):
    """Two views on one process with labels: one array of ids for the one tensor, the symmetric backward's
    transposed term and the forward's mirrored entries (over the triangle, in bands of 16 rows) masked by the
    columns' own ids (the fused forward, cublas, dense). Each case on every forward route, the features as
    given on alternate ones (each_route)."""
    _logits_from(monkeypatch, logits_from)
    from contrastkit.losses.triton import stats as triton_stats
    from contrastkit.losses.triton import stats_fwd

    monkeypatch.setattr(triton_stats, "FUSED_TRIANGLE", True)
    monkeypatch.setattr(stats_fwd, "TRIANGLE_BAND_ROWS", 16)
    g = torch.Generator().manual_seed(33 + same_label)
    n = 20
    z = _features(g, 2 * n, 24).to(DEVICE)
    own = torch.arange(2 * n)
    exclude = torch.stack([own, (own + n) % (2 * n)], dim=1).to(DEVICE)
    ids = _ids(g, n).repeat(2)  # a sample's two views share its label
    _compare(z, z, 10.0, 2e-6, 2e-6, same=True, exclude=exclude, labels=(ids, ids), same_label=same_label,
             normalize=as_given)


def test_labels_in_bands_at_production_tiles(monkeypatch, logits_from):
    """Labels at D = 512, the production tiles, blocks of 128 x 128 and forward launches of 128 rows (the
    buffers' bounds made small), bf16: every band and split masks by its own rows' and columns' ids."""
    from contrastkit.losses.triton import dlogits, stats_fwd

    monkeypatch.setattr(dlogits, "BACKWARD_BYTES", 1)
    monkeypatch.setattr(dlogits, "BLOCK_MIN_ELEMENTS", 1)
    monkeypatch.setattr(stats_fwd, "PARTIAL_BYTES", 1)
    g = torch.Generator().manual_seed(35)
    a, b = _features(g, 150, 512, torch.bfloat16).to(DEVICE), _features(g, 150, 512, torch.bfloat16).to(DEVICE)
    _compare_at(a, b, 14.0, 2e-6, 1e-2, scale_tol=1e-5, tiles={}, labels=(_ids(g, 150, 7), _ids(g, 150, 7)),
                with_mean=True, normalize=True)


@pytest.mark.quick
def test_bad_inputs_raise_clear_errors():
    a = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(TypeError, match="float64"):
        negative_stats_triton(a.double(), a.double(), 1.0)
    with pytest.raises(ValueError, match="with_mean=True with columns"):
        negative_stats_triton(a, a, 1.0, columns=True, with_mean=True)
    with pytest.raises(ValueError, match="square"):
        negative_stats_triton(a, a[:5], 1.0, columns=True)
    with pytest.raises(ValueError, match="diagonal"):  # its shape, read on every device
        negative_stats_triton(a, a, 1.0, columns=True, exclude=torch.zeros(8, 2, dtype=torch.long, device=DEVICE))
    if DEVICE == "cpu":  # its values, read where that costs no host sync (on CUDA, as documented, not read)
        with pytest.raises(ValueError, match="diagonal"):
            negative_stats_triton(a, a, 1.0, columns=True, exclude=torch.zeros(8, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="exclude must be int64"):
        negative_stats_triton(a, a, 1.0, exclude=torch.zeros(8, 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="D = 16"):
        negative_stats_triton(a, a[:, :8], 1.0)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        negative_stats_triton(a, a, 1.0, block_m=16, block_n=24, block_d=16)
    with pytest.raises(ValueError, match="together"):
        negative_stats_triton(a, a, 1.0, block_n=32)
    with pytest.raises(ValueError, match="0-dim"):
        negative_stats_triton(a, a, torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="forward_logits must be one of kernel, cublas, dense or auto"):
        negative_stats_triton(a, a, 1.0, forward_logits="fused")
    ids = torch.zeros(8, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="columns=True takes no labels"):
        negative_stats_triton(a, a.clone(), 1.0, columns=True, labels=(ids, ids))
    with pytest.raises(ValueError, match="column ids must be an integer tensor of 8 entries"):
        negative_stats_triton(a, a.clone(), 1.0, labels=(ids, ids[:5]))
    with pytest.raises(ValueError, match="row ids must be an integer tensor"):
        negative_stats_triton(a, a.clone(), 1.0, labels=(ids.float(), ids))


def test_compiles_into_one_graph():
    """torch.compile(fullgraph=True) keeps the op in the graph (no break) with its backward: values and
    gradients equal eager's."""
    g = torch.Generator().manual_seed(9)
    a, b = _features(g, 20, 24).to(DEVICE), _features(g, 21, 24).to(DEVICE)
    exclude = torch.randint(0, 21, (20, 2), generator=g).to(DEVICE)

    def loss(a, b, scale):
        stats = negative_stats_triton(a, b, scale, exclude=exclude, with_mean=True, **TILES)
        return (stats[0] - 2 * stats[1]).mean()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaves = [a.clone().requires_grad_(), b.clone().requires_grad_(), torch.tensor(5.0, requires_grad=True)]
        value = fn(*leaves)
        results.append([value.detach(), *torch.autograd.grad(value, leaves)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


BUFFERS = ["bands", "blocks"]
BACKWARDS = ["triangle", "full rows"]


@pytest.fixture(params=BUFFERS)
def small_buffers(request, monkeypatch):
    """The buffers' bounds (256 MiB of d logits, 128 MiB of column partials in production) made tiny, so
    that small shapes take the paths of large ones: d logits in bands of 16 rows and every column, or in
    blocks of 16 x 16 (dA and dB each summed over blocks); forward launches of one row tile, their partials
    combined per launch, and two views' forward over the upper triangle in bands of one row tile (the fused
    kernel's too: FUSED_TRIANGLE); dA's normalisation two bands of 16 rows at a time at D = 24 (37 rows: a group
    of two, then the last band alone)."""
    return _small_buffers(monkeypatch, request.param)


def _small_buffers(monkeypatch, kind):
    from contrastkit.losses.triton import stats as triton_stats
    from contrastkit.losses.triton import dlogits, stats_fwd

    monkeypatch.setattr(triton_stats, "FUSED_TRIANGLE", True)
    monkeypatch.setattr(triton_stats, "GROUP_ELEMENTS", 2 * 16 * 24)

    monkeypatch.setattr(dlogits, "BACKWARD_BYTES", 1)
    monkeypatch.setattr(dlogits, "BLOCK_MIN_ELEMENTS", 1)
    monkeypatch.setattr(dlogits, "BAND_ALIGN", 16)
    monkeypatch.setattr(dlogits, "BAND_MIN_ROWS", 0 if kind == "bands" else 10**9)
    monkeypatch.setattr(stats_fwd, "PARTIAL_BYTES", 1)
    monkeypatch.setattr(stats_fwd, "TRIANGLE_BAND_ROWS", 16)
    return kind


@pytest.mark.parametrize("buffers, dtype, as_given, logits_from",
                         spread(BUFFERS, [torch.float32, torch.bfloat16], [False, True]), ids=_spread_id)
def test_image_text_in_bands(monkeypatch, buffers, dtype, as_given, logits_from):
    """Image-text in 3 bands (16 + 16 + 5 rows) or 3 x 3 blocks, 3 forward launches: the columns' lse from
    the rows' pass, dA and dB summed over the blocks (in float32 where the inputs are bfloat16). The scale's
    gradient, a float32 sum of M K terms that cancel, within 1e-5 (8e-6 measured, 5e-6 in one band); 3e-5
    after the fused forward (1.5e-5 measured: SCALE_TOL_FUSED's reason). Each case on one forward route
    (spread)."""
    _small_buffers(monkeypatch, buffers), _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(14)
    a, b = _features(g, 37, 24, dtype).to(DEVICE), _features(g, 37, 24, dtype).to(DEVICE)
    grad_tol = 2e-6 if dtype == torch.float32 else 1e-2
    _compare(a, b, 10.0, 2e-6, grad_tol, scale_tol=3e-5 if logits_from == "kernel" else 1e-5,
             exclude=torch.arange(37, device=DEVICE)[:, None], columns=True, normalize=as_given)


BUFFER_CASES = [(b,) for b in BUFFERS]


@pytest.mark.parametrize("buffers, logits_from, as_given", each_route(BUFFER_CASES),
                         ids=[f"{b}-{r}-{'as_given' if n else 'units'}" for b, r, n in each_route(BUFFER_CASES)])
def test_query_queue_in_bands(monkeypatch, buffers, logits_from, as_given):
    """Rows only (query/queue) with CACR's mean, exclusions, in bands or blocks. Each buffer design on every
    forward route, the features as given on alternate ones (each_route)."""
    _small_buffers(monkeypatch, buffers), _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(15)
    a, b = _features(g, 37, 24).to(DEVICE), _features(g, 53, 24).to(DEVICE)
    exclude = torch.stack([torch.randperm(53, generator=g)[:2] for _ in range(37)]).to(DEVICE)
    _compare(a, b, 10.0, 2e-6, 2e-6, scale_tol=1e-5, exclude=exclude, with_mean=True, normalize=as_given)


@pytest.mark.parametrize("buffers, logits_from, as_given", each_route(BUFFER_CASES, (True, False)),
                         ids=[f"{b}-{r}-{'as_given' if n else 'units'}"
                              for b, r, n in each_route(BUFFER_CASES, (True, False))])
def test_one_tensor_as_image_and_text(monkeypatch, buffers, logits_from, as_given):
    """columns=True with the very tensor as both operands: its gradient is the sum of both roles' (dA + dB).
    Each buffer design on every forward route, the features as given on alternate ones (each_route), the
    other half of test_query_queue_in_bands' (together: every buffer design, route and normalisation)."""
    _small_buffers(monkeypatch, buffers), _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(16)
    z = _features(g, 37, 24).to(DEVICE)
    _compare(z, z, 10.0, 2e-6, 2e-6, scale_tol=1e-5, same=True, exclude=torch.arange(37, device=DEVICE)[:, None],
             columns=True, normalize=as_given)


@pytest.fixture(params=BACKWARDS)
def two_view_backward(request, monkeypatch):
    """Two views' backward in the band design: over the upper triangle (the default where dz's float32 sum
    fits TRIANGLE_BYTES) or over full rows (beyond it)."""
    return _two_view_backward(monkeypatch, request.param)


def _two_view_backward(monkeypatch, kind):
    from contrastkit.losses.triton import stats as triton_stats

    monkeypatch.setattr(triton_stats, "TRIANGLE_BYTES", 2**62 if kind == "triangle" else 0)
    return kind


TWO_VIEW_CASES = [(torch.float32, False, False), (torch.float32, True, False), (torch.bfloat16, False, False),
                  (torch.float32, False, True)]  # dtype, with_mean, labelled


@pytest.mark.parametrize("buffers, backward, case, as_given, logits_from",
                         spread(BUFFERS, BACKWARDS, TWO_VIEW_CASES, [False, True]), ids=_spread_id)
def test_two_views_in_bands(monkeypatch, buffers, backward, case, as_given, logits_from):
    """Two views in 3 bands (16 + 16 + 8 rows) or blocks of 16 x 16, over the upper triangle (each band's
    blocks from its first row on; the rows past the band from the transposed product; the unvisited lower
    triangle's d scale terms) or over full rows. Exclusions not symmetric (each row itself and one random
    column: the transposed term reads row k's own), CACR's mean, bf16, labels. Each case on one forward route
    (spread)."""
    _small_buffers(monkeypatch, buffers), _two_view_backward(monkeypatch, backward)
    _logits_from(monkeypatch, logits_from)
    dtype, with_mean, labelled = case
    g = torch.Generator().manual_seed(17 + with_mean + 2 * labelled)
    z = _features(g, 40, 24, dtype).to(DEVICE)
    own = torch.arange(40)
    exclude = torch.stack([own, torch.randint(0, 40, (40,), generator=g)], dim=1).to(DEVICE)
    labels = (_ids(g, 40, 5),) * 2 if labelled else None
    grad_tol = 2e-6 if dtype == torch.float32 else 1e-2
    _compare(z, z, 10.0, 2e-6, grad_tol, scale_tol=1e-5, same=True, exclude=exclude, with_mean=with_mean,
             labels=labels, normalize=as_given)


@pytest.mark.quick
def test_triangle_recomputes_the_upper_triangle_only(monkeypatch):
    """Two views' backward over the upper triangle writes each band's logits from its first row on (40 rows
    in bands of 16: 16 x 40 + 16 x 24 + 8 x 8 = 1088 logits), against the full rows' 40 x 40 = 1600."""
    from contrastkit.losses.triton import stats as triton_stats
    from contrastkit.losses.triton import dlogits

    monkeypatch.setattr(dlogits, "BACKWARD_BYTES", 1)
    monkeypatch.setattr(dlogits, "BLOCK_MIN_ELEMENTS", 1)
    monkeypatch.setattr(dlogits, "BAND_ALIGN", 16)
    monkeypatch.setattr(dlogits, "BAND_MIN_ROWS", 0)
    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", "kernel")
    written = []
    write = triton_stats._write_product
    monkeypatch.setattr(triton_stats, "_write_product", lambda out, x, y: (written.append(out.numel()),
                                                                           write(out, x, y)))
    z = _features(torch.Generator().manual_seed(18), 40, 24).to(DEVICE).requires_grad_()
    exclude = torch.arange(40, device=DEVICE)[:, None]
    for bound, logits in ((2**62, 1088), (0, 1600)):
        monkeypatch.setattr(triton_stats, "TRIANGLE_BYTES", bound)
        written.clear()
        negative_stats_triton(z, z, 10.0, exclude=exclude).sum().backward()
        assert sum(written) == logits


@pytest.mark.parametrize("forward, fused_triangle", [("kernel", True), ("kernel", False), ("cublas", False)])
def test_forward_visits_the_upper_triangle_only(monkeypatch, forward, fused_triangle):
    """Two views' forward in bands of TRIANGLE_BAND_ROWS, each against the columns from its first row on: 40
    rows in bands of 16 take 16 x 40 + 16 x 24 + 8 x 8 = 1088 logits (cuBLAS's products, or the kernel's
    columns), against one band's 40 x 40 = 1600 where the band holds every row; image-text (columns) takes
    every column in each band. The fused kernel only where FUSED_TRIANGLE (off: full rows, 1600)."""
    from contrastkit.losses.triton import stats as triton_stats
    from contrastkit.losses.triton import launch, stats_fwd

    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", forward)
    monkeypatch.setattr(triton_stats, "FUSED_TRIANGLE", fused_triangle)
    in_triangle = 1088 if forward == "cublas" or fused_triangle else 1600
    visited = []
    run = launch.run
    monkeypatch.setattr(launch, "run", lambda kernel, grid, *args, **kwargs: (
        visited.append((kwargs["R1"] - kwargs["R0"]) * (kwargs["K"] - kwargs["C0"])), run(kernel, grid, *args, **kwargs)))
    z = _features(torch.Generator().manual_seed(19), 40, 24).to(DEVICE)
    exclude = torch.arange(40, device=DEVICE)[:, None]
    for rows, same, columns, logits in ((16, True, False, in_triangle), (2**20, True, False, 1600),
                                        (16, False, True, 1600)):
        monkeypatch.setattr(stats_fwd, "TRIANGLE_BAND_ROWS", rows)
        monkeypatch.setattr(stats_fwd, "PARTIAL_BYTES", 1 if columns else 2**27)  # image-text in bands of 16 too
        visited.clear()
        negative_stats_triton(z, z if same else z.clone(), 10.0, exclude=exclude, columns=columns, **TILES)
        assert sum(visited) == logits


# The production configuration under the interpreter: the default tiles (the first entry of each kernel's
# space: forward 128 x 64 (D in chunks of 64, float32 32), d logits 128 x 64 (float32 128 x 32)), D = 512, several
# tiles on
# every axis and partial last tiles (150 = 128 + 22 = 2 * 64 + 22), and the split over the other axis
# (150 > 64 columns: 3 splits) that small batches take; 60 columns: one split. Blocks of d logits of
# 128 x 128 and forward launches of 128 rows (the buffers' bounds made small): two of each on each axis.
PRODUCTION = [("rows", 150, 150, 2, True, torch.float32), ("rows", 150, 60, 0, False, torch.float32),
              ("two views", 150, 150, 2, True, torch.float32), ("two views", 150, 150, 2, False, torch.bfloat16),
              ("two views", 150, 150, 2, True, torch.float16), ("image-text", 150, 150, 1, False, torch.float32),
              ("image-text", 150, 150, 1, False, torch.bfloat16)]


# Each entry on each of the forward's logits (LOGITS), the features as given (normalize=True) on alternate ones:
# every entry, every route and every dtype meet both normalisations (21 cases; the full cross was 42, the small
# tiles' tests keep it).
PRODUCTION_CASES = each_route(PRODUCTION, (True, False))


@pytest.mark.parametrize("setting, m, k, excluded, with_mean, dtype, route, as_given", PRODUCTION_CASES,
                         ids=[f"{'as_given' if g else 'units'}-{r}-{s}-{m}x{k}-{str(t)[6:]}{'-mean' if w else ''}"
                              for s, m, k, _, w, t, r, g in PRODUCTION_CASES])
def test_production_configuration_equals_float64_reference(monkeypatch, setting, m, k, excluded, with_mean, dtype,
                                                           route, as_given):
    """Every kernel at the production tiles and D = 512 against the float64 reference: rows (query/queue)
    with and without exclusions, two views (one tensor: the symmetric backward), image-text (columns). The
    scale's gradient, a float32 sum over M K entries that cancel (CACR's mean), within 1e-5."""
    from contrastkit.losses.triton import stats as triton_stats
    from contrastkit.losses.triton import dlogits, launch, stats_fwd

    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", route)

    assert stats_fwd.space(512, 2)[0].kwargs == dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=64)
    assert dlogits.space(512, 2)[0].kwargs == dict(BLOCK_M=128, BLOCK_N=64)
    assert launch.split(3, 150, torch.device("cpu"))[0] == 3
    monkeypatch.setattr(dlogits, "BACKWARD_BYTES", 1)
    monkeypatch.setattr(dlogits, "BLOCK_MIN_ELEMENTS", 1)
    monkeypatch.setattr(stats_fwd, "PARTIAL_BYTES", 1)
    monkeypatch.setattr(stats_fwd, "TRIANGLE_BAND_ROWS", 128)
    monkeypatch.setattr(triton_stats, "FUSED_TRIANGLE", True)
    assert dlogits.block_shape(150, 150, 4) == (128, 128)
    g = torch.Generator().manual_seed(20 + m + k + excluded)
    a = _features(g, m, 512, dtype).to(DEVICE)
    b = a if setting == "two views" else _features(g, k, 512, dtype).to(DEVICE)
    exclude = None
    if setting == "two views":  # itself and its other view, as base.py's two-view setting
        own = torch.arange(m)
        exclude = torch.stack([own, (own + m // 2) % m], dim=1)
    elif setting == "image-text":
        exclude = torch.arange(m)[:, None]
    elif excluded:
        exclude = torch.stack([torch.randperm(k, generator=g)[:excluded] for _ in range(m)])
    options = dict(exclude=None if exclude is None else exclude.to(DEVICE), with_mean=with_mean,
                   columns=setting == "image-text")
    # float32: some 50 units of rounding of the largest gradient (2.9e-6 seen on an H100, whose sums run in
    # another order than the interpreter's; a TF32 product would be ~1e-3 off).
    if dtype == torch.float16 and as_given:  # on float16 units (FLOAT16_UNITS)
        _compare_units(a, b, 14.0, same=setting == "two views", **options)
        return
    grad_tol = {torch.float32: 6e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    _compare_at(a, b, 14.0, 2e-6, grad_tol, scale_tol=1e-5, same=setting == "two views", tiles={}, **options, normalize=as_given)


@pytest.mark.quick
@pytest.mark.parametrize("forward", ["dense", "cublas"])
def test_dense_keeps_the_logits_and_backward_reads_them(monkeypatch, forward):
    """The dense path: cuBLAS writes the whole matrix once in forward and backward reads it back (no product
    written in backward); the band path recomputes each block in backward. Two views and image-text."""
    from contrastkit.losses.triton import stats as triton_stats

    calls = []
    write = triton_stats._write_product
    monkeypatch.setattr(triton_stats, "_write_product", lambda out, x, y: (calls.append(out.shape), write(out, x, y)))
    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", forward)
    g = torch.Generator().manual_seed(21)
    z = _features(g, 37, 24).to(DEVICE).requires_grad_()
    for columns, b in ((False, z), (True, _features(g, 37, 24).to(DEVICE).requires_grad_())):
        calls.clear()
        stats = negative_stats_triton(z, b, 10.0, exclude=torch.arange(37, device=DEVICE)[:, None], columns=columns)
        assert calls == [(37, 37)]  # forward: one product (the whole matrix, or its one band)
        stats.sum().backward()
        assert calls[1:] == ([] if forward == "dense" else [(37, 37)])


@pytest.fixture
def tf32(float32_precision, monkeypatch):
    """TF32 allowed for float32 matmuls (the legacy flag, as open_clip_train sets it), and the shapes of the
    float16 unit vectors the products then take (functional.half_units), as the calls make them."""
    from contrastkit.losses.triton import stats as triton_stats

    torch.backends.cuda.matmul.allow_tf32 = True
    made, half = [], triton_stats.half_units
    monkeypatch.setattr(triton_stats, "half_units", lambda x, inv: made.append(tuple(x.shape)) or half(x, inv))
    return made


def _compare_units(a, b, scale, *, same=False, weight=1.0, **options):
    """Features that the path runs on float16 unit vectors (float32 with TF32 allowed, and float16), of norms
    0.2 to 5, normalised in the kernels: the statistics exact (2e-6) for their unit vectors rounded to float16
    as the path rounds them, which lie within TF32's rounding of the true ones (2^-11 relative; 2^-25
    absolutely below float16's normal range); the features' gradients within 2^-10 of the float64 ones through
    those units (the backward's float16 d logits round as TF32 rounds float32 ones; 3e-4 measured), the
    scale's within 1e-4; every gradient in the features' dtype. ``weight``: the upstream gradient's size."""
    from contrastkit.losses.functional import half_units, inverse_norms

    g = torch.Generator().manual_seed(98)
    dtype = a.dtype
    a, b = (x.cpu().double() * torch.empty(x.shape[0], 1, dtype=torch.float64).uniform_(0.2, 5.0, generator=g)
            for x in (a, b))
    a, b = a.to(DEVICE, dtype), a.to(DEVICE, dtype) if same else b.to(DEVICE, dtype)
    leaves64 = [a.double().cpu().requires_grad_(), b.double().cpu().requires_grad_(),
                torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)]
    units = []
    for x, x64 in zip((a, b), leaves64):
        rounded = half_units(x, inverse_norms(x)).double().cpu()
        exact = torch.nn.functional.normalize(x64, dim=1)
        assert ((rounded - exact).abs() <= 2**-11 * (1 + 1e-3) * exact.abs() + 2**-25).all()
        units.append(exact + (rounded - exact).detach())  # the rounded values; the gradient F.normalize's
    if same:
        leaves64, units = [leaves64[0], leaves64[2]], [units[0], units[0]]
    want = reference(units[0], units[1], leaves64[-1], **options)
    w = weight * torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want_grads = torch.autograd.grad((want * w).sum(), leaves64)
    leaves = [a.clone().requires_grad_(), torch.tensor(float(scale), device=a.device, requires_grad=True)]
    if not same:
        leaves.insert(1, b.clone().requires_grad_())
    got = negative_stats_triton(leaves[0], leaves[0] if same else leaves[1], leaves[-1], normalize=True, **options)
    _close(got, want, 2e-6, "values")
    grads = torch.autograd.grad((got * w.to(got)).sum(), leaves)
    for name, grad, wg in zip(["anchors", "candidates", "scale"][-len(leaves):] if not same else ["anchors", "scale"],
                              grads, want_grads):
        assert grad.dtype == (torch.float32 if name == "scale" else dtype) and torch.isfinite(grad).all()
        _close(grad, wg, 1e-4 if name == "scale" else 2**-10, f"d {name}")


# Two views' backward designs (triangle, full rows) apply to two views alone: image-text takes each once.
FLOAT16_IN_BANDS = [("two_views", backward) for backward in BACKWARDS] + [("image_text", None)]


@pytest.mark.parametrize("setting, backward", FLOAT16_IN_BANDS, ids=[s + (f"-{b}" if b else "") for s, b in FLOAT16_IN_BANDS])
def test_float16_on_units_in_bands(small_buffers, setting, backward, logits_from, monkeypatch):
    """float16 features normalised in the kernels take their float16 unit vectors on the band design and the
    dense path (FLOAT16_UNITS), made once in forward and once in backward: two views with CACR's mean and
    asymmetric exclusions, image-text at a logit scale of 100, in bands or blocks, exact for the rounded
    units (_compare_units)."""
    from contrastkit.losses.triton import stats as triton_stats

    if backward:
        _two_view_backward(monkeypatch, backward)
    made, half = [], triton_stats.half_units
    monkeypatch.setattr(triton_stats, "half_units", lambda x, inv: made.append(tuple(x.shape)) or half(x, inv))
    g = torch.Generator().manual_seed(45)
    a = _features(g, 40, 24, torch.float16).to(DEVICE)
    if setting == "two_views":
        exclude = torch.stack([torch.arange(40), torch.randint(0, 40, (40,), generator=g)], dim=1).to(DEVICE)
        b, scale, options = a, 10.0, dict(same=True, exclude=exclude, with_mean=True)
    else:
        b, scale = _features(g, 40, 24, torch.float16).to(DEVICE), 100.0
        options = dict(exclude=torch.arange(40, device=DEVICE)[:, None], columns=True)
    _compare_units(a, b, scale, **options)
    assert made == [(40, 24)] * (2 if setting == "two_views" else 4)


@pytest.mark.parametrize("norm, scale, weight", [(1000.0, 10.0, 2.0**16), (0.003, 100.0, 1.0)], ids=["large", "tiny"])
def test_float16_features_of_any_norm(monkeypatch, norm, scale, weight):
    """float16 features normalised in the kernels run on their float16 unit vectors (FLOAT16_UNITS), so that
    their d logits carry no inverse norms: rows of norm 1000 at logit scale 10 (p ~ 1/128 times inv_a inv_b
    ~ 1e-6 fell into float16's subnormals: the gradient 24 % off, 3 % at norm 300, 84 % at 3000) and of norm
    0.003 with near-duplicates at scale 100 (p ~ 1 times ~ 1e5 overflowed to inf) both within 2e-3 of the
    float64 gradient of the same features (5e-4 and 1.1e-3 measured). The upstream gradient is a
    GradScaler's: 2^16 where the features' own gradients are small, 1 where they are large."""
    from contrastkit.losses.triton import stats as triton_stats

    g = torch.Generator().manual_seed(23)
    base = torch.nn.functional.normalize(torch.randn(64, 32, generator=g, dtype=torch.float64), dim=1)
    views = torch.cat([base, base + 0.05 * torch.randn(64, 32, generator=g, dtype=torch.float64)])
    z = (torch.nn.functional.normalize(views, dim=1) * norm).half().to(DEVICE)
    own = torch.arange(128)
    exclude = torch.stack([own, (own + 64) % 128], dim=1).to(DEVICE)
    z64 = z.double().cpu().requires_grad_()
    u = torch.nn.functional.normalize(z64, dim=1)
    want = reference(u, u, scale, exclude.cpu())
    (want_grad,) = torch.autograd.grad(want.sum() * weight / 128, z64)
    for forward in ("kernel", "cublas"):
        monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", forward)
        leaf = z.clone().requires_grad_()
        got = negative_stats_triton(leaf, leaf, scale, exclude=exclude, normalize=True)
        (grad,) = torch.autograd.grad(got.sum() * weight / 128, leaf)
        assert torch.isfinite(grad).all(), forward
        error = float((grad.double().cpu() - want_grad).norm() / want_grad.norm())
        assert error < 2e-3, (forward, error)


@pytest.mark.parametrize("buffers, backward, with_mean, logits_from", spread(BUFFERS, BACKWARDS, [False, True]))
def test_tf32_two_views_on_float16_units(tf32, monkeypatch, buffers, backward, with_mean, logits_from):
    """float32 with TF32 allowed on the band design (HALF_UNITS_FOR_TF32): the call runs on float16 copies of
    the unit vectors (forward and backward each make them; the fused forward kernel, cuBLAS's or the dense
    logits) at the 16-bit GEMM rate, and is as exact as TF32's rounding lets it be. Each case on one forward
    route (spread)."""
    _small_buffers(monkeypatch, buffers), _two_view_backward(monkeypatch, backward)
    _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(40 + with_mean)
    z = _features(g, 40, 24).to(DEVICE)
    exclude = torch.stack([torch.arange(40), torch.randint(0, 40, (40,), generator=g)], dim=1).to(DEVICE)
    _compare_units(z, z, 10.0, same=True, exclude=exclude, with_mean=with_mean)
    assert tf32 == [(40, 24)] * 2  # one copy in forward, one in backward


TF32_SETTINGS = [("image_text",), ("rows",)]


@pytest.mark.parametrize("setting, logits_from, buffers", each_route(TF32_SETTINGS, BUFFERS),
                         ids=[f"{s}-{r}-{b}" for s, r, b in each_route(TF32_SETTINGS, BUFFERS)])
def test_tf32_image_text_and_rows_on_float16_units(tf32, monkeypatch, setting, logits_from, buffers):
    """As test_tf32_two_views_on_float16_units for image-text (the columns' statistics, a logit scale of 100)
    and for rows only (query/queue: CACR's mean, labels, two excluded columns). Each setting on every forward
    route, in bands and in blocks on alternate ones (each_route)."""
    _small_buffers(monkeypatch, buffers), _logits_from(monkeypatch, logits_from)
    g = torch.Generator().manual_seed(42)
    a = _features(g, 37, 24).to(DEVICE)
    if setting == "image_text":
        b, scale = _features(g, 37, 24).to(DEVICE), 100.0
        options = dict(exclude=torch.arange(37, device=DEVICE)[:, None], columns=True)
    else:
        b, scale = _features(g, 53, 24).to(DEVICE), 10.0
        options = dict(exclude=torch.stack([torch.randperm(53, generator=g)[:2] for _ in range(37)]).to(DEVICE),
                       with_mean=True, labels=(_ids(g, 37), _ids(g, 53)))
    _compare_units(a, b, scale, **options)
    assert tf32 == [(37, 24), (b.shape[0], 24)] * 2


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
@pytest.mark.parametrize("weight", [1e-30, 1e30])
def test_tf32_d_logits_within_float16_range(tf32, scale, weight):
    """The float16 d logits of unit vectors are dL over a factor from the upstream gradient's largest entry and
    the bound on |dL / that| (triton_stats._units_factor: with CACR's mean 2 (3 + 1 / scale)), so that no
    logit scale or upstream size overflows them or flushes them to zero: CACR's two views, whose mean term
    grows as 1 / scale, at a scale of 0.01 and upstream gradients of 1e-30 and 1e30."""
    z = _features(torch.Generator().manual_seed(43), 40, 24).to(DEVICE)
    _compare_units(z, z, scale, same=True, weight=weight, exclude=torch.arange(40, device=DEVICE)[:, None],
                  with_mean=True)
    assert tf32


@pytest.mark.parametrize("case", ["TF32 off", "normalize=False", "bfloat16"])
def test_tf32_units_only_where_the_kernels_normalise_float32_under_tf32(tf32, case):
    """The float16 units replace TF32 products only for float32 features normalised in the kernels with TF32
    allowed: features given as they are (normalize=False: their range is the caller's) keep TF32 products."""
    if case == "TF32 off":
        torch.backends.cuda.matmul.allow_tf32 = False
    x = _features(torch.Generator().manual_seed(44), 40, 24, torch.bfloat16 if case == "bfloat16" else torch.float32)
    x = x.to(DEVICE).requires_grad_()
    negative_stats_triton(x, x, 10.0, normalize=case != "normalize=False").sum().backward()
    assert tf32 == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_before_sm80_products_on_cublas(tf32, monkeypatch, dtype):
    """On a GPU before sm_80 (plan.ampere_or_later False: a T4, a V100), where triton lowers the fused
    kernel's products to FMA, auto's forward takes cuBLAS's band products; float32 under TF32 stays float32 (no
    TF32 there, so no float16 units); float16 keeps its units (their range, not TF32); bfloat16 features are
    taken in float32 (cuBLAS writes no float32 product of bfloat16 operands there). The call is then exactly
    the one sm_80 makes with those settings: forward "cublas" (fp16), TF32 off (float32, and bfloat16's
    float32 copy, its gradient rounded back to bfloat16). On sm_80 and later (the default here) the same call
    takes the fused kernel, and float32 the units."""
    from contrastkit.losses import plan
    from contrastkit.losses.triton import stats as triton_stats

    monkeypatch.setattr(triton_stats, "DENSE_BYTES", 0)  # beyond the dense bound
    fused = []
    forward_stats = triton_stats.forward_stats
    monkeypatch.setattr(triton_stats, "forward_stats", lambda a, b, inputs, product, *rest: (
        fused.append((product is None, a.dtype)), forward_stats(a, b, inputs, product, *rest))[1])
    z = _features(torch.Generator().manual_seed(45), 40, 24, dtype).to(DEVICE)
    exclude = torch.arange(40, device=DEVICE)[:, None]

    def call(features):
        fused.clear(), tf32.clear()
        x = features.clone().requires_grad_()
        stats = negative_stats_triton(x, x, 10.0, exclude=exclude, with_mean=True, normalize=True)
        (stats * torch.linspace(0.5, 2.0, 40, device=DEVICE)).sum().backward()
        return (stats.detach(), x.grad), fused[:], len(tf32) > 0

    units = dtype != torch.bfloat16
    assert call(z)[1:] == ([(True, torch.float16 if units else dtype)], units)
    monkeypatch.setattr(plan, "ampere_or_later", lambda device: False)
    units = dtype == torch.float16
    got, path, made = call(z)
    assert path == [(False, torch.float16 if units else torch.float32)] and made == units
    assert plan.triton_route(40, 40, dtype, True, z.device, True)[2] == units  # TF32 allowed (the tf32 fixture)
    monkeypatch.setattr(plan, "ampere_or_later", lambda device: True)
    if dtype == torch.float16:
        monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", "cublas")
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
    want, path, made = call(z.float() if dtype == torch.bfloat16 else z)
    assert path == [(False, torch.float16 if units else torch.float32)] and made == units
    assert got[1].dtype == dtype
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=0, atol=0)


def test_ampere_or_later_is_a_constant_of_a_compiled_graph(monkeypatch):
    """plan.ampere_or_later reads the device's compute capability once while torch.compile traces
    (fullgraph: no graph break), as a constant of the graph; other devices count as sm_80 and later."""
    from types import SimpleNamespace

    from contrastkit.losses import plan

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or SimpleNamespace(major=7))
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2 if plan.ampere_or_later(torch.device("cuda", 1)) else x - 1,
                       fullgraph=True, backend="eager")
    assert torch.equal(fn(torch.ones(3)), torch.zeros(3)) and torch.equal(fn(torch.ones(3)), torch.zeros(3))
    assert asked == [1]
    assert plan.ampere_or_later(torch.device("cpu")) and plan.ampere_or_later(torch.device("meta"))


@pytest.mark.parametrize("ampere, fp16_accumulation", [(True, False), (False, False), (True, True)])
def test_products_of_bfloat16_before_sm80_in_float32(monkeypatch, ampere, fp16_accumulation):
    """The exact path's and the band design's products (chunked._operand) take CUDA features as they are where
    torch writes their product in float32: bfloat16 from sm_80 on (before it torch refuses bfloat16 operands
    with out_dtype: "only supported for CUDA devices with compute capability 8.0 or higher"), float16 unless
    cuBLAS may accumulate it in float16 (allow_fp16_accumulation, where torch refuses it too); else a float32
    copy. Fake CUDA tensors: no GPU needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from contrastkit.losses import chunked, plan, precision

    monkeypatch.setattr(plan, "ampere_or_later", lambda device: ampere)
    monkeypatch.setattr(precision, "fp16_accumulation", lambda: fp16_accumulation)
    with FakeTensorMode():
        for dtype, kept in ((torch.bfloat16, ampere), (torch.float16, not fp16_accumulation), (torch.float32, True)):
            x = torch.empty(8, 4, device="cuda", dtype=dtype)
            assert (chunked._operand(x) is x) == kept, dtype
            assert chunked._operand(x).dtype == (dtype if kept else torch.float32)
