"""sentence-transformers: contrastkit's objectives in place of MultipleNegativesRankingLoss (MNRL).

>>> from contrastkit.adapters.sentence_transformers import MultipleNegativesLoss
>>> loss = MultipleNegativesLoss(model, loss="dcl")    # was: losses.MultipleNegativesRankingLoss(model)
>>> SentenceTransformerTrainer(model=model, train_dataset=train, loss=loss).train()

The interface is MNRL's: the constructor takes the model, ``forward(sentence_features, labels)`` returns
the loss (labels unused), and the inputs are MNRL's columns: (anchor, positive) pairs, or (anchor,
positive, negative_1, ..., negative_n). Anchor i's positive is positive i; its negatives are every
other positive of the batch and every hard negative (its own and the other anchors'), from every
process with ``gather_across_devices=True`` (the core's gather with gradient: P processes equal one
process on the whole batch). ``directions=("query_to_doc", "doc_to_query"),
partition_mode="per_direction"`` is MNRL's symmetric form: the mean of that loss and the positives'
loss against the anchors. MNRL's defaults are kept, so a swap changes only the objective: scale 20
(temperature 1 / 20 for infonce, dcl, dclw, eqco) and cosine similarity (``similarity_fct=dot_score``
means ``normalize=False``). ``loss="infonce"`` is MNRL itself, values and gradients.

CACR has no temperature (its weights use t_pos, t_neg) and so takes no ``scale``. UniGrad has no
negatives (its repulsion is a running correlation of the features, averaged over processes): it takes
(anchor, positive) pairs only and is symmetric by construction. Other keyword arguments are the
objective's own (sigma, alpha, t_pos, t_neg, lam, rho, chunk_size, backend).

``CachedMultipleNegativesLoss`` is the GradCache form (sentence-transformers'
CachedMultipleNegativesRankingLoss, whose caching machinery it reuses): embeddings are computed in
mini-batches of ``mini_batch_size`` without a graph, the loss and its gradient in the embeddings on the
whole batch (the core is exact and memory-linear, so the batch's [N, N] matrix is never held), then each
mini-batch is embedded again with its graph and given its cached gradient. Same values and gradients as
``MultipleNegativesLoss``; memory of one mini-batch of activations.
"""

from __future__ import annotations

from typing import Any

import torch
from sentence_transformers import util
from sentence_transformers.base.losses.gradcache import (CachedLossMixin, _validate_mini_batch_num_tokens,
                                                         has_static_embedding_input)
from sentence_transformers.base.losses.merged_forward import embed_columns
from torch import nn

from contrastkit.losses import build_loss

ST_LOSSES = ("infonce", "dcl", "dclw", "eqco", "cacr", "unigrad")
TEMPERATURE_LOSSES = ("infonce", "dcl", "dclw", "eqco")
DEFAULT_SCALE = 20.0  # MNRL's
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


class MultipleNegativesLoss(nn.Module):
    """MultipleNegativesRankingLoss with a contrastkit objective (``loss``: infonce, dcl, dclw, eqco, cacr,
    unigrad). See the module docstring for the forms and defaults."""

    def __init__(self, model, loss: str = "dcl", scale: float | None = None, similarity_fct=None,
                 gather_across_devices: bool = False, directions: tuple[str, ...] = ONE_WAY,
                 partition_mode: str = "joint", **options: Any):
        super().__init__()
        name = str(loss).lower()
        if name not in ST_LOSSES:
            raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(ST_LOSSES)}")
        directions = tuple(directions)
        if directions not in (ONE_WAY, SYMMETRIC):
            raise ValueError(f"directions must be {ONE_WAY} or {SYMMETRIC} (MNRL's symmetric form), got {directions}")
        if directions == SYMMETRIC and partition_mode != "per_direction":
            raise ValueError("the symmetric form is MNRL's partition_mode='per_direction' (one softmax per direction); "
                             f"got partition_mode={partition_mode!r}")
        if partition_mode not in ("joint", "per_direction"):
            raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
        if name == "unigrad" and directions != ONE_WAY:
            raise ValueError("unigrad is symmetric over the pair by construction; use directions=('query_to_doc',)")
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
            self.objective = build_loss(name, **options)
        except TypeError as err:
            raise ValueError(str(err)) from None
        self.model = model
        self.name, self.scale, self.options = name, scale, options
        self.gather_across_devices, self.directions = gather_across_devices, directions
        self.partition_mode = partition_mode

    def forward(self, sentence_features, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.compute_loss_from_embeddings(embed_columns(self.model, sentence_features), labels)

    def compute_loss_from_embeddings(self, embeddings: list[torch.Tensor], labels=None) -> torch.Tensor:
        """The loss of the columns' embeddings: anchors, positives, then any hard negatives, each [N, D]."""
        if len(embeddings) < 2:
            raise ValueError(f"{self.name}: expected (anchor, positive, negatives...) columns, got {len(embeddings)}")
        anchors, positives, *hard = embeddings
        if self.name == "unigrad":
            if hard:
                raise ValueError("unigrad has no negatives: train it on (anchor, positive) pairs")
            self.objective.train(self.model.training)  # the correlation is updated in training only
            return self.objective(anchors, positives)
        negatives = torch.stack(hard, dim=1) if hard else None
        loss = self.objective.query_key(anchors, positives, negatives=negatives)
        if self.directions == SYMMETRIC:  # the positives as anchors against the anchors (MNRL's doc_to_query)
            loss = (loss + self.objective.query_key(positives, anchors)) / 2
        return loss

    @property
    def temperature(self) -> float | None:
        return None if self.scale is None else 1.0 / self.scale

    def get_config_dict(self) -> dict[str, Any]:
        """What the model card records."""
        return {"loss": self.name, "scale": self.scale,
                "similarity_fct": util.similarity_fct_name(self.similarity_fct),
                "gather_across_devices": self.gather_across_devices, "directions": self.directions,
                "partition_mode": self.partition_mode, **{k: v for k, v in self.options.items() if k not in REPLACED}}


class CachedMultipleNegativesLoss(CachedLossMixin, nn.Module):
    """CachedMultipleNegativesRankingLoss with a contrastkit objective: GradCache over mini-batches of
    ``mini_batch_size`` (or of ``mini_batch_num_tokens`` tokens) through sentence-transformers'
    CachedLossMixin (its RNG replay for dropout, DDP no_sync and backward hook); same values and gradients
    as MultipleNegativesLoss. Arguments as MultipleNegativesLoss's, plus those two and ``show_progress_bar``."""

    def __init__(self, model, loss: str = "dcl", scale: float | None = None, similarity_fct=None,
                 mini_batch_size: int = 32, mini_batch_num_tokens: int | None = None,
                 gather_across_devices: bool = False, directions: tuple[str, ...] = ONE_WAY,
                 partition_mode: str = "joint", show_progress_bar: bool = False, **options: Any):
        super().__init__()
        if has_static_embedding_input(model):
            raise ValueError("CachedMultipleNegativesLoss cannot split a StaticEmbedding model's inputs into "
                             "mini-batches; use MultipleNegativesLoss")
        if not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive integer, got {mini_batch_size!r}")
        _validate_mini_batch_num_tokens(mini_batch_num_tokens)
        self.loss = MultipleNegativesLoss(model, loss, scale, similarity_fct, gather_across_devices, directions,
                                          partition_mode, **options)
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

