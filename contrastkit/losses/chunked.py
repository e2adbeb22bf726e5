"""Exact blockwise negative statistics: the [M, K] similarity matrix is never held whole.

Anchors a [M, D] and candidates b [K, D] (unit vectors) give the logits L = scale a b^T, some (anchor,
candidate) pairs excluded (an anchor's own sample). The score objectives need only, per anchor,

- lse_i = log sum_k exp(L_ik) over valid k: the denominator of InfoNCE, DCL (Eq. 6), DCLW, EqCo;
- mean_i = sum_k softmax(L_i)_k L_ik / scale: the softmax-weighted cosine of CACR's repulsion (Sec. 3.2).

Forward walks over blocks of anchors keeping only these per-row statistics; backward recomputes each
block's logits (one more matrix product), so the extra memory is O(block K) instead of O(M K). With
``recompute=False`` the blocks' logits are kept instead (memory O(M K), no extra product): the fastest
form while the matrix fits. Gradients, with p = softmax(L_i):

    d lse_i / dL_ik = p_ik,    d mean_i / dL_ik = p_ik (1 + L_ik - scale mean_i) / scale,

then dA = scale dL b, dB = scale dL^T a (= dL^T (scale a)), and d scale = <dL, a b^T> - sum_i g_mean_i mean_i / scale.

``columns=True`` (image-text on one process, where candidates are anchors too and the matrix is
square) also gives the statistics of every column, accumulated online over the row blocks, so both
directions of CLIP's loss come from one product.
"""

from __future__ import annotations

import torch

# Excluded pairs get a finite, hugely negative logit: exp() of it is exactly 0, and unlike -inf it never
# makes 0 * inf = NaN in the mean or its gradient.
_EXCLUDED_FRACTION = 0.25


def _excluded(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min * _EXCLUDED_FRACTION


def _block_logits(a_s, b, exclude, r0, r1):
    logits = a_s[r0:r1] @ b.T
    if exclude is not None:
        rows = torch.arange(r1 - r0, device=logits.device)[:, None].expand(-1, exclude.shape[1])
        logits.index_put_((rows.reshape(-1), exclude[r0:r1].reshape(-1)),
                          logits.new_tensor(_excluded(logits.dtype)))
    return logits


def _dlogits(logits, lse, grad, mean, grad_mean, scale, *, inplace=False):
    """Gradient of the statistics in one direction with respect to the block's logits."""
    if mean is None:
        p = logits.sub_(lse).exp_() if inplace else torch.exp(logits - lse)
        return p.mul_(grad)
    return torch.exp(logits - lse).mul_(grad + grad_mean / scale * (1.0 + logits - scale * mean))


def _softmax_(logits):
    """Row logsumexp of the block, and the block turned into its row softmax in place."""
    top = logits.amax(dim=1, keepdim=True)
    total = logits.sub_(top).exp_().sum(dim=1, keepdim=True)
    return (top + torch.log(total))[:, 0], logits.div_(total)


class _BlockStats(torch.autograd.Function):
    """Rows [lse, (mean)] and, with columns, [col lse, (col mean)] stacked into one [S, M] tensor.

    Without mean and columns (InfoNCE, DCL, DCLW, EqCo) a block is turned into its softmax in place,
    which is what backward needs (kept, or recomputed); otherwise the logits themselves.
    """

    @staticmethod
    def forward(ctx, a, b, scale, exclude, block, with_mean, columns, recompute):
        m, k = a.shape[0], b.shape[0]
        plain = not (with_mean or columns)
        a_s = a * scale
        stats = a.new_empty(((2 if with_mean else 1) * (2 if columns else 1), m))
        lse, mean = stats[0], stats[1] if with_mean else None
        if columns:
            col_max = a.new_full((k,), float("-inf"))
            col_sum, col_wsum = a.new_zeros(k), a.new_zeros(k)
        kept = []
        for r0 in range(0, m, block):
            r1 = min(r0 + block, m)
            logits = _block_logits(a_s, b, exclude, r0, r1)
            if plain:
                lse[r0:r1], logits = _softmax_(logits)
            else:
                lse[r0:r1] = torch.logsumexp(logits, dim=1)
            if with_mean:
                mean[r0:r1] = (torch.exp(logits - lse[r0:r1, None]) * logits).sum(dim=1) / scale
            if columns:
                # Online logsumexp down the columns (and the softmax-weighted sum for the mean). A column
                # whose block holds only its excluded entry counts it once, but the first valid entry
                # after it rescales that by exp(excluded - valid) = 0, and every column has one.
                new_max = torch.maximum(col_max, logits.amax(dim=0))
                rescale = torch.exp(col_max - new_max)
                e = torch.exp(logits - new_max)
                col_sum.mul_(rescale).add_(e.sum(dim=0))
                if with_mean:
                    col_wsum.mul_(rescale).add_((e * logits).sum(dim=0))
                col_max = new_max
            if not recompute:
                kept.append(logits)
        if columns:
            col = 2 if with_mean else 1
            stats[col] = col_max + torch.log(col_sum)
            if with_mean:
                stats[col + 1] = col_wsum / col_sum / scale
        ctx.block, ctx.plain, ctx.with_mean, ctx.columns, ctx.kept = block, plain, with_mean, columns, kept
        ctx.scale_is_tensor = isinstance(scale, torch.Tensor)
        ctx.save_for_backward(a, b, stats, exclude, scale if ctx.scale_is_tensor else None)
        if not ctx.scale_is_tensor:
            ctx.scale = scale
        return stats

    @staticmethod
    def backward(ctx, grad):
        a, b, stats, exclude, scale_t = ctx.saved_tensors
        scale = scale_t if ctx.scale_is_tensor else ctx.scale
        need_a, need_b, need_scale = ctx.needs_input_grad[:3]
        col = 2 if ctx.with_mean else 1
        a_s = a * scale
        d_as = torch.zeros_like(a) if (need_a or need_scale) else None
        db = torch.zeros_like(b) if need_b else None
        for i, r0 in enumerate(range(0, a.shape[0], ctx.block)):
            r1 = min(r0 + ctx.block, a.shape[0])
            g = grad[0, r0:r1, None]
            if ctx.plain and ctx.kept:  # the kept softmax
                dl = ctx.kept[i] * g
            else:
                fresh = not ctx.kept
                logits = ctx.kept[i] if ctx.kept else _block_logits(a_s, b, exclude, r0, r1)
                mean, g_mean = (stats[1, r0:r1, None], grad[1, r0:r1, None]) if ctx.with_mean else (None, None)
                dl = _dlogits(logits, stats[0, r0:r1, None], g, mean, g_mean, scale,
                              inplace=fresh and not ctx.columns)
                if ctx.columns:
                    mean, g_mean = (stats[col + 1], grad[col + 1]) if ctx.with_mean else (None, None)
                    dl += _dlogits(logits, stats[col], grad[col], mean, g_mean, scale, inplace=fresh)
            if d_as is not None:
                torch.mm(dl, b, out=d_as[r0:r1])
            if db is not None:
                db.addmm_(dl.T, a_s[r0:r1])
        da = d_as * scale if need_a else None
        d_scale = None
        if need_scale:
            d_scale = (d_as * a).sum()
            if ctx.with_mean:
                d_scale = d_scale - (grad[1] * stats[1]).sum() / scale
                if ctx.columns:
                    d_scale = d_scale - (grad[col + 1] * stats[col + 1]).sum() / scale
            d_scale = d_scale.reshape(scale.shape)
        return da, db, d_scale, None, None, None, None, None


def negative_stats(anchors: torch.Tensor, candidates: torch.Tensor, scale, *, exclude: torch.Tensor | None = None,
                   block: int, with_mean: bool = False, columns: bool = False, recompute: bool = True):
    """Per-anchor statistics of the negatives' logits scale * anchors @ candidates.T, blockwise.

    anchors [M, D], candidates [K, D]; scale a float or a 0-dim tensor (gets its gradient); exclude
    [M, E] column indices left out of each anchor's row; block: anchors per block. Returns a tensor
    [S, M]: lse, then mean (with_mean), then the columns' lse and mean (columns, needs M == K).
    """
    if columns and anchors.shape[0] != candidates.shape[0]:
        raise ValueError(f"columns=True needs a square matrix, got {anchors.shape[0]} x {candidates.shape[0]}")
    if block < 1:
        raise ValueError(f"block must be a positive number of anchors, got {block}")
    return _BlockStats.apply(anchors, candidates, scale, exclude, int(block), with_mean, columns, recompute)
