"""Backward's d loss / d logits for a block of rows and columns, from the block's float32 logits (cuBLAS's
recompute, or the dense path's kept ones) and the saved statistics, written once: an elementwise pass, no
product inside. Two cuBLAS products read it (triton/stats.py), so dA and dB come from one recompute
(image-text and query/queue: 1 recompute + 2 products; two views: 1 + 1, of dL + dL^T).

dL' goes to a [rows, K] buffer in the inputs' dtype (float16: dL' = dL / factor, factor = max |grad|, so that
its small entries stay in float16's range; bfloat16 and float32 have float32's range and take dL itself); with
it the rows' terms of d scale, sum_k dL'_ik a_i.b_k, per split of the columns. The logit scale (and the
factor) go on the products' float32 sums once, at the end (stats.py).
A block's float32 logits and its d logits, with the float32 sums of the gradients the backward holds beside
them, fit BACKWARD_BYTES (896 MiB; block_shape): the blocks are as large as that allows, so that a call issues
as few operators as its memory bound permits. At N = 32768 image-text (bf16), 8 bands of 4096 rows and every
column (16 bands of 2048 rows when a block had 256 MiB of logits); two views at N = 32768 (65536 rows), squares
of 11008 (6 bands over the triangle, 21 blocks; were 8192: 36); from N = 262144 on, squares of 8192 (the
held bytes leave less than BLOCK_MIN_ELEMENTS).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from contrastkit.losses.triton import launch
from contrastkit.losses.triton.common import (EXCLUDED, anchor_dlogits, column_dlogits, inverse_norms,
                                               kept_by_label, scaled, tile_exp, valid)

# The backward's buffers: one block's float32 logits and d logits, and the gradients' float32 sums and the
# operands the call made (block_shape's ``held``). 896 MiB keeps a call's whole memory beyond its inputs and their
# gradients within 1 GiB at N = 262144, D = 512 (tests/losses/test_memory.py), and at N = 32768 gives image-text
# 8 bands where 256 MiB of logits gave 16 (4 operators each).
BACKWARD_BYTES = 7 * 2**27
# Where the held bytes leave less (dB's float32 sum alone is 512 MiB at N = 262144), a block keeps this many
# entries all the same (256 MiB of float32 logits: the earlier fixed size, whose blocks the memory tests bound).
BLOCK_MIN_ELEMENTS = 2**26
BAND_ALIGN = 128
BAND_MIN_ROWS = 4096

# (BLOCK_M, BLOCK_N, warps, stages, architectures) by the d logits' itemsize (launch.py): the entries the first
# design's kernel (its products inside) kept, without their chunk of D. float32 on sm_90: 128 x 32 first, as it
# was there; sm_80: 128 x 32, as it was. Compiled (tools/perf/triton_compile.py, triton 3.8): every entry
# spill-free but float32's 128 x 64 on sm_90 with labels in the two-view form (8 bytes; docs/gpu/compile.md).
NAMES = ("BLOCK_M", "BLOCK_N")
SPACE = {2: [(128, 64, 8, 3, (90,)), (128, 32, 8, 3, (90, 80))],
         4: [(128, 32, 8, 3, (90, 80)), (128, 64, 8, 3, (90,))]}


def space(d: int, itemsize: int, arch: int = 90) -> list[triton.Config]:
    """The autotune space (d: unused, no product inside; the same signature as stats_fwd.space)."""
    return launch.configs(launch.entries(SPACE, NAMES, None, d, itemsize, arch), NAMES)


def block_shape(m: int, k: int, entry_bytes: int, held: int = 0) -> tuple[int, int]:
    """(rows, columns) of a block of d logits, multiples of BAND_ALIGN, whose entries (entry_bytes each: the
    float32 logits and the d logits) fit what BACKWARD_BYTES leaves beside ``held`` bytes (the float32 sums of
    the gradients, the operands the call made), and at least BLOCK_MIN_ELEMENTS: a band of every column while
    that leaves BAND_MIN_ROWS rows (or all of them), else a square. Per block, the products read b's and a's
    rows and add into float32 gradients (2 columns D + 8 (rows + columns) D bytes) against 6 rows columns D
    FLOPs: rows and columns of a few thousand keep that above the H100's 295 FLOPs per byte
    (docs/performance.md)."""
    elements = max(BLOCK_MIN_ELEMENTS, (BACKWARD_BYTES - held) // entry_bytes)
    rows = elements // k // BAND_ALIGN * BAND_ALIGN
    if rows >= min(m, BAND_MIN_ROWS):
        return min(m, max(BAND_ALIGN, rows)), k
    side = max(BAND_ALIGN, math.isqrt(elements) // BAND_ALIGN * BAND_ALIGN)
    return min(m, side), min(k, side)


@triton.jit
def dlogits(dl_ptr, p_ptr, scale_ptr, inv_a_ptr, inv_b_ptr, ex_ptr, ids_a_ptr, ids_b_ptr, stats_ptr, grad_ptr, ds_ptr,
            M, K, R0, R1, C0, C1, SPLIT, s_pr, s_lr, s_ds, E: tl.constexpr, LABELS: tl.constexpr,
            WITH_MEAN: tl.constexpr, COLUMNS: tl.constexpr, SYMMETRIC: tl.constexpr, TRIANGLE: tl.constexpr,
            NORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dl[rows - R0, cols - C0] = dL'[rows, cols] for rows R0 + [t BLOCK_M, (t + 1) BLOCK_M) (t = program_id(0),
    rows < R1) and the columns C0 + [SPLIT s, SPLIT (s + 1)) (s = program_id(1), columns < C1);
    ds[s, rows - R0] = sum over those columns of dL' a.b, the products a.b of the block read from p
    [R1 - R0, C1 - C0] float32 (cuBLAS wrote them). dl first: its dtype, the inputs', picks the autotune space.
    stats, grad: [S, M] (rows' lse, then mean (WITH_MEAN) or the columns' lse (COLUMNS, square)).
    SYMMETRIC (two views, a = b): dl = dL' + dL'^T on the block, the term dL'_ki from row k's statistics and
    exclusions (L is symmetric), so that one product gives dz; ds from dL' alone. TRIANGLE (with SYMMETRIC: the band
    design's two views over the upper triangle, the columns from the band's first row on,
    triton.stats._triangle_gradients): the entries (k, r) below the diagonal are never visited, so ds sums H = dL' +
    dL'^T times a.b over the columns past the band (k >= R1) and H / 2 on the band's own square (the first block's
    columns R0:R1, which holds both (r, k) and (k, r)). NORMALIZE: a and b are the features as given, the logits
    scale (a.b) inv_a inv_b (common.scaled), ds sums dL' times those cosines, and dl is written times inv_a inv_b,
    so that cuBLAS's products of it with the features are the gradients with respect to the unit vectors, times the
    rows' inverse norms (stats.py applies the normalisation's projection after). LABELS: pairs also left out by
    the samples' ids (common.kept_by_label; two views: one array of ids, the transposed term's too)."""
    rows = (R0 + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    start = C0 + tl.program_id(1) * SPLIT
    end = tl.minimum(start + SPLIT, C1)
    scale = tl.load(scale_ptr)
    inv_a = inverse_norms(inv_a_ptr, rows, R1, NORMALIZE)
    ds = tl.zeros([BLOCK_M], dtype=tl.float32)
    inside = rows < R1
    for n0 in range(start, end, BLOCK_N):
        cols = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        products = tl.load(p_ptr + (rows - R0)[:, None] * s_pr + (cols - C0)[None, :],
                           mask=inside[:, None] & (cols[None, :] < end), other=0.0)
        inv_b = inverse_norms(inv_b_ptr, cols, K, NORMALIZE)
        products = scaled(products, inv_a, inv_b, NORMALIZE)
        s = products * scale
        ok = valid(ex_ptr, rows, cols, R1, end, E, True)
        if LABELS != 0:  # the transposed term's too (SYMMETRIC: one array of ids, and equality is symmetric)
            by_label = kept_by_label(ids_a_ptr, ids_b_ptr, rows, cols, R1, end, LABELS, True)
            ok = ok & by_label
        if COLUMNS:  # p and q from one exp per logit where the tile allows it (common.tile_exp)
            e, t, T, narrow = tile_exp(tl.where(ok, s, EXCLUDED), cols, end)
            g = tl.load(grad_ptr + rows, mask=rows < M, other=0.0)
            dl = e * (tl.exp(t - tl.load(stats_ptr + rows, mask=rows < M, other=0.0)) * g)[:, None]
            if narrow:
                clse = tl.load(stats_ptr + M + cols, mask=cols < M, other=0.0)
                gc = tl.load(grad_ptr + M + cols, mask=cols < M, other=0.0)
                dl += e * tl.exp(t - T)[:, None] * (tl.exp(T - clse) * gc)[None, :]
            else:  # a column far below the tile's maximum: its own exps
                dl += column_dlogits(s, cols, M, stats_ptr, grad_ptr, True)
        else:
            dl = anchor_dlogits(s, rows, M, stats_ptr, grad_ptr, scale, WITH_MEAN, True)
        dl = tl.where(ok, dl, 0.0)
        if not TRIANGLE:
            ds += tl.sum(dl * products, axis=1)
        if SYMMETRIC:  # + dL'_kr: the columns as anchors, their own exclusions
            ok_t = valid(ex_ptr, cols, rows, end, R1, E, False)
            if LABELS != 0:
                ok_t = ok_t & by_label
            dl += tl.where(ok_t, anchor_dlogits(s, cols, M, stats_ptr, grad_ptr, scale, WITH_MEAN, False), 0.0)
        if TRIANGLE:  # from H = dL' + dL'^T: past the band an entry stands for itself and its unvisited mirror,
            # on the band's own square, which holds both, H sums to twice dL' (exactly: the square is symmetric)
            ds += tl.sum(tl.where(cols[None, :] >= R1, dl, 0.5 * dl) * products, axis=1)
        dl = scaled(dl, inv_a, inv_b, NORMALIZE)
        tl.store(dl_ptr + (rows - R0)[:, None] * s_lr + (cols - C0)[None, :], dl.to(dl_ptr.dtype.element_ty),
                 mask=inside[:, None] & (cols[None, :] < end))
    tl.store(ds_ptr + tl.program_id(1) * s_ds + rows - R0, ds, mask=inside)


def write_dlogits(a, b, inputs: launch.KernelInputs, stats, grad, dl, ds, r0, r1, c0, c1, splits, share, logits,
                  symmetric=False, triangle=False):
    """dl[:r1 - r0, :c1 - c0] = dL' of rows r0:r1 and columns c0:c1 (in a's dtype), ds[:, :r1 - r0] their d scale
    terms per split of the columns (splits, share: launch.split), from the forward's statistics and their
    upstream gradient dL / factor (stats, grad [S, M]) and the call's inputs (a, b: the operands, for their
    sizes). logits: the block's products a.b in float32 (cuBLAS's); symmetric: dL' + dL'^T (two views, b is
    a); triangle: the block is of the upper triangle's (the kernel's TRIANGLE)."""
    blocks = None if inputs.blocks is None else {k: v for k, v in inputs.blocks.items() if k != "BLOCK_D"}
    launch.run(dlogits, lambda meta: (triton.cdiv(r1 - r0, meta["BLOCK_M"]), splits), space,
               ("M", "K", "WITH_MEAN", "COLUMNS", "SYMMETRIC", "TRIANGLE", "NORMALIZE", "LABELS"),
               dl, *inputs.pointers(logits), stats, grad, ds, R0=r0, R1=r1, C0=c0, C1=c1, SPLIT=share,
               s_pr=logits.stride(0), s_lr=dl.stride(0), s_ds=ds.stride(0), SYMMETRIC=symmetric, TRIANGLE=triangle,
               **inputs.form(a.shape[0], b.shape[0]), blocks=blocks)
