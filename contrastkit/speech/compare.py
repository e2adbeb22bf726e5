"""InfoNCE vs DCL (or any objectives) as wav2vec 2.0 upstreams on the same data: pre-train each with the
recipe, evaluate speaker ID and intent SUPERB-style, and write a table (Markdown, JSON) and a plot.

The untrained upstream (same initialisation) is evaluated too, as the floor the pre-training must beat.
A run folder that holds a finished run (and its evaluation) is reused, so seeds can run as separate
processes into one folder and a last call with every seed writes the table.
Each cell is the mean ± half-width of the 95 % t-interval over seeds; every upstream gets a paired verdict
against the untrained one and every objective against InfoNCE (contrastkit.evaluation.stats).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from contrastkit.cli import arg, existing, positive
from contrastkit.evaluation import superb
from contrastkit.evaluation.stats import grouped_verdicts, interval
from contrastkit.speech.pretrain import (BACKENDS, SPEECH_LOSSES, PretrainConfig, build_model, export_upstream,
                                         pretrain)


@dataclasses.dataclass
class SpeechCompareArgs:
    """The command line of recipes/wav2vec2/compare.py."""

    backend: str = arg("hf", "wav2vec 2.0 implementation", choices=BACKENDS)
    losses: list[str] = arg(help="objectives to compare", choices=SPEECH_LOSSES, factory=lambda: ["infonce", "dcl"])
    seeds: list[int] = arg(help="seeds", factory=lambda: [0])
    steps: int = arg(PretrainConfig.steps, "pre-training steps per upstream")
    batch_size: int = arg(8, "utterances per process")
    epochs: int = arg(150, "downstream epochs")
    data: str | None = arg(None, "a folder holding fsc/ and voxceleb1/ (default: embedded)")
    out: str = arg("runs/wav2vec2-compare", "output folder", aliases=["--out-dir"])

    def check(self) -> None:
        for name in ("steps", "batch_size", "epochs"):
            positive(name, getattr(self, name))
        existing("data", self.data, "data folder")


def compare(out_dir: str | Path, losses=("infonce", "dcl"), seeds=(0,), base: PretrainConfig | None = None,
            downstream: superb.DownstreamConfig | None = None, data_root: str | Path | None = None) -> dict:
    out_dir = Path(out_dir)
    base = base or PretrainConfig()
    downstream = downstream or superb.DownstreamConfig()
    rows = []
    for seed in seeds:
        for loss in ("untrained", *losses):
            run = out_dir / f"{loss}-seed{seed}"
            cfg = dataclasses.replace(base, loss="infonce" if loss == "untrained" else loss, seed=seed,
                                      out_dir=str(run), data=data_root)
            if loss == "untrained":
                if not (run / "upstream").is_dir():
                    export_upstream(build_model(cfg), cfg, run / "upstream")
            elif not (run / "summary.json").is_file():
                pretrain(cfg)
            row = {"upstream": loss, "seed": seed}
            upstream = None
            for task, fn, sub in (("speaker_id", superb.speaker_id, "voxceleb1"), ("intent", superb.intent, "fsc")):
                report = run / "eval" / f"{task}.json"
                if report.is_file():  # a finished run's evaluation is reused
                    result = json.loads(report.read_text())
                else:
                    upstream = upstream or superb.Upstream(run, cache=True)  # both tasks: features once per file
                    result = fn(upstream, Path(data_root) / sub if data_root else None, downstream)
                    superb.write_report(result, run / "eval")
                row[task] = result["test_accuracy"]
            if loss != "untrained":
                row["final_loss_per_frame"] = json.loads((run / "summary.json").read_text())["final_loss_per_frame"]
            rows.append(row)
            print(row, flush=True)
    return write_comparison(rows, out_dir, base)


def write_comparison(rows: list[dict], out_dir: Path, base: PretrainConfig) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["upstream"] for r in rows))
    tasks = ("speaker_id", "intent")
    table = {name: {t: interval([r[t] for r in rows if r["upstream"] == name]) for t in tasks} for name in names}
    verdicts = [{**v, "task": t, "text": f"{t}: {v['text']}"} for t in tasks for reference in ("untrained", "infonce")
                for v in grouped_verdicts([r for r in rows if reference == "untrained" or r["upstream"] != "untrained"],
                                          name_key="upstream", metric=t, reference=reference)]

    def cell(ci):
        return f"{ci['mean']:.3f}" + (" (1 seed)" if ci["n"] == 1 else f" ± {ci['half_width']:.3f}")

    lines = [f"wav2vec 2.0 {base.backend} upstreams, {base.steps} steps x batch {base.batch_size}, "
             f"{len(rows) // len(names)} seed(s); test accuracy, mean ± half-width of the 95 % t-interval over seeds",
             "", "| upstream | speaker ID (VoxCeleb1 layout) | intent (FSC layout) |", "|---|---|---|"]
    for name, t in table.items():
        lines.append(f"| {name} | {cell(t['speaker_id'])} | {cell(t['intent'])} |")
    lines += ["", "Paired verdicts (same seeds; resolved = the 95 % interval excludes 0):", ""]
    lines += [f"- {v['text']}" for v in verdicts]
    (out_dir / "comparison.md").write_text("\n".join(lines) + "\n")
    summary = {"rows": rows, "table": table, "verdicts": verdicts, "pretrain": dataclasses.asdict(base)}
    (out_dir / "comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        means = [table[name][t]["mean"] for t in tasks]
        halves = [0.0 if table[name][t]["n"] == 1 else table[name][t]["half_width"] for t in tasks]
        ax.bar([x + i * width for x in (0, 1)], means, width, yerr=halves, label=name, capsize=3)
    ax.set_xticks([0.4 - width / 2, 1.4 - width / 2], ["speaker ID", "intent"])
    ax.set_ylabel("test accuracy")
    ax.set_title(f"wav2vec 2.0 upstreams ({base.backend}, {base.steps} steps)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "comparison.png", dpi=120)
    plt.close(fig)
    print("\n".join(lines))
    return summary
