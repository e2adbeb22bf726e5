"""sentence-transformers: contrastkit's objectives in place of MultipleNegativesRankingLoss (MNRL).

>>> from contrastkit.adapters.sentence_transformers import MultipleNegativesLoss
>>> loss = MultipleNegativesLoss(model, loss="dcl")    # was: losses.MultipleNegativesRankingLoss(model)
>>> SentenceTransformerTrainer(model=model, train_dataset=train, loss=loss).train()

The interface is MNRL's (sentence-transformers 6.2): the constructor takes the model and every MNRL
argument (scale, similarity_fct, gather_across_devices, directions, partition_mode, hardness_mode,
hardness_strength), ``forward(sentence_features, labels)`` returns the loss, and the inputs
are MNRL's columns: (anchor, positive) pairs, or (anchor, positive, negative_1, ..., negative_n). MNRL's
defaults are kept, so a swap changes only the objective: scale 20 (temperature 1 / 20 for infonce, dcl,
dclw, eqco) and cosine similarity (``similarity_fct=dot_score`` means ``normalize=False``).
``loss="infonce"`` is MNRL itself, values and gradients, for every combination of its arguments.

Anchor i is query i (the anchor column); its positive pair is (query i, document i), document i being the
positive column's row i; every hard negative column's row i also belongs to query i. Each direction gives
anchor i one row of candidates (all of them from every process with ``gather_across_devices=True``, the
gather with gradient: P processes equal one process on the whole batch):

- ``query_to_doc`` (required): query i against every document, positives and hard negatives. Its
  positive is document i; its negatives every other document, query i's own hard negatives included.
- ``query_to_query``: query i against every other query, all negatives.
- ``doc_to_query``: document i against every query. Its positive is query i (the same pair, so the same
  score as query_to_doc's positive); its negatives the other queries.
- ``doc_to_doc``: document i against every document of the other queries (query i's own documents, its
  positive and hard negatives, left out), all negatives.

``partition_mode="per_direction"`` (directions query_to_doc and doc_to_query only, as in MNRL): each
direction is the objective on its own (positive, negatives), and the loss is the mean over directions.
``"joint"``: one partition over the union of the directions' rows. The positive pair appears in it once
per direction that holds it (query_to_doc, and doc_to_query if chosen); the extra copy is a positive, not
a negative: InfoNCE and EqCo keep it in the denominator beside the positive (InfoNCE: -p + log(2 e^p +
sum_k e^n_k), exactly MNRL's joint form; EqCo: its alpha / K scales only the negatives, and K counts only
the negatives), DCL and DCLW leave every copy out (-p + log sum_k e^n_k over the union's negatives), and
CACR's repulsion runs over the union's negatives only. DCLW's weight is the pair's, once per anchor.

``hardness_mode`` (with ``hardness_strength`` alpha > 0) weights negatives of the query_to_doc row by
w = exp(alpha s), s their similarity (cosine, or dot product with dot_score), detached, as MNRL does:
``"in_batch_negatives"`` the other queries' documents (positives and hard negatives),
``"hard_negatives"`` query i's own hard negatives, ``"all_negatives"`` both; the positive and the other
directions' candidates are never weighted. The weight multiplies a negative's term inside the objective's
denominator (log w = alpha s added to its logit, not divided by the temperature): InfoNCE -p + log(e^p +
sum_k w_k e^n_k); EqCo the same with alpha / K on the weighted sum (K still counts negatives, not
weights); DCL and DCLW -w_p p + log sum_k w_k e^n_k (w_p: 1 for DCL, DCLW's pair weight), the positive
still out of it; CACR's repulsion weights become pi_k proportional to w_k e^(2 t_neg s_k). In the joint
partition the weighted query_to_doc terms share the one denominator with the other directions' unweighted
ones. A hardness_mode with hardness_strength 0 weights nothing (a logged warning, as in MNRL).

CACR has no temperature (its weights use t_pos, t_neg) and so takes no ``scale``. UniGrad has no
negatives (its repulsion is a running correlation of the features, averaged over processes): it takes
(anchor, positive) pairs only, is symmetric by construction, and so refuses other directions and any
hardness_mode. Other keyword arguments are the objective's own (sigma, alpha, t_pos, t_neg, lam, rho,
chunk_size, backend).

Labels. sentence-transformers hands a loss the dataset's ``label`` column (or ``labels``, ``score``,
``scores``: its collator's first found) as ``labels``; MNRL ignores it. Here an integer column is each pair's
label (a class, or a sample id shared by duplicates; gathered with the rows under gather_across_devices):
pairs whose labels are equal are not each other's negatives. In every direction a candidate of the anchor's
pair label (its query or positive document; the anchor's own positive and, in query_to_query and doc_to_doc,
its own row are out already) is, by ``same_label``:

- ``"mask"`` (default): left out of the anchor's negatives; the loss is otherwise the one without labels
  (EqCo's K counts the negatives left, per anchor and partition).
- ``"positive"``: one of the anchor's positives P(i), SupCon's L_out as the loss core's ContrastiveLoss
  defines it per objective. P(i) is the partition's: the positive pair once per direction that holds it
  (as above) and every same-label candidate of its directions, the label's at weight 1 (DCLW's weight is
  the pair's only) and never hardness-weighted. InfoNCE: -1/|P| sum_P s_p + log(sum_P e^s_p + sum_k w_k
  e^n_k); EqCo the same with alpha / K_i on the negatives' sum; DCL and DCLW -1/|P| sum_P w_p s_p + log
  sum_k w_k e^n_k. CACR: its attraction over P(i), weights softmax(t_pos c) detached (the pair's copies
  each one positive), its repulsion over the negatives left (see CACRLoss).

Hard negative columns carry no label: they stay negatives in every direction (query_to_doc, doc_to_doc),
whatever the labels, and keep their hardness weights. With every label distinct the loss is the one without
labels. Every anchor needs a negative left in each partition (a ValueError on the CPU; a device-side
assertion on CUDA). A floating-point column (a similarity score) is not a label and is ignored, as MNRL
ignores it. UniGrad takes no labels.

Two paths give these values. MNRL's defaults (query_to_doc alone, or query_to_doc and doc_to_query with
per_direction; no hardness) take the loss core's ``query_key``: exact, blockwise, memory linear in the
batch. Every other combination builds each direction's [N, candidates] score matrix, as MNRL itself does,
and applies the objective's score-level terms (contrastkit.losses.functional) with a validity mask and the
log-weights (``chunk_size`` and ``backend`` choose the core's kernel, and so act on the first path only).

``CachedMultipleNegativesLoss`` is the GradCache form (sentence-transformers'
CachedMultipleNegativesRankingLoss, whose caching machinery it reuses): embeddings are computed in
mini-batches of ``mini_batch_size`` without a graph, the loss and its gradient in the embeddings on the
whole batch, then each mini-batch is embedded again with its graph and given its cached gradient. Same
values and gradients as ``MultipleNegativesLoss``; memory of one mini-batch of activations, plus, on the
score-matrix path, the batch's score matrices in the loss stage (the core's path never holds them).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from sentence_transformers import util
from sentence_transformers.base.losses.gradcache import (CachedLossMixin, _validate_mini_batch_num_tokens,
                                                         has_static_embedding_input)
from sentence_transformers.base.losses.merged_forward import embed_columns
from torch import nn

from contrastkit.distributed import gather_no_grad, gather_with_grad
from contrastkit.losses import build_loss
from contrastkit.losses.base import check_features, check_labels, require_negatives
from contrastkit.losses.chunked import no_autocast
from contrastkit.losses.functional import _compute_dtype, cacr_positive_stat_terms, cacr_stat_terms, normalize_rows
from contrastkit.losses.plan import host_checks_allowed

logger = logging.getLogger(__name__)

ST_LOSSES = ("infonce", "dcl", "dclw", "eqco", "cacr", "unigrad")
TEMPERATURE_LOSSES = ("infonce", "dcl", "dclw", "eqco")
DEFAULT_SCALE = 20.0  # MNRL's
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")
HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")
ONE_WAY, SYMMETRIC = ("query_to_doc",), ("query_to_doc", "doc_to_query")
REPLACED = {"temperature": "use scale (= 1 / temperature), as in MNRL", "normalize": "use similarity_fct",
            "gather_distributed": "use gather_across_devices", "reduction": "the loss is the batch mean, as MNRL's"}


def _similarity_normalizes(similarity_fct) -> bool:
    """True for cos_sim, False for dot_score (MNRL's two choices), else a clear error."""
    if similarity_fct is util.cos_sim:
        return True
    if similarity_fct is util.dot_score:
        return False
    name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
    raise ValueError(f"contrastkit sentence-transformers loss: similarity_fct must be util.cos_sim or util.dot_score, "
                     f"got {name}")


def _check_mnrl_arguments(name: str, directions, partition_mode, hardness_mode, hardness_strength) -> tuple[str, ...]:
    """MNRL's checks of its arguments, and UniGrad's limits; the chosen directions, each once, in the
    canonical order (MNRL, too, counts a repeated direction once)."""
    directions = tuple(directions)
    if not directions:
        raise ValueError("directions: give at least one (query_to_doc is required)")
    unknown = [d for d in directions if d not in DIRECTIONS]
    if unknown:
        raise ValueError(f"directions: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(DIRECTIONS)}")
    if "query_to_doc" not in directions:
        raise ValueError("directions must include 'query_to_doc' (the only one that pairs a query with its positive "
                         f"as the anchor), got {directions}")
    if partition_mode not in PARTITION_MODES:
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
    same_type = sorted({"query_to_query", "doc_to_doc"} & set(directions))
    if partition_mode == "per_direction" and same_type:
        raise ValueError(f"partition_mode='per_direction' needs a positive in every direction's candidates, and "
                         f"{', '.join(same_type)} has none (as in MNRL); use partition_mode='joint'")
    if hardness_mode is not None and hardness_mode not in HARDNESS_MODES:
        raise ValueError(f"hardness_mode must be None or one of {', '.join(HARDNESS_MODES)}, got {hardness_mode!r}")
    if isinstance(hardness_strength, bool) or not isinstance(hardness_strength, (int, float)):
        raise ValueError(f"hardness_strength must be a number, got {type(hardness_strength).__name__}")
    if not (hardness_strength >= 0 and math.isfinite(hardness_strength)):
        raise ValueError(f"hardness_strength must be non-negative and finite, got {hardness_strength}")
    if name == "unigrad":
        if set(directions) != {"query_to_doc"}:
            raise ValueError("unigrad is symmetric over the pair by construction and has no negatives; use "
                             "directions=('query_to_doc',)")
        if hardness_mode is not None:
            raise ValueError("unigrad has no negatives, so no hardness weights: leave hardness_mode=None")
    if hardness_mode is not None and hardness_strength == 0:
        logger.warning("hardness_mode=%r with hardness_strength=0.0 weights nothing; give a positive "
                       "hardness_strength", hardness_mode)
    return tuple(d for d in DIRECTIONS if d in directions)


class MultipleNegativesLoss(nn.Module):
    """MultipleNegativesRankingLoss with a contrastkit objective (``loss``: infonce, dcl, dclw, eqco, cacr,
    unigrad) and every MNRL argument of sentence-transformers 6.2. See the module docstring for what each
    direction, partition and hardness weight means for each objective."""

    def __init__(self, model, loss: str = "dcl", scale: float | None = None, similarity_fct=None,
                 gather_across_devices: bool = False, directions: tuple[str, ...] = ONE_WAY,
                 partition_mode: str = "joint", hardness_mode: str | None = None, hardness_strength: float = 0.0,
                 **options: Any):
        super().__init__()
        name = str(loss).lower()
        if name not in ST_LOSSES:
            raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(ST_LOSSES)}")
        chosen = _check_mnrl_arguments(name, directions, partition_mode, hardness_mode, hardness_strength)
        for key, instead in REPLACED.items():
            if key in options:
                raise ValueError(f"{name}: no {key}= here; {instead}")
        if name in TEMPERATURE_LOSSES:
            scale = DEFAULT_SCALE if scale is None else scale
            if not scale > 0:
                raise ValueError(f"{name}: scale must be positive, got {scale}")
            options["temperature"] = 1.0 / scale
        elif scale is not None:
            raise ValueError(f"{name} has no temperature, so no scale; its options are "
                             f"{'t_pos, t_neg' if name == 'cacr' else 'lam, rho'}")
        self.similarity_fct = util.cos_sim if similarity_fct is None else similarity_fct
        options["normalize"] = _similarity_normalizes(self.similarity_fct)
        if name != "unigrad":
            options["gather_distributed"] = gather_across_devices
        try:
            self.objective: Any = build_loss(name, **options)  # its subclass attributes (alpha, t_pos) read below
        except TypeError as err:
            raise ValueError(str(err)) from None
        self.model = model
        self.name, self.scale, self.options = name, scale, options
        self.gather_across_devices, self.directions = gather_across_devices, tuple(directions)
        self.partition_mode = partition_mode
        self.hardness_mode, self.hardness_strength = hardness_mode, hardness_strength
        self._chosen = chosen  # each direction once, in DIRECTIONS' order
        weighted = hardness_mode is not None and hardness_strength > 0
        # MNRL's defaults take the core's query_key (memory-linear); the other combinations the score matrices.
        symmetric = chosen == SYMMETRIC and partition_mode == "per_direction"
        self._core_path = not weighted and (chosen == ONE_WAY or symmetric)

    def forward(self, sentence_features, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.compute_loss_from_embeddings(embed_columns(self.model, sentence_features), labels)

    def compute_loss_from_embeddings(self, embeddings: list[torch.Tensor], labels=None) -> torch.Tensor:
        """The loss of the columns' embeddings: anchors, positives, then any hard negatives, each [N, D]."""
        if len(embeddings) < 2:
            raise ValueError(f"{self.name}: expected (anchor, positive, negatives...) columns, got {len(embeddings)}")
        anchors, positives, *hard = embeddings
        labels = self._pair_labels(labels, anchors.device)
        if self.name == "unigrad":
            if hard:
                raise ValueError("unigrad has no negatives: train it on (anchor, positive) pairs")
            self.objective.train(self.model.training)  # the correlation is updated in training only
            return self.objective(anchors, positives, labels=labels)
        if not self._core_path:
            return self._score_matrix_loss(list(embeddings), labels)
        negatives = torch.stack(hard, dim=1) if hard else None
        loss = self.objective.query_key(anchors, positives, negatives=negatives, labels=labels)
        if self._chosen == SYMMETRIC:  # the positives as anchors against the anchors (MNRL's doc_to_query)
            loss = (loss + self.objective.query_key(positives, anchors, labels=labels)) / 2
        return loss

    def _pair_labels(self, labels, device: torch.device) -> torch.Tensor | None:
        """The label column as pair labels: an integer tensor, on the embeddings' device; a floating-point one
        (a similarity score, which MNRL ignores) gives None."""
        if labels is None:
            return None
        if isinstance(labels, torch.Tensor) and labels.is_floating_point():
            if not getattr(self, "_warned_scores", False):
                logger.warning("%s: the dataset's label column holds floating-point values (scores), not labels; "
                               "it is ignored, as MultipleNegativesRankingLoss ignores it", self.name)
                self._warned_scores = True
            return None
        return labels.to(device) if isinstance(labels, torch.Tensor) else labels

    # ------------------------------------------------------------------ the score-matrix path

    def _score_matrix_loss(self, columns: list[torch.Tensor], labels: torch.Tensor | None = None) -> torch.Tensor:
        """Every direction's [n, candidates] similarities (this process's rows against every process's
        candidates), the objective's per-anchor terms on each partition, their mean. labels [n]: the pairs'."""
        check_features(self.name, {f"column {i}": c for i, c in enumerate(columns)}, values=False)
        device = columns[0].device
        if labels is not None:
            check_labels(self.name, labels, columns[0].shape[0], device)
        with no_autocast(device.type):
            dtype = _compute_dtype(*columns)
            x = torch.stack([c.to(dtype) for c in columns], dim=1)  # [n, C, D]: query, positive, hard negatives
            n, c, d = x.shape
            start = 0
            if self.gather_across_devices:  # every process's rows, with gradient (contrastkit's gather)
                gathered, start = gather_with_grad(x.reshape(n, c * d))
                x = gathered.reshape(-1, c, d)
            total = x.shape[0]
            u = normalize_rows(x) if self.options["normalize"] else x
            queries = u[:, 0]  # [T, D]
            docs = u[:, 1:].transpose(0, 1).reshape((c - 1) * total, d)  # positives, then each hard column
            query, doc = queries[start:start + n], u[start:start + n, 1]
            pos = (query * doc).sum(dim=-1)  # [n]: the pair's similarity, every direction's positive
            own = start + torch.arange(n, device=device)
            column = torch.arange((c - 1) * total, device=device)
            own_doc = (column % total)[None] == own[:, None]  # [n, (C - 1) T]: query i's documents
            own_positive = own_doc & (column < total)[None]
            other_query = torch.arange(total, device=device)[None] != own[:, None]  # [n, T]

            # Per direction: (similarities, negatives mask, number of negatives per anchor, holds the positive
            # pair, the candidates that are positives too: same_label="positive", else None)
            rows: dict[str, tuple[torch.Tensor, torch.Tensor, int | torch.Tensor, bool, torch.Tensor | None]]
            rows = {"query_to_doc": (query @ docs.T, ~own_positive, (c - 1) * total - 1, True, None)}
            if "query_to_query" in self._chosen:
                rows["query_to_query"] = (query @ queries.T, other_query, total - 1, False, None)
            if "doc_to_query" in self._chosen:
                rows["doc_to_query"] = (doc @ queries.T, other_query, total - 1, True, None)
            if "doc_to_doc" in self._chosen:
                rows["doc_to_doc"] = (doc @ docs.T, ~own_doc, (c - 1) * (total - 1), False, None)
            log_w = self._log_weights(rows["query_to_doc"][0], own_doc, own_positive)  # query_to_doc's only
            if labels is not None:  # the label's candidates leave the negatives; with "positive" join the positives
                same_query = (gather_no_grad(labels) if self.gather_across_devices else labels)[None] == labels[:, None]
                same_doc = torch.cat([same_query, same_query.new_zeros(n, (c - 2) * total)], dim=1)  # hard: no label
                positive = self.objective.same_label == "positive"
                for key, (s, mask, _, held, _) in rows.items():
                    of_label = mask & (same_doc if key.endswith("_doc") else same_query)
                    kept = mask & ~of_label
                    rows[key] = (s, kept, kept.sum(dim=1), held, of_label if positive else None)

            if self.partition_mode == "per_direction":
                per_anchor = [self._terms(pos, s, mask, k, log_w if key == "query_to_doc" else None, 0, same)
                              for key, (s, mask, k, _, same) in rows.items()]
                loss = torch.stack(per_anchor).mean(dim=0).mean()
            else:  # one partition: the directions' rows side by side, query_to_doc's first
                parts = list(rows.values())
                s = torch.cat([p[0] for p in parts], dim=1)
                mask = torch.cat([p[1] for p in parts], dim=1)
                if log_w is not None:
                    log_w = torch.cat([log_w, *(torch.zeros_like(p[0]) for p in parts[1:])], dim=1)
                positives = [p[4] for p in parts if p[4] is not None]
                same = torch.cat(positives, dim=1) if positives else None
                copies = sum(p[3] for p in parts) - 1  # the positive pair again: doc_to_query's
                loss = self._terms(pos, s, mask, sum(p[2] for p in parts), log_w, copies, same).mean()
        if host_checks_allowed(loss) and not bool(torch.isfinite(loss)):
            check_features(self.name, {f"column {i}": c for i, c in enumerate(columns)}, same_shape=False)
        return loss

    def _log_weights(self, s: torch.Tensor, own_doc: torch.Tensor, own_positive: torch.Tensor) -> torch.Tensor | None:
        """log w = hardness_strength * s (detached) on the query_to_doc negatives the mode names, else 0; None
        without hardness."""
        if self.hardness_mode is None or self.hardness_strength == 0:
            return None
        if self.hardness_mode == "in_batch_negatives":
            chosen = ~own_doc
        elif self.hardness_mode == "hard_negatives":
            chosen = own_doc & ~own_positive
        else:  # all_negatives
            chosen = ~own_positive
        return torch.where(chosen, self.hardness_strength * s.detach(), s.new_zeros(()))

    def _terms(self, pos: torch.Tensor, s: torch.Tensor, mask: torch.Tensor, num_neg: int | torch.Tensor,
               log_w: torch.Tensor | None, copies: int, same: torch.Tensor | None = None) -> torch.Tensor:
        """Per-anchor loss [n] of positive similarities pos [n] against the negatives' similarities s [n, K]
        where mask (num_neg of them per anchor: one number, or [n] with labels), each negative's exponential
        times w (log_w, or 1); copies: further copies of the positive pair in the partition (joint
        doc_to_query); same [n, K]: the candidates that are positives too (same_label="positive")."""
        self._check_negatives(num_neg)
        scale = self.objective.default_logit_scale()
        logits = s * scale if log_w is None else s * scale + log_w
        logits = logits.masked_fill(~mask, float("-inf"))
        if self.name == "cacr":  # the repulsion's softmax over the negatives, times their weights
            neg_mean = (torch.softmax(logits, dim=1) * s).sum(dim=1)
            if same is None:
                return cacr_stat_terms(pos[:, None], neg_mean, t_pos=self.objective.t_pos).loss
            # the attraction over P(i) (the pair once per direction holding it, the label's candidates), weights
            # softmax(t_pos c) = softmax(-2 t_pos s), from the positives' lse and mean as in the loss core
            pos_scale = -2.0 * self.objective.t_pos
            both = torch.cat([pos[:, None] * pos_scale + math.log(1 + copies),
                              (s * pos_scale).masked_fill(~same, float("-inf"))], dim=1)
            pos_lse = torch.logsumexp(both, dim=1)
            pos_mean = (torch.softmax(both, dim=1) * torch.cat([pos[:, None], s], dim=1)).sum(dim=1)
            return cacr_positive_stat_terms(pos_lse, pos_mean, neg_mean, pos_scale=pos_scale).loss
        neg_lse = torch.logsumexp(logits, dim=1)
        if same is None and not copies:  # one positive: the objective's own terms
            return self.objective.stat_terms(pos[:, None], neg_lse, None, num_neg, scale, diagnostics=False).loss
        # Several positives sharing one denominator, the objective's label_terms (SupCon's L_out; DCL, DCLW keep
        # them out of it): the pair once per direction holding it (DCLW's weight on it), the label's candidates.
        p, pair = pos * scale, 1 + copies
        weight = self.objective.positive_weight(pos[:, None])
        pos_sum, count, lse_parts = pair * (p if weight is None else weight[:, 0] * p), pair, [p + math.log(pair)]
        if same is not None:
            pos_sum = pos_sum + (s * scale * same).sum(dim=1)
            count = pair + same.sum(dim=1)
            lse_parts.append(torch.logsumexp((s * scale).masked_fill(~same, float("-inf")), dim=1))
        pos_lse = lse_parts[0] if len(lse_parts) == 1 else torch.logaddexp(*lse_parts)
        return self.objective.label_terms(pos_sum / count, pos_lse, neg_lse, num_neg).loss

    def _check_negatives(self, num_neg: int | torch.Tensor) -> None:
        """Every anchor needs a negative: a ValueError, or with labels (num_neg per anchor) the loss core's check."""
        if not isinstance(num_neg, int):
            require_negatives(self.name, num_neg)
        elif num_neg < 1:
            raise ValueError(f"{self.name}: an anchor has no negatives (a batch of one pair); use a batch of "
                             "at least 2")

    @property
    def temperature(self) -> float | None:
        return None if self.scale is None else 1.0 / self.scale

    def get_config_dict(self) -> dict[str, Any]:
        """What the model card records."""
        return {"loss": self.name, "scale": self.scale,
                "similarity_fct": util.similarity_fct_name(self.similarity_fct),
                "gather_across_devices": self.gather_across_devices, "directions": self.directions,
                "partition_mode": self.partition_mode, "hardness_mode": self.hardness_mode,
                "hardness_strength": self.hardness_strength,
                **{k: v for k, v in self.options.items() if k not in REPLACED}}


class CachedMultipleNegativesLoss(CachedLossMixin, nn.Module):
    """CachedMultipleNegativesRankingLoss with a contrastkit objective: GradCache over mini-batches of
    ``mini_batch_size`` (or of ``mini_batch_num_tokens`` tokens) through sentence-transformers'
    CachedLossMixin (its RNG replay for dropout, DDP no_sync and backward hook); same values and gradients
    as MultipleNegativesLoss. Arguments as MultipleNegativesLoss's, plus those two and ``show_progress_bar``."""

    def __init__(self, model, loss: str = "dcl", scale: float | None = None, similarity_fct=None,
                 mini_batch_size: int = 32, mini_batch_num_tokens: int | None = None,
                 gather_across_devices: bool = False, directions: tuple[str, ...] = ONE_WAY,
                 partition_mode: str = "joint", show_progress_bar: bool = False, hardness_mode: str | None = None,
                 hardness_strength: float = 0.0, **options: Any):
        super().__init__()
        if has_static_embedding_input(model):
            raise ValueError("CachedMultipleNegativesLoss cannot split a StaticEmbedding model's inputs into "
                             "mini-batches; use MultipleNegativesLoss")
        if not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive integer, got {mini_batch_size!r}")
        _validate_mini_batch_num_tokens(mini_batch_num_tokens)
        self.loss = MultipleNegativesLoss(model, loss, scale, similarity_fct,
                                          gather_across_devices=gather_across_devices, directions=directions,
                                          partition_mode=partition_mode, hardness_mode=hardness_mode,
                                          hardness_strength=hardness_strength, **options)
        self.model = model
        self.mini_batch_size, self.mini_batch_num_tokens = mini_batch_size, mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar

    def forward(self, sentence_features, labels: torch.Tensor | None = None) -> torch.Tensor:
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ValueError(f"expected (anchor, positive, negatives...) columns, got {len(sentence_features)}")
        return self.forward_cached(sentence_features, labels)

    def calculate_loss(self, reps: list[list[torch.Tensor]], labels=None, *, with_backward: bool = False):
        """The loss on the whole batch from the mini-batches' embeddings (GradCache's step 2); with
        ``with_backward`` its gradient reaches the embeddings (the cache) and the loss comes back detached."""
        loss = self.loss.compute_loss_from_embeddings([torch.cat(r) for r in reps], labels)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def get_config_dict(self) -> dict[str, Any]:
        return {**self.loss.get_config_dict(), "mini_batch_size": self.mini_batch_size,
                "mini_batch_num_tokens": self.mini_batch_num_tokens}

    @property
    def temperature(self) -> float | None:
        return self.loss.temperature
