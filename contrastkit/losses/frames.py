"""The wav2vec 2.0 contrastive term (wav2vec 2.0 paper, Eq. 3) computed by the score-level kernels
(functional.py): each masked frame against its own sampled distractors.

Both adapters (Hugging Face and fairseq2) reduce the model's own scores to the same inputs: for each
masked frame m, the cosine of the context vector with its quantised target (``pos`` [M]), with its
K sampled distractors (``neg`` [M, K]), and which distractors are valid (``valid`` [M, K]: a distractor
equal to the target is masked out, as both frameworks do). ``FrameObjective`` turns them into the
summed loss (the frameworks' ``reduction="sum"``, so that a script's normalisation by the number of
masked frames stays right).

A frame whose distractors are all equal to its target has no valid negative. The models' own
InfoNCE gives it exactly 0 (cross entropy over a single finite logit), so here every objective leaves
such frames out of the sum (a contribution of 0), and the count is returned as ``dropped`` (a 0-dim
tensor: reading it would wait for the device).
"""

from __future__ import annotations

from typing import Callable

import torch

from contrastkit.distributed import gather_no_grad
from contrastkit.losses import functional as K
from contrastkit.losses.dense import score_loss

# name -> (kernel, options it takes besides pos/neg/neg_mask)
KERNELS: dict[str, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {
    "infonce": (K.infonce, ("temperature",)),
    "dcl": (K.dcl, ("temperature",)),
    "dclw": (K.dclw, ("temperature", "sigma")),
    "eqco": (K.eqco, ("temperature", "alpha")),
    "cacr": (K.cacr, ("t_pos", "t_neg")),
}


class FrameObjective:
    """One objective with its options, applied to wav2vec 2.0 frame scores.

    temperature=None means the model's own (HF ``contrastive_logits_temperature``, fairseq2
    ``logit_temp``), so that ``infonce`` reproduces the model's loss.
    """

    def __init__(self, loss: str = "dcl", **options):
        name = loss.lower()
        if name not in KERNELS:
            hint = (" (UniGrad has no distractor form: it needs whole-feature targets, not frame scores)"
                    if name == "unigrad" else "")
            raise ValueError(f"wav2vec 2.0 adapter: unsupported loss {loss!r}{hint}; choose one of {', '.join(KERNELS)}")
        kernel, allowed = KERNELS[name]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"wav2vec 2.0 adapter: loss {name!r} takes options {list(allowed)}, got unknown {unknown}")
        self.name, self.kernel, self.options = name, kernel, dict(options)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"FrameObjective({self.name!r}{', ' + opts if opts else ''})"

    def summed(self, pos: torch.Tensor, neg: torch.Tensor, valid: torch.Tensor, *, model_temperature: float,
               frames: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum over frames of the per-frame loss, number of frames dropped for having no valid distractor, a
        0-dim tensor). ``frames`` [M] bool: the rows that are frames to contrast (default: every row); the others
        count for nothing, not even as dropped (the Hugging Face adapter scores every frame and passes its mask).

        One autograd Function for the per-frame losses (dense.score_loss: the formula and its backward written
        out, as the loss core's dense path), so that a step pays few operators. No value is read on the host and
        no shape depends on values, so a CUDA step never waits for the device: a frame left out keeps its row
        (its lse the excluded logit's, its loss finite) and its loss is replaced by an exact 0, which gives its
        scores no gradient either."""
        has_negative = valid.any(dim=1)
        keep = has_negative if frames is None else has_negative & frames
        dropped = (~has_negative if frames is None else frames & ~has_negative).sum()
        if pos.shape[0] == 0:  # nothing to contrast: a zero that stays connected to the graph
            return neg.sum() * 0.0, dropped
        scale, terms, num_neg = self._formula(pos, valid, keep, model_temperature)
        per_frame = score_loss(pos, neg, valid, scale, terms=terms, num_neg=num_neg, with_mean=self.name == "cacr")
        return torch.where(keep, per_frame, 0.0).sum(), dropped

    def _formula(self, pos, valid, keep, model_temperature):
        """(the logits' scale, the per-frame formula with its partial derivatives, the negatives' count) of this
        objective (functional.softmax_logit_terms, cacr_logit_terms: one positive per frame)."""
        options = self.options
        if self.name == "cacr":  # one positive: its attraction weight is 1, t_pos has nothing to weigh
            return 2.0 * options.get("t_neg", 2.0), _cacr_terms, None
        temperature = options.get("temperature", model_temperature)
        K._check_temperature(self.name, temperature)
        weight, num_neg = None, None
        if self.name == "dclw":  # a collective: called on every process, also one with no frame left
            weight = frame_weights(pos, keep, options.get("sigma", 0.5))
        if self.name == "eqco":
            num_neg = valid.sum(dim=1, dtype=K._compute_dtype(pos)).clamp_min_(1.0)
        keep_positive = self.name in ("infonce", "eqco")
        alpha = options.get("alpha", 256.0)

        def terms(p, lse, mean, scale, k):
            shift = torch.log(alpha / k) if k is not None else 0.0
            return K.softmax_logit_terms(p, lse, keep_positive=keep_positive, shift=shift, pos_weight=weight)

        return 1.0 / temperature, terms, num_neg


def _cacr_terms(pos, lse, mean, scale, num_neg):
    return K.cacr_logit_terms(pos, mean, scale)


def frame_weights(pos: torch.Tensor, keep: torch.Tensor, sigma: float) -> torch.Tensor:
    """DCLW's weights (functional.dclw_weights) over the kept frames of every process: w = 2 - n softmax(pos /
    sigma), n and the softmax over the frames where ``keep`` [M] holds; 1 elsewhere (those frames count 0).
    Processes hold different numbers of frames: the rows are gathered as (scaled cosine, kept) pairs, their
    sizes exchanged between the hosts, so nothing is read from the device."""
    scaled = (pos.detach() / sigma).masked_fill(~keep, float("-inf"))
    rows = gather_no_grad(torch.stack([scaled, keep.to(scaled.dtype)], dim=1), uneven=True)
    weights = 2.0 - rows[:, 1].sum() * torch.exp(scaled - torch.logsumexp(rows[:, 0], dim=0))
    return torch.where(keep, weights, 1.0)
