"""Contrastive attraction and contrastive repulsion (CACR, Zheng et al., TMLR 2023)."""

from __future__ import annotations

import torch

from contrastkit.losses.base import Backend, ContrastiveLoss, Gather, Reduction, SameLabel
from contrastkit.losses.functional import (LogitTerms, Terms, _check_temperature, cacr_logit_terms,
                                           cacr_positive_stat_terms, cacr_stat_terms)


class CACRLoss(ContrastiveLoss):
    """CACR (Sec. 3.2, Algorithm 3): within the positives, attraction weighted by softmax(t_pos c)
    (detached), so distant positives pull harder; within the negatives, repulsion weighted by
    softmax(-t_neg c) (with gradient), so close negatives push harder; c = squared Euclidean distance
    between unit vectors. No temperature. Defaults: t_pos 1.0, t_neg 2.0 (Algorithm 3).

    Several views per sample (``loss_fn(z1, z2, z3, z4)``) give each anchor several positives to weigh.

    ``labels`` with same_label="positive" (see ContrastiveLoss): an anchor's positives P(i) are its own
    sample's and every candidate of its label, its negatives N(i) the candidates of the other labels: Eq. 5's
    empirical p(x+ | x) uniform over P(i) (not the K views alone), p(x-) over N(i), in Eq. 3 and 4's
    conditional distributions, as in Sec. 3.2's mini-batch loss:

        l_i = sum_{p in P(i)} softmax_P(t_pos c)_p c_p  -  sum_{n in N(i)} softmax_N(-t_neg c)_n c_n

    the attraction's weights detached, so the label's distant samples pull hardest. The repulsion is
    "mask"'s; with every label distinct the loss is the one without labels (several views included). The
    attraction takes one more pass of the kernel, over each anchor's same-label candidates at the scale
    -2 t_pos (see _label_positive_terms).

    >>> loss_fn = CACRLoss(t_pos=1.0, t_neg=2.0)
    >>> loss = loss_fn(torch.randn(32, 128), torch.randn(32, 128), torch.randn(32, 128))
    """

    name = "cacr"
    needs_mean = True

    def __init__(self, t_pos: float = 1.0, t_neg: float = 2.0, *, normalize: bool = True, gather_distributed: Gather = False,
                 chunk_size: int | None = None, backend: Backend = "auto", reduction: Reduction = "mean",
                 same_label: SameLabel = "mask"):
        super().__init__(normalize=normalize, gather_distributed=gather_distributed, chunk_size=chunk_size,
                         backend=backend, reduction=reduction, same_label=same_label)
        _check_temperature(self.name, t_pos, "t_pos")
        _check_temperature(self.name, t_neg, "t_neg")
        self.t_pos, self.t_neg = t_pos, t_neg

    def default_logit_scale(self) -> float:
        return 2.0 * self.t_neg  # softmax(-t_neg (2 - 2 s)) = softmax(2 t_neg s)

    def stat_terms(self, pos, neg_lse, neg_mean, num_neg, scale, diagnostics=True) -> Terms:
        return cacr_stat_terms(pos, neg_mean, t_pos=self.t_pos)  # its diagnostics: its loss's two parts

    def stat_grad(self, pos, neg_lse, neg_mean, num_neg, scale):
        return torch.stack([torch.zeros_like(neg_mean), torch.full_like(neg_mean, 2.0)])  # repulsion 2 mean - 2

    def logit_terms(self, pos, neg_lse, neg_mean, scale, num_neg, weight=None) -> LogitTerms:
        return cacr_logit_terms(pos, neg_mean, scale)

    def _label_positive_terms(self, plan, stats, pos, anchors, candidates, exclude, num_neg, same, scale,
                              labels, itself, raw) -> Terms:
        """same_label="positive": the repulsion from the negatives' mean over the other labels (``stats``), the
        attraction from the positives' lse and mean at the scale -2 t_pos, whose softmax is softmax(t_pos c)."""
        pos_scale = -2.0 * self.t_pos
        pos_lse, pos_mean = self._positive_stats(plan, pos, anchors, candidates, exclude, pos_scale, labels,
                                                 itself, raw)
        return cacr_positive_stat_terms(pos_lse, pos_mean, stats[1], pos_scale=pos_scale)

    def _diagnostics(self, terms):
        return {"attraction": terms.pos_term, "repulsion": terms.neg_term}
