"""The whole logits matrix in one autograd Function: the path of the batch sizes people train with per device.

At N = 64 .. 4096 a call's time is the host's, a fixed cost per operator launched, not the products'
(docs/performance.md: ~30 us an operator on an H200, a few on a CPU core). So one call here is one forward and
one backward written out by hand, each a short straight run of operators:

    forward   u = a / |a|, v = b / |b|;  L = scale u v^T;  p_i = L at anchor i's positive;  the own sample's
              entries left out (EXCLUDED);  lse_i = logsumexp of row i (and of column i, image-text);  CACR's
              m_i = sum_j softmax(L_i)_j L_ij;  loss_i = the objective's formula of (p_i, lse_i, m_i)
    backward  dL = g_i (d_lse_i softmax(L_i) + d_m_i softmax(L_i) (1 + L_i - m_i)) - g_i pull_i at the
              positives;  du = scale dL v, dv = scale dL^T u (two views: one product of dL + dL^T);  the
              normalisation's backward;  d scale = <dL, u v^T> + the objective's direct term

The objective supplies only its formula and its partial derivatives (``logit_terms`` of each loss class, from
functional.py: functional.LogitTerms); the setting supplies which entries are each anchor's positive and which are left out, as flat
indices made once per shape and device (base.positions). The blockwise paths (chunked.py, triton/stats.py) serve
the matrices that do not fit (plan.choose_backend).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from contrastkit.losses.chunked import EXCLUDED, NORM_EPS, no_autocast


class Layout(NamedTuple):
    """Flat indices into the [M, K] logits: each anchor's positive ([M], then [K] for the columns' anchors of
    image-text), and the entries left out of the negatives (the anchor's own sample's, its positive included)."""

    positives: torch.Tensor
    excluded: torch.Tensor


def _units(x: torch.Tensor, dtype: torch.dtype, normalize: bool):
    """(rows in ``dtype``, unit rows where ``normalize``; 1 / max(|x|, eps) per row; the inverse norm of the
    rows whose norm was not clamped, else 0: their projection in backward)."""
    x = x if x.dtype == dtype else x.to(dtype)
    if not normalize:
        return x, None, None
    norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    inv = norm.clamp_min(NORM_EPS).reciprocal_()
    return x * inv, inv, inv * (norm >= NORM_EPS)


def _normalisation_backward(grad, u, inv, projected):
    """d loss / d x from d loss / d u for u = x inv: (grad - u <grad, u> [unclamped rows]) inv."""
    if inv is None:
        return grad
    along = (grad * u).sum(dim=1, keepdim=True).mul_(projected)
    return torch.addcmul(grad * inv, u, along, value=-1.0)


class _DenseLoss(torch.autograd.Function):
    """Per-anchor losses [M (+ K)] of anchors a [M, D] against candidates b [K, D] (None: a itself, two views on
    one process); also the positives' logits, the negatives' lse and (CACR) mean, for the diagnostics."""

    @staticmethod
    def forward(ctx, a, b, scale, positives, excluded, columns, terms, num_neg, with_mean, normalize, dtype):
        with no_autocast(a.device.type):
            u, inv_a, proj_a = _units(a, dtype, normalize)
            v, inv_b, proj_b = (u, inv_a, proj_a) if b is None else _units(b, dtype, normalize)
            logits = torch.mm(u, v.T).mul_(scale)
            pos = logits.take(positives)
            logits.view(-1).index_fill_(0, excluded, EXCLUDED)
            lse = torch.logsumexp(logits, 1)
            if columns:
                lse = torch.cat([lse, torch.logsumexp(logits, 0)])
            mean = _softmax_means(logits, columns) if with_mean else None
            loss, d_lse, d_mean, pull, d_scale = terms(pos, lse, mean, scale, num_neg)
        pull = _pull(pull, d_lse, d_mean)
        ctx.save_for_backward(u, v, inv_a, proj_a, inv_b, proj_b, logits, mean, positives,
                              *(t if isinstance(t, torch.Tensor) else None for t in (scale, d_lse, d_mean, pull,
                                                                                     d_scale)))
        ctx.constants = tuple(None if isinstance(t, torch.Tensor) else t for t in (scale, d_lse, d_mean, pull))
        ctx.columns, ctx.same, ctx.dtypes = columns, b is None, (a.dtype, a.dtype if b is None else b.dtype)
        outputs = (pos, lse) if mean is None else (pos, lse, mean)
        ctx.mark_non_differentiable(*outputs)
        ctx.set_materialize_grads(False)  # the statistics take no gradient: no zeros made for them
        return (loss, *outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, *_):
        if grad is None:  # only the statistics were differentiated (they take no gradient)
            return (None,) * 11
        u, v, inv_a, proj_a, inv_b, proj_b, logits, mean, positives, *tensors = ctx.saved_tensors
        scale, d_lse, d_mean, pull = (c if t is None else t for t, c in zip(tensors, ctx.constants))
        d_scale_direct = tensors[4]
        need_a, need_b, need_scale = ctx.needs_input_grad[:3]
        with no_autocast(grad.device.type):
            grad = _as(grad, logits.dtype)
            c_lse, c_mean = _times(grad, d_lse), _times(grad, d_mean)
            m = logits.shape[0]
            dl = _d_logits(logits, _part(c_lse, 0, m), _part(c_mean, 0, m), _part(mean, 0, m), 1)
            if ctx.columns:
                dl += _d_logits(logits, _part(c_lse, m, None), _part(c_mean, m, None), _part(mean, m, None), 0)
            dl.view(-1).index_add_(0, positives, _pulled(pull, grad, c_lse, c_mean), alpha=-1.0)
            if ctx.same:
                du = torch.mm(dl + dl.T, u)
                d_scale = (du * u).sum() * 0.5 if need_scale else None
            else:
                du = torch.mm(dl, v) if need_a or need_scale else None
                d_scale = (du * u).sum() if need_scale else None
            if d_scale is not None and d_scale_direct is not None:
                d_scale = d_scale + (grad * d_scale_direct).sum()
            if d_scale is not None and d_scale.shape != scale.shape:
                d_scale = d_scale.view(scale.shape)  # a scale of shape [1]
            grad_a = grad_b = None
            if need_a:
                grad_a = _as(_normalisation_backward(du.mul_(scale), u, inv_a, proj_a), ctx.dtypes[0])
            if need_b and not ctx.same:
                dv = torch.mm(dl.T, u).mul_(scale)
                grad_b = _as(_normalisation_backward(dv, v, inv_b, proj_b), ctx.dtypes[1])
        return grad_a, grad_b, d_scale if need_scale else None, *(None,) * 8


class _ScoreLoss(torch.autograd.Function):
    """Per-anchor losses [M] of scores given whole (the wav2vec 2.0 frames'): the positive's cosine pos [M], the
    candidates' cosines neg [M, K] where ``valid`` [M, K]: _DenseLoss's statistics, formula and backward
    without the product. An anchor with no valid candidate gets a finite loss (its lse the excluded logit's)."""

    @staticmethod
    def forward(ctx, pos, neg, valid, scale, terms, num_neg, with_mean):
        dtype = torch.float64 if torch.float64 in (pos.dtype, neg.dtype) else torch.float32
        with no_autocast(neg.device.type):
            logits = _as(neg, dtype) * scale
            if valid is not None:
                logits = torch.where(valid, logits, EXCLUDED)
            lse = torch.logsumexp(logits, 1)
            mean = (torch.softmax(logits, 1) * logits).sum(1) if with_mean else None
            loss, d_lse, d_mean, pull, _ = terms(_as(pos, dtype) * scale, lse, mean, scale, num_neg)
        partials = (d_lse, d_mean, _pull(pull, d_lse, d_mean))
        ctx.save_for_backward(logits, mean, *(t if isinstance(t, torch.Tensor) else None for t in partials))
        ctx.constants = tuple(None if isinstance(t, torch.Tensor) else t for t in partials)
        ctx.scale, ctx.dtypes = scale, (pos.dtype, neg.dtype)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logits, mean, *tensors = ctx.saved_tensors
        d_lse, d_mean, pull = (c if t is None else t for t, c in zip(tensors, ctx.constants))
        with no_autocast(grad.device.type):
            grad = _as(grad, logits.dtype)
            c_lse, c_mean = _times(grad, d_lse), _times(grad, d_mean)
            d_pos = _pulled(pull, grad, c_lse, c_mean) * -ctx.scale
            d_neg = _d_logits(logits, c_lse, c_mean, mean, 1).mul_(ctx.scale)
        return _as(d_pos, ctx.dtypes[0]), _as(d_neg, ctx.dtypes[1]), None, None, None, None, None


def score_loss(pos: torch.Tensor, neg: torch.Tensor, valid: torch.Tensor | None, scale: float, *, terms, num_neg,
               with_mean: bool) -> torch.Tensor:
    """Per-anchor losses [M] of given scores (see _ScoreLoss; ``terms`` as dense_loss's), scale a number."""
    return _ScoreLoss.apply(pos, neg, valid, scale, terms, num_neg, with_mean)


def _softmax_means(logits, columns):
    """sum_j softmax(L_i)_j L_ij per row (and per column): the excluded entries weigh 0 (exp(EXCLUDED) is 0)."""
    rows = (torch.softmax(logits, 1) * logits).sum(1)
    return torch.cat([rows, (torch.softmax(logits, 0) * logits).sum(0)]) if columns else rows


def _as(x, dtype):
    """x in ``dtype`` (no operator where it is already: each one counts at host-bound sizes)."""
    return x if x.dtype == dtype else x.to(dtype)


def _times(grad, d):
    """g d per anchor (None where d is)."""
    if d is None or isinstance(d, float) and d == 1.0:
        return None if d is None else grad
    return grad * d


def _pull(pull, d_lse, d_mean):
    """What backward needs of the positive's pull: "lse" or "mean" where it is that partial derivative itself
    (its product with the upstream gradient is made already), else the pull."""
    for name, d in (("lse", d_lse), ("mean", d_mean)):
        if pull is d or isinstance(pull, float) and isinstance(d, float) and pull == d:
            return name
    return pull


def _pulled(pull, grad, c_lse, c_mean):
    """g pull per anchor: c_lse or c_mean where the pull is that partial derivative (see _pull)."""
    if isinstance(pull, str):
        return c_lse if pull == "lse" else c_mean
    return _times(grad, pull)


def _part(x, start, stop):
    """x[start:stop] of per-anchor values (rows, then columns' anchors); x itself where that is all of it."""
    return x if x is None or start == 0 and stop == x.shape[0] else x[start:stop]


def _d_logits(logits, c_lse, c_mean, mean, dim):
    """d loss / d L along ``dim`` (1: each row an anchor's, 0: each column's), from the anchors' coefficients
    c_lse = g d_lse and c_mean = g d_mean: softmax(L) c_lse + softmax(L) (1 + L - m) c_mean."""
    p = torch.softmax(logits, dim)
    along = (slice(None), None) if dim == 1 else (None, slice(None))
    if c_mean is None:
        return p.mul_(c_lse[along])
    weighted = (logits - (mean - 1.0)[along]).mul_(p).mul_(c_mean[along])
    return weighted if c_lse is None else weighted.add_(p.mul_(c_lse[along]))


def dense_loss(a: torch.Tensor, b: torch.Tensor | None, scale, where: Layout, *, columns: bool, terms, num_neg,
               with_mean: bool, normalize: bool, dtype: torch.dtype):
    """(per-anchor losses with their gradient, positives' logits, negatives' lse[, mean]): see the module
    docstring. ``terms(pos, lse, mean, scale, num_neg)`` -> functional.LogitTerms (loss, d_lse, d_mean, pull,
    d_scale): the objective's per-anchor loss and its partial derivatives (a tensor, a number, or None for zero;
    the pull minus the derivative in the positive's logit; d_scale the direct dependence on the scale, beside
    the logits'); dtype: the compute dtype, the plan's)."""
    return _DenseLoss.apply(a, b, scale, where.positives, where.excluded, columns, terms, num_neg, with_mean,
                            normalize, dtype)
