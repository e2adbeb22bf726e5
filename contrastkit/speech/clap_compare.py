"""Objectives compared on audio-text: the CLAP recipe trained with each objective and seed, zero-shot intent
accuracy against the untrained model (same initialisation), with 95 % intervals over seeds.

Each run is ``recipes/clap/train.py`` with the given settings; a run whose summary.json exists is reused, so
an interrupted comparison continues. Writes ``results.json``, ``results.md`` (mean ± half-width per
objective, the paired verdicts trained - untrained and objective - InfoNCE) and ``results.png``.
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from contrastkit.adapters.hf_clip import CLIP_LOSSES
from contrastkit.cli import arg, existing, positive
from contrastkit.evaluation.stats import grouped_verdicts, interval
from contrastkit.speech.clap import ClapTrainConfig


@dataclass
class ClapCompareArgs:
    """The command line of recipes/clap/compare.py."""

    losses: list[str] = arg(help="objectives to compare", choices=CLIP_LOSSES, factory=lambda: ["infonce", "dcl"])
    seeds: list[int] = arg(help="seeds", factory=lambda: [0, 1, 2])
    steps: int = arg(ClapTrainConfig.steps, "optimizer steps per run")
    caption: str = arg(ClapTrainConfig.caption, "each clip's text (see the recipe)", choices=("mix", "transcript",
                                                                                             "intent"))
    data: str | None = arg(None, "Fluent Speech Commands root (default: the embedded spoken commands)")
    jobs: int = arg(1, "runs in parallel (each on 2 / jobs threads)")
    out_dir: str = arg("runs/clap-compare", "output folder (finished runs in it are reused)")
    results_dir: str | None = arg(None, "where results.json/md/png go (default: --out-dir)")

    def check(self) -> None:
        for name in ("steps", "jobs"):
            positive(name, getattr(self, name))
        existing("data", self.data, "Fluent Speech Commands root")


def _run(cfg: ClapTrainConfig, threads: int | None) -> None:
    import torch

    from contrastkit.speech.clap import train

    if threads:
        torch.set_num_threads(threads)
    train(cfg)


def compare(args: ClapCompareArgs) -> dict:
    """Train every (objective, seed) and write the comparison to ``args.out_dir``."""
    from tqdm import tqdm

    from contrastkit.speech.clap import fsc_splits

    made_by = provenance()  # before the runs: the code that runs them
    out_dir = Path(args.out_dir)
    base = ClapTrainConfig(steps=args.steps, caption=args.caption, data=args.data, eval_every=0, save_every=0,
                           progress=False)
    runs = [replace(base, loss=loss, seed=seed, out_dir=str(out_dir / f"{loss}-seed{seed}"))
            for seed in args.seeds for loss in args.losses]
    fsc_splits(args.data)  # the embedded data generated once, before the workers start
    todo = [cfg for cfg in runs if not (Path(cfg.out_dir) / "summary.json").is_file()]
    if args.jobs > 1:
        import multiprocessing

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(tqdm(pool.map(_run, todo, [max(1, 2 // args.jobs)] * len(todo)), total=len(todo), desc="runs"))
    else:
        for cfg in tqdm(todo, desc="runs"):
            _run(cfg, None)
    rows = []
    for cfg in runs:
        s = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
        if cfg.loss == args.losses[0]:  # the untrained model depends on the seed only
            untrained = s["zeroshot_intent_untrained"]["accuracy"]
            rows.append({"model": "untrained", "seed": cfg.seed, "accuracy": untrained})
        rows.append({"model": cfg.loss, "seed": cfg.seed, "accuracy": s["zeroshot_intent"]["accuracy"],
                     "final_loss": s["final_loss"], "train_seconds": s["train_seconds"]})
    chance, clips = s["zeroshot_intent"]["chance"], s["zeroshot_intent"]["num_clips"]
    return write_comparison(rows, Path(args.results_dir or out_dir), args, chance, clips, made_by)


def provenance() -> str:
    """The command line and the commit that ran it (with a mark where the checkout had uncommitted changes)."""
    import shlex
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        commit, dirty = "", ""
    commit = (commit or "unknown") + (" (with uncommitted changes)" if dirty else "")
    return f"`python {shlex.join(sys.argv)}` at commit {commit}"


def write_comparison(rows: list[dict], out_dir: Path, args: ClapCompareArgs, chance: float, clips: int,
                     made_by: str) -> dict:
    """results.json, results.md and results.png from one row per (model, seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in rows))
    table = {name: interval([r["accuracy"] for r in rows if r["model"] == name]) for name in names}
    verdicts = [v for reference in ("untrained", "infonce") for v in grouped_verdicts(
        [r for r in rows if reference == "untrained" or r["model"] != "untrained"], name_key="model",
        metric="accuracy", reference=reference, scale=100, digits=1)]
    results = {"made_by": made_by, "settings": dict(vars(args)), "chance": chance, "test_clips": clips,
               "table": table, "verdicts": verdicts, "runs": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    def cell(ci):
        return f"{100 * ci['mean']:.1f}" + (f" ± {100 * ci['half_width']:.1f}" if ci["n"] > 1 else "")

    lines = [f"Zero-shot intent accuracy (%) of a tiny CLAP on the Fluent Speech Commands test split ({clips} clips "
             f"of speakers unseen in training; chance {100 * chance:.1f}), {args.steps} steps, captions "
             f"'{args.caption}': mean ± half-width of the 95 % t-interval over seeds {list(args.seeds)}.", "",
             "| model | accuracy | per seed |", "|---|---|---|"]
    for name in names:
        values = ", ".join(f"{100 * r['accuracy']:.1f}" for r in rows if r["model"] == name)
        lines.append(f"| {name} | {cell(table[name])} | {values} |")
    lines += ["", "Paired verdicts (points; resolved = the 95 % interval of the per-seed difference excludes 0):", ""]
    lines += [f"- {v['text']}" for v in verdicts]
    lines += ["", f"Made by {made_by}."]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 3.6))
    for i, name in enumerate(names):
        ci = table[name]
        ax.bar(i, 100 * ci["mean"], yerr=100 * (ci["half_width"] or 0.0), capsize=4, alpha=0.7,
               color="grey" if name == "untrained" else f"C{i}")
        values = [100 * r["accuracy"] for r in rows if r["model"] == name]
        ax.plot([i] * len(values), values, "k.", ms=5)
    ax.axhline(100 * chance, color="grey", ls="--", lw=1, label="chance")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("zero-shot intent accuracy (%)")
    ax.set_title(f"CLAP on spoken commands, {args.steps} steps")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "results.png", dpi=120)
    plt.close(fig)
    return results
