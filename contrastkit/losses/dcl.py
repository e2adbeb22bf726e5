"""Decoupled contrastive learning: DCL and its weighted form DCLW (Yeh et al., ECCV 2022)."""

from __future__ import annotations

import torch

from contrastkit.distributed import gather_no_grad
from contrastkit.losses.base import Backend, ContrastiveLoss, Gather, Reduction, SameLabel
from contrastkit.losses.functional import Terms, _check_temperature, dclw_weights, supcon_terms


class DCLLoss(ContrastiveLoss):
    """DCL (DCL paper, Prop. 2, Eq. 6): -s_p / tau + log sum_k e^{s_k/tau}, the positive left out of the
    denominator. This removes InfoNCE's negative-positive coupling multiplier q_B from the gradient,
    so small batches learn as efficiently as large ones. Default temperature 0.1.

    Needs at least one negative per anchor: a two-view batch of 1 is an error.

    >>> loss_fn = DCLLoss(temperature=0.1)
    >>> loss = loss_fn(torch.randn(32, 128), torch.randn(32, 128))
    """

    name = "dcl"
    positives_in_denominator = False

    def __init__(self, temperature: float = 0.1, *, normalize: bool = True, gather_distributed: Gather = False,
                 chunk_size: int | None = None, backend: Backend = "auto", reduction: Reduction = "mean",
                 same_label: SameLabel = "mask"):
        super().__init__(normalize=normalize, gather_distributed=gather_distributed, chunk_size=chunk_size,
                         backend=backend, reduction=reduction, same_label=same_label)
        _check_temperature(self.name, temperature)
        self.temperature = temperature

    def default_logit_scale(self) -> float:
        return 1.0 / self.temperature

    def terms(self, p, l, k, m=None):
        """l - p (Eq. 6 per anchor, in logits): its derivative 1 in l, a pull of 1 on the positive."""
        return l - p, 1.0, 1.0, None

    def label_terms(self, pos_mean, pos_lse, neg_lse, num_neg) -> Terms:
        return supcon_terms(pos_mean, pos_lse, neg_lse, keep_positives=False)


class DCLWLoss(DCLLoss):
    """DCLW (DCL paper, Eq. 7): DCL with the positive term weighted by w = 2 - N softmax(s_p / sigma)
    over the batch's positive pairs (all processes' pairs with gather_distributed). The weight is
    detached: a scale that favours hard positives, not a path for gradient. E[w] = 1 and DCLW tends
    to DCL as sigma grows. Defaults: temperature 0.1, sigma 0.5.

    >>> loss_fn = DCLWLoss(temperature=0.1, sigma=0.5)
    >>> loss = loss_fn(torch.randn(32, 128), torch.randn(32, 128))
    """

    name = "dclw"

    def __init__(self, temperature: float = 0.1, sigma: float = 0.5, *, normalize: bool = True, gather_distributed: Gather = False,
                 chunk_size: int | None = None, backend: Backend = "auto", reduction: Reduction = "mean",
                 same_label: SameLabel = "mask"):
        super().__init__(temperature, normalize=normalize, gather_distributed=gather_distributed, chunk_size=chunk_size,
                         backend=backend, reduction=reduction, same_label=same_label)
        _check_temperature(self.name, sigma, "sigma")
        self.sigma = sigma

    def positive_weight(self, pos: torch.Tensor) -> torch.Tensor:
        all_pos = gather_no_grad(pos, uneven=self.uneven) if self.gather_distributed else None
        return dclw_weights(pos, self.sigma, all_pos)
