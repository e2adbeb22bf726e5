"""The blockwise path (chunk_size > 0, and the automatic choice) equals the dense path (chunk_size=0):
values and gradients, every objective and setting, float64 and float32, autocast, 2 processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from launch import end_process_group, fork_ranks
from settings import SCORE_LOSSES, fresh, fresh_call, inputs, shard

from contrastkit.losses import build_loss
from contrastkit.losses.plan import BLOCK_ELEMENTS, KEEP_MAX_ELEMENTS, blocking
from contrastkit.losses.chunked import negative_stats

pytestmark = pytest.mark.quick

SETTINGS = ["two_views", "three_views", "query_key", "queue", "several_keys", "image_text", "image_text_scale"]


def _inputs(seed, setting, n, d, dtype, device="cpu"):
    """The setting's inputs (tests/losses/settings.py): a queue of 2n + 1 rows, a constant as in MoCo; two keys
    per query; CLIP's learnable exp(t) of 14, in the features' dtype."""
    return inputs(setting, n, d, dtype=dtype, device=device, seed=seed, queue=2 * n + 1, queue_grad=False)


def _blockwise_call(name, setting, chunk, x, output_dict=False, **opts):
    """Loss and the tensors to differentiate for one objective in one setting, on fresh leaves of x: the
    blockwise torch kernel (chunk None: its automatic blocks, which "auto" takes beyond the dense bound), unless
    ``backend`` says otherwise; chunk 0 the dense path."""
    fn = build_loss(name, chunk_size=chunk, **{"backend": "torch", **opts})
    return fresh_call(fn, setting, x, output_dict=output_dict)


def _value_and_grads(name, setting, chunk, x):
    loss, leaves = _blockwise_call(name, setting, chunk, x)
    return loss.detach(), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("name", SCORE_LOSSES)
@pytest.mark.parametrize("setting", SETTINGS)
def test_blockwise_equals_dense_float64(name, setting, device):
    x = _inputs(hash((name, setting)) % 2**31, setting, 11, 6, torch.float64, device)
    want, want_grads = _value_and_grads(name, setting, 0, x)
    for chunk in (1, 4, None):  # single rows, ragged blocks (11 = 4 + 4 + 3 anchors), automatic
        got, grads = _value_and_grads(name, setting, chunk, x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"chunk {chunk}: {m}")
        for i, (g, w) in enumerate(zip(grads, want_grads)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"chunk {chunk} grad {i}: {m}")


@pytest.mark.parametrize("name", SCORE_LOSSES)
@pytest.mark.parametrize("setting", ["two_views", "three_views", "query_key", "image_text_scale"])
def test_blockwise_equals_dense_float32(name, setting, device):
    """Relative error under 1e-5 in float32, at the low temperature where exp() is most sensitive (on CUDA
    the automatic choice, chunk_size None, is the blockwise kernel on the exact path)."""
    opts = {} if name == "cacr" else {"temperature": 0.05}
    x = _inputs(7, setting, 96, 32, torch.float32, device)
    want, leaves = _blockwise_call(name, setting, 0, x, **opts)
    want_grads = torch.autograd.grad(want, leaves)
    for chunk in (13, None):
        got, leaves = _blockwise_call(name, setting, chunk, x, **opts)
        grads = torch.autograd.grad(got, leaves)
        assert abs(float(got.detach() - want.detach())) <= 1e-5 * abs(float(want.detach())), f"chunk {chunk}"
        for g, w in zip(grads, want_grads):
            assert float((g - w).norm() / w.norm()) < 1e-5, f"chunk {chunk}"


@pytest.mark.parametrize("name", SCORE_LOSSES)
@pytest.mark.parametrize("setting", SETTINGS)
def test_triton_backend_equals_dense(name, setting, device):
    """backend="triton" (on CPU under Triton's interpreter, see conftest) in every setting: float32 to 1e-5 in
    value, the gradients to 5e-5 of their norm (two float32 computations; CACR's, a difference of attraction and
    repulsion, once came to 1.04e-5 on fresh inputs: the seed hashes the names, which Python salts per process),
    ragged against its tiles (21 anchors, 6 dimensions)."""
    opts = {} if name == "cacr" else {"temperature": 0.05}
    x = _inputs(hash((name, setting, 1)) % 2**31, setting, 21, 6, torch.float32, device)
    want, leaves = _blockwise_call(name, setting, 0, x, **opts)
    want_grads = torch.autograd.grad(want, leaves)
    got, leaves = _blockwise_call(name, setting, None, x, backend="triton", **opts)
    grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads):
        assert float((g - w).norm() / w.norm()) < 5e-5


@pytest.mark.parametrize("name", ["infonce", "cacr"])
def test_triton_backend_takes_bf16_products_under_autocast(name, device):
    """Under bf16 autocast the Triton products take the unit vectors in bf16 (float32 accumulation): the
    loss within bf16's precision of the dense float32 one."""
    x = _inputs(31, "two_views", 40, 16, torch.float32, device)
    want = _blockwise_call(name, "two_views", 0, x)[0]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        got, leaves = _blockwise_call(name, "two_views", None, [t.bfloat16() for t in x], backend="triton")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert all(g.dtype == torch.bfloat16 for g in torch.autograd.grad(got, leaves))


@pytest.mark.parametrize("name", SCORE_LOSSES)
def test_diagnostics_are_the_same(name, device):
    x = _inputs(3, "two_views", 10, 5, torch.float64, device)
    dense = _blockwise_call(name, "two_views", 0, x, output_dict=True)[0]
    blocks = _blockwise_call(name, "two_views", 3, x, output_dict=True)[0]
    assert dense.keys() == blocks.keys()
    for key in dense:
        torch.testing.assert_close(blocks[key], dense[key], rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("name", SCORE_LOSSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_blockwise_equals_dense(name, dtype):
    """Under autocast the features arrive in low precision; both paths compute in float32 from them.

    The losses agree to float32 rounding. The weight gradient passes back through the low-precision
    layer, where a float32 difference of 1e-7 can flip one rounding of the feature gradient, so it is
    compared at that precision: 1 % of the largest entry (one bf16 ulp is 4e-3 relative, and the layer's
    bf16 weight-gradient product rounds at the scale of its largest terms)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x1, x2 = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    results = []
    for chunk in (0, 5):
        layer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            z1, z2 = layer(x1), layer(x2)
            assert z1.dtype == dtype
            loss = build_loss(name, chunk_size=chunk)(z1, z2)
        assert loss.dtype == torch.float32
        loss.backward()
        results.append((loss.detach(), layer.weight.grad.clone()))
    (want, want_grad), (got, grad) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-2, atol=1e-2 * float(want_grad.abs().max()))


@pytest.mark.parametrize("with_mean", [False, True])
@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("keep", [0, 10, 100])  # recompute all, keep the first block (2 x 5 entries), keep all
@pytest.mark.parametrize("same", [False, True])  # one tensor as anchors and candidates (two views): one gradient
def test_negative_stats_gradcheck(with_mean, columns, keep, same):
    """Finite differences of every statistic, in the anchors, candidates and a learnable scale."""
    g = torch.Generator().manual_seed(1)
    a, b = (torch.nn.functional.normalize(torch.randn(5, 3, generator=g, dtype=torch.float64), dim=1)
            .requires_grad_() for _ in range(2))
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    exclude = torch.tensor([[0], [1], [2], [3], [4]])
    if same:
        torch.autograd.gradcheck(lambda a, s: negative_stats(a, a, s, exclude=exclude, block=2, with_mean=with_mean,
                                                             columns=columns, keep=keep, fast=True), (a, scale))
    else:
        torch.autograd.gradcheck(lambda a, b, s: negative_stats(a, b, s, exclude=exclude, block=2,
                                                                with_mean=with_mean, columns=columns, keep=keep,
                                                                fast=True), (a, b, scale))


def test_blockwise_saves_nothing_quadratic():
    """With recomputation, backward keeps only per-row statistics and the features: no [M, K] tensor."""
    n, d = 64, 8
    z1, z2 = (torch.randn(n, d, requires_grad=True) for _ in range(2))
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    for name in SCORE_LOSSES:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = build_loss(name, chunk_size=16)(z1, z2)
        loss.backward()
    assert sizes and max(sizes) <= 2 * n * d < (2 * n) ** 2


def test_automatic_choice():
    fn = build_loss("infonce")
    assert blocking("cpu", 1024, None) == (BLOCK_ELEMENTS // 1024, KEEP_MAX_ELEMENTS)  # blocks kept up to a budget
    assert blocking("cpu", 8, 7) == (7, 0)  # none kept
    big = torch.empty(1024, 8, device="meta")  # two views: 2048 x 2048 logits, beyond the dense bound off CUDA
    for dtype in (torch.float32, torch.bfloat16):  # low precision concerns the Triton path's products only
        plan = fn.plan(big.to(dtype), big.to(dtype))
        assert (plan.path, plan.route, plan.compute, plan.operands) == ("torch", "exact", torch.float32, None)
        assert (plan.block, plan.keep) == blocking("meta", 2048, None)
    cpu = torch.zeros(2, 2)
    assert (fn.plan(cpu, cpu).path, fn.plan(cpu, cpu).route) == ("dense", "fused")
    assert build_loss("infonce", chunk_size=0).plan(big, big).path == "dense"
    assert build_loss("infonce", backend="dense").plan(big, big).path == "dense"
    with pytest.raises(TypeError, match="float64"):
        build_loss("infonce", backend="triton").plan(cpu.double(), cpu.double())


@pytest.mark.parametrize("bad", ["cuda", "Triton", None])
def test_bad_backend(bad):
    with pytest.raises(ValueError, match="backend must be one of auto, triton, torch, dense"):
        build_loss("dcl", backend=bad)


def test_columns_exclude_only_the_diagonal():
    """Its shape is checked on every call, its values where the call may read the host (fast=True)."""
    a = torch.randn(4, 3)
    with pytest.raises(ValueError, match="excluding the diagonal only"):
        negative_stats(a, a, 1.0, exclude=torch.arange(4)[:, None].repeat(1, 2), block=2, columns=True)
    with pytest.raises(ValueError, match="excluding the diagonal only"):
        negative_stats(a, a, 1.0, exclude=torch.arange(4).flip(0)[:, None], block=2, columns=True, fast=True)


@pytest.mark.parametrize("bad", [-1, 2.5, "8"])
def test_bad_chunk_size(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        build_loss("dcl", chunk_size=bad)


# ----------------------------------------------------------------------------- two processes


TWO_PROCESS_SETTINGS = ["two_views", "three_views", "query_key", "image_text_scale"]


def _run(rank, world, sizes, init_file, out_dir):
    import contrastkit.losses.chunked as chunked

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    weight = sizes[rank] / sum(sizes)
    results, ratios = {}, []
    original = chunked._upstream_ratio
    chunked._upstream_ratio = lambda *args: ratios.append(original(*args)) or ratios[-1]
    for name in SCORE_LOSSES:
        for setting in TWO_PROCESS_SETTINGS:
            local = shard(setting, _inputs(5, setting, sum(sizes), 6, torch.float64), lo, hi)
            loss, leaves = _blockwise_call(name, setting, 2, local, gather_distributed="uneven")
            ratios.clear()
            (weight * loss).backward()
            results[name, setting] = (float(loss) * weight, [t.grad for t in leaves], list(ratios))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


def test_two_processes_blockwise_equal_one_process_dense(tmp_path):
    """Blocks of 2 anchors, negatives gathered from 2 processes holding 3 and 4 samples, against one
    dense process on the 7: the gathered features' gradient is summed across processes. The gradient
    guessed in forward is taken on both (each image-text direction's mean is over both directions)."""
    sizes = [3, 4]
    fork_ranks(_run, (2, sizes, str(tmp_path / "init"), str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for (name, setting), _ in ranks[0].items():
        want, leaves = _blockwise_call(name, setting, 0, _inputs(5, setting, sum(sizes), 6, torch.float64))
        want_grads = torch.autograd.grad(want, leaves)
        assert sum(r[name, setting][0] for r in ranks) == pytest.approx(float(want), rel=1e-10), (name, setting)
        for r, rank_weight in zip(ranks, (3 / 7, 4 / 7)):
            guessed = r[name, setting][2]
            assert guessed == [pytest.approx(rank_weight)] * (2 if setting == "image_text_scale" else 1), guessed
        for i, w in enumerate(want_grads):
            parts = [r[name, setting][1][i] for r in ranks]
            got = sum(parts) if w.dim() == 0 else torch.cat(parts)  # the shared scale: DDP sums its gradient
            torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name} {setting} {i}: {m}")


# ----------------------------------------------------------------------------- the fast path and its fallback


def _dense_stats(a, b, scale, columns, with_mean=False):
    """Row (and column) logsumexp of scale a b^T without the diagonal, and with_mean the softmax-weighted
    mean cosine of each row, in float64: the reference."""
    cosines = a.double() @ b.double().T
    logits = (scale * cosines).fill_diagonal_(float("-inf"))
    rows = torch.logsumexp(logits, dim=1)
    if with_mean:
        return torch.stack([rows, (torch.softmax(logits, dim=1) * cosines).sum(dim=1)])
    return torch.stack([rows, torch.logsumexp(logits, dim=0)]) if columns else rows[None]


ALL = 10**9  # entries kept for backward: every block


def _check_against_dense(a, b, scale, columns, keep, block=7, with_mean=False):
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    want = _dense_stats(a64, b64, scale, columns, with_mean)
    weights = torch.rand_like(want)  # a generic upstream gradient
    want_grads = torch.autograd.grad((want * weights).sum(), (a64, b64))
    a32, b32 = a.float().requires_grad_(), b.float().requires_grad_()
    exclude = torch.arange(a.shape[0])[:, None]
    got = negative_stats(a32, b32, scale, exclude=exclude, block=block, columns=columns, keep=keep,
                         with_mean=with_mean, fast=True)
    grads = torch.autograd.grad((got * weights.float()).sum(), (a32, b32))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    for g, w in zip(grads, want_grads):
        assert float((g.double() - w).norm() / w.norm()) < 1e-5


@pytest.fixture
def safe_calls(monkeypatch):
    """Counts the calls that took the safe path."""
    import contrastkit.losses.chunked as chunked

    calls = []
    original = chunked._safe_forward
    monkeypatch.setattr(chunked, "_safe_forward", lambda *args: calls.append(1) or original(*args))
    return calls


@pytest.mark.parametrize("stats", ["rows", "columns", "rows+mean"])
@pytest.mark.parametrize("keep", [ALL, 0, 30 * 200])  # all blocks, none, the first 4 blocks of 7 rows
def test_fast_path_on_ordinary_inputs(stats, keep, safe_calls):
    """Unit features at CLIP's initial scale take the fast path, and it is exact in float32: row lse,
    row and column lse (image-text), row lse and CACR's mean (its repulsion at t_neg = 2)."""
    g = torch.Generator().manual_seed(11)
    a, b = (torch.nn.functional.normalize(torch.randn(200, 24, generator=g), dim=1) for _ in range(2))
    scale = 2.0 if stats == "rows+mean" else 1 / 0.07
    _check_against_dense(a, b, scale, stats == "columns", keep, with_mean=stats == "rows+mean")
    assert not safe_calls


@pytest.mark.parametrize("columns", [False, True])
def test_sample_missing_the_maximum_falls_back_exactly(columns, safe_calls):
    """A row whose maximum lies outside the sampled candidates, 180 logits above them: exp() would overflow
    in float32, so the call is redone by the safe path, and is still exact."""
    g = torch.Generator().manual_seed(12)
    n, d = 256, 32  # 64 candidates sampled: every 4th
    a, b = (torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1) for _ in range(2))
    b[5] = a[0]  # candidate 5 (not sampled) is anchor 0 itself: logit 200, the sampled ones about 200 * 0.3
    _check_against_dense(a, b, 200.0, columns, keep=ALL)
    assert safe_calls == [1]


@pytest.mark.parametrize("keep", [ALL, 0])
@pytest.mark.parametrize("cold_caption", [False, True])
def test_exact_at_scale_100_with_duplicates(keep, cold_caption, safe_calls):
    """CLIP at its largest scale, a batch with near-duplicate pairs (cosine ~1: logits of 100 beside ones
    of ~30; the sampled shift misses them by ~57 logits) takes the fast path and is exact. Add a caption
    unlike every image (its column's logits all far below the others) and the image-text call cannot
    bound its error, so it takes the safe path, and is exact too."""
    g = torch.Generator().manual_seed(13)
    n, d = 300, 32
    a, b = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    b = 0.6 * a + 0.8 * b  # matched pairs: cosine ~0.6
    a[10], b[11] = a[11], a[10]  # near-duplicates across pairs
    a[40], b[41] = a[41], a[40]
    if cold_caption:  # images share a direction c (cosine ~0.5 with it); this caption is -c
        c = torch.randn(d, generator=g)
        a, b = a + c, b + c
        b[99] = -c
    a, b = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(b, dim=1)
    _check_against_dense(a, b, 100.0, columns=False, keep=keep)
    assert not safe_calls
    _check_against_dense(a, b, 100.0, columns=True, keep=keep)
    assert safe_calls == ([1] if cold_caption else [])


# ----------------------------------------------------------------------------- backward's products done in forward


@pytest.fixture
def guesses(monkeypatch):
    """The upstream ratio backward found for each guessed gradient (None: the guess was refused)."""
    import contrastkit.losses.chunked as chunked

    ratios = []
    original = chunked._upstream_ratio
    monkeypatch.setattr(chunked, "_upstream_ratio", lambda *args: ratios.append(original(*args)) or ratios[-1])
    return ratios


@pytest.mark.parametrize("name", SCORE_LOSSES)
@pytest.mark.parametrize("setting", ["two_views", "three_views", "queue", "several_keys", "image_text_scale"])
@pytest.mark.parametrize("factor", [1.0, 0.25])  # the loss as is, and scaled (gradient accumulation)
def test_guessed_gradient_is_taken_and_exact(name, setting, factor, guesses):
    """Every objective has a closed-form d loss / d (lse, mean), so backward's products are done in forward;
    backward takes them (times the upstream factor) and the gradients equal the dense float64 ones. On one
    process image-text takes them for CACR (each direction as rows) and not for the others (columns)."""
    x = _inputs(21, setting, 13, 6, torch.float64)
    want, leaves = _blockwise_call(name, setting, 0, x)
    want_grads = torch.autograd.grad(factor * want, leaves)
    got, leaves = _blockwise_call(name, setting, 4, x)
    grads = torch.autograd.grad(factor * got, leaves)
    one_product = setting == "image_text_scale" and name != "cacr"
    assert guesses == ([] if one_product else [pytest.approx(factor)] * (2 if setting == "image_text_scale" else 1))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_guessed_gradient_float32_is_taken(guesses):
    """In float32 the guess and autograd's gradient differ by rounding only: taken, and exact to 1e-5."""
    x = _inputs(22, "two_views", 200, 32, torch.float32)
    want, leaves = _blockwise_call("infonce", "two_views", 0, x, temperature=0.05)
    want_grads = torch.autograd.grad(want, leaves)
    got, leaves = _blockwise_call("infonce", "two_views", None, x, temperature=0.05)
    grads = torch.autograd.grad(got, leaves)
    assert guesses == [pytest.approx(1.0)]
    for g, w in zip(grads, want_grads):
        assert float((g - w).norm() / w.norm()) < 1e-5


@pytest.mark.parametrize("keep", [0, 10**9])
@pytest.mark.parametrize("same", [False, True])  # one tensor as anchors and candidates (two views)
def test_wrong_guess_is_refused_and_exact(keep, same, guesses):
    """An upstream gradient that is not the guess times a constant (here: random weights on each row's lse):
    backward refuses the guess, recomputes the blocks, and is exact."""
    g = torch.Generator().manual_seed(23)
    a, b = (torch.nn.functional.normalize(torch.randn(40, 8, generator=g, dtype=torch.float64), dim=1)
            .requires_grad_() for _ in range(2))
    if same:
        b = a
    exclude = torch.arange(40)[:, None]
    weights = torch.rand(40, generator=g, dtype=torch.float64)
    stats = negative_stats(a, b, 5.0, exclude=exclude, block=6, keep=keep,
                           row_grad=lambda lse, r0, r1: torch.ones_like(lse), fast=True)
    grads = torch.autograd.grad((stats[0] * weights).sum(), (a, b))
    want = _dense_stats(a, b, 5.0, columns=False)
    want_grads = torch.autograd.grad((want[0] * weights).sum(), (a, b))
    assert guesses == [None]
    torch.testing.assert_close(stats, want, rtol=1e-12, atol=1e-12)
    for got, w in zip(grads, want_grads):
        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-12)


def test_guessed_gradient_gradcheck():
    """Finite differences with a guess given: gradcheck's upstream vectors are one-hot rows, refused unless
    there is one row; either way the gradient is the true one."""
    g = torch.Generator().manual_seed(24)
    a, b = (torch.nn.functional.normalize(torch.randn(5, 3, generator=g, dtype=torch.float64), dim=1)
            .requires_grad_() for _ in range(2))
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    exclude = torch.arange(5)[:, None]
    torch.autograd.gradcheck(lambda a, b, s: negative_stats(a, b, s, exclude=exclude, block=2,
                                                            row_grad=lambda lse, r0, r1: lse.exp(), fast=True),
                                 (a, b, scale))


def test_retain_graph_backward_twice():
    """Saved blocks and guesses survive a retained graph: two backward passes give the same gradients."""
    # guessed, kept, guessed
    for name, setting in (("infonce", "two_views"), ("infonce", "image_text"), ("cacr", "two_views")):
        loss, leaves = _blockwise_call(name, setting, None, _inputs(25, setting, 12, 5, torch.float64))
        first = torch.autograd.grad(loss, leaves, retain_graph=True)
        second = torch.autograd.grad(loss, leaves)
        for f, s in zip(first, second):
            torch.testing.assert_close(f, s, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["image-text", "rows", "rows+mean"])
def test_kept_blocks_freed_by_backward(case, monkeypatch):
    """Blocks kept for backward are freed once backward has run, while the output still lives (as a loss
    tensor does in a training loop, until the next step's forward has run)."""
    import weakref

    import contrastkit.losses.chunked as chunked

    refs = []
    for fn_name in ("_fast_rows", "_fast_columns"):
        original = getattr(chunked, fn_name)

        def spy(*args, original=original, **kwargs):
            state = original(*args, **kwargs)
            refs.extend(weakref.ref(t) for t in state[3])
            return state

        monkeypatch.setattr(chunked, fn_name, spy)
    x = _inputs(26, "image_text", 20, 6, torch.float32)
    if case == "image-text":
        out, leaves = _blockwise_call("infonce", "image_text", None, x)
    else:  # no guess: the blocks are kept
        leaves = fresh(x)
        out = negative_stats(*leaves, 5.0, exclude=torch.arange(20)[:, None], block=6, keep=10**9,
                             with_mean=case == "rows+mean", fast=True).sum()
    assert refs and all(r() is not None for r in refs)
    out.backward()
    assert out.grad_fn is not None and all(r() is None for r in refs)


def test_no_grad_keeps_nothing(monkeypatch):
    """Evaluation under no_grad: no block is kept and no gradient guessed, the values the same."""
    import contrastkit.losses.chunked as chunked

    seen = []
    original = chunked._fast_rows
    monkeypatch.setattr(chunked, "_fast_rows", lambda *args: seen.append((args[4], args[6])) or original(*args))
    x = _inputs(27, "two_views", 20, 6, torch.float32)
    with_grad = _blockwise_call("infonce", "two_views", None, x)[0]
    with torch.no_grad():
        without = _blockwise_call("infonce", "two_views", None, x)[0]
    assert seen[0][1] is not None and seen[1] == (0, None)
    torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=0)
