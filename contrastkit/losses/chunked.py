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

``normalize=True``: a and b are the raw features, in any float dtype; the kernel L2-normalises them, so that
the loss's settings (base.py) make no unit vectors of the features' size. The exact path keeps only the features as given and their inverse norms, builds each
block's unit rows on the way, and writes each row's gradient (negatives', positives' and the
normalisation's backward) once, in the features' dtype: nothing of the features' size in float32 lives
between forward and backward, nor during it, but image-text's [D, K] accumulator of d b
(docs/performance.md, memory). bf16/fp16 features enter the products as they are (see _mm_low).

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

import contextlib
import math
import threading
from typing import NamedTuple

import torch

from contrastkit.losses import plan, precision

# Excluded pairs get a finite, hugely negative logit: exp() of it is exactly 0, and unlike -inf it never
# makes 0 * inf = NaN in the mean or its gradient. -2^100, not near float32's limit: the mean's gradient
# multiplies it by g_mean / scale, which a loss scaler makes large (2^16 and up), and must not overflow.
EXCLUDED = -(2.0**100)
# Candidates per row whose largest logit sets the fast path's shift.
SAMPLE = 64


def _excluded(dtype: torch.dtype) -> float:
    return max(EXCLUDED, torch.finfo(dtype).min / 4)  # float16's range: a quarter of its most negative


class Excluded(NamedTuple):
    """The (anchor, candidate) pairs left out: ``columns`` [M, E], each anchor's excluded columns (or None), and
    by label (``row_ids`` [M], ``col_ids`` [K], or None): with ``same`` the pairs whose ids are equal (labels
    as false negatives), else those whose ids differ (the statistics over an anchor's same-label candidates)."""

    columns: torch.Tensor | None
    row_ids: torch.Tensor | None = None
    col_ids: torch.Tensor | None = None
    same: bool = True

    def label_hits(self, r0, r1, stride=1):
        """[r1 - r0, K'] bool: the pairs of rows r0:r1 and every stride-th candidate left out by label (a
        stride, not a slice argument: torch 2.9's dynamo cannot wrap a slice default)."""
        rows, cols = self.row_ids[r0:r1, None], self.col_ids[::stride][None]
        return rows == cols if self.same else rows != cols


def _put_excluded(block, exclude, r0, r1, value=None):
    """Set the excluded pairs of rows r0:r1 (an Excluded, or None) to ``value`` (default: the excluded
    logit), in place."""
    if exclude is None:
        return block
    value = _excluded(block.dtype) if value is None else value
    if exclude.columns is not None:
        index = exclude.columns
        rows = torch.arange(r1 - r0, device=block.device)[:, None].expand(-1, index.shape[1])
        block.index_put_((rows.reshape(-1), index[r0:r1].reshape(-1)), block.new_full((), value))
    if exclude.row_ids is not None:
        block.masked_fill_(exclude.label_hits(r0, r1), value)
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
    if exclude is not None and exclude.columns is not None:
        index = exclude.columns
        hit = index % stride == 0  # excluded candidates that are in the sample
        rows = torch.arange(a_s.shape[0], device=a_s.device)[:, None].expand_as(index)
        logits.index_put_((rows[hit], index[hit] // stride), logits.new_full((), _excluded(logits.dtype)))
    shift = logits.amax(dim=1)
    if exclude is not None and exclude.row_ids is not None:
        logits.masked_fill_(exclude.label_hits(0, a_s.shape[0], stride), _excluded(logits.dtype))
        # A row's candidates of its own label are few, and the sample often misses them all: then its shift is
        # the floor of every logit, -|a_i| max_k |b_k| (Cauchy-Schwarz), a lower bound of its maximum too.
        floor = -torch.linalg.vector_norm(a_s, dim=1) * torch.linalg.vector_norm(b, dim=1).amax()
        shift = torch.maximum(logits.amax(dim=1), floor)
    return _operand_exact(shift)


def _operand_exact(shift):
    """The shift rounded to 8 significant bits (a bfloat16 value, so a TF32 one too). It enters the matrix
    product as an operand, and a product in TF32 (torch.backends.cuda.matmul.allow_tf32) rounds its
    operands to 11 bits: rounded first, it is subtracted exactly, the very shift that lse adds back.
    Any value near the row's maximum serves as a shift."""
    return shift.to(torch.bfloat16).to(shift.dtype)


def no_autocast(device_type: str):
    """Autocast off on this device: the kernels choose each op's precision, in forward and in backward (which
    runs under the caller's autocast where backward() is called inside an autocast block). The meta device
    (tests/losses/test_memory.py) has no autocast; not through torch.amp.is_autocast_available, which torch 2.9's
    dynamo cannot trace. Where autocast is off already, no context (entering one costs ~8 us of host time per
    call, which counts at the small sizes where a GPU step is host-bound)."""
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


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


# ----------------------------------------------------------------------------- features: raw rows, unit rows

NORM_EPS = 1e-12  # F.normalize's default


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _inverse_norms(x):
    """(1 / max(||x_i||, eps), ||x_i|| >= eps) per row, in float32 (float64 for float64) whatever x's dtype."""
    norm = torch.linalg.vector_norm(x, dim=1, dtype=_compute_dtype(x))
    return 1.0 / norm.clamp_min(NORM_EPS), norm >= NORM_EPS


def _unit_rows(x, inv, _unclamped=None):
    """The unit rows x_i inv_i in float32 (float64), or x's rows as they are (in that dtype) without inv."""
    x = x.to(_compute_dtype(x))
    return x if inv is None else x * inv[:, None]


def drop_along(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None):
    """grad - x (grad . x) weight per row (grad, x [rows, D], weight [rows, 1]): the one formula of every
    backward of F.normalize here. The unit vectors' gradient loses its part along them, (grad - u <grad, u>)
    / ||x||: weight 1 with x = u, 1 / ||x||^2 with the features as given (the Triton path makes no unit
    vectors), 0 for a row whose norm was clamped to eps (a constant divisor, no projection)."""
    along = torch.linalg.vecdot(grad, x, dim=-1).unsqueeze(-1) * weight
    return torch.addcmul(grad, x, along, value=-1.0, out=out)


def _unit_backward(grad, u, inv, unclamped):
    """The features' gradient from their unit vectors' (u = x inv): (grad - u <grad, u>) inv, rows whose norm
    was clamped only grad inv (as functional.normalize_rows); grad itself without normalisation."""
    return grad if inv is None else drop_along(grad, u, unclamped[:, None]).mul_(inv[:, None])


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
    def forward(ctx, a, b, scale, exclude, block, with_mean, columns, keep, row_grad, symmetric, normalize, row_ids,
                col_ids, same_ids, fast):
        # b None: two views on one process, the anchors are the candidates. Passed once, as torch.compile
        # cannot trace a Function given one tensor twice; backward returns the summed gradient as a's.
        ctx.same_input = b is None
        b = a if ctx.same_input else b
        ctx.dtypes = a.dtype, b.dtype
        if not any(ctx.needs_input_grad[:3]):  # no backward (e.g. under no_grad): nothing to keep or guess
            keep, row_grad = 0, None
        index, ctx.same_ids = exclude, same_ids
        exclude = None if index is None and row_ids is None else Excluded(index, row_ids, col_ids, same_ids)
        inv_a = _inverse_norms(a) if normalize else (None, None)
        inv_b = inv_a if ctx.same_input or not normalize else _inverse_norms(b)
        # The fast path's checks (overflow, the columns' error bound) and backward's check of the guess read
        # values on the host; elsewhere (CUDA, torch.compile) the safe path runs, exact with no check. The fast
        # path takes unit vectors, made whole (on the CPU memory is not what binds).
        state = None
        if fast and not (columns and with_mean):
            u_a = _unit_rows(a, *inv_a)
            u_b = u_a if ctx.same_input else _unit_rows(b, *inv_b)
            a_s = u_a * scale
            if columns:
                state = _fast_columns(a_s, u_b, exclude, block, keep)
            else:
                state = _fast_rows(a_s, u_b, exclude, block, keep, scale if with_mean else None, row_grad)
        ctx.fast = state is not None
        ctx.symmetric = symmetric and ctx.same_input and not ctx.fast and not columns
        spec = ()
        if ctx.fast:
            a, b = u_a, u_b
            stats, shifts, norms, kept, *spec = state
        else:
            stats, kept = _safe_forward(a, b, scale, exclude, block, with_mean, columns, keep, inv_a, inv_b)
            shifts = norms = None
        ctx.block, ctx.with_mean, ctx.columns, ctx.n_spec = block, with_mean, columns, len(spec)
        ctx.scale_is_tensor = isinstance(scale, torch.Tensor)
        # Saved: the features as given (the exact path; the fast path's unit vectors), per-row numbers, and
        # the kept blocks, as saved tensors too, so that autograd frees them once backward has run (a Python
        # attribute would hold them until the loss tensor dies: through the next step's forward).
        ctx.save_for_backward(a, None if ctx.same_input else b, stats, index, row_ids, col_ids,
                              scale if ctx.scale_is_tensor else None, shifts, norms, *inv_a, *inv_b, *spec, *kept)
        if not ctx.scale_is_tensor:
            ctx.scale = scale
        return stats

    @staticmethod
    def backward(ctx, grad):
        with no_autocast(grad.device.type):
            return _BlockStats._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        a, b, stats, index, row_ids, col_ids, scale_t, shifts, norms, *rest = ctx.saved_tensors
        b = a if ctx.same_input else b
        exclude = None if index is None and row_ids is None else Excluded(index, row_ids, col_ids, ctx.same_ids)
        inv_a, inv_b, rest = tuple(rest[:2]), tuple(rest[2:4]), rest[4:]
        spec, kept = rest[: ctx.n_spec], rest[ctx.n_spec :]
        scale = scale_t if ctx.scale_is_tensor else ctx.scale
        none = (None,) * 12
        if not any(ctx.needs_input_grad[:3]):
            return None, None, None, *none
        if not ctx.fast:
            return (*_safe_backward(ctx, a, b, exclude, kept, stats, grad, scale, inv_a, inv_b),
                    *none)
        ratio = _upstream_ratio(grad, spec[0]) if spec else None
        if ratio is not None:  # the gradient guessed in forward, times the upstream's scale
            d_a, db, d_scale = _finish(ctx, grad, a, stats, scale, spec[1], spec[2], ratio)
        else:
            a_s = a * scale
            if ctx.columns:
                d_as, db_t = _fast_columns_backward(a_s, b, exclude, ctx.block, kept, shifts, norms, grad)
            else:
                d_as, db_t = _fast_rows_backward(a_s, b, exclude, ctx.block, kept, shifts, norms, grad,
                                                 stats if ctx.with_mean else None, scale)
            d_a, db, d_scale = _finish(ctx, grad, a, stats, scale, d_as, db_t)
        d_a = None if d_a is None else _unit_backward(d_a, a, *inv_a).to(ctx.dtypes[0])
        db = None if db is None else _unit_backward(db, b, *inv_b).to(ctx.dtypes[1])
        return d_a, db, d_scale, *none


def _finish(ctx, grad, a, stats, scale, d_as, db_t, ratio=None):
    """The fast path's gradients of a, b (unit vectors) and the scale from d a_s (the scaled anchors'
    gradient) and d b^T (db_t, the layout of the faster products), both times ``ratio`` when they are
    forward's guess (saved tensors, so never changed in place; None: computed by backward, and scaled in
    place). When one tensor is both anchors and candidates (two views on one process) its gradient is the
    sum, returned once (autograd would add the two). The transposed copy comes first: elementwise ops
    reading db_t.T took up to twice as long."""
    need_a, need_b, need_scale = ctx.needs_input_grad[:3]
    guessed, ratio = ratio is not None, 1.0 if ratio is None else ratio
    d_scale = None
    if need_scale:
        d_scale = _mean_scale_grad(ctx, grad, stats, scale, (d_as * a).sum() * ratio)  # <dL, a b^T>
    d_a = db = None
    if need_a or (need_b and ctx.same_input):
        d_a = d_as * (scale * ratio) if guessed else d_as.mul_(scale)
        # No add(..., alpha=scale): inductor (2.9.1, 2.14.1, CPU) turns add(c, a @ b, alpha=s) into addmm, alpha lost.
        if ctx.same_input:
            d_a = _times(_transposed(db_t), ratio).add_(d_a)
    if need_b and not ctx.same_input:
        db = _times(_transposed(db_t), ratio)
    return d_a, db, d_scale


def _mean_scale_grad(ctx, grad, stats, scale, d_scale):
    """d scale from <dL, a b^T>, less the mean's own 1 / scale (mean = sum p L / scale), in scale's shape."""
    if ctx.with_mean:
        d_scale = d_scale - (grad[1] * stats[1]).sum() / scale
        if ctx.columns:
            d_scale = d_scale - (grad[3] * stats[3]).sum() / scale
    return d_scale.reshape(scale.shape)


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
    error = a_s.new_full((), float("-inf"))  # log of the bound on every column's sum
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


def _operand(x):
    """x as the exact path's products take it: itself in float32 or float64, and in bfloat16 or float16 where
    the device's product writes float32 from it (CUDA, which torch refuses for bfloat16 before sm_80,
    plan.ampere_or_later, and for float16 under precision.fp16_accumulation; the meta device, which
    counts memory), else a float32 copy (the CPU, and those two cases)."""
    if x.dtype in (torch.float32, torch.float64) or x.device.type == "meta":
        return x
    if x.device.type == "cuda" and (plan.ampere_or_later(x.device) if x.dtype == torch.bfloat16
                                    else not precision.fp16_accumulation()):
        return x
    return x.float()


def _low(x):
    return x.dtype in (torch.bfloat16, torch.float16)


def _mm_f32(x, y):
    """x @ y for bfloat16 or float16 operands, written in float32: exact products, float32 sums (CUDA's
    bf16/fp16 GEMM with out_dtype; the meta device gives its shape)."""
    return torch.mm(x, y, out_dtype=torch.float32)


def _mm_low(dl, x):
    """dl @ x for dl in float32 and x in bfloat16 or float16, in float32 with no float32 copy of x: dl split
    into hi + lo in x's dtype (16 significant bits in bf16, 22 in fp16: a relative error some 2^-17 per
    entry, far below the rounding of the bf16/fp16 gradient this makes), two products written in float32.
    fp16's range: each row of dl scaled by a power of two first (exact). Overwrites dl."""
    if not _low(x):
        return torch.mm(dl, x)
    row = None
    if x.dtype == torch.float16:
        row = torch.exp2(torch.floor(torch.log2(dl.abs().amax(dim=1).clamp_min(2.0**-100))))[:, None]
        dl.div_(row)
    hi = dl.to(x.dtype)
    lo = dl.sub_(hi).to(x.dtype)
    out = _mm_f32(hi, x)
    out += _mm_f32(lo, x)
    return out if row is None else out.mul_(row)


def _scaled_logits(xa, scale, xb, exclude, r0, r1, inv_a=None, inv_b=None):
    """The block's logits scale u_a u_b^T, u = x inv made on the way (no unit or scaled copy of the whole of
    a or b): the rows' factor folds into a's rows (float32/64) or scales the product (bf16/fp16, whose
    product is written in float32), the columns' inverse norms scale it."""
    row = scale if inv_a is None else inv_a[r0:r1, None] * scale
    if _low(xa):
        logits = _mm_f32(xa[r0:r1], xb.T).mul_(row)
    else:
        logits = torch.mm(xa[r0:r1] * row, xb.T)
    if inv_b is not None:
        logits.mul_(inv_b)
    return _put_excluded(logits, exclude, r0, r1)


def _safe_forward(a, b, scale, exclude, block, with_mean, columns, keep, inv_a, inv_b):
    """Each block's exact row maximum (and the columns' running maximum); the logits kept or not. No value is read on the host: the path of CUDA and torch.compile. At most two
    blocks live at a time, and on CUDA nothing of a's or b's size (the features are normalised per block;
    the CPU takes float32 copies of bf16/fp16 features, see _operand)."""
    m, k = a.shape[0], b.shape[0]
    xa = _operand(a)
    xb = xa if b is a else _operand(b)
    dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    stats = a.new_empty(((2 if with_mean else 1) * (2 if columns else 1), m), dtype=dtype)
    lse, mean = stats[0], stats[1] if with_mean else None
    if columns:
        col_max = stats.new_full((k,), float("-inf"))
        col_sum, col_wsum = stats.new_zeros(k), stats.new_zeros(k)
    kept = []
    for r0, r1, keep_block in _blocks(m, k, block, keep):
        logits = _scaled_logits(xa, scale, xb, exclude, r0, r1, inv_a[0], inv_b[0])
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


def _rows(x, r0, r1):
    return None if x is None else x[r0:r1]


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


def _safe_backward(ctx, a, b, exclude, kept, stats, grad, scale, inv_a, inv_b):
    """The exact path's gradients of a, b and the scale, row block by row block: the block's d/dL, its
    product with the unit candidates and the normalisation's backward, each row of
    d a written once in a's dtype. d b: scale dL^T u_a accumulated over the blocks ([D, K], float32), then
    normalised the same way. ``symmetric`` (two views on one process: b is a, and the excluded pairs are
    symmetric): L is symmetric, so the transposed term p_ki of each block is exp(L_ik - lse_k) and
    d u = scale (dL + dL^T) u comes row block by row block, one product each, with no [D, K] accumulator.
    Nothing else of a's or b's size is made but their gradients (on the CPU, see _operand)."""
    need_a, need_b, need_scale = ctx.needs_input_grad[:3]
    block, with_mean, columns, symmetric = ctx.block, ctx.with_mean, ctx.columns, ctx.symmetric
    col = 2 if with_mean else 1
    (m, d), k = a.shape, b.shape[0]
    xa = _operand(a)
    xb = xa if ctx.same_input else _operand(b)
    whole = ctx.same_input and not symmetric  # both shares of one tensor's gradient: summed before normalising
    d_a = None
    if whole:
        d_a = stats.new_empty(m, d)
    elif need_a:
        d_a = torch.empty_like(a)
    db_t = None if symmetric or not (need_b or whole) else stats.new_zeros(d, k)  # transposed: faster products
    d_scale = stats.new_zeros(())
    for i, (r0, r1, _) in enumerate(_blocks(m, k, block, 0)):
        recomputed = i >= len(kept)
        logits = _scaled_logits(xa, scale, xb, exclude, r0, r1, inv_a[0], inv_b[0]) if recomputed else kept[i]
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
        del logits
        u = _unit_rows(a[r0:r1], _rows(inv_a[0], r0, r1))
        if db_t is not None:
            db_t.addmm_((u * scale).T, dl)
        if inv_b[0] is not None:
            dl.mul_(inv_b[0])  # dL u_b = (dL inv_b) x_b
        g = _mm_low(dl, xb)  # (dL or dL + dL^T) u_b for these rows
        del dl  # before the next block's product: two blocks at a time
        if need_scale:
            d_scale += (g * u).sum()  # <dL, u_a u_b^T> over these rows
        if d_a is not None:
            g.mul_(scale)
            d_a[r0:r1] = g if whole else _unit_backward(g, u, *(_rows(x, r0, r1) for x in inv_a))
    d_scale = _mean_scale_grad(ctx, grad, stats, scale, d_scale * 0.5 if symmetric else d_scale) if need_scale else None
    if whole:
        d_a = _normalised_grad(d_a.add_(db_t.T), a, inv_a, block)
        return d_a, None, d_scale
    d_b = None
    if need_b and db_t is not None:
        d_b = _normalised_grad(db_t.T, b, inv_b, block)
    return d_a, d_b, d_scale


def _normalised_grad(g, x, inv, block):
    """The features' gradient, in x's dtype, from their unit vectors' (g [K, D], any layout), block by block."""
    out = torch.empty_like(x)
    for r0, r1, _ in _blocks(x.shape[0], 0, block, 0):
        u = _unit_rows(x[r0:r1], _rows(inv[0], r0, r1))
        out[r0:r1] = _unit_backward(g[r0:r1], u, *(_rows(t, r0, r1) for t in inv))
    return out


def negative_stats(anchors: torch.Tensor, candidates: torch.Tensor, scale, *, exclude: torch.Tensor | None = None,
                   block: int, with_mean: bool = False, columns: bool = False, keep: int = 0,
                   row_grad=None, symmetric: bool = False, normalize: bool = False,
                   labels: tuple[torch.Tensor, torch.Tensor] | None = None,
                   same_label: bool = True, fast: bool = False):
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

    normalize: anchors and candidates are raw features (any float dtype), L2-normalised inside; the exact
    path keeps only their inverse norms and normalises each block on the way, so nothing of their size is
    held between forward and backward, and their gradients come back in their own dtype.

    labels (rows only): (row_ids [M], col_ids [K]) integer ids; the pairs whose ids are equal are left out
    too (``same_label``: labels as false negatives), or with same_label=False those whose ids differ (the
    statistics over each anchor's same-label candidates). A row with every pair left out gets the
    statistics of the excluded logit (lse about -2^100: exp of it is 0); the fast path then hands the call
    to the safe one.

    fast: the fast implementation (sampled shifts, values checked on the host) where it serves, else the safe
    one alone (the default: no host reads, so it runs under torch.compile and on CUDA without a sync). The
    caller says whether host reads are free; the losses pass their plan's. Only a fast call has its
    ``exclude`` read on the host (columns: that it is the diagonal).
    """
    if columns and labels is not None:
        raise ValueError("columns=True takes no labels: give each direction as rows")
    if columns:
        m = anchors.shape[0]
        if candidates.shape[0] != m:
            raise ValueError(f"columns=True needs a square matrix, got {m} x {candidates.shape[0]}")
        if exclude is not None and (exclude.shape[1] != 1 or (fast and not torch.equal(
                exclude, torch.arange(m, device=exclude.device)[:, None]))):
            raise ValueError("columns=True supports excluding the diagonal only (exclude = arange(M)[:, None])")
    if block < 1:
        raise ValueError(f"block must be a positive number of anchors, got {block}")
    row_ids, col_ids = (None, None) if labels is None else labels
    if row_ids is not None and row_ids is col_ids:  # torch.compile cannot trace one tensor given twice
        col_ids = col_ids.clone()
    return _BlockStats.apply(anchors, None if candidates is anchors else candidates, scale, exclude, int(block),
                             with_mean, columns, int(keep), row_grad, symmetric, normalize, row_ids, col_ids,
                             bool(same_label), fast)
