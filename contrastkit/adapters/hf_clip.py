"""Hugging Face dual encoders (the CLIP family and CLAP) with any contrastkit objective in place of their
InfoNCE.

>>> from contrastkit.adapters import hf_clip
>>> handle = hf_clip.patch(model, loss="dcl")      # a model instance, a class, or None for every class
>>> out = model(input_ids=..., pixel_values=..., return_loss=True)   # out.loss is DCL's
>>> handle.undo()                                   # or: with hf_clip.patch(...): ...

What changes: the loss of a call with ``return_loss=True``. The model runs its own forward without its
loss; the loss is then computed from the output's normalised embeddings with the model's learnable
scale standing in for 1/tau (CLIP paper's t, keeps its gradient):

- CLIP-like models (``SUPPORTED``): the image-text setting of the core, ``cross_modal(image, text,
  logit_scale=exp(t))``: images and texts are anchors, the mean of both directions, as ``clip_loss``.
  ALIGN's scale is 1 / its learnable temperature, and its loss smooths labels by 0.1: that is the
  objective plus the linear term eps * mean_i(l_ii - mean_j l_ij) of the logits l, which is kept for
  every softmax objective (``label_smoothing=0`` drops it; CACR has no logits and never gets it).
- ClapModel: its own loss takes the text rows of the similarity twice, once scaled by exp(logit_scale_t)
  and once by exp(logit_scale_a) (``contrastive_loss(logits_per_audio.t())``), so texts are the anchors
  and audio clips the candidates in both halves; the objective is applied the same way. With
  ``directions="both"`` the second half has audio clips as anchors (``logits_per_audio`` with
  exp(logit_scale_a)), as CLIP and LAION-CLAP train: what zero-shot classification of audio by text
  prompts ranks (a text-anchored loss never asks an audio clip's own transcript to beat the other texts).

``infonce`` is then exactly the model's own loss (values and gradients); dcl, dclw, eqco and cacr are the
core kernels on the same scores. CACR has no temperature: its repulsion weights use a fixed t_neg
(Algorithm 3), the model's scale stays in the graph with a zero gradient, as with ``temperature=`` (a
fixed 1/tau instead of the model's scale).

``gather_with_grad=True``: negatives from every process (gathered with gradient), each process's loss
over its own anchors, so that P processes with DDP's averaging equal one process on the whole batch
(the fix transformers issue #22252 asks for). Without it each process contrasts its local batch, as the
models do. The output is the model's own output type (its tuple with ``return_dict=False``); its logits
stay the model's local ones.

``model(..., return_loss=True, sample_ids=ids)``: an integer per pair (taken off the call before the model
sees it), so that pairs sharing one (one image with several captions, a duplicate) are not each other's
negatives, or with ``same_label="positive"`` among the options are each other's positives (the loss core's
ContrastiveLoss says what each objective does); gathered with the embeddings under ``gather_with_grad``.
Not with a label smoothing (ALIGN's: pass ``label_smoothing=0``).

The sigmoid family (SiglipModel, Siglip2Model) is refused: its loss is a per-pair sigmoid, not a softmax
over candidates.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from contrastkit.adapters import patching
from contrastkit.adapters.patching import Patch
from contrastkit.distributed import gather_no_grad, gather_with_grad
from contrastkit.losses import build_loss
from contrastkit.losses.base import check_labels, label_ids
from contrastkit.losses.functional import _compute_dtype, normalize_rows

CLIP_LOSSES = ("infonce", "dcl", "dclw", "eqco", "cacr")


@dataclass(frozen=True)
class Family:
    """A supported model class: where it lives, its non-text embedding, its label smoothing."""

    module: str
    name: str
    other: str = "image_embeds"
    label_smoothing: float = 0.0


SUPPORTED = (
    Family("transformers.models.clip.modeling_clip", "CLIPModel"),
    Family("transformers.models.vision_text_dual_encoder.modeling_vision_text_dual_encoder",
           "VisionTextDualEncoderModel"),
    Family("transformers.models.metaclip_2.modeling_metaclip_2", "MetaClip2Model"),
    Family("transformers.models.chinese_clip.modeling_chinese_clip", "ChineseCLIPModel"),
    Family("transformers.models.altclip.modeling_altclip", "AltCLIPModel"),
    Family("transformers.models.align.modeling_align", "AlignModel", label_smoothing=0.1),
    Family("transformers.models.clap.modeling_clap", "ClapModel", other="audio_embeds"),
)
REFUSED = {"SiglipModel": "SigLIP", "Siglip2Model": "SigLIP 2"}


@functools.cache
def supported_classes() -> dict[type, Family]:
    """The classes ``patch(None)`` patches (those this transformers version has), with their family."""
    found = {}
    for family in SUPPORTED:
        try:
            found[getattr(importlib.import_module(family.module), family.name)] = family
        except (ImportError, AttributeError):
            pass
    if not found:
        raise ImportError("no Hugging Face dual encoder class found: is transformers installed?")
    return found


def family_of(target) -> Family:
    """The family of a model class or instance, or a clear error for an unsupported one."""
    cls = target if isinstance(target, type) else type(patching.unwrap(target))
    for klass in cls.__mro__:
        if klass.__name__ in REFUSED:
            raise TypeError(f"hf_clip.patch: {cls.__name__} trains with {REFUSED[klass.__name__]}'s pairwise sigmoid "
                            "loss, not a softmax over candidates; contrastkit's objectives do not replace it")
        for supported, family in supported_classes().items():
            if klass is supported:
                return family
    raise TypeError(f"hf_clip.patch: {cls.__name__} is not a supported dual encoder; supported: "
                    f"{', '.join(c.__name__ for c in supported_classes())}")


class ClipObjective:
    """One objective with its options, applied to a dual encoder's embeddings and scale."""

    def __init__(self, loss: str = "dcl", *, gather_with_grad: bool = False, temperature: float | None = None,
                 label_smoothing: float | None = None, directions: str = "model", **options):
        name = loss.lower()
        if directions not in ("model", "both"):
            raise ValueError(f"hf_clip: directions must be 'model' or 'both', got {directions!r}")
        if name not in CLIP_LOSSES:
            hint = (" (UniGrad has no image-text form: it needs one embedding space with a stop-gradient target)"
                    if name == "unigrad" else "")
            raise ValueError(f"hf_clip: unsupported loss {loss!r}{hint}; choose one of {', '.join(CLIP_LOSSES)}")
        if label_smoothing is not None and not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"hf_clip: label_smoothing must be in [0, 1), got {label_smoothing!r}")
        if temperature is not None:
            if name == "cacr":
                raise ValueError("hf_clip: cacr has no temperature (its weights use t_pos and t_neg)")
            options["temperature"] = temperature
        try:
            self.loss = build_loss(name, gather_distributed=gather_with_grad, **options)
        except TypeError as err:
            raise ValueError(f"hf_clip: {err}") from None
        self.name, self.gather_with_grad, self.options = name, gather_with_grad, options
        self.label_smoothing, self.directions = label_smoothing, directions
        self.model_scale = name != "cacr" and temperature is None

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v}" for k, v in self.options.items())
        return f"ClipObjective({self.name!r}{opts}, gather_with_grad={self.gather_with_grad})"

    def __call__(self, model, family: Family, text: torch.Tensor, other: torch.Tensor,
                 sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of one batch: text [N, D] and image (or audio) [N, D] embeddings of ``model``, and the
        pairs' ``sample_ids`` [N] (optional, see the module docstring)."""
        scales = model_scales(model, family)
        unused = sum(0.0 * s for s in scales) if not self.model_scale else 0.0  # in the graph for DDP
        if sample_ids is not None:
            check_labels(f"hf_clip {self.name}", sample_ids, text.shape[0], text.device, "sample_ids")
        if family.name == "ClapModel":
            text_scale, audio_scale = (s if self.model_scale else None for s in scales)
            second = (other, text) if self.directions == "both" else (text, other)
            loss = (self._anchored(text, other, text_scale, sample_ids)
                    + self._anchored(*second, audio_scale, sample_ids)) / 2
        else:
            scale = scales[0] if self.model_scale else None
            loss = self.loss.cross_modal(other, text, logit_scale=scale, labels=sample_ids)
            smoothing = family.label_smoothing if self.label_smoothing is None else self.label_smoothing
            if smoothing and self.name != "cacr" and sample_ids is not None:
                raise ValueError(f"hf_clip: sample_ids with label smoothing ({smoothing}, {family.name}'s) are not "
                                 "supported; pass label_smoothing=0 to patch()")
            if smoothing and self.name != "cacr":
                fixed = self.loss.default_logit_scale() if scale is None else scale
                loss = loss + smoothing * self._smoothing_term(other, text, fixed)
        return loss + unused

    def _units(self, *features: torch.Tensor) -> list[torch.Tensor]:
        dtype = _compute_dtype(*features)
        return [normalize_rows(x.to(dtype)) for x in features]

    def _all(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return gather_with_grad(x) if self.gather_with_grad else (x, 0)

    def _anchored(self, anchors: torch.Tensor, candidates: torch.Tensor, scale,
                  sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One direction: each anchor against every (gathered) candidate, the rows of ``anchors @ candidates.T``."""
        with torch.autocast(anchors.device.type, enabled=False):
            a, b = self._units(anchors, candidates)
            all_b, start = self._all(b)
            if all_b.shape[0] < 2:
                raise ValueError(f"hf_clip {self.name}: a batch of 1 pair has no negatives; use at least 2")
            scale = self.loss.default_logit_scale() if scale is None else scale.to(a.dtype)
            own = (start + torch.arange(a.shape[0], device=a.device))[:, None]
            pos = (a * b).sum(-1, keepdim=True)
            ids = None
            if sample_ids is not None:  # gathered as the candidates
                ids = label_ids(sample_ids, gather_no_grad(sample_ids) if self.gather_with_grad else sample_ids)
            return self.loss.negative_terms(pos, a, all_b, own, all_b.shape[0] - 1, scale, labels=ids).loss.mean()

    def _smoothing_term(self, image: torch.Tensor, text: torch.Tensor, scale) -> torch.Tensor:
        """mean over both directions' anchors of l_ii - mean_j l_ij (l = scale * cosine, j over every
        process's candidates): what label smoothing adds to cross entropy, per unit of eps."""
        with torch.autocast(image.device.type, enabled=False):
            a, b = self._units(image, text)
            mean_a, mean_b = (self._all(x)[0].mean(0) for x in (a, b))
            cross = ((a @ mean_b).mean() + (b @ mean_a).mean()) / 2
            scale = scale.to(a.dtype) if isinstance(scale, torch.Tensor) else scale
            return scale * ((a * b).sum(-1).mean() - cross)


def model_scales(model, family: Family) -> list[torch.Tensor]:
    """The model's learnable logit scale(s), as its forward computes them (CLAP: text's, then audio's)."""
    if family.name == "ClapModel":
        return [model.logit_scale_t.exp(), model.logit_scale_a.exp()]
    if family.name == "AlignModel":
        return [1.0 / model.temperature]
    return [model.logit_scale.exp()]


def _pre(model, args, kwargs):
    """Before a call: one with return_loss runs without the model's loss and returns a dict output; the loss's
    own ``sample_ids`` are taken off the call."""
    kwargs = dict(kwargs)
    sample_ids = kwargs.pop("sample_ids", None)
    arguments = patching.call_arguments(model, args, kwargs)
    if not arguments.get("return_loss"):
        if sample_ids is not None:
            raise ValueError("hf_clip: sample_ids are the loss's: give them with return_loss=True")
        return args, kwargs, None
    wish = arguments.pop("return_dict", None)
    return (), {**arguments, "return_loss": False, "return_dict": True}, (wish, sample_ids)


def _post(objective: ClipObjective):
    def post(model, state, out):
        wish, sample_ids = state
        family = family_of(model)
        loss = objective(model, family, out.text_embeds, out[family.other], sample_ids)
        out = type(out)(**{**out, "loss": loss})
        if wish is None:
            wish = getattr(model.config, "return_dict", True)
        return out if wish else out.to_tuple()

    return post


def patch(target=None, loss: str = "dcl", gather_with_grad: bool = False, **options) -> Patch:
    """Make ``target``'s ``return_loss=True`` calls use ``loss`` (infonce, dcl, dclw, eqco, cacr).

    target: a model instance, a model class, or None for every supported class. options: the loss's own
    (sigma, alpha, t_pos, t_neg, chunk_size), ``temperature`` (a fixed 1/scale instead of the model's),
    ``label_smoothing`` (default: the model's own, 0.1 for ALIGN, else 0) and ``directions`` (ClapModel:
    "model", texts as anchors in both halves as its own loss, or "both", texts then audio clips; the CLIP
    family always has both). Patching again replaces the
    objective; ``handle.undo()`` (or ``unpatch``) restores the model.
    """
    objective = ClipObjective(loss, gather_with_grad=gather_with_grad, **options)
    targets = list(supported_classes()) if target is None else [patching.unwrap(target)]
    for t in targets:
        family_of(t)
    handle = Patch(objective)
    for t in targets:
        patching.wrap_call(handle, t, _pre, _post(objective))
    return handle


def unpatch(target=None) -> None:
    """Restore ``target`` (instance, class, or None for every supported class)."""
    for t in supported_classes() if target is None else [patching.unwrap(target)]:
        patching.remove(t)


def active_objective(model) -> ClipObjective | None:
    """The objective ``model`` (or a DDP/accelerate wrapper of it) uses, or None when it is unpatched."""
    return patching.active_objective(model)
