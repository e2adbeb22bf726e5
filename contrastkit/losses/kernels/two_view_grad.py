"""The two-view backward: one tensor z as anchors and candidates (two views on one process), whose gradient
is dz_i = scale sum_k (dL_ik + dL_ki) z_k, one kernel (the term dL_ki from row k's statistics, by symmetry of
z z^T). A program owns a tile of output rows and a chunk of D_OUT <= 256 columns of D, accumulates its
gradient in registers over the other axis, and writes it once in the inputs' dtype: deterministic, no
atomics, no float32 copy of the gradient. Each chunk recomputes the logits: with c = cdiv(D, 256) chunks,
c + 1 products (2 at D <= 256, 3 at D = 512: a 64 x 512 float32 accumulator spills on sm_90).

dL_rk and dL_kr take one exp per logit where a tile allows it (common.tile_exp's argument), else one each.
dL meets z in the inputs' dtype: bfloat16, float16 (dL divided by max |grad| first, so that its small
entries stay in float16's range; the factor is put back on the float32 sum), or float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from contrastkit.losses.kernels import launch
from contrastkit.losses.kernels.common import (EXCLUDED, WINDOW, anchor_dlogits, anchor_grad, dot, dots, load_rows,
                                               resident, valid)

D_OUT_MAX = 256  # the widest chunk of D one program accumulates in registers (64 x 256 float32)

# (BLOCK_M, BLOCK_N, BLOCK_D, warps, stages, architectures) by itemsize (launch.py); 128-row tiles spill.
# The last two spill 0.4-1.6 KiB on sm_90 yet were the fastest on an H100 (107-108 ms at N = 32768, D = 512
# bf16, against 145-227 ms for the others and 402 ms for 64 x 16: docs/gpu/NVIDIA-H100-80GB-HBM3/kernels.md).
NAMES = ("BLOCK_M", "BLOCK_N", "BLOCK_D")
SPACE = {2: [(64, 32, 64, 8, 2, (90,)), (64, 16, 64, 8, 2, (80,)), (64, 32, 64, 8, 3, (90,)),
             (64, 64, 64, 8, 2, (90,)), (64, 64, 64, 4, 2, (90,)), (64, 128, 64, 8, 2, (90,))],
         4: [(64, 16, 32, 8, 2, (90, 80))]}


def space(d: int, itemsize: int, arch: int = 90) -> list[triton.Config]:
    shapes = launch.entries(SPACE, NAMES, "BLOCK_D", d, itemsize, arch)
    return launch.configs(shapes, NAMES, D_OUT=min(triton.next_power_of_2(d), D_OUT_MAX))


@triton.jit
def two_view_grad(z_ptr, scale_ptr, factor_ptr, ex_ptr, stats_ptr, grad_ptr, out_ptr, ds_ptr, M, SPLIT, s_zr, s_zd,
                  D: tl.constexpr, E: tl.constexpr, WITH_MEAN: tl.constexpr, PARTIAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_OUT: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[rows, chunk] = scale sum_k (dL_rk + dL_kr) z[k, chunk] for one tile of rows and one chunk of D
    (program ids 0, 1), k over split program_id(2), accumulated in registers; ds[split, rows] = the rows'
    terms of d scale, sum_k dL_rk z_r.z_k. PARTIAL: out is float32 [splits, M, D], else [M, D] in z's dtype."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    chunk = tl.program_id(1) * D_OUT + tl.arange(0, D_OUT)
    start = tl.program_id(2) * SPLIT
    end = tl.minimum(start + SPLIT, M)
    scale = tl.load(scale_ptr)
    x = resident(z_ptr, rows, M, D, s_zr, s_zd, BLOCK_D)
    acc = tl.zeros([BLOCK_M, D_OUT], dtype=tl.float32)
    ds = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        products = dots(z_ptr, z_ptr, x, rows, cols, M, end, D, s_zr, s_zd, s_zr, s_zd, BLOCK_M, BLOCK_N,
                        BLOCK_D, PRECISION, UPCAST)
        s = products * scale
        ok = valid(ex_ptr, rows, cols, M, end, E, True)
        ok_t = valid(ex_ptr, cols, rows, end, M, E, False)  # dL_kr: row k's own terms and exclusions
        # p_rk and p_kr from one exp per logit, e = exp(L - t_r) against the row's maximum on the tile (valid
        # pairs either way), where the factors exp(t_r - lse_r) and exp(T - lse_k) stay within e^WINDOW
        # (common.tile_exp's argument), else each from its own exp
        t = tl.max(tl.where(ok | ok_t, s, EXCLUDED), axis=1)
        T = tl.max(t, axis=0)
        lse_r = tl.load(stats_ptr + rows, mask=rows < M, other=0.0)
        lse_k = tl.load(stats_ptr + cols, mask=cols < end, other=0.0)
        wide = tl.maximum(tl.max(tl.where(rows < M, t - lse_r, 0.0), axis=0),
                          tl.max(tl.where(cols < end, T - lse_k, 0.0), axis=0))
        if wide <= WINDOW:
            e = tl.exp(tl.where(ok | ok_t, s, EXCLUDED) - t[:, None])
            g = anchor_grad(s, rows, M, stats_ptr, grad_ptr, scale, WITH_MEAN, True)
            dl = tl.where(ok, e * tl.exp(t - lse_r)[:, None] * g, 0.0)
            ds += tl.sum(dl * products, axis=1)
            g_t = anchor_grad(s, cols, M, stats_ptr, grad_ptr, scale, WITH_MEAN, False)
            dl += tl.where(ok_t, e * tl.exp(t - T)[:, None] * (tl.exp(T - lse_k)[None, :] * g_t), 0.0)
        else:
            dl = tl.where(ok, anchor_dlogits(s, rows, M, stats_ptr, grad_ptr, scale, WITH_MEAN, True), 0.0)
            ds += tl.sum(dl * products, axis=1)
            dl += tl.where(ok_t, anchor_dlogits(s, cols, M, stats_ptr, grad_ptr, scale, WITH_MEAN, False), 0.0)
        y = load_rows(z_ptr, cols, end, chunk, D, s_zr, s_zd)
        if y.dtype == tl.float32:
            acc = dot(dl, y, acc, PRECISION, UPCAST)
        else:  # bfloat16, or float16 with dL divided by max |grad| (module docstring)
            acc = dot(dl.to(y.dtype), y, acc, PRECISION, UPCAST)
    factor = tl.load(factor_ptr)
    inside = rows < M
    mask = inside[:, None] & (chunk[None, :] < D)
    if PARTIAL:
        at = out_ptr + (tl.program_id(2) * M + rows)[:, None] * D + chunk[None, :]
        tl.store(at, acc * (scale * factor), mask=mask)
    else:
        at = out_ptr + rows[:, None] * D + chunk[None, :]
        tl.store(at, (acc * (scale * factor)).to(out_ptr.dtype.element_ty), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(ds_ptr + tl.program_id(2) * M + rows, ds, mask=inside)


def two_view_gradient(z, inputs: launch.KernelInputs, stats, grad, factor):
    """(dz in z's dtype, the rows' d scale terms [M] (times 1 / factor)) from the forward's statistics and
    their upstream gradient dL / factor: one launch, split over z's rows where z has few row tiles (inputs:
    the call's; neither normalisation nor labels)."""
    m, d = z.shape
    exclude, blocks = inputs.exclude, inputs.blocks
    whole = triton.next_power_of_2(d)
    chunks = triton.cdiv(d, min(whole, D_OUT_MAX))
    if blocks is not None:
        blocks = dict(blocks, D_OUT=min(whole, D_OUT_MAX))
    splits, share = launch.split(triton.cdiv(m, 64) * chunks, m, z.device)
    partial = splits > 1
    out = z.new_empty((splits, m, d), dtype=torch.float32) if partial else torch.empty_like(
        z, memory_format=torch.contiguous_format)
    ds = z.new_empty((splits, m), dtype=torch.float32)
    launch.run(two_view_grad, lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(d, meta["D_OUT"]), splits),
               space, ("M", "D"), z, inputs.scale, factor, z if exclude is None else exclude, stats, grad, out, ds, M=m,
               SPLIT=share, s_zr=z.stride(0), s_zd=z.stride(1), D=d, E=0 if exclude is None else exclude.shape[1],
               WITH_MEAN=inputs.with_mean, PARTIAL=partial, PRECISION=launch.precision(z.dtype, inputs.tf32),
               UPCAST=launch.upcast(z.dtype), blocks=blocks)
    if partial:
        out = out.sum(0).to(z.dtype)
    return out, ds.sum(0)
