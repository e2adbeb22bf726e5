"""What every recipe shares: a metrics log (JSONL, plot, summary) and checkpoints that resume exactly.

Checkpoints are accelerate's own ``save_state`` folders (model, optimizer, scheduler, RNG states, and
any object registered with ``accelerator.register_for_checkpointing``) named ``step_<n>``; the recipe
stores its step and data position in a registered object so that resuming continues the same run.

>>> log = MetricsLog("runs/clip-dcl")
>>> log.log(step=10, loss=3.2)
>>> log.plot(["loss"])               # runs/clip-dcl/metrics.png
>>> log.summary({"zero_shot_top1": 0.61})
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path


class MetricsLog:
    """Append-only JSONL metrics in ``out_dir/metrics.jsonl``, a plot beside it, and a summary JSON.

    On resume, records after the resumed step are dropped so the log matches the resumed run.
    """

    def __init__(self, out_dir: str | Path, *, enabled: bool = True, resume_step: int | None = None):
        self.out_dir = Path(out_dir)
        self.enabled = enabled
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
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **{k: _plain(v) for k, v in metrics.items()}}) + "\n")

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


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step}"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest ``step_<n>`` checkpoint under ``out_dir/checkpoints``, or None."""
    root = Path(out_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name))]
    return max(found)[1] if found else None


def save_checkpoint(accelerator, out_dir: str | Path, step: int, keep: int = 2) -> Path:
    """accelerator.save_state into ``checkpoints/step_<step>``, keeping the newest ``keep`` of them."""
    path = checkpoint_dir(out_dir, step)
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        root = path.parent
        old = sorted((int(p.name.split("_")[1]), p) for p in root.glob("step_*") if p.name.split("_")[1].isdigit())
        for _, p in old[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path
