"""InfoNCE vs DCL (or any objectives) as wav2vec 2.0 upstreams on the same data: pre-train each with the
recipe, evaluate speaker ID and intent SUPERB-style, and write a table (Markdown, JSON) and a plot.

The untrained upstream (same initialisation) is evaluated too, as the floor the pre-training must beat.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from contrastkit.cli import arg, existing, positive
from contrastkit.evaluation import superb
from contrastkit.speech.pretrain import (BACKENDS, SPEECH_LOSSES, PretrainConfig, build_model, export_upstream,
                                         pretrain)


@dataclasses.dataclass
class SpeechCompareArgs:
    """The command line of recipes/wav2vec2/compare.py."""

    backend: str = arg("hf", "wav2vec 2.0 implementation", choices=BACKENDS)
    losses: list[str] = arg(help="objectives to compare", choices=SPEECH_LOSSES, factory=lambda: ["infonce", "dcl"])
    seeds: list[int] = arg(help="seeds", factory=lambda: [0])
    steps: int = arg(400, "pre-training steps per upstream")
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
                export_upstream(build_model(cfg), cfg, run / "upstream")
            elif not (run / "summary.json").is_file():
                pretrain(cfg)
            row = {"upstream": loss, "seed": seed}
            for task, fn, sub in (("speaker_id", superb.speaker_id, "voxceleb1"), ("intent", superb.intent, "fsc")):
                result = fn(run, Path(data_root) / sub if data_root else None, downstream)
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
    table = {}
    for name in names:
        mine = [r for r in rows if r["upstream"] == name]
        table[name] = {t: (statistics.mean(r[t] for r in mine),
                           statistics.stdev(r[t] for r in mine) if len(mine) > 1 else 0.0)
                       for t in ("speaker_id", "intent")}
    lines = [f"wav2vec 2.0 {base.backend} upstreams, {base.steps} steps x batch {base.batch_size}, "
             f"{len(rows) // len(names)} seed(s); test accuracy, mean ± std over seeds", "",
             "| upstream | speaker ID (VoxCeleb1 layout) | intent (FSC layout) |", "|---|---|---|"]
    for name, t in table.items():
        lines.append(f"| {name} | {t['speaker_id'][0]:.3f} ± {t['speaker_id'][1]:.3f} | "
                     f"{t['intent'][0]:.3f} ± {t['intent'][1]:.3f} |")
    (out_dir / "comparison.md").write_text("\n".join(lines) + "\n")
    summary = {"rows": rows, "table": table, "pretrain": dataclasses.asdict(base)}
    (out_dir / "comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        means = [table[name][t][0] for t in ("speaker_id", "intent")]
        stds = [table[name][t][1] for t in ("speaker_id", "intent")]
        ax.bar([x + i * width for x in (0, 1)], means, width, yerr=stds, label=name, capsize=3)
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
