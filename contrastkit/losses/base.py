"""The settings around the kernels: two (or more) views, query/key/queue, and the distributed gather.

A ContrastiveLoss subclass says only how to scale the similarities into logits and how to turn
positive cosines and the negatives' statistics (logsumexp of their logits; for CACR also their
softmax-weighted mean cosine) into per-anchor terms; this module builds those statistics once per
call, with one matrix product, blockwise so that the [M, K] matrix need never be held whole.
"""

from __future__ import annotations

import inspect
import math
from typing import Literal, NamedTuple, get_args

import torch
from torch import nn

from contrastkit.distributed import gather_no_grad, gather_with_grad, world
from contrastkit.losses.chunked import EXCLUDED, negative_stats, no_autocast
from contrastkit.losses.dense import Layout, dense_loss
from contrastkit.losses.functional import (LogitTerms, NonFiniteError, Partial, Terms, _over_positives,
                                           normalize_rows, row_cosines, softmax_mean)
from contrastkit.losses.plan import Plan, host_checks_allowed, make_plan

# How the negatives' statistics are computed: "auto" (the one measured faster, see choose_backend), or one forced.
Backend = Literal["auto", "triton", "torch", "dense"]
BACKENDS = get_args(Backend)
Gather = bool | Literal["uneven"]  # gather_distributed: False, True (equal batch sizes) or "uneven"
Reduction = Literal["mean", "sum", "none"]
REDUCTIONS = get_args(Reduction)
SameLabel = Literal["mask", "positive"]  # what a candidate sharing the anchor's label is (see ContrastiveLoss)
SAME_LABELS = get_args(SameLabel)


def check_logit_scale(name: str, scale) -> None:
    """A ``logit_scale`` must be a finite number > 0 (a negative one turns the objective around). A tensor's
    values are read only where host reads are free (see host_checks_allowed); on CUDA a non-finite scale
    shows as a non-finite loss, which the recipes' divergence check names."""
    if isinstance(scale, torch.Tensor):
        if not scale.is_floating_point():
            raise TypeError(f"{name}: logit_scale must be a floating-point tensor or a number, got dtype {scale.dtype}")
        if not host_checks_allowed(scale):
            return
        value = float(scale.detach()) if scale.dim() == 0 else None  # one host read, the checks on the host's number
        if value is not None and math.isfinite(value) and value > 0:
            return
        if not bool(torch.isfinite(scale).all()):
            raise NonFiniteError(f"{name}: logit_scale has non-finite values (inf or NaN): the learnable scale "
                                 "diverged; lower the learning rate")
        if not bool((scale > 0).all()):
            raise ValueError(f"{name}: logit_scale must be > 0, got min {float(scale.min())} "
                             "(pass exp(t), CLIP's scale, not t)")
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name}: logit_scale must be a tensor or a number, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise NonFiniteError(f"{name}: logit_scale must be finite, got {scale}")
    if scale <= 0:
        raise ValueError(f"{name}: logit_scale must be > 0, got {scale} (pass exp(t), CLIP's scale, not t)")


def check_features(name: str, tensors: dict[str, torch.Tensor], *, same_shape: bool = True,
                   values: bool = True) -> None:
    """Clear errors for the feature inputs of a loss module: type, dtype, rank, shape, device, and (with
    ``values``) non-finite values."""
    first_name, first = next(iter(tensors.items()))
    for arg, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: {arg} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name}: {arg} must be [N, D], got shape {tuple(t.shape)}")
        if t.shape[0] == 0:
            raise ValueError(f"{name}: {arg} is an empty batch (shape {tuple(t.shape)})")
        if t.device != first.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but {first_name} is on {first.device}")
        if same_shape and t.shape != first.shape:
            raise ValueError(f"{name}: {arg} has shape {tuple(t.shape)} but {first_name} has {tuple(first.shape)}")
        if t.shape[1] != first.shape[1]:
            raise ValueError(f"{name}: {arg} has dimension {t.shape[1]} but {first_name} has {first.shape[1]}")
        if values and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"{name}: {arg} has non-finite values (inf or NaN)")


def check_labels(name: str, labels, n: int, device: torch.device, what: str = "labels") -> None:
    """Clear errors for a labels input: a 1-D integer tensor, one label per sample (n), on the features' device."""
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"{name}: {what} must be a torch.Tensor of integer class ids, got {type(labels).__name__}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"{name}: {what} must have an integer dtype (class ids), got {labels.dtype}")
    if labels.dim() != 1 or labels.shape[0] != n:
        raise ValueError(f"{name}: {what} must be [{n}], one per sample, got shape {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"{name}: {what} is on {labels.device} but the features are on {device}")


def label_ids(row_labels: torch.Tensor, col_labels: torch.Tensor,
              col_known: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels of anchors [M] and candidates [K] as ids in 0..M+K-1, equal exactly where the labels are
    (each label's first place among both, sorted): small enough to index a table, found without reading a
    value on the host (torch.unique would). Candidates where ``col_known`` [K] is False (hard negatives,
    which carry no label) get -1, equal to no anchor's id."""
    everything = torch.cat([row_labels, col_labels]).to(torch.int64).sort().values
    row_ids = torch.searchsorted(everything, row_labels.to(torch.int64))
    col_ids = torch.searchsorted(everything, col_labels.to(torch.int64))
    if col_known is not None:
        col_ids = torch.where(col_known, col_ids, -1)
    return row_ids, col_ids


def require_negatives(name: str, left: torch.Tensor) -> None:
    """Every anchor needs a negative left (``left`` [M]: how many, per anchor, once labels took theirs out): a
    ValueError where host reads are free, a device-side assertion on CUDA (no host read), unchecked under
    torch.compile."""
    if host_checks_allowed(left):
        empty = int((left < 1).sum())
        if empty:
            raise ValueError(f"{name}: an anchor has no negative left: every candidate shares its label ({empty} "
                             f"of {left.shape[0]} anchors); a batch needs samples of at least two labels")
    elif left.is_cuda and not torch.compiler.is_compiling():
        torch._assert_async((left >= 1).all(), f"{name}: an anchor has no negative left (every candidate shares "
                            "its label)")


def _per_anchor(d, like: torch.Tensor) -> torch.Tensor:
    """A partial derivative (a tensor [M, P] or [M, 1], or a number) as one per anchor [M], averaged over the
    positives (``like``: [M, 1])."""
    return _over_positives(d) if isinstance(d, torch.Tensor) else torch.full_like(like[:, 0], d)


def _counts(num_neg, like: torch.Tensor) -> torch.Tensor:
    """The negatives' count per anchor as a tensor that broadcasts against ``like`` ([M] or [M, 1]): a fill, not
    a copy from the host (which would wait for a GPU)."""
    if not isinstance(num_neg, torch.Tensor):
        return torch.full_like(like, num_neg)
    return num_neg.to(like.dtype).view(like.shape)


def _per_id(col_ids: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """sum of ``values`` [K, ...] per candidate id: [size, ...]; the unlabelled (-1) are left out."""
    slots = torch.where(col_ids < 0, size, col_ids)  # one spare row takes them
    table = values.new_zeros((size + 1, *values.shape[1:]))
    return table.index_add_(0, slots, values)[:size]


def _is_default(value, default) -> bool:
    """Whether a setting holds its default (False for values that do not compare as one bool)."""
    try:
        return type(value) is type(default) and bool(value == default)
    except (TypeError, ValueError, RuntimeError):
        return False


class Problem(NamedTuple):
    """One block of a call's matrix as its setting lays it out, the same for every path: this process's anchors
    [M, D] against candidates [K, D] (every process's where gathered), both as given (each path normalises them
    its own way), and where each anchor's own sample and positives are."""

    anchors: torch.Tensor
    candidates: torch.Tensor | None  # None: the anchors themselves (two views on one process)
    own: torch.Tensor | None  # [M, E] each anchor's own sample's columns, left out of its negatives (a queue: None)
    positives: torch.Tensor  # [M, P] where its positives' cosines are among the setting's pairs' (Setting)
    num_neg: int  # each anchor's negatives
    labels: tuple[torch.Tensor, torch.Tensor] | None  # (row ids, column ids) of label_ids
    itself: torch.Tensor | None  # [M, 1] each anchor's own column, where it is a candidate (same_label="positive")
    columns: bool  # square, the columns anchors too (image-text on one process): rows' terms, then columns'
    mean_over: int | None  # how many anchors the loss averages over, where more than this block's M
    flat: Layout | None  # the fused path's flat indices into its [M, K] logits (Positions.flat), else None
    queue: bool = False  # the candidates a queue: the fused path puts the keys before it


class Setting(NamedTuple):
    """A call's matrix: the pairs of local rows whose cosines are its positives (each pair's n cosines, one
    after the other, are what Problem.positives index), and its blocks (two for image-text's directions apart)."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    problems: list[Problem]


_PER_SHAPE: dict[tuple, tuple] = {}
_MAX_PER_SHAPE = 128  # shapes seen in one run: the batch, the last batch, an evaluation's, per setting


def per_shape(key: tuple, make):
    """``make()``, a call's index tensors (positions), made once per ``key`` (its shape and device) and
    cached, or made in the graph under torch.compile (a cached tensor would be a constant of it)."""
    if torch.compiler.is_compiling():
        return make()
    found = _PER_SHAPE.get(key)
    if found is None:
        if len(_PER_SHAPE) >= _MAX_PER_SHAPE:
            _PER_SHAPE.clear()
        found = _PER_SHAPE[key] = make()
    return found


class Positions(NamedTuple):
    """A Problem's index tensors (see positions): own columns [M, E], positives [M, P], own column [M, 1], and
    where the plan's route is "fused" the same positions as flat indices into the [M, K] logits (dense.py)."""

    own: torch.Tensor | None
    positives: torch.Tensor
    itself: torch.Tensor | None
    flat: Layout | None


def positions(kind: str, p: int, n: int, total: int, start: int, device: torch.device, per_sample: int = 1,
              fused: bool = False) -> Positions:
    """The index tensors of a Problem (made once per shape: per_shape), for n local samples at ``start`` of
    ``total``: "views", p views view-major (anchor (a, i)'s positives the pairs (a, w), w != a, of the pairs
    a < b in order); "image_text", one square matrix, its rows' anchors then its columns'; "keys", p keys per
    sample among ``per_sample`` candidates (its first p) and the pairs (query, key j) in order; "queue", the same
    with no key among the candidates (the fused path puts the n keys before the queue). ``fused`` (one positive
    per anchor): also ``flat``, each anchor's positive and own columns as indices into the flattened logits."""

    def make() -> Positions:
        i = torch.arange(n, device=device)
        if kind == "views":
            view = torch.arange(p, device=device)
            own = view[None] * total + (start + i)[:, None]  # [n, V]: sample start + i's column in each view
            others = view[None, : p - 1] + (view[None, : p - 1] >= view[:, None]).long()  # [V, V-1]: w != a
            low, high = torch.minimum(view[:, None], others), torch.maximum(view[:, None], others)
            pair = low * (2 * p - low - 1) // 2 + high - low - 1  # the pair (low, high)'s place among a < b
            positives = (pair[:, None] * n + i[None, :, None]).reshape(p * n, p - 1)
            mine = own.repeat(p, 1)
            # fused (two views): each anchor's positive is its sample's column in the other view
            flat = _flat(mine, own.flip(1).T.reshape(-1), p * total) if fused else None
            return Positions(mine, positives, own.T.reshape(p * n, 1), flat)
        if kind == "image_text":
            diagonal = i * (n + 1)  # the rows' positives, then the columns': the same diagonal
            return Positions(i[:, None], i.repeat(2)[:, None], None,
                             Layout(diagonal.repeat(2), diagonal) if fused else None)
        positives = torch.arange(p, device=device)[None] * n + i[:, None]  # sample i's key j: pair j's row i
        if kind == "queue":  # fused: candidates the n keys, then the queue; every key left out, its own the positive
            return Positions(None, positives, None, _flat(i.expand(n, n), i, n + total) if fused else None)
        own = ((start + i) * per_sample)[:, None] + torch.arange(p, device=device)
        return Positions(own, positives, None, _flat(own, own[:, 0], total * per_sample) if fused else None)

    return per_shape(("positions", kind, p, n, total, start, device, per_sample, fused), make)


def _flat(own: torch.Tensor, partner: torch.Tensor, width: int) -> Layout:
    """The fused path's flat indices into [M, width] logits: each anchor's positive, at column ``partner`` [M],
    and its own sample's entries, at columns ``own`` [M, E] (its positive among them), left out."""
    rows = torch.arange(own.shape[0], device=own.device)[:, None] * width
    return Layout(rows[:, 0] + partner, (rows + own).reshape(-1))


class Objective(nn.Module):
    """Base type of every loss that ``build_loss`` returns: the settings all objectives share and the
    calls a user can make (``loss_fn(z1, z2)``, ``query_key``, ``cross_modal``); an objective without a
    form for a setting says so with a ValueError.

    ``normalize``: L2-normalise the features inside (False if they already are unit vectors).
    ``reduction``: "mean" (default) over this process's anchors, "sum", or "none" for the per-anchor
    losses (for sample weighting; the order of the anchors is given by each call). With
    ``output_dict=True`` the diagnostics are reduced the same way.
    """

    name = "objective"

    def __init__(self, *, normalize: bool = True, reduction: Reduction = "mean"):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"{self.name}: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
        self.normalize = normalize
        self.reduction = reduction

    # Settings extra_repr shows even at their default (the others only where they are not).
    _always_shown: tuple[str, ...] = ()

    def extra_repr(self) -> str:
        """The settings, as torch's modules show theirs (``print(model)``): the objective's own (the arguments
        its class takes by position: temperature, sigma, alpha, t_pos and t_neg, lam and rho), then
        ``_always_shown`` (the score objectives' gather_distributed and same_label), then the other keyword
        settings (normalize, reduction, chunk_size, backend) where they are not the default."""
        shown = []
        for name, p in inspect.signature(type(self).__init__).parameters.items():
            if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or not hasattr(self, name):
                continue
            value = getattr(self, name)
            if p.kind is p.KEYWORD_ONLY and name not in self._always_shown and _is_default(value, p.default):
                continue
            shown.append(f"{name}={value!r}")
        return ", ".join(shown)

    def query_key(self, query: torch.Tensor, key: torch.Tensor, queue: torch.Tensor | None = None, *,
                  negatives: torch.Tensor | None = None, output_dict: bool = False):
        raise ValueError(f"{self.name} has no query/key (MoCo) form; use one of infonce, dcl, dclw, eqco, cacr")

    def cross_modal(self, image: torch.Tensor, text: torch.Tensor, *, logit_scale: torch.Tensor | float | None = None,
                    output_dict: bool = False):
        raise ValueError(f"{self.name} has no image-text (CLIP) form; use one of infonce, dcl, dclw, eqco, cacr")

    def _unit(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x.to(dtype)
        return normalize_rows(x) if self.normalize else x

    def _apply_reduction(self, per_anchor: torch.Tensor) -> torch.Tensor:
        if self.reduction == "mean":
            return per_anchor.mean()
        return per_anchor.sum() if self.reduction == "sum" else per_anchor

    def _output(self, terms: Terms, output_dict: bool):
        """The reduced loss, or with ``output_dict`` the dict of it and its reduced diagnostics."""
        loss = self._apply_reduction(terms.loss)
        if not output_dict:
            return loss
        diagnostics = self._diagnostics(terms)
        return {"loss": loss, **{k: self._apply_reduction(v) for k, v in diagnostics.items() if v is not None}}

    def _diagnostics(self, terms: Terms) -> dict[str, torch.Tensor | None]:
        return {"pos_term": terms.pos_term, "neg_term": terms.neg_term, "npc_multiplier": terms.npc}


class ContrastiveLoss(Objective):
    """Base of the score-based objectives (infonce, dcl, dclw, eqco, cacr).

    ``loss_fn(z1, z2)``: the two-view setting (SimCLR). Anchors are all 2N views; an anchor's positive
    is the other view of its sample, its negatives the 2N - 2 views of the other samples. Extra views,
    ``loss_fn(z1, z2, z3, ...)``, give each anchor the V - 1 other views of its sample as positives.
    ``loss_fn.query_key(q, k, queue)``: the MoCo setting. Anchors are the queries, the positive is the
    key of the same sample, the negatives the queue, or without a queue the other keys of the batch.
    ``loss_fn.cross_modal(image, text)``: the CLIP setting.

    Settings (keyword arguments of every subclass):

    - ``normalize`` (True), ``reduction`` ("mean" | "sum" | "none"): see Objective. With "none" the
      per-anchor losses come view-major ([V N]: all first views, then all second views, ...), [N] for
      query_key, [2 N] for cross_modal (images, then texts).
    - ``gather_distributed`` (False): the negatives come from every process (gathered with gradient),
      so that P processes (with DDP's gradient averaging) match one process on the concatenated batch.
      True: every process holds the same batch size (checked on the device: no host round trip, and the
      call compiles with fullgraph=True); "uneven": batch sizes may differ (exchanged between the hosts on
      every call, e.g. for an epoch's last batch).
    - ``chunk_size``: how the [M, K] anchor-negative matrix is handled by the blockwise torch kernel. None
      (default): blocks of about BLOCK_ELEMENTS logits through an exact custom autograd function
      (losses/chunked.py): objectives with a closed-form ``stat_grad`` get backward's products done in
      forward and keep no block; the others (image-text on one process) keep the blocks' exponentials for
      backward up to KEEP_MAX_ELEMENTS entries (the first blocks) and recompute the rest, so memory grows
      linearly in the batch; a positive number: blocks of that many anchors, none kept; 0: the dense path.
      All give the same values and gradients.
    - ``backend`` ("auto" | "triton" | "torch" | "dense"): how the negatives' statistics are computed:
      "auto" is the one measured faster (see choose_backend): the dense path where the matrix is small (the
      call host-bound: dense.py, one autograd Function for two views and image-text, the matrix through
      autograd otherwise); beyond it on CUDA the Triton kernels (bf16/fp16 products, or float32 with TF32
      where allowed), elsewhere the blockwise torch kernel ("torch"): on CPU cache-sized blocks with
      host-checked fast paths, on CUDA cuBLAS products in GPU-sized blocks (DEVICE_BLOCK_ELEMENTS) on the exact
      path, no value read on the host. In the
      two-view and image-text settings the torch kernel takes the features as given and normalises them
      per block, so that no float32 copy of them is made (about 0.5-0.8 GiB of loss memory at N = 262144,
      D = 512 bf16 on CUDA: docs/performance.md).
    - ``same_label`` ("mask" | "positive"), for calls given ``labels=`` [N], an integer label per sample
      (a class, or a sample id so that duplicates in a batch are not negatives; query_key with a queue also
      takes ``queue_labels`` [Q]). The candidates that share an anchor's label, its own sample's aside, are:

      "mask" (default): left out of its negatives (false-negative elimination); the loss is otherwise the
      same, EqCo's K counting the negatives left per anchor.

      "positive": its positives too. With P(i) the anchor's positives (its own sample's, then every
      same-label candidate), N(i) its negatives (the candidates of other labels) and s the logits
      (cosine / tau), SupCon's L_out (Khosla et al. 2020, Eq. 2) for InfoNCE:

          l_i = -1/|P(i)| sum_{p in P(i)} s_p + log( sum_{p in P(i)} e^{s_p} + sum_{n in N(i)} e^{s_n} )

      EqCo: the same with its margin on every positive, i.e. sum_N scaled by alpha / K_i, K_i = |N(i)|.
      DCL: every positive out of the denominator, l_i = -1/|P(i)| sum_p s_p + log sum_{n in N(i)} e^{s_n};
      DCLW: the same with the own sample's positives weighted by w (its weights over the batch's own
      pairs), the label's positives by 1. CACR: its attraction weighs every positive in P(i) by
      softmax(t_pos c) over P(i), its repulsion the negatives N(i) (see CACRLoss); UniGrad has no
      negatives (a ValueError).

      With every label distinct, "mask" is the loss without labels, and so is "positive" where an anchor
      has one positive (two views, image-text, one key); with several views or keys SupCon's denominator
      holds all of them, where the loss without labels contrasts each positive with the negatives alone
      (CACR's "positive" is the loss without labels there too: it weighs the views by one softmax already).
      Every anchor needs one negative left (a ValueError on the CPU; a device-side assertion on CUDA).
      Labels are gathered with the features (gather_distributed). They run on every backend (the Triton
      kernels leave the pairs out in their elementwise passes). Hard negatives carry no label.
      "positive" with InfoNCE, EqCo or CACR takes a second pass of the kernel (the positives' lse, and
      CACR's mean).
    """

    name = "contrastive"
    _always_shown = ("gather_distributed", "same_label")

    needs_mean = False  # True where the terms need the softmax-weighted mean cosine of the negatives (CACR)
    # same_label="positive": whether the denominator holds the positives (InfoNCE, EqCo) or not (DCL, DCLW)
    positives_in_denominator = True

    def __init__(self, *, normalize: bool = True, gather_distributed: Gather = False,
                 chunk_size: int | None = None, backend: Backend = "auto", reduction: Reduction = "mean",
                 same_label: SameLabel = "mask"):
        super().__init__(normalize=normalize, reduction=reduction)
        if same_label not in SAME_LABELS:
            raise ValueError(f"{self.name}: same_label must be one of {', '.join(SAME_LABELS)}, got {same_label!r}")
        self.same_label = same_label
        if gather_distributed not in (False, True, "uneven"):
            raise ValueError(f"{self.name}: gather_distributed must be False, True or 'uneven', "
                             f"got {gather_distributed!r}")
        if backend not in BACKENDS:
            raise ValueError(f"{self.name}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 0):
            raise ValueError(f"{self.name}: chunk_size must be None (automatic), 0 (dense) or a positive number "
                             f"of anchors per block, got {chunk_size!r}")
        self.gather_distributed = gather_distributed
        self.chunk_size = chunk_size
        self.backend = backend
        if same_label == "positive" and self._has_formula and type(self).label_terms is ContrastiveLoss.label_terms:
            raise ValueError(f"{self.name}: same_label='positive' needs the objective's form with several positives "
                             "sharing one denominator (label_terms, SupCon's); a formula alone takes same_label='mask'")

    # An objective is its per-anchor formula: ``formula`` alone (its partial derivatives by torch.func: an
    # objective of one's own, docs/own-objective.md), or ``terms``, the formula with its partial derivatives
    # written beside it (InfoNCE, DCL, EqCo). Every path and setting take it from there (stat_terms, logit_terms,
    # stat_grad below); label_terms is the form with several positives sharing one denominator (same_label=
    # "positive"). CACR, whose loss depends on the scale beside its logits, writes the three forms itself.
    def default_logit_scale(self) -> float:
        """The factor on cosines where no ``logit_scale=`` is given: 1 / temperature (CACR: 2 t_neg)."""
        raise NotImplementedError

    def formula(self, p, l, k, m=None) -> torch.Tensor:
        """An objective's loss per (anchor, positive) from ``p``, the positive's logit (the scale times its
        cosine), ``l``, the log-sum-exp of the anchor's negatives' logits, ``k``, how many negatives it has, and
        (where ``needs_mean``) ``m``, their softmax-weighted mean logit: tensors of one shape, or broadcasting
        (several positives per anchor: p [M, P], the others [M, 1]; the loss averages over the positives). The
        one form an objective of one's own writes: every setting and path takes it, its partial derivatives
        by torch.func (_derived). InfoNCE's is softplus(l - p), DCL's l - p."""
        if type(self).terms is ContrastiveLoss.terms:
            raise NotImplementedError
        return self.terms(p, l, k, m)[0]

    def terms(self, p, l, k, m=None) -> tuple[torch.Tensor, Partial, Partial, Partial]:
        """(the formula's loss, the positive's pull -d/dp, d/dl, d/dm) at (p, l, k, m), each derivative a tensor,
        a number, or None for zero: written out by an objective that has them in closed form (k then as given:
        a number, or [M] where labels leave out some negatives), else derived from ``formula``."""
        return self._derived(p, l, _counts(k, l), m)

    @property
    def _has_formula(self) -> bool:
        return type(self).formula is not ContrastiveLoss.formula or type(self).terms is not ContrastiveLoss.terms

    def _counts_for(self, k, like):
        """k as ``formula`` takes it: a tensor for a formula alone (docs/own-objective.md), as given for terms."""
        if type(self).terms is ContrastiveLoss.terms:
            return _counts(k, like)
        return k.view(like.shape) if isinstance(k, torch.Tensor) else k

    def _at_logits(self, pos, neg_lse, neg_mean, scale):
        """(p [M, P], l [M, 1], m [M, 1] or None) of the formula from the positives' cosines [M, P] and the
        negatives' lse [M] and mean cosine [M] (stat_terms' and stat_grad's arguments)."""
        if not self._has_formula:
            raise NotImplementedError
        m = None if neg_mean is None else neg_mean[:, None] * scale
        return pos * scale, neg_lse[:, None], m

    def _weighted(self, p, cosines):
        """p times the positives' weights (DCLW's, of their ``cosines``), and the weights (None: none)."""
        if type(self).positive_weight is ContrastiveLoss.positive_weight:
            return p, None
        weight = self.positive_weight(cosines)
        return p if weight is None else weight * p, weight

    def stat_terms(self, pos: torch.Tensor, neg_lse: torch.Tensor, neg_mean: torch.Tensor | None, num_neg: int,
                   scale, diagnostics: bool = True) -> Terms:
        """Per-anchor terms from positive cosines [M, P] and the negatives' statistics: neg_lse [M], the
        logsumexp of their logits (cosines times ``scale``), and, where ``needs_mean``, neg_mean [M], their
        softmax-weighted mean cosine; num_neg is the number of valid negatives per anchor. The loss from the
        formula (through autograd), and with ``diagnostics`` (a call's output_dict: else None, no operator spent
        on them) the positive's term -p (weighted), the negatives' the rest, and InfoNCE's q_B = sigmoid(l - p)
        (DCL paper, Prop. 1)."""
        p, l, m = self._at_logits(pos, neg_lse, neg_mean, scale)
        weighted, _ = self._weighted(p, pos)
        args = (weighted, l, self._counts_for(num_neg, l)) + (() if m is None else (m,))
        loss = _over_positives(self.formula(*args))
        if not diagnostics:
            return Terms(loss, None, None, None)
        pos_term = -_over_positives(weighted).detach()
        npc = _over_positives(torch.sigmoid(l - p)).detach()
        return Terms(loss, pos_term, loss.detach() - pos_term, npc)

    def stat_grad(self, pos: torch.Tensor, neg_lse: torch.Tensor, neg_mean: torch.Tensor | None, num_neg: int,
                  scale) -> torch.Tensor:
        """d loss_i / d neg_lse_i (and, where ``needs_mean``, d loss_i / d neg_mean_i) per anchor, [S, M]
        (arguments as for stat_terms): the blockwise kernel then does backward's matrix products during forward,
        each block while it is in cache, and keeps no block for backward; backward checks that its gradient is
        this one times a constant, and recomputes otherwise. From ``terms``, averaged over the positives. Called
        per block of anchors, so without the positives' weights (DCLW's, made over the whole batch and every
        process: a collective), which scale the positive's term only and leave d/dl alone there (DCL's 1)."""
        p, l, m = self._at_logits(pos, neg_lse, neg_mean, scale)
        _, _, d_l, d_m = self.terms(p, l, self._counts_for(num_neg, l), m)
        rows = [_per_anchor(d_l, l)] + ([] if m is None else [_per_anchor(d_m, l) * scale])
        return torch.stack(rows) if len(rows) > 1 else rows[0][None]

    def label_terms(self, pos_mean: torch.Tensor, pos_lse: torch.Tensor, neg_lse: torch.Tensor,
                    num_neg: torch.Tensor) -> Terms:
        """Per-anchor terms of same_label="positive" (see the class docstring) from the mean of the positives'
        logits, their logsumexp (where positives_in_denominator, else the anchor's own sample's positives'
        alone: a diagnostic), the negatives' logsumexp and count."""
        raise NotImplementedError

    def positive_weight(self, pos: torch.Tensor) -> torch.Tensor | None:
        """Weights [M, P] of the positive cosines in the loss (DCLW's), or None."""
        return None

    def logit_terms(self, pos: torch.Tensor, neg_lse: torch.Tensor, neg_mean: torch.Tensor | None, scale,
                    num_neg: int, weight: torch.Tensor | None = None) -> LogitTerms:
        """The per-anchor loss [M] of one positive per anchor from its logit ``pos``, the negatives' lse and their
        softmax-weighted mean logit, with its partial derivatives in each, for the dense path's backward written
        by hand (dense.py; functional.LogitTerms), from ``terms``. ``weight``: the positives' weights where the
        caller made them (wav2vec 2.0's frames: DCLW's over the kept frames), else positive_weight's."""
        if not self._has_formula:
            raise NotImplementedError
        if weight is not None:
            weighted = weight * pos
        else:
            has_weight = type(self).positive_weight is not ContrastiveLoss.positive_weight
            weighted, weight = self._weighted(pos, pos / scale if has_weight else pos)
        loss, pull, d_l, d_m = self.terms(weighted, neg_lse, self._counts_for(num_neg, neg_lse), neg_mean)
        if weight is not None and pull is not None:  # the pull on the unweighted positive's logit
            pull = weight if isinstance(pull, float) and pull == 1.0 else pull * weight
        return LogitTerms(loss, d_l, d_m, pull, None)

    def _derived(self, p, l, k, m):
        """(``formula`` at (p, l, k, m), the pull -d/dp, d/dl, d/dm (None without m)), the derivatives by
        torch.func on these vectors (which torch.compile traces, fullgraph): a few operators beside the call's
        [M, K] passes."""
        args = (p, l) if m is None else (p, l, m)
        loss, pullback = torch.func.vjp(lambda *x: self.formula(x[0], x[1], k, *x[2:]), *args)
        grads = pullback(torch.ones_like(loss))
        return loss, -grads[0], grads[1], grads[2] if m is not None else None

    @property
    def _fuses(self) -> bool:
        """Whether this objective has the dense path's form (logit_terms, or a formula)."""
        return self._has_formula or type(self).logit_terms is not ContrastiveLoss.logit_terms

    # ------------------------------------------------------------------ the plan (plan.py)

    def plan(self, *features: torch.Tensor, call: str = "forward", labels: torch.Tensor | None = None,
             queue: torch.Tensor | None = None, negatives: torch.Tensor | None = None,
             logit_scale: torch.Tensor | float | None = None) -> Plan:
        """The route the call ``call`` ("forward", "query_key" or "cross_modal") would take on these inputs
        (given as to that call), without running it: ``print(loss_fn.plan(z1, z2))``. See plan.Plan."""
        if call == "forward":
            return self._views_plan(list(features), labels)
        if call == "query_key":
            query, key, *given = features  # (query, key) or (query, key, queue), as query_key takes them
            queue = given[0] if given else queue
            keys = key if key.dim() == 3 else key[:, None]
            if negatives is not None and negatives.dim() == 2:
                negatives = negatives[:, None]
            named = {"query": query, "key": keys, **({} if queue is None else {"queue": queue}),
                     **({} if negatives is None else {"negatives": negatives})}
            return self._query_key_plan(named, keys, queue, negatives, labels)
        if call == "cross_modal":
            image, text = features
            return self._image_text_plan(image, text, logit_scale, labels)
        raise ValueError(f"{self.name}: call must be 'forward', 'query_key' or 'cross_modal', got {call!r}")

    def _plan(self, setting: str, anchors: int, candidates: int, features, fused: bool = False) -> Plan:
        options = (self.backend, self.chunk_size, self.needs_mean, self._fuses, self.normalize)
        return make_plan(self.name, options, setting, anchors, candidates, features, fused)

    def _views_plan(self, views: list[torch.Tensor], labels) -> Plan:
        """Several views: the V n local views against every process's V n."""
        v, n = len(views), views[0].shape[0]
        return self._plan("two_views" if v == 2 else "views", v * n, v * n * self._processes(), views,
                          fused=v == 2 and labels is None)

    def _query_key_plan(self, features: dict[str, torch.Tensor], keys, queue, negatives, labels) -> Plan:
        """Queries against a queue (its rows), or against every process's keys and hard negatives (keys
        [n, P, D], negatives [n, H, D])."""
        n = keys.shape[0]
        if queue is not None:
            setting, candidates = "queue", queue.shape[0]
        else:
            per_sample = keys.shape[1] + (0 if negatives is None else negatives.shape[1])
            setting, candidates = "batch_keys", n * per_sample * self._processes()
        return self._plan(setting, n, candidates, list(features.values()),
                          fused=labels is None and keys.shape[1] == 1)

    def _image_text_plan(self, image, text, scale, labels) -> Plan:
        """Each direction's n local anchors against every process's n candidates."""
        one_scale = not isinstance(scale, torch.Tensor) or scale.numel() == 1
        n = image.shape[0]
        return self._plan("image_text", n, n * self._processes(), [image, text], fused=labels is None and one_scale)

    # ------------------------------------------------------------------ settings: each lays out its matrix once

    def forward(self, z1: torch.Tensor, z2: torch.Tensor, *more_views: torch.Tensor,
                labels: torch.Tensor | None = None, output_dict: bool = False):
        views = {f"z{i + 1}": z for i, z in enumerate((z1, z2, *more_views))}
        check_features(self.name, views, values=False)  # values: see _reduce
        if labels is not None:
            check_labels(self.name, labels, z1.shape[0], z1.device)
        zs = list(views.values())
        plan = self._views_plan(zs, labels)
        return self._run(self._views(zs, labels, plan), plan, self.default_logit_scale(), output_dict, views)

    def query_key(self, query: torch.Tensor, key: torch.Tensor, queue: torch.Tensor | None = None, *,
                  negatives: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                  queue_labels: torch.Tensor | None = None, output_dict: bool = False):
        """MoCo setting: query [N, D], key [N, D] (or [N, P, D] for P positives), queue [Q, D] or None.

        ``negatives`` [N, H, D] (or [N, D]), without a queue: H extra candidates per sample (retrieval's hard
        negatives), gathered with the keys; every query contrasts with every sample's keys and extras, its
        own sample's keys excepted (sentence-transformers' MultipleNegativesRankingLoss).

        ``labels`` [N]: each sample's label (its query's and keys'; see same_label in the class docstring);
        with a queue, ``queue_labels`` [Q] too (the labels enqueued with the keys). Hard negatives carry no
        label: they stay negatives."""
        for arg, t in (("query", query), ("key", key), ("queue", queue), ("negatives", negatives)):
            if not isinstance(t, torch.Tensor) and not (arg in ("queue", "negatives") and t is None):
                raise TypeError(f"{self.name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        keys = key if key.dim() == 3 else key[:, None]
        features = {"query": query, "key": keys.reshape(-1, keys.shape[-1])}
        if queue is not None:
            features["queue"] = queue
        if negatives is not None:
            if queue is not None:
                raise ValueError(f"{self.name}: give a queue or negatives, not both")
            negatives = negatives if negatives.dim() == 3 else negatives[:, None]
            features["negatives"] = negatives.reshape(-1, negatives.shape[-1])
        check_features(self.name, features, same_shape=False, values=False)
        for arg, t in (("key", keys), ("negatives", negatives)):
            if t is not None and t.shape[0] != query.shape[0]:
                raise ValueError(f"{self.name}: query has {query.shape[0]} rows but {arg} has {t.shape[0]}")
        if labels is not None:
            check_labels(self.name, labels, query.shape[0], query.device)
            if queue is not None:
                if queue_labels is None:
                    raise ValueError(f"{self.name}: labels with a queue need queue_labels, the labels of the queued keys")
                check_labels(self.name, queue_labels, queue.shape[0], query.device, "queue_labels")
        elif queue_labels is not None:
            raise ValueError(f"{self.name}: queue_labels without labels: give the batch's labels too")
        plan = self._query_key_plan(features, keys, queue, negatives, labels)
        setting = self._query_keys(query, keys, queue, negatives, labels, queue_labels, plan)
        return self._run(setting, plan, self.default_logit_scale(), output_dict, features)

    def cross_modal(self, image: torch.Tensor, text: torch.Tensor, *, logit_scale: torch.Tensor | float | None = None,
                    labels: torch.Tensor | None = None, output_dict: bool = False):
        """Image-text setting (CLIP): anchors are the images and the texts; an image's positive is its
        caption and its negatives the other captions, and vice versa; the loss is the mean of both
        directions. ``logit_scale`` (e.g. CLIP's learnable exp(t), keeps its gradient) replaces the
        loss's own scale (1 / temperature) when given. ``labels`` [N]: each pair's label or sample id
        (duplicates share one; see same_label in the class docstring)."""
        features = {"image": image, "text": text}
        check_features(self.name, features, values=False)
        if labels is not None:
            check_labels(self.name, labels, image.shape[0], image.device)
        if logit_scale is not None:
            check_logit_scale(self.name, logit_scale)
        scale = self.default_logit_scale() if logit_scale is None else logit_scale
        plan = self._image_text_plan(image, text, scale, labels)
        if isinstance(scale, torch.Tensor) and scale.dtype != plan.compute:
            scale = scale.to(plan.compute)
        return self._run(self._image_text(image, text, labels, plan), plan, scale, output_dict, features)

    def _views(self, zs: list[torch.Tensor], labels, plan: Plan) -> Setting:
        """V views of n samples: the anchors the V n local views (view-major), the candidates every process's
        V total (samples gathered whole, then view-major; on one process the anchors themselves); anchor (a, i)'s
        positives the other views of its sample, all V of them left out of its negatives."""
        v, (n, d) = len(zs), zs[0].shape
        rows = zs if len({z.dtype for z in zs}) == 1 else [z.to(plan.compute) for z in zs]
        anchors, candidates, start, total = torch.cat(rows), None, 0, n
        if self.gather_distributed:
            every, start = self._gather(torch.cat(rows, dim=1))
            total = every.shape[0]
            candidates = every.view(total, v, d).transpose(0, 1).reshape(v * total, d)
        if total < 2:
            raise ValueError(f"{self.name}: a batch of 1 sample has no negatives (each anchor's negatives are "
                             "the views of the other samples); use a batch of at least 2")
        where = positions("views", v, n, total, start, anchors.device, fused=plan.route == "fused")
        ids = None if labels is None else label_ids(labels.repeat(v), self._gather_labels(labels).repeat(v))
        problem = Problem(anchors, candidates, where.own, where.positives, v * (total - 1), ids, where.itself, False,
                          None, where.flat)
        return Setting([(zs[a], zs[b]) for a in range(v) for b in range(a + 1, v)], [problem])

    def _query_keys(self, query, keys, queue, negatives, labels, queue_labels, plan: Plan) -> Setting:
        """n queries, each with P keys [n, P, D]: against a queue (its rows the candidates, no key among them), or
        against every process's samples' keys and hard negatives (gathered whole), its own sample's keys left
        out of its negatives."""
        n, p = keys.shape[:2]
        pairs = [(query, keys[:, j]) for j in range(p)]
        if queue is not None:
            where = positions("queue", p, n, queue.shape[0], 0, query.device, fused=plan.route == "fused")
            # labels and queue_labels come together (checked by query_key)
            ids = None if labels is None or queue_labels is None else label_ids(labels, queue_labels)
            return Setting(pairs, [Problem(query, queue, None, where.positives, queue.shape[0], ids, None, False,
                                           None, where.flat, queue=True)])
        rows = keys  # [n, c, D]: each sample's keys, then its hard negatives
        if negatives is not None:
            rows = torch.cat([keys, negatives] if negatives.dtype == keys.dtype else
                             [keys.to(plan.compute), negatives.to(plan.compute)], dim=1)
        c, start, total = rows.shape[1], 0, n
        if self.gather_distributed:  # the rows as given (their own dtype), normalised by the path
            every, start = self._gather(rows.reshape(n, -1))
            rows, total = every.view(every.shape[0], c, -1), every.shape[0]
        if total * c - p < 1:
            raise ValueError(f"{self.name}: without a queue the negatives are the other keys of the batch, "
                             "and a batch of 1 has none")
        where = positions("keys", p, n, total, start, query.device, c, fused=plan.route == "fused")
        ids = None
        if labels is not None:  # each sample's keys carry its label, its hard negatives none
            known = (torch.arange(c, device=query.device) < p).repeat(total)
            ids = label_ids(labels, self._gather_labels(labels).repeat_interleave(c), known)
        return Setting(pairs, [Problem(query, rows.reshape(total * c, -1), where.own, where.positives, total * c - p,
                                       ids, None, False, None, where.flat)])

    def _image_text(self, image, text, labels, plan: Plan) -> Setting:
        """n image-text pairs: on one process one square matrix, its rows the images' anchors and its columns the
        texts', the diagonal the positives; gathered (or with labels, or CACR's mean off the paths that give the
        columns' too) each direction's n local anchors against every process's candidates of the other kind."""
        n = image.shape[0]
        a, b = (image, text) if image.dtype == text.dtype else (image.to(plan.compute), text.to(plan.compute))
        all_a, all_b, start = a, b, 0
        if self.gather_distributed:
            both, start = self._gather(torch.cat([a, b], 1))
            all_a, all_b = both.split(a.shape[1], dim=1)
        total = all_a.shape[0]
        if total < 2:
            raise ValueError(f"{self.name}: a batch of 1 pair has no negatives; use a batch of at least 2")
        pairs = [(image, text)]
        # CACR's columns' mean: the dense path and the torch kernel's exact route only
        columns_mean = plan.path == "dense" or plan.path == "torch" and not plan.host_checks
        if total == n and labels is None and (columns_mean or not self.needs_mean):
            where = positions("image_text", 1, n, n, 0, image.device, fused=plan.route == "fused")
            return Setting(pairs, [Problem(a, b, where.own, where.positives, n - 1, None, None, True, None,
                                           where.flat)])
        where = positions("keys", 1, n, total, start, image.device, fused=plan.route == "fused")
        ids = None if labels is None else label_ids(labels, self._gather_labels(labels))
        return Setting(pairs, [Problem(x, others, where.own, where.positives, total - 1, ids, None, False, 2 * n,
                                       where.flat) for x, others in ((a, all_b), (b, all_a))])

    # ------------------------------------------------------------------ the paths

    def _run(self, setting: Setting, plan: Plan, scale, output_dict: bool, inputs: dict[str, torch.Tensor]):
        """The reduced loss of a setting's matrix on the plan's path: dense.py's one Function where the plan says
        "fused", else each block's negatives' statistics (the whole logits, the blockwise torch kernel or the
        Triton kernels) with its positives' cosines into the objective's terms."""
        problems = setting.problems
        with no_autocast(problems[0].anchors.device.type):
            if plan.route == "fused":
                outs = [self._fused(problem, setting, scale, plan) for problem in problems]
                out = outs[0] if len(outs) == 1 else tuple(torch.cat(parts) for parts in zip(*outs))
                return self._dense_output(out, scale, problems[0].num_neg, output_dict, inputs)
            cosines = [self._cosines(x, y, plan) for x, y in setting.pairs]
            flat = cosines[0] if len(cosines) == 1 else torch.cat(cosines)
            parts = [self._terms(problem, flat[problem.positives], plan, scale, output_dict) for problem in problems]
            terms = parts[0] if len(parts) == 1 else Terms._make(None if pair[0] is None else torch.cat(pair)
                                                                 for pair in zip(*parts))
        return self._reduce(terms, output_dict, inputs)

    def _fused(self, problem: Problem, setting: Setting, scale, plan: Plan):
        """dense_loss's outputs for one block (its flat positions), the queue's keys put before it."""
        candidates = problem.candidates
        if problem.queue and candidates is not None:
            key = setting.pairs[0][1]
            candidates = torch.cat([key, candidates] if key.dtype == candidates.dtype else
                                   [key.to(plan.compute), candidates.to(plan.compute)])
        assert problem.flat is not None  # made by positions wherever the route is "fused"
        return dense_loss(problem.anchors, candidates, scale, problem.flat, columns=problem.columns,
                          terms=self.logit_terms, num_neg=problem.num_neg, with_mean=self.needs_mean,
                          normalize=self.normalize, dtype=plan.compute)

    def _terms(self, problem: Problem, pos: torch.Tensor, plan: Plan, scale, diagnostics: bool) -> Terms:
        """Per-anchor terms of one block from its positives' cosines ``pos`` [M, P] (a square one's rows, then its
        columns: [2 M, 1]); their diagnostics where asked. The torch kernel takes the features as given and
        normalises them per block (nothing of their size kept for backward, chunked.py), the Triton kernels too
        through their inverse norms (_units); the dense path takes unit vectors."""
        raw = plan.path == "torch"
        anchors, candidates = problem.anchors, problem.candidates
        if raw:
            if candidates is not None and candidates.dtype != anchors.dtype:
                anchors, candidates = anchors.to(plan.compute), candidates.to(plan.compute)
        else:
            anchors = self._units(anchors, plan)
            candidates = None if candidates is None else self._units(candidates, plan)
        candidates = anchors if candidates is None else candidates  # the same tensor: one gradient for both
        if not problem.columns:
            return self.negative_terms(pos, anchors, candidates, problem.own, problem.num_neg, scale, problem.mean_over,
                                       plan=plan, labels=problem.labels, itself=problem.itself, raw=raw,
                                       diagnostics=diagnostics)
        # A square block: one product (dense) or one pass of a kernel gives the rows' and the columns' statistics,
        # and one call of the terms takes both (the fewest operators, which is what counts at host-bound sizes).
        if plan.path == "dense":
            logits = self._dense_logits(anchors, candidates, scale, problem.own)
            stats = torch.cat([self._dense_stats(logits, scale), self._dense_stats(logits.T, scale)], dim=1)
        else:  # [2 S, n] (the rows' statistics, then the columns') to [S, 2 n]
            stats = self._negative_stats(plan, anchors, candidates, scale, problem.own, columns=True, raw=raw)
            stats = stats.reshape(2, -1, anchors.shape[0]).transpose(0, 1).reshape(-1, 2 * anchors.shape[0])
        return self._stat_terms(pos, stats, problem.num_neg, scale, diagnostics)

    def _cosines(self, x: torch.Tensor, y: torch.Tensor, plan: Plan) -> torch.Tensor:
        """cos(x_i, y_i) [n] of a positive pair's rows on the plan's path, in float32 by functional.row_cosines
        (12 bytes a row kept, no float32 copy of the features), float64 ones from the unit vectors. On the Triton
        path of the rows its products take (_units: under autocast the bf16/fp16 copies, not the float32
        features; float16, and float32 under TF32, rounded to float16 unit vectors: the plan's half_units), so
        that a positive inside its row's lse cancels there as in the dense loss, whose positive is a logit of the
        same product."""
        if plan.path == "triton":
            return row_cosines(self._units(x, plan), self._units(y, plan), self.normalize, units16=plan.half_units)
        if plan.compute == torch.float64:
            return (self._unit(x, plan.compute) * self._unit(y, plan.compute)).sum(dim=1)
        return row_cosines(x, y, self.normalize)

    def _dense_output(self, out, scale, num_neg, output_dict, inputs):
        """The reduced loss of dense_loss's outputs (per-anchor loss, positives' logits, lse[, mean]); the
        diagnostics, made only where ``output_dict`` asks, from stat_terms on the detached statistics."""
        if not output_dict:
            loss = self._apply_reduction(out[0])
            self._check_finite(loss, inputs)
            return loss
        s = scale.detach() if isinstance(scale, torch.Tensor) else scale
        mean = out[3] / s if len(out) > 3 else None
        terms = self.stat_terms((out[1] / s)[:, None], out[2], mean, num_neg, s)._replace(loss=out[0])
        return self._reduce(terms, output_dict, inputs)

    # ------------------------------------------------------------------ helpers

    def _units(self, x: torch.Tensor, plan: Plan) -> torch.Tensor:
        """The rows the plan's path takes: on the Triton path the features as given, in its operands' dtype
        (bf16/fp16) or the compute dtype, which its kernels normalise through their inverse norms (nothing of the features'
        size made or kept for backward beyond them: issue 40's memory); elsewhere the unit vectors (with
        normalize=False, the features) in the compute dtype. The Triton backend's positives are then
        functional.row_cosines of these rows (float32 sums: _cosines)."""
        if plan.path == "triton":
            return x.to(plan.operands or plan.compute)
        return self._unit(x, plan.compute)

    def _gather(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every process's rows of x and this process's offset. The settings gather the raw features, in
        their own dtype (a bf16 batch moves half the bytes of its float32 unit vectors), and normalise the
        gathered rows: exactly the unit vectors one process would compute."""
        return gather_with_grad(x, uneven=self.uneven) if self.gather_distributed else (x, 0)

    @property
    def uneven(self) -> bool:
        """Whether processes may hold different batch sizes (gather_distributed="uneven")."""
        return self.gather_distributed == "uneven"

    def _gather_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Every process's labels, in the order of the gathered features."""
        return gather_no_grad(labels, uneven=self.uneven) if self.gather_distributed else labels

    def _processes(self) -> int:
        """How many processes' candidates a call gathers (1 without gather_distributed): for the size of its
        matrix (uneven batches: counted as this process's)."""
        return world()[1] if self.gather_distributed else 1

    def _negative_stats(self, plan, anchors, candidates, scale, exclude, *, columns=False, row_grad=None,
                        raw=False, labels=None, same_label=True):
        """The negatives' statistics [S, M] (lse, CACR's mean, with ``columns`` the columns' lse) on the plan's
        path: the Triton kernels (products in the plan's operands' dtype where it has one) or the blockwise torch
        kernel (float32 or float64 products, its blocks and route the plan's; ``raw``: the features as given,
        normalised per block; ``labels`` and ``same_label``: pairs left out by label, see
        chunked.negative_stats)."""
        if plan.path == "triton":
            from contrastkit.losses.triton.stats import negative_stats_triton

            low = plan.operands
            if low is not None and anchors.dtype != low:  # features given by a caller outside the settings
                same = candidates is anchors
                anchors = anchors.to(low)
                candidates = anchors if same else candidates.to(low)
            return negative_stats_triton(anchors, candidates, scale, exclude=exclude, with_mean=self.needs_mean,
                                         columns=columns, normalize=self.normalize, labels=labels,
                                         same_label=same_label, forward_logits=plan.route, tf32=plan.tf32)
        # The same tensor as anchors and candidates only in the two-view setting, whose excluded pairs (a
        # sample's views, and pairs by label) are symmetric.
        return negative_stats(anchors, candidates, scale, exclude=exclude, block=plan.block, with_mean=self.needs_mean,
                              columns=columns, keep=plan.keep, row_grad=row_grad, symmetric=candidates is anchors,
                              normalize=raw and self.normalize, labels=labels,
                              same_label=same_label, fast=plan.route == "fast")

    @staticmethod
    def _dense_logits(anchors, candidates, scale, exclude, labels=None, same_label=True):
        """The whole [M, K] logits, excluded pairs at -inf (pairs left out as not of the anchor's label at
        chunked's finite excluded logit instead: a row may hold none of its label, and its lse then stays finite
        and takes no gradient, as the kernel's)."""
        logits = (anchors * scale) @ candidates.T
        if exclude is not None:  # masked in place: fewer operators than an index_put (host-bound sizes)
            logits.masked_fill_(torch.zeros_like(logits, dtype=torch.bool).scatter_(1, exclude, True), float("-inf"))
        if labels is not None:
            row_ids, col_ids = labels
            hit = row_ids[:, None] == col_ids[None] if same_label else row_ids[:, None] != col_ids[None]
            logits = logits.masked_fill(hit, float("-inf") if same_label else EXCLUDED)
        return logits

    def negative_terms(self, pos, anchors, candidates, exclude, num_neg, scale=None, mean_over=None,
                       plan=None, labels=None, itself=None, raw=False, diagnostics=True) -> Terms:
        """Per-anchor terms of anchors [M, D] against candidates [K, D] from the positives' cosines ``pos``
        [M, P], each anchor's excluded columns (exclude [M, E], or None) left out: dense (one product, masked in
        place) or blockwise (exact, the matrix never held whole). mean_over: how many anchors the loss averages
        these terms over (default M), for the kernel's guess of the gradient (see stat_grad). ``raw`` (the
        torch path): anchors and candidates are the features as given, normalised in the kernel where
        ``normalize``. ``labels``: (row_ids, col_ids) of label_ids; the candidates that
        share an anchor's label leave its negatives, num_neg then counted per anchor, and with
        same_label="positive" join its positives (see _label_positive_terms; ``itself`` [M, 1]: each anchor's
        own column among the candidates, where it is one). diagnostics: False leaves them out (None) where the
        objective's terms can (not the labels' SupCon form). plan: the one the setting made for the whole call
        (its units are made for it); a caller outside the settings (the adapters) gets one for these rows."""
        scale = self.default_logit_scale() if scale is None else scale
        if plan is None:
            plan = self._plan("rows", anchors.shape[0], candidates.shape[0], [anchors, candidates])
        if labels is not None:
            num_neg, same = self._negatives_left(labels, exclude, num_neg)
            if self.same_label == "positive":
                stats = self._stats(plan, anchors, candidates, scale, exclude, raw=raw, labels=labels)
                return self._label_positive_terms(plan, stats, pos, anchors, candidates, exclude, num_neg, same,
                                                  scale, labels, itself, raw)
        if plan.path == "dense":
            return self._stat_terms(pos, self._stats(plan, anchors, candidates, scale, exclude, labels=labels),
                                    num_neg, scale, diagnostics)
        row_grad = None
        if plan.path == "torch" and (self._has_formula or type(self).stat_grad is not ContrastiveLoss.stat_grad):
            count = anchors.shape[0] if mean_over is None else mean_over

            def row_grad(stats, r0, r1):
                mean = stats[1] if self.needs_mean else None
                k = num_neg[r0:r1] if isinstance(num_neg, torch.Tensor) else num_neg
                return self.stat_grad(pos[r0:r1], stats[0], mean, k, scale) / count

        stats = self._negative_stats(plan, anchors, candidates, scale, exclude, row_grad=row_grad, raw=raw,
                                     labels=labels)
        return self._stat_terms(pos, stats, num_neg, scale, diagnostics)

    def _negatives_left(self, labels, exclude, num_neg):
        """(negatives left per anchor [M], same-label candidates per anchor [M] beyond its own sample's
        excluded columns, which share its label). Every anchor needs one negative left: a ValueError on the
        CPU, a device-side assertion on CUDA (no host read), unchecked under torch.compile."""
        row_ids, col_ids = labels
        same = _per_id(col_ids, torch.ones_like(col_ids), row_ids.shape[0] + col_ids.shape[0])[row_ids]
        if exclude is not None:
            same = same - exclude.shape[1]
        left = num_neg - same
        require_negatives(self.name, left)
        return left, same

    def _label_positive_terms(self, plan, stats, pos, anchors, candidates, exclude, num_neg, same, scale,
                              labels, itself, raw) -> Terms:
        """same_label="positive": from the negatives' statistics over the other labels (``stats``) and the own
        sample's positive cosines, the mean logit over the anchor's positives P(i) (its own sample's, weighted
        for DCLW, and the same-label candidates) and the positives' lse where the objective's denominator holds
        them (else the own sample's alone, for the diagnostics). ``raw``: the torch kernel's raw features."""
        # sum of the same-label candidates' cosines: u_i . (the sum of their unit vectors), the own sample's
        # columns (same label, counted in pos) taken out
        as_given = raw or plan.path == "triton"  # the Triton path takes the features as given too (_units)
        ua, uc = ((self._unit(anchors, plan.compute), self._unit(candidates, plan.compute)) if as_given
                  else (anchors, candidates))
        row_ids, col_ids = labels
        sums = _per_id(col_ids, uc, row_ids.shape[0] + col_ids.shape[0])[row_ids]
        if exclude is not None:
            sums = sums - uc[exclude].sum(dim=1)
        weight = self.positive_weight(pos)
        own = (pos if weight is None else weight * pos).sum(dim=1)
        pos_mean = (own + (ua * sums).sum(dim=1)) * scale / (pos.shape[1] + same)
        pos_lse = torch.logsumexp(pos * scale, dim=1)
        if self.positives_in_denominator:
            pos_lse = self._positive_stats(plan, pos, anchors, candidates, exclude, scale, labels, itself, raw)[0]
        return self.label_terms(pos_mean, pos_lse, stats[0], num_neg)

    def _positive_stats(self, plan, pos, anchors, candidates, exclude, scale, labels, itself, raw):
        """same_label="positive": the statistics [S, M] (lse, and where ``needs_mean`` the mean) of the logits
        scale * s over each anchor's positives P(i): over every candidate of its label but itself (one pass of
        the kernel), the own sample's positives (cosines ``pos`` [M, P]) joined where they are no candidates."""
        stats = self._stats(plan, anchors, candidates, scale, itself, raw=raw, labels=labels, same_label=False)
        if exclude is not None:  # the own sample's positives are candidates (and counted there)
            return stats
        own = pos * scale  # a queue's keys
        lse = torch.logaddexp(torch.logsumexp(own, dim=1), stats[0])
        if not self.needs_mean:
            return lse[None]
        mean = (torch.exp(own - lse[:, None]) * pos).sum(dim=1) + torch.exp(stats[0] - lse) * stats[1]
        return torch.stack([lse, mean])

    def _stats(self, plan, anchors, candidates, scale, exclude, *, raw=False, labels=None, same_label=True):
        """_negative_stats (arguments as there) on every path, the dense one from the whole logits."""
        if plan.path != "dense":
            return self._negative_stats(plan, anchors, candidates, scale, exclude, raw=raw, labels=labels,
                                        same_label=same_label)
        return self._dense_stats(self._dense_logits(anchors, candidates, scale, exclude, labels, same_label), scale)

    def _dense_stats(self, logits, scale):
        """The statistics [S, M] of the rows of whole logits [M, K] (masked at -inf): lse, and CACR's mean."""
        lse = torch.logsumexp(logits, dim=1)
        return torch.stack([lse, softmax_mean(logits, scale)]) if self.needs_mean else lse[None]

    def _stat_terms(self, pos, stats, num_neg, scale, diagnostics=True) -> Terms:
        return self.stat_terms(pos, stats[0], stats[1] if self.needs_mean else None, num_neg, scale, diagnostics)

    def _reduce(self, terms: Terms, output_dict: bool, inputs: dict[str, torch.Tensor]):
        """The reduced loss (and with ``output_dict`` its diagnostics). Non-finite features always make a
        non-finite loss, so the inputs are searched for them only then: one check per call, not one per
        input."""
        out = self._output(terms, output_dict)
        self._check_finite(out["loss"] if output_dict else out, inputs)
        return out

    def _check_finite(self, loss: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
        """Non-finite features always make a non-finite loss, so the inputs are searched for them only then:
        one host read per call where host reads are free (the CPU), none on CUDA."""
        if host_checks_allowed(loss):
            finite = torch.isfinite(loss)
            if not bool(finite.all() if loss.dim() else finite):
                check_features(self.name, inputs, same_shape=False)
