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

Two views on one process pass one tensor z as anchors and candidates; its gradient is then
dz_i = scale sum_k (dL_ik + dL_ki) z_k, one kernel (the term dL_ki from row k's statistics, by symmetry of
z z^T). Each program owns a tile of output rows and a chunk of D_OUT <= 256 columns of D, accumulates its
gradient in registers over the other axis, and writes it once in the inputs' dtype: deterministic, no
atomics, no float32 copy of a gradient. Each chunk recomputes the logits, so with c = cdiv(D, 256) chunks
the cost in [M, K, D] matrix products is:

    two views      forward 1, backward c + 1 (recompute, product)         = 3 (D <= 256), 4 (D = 512)
    rows only      forward 1, backward 2 (c + 1) (dA and dB each)        = 5, 7
    image-text     forward 2 (rows, then columns as rows of b a^T), 2 (c + 1)  = 6, 8

Small M (few row tiles) splits the other axis over programs (flash-decoding style): each split writes its
partial statistics (or partial gradients in float32), combined by a few torch ops on [splits, M] (or
[splits, M, D]), so that B = 256 fills the GPU. On CUDA the tiles, warps and pipeline stages are autotuned
(keyed on M, K, D); under TRITON_INTERPRET=1 (the CPU tests) the production default (first of _configs).

Products accumulate in float32; float32 inputs use TF32 where the user allows it for float32 matmuls
(precision.tf32_matmul_allowed: the legacy allow_tf32 flag or torch >= 2.9's fp32_precision). In backward
dL meets b (or a) in the inputs' dtype: bfloat16, float16 (dL divided by max |grad| first, so that its
small entries stay in float16's range; the factor is put back on the float32 sum), or float32.
Statistics are float32. No host synchronisation: the scale is read on the device, shapes never depend on
values.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import custom_op, triton_op, wrap_triton

from contrastkit.losses.chunked import host_checks_allowed
from contrastkit.losses.precision import tf32_matmul_allowed

# Excluded pairs get a finite, hugely negative logit (as in chunked.py): exp() of it is 0 and, unlike -inf,
# it never meets -inf - (-inf) in the online maximum.
_EXCLUDED = tl.constexpr(-0.25 * 3.4028234663852886e38)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
D_OUT_MAX = 256  # the widest chunk of D one backward program accumulates in registers (64 x 256 float32)
SPLIT_ALIGN = 64  # a split's share of the other axis: a multiple of 64 rows (a partial tile where BLOCK_N is 128)


@triton.jit
def _dot(x, y, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """x @ y + acc in float32. UPCAST (Triton 3.5's interpreter only, which multiplies bfloat16's raw bits):
    bfloat16 operands as float32, the exact products the tensor cores form."""
    if UPCAST:
        x = x.to(tl.float32)
        y = y.to(tl.float32)
    return tl.dot(x, y, acc, input_precision=PRECISION)


@triton.jit
def _load_rows(ptr, rows, n, d, D: tl.constexpr, s_r, s_d):
    """x[rows, d] of an [n, D] matrix with strides (s_r, s_d); zeros outside it."""
    return tl.load(ptr + rows[:, None] * s_r + d[None, :] * s_d, mask=(rows[:, None] < n) & (d[None, :] < D),
                   other=0.0)


@triton.jit
def _dots(x_ptr, y_ptr, x_tile, rows, cols, n_x, n_y, D: tl.constexpr, s_xr, s_xd, s_yr, s_yd,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
          UPCAST: tl.constexpr):
    """x[rows] y[cols]^T in float32. x_tile: x[rows] loaded once by the caller where BLOCK_D covers D (the
    row tile resident over the whole loop), else the D loop loads it chunk by chunk."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCK_D >= D:
        d = tl.arange(0, BLOCK_D)
        acc = _dot(x_tile, tl.trans(_load_rows(y_ptr, cols, n_y, d, D, s_yr, s_yd)), acc, PRECISION, UPCAST)
    else:
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            x = _load_rows(x_ptr, rows, n_x, d, D, s_xr, s_xd)
            acc = _dot(x, tl.trans(_load_rows(y_ptr, cols, n_y, d, D, s_yr, s_yd)), acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _resident(x_ptr, rows, n_x, D: tl.constexpr, s_xr, s_xd, BLOCK_D: tl.constexpr):
    """The row tile x[rows] when BLOCK_D covers D (see _dots), else nothing to keep."""
    x = None
    if BLOCK_D >= D:
        x = _load_rows(x_ptr, rows, n_x, tl.arange(0, BLOCK_D), D, s_xr, s_xd)
    return x


@triton.jit
def _valid(ex_ptr, anchors, cands, M, K, E: tl.constexpr, ANCHORS_ON_ROWS: tl.constexpr):
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
def _stats_fwd(a_ptr, b_ptr, scale_ptr, ex_ptr, lse_ptr, mean_ptr, M, K, SPLIT, s_am, s_ad, s_bk, s_bd,
               D: tl.constexpr, E: tl.constexpr, WITH_MEAN: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One row tile, columns [SPLIT * s, SPLIT * (s + 1)) of split s = program_id(1): online maximum m, sum
    l of exp(L - m) and (WITH_MEAN) sum w of exp(L - m) L; the split's lse and mean to row s of the outputs."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    start = tl.program_id(1) * SPLIT
    end = tl.minimum(start + SPLIT, K)
    scale = tl.load(scale_ptr)
    a = _resident(a_ptr, rows, M, D, s_am, s_ad, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    w = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        s = _dots(a_ptr, b_ptr, a, rows, cols, M, K, D, s_am, s_ad, s_bk, s_bd, BLOCK_M, BLOCK_N, BLOCK_D,
                  PRECISION, UPCAST) * scale
        ok = _valid(ex_ptr, rows, cols, M, end, E, True)
        s = tl.where(ok, s, _EXCLUDED)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        rescale = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * rescale + tl.sum(p, axis=1)
        if WITH_MEAN:
            w = w * rescale + tl.sum(tl.where(ok, p * s, 0.0), axis=1)
        m = m_new
    inside = rows < M
    out = tl.program_id(1) * M + rows
    tl.store(lse_ptr + out, m + tl.log(l), mask=inside)
    if WITH_MEAN:
        tl.store(mean_ptr + out, w / l / scale, mask=inside)


@triton.jit
def _anchor_dlogits(s, anchors, M, stats_ptr, grad_ptr, scale, WITH_MEAN: tl.constexpr,
                    ANCHORS_ON_ROWS: tl.constexpr):
    """p (g + g_mean (1 + L - scale mean) / scale) on a tile, from the anchors' statistics [S, M] and their
    (normalised) gradient, the anchors on the tile's rows or on its columns."""
    inside = anchors < M
    lse = _across(tl.load(stats_ptr + anchors, mask=inside, other=0.0), ANCHORS_ON_ROWS)
    g = _across(tl.load(grad_ptr + anchors, mask=inside, other=0.0), ANCHORS_ON_ROWS)
    p = tl.exp(s - lse)
    if WITH_MEAN:
        mean = _across(tl.load(stats_ptr + M + anchors, mask=inside, other=0.0), ANCHORS_ON_ROWS)
        g_mean = _across(tl.load(grad_ptr + M + anchors, mask=inside, other=0.0), ANCHORS_ON_ROWS) / scale
        g = g + g_mean * (1.0 + s - scale * mean)
    return p * g


@triton.jit
def _column_dlogits(s, cands, M, stats_ptr, grad_ptr, ANCHORS_ON_ROWS: tl.constexpr):
    """q gc on a tile: the columns' lse (square matrix: the second row of stats, indexed by candidate)."""
    inside = cands < M
    lse = _across(tl.load(stats_ptr + M + cands, mask=inside, other=0.0), not ANCHORS_ON_ROWS)
    g = _across(tl.load(grad_ptr + M + cands, mask=inside, other=0.0), not ANCHORS_ON_ROWS)
    return tl.exp(s - lse) * g


@triton.jit
def _across(v, ON_ROWS: tl.constexpr):
    """A per-row ([n, 1]) or per-column ([1, n]) operand of a tile from a vector (no early return: Triton
    generates the code after one, and checks its shapes)."""
    if ON_ROWS:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def _grad(x_ptr, y_ptr, scale_ptr, factor_ptr, ex_ptr, stats_ptr, grad_ptr, out_ptr, ds_ptr, M, K, N_OUT, N_OTHER,
          SPLIT, s_xr, s_xd, s_yr, s_yd, D: tl.constexpr, E: tl.constexpr, WITH_MEAN: tl.constexpr,
          COLUMNS: tl.constexpr, ROLE: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_OUT: tl.constexpr, PRECISION: tl.constexpr,
          UPCAST: tl.constexpr):
    """out[rows, chunk] = scale sum_k dX_rk y[k, chunk] for one tile of x's rows and one chunk of D (program
    ids 0, 1), k over split program_id(2) of y's rows, accumulated in registers.

    ROLE 0: x are the anchors, y the candidates (dA; ds[rows] = sum_k dL_rk x_r.y_k too); 1: x are the
    candidates, y the anchors (dB, dX = dL^T); 2: one tensor as both (two views, dX = dL + dL^T; ds too).
    PARTIAL: out is float32 [splits, N_OUT, D] (summed by the caller), else [N_OUT, D] in out's dtype."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    chunk = tl.program_id(1) * D_OUT + tl.arange(0, D_OUT)
    start = tl.program_id(2) * SPLIT
    end = tl.minimum(start + SPLIT, N_OTHER)
    scale = tl.load(scale_ptr)
    x = _resident(x_ptr, rows, N_OUT, D, s_xr, s_xd, BLOCK_D)
    acc = tl.zeros([BLOCK_M, D_OUT], dtype=tl.float32)
    ds = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        dots = _dots(x_ptr, y_ptr, x, rows, cols, N_OUT, end, D, s_xr, s_xd, s_yr, s_yd, BLOCK_M, BLOCK_N,
                     BLOCK_D, PRECISION, UPCAST)
        s = dots * scale
        if ROLE == 1:  # rows are candidates, columns anchors
            ok = _valid(ex_ptr, cols, rows, M, K, E, False) & (cols[None, :] < end)
            dl = _anchor_dlogits(s, cols, M, stats_ptr, grad_ptr, scale, WITH_MEAN, False)
            if COLUMNS:
                dl += _column_dlogits(s, rows, M, stats_ptr, grad_ptr, False)
            dl = tl.where(ok, dl, 0.0)
        else:
            ok = _valid(ex_ptr, rows, cols, M, end, E, True)
            dl = tl.where(ok, _anchor_dlogits(s, rows, M, stats_ptr, grad_ptr, scale, WITH_MEAN, True), 0.0)
            if COLUMNS:
                dl += tl.where(ok, _column_dlogits(s, cols, M, stats_ptr, grad_ptr, True), 0.0)
            ds += tl.sum(dl * dots, axis=1)
            if ROLE == 2:  # dL_kr: row k's own terms, its exclusions read from its row of exclude
                ok_t = _valid(ex_ptr, cols, rows, end, M, E, False)
                dl += tl.where(ok_t, _anchor_dlogits(s, cols, M, stats_ptr, grad_ptr, scale, WITH_MEAN, False),
                               0.0)
        y = _load_rows(y_ptr, cols, end, chunk, D, s_yr, s_yd)
        if y.dtype == tl.float32:
            acc = _dot(dl, y, acc, PRECISION, UPCAST)
        else:  # bfloat16, or float16 with dL divided by max |grad| (module docstring)
            acc = _dot(dl.to(y.dtype), y, acc, PRECISION, UPCAST)
    factor = tl.load(factor_ptr)
    inside = rows < N_OUT
    mask = inside[:, None] & (chunk[None, :] < D)
    if PARTIAL:
        at = out_ptr + (tl.program_id(2) * N_OUT + rows)[:, None] * D + chunk[None, :]
        tl.store(at, acc * (scale * factor), mask=mask)
    else:
        at = out_ptr + rows[:, None] * D + chunk[None, :]
        tl.store(at, (acc * (scale * factor)).to(out_ptr.dtype.element_ty), mask=mask)
    if ROLE != 1:
        if tl.program_id(1) == 0:
            tl.store(ds_ptr + tl.program_id(2) * N_OUT + rows, ds * factor, mask=inside)


def _interpreted() -> bool:
    return not isinstance(_stats_fwd, triton.runtime.jit.JITFunction)  # TRITON_INTERPRET=1 (CPU tests)


_INTERPRETED = _interpreted()


# The autotune spaces, (BLOCK_M, BLOCK_N, BLOCK_D, warps, stages, architectures): the entries that compile
# without register spills at D = 512 for those architectures (docs/gpu/compile.md; 128-row backward tiles,
# 64 x 128 x 64 and 4-warp 64 x 128 forward tiles all spill), the first for an architecture its production
# default, spill-free with triton 3.5 and 3.8 (tests/test_triton_compile.py); the first of all is the
# configuration the interpreter runs.
_SPACES = {(False, 2): [(128, 64, 64, 8, 3, (90, 80)), (128, 128, 32, 8, 4, (90,))],
           (True, 2): [(64, 32, 64, 8, 2, (90,)), (64, 16, 64, 8, 2, (80, 90)), (64, 32, 64, 8, 3, (90,)),
                       (64, 64, 64, 8, 2, (90,))],
           (False, 4): [(128, 64, 32, 8, 3, (90, 80)), (64, 64, 32, 4, 3, (90, 80)), (128, 128, 16, 8, 4, (90,)),
                        (128, 64, 64, 8, 2, (90,)), (128, 128, 32, 8, 3, (90,))],
           (True, 4): [(64, 16, 32, 8, 2, (90, 80))]}


def _configs(backward, d, itemsize, arch=90):
    """The autotune space of the forward or backward kernel for features of dimension d and itemsize bytes
    on sm_<arch> (90: Hopper and later, else 80; _SPACES). Where D <= 256 the forward also tries BLOCK_D = D
    (the row tile then loaded once: see _dots). Backward keeps 64 x D_OUT float32 in the registers of 8
    warps: D_OUT 256 (512 spills on sm_90), so D = 512 takes two chunks."""
    whole = triton.next_power_of_2(d)
    shapes = [shape[:5] for shape in _SPACES[backward, 2 if itemsize == 2 else 4] if arch in shape[5]]
    if whole <= 256 and not backward:
        shapes.append(shapes[0][:2] + (whole,) + shapes[0][3:])
    extra = dict(D_OUT=min(whole, D_OUT_MAX)) if backward else {}
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_D=min(b, whole), **extra), num_warps=w, num_stages=s)
            for m, n, b, w, s in dict.fromkeys(shapes)]


@functools.cache
def _tuned(kernel_name, d, itemsize, arch):
    """The kernel under triton.autotune (CUDA only: the interpreter has nothing to time), keyed on the sizes."""
    kernel = globals()[kernel_name]
    backward = kernel_name == "_grad"
    key = ["M", "K", "N_OUT", "D", "ROLE"] if backward else ["M", "K", "D"]
    return triton.autotune(_configs(backward, d, itemsize, arch), key=key)(kernel)


def _launch(kernel, grid, *args, blocks=None, **kwargs):
    """Runs kernel (a name) on grid(meta): with blocks where given (4 warps on CUDA), else under the
    interpreter the production default (the first of _configs), on CUDA autotuned."""
    backward, itemsize = kernel == "_grad", args[0].element_size()
    config = dict(blocks) if blocks else _configs(backward, kwargs["D"], itemsize)[0].kwargs
    if backward:
        config["D_OUT"] = min(triton.next_power_of_2(kwargs["D"]), D_OUT_MAX)
    if _INTERPRETED:
        if not is_fake(args[0]):  # runs on the host; nothing to run while tracing shapes
            globals()[kernel][grid(config)](*args, **kwargs, **config)
        return
    if blocks is not None:
        wrap_triton(globals()[kernel])[grid(config)](*args, **kwargs, **config)
    else:
        arch = 90 if torch.cuda.get_device_capability(args[0].device)[0] >= 9 else 80
        wrap_triton(_tuned(kernel, kwargs["D"], itemsize, arch))[grid](*args, **kwargs)


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


def _target_programs(device: torch.device) -> int:
    """Programs enough to fill the device: two per SM (264 on an H100; under the interpreter the same, so
    that the CPU tests split as an H100 would)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 264


def _split(tiles: int, other: int, device: torch.device) -> tuple[int, int]:
    """(splits, rows of the other axis per split) for a grid of ``tiles`` programs per split: one split
    where the tiles fill the device, else enough to, each split a multiple of SPLIT_ALIGN."""
    want = max(1, min(_target_programs(device) // tiles, triton.cdiv(other, SPLIT_ALIGN)))
    share = triton.cdiv(triton.cdiv(other, want), SPLIT_ALIGN) * SPLIT_ALIGN
    return triton.cdiv(other, share), share


def _precision(dtype, tf32):
    return "tf32" if dtype == torch.float32 and tf32 else "ieee"


def _strides(x, y):
    return dict(s_xr=x.stride(0), s_xd=x.stride(1), s_yr=y.stride(0), s_yd=y.stride(1))


def _row_stats(a, b, scale, exclude, with_mean, tf32, blocks):
    """[lse] (and mean) of the rows of scale a b^T, split over b's rows where a has few row tiles."""
    m, k = a.shape[0], b.shape[0]
    splits, share = _split(triton.cdiv(m, 64), k, a.device)
    lse = a.new_empty((splits, m), dtype=torch.float32)
    mean = torch.empty_like(lse) if with_mean else lse
    _launch("_stats_fwd", lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), splits), a, b, scale,
            a if exclude is None else exclude, lse, mean, M=m, K=k, SPLIT=share, s_am=a.stride(0), s_ad=a.stride(1),
            s_bk=b.stride(0), s_bd=b.stride(1), D=a.shape[1], E=0 if exclude is None else exclude.shape[1],
            WITH_MEAN=with_mean, PRECISION=_precision(a.dtype, tf32), UPCAST=_INTERPRETED and a.dtype == torch.bfloat16,
            blocks=blocks)
    if splits == 1:
        return [lse[0], mean[0]] if with_mean else [lse[0]]
    total = torch.logsumexp(lse, dim=0)  # the splits' partial statistics combined exactly
    if not with_mean:
        return [total]
    return [total, (torch.exp(lse - total) * mean).sum(0)]


@_operator("contrastkit::negative_stats")
def _negative_stats(a: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor, exclude: torch.Tensor | None,
                    with_mean: bool, columns: bool, tf32: bool, blocks: list[int] | None) -> torch.Tensor:
    """b None: the candidates are a (two views on one process)."""
    tiles = None if blocks is None else dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_D"), blocks))
    b = a if b is None else b
    stats = _row_stats(a, b, scale, exclude, with_mean, tf32, tiles)
    if columns:  # the columns of a b^T are the rows of b a^T, whose excluded pairs are the same diagonal
        swapped = None if tiles is None else dict(tiles, BLOCK_M=tiles["BLOCK_N"], BLOCK_N=tiles["BLOCK_M"])
        stats += _row_stats(b, a, scale, exclude, False, tf32, swapped)
    return torch.stack(stats)


def _gradient(role, x, y, scale, factor, exclude, stats, grad, with_mean, columns, tf32, blocks):
    """dX (role 0: dA, 1: dB, 2: dz of one tensor) in x's dtype, and for roles 0 and 2 the rows' terms of
    d scale [N_OUT] (else None): one _grad launch, split over y's rows where x has few row tiles."""
    n_out, n_other, d = x.shape[0], y.shape[0], x.shape[1]
    chunks = triton.cdiv(d, min(triton.next_power_of_2(d), D_OUT_MAX))
    splits, share = _split(triton.cdiv(n_out, 64) * chunks, n_other, x.device)
    partial = splits > 1
    out = x.new_empty((splits, n_out, d), dtype=torch.float32) if partial else torch.empty_like(
        x, memory_format=torch.contiguous_format)
    ds = x.new_empty((splits, n_out), dtype=torch.float32)
    m, k = (y.shape[0], x.shape[0]) if role == 1 else (x.shape[0], y.shape[0])
    _launch("_grad", lambda meta: (triton.cdiv(n_out, meta["BLOCK_M"]), triton.cdiv(d, meta["D_OUT"]), splits), x, y, scale, factor,
            x if exclude is None else exclude, stats, grad, out, ds, M=m, K=k, N_OUT=n_out, N_OTHER=n_other,
            SPLIT=share, **_strides(x, y), D=d, E=0 if exclude is None else exclude.shape[1], WITH_MEAN=with_mean,
            COLUMNS=columns, ROLE=role, PARTIAL=partial, PRECISION=_precision(x.dtype, tf32),
            UPCAST=_INTERPRETED and x.dtype == torch.bfloat16, blocks=blocks)
    if partial:
        out = out.sum(0).to(x.dtype)
    return out, (ds.sum(0) if role != 1 else None)


@_operator("contrastkit::negative_stats_backward")
def _negative_stats_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor,
                             exclude: torch.Tensor | None, stats: torch.Tensor, with_mean: bool, columns: bool,
                             tf32: bool, blocks: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dA, dB, per-row terms of d scale through the logits); b None: (dz, an empty dB, ...)."""
    tiles = None if blocks is None else dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_D"), blocks))
    factor = grad.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)  # dL / factor: in float16's range
    grad = grad / factor
    if b is None:
        dz, ds = _gradient(2, a, a, scale, factor, exclude, stats, grad, with_mean, columns, tf32, tiles)
        return dz, a.new_empty(0), ds
    da, ds = _gradient(0, a, b, scale, factor, exclude, stats, grad, with_mean, columns, tf32, tiles)
    swapped = None if tiles is None else dict(tiles, BLOCK_M=tiles["BLOCK_N"], BLOCK_N=tiles["BLOCK_M"])
    db, _ = _gradient(1, b, a, scale, factor, exclude, stats, grad, with_mean, columns, tf32, swapped)
    return da, db, ds


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
    return da, None if b is None else db, d_scale, None, None, None, None, None


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
    if blocks is not None:
        for name, size in zip(("block_m", "block_n", "block_d"), blocks):
            if size < 16 or size & (size - 1):
                raise ValueError(f"negative_stats_triton: {name} must be a power of two >= 16, got {size}")


def negative_stats_triton(anchors: torch.Tensor, candidates: torch.Tensor, scale, *,
                          exclude: torch.Tensor | None = None, with_mean: bool = False, columns: bool = False,
                          block_m: int | None = None, block_n: int | None = None,
                          block_d: int | None = None) -> torch.Tensor:
    """chunked.negative_stats on Triton kernels: [S, M] float32 statistics of the logits scale * a @ b.T.

    anchors [M, D] and candidates [K, D] (float32, bfloat16 or float16; float64 raises TypeError); scale a
    number or a 0-dim tensor (gets its gradient); exclude [M, E] int64 column indices left out of each row.
    Rows: lse, then mean (with_mean); with columns (square, exclude None or the diagonal) then the columns'
    lse. A row whose every column is excluded gets a hugely negative lse (as chunked.py's), mean 0, and no
    gradient; an exclude index outside [0, K) excludes nothing (indices are not checked: that would sync).
    candidates the very tensor anchors (two views): one gradient for it from one backward kernel.
    block_m, block_n, block_d: fixed tiles (powers of two >= 16, all three or none); None: autotuned on
    CUDA, the production default under the interpreter.
    """
    given = [x for x in (block_m, block_n, block_d) if x is not None]
    if given and len(given) != 3:
        raise ValueError("negative_stats_triton: give block_m, block_n and block_d together, or none of them")
    blocks = given or None
    _check(anchors, candidates, scale, exclude, with_mean, columns, blocks)
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=anchors.device, dtype=torch.float32)
    else:
        scale = torch.full((), float(scale), dtype=torch.float32, device=anchors.device)
    if exclude is not None:
        exclude = exclude.contiguous()
    tf32 = anchors.dtype == torch.float32 and tf32_matmul_allowed()
    return _negative_stats(anchors, None if candidates is anchors else candidates, scale, exclude, with_mean,
                           columns, tf32, blocks)
