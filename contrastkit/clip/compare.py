"""InfoNCE vs DCL vs DCLW at small batch sizes: zero-shot accuracy against batch size on the embedded data.

Every run sees the same number of training pairs (``samples``), so smaller batches take more steps, as in
the DCL paper's equal-epoch comparisons. Runs whose summary.json exists are reused, so an interrupted
comparison continues where it stopped. Writes ``results.json``, ``results.md`` (a table) and
``results.png`` (top-1 against batch size, one line per loss, mean over seeds with 95 % intervals), and
every loss's paired verdict against InfoNCE at each batch size (contrastkit.evaluation.stats).
"""

from __future__ import annotations

import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from contrastkit.adapters.open_clip import CLIP_LOSSES, DEFAULT_MODEL, check_model
from contrastkit.cli import arg, positive
from contrastkit.clip.train import ClipTrainConfig
from contrastkit.evaluation.stats import format_interval, grouped_verdicts, interval


@dataclass
class CompareArgs:
    """The command line of recipes/clip/compare.py."""

    losses: list[str] = arg(help="objectives to compare", choices=CLIP_LOSSES,
                            factory=lambda: ["infonce", "dcl", "dclw"])
    batch_sizes: list[int] = arg(help="global batch sizes", factory=lambda: [8, 16, 32, 64])
    seeds: list[int] = arg(help="seeds per cell", factory=lambda: [0])
    samples: int = arg(8192, "training pairs per run (steps = samples / batch)")
    lr: float = arg(ClipTrainConfig.lr, "peak learning rate")
    model: str = arg(DEFAULT_MODEL, "open_clip config name")
    data_dir: str | None = arg(None, "where the embedded data is generated (default ~/.cache/contrastkit)")
    jobs: int = arg(1, "runs in parallel (each gets 2 / jobs threads)")
    out_dir: str = arg("runs/clip-compare", "output folder (finished runs in it are reused)")

    def check(self) -> None:
        for name in ("samples", "lr", "jobs"):
            positive(name, getattr(self, name))
        for b in self.batch_sizes:
            positive("batch_sizes", b)
            if b > self.samples:
                raise ValueError(f"--batch-sizes {b} is larger than --samples {self.samples}")
        check_model(self.model)


def _run(cfg: ClipTrainConfig, threads: int) -> dict:
    import torch

    from contrastkit.clip.train import train

    torch.set_num_threads(threads)
    return train(cfg)


def compare(out_dir: str | Path, *, losses=("infonce", "dcl", "dclw"), batch_sizes=(8, 16, 32, 64), seeds=(0,),
            samples: int = 8192, jobs: int = 1, base: ClipTrainConfig | None = None) -> list[dict]:
    """Train every (loss, batch size, seed) for ``samples`` pairs and tabulate the final zero-shot accuracy."""
    out_dir = Path(out_dir)
    base = base or ClipTrainConfig()
    runs = []
    for seed in seeds:
        for batch in batch_sizes:
            for loss in losses:
                steps = max(1, samples // batch)
                cfg = replace(base, loss=loss, batch_size=batch, seed=seed, steps=steps, warmup=max(1, steps // 10),
                              eval_every=0, save_every=0, log_every=max(1, steps // 50), progress=False,
                              out_dir=str(out_dir / f"{loss}-b{batch}-n{samples}-s{seed}"))
                runs.append(cfg)
    from contrastkit.data.image_text import make_shapes_clip

    make_shapes_clip(base.data_dir, num_train=base.num_train)  # once, before the workers start
    todo = [cfg for cfg in runs if not (Path(cfg.out_dir) / "summary.json").exists()]
    from tqdm import tqdm

    threads = max(1, 2 // jobs) if jobs > 1 else None
    if jobs > 1:
        import multiprocessing

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(tqdm(pool.map(_run, todo, [threads] * len(todo)), total=len(todo), desc="comparison runs"))
    else:
        from contrastkit.clip.train import train

        for cfg in tqdm(todo, desc="comparison runs"):
            train(cfg)
    rows = []
    for cfg in runs:
        s = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
        rows.append({"loss": cfg.loss, "batch_size": cfg.batch_size, "seed": cfg.seed, "steps": cfg.steps,
                     "top1": s["zeroshot_top1"], "top5": s["zeroshot_top5"],
                     "mean_per_class_recall": s["zeroshot_mean_per_class_recall"], "final_loss": s["final_loss"],
                     "train_seconds": s["train_seconds"]})
    report(rows, out_dir, samples)
    return rows


def report(rows: list[dict], out_dir: Path, samples: int) -> None:
    """results.json, results.md (mean top-1 per loss and batch size) and results.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    verdicts = grouped_verdicts(rows, name_key="loss", metric="top1", group_key="batch_size")
    (out_dir / "results.json").write_text(json.dumps({"samples": samples, "runs": rows, "verdicts": verdicts},
                                                     indent=2) + "\n")
    losses = list(dict.fromkeys(r["loss"] for r in rows))
    batches = sorted({r["batch_size"] for r in rows})

    def cell(loss, batch, key="top1"):
        return [r[key] for r in rows if r["loss"] == loss and r["batch_size"] == batch]

    seeds = len({r["seed"] for r in rows})
    lines = [f"Zero-shot top-1 on the held-out shapes split (8 classes, chance 0.125), {samples} training pairs per "
             f"run, {seeds} seed(s): mean ± half-width of the 95 % t-interval over seeds; in brackets mean "
             "per-class recall (mean).", "",
             "| loss | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for loss in losses:
        lines.append(f"| {loss} | " + " | ".join(
            f"{format_interval(cell(loss, b))} ({statistics.mean(cell(loss, b, 'mean_per_class_recall')):.3f})"
            for b in batches) + " |")
    if verdicts:
        lines += ["", "Paired verdicts against InfoNCE (top-1, same seeds; resolved = the 95 % interval excludes 0):",
                  ""] + [f"- {v['text']}" for v in verdicts]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for loss in losses:
        cis = [interval(cell(loss, b)) for b in batches]
        ax.errorbar(batches, [c["mean"] for c in cis], yerr=[c["half_width"] or 0.0 for c in cis], marker="o",
                    capsize=3, label=loss)
    ax.axhline(0.125, color="grey", ls="--", lw=1, label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("zero-shot top-1")
    ax.set_title(f"CLIP on shapes, {samples} pairs per run")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "results.png", dpi=120)
    plt.close(fig)
