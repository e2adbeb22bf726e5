"""Hugging Face wav2vec 2.0 pre-training with any contrastkit objective in place of its InfoNCE.

>>> from contrastkit.adapters import hf_wav2vec2
>>> handle = hf_wav2vec2.patch(model, loss="dcl")     # a model instance, a class, or None for all
>>> out = model(input_values, mask_time_indices=m, sampled_negative_indices=n)   # out.loss uses DCL
>>> handle.undo()                                      # or: with hf_wav2vec2.patch(...): ...

The returned handle is the ``Patch`` of every adapter (adapters/patching.py).

What changes: the contrastive term L_m (wav2vec 2.0 paper, Eq. 3) of ``Wav2Vec2ForPreTraining`` and
``Wav2Vec2ConformerForPreTraining``. The patched forward runs the model's own forward and recomputes
L_m from its outputs with the same scores the model uses: cosine similarity (in float32) of each masked
frame's projected context vector with its projected quantised target and with the distractors picked by
``sampled_negative_indices``, a distractor equal to the target masked out; the temperature is
``config.contrastive_logits_temperature`` unless given. The sum over masked frames (``reduction="sum"``)
and ``loss = L_m + config.diversity_loss_weight * L_d`` are kept, so scripts that divide by the number
of masked frames stay right; the output is the model's own output type (or its tuple).

A masked frame whose distractors all equal its target has no valid negative: the model's InfoNCE
gives it 0 and every objective here leaves it out of the sum (also 0); see FrameObjective.

Without ``sampled_negative_indices`` the model computes no loss and the patched forward changes nothing.
"""

from __future__ import annotations

import importlib

import torch

from contrastkit.adapters import patching
from contrastkit.adapters.patching import Patch
from contrastkit.losses.frames import FrameObjective

SUPPORTED = (
    ("transformers.models.wav2vec2.modeling_wav2vec2", "Wav2Vec2ForPreTraining"),
    ("transformers.models.wav2vec2_conformer.modeling_wav2vec2_conformer", "Wav2Vec2ConformerForPreTraining"),
)


def supported_classes() -> list[type]:
    """The model classes ``patch(None)`` patches (those this transformers version has)."""
    found = []
    for module, name in SUPPORTED:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    if not found:
        raise ImportError("no wav2vec 2.0 pre-training class found: is transformers installed?")
    return found


def patch(target=None, loss: str = "dcl", **options) -> Patch:
    """Make ``target``'s calls use ``loss`` (infonce, dcl, dclw, eqco, cacr) with ``options``
    (temperature, sigma, alpha, t_pos, t_neg) for its contrastive term.

    target: a model instance (or a DDP/accelerate wrapper of one), a model class, or None for every
    supported class. Patching again replaces the objective; the returned handle's ``undo()`` (or
    ``unpatch``) restores the original. The patch sits around the model's call, not in its ``forward``,
    so accelerate's mixed-precision wrapper stays in place in either order (see adapters/patching.py).
    """
    objective = FrameObjective(loss, **options)
    targets = supported_classes() if target is None else [patching.unwrap(target)]
    for t in targets:
        cls = t if isinstance(t, type) else type(t)
        if not any(issubclass(cls, c) for c in supported_classes()):
            raise TypeError(f"hf_wav2vec2.patch: {cls.__name__} is not a wav2vec 2.0 pre-training model; "
                            f"supported: {', '.join(c.__name__ for c in supported_classes())}")
    handle = Patch(objective)
    for t in targets:
        patching.wrap_call(handle, t, _pre, _post(objective))
    return handle


def unpatch(target=None) -> None:
    """Restore ``target`` (instance, class, or None for all supported classes)."""
    for t in supported_classes() if target is None else [patching.unwrap(target)]:
        patching.remove(t)


def active_objective(model) -> FrameObjective | None:
    """The objective ``model`` (or a DDP/accelerate wrapper of it) uses, or None when it is unpatched."""
    return patching.active_objective(model)


def contrastive_scores(projected_states: torch.Tensor, projected_quantized: torch.Tensor,
                       sampled_negative_indices: torch.Tensor, mask_time_indices: torch.Tensor):
    """The model's scores on its masked frames: pos [M], neg [M, K] cosines (float32) and valid [M, K].

    Same construction as ``Wav2Vec2ForPreTraining.forward``: distractors gathered from the flattened
    quantised states by ``sampled_negative_indices``; a distractor equal to the target is invalid. M comes
    from the mask's values (a host read on CUDA): training takes every frame's scores (frame_scores).
    """
    pos, neg, valid = frame_scores(projected_states, projected_quantized, sampled_negative_indices)
    mask = mask_time_indices.bool().reshape(-1)
    return pos[mask], neg[mask], valid[mask]


def frame_scores(projected_states: torch.Tensor, projected_quantized: torch.Tensor,
                 sampled_negative_indices: torch.Tensor):
    """contrastive_scores of every frame, masked or not (B T rows, in the order of ``mask_time_indices.reshape(-1)``,
    as the model scores them): no shape depends on the mask, so no value is read on the host."""
    b, t, h = projected_quantized.shape
    negatives = projected_quantized.reshape(-1, h)[sampled_negative_indices.long().reshape(-1)].view(b * t, -1, h)
    context, target = projected_states.reshape(b * t, h).float(), projected_quantized.reshape(b * t, h)
    pos = torch.cosine_similarity(context, target.float(), dim=-1)
    neg = torch.cosine_similarity(context[:, None], negatives.float(), dim=-1)
    valid = ~(target[:, None] == negatives).all(-1)
    return pos, neg, valid


def _pre(model, args, kwargs):
    """Before a call with sampled_negative_indices: every argument by name, a dict output asked for."""
    arguments = patching.call_arguments(model, args, kwargs)
    negatives = arguments.get("sampled_negative_indices")
    if negatives is None:
        return args, kwargs, None
    mask = arguments.get("mask_time_indices")
    if mask is None:
        raise ValueError("sampled_negative_indices needs mask_time_indices (the frames to contrast)")
    wish = arguments.pop("return_dict", None)
    return (), {**arguments, "return_dict": True}, (wish, negatives, mask)


def _post(objective: FrameObjective):
    def post(model, state, out):
        return_dict, negatives, mask = state
        if return_dict is None:  # the config's default (transformers 5 renamed use_return_dict to return_dict)
            return_dict = getattr(model.config, "return_dict", True)
        pos, neg, valid = frame_scores(out.projected_states, out.projected_quantized_states, negatives)
        frames = mask.to(pos.device, torch.bool, non_blocking=True).reshape(-1)
        contrastive, dropped = objective.summed(pos, neg, valid, frames=frames,
                                                model_temperature=model.config.contrastive_logits_temperature)
        object.__setattr__(model, "_contrastkit_dropped_frames", dropped)
        loss = contrastive + model.config.diversity_loss_weight * out.diversity_loss
        out = type(out)(**{**out, "loss": loss, "contrastive_loss": contrastive})
        if return_dict:
            return out
        extra = tuple(x for x in (out.hidden_states, out.attentions) if x is not None)
        return (loss, out.projected_states, out.projected_quantized_states, out.codevector_perplexity) + extra

    return post
