"""Device helpers the kernels share: loads, the logits of a tile, its valid pairs, and d loss / d logits.

Anchors a [M, D], candidates b [K, D], logits L = scale a b^T. Excluded pairs get a finite, hugely negative
logit (as in chunked.py): exp() of it is 0 and, unlike -inf, it never meets -inf - (-inf) in an online
maximum. With dL = d loss / dL (chunked.py's docstring) and the statistics of the rows (lse, mean) and of
the columns (clse):

    dL_ik = p_ik (g_i + g_mean_i (1 + L_ik - scale mean_i) / scale) + q_ik gc_k,
    p_ik = exp(L_ik - lse_i),   q_ik = exp(L_ik - clse_k).
"""

from __future__ import annotations

import triton
import triton.language as tl

EXCLUDED = tl.constexpr(-(2.0**100))  # chunked.EXCLUDED: its reason there
# A tile whose every column's maximum is within WINDOW of the tile's maximum takes one exp per logit for
# the rows' and the columns' terms alike (tile_exp); a term it then drops is below e^(WINDOW - 87) = e^-47
# of its row's or column's largest.
WINDOW = tl.constexpr(40.0)


@triton.jit
def dot(x, y, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """x @ y + acc in float32. UPCAST (Triton 3.5's interpreter only, which multiplies bfloat16's raw bits):
    bfloat16 operands as float32, the exact products the tensor cores form."""
    if UPCAST:
        x = x.to(tl.float32)
        y = y.to(tl.float32)
    return tl.dot(x, y, acc, input_precision=PRECISION)


@triton.jit
def load_rows(ptr, rows, n, d, D: tl.constexpr, s_r, s_d):
    """x[rows, d] of an [n, D] matrix with strides (s_r, s_d); zeros outside it."""
    return tl.load(ptr + rows[:, None] * s_r + d[None, :] * s_d, mask=(rows[:, None] < n) & (d[None, :] < D),
                   other=0.0)


@triton.jit
def dots(x_ptr, y_ptr, x_tile, rows, cols, n_x, n_y, D: tl.constexpr, s_xr, s_xd, s_yr, s_yd,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
         UPCAST: tl.constexpr):
    """x[rows] y[cols]^T in float32. x_tile: x[rows] loaded once by the caller where BLOCK_D covers D (the
    row tile resident over the whole loop), else the D loop loads it chunk by chunk."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCK_D >= D:
        d = tl.arange(0, BLOCK_D)
        acc = dot(x_tile, tl.trans(load_rows(y_ptr, cols, n_y, d, D, s_yr, s_yd)), acc, PRECISION, UPCAST)
    else:
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            x = load_rows(x_ptr, rows, n_x, d, D, s_xr, s_xd)
            acc = dot(x, tl.trans(load_rows(y_ptr, cols, n_y, d, D, s_yr, s_yd)), acc, PRECISION, UPCAST)
    return acc


@triton.jit
def resident(x_ptr, rows, n_x, D: tl.constexpr, s_xr, s_xd, BLOCK_D: tl.constexpr):
    """The row tile x[rows] when BLOCK_D covers D (see dots), else nothing to keep."""
    x = None
    if BLOCK_D >= D:
        x = load_rows(x_ptr, rows, n_x, tl.arange(0, BLOCK_D), D, s_xr, s_xd)
    return x


@triton.jit
def inverse_norms(inv_ptr, index, n, NORMALIZE: tl.constexpr):
    """The inverse norms (float32) of the rows ``index`` where NORMALIZE: the kernels then take the features as
    given and scale their products to cosines (issue 40: no unit vectors made), else nothing."""
    inv = None
    if NORMALIZE:
        inv = tl.load(inv_ptr + index, mask=index < n, other=0.0)
    return inv


@triton.jit
def scaled(tile, inv_rows, inv_cols, NORMALIZE: tl.constexpr):
    """tile * inv_rows[:, None] * inv_cols[None, :] where NORMALIZE, else the tile."""
    if NORMALIZE:
        tile = tile * inv_rows[:, None] * inv_cols[None, :]
    return tile


@triton.jit
def valid(ex_ptr, anchors, cands, M, K, E: tl.constexpr, ANCHORS_ON_ROWS: tl.constexpr):
    """The tile's pairs inside the matrix and not excluded (exclude [M, E] column indices, contiguous), the
    anchors on the tile's rows or on its columns."""
    if ANCHORS_ON_ROWS:
        ok = (anchors[:, None] < M) & (cands[None, :] < K)
    else:
        ok = (cands[:, None] < K) & (anchors[None, :] < M)
    for e in tl.static_range(E):
        index = tl.load(ex_ptr + anchors * E + e, mask=anchors < M, other=-1)
        if ANCHORS_ON_ROWS:
            ok = ok & (cands[None, :] != index[:, None])
        else:
            ok = ok & (cands[:, None] != index[None, :])
    return ok


@triton.jit
def kept_by_label(anchor_ids_ptr, cand_ids_ptr, anchors, cands, M, K, LABELS: tl.constexpr,
                  ANCHORS_ON_ROWS: tl.constexpr):
    """The tile's pairs kept by the samples' integer ids (issue 41's labels): LABELS 1 leaves out the pairs
    whose ids are equal (same-label candidates, false negatives), 2 those whose ids differ (the statistics
    over each anchor's same-label candidates); anchors on the tile's rows or on its columns."""
    a = tl.load(anchor_ids_ptr + anchors, mask=anchors < M, other=-1)
    c = tl.load(cand_ids_ptr + cands, mask=cands < K, other=-1)
    if ANCHORS_ON_ROWS:
        equal = a[:, None] == c[None, :]
    else:
        equal = c[:, None] == a[None, :]
    if LABELS == 1:
        kept = equal == 0
    else:
        kept = equal
    return kept


@triton.jit
def tile_exp(s, cols, end):
    """(e, t, T, ok): e = exp(s - t) with t each row's maximum on the tile, T the tile's maximum, and ok
    whether every column (of those < end) has its maximum within WINDOW of T. Then exp(s_ik - c_k) for any
    c_k >= the column's maximum is e_ik exp(t_i - T) exp(T - c_k), both factors in float32's range: one
    exp per logit serves the rows' and the columns' terms (the exp unit, 16 per clock and SM, is the
    tensor cores' bottleneck in such kernels: FlashAttention-3, Sec. 3)."""
    t = tl.max(s, axis=1)
    top = tl.max(s, axis=0)
    T = tl.max(t, axis=0)
    low = tl.min(tl.where(cols < end, top, T), axis=0)
    return tl.exp(s - t[:, None]), t, T, T - low <= WINDOW


@triton.jit
def across(v, ON_ROWS: tl.constexpr):
    """A per-row ([n, 1]) or per-column ([1, n]) operand of a tile from a vector (no early return: Triton
    generates the code after one, and checks its shapes)."""
    if ON_ROWS:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def anchor_dlogits(s, anchors, M, stats_ptr, grad_ptr, scale, WITH_MEAN: tl.constexpr,
                   ANCHORS_ON_ROWS: tl.constexpr):
    """p (g + g_mean (1 + L - scale mean) / scale) on a tile, from the anchors' statistics [S, M] and their
    (normalised) gradient, the anchors on the tile's rows or on its columns."""
    lse = across(tl.load(stats_ptr + anchors, mask=anchors < M, other=0.0), ANCHORS_ON_ROWS)
    return tl.exp(s - lse) * anchor_grad(s, anchors, M, stats_ptr, grad_ptr, scale, WITH_MEAN, ANCHORS_ON_ROWS)


@triton.jit
def anchor_grad(s, anchors, M, stats_ptr, grad_ptr, scale, WITH_MEAN: tl.constexpr, ANCHORS_ON_ROWS: tl.constexpr):
    """anchor_dlogits without its p: g + g_mean (1 + L - scale mean) / scale."""
    inside = anchors < M
    g = across(tl.load(grad_ptr + anchors, mask=inside, other=0.0), ANCHORS_ON_ROWS)
    if WITH_MEAN:
        mean = across(tl.load(stats_ptr + M + anchors, mask=inside, other=0.0), ANCHORS_ON_ROWS)
        g_mean = across(tl.load(grad_ptr + M + anchors, mask=inside, other=0.0), ANCHORS_ON_ROWS) / scale
        g = g + g_mean * (1.0 + s - scale * mean)
    return g


@triton.jit
def column_dlogits(s, cands, M, stats_ptr, grad_ptr, ANCHORS_ON_ROWS: tl.constexpr):
    """q gc on a tile: the columns' lse (square matrix: the second row of stats, indexed by candidate)."""
    inside = cands < M
    lse = across(tl.load(stats_ptr + M + cands, mask=inside, other=0.0), not ANCHORS_ON_ROWS)
    g = across(tl.load(grad_ptr + M + cands, mask=inside, other=0.0), not ANCHORS_ON_ROWS)
    return tl.exp(s - lse) * g
