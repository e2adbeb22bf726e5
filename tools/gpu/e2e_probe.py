"""The harness of tools/gpu/e2e.sh: runs one entry point (a script, or ``-m module``) in this process
and watches the objective inside it (contrastkit's, or the ecosystem's own loss), without changing the product.

    E2E_OUT=run.json E2E_REFERENCE=openclip accelerate launch --mixed_precision bf16 \\
        tools/gpu/e2e_probe.py recipes/clip/train.py --loss dcl --steps 200
    E2E_OUT=st.json E2E_WATCH=mnrl E2E_REFERENCE=mnrl python tools/gpu/e2e_probe.py tests/scripts/st_train.py ...

What it records, written to ``E2E_OUT`` (JSON) when the entry point returns (a process of rank R > 0 writes
``<E2E_OUT without .json>.rankR.json``):

- every training call of the objective (an outermost call with gradients on): its loss and its top-1, kept on
  the device (no host read until the end). Top-1 is the share of anchors (rows, captions, masked frames) whose
  positive scores above every candidate the loss gave it, beside chance (what random scores get: 1 / candidates;
  for wav2vec 2.0 the mean of 1 / (1 + valid distractors), which a collapsed codebook raises): the untrained
  value (the first UNTRAINED_CALLS calls) against the trained one (the last quarter) is a learning criterion
  that reads the same for every objective (tools/gpu/e2e_report.py);
- a CUDA event after every optimizer step (torch's global step hook), so the steady-state step time is the
  GPU's own timeline, the median interval after the first fifth of the steps (evaluations and checkpoints
  fall out as outliers); on the CPU (``--dry-run``) the wall clock;
- with ``E2E_REFERENCE`` set, the objective's share: the last training call replayed alone (forward + backward,
  the same features, under the same autocast), timed with CUDA events, times the calls per step; beside it the
  ecosystem's own InfoNCE on the same features (see REFERENCES). ``none`` (the ecosystem's own runs, and
  several processes, whose objective gathers) replays nothing;
- host synchronisations: from the ``E2E_WARMUP_CALLS``-th training call on (the first ones autotune Triton
  kernels, which synchronise by design), every call of the objective runs under
  ``torch.cuda.set_sync_debug_mode`` (and so does the replay's backward): ``E2E_SYNC=error`` (default) fails the
  run at a sync; ``warn`` counts the ones raised in the calling thread (``host_syncs``, the first message kept);
- peak GPU memory (``torch.cuda.max_memory_allocated``).

``E2E_SHARED_GPU=1``: several processes share the one GPU (LOCAL_RANK 0 in each, before the entry point runs).
``E2E_IMPORT``: a module imported first (the one-import adapters, e.g. contrastkit.adapters.hf_clip_dcl).
``E2E_WATCH``: what counts as the objective (WATCHES): ``core`` (default: contrastkit's loss classes' forward,
query_key and cross_modal, the wav2vec 2.0 frame objective and the Hugging Face dual encoders' ClipObjective),
``mnrl`` (contrastkit's sentence-transformers losses), or an ecosystem's own loss: ``openclip`` (open_clip's
ClipLoss), ``hf_clip`` (transformers' image_text_contrastive_loss of CLIP and the dual encoder),
``hf_wav2vec2`` (Wav2Vec2ForPreTraining's forward, whose loss it is), ``st_mnrl`` (sentence-transformers'
MultipleNegativesRankingLoss and its cached form).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import runpy
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

REPLAYS, REPLAY_WARMUP = 10, 3
UNTRAINED_CALLS = 3  # the first calls' top-1: the model as initialised (a warm-up's first steps barely move it)


class Probe:
    def __init__(self, out: Path, reference: str, warmup_calls: int, sync: str = "error"):
        self.out, self.reference, self.warmup_calls, self.sync = out, reference, warmup_calls, sync
        self.depth = 0
        self.losses: list[torch.Tensor] = []
        self.hits: list[torch.Tensor] = []  # per call: (top-1, chance), on the device
        self.marks: list = []  # CUDA events (or wall-clock seconds on the CPU) after each optimizer step
        self.last = None  # (objective, function, its name, args, kwargs, autocast) of the last training call
        self.device = "cpu"
        self.syncs: list[str] = []  # E2E_SYNC=warn: the synchronisations seen

    # ------------------------------------------------------------------ during the run

    def watch(self, owner, name: str, score) -> None:
        """Wrap ``owner.name`` (a class's method, or a module's function) so that its outermost calls with
        gradients on are recorded; ``score(args, kwargs, out)`` gives the call's (top-1, chance)."""
        original = getattr(owner, name)
        if isinstance(owner, type):
            def call(obj, *args, **kwargs):
                return original(obj, *args, **kwargs)
        else:  # a function: no object
            def call(obj, *args, **kwargs):
                return original(*args, **kwargs)

        @functools.wraps(original)
        def watched(*args, **kwargs):
            obj, args = (args[0], args[1:]) if isinstance(owner, type) else (None, args)
            if self.depth or not torch.is_grad_enabled():
                return call(obj, *args, **kwargs)
            self.device = _device_of(args, kwargs) or self.device
            self.depth += 1
            try:
                with self._no_sync(len(self.losses) >= self.warmup_calls):
                    out = call(obj, *args, **kwargs)
                with torch.no_grad():
                    hit = score(args, kwargs, out)
            finally:
                self.depth -= 1
            self.losses.append(_loss_of(out).detach().float())
            self.hits.append(torch.stack(hit).float())
            self.last = (obj, call, name, _detached(args), _detached(kwargs), _autocast(self.device))
            return out

        setattr(owner, name, watched)

    def mark_step(self, *_):
        if self.device == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    @contextmanager
    def _no_sync(self, check: bool):
        if not (check and self.device == "cuda"):
            yield
            return
        import warnings

        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(self.sync)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                yield
        finally:
            torch.cuda.set_sync_debug_mode(before)
        self.syncs += [str(w.message) for w in seen if "synchroniz" in str(w.message)]

    # ------------------------------------------------------------------ at the end

    def time_alone(self, fns: dict, args, kwargs, autocast) -> dict[str, float]:
        """Median ms of forward + backward of each of ``fns`` on fresh leaves of the saved inputs, in
        interleaved rounds, under the training call's autocast; on CUDA timed with events, and every call
        after the warm-up, its backward included, under sync debug mode. Nested objective calls are
        not recorded (depth)."""
        cuda = self.device == "cuda"
        times: dict[str, list[float]] = {name: [] for name in fns}
        self.depth += 1
        try:
            for i in range(REPLAY_WARMUP + REPLAYS):
                for name, fn in fns.items():
                    a, k = _leaves(args), _leaves(kwargs)
                    amp = torch.autocast(self.device, dtype=autocast) if autocast is not None else nullcontext()
                    if cuda:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                    t0 = time.perf_counter()
                    with self._no_sync(i >= REPLAY_WARMUP):
                        with amp:
                            loss = _loss_of(fn(a, k))
                        loss.backward()
                    if cuda:
                        end.record()
                        end.synchronize()
                        times[name].append(start.elapsed_time(end))
                    else:
                        times[name].append(1e3 * (time.perf_counter() - t0))
        finally:
            self.depth -= 1
        return {name: statistics.median(t[REPLAY_WARMUP:]) for name, t in times.items()}

    def summary(self) -> dict:
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        result: dict = {"device": self.device, "calls": len(self.losses), "steps": len(self.marks),
                        "reference": self.reference}
        if cuda:
            result["peak_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            result["device_name"] = torch.cuda.get_device_name()
            result["host_syncs"] = len(self.syncs)
            if self.syncs:
                result["first_sync"] = self.syncs[0]
        losses = torch.stack(self.losses).tolist() if self.losses else []
        result["losses"] = losses
        hits = torch.stack(self.hits).tolist() if self.hits else []
        result["top1"], result["chance"] = [h[0] for h in hits], [h[1] for h in hits]
        if len(losses) >= 4:
            q = len(losses) // 4
            result.update(loss_first=statistics.fmean(losses[:q]), loss_last=statistics.fmean(losses[-q:]))
        if len(hits) >= max(4, 2 * UNTRAINED_CALLS):
            first, last = hits[:UNTRAINED_CALLS], hits[-(len(hits) // 4):]
            result.update(top1_untrained=statistics.fmean(h[0] for h in first),
                          chance_untrained=statistics.fmean(h[1] for h in first),
                          top1_trained=statistics.fmean(h[0] for h in last),
                          chance_trained=statistics.fmean(h[1] for h in last))
        intervals = [_elapsed_ms(a, b) for a, b in zip(self.marks, self.marks[1:])]
        steady = intervals[len(intervals) // 5:]
        if steady:
            result["step_ms"] = statistics.median(steady)
        if self.last is not None and result["steps"] and self.reference != "none":
            per_step = len(self.losses) / result["steps"]
            obj, call, name, args, kwargs, autocast = self.last
            result["calls_per_step"] = per_step
            fns = {"objective_ms": lambda a, k: call(obj, *a, **k), "infonce_ms": REFERENCES[self.reference](obj, name)}
            for name, ms in self.time_alone(fns, args, kwargs, autocast).items():
                result[name] = per_step * ms
        return result

    def write(self, rank: int = 0) -> None:
        out = self.out if rank == 0 else self.out.with_suffix(f".rank{rank}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.summary(), indent=1) + "\n")


def _device_of(args, kwargs) -> str | None:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.device.type
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
            return x[0].device.type
    return None


def _loss_of(out) -> torch.Tensor:
    if isinstance(out, dict):  # a model's output, or open_clip's output_dict: {"contrastive_loss": ...}
        return out["loss"] if "loss" in out else sum(v for k, v in out.items() if k.endswith("_loss"))
    if isinstance(out, tuple):  # FrameObjective.summed: (loss, dropped)
        return out[0]
    return out


class _Saved:
    """A tensor of the call without its graph (the step's own features, kept by reference) and whether it
    needed a gradient (features do; a MoCo queue does not)."""

    def __init__(self, x: torch.Tensor):
        self.tensor, self.grad = x.detach(), x.requires_grad


def _detached(x):
    if isinstance(x, torch.Tensor):
        return _Saved(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def _leaves(x):
    """Fresh leaves of the saved tensors, needing a gradient where the originals did."""
    if isinstance(x, _Saved):
        return x.tensor.detach().requires_grad_(x.grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_leaves(v) for v in x)
    if isinstance(x, dict):
        return {k: _leaves(v) for k, v in x.items()}
    return x


def _autocast(device: str):
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def _elapsed_ms(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else 1e3 * (b - a)


# ---------------------------------------------------------------------- the ecosystems' own InfoNCE

def _contrastkit_infonce(obj, method: str):
    """The recipe's own --loss infonce: contrastkit's InfoNCE with the objective's temperature, normalisation
    and backend, called the same way (two views, query_key or cross_modal)."""
    from contrastkit.losses import build_loss

    options = {"normalize": getattr(obj, "normalize", True), "backend": getattr(obj, "backend", "auto")}
    if getattr(obj, "temperature", None) is not None:
        options["temperature"] = obj.temperature
    infonce = build_loss("infonce", **options)
    return lambda a, k: getattr(infonce, method)(*a, **k)


def _open_clip(obj, method: str):
    """open_clip's ClipLoss (one process) on the features and logit scale the adapter was given."""
    from open_clip.loss import ClipLoss

    loss = ClipLoss()
    return lambda a, k: loss(a[0], a[1], k.get("logit_scale", a[2] if len(a) > 2 else None))


def _hf_clip(obj, method: str):
    """The dual encoder's own loss as transformers computes it (the adapter's call: model, family, text, other
    embeddings): logits_per_text = scale t o^T of the normalised embeddings, cross-entropy both ways, ClapModel
    with its text and audio scales (contrastive_loss, the function every CLIP family shares)."""
    from transformers.models.clip.modeling_clip import contrastive_loss

    from contrastkit.adapters.hf_clip import model_scales

    def loss(a, k):
        model, family, text, other = a[:4]  # (then the pairs' sample_ids, where the call gives them)
        text, other = (torch.nn.functional.normalize(x, dim=-1) for x in (text, other))
        scales = model_scales(model, family)  # already exp(t), as the model applies them
        logits = scales[0] * text @ other.t()
        second = (scales[1] if len(scales) > 1 else scales[0]) * text @ other.t()  # logits_per_audio transposed
        return (contrastive_loss(logits) + contrastive_loss(second.t())) / 2

    return loss


def _mnrl(obj, method: str):
    """sentence-transformers' MultipleNegativesRankingLoss on the same columns of embeddings."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    loss = MultipleNegativesRankingLoss(obj.model, scale=obj.scale or 20.0, directions=obj.directions,
                                        partition_mode=obj.partition_mode)
    return lambda a, k: loss.compute_loss_from_embeddings(a[0], None)


def _hf_wav2vec2(obj, method: str):
    """Wav2Vec2ForPreTraining's own contrastive loss on the same frame scores: cross-entropy of the target
    among [target, distractors] / temperature, distractors equal to the target at -inf, summed over the
    masked frames (transformers' formula, written on the scores the adapter was given)."""
    def loss(a, k):
        pos, neg, valid = a[:3]
        logits = torch.cat([pos[:, None], neg.masked_fill(~valid, float("-inf"))], dim=1) / k["model_temperature"]
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        per_frame = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
        frames = k.get("frames")
        return (per_frame if frames is None else torch.where(frames, per_frame, 0.0)).sum()

    return loss


REFERENCES = {"contrastkit": _contrastkit_infonce, "openclip": _open_clip, "hf_clip": _hf_clip, "mnrl": _mnrl,
              "hf_wav2vec2": _hf_wav2vec2}


# ---------------------------------------------------------------------- top-1 of a call: (share, chance)

def _pairs(a: torch.Tensor, b: torch.Tensor):
    """Row i of ``a`` against every row of ``b`` (cosine), its positive row i of ``b``: the share of rows whose
    positive is the most similar, and chance 1 / len(b)."""
    a, b = (torch.nn.functional.normalize(x.detach().float(), dim=-1) for x in (a, b))
    return _diagonal(a @ b.t())


def _diagonal(scores: torch.Tensor):
    """Rows of scores whose largest entry is the diagonal's, and chance 1 / columns."""
    rows = torch.arange(scores.shape[0], device=scores.device)
    return (scores.argmax(1) == rows).float().mean(), torch.full((), 1.0 / scores.shape[1], device=scores.device)


def _frames(pos: torch.Tensor, neg: torch.Tensor, valid: torch.Tensor, frames: torch.Tensor | None = None):
    """wav2vec 2.0's pretext accuracy over the contrasted frames (a frame with at least one valid distractor,
    and in ``frames`` where given): the target scores above every valid distractor; chance the mean of
    1 / (1 + valid distractors)."""
    rows = valid.any(1) if frames is None else valid.any(1) & frames.reshape(-1).bool()
    best = neg.detach().float().masked_fill(~valid, float("-inf")).amax(1)
    count = rows.sum().clamp_min(1)
    hits = ((pos.detach().float() > best) & rows).sum() / count
    chance = torch.where(rows, 1.0 / (1 + valid.sum(1)), 0.0).sum() / count
    return hits, chance


def _hf_wav2vec2_scores(a, k, out):
    """Wav2Vec2ForPreTraining's own forward: its masked frames' scores, as the model forms them."""
    from contrastkit.adapters.hf_wav2vec2 import frame_scores

    pos, neg, valid = frame_scores(out.projected_states, out.projected_quantized_states,
                                   k["sampled_negative_indices"])
    return _frames(pos, neg, valid, k["mask_time_indices"])


def _first_two(a, k, out):  # forward(z1, z2), query_key(query, key, ...), cross_modal(image, text), ClipLoss
    named = [k[n] for n in ("z1", "z2", "query", "key", "image", "text", "image_features", "text_features") if n in k]
    first, second = [*a, *named][:2]  # open_clip_train calls its loss with keywords: loss(**model_out, ...)
    return _pairs(first, second)


def _columns(a, k, out):  # compute_loss_from_embeddings([anchors, positives, ...], labels)
    return _pairs(a[0][0], a[0][1])


def _cached_columns(a, k, out):  # calculate_loss(reps: one list of mini-batches per column, ...)
    return _pairs(torch.cat(a[0][0]), torch.cat(a[0][1]))


def _watches(watch: str) -> list:
    """(owner, name, score) of each function that is the objective under ``E2E_WATCH=watch``."""
    if watch == "core":
        from contrastkit.adapters.hf_clip import ClipObjective
        from contrastkit.losses.frames import FrameObjective
        from contrastkit.losses.registry import LOSSES

        classes = {c for loss in LOSSES.values() for c in loss.__mro__ if c.__module__.startswith("contrastkit.")}
        return [(cls, name, _first_two) for cls in classes for name in ("forward", "query_key", "cross_modal")
                if name in vars(cls)] + [
            (FrameObjective, "summed", lambda a, k, out: _frames(*a[:3], k.get("frames"))),
            # the Hugging Face dual encoders' objective (model, family, text, other), around cross_modal
            (ClipObjective, "__call__", lambda a, k, out: _pairs(a[2], a[3]))]
    if watch == "mnrl":
        from contrastkit.adapters.sentence_transformers import MultipleNegativesLoss

        return [(MultipleNegativesLoss, "compute_loss_from_embeddings", _columns)]
    if watch == "openclip":
        from open_clip.loss import ClipLoss

        from contrastkit.adapters.open_clip import register_configs

        register_configs()  # open_clip_train on the adapter's model (contrastkit-tiny), as the adapter runs it
        return [(ClipLoss, "forward", _first_two)]
    if watch == "hf_clip":  # called by name inside the models' forward: the modules' own functions
        from transformers.models.clip import modeling_clip
        from transformers.models.vision_text_dual_encoder import modeling_vision_text_dual_encoder as dual

        return [(m, "image_text_contrastive_loss", lambda a, k, out: _diagonal(a[0].detach()))
                for m in (modeling_clip, dual)]
    if watch == "hf_wav2vec2":
        from transformers import Wav2Vec2ForPreTraining

        return [(Wav2Vec2ForPreTraining, "forward", _hf_wav2vec2_scores)]
    if watch == "st_mnrl":
        from sentence_transformers.sentence_transformer.losses import (CachedMultipleNegativesRankingLoss,
                                                                       MultipleNegativesRankingLoss)

        return [(MultipleNegativesRankingLoss, "compute_loss_from_embeddings", _columns),
                (CachedMultipleNegativesRankingLoss, "calculate_loss", _cached_columns)]
    raise ValueError(watch)


WATCHES = ("core", "mnrl", "openclip", "hf_clip", "hf_wav2vec2", "st_mnrl")


# ---------------------------------------------------------------------- install, then run the entry point

def install(probe: Probe, watch: str) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(probe.mark_step)
    for owner, name, score in _watches(watch):
        probe.watch(owner, name, score)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("error: usage: e2e_probe.py (SCRIPT | -m MODULE) [ARGS...]")
    reference, watch = os.environ.get("E2E_REFERENCE", "none"), os.environ.get("E2E_WATCH", "core")
    sync = os.environ.get("E2E_SYNC", "error")
    if reference != "none" and reference not in REFERENCES:
        sys.exit(f"error: E2E_REFERENCE must be none or one of {', '.join(REFERENCES)}, got {reference!r}")
    if watch not in WATCHES:
        sys.exit(f"error: E2E_WATCH must be one of {', '.join(WATCHES)}, got {watch!r}")
    if sync not in ("error", "warn"):
        sys.exit(f"error: E2E_SYNC must be error or warn, got {sync!r}")
    probe = Probe(Path(os.environ.get("E2E_OUT", "e2e_probe.json")), reference,
                  int(os.environ.get("E2E_WARMUP_CALLS", "3")), sync)
    if os.environ.get("E2E_SHARED_GPU") == "1":  # several processes on the one GPU: accelerate maps local rank r
        os.environ["LOCAL_RANK"] = "0"            # to device r, DDP to device_ids [r]; here every rank's is 0
    if os.environ.get("E2E_IMPORT"):
        importlib.import_module(os.environ["E2E_IMPORT"])
    install(probe, watch)
    try:
        if sys.argv[1] == "-m":
            module, sys.argv = sys.argv[2], sys.argv[2:]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script, sys.argv = sys.argv[1], sys.argv[1:]
            sys.path.insert(0, str(Path(script).resolve().parent))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
    probe.write(_rank())  # after the run, not at exit: a failure here fails the process


if __name__ == "__main__":
    main()
