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
such frames out of the sum (a contribution of 0), and the count is returned as ``dropped``.
"""

from __future__ import annotations

from typing import Callable

import torch

from contrastkit.distributed import gather_no_grad, world
from contrastkit.losses import functional as K

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

    def summed(self, pos: torch.Tensor, neg: torch.Tensor, valid: torch.Tensor, *,
               model_temperature: float) -> tuple[torch.Tensor, int]:
        """(sum over frames of the per-frame loss, number of frames dropped for having no valid distractor)."""
        keep = valid.any(dim=1)
        dropped = int((~keep).sum())
        if dropped:
            pos, neg, valid = pos[keep], neg[keep], valid[keep]
        options = dict(self.options)
        if "temperature" in KERNELS[self.name][1]:
            options.setdefault("temperature", model_temperature)
        if self.name == "dclw" and world()[1] > 1:
            # DCLW's weights are a softmax over the batch's positive pairs: every process's frames
            # (a collective: called on every process, also one with no frame left).
            options["pos_weight"] = K.dclw_weights(pos[:, None], options.get("sigma", 0.5),
                                                   gather_no_grad(pos, uneven=True))[:, 0]  # frames differ
        if pos.shape[0] == 0:  # nothing to contrast: a zero that stays connected to the graph
            return neg.sum() * 0.0, dropped
        return self.kernel(pos, neg, neg_mask=valid, **options).sum(), dropped
