"""InfoNCE (the baseline) and EqCo, its margin form that does not depend on the number of negatives."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from contrastkit.losses.base import Backend, ContrastiveLoss, Gather, Reduction, SameLabel
from contrastkit.losses.functional import Terms, _check_temperature, eqco_negatives, supcon_terms


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

    def terms(self, p, l, k, m=None):
        """-p + log(e^p + e^l) = softplus(l - p), and its derivative in l, q_B = sigmoid(l - p), the NPC multiplier
        (DCL paper, Prop. 1), which is the positive's pull too."""
        return _infonce(l - p)

    def label_terms(self, pos_mean, pos_lse, neg_lse, num_neg) -> Terms:
        return supcon_terms(pos_mean, pos_lse, neg_lse, keep_positives=True)


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

    def terms(self, p, l, k, m=None):
        """InfoNCE's with the negatives' lse moved by log(alpha / k) (Eq. 5: the margin on the positive)."""
        shift = torch.log(self.alpha / k.to(l.dtype)) if isinstance(k, torch.Tensor) else math.log(self.alpha / k)
        return _infonce((l - p).add_(shift))

    def label_terms(self, pos_mean, pos_lse, neg_lse, num_neg) -> Terms:
        return supcon_terms(pos_mean, pos_lse, eqco_negatives(neg_lse, self.alpha, num_neg), keep_positives=True)


def _infonce(gap):
    """softplus(gap) and its derivative sigmoid(gap), twice: in the negatives' lse and as the positive's pull.
    softplus past 40 returns gap itself, off by e^-40 = 4e-18: below float64's rounding there (F.softplus's
    default threshold 20 would be off by 2e-9)."""
    q = torch.sigmoid(gap)
    return F.softplus(gap, threshold=40.0), q, q, None
