"""torch.compile(loss, fullgraph=True) captures a whole loss call, forward and backward, with no graph break:
the proof that no data-dependent host read (.item(), bool(tensor), a shape from values) is left in it. The
compiled call takes the safe blockwise path (exact maxima, no checks) and must equal eager, which on CPU
takes the fast path with its checks."""

from __future__ import annotations

import pytest
import torch
from settings import call, fresh, inputs, labels

from contrastkit.losses import build_loss

pytestmark = pytest.mark.legacy  # fullgraph on torch 2.9.1 (the second environment) too

SETTINGS = ["two_views", "three_views", "query_key", "queue", "image_text_scale"]


def _inputs(seed, setting, dtype=torch.float32, n=8):
    """The setting's tensors (tests/losses/settings.py), ``n`` rows of 16, a queue of ``n`` and a float32 logit scale
    of 14, each a leaf needing a gradient. 8 rows: blocks of 7 anchors (chunk_size=7) still make several blocks
    with a ragged last one in every setting (8 = 7 + 1 anchors, two views' 16 = 7 + 7 + 2, three views' 24), and
    the compiled graph, which holds every block's operators, stays small (its tracing is the tests' cost)."""
    return inputs(setting, n, 16, dtype=dtype, seed=seed, queue=n, scale_dtype=torch.float32)


def _value_and_grads(loss_of, x):
    leaves = fresh(x)
    loss = loss_of(*leaves)
    return loss.detach(), torch.autograd.grad(loss, leaves, allow_unused=True)


def _check(name, setting, compiler, dtype=torch.float32, **options):
    torch._dynamo.reset()
    x = _inputs(hash((name, setting)) % 2**31, setting, dtype)
    fn = build_loss(name, **options)

    def loss(*x):
        return call(fn, setting, x)

    want, want_grads = _value_and_grads(loss, x)
    got, got_grads = _value_and_grads(torch.compile(loss, fullgraph=True, backend=compiler), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g_got, g_want in zip(got_grads, want_grads):
        assert (g_got is None) == (g_want is None)
        if g_want is not None:
            torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


def test_dcl_compiles_with_inductor_fullgraph():
    _check("dcl", "two_views", "inductor")


# Each objective and each setting once on the blockwise path: an objective's code there (its formula's terms,
# stat_grad, DCLW's weights, CACR's own forms) is the same in every setting, and a setting's layout the same for
# every objective. CACR twice: its mean over two views' one tensor (three views: the symmetric kernel with the
# mean) and image-text's directions each as rows; DCL on image-text takes the columns' statistics instead.
# Labels (test_labels_have_no_graph_break) cross objectives and settings again.
CASES = [("infonce", "two_views"), ("cacr", "three_views"), ("dclw", "query_key"), ("eqco", "queue"),
         ("dcl", "image_text_scale"), ("cacr", "image_text_scale")]  # CACR's mean, each image-text direction as rows
# The dense path (dense.py's Function): its two layouts, two views and image-text, each with the objectives'
# written-out forms (logit_terms: the formula's terms, DCLW's weights, CACR's own), CACR in both.
DENSE = [("infonce", "two_views"), ("dclw", "two_views"), ("cacr", "two_views"), ("dcl", "image_text_scale"),
         ("eqco", "image_text_scale"), ("cacr", "image_text_scale")]


@pytest.mark.parametrize("name, setting", DENSE)
def test_dense_path_has_no_graph_break(name, setting):
    """The default at these sizes: dense.py's Function, its layout made in the graph."""
    _check(name, setting, "aot_eager")


@pytest.mark.parametrize("name, setting", CASES)
def test_every_objective_and_setting_has_no_graph_break(name, setting):
    # aot_eager: the same capture as inductor (dynamo with fullgraph, autograd traced), without code generation.
    _check(name, setting, "aot_eager", chunk_size=7)  # 7: several blocks, a ragged last one


@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
def test_triton_backend_stays_in_the_graph(setting):
    """The Triton kernels are custom ops: a compiled call keeps them in one graph (on CPU, under the
    interpreter, as opaque custom ops; on CUDA as triton_op, which inductor can see into)."""
    _check("dcl", setting, "aot_eager", backend="triton")


@pytest.mark.parametrize("setting", SETTINGS)
def test_triton_backend_with_bf16_features_compiles(setting):
    """bf16 features: the Triton path's inverse norms and the positives' cosines in float32
    (functional.inverse_norms, row_cosines: loops over chunks of rows, the second an autograd Function) trace
    into the same fullgraph, equal to eager."""
    _check("dcl", setting, "aot_eager", dtype=torch.bfloat16, backend="triton")


@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
def test_triton_backend_under_tf32_compiles_with_its_rounding(float32_precision, setting):
    """float32 under TF32 on the Triton path runs on float16 unit vectors, the positives' cosines from the same
    units (functional.half_units, an operator of its own): compiled by Inductor, which drops a float16 round
    trip inside a fused kernel, the rounding stays: the loss equals eager's and at most 1 % of the gradients'
    entries differ (without it about half of them, by up to 3.6e-5). Inductor's own arithmetic may move an
    inverse norm by an ulp and so a component near a float16 tie to the other side: torch 2.9.1's did, for 1-2
    entries of 384 (by 3.6e-6 and 2.4e-5)."""
    torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = True
    x = _inputs(5, setting, n=24)  # 24 rows: the 1 % bound above is read over 384 entries a tensor
    fn = build_loss("infonce", backend="triton")

    def loss(*x):
        return call(fn, setting, x)

    want, want_grads = _value_and_grads(loss, x)
    got, got_grads = _value_and_grads(torch.compile(loss, fullgraph=True, backend="inductor"), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = [(x, w) for x, w in zip(got_grads, want_grads) if w is not None]
    moved = sum(int((~torch.isclose(x, w, rtol=1e-4, atol=1e-6)).sum()) for x, w in grads)
    assert moved <= 0.01 * sum(w.numel() for _, w in grads), f"{moved} gradient entries differ from eager"


LABELLED = [("infonce", "positive", "two_views"), ("dcl", "mask", "image_text"), ("eqco", "positive", "queue"),
            ("dclw", "positive", "query_key"), ("cacr", "mask", "three_views"), ("eqco", "mask", "two_views"),
            ("cacr", "positive", "queue")]


@pytest.mark.parametrize("name, mode, setting", LABELLED)
def test_labels_have_no_graph_break(name, mode, setting):
    """Labels (ids by sort and searchsorted, counts and class sums by index_add: no value read on the host)
    keep the call in one graph, equal to eager."""
    torch._dynamo.reset()
    x = _inputs(5, setting)
    given = labels(setting, x, classes=4, seed=5)  # constants of the graph
    fn = build_loss(name, chunk_size=7, same_label=mode)

    def loss(*x):
        return call(fn, setting, x, **given)

    want, want_grads = _value_and_grads(loss, x)
    got, got_grads = _value_and_grads(torch.compile(loss, fullgraph=True, backend="aot_eager"), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g_got, g_want in zip(got_grads, want_grads):
        assert (g_got is None) == (g_want is None)
        if g_want is not None:
            torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["infonce", "dcl", "dclw", "eqco", "cacr"])
def test_wav2vec2_frames_have_no_graph_break(name):
    """The frames' objective (dense.score_loss with the objective's formula) in one graph, equal to eager."""
    from contrastkit.losses.frames import FrameObjective

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(hash(name) % 2**31)
    pos, neg = torch.rand(12, generator=g).requires_grad_(), torch.rand(12, 6, generator=g).requires_grad_()
    valid, frames = torch.rand(12, 6, generator=g) > 0.3, torch.rand(12, generator=g) > 0.2
    valid[0] = False  # a frame with no valid distractor
    objective = FrameObjective(name)

    def loss(p, n):
        return objective.summed(p, n, valid, model_temperature=0.1, frames=frames)[0]

    want, want_grads = _value_and_grads(loss, [pos, neg])
    got, got_grads = _value_and_grads(torch.compile(loss, fullgraph=True, backend="aot_eager"), [pos, neg])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g_got, g_want in zip(got_grads, want_grads):
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)
