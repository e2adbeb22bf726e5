"""Labels in the core: same_label="mask" (false negatives leave the negatives) and "positive" (they join the
positives, SupCon's L_out), against the float64 references of tests/losses/reference.py, in every setting and with
the torch kernel blocked (several blocks), automatic and dense."""

from __future__ import annotations

import pytest
import torch
from settings import call, inputs, labels

import reference
from contrastkit.losses import build_loss
from contrastkit.losses.plan import choose_backend

pytestmark = pytest.mark.quick

PARAMS = {
    "infonce": ({"temperature": 0.2}, {"tau": 0.2}),
    "dcl": ({"temperature": 0.2}, {"tau": 0.2}),
    "dclw": ({"temperature": 0.2, "sigma": 0.5}, {"tau": 0.2, "sigma": 0.5}),
    "eqco": ({"temperature": 0.2, "alpha": 64.0}, {"tau": 0.2, "alpha": 64.0}),
    "cacr": ({"t_pos": 1.0, "t_neg": 2.0}, {"t_pos": 1.0, "t_neg": 2.0}),
}
CASES = [(kind, mode) for kind in PARAMS for mode in ("mask", "positive")]
SETTINGS = ["two_views", "three_views", "image_text", "hard_negatives", "queue"]
CHUNKS = [None, 2, 0]  # automatic (the CPU's fast path), blocks of 2 anchors (several blocks), dense


def _inputs(seed, setting, n=6, d=5, classes=3):
    """The setting's tensors (tests/losses/settings.py), float64 leaves: one hard negative per sample ([n, d]), a
    queue of 9; and their labels (call's keyword arguments), two at least in the batch and in the queue."""
    x = inputs(setting, n, d, seed=seed, queue=9, hard=None)
    return x, labels(setting, x, classes=classes, seed=seed)


def _expected(kind, mode, setting, x, given):
    return reference.loss(kind, setting, x, mode=mode, **given, **PARAMS[kind][1])


def _labelled_loss(kind, mode, **options):
    return build_loss(kind, **PARAMS[kind][0], same_label=mode, **options)


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind,mode", CASES)
def test_labels_match_float64_reference(kind, mode, setting, chunk_size):
    seed = hash((kind, mode, setting)) % 2**31
    x, given = _inputs(seed, setting)
    got = call(_labelled_loss(kind, mode, chunk_size=chunk_size), setting, x, **given)
    expected = _expected(kind, mode, setting, x, given)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(got, x)
    for g, e in zip(grads, torch.autograd.grad(expected, x)):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-11, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("kind,mode", CASES)
def test_float32_with_labels_close_to_float64_reference(kind, mode):
    """float32 features: the CPU's fast path (sampled shifts, backward guessed in forward) with labels."""
    x, given = _inputs(7, "two_views", n=16, d=8, classes=4)
    x32 = [t.detach().float().requires_grad_() for t in x]
    got = call(_labelled_loss(kind, mode), "two_views", x32, **given)
    expected = _expected(kind, mode, "two_views", x, given)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(torch.autograd.grad(got, x32), torch.autograd.grad(expected, x)):
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-6)


def _distinct(setting):
    """Labels all distinct (batch and queue: 6 and 9 rows)."""
    return {"labels": torch.arange(6), **({"queue_labels": torch.arange(6, 15)} if setting == "queue" else {})}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", list(PARAMS))
def test_distinct_labels_mask_nothing(kind, setting):
    """same_label="mask" with every label distinct is the loss without labels, values and gradients, to float64
    rounding: the two calls take different routes (with labels image-text's directions come one at a time, the
    dense path's Function runs autograd's), so bit-identity is not the claim."""
    x, _ = _inputs(3, setting)
    for chunk_size in CHUNKS:
        fn = _labelled_loss(kind, "mask", chunk_size=chunk_size)
        got = call(fn, setting, x, **_distinct(setting))
        plain = call(fn, setting, x)
        for g, e in zip((got, *torch.autograd.grad(got, x)), (plain, *torch.autograd.grad(plain, x))):
            torch.testing.assert_close(g, e, rtol=1e-14, atol=1e-15, msg=lambda m: f"chunk_size {chunk_size}: {m}")


@pytest.mark.parametrize("kind,setting", [(kind, setting) for kind in PARAMS for setting in SETTINGS
                                          if setting != "three_views" or kind == "cacr"])
def test_distinct_labels_as_positives_are_the_plain_loss(kind, setting):
    """same_label="positive" with every label distinct: one positive per anchor, SupCon's L_out is the plain
    loss (to rounding: the positives' sums are built another way). CACR's too with several views: its plain
    attraction already weighs all of an anchor's own positives by one softmax."""
    x, _ = _inputs(4, setting)
    got = call(_labelled_loss(kind, "positive", chunk_size=2), setting, x, **_distinct(setting))
    plain = call(_labelled_loss(kind, "mask", chunk_size=2 if setting != "queue" else None), setting, x)
    torch.testing.assert_close(got, plain, rtol=1e-13, atol=1e-13)
    for g, e in zip(torch.autograd.grad(got, x), torch.autograd.grad(plain, x)):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("kind,mode", CASES)
def test_one_label_for_all_leaves_no_negative(kind, mode):
    x, _ = _inputs(5, "two_views")
    with pytest.raises(ValueError, match="no negative left"):
        _labelled_loss(kind, mode)(x[0], x[1], labels=torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="no negative left"):
        _labelled_loss(kind, mode, chunk_size=0).cross_modal(x[0], x[1], labels=torch.full((6,), 3))


def test_bad_labels_are_named():
    x, given = _inputs(6, "queue")
    labels, queue = given["labels"], x[2]
    fn = _labelled_loss("dcl", "mask")
    for bad, match in [(labels[:5], r"must be \[6\]"), (labels[:, None], r"must be \[6\]"),
                       (labels.double(), "integer dtype"), (labels.bool(), "integer dtype"),
                       (labels.tolist(), "torch.Tensor"), (labels.to("meta"), "is on meta")]:
        with pytest.raises(ValueError, match=match):
            fn(x[0], x[1], labels=bad)
    with pytest.raises(ValueError, match="need queue_labels"):
        fn.query_key(x[0], x[1], queue, labels=labels)
    with pytest.raises(ValueError, match=r"queue_labels must be \[9\]"):
        fn.query_key(x[0], x[1], queue, labels=labels, queue_labels=labels)
    with pytest.raises(ValueError, match="queue_labels without labels"):
        fn.query_key(x[0], x[1], queue, queue_labels=torch.arange(9))
    with pytest.raises(ValueError, match="same_label must be one of"):
        build_loss("infonce", same_label="supcon")
    with pytest.raises(ValueError, match="unigrad: labels have no meaning"):
        build_loss("unigrad")(x[0], x[1], labels=labels)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind,mode", CASES)
def test_labels_on_the_triton_backend(kind, mode, setting):
    """backend="triton" (under the interpreter on CPU) masks by label in its kernels (triton/common.
    kept_by_label): float32 features against the float64 reference, every objective, mode and setting."""
    seed = hash((kind, mode, setting, "triton")) % 2**31
    x, given = _inputs(seed, setting)
    x32 = [t.detach().float().requires_grad_() for t in x]
    got = call(_labelled_loss(kind, mode, backend="triton"), setting, x32, **given)
    expected = _expected(kind, mode, setting, x, given)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(torch.autograd.grad(got, x32), torch.autograd.grad(expected, x)):
        assert float((g.double() - e).norm() / e.norm()) < 1e-5, f"seed {seed}"


def test_labels_take_every_backend():
    """Labels change no backend choice: "auto" takes Triton on CUDA with or without them."""
    assert choose_backend("auto", None, "cuda", torch.bfloat16) in ("triton", "torch")


def test_mask_cuts_same_label_samples_off_and_positive_pulls_them():
    """Anchor 0 (sample 0, label 0) and sample 1 (label 0): with "mask" anchor 0's loss does not depend on
    sample 1 at all; with "positive" its gradient moves sample 1's view towards anchor 0."""
    x, _ = _inputs(9, "two_views", n=4)
    labels = torch.tensor([0, 0, 1, 2])
    for mode in ("mask", "positive"):
        z1, z2 = (t.detach().clone().requires_grad_() for t in x[:2])
        per_anchor = _labelled_loss("dcl", mode, chunk_size=2, reduction="none")(z1, z2, labels=labels)
        (g,) = torch.autograd.grad(per_anchor[0], [z2])
        if mode == "mask":
            assert torch.equal(g[1], torch.zeros_like(g[1]))
        else:  # a step against the gradient raises the cosine of z2[1] with z1[0]
            u = torch.nn.functional.normalize(z1[0].detach(), dim=0)
            assert float((-g[1] * u).sum()) > 0


@pytest.mark.parametrize("setting", SETTINGS)
def test_cacr_positive_moves_only_the_attraction(setting):
    """CACR's negatives are the other labels' candidates in both modes: "positive" has "mask"'s repulsion (to
    rounding), and only its attraction, over the label's candidates too, differs."""
    x, given = _inputs(8, setting)
    mask, positive = (call(_labelled_loss("cacr", mode, chunk_size=2), setting, x, output_dict=True, **given)
                      for mode in ("mask", "positive"))
    torch.testing.assert_close(positive["repulsion"], mask["repulsion"], rtol=1e-13, atol=1e-14)
    assert float((positive["attraction"] - mask["attraction"]).abs()) > 1e-3


@pytest.mark.parametrize("kind", ["infonce", "eqco", "cacr"])
def test_sparse_labels_keep_the_fast_path(kind, monkeypatch):
    """The positives' lse runs over each anchor's few same-label candidates, which the fast path's sampled
    shift (every K/64-th candidate) mostly misses; the shift then falls to the logits' floor -|a||b|, and the
    call stays on the fast path, equal to the dense float64 loss."""
    import contrastkit.losses.chunked as chunked

    g = torch.Generator().manual_seed(2)
    z = [torch.randn(150, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    labels = torch.randint(60, (150,), generator=g)
    dense = _labelled_loss(kind, "positive", chunk_size=0)(*z, labels=labels)

    def refuse(*args, **kwargs):
        raise AssertionError("the safe path ran")

    monkeypatch.setattr(chunked, "_safe_forward", refuse)
    fast = _labelled_loss(kind, "positive")(*z, labels=labels)
    torch.testing.assert_close(fast, dense, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(fast, z), torch.autograd.grad(dense, z)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
