"""What the three training loops (clip, vision, speech) share, written once: the accelerator with its
trackers and checkpoint rotation, the batches of each step, the learning-rate schedule, checkpoints that
resume exactly, and a metrics log (JSONL, plot, summary, mirrored to the trackers).

Checkpoints are accelerate's own ``save_state`` folders (model, optimizer, scheduler, RNG states, and
any object registered with ``accelerator.register_for_checkpointing``), named by accelerate's
``ProjectConfiguration`` (``automatic_checkpoint_naming``, ``total_limit`` rotation) as
``checkpoints/checkpoint_<step>``. A folder counts only once its ``COMPLETE`` marker is written, after
every process has finished writing, so a run killed during a save resumes from the previous one.

>>> log = MetricsLog("runs/clip-dcl")
>>> log.log(step=10, loss=3.2)
>>> log.plot(["loss"])               # runs/clip-dcl/metrics.png
>>> log.summary({"zero_shot_top1": 0.61})
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from contrastkit.cli import arg, positive


class MetricsLog:
    """Append-only JSONL metrics in ``out_dir/metrics.jsonl``, a plot beside it, and a summary JSON.

    On resume, records after the resumed step are dropped so the log matches the resumed run.
    """

    def __init__(self, out_dir: str | Path, *, enabled: bool = True, resume_step: int | None = None,
                 accelerator=None):
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.accelerator = accelerator  # its trackers (TensorBoard, W&B) get every record too
        self.path = self.out_dir / "metrics.jsonl"
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, **metrics) -> None:
        if self.enabled:
            values = {k: _plain(v) for k, v in metrics.items()}
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")
            if self.accelerator is not None and self.accelerator.trackers:
                self.accelerator.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def plot(self, keys: list[str], filename: str = "metrics.png", title: str | None = None) -> Path | None:
        """One panel per key against the step; returns the PNG's path."""
        if not self.enabled:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        keys = [k for k in keys if any(k in r for r in records)]
        if not keys:
            return None
        fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.4), squeeze=False)
        for ax, key in zip(axes[0], keys):
            points = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
            ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3)
            ax.set_xlabel("step")
            ax.set_title(key)
            ax.grid(alpha=0.3)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        path = self.out_dir / filename
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def summary(self, values: dict, filename: str = "summary.json") -> Path | None:
        if not self.enabled:
            return None
        path = self.out_dir / filename
        path.write_text(json.dumps({k: _plain(v) for k, v in values.items()}, indent=2) + "\n")
        return path


def _plain(value):
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class TrainState:
    """The run's step, registered with ``accelerator.register_for_checkpointing`` so that a checkpoint
    restores it; recipes derive the data position, learning rate and schedules from it."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])



REPORT_TO = ("none", "tensorboard", "wandb", "all")


def check_report_to(report_to: str) -> None:
    """Refuse an unknown tracker, or one whose package is not installed, before any work."""
    import importlib.util

    if report_to not in REPORT_TO:
        raise ValueError(f"--report-to {report_to!r}: choose one of {', '.join(REPORT_TO)}")
    for name, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if report_to == name and importlib.util.find_spec(package) is None:
            raise ValueError(f"--report-to {name} needs the {package} package: pip install {package}")


@dataclass
class RunOptions:
    """What every training recipe's config has beside its own options: trackers and checkpoint rotation."""

    report_to: str = arg("none", "trackers beside metrics.jsonl (accelerate's, logging to <out-dir>/logs)",
                         choices=REPORT_TO)
    keep_checkpoints: int = arg(2, "checkpoints kept (accelerate's total_limit)")

    def check_run(self) -> None:
        positive("keep_checkpoints", self.keep_checkpoints)
        check_report_to(self.report_to)


def make_accelerator(out_dir: str | Path, report_to: str = "none", keep: int = 2, **kwargs):
    """An Accelerator whose checkpoints rotate under ``out_dir/checkpoints`` (the newest ``keep``) and whose
    trackers (``report_to``: none, tensorboard, wandb or all) log under ``out_dir/logs``."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(out_dir), logging_dir=str(Path(out_dir) / "logs"),
                                   automatic_checkpoint_naming=True, total_limit=keep)
    accelerator = Accelerator(project_config=project, log_with=None if report_to == "none" else report_to, **kwargs)
    check_launch(accelerator)
    return accelerator


def check_launch(accelerator) -> None:
    """Raise RuntimeError where accelerate set up another run than the launch asked for, which it does
    without a word: ``accelerate launch --multi_gpu`` (torchrun) on a machine without a GPU gives each
    process a run of its own unless ACCELERATE_USE_CPU=1, and ``--use_fsdp`` on the CPU gives DDP
    (accelerate 1.15 shards with FSDP on GPUs and other accelerators only)."""
    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RuntimeError(f"launched as {launched} processes (WORLD_SIZE) but accelerate set up "
                           f"{accelerator.num_processes} ({accelerator.distributed_type.value}): on a CPU launch with "
                           "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N (accelerate's --cpu "
                           "flag alone starts one process)")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and \
            accelerator.distributed_type != DistributedType.FSDP:
        raise RuntimeError(f"launched with FSDP (accelerate launch --use_fsdp) but accelerate set up "
                           f"{accelerator.distributed_type.value}: accelerate shards with FSDP on GPUs only")


def start_trackers(accelerator, name: str, config: dict) -> None:
    """init_trackers with the run's config flattened to what every tracker accepts."""
    if accelerator.log_with:
        plain = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}
        accelerator.init_trackers(name, config=plain)


class StepBatches(torch.utils.data.Sampler):
    """Batch sampler: this process's share of the global batch of every step in [start, stop).

    Epoch e is a permutation seeded by (seed, e), cut into global batches (the last partial one dropped);
    process r takes rows [r B/P, (r+1) B/P) of each, so gathering in process order gives back the
    one-process batch, and the step alone fixes the data position (exact resume). With ``tag_epoch``
    it yields (epoch, index) pairs (for datasets whose augmentation is seeded by the epoch).
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int = 0, world: int = 1, seed: int = 0,
                 start: int = 0, stop: int | None = None, tag_epoch: bool = False):
        if global_batch < 1 or global_batch % world:
            raise ValueError(f"the batch size {global_batch} must be divisible by the number of processes {world}")
        if num_samples < global_batch:
            raise ValueError(f"the batch size {global_batch} is larger than the dataset ({num_samples} samples)")
        self.n, self.batch, self.rank, self.world, self.seed = num_samples, global_batch, rank, world, seed
        self.start, self.stop, self.tag_epoch = start, stop, tag_epoch
        self.per_epoch = num_samples // global_batch

    def __len__(self):
        return (self.stop - self.start) if self.stop is not None else 0

    def __iter__(self):
        local, epoch, order = self.batch // self.world, None, None
        step = self.start
        while self.stop is None or step < self.stop:
            if step // self.per_epoch != epoch:
                epoch = step // self.per_epoch
                order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            j = (step % self.per_epoch) * self.batch + self.rank * local
            rows = order[j:j + local].tolist()
            yield [(epoch, i) for i in rows] if self.tag_epoch else rows
            step += 1


def lr_schedule(optimizer, name: str, warmup: int, total: int):
    """transformers' schedule ``name`` (cosine, linear, constant_with_warmup, ...) over ``total`` steps."""
    from transformers import get_scheduler

    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)


COMPLETE = "COMPLETE"


def _checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    root = Path(out_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("checkpoint_*")
             if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete ``checkpoints/checkpoint_<step>`` under ``out_dir``, or None."""
    done = [p for _, p in _checkpoints(out_dir) if (p / COMPLETE).is_file()]
    return done[-1] if done else None


def _drop_incomplete(accelerator, out_dir: str | Path) -> None:
    if accelerator.is_main_process:
        for _, path in _checkpoints(out_dir):
            if not (path / COMPLETE).is_file():
                shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()


def save_checkpoint(accelerator, out_dir: str | Path, step: int) -> Path:
    """accelerator.save_state into ``checkpoints/checkpoint_<step>`` (accelerate rotates the old ones), then
    the COMPLETE marker once every process has written its part."""
    path = Path(out_dir) / "checkpoints" / f"checkpoint_{step}"
    if (path / COMPLETE).is_file():
        return path
    _drop_incomplete(accelerator, out_dir)
    accelerator.project_configuration.iteration = step
    accelerator.save_state()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(path / COMPLETE, "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
    accelerator.wait_for_everyone()
    return path


def resume(accelerator, out_dir: str | Path, required: bool = False) -> Path | None:
    """Load the newest complete checkpoint (a half-written one is removed, never loaded); its path or None."""
    _drop_incomplete(accelerator, out_dir)
    path = latest_checkpoint(out_dir)
    if path is None:
        if required:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {Path(out_dir) / 'checkpoints'}")
        return None
    accelerator.load_state(str(path))
    accelerator.print(f"resumed from {path}")
    return path
