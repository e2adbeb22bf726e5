"""Exact blockwise negative statistics: the [M, K] similarity matrix is never held whole.

Anchors a [M, D] and candidates b [K, D] give the logits L = scale a b^T, some (anchor, candidate) pairs
excluded (an anchor's own sample). The score objectives need only, per anchor,

- lse_i = log sum_k exp(L_ik) over valid k: the denominator of InfoNCE, DCL (Eq. 6), DCLW, EqCo;
- mean_i = sum_k softmax(L_i)_k L_ik / scale: the softmax-weighted cosine of CACR's repulsion (Sec. 3.2).

Forward walks over blocks of anchors keeping only per-row statistics; backward recomputes each block
(one more matrix product), so the extra memory is O(block K) instead of O(M K). Up to ``keep`` entries
of blocks are kept instead (no extra product), the first blocks in order. Faster still, where the
caller knows d loss / d lse_i (and mean_i) as soon as row i is done (``row_grad``: every objective here,
whose loss is a mean of per-anchor terms), forward does backward's two products on each block while
it is in cache, for that guessed gradient, and keeps nothing; backward checks that the gradient it
receives is the guess times a constant (the mean's 1 / M, gradient accumulation, a loss scaler) and
otherwise recomputes every block: a wrong guess costs time, never exactness. Gradients, with
p = softmax(L_i):

    d lse_i / dL_ik = p_ik,    d mean_i / dL_ik = p_ik (1 + L_ik - scale mean_i) / scale,

then dA = scale dL b, dB = scale dL^T a (= dL^T (scale a)), and d scale = <dL, a b^T> - sum_i g_mean_i mean_i / scale.

``columns=True`` (image-text on one process: a square matrix whose excluded pairs are its diagonal) also
gives the statistics of every column, so both directions of CLIP's loss come from one product.

Two implementations. The fast one shifts each row by the largest logit of a sample of its candidates,
folded into the product as one more column ([a, -shift] [b, 1]^T), so a block costs one exp and one
sum; in backward the row's 1 / sum folds into the small factors and the kept block goes straight into
the two products. CACR's mean costs one more product (sum_k p_ik L_ik = a_i . (p b)_i, scale folded).
The shift is a lower bound of the row's maximum, so the row's sum is at least 1 and cannot underflow;
it could overflow only if the sample missed the maximum by some 80 logits, and then (checked once per
call) the call is redone by the safe implementation: the exact maximum of each block, as a dense
logsumexp would. The image-text columns have their own check (see _fast_columns). The safe one also
serves the columns' mean, which the losses do not use (image-text CACR takes each direction as rows).
"""

from __future__ import annotations

import math
import threading

import torch

# Excluded pairs get a finite, hugely negative logit: exp() of it is exactly 0, and unlike -inf it never
# makes 0 * inf = NaN in the mean or its gradient.
_EXCLUDED_FRACTION = 0.25
# Candidates per row whose largest logit sets the fast path's shift.
SAMPLE = 64


def _excluded(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min * _EXCLUDED_FRACTION


def _put_excluded(block, exclude, r0, r1, value=None):
    """Set the excluded pairs of rows r0:r1 (exclude [M, E] column indices) to ``value`` (default: the
    excluded logit), in place."""
    if exclude is not None:
        rows = torch.arange(r1 - r0, device=block.device)[:, None].expand(-1, exclude.shape[1])
        value = _excluded(block.dtype) if value is None else value
        block.index_put_((rows.reshape(-1), exclude[r0:r1].reshape(-1)), block.new_tensor(value))
    return block


def _block_logits(a_s, b, exclude, r0, r1, out=None):
    return _put_excluded(torch.mm(a_s[r0:r1], b.T, out=out), exclude, r0, r1)


def _block_grads(dl, b, a_s, r0, r1, d_as, db_t, factor=None):
    """Backward's two products for the block rows r0:r1 with d/dL = diag(factor) dl: d_as[r0:r1] = that
    times b, and db_t (b's gradient, transposed: faster products) += a_s[r0:r1]^T times that. The row
    factor folds into the [rows, D] operands, so dl is never scaled."""
    torch.mm(dl, b, out=d_as[r0:r1])
    rows = a_s[r0:r1]
    if factor is not None:
        d_as[r0:r1] *= factor[:, None]
        rows = rows * factor[:, None]
    db_t.addmm_(rows.T, dl)


def _sampled_max(a_s, b, exclude):
    """Per row, the largest valid logit among every stride-th candidate: a lower bound of the row's maximum."""
    stride = max(1, b.shape[0] // SAMPLE)
    logits = a_s @ b[::stride].T
    if exclude is not None:
        hit = exclude % stride == 0  # excluded candidates that are in the sample
        rows = torch.arange(a_s.shape[0], device=a_s.device)[:, None].expand_as(exclude)
        logits.index_put_((rows[hit], exclude[hit] // stride), logits.new_tensor(_excluded(logits.dtype)))
    return _operand_exact(logits.amax(dim=1))


def _operand_exact(shift):
    """The shift rounded to 8 significant bits (a bfloat16 value, so a TF32 one too). It enters the matrix
    product as an operand, and a product in TF32 (torch.backends.cuda.matmul.allow_tf32) rounds its
    operands to 11 bits: rounded first, it is subtracted exactly, the very shift that lse adds back.
    Any value near the row's maximum serves as a shift."""
    return shift.to(torch.bfloat16).to(shift.dtype)


def host_checks_allowed(x: torch.Tensor) -> bool:
    """Whether a call may read values of x's device on the host: in eager CPU calls only. There it costs
    nothing; on a GPU each read stalls the pipeline, and under torch.compile it breaks the graph."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def _with_shift(x, shift):
    """[x, -shift]: one product with [b, 1] then gives the logits minus each row's shift."""
    return torch.cat([x, -shift[:, None]], dim=1)


def _ones_column(x):
    return torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)


def _blocks(m, k, block, keep):
    """(r0, r1, kept) for each block of rows: the first blocks kept while their entries fit in ``keep``."""
    kept = 0
    for r0 in range(0, m, block):
        r1 = min(r0 + block, m)
        kept += (r1 - r0) * k
        yield r0, r1, kept <= keep


# Scratch blocks on CPU are cached per thread between calls: fresh memory costs page faults there (some
# 20 ms per 64 MiB on a 2-core VM, a quarter of a block's product at D = 128), which CUDA's caching
# allocator already avoids. A buffer is only ever used inside one forward or backward body, never
# returned or saved, and those bodies do not nest.
_WORKSPACE = threading.local()
_WORKSPACE_MAX_BYTES = 2**26


class _Scratch:
    """A reusable [block, K] buffer named ``slot``, fetched on first use."""

    def __init__(self, slot, block, k, like):
        self.slot, self.shape, self.like, self.buffer = slot, (block, k), like, None

    def __call__(self, rows=None):
        if self.buffer is None:
            self.buffer = _workspace(self.slot, self.shape, self.like)
        return self.buffer if rows is None else self.buffer[:rows]


def clear_workspace() -> None:
    """Free this thread's cached scratch blocks (they are fetched again on the next call)."""
    _WORKSPACE.__dict__.clear()


def _workspace(slot, shape, like):
    numel = shape[0] * shape[1]
    if like.device.type != "cpu" or numel * like.element_size() > _WORKSPACE_MAX_BYTES:
        return like.new_empty(shape)
    cache = _WORKSPACE.__dict__
    flat = cache.get((slot, like.dtype))
    if flat is None or flat.numel() < numel:
        flat = cache[(slot, like.dtype)] = like.new_empty(numel)
    return flat[:numel].view(shape)


class _BlockStats(torch.autograd.Function):
    """Rows [lse, (mean)] and, with columns, [col lse, (col mean)] stacked into one [S, M] tensor."""

    @staticmethod
    def forward(ctx, a, b, scale, exclude, block, with_mean, columns, keep, row_grad, symmetric):
        # b None: two views on one process, the anchors are the candidates. Passed once, as torch.compile
        # cannot trace a Function given one tensor twice; backward returns the summed gradient as a's.
        ctx.same_input = b is None
        b = a if ctx.same_input else b
        if not any(ctx.needs_input_grad[:3]):  # no backward (e.g. under no_grad): nothing to keep or guess
            keep, row_grad = 0, None
        # The fast path's checks (overflow, the columns' error bound) and backward's check of the guess read
        # values on the host; elsewhere (CUDA, torch.compile) the safe path runs, exact with no check.
        fast = host_checks_allowed(a)
        state, a_s = None, a * scale if fast else None  # the safe path scales each block's rows (no [M, D] copy)
        if fast and columns and not with_mean:
            state = _fast_columns(a_s, b, exclude, block, keep)
        elif fast and not columns:
            state = _fast_rows(a_s, b, exclude, block, keep, scale if with_mean else None, row_grad)
        ctx.fast = state is not None
        ctx.symmetric = symmetric and ctx.same_input and not ctx.fast and not columns
        spec = ()
        if ctx.fast:
            stats, shifts, norms, kept, *spec = state
        else:
            stats, kept = _safe_forward(a, b, scale, exclude, block, with_mean, columns, keep)
            shifts = norms = None
        ctx.block, ctx.with_mean, ctx.columns, ctx.n_spec = block, with_mean, columns, len(spec)
        ctx.scale_is_tensor = isinstance(scale, torch.Tensor)
        # The kept blocks are saved tensors too, so autograd frees them once backward has run (a Python
        # attribute would hold them until the loss tensor dies: through the next step's forward).
        ctx.save_for_backward(a, None if ctx.same_input else b, stats, exclude, scale if ctx.scale_is_tensor else None,
                              shifts, norms, *spec, *kept)
        if not ctx.scale_is_tensor:
            ctx.scale = scale
        return stats

    @staticmethod
    def backward(ctx, grad):
        a, b, stats, exclude, scale_t, shifts, norms, *rest = ctx.saved_tensors
        b = a if ctx.same_input else b
        spec, kept = rest[: ctx.n_spec], rest[ctx.n_spec :]
        scale = scale_t if ctx.scale_is_tensor else ctx.scale
        need_a, need_b, need_scale = ctx.needs_input_grad[:3]
        if not (need_a or need_b or need_scale):
            return (None,) * 10
        ratio = _upstream_ratio(grad, spec[0]) if spec else None
        if ratio is not None:  # the gradient guessed in forward, times the upstream's scale
            return _finish(ctx, grad, a, stats, scale, spec[1], spec[2], ratio)
        a_s = a * scale if ctx.fast else None
        if ctx.fast and ctx.columns:
            d_as, db_t = _fast_columns_backward(a_s, b, exclude, ctx.block, kept, shifts, norms, grad)
        elif ctx.fast:
            d_as, db_t = _fast_rows_backward(a_s, b, exclude, ctx.block, kept, shifts, norms, grad,
                                             stats if ctx.with_mean else None, scale)
        else:
            d_as, db_t = _safe_backward(a, b, exclude, ctx.block, kept, stats, grad, scale, ctx.with_mean,
                                        ctx.columns, ctx.symmetric)
        return _finish(ctx, grad, a, stats, scale, d_as, db_t)


def _finish(ctx, grad, a, stats, scale, d_as, db_t, ratio=None):
    """Backward's results from d a_s (the scaled anchors' gradient) and d b^T (db_t, the layout of the
    faster products), both times ``ratio`` when they are forward's guess (saved tensors, so never changed
    in place; None: computed by backward, and scaled in place). When one tensor is both anchors and
    candidates (two views on one process) its gradient is the sum, returned once (autograd would add
    the two). The transposed copy comes first: elementwise ops reading db_t.T took up to twice as long.
    Symmetric (see _safe_backward): d_as is (dL + dL^T) b, the whole gradient over scale, and db_t None."""
    need_a, need_b, need_scale = ctx.needs_input_grad[:3]
    guessed, ratio = ratio is not None, 1.0 if ratio is None else ratio
    d_scale = None
    if need_scale:
        d_scale = (d_as * a).sum() * (0.5 if ctx.symmetric else ratio)  # <dL, a b^T> = <dL + dL^T, a a^T> / 2
        if ctx.with_mean:  # mean = sum p L / scale: its own 1 / scale
            d_scale = d_scale - (grad[1] * stats[1]).sum() / scale
            if ctx.columns:
                d_scale = d_scale - (grad[3] * stats[3]).sum() / scale
        d_scale = d_scale.reshape(scale.shape)
    d_a = db = None
    if need_a:
        d_a = d_as * (scale * ratio) if guessed else d_as.mul_(scale)
        # No add(..., alpha=scale): inductor (2.9.1, 2.14.1, CPU) turns add(c, a @ b, alpha=s) into addmm, alpha lost.
        if ctx.same_input and not ctx.symmetric:
            d_a = _times(_transposed(db_t), ratio).add_(d_a)
    if need_b and not ctx.same_input:
        db = _times(_transposed(db_t), ratio)
    return d_a, db, d_scale, None, None, None, None, None, None, None


def _transposed(x):
    """A contiguous copy of x^T (never a view of x: it is changed in place next), as collectives need:
    gloo's all_gather backward mishandles other layouts."""
    return x.T.clone(memory_format=torch.contiguous_format)


def _times(x, ratio):
    return x if ratio == 1.0 else x.mul_(ratio)


def _upstream_ratio(grad, guess):
    """c such that grad = c * guess up to float rounding (the loss scaled by a constant: a mean, gradient
    accumulation, a loss scaler), else None. Computed in float64, so the sums' rounding stays far below
    the tolerance (some 16 units in the last place of the inputs' dtype)."""
    tolerance = 2**-20 if grad.dtype != torch.float64 else 2**-48
    grad, guess = grad.double(), guess.double()
    norm2 = (guess * guess).sum()
    c = (grad * guess).sum() / norm2 if bool(norm2 > 0) else norm2
    if bool((grad - c * guess).abs().max() <= tolerance * grad.abs().max()):
        return c.item()
    return None


# ----------------------------------------------------------------------------- fast: sampled shifts


def _fast_rows(a_s, b, exclude, block, keep, mean_scale=None, row_grad=None):
    """Row lse (and with ``mean_scale``, the scale, CACR's mean) with sampled shifts. Returns (stats [S, M],
    shifts, norms, kept, *guess), or None to use the safe path. Backward's blocks are exp(L - shift) / norm:
    kept, or recomputed with shift = lse and norm = 1 (for those rows). For the mean, sum_k p_ik L_ik =
    a_s_i . (p b)_i costs one product [rows, K] x [K, D] instead of a pass over L; the blocks kept are
    then L - shift.

    ``row_grad(stats_rows [S, rows], r0, r1)``: the loss's derivative d loss / d stats for rows r0:r1,
    known once their block is done (the objectives whose loss is a mean of per-anchor terms). Backward's
    two products are then done here, while the block is in cache, for the gradient this guess gives:
    ``guess`` is (d loss / d stats [S, M], d a_s [M, D], d b^T [D, K]), no block is kept, and backward
    only checks that its gradient is this one times a constant (or recomputes every block)."""
    m, k = a_s.shape[0], b.shape[0]
    with_mean = mean_scale is not None
    shift = _sampled_max(a_s, b, exclude)
    a_aug, b_aug = _with_shift(a_s, shift), _ones_column(b)
    norm, kept = a_s.new_empty(m), []
    weighted = a_s.new_empty(m) if with_mean else None  # sum_k e_ik L_ik
    scratch = _Scratch("block", min(block, m), k, a_s)
    exp_buf = _Scratch("exp", min(block, m), k, a_s)() if with_mean else None
    if row_grad is not None:
        keep, g = 0, a_s.new_empty(2 if with_mean else 1, m)
        d_as, db_t = torch.empty_like(a_s), b.new_zeros(b.shape[1], k)  # db transposed: faster products
        dl_buf = _Scratch("grad", min(block, m), k, a_s)() if with_mean else None
    for r0, r1, keep_block in _blocks(m, k, block, keep):
        z = _block_logits(a_aug, b_aug, exclude, r0, r1, out=None if keep_block else scratch(r1 - r0))
        e = torch.exp(z, out=exp_buf[: r1 - r0]) if with_mean else z.exp_()
        torch.sum(e, dim=1, out=norm[r0:r1])
        if with_mean:
            weighted[r0:r1] = (a_s[r0:r1] * (e @ b)).sum(dim=1)
        if row_grad is not None:
            lse = shift[r0:r1] + torch.log(norm[r0:r1])
            if with_mean:
                mean = weighted[r0:r1] / norm[r0:r1] / mean_scale
                g[:, r0:r1] = row_grad(torch.stack([lse, mean]), r0, r1)
                dl = _mean_dlogits(z, e, g[0, r0:r1], g[1, r0:r1], shift[r0:r1], mean, norm[r0:r1], mean_scale,
                                   dl_buf[: r1 - r0], exclude, r0, r1)
                _block_grads(dl, b, a_s, r0, r1, d_as, db_t)
            else:
                g[:, r0:r1] = row_grad(lse[None], r0, r1)
                _block_grads(e, b, a_s, r0, r1, d_as, db_t, g[0, r0:r1] / norm[r0:r1])  # d lse / d L = e / norm
        if keep_block:
            kept.append(z if with_mean else e)
    if not bool(torch.isfinite(norm).all() & (norm > 0).all()):
        return None  # the sample missed a row's maximum by ~80 logits: the safe path
    lse = shift + torch.log(norm)
    stats = torch.stack([lse, weighted / norm / mean_scale]) if with_mean else lse[None]
    done = min(len(kept) * block, m)  # rows recomputed in backward: shift = lse, norm = 1
    shift[done:], norm[done:] = lse[done:], 1.0
    guess = (g, d_as, db_t) if row_grad is not None else ()
    return stats, shift, norm, kept, *guess


def _mean_dlogits(z, e, g, g_mean, shift, mean, norm, scale, out, exclude, r0, r1):
    """d/dL of lse and mean for a block with the mean: e (alpha_i + beta_i z_ik), z = L - shift (module
    docstring's gradients), e = exp(z), norm the row sums."""
    beta = g_mean / scale / norm
    alpha = (g + g_mean / scale * (1.0 + shift - scale * mean)) / norm
    dl = torch.mul(z, beta[:, None], out=out).add_(alpha[:, None]).mul_(e)
    return _put_excluded(dl, exclude, r0, r1, 0.0)  # excluded: e = 0 times a huge z (possibly inf: NaN)


def _fast_rows_backward(a_s, b, exclude, block, kept, shifts, norms, grad, stats=None, scale=None):
    m, k = a_s.shape[0], b.shape[0]
    d_as, db_t = torch.empty_like(a_s), b.new_zeros(b.shape[1], b.shape[0])  # db transposed: faster products
    recomputed = len(kept) * block < m  # only then the shifted operands and a scratch block
    a_aug, b_aug = (_with_shift(a_s, shifts), _ones_column(b)) if recomputed else (None, None)
    scratch = _Scratch("block", min(block, m), k, a_s)
    if stats is None:
        factor = grad[0] / norms  # d lse / d L = exp(L - shift) / norm
        for i, r0 in enumerate(range(0, m, block)):
            r1 = min(r0 + block, m)
            e = kept[i] if i < len(kept) else _block_logits(a_aug, b_aug, exclude, r0, r1, out=scratch(r1 - r0)).exp_()
            _block_grads(e, b, a_s, r0, r1, d_as, db_t, factor[r0:r1])
        return d_as, db_t
    exp_buf, dl_buf = _Scratch("exp", min(block, m), k, a_s)(), _Scratch("grad", min(block, m), k, a_s)()
    for i, r0 in enumerate(range(0, m, block)):
        r1 = min(r0 + block, m)
        z = kept[i] if i < len(kept) else _block_logits(a_aug, b_aug, exclude, r0, r1, out=scratch(r1 - r0))
        e = torch.exp(z, out=exp_buf[: r1 - r0])
        dl = _mean_dlogits(z, e, grad[0, r0:r1], grad[1, r0:r1], shifts[r0:r1], stats[1, r0:r1], norms[r0:r1],
                           scale, dl_buf[: r1 - r0], exclude, r0, r1)
        _block_grads(dl, b, a_s, r0, r1, d_as, db_t)
    return d_as, db_t


# Fast columns: row i's block entries e_ij = exp(L_ij - shift_i) also give the columns' sums, as
# sum_i e_ij x_i with x_i = exp(shift_i - C) per block (C: the block's largest shift minus _X_RANGE).
# Each product is exact unless it underflows, so a block's column sums are off by at most
# tiny * (2 rows + the row sums of rows whose x underflowed), times e^C: the call's bound is the sum of
# these, and every column must exceed it 2^24 times, else the call is redone by the safe path.
_X_RANGE = 16.0  # x_i <= e^16
_ROW_RANGE = 64.0  # row sums <= e^64 (the sample missed the row's maximum by at most 64 logits): e x <= e^80
_MARGIN = 17.0  # columns exceed the bound by e^17 > 2^24


def _column_factors(shift, r0, r1):
    top = shift[r0:r1].max() - _X_RANGE
    return top, torch.exp(shift[r0:r1] - top)


def _fast_columns(a_s, b, exclude, block, keep):
    """Row and column lse of a square matrix, one exp per entry (see above). Returns (stats [2, M],
    shift, norms, kept) or None. ``norms`` holds the row sums then the column lse."""
    m, k = a_s.shape[0], b.shape[0]
    shift = _sampled_max(a_s, b, exclude)
    a_aug, b_aug = _with_shift(a_s, shift), _ones_column(b)
    norm, col_lse, kept = a_s.new_empty(m), a_s.new_full((k,), float("-inf")), []
    error = a_s.new_tensor(float("-inf"))  # log of the bound on every column's sum
    tiny = torch.finfo(a_s.dtype).tiny
    scratch = _Scratch("block", min(block, m), k, a_s)
    for r0, r1, keep_block in _blocks(m, k, block, keep):
        e = _block_logits(a_aug, b_aug, exclude, r0, r1, out=None if keep_block else scratch(r1 - r0)).exp_()
        torch.sum(e, dim=1, out=norm[r0:r1])
        top, x = _column_factors(shift, r0, r1)
        col_lse = torch.logaddexp(col_lse, top + torch.log(e.T @ x))
        lost = 2 * (r1 - r0) + torch.where(x < 2**24 * tiny, norm[r0:r1], 0).sum()
        error = torch.logaddexp(error, top + torch.log(lost * tiny))
        if keep_block:
            kept.append(e)
    ok = torch.isfinite(norm).all() & (norm > 0).all() & (norm <= math.exp(_ROW_RANGE)).all()
    if not bool(ok & (col_lse >= error + _MARGIN).all()):
        return None
    stats = torch.stack([shift + torch.log(norm), col_lse])
    return stats, shift, torch.cat([norm, col_lse]), kept


def _fast_columns_backward(a_s, b, exclude, block, kept, shift, norms, grad):
    m, k = a_s.shape[0], b.shape[0]
    norm, col_lse = norms[:m], norms[m:]
    f_r = grad[0] / norm
    d_as, db_t = torch.empty_like(a_s), b.new_zeros(b.shape[1], b.shape[0])  # db transposed: faster products
    recomputed = len(kept) * block < m  # only then the shifted operands and a scratch block
    a_aug, b_aug = (_with_shift(a_s, shift), _ones_column(b)) if recomputed else (None, None)
    scratch = _Scratch("block", min(block, m), k, a_s)
    dl_buf = _Scratch("grad", min(block, m), k, a_s)()
    for i, r0 in enumerate(range(0, m, block)):
        r1 = min(r0 + block, m)
        e = kept[i] if i < len(kept) else _block_logits(a_aug, b_aug, exclude, r0, r1, out=scratch(r1 - r0)).exp_()
        top, x = _column_factors(shift, r0, r1)
        # d/dL_ij: e_ij (f_r_i + x_i g_c_j exp(top - col_lse_j)), the second factor the column's softmax.
        dl = torch.outer(x, grad[1] * torch.exp(top - col_lse), out=dl_buf[: r1 - r0]).add_(f_r[r0:r1, None]).mul_(e)
        _block_grads(dl, b, a_s, r0, r1, d_as, db_t)
    return d_as, db_t


# ----------------------------------------------------------------------------- safe: exact maxima, CACR's mean


def _scaled_logits(a, scale, b, exclude, r0, r1):
    """The block's logits, its rows of a scaled on the way (no scaled copy of the whole of a)."""
    return _put_excluded(torch.mm(a[r0:r1] * scale, b.T), exclude, r0, r1)


def _safe_forward(a, b, scale, exclude, block, with_mean, columns, keep):
    """Each block's exact row maximum (and the columns' running maximum); the logits kept or not. No value
    is read on the host: the path of CUDA and torch.compile. At most two blocks live at a time."""
    m, k = a.shape[0], b.shape[0]
    stats = a.new_empty(((2 if with_mean else 1) * (2 if columns else 1), m))
    lse, mean = stats[0], stats[1] if with_mean else None
    if columns:
        col_max = a.new_full((k,), float("-inf"))
        col_sum, col_wsum = a.new_zeros(k), a.new_zeros(k)
    kept = []
    for r0, r1, keep_block in _blocks(m, k, block, keep):
        logits = _scaled_logits(a, scale, b, exclude, r0, r1)
        lse[r0:r1] = torch.logsumexp(logits, dim=1)
        if with_mean:
            mean[r0:r1] = torch.sub(logits, lse[r0:r1, None]).exp_().mul_(logits).sum(dim=1) / scale
        if columns:
            # Online logsumexp down the columns (and the softmax-weighted sum for the mean). A column whose
            # block holds only its excluded entry counts it once, but the first valid entry after it
            # rescales that by exp(excluded - valid) = 0, and every column has one.
            new_max = torch.maximum(col_max, logits.amax(dim=0))
            rescale = torch.exp(col_max - new_max)
            e = torch.sub(logits, new_max).exp_()
            col_sum.mul_(rescale).add_(e.sum(dim=0))
            if with_mean:
                col_wsum.mul_(rescale).add_(e.mul_(logits).sum(dim=0))
            col_max = new_max
        if keep_block:
            kept.append(logits)
        del logits  # before the next block's product: one block at a time
    if columns:
        col = 2 if with_mean else 1
        stats[col] = col_max + torch.log(col_sum)
        if with_mean:
            stats[col + 1] = col_wsum / col_sum / scale
    return stats, kept


def _safe_dlogits(logits, lse, grad, mean, grad_mean, scale, inplace=False):
    """Gradient of the statistics in one direction with respect to the block's logits: p (alpha + beta L),
    p = exp(L - lse), beta = g_mean / scale, alpha = g + beta (1 - scale mean) (module docstring). With
    ``inplace`` (a recomputed block) the result overwrites the logits: one block of temporaries fewer."""
    if mean is None:
        return (logits.sub_(lse) if inplace else logits - lse).exp_().mul_(grad)
    p = torch.exp(logits - lse)
    beta = grad_mean / scale
    alpha = grad + beta * (1.0 - scale * mean)
    return (logits.mul_(beta) if inplace else logits * beta).add_(alpha).mul_(p)


def _safe_backward(a, b, exclude, block, kept, stats, grad, scale, with_mean, columns, symmetric):
    """d a_s and d b^T, block by block. ``symmetric`` (two views on one process: b is a, and the excluded
    pairs are symmetric): L is symmetric, so the transposed term p_ki of each block is exp(L_ik - lse_k) and
    d a = scale (dL + dL^T) a comes row block by row block, one product each, with no [D, K] accumulator:
    d_as is then (dL + dL^T) b and db_t None (see _finish)."""
    col = 2 if with_mean else 1
    m = a.shape[0]
    d_as = torch.empty_like(a)
    db_t = None if symmetric else b.new_zeros(b.shape[1], b.shape[0])  # db transposed: faster products
    for i, r0 in enumerate(range(0, m, block)):
        r1 = min(r0 + block, m)
        recomputed = i >= len(kept)
        logits = _scaled_logits(a, scale, b, exclude, r0, r1) if recomputed else kept[i]
        other = None
        if columns or symmetric:  # the columns' term first, while the logits are intact
            c = col if columns else 0
            mean, g_mean = (stats[c + 1], grad[c + 1]) if with_mean else (None, None)
            other = _safe_dlogits(logits, stats[c], grad[c], mean, g_mean, scale)
        mean, g_mean = (stats[1, r0:r1, None], grad[1, r0:r1, None]) if with_mean else (None, None)
        dl = _safe_dlogits(logits, stats[0, r0:r1, None], grad[0, r0:r1, None], mean, g_mean, scale,
                           inplace=recomputed)
        if other is not None:
            dl = dl.add_(other)
            del other
        torch.mm(dl, b, out=d_as[r0:r1])
        if not symmetric:
            db_t.addmm_((a[r0:r1] * scale).T, dl)
        del logits, dl  # before the next block's product: two blocks at a time
    return d_as, db_t


def negative_stats(anchors: torch.Tensor, candidates: torch.Tensor, scale, *, exclude: torch.Tensor | None = None,
                   block: int, with_mean: bool = False, columns: bool = False, keep: int = 0,
                   row_grad=None, symmetric: bool = False):
    """Per-anchor statistics of the negatives' logits scale * anchors @ candidates.T, blockwise.

    anchors [M, D], candidates [K, D]; scale a float or a 0-dim tensor (gets its gradient); exclude
    [M, E] column indices left out of each anchor's row; block: anchors per block; keep: how many entries
    of the first blocks may be kept for backward (0: recompute every block). Returns a tensor
    [S, M]: lse, then mean (with_mean), then the columns' lse and mean (columns: a square matrix whose
    excluded pairs, if any, are its diagonal, exclude [M, 1] = arange(M)).

    row_grad (rows only): ``row_grad(stats_rows [S, rows], r0, r1)`` -> d loss / d stats of rows r0:r1,
    for a caller whose loss is a sum of per-row terms of the statistics: backward's products are then
    done in forward and no block is kept (see _fast_rows). A wrong guess costs time, never exactness.

    symmetric (rows only): the caller vouches that candidates is anchors and that k is excluded from row i
    exactly when i is from row k (two views on one process); the exact path's backward (CUDA, compiled)
    then takes one product per block instead of two, and no [D, K] accumulator (see _safe_backward).
    """
    if columns:
        m = anchors.shape[0]
        if candidates.shape[0] != m:
            raise ValueError(f"columns=True needs a square matrix, got {m} x {candidates.shape[0]}")
        if exclude is not None and host_checks_allowed(exclude) and not torch.equal(exclude, torch.arange(m, device=exclude.device)[:, None]):
            raise ValueError("columns=True supports excluding the diagonal only (exclude = arange(M)[:, None])")
    if block < 1:
        raise ValueError(f"block must be a positive number of anchors, got {block}")
    return _BlockStats.apply(anchors, None if candidates is anchors else candidates, scale, exclude, int(block),
                             with_mean, columns, int(keep), row_grad, symmetric)
