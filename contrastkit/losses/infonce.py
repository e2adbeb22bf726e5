"""InfoNCE (the baseline) and EqCo, its margin form that does not depend on the number of negatives."""

from __future__ import annotations

import math

import torch

from contrastkit.losses.base import Backend, ContrastiveLoss, Gather, Reduction, SameLabel
from contrastkit.losses.functional import (LogitTerms, Terms, _check_temperature, eqco_negatives, softmax_logit_terms,
                                           softmax_terms, supcon_terms)


class InfoNCELoss(ContrastiveLoss):
    """InfoNCE / NT-Xent (SimCLR; DCL paper, Eq. 1): -s_p / tau + log(e^{s_p/tau} + sum_k e^{s_k/tau}).

    Default temperature 0.1.

    >>> loss_fn = InfoNCELoss(temperature=0.1)
    >>> loss = loss_fn(torch.randn(32, 128), torch.randn(32, 128))
    """

    name = "infonce"

    def __init__(self, temperature: float = 0.1, *, normalize: bool = True, gather_distributed: Gather = False,
                 chunk_size: int | None = None, backend: Backend = "auto", reduction: Reduction = "mean",
                 same_label: SameLabel = "mask"):
        super().__init__(normalize=normalize, gather_distributed=gather_distributed, chunk_size=chunk_size,
                         backend=backend, reduction=reduction, same_label=same_label)
        _check_temperature(self.name, temperature)
        self.temperature = temperature

    def default_logit_scale(self) -> float:
        return 1.0 / self.temperature

    def stat_terms(self, pos, neg_lse, neg_mean, num_neg, scale) -> Terms:
        return softmax_terms(pos * scale, neg_lse, keep_positive=True)

    def label_terms(self, pos_mean, pos_lse, neg_lse, num_neg) -> Terms:
        return supcon_terms(pos_mean, pos_lse, neg_lse, keep_positives=True)

    def logit_terms(self, pos, neg_lse, neg_mean, scale, num_neg) -> LogitTerms:
        return softmax_logit_terms(pos, neg_lse, keep_positive=True)

    def stat_grad(self, pos, neg_lse, neg_mean, num_neg, scale):
        # sigmoid(lse - s_p), the NPC multiplier q_B (DCL paper, Prop. 1), as autograd computes it through
        # the loss's softplus, to the bit, so that backward's check can be tight.
        with torch.enable_grad():
            lse = neg_lse.detach().requires_grad_()
            loss = self.stat_terms(pos.detach(), lse, None, num_neg, scale).loss.sum()
            return torch.autograd.grad(loss, lse)[0][None]


class EqCoLoss(InfoNCELoss):
    """EqCo (Zhu et al., Eq. 1 and 5): InfoNCE with the margin m = tau log(alpha / K) on the positive.

    K is the number of negatives each anchor actually uses (2N - 2 in the two-view setting, the queue
    length with a queue); with alpha = K this is InfoNCE exactly. Defaults: temperature 0.1, alpha 256
    (the paper's SimCLR setting; it uses 65536 for MoCo).

    >>> loss_fn = EqCoLoss(temperature=0.1, alpha=256)
    >>> loss = loss_fn(torch.randn(16, 128), torch.randn(16, 128))  # 30 negatives, behaves like 256
    """

    name = "eqco"

    def __init__(self, temperature: float = 0.1, alpha: float = 256.0, *, normalize: bool = True, gather_distributed: Gather = False,
                 chunk_size: int | None = None, backend: Backend = "auto", reduction: Reduction = "mean",
                 same_label: SameLabel = "mask"):
        super().__init__(temperature, normalize=normalize, gather_distributed=gather_distributed, chunk_size=chunk_size,
                         backend=backend, reduction=reduction, same_label=same_label)
        _check_temperature(self.name, alpha, "alpha")
        self.alpha = alpha

    def stat_terms(self, pos, neg_lse, neg_mean, num_neg, scale) -> Terms:
        return softmax_terms(pos * scale, eqco_negatives(neg_lse, self.alpha, num_neg), keep_positive=True)

    def label_terms(self, pos_mean, pos_lse, neg_lse, num_neg) -> Terms:
        return supcon_terms(pos_mean, pos_lse, eqco_negatives(neg_lse, self.alpha, num_neg), keep_positives=True)

    def logit_terms(self, pos, neg_lse, neg_mean, scale, num_neg) -> LogitTerms:
        return softmax_logit_terms(pos, neg_lse, keep_positive=True, shift=math.log(self.alpha / num_neg))
