"""fairseq2 (0.8.1) wav2vec 2.0 pre-training with any contrastkit objective in place of its InfoNCE.

>>> from contrastkit.adapters import fairseq2_wav2vec2
>>> handle = fairseq2_wav2vec2.patch(model, loss="dcl")   # a Wav2Vec2Model, the class, or None
>>> loss, output = model(seqs, seqs_layout)                 # loss.contrastive uses DCL
>>> handle.undo()

What changes: ``Wav2Vec2Model.compute_contrastive_loss(logits)``. Its logits [N, S_masked, 1 + K] are
cosines divided by ``model.logit_temp`` with distractors equal to the target at -inf; the patched method
turns them back into cosines (times ``logit_temp``) and a validity mask, and sums the chosen kernel over
the masked frames, as fairseq2 sums its cross entropy. Diversity loss and feature penalty are untouched.
Frames with no valid distractor contribute 0, as in fairseq2's own InfoNCE (see FrameObjective).

On a CPU: fairseq2's Gumbel quantiser calls ``torch.compile`` inside every forward, which costs minutes of
compilation on a CPU (and recompiles when shapes change). Call ``eager_quantizer(model)`` (what the
recipe does when there is no GPU), or set ``TORCHDYNAMO_DISABLE=1`` before starting Python.
"""

from __future__ import annotations

import functools

import torch

from contrastkit.adapters import patching
from contrastkit.adapters.patching import Patch
from contrastkit.losses.frames import FrameObjective


def model_class():
    from fairseq2.models.wav2vec2 import Wav2Vec2Model

    return Wav2Vec2Model


def patch(target=None, loss: str = "dcl", **options) -> Patch:
    """Make ``target`` (a fairseq2 ``Wav2Vec2Model`` instance or a wrapper of one, the class, or None for
    the class) use ``loss`` (infonce, dcl, dclw, eqco, cacr) with ``options`` for its contrastive term.
    Returns the handle of every adapter (adapters/patching.py): ``undo()``, or a ``with`` block."""
    objective = FrameObjective(loss, **options)
    cls = model_class()
    target = cls if target is None else patching.unwrap(target)
    if not (target is cls or isinstance(target, cls)):
        raise TypeError(f"fairseq2_wav2vec2.patch: expected a fairseq2 Wav2Vec2Model, got {type(target).__name__}")
    method = _contrastive_loss(objective)
    handle = Patch(objective)
    patching.replace_attribute(handle, target, "compute_contrastive_loss",
                               method if target is cls else functools.partial(method, target))
    return handle


def unpatch(target=None) -> None:
    """Restore the original ``compute_contrastive_loss`` of ``target`` (instance, or the class)."""
    patching.remove(model_class() if target is None else patching.unwrap(target))


def active_objective(model) -> FrameObjective | None:
    """The objective ``model`` (or a DDP/accelerate wrapper of it) uses, or None when it is unpatched."""
    return patching.active_objective(model)


def frame_scores(logits: torch.Tensor, logit_temp: float):
    """fairseq2's logits [N, S, 1 + K] -> pos [M], neg [M, K] cosines (float32) and valid [M, K], in the
    frame order of its own loss (S x N)."""
    flat = logits.transpose(0, 1).reshape(-1, logits.shape[-1]).float()
    cos = flat * logit_temp if logit_temp != 1.0 else flat
    valid = torch.isfinite(flat[:, 1:])
    return cos[:, 0], cos[:, 1:].masked_fill(~valid, 0.0), valid


def _contrastive_loss(objective: FrameObjective):
    original = model_class().__dict__["compute_contrastive_loss"]
    original = getattr(original, "__contrastkit_original__", original)

    @functools.wraps(original)
    def compute_contrastive_loss(self, logits: torch.Tensor) -> torch.Tensor:
        pos, neg, valid = frame_scores(logits, self.logit_temp)
        total, dropped = objective.summed(pos, neg, valid, model_temperature=self.logit_temp)
        self._contrastkit_dropped_frames = dropped
        return total

    compute_contrastive_loss.__contrastkit_original__ = original
    return compute_contrastive_loss


def eager_quantizer(model) -> None:
    """Run ``model.quantizer`` without the ``torch.compile`` it calls inside its forward (for CPUs)."""
    quantizer = model.quantizer
    forward = type(quantizer).forward

    def eager_forward(*args, **kwargs):
        with torch._dynamo.config.patch(disable=True):
            return forward(quantizer, *args, **kwargs)

    quantizer.forward = eager_forward
