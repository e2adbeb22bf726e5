"""The loss core's settings, one spelling each: their names, fresh random inputs for each, and each one's call
through the loss API. The tests of a setting take all three from here:

    x = inputs("queue", n=6, d=5, seed=seed)            # [query, key, queue], leaves that need a gradient
    loss = call(build_loss("dcl"), "queue", x, **labels("queue", x))
    grads = torch.autograd.grad(loss, leaves(x))

A setting's tensors, in the order inputs() makes them and call() passes them:

    two_views               z1, z2                        loss_fn(z1, z2)                           SimCLR
    three_views             z1, z2, z3                    loss_fn(z1, z2, z3)                       several views
    query_key               query, key                    loss_fn.query_key(q, k)                   in-batch keys (SiMo)
    several_keys            query, keys [N, P, D]         loss_fn.query_key(q, keys)                P positives a query
    hard_negatives          query, key, negatives         loss_fn.query_key(q, k, negatives=h)      retrieval
                            ([N, H, D], or [N, D])
    queue                   query, key, queue [Q, D]      loss_fn.query_key(q, k, queue)            MoCo
    image_text              image, text                   loss_fn.cross_modal(i, t)                 CLIP, its own scale
    image_text_scale        image, text, scale (0-dim)    loss_fn.cross_modal(i, t, logit_scale=s)  a learnable scale
    image_text_float_scale  image, text                   loss_fn.cross_modal(i, t, logit_scale=14.0)

The float64 references of the settings (tests/losses/reference.py: ``reference.loss``) take the same tensors.
"""

from __future__ import annotations

import torch

SCORE_LOSSES = ["infonce", "dcl", "dclw", "eqco", "cacr"]  # the objectives that have every setting (not UniGrad)

# What each setting's call takes, in order: a row per sample ("view"), P keys per sample ("keys"), H hard
# negatives per sample ("negatives"), a queue's rows ("queue"), a 0-dim logit scale ("scale").
PARTS = {
    "two_views": ("view", "view"),
    "three_views": ("view", "view", "view"),
    "query_key": ("view", "view"),
    "several_keys": ("view", "keys"),
    "hard_negatives": ("view", "view", "negatives"),
    "queue": ("view", "view", "queue"),
    "image_text": ("view", "view"),
    "image_text_scale": ("view", "view", "scale"),
    "image_text_float_scale": ("view", "view"),
}
SETTINGS = list(PARTS)
PER_SAMPLE = ("view", "keys", "negatives")  # a process holds its share of these rows (shard), a queue and a scale whole
FLOAT_SCALE = 14.0  # image_text_float_scale's logit scale, a Python number (CLIP's initial 1 / 0.07 is 14.3)


def _check(setting: str) -> tuple[str, ...]:
    if setting not in PARTS:
        raise ValueError(f"unknown setting {setting!r}: one of {', '.join(PARTS)}")
    return PARTS[setting]


def inputs(setting: str, n: int = 9, d: int = 7, *, dtype: torch.dtype = torch.float64, device="cpu", seed: int = 0,
           queue: int = 11, keys: int = 2, hard: int | None = 2, scale: float = 14.0,
           scale_dtype: torch.dtype | None = None, size: float = 1.0, requires_grad: bool = True,
           queue_grad: bool = True) -> list[torch.Tensor]:
    """Fresh random inputs of ``setting`` (PARTS' order): rows [n, d] of standard normal entries times ``size``,
    ``keys`` keys per query [n, keys, d], ``hard`` hard negatives per query [n, hard, d] (None: one per query as
    [n, d], the call's other form), a queue of ``queue`` rows [queue, d], a 0-dim logit scale of ``scale`` (in
    ``scale_dtype``, default the features' ``dtype``). Drawn in float64 (float32 for the other dtypes) from a
    generator seeded with ``seed``, then cast to ``dtype``: the same seed and sizes give the same values. Each a
    leaf needing a gradient (requires_grad), but the queue without queue_grad (MoCo's queue is a constant). On
    the meta device nothing is drawn: empty tensors, any size."""
    g = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    shapes = {"view": (n, d), "keys": (n, keys, d), "negatives": (n, d) if hard is None else (n, hard, d),
              "queue": (queue, d)}
    x = []
    for part in _check(setting):
        if part == "scale":
            t = torch.tensor(scale, dtype=scale_dtype or dtype).to(device)  # made on the host, as the rows
        elif device.type == "meta":
            t = torch.empty(shapes[part], dtype=dtype, device=device)
        else:
            drawn_in = torch.float64 if dtype == torch.float64 else torch.float32
            t = (size * torch.randn(shapes[part], generator=g, dtype=drawn_in)).to(device=device, dtype=dtype)
        x.append(t.requires_grad_(requires_grad and (queue_grad or part != "queue")))
    return x


def labels(setting: str, x: list[torch.Tensor], *, classes: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random labels for inputs ``x`` of ``setting``, as call()'s keyword arguments: ``labels`` [N] of ``classes``
    classes, and for a queue ``queue_labels`` [Q] of one class more (a label no sample has). The first two of
    each are 0 and 1: two labels at least, so that every anchor keeps a negative."""
    g = torch.Generator().manual_seed(seed)
    n = x[0].shape[0]
    out = {"labels": torch.randint(classes, (n,), generator=g)}
    out["labels"][:2] = torch.arange(2)
    if setting == "queue":
        out["queue_labels"] = torch.randint(classes + 1, (x[2].shape[0],), generator=g)
        out["queue_labels"][:2] = torch.arange(2)
    return {k: v.to(x[0].device) for k, v in out.items()}


def call(loss_fn, setting: str, x, **kwargs):
    """``loss_fn`` called in ``setting`` on its tensors ``x`` (inputs' order); kwargs go to the call (labels,
    output_dict, a logit_scale for image_text)."""
    if len(x) != len(_check(setting)):
        raise ValueError(f"{setting} takes {len(PARTS[setting])} tensors ({', '.join(PARTS[setting])}), got {len(x)}")
    if setting in ("two_views", "three_views"):
        return loss_fn(*x, **kwargs)
    if setting in ("query_key", "several_keys"):
        return loss_fn.query_key(x[0], x[1], **kwargs)
    if setting == "hard_negatives":
        return loss_fn.query_key(x[0], x[1], negatives=x[2], **kwargs)
    if setting == "queue":
        return loss_fn.query_key(x[0], x[1], x[2], **kwargs)
    if setting == "image_text_scale":
        return loss_fn.cross_modal(x[0], x[1], logit_scale=x[2], **kwargs)
    if setting == "image_text_float_scale":
        return loss_fn.cross_modal(x[0], x[1], logit_scale=FLOAT_SCALE, **kwargs)
    return loss_fn.cross_modal(x[0], x[1], **kwargs)


def plan(loss_fn, setting: str, x, **kwargs):
    """The plan (contrastkit/losses/plan.py) of call(): the route that call takes on these tensors."""
    parts = _check(setting)
    kind = "forward" if setting in ("two_views", "three_views") else "cross_modal" if "image" in setting else "query_key"
    if setting == "hard_negatives":
        kwargs["negatives"] = x[2]
    if setting == "image_text_scale":
        kwargs["logit_scale"] = x[2]
    given = x if setting in ("two_views", "three_views", "queue") else x[:2]
    assert len(x) == len(parts)
    return loss_fn.plan(*given, call=kind, **kwargs)


def fresh(x) -> list[torch.Tensor]:
    """New leaves with x's values, each needing a gradient where its original does."""
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in x]


def leaves(x) -> list[torch.Tensor]:
    """The tensors of x that need a gradient (all but a constant queue)."""
    return [t for t in x if t.requires_grad]


def fresh_call(loss_fn, setting: str, x, **kwargs):
    """call() on fresh leaves of x: (the loss, the leaves that need a gradient)."""
    x = fresh(x)
    return call(loss_fn, setting, x, **kwargs), leaves(x)


def shard(setting: str, x, lo: int, hi: int) -> list[torch.Tensor]:
    """One process's share of inputs x: samples lo:hi of the per-sample rows (views, keys, hard negatives), the
    queue and the scale whole; fresh leaves (see fresh)."""
    return fresh([t[lo:hi] if part in PER_SAMPLE else t for t, part in zip(x, _check(setting))])
