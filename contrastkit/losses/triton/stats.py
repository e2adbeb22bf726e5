"""The negatives' statistics on Triton kernels (chunked.negative_stats on the GPU), with their autograd.

Anchors a [M, D], candidates b [K, D], logits L = scale a b^T, each row's excluded columns left out.
Per row: lse_i = log sum_k exp(L_ik) (InfoNCE, DCL Eq. 6, DCLW, EqCo) and, for CACR's repulsion (Sec. 3.2),
mean_i = sum_k p_ik L_ik / scale with p = softmax(L_i); with ``columns`` (CLIP, a square matrix) also each
column's lse. The [M, K] matrix is never stored whole. The kernels, one per file (losses/triton/):

- forward (stats_fwd.py): one pass, an online maximum per row (exact whatever the logits' range, no shift
  to guess); image-text's columns from the same pass, as partial lse per row tile combined by a logsumexp;
  two views over the upper triangle, in bands, each row's lower-triangle share from the columns' partials
  (on cuBLAS's band products; the fused kernel's own only where FUSED_TRIANGLE);
- backward, per block of rows and columns (a band of rows and every column up to large sizes): the block's
  logits recomputed by cuBLAS in float32 (or the dense path's, kept from forward), d loss / d logits written
  once in the inputs' dtype by an elementwise kernel (dlogits.py), then on cuBLAS dA[rows] += dL b[cols] and dB[cols] += dL^T a[rows]
  (image-text, query/queue), or for two views dz[rows] += (dL + dL^T) z[cols],
  one product (L = z z^T is symmetric: dL^T's entries come from the columns' own statistics), and where
  dz's float32 sum fits TRIANGLE_BYTES over the upper triangle alone (_triangle_gradients: the rows past
  each band from the same block's transposed product); each gradient summed in float32 in cuBLAS's
  epilogue (addmm with out_dtype), then times the logit scale once.

Where the forward's logits come from is FORWARD_LOGITS ("kernel": the fused Triton kernel computes its own
products; "cublas": the band design above, every kernel elementwise; "dense": written whole and kept). The
first design's backward (the products inside the kernels, two views in one kernel) is gone: an H200 ran its
two-view kernel at N = 32768 in 3700 ms against the default's 40.9, and no table showed a setting where it was
fastest (docs/gpu/NVIDIA-H200/README.md). Cost in [M, K, D] matrix products (docs/performance.md):

    two views      forward 1, backward 2 (recompute, (dL + dL^T) z)   = 3
      triangle     forward (R + 1) / 2R, backward (R + 1) / 2R + 1, R bands ~ 2
    image-text     forward 1, backward 3 (recompute, dA, dB)          = 4
    rows only      forward 1, backward 3                              = 4

Small M (few row tiles) splits the other axis over programs (flash-decoding style), each split's partial
statistics (or gradients, in float32) combined by a few torch ops. On CUDA the tiles, warps and pipeline
stages are autotuned (triton/launch.py); under TRITON_INTERPRET=1 (the CPU tests) the production default.

Products accumulate in float32; float32 inputs use TF32 where the user allows it for float32 matmuls
(precision.tf32_matmul_allowed: the legacy allow_tf32 flag or torch >= 2.9's fp32_precision) and the GPU has it
(sm_80 and later, plan.ampere_or_later; before it auto's products are all cuBLAS's, bfloat16 features taken in
float32), on the band design as float16 copies of their unit vectors (HALF_UNITS_FOR_TF32, the same 10 mantissa
bits), as float16 features normalised there do (FLOAT16_UNITS: their range). In backward dL meets b (or a) in the
inputs' dtype: bfloat16, float16 (dL divided by a factor first, so that its small entries stay in float16's
range; the factor is put back on the float32 sum), or float32 (bfloat16 and float32 have float32's range: no
factor). Statistics are float32. No host synchronisation: the scale is read on the device, shapes never depend on
values. Memory beyond the inputs, their gradients and the statistics: in forward the partials (at most
PARTIAL_BYTES, 128 MiB) and the band design's float32 products (LOGIT_BAND_BYTES, 256 MiB); in backward one
block's float32 logits and d logits and, for half-precision inputs, the gradients' float32 sums (dB: K D 4 bytes;
dA: a group's rows D 4 bytes, at most GROUP_ELEMENTS; two views over the triangle: dz, M D 4 bytes, at most
TRIANGLE_BYTES), all of it within dlogits.BACKWARD_BYTES (896 MiB: the block takes what the sums leave).
"""

from __future__ import annotations

import torch
import triton
from torch._subclasses.fake_tensor import is_fake

from contrastkit.losses import plan, precision
from contrastkit.losses.chunked import _low, _mm_f32, _operand, no_autocast
from contrastkit.losses.functional import half_units, inverse_norms, normalization_backward, projection_weights
from contrastkit.losses.plan import host_checks_allowed
from contrastkit.losses.triton import dlogits, launch
from contrastkit.losses.triton.dlogits import block_shape, write_dlogits
from contrastkit.losses.triton.stats_fwd import forward_stats

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRETED = launch.INTERPRETED


def _tiles(blocks):
    return None if blocks is None else dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_D"), blocks))


# Where the forward's logits come from (the band design, issue 40): "kernel", the fused Triton kernel computes
# its own products; "cublas", cuBLAS writes a band's products in float32 and the kernel reads them (then every
# kernel is elementwise: no product inside, no atomics, no cooperation between programs). The backward's are
# always cuBLAS's (recomputed per block, or the dense path's kept ones): an H100 measured the Triton products
# L2-bound (0.19-0.57 of cuBLAS's rate), and an H200 the first design's two-view backward kernel at 3700 ms
# (N = 32768) against 40.9 for the default. The fused forward ran the two-view statistics at N = 32768 in
# 11.8 ms on the H100, where a band forward is predicted at ~18; on the H200 the band path (cuBLAS's forward)
# measured 48.8 ms against the default's 40.9 for two views, 23.8 against 20.1 for image-text.
# "auto" (forward): the fused kernel for bf16/fp16 inputs, where it was measured, and for float32 with TF32 on
# its float16 unit vectors (HALF_UNITS_FOR_TF32: float16's kernel); other float32 on cuBLAS's products, since a
# fused float32 kernel becomes a default only with a GPU table that shows it faster.
# The dense path (forward "dense"): where the whole float32 matrix fits DENSE_BYTES, cuBLAS writes it once in
# forward and backward reads it back, no recompute: 2 products for two views, 3 for image-text (the floors).
# "auto" takes it there (the model predicts it the fastest where it fits: a SimCLR batch of 2N <= 8192, a
# CLIP GPU's 2048 local rows against 65536 gathered columns); it keeps 4 M K bytes from forward to backward.
LOGITS = ("kernel", "cublas", "dense")
FORWARD_LOGITS = "auto"
DENSE_BYTES = 2**29
# Two views' backward over the upper triangle (_triangle_gradients) where its float32 sum of dz, M D 4 bytes,
# fits this (up to N = 65536 at D = 512; beyond it the full rows of _band_gradients, whose sums are a band's).
TRIANGLE_BYTES = 2**28
# The bands' backward (_band_gradients) normalises dA's rows a group of bands at a time, their float32 sums
# this many elements (16 MiB; at least one band's), or 4x where dlogits.BACKWARD_BYTES has room for that beside
# the block's least: at N = 32768, D = 512 one pass of a few operators, not one per band (16 bands: image-text's
# call 249 operators, 189 in groups of 2^22 elements); at N = 262144 dB's sum leaves no room (2^24 there went
# to 1063 MiB against the 1 GiB, tests/losses/test_memory.py).
GROUP_ELEMENTS = 2**22
# float32 features with TF32 allowed, normalised in the kernels, on the band design: the products' operands
# are float16 copies of the unit vectors (functional.half_units), the d logits float16, so that the call runs
# as a float16 one at the 16-bit GEMM rate, twice TF32's, with the gradients float32. TF32 keeps 10 mantissa
# bits, and so does float16: a unit vector's components (<= 1) round alike where they are at least 2^-14,
# below it to within 2^-25 absolutely (the error of a dot product grows by at most sqrt(D) 2^-25 against
# TF32's ~2^-11); the d logits are scaled into float16's range (_units_factor). cuBLAS's own
# CUBLAS_COMPUTE_32F_FAST_16F does the same for float32 products. False: TF32 products (docs/kernels.md).
HALF_UNITS_FOR_TF32 = True
# float16 features normalised in the kernels take the same float16 unit vectors (FLOAT16_UNITS): their
# d logits would otherwise carry both rows' inverse norms p inv_a inv_b: overflowing float16 for rows of norm
# ~0.005 and a peaked softmax, and sinking into its subnormals for rows of large norm (norm 1000, 128 rows at
# logit scale 10: the gradient 24 % off; the fraction grows with the batch, as p ~ 1 / M). Units have norm 1,
# and their d logits are placed in float16's range by _units_factor (tests: test_float16_features_of_any_norm);
# the cost is one more float16 rounding, of each unit vector (2^-11 relative, as the features' own: the
# statistics within ~2e-3 of the features' at logit scale 10), and the units' copies in each pass.
FLOAT16_UNITS = True
# Two views' forward over the upper triangle in the fused kernel (stats_fwd's TRIANGLE, "kernel" forward
# logits): proven under the interpreter and compiled spill-free for sm_90/sm_80. It is issue 40's stretch
# (triangle tiles in a fused GEMM kernel), a default only with a GPU table showing it correct and faster: the
# H200's (docs/gpu/NVIDIA-H200) showed it slower, dcl-triton-tri 46.1 ms against dcl-triton's 40.9 (the fused
# kernel over full rows) at N = 32768, so it stays off. The band path's forward ("cublas": cuBLAS's products,
# an elementwise pass) takes the triangle regardless, as the backward does.
FUSED_TRIANGLE = False


def _write_product(out, x, y):
    """out = x @ y in float32, on cuBLAS (bf16/fp16 operands written in float32 through out_dtype, float32 ones
    in TF32 where torch's own setting allows it); under the interpreter from float32 copies (_operand)."""
    x, y = _operand(x), _operand(y)
    if _low(x):
        torch.mm(x, y, out_dtype=torch.float32, out=out)
    else:
        torch.mm(x, y, out=out)


@launch.operator("contrastkit::negative_stats")
def _negative_stats(a: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor, inv_a: torch.Tensor | None,
                    inv_b: torch.Tensor | None, exclude: torch.Tensor | None, ids_a: torch.Tensor | None,
                    ids_b: torch.Tensor | None, labels: int, with_mean: bool, columns: bool, tf32: bool,
                    blocks: list[int] | None, forward_logits: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the statistics, the float32 logits kept for backward: the dense path, else empty); b None: the
    candidates are a (two views on one process); inv_a, inv_b: the rows' inverse norms where a and b are the
    features as given (the kernels normalise), else None; ids_a, ids_b, labels: the samples' ids and the
    kernels' LABELS (triton/common.kept_by_label; 0: none)."""
    a, b, inv_a, inv_b, tf32, _ = _operands(a, b, inv_a, inv_b, tf32)
    inputs = _inputs(scale, exclude, with_mean, columns, tf32, blocks, inv_a, inv_b, ids_a, ids_b, labels)
    # L symmetric: its upper triangle (the fused kernel's only where FUSED_TRIANGLE)
    fused_triangle = FUSED_TRIANGLE and forward_logits == "kernel"
    triangle = b is None and not columns and (forward_logits == "cublas" or fused_triangle)
    b = a if b is None else b
    product = None
    if forward_logits in ("cublas", "dense"):
        def product(r0, r1, c0, out):
            _write_product(out, a[r0:r1], b[c0:].T)
    kept = a.new_empty((a.shape[0], b.shape[0]) if forward_logits == "dense" else (0, 0), dtype=torch.float32)
    stats = forward_stats(a, b, inputs, product, kept if forward_logits == "dense" else None, triangle)
    return stats, kept


def _inputs(scale, exclude, with_mean, columns, tf32, blocks, inv_a, inv_b, ids_a, ids_b, labels):
    """The kernels' shared inputs from the operators' flat arguments (b None: a's norms and ids serve b)."""
    norms = None if inv_a is None else (inv_a, inv_a if inv_b is None else inv_b)
    by_label = None if labels == 0 else (ids_a, ids_a if ids_b is None else ids_b, labels)
    return launch.KernelInputs(scale, exclude, with_mean, columns, tf32, _tiles(blocks), norms, by_label)


def _operands(a, b, inv_a, inv_b, tf32):
    """(a, b, inv_a, inv_b, tf32, given): what the products take, the same in forward and backward. Where the
    call runs on units (plan.takes_units): the float16 unit vectors of a and of b (None: b is a), no inverse
    norms, no TF32, and given = (the features, their inverse norms), whose gradients backward returns; else
    the arguments as they are and given None."""
    if not plan.takes_units(a.dtype, inv_a is not None, tf32):
        return a, b, inv_a, inv_b, tf32, None
    given = (a, a if b is None else b, inv_a, inv_a if inv_b is None else inv_b)
    return half_units(a, inv_a), None if b is None else half_units(b, inv_b), None, None, False, given


def _units_factor(grad, scale, with_mean):
    """float16 d logits of unit vectors: dL / factor then lies within 2^15 (half of float16's largest), so that
    their small entries keep float16's normal range down to 2^-14 of that. |dL'| <= 2 max |grad| (1 + (2 +
    1 / scale) with the mean): p, and CACR's mean term with cosines in [-1, 1] (common.anchor_grad), twice
    for the columns' or the transposed term; the kernels fold no inverse norms in (the operands are units)."""
    bound = 2 * (3 + 1 / scale.clamp_min(torch.finfo(torch.float32).tiny)) if with_mean else 2
    return grad.abs().amax().clamp_min(torch.finfo(torch.float32).tiny) * bound * 2**-15


# addmm with out_dtype under fake tensors (torch.compile, the meta device) fails before torch 2.13: its
# decomposition took out_dtype for beta (pytorch/pytorch#179634, in 2.13; 2.11 and 2.12.1 still have it).
_FAKE_ADDMM_OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def _add_product(out, x, y, accumulate):
    """out (+ out where ``accumulate``) = x @ y with float32 sums, one cuBLAS call whose epilogue adds out (beta
    1): bfloat16/float16 operands written in float32 (addmm's out_dtype, as Liger-Kernel's fused linear
    cross-entropy sums its gradients), float32 ones in TF32 where torch's own setting allows it (as the user's
    other float32 products); under the interpreter (the CPU tests) from float32 copies (chunked._operand)."""
    x, y = _operand(x), _operand(y)
    if not _low(x):
        torch.addmm(out, x, y, beta=int(accumulate), out=out)
    elif _FAKE_ADDMM_OUT_DTYPE or not (is_fake(out) or out.device.type == "meta"):
        torch.addmm(out, x, y, out_dtype=torch.float32, beta=int(accumulate), out=out)
    elif accumulate:  # traced on torch < 2.13: the product written, then added
        out.add_(_mm_f32(x, y))
    else:
        out.copy_(_mm_f32(x, y))


def _finish(total, x, inv, weight, factor, out=None, units=False):
    """A gradient from its float32 sum of products of d logits: times ``factor`` (the logit scale, and the
    d logits' own factor: d logits in float16 stay in range without either), then F.normalize's
    backward where the rows' inverse norms ``inv`` are given, with their ``weight``
    (functional.normalization_backward, projection_weights), written into ``out`` in its dtype, or in place in
    ``total`` where out is None. units: the products were of the unit vectors (functional.half_units), so the sum
    is d loss / d unit vector, which the normalisation's backward takes times inv."""
    if inv is not None:
        total.mul_(factor)
        normalization_backward(total.mul_(inv[:, None]) if units else total, x, weight, total if out is None else out)
    elif out is None:
        total.mul_(factor)
    else:
        torch.mul(total, factor, out=out)


def _block_logits(a, b, r0, r1, c0, c1, kept, buffer):
    """The float32 logits of the block a[r0:r1] b[c0:c1]^T that the d-logits kernel reads: the dense path's kept
    ones, else cuBLAS's written into ``buffer``."""
    if kept is not None:
        return kept[r0:r1, c0:c1]
    out = buffer[: r1 - r0, : c1 - c0]
    _write_product(out, a[r0:r1], b[c0:c1].T)
    return out


def _made(a, b, given, symmetric):
    """Bytes of the operands the call made, which live beside the backward's buffers: two views' stack of the
    views (symmetric), float16 unit vectors (given)."""
    if given is not None:
        return a.nbytes + (0 if symmetric or b is a else b.nbytes)
    return a.nbytes if symmetric else 0


def band_blocks(m: int, k: int, d: int, entry: int, held: int, low: bool) -> tuple[int, int, int]:
    """(rows, columns, group rows) of _band_gradients' blocks: a block's entries (``entry`` bytes each) within
    dlogits.BACKWARD_BYTES beside ``held`` bytes (dB's float32 sum, the operands the call made) and, for 16-bit
    gradients (``low``), dA's float32 sums over a group of rows: up to 4 GROUP_ELEMENTS where that leaves the
    block its least (at N = 32768, D = 512 every row: one pass), else GROUP_ELEMENTS."""
    group = min(m * d, 4 * GROUP_ELEMENTS)
    if dlogits.BACKWARD_BYTES - held - 4 * group * low < dlogits.BLOCK_MIN_ELEMENTS * entry:
        group = GROUP_ELEMENTS
    rows, cols = block_shape(m, k, entry, held + 4 * group * low)
    return rows, cols, max(1, group // d // rows) * rows


def _band_gradients(a, b, inputs, stats, grad, factor, symmetric=False, kept=None, given=None):
    """(dA, dB, the rows' d scale terms / factor) of two operands, from the forward's statistics, their upstream
    gradient dL / factor (factor None: dL itself) and the call's inputs (launch.KernelInputs): per block of d
    logits (a band of rows and every column, or at large sizes a square, dlogits.block_shape), d logits once
    (dlogits.py), then its two products on cuBLAS (an H100 ran the band's product shape 2.6x faster there than in
    a Triton kernel of ours: docs/gpu/NVIDIA-H100-80GB-HBM3/kernels.md), each gradient summed over the blocks in
    float32. The block's logits are recomputed by cuBLAS into a float32 buffer that the d logits kernel reads
    (the buffer and the d logits are what dlogits.BACKWARD_BYTES bounds, beside the float32 sums and the operands
    the call made: _made), or where ``kept`` is given, the whole matrix's float32 logits from forward (the dense
    path), read in place of a recompute. symmetric (two views, b is a): d logits dL + dL^T, one product, dA is dz
    and dB empty. Where the inputs carry inverse norms (a and b the features as given) the products give the unit
    vectors' gradients times the inverse norms, in float32, and the normalisation's backward
    (functional.normalization_backward) makes the features' own, a's rows a group of bands at a time
    (GROUP_ELEMENTS), b's once every band has added to them. given: (the features, their inverse norms) where a
    and b are float16 copies of their unit vectors (functional.half_units): the gradients are then the features'
    own, in their dtype."""
    m, k, d = a.shape[0], b.shape[0], a.shape[1]
    x_a, x_b, inv_a, inv_b = given or (a, b, *(inputs.inverse_norms or (None, None)))
    low = x_a.dtype != torch.float32  # the products' sums then need float32 buffers: a group's rows of dA, all of dB
    held = 4 * d * (0 if symmetric else k) * low + _made(a, b, given, symmetric)
    rows, cols, group = band_blocks(m, k, d, (4 if kept is None else 0) + a.element_size(), held, low)
    da = torch.empty_like(x_a, memory_format=torch.contiguous_format)
    db = a.new_empty(0) if symmetric else torch.empty_like(x_b, memory_format=torch.contiguous_format)
    da_sum = a.new_empty((min(group, m), d), dtype=torch.float32) if low else None
    db_sum = torch.empty_like(db, dtype=torch.float32) if low and not symmetric else db
    splits, share = launch.split(triton.cdiv(rows, 64), cols, a.device)
    ds = a.new_empty((triton.cdiv(k, cols), splits, min(group, m)), dtype=torch.float32)  # a group's d scale terms
    ds_rows = a.new_empty(m, dtype=torch.float32)
    dl = a.new_empty((rows, cols))
    logits = a.new_empty((rows, cols), dtype=torch.float32) if kept is None else None
    step = inputs.scale if factor is None else inputs.scale * factor  # on the sums, once
    w_a = None if inv_a is None else projection_weights(inv_a)
    for r0 in range(0, m, rows):
        r1 = min(r0 + rows, m)
        g0 = r0 - r0 % group  # the group's first row
        da_band = da[r0:r1] if da_sum is None else da_sum[r0 - g0 : r1 - g0]
        for j, c0 in enumerate(range(0, k, cols)):
            c1 = min(c0 + cols, k)
            block = dl[: r1 - r0, : c1 - c0]
            products = _block_logits(a, b, r0, r1, c0, c1, kept, logits)
            write_dlogits(a, b, inputs, stats, grad, block, ds[j, :, r0 - g0 : r1 - g0], r0, r1, c0, c1, splits,
                          share, products, symmetric)
            _add_product(da_band, block, b[c0:c1], c0 > 0)
            if not symmetric:
                _add_product(db_sum[c0:c1], block.T, a[r0:r1], r0 > 0)
        if r1 - g0 == group or r1 == m:  # the group's last band: its rows' d scale terms and gradients made
            torch.sum(ds[:, :, : r1 - g0], (0, 1), out=ds_rows[g0:r1])
            _finish(da[g0:r1] if da_sum is None else da_sum[: r1 - g0], x_a[g0:r1],
                    None if inv_a is None else inv_a[g0:r1], None if w_a is None else w_a[g0:r1], step,
                    None if da_sum is None else da[g0:r1], given is not None)
    if not symmetric:
        _finish(db_sum, x_b, inv_b, None if inv_b is None else projection_weights(inv_b), step,
                None if db_sum is db else db, given is not None)
    return da, db, ds_rows


def _triangle_gradients(z, inputs, stats, grad, factor, kept=None, given=None):
    """(dz, the rows' d scale terms / factor) of two views (L = s z z^T, symmetric) over the upper triangle
    alone: per band of rows r0:r1 the blocks of columns from r0 on, their logits from cuBLAS (or the dense
    path's ``kept``), d logits H = dL' + dL'^T once (dlogits.py's SYMMETRIC, TRIANGLE), then dz[r0:r1] += H
    z[c0:c1] and, for the columns past the band, dz[c0:c1] += H^T z[r0:r1] (the lower triangle's share, by
    symmetry), dz times the logit scale at the end. Against _band_gradients' full rows: half the recompute and
    half the d logits pass, the same product FLOPs (docs/performance.md). dz is summed in float32 [M, D]
    (TRIANGLE_BYTES bounds it), then normalised as _band_gradients' (functional.normalization_backward) where
    the inputs carry inverse norms, or ``given`` (the features and their inverse norms, _band_gradients')
    where z is a float16 copy of their unit vectors."""
    m, d = z.shape
    x, inv = given[::2] if given else (z, None if inputs.inverse_norms is None else inputs.inverse_norms[0])
    held = 4 * m * d + _made(z, z, given, True)  # dz's float32 sum
    rows, cols = block_shape(m, m, (4 if kept is None else 0) + z.element_size(), held)
    dz = z.new_empty((m, d), dtype=torch.float32)  # the first band writes every row: its own, then the rest
    splits, share = launch.split(triton.cdiv(rows, 64), cols, z.device)
    ds = z.new_empty((triton.cdiv(m, cols), splits, rows), dtype=torch.float32)
    ds_rows = z.new_empty(m, dtype=torch.float32)
    dl = z.new_empty((rows, cols))
    logits = z.new_empty((rows, cols), dtype=torch.float32) if kept is None else None
    for r0 in range(0, m, rows):
        r1 = min(r0 + rows, m)
        blocks = range(r0, m, cols)
        for j, c0 in enumerate(blocks):
            c1 = min(c0 + cols, m)
            block = dl[: r1 - r0, : c1 - c0]
            products = _block_logits(z, z, r0, r1, c0, c1, kept, logits)
            write_dlogits(z, z, inputs, stats, grad, block, ds[j, :, : r1 - r0], r0, r1, c0, c1, splits, share,
                          products, symmetric=True, triangle=True)
            _add_product(dz[r0:r1], block, z[c0:c1], r0 > 0 or c0 > r0)
            past = max(c0, r1)  # the block's columns past the band: their rows' share, the lower triangle's
            if past < c1:
                _add_product(dz[past:c1], block[:, past - c0:].T, z[r0:r1], r0 > 0)
        torch.sum(ds[: len(blocks), :, : r1 - r0], (0, 1), out=ds_rows[r0:r1])
    out = None if x.dtype == torch.float32 else torch.empty_like(x, memory_format=torch.contiguous_format)
    step = inputs.scale if factor is None else inputs.scale * factor
    _finish(dz, x, inv, None if inv is None else projection_weights(inv), step, out, given is not None)
    return (dz if out is None else out), ds_rows


@launch.operator("contrastkit::negative_stats_backward")
def _negative_stats_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor,
                             inv_a: torch.Tensor | None, inv_b: torch.Tensor | None, exclude: torch.Tensor | None,
                             ids_a: torch.Tensor | None, ids_b: torch.Tensor | None, labels: int,
                             stats: torch.Tensor, kept: torch.Tensor, with_mean: bool, columns: bool, tf32: bool,
                             blocks: list[int] | None,
                             forward_logits: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dA, dB, per-row terms of d scale through the logits); b None: (dz, an empty dB, ...). kept: the
    forward's logits (the dense path), else empty; inv_a, inv_b: as the forward's (the gradients are then the
    features' own)."""
    logits = kept if forward_logits == "dense" else None
    a, b, inv_a, inv_b, tf32, given = _operands(a, b, inv_a, inv_b, tf32)  # as the forward's
    factor = None  # bfloat16 and float32 d logits have float32's range: no factor
    if a.dtype == torch.float16:  # dL / factor: in float16's range (units: _units_factor)
        factor = (_units_factor(grad, scale, with_mean) if given is not None
                  else grad.abs().amax().clamp_min(torch.finfo(torch.float32).tiny))
        grad = grad / factor
    inputs = _inputs(scale, exclude, with_mean, columns, tf32, blocks, inv_a, inv_b, ids_a, ids_b, labels)
    if b is None and not columns:
        if a.shape[0] * a.shape[1] * 4 <= TRIANGLE_BYTES:  # the upper triangle alone
            dz, ds = _triangle_gradients(a, inputs, stats, grad, factor, kept=logits, given=given)
        else:  # full rows: dL + dL^T per band, one product
            dz, _, ds = _band_gradients(a, a, inputs, stats, grad, factor, symmetric=True, kept=logits, given=given)
        return dz, a.new_empty(0), ds if factor is None else ds * factor
    da, db, ds = _band_gradients(a, a if b is None else b, inputs, stats, grad, factor, kept=logits, given=given)
    ds = ds if factor is None else ds * factor
    if b is None:  # one tensor as both operands, image-text style: both roles' gradients
        return da + db, a.new_empty(0), ds
    return da, db, ds


def _setup_context(ctx, inputs, output):
    a, b, scale, inv_a, inv_b, exclude, ids_a, ids_b, ctx.labels, *ctx.options = inputs
    stats, kept = output
    ctx.mark_non_differentiable(kept)
    ctx.save_for_backward(a, b, scale, inv_a, inv_b, exclude, ids_a, ids_b, stats, kept)


def _backward(ctx, grad, _):
    a, b, scale, inv_a, inv_b, exclude, ids_a, ids_b, stats, kept = ctx.saved_tensors
    with_mean = ctx.options[0]
    with no_autocast(grad.device.type):  # backward() may be called inside the caller's autocast block
        grad = grad.to(torch.float32).contiguous()
        da, db, ds = torch.ops.contrastkit.negative_stats_backward(grad, a, b, scale, inv_a, inv_b, exclude, ids_a,
                                                                   ids_b, ctx.labels, stats, kept, *ctx.options)
        d_scale = ds.sum()
        if with_mean:  # mean = sum p L / scale: its own 1 / scale
            d_scale = d_scale - (grad[1] * stats[1]).sum() / scale
    return da, None if b is None else db, d_scale, *(None,) * 11


_negative_stats.register_autograd(_backward, setup_context=_setup_context)


def _check(anchors, candidates, scale, exclude, with_mean, columns, blocks, forward_logits):
    if forward_logits not in LOGITS:
        raise ValueError(f"negative_stats_triton: forward_logits must be one of {', '.join(LOGITS)} or auto, "
                         f"got {forward_logits!r}")
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
                          block_m: int | None = None, block_n: int | None = None, block_d: int | None = None,
                          forward_logits: str | None = None,
                          normalize: bool = False, labels: tuple[torch.Tensor, torch.Tensor] | None = None,
                          same_label: bool = True, tf32: bool | None = None) -> torch.Tensor:
    """chunked.negative_stats on Triton kernels: [S, M] float32 statistics of the logits scale * a @ b.T.

    anchors [M, D] and candidates [K, D] (float32, bfloat16 or float16; float64 raises TypeError); scale a
    number or a 0-dim tensor (gets its gradient); exclude [M, E] int64 column indices left out of each row.
    Rows: lse, then mean (with_mean); with columns (square, exclude None or the diagonal) then the columns'
    lse. A row whose every column is excluded gets a hugely negative lse (as chunked.py's), mean 0, and no
    gradient; an exclude index outside [0, K) excludes nothing (indices are not checked: that would sync).
    candidates the very tensor anchors (two views): one gradient for it, from one product of dL + dL^T.
    block_m, block_n, block_d: fixed tiles (powers of two >= 16, all three or none); None: autotuned on
    CUDA, the production default under the interpreter. forward_logits: where the forward's logits come
    from (LOGITS): "kernel" (the fused kernel's own products) or "cublas" (a band's, written by cuBLAS;
    backward recomputes each block there in both cases), or "dense" (cuBLAS writes the whole matrix once and
    backward reads it: no recompute) or "auto" (dense where the float32 matrix fits DENSE_BYTES, else the
    kernel for bf16/fp16 or float16 units, measured on an H100 and an H200, and cuBLAS for float32 and on
    GPUs before sm_80, where Triton's products take no tensor cores (plan.ampere_or_later: there
    bfloat16 features are taken in float32, since cuBLAS writes no float32 product of them); two views'
    forward visits the upper triangle on cuBLAS's products, on the kernel's only where FUSED_TRIANGLE);
    None: FORWARD_LOGITS. normalize: the logits are those of the unit
    vectors, scale cos(a_i, b_k): the kernels take the features as given with their float32 inverse norms
    (functional.inverse_norms), so no unit vectors are made or kept (float16 features, and float32 with
    TF32: float16 copies of them, made in each pass, none kept: FLOAT16_UNITS, HALF_UNITS_FOR_TF32), and the
    gradients are the features' own (F.normalize's backward per band).
    labels (rows only): (row ids [M], column ids [K]) integers; the pairs whose ids are equal are left out
    too (``same_label``: labels as false negatives), or with same_label=False those whose ids differ (the
    statistics over each anchor's same-label candidates), as chunked.negative_stats' labels; one tensor as
    anchors and candidates (two views) reads the row ids for both. tf32: whether float32 products may use TF32
    (the losses pass their plan's; None: read here, plan.triton_route).
    """
    given = [x for x in (block_m, block_n, block_d) if x is not None]
    if given and len(given) != 3:
        raise ValueError("negative_stats_triton: give block_m, block_n and block_d together, or none of them")
    blocks = given or None
    same = candidates is anchors
    ampere = plan.ampere_or_later(anchors.device)
    if anchors.dtype == torch.bfloat16 and not ampere:
        # before sm_80 cuBLAS writes no float32 product of bfloat16 operands: their float32 copies (exact)
        anchors = anchors.float()
        candidates = anchors if same else candidates.float()
    if forward_logits in (None, "auto") or tf32 is None:
        logits, tf32, _ = plan.triton_route(anchors.shape[0], candidates.shape[0], anchors.dtype, normalize,
                                            anchors.device, precision.tf32_matmul_allowed())
        forward_logits = logits if forward_logits in (None, "auto") else forward_logits
    _check(anchors, candidates, scale, exclude, with_mean, columns, blocks, forward_logits)
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=anchors.device, dtype=torch.float32)
    else:
        scale = torch.full((), float(scale), dtype=torch.float32, device=anchors.device)
    if exclude is not None:
        exclude = exclude.contiguous()
    ids_a = ids_b = None
    if labels is not None:
        ids_a, ids_b = _check_labels(labels, anchors, candidates, columns)
    inv_a = inverse_norms(anchors) if normalize else None
    inv_b = None if same or not normalize else inverse_norms(candidates)
    return _negative_stats(anchors, None if same else candidates, scale, inv_a, inv_b, exclude, ids_a,
                           None if same else ids_b, 0 if labels is None else 1 if same_label else 2, with_mean,
                           columns, tf32, blocks, forward_logits)[0]


def _check_labels(labels, anchors, candidates, columns):
    """The ids of a labels=(row ids, column ids) argument, contiguous int64, or a ValueError naming the problem."""
    if columns:
        raise ValueError("negative_stats_triton: columns=True takes no labels: give each direction as rows")
    ids = []
    for name, x, rows in (("row ids", labels[0], anchors.shape[0]), ("column ids", labels[1], candidates.shape[0])):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] != rows or x.is_floating_point():
            raise ValueError(f"negative_stats_triton: labels' {name} must be an integer tensor of {rows} entries, "
                             f"got {x.dtype if isinstance(x, torch.Tensor) else type(x).__name__} "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}")
        if x.device != anchors.device:
            raise ValueError(f"negative_stats_triton: labels' {name} are on {x.device}, anchors on {anchors.device}")
        ids.append(x.to(torch.int64).contiguous())
    return ids
