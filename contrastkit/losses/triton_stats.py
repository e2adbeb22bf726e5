"""Triton kernels of the negatives' statistics (chunked.negative_stats on the GPU), with their autograd.

Anchors a [M, D], candidates b [K, D], logits L = scale a b^T, each row's excluded columns left out.
Per row: lse_i = log sum_k exp(L_ik) (InfoNCE, DCL Eq. 6, DCLW, EqCo) and, for CACR's repulsion (Sec. 3.2),
mean_i = sum_k p_ik L_ik / scale with p = softmax(L_i); with ``columns`` (CLIP, a square matrix) also each
column's lse. The [M, K] matrix is never stored: a program walks its rows' tiles keeping an online maximum
(FlashAttention style), so the statistics are exact whatever the logits' range, with no shift to guess.

Backward recomputes each tile from the saved statistics (Inf-CL / FlashAttention-2 style). With
dL = d loss / dL (chunked.py's docstring):

    dL_ik = p_ik (g_i + g_mean_i (1 + L_ik - scale mean_i) / scale) + q_ik gc_k,   q_ik = exp(L_ik - clse_k),
    dA = scale dL b,   dB = scale dL^T a,   d scale = sum_ik dL_ik a_i.b_k - sum_i g_mean_i mean_i / scale.

One program per row tile computes dA (looping over column tiles), one per column tile dB (looping over row
tiles): deterministic, no atomics. Cost in [M, K, D] matrix products: forward 1 (2 with columns: the columns
are the rows of b a^T), backward 4 (each kernel recomputes the tile, then one product), so 5 (6).

Products accumulate in float32; float32 inputs use TF32 where the user allows it for float32 matmuls
(precision.tf32_matmul_allowed: the legacy allow_tf32 flag or torch >= 2.9's fp32_precision).
In backward, dL meets b (or a) as bfloat16 for bfloat16 inputs, and as TF32 for float16 ones (float16's
range would flush small dL to zero). Statistics are float32; gradients come back in the inputs' dtype.
No host synchronisation: the scale is read on the device, shapes never depend on values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import custom_op, triton_op, wrap_triton

from contrastkit.losses.chunked import host_checks_allowed
from contrastkit.losses.precision import tf32_matmul_allowed
from triton.runtime.jit import JITFunction

# Excluded pairs get a finite, hugely negative logit (as in chunked.py): exp() of it is 0 and, unlike -inf,
# it never meets -inf - (-inf) in the online maximum.
_EXCLUDED = tl.constexpr(-0.25 * 3.4028234663852886e38)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _dot(x, y, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """x @ y + acc in float32. UPCAST (Triton 3.5's interpreter only, which multiplies bfloat16's raw bits):
    bfloat16 operands as float32, the exact products the tensor cores form."""
    if UPCAST:
        x = x.to(tl.float32)
        y = y.to(tl.float32)
    return tl.dot(x, y, acc, input_precision=PRECISION)


@triton.jit
def _load_rows(ptr, rows, n, d, D, s_r, s_d):
    """x[rows, d] of an [n, D] matrix with strides (s_r, s_d); zeros outside it."""
    return tl.load(ptr + rows[:, None] * s_r + d[None, :] * s_d, mask=(rows[:, None] < n) & (d[None, :] < D),
                   other=0.0)


@triton.jit
def _logits(a_ptr, b_ptr, rows, cols, M, K, D, s_am, s_ad, s_bk, s_bd, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a[rows] b[cols]^T in float32, the D loop chunked (rows and columns past the end load zeros)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        a = _load_rows(a_ptr, rows, M, d, D, s_am, s_ad)
        b = _load_rows(b_ptr, cols, K, d, D, s_bk, s_bd)
        acc = _dot(a, tl.trans(b), acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _valid(ex_ptr, rows, cols, M, K, E: tl.constexpr):
    """The tile's pairs inside the matrix and not excluded (exclude [M, E] column indices, contiguous)."""
    ok = (rows[:, None] < M) & (cols[None, :] < K)
    for e in tl.static_range(E):
        index = tl.load(ex_ptr + rows * E + e, mask=rows < M, other=-1)
        ok = ok & (cols[None, :] != index[:, None])
    return ok


@triton.jit
def _stats_fwd(a_ptr, b_ptr, scale_ptr, ex_ptr, lse_ptr, mean_ptr, M, K, D, s_am, s_ad, s_bk, s_bd,
               E: tl.constexpr, WITH_MEAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One row tile: online maximum m, sum l of exp(L - m) and (WITH_MEAN) sum w of exp(L - m) L."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    scale = tl.load(scale_ptr)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    w = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, K, BLOCK_N):
        cols = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        s = _logits(a_ptr, b_ptr, rows, cols, M, K, D, s_am, s_ad, s_bk, s_bd, BLOCK_M, BLOCK_N, BLOCK_D,
                    PRECISION, UPCAST) * scale
        ok = _valid(ex_ptr, rows, cols, M, K, E)
        s = tl.where(ok, s, _EXCLUDED)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        rescale = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * rescale + tl.sum(p, axis=1)
        if WITH_MEAN:
            w = w * rescale + tl.sum(tl.where(ok, p * s, 0.0), axis=1)
        m = m_new
    inside = rows < M
    tl.store(lse_ptr + rows, m + tl.log(l), mask=inside)
    if WITH_MEAN:
        tl.store(mean_ptr + rows, w / l / scale, mask=inside)


@triton.jit
def _dlogits(s, ok, rows, cols, M, stats_ptr, grad_ptr, scale, WITH_MEAN: tl.constexpr, COLUMNS: tl.constexpr):
    """d loss / d L on one tile from the statistics [S, M] and their gradient (module docstring)."""
    inside = rows < M
    lse = tl.load(stats_ptr + rows, mask=inside, other=0.0)
    g = tl.load(grad_ptr + rows, mask=inside, other=0.0)
    p = tl.exp(s - lse[:, None])
    if WITH_MEAN:
        mean = tl.load(stats_ptr + M + rows, mask=inside, other=0.0)
        g_mean = tl.load(grad_ptr + M + rows, mask=inside, other=0.0)
        dl = p * (g[:, None] + (g_mean / scale)[:, None] * (1.0 + s - (scale * mean)[:, None]))
    else:
        dl = p * g[:, None]
    if COLUMNS:  # square: the columns' statistics are the second row of stats, indexed by column
        col_lse = tl.load(stats_ptr + M + cols, mask=cols < M, other=0.0)
        g_col = tl.load(grad_ptr + M + cols, mask=cols < M, other=0.0)
        dl += tl.exp(s - col_lse[None, :]) * g_col[None, :]
    return tl.where(ok, dl, 0.0)


@triton.jit
def _tile_dlogits(a_ptr, b_ptr, ex_ptr, stats_ptr, grad_ptr, scale, rows, cols, M, K, D, s_am, s_ad, s_bk, s_bd,
                  E: tl.constexpr, WITH_MEAN: tl.constexpr, COLUMNS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """The tile recomputed: (a b^T, d loss / dL) on rows x cols."""
    dots = _logits(a_ptr, b_ptr, rows, cols, M, K, D, s_am, s_ad, s_bk, s_bd, BLOCK_M, BLOCK_N, BLOCK_D,
                   PRECISION, UPCAST)
    ok = _valid(ex_ptr, rows, cols, M, K, E)
    return dots, _dlogits(dots * scale, ok, rows, cols, M, stats_ptr, grad_ptr, scale, WITH_MEAN, COLUMNS)


@triton.jit
def _add_product(out_ptr, out_rows, n_out, dl, x_ptr, x_rows, n_x, s_xr, s_xd, D, BLOCK_D: tl.constexpr,
                 DL_BF16: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[out_rows] (float32 [n_out, D]) += dl @ x[x_rows], chunk by chunk of D: dl as bfloat16 for
    bfloat16 x, else x in float32."""
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        x = _load_rows(x_ptr, x_rows, n_x, d, D, s_xr, s_xd)
        at = out_ptr + out_rows[:, None] * D + d[None, :]
        inside = (out_rows[:, None] < n_out) & (d[None, :] < D)
        acc = tl.load(at, mask=inside, other=0.0)
        if DL_BF16:
            acc = _dot(dl.to(tl.bfloat16), x, acc, PRECISION, UPCAST)
        else:
            acc = _dot(dl, x.to(tl.float32), acc, PRECISION, UPCAST)
        tl.store(at, acc, mask=inside)


@triton.jit
def _grad_anchors(a_ptr, b_ptr, scale_ptr, ex_ptr, stats_ptr, grad_ptr, da_ptr, ds_ptr, M, K, D,
                  s_am, s_ad, s_bk, s_bd, E: tl.constexpr, WITH_MEAN: tl.constexpr, COLUMNS: tl.constexpr,
                  DL_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One row tile: da[rows] (float32 [M, D]) = scale dL b, ds[rows] = sum_k dL_ik a_i.b_k."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    scale = tl.load(scale_ptr)
    ds = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, K, BLOCK_N):
        cols = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        dots, dl = _tile_dlogits(a_ptr, b_ptr, ex_ptr, stats_ptr, grad_ptr, scale, rows, cols, M, K, D, s_am, s_ad,
                                 s_bk, s_bd, E, WITH_MEAN, COLUMNS, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, UPCAST)
        ds += tl.sum(dl * dots, axis=1)
        _add_product(da_ptr, rows, M, dl * scale, b_ptr, cols, K, s_bk, s_bd, D, BLOCK_D, DL_BF16, PRECISION,
                     UPCAST)
    tl.store(ds_ptr + rows, ds, mask=rows < M)


@triton.jit
def _grad_candidates(a_ptr, b_ptr, scale_ptr, ex_ptr, stats_ptr, grad_ptr, db_ptr, M, K, D,
                     s_am, s_ad, s_bk, s_bd, E: tl.constexpr, WITH_MEAN: tl.constexpr, COLUMNS: tl.constexpr,
                     DL_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One column tile: db[cols] (float32 [K, D]) = scale dL^T a."""
    cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    scale = tl.load(scale_ptr)
    for m0 in range(0, M, BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        _, dl = _tile_dlogits(a_ptr, b_ptr, ex_ptr, stats_ptr, grad_ptr, scale, rows, cols, M, K, D, s_am, s_ad,
                              s_bk, s_bd, E, WITH_MEAN, COLUMNS, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, UPCAST)
        _add_product(db_ptr, cols, K, tl.trans(dl * scale), a_ptr, rows, M, s_am, s_ad, D, BLOCK_D, DL_BF16,
                     PRECISION, UPCAST)


_INTERPRETED = not isinstance(_stats_fwd, JITFunction)  # TRITON_INTERPRET=1 (CPU tests)


def _launch(kernel, grid, *args, **kwargs):
    if not _INTERPRETED:
        wrap_triton(kernel)[grid](*args, **kwargs)
    elif not is_fake(args[0]):  # TRITON_INTERPRET: runs on the host; nothing to run while tracing shapes
        kernel[grid](*args, **kwargs)


def _operator(name):
    """triton_op (torch.compile sees the kernels), or under TRITON_INTERPRET, whose kernels wrap_triton
    rejects, an opaque custom op whose fake is the same body with the launches skipped."""

    def register(fn):
        if not _INTERPRETED:
            return triton_op(name, fn, mutates_args=())
        op = custom_op(name, fn, mutates_args=())
        op.register_fake(fn)
        return op

    return register


def _launch_config(a, b, exclude, block_m, block_n, block_d, tf32):
    """The arguments every kernel shares after its outputs: sizes, strides, constexprs."""
    return dict(M=a.shape[0], K=b.shape[0], D=a.shape[1], s_am=a.stride(0), s_ad=a.stride(1), s_bk=b.stride(0),
                s_bd=b.stride(1), E=0 if exclude is None else exclude.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_D=block_d, PRECISION="tf32" if tf32 else "ieee",
                UPCAST=_INTERPRETED and a.dtype == torch.bfloat16)


def _row_stats(a, b, scale, exclude, with_mean, block_m, block_n, block_d, tf32):
    lse = a.new_empty(a.shape[0], dtype=torch.float32)
    mean = torch.empty_like(lse) if with_mean else lse
    config = _launch_config(a, b, exclude, block_m, block_n, block_d, tf32)
    _launch(_stats_fwd, (triton.cdiv(a.shape[0], block_m),), a, b, scale, a if exclude is None else exclude, lse,
            mean, WITH_MEAN=with_mean, **config)
    return [lse, mean] if with_mean else [lse]


@_operator("contrastkit::negative_stats")
def _negative_stats(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, exclude: torch.Tensor | None,
                    with_mean: bool, columns: bool, block_m: int, block_n: int, block_d: int,
                    tf32: bool) -> torch.Tensor:
    stats = _row_stats(a, b, scale, exclude, with_mean, block_m, block_n, block_d, tf32)
    if columns:  # the columns of a b^T are the rows of b a^T, whose excluded pairs are the same diagonal
        stats += _row_stats(b, a, scale, exclude, False, block_n, block_m, block_d, tf32)
    return torch.stack(stats)


@_operator("contrastkit::negative_stats_backward")
def _negative_stats_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                             exclude: torch.Tensor | None, stats: torch.Tensor, with_mean: bool, columns: bool,
                             block_m: int, block_n: int, block_d: int,
                             tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dA, dB, per-row terms of d scale through the logits). Each gradient is summed in a float32 buffer,
    cast to the inputs' dtype before the next is made: one such buffer at a time."""
    config = _launch_config(a, b, exclude, block_m, block_n, block_d, tf32)
    flags = dict(WITH_MEAN=with_mean, COLUMNS=columns, DL_BF16=a.dtype == torch.bfloat16)
    ex = a if exclude is None else exclude
    da = torch.zeros(a.shape, dtype=torch.float32, device=a.device)
    ds = a.new_empty(a.shape[0], dtype=torch.float32)
    _launch(_grad_anchors, (triton.cdiv(a.shape[0], block_m),), a, b, scale, ex, stats, grad, da, ds, **flags,
            **config)
    da = da.to(a.dtype)
    db = torch.zeros(b.shape, dtype=torch.float32, device=b.device)
    _launch(_grad_candidates, (triton.cdiv(b.shape[0], block_n),), a, b, scale, ex, stats, grad, db, **flags,
            **config)
    return da, db.to(b.dtype), ds


def _setup_context(ctx, inputs, output):
    a, b, scale, exclude, *ctx.options = inputs
    ctx.save_for_backward(a, b, scale, exclude, output)


def _backward(ctx, grad):
    a, b, scale, exclude, stats = ctx.saved_tensors
    with_mean = ctx.options[0]
    grad = grad.to(torch.float32).contiguous()
    da, db, ds = torch.ops.contrastkit.negative_stats_backward(grad, a, b, scale, exclude, stats, *ctx.options)
    d_scale = ds.sum()
    if with_mean:  # mean = sum p L / scale: its own 1 / scale
        d_scale = d_scale - (grad[1] * stats[1]).sum() / scale
    return da, db, d_scale, None, None, None, None, None, None, None


_negative_stats.register_autograd(_backward, setup_context=_setup_context)


def _check(anchors, candidates, scale, exclude, with_mean, columns, blocks):
    for name, x in (("anchors", anchors), ("candidates", candidates)):
        if x.dtype == torch.float64:
            raise TypeError(f"negative_stats_triton: {name} are float64; the Triton kernels take float32, "
                            "bfloat16 or float16 (use the torch backend for float64)")
        if x.dtype not in _DTYPES:
            raise TypeError(f"negative_stats_triton: {name} must be float32, bfloat16 or float16, got {x.dtype}")
        if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"negative_stats_triton: {name} must be a non-empty [rows, D] matrix, "
                             f"got shape {tuple(x.shape)}")
    if anchors.device.type == "cpu" and not _INTERPRETED:
        raise ValueError("negative_stats_triton: CPU tensors run only under Triton's interpreter "
                         "(TRITON_INTERPRET=1 set before triton is imported); use the torch backend on CPU")
    if anchors.dtype != candidates.dtype or anchors.device != candidates.device:
        raise TypeError(f"negative_stats_triton: anchors ({anchors.dtype}, {anchors.device}) and candidates "
                        f"({candidates.dtype}, {candidates.device}) must share dtype and device")
    m, k = anchors.shape[0], candidates.shape[0]
    if anchors.shape[1] != candidates.shape[1]:
        raise ValueError(f"negative_stats_triton: anchors have D = {anchors.shape[1]}, candidates "
                         f"D = {candidates.shape[1]}")
    if isinstance(scale, torch.Tensor) and scale.dim() != 0:
        raise ValueError(f"negative_stats_triton: scale must be a number or a 0-dim tensor, got shape "
                         f"{tuple(scale.shape)}")
    if exclude is not None:
        if exclude.dtype != torch.int64 or exclude.dim() != 2 or exclude.shape[0] != m:
            raise ValueError(f"negative_stats_triton: exclude must be int64 [M={m}, E] column indices, got "
                             f"{exclude.dtype} {tuple(exclude.shape)}")
        if exclude.device != anchors.device:
            raise ValueError(f"negative_stats_triton: exclude is on {exclude.device}, anchors on {anchors.device}")
    if columns:
        if with_mean:
            raise ValueError("negative_stats_triton: columns=True gives the columns' lse only; with_mean=True "
                             "with columns is not supported (take each direction as rows)")
        if k != m:
            raise ValueError(f"negative_stats_triton: columns=True needs a square matrix, got {m} x {k}")
        if exclude is not None and (exclude.shape[1] != 1 or (host_checks_allowed(exclude) and not torch.equal(
                exclude, torch.arange(m)[:, None]))):  # the values are checked on CPU only: no sync on GPU
            raise ValueError("negative_stats_triton: columns=True supports excluding the diagonal only "
                             "(exclude = arange(M)[:, None])")
    for name, size in zip(("block_m", "block_n", "block_d"), blocks):
        if size < 16 or size & (size - 1):
            raise ValueError(f"negative_stats_triton: {name} must be a power of two >= 16, got {size}")


def negative_stats_triton(anchors: torch.Tensor, candidates: torch.Tensor, scale, *,
                          exclude: torch.Tensor | None = None, with_mean: bool = False, columns: bool = False,
                          block_m: int = 64, block_n: int = 64, block_d: int = 64) -> torch.Tensor:
    """chunked.negative_stats on Triton kernels: [S, M] float32 statistics of the logits scale * a @ b.T.

    anchors [M, D] and candidates [K, D] (float32, bfloat16 or float16; float64 raises TypeError); scale a
    number or a 0-dim tensor (gets its gradient); exclude [M, E] int64 column indices left out of each row.
    Rows: lse, then mean (with_mean); with columns (square, exclude None or the diagonal) then the columns'
    lse. A row whose every column is excluded gets a hugely negative lse (as chunked.py's), mean 0, and no
    gradient; an exclude index outside [0, K) excludes nothing (indices are not checked: that would sync).
    block_m, block_n, block_d: the tiles (powers of two >= 16).
    """
    _check(anchors, candidates, scale, exclude, with_mean, columns, (block_m, block_n, block_d))
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=anchors.device, dtype=torch.float32)
    else:
        scale = torch.full((), float(scale), dtype=torch.float32, device=anchors.device)
    if exclude is not None:
        exclude = exclude.contiguous()
    # float16: dL meets the float16 operand as TF32 (float16's mantissa, float32's range) on the tensor cores
    tf32 = anchors.dtype == torch.float16 or (anchors.dtype == torch.float32 and tf32_matmul_allowed())
    return _negative_stats(anchors, candidates, scale, exclude, with_mean, columns, block_m, block_n, block_d,
                           tf32)
