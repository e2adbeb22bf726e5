"""The harness of benchmarks/gpu_e2e.sh: runs one entry point (a script, or ``-m module``) in this process
and watches contrastkit's objective inside it, without changing the product.

    E2E_OUT=run.json E2E_REFERENCE=openclip accelerate launch --mixed_precision bf16 \\
        benchmarks/e2e_probe.py recipes/clip/train.py --loss dcl --steps 200
    E2E_OUT=st.json E2E_WATCH=mnrl E2E_REFERENCE=mnrl python benchmarks/e2e_probe.py benchmarks/e2e_st_train.py ...

What it records, written to ``E2E_OUT`` (JSON) when the entry point returns:

- every training call of the objective (an outermost call with gradients on): its loss, kept on the device
  (no host read until the end), so that "it learned" is the same test for every entry point;
- a CUDA event after every optimizer step (torch's global step hook), so the steady-state step time is the
  GPU's own timeline, the median interval after the first fifth of the steps (evaluations and checkpoints
  fall out as outliers); on the CPU (``--dry-run``) the wall clock;
- the objective's share: the last training call replayed alone (forward + backward, the same features,
  under the same autocast), timed with CUDA events, times the calls per step; beside it the ecosystem's own
  InfoNCE on the same features (``E2E_REFERENCE``, see REFERENCES);
- host synchronisations: from the ``E2E_WARMUP_CALLS``-th training call on (the first ones autotune Triton
  kernels, which synchronise by design), every call of the objective runs under
  ``torch.cuda.set_sync_debug_mode("error")``, and so does the replay's backward: a sync fails the run;
- peak GPU memory (``torch.cuda.max_memory_allocated``).

``E2E_IMPORT``: a module imported first (the one-import adapters, e.g. contrastkit.adapters.hf_clip_dcl).
``E2E_WATCH``: what counts as the objective: ``core`` (default: the loss classes' forward, query_key and
cross_modal, the wav2vec 2.0 frame objective and the Hugging Face dual encoders' ClipObjective) or ``mnrl`` (the sentence-transformers adapter's
compute_loss_from_embeddings, the span MNRL's own method covers).
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


class Probe:
    def __init__(self, out: Path, reference: str, warmup_calls: int):
        self.out, self.reference, self.warmup_calls = out, reference, warmup_calls
        self.depth = 0
        self.losses: list[torch.Tensor] = []
        self.marks: list = []  # CUDA events (or wall-clock seconds on the CPU) after each optimizer step
        self.last = None  # (objective, method, args, kwargs, autocast) of the last training call
        self.device = "cpu"

    # ------------------------------------------------------------------ during the run

    def watch(self, cls, name: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def watched(obj, *args, **kwargs):
            if self.depth or not torch.is_grad_enabled():
                return original(obj, *args, **kwargs)
            self.device = _device_of(args, kwargs) or self.device
            self.depth += 1
            try:
                with self._no_sync(len(self.losses) >= self.warmup_calls):
                    out = original(obj, *args, **kwargs)
            finally:
                self.depth -= 1
            self.losses.append(_loss_of(out).detach().float())
            self.last = (obj, original, _detached(args), _detached(kwargs), _autocast(self.device))
            return out

        setattr(cls, name, watched)

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
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)

    # ------------------------------------------------------------------ at the end

    def time_alone(self, fns: dict, args, kwargs, autocast) -> dict[str, float]:
        """Median ms of forward + backward of each of ``fns`` on fresh leaves of the saved inputs, in
        interleaved rounds, under the training call's autocast; on CUDA timed with events, and every call
        after the warm-up, its backward included, under sync debug mode "error". Nested objective calls are
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
        losses = torch.stack(self.losses).tolist() if self.losses else []
        result["losses"] = losses
        if len(losses) >= 4:
            q = len(losses) // 4
            first, last = statistics.fmean(losses[:q]), statistics.fmean(losses[-q:])
            result.update(loss_first=first, loss_last=last,
                          learned=bool(last <= first - LEARNED_FRACTION * abs(first)))
        intervals = [_elapsed_ms(a, b) for a, b in zip(self.marks, self.marks[1:])]
        steady = intervals[len(intervals) // 5:]
        if steady:
            result["step_ms"] = statistics.median(steady)
        if self.last is not None and result["steps"]:
            per_step = len(self.losses) / result["steps"]
            obj, method, args, kwargs, autocast = self.last
            result["calls_per_step"] = per_step
            fns = {"objective_ms": lambda a, k: method(obj, *a, **k)}
            if self.reference != "none":
                fns["infonce_ms"] = REFERENCES[self.reference](obj, method.__name__)
            for name, ms in self.time_alone(fns, args, kwargs, autocast).items():
                result[name] = per_step * ms
        return result

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.summary(), indent=1) + "\n")


# The loss must fall by this fraction of its starting value (first quarter of the calls against the last).
LEARNED_FRACTION = 0.05


def _device_of(args, kwargs) -> str | None:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.device.type
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
            return x[0].device.type
    return None


def _loss_of(out) -> torch.Tensor:
    if isinstance(out, dict):
        return out["loss"]
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


# ---------------------------------------------------------------------- install, then run the entry point

def install(probe: Probe, watch: str) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(probe.mark_step)
    if watch == "mnrl":
        from contrastkit.adapters.sentence_transformers import MultipleNegativesLoss

        probe.watch(MultipleNegativesLoss, "compute_loss_from_embeddings")
        return
    from contrastkit.adapters.hf_clip import ClipObjective
    from contrastkit.losses.frames import FrameObjective
    from contrastkit.losses.registry import LOSSES

    classes = {c for loss in LOSSES.values() for c in loss.__mro__ if c.__module__.startswith("contrastkit.")}
    for cls in classes:
        for name in ("forward", "query_key", "cross_modal"):
            if name in vars(cls):
                probe.watch(cls, name)
    probe.watch(FrameObjective, "summed")
    probe.watch(ClipObjective, "__call__")  # the Hugging Face dual encoders' objective, around cross_modal


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("error: usage: e2e_probe.py (SCRIPT | -m MODULE) [ARGS...]")
    reference = os.environ.get("E2E_REFERENCE", "none")
    if reference != "none" and reference not in REFERENCES:
        sys.exit(f"error: E2E_REFERENCE must be none or one of {', '.join(REFERENCES)}, got {reference!r}")
    probe = Probe(Path(os.environ.get("E2E_OUT", "e2e_probe.json")), reference,
                  int(os.environ.get("E2E_WARMUP_CALLS", "3")))
    if os.environ.get("E2E_IMPORT"):
        importlib.import_module(os.environ["E2E_IMPORT"])
    install(probe, os.environ.get("E2E_WATCH", "core"))
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
    if _rank() == 0:  # after the run, not at exit: a failure here fails the process
        probe.write()


if __name__ == "__main__":
    main()
