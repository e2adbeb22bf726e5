"""The forward statistics: per row of the logits L = scale a b^T its lse (and CACR's mean), and with
``columns`` (image-text) each column's lse, all from one pass over the matrix.

A program owns a tile of rows and walks a split of the columns with an online maximum (FlashAttention
style): exact whatever the logits' range. The columns' statistics need every row, so each program also
writes, per column, the lse of its own rows (from the rows' exps: common.tile_exp); the row
tiles' partial lse are combined by a logsumexp (torch). Their buffer, [row tiles, K] float32, is bounded:
the rows go in launches of at most COLUMN_PARTIAL_BYTES of partials (128 MiB: one launch at N = 32768,
16 of 16384 rows at N = 262144).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from contrastkit.losses.kernels import launch
from contrastkit.losses.kernels.common import (EXCLUDED, dots, inverse_norms, kept_by_label, resident, scaled,
                                               tile_exp, valid)

COLUMN_PARTIAL_BYTES = 2**27
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


@triton.jit
def stats_fwd(a_ptr, b_ptr, p_ptr, scale_ptr, inv_a_ptr, inv_b_ptr, ex_ptr, ids_a_ptr, ids_b_ptr, lse_ptr, mean_ptr,
              cpart_ptr, M, K, R0, R1, SPLIT, s_am, s_ad, s_bk, s_bd, s_pr, s_part, D: tl.constexpr, E: tl.constexpr,
              LABELS: tl.constexpr, WITH_MEAN: tl.constexpr, COLUMNS: tl.constexpr, FROM_LOGITS: tl.constexpr,
              NORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Rows R0 + [t BLOCK_M, (t + 1) BLOCK_M) (t = program_id(0), rows < R1), columns [SPLIT s, SPLIT (s + 1))
    of split s = program_id(1): online maximum m, sum l of exp(L - m) and (WITH_MEAN) sum w of exp(L - m) L;
    the split's lse and mean to row s, column row - R0, of the launch's [splits, R1 - R0] partials (row
    stride s_part). COLUMNS (no mean): each column's lse over
    the tile's rows to row t of cpart [tiles, K]. FROM_LOGITS: the products a.b read from p [R1 - R0, K]
    float32 (the band's, cuBLAS's), not computed here. NORMALIZE: a and b are the features as given and the
    logits scale (a.b) inv_a inv_b (common.scaled). LABELS: pairs also left out by the rows' and columns' ids
    (common.kept_by_label)."""
    rows = (R0 + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    start = tl.program_id(1) * SPLIT
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
            s = tl.load(p_ptr + (rows - R0)[:, None] * s_pr + cols[None, :],
                        mask=(rows[:, None] < R1) & (cols[None, :] < end), other=0.0)
        else:
            s = dots(a_ptr, b_ptr, a, rows, cols, R1, K, D, s_am, s_ad, s_bk, s_bd, BLOCK_M, BLOCK_N, BLOCK_D,
                     PRECISION, UPCAST)
        s = scaled(s, inv_a, inverse_norms(inv_b_ptr, cols, K, NORMALIZE), NORMALIZE) * scale
        ok = valid(ex_ptr, rows, cols, R1, end, E, True)
        if LABELS != 0:
            ok = ok & kept_by_label(ids_a_ptr, ids_b_ptr, rows, cols, R1, end, LABELS, True)
        s = tl.where(ok, s, EXCLUDED)
        if COLUMNS:  # the rows' and the columns' terms from one exp per logit (common.tile_exp)
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
            m_new = tl.maximum(m, tl.max(s, axis=1))
            rescale = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * rescale + tl.sum(p, axis=1)
            if WITH_MEAN:
                w = w * rescale + tl.sum(tl.where(ok, p * s, 0.0), axis=1)
            m = m_new
    inside = rows < R1
    out = tl.program_id(1) * s_part + rows - R0
    tl.store(lse_ptr + out, m + tl.log(l), mask=inside)
    if WITH_MEAN:
        tl.store(mean_ptr + out, w / l / scale, mask=inside)


def forward_stats(a, b, inputs: launch.KernelInputs, product=None, logits=None):
    """[lse, (mean), (columns' lse)] of scale a b^T: [M] float32 each (inputs: the call's scale, exclusions,
    form, tiles, norms and labels). The columns split over b's rows where a has few row tiles. product(r0, r1,
    out): where given, the band's products a[r0:r1] b^T written into out (cuBLAS: the band design), in bands
    of at most LOGIT_BAND_BYTES, which the kernel then reads instead of computing them; into the rows of
    ``logits`` [M, K] float32 where given (the dense path, which keeps them for backward)."""
    m, k = a.shape[0], b.shape[0]
    with_mean, columns, blocks = inputs.with_mean, inputs.columns, inputs.blocks
    tile = blocks["BLOCK_M"] if blocks else BLOCK_M
    chunk = m
    if columns:  # the partials' buffer bounded: launches of at most COLUMN_PARTIAL_BYTES
        chunk = min(m, max(1, COLUMN_PARTIAL_BYTES // (k * 4)) * tile)
    band = None
    if product is not None and logits is None:  # the band's float32 products bounded too
        chunk = min(chunk, max(1, LOGIT_BAND_BYTES // (k * 4 * tile)) * tile)
        band = a.new_empty((chunk, k), dtype=torch.float32)
    splits, share = launch.split(triton.cdiv(chunk, 64), k, a.device)
    # Each launch's partial statistics per split, [splits, chunk], combined into [M] after it: bounded however
    # many splits a launch of few rows against many columns takes (a band of 128 rows at 2^19 columns: 132).
    lse, mean = a.new_empty((splits, chunk), dtype=torch.float32), None
    if with_mean:
        mean = torch.empty_like(lse)
    total = a.new_empty(m, dtype=torch.float32)
    row_mean = torch.empty_like(total) if with_mean else None
    cpart = a.new_empty((triton.cdiv(chunk, tile), k), dtype=torch.float32) if columns else lse
    column_lse = None
    for r0 in range(0, m, chunk):
        r1 = min(r0 + chunk, m)
        if logits is not None:
            band = logits[r0:r1]
        if band is not None:
            product(r0, r1, band[: r1 - r0])
        launch.run(stats_fwd, lambda meta: (triton.cdiv(r1 - r0, meta["BLOCK_M"]), splits), space,
                   ("M", "K", "D", "COLUMNS", "FROM_LOGITS", "NORMALIZE", "LABELS"), *inputs.pointers(a, b, band), lse,
                   lse if mean is None else mean, cpart, R0=r0, R1=r1, SPLIT=share,
                   s_pr=0 if band is None else band.stride(0), s_part=lse.stride(0), FROM_LOGITS=band is not None,
                   **inputs.constants(a, b), blocks=blocks)
        part = lse[:, : r1 - r0]
        total[r0:r1] = torch.logsumexp(part, dim=0) if splits > 1 else part[0]  # the splits' partials, exactly
        if mean is not None and row_mean is not None:  # with_mean (the test mypy can follow)
            mean_part = mean[:, : r1 - r0]
            row_mean[r0:r1] = (torch.exp(part - total[r0:r1]) * mean_part).sum(0) if splits > 1 else mean_part[0]
        if columns:
            part = torch.logsumexp(cpart[: triton.cdiv(r1 - r0, tile)], dim=0)
            column_lse = part if column_lse is None else torch.logaddexp(column_lse, part)
    stats = [total]
    if with_mean:
        stats.append(row_mean)
    if columns:
        stats.append(column_lse)
    return stats
