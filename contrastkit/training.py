"""What the three training loops (clip, vision, speech) share, written once: the accelerator with its
trackers, the batches of each step, the learning-rate schedule, checkpoints that resume exactly, the
divergence check, and a metrics log (JSONL, plot, summary, mirrored to the trackers).

Checkpoints are accelerate's own ``save_state`` folders (model, optimizer, scheduler, RNG states, and
any object registered with ``accelerator.register_for_checkpointing``) in ``checkpoints/checkpoint_<step>``,
with the run's config beside them (``run_config.json``). A folder counts only once its ``COMPLETE`` marker
(the step and every file's size) is written, after every process has finished writing; only then are
old folders removed, so a run killed during a save, with any ``--keep-checkpoints``, resumes from the
previous one. A save that fails (disk full), a resume with nothing to resume from, a damaged checkpoint
and a run that diverged end in a ``RunError`` naming the path, the cause and the newest good checkpoint.

On several machines: collectives give up after ``--ddp-timeout`` seconds, and a lost peer (a dead or
cut-off host, a killed process) ends each surviving process with one ``RunError`` line (``guarded``).
At start-up the main process writes a marker into ``--out-dir`` that every process looks for: where a machine
does not see it (its own disk), ``--save-on-each-node`` has that machine write complete checkpoints of its own
(without the flag it is an error). A resume loads the newest checkpoint complete on every machine;
``--resume auto`` (and every torchrun restart) starts fresh where there is none yet, so a requeued command
carries on.

A preempted job loses nothing: SIGTERM and ``--requeue-signal`` only set a flag, and ``StepBoundary``, which
every recipe calls after each step, has every process stop at the same step with a complete checkpoint of it and
exit status ``STOPPED`` (75), the SLURM job requeued first with ``--requeue-on-signal``.

>>> log = MetricsLog("runs/clip-dcl")
>>> log.log(step=10, loss=3.2)
>>> log.plot(["loss"])               # runs/clip-dcl/metrics.png
>>> log.summary({"zero_shot_top1": 0.61})
"""

from __future__ import annotations

import datetime
import errno
import atexit
import dataclasses
import functools
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from contrastkit.cli import RunError, arg, positive, renamed


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
        """One panel per key against the step; returns the PNG's path. Drawn on a bare Figure with fixed margins
        (no pyplot, no tight layout): about half the time (0.4 s for 7 panels), which every run pays at its end."""
        if not self.enabled:
            return None
        records = self.records()
        keys = [k for k in keys if any(k in r for r in records)]
        if not keys:
            return None
        from matplotlib.figure import Figure

        panel, height, top = 4.5, 3.4, 0.75 if title else 0.45  # inches; the margins fit 6-digit tick labels
        left, right, gap, bottom = 0.75, 0.2, 0.8, 0.55
        width = panel * len(keys)
        fig = Figure(figsize=(width, height))
        fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                            wspace=gap / ((width - left - right - gap * (len(keys) - 1)) / len(keys)))
        for ax, key in zip(fig.subplots(1, len(keys), squeeze=False)[0], keys):
            points = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
            ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3)
            ax.set_xlabel("step")
            ax.set_title(key)
            ax.grid(alpha=0.3)
        if title:
            fig.suptitle(title)
        path = self.out_dir / filename
        fig.savefig(path, dpi=120)
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
    restores it; recipes derive the data position, learning rate and schedules from it. ``resumes``: each
    resume's step, checkpoint and changed settings (for summary.json)."""

    def __init__(self):
        self.step = 0
        self.resumes: list[dict] = []

    def state_dict(self):
        return {"step": self.step, "resumes": json.dumps(self.resumes)}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        self.resumes = json.loads(state.get("resumes", "[]"))



REPORT_TO = ("none", "tensorboard", "wandb", "all")


def check_report_to(report_to: str) -> None:
    """Refuse an unknown tracker, or one whose package is not installed, before any work."""
    import importlib.util

    if report_to not in REPORT_TO:
        raise ValueError(f"--report-to {report_to!r}: choose one of {', '.join(REPORT_TO)}")
    for name, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if report_to == name and importlib.util.find_spec(package) is None:
            raise ValueError(f"--report-to {name} needs the {package} package: pip install {package}")


STOPPED = 75  # sysexits.h's EX_TEMPFAIL, "a temporary failure: try again later": the run stopped to be requeued
REQUEUE_SIGNALS = ("USR1", "USR2", "HUP", "TERM")  # --requeue-signal's choices (TERM: SIGTERM alone)

RESUME_HELP = ("continue from the newest complete checkpoint in --out-dir, which must exist (a new --lr is "
               "applied); --resume auto: continue if there is one, else start (a requeued job's command)")


@dataclass
class RunOptions:
    """What every training recipe's config has beside its own options: the schedule and its intervals, trackers,
    checkpoints, resuming and the settings of runs on several machines. Each is written here once; a recipe
    whose default differs gives it in its class's ``DEFAULTS`` ({name: value}), which changes the default of
    the one definition (help and aliases stay).

    ``warmup`` is steps, or below 1 a fraction of ``steps`` (as transformers' ``warmup_steps``, but rounded
    down, as the wav2vec 2.0 recipe's fraction was): ``warmup_for(total)`` turns it into steps. The names the
    recipes had before (``--warmup-steps``, ``--checkpoint-every``: the vision recipe's) are aliases: on the
    command line, in a --config file and in a checkpoint's saved config (``cli.renamed``)."""

    steps: int | None = arg(300, "optimizer steps (0: save the initial model, an untrained baseline)")
    lr: float = arg(1e-3, "peak learning rate")
    warmup: float = arg(30, "linear warm-up before the decay: steps, or below 1 a fraction of --steps (0.08: the "
                            "first 8 %%, rounded down); --warmup-steps, the vision recipe's earlier name, is the "
                            "same option", metavar="N|FRACTION", aliases=["--warmup-steps", "--warmup_steps"])
    log_every: int = arg(10, "log the loss every N steps")
    eval_every: int = arg(100, "evaluate every N steps (0: only at the end); the recipe's evaluation: zero-shot, kNN "
                               "or held-out pretext accuracy")
    save_every: int = arg(100, "checkpoint every N steps (0: none before the end); --checkpoint-every, the vision "
                               "recipe's earlier name, is the same option",
                          aliases=["--checkpoint-every", "--checkpoint_every"])
    seed: int = arg(0, "random seed (initialisation, data order, augmentation)")
    progress: bool = arg(True, "show a progress bar")
    report_to: str = arg("none", "trackers beside metrics.jsonl (accelerate's, logging to <out-dir>/logs)",
                         choices=REPORT_TO)
    keep_checkpoints: int = arg(2, "checkpoints kept (old ones are removed only once a new one is complete)")
    resume: bool | str = arg(False, RESUME_HELP, choices=("auto",))
    ddp_timeout: int = arg(1800, "seconds a collective (all-reduce, barrier) waits for the other processes before "
                                 "the run stops with an error naming the lost peer")
    ddp_backend: str | None = arg(None, "the processes' collective backend (default: accelerate's, NCCL on GPUs); gloo "
                                        "lets several processes share one GPU, which NCCL refuses (its collectives "
                                        "then pass through host memory)", choices=("nccl", "gloo"))
    save_on_each_node: bool = arg(False, "several machines whose --out-dir is not one shared folder: each machine "
                                         "writes complete checkpoints to its own (needed for --resume there)")
    requeue_signal: str = arg("USR1", "the signal that, like SIGTERM, stops the run at the next step boundary with a "
                                      f"complete checkpoint and exit status {STOPPED} (SLURM: sbatch "
                                      "--signal=USR1@120; TERM: SIGTERM alone)", choices=REQUEUE_SIGNALS)
    requeue_on_signal: bool = arg(False, "in a SLURM job, the first process requeues it (scontrol requeue "
                                         "$SLURM_JOB_ID) once a signal's checkpoint is complete")

    def __init_subclass__(cls, **kwargs):
        """Apply the subclass's ``DEFAULTS`` before @dataclass reads its fields: each named field of RunOptions
        is given to the subclass again, the same but for its default."""
        super().__init_subclass__(**kwargs)
        defaults = cls.__dict__.get("DEFAULTS", {})
        if not defaults:
            return
        fields = RunOptions.__dataclass_fields__
        unknown = sorted(set(defaults) - set(fields))
        if unknown:
            raise TypeError(f"{cls.__name__}.DEFAULTS: {', '.join(unknown)} not RunOptions fields")
        if "__annotations__" not in cls.__dict__:
            cls.__annotations__ = {}
        for name, value in defaults.items():
            cls.__dict__["__annotations__"][name] = fields[name].type
            setattr(cls, name, dataclasses.field(default=value, metadata=fields[name].metadata))

    def warmup_for(self, total: int) -> int:
        """The warm-up in steps of a run of ``total`` steps: ``warmup`` itself, or below 1 that fraction of it."""
        return int(self.warmup * total) if self.warmup < 1 else int(self.warmup)

    def check_run(self) -> None:
        positive("lr", self.lr)
        positive("log_every", self.log_every)
        for name in ("steps", "warmup", "eval_every", "save_every"):
            positive(name, getattr(self, name), zero=True)
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            raise ValueError(f"--warmup {self.warmup}: steps are whole, a fraction of --steps is below 1")
        positive("keep_checkpoints", self.keep_checkpoints)
        positive("ddp_timeout", self.ddp_timeout)
        check_report_to(self.report_to)
        if self.resume not in (True, False, "auto"):  # a --config file's value (the command line checks its own)
            raise ValueError(f"--resume takes no value or auto, got {self.resume!r}")


def make_accelerator(out_dir: str | Path, run: RunOptions, **kwargs):
    """An Accelerator for a run of ``run``'s options: trackers (``report_to``: none, tensorboard, wandb or all)
    logging under ``out_dir/logs``, collectives that time out after ``ddp_timeout`` seconds (on ``ddp_backend``
    where given), and checkpoints
    written on each machine that does not share ``out_dir`` with the main process (``save_on_each_node``
    allows it; without it such a machine is an error). Checkpoints: ``Checkpoints`` (not accelerate's
    ``total_limit``, which deletes the old checkpoint before the new one is written). The processes that write
    checkpoints hold ``out_dir/LOCK`` (``RunLock``): another run there is an error. From here on SIGTERM and
    ``requeue_signal`` only set a flag, which the recipe's ``StepBoundary`` acts on."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(out_dir), logging_dir=str(Path(out_dir) / "logs"))
    backend = {"backend": run.ddp_backend} if run.ddp_backend else {}
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=run.ddp_timeout), **backend)
    accelerator = Accelerator(project_config=project, log_with=None if run.report_to == "none" else run.report_to,
                              kwargs_handlers=[timeout], **kwargs)
    check_launch(accelerator)
    project.save_on_each_node = own_out_dir(accelerator, out_dir, run.save_on_each_node)
    lock_out_dir(accelerator, out_dir, run.resume == "auto" or (restarted() > 0 and not run.resume))
    catch_stop_signals(run.requeue_signal)
    return accelerator


def own_out_dir(accelerator, out_dir: str | Path, allowed: bool) -> bool:
    """Whether this process's ``out_dir`` is not the main process's (another machine's disk). The main process
    writes a marker with a random name, and every process looks for it after a barrier. A RunError (exit 2,
    on every process) where some process does not see it and ``allowed`` (--save-on-each-node) is False."""
    if accelerator.num_processes == 1:
        return False
    import torch.distributed as dist

    name = [f".shared-{secrets.token_hex(8)}"]
    dist.broadcast_object_list(name, src=0)
    marker = Path(out_dir) / name[0]
    if accelerator.is_main_process:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("written by process 0 to find out which processes share this folder\n")
    accelerator.wait_for_everyone()
    own = not marker.is_file()
    everyone = [None] * accelerator.num_processes
    dist.all_gather_object(everyone, own)
    if accelerator.is_main_process:
        marker.unlink()
    apart = [rank for rank, flag in enumerate(everyone) if flag]
    if apart and not allowed:
        raise RunError(f"--out-dir {out_dir} is not one folder shared by the machines: process(es) "
                       f"{', '.join(map(str, apart))} do not see what process 0 writes there. Add --save-on-each-node "
                       "(each machine then writes complete checkpoints to its own --out-dir), or give an --out-dir "
                       "on a filesystem every machine mounts", status=2)
    return own


def check_launch(accelerator) -> None:
    """Raise RunError (one line, exit 2) where accelerate set up another run than the launch asked for,
    which it does without a word: ``accelerate launch --multi_gpu`` (torchrun) on a machine without a GPU gives each
    process a run of its own unless ACCELERATE_USE_CPU=1, and ``--use_fsdp`` on the CPU gives DDP
    (accelerate 1.15 shards with FSDP on GPUs and other accelerators only)."""
    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RunError(f"launched as {launched} processes (WORLD_SIZE) but accelerate set up "
                       f"{accelerator.num_processes} ({accelerator.distributed_type.value}), each a run of its own: "
                       "on a machine without a GPU set ACCELERATE_USE_CPU=1 (for torchrun, or for accelerate launch "
                       "--multi_gpu --num_processes N; accelerate's --cpu flag alone starts one process)", status=2)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and \
            accelerator.distributed_type != DistributedType.FSDP:
        raise RunError(f"launched with FSDP (accelerate launch --use_fsdp) but accelerate set up "
                           f"{accelerator.distributed_type.value}: accelerate shards with FSDP on GPUs only", status=2)


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
RUN_CONFIG = "run_config.json"
HINT = ("lower --lr and continue from that checkpoint with --resume (the new --lr is applied), or train in bf16 "
        "rather than fp16 (accelerate launch --mixed_precision bf16)")


def _checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    root = Path(out_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("checkpoint_*")
             if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]
    return sorted(found)


def _complete(out_dir: str | Path) -> list[Path]:
    return [p for _, p in _checkpoints(out_dir) if (p / COMPLETE).is_file()]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete ``checkpoints/checkpoint_<step>`` under ``out_dir``, or None."""
    done = _complete(out_dir)
    return done[-1] if done else None


def damage(path: Path) -> str | None:
    """What is wrong with the complete checkpoint ``path`` by its marker's file sizes (None: intact; markers
    without sizes, from older versions, count as intact)."""
    try:
        files = json.loads((path / COMPLETE).read_text()).get("files", {})
    except (ValueError, AttributeError):
        return None
    for name, size in files.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if (path / name).stat().st_size != size:
            return f"{name} has {(path / name).stat().st_size} bytes, {size} were written"
    return None


def newest_good(out_dir: str | Path, before: Path | None = None) -> Path | None:
    """The newest complete checkpoint (older than ``before``, when given) whose files have the sizes written."""
    done = _complete(out_dir)
    if before is not None:
        done = done[:done.index(before)] if before in done else done
    good = [p for p in done if damage(p) is None]
    return good[-1] if good else None


def _named(path: Path | None) -> str:
    return str(path) if path is not None else "none (no complete checkpoint was written)"


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return f"{type(err).__name__}: {text.splitlines()[0]}"


def set_peak_lr(optimizer, scheduler, lr: float) -> None:
    """Make ``lr`` the peak of the schedule from the scheduler's current step on: a resumed scheduler would
    otherwise keep the checkpoint's (its ``base_lrs`` are state)."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def restarted() -> int:
    """torchrun's count of restarts of this run's workers (0: the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Checkpoints:
    """The ``checkpoints/`` folder of a run in ``out_dir``: ``save(step)`` writes one and then rotates (the
    newest ``keep`` complete ones stay); ``resume(...)`` loads the newest, checking that the settings it
    fixes (``fixed``, names of ``config``'s keys) did not change and applying the others (the peak
    learning rate: ``lr_key``), each change printed and recorded in the TrainState's ``resumes``.

    The main process writes the folder, and on a machine with an out_dir of its own (make_accelerator's
    ``save_on_each_node``) that machine's first process too: marker, rotation and clean-up included."""

    def __init__(self, accelerator, out_dir: str | Path, keep: int, config: dict, fixed: tuple[str, ...],
                 lr_key: str = "lr"):
        self.accelerator, self.out_dir, self.keep = accelerator, Path(out_dir), keep
        self.config = json.loads(json.dumps(config))  # as run_config.json holds it (tuples become lists)
        self.fixed, self.lr_key = fixed, lr_key
        own = accelerator.project_configuration.save_on_each_node
        self.writer = accelerator.is_main_process or (own and accelerator.is_local_main_process)

    def _drop_incomplete(self) -> None:
        if self.writer:
            for _, path in _checkpoints(self.out_dir):
                if not (path / COMPLETE).is_file():
                    shutil.rmtree(path, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def _everywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every process."""
        count = self.accelerator.reduce(torch.tensor(float(flag), device=self.accelerator.device), "sum")
        return int(count) == self.accelerator.num_processes

    def save(self, step: int) -> Path:
        """accelerator.save_state into ``checkpoints/checkpoint_<step>``, the run's config beside it, the
        COMPLETE marker once every process has written its part, and only then the old ones removed."""
        acc = self.accelerator
        path = self.out_dir / "checkpoints" / f"checkpoint_{step}"
        if self._everywhere((path / COMPLETE).is_file()):
            return path
        if self.writer:  # complete here but not on every machine: written again, and incomplete till then
            (path / COMPLETE).unlink(missing_ok=True)
        self._drop_incomplete()
        try:
            acc.save_state(str(path))
            if self.writer:
                (path / RUN_CONFIG).write_text(json.dumps(self.config, indent=2) + "\n")
            acc.wait_for_everyone()
            if self.writer:
                files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
                with open(path / COMPLETE, "w") as f:
                    f.write(json.dumps({"step": step, "files": files}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
        except (OSError, RuntimeError) as err:
            if lost_peer(err):
                raise
            shutil.rmtree(path, ignore_errors=True)
            free = shutil.disk_usage(path.parent).free / 2**20 if path.parent.exists() else float("nan")
            full = (getattr(err, "errno", None) in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
                    or "unexpected pos" in str(err))  # torch.save's zip writer on a short write
            cause = "a file could not be written whole: the disk is full, or a quota or file-size limit was hit; "
            raise RunError(f"could not write checkpoint {path} ({cause if full else ''}{_first_line(err)}; "
                           f"{free:.0f} MiB free on its filesystem); the newest good checkpoint is "
                           f"{_named(newest_good(self.out_dir))}") from err
        acc.wait_for_everyone()
        if self.writer:
            for old in _complete(self.out_dir)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return path

    def _newest_everywhere(self) -> Path | None:
        """The newest checkpoint complete in every process's out_dir; a RunError where some have one and
        others none (a machine whose disk was replaced)."""
        from accelerate.utils import gather_object

        mine = [step for step, path in _checkpoints(self.out_dir) if (path / COMPLETE).is_file()]
        found = gather_object([mine])
        common = set.intersection(*map(set, found))
        if common:
            return self.out_dir / "checkpoints" / f"checkpoint_{max(common)}"
        if any(found):
            empty = [str(rank) for rank, steps in enumerate(found) if not steps]
            having = next(rank for rank, steps in enumerate(found) if steps)
            raise RunError(f"--resume: process(es) {', '.join(empty)} find no complete checkpoint under their "
                           f"{self.out_dir / 'checkpoints'}, process {having} has checkpoint_{max(found[having])}: "
                           "copy that folder to their machine(s) (their processes' RNG states, "
                           "random_states_<rank>.pkl, are not in it: those start afresh), or start the run again in "
                           "another --out-dir", status=2)
        return None

    def resume(self, state: TrainState, optimizer, scheduler, mode: bool | str = True) -> Path | None:
        """Load the newest complete checkpoint (a half-written one is removed, never loaded) into the
        prepared objects; its path, or None. ``mode``: True (--resume: there must be one), "auto" (start
        fresh where there is none) or False (start fresh; under a torchrun restart: "auto")."""
        if restarted() and not mode:
            mode = "auto"
        if not mode:
            return None
        self._drop_incomplete()
        path = self._newest_everywhere()
        if path is None:
            if mode is True:
                raise RunError(f"--resume: no complete checkpoint under {self.out_dir / 'checkpoints'} "
                               "(leave out --resume, or give --resume auto, to start a run there)", status=2)
            self.accelerator.print(f"--resume auto: no complete checkpoint under {self.out_dir / 'checkpoints'} "
                                   "yet, starting from step 0")
            return None
        problem = damage(path)
        if problem is None:
            changed = self._changes(path)
            try:
                self.accelerator.load_state(str(path))
            except Exception as err:  # any reader's error (safetensors, pickle, zip): the file is damaged
                problem = _first_line(err)
        if problem is not None:
            raise RunError(f"--resume: checkpoint {path} cannot be read ({problem}); the newest good checkpoint is "
                           f"{_named(newest_good(self.out_dir, before=path))}: remove {path.name} to resume from it")
        if self.lr_key in changed:
            set_peak_lr(optimizer, scheduler, self.config[self.lr_key])
        for key, (old, new) in changed.items():
            if key == "loss_options":
                shown = {k: (old.get(k, "unset"), new.get(k, "unset")) for k in sorted({*old, *new})
                         if old.get(k) != new.get(k)}
                for option, (was, now) in shown.items():
                    self.accelerator.print(f"--resume: --loss-option {option}={now} (the checkpoint's run had {was}), "
                                           f"applied from step {state.step}")
                continue
            self.accelerator.print(f"--resume: --{key.replace('_', '-')} {new} (the checkpoint's run had {old}), "
                                   f"applied from step {state.step}")
        state.resumes.append({"step": state.step, "checkpoint": str(path),
                              "changed": {k: {"was": old, "now": new} for k, (old, new) in changed.items()}})
        restart = f" (torchrun restart {restarted()})" if restarted() else ""
        self.accelerator.print(f"resumed from {path}{restart}")
        return path

    def _changes(self, path: Path) -> dict:
        """{key: (checkpoint's value, this run's)} of the settings that differ; a RunError where one is fixed."""
        saved_file = path / RUN_CONFIG
        if not saved_file.is_file():  # written before run_config.json existed: nothing to compare
            return {}
        saved = renamed(json.loads(saved_file.read_text()), RunOptions)  # a run saved before a field's rename
        changed = {k: (saved[k], v) for k, v in self.config.items() if k in saved and saved[k] != v and k != "resume"}
        for key in changed:
            old, new = changed[key]
            if key == "loss_options" and _without_memory(old) == _without_memory(new):
                continue  # only the loss's memory options changed: the objective is the same
            if key in self.fixed:
                raise RunError(f"--resume: {path} was trained with --{key.replace('_', '-')} {old}, this command "
                               f"asks for {new}; the checkpoint fixes it: resume with --{key.replace('_', '-')} "
                               f"{old}, or train with {new} from scratch in another --out-dir", status=2)
        return changed


MEMORY_OPTIONS = ("chunk_size", "backend")  # loss options that change memory and speed, not the objective


def _without_memory(options) -> dict:
    return {k: v for k, v in (options or {}).items() if k not in MEMORY_OPTIONS}


class Divergence:
    """Stops a run whose loss, logit scale or gradient norm became non-finite, with one line: the step, what
    became non-finite, the last good checkpoint and a hint.

    ``watch(step, loss=..., grad_norm=...)`` records on the device (no host sync: on CUDA the values are
    read by ``check``, which the recipes call where they read the host anyway: at logging steps and before
    every checkpoint, so no checkpoint with non-finite weights is written, nor a good one rotated away).
    On a CPU the host reads cost nothing, and ``check`` every step stops the run before the update.
    ``check(model=...)`` also checks the parameters themselves."""

    def __init__(self, accelerator, out_dir: str | Path):
        self.accelerator, self.out_dir = accelerator, Path(out_dir)
        self.names: list[str] = []
        self.bad = self.first = None

    def watch(self, step: int, **values: torch.Tensor) -> None:
        bad = torch.stack([~torch.isfinite(v.detach()).all() for v in values.values()])
        if self.bad is None:
            self.names = list(values)
            self.bad = torch.zeros_like(bad)
            self.first = torch.full(bad.shape, -1, dtype=torch.long, device=bad.device)
        self.first = torch.where(bad & ~self.bad, step, self.first)
        self.bad |= bad

    def error(self, step: int, what: str, detail: str = "inf or NaN") -> RunError:
        return RunError(f"step {step}: the {what} became non-finite ({detail}); the run stopped. The last good "
                        f"checkpoint is {_named(newest_good(self.out_dir))}: {HINT}")

    def from_loss(self, err: Exception, step: int) -> RunError:
        """The loss core's NonFiniteError (CPU: it names the input) as the run's one line."""
        return self.error(step, "logit scale" if "logit_scale" in str(err) else "features", str(err))

    def check(self, step: int, model=None) -> None:
        if self.bad is not None:
            first = self.accelerator.gather(self.first[None]).reshape(-1, len(self.names))
            first = torch.where(first < 0, torch.iinfo(torch.long).max, first).min(0).values.tolist()
            hits = [(s, n) for s, n in zip(first, self.names) if s != torch.iinfo(torch.long).max]
            if hits:
                step, name = min(hits)
                raise self.error(step, name.replace("_", " "))
        if model is not None:
            finite = torch.stack([torch.isfinite(p.detach()).all() for p in model.parameters()]).all()
            if not bool(self.accelerator.reduce(finite.float(), "sum") == self.accelerator.num_processes):
                raise self.error(step, "model's weights")


def grad_norm(parameters) -> torch.Tensor:
    """The global gradient norm (on the device, no host sync), for Divergence.watch."""
    return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])


PEER_LOST = ("connection closed", "connection reset", "timed out", "timeout", "no route to host", "broken pipe",
             "connection refused", "network is unreachable", "connectfullmesh", "nccl")


def lost_peer(err: BaseException) -> str | None:
    """What a collective's error says about a lost peer (its first sentence, without C++ source locations),
    or None where it is not one, or the run has one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not isinstance(err, RuntimeError):
        return None
    import torch.distributed as dist

    text = str(err).strip()
    if not (isinstance(err, dist.DistError) or any(key in text.lower() for key in PEER_LOST)):
        return None
    first = next((line for line in text.splitlines() if line.strip()), type(err).__name__)
    return re.sub(r"\[/[^\]]*:\d+\]\s*", "", first).split(". ")[0].strip()


def _accepts_chunk_size(loss: str) -> bool:
    from contrastkit.losses import build_loss

    try:
        build_loss(loss, chunk_size=1)
    except (TypeError, ValueError):
        return False
    return True


def out_of_memory(cfg, err: BaseException, where: str = "the device") -> RunError:
    """The one line of a run that ran out of memory: the step (the one being trained, from the run's
    StepBoundary), the batch each process holds, the newest complete checkpoint, and the settings that lower
    the memory here, said as what a resume may change (the loss's block size, --max-seconds where the checkpoint
    does not fix it, bf16) and what needs a new run (what the checkpoint fixes: the batch size)."""
    boundary = StepBoundary.active
    when = f"step {boundary.state.step + 1}" if boundary is not None else "before the first step"
    world = boundary.accelerator.num_processes if boundary is not None else int(os.environ.get("WORLD_SIZE", "1"))
    batch = getattr(cfg, "batch_size", None)
    held = ""
    if batch:
        local = batch // world if getattr(cfg, "GLOBAL_BATCH", True) else batch
        spread = (f"--batch-size {batch} over {world} processes" if getattr(cfg, "GLOBAL_BATCH", True) and world > 1
                  else f"--batch-size {batch}{'' if getattr(cfg, 'GLOBAL_BATCH', True) else ' per process'}")
        held = f" with {local} samples per process ({spread})"
    cause = ". ".join(_first_line(err).split(": ", 1)[-1].split(". ")[:2]).rstrip(".")
    fixed = getattr(cfg, "FIXED", ())
    resume, anew = [], []  # what a resume may change, what needs a new run
    loss = getattr(cfg, "loss", None)
    if loss and _accepts_chunk_size(loss):
        chunk = (getattr(cfg, "loss_options", None) or {}).get("chunk_size")
        now = f", now {chunk}" if chunk else ""
        resume.append(f"a smaller block of the loss, --loss-option chunk_size=N (anchors per block{now}; the same "
                      "objective)")
    if getattr(cfg, "max_seconds", None):
        (anew if "max_seconds" in fixed else resume).append(f"shorter clips (--max-seconds below {cfg.max_seconds})")
    mixed = (boundary.accelerator.mixed_precision if boundary is not None
             else os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    if where == "the device" and mixed == "no":
        resume.append("bf16 (accelerate launch --mixed_precision bf16)")
    if batch:
        (anew if "batch_size" in fixed else resume).append("a smaller --batch-size")
    checkpoint = newest_good(cfg.out_dir)
    if checkpoint is None:
        advice = f"start again with {' or '.join(resume + anew)}"
    else:
        advice = "; or ".join(
            ([f"resume from it (the same command with --resume auto) with {' or '.join(resume)}"] if resume else [])
            + ([f"start a new run in another --out-dir (the checkpoint fixes it) with {' or '.join(anew)}"]
               if anew else []))
    return RunError(f"{when}: out of memory on {where}{held} ({cause}); the run stopped. The newest complete "
                    f"checkpoint is {_named(checkpoint)}. To use less memory, {advice}")


def guarded(train):
    """For a recipe's ``train(cfg, ...)``: a collective that fails because another process is gone (its host
    died, was killed or cut off: a connection reset, or no answer within ``cfg.ddp_timeout`` seconds) ends the
    run on this process with one RunError line that names the peer, the timeout and this machine's newest
    complete checkpoint, to resume from once every host is back; running out of memory is one line too
    (``out_of_memory``). However the run ends, the stop signals get
    their handlers back and the ``out_dir``'s lock is released."""

    @functools.wraps(train)
    def run(cfg, *args, **kwargs):
        try:
            return train(cfg, *args, **kwargs)
        except torch.OutOfMemoryError as err:
            raise out_of_memory(cfg, err) from None
        except RuntimeError as err:
            if "can't allocate memory" in str(err):  # the CPU's allocator
                raise out_of_memory(cfg, err, "the host") from None
            cause = lost_peer(err)
            if cause is None:
                raise
            address = re.search(r"\[?(\d+\.\d+\.\d+\.\d+)\]?:(\d+)", cause)
            who = f"the process at {address.group(1)}" if address else "another process of the run"
            timed_out = "timed out" in cause.lower() or "timeout" in cause.lower()
            raise RunError(f"lost {who} ({cause}): its host died, was stopped or cut off from this one"
                           f"{' (or it was busy for longer than --ddp-timeout: raise it)' if timed_out else ''}; "
                           f"collectives wait --ddp-timeout {cfg.ddp_timeout} s. The newest complete checkpoint "
                           f"here is {_named(newest_good(cfg.out_dir))}: once every host is back, start the job "
                           "again with --resume auto") from None
        finally:
            release_stop_signals()
            release_locks()
            StepBoundary.active = None

    return run


# --- one run at a time in an out_dir -----------------------------------------------------------------------------

LOCK = "LOCK"


def lock_beat() -> float:
    """Seconds between two heartbeats of a lock's holder (CONTRASTKIT_LOCK_BEAT, default 10; the tests shorten it);
    a holder on another host is taken for gone after three beats without one."""
    return float(os.environ.get("CONTRASTKIT_LOCK_BEAT", "10"))


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot: /proc/<pid>/stat's 22nd field), or None."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class RunLock:
    """``out_dir/LOCK``, held by a running job's process that writes checkpoints there, so that a second run into
    the same ``out_dir`` (a job submitted twice, a requeue while the old job still drains) cannot rotate away the
    first one's checkpoints. The file (JSON) names its holder: host, boot, pid, the process's start, the time,
    the SLURM job and the command; it is made whole and then linked into place (no half-written lock), and its
    holder touches it every ``lock_beat()`` seconds (its heartbeat).

    ``acquire`` takes a lock that is absent, or whose holder is gone: a process on this host that ended (or a pid
    now another process's, or a boot ago), this very process (a run that ended without releasing it), or, with
    ``watch`` (``--resume auto``: a requeued job, often on another node), a holder on another host whose heartbeat
    stopped for three beats. Otherwise it returns the sentence that names the holder."""

    held: list["RunLock"] = []  # the locks this process holds, released by ``guarded`` and at exit

    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK
        self.token = secrets.token_hex(8)
        self.stop = threading.Event()
        pid = os.getpid()
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self.content = {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid,
                        "process_start": _process_start(pid), "started": started,
                        "slurm_job": os.environ.get("SLURM_JOB_ID"), "command": " ".join(sys.argv)[:500],
                        "token": self.token}

    def _create(self) -> bool:
        """Make the lock whole beside it, then link it into place (fails where one exists)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / f".{LOCK}.{self.token}"
        tmp.write_text(json.dumps(self.content, indent=1) + "\n")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(tmp.read_text())
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _holder(self) -> tuple[dict, int] | None:
        """(the lock's content, its mtime in ns), or None where there is no lock."""
        try:
            text, mtime = self.path.read_text(), self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), mtime

    def _gone(self, holder: dict, mtime: int, watch: bool) -> str | None:
        """Why the holder is gone (a phrase), or None where it may be running."""
        here = holder.get("host") == self.content["host"]
        if here and holder.get("boot") and holder.get("boot") != self.content["boot"]:
            return "this host has restarted since"
        pid = holder.get("pid")
        if here and isinstance(pid, int):
            if pid == os.getpid():
                return "it was this process's own, from a run that has ended"
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return "its process has ended"
            except PermissionError:
                pass
            start = _process_start(pid)
            if start is not None and holder.get("process_start") not in (None, start):
                return "its process has ended (the pid is now another process's)"
            return None
        if not watch:
            return None
        beats = 3
        time.sleep(beats * lock_beat())
        now = self._holder()
        if now is None or now[1] != mtime:  # released meanwhile (the caller tries again), or alive
            return None
        return f"no heartbeat for {beats * lock_beat():g} s"

    def describe(self, holder: dict) -> str:
        here = holder.get("host") == self.content["host"]
        who = f"process {holder.get('pid', '?')} on {'this host' if here else 'host ' + str(holder.get('host', '?'))}"
        job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
        return f"{who}{job}, started {holder.get('started', 'at an unknown time')}"

    def acquire(self, watch: bool = False) -> str | None:
        """Hold the lock (None), or the sentence that says who holds it."""
        for _ in range(5):
            if self._create():
                break
            found = self._holder()
            if found is None:
                continue  # released meanwhile
            holder, mtime = found
            why = self._gone(holder, mtime, watch)
            if why is None:
                if self._holder() is None:
                    continue
                here = holder.get("host") == self.content["host"]
                advice = ("let that run finish, stop it, or give another --out-dir" if here else
                          f"if that run has ended (its machine was lost), remove {self.path}, or start with --resume "
                          f"auto, which takes the lock over once it sees no heartbeat for {3 * lock_beat():g} s; "
                          "else give another --out-dir")
                return (f"--out-dir {self.out_dir} is in use by another run: {self.describe(holder)} holds "
                        f"{self.path}{' and its heartbeat goes on' if watch and not here else ''}; a second run there "
                        f"would rotate away its checkpoints: {advice}")
            stale = self.out_dir / f".{LOCK}.stale.{self.token}"
            try:
                os.rename(self.path, stale)
            except FileNotFoundError:
                continue
            taken = json.loads(stale.read_text() or "{}") if stale.stat().st_size else {}
            if taken.get("token") != holder.get("token"):  # another run replaced it meanwhile: put it back
                try:
                    os.link(stale, self.path)
                except FileExistsError:
                    pass
                stale.unlink(missing_ok=True)
                continue
            stale.unlink(missing_ok=True)
            print(f"{self.path}: took over the lock of {self.describe(holder)}: {why}", flush=True)
        else:
            return f"--out-dir {self.out_dir}: could not take {self.path} (other runs keep taking it)"
        RunLock.held.append(self)
        threading.Thread(target=self._beat, daemon=True, name="contrastkit-lock").start()
        return None

    def _beat(self) -> None:
        while not self.stop.wait(lock_beat()):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        self.stop.set()
        found = self._holder()
        if found is not None and found[0].get("token") == self.token:
            self.path.unlink(missing_ok=True)
        if self in RunLock.held:
            RunLock.held.remove(self)


def release_locks() -> None:
    for lock in list(RunLock.held):
        lock.release()


atexit.register(release_locks)


def lock_out_dir(accelerator, out_dir: str | Path, watch: bool) -> None:
    """Every process that writes checkpoints into its ``out_dir`` takes its ``RunLock`` (``watch``: --resume auto);
    a RunError (exit 2) on every process where one could not, naming the holder."""
    own = accelerator.project_configuration.save_on_each_node
    writer = accelerator.is_main_process or (own and accelerator.is_local_main_process)
    problem = RunLock(out_dir).acquire(watch) if writer else None
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        everyone = [None] * accelerator.num_processes
        dist.all_gather_object(everyone, problem)
        problem = next((p for p in everyone if p), None)
    if problem:
        release_locks()
        raise RunError(problem, status=2)


# --- stopping on a signal: a preempted job loses nothing --------------------------------------------------------

_seen: list[int] = []  # the stop signals this process received since catch_stop_signals, in order
_previous: dict[int, object] = {}  # the handlers catch_stop_signals replaced


def _note(signum, frame) -> None:
    """The handler of the stop signals: it only notes the signal (no checkpoint is written from a handler);
    the run acts on it at its next step boundary. A second signal is noted too, and changes nothing."""
    _seen.append(signum)


def stop_signals(requeue_signal: str) -> list[signal.Signals]:
    """SIGTERM and the --requeue-signal one."""
    return sorted({signal.SIGTERM, getattr(signal, f"SIG{requeue_signal}")})


def catch_stop_signals(requeue_signal: str) -> None:
    """From now on SIGTERM and ``requeue_signal`` set a flag (``release_stop_signals`` puts the handlers back).
    Python runs handlers in the main thread only: called from another thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return
    _seen.clear()
    for number in stop_signals(requeue_signal):
        if number not in _previous:
            _previous[number] = signal.signal(number, _note)


def release_stop_signals() -> None:
    for number, handler in _previous.items():
        signal.signal(number, handler if handler is not None else signal.SIG_DFL)
    _previous.clear()


def quiet_worker(worker_id: int) -> None:
    """A DataLoader's ``worker_init_fn``: a SIGTERM that a scheduler sends to every process of a job (SLURM
    signals the whole step) does not end the worker, so the run can stop at its next step boundary (torch's
    worker dies on it, and its loader then raises in the main process); the SIGTERM with which the loader itself
    ends its worker (it comes from the main process) still ends it. The other stop signals are noted and ignored
    (the handler the worker inherits)."""
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # for every thread of the worker: sigwaitinfo takes it

    def wait() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=wait, daemon=True, name="contrastkit-sigterm").start()


class Stopped(SystemExit):
    """The run stopped on a signal at a step boundary, its checkpoint complete: a SystemExit with status
    ``STOPPED`` (75), so a script ends with it and no traceback, and an in-process caller can catch it."""

    def __init__(self, step: int, checkpoint: Path, signal_name: str):
        super().__init__(STOPPED)
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name


def requeue_slurm_job() -> str:
    """``scontrol requeue`` of this SLURM job (an array job's own task: ``<array job>_<task>``, as SLURM names
    it); what happened, in words."""
    job = os.environ.get("SLURM_JOB_ID")
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        job = f"{array}_{task}"
    if not job:
        return "nothing requeued: --requeue-on-signal, but this is not a SLURM job (no SLURM_JOB_ID)"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job} failed ({_first_line(err)}): submit the job again"
    if done.returncode:
        why = (done.stderr or done.stdout).strip().splitlines()[:1] or [f"exit status {done.returncode}"]
        return f"scontrol requeue {job} failed ({why[0]}): submit the job again"
    return f"SLURM job {job} requeued (scontrol requeue {job})"


class StepBoundary:
    """What every recipe calls after each optimizer step (``boundary()``, once ``state.step`` counts it): where
    a stop signal (SIGTERM, ``--requeue-signal``) seen by any process becomes a stop of every process at the same
    step, with one complete checkpoint of that step (``Checkpoints.save``: the COMPLETE marker, then the
    rotation; after the divergence check, so it holds finite weights), one line naming it, and exit status
    ``STOPPED`` (raised as ``Stopped``). With ``--requeue-on-signal`` in a SLURM job, the main process requeues
    the job first.

    The agreement costs no host sync of the device: each process's flag is a CPU tensor all-reduced (MAX) over a
    gloo group of its own, started without waiting at one boundary (``async_op``) and read at the next, by which
    time it is done; so a signal is acted on at most one step after the step in which it came, and the last
    step's boundary waits for its reduction. One process: the flag is read at once."""

    active: "StepBoundary | None" = None  # the running loop's (its step names an out-of-memory error's)

    def __init__(self, accelerator, run: RunOptions, checkpoints: "Checkpoints", state: TrainState, total: int,
                 divergence: "Divergence | None" = None, model=None):
        StepBoundary.active = self
        self.accelerator, self.run, self.checkpoints = accelerator, run, checkpoints
        self.state, self.total = state, total
        self.divergence, self.model = divergence, model
        self.group = self.pending = None
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=run.ddp_timeout))

    def __call__(self) -> None:
        seen = self._agree(last=self.state.step >= self.total)
        if seen:
            self._stop(signal.Signals(seen).name)

    def _agree(self, last: bool) -> int:
        """The stop signal some process saw (its number; 0: none), the same on every process."""
        mine = _seen[0] if _seen else 0
        if self.group is None:
            return mine
        import torch.distributed as dist

        if self.pending is not None:
            work, flag = self.pending
            self.pending = None
            work.wait()  # started a step ago: done by now
            if int(flag):
                return int(flag)
        flag = torch.tensor(mine, dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if last:  # no later boundary to read it at
            work.wait()
            return int(flag)
        self.pending = (work, flag)
        return 0

    def _stop(self, name: str) -> None:
        step, acc = self.state.step, self.accelerator
        if self.divergence is not None:
            self.divergence.check(step, self.model)
        path = self.checkpoints.save(step)
        requeued = ""
        if self.run.requeue_on_signal and acc.is_main_process:
            requeued = f"; {requeue_slurm_job()}"
        acc.print(f"stopped on {name} at step {step}: checkpoint {path} is complete; exit status {STOPPED} (stopped "
                  f"to be requeued: the same command with --resume auto carries on from it){requeued}", flush=True)
        acc.end_training()
        raise Stopped(step, path, name)
