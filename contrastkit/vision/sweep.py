"""The sweep behind the papers' vision claims, small enough for a CPU.

- DCL paper Fig. 3: SimCLR with InfoNCE, DCL and DCLW at several batch sizes -> kNN top-1 vs batch size.
- EqCo Fig. 3: MoCo v2 with InfoNCE and EqCo (alpha fixed) at several queue sizes, plus SiMo (no queue)
  -> kNN top-1 vs the number of negatives per query.

Every run sees the same number of samples (``samples``), so batch sizes compare at equal data and
compute. Runs whose summary.json already exists are not repeated, so an interrupted sweep continues.
With several seeds, ``summary_table`` gives mean ± 95 % interval per setting and every objective's paired
verdict against InfoNCE in the same setting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from contrastkit.cli import arg, positive
from contrastkit.evaluation.linear_probe import logistic_regression_lbfgs
from contrastkit.losses import available_losses
from contrastkit.vision.train import VisionConfig, frozen_features, load_backbone, train


@dataclass
class SweepArgs:
    """The command line of recipes/vision/sweep.py."""

    out_dir: str = arg("runs/vision-sweep", "output folder (finished runs in it are kept)")
    samples: int = arg(4096, "images seen per run (same for every batch size)")
    batch_sizes: list[int] = arg(help="SimCLR global batch sizes", factory=lambda: [16, 32, 64, 128])
    simclr_losses: list[str] = arg(help="SimCLR objectives", choices=available_losses(),
                                   factory=lambda: ["infonce", "dcl", "dclw"])
    queue_sizes: list[int] = arg(help="MoCo queue sizes", factory=lambda: [32, 256, 2048])
    moco_losses: list[str] = arg(help="MoCo objectives", choices=available_losses(),
                                 factory=lambda: ["infonce", "eqco"])
    moco_batch: int = arg(64, "MoCo and SiMo global batch")
    simo_losses: list[str] = arg(help="SiMo objectives", choices=available_losses(),
                                 factory=lambda: ["infonce", "eqco"])
    alpha: float = arg(2048.0, "EqCo's alpha (the largest queue by default)")
    train_images: int = arg(2000, "embedded training images")
    test_images: int = arg(800, "embedded test images")
    width: int = arg(16, "small_cnn width")
    lr: float = arg(2e-3, "peak learning rate")
    crop_min: float = arg(0.5, "smallest random-resized-crop scale")
    blur: bool = arg(False, "Gaussian blur in the augmentation")
    temperature: float = arg(0.1, "temperature")
    seed: int = arg(0, "random seed (one run per setting)")
    seeds: list[int] | None = arg(None, "every run once per seed instead, e.g. 0 1 2: mean and 95-percent interval, "
                                        "paired verdicts in sweep.md")

    def check(self) -> None:
        for name in ("samples", "moco_batch", "alpha", "train_images", "test_images", "width", "lr", "temperature"):
            positive(name, getattr(self, name))
        for name in ("batch_sizes", "queue_sizes"):
            for value in getattr(self, name):
                positive(name, value)


def sweep_configs(base: VisionConfig, out_dir: Path, batch_sizes, simclr_losses, queue_sizes, moco_losses,
                  moco_batch: int, simo_losses, seeds=None) -> list[tuple[str, VisionConfig]]:
    """(name, config) of every run: the SimCLR batch-size grid, the MoCo queue grid and SiMo; with ``seeds``
    each of them once per seed (names end in -s<seed>), else once with ``base.seed``."""
    runs = []
    for loss in simclr_losses:
        for b in batch_sizes:
            runs.append((f"simclr-{loss}-b{b}", replace(base, method="simclr", loss=loss, batch_size=b)))
    for loss in moco_losses:
        for q in queue_sizes:
            runs.append((f"moco-{loss}-q{q}", replace(base, method="moco", loss=loss, batch_size=moco_batch,
                                                      queue_size=q)))
    for loss in simo_losses:
        runs.append((f"simo-{loss}-b{moco_batch}", replace(base, method="simo", loss=loss, batch_size=moco_batch)))
    if seeds is not None:
        runs = [(f"{name}-s{seed}", replace(cfg, seed=seed)) for seed in seeds for name, cfg in runs]
    return [(name, replace(cfg, out_dir=str(out_dir / name))) for name, cfg in runs]


def negatives(cfg: VisionConfig) -> int:
    """Negatives per anchor: 2B - 2 views (SimCLR), the queue (MoCo), the other B - 1 keys (SiMo)."""
    return {"simclr": 2 * cfg.batch_size - 2, "moco": cfg.queue_size or 0, "simo": cfg.batch_size - 1}[cfg.method]


def probe(cfg: VisionConfig) -> float:
    """L-BFGS logistic regression on the run's frozen backbone features (test top-1): on the small
    budgets of the sweep it moves before kNN does."""
    done = Path(cfg.out_dir) / "probe.json"
    if not done.exists():
        backbone, _ = load_backbone(cfg.out_dir)
        (train_x, train_y), (test_x, test_y), classes = frozen_features(backbone, cfg, progress=False)
        result = logistic_regression_lbfgs(train_x, train_y, test_x, test_y, num_classes=len(classes))
        done.write_text(json.dumps(result) + "\n")
    return json.loads(done.read_text())["test_top1"]


def run_sweep(runs: list[tuple[str, VisionConfig]], out_dir: Path) -> list[dict]:
    rows = []
    for i, (name, cfg) in enumerate(runs, 1):
        done = Path(cfg.out_dir) / "summary.json"
        if done.exists():
            summary = json.loads(done.read_text())
        else:
            print(f"[{i}/{len(runs)}] {name}", flush=True)
            summary = train(cfg)
        summary["probe_top1"] = probe(cfg)
        rows.append({"name": name, "seed": cfg.seed, "method": cfg.method, "loss": cfg.loss, "batch_size": cfg.batch_size,
                     "queue_size": cfg.queue_size, "negatives": negatives(cfg), "samples": summary["samples_seen"],
                     "steps": summary["steps"], "final_loss": summary["final_loss"], "knn_top1": summary["knn_top1"],
                     "probe_top1": summary["probe_top1"], "train_seconds": summary["train_seconds"]})
        (out_dir / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| run | method | loss | batch | queue | negatives | steps | final loss | kNN top-1 | probe top-1 | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['method']} | {r['loss']} | {r['batch_size']} | {r['queue_size'] or '-'} | "
                     f"{r['negatives']} | {r['steps']} | {r['final_loss']:.3f} | {100 * r['knn_top1']:.1f} | "
                     f"{100 * r['probe_top1']:.1f} | "
                     f"{r['train_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def _setting(r: dict) -> str:
    return f"{r['method']} b{r['batch_size']}" + (f" q{r['queue_size']}" if r["queue_size"] else "")


def summary_table(rows: list[dict]) -> str:
    """Mean ± half-width of the 95 % t-interval over seeds of kNN and probe top-1 (%) per setting and loss,
    then every loss's paired verdict against InfoNCE in the same setting (same seeds)."""
    from contrastkit.evaluation.stats import format_interval, grouped_verdicts

    keyed = [{**r, "setting": _setting(r)} for r in rows]
    groups: dict = {}
    for r in keyed:
        groups.setdefault((r["setting"], r["loss"]), []).append(r)
    lines = ["| setting | loss | seeds | kNN top-1 | probe top-1 |", "|---|---|---|---|---|"]
    for (setting, loss), rs in groups.items():
        lines.append(f"| {setting} | {loss} | {len(rs)} | {format_interval([r['knn_top1'] for r in rs], 100, 1)} | "
                     f"{format_interval([r['probe_top1'] for r in rs], 100, 1)} |")
    lines += ["", "Paired verdicts against InfoNCE (points of top-1; resolved = the 95 % interval excludes 0):", ""]
    for metric in ("knn_top1", "probe_top1"):
        lines += [f"- {metric}, {v['text']}" for v in grouped_verdicts(keyed, name_key="loss", metric=metric,
                                                                       group_key="setting", scale=100, digits=1)]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out_dir: Path, chance: float) -> list[Path]:
    """batch_size.png (SimCLR, DCL Fig. 3) and negatives.png (MoCo / SiMo, EqCo Fig. 3): mean over seeds,
    bars the 95 % intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from contrastkit.evaluation.stats import interval

    paths = []
    for filename, methods, x_key, xlabel, title in (
            ("batch_size.png", ("simclr",), "batch_size", "batch size", "SimCLR: kNN top-1 vs batch size"),
            ("negatives.png", ("moco", "simo"), "negatives", "negatives per query (queue size; SiMo: B - 1)",
             "MoCo v2 / SiMo: kNN top-1 vs negatives")):
        chosen = [r for r in rows if r["method"] in methods]
        if not chosen:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, metric, label in zip(axes, ("knn_top1", "probe_top1"), ("kNN top-1 (%)", "linear probe top-1 (%)")):
            for method in methods:
                for loss in dict.fromkeys(r["loss"] for r in chosen if r["method"] == method):
                    by_x: dict = {}
                    for r in chosen:
                        if r["method"] == method and r["loss"] == loss:
                            by_x.setdefault(r[x_key], []).append(100 * r[metric])
                    xs = sorted(by_x)
                    cis = [interval(by_x[x]) for x in xs]  # one seed: no bar
                    ax.errorbar(xs, [c["mean"] for c in cis], yerr=[0 if c["n"] == 1 else c["half_width"] for c in cis],
                                fmt="o-" if method != "simo" else "s", capsize=3, markersize=6,
                                label=f"{method} {loss}" if len(methods) > 1 else loss)
            ax.axhline(100 * chance, color="gray", linestyle=":", label="chance")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=120)
        plt.close(fig)
        paths.append(out_dir / filename)
    return paths
