"""Float64 references written straight from the papers' formulas, one anchor at a time.

Deliberately naive: explicit index lists, exp and log rather than logsumexp, squared distances from
vectors rather than from cosines, so that they share nothing with the kernels under test.
"""

from __future__ import annotations

import math

import torch

import settings


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def view_pairs(num_views: int, n: int):
    """For each anchor (view v, sample i): its index, its positives' indices, its negatives' indices,
    in the stacked order [view 0 samples..., view 1 samples..., ...]."""
    out = []
    for v in range(num_views):
        for i in range(n):
            pos = [w * n + i for w in range(num_views) if w != v]
            neg = [w * n + j for w in range(num_views) for j in range(n) if j != i]
            out.append((v * n + i, pos, neg))
    return out


def per_anchor(z, kind, *, mean=True, **p):
    """Mean over anchors of the per-anchor loss of `kind` (mean=False: the per-anchor losses, view-major),
    views z: list of [N, D] float64 tensors."""
    u = unit(torch.cat(z))
    anchors = view_pairs(len(z), z[0].shape[0])
    if kind == "dclw":
        # w = 2 - exp(<z1,z2>/sigma) / E_i[exp(<z1,z2>/sigma)] over every (anchor, positive) pair, detached
        pairs = torch.stack([(u[a] * u[b]).sum() for a, ps, _ in anchors for b in ps]).detach()
        e = torch.exp(pairs / p["sigma"])
        weights = iter(2 - e / e.mean())
    losses = []
    for a, ps, ns in anchors:
        s_pos = [(u[a] * u[b]).sum() for b in ps]
        s_neg = torch.stack([(u[a] * u[b]).sum() for b in ns])
        terms = []
        for sp in s_pos:
            if kind in ("infonce", "eqco"):
                t = p["tau"]
                m = t * math.log(p["alpha"] / len(ns)) if kind == "eqco" else 0.0
                num = torch.exp((sp - m) / t)
                terms.append(-torch.log(num / (num + torch.exp(s_neg / t).sum())))
            elif kind == "dcl":
                t = p["tau"]
                terms.append(-sp / t + torch.log(torch.exp(s_neg / t).sum()))
            elif kind == "dclw":
                t = p["tau"]
                terms.append(-next(weights) * sp / t + torch.log(torch.exp(s_neg / t).sum()))
        if kind == "cacr":
            c_pos = torch.stack([((u[a] - u[b]) ** 2).sum() for b in ps])
            c_neg = torch.stack([((u[a] - u[b]) ** 2).sum() for b in ns])
            w_pos = (torch.exp(p["t_pos"] * c_pos) / torch.exp(p["t_pos"] * c_pos).sum()).detach()
            w_neg = torch.exp(-p["t_neg"] * c_neg) / torch.exp(-p["t_neg"] * c_neg).sum()
            losses.append((w_pos * c_pos).sum() - (w_neg * c_neg).sum())
        else:
            losses.append(torch.stack(terms).mean())
    return torch.stack(losses).mean() if mean else torch.stack(losses)


def _one_positive(kind, x, y, negatives, scale, weight=1.0, **p):
    """Loss of anchor x with one positive y and negatives (rows), logits = cosines times ``scale`` (1 / tau;
    CACR: 2 t_neg, since softmax(-t_neg |x - y|^2) = softmax(2 t_neg cos))."""
    sp = (x * y).sum() * scale
    s_neg = torch.stack([(x * z).sum() for z in negatives]) * scale
    if kind in ("infonce", "eqco"):
        num = torch.exp(sp) * (len(negatives) / p["alpha"] if kind == "eqco" else 1.0)
        return -torch.log(num / (num + torch.exp(s_neg).sum()))
    if kind in ("dcl", "dclw"):
        return -weight * sp + torch.log(torch.exp(s_neg).sum())
    c_pos = ((x - y) ** 2).sum()  # cacr: one positive, whose softmax weight is 1
    c_neg = torch.stack([((x - z) ** 2).sum() for z in negatives])
    w_neg = torch.exp(-scale / 2 * c_neg) / torch.exp(-scale / 2 * c_neg).sum()
    return c_pos - (w_neg * c_neg).sum()


def _dclw_weights(x, y, sigma):
    """2 - N softmax_i(<x_i, y_i> / sigma) over the N (anchor, positive) pairs, detached."""
    e = torch.exp(torch.stack([(a * b).sum() for a, b in zip(x, y)]).detach() / sigma)
    return 2 - e / e.mean()


def _scale(kind, p):
    return 2 * p["t_neg"] if kind == "cacr" else 1 / p["tau"]


def query_key(q, k, queue, kind, *, mean=True, **p):
    """MoCo setting: anchors are the queries, positive the key, negatives the queue rows."""
    q, k, queue = unit(q), unit(k), unit(queue)
    weights = _dclw_weights(q, k, p["sigma"]) if kind == "dclw" else torch.ones(q.shape[0], dtype=q.dtype)
    losses = [_one_positive(kind, q[i], k[i], queue, _scale(kind, p), weights[i], **p) for i in range(q.shape[0])]
    return torch.stack(losses).mean() if mean else torch.stack(losses)


def unigrad(z1, z2, correlation, lam, *, mean=True):
    """Eq. 15, symmetric, target = the other view detached; correlation given (already updated)."""
    u1, u2 = unit(z1), unit(z2)
    losses = []
    for a, t in ((u1, u2.detach()), (u2, u1.detach())):
        for i in range(a.shape[0]):
            losses.append(-(a[i] * t[i]).sum() + lam / 2 * a[i] @ correlation @ a[i])
    return torch.stack(losses).mean() if mean else torch.stack(losses)


def ranking(queries, docs, kind, *, mean=True, **p):
    """Retrieval with in-batch and hard negatives (sentence-transformers' MultipleNegativesRankingLoss):
    docs is a list of [N, D] columns, docs[0] the positives, the others hard negatives. Anchor i is query i,
    its positive docs[0][i], its negatives every row of every column but docs[0][i]."""
    q = unit(queries)
    columns = [unit(d) for d in docs]
    n = q.shape[0]
    if kind == "dclw":
        pairs = torch.stack([(q[i] * columns[0][i]).sum() for i in range(n)]).detach()
        e = torch.exp(pairs / p["sigma"])
        weights = 2 - e / e.mean()
    losses = []
    for i in range(n):
        sp = (q[i] * columns[0][i]).sum()
        s_neg = torch.stack([(q[i] * col[j]).sum() for c, col in enumerate(columns) for j in range(n)
                             if (c, j) != (0, i)])
        if kind in ("infonce", "eqco"):
            t = p["tau"]
            m = t * math.log(p["alpha"] / len(s_neg)) if kind == "eqco" else 0.0
            num = torch.exp((sp - m) / t)
            losses.append(-torch.log(num / (num + torch.exp(s_neg / t).sum())))
        elif kind in ("dcl", "dclw"):
            t = p["tau"]
            w = weights[i] if kind == "dclw" else 1.0
            losses.append(-w * sp / t + torch.log(torch.exp(s_neg / t).sum()))
        elif kind == "cacr":  # one positive: its attraction weight is 1
            c_pos = ((q[i] - columns[0][i]) ** 2).sum()
            c_neg = torch.stack([((q[i] - col[j]) ** 2).sum() for c, col in enumerate(columns) for j in range(n)
                                 if (c, j) != (0, i)])
            w_neg = torch.exp(-p["t_neg"] * c_neg) / torch.exp(-p["t_neg"] * c_neg).sum()
            losses.append(c_pos - (w_neg * c_neg).sum())
    return torch.stack(losses).mean() if mean else torch.stack(losses)


def cross_modal(img, txt, kind, *, scale=None, mean=True, **p):
    """Image-text (CLIP) setting: an image's positive is its caption and its negatives the other captions, a
    caption's the other way round; logits are cosines times ``scale`` (default: the loss's own). Per-anchor
    losses: images, then texts."""
    a, b = unit(img), unit(txt)
    n = a.shape[0]
    scale = _scale(kind, p) if scale is None else scale
    weights = _dclw_weights(a, b, p["sigma"]) if kind == "dclw" else torch.ones(n, dtype=a.dtype)
    losses = []
    for x, y in ((a, b), (b, a)):
        for i in range(n):
            others = torch.stack([y[j] for j in range(n) if j != i])
            losses.append(_one_positive(kind, x[i], y[i], others, scale, weights[i], **p))
    return torch.stack(losses).mean() if mean else torch.stack(losses)


# ----------------------------------------------------------------------------- labels


def _labelled_anchor(kind, mode, x, own, candidates, label, scale, own_weights, **p):
    """One anchor's loss with labels: x its unit vector, own its sample's positives (unit vectors, weights
    own_weights: DCLW's, else 1), candidates [(unit vector, label or None)] every other column. "mask": the
    candidates of its label are dropped, the rest are the negatives, as without labels. "positive": they
    join the positives; SupCon's L_out (Khosla et al. 2020, Eq. 2) for InfoNCE, with EqCo's margin on every
    positive, and the positives out of the denominator for DCL; CACR's attraction weighs all of them by
    softmax(t_pos c) (detached), its repulsion the negatives by softmax(-t_neg c)."""
    same = [y for y, l in candidates if l is not None and l == label]
    neg = [y for y, l in candidates if l is None or l != label]
    assert neg, "an anchor with no negative left"
    s_neg = torch.stack([(x * y).sum() * scale for y in neg])
    k = len(neg)
    if kind == "cacr":  # Sec. 3.2: "positive" puts the candidates of its label among the positives weighed
        pos = own + (same if mode == "positive" else [])
        c_pos = torch.stack([((x - y) ** 2).sum() for y in pos])
        c_neg = torch.stack([((x - y) ** 2).sum() for y in neg])
        w_pos = (torch.exp(p["t_pos"] * c_pos) / torch.exp(p["t_pos"] * c_pos).sum()).detach()
        w_neg = torch.exp(-scale / 2 * c_neg) / torch.exp(-scale / 2 * c_neg).sum()
        return (w_pos * c_pos).sum() - (w_neg * c_neg).sum()
    margin = math.log(p["alpha"] / k) if kind == "eqco" else 0.0  # m / tau, the margin in logits
    pairs = list(zip(own, own_weights))
    if mode == "positive":
        pairs += [(y, 1.0) for y in same]
    s_pos = [(x * y).sum() * scale for y, _ in pairs]
    terms = []
    for sp, (_, w) in zip(s_pos, pairs):
        if kind in ("dcl", "dclw"):
            terms.append(-w * sp + torch.log(torch.exp(s_neg).sum()))
        elif mode == "mask":  # each positive against the negatives, as without labels
            num = torch.exp(sp - margin)
            terms.append(-torch.log(num / (num + torch.exp(s_neg).sum())))
        else:  # every positive in the denominator
            pos_sum = sum(torch.exp(t - margin) for t in s_pos)
            terms.append(-torch.log(torch.exp(sp - margin) / (pos_sum + torch.exp(s_neg).sum())))
    return torch.stack(terms).mean()


def labelled_views(z, labels, kind, mode, *, mean=True, **p):
    """Views z (list of [N, D]) with sample labels [N]; anchors view-major, as per_anchor."""
    u = [unit(x) for x in z]
    n, v = z[0].shape[0], len(z)
    weights = {}
    if kind == "dclw":
        pairs = torch.stack([(u[a][i] * u[b][i]).sum() for a in range(v) for i in range(n) for b in range(v)
                             if b != a]).detach()
        e = iter(2 - torch.exp(pairs / p["sigma"]) / torch.exp(pairs / p["sigma"]).mean())
        weights = {(a, i, b): next(e) for a in range(v) for i in range(n) for b in range(v) if b != a}
    losses = []
    for a in range(v):
        for i in range(n):
            others = [b for b in range(v) if b != a]
            own = [u[b][i] for b in others]
            w = [weights.get((a, i, b), 1.0) for b in others]
            candidates = [(u[b][j], int(labels[j])) for b in range(v) for j in range(n) if j != i]
            losses.append(_labelled_anchor(kind, mode, u[a][i], own, candidates, int(labels[i]), _scale(kind, p), w, **p))
    return torch.stack(losses).mean() if mean else torch.stack(losses)


def labelled_cross_modal(img, txt, labels, kind, mode, *, mean=True, **p):
    """Image-text with pair labels [N]: images then texts as anchors."""
    a, b = unit(img), unit(txt)
    n = a.shape[0]
    weights = _dclw_weights(a, b, p["sigma"]) if kind == "dclw" else torch.ones(n, dtype=a.dtype)
    losses = []
    for x, y in ((a, b), (b, a)):
        for i in range(n):
            candidates = [(y[j], int(labels[j])) for j in range(n) if j != i]
            losses.append(_labelled_anchor(kind, mode, x[i], [y[i]], candidates, int(labels[i]), _scale(kind, p),
                                           [weights[i]], **p))
    return torch.stack(losses).mean() if mean else torch.stack(losses)


def labelled_query_key(q, k, labels, kind, mode, *, queue=None, queue_labels=None, hard=None, mean=True, **p):
    """Queries q and keys k [N, D] with sample labels [N]. With a queue [Q, D] (labels queue_labels) the
    candidates are the queue; else the other samples' keys and every sample's hard negatives (hard [N, D],
    no label: always negatives)."""
    q, k = unit(q), unit(k)
    n = q.shape[0]
    weights = _dclw_weights(q, k, p["sigma"]) if kind == "dclw" else torch.ones(n, dtype=q.dtype)
    losses = []
    for i in range(n):
        if queue is not None:
            candidates = [(r, int(l)) for r, l in zip(unit(queue), queue_labels)]
        else:
            candidates = [(k[j], int(labels[j])) for j in range(n) if j != i]
            candidates += [(r, None) for r in unit(hard)] if hard is not None else []
        losses.append(_labelled_anchor(kind, mode, q[i], [k[i]], candidates, int(labels[i]), _scale(kind, p),
                                       [weights[i]], **p))
    return torch.stack(losses).mean() if mean else torch.stack(losses)


# ----------------------------------------------------------------------------- as plain PyTorch code writes it


def _logit_scale(setting, x):
    """The logit scale a setting's call passes (settings.call), None where the loss takes its own."""
    if setting == "image_text_scale":
        return x[2]
    return settings.FLOAT_SCALE if setting == "image_text_float_scale" else None


def plain(kind, setting, x, **p):
    """The loss as plain PyTorch code writes it, for comparing rounding (TF32) and F.normalize's semantics (a
    row of norm below eps): unit vectors through F.normalize, one similarity matrix, the positives read off
    it, the objective's formula on the scores (contrastkit.losses.functional), autograd's gradient. Settings
    "two_views" and the image-text ones (logits scale * cosines; image_text: the loss's own scale), on their
    tensors x (settings.inputs' order)."""
    from contrastkit.losses import functional

    a, b = x[:2]
    scale = _logit_scale(setting, x)
    kernel = getattr(functional, kind)
    if kind == "cacr":  # its logits are 2 t_neg s: a logit scale stands for 2 t_neg
        options = {"t_pos": p.get("t_pos", 1.0), "t_neg": scale / 2 if scale is not None else p.get("t_neg", 2.0)}
    else:
        options = {"temperature": 1.0 / scale if scale is not None else p.get("tau", 0.1)}
    options.update({k: p[k] for k in ("alpha", "sigma") if k in p and kind in ("eqco", "dclw")})
    if setting.startswith("image_text"):
        sims = torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(b, dim=1).T
        n = sims.shape[0]
        off = ~torch.eye(n, dtype=torch.bool, device=sims.device)
        return sum(kernel(s.diagonal(), s.masked_select(off).view(n, n - 1), **options).mean()
                   for s in (sims, sims.T)) / 2
    if setting != "two_views":
        raise ValueError(f"plain: no {setting} form (two_views and the image-text settings)")
    z = torch.nn.functional.normalize(torch.cat([a, b]), dim=1)
    sims, n = z @ z.T, a.shape[0]
    partner = (torch.arange(2 * n, device=z.device) + n) % (2 * n)
    eye = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    own = eye | eye.roll(n, dims=1)
    pos = sims.gather(1, partner[:, None])[:, 0]
    return kernel(pos, sims.masked_select(~own).view(2 * n, 2 * n - 2), **options).mean()


# ----------------------------------------------------------------------------- by setting


def loss(kind, setting, x, *, mean=True, labels=None, queue_labels=None, mode=None, **p):
    """The reference of ``kind`` in ``setting`` (tests/losses/settings.py) on the call's tensors x: the mean
    over anchors, or with mean=False the per-anchor losses in the library's order (reduction="none"). With
    ``labels`` (and a queue's ``queue_labels``), same_label ``mode`` ("mask" or "positive"). several_keys has no
    reference here, nor labels with a logit scale."""
    scale = _logit_scale(setting, x)
    hard = None
    if setting == "hard_negatives":  # [N, H, D], or one per query [N, D]
        hard = x[2].unbind(1) if x[2].dim() == 3 else [x[2]]
    if labels is None:
        if setting in ("two_views", "three_views"):
            return per_anchor(list(x), kind, mean=mean, **p)
        if setting in ("query_key", "hard_negatives"):
            return ranking(x[0], [x[1], *(hard or [])], kind, mean=mean, **p)
        if setting == "queue":
            return query_key(x[0], x[1], x[2], kind, mean=mean, **p)
        if setting.startswith("image_text"):
            return cross_modal(x[0], x[1], kind, scale=scale, mean=mean, **p)
    else:
        if setting in ("two_views", "three_views"):
            return labelled_views(list(x), labels, kind, mode, mean=mean, **p)
        if setting in ("query_key", "hard_negatives"):
            return labelled_query_key(x[0], x[1], labels, kind, mode, hard=torch.cat(hard) if hard else None,
                                      mean=mean, **p)
        if setting == "queue":
            return labelled_query_key(x[0], x[1], labels, kind, mode, queue=x[2], queue_labels=queue_labels,
                                      mean=mean, **p)
        if setting == "image_text":
            return labelled_cross_modal(x[0], x[1], labels, kind, mode, mean=mean, **p)
    raise ValueError(f"no reference for {setting}{' with labels' if labels is not None else ''}")
