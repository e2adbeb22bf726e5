"""The forward statistics: per row of the logits L = scale a b^T its lse (and CACR's mean), and with
``columns`` (image-text) each column's lse, all from one pass over the matrix.

A program owns a tile of rows and walks a split of the columns with an online maximum (FlashAttention
style): exact whatever the logits' range. The columns' statistics need every row, so each program also
writes, per column, the lse of its own rows (from the rows' exps: common.tile_exp). Two views (a = b, L
symmetric) visit the upper triangle alone (``triangle``): each band of rows against the columns from its
first row on, the columns' partials (with each column's own exclusions) giving every row the lower
triangle's share of its statistics, about half the products and exps of full rows. The partials, per split
of the columns and per row tile, are combined by a logsumexp (torch) once per group of bands whose buffers
fit PARTIAL_BYTES (128 MiB: one group at N = 32768; image-text's column partials bound a band to 16384 rows
at N = 262144).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from contrastkit.losses.triton import launch
from contrastkit.losses.triton.common import (EXCLUDED, dots, inverse_norms, kept_by_label, resident, scaled,
                                               tile_exp, valid)

PARTIAL_BYTES = 2**27
TRIANGLE_BAND_ROWS = 2048  # two views' forward over the upper triangle: bands of this many rows (forward_stats)
LOGIT_BAND_BYTES = 2**28  # the band design's float32 products of a band of rows and every column
BLOCK_M = 128  # every entry's row tile: the columns' partials are indexed by it, whichever entry autotune keeps

# (BLOCK_M, BLOCK_N, BLOCK_D, warps, stages, architectures) by itemsize (launch.py).
NAMES = ("BLOCK_M", "BLOCK_N", "BLOCK_D")
SPACE = {2: [(128, 64, 64, 8, 3, (90, 80)), (128, 128, 32, 8, 4, (90,)), (128, 128, 64, 8, 3, (90,))],
         4: [(128, 64, 32, 8, 3, (90, 80)), (128, 128, 16, 8, 4, (90,)), (128, 64, 64, 8, 2, (90,)),
             (128, 128, 32, 8, 3, (90,))]}
assert all(entry[0] == BLOCK_M for entries in SPACE.values() for entry in entries)


def space(d: int, itemsize: int, arch: int = 90) -> list[triton.Config]:
    """The autotune space; where D <= 256 also BLOCK_D = D (the row tile then loaded once: common.dots)."""
    shapes = launch.entries(SPACE, NAMES, "BLOCK_D", d, itemsize, arch)
    whole = max(16, triton.next_power_of_2(d))
    if whole <= 256:
        shapes.append(shapes[0][:2] + (whole,) + shapes[0][3:])
    return launch.configs(shapes, NAMES)


def triangle_space(d: int, itemsize: int, arch: int = 90) -> list[triton.Config]:
    """space's entries for two views over the triangle (TRIANGLE): those of 64 columns, since its mirrored
    tile values make the 128 x 128 entries spill 28-280 bytes on sm_90 (tools/perf/triton_compile.py)."""
    return [config for config in space(d, itemsize, arch) if config.kwargs["BLOCK_N"] <= 64]


@triton.jit
def stats_fwd(a_ptr, b_ptr, p_ptr, scale_ptr, inv_a_ptr, inv_b_ptr, ex_ptr, ids_a_ptr, ids_b_ptr, lse_ptr, mean_ptr,
              cpart_ptr, cmean_ptr, M, K, R0, R1, C0, SPLIT, s_am, s_ad, s_bk, s_bd, s_pr, s_part, D: tl.constexpr,
              E: tl.constexpr, LABELS: tl.constexpr, WITH_MEAN: tl.constexpr, COLUMNS: tl.constexpr,
              TRIANGLE: tl.constexpr, FROM_LOGITS: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Rows R0 + [t BLOCK_M, (t + 1) BLOCK_M) (t = program_id(0), rows < R1), columns C0 + [SPLIT s, SPLIT (s + 1))
    of split s = program_id(1) (columns < K): online maximum m, sum l of exp(L - m) and (WITH_MEAN) sum w of
    exp(L - m) L; the split's lse and mean to row s, column row - R0, of the launch's partials (row stride
    s_part; a split past K writes lse -inf, mean 0). COLUMNS (image-text): each column's lse over the tile's
    rows to row t of cpart [tiles, K]. TRIANGLE (two views, a = b, L symmetric: the launch's rows against the
    columns from C0 = R0 on): also each column's lse (and mean) over the tile's rows, with the column's own
    exclusions (the mirrored entry (k, r) of L), to cpart and cmean, so that the columns past the launch's
    rows (k >= R1) get the lower triangle's share of their statistics, which no launch visits.
    FROM_LOGITS: the products a.b read from p [R1 - R0, K - C0] float32 (the band's, cuBLAS's), not computed
    here. NORMALIZE: a and b are the features as given and the logits scale (a.b) inv_a inv_b
    (common.scaled). LABELS: pairs also left out by the rows' and columns' ids (common.kept_by_label)."""
    rows = (R0 + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    start = C0 + tl.program_id(1) * SPLIT
    end = tl.minimum(start + SPLIT, K)
    scale = tl.load(scale_ptr)
    a = None
    if not FROM_LOGITS:
        a = resident(a_ptr, rows, R1, D, s_am, s_ad, BLOCK_D)
    inv_a = inverse_norms(inv_a_ptr, rows, R1, NORMALIZE)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    w = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        if FROM_LOGITS:
            s = tl.load(p_ptr + (rows - R0)[:, None] * s_pr + (cols - C0)[None, :],
                        mask=(rows[:, None] < R1) & (cols[None, :] < end), other=0.0)
        else:
            s = dots(a_ptr, b_ptr, a, rows, cols, R1, K, D, s_am, s_ad, s_bk, s_bd, BLOCK_M, BLOCK_N, BLOCK_D,
                     PRECISION, UPCAST)
        s = scaled(s, inv_a, inverse_norms(inv_b_ptr, cols, K, NORMALIZE), NORMALIZE) * scale
        if LABELS != 0:
            kept = kept_by_label(ids_a_ptr, ids_b_ptr, rows, cols, R1, end, LABELS, True)
        if TRIANGLE:  # the mirrored entries (k, r) first, with row k's exclusions (labels are symmetric), own exps
            ok = valid(ex_ptr, cols, rows, end, R1, E, False)
            if LABELS != 0:
                ok = ok & kept
            masked = tl.where(ok, s, EXCLUDED)
            top = tl.max(masked, axis=0)
            p = tl.exp(masked - top[None, :])
            lc = tl.sum(p, axis=0)
            inside = (cols < end) & (cols >= R1)  # the band's own square: its rows take both (r, k) and (k, r)
            tl.store(cpart_ptr + tl.program_id(0) * K + cols, top + tl.log(lc), mask=inside)
            if WITH_MEAN:
                tl.store(cmean_ptr + tl.program_id(0) * K + cols,
                         tl.sum(tl.where(ok, p * s, 0.0), axis=0) / lc / scale, mask=inside)
        ok = valid(ex_ptr, rows, cols, R1, end, E, True)
        if LABELS != 0:
            ok = ok & kept
        if COLUMNS:  # the rows' and the columns' terms from one exp per logit (common.tile_exp)
            s = tl.where(ok, s, EXCLUDED)
            e, t, T, narrow = tile_exp(s, cols, end)
            m_new = tl.maximum(m, t)
            l = l * tl.exp(m - m_new) + tl.exp(t - m_new) * tl.sum(e, axis=1)
            m = m_new
            if narrow:
                part = T + tl.log(tl.sum(e * tl.exp(t - T)[:, None], axis=0))
            else:  # a column far below the tile's maximum: its own exps
                top = tl.max(s, axis=0)
                part = top + tl.log(tl.sum(tl.exp(s - top[None, :]), axis=0))
            tl.store(cpart_ptr + tl.program_id(0) * K + cols, part, mask=cols < end)
        else:
            masked = tl.where(ok, s, EXCLUDED)
            m_new = tl.maximum(m, tl.max(masked, axis=1))
            rescale = tl.exp(m - m_new)
            p = tl.exp(masked - m_new[:, None])
            l = l * rescale + tl.sum(p, axis=1)
            if WITH_MEAN:
                w = w * rescale + tl.sum(tl.where(ok, p * s, 0.0), axis=1)
            m = m_new
    inside = rows < R1
    out = tl.program_id(1) * s_part + rows - R0
    tl.store(lse_ptr + out, m + tl.log(l), mask=inside)
    if WITH_MEAN:
        tl.store(mean_ptr + out, w / tl.maximum(l, 1.0) / scale, mask=inside)


def forward_stats(a, b, inputs: launch.KernelInputs, product=None, logits=None, triangle=False):
    """[lse, (mean), (columns' lse)] of scale a b^T: [S, M] float32 (inputs: the call's scale, exclusions,
    form, tiles, norms and labels). The rows go in launches (bands) of at most LOGIT_BAND_BYTES of products
    where cuBLAS writes them: product(r0, r1, c0, out) writes a[r0:r1] b[c0:]^T into out, which the kernel
    then reads instead of computing the products; into the rows of ``logits`` [M, K] float32 where given
    (the dense path, which keeps them for backward). triangle (two views: b is a, no columns): each band of
    TRIANGLE_BAND_ROWS against the columns from its first row on, the upper triangle alone (about half the
    products and exps), the columns' partials giving each row the share of the lower triangle. The
    launches' partials (per split of the columns, and the columns' per row tile) are combined per group
    of bands within PARTIAL_BYTES; where one launch's partials are the rows' whole statistics (one split, one
    group), the kernel writes them in place and nothing is combined (an operator fewer a call)."""
    m, k = a.shape[0], b.shape[0]
    with_mean, columns, blocks = inputs.with_mean, inputs.columns, inputs.blocks
    tile = blocks["BLOCK_M"] if blocks else BLOCK_M
    rows = m
    if triangle:
        rows = max(tile, TRIANGLE_BAND_ROWS // tile * tile)
    banded = product is not None and logits is None  # cuBLAS writes each band's products into a buffer
    if banded:  # the band's float32 products bounded
        rows = min(rows, max(1, LOGIT_BAND_BYTES // (k * 4 * tile)) * tile)
    if columns or triangle:  # the columns' partials of a band, [row tiles, K] (and their means), bounded
        rows = min(rows, max(1, PARTIAL_BYTES // (k * 4 * (2 if with_mean else 1))) * tile)
    rows = min(rows, m)
    triangle = triangle and rows < m  # one band: the whole matrix, nothing to mirror
    by_column = columns or triangle
    flat = a.new_empty(rows * k, dtype=torch.float32) if banded else None
    bands = [(r0, min(r0 + rows, m), r0 if triangle else 0) for r0 in range(0, m, rows)]
    plan = [launch.split(triton.cdiv(r1 - r0, tile), k - c0, a.device) for r0, r1, c0 in bands]
    splits = max(s for s, _ in plan)  # a band whose columns take fewer: its last splits empty (lse -inf)
    per_band = 4 * (splits * rows + (triton.cdiv(rows, tile) * k if by_column else 0)) * (2 if with_mean else 1)
    group = max(1, PARTIAL_BYTES // per_band) * rows
    stats = a.new_empty((1 + with_mean + columns, m), dtype=torch.float32)
    total, row_mean = stats[0], stats[1] if with_mean else None
    one_group = group >= m
    direct = splits == 1 and one_group  # the partials are the rows' statistics: written into stats
    lse = stats[:1] if direct else a.new_empty((splits, min(group, m)), dtype=torch.float32)
    mean = (stats[1:2] if direct else torch.empty_like(lse)) if with_mean else lse
    cpart = a.new_empty((triton.cdiv(min(group, m), tile), k), dtype=torch.float32) if by_column else lse
    cmean = torch.empty_like(cpart) if by_column and with_mean else cpart
    column = None
    for g0 in range(0, m, group):
        g1 = min(g0 + group, m)
        if triangle:  # the columns before each band's first row: no partial
            cpart.fill_(float("-inf"))
            if with_mean:
                cmean.zero_()
        for (r0, r1, c0), (_, share) in zip(bands[g0 // rows: triton.cdiv(g1, rows)], plan[g0 // rows:]):
            band = None
            if logits is not None:
                band = logits[r0:r1]
            elif flat is not None:
                band = flat[: (r1 - r0) * (k - c0)].view(r1 - r0, k - c0)
            if band is not None:
                product(r0, r1, c0, band)
            at = (r0 - g0) // tile if by_column else 0  # the band's first row tile in the columns' partials
            launch.run(stats_fwd, lambda meta: (triton.cdiv(r1 - r0, meta["BLOCK_M"]), splits),
                       triangle_space if triangle else space,
                       ("M", "K", "D", "COLUMNS", "TRIANGLE", "FROM_LOGITS", "NORMALIZE", "LABELS"),
                       a, b, *inputs.pointers(band), lse[:, r0 - g0:], mean[:, r0 - g0:], cpart[at:], cmean[at:],
                       R0=r0, R1=r1, C0=c0, SPLIT=share, s_pr=0 if band is None else band.stride(0),
                       s_part=lse.stride(0), TRIANGLE=triangle, FROM_LOGITS=band is not None,
                       **inputs.constants(a, b), blocks=blocks)
        if not direct:
            total[g0:g1], part_mean = _combine(lse[:, : g1 - g0], mean[:, : g1 - g0] if with_mean else None)
            if row_mean is not None:  # with_mean (the test mypy can follow)
                row_mean[g0:g1] = part_mean
        if by_column:
            tiles = triton.cdiv(g1 - g0, tile)
            into = stats[-1] if columns and one_group else None  # the columns' lse written into stats
            part = _combine(cpart[:tiles], cmean[:tiles] if with_mean else None, into)
            if column is None and g1 < m:  # a view of the buffer the next group overwrites: kept as a copy
                part = tuple(None if x is None else x.clone() for x in part)
            column = part if column is None else _merge(column, part)
    if triangle:  # each row's upper-triangle statistics with its column's, the lower triangle's share
        stats[0], part_mean = _merge((total, row_mean), column)
        if row_mean is not None:
            row_mean.copy_(part_mean)
    elif columns and not one_group and column is not None:  # the columns' lse over several groups
        stats[-1] = column[0]
    return stats


def _combine(lse, mean, out=None):
    """(lse, mean) over the partials [parts, n] of disjoint sets of columns (mean None: without): the
    logsumexp (into ``out`` where given, mean None), and the means weighted by each part's share (a part of lse
    -inf has none)."""
    if lse.shape[0] == 1:
        return (lse[0] if out is None else out.copy_(lse[0])), None if mean is None else mean[0]
    if out is not None:
        return torch.logsumexp(lse, dim=0, out=out), None
    total = torch.logsumexp(lse, dim=0)
    if mean is None:
        return total, None
    weights = torch.exp(lse - total.clamp_min(torch.finfo(torch.float32).min))
    return total, (weights * mean).sum(0)


def _merge(x, y):
    """_combine of two (lse, mean) pairs."""
    return _combine(torch.stack([x[0], y[0]]), None if x[1] is None else torch.stack([x[1], y[1]]))
