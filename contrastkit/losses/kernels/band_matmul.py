"""The products of a band's d logits with the features: dA[band] = scale factor dL'_band b and
dB (+)= scale factor dL'_band^T a[band], a tiled matrix product with float32 accumulation (TF32 for float32
inputs where allowed). dB sums over the bands in float32 (in place where dB is float32), read and written
once per band, not per tile: K D 8 bytes per band against its 2 R K D FLOPs (R the band's rows).
Few output tiles (small batches): split over the reduced axis, the splits' float32 partials summed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from contrastkit.losses.kernels import launch
from contrastkit.losses.kernels.common import dot

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, architectures) by itemsize (launch.py): output rows, output
# columns (a chunk of D), reduced axis.
NAMES = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
SPACE = {2: [(128, 128, 64, 8, 3, (90, 80)), (128, 128, 64, 8, 4, (90,)), (128, 64, 64, 4, 3, (90, 80))],
         4: [(128, 128, 32, 8, 3, (90, 80)), (128, 64, 32, 4, 3, (90, 80))]}


def space(d: int, itemsize: int, arch: int = 90) -> list[triton.Config]:
    return launch.configs(launch.entries(SPACE, NAMES, "BLOCK_N", d, itemsize, arch), NAMES)


@triton.jit
def band_matmul(x_ptr, y_ptr, out_ptr, scale_ptr, factor_ptr, N_OUT, N_RED, SPLIT, s_xo, s_xr, s_yr, s_yd, s_os,
                s_oo, D: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[split, rows, chunk] (+ out where ACCUMULATE) = scale factor sum_r x[rows, r] y[r, chunk]: a chunk of
    D and a tile of rows (program ids 0, 1: the chunks of one tile run side by side and read its x once
    from HBM, then from L2), r over split program_id(2) of the reduced axis."""
    chunk = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    start = tl.program_id(2) * SPLIT
    end = tl.minimum(start + SPLIT, N_RED)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        r = (r0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * s_xo + r[None, :] * s_xr,
                    mask=(rows[:, None] < N_OUT) & (r[None, :] < end), other=0.0)
        y = tl.load(y_ptr + r[:, None] * s_yr + chunk[None, :] * s_yd, mask=(r[:, None] < end) & (chunk[None, :] < D),
                    other=0.0)
        acc = dot(x, y, acc, PRECISION, UPCAST)
    acc = acc * (tl.load(scale_ptr) * tl.load(factor_ptr))
    at = out_ptr + tl.program_id(2) * s_os + rows[:, None] * s_oo + chunk[None, :]
    mask = (rows[:, None] < N_OUT) & (chunk[None, :] < D)
    if ACCUMULATE:
        acc += tl.load(at, mask=mask, other=0.0)
    tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def product(x, y, out, scale, factor, accumulate, tf32, blocks=None):
    """out (+ out where ``accumulate``) = scale factor x @ y: x [n, r] (any strides), y [r, D], out [n, D]
    with unit column stride, in its dtype (float32 to accumulate in)."""
    n, r, d = x.shape[0], x.shape[1], y.shape[1]
    splits, share = launch.split(triton.cdiv(n, 128) * triton.cdiv(d, 128), r, x.device)
    target = out if splits == 1 else x.new_empty((splits, n, d), dtype=torch.float32)
    adds = accumulate and splits == 1
    launch.run(band_matmul, lambda meta: (triton.cdiv(d, meta["BLOCK_N"]), triton.cdiv(n, meta["BLOCK_M"]), splits),
               space, ("N_OUT", "N_RED", "D", "ACCUMULATE"), x, y, target, scale, factor, N_OUT=n, N_RED=r,
               SPLIT=share, s_xo=x.stride(0), s_xr=x.stride(1), s_yr=y.stride(0), s_yd=y.stride(1),
               s_os=n * d if splits > 1 else 0, s_oo=target.stride(-2), D=d, ACCUMULATE=adds,
               PRECISION=launch.precision(x.dtype, tf32), UPCAST=launch.upcast(x.dtype), blocks=blocks,
               restore=("out_ptr",) if adds else ())
    if splits > 1:
        total = target.sum(0)
        if accumulate:
            out.add_(total)
        else:
            out.copy_(total)
