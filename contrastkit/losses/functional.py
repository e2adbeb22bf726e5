"""Score-level kernels: each objective written once, over similarity scores.

Every setting (two views, query/queue, image-text, wav2vec 2.0 frames) only builds the scores:

- ``pos``: [M] cosine similarity of each anchor with its positive, or [M, P] with P positives;
- ``neg``: [M, K] cosine similarity of each anchor with its candidate negatives;
- ``neg_mask``: optional [M, K] bool, True where a negative is valid.

Each kernel returns the per-anchor loss [M] in float32 (float64 if given float64), computed in the
log domain whatever the autocast dtype. With P positives the per-anchor loss is the mean over its
positives of the single-positive loss (each positive contrasted with the same negatives).
An anchor with no valid negative is an error, never a silent inf or NaN.

>>> pos, neg = torch.rand(8), torch.rand(8, 14)
>>> dcl(pos, neg, temperature=0.1).shape
torch.Size([8])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from contrastkit.losses.chunked import NORM_EPS, drop_along, no_autocast
from contrastkit.losses.plan import host_checks_allowed

__all__ = ["infonce", "dcl", "dclw", "eqco", "cacr", "unigrad", "npc_multiplier", "dclw_weights", "normalize_rows"]


class Terms(NamedTuple):
    """Per-anchor loss and its diagnostics ([M] each; diagnostics detached, None where a call did not ask for
    them: output_dict=False)."""

    loss: torch.Tensor
    pos_term: torch.Tensor | None
    neg_term: torch.Tensor | None
    npc: torch.Tensor | None  # q_B = 1 - softmax probability of the positive (DCL paper, Prop. 1)


Partial = torch.Tensor | float | None  # a derivative per anchor [M], one for all anchors, or zero (None)


class LogitTerms(NamedTuple):
    """Per-anchor loss [M] of one positive per anchor and its partial derivatives in the negatives' lse and their
    softmax-weighted mean logit, the positive's pull (minus the derivative in its logit: the same tensor or
    number as d_lse or d_mean where it equals it, which backward then reuses), and the derivative in the scale
    where the loss depends on it beside the logits (CACR): what the dense path's backward needs of an
    objective (dense.py)."""

    loss: torch.Tensor
    d_lse: Partial
    d_mean: Partial
    pull: Partial
    d_scale: torch.Tensor | None


# ----------------------------------------------------------------------------- features


class _NormalizeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        divisor = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(NORM_EPS)
        y = x / divisor
        ctx.save_for_backward(y, divisor)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        y, divisor = ctx.saved_tensors
        with no_autocast(grad.device.type):  # in the features' dtype, also where backward() runs under autocast
            # A row whose norm was clamped (divisor eps) is divided by a constant: its gradient is grad / eps.
            return drop_along(grad, y, divisor > NORM_EPS).div_(divisor)


# Rows per pass of the row helpers below (the Triton path's norms, positives and normalisation backward): their
# float32 work stays within 2^24 elements (64 MiB), one pass for [32768, 512] features. Each pass is a few
# operators, each some 30 us of host time on an H200 (issue 59: with 2^22, four passes, a default image-text call
# at N = 32768 issued 350 operators, 249 with one pass; two views 348, 237: profile_call.py --count); the memory
# tests' bounds (tests/losses/test_memory.py, N = 262144) hold.
_LOW_CHUNK_ELEMENTS = 2**24


def _row_chunks(rows: int, d: int):
    step = max(1, _LOW_CHUNK_ELEMENTS // max(d, 1))
    return ((r0, min(r0 + step, rows)) for r0 in range(0, rows, step))


def _by_chunks(rows: int, d: int, fn):
    """fn(r0, r1) -> a tuple of tensors over rows r0:r1, over all rows: fn's own result where one chunk covers
    them (no copy: an operator fewer per call, which counts where a step is host-bound), else written into
    buffers chunk by chunk (no list of chunks held beside the result)."""
    chunks = list(_row_chunks(rows, d))
    if len(chunks) == 1:
        return fn(0, rows)
    out = None
    for r0, r1 in chunks:
        part = fn(r0, r1)
        if out is None:
            out = tuple(t.new_empty((rows, *t.shape[1:])) for t in part)
        for buffer, t in zip(out, part):
            buffer[r0:r1] = t
    return out


def inverse_norms(x: torch.Tensor) -> torch.Tensor:
    """1 / max(||x_i||, eps) per row of x [rows, D] (F.normalize's divisor), float32, computed in chunks of rows
    (no float32 copy of x), no gradient: the Triton kernels scale the products of the features as given by
    them, so that no unit vectors are made (issue 40)."""
    def rows(r0, r1):
        norm = torch.linalg.vector_norm(x[r0:r1], dim=-1, dtype=torch.float32)
        return (norm.clamp_min_(NORM_EPS).reciprocal_(),)

    with torch.no_grad():
        return _by_chunks(x.shape[0], x.shape[1], rows)[0]


# inverse_norms' value for a clamped row, float32's 1 / eps, made on the host once: a tensor made from a Python
# number on CUDA in a training step is a host-to-device copy (a sync; the first GPU run found one here).
_CLAMPED_INVERSE = float(1.0 / torch.tensor(NORM_EPS, dtype=torch.float32))


def projection_weights(inv: torch.Tensor) -> torch.Tensor:
    """normalization_backward's weights [rows, 1] from the rows' inverse norms [rows]: inv^2, 0 for a row whose
    norm was clamped to eps (a constant divisor: no projection). Made once per call, not per band of rows."""
    return (inv * inv).mul_(inv < _CLAMPED_INVERSE)[:, None]


def normalization_backward(pre: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = d loss / d x from pre = inv * (d loss / d unit vector) (float32, [rows, D]): F.normalize's
    backward, pre - inv^2 (x . pre) x, with the rows' ``weight`` (projection_weights). out may be pre itself;
    the float32 work goes in chunks of rows (one chunk: the tensors as they are, no slices)."""
    rows = x.shape[0]
    for r0, r1 in _row_chunks(rows, x.shape[1]):
        whole = r1 - r0 == rows
        v = x if whole else x[r0:r1]
        drop_along(pre if whole else pre[r0:r1], v if v.dtype == torch.float32 else v.float(),
                   weight if whole else weight[r0:r1], out=out if whole else out[r0:r1])


@torch.library.custom_op("contrastkit::half_units", mutates_args=())
def half_units(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x_i / ||x_i|| in float16 from x [rows, D] and its rows' inverse norms [rows] (inverse_norms): the float32
    product rounded once, no float32 copy made. What the Triton path's products take for float16 features and
    for float32 ones under TF32 (triton.stats.FLOAT16_UNITS, HALF_UNITS_FOR_TF32). An operator of its own, so that torch.compile keeps the
    rounding (Inductor drops a float16 round trip inside a fused kernel: emulate_precision_casts)."""
    return torch.mul(x, inv[:, None], out=x.new_empty(x.shape, dtype=torch.float16))


@half_units.register_fake
def _half_units_shape(x, inv):
    return x.new_empty(x.shape, dtype=torch.float16)


class _RowCosines(torch.autograd.Function):
    """cos(a_i, b_i) per row in float32 from features in any dtype (the products exact, the sums float32),
    keeping the features as given and their rows' float32 divisors max(||x||, eps) and cosines for backward
    (12 bytes a row), chunked. With ``normalize`` False the plain dot products; with ``units16`` the cosines of
    the unit vectors rounded to float16, and the gradient through those (straight through the rounding)."""

    @staticmethod
    def forward(ctx, a, b, normalize, units16):
        flat_a, flat_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])

        def rows(r0, r1):
            x, y = flat_a[r0:r1].float(), flat_b[r0:r1].float()
            if not normalize:
                return (torch.linalg.vecdot(x, y, dim=-1),)
            divisor = torch.stack([torch.linalg.vector_norm(x, dim=-1), torch.linalg.vector_norm(y, dim=-1)], dim=1)
            divisor.clamp_min_(NORM_EPS)
            if units16:
                return torch.linalg.vecdot(_rounded(x, divisor[:, 0]), _rounded(y, divisor[:, 1]), dim=-1), divisor
            return torch.linalg.vecdot(x, y, dim=-1), divisor

        parts = _by_chunks(flat_a.shape[0], flat_a.shape[1], rows)
        out = parts[0]
        if normalize:
            divisor = parts[1]  # [rows, 2]: a's, b's
            out = out if units16 else out / (divisor[:, 0] * divisor[:, 1])
            ctx.save_for_backward(a, b, divisor, out)
        else:
            ctx.save_for_backward(a, b)
        ctx.normalize, ctx.units16 = normalize, units16
        return out.view(a.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b, *saved = ctx.saved_tensors
        with no_autocast(grad.device.type):
            flat_a, flat_b, g = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), grad.reshape(-1, 1).float()
            if ctx.normalize and not ctx.units16:
                # d cos / d x = y / (|x| |y|) - cos x / |x|^2, the second term dropped for a row whose norm was
                # clamped to eps (F.normalize's constant divisor): per row one factor on y and one on x.
                divisor, cos = saved[0], saved[1][:, None]
                on_other = g / (divisor[:, :1] * divisor[:, 1:])
                on_own = (g * cos) * (divisor > NORM_EPS) / divisor.square()  # [rows, 2]: for a, for b

            def rows(r0, r1):
                x, y = flat_a[r0:r1].float(), flat_b[r0:r1].float()
                if not ctx.normalize:
                    return (g[r0:r1] * y).to(a.dtype), (g[r0:r1] * x).to(b.dtype)
                if ctx.units16:  # F.normalize's backward of g times the other's rounded unit vector
                    div = saved[0][r0:r1]
                    return (_rounded_gradient(g[r0:r1], x, div[:, :1], _rounded(y, div[:, 1])).to(a.dtype),
                            _rounded_gradient(g[r0:r1], y, div[:, 1:], _rounded(x, div[:, 0])).to(b.dtype))
                other, own = on_other[r0:r1], on_own[r0:r1]
                return (torch.addcmul(y * other, x, own[:, :1], value=-1.0).to(a.dtype),
                        torch.addcmul(x * other, y, own[:, 1:], value=-1.0).to(b.dtype))

            da, db = _by_chunks(flat_a.shape[0], flat_a.shape[1], rows)
            return da.view(a.shape), db.view(b.shape), None, None


def _rounded(x, divisor):
    """half_units of float32 rows x with their divisors, back in float32."""
    return half_units(x, divisor.reciprocal()).float()


def _rounded_gradient(g, x, divisor, other):
    """d (g u . other) / d x for u = x / divisor: (other - (u . other) u) g / divisor, the projection dropped
    for a row clamped to eps (chunked.drop_along)."""
    return drop_along(other, x / divisor, divisor > NORM_EPS).mul_(g / divisor)


def row_cosines(a: torch.Tensor, b: torch.Tensor, normalize: bool = True, units16: bool = False) -> torch.Tensor:
    """cos(a_i, b_i) (with ``normalize`` False: a_i . b_i) over the last dimension, in float32, exactly as the
    float32 unit vectors would give it, from features in any dtype, keeping for backward only 12 bytes a row
    (the rows' divisors and the cosine: backward then needs no norms again). units16 (with normalize): from
    the unit vectors rounded to float16, as the Triton path's products take float16 features and float32 ones
    under TF32 (the plan's half_units, plan.triton_route), so that a positive inside a row's lse cancels as the dense loss's
    does, whose positive is a logit of the same products."""
    return _RowCosines.apply(a, b, normalize, units16 and normalize)


class NonFiniteError(ValueError):
    """An input of a loss (scores, features, logit scale) holds inf or NaN: what a diverging run produces."""


def normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """``F.normalize(x, dim=-1)`` (x / max(||x||, 1e-12)) with its gradient written out,
    (grad - y <grad, y>) / ||x||. Autograd's composition of norm, clamp and a broadcast division makes
    many more passes over x: forward + backward of a [1024, 512] tensor took 2.3 ms against this 1.2 ms
    on a 2-core CPU, and a loss normalises two or more. Not twice differentiable."""
    return _NormalizeRows.apply(x)


# ----------------------------------------------------------------------------- validation


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_scores(pos, neg, neg_mask, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate the score inputs of a kernel; return pos as [M, P] and both in the compute dtype."""
    for arg, t in (("pos", pos), ("neg", neg)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: {arg} must be a floating-point tensor, got dtype {t.dtype}")
    if pos.dim() not in (1, 2):
        raise ValueError(f"{name}: pos must be [M] or [M, P], got shape {tuple(pos.shape)}")
    if neg.dim() != 2:
        raise ValueError(f"{name}: neg must be [M, K], got shape {tuple(neg.shape)}")
    if pos.shape[0] != neg.shape[0]:
        raise ValueError(f"{name}: pos has {pos.shape[0]} anchors but neg has {neg.shape[0]} (shapes "
                         f"{tuple(pos.shape)} and {tuple(neg.shape)})")
    if pos.shape[0] == 0:
        raise ValueError(f"{name}: no anchors (pos has shape {tuple(pos.shape)})")
    if pos.dim() == 2 and pos.shape[1] == 0:
        raise ValueError(f"{name}: pos has no positive per anchor (shape {tuple(pos.shape)})")
    if pos.device != neg.device:
        raise ValueError(f"{name}: pos is on {pos.device} but neg is on {neg.device}")
    if neg_mask is not None:
        if not isinstance(neg_mask, torch.Tensor) or neg_mask.dtype != torch.bool:
            raise ValueError(f"{name}: neg_mask must be a bool tensor, got "
                             f"{getattr(neg_mask, 'dtype', type(neg_mask).__name__)}")
        if neg_mask.shape != neg.shape:
            raise ValueError(f"{name}: neg_mask has shape {tuple(neg_mask.shape)}, neg has {tuple(neg.shape)}")
        if neg_mask.device != neg.device:
            raise ValueError(f"{name}: neg_mask is on {neg_mask.device} but neg is on {neg.device}")
    if neg.shape[1] == 0:
        raise ValueError(f"{name}: no negatives (neg has shape {tuple(neg.shape)}); every anchor needs at least one")
    if not host_checks_allowed(neg):  # CUDA or torch.compile: no host read of values (see host_checks_allowed)
        if neg_mask is not None and neg.is_cuda and not torch.compiler.is_compiling():
            torch._assert_async(neg_mask.any(dim=1).all(), f"{name}: an anchor has no valid negative in neg_mask")
        dtype = _compute_dtype(pos, neg)
        return (pos if pos.dim() == 2 else pos[:, None]).to(dtype), neg.to(dtype), neg_mask
    if neg_mask is not None:
        empty = int((~neg_mask.any(dim=1)).sum())
        if empty:
            raise ValueError(f"{name}: {empty} of {neg.shape[0]} anchors have no valid negative in neg_mask; "
                             "drop those anchors before calling the loss")
    if not bool(torch.isfinite(pos).all()):
        raise NonFiniteError(f"{name}: pos has non-finite values (inf or NaN)")
    bad = ~torch.isfinite(neg)
    if neg_mask is not None:
        bad &= neg_mask
    if bool(bad.any()):
        raise NonFiniteError(f"{name}: neg has {int(bad.sum())} non-finite values (inf or NaN) among valid negatives")
    dtype = _compute_dtype(pos, neg)
    pos = pos.to(dtype)
    return (pos if pos.dim() == 2 else pos[:, None]), neg.to(dtype), neg_mask


def _check_temperature(name: str, value: float, what: str = "temperature") -> None:
    """A positive, finite number; a tensor's values only where host reads are free (see host_checks_allowed)."""
    if isinstance(value, torch.Tensor):
        if host_checks_allowed(value) and (bool((value <= 0).any()) or not bool(torch.isfinite(value).all())):
            raise ValueError(f"{name}: {what} must be positive and finite")
    elif not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}: {what} must be positive and finite, got {value}")


def _masked_logits(neg: torch.Tensor, neg_mask: torch.Tensor | None, scale) -> torch.Tensor:
    logits = neg * scale
    return logits if neg_mask is None else logits.masked_fill(~neg_mask, float("-inf"))


def _valid_count(neg: torch.Tensor, neg_mask: torch.Tensor | None) -> torch.Tensor:
    if neg_mask is None:
        return torch.full((neg.shape[0],), neg.shape[1], dtype=neg.dtype, device=neg.device)
    return neg_mask.sum(dim=1).to(neg.dtype)


# ----------------------------------------------------------------------------- the terms
# These take logits already scaled and masked (-inf where invalid); the nn.Modules call them
# directly on the similarity matrix they build once, the public kernels below after validation.


def _over_positives(x: torch.Tensor) -> torch.Tensor:
    """The mean over an anchor's positives, x [M, P] -> [M]: with one positive (two views, image-text, one key)
    the column itself, a view, not a reduction (an operator fewer in forward and backward)."""
    return x[:, 0] if x.shape[1] == 1 else x.mean(dim=1)


_SOFTPLUS_EXACT = 40.0  # softplus(x) = x + log1p(e^-x) = x to float64's precision from here on


def softmax_terms(pos_logits: torch.Tensor, neg_lse: torch.Tensor, *, keep_positive: bool,
                  pos_weight: torch.Tensor | None = None) -> Terms:
    """InfoNCE-family per-anchor loss from positive logits [M, P] and the negatives' logsumexp [M].

    keep_positive=True: InfoNCE, -p + log(e^p + sum_k e^n_k) = softplus(lse_n - p).
    keep_positive=False: the decoupled loss (DCL paper, Prop. 2), -w p + lse_n.
    """
    gap = neg_lse[:, None] - pos_logits
    npc = _over_positives(torch.sigmoid(gap)).detach()
    if keep_positive:
        # softplus(gap) = log(1 + e^gap); past the threshold it returns gap itself, off by e^-40 = 4e-18: below
        # float64's rounding there (F.softplus's default threshold 20 would be off by 2e-9).
        loss = _over_positives(F.softplus(gap, threshold=_SOFTPLUS_EXACT))
        pos_mean = _over_positives(pos_logits).detach()
        return Terms(loss, -pos_mean, loss.detach() + pos_mean, npc)  # neg_term: log(e^p + sum e^n), averaged
    weighted = pos_logits if pos_weight is None else pos_weight * pos_logits
    pos_term = -_over_positives(weighted)
    return Terms(pos_term + neg_lse, pos_term.detach(), neg_lse.detach(), npc)


def softmax_logit_terms(pos: torch.Tensor, neg_lse: torch.Tensor, *, keep_positive: bool,
                        shift: float | torch.Tensor = 0.0, pos_weight: torch.Tensor | None = None) -> LogitTerms:
    """softmax_terms' loss with one positive per anchor, from its logit [M], and the partial derivatives:
    keep_positive (InfoNCE; EqCo with ``shift`` log(alpha / K), one number or per anchor): softplus(lse + shift
    - p), whose derivative in lse is q_B = sigmoid(lse + shift - p) (DCL paper, Prop. 1), the positive's pull
    q_B too; else (DCL, DCLW with its detached ``pos_weight`` w) lse - w p: 1, and a pull of w."""
    if keep_positive:
        gap = neg_lse - pos if isinstance(shift, float) and shift == 0.0 else (neg_lse - pos).add_(shift)
        q = torch.sigmoid(gap)
        return LogitTerms(F.softplus(gap, threshold=_SOFTPLUS_EXACT), q, None, q, None)
    if pos_weight is None:
        return LogitTerms(neg_lse - pos, 1.0, None, 1.0, None)
    return LogitTerms(neg_lse - pos_weight * pos, 1.0, None, pos_weight, None)


def supcon_terms(pos_mean: torch.Tensor, pos_lse: torch.Tensor, neg_lse: torch.Tensor, *,
                 keep_positives: bool) -> Terms:
    """Per-anchor loss with several positives P(i), SupCon's L_out (Khosla et al. 2020, Eq. 2), from the mean
    of the positives' logits, their logsumexp and the negatives' logsumexp [M] each:

        keep_positives=True:  -1/|P| sum_p s_p + log(sum_p e^{s_p} + sum_n e^{s_n})
        keep_positives=False: -1/|P| sum_p s_p + log(sum_n e^{s_n})   (DCL: every positive out of the denominator)

    npc: 1 - the positives' softmax mass in the first form."""
    denominator = torch.logaddexp(pos_lse, neg_lse) if keep_positives else neg_lse
    npc = torch.sigmoid(neg_lse - pos_lse).detach()
    return Terms(denominator - pos_mean, (-pos_mean).detach(), denominator.detach(), npc)


def eqco_negatives(neg_lse: torch.Tensor, alpha: float, num_neg: int | torch.Tensor) -> torch.Tensor:
    """EqCo's margin m = tau log(alpha / K) moved onto the negatives (EqCo, Eq. 5): e^{(s_p - m) / tau} =
    e^{s_p / tau} K / alpha, so InfoNCE with the margin is InfoNCE with lse_n + log(alpha / K). num_neg:
    K, one number or per anchor [M]."""
    if isinstance(num_neg, torch.Tensor):
        return neg_lse + torch.log(alpha / num_neg.to(neg_lse.dtype))
    return neg_lse + math.log(alpha / num_neg)


def unigrad_terms(u: torch.Tensor, t: torch.Tensor, correlation: torch.Tensor, lam: float) -> Terms:
    """UniGrad per-anchor loss -<u, t> + (lam / 2) u^T F u (UniGrad, Eq. 15) from unit anchors u [M, D],
    their detached targets t [M, D] and the correlation F [D, D]; its gradient in u is -t + lam F u
    (Eq. 14). No negatives matrix, so no NPC multiplier (0)."""
    pos = (u * t).sum(dim=-1)
    quad = 0.5 * lam * ((u @ correlation) * u).sum(dim=-1)
    return Terms(quad - pos, (-pos).detach(), quad.detach(), torch.zeros_like(pos))


def dclw_weights(pos: torch.Tensor, sigma: float, all_pos: torch.Tensor | None = None) -> torch.Tensor:
    """DCLW's positive weights w = 2 - n softmax(pos / sigma) over all n positive pairs, detached.

    DCL paper, Sec. 3 (negative von Mises-Fisher weighting); E[w] = 1, and w -> 1 as sigma grows.
    all_pos: every pair the softmax runs over (e.g. all processes' pairs), pos by default. Pairs that
    appear once per view (two-view setting) give the same weights as the N pairs once each.
    """
    scaled = pos.detach() / sigma
    everyone = scaled.reshape(-1) if all_pos is None else all_pos.detach().reshape(-1) / sigma
    return 2.0 - everyone.numel() * torch.exp(scaled - torch.logsumexp(everyone, dim=0))


def softmax_mean(logits: torch.Tensor, scale) -> torch.Tensor:
    """Per row, the cosines' mean under softmax(logits) [M], logits = scale * cosines [M, K] (-inf where
    masked): CACR's E_pi[s]."""
    cos = logits.masked_fill(torch.isinf(logits), 0.0) / scale  # fill first: no 0 * inf in backward
    return (torch.softmax(logits, dim=1) * cos).sum(dim=1)


def cacr_terms(pos: torch.Tensor, neg_logits: torch.Tensor, *, t_pos: float, neg_scale) -> Terms:
    """CACR per-anchor loss from positive cosines [M, P] and negative logits neg_scale * s [M, K] (masked),
    neg_scale = 2 t_neg.

    Cost c = ||u - v||^2 = 2 - 2 s for unit vectors. Attraction: sum_k softmax(t_pos c+)_k c+_k,
    weights detached (the positives come from the momentum encoder in Algorithm 3). Repulsion:
    -sum_j softmax(-t_neg c-)_j c-_j, weights keep their gradient. softmax(-t_neg c) is softmax(2 t_neg s),
    so the repulsion is -2 + 2 E_pi[s] with pi = softmax(neg_logits).
    """
    return cacr_stat_terms(pos, softmax_mean(neg_logits, neg_scale), t_pos=t_pos)


def cacr_stat_terms(pos: torch.Tensor, neg_mean: torch.Tensor, *, t_pos: float) -> Terms:
    """CACR per-anchor loss from positive cosines [M, P] and the negatives' softmax-weighted mean cosine
    neg_mean [M], E_pi[s] (see cacr_terms): attraction - 2 + 2 neg_mean."""
    pos_cost = 2.0 - 2.0 * pos
    with torch.no_grad():
        pos_w = torch.softmax(t_pos * pos_cost, dim=1)
    return _cacr((pos_w * pos_cost).sum(dim=1), neg_mean)


def cacr_logit_terms(pos: torch.Tensor, neg_mean: torch.Tensor, scale) -> LogitTerms:
    """cacr_stat_terms with one positive per anchor (its attraction weight is 1), from logits: the positive's
    p = scale s_p and the negatives' softmax-weighted mean logit m = scale E_pi[s]. Attraction 2 - 2 s_p and
    repulsion 2 E_pi[s] - 2 make 2 (m - p) / scale, which depends on the scale beside the logits: -loss / scale."""
    factor = 2.0 / scale
    loss = (neg_mean - pos) * factor
    return LogitTerms(loss, None, factor, factor, -loss / scale if isinstance(scale, torch.Tensor) else None)


def cacr_positive_stat_terms(pos_lse: torch.Tensor, pos_mean: torch.Tensor, neg_mean: torch.Tensor, *,
                             pos_scale: float) -> Terms:
    """CACR per-anchor loss from its positives' statistics, of the logits pos_scale * s with pos_scale =
    -2 t_pos (softmax(t_pos c) = softmax(-2 t_pos s)): their lse and softmax-weighted mean cosine E_w[s] [M]
    each, and the negatives' neg_mean (see cacr_stat_terms). The attraction sum_p w_p c_p = 2 - 2 E_w[s], w
    detached, takes its value from the mean and its gradient, -2 w_p on s_p, from the lse: d lse / d s_p =
    pos_scale w_p (the mean's own gradient would move the weights too)."""
    weighted = pos_mean.detach() + (pos_lse - pos_lse.detach()) / pos_scale
    return _cacr(2.0 - 2.0 * weighted, neg_mean)


def _cacr(attraction: torch.Tensor, neg_mean: torch.Tensor) -> Terms:
    """CACR's terms from the attraction [M] and the negatives' mean cosine [M]."""
    repulsion = -2.0 + 2.0 * neg_mean
    zeros = torch.zeros_like(attraction)
    return Terms(attraction + repulsion, attraction.detach(), repulsion.detach(), zeros)


# ----------------------------------------------------------------------------- public kernels


def infonce(pos, neg, *, temperature: float = 0.1, neg_mask=None) -> torch.Tensor:
    """InfoNCE / NT-Xent: -s_p / tau + log(e^{s_p/tau} + sum_k e^{s_k/tau}) (DCL paper, Eq. 1)."""
    return _softmax_kernel("infonce", pos, neg, neg_mask, temperature, keep_positive=True).loss


def dcl(pos, neg, *, temperature: float = 0.1, neg_mask=None) -> torch.Tensor:
    """Decoupled contrastive loss: the positive removed from the denominator (DCL paper, Eq. 6)."""
    return _softmax_kernel("dcl", pos, neg, neg_mask, temperature, keep_positive=False).loss


def dclw(pos, neg, *, temperature: float = 0.1, sigma: float = 0.5, neg_mask=None,
         pos_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted DCL: the positive term scaled by w = 2 - n softmax(pos / sigma), detached (DCL paper, Eq. 7).

    pos_weight overrides the weights (for example computed over all processes' pairs).
    """
    _check_temperature("dclw", sigma, "sigma")
    if pos_weight is None:
        pos_weight = dclw_weights(pos if pos.dim() == 2 else pos[:, None], sigma)
    elif pos_weight.dim() == 1:
        pos_weight = pos_weight[:, None]
    return _softmax_kernel("dclw", pos, neg, neg_mask, temperature, keep_positive=False,
                           pos_weight=pos_weight).loss


def eqco(pos, neg, *, temperature: float = 0.1, alpha: float = 256.0, neg_mask=None) -> torch.Tensor:
    """EqCo: InfoNCE with the margin m = tau log(alpha / K) on the positive (EqCo, Eq. 1 and 5).

    K counts each anchor's valid negatives; alpha = K gives InfoNCE back exactly.
    """
    _check_temperature("eqco", alpha, "alpha")
    return _softmax_kernel("eqco", pos, neg, neg_mask, temperature, keep_positive=True, alpha=alpha).loss


def npc_multiplier(pos, neg, *, temperature: float = 0.1, neg_mask=None) -> torch.Tensor:
    """q_B per anchor: 1 - the softmax probability InfoNCE gives the positive (DCL paper, Prop. 1)."""
    npc = _softmax_kernel("npc_multiplier", pos, neg, neg_mask, temperature, keep_positive=True).npc
    assert npc is not None  # the functional kernels make every diagnostic
    return npc


def cacr(pos, neg, *, t_pos: float = 1.0, t_neg: float = 2.0, neg_mask=None) -> torch.Tensor:
    """Contrastive attraction and contrastive repulsion (CACR, Sec. 3.2 and Algorithm 3)."""
    _check_temperature("cacr", t_pos, "t_pos")
    _check_temperature("cacr", t_neg, "t_neg")
    pos, neg, neg_mask = check_scores(pos, neg, neg_mask, "cacr")
    return cacr_terms(pos, _masked_logits(neg, neg_mask, 2.0 * t_neg), t_pos=t_pos, neg_scale=2.0 * t_neg).loss


def unigrad(anchor, target, correlation, *, lam: float = 100.0, normalize: bool = True) -> torch.Tensor:
    """UniGrad per-anchor loss -cos(u, t) + (lam / 2) u^T F u, target detached (UniGrad, Eq. 15).

    Its gradient in u is -t + lam F u (Eq. 14). UniGrad has no negatives matrix: the repulsion goes
    through the correlation matrix F [D, D] (a running average of target features' u u^T), so this
    kernel takes features, anchor [M, D] and target [M, D], rather than scores.
    """
    for arg, t in (("anchor", anchor), ("target", target), ("correlation", correlation)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"unigrad: {arg} must be a floating-point tensor")
        if host_checks_allowed(t) and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"unigrad: {arg} has non-finite values (inf or NaN)")
    if anchor.dim() != 2 or anchor.shape != target.shape:
        raise ValueError(f"unigrad: anchor and target must both be [M, D], got {tuple(anchor.shape)} "
                         f"and {tuple(target.shape)}")
    d = anchor.shape[1]
    if correlation.shape != (d, d):
        raise ValueError(f"unigrad: correlation must be [{d}, {d}], got {tuple(correlation.shape)}")
    dtype = _compute_dtype(anchor, target)
    u, t = anchor.to(dtype), target.detach().to(dtype)
    if normalize:
        u, t = normalize_rows(u), normalize_rows(t)
    return unigrad_terms(u, t, correlation.detach().to(dtype), lam).loss


def _softmax_kernel(name, pos, neg, neg_mask, temperature, *, keep_positive, pos_weight=None,
                    alpha=None) -> Terms:
    _check_temperature(name, temperature)
    pos, neg, neg_mask = check_scores(pos, neg, neg_mask, name)
    neg_lse = torch.logsumexp(_masked_logits(neg, neg_mask, 1.0 / temperature), dim=1)
    if alpha is not None:
        neg_lse = eqco_negatives(neg_lse, alpha, _valid_count(neg, neg_mask))
    if pos_weight is not None:
        if pos_weight.shape != pos.shape:
            raise ValueError(f"{name}: pos_weight has shape {tuple(pos_weight.shape)}, pos has {tuple(pos.shape)}")
        pos_weight = pos_weight.detach().to(pos.dtype)
    return softmax_terms(pos / temperature, neg_lse, keep_positive=keep_positive, pos_weight=pos_weight)
