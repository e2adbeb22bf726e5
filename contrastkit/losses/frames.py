"""The wav2vec 2.0 contrastive term (wav2vec 2.0 paper, Eq. 3) with any objective's per-anchor formula (its
``logit_terms``, the form every setting of the loss core takes): each masked frame against its own sampled
distractors.

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

import inspect

import torch

from contrastkit.distributed import gather_no_grad
from contrastkit.losses.base import ContrastiveLoss
from contrastkit.losses.dcl import DCLWLoss
from contrastkit.losses.dense import score_loss
from contrastkit.losses.functional import _compute_dtype
from contrastkit.losses.registry import LOSSES, _key


def frame_losses() -> list[str]:
    """The objectives that score frames: every registered one written as a per-anchor formula (a ``formula``,
    ``terms`` or ``logit_terms``: not UniGrad, which needs whole features), whose positives carry no weight or
    DCLW's (taken over the kept frames: frame_weights)."""
    base = ContrastiveLoss
    return [name for name, cls in LOSSES.items() if issubclass(cls, base)
            and (cls.formula, cls.terms, cls.logit_terms) != (base.formula, base.terms, base.logit_terms)
            and (cls.positive_weight is base.positive_weight or issubclass(cls, DCLWLoss))]


def _options(name: str) -> list[str]:
    """The objective's own options (temperature, sigma, alpha, t_pos, ...), not the settings every objective
    takes (gather_distributed, backend, ...: frames have none of them)."""
    shared = inspect.signature(ContrastiveLoss).parameters
    return [k for k, p in inspect.signature(LOSSES[name]).parameters.items()
            if k not in shared and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


class FrameObjective:
    """One objective with its options, applied to wav2vec 2.0 frame scores: the objective's own per-anchor
    formula (its ``logit_terms``, as every other setting takes it), so an objective registered with
    register_loss scores frames too.

    temperature=None (the default) means the model's own (HF ``contrastive_logits_temperature``, fairseq2
    ``logit_temp``), so that ``infonce`` reproduces the model's loss.
    """

    def __init__(self, loss: str = "dcl", **options):
        try:
            name = _key(loss)
        except ValueError:
            name = None
        if name is None or name not in frame_losses():
            hint = (" (UniGrad has no distractor form: it needs whole-feature targets, not frame scores)"
                    if str(loss).lower() == "unigrad" else "")
            raise ValueError(f"wav2vec 2.0 adapter: unsupported loss {loss!r}{hint}; choose one of "
                             f"{', '.join(frame_losses())}")
        unknown = sorted(set(options) - set(_options(name)))
        if unknown:
            raise ValueError(f"wav2vec 2.0 adapter: loss {name!r} takes options {_options(name)}, got unknown {unknown}")
        self.name, self.options = name, dict(options)
        self._objectives: dict[float, ContrastiveLoss] = {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"FrameObjective({self.name!r}{', ' + opts if opts else ''})"

    def objective(self, model_temperature: float) -> ContrastiveLoss:
        """The objective, at the model's temperature where it takes one and none was given (one per temperature:
        a Module built once, not per step)."""
        found = self._objectives.get(model_temperature)
        if found is None:
            options = dict(self.options)
            takes = "temperature" in inspect.signature(LOSSES[self.name]).parameters
            if takes and options.get("temperature") is None:
                options["temperature"] = model_temperature
            made = LOSSES[self.name](**options)
            assert isinstance(made, ContrastiveLoss)  # frame_losses() holds ContrastiveLoss's subclasses only
            found = self._objectives[model_temperature] = made
        return found

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
        objective = self.objective(model_temperature)
        scale, terms, num_neg = self._formula(objective, pos, valid, keep)
        per_frame = score_loss(pos, neg, valid, scale, terms=terms, num_neg=num_neg, with_mean=objective.needs_mean)
        return torch.where(keep, per_frame, 0.0).sum(), dropped

    def _formula(self, objective, pos, valid, keep):
        """(the logits' scale, the objective's per-frame formula with its partial derivatives, the negatives'
        count per frame): the objective's logit_terms, DCLW's positives' weights over the kept frames of every
        process (frame_weights)."""
        num_neg = valid.sum(dim=1, dtype=_compute_dtype(pos)).clamp_min_(1.0)
        if type(objective).positive_weight is ContrastiveLoss.positive_weight:
            return objective.default_logit_scale(), objective.logit_terms, num_neg
        # a collective: every process calls it, one with no frame left too
        weight = frame_weights(pos, keep, objective.sigma)

        def terms(p, lse, mean, scale, k):
            return objective.logit_terms(p, lse, mean, scale, k, weight=weight)

        return objective.default_logit_scale(), terms, num_neg


def frame_weights(pos: torch.Tensor, keep: torch.Tensor, sigma: float) -> torch.Tensor:
    """DCLW's weights (functional.dclw_weights) over the kept frames of every process: w = 2 - n softmax(pos /
    sigma), n and the softmax over the frames where ``keep`` [M] holds; 1 elsewhere (those frames count 0).
    Processes hold different numbers of frames: the rows are gathered as (scaled cosine, kept) pairs, their
    sizes exchanged between the hosts, so nothing is read from the device."""
    scaled = (pos.detach() / sigma).masked_fill(~keep, float("-inf"))
    rows = gather_no_grad(torch.stack([scaled, keep.to(scaled.dtype)], dim=1), uneven=True)
    weights = 2.0 - rows[:, 1].sum() * torch.exp(scaled - torch.logsumexp(rows[:, 0], dim=0))
    return torch.where(keep, weights, 1.0)
