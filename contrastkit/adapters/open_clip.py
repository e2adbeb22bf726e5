"""open_clip adapter: contrastkit objectives as drop-in replacements for open_clip's ClipLoss.

Three ways in:

- ``build_clip_loss("dcl", local_loss=..., gather_with_grad=..., rank=..., world_size=...)``: a module
  called exactly like ``open_clip.ClipLoss`` (image_features, text_features, logit_scale, logit_bias=None,
  output_dict=False), with the same distributed options.
- ``patch("dcl")``: from then on ``open_clip.create_loss(args)`` returns that loss, and on open_clip 4
  ``open_clip.create_task(args, model)`` gives CLIPTask (CLAPTask for audio-text) that loss in place of its
  ClipLoss (also the copies that ``open_clip_train.main`` imported by name), for people who keep their own
  training code; it returns the handle every adapter returns (``undo()``, a ``with`` block).
- ``python -m contrastkit.adapters.open_clip --loss dcl <open_clip_train arguments>``: runs open_clip's own
  trainer with the loss swapped, on GPUs or on several CPU processes (torchrun with gloo).

The learnable logit scale of the CLIP model stands in for 1/temperature (infonce, dcl, dclw, eqco) and
keeps its gradient. CACR has no temperature: its repulsion weights are softmax(-t_neg c) with a fixed
t_neg (Algorithm 3), because a learnable scale there is driven to 0 (uniform weights) by the repulsion
itself; the model's scale stays in the graph with a zero gradient. UniGrad is not offered: it needs a
single embedding space with a stop-gradient or momentum target and a running correlation of it, and
the paper defines no image-text form.

SigLIP is a baseline here, not a contrastkit objective: ``build_siglip_loss`` is open_clip's own SigLipLoss,
built as ``open_clip.create_loss`` builds it for ``--siglip``, and ``SIGLIP_MODEL_OPTIONS`` is the
initialisation open_clip_train gives a model trained with ``--siglip`` (logit scale ln 10, logit bias -10).

Supported open_clip: ``SUPPORTED_OPEN_CLIP``, 3.x (open_clip_train calls ``create_loss``) and 4.x up to 4.2
(open_clip_train calls ``create_task``; tested on the main branch's 4.2.0.dev0 at commit
89fb801f1e6087880e951fc8354b8a2077b79c6d). On 4.x the task calls the loss as ``loss(**model_out,
output_dict=True)`` and sums the keys ending in ``_loss``: the loss returns ``contrastive_loss``, and holds no
state that changes between calls, so ``--torchcompile`` (any ``--torchcompile-strategy``) can trace it.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from contrastkit.adapters import patching
from contrastkit.adapters.patching import Patch
from contrastkit.cli import held_back, key_value
from contrastkit.distributed import gather_no_grad
from contrastkit.losses import build_loss

SUPPORTED_OPEN_CLIP = ((3, 0), (4, 3))  # versions from 3.0 up to, not including, 4.3
TASK_API = (4, 0)  # from here open_clip_train builds a task (create_task) rather than a loss (create_loss)
CLIP_LOSSES = ("infonce", "dcl", "dclw", "eqco", "cacr")
SIGLIP = "siglip"  # open_clip's own sigmoid loss: the baseline the recipe and the suite compare against
# open_clip_train's model options under --siglip (open_clip_train/main.py, 3.3): in place of CLIP's ln(1/0.07)
SIGLIP_MODEL_OPTIONS = {"init_logit_scale": math.log(10), "init_logit_bias": -10.0}
CONFIG_DIR = Path(__file__).parent / "open_clip_configs"  # small model configs that ship with contrastkit
DEFAULT_MODEL = "contrastkit-tiny"  # the recipes' default: 32 px images, open_clip's built-in tokenizer


def register_configs() -> None:
    """Make the model configs that ship with contrastkit (contrastkit-tiny) known to open_clip."""
    import open_clip

    if not {p.stem for p in CONFIG_DIR.glob("*.json")} <= set(open_clip.list_models()):
        open_clip.add_model_config(CONFIG_DIR)


def check_model(name: str) -> None:
    """Raise ValueError unless ``name`` is an open_clip config (contrastkit's included)."""
    import open_clip

    register_configs()
    if name not in open_clip.list_models():
        known = open_clip.list_models()
        raise ValueError(f"unknown open_clip model config {name!r}; e.g. {', '.join(known[:8])}, ... "
                         f"({len(known)} known, see open_clip.list_models())")


def create_clip(name: str, **model_options):
    """(model, preprocess, tokenizer) for an open_clip config name, randomly initialised (no download);
    ``model_options`` go to the model class (e.g. ``nonscalar_logit_scale=True``: FSDP2 shards no scalar)."""
    import open_clip

    check_model(name)
    # open_clip warns that the model got no pretrained weights: the point here (a model trained from scratch)
    from_scratch = f"No pretrained weights loaded for model '{name}'. Model initialized randomly."
    with held_back(logging.getLogger(), lambda message: message == from_scratch):
        model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None, output_dict=True,
                                                                     **model_options)
    return model, preprocess, open_clip.get_tokenizer(name)


def _major_minor(version: str) -> tuple[int, int]:
    import re

    found = re.match(r"(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise RuntimeError(f"open_clip version {version!r} is not a version number")
    return int(found.group(1)), int(found.group(2) or 0)


def check_open_clip_version(version: str | None = None) -> str:
    """The installed open_clip version, or a clear error when it is one this adapter does not support
    (``SUPPORTED_OPEN_CLIP``: >=3.0, <4.3)."""
    if version is None:
        import open_clip

        version = open_clip.__version__
    low, high = SUPPORTED_OPEN_CLIP
    if not low <= _major_minor(version) < high:
        raise RuntimeError(f"contrastkit's open_clip adapter supports open_clip_torch >={low[0]}.{low[1]},"
                           f"<{high[0]}.{high[1]} (3.x through create_loss, 4.0-4.2 through create_task), "
                           f"found {version}")
    return version


def uses_tasks(version: str | None = None) -> bool:
    """Whether this open_clip's trainer builds a task (4.x: ``create_task``) rather than a loss (3.x)."""
    return _major_minor(check_open_clip_version(version)) >= TASK_API


class ContrastkitClipLoss(nn.Module):
    """A contrastkit objective with open_clip ClipLoss's call and distributed options.

    On P processes the four open_clip modes are reproduced: without ``local_loss`` every process computes
    the loss of the whole gathered batch (gathered with gradient, or without it except for its own slice);
    with ``local_loss`` and ``gather_with_grad`` each process computes its own anchors against all
    (contrastkit's ``gather_distributed``, equal to one process on the concatenated batch after DDP's
    averaging); with ``local_loss`` alone the gathered features carry no gradient, as in ClipLoss.
    """

    def __init__(self, name: str, *, local_loss: bool = False, gather_with_grad: bool = False,
                 cache_labels: bool = False, rank: int = 0, world_size: int = 1, use_horovod: bool = False,
                 **loss_options):
        super().__init__()
        if name.lower() == "unigrad":
            raise ValueError("unigrad has no image-text form: it needs one embedding space with a momentum or "
                             f"stop-gradient target; choose one of {', '.join(CLIP_LOSSES)}")
        if name.lower() not in CLIP_LOSSES:
            raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(CLIP_LOSSES)}")
        if use_horovod and world_size > 1:
            raise ValueError("contrastkit's open_clip losses gather with torch.distributed; horovod is not supported")
        self.name = name.lower()
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad
        self.rank, self.world_size = rank, world_size
        # cache_labels is accepted for ClipLoss compatibility: there are no labels to cache here.
        self.loss = build_loss(self.name, gather_distributed=world_size > 1 and local_loss, **loss_options)

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale,
                logit_bias=None, output_dict: bool = False, sample_ids: torch.Tensor | None = None):
        """open_clip's ClipLoss call. ``sample_ids`` [N] (optional, an integer per pair, gathered with the
        features in every mode): pairs that share one (duplicates: one image with several captions, one
        caption twice) are not each other's negatives, or with ``same_label="positive"`` among the loss
        options are each other's positives (see the loss core's ContrastiveLoss)."""
        # A constant bias added to every logit cancels in the softmax-form losses (as it does in ClipLoss);
        # CACR ignores the scale (see the module docstring). Both stay in the graph so DDP sees them used.
        unused = 0.0
        if logit_bias is not None and isinstance(logit_bias, torch.Tensor):
            unused = unused + 0.0 * logit_bias.sum()
        scale = logit_scale
        if self.name == "cacr":
            if isinstance(logit_scale, torch.Tensor):
                unused = unused + 0.0 * logit_scale.sum()
            scale = None
        elif isinstance(scale, torch.Tensor) and scale.numel() != 1:
            raise ValueError(f"{self.name}: logit_scale must be a scalar, got shape {tuple(scale.shape)}")

        if self.world_size > 1 and not self.local_loss:
            from open_clip.loss import gather_features

            image_features, text_features = gather_features(
                image_features, text_features, local_loss=False, gather_with_grad=self.gather_with_grad,
                rank=self.rank, world_size=self.world_size)
            ids = None if sample_ids is None else gather_no_grad(sample_ids)  # in rank order, as the features
            loss = self.loss.cross_modal(image_features, text_features, logit_scale=scale, labels=ids)
        elif self.world_size > 1 and not self.gather_with_grad:
            loss = self._local_loss_detached(image_features, text_features, scale, sample_ids)
        else:
            loss = self.loss.cross_modal(image_features, text_features, logit_scale=scale, labels=sample_ids)
        loss = loss + unused
        return {"contrastive_loss": loss} if output_dict else loss

    def _local_loss_detached(self, image: torch.Tensor, text: torch.Tensor, scale,
                             sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """open_clip's local_loss without gather_with_grad: this process's anchors against every process's
        features, the gathered features (its own included) detached."""
        from open_clip.loss import gather_features

        from contrastkit.losses.base import check_features, check_labels, check_logit_scale, label_ids
        from contrastkit.losses.plan import host_checks_allowed
        from contrastkit.losses.functional import normalize_rows

        # values where host reads are free only: on CUDA a non-finite feature shows as a non-finite loss
        check_features(self.name, {"image": image, "text": text}, values=host_checks_allowed(image))
        if scale is not None:
            check_logit_scale(self.name, scale)
        ids = None
        if sample_ids is not None:
            check_labels(self.name, sample_ids, image.shape[0], image.device, "sample_ids")
            ids = label_ids(sample_ids, gather_no_grad(sample_ids))
        all_image, all_text = gather_features(image, text, local_loss=True, gather_with_grad=False,
                                              rank=self.rank, world_size=self.world_size)
        if scale is None:
            scale = self.loss.default_logit_scale()
        dtype = torch.float64 if image.dtype == torch.float64 else torch.float32
        with torch.autocast(image.device.type, enabled=False):
            a, b = (normalize_rows(x.to(dtype)) for x in (image, text))
            all_a, all_b = (normalize_rows(x.to(dtype)) for x in (all_image, all_text))
            if isinstance(scale, torch.Tensor):
                scale = scale.to(dtype)
            n, total = a.shape[0], all_a.shape[0]
            cols = self.rank * n + torch.arange(n, device=a.device)  # ClipLoss's labels: equal batches everywhere
            terms = []
            for anchor, others in ((a, all_b), (b, all_a)):
                pos = (anchor * others[cols]).sum(-1, keepdim=True)
                terms.append(self.loss.negative_terms(pos, anchor, others, cols[:, None], total - 1, scale, 2 * n,
                                                      labels=ids))
            return torch.cat([t.loss for t in terms]).mean()


def build_siglip_loss(*, rank: int = 0, world_size: int = 1, dist_impl: str | None = None, **unknown):
    """open_clip's SigLipLoss, unchanged, with the arguments ``open_clip.create_loss(args)`` gives it under
    ``--siglip`` (rank, world_size, dist_impl from --loss-dist-impl: bidir, shift, reduce or gather). Its call
    needs the model's ``logit_bias``: create the model with ``SIGLIP_MODEL_OPTIONS``. Built directly rather
    than through ``create_loss``, which ``patch`` may have replaced."""
    from open_clip.loss import SigLipLoss

    if unknown:
        raise ValueError(f"siglip (open_clip's SigLipLoss) takes only the option dist_impl, got {sorted(unknown)}")
    if dist_impl not in (None, "bidir", "shift", "reduce", "gather"):
        raise ValueError(f"siglip: dist_impl must be one of bidir, shift, reduce, gather; got {dist_impl!r}")
    return SigLipLoss(rank=rank, world_size=world_size, dist_impl=dist_impl)


def build_clip_loss(name: str, **options) -> ContrastkitClipLoss:
    """A ClipLoss-compatible contrastkit loss: ``name`` one of infonce, dcl, dclw, eqco, cacr; options are
    open_clip's (local_loss, gather_with_grad, cache_labels, rank, world_size, use_horovod) and the loss's
    own (temperature for the fixed-scale use, sigma, alpha, t_pos, t_neg)."""
    return ContrastkitClipLoss(name, **options)


def _other_training(args) -> str | None:
    """What an open_clip_train run trains instead of plain CLIP (the patch replaces ClipLoss only), or None."""
    model = str(getattr(args, "model", "")).lower()
    if getattr(args, "distill", False):
        return "distillation"
    if getattr(args, "siglip", False):
        return "SigLIP"
    return next((kind for kind in ("CoCa", "GenLIP", "GenLAP") if kind.lower() in model), None)


def patch(name: str = "dcl", **loss_options) -> Patch:
    """Make ``open_clip.create_loss(args)`` return the contrastkit loss ``name`` built from args' distributed
    options, and on open_clip 4 ``open_clip.create_task(args, model)`` put that loss in the CLIPTask (or, for a
    CLAP model, CLAPTask) it builds (also in ``open_clip_train.main``, which imported them by name). Returns
    the handle of every adapter (adapters/patching.py): ``undo()``, or a ``with`` block; ``active_objective()``
    tells the loss.

    Only plain CLIP (and CLAP) training is patched: CoCa, GenLIP, distillation and SigLIP runs get a clear error.
    """
    tasks = uses_tasks()
    import open_clip
    import open_clip.factory

    objective = build_clip_loss(name, **loss_options)  # fail now on a bad name or option, not at the first step

    def refuse_other(args):
        other = _other_training(args)
        if other is not None:
            raise ValueError(f"contrastkit --loss {name} replaces ClipLoss only; this run uses {other}")

    def loss_for(args, where: str):
        loss = build_clip_loss(name, local_loss=args.local_loss, gather_with_grad=args.gather_with_grad,
                               cache_labels=True, rank=args.rank, world_size=args.world_size,
                               use_horovod=getattr(args, "horovod", False), **loss_options)
        logging.info(f"contrastkit loss {name} replaces open_clip's ClipLoss{where} (local_loss={args.local_loss}, "
                     f"gather_with_grad={args.gather_with_grad}, options {loss_options})")
        return loss

    def create_loss(args):
        refuse_other(args)
        return loss_for(args, "")

    modules = [open_clip, open_clip.factory]
    for m in modules:  # an earlier patch's functions are not the originals
        patching.remove(m)
    replacements = {"create_loss": create_loss}
    if tasks:
        original_create_task = open_clip.factory.create_task

        def create_task(args, model, *more, **options):
            refuse_other(args)
            task = original_create_task(args, model, *more, **options)
            from open_clip.task import CLAPTask, CLIPTask

            if type(task) not in (CLIPTask, CLAPTask):
                raise ValueError(f"contrastkit --loss {name} replaces the ClipLoss of CLIPTask and CLAPTask only; "
                                 f"this run's task is {type(task).__name__}")
            task.loss = loss_for(args, f" in {type(task).__name__}")  # built by the task, never called
            return task

        replacements["create_task"] = create_task
    if "open_clip_train.main" in sys.modules:
        modules.append(sys.modules["open_clip_train.main"])
    handle = Patch(objective)
    for m in modules:
        patching.replace_attributes(handle, m, {k: v for k, v in replacements.items() if hasattr(m, k)})
    return handle


def active_objective() -> ContrastkitClipLoss | None:
    """The loss (a ContrastkitClipLoss of the patch's name and options) ``open_clip.create_loss`` builds
    under a patch, or None."""
    import open_clip

    return patching.active_objective(open_clip)


@contextmanager
def cpu_ddp():
    """Let open_clip_train wrap the model in DDP on CPU: it passes ``device_ids=[cpu device]``, which torch
    rejects for CPU modules; drop device_ids when they are all CPU devices."""
    original = torch.nn.parallel.DistributedDataParallel

    class DistributedDataParallel(original):
        def __init__(self, module, device_ids=None, *args, **kwargs):
            if device_ids is not None and all(torch.device(d).type == "cpu" for d in device_ids):
                device_ids = None
            super().__init__(module, device_ids, *args, **kwargs)

    torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
    try:
        yield
    finally:
        torch.nn.parallel.DistributedDataParallel = original


def main(argv: list[str] | None = None):
    """``python -m contrastkit.adapters.open_clip --loss dcl [--loss-option sigma=0.5] <open_clip_train args>``"""
    parser = argparse.ArgumentParser(
        prog="python -m contrastkit.adapters.open_clip",
        description="Run open_clip_train with a contrastkit loss; all other arguments go to open_clip_train.")
    parser.add_argument("--loss", required=True, help=f"one of {', '.join(CLIP_LOSSES)}")
    parser.add_argument("--loss-option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="a loss option, typed (int, float, bool or str), e.g. sigma=0.5 (dclw), alpha=256 "
                             "(eqco), t_neg=2 (cacr), backend=torch")
    ours, rest = parser.parse_known_args(argv)
    check_open_clip_version()
    import open_clip_train.main

    register_configs()  # contrastkit's small configs (contrastkit-tiny) join open_clip's
    with patch(ours.loss, **dict(ours.loss_option)), cpu_ddp():
        return open_clip_train.main.main(rest)


if __name__ == "__main__":
    sys.exit(main() or 0)
