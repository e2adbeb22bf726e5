"""The cross-domain suite: train (or take) one model per domain, objective and seed, run every evaluation
that fits, and write one report (JSON, Markdown, plots).

A *cell* is (domain, objective, seed, variant); the objective "untrained" is the domain's recipe run with
--steps 0, the floor each objective is compared with. Besides contrastkit's objectives, a domain may offer
another library's loss as a baseline (``BASELINES``: "siglip", open_clip's SigLipLoss, in image_text); the
other domains plan no cell for it, and every objective is compared with it as with InfoNCE. Each cell runs
the domain's recipe and eval scripts as subprocesses, exactly the commands a person would type, and stores its
numbers and commands in ``cell.json``; a cell whose ``cell.json`` holds the same commands is not run again, so
an interrupted suite picks up where it stopped (and the recipes' own ``--resume`` continues an interrupted
training run), while a cell whose settings changed since is run again from scratch.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from contrastkit.cli import arg
from contrastkit.evaluation.stats import grouped_verdicts, interval
from contrastkit.losses import available_losses

ROOT = Path(__file__).resolve().parent.parent  # the checkout: recipes/ and eval/ live beside the package

# Columns of the report: (domain, metric key in cell.json, column title).
COLUMNS = [
    ("image_text", "zeroshot_top1", "image zero-shot top-1"),
    ("vision", "linear_probe_top1", "image linear probe"),
    ("vision", "knn_top1", "image kNN"),
    ("speech", "speaker_id_accuracy", "speaker ID"),
    ("speech", "intent_accuracy", "intent"),
    ("speech_fairseq2", "speaker_id_accuracy", "speaker ID (fairseq2)"),
    ("speech_fairseq2", "intent_accuracy", "intent (fairseq2)"),
    ("audio_text", "zeroshot_intent_accuracy", "audio-text zero-shot intent"),
]

# The papers' numbers, with the setting they were measured in: shown only where a run matches it.
PAPER_REFERENCES = {
    ("speech", "speaker_id_accuracy"): {
        "infonce": 74.9, "dcl": 75.2,
        "setting": "wav2vec 2.0 Base pre-trained on LibriSpeech, VoxCeleb1 identification, mean-pooled features "
                   "and a linear layer (DCL paper, appendix Table 7)"},
    ("speech", "intent_accuracy"): {
        "infonce": 92.3, "dcl": 92.5,
        "setting": "wav2vec 2.0 Base pre-trained on LibriSpeech, Fluent Speech Commands intent "
                   "(DCL paper, appendix Table 7)"},
}

# Baselines that are another library's loss, not a contrastkit objective, and the domains whose recipe offers them
BASELINES = {"siglip": ("image_text",)}  # open_clip's SigLipLoss (the CLIP recipe's --loss siglip)
RESUME = ("--resume", "auto")  # every training command: an interrupted cell continues its run, a new one starts
UNTRAINED = "untrained"  # the baseline row: each domain's recipe run with --steps 0 (its initial model)
SPEECH_EVALS = {"evals": ["speaker_id", "intent"],
                "eval_options": {"speaker_id": {"epochs": 60}, "intent": {"epochs": 60}}}

DEFAULT_CONFIG = {
    "output_dir": "runs/suite",
    "objectives": ["infonce", "dcl"],
    "seeds": [0, 1, 2],  # with 2 seeds the 95 % interval is 12.7 standard errors wide each way; with 3, 4.3
    "baseline": True,
    "domains": {
        "vision": {"data": None, "checkpoints": {},
                   "train": {"method": "simclr", "batch-size": 32, "steps": 100, "train-images": 2000,
                             "test-images": 500, "threads": 1},
                   "evals": ["knn", "linear_probe"], "eval_options": {"linear_probe": {"epochs": 30}}},
        # the CLIP recipe's defaults: at 100 steps of 32 pairs zero-shot rose 5 points, not resolved over 3 seeds
        "image_text": {"data": None, "zeroshot": None, "checkpoints": {}, "train": {"batch-size": 64, "steps": 300},
                       "evals": ["zeroshot"]},
        "speech": {"fsc": None, "voxceleb": None, "checkpoints": {}, "train": {"backend": "hf", "steps": 800},
                   **SPEECH_EVALS},
        # fairseq2 0.8.1 pins torch 2.9.1: its cells run in the second environment (bash setup.sh --legacy-only)
        "speech_fairseq2": {"python": ".venv-legacy/bin/python", "fsc": None, "voxceleb": None, "checkpoints": {},
                            "train": {"backend": "fairseq2", "steps": 800}, **SPEECH_EVALS},
        "audio_text": {"fsc": None, "checkpoints": {}, "train": {"steps": 300}, "evals": ["zeroshot_intent"]},
    },
    "sweep": {"domain": "vision", "batch_sizes": [8, 64], "objectives": ["infonce", "dcl"], "seeds": [0]},
}


@dataclass
class Cell:
    domain: str
    objective: str
    seed: int
    variant: str = ""  # e.g. "bs8" in the batch-size sweep
    overrides: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "/".join(x for x in (self.domain + (f"-{self.variant}" if self.variant else ""), self.objective,
                                    f"seed{self.seed}"))


DOMAINS = tuple(DEFAULT_CONFIG["domains"])


@dataclass
class SuiteArgs:
    """The command line of eval/suite.py (its --config is the suite's own YAML or TOML, see load_config)."""

    config: str | None = arg(None, "YAML or TOML file; keys: output_dir, objectives, seeds, domains, sweep")
    output_dir: str | None = arg(None, "overrides the config's output_dir")
    objectives: list[str] | None = arg(None, "overrides the config's objectives (siglip: image_text only)",
                                       choices=[*available_losses(), *BASELINES])
    seeds: list[int] | None = arg(None, "overrides the config's seeds")
    domains: list[str] | None = arg(None, "a subset of the domains to run", choices=DOMAINS)
    sweep: bool = arg(True, "run the batch-size sweep (--no-sweep skips it)")
    baseline: bool = arg(True, "evaluate each domain's untrained model too (--no-baseline skips it)")
    reuse: str | None = arg(None, "an earlier report.json (e.g. docs/suite_default/report.json): its cells stand "
                                  "for this suite's where their recorded commands match, and are not run again")
    print_config: bool = arg(False, "print the resolved config and exit")
    progress: bool = arg(True, "show progress")

    def resolve(self) -> dict:
        """The suite config: the file (or the default) with the command line's overrides."""
        config = load_config(self.config)
        if self.output_dir:
            config["output_dir"] = self.output_dir
        if self.objectives:
            config["objectives"] = self.objectives
        if self.seeds:
            config["seeds"] = self.seeds
        if self.domains:
            unknown = set(self.domains) - set(config["domains"])
            if unknown:
                raise ValueError(f"--domains {sorted(unknown)} not in the config's domains {sorted(config['domains'])}")
            config["domains"] = {d: config["domains"][d] for d in self.domains}
        if not self.sweep:
            config["sweep"] = {}
        if not self.baseline:
            config["baseline"] = False
        return config

    def check(self) -> None:
        self.resolve()
        if self.reuse:
            load_reused(self.reuse)


def load_config(path: str | Path | None) -> dict:
    """The default suite, updated by a YAML or TOML file (domains merge key by key)."""
    config = json.loads(json.dumps(DEFAULT_CONFIG))
    if path is None:
        return config
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"suite config {path} does not exist")
    if path.suffix == ".toml":
        import tomllib

        user = tomllib.loads(path.read_text())
    else:
        import yaml

        user = yaml.safe_load(path.read_text()) or {}
    unknown = set(user) - set(config)
    if unknown:
        raise ValueError(f"suite config {path}: unknown keys {sorted(unknown)}; expected {sorted(config)}")
    for key, value in user.items():
        if key == "domains":
            unknown = set(value) - set(config["domains"])
            if unknown:
                raise ValueError(f"suite config {path}: unknown domains {sorted(unknown)}; "
                                 f"expected {sorted(config['domains'])}")
            config["domains"] = {name: {**config["domains"][name], **(value.get(name) or {})}
                                 for name in config["domains"] if name in value}
        else:
            config[key] = value
    return config


def _rows(config: dict) -> list[str]:
    """The report's rows: the untrained baseline (unless ``baseline`` is false), then the objectives."""
    return ([UNTRAINED] if config.get("baseline", True) else []) + list(config["objectives"])


def offers(domain: str, objective: str) -> bool:
    """Whether ``domain``'s recipe trains with ``objective`` (every contrastkit objective; a baseline only where
    BASELINES says)."""
    return objective not in BASELINES or domain in BASELINES[objective]


def plan(config: dict) -> list[Cell]:
    """Every cell of the suite: each domain x (untrained and each objective it offers) x seed, plus the
    batch-size sweep. An untrained cell runs the domain's recipe with --steps 0 and evaluates what it saves."""
    cells = [Cell(domain, objective, seed, overrides={"steps": 0} if objective == UNTRAINED else {})
             for domain in config["domains"] for objective in _rows(config) if offers(domain, objective)
             for seed in config["seeds"]]
    sweep = config.get("sweep") or {}
    if sweep.get("domain") in config["domains"]:
        for batch in sweep.get("batch_sizes", []):
            for objective in [o for o in sweep.get("objectives", config["objectives"]) if offers(sweep["domain"], o)]:
                for seed in sweep.get("seeds", config["seeds"]):
                    cells.append(Cell(sweep["domain"], objective, seed, f"bs{batch}", {"batch-size": batch}))
    return cells


def _python(settings: dict) -> str:
    """The interpreter of a domain's commands: its ``python`` setting (relative to the checkout), else this one."""
    return str(ROOT / settings["python"]) if settings.get("python") else sys.executable


def missing_data(domain: str, settings: dict) -> str | None:
    """Why a domain cannot run (a data path or its interpreter does not exist), or None."""
    if settings.get("python") and not Path(_python(settings)).exists():
        return (f"{domain}: python {settings['python']} does not exist (fairseq2 runs in the second environment: "
                "bash setup.sh --legacy-only); domain skipped")
    for key in DATA_KEYS[domain]:
        value = settings.get(key)
        if value and not Path(value).exists():
            return f"{domain}: {key} path {value} does not exist; domain skipped"
    for objective, checkpoint in (settings.get("checkpoints") or {}).items():
        if checkpoint and not Path(checkpoint).exists():
            return f"{domain}: checkpoint for {objective} ({checkpoint}) does not exist; domain skipped"
    return None


def _run(argv: list[str], log_path: Path) -> None:
    with log_path.open("a") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        done = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"command failed ({done.returncode}): {shlex.join(argv)}\n{tail}")


def run_cell(cell: Cell, config: dict, out_dir: Path, reuse: tuple[dict, ...] = ()) -> dict:
    """Train (unless a checkpoint is given) and evaluate one cell; the result is cached in cell.json. A cell of
    ``reuse`` (an earlier report's cells) with this cell's name and commands stands for it when its folder
    holds no cell.json: it is written there, marked ``reused_from``, and nothing runs."""
    cell_dir = out_dir / "cells" / cell.name
    result_path = cell_dir / "cell.json"
    settings = config["domains"][cell.domain]
    options = settings.get("eval_options") or {}
    shown = [settings["python"]] if settings.get("python") else []  # as typed: relative to the checkout

    commands = [(name, argv + _flags(options.get(name, {})), output)  # (name, argv, output) each
                for name, argv, output in COMMANDS[cell.domain](cell, settings, cell_dir)]
    recorded = [shlex.join(shown + argv) for _, argv, _ in commands]
    if not result_path.exists():
        earlier = next((r for r in reuse if _name(r) == cell.name and _same_commands(r["commands"], recorded, cell)),
                       None)
        if earlier is not None:
            cell_dir.mkdir(parents=True, exist_ok=True)
            result_path.write_text(json.dumps(earlier, indent=2) + "\n")
    if result_path.exists():
        cached = json.loads(result_path.read_text())
        if _same_commands(cached["commands"], recorded, cell):
            return cached
        print(f"suite: {cell.name}: its settings changed since cell.json was written; running it again",
              file=sys.stderr)
        shutil.rmtree(cell_dir)  # a training run resumed under other settings would mix the two
    cell_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    python = _python(settings)
    metrics = {}
    for name, argv, output in commands:
        _run([python, *argv], cell_dir / "log.txt")
        if output is not None:
            metrics.update(READERS[name](json.loads(Path(output).read_text())))
    result = {"domain": cell.domain, "objective": cell.objective, "seed": cell.seed, "variant": cell.variant,
              "metrics": metrics, "settings": {**settings.get("train", {}), **cell.overrides},
              "commands": recorded, "seconds": round(time.time() - started, 1)}
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _name(result: dict) -> str:
    """A cell.json's cell name (domain[-variant]/objective/seedN)."""
    return Cell(result["domain"], result["objective"], result["seed"], result.get("variant", "")).name


def load_reused(path: str | Path) -> tuple[dict, ...]:
    """The cells of an earlier report.json, each marked with where it came from (for ``run_suite(reuse=...)``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--reuse: {path} does not exist")
    cells = json.loads(path.read_text()).get("cells")
    if not isinstance(cells, list):
        raise ValueError(f"--reuse: {path} is not a suite report (no 'cells' list)")
    return tuple({**c, "reused_from": c.get("reused_from", str(path))} for c in cells)


def _same_commands(cached: list[str], planned: list[str], cell: Cell) -> bool:
    """The same commands, up to where the output folder lies (a moved folder keeps its cells) and --resume
    (cells recorded before ``RESUME`` have a bare one where their training run had been interrupted)."""
    cell_path = re.compile(r"\S*" + re.escape(f"cells/{cell.name}"))

    def key(commands: list[str]) -> list[str]:
        return [re.sub(r" --resume( auto)?(?= |$)", "", shlex.join(shlex.split(cell_path.sub("<cell>", c))))
                for c in commands]

    return key(cached) == key(planned)


def run_suite(config: dict, *, progress: bool = True, reuse: tuple[dict, ...] = ()) -> dict:
    """Run every cell not yet done, then write report.json, report.md and the plots to output_dir. ``reuse``:
    an earlier report's cells (``load_reused``), taken for the cells whose recorded commands they match."""
    from tqdm.auto import tqdm

    out_dir = Path(config["output_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    skipped = {d: why for d, s in config["domains"].items() if (why := missing_data(d, s))}
    results, failures = [], {}
    cells = [c for c in plan(config) if c.domain not in skipped]
    for cell in tqdm(cells, desc="suite", unit="cell", disable=not progress):
        try:
            results.append(run_cell(cell, config, out_dir, reuse))
        except RuntimeError as err:
            failures[cell.name] = str(err)
    report = build_report(config, results, skipped, failures)
    write_report(report, out_dir)
    return report


def _stats(values: list[float]) -> dict:
    """Mean, sample std and the 95 % t-interval's half-width over seeds (None with one seed)."""
    ci = interval(values)
    return {"mean": ci["mean"], "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "half_width": ci["half_width"], "n": len(values), "values": values}


def _verdicts(config: dict, results: list[dict]) -> list[dict]:
    """Paired over seeds, per column of the table: every objective against the untrained model (did training
    help?), then contrastkit's objectives against InfoNCE (per sweep batch size too), then every trained
    objective against each baseline of BASELINES that ran (InfoNCE included)."""
    rows = []
    for domain, key, title in COLUMNS:
        rows += [{"objective": r["objective"], "seed": r["seed"], "column": title, "value": r["metrics"][key]}
                 for r in results if r["domain"] == domain and not r["variant"] and r["metrics"].get(key) is not None]
    rows += [{"objective": r["objective"], "seed": r["seed"], "column": f"kNN at batch {r['variant'][2:]}",
              "value": r["metrics"].get("knn_top1")} for r in results if r["variant"].startswith("bs")]
    options = {"name_key": "objective", "metric": "value", "group_key": "column", "scale": 100, "digits": 1}
    trained = [r for r in rows if r["objective"] != UNTRAINED]
    verdicts = (grouped_verdicts(rows, reference=UNTRAINED, **options)
                + grouped_verdicts([r for r in trained if r["objective"] not in BASELINES], reference="infonce",
                                   **options))
    for baseline in BASELINES:
        verdicts += grouped_verdicts([r for r in trained if r["objective"] == baseline or r["objective"] not in
                                      BASELINES], reference=baseline, **options)
    return verdicts


def build_report(config: dict, results: list[dict], skipped: dict, failures: dict) -> dict:
    """Every number with its settings; per objective and column: mean, spread (sample std) and seeds."""
    table = {}
    for objective in _rows(config):
        row = {}
        for domain, key, title in COLUMNS:
            values = [r["metrics"][key] for r in results
                      if r["domain"] == domain and r["objective"] == objective and not r["variant"]
                      and r["metrics"].get(key) is not None]
            if values:
                row[title] = _stats(values)
        table[objective] = row
    sweep = {}
    for r in results:
        if r["variant"].startswith("bs"):
            batch = int(r["variant"][2:])
            sweep.setdefault(r["objective"], {}).setdefault(batch, []).append(r["metrics"].get("knn_top1"))
    sweep = {o: {b: _stats([v for v in vs if v is not None]) for b, vs in sorted(per.items()) if any(
        v is not None for v in vs)} for o, per in sweep.items()}
    references = []
    for (domain, key), ref in PAPER_REFERENCES.items():
        if domain not in config["domains"]:
            continue
        real = domain in config["domains"] and not _uses_embedded_data(domain, config["domains"][domain])
        references.append({"domain": domain, "metric": key, "setting": ref["setting"],
                           "paper": {o: v for o, v in ref.items() if o != "setting"},
                           "matches_this_run": False, "why": "this run uses the user's data; check the setting"
                           if real else "this run uses the embedded default data, not the paper's"})
    return {"config": config, "table": table, "sweep": sweep, "verdicts": _verdicts(config, results),
            "skipped": skipped, "failures": failures, "references": references, "cells": results}


def _uses_embedded_data(domain: str, settings: dict) -> bool:
    return not any(settings.get(key) for key in DATA_KEYS[domain])


def _fmt(stat: dict | None, scale: float = 100.0) -> str:
    if not stat:
        return "-"
    text = f"{scale * stat['mean']:.1f}"
    return text + (f" ± {scale * stat['half_width']:.1f}" if stat["n"] > 1 else "") + f" (n={stat['n']})"


def _columns(report: dict) -> list[str]:
    """The titles of the columns that hold a number (a suite of some domains leaves the others out)."""
    return [title for _, _, title in COLUMNS if any(title in row for row in report["table"].values())]


def markdown(report: dict) -> str:
    config = report["config"]
    titles = _columns(report)
    lines = ["# contrastkit cross-domain suite", "",
             f"Objectives {', '.join(config['objectives'])}"
             + (" and the untrained model (each recipe with --steps 0)" if config.get("baseline", True) else "")
             + f"; seeds {config['seeds']}. Accuracy in %, "
             "mean ± half-width of the 95 % t-interval over seeds (n = number of seeds). What each paper claims "
             "and whether the project reproduces it: docs/evidence.md.", "",
             "| objective | " + " | ".join(titles) + " |", "|---" * (len(titles) + 1) + "|"]
    for objective, row in report["table"].items():
        lines.append(f"| {objective} | " + " | ".join(_fmt(row.get(t)) for t in titles) + " |")
    for domain, settings in config["domains"].items():
        data = "embedded default" if _uses_embedded_data(domain, settings) else ", ".join(
            f"{k}={settings[k]}" for k in DATA_KEYS[domain] if settings.get(k))
        lines.append(f"\n- {domain}: data {data}; training {json.dumps(settings.get('train', {}))}"
                     + (f"; python {settings['python']}" if settings.get("python") else "")
                     + (f"; checkpoints {settings['checkpoints']}" if settings.get("checkpoints") else ""))
    for domain, why in report["skipped"].items():
        lines.append(f"- **skipped** {why}")
    for name, error in report["failures"].items():
        lines.append(f"- **failed** {name}: {error.splitlines()[0]}")
    reused: dict = {}
    for cell in report["cells"]:
        if cell.get("reused_from"):
            reused.setdefault(cell["reused_from"], []).append(_name(cell))
    for source, names in reused.items():
        lines.append(f"- {len(names)} cells taken from {source} (the same commands, not run again): "
                     + ", ".join(names))
    if report["sweep"]:
        batches = sorted({b for per in report["sweep"].values() for b in per})
        lines += ["", "## kNN accuracy vs batch size", "", "| objective | " + " | ".join(f"batch {b}" for b in batches)
                  + " |", "|---" * (len(batches) + 1) + "|"]
        for objective, per in report["sweep"].items():
            lines.append(f"| {objective} | " + " | ".join(_fmt(per.get(b)) for b in batches) + " |")
    baselines = [b for b in BASELINES if b in config["objectives"]]
    for baseline in baselines:
        lines.append(f"- {baseline}: a baseline (another library's loss), trained in "
                     f"{', '.join(BASELINES[baseline])} only")
    if report.get("verdicts"):
        lines += ["", "## Paired verdicts: against the untrained model, then against InfoNCE"
                  + "".join(f", then against {b}" for b in baselines), "",
                  "Points of accuracy, same seeds; resolved = the 95 % interval of the difference excludes 0.", ""]
        lines += [f"- {v['text']}" for v in report["verdicts"]]
    if report["references"]:
        lines += ["", "## Papers' numbers", "", "| domain | metric | InfoNCE | DCL | setting | comparable here |",
                  "|---|---|---|---|---|---|"]
    for ref in report["references"]:
        lines.append(f"| {ref['domain']} | {ref['metric']} | {ref['paper'].get('infonce', '-')} | "
                     f"{ref['paper'].get('dcl', '-')} | {ref['setting']} | no: {ref['why']} |")
    return "\n".join(lines) + "\n"


def _bar(stat: dict | None) -> float:
    """Error bar (%): the 95 % interval's half-width; none with one seed."""
    return 100 * stat["half_width"] if stat and stat["n"] > 1 else 0.0


def write_report(report: dict, out_dir: Path) -> None:
    """report.json, report.md, and the plots beside them."""
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(report))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = _columns(report)
    for plot, made in (("report_domains.png", titles), ("report_batch_size.png", report["sweep"])):
        if not made:  # an earlier report's plot in the same folder would no longer match report.md
            (out_dir / plot).unlink(missing_ok=True)
    if titles:
        fig, axes = plt.subplots(1, len(titles), figsize=(3.6 * len(titles), 3.4), squeeze=False)
        objectives = list(report["table"])
        for ax, title in zip(axes[0], titles):
            stats = [report["table"][o].get(title) for o in objectives]
            ax.bar(range(len(objectives)), [100 * s["mean"] if s else math.nan for s in stats],
                   yerr=[_bar(s) for s in stats], capsize=4, alpha=0.8,
                   color=["tab:gray" if o == UNTRAINED else "tab:blue" for o in objectives])
            ax.set_xticks(range(len(objectives)), objectives)
            ax.set_title(title)
            ax.set_ylabel("accuracy (%)")
            ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "report_domains.png", dpi=120)
        plt.close(fig)
    if report["sweep"]:
        fig, ax = plt.subplots(figsize=(4.8, 3.6))
        for objective, per in report["sweep"].items():
            batches = sorted(per)
            ax.errorbar(batches, [100 * per[b]["mean"] for b in batches], yerr=[_bar(per[b]) for b in batches],
                        marker="o", capsize=3, label=objective)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("kNN accuracy (%)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "report_batch_size.png", dpi=120)
        plt.close(fig)


# ----------------------------------------------------------------------------- the domains
# Each builder returns the commands of one cell: (name, argv after the Python executable, JSON output or
# None). They are the commands of the README, so a number in the report can be reproduced by hand.

DATA_KEYS = {"vision": ("data",), "image_text": ("data", "zeroshot"), "speech": ("fsc", "voxceleb"),
             "speech_fairseq2": ("fsc", "voxceleb"), "audio_text": ("fsc",)}


def _flags(options: dict) -> list[str]:
    argv = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv += [flag, "false"]  # every recipe flag is a dataclass bool: --x false works for all
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _loss(cell: Cell) -> str:
    """The recipe's --loss: the objective's (an untrained cell trains no step: any loss builds the model)."""
    return "infonce" if cell.objective == UNTRAINED else cell.objective


def _checkpoint(settings: dict, cell: Cell) -> str | None:
    return None if cell.variant else (settings.get("checkpoints") or {}).get(cell.objective)


def vision_commands(cell: Cell, settings: dict, cell_dir: Path) -> list:
    run = _checkpoint(settings, cell)
    commands = []
    if run is None:
        run = str(cell_dir / "train")
        options = {**settings.get("train", {}), **cell.overrides, "loss": _loss(cell), "seed": cell.seed,
                   "out-dir": run, "data": settings.get("data")}
        if options["steps"] == 0:  # untrained: --steps 0 replaces a length given as samples or epochs
            options.update(samples=None, epochs=None)
        argv = ["recipes/vision/train.py", *_flags(options), "--no-progress", *RESUME]
        commands.append(("train", argv, None))
    evals = ["knn"] if cell.variant else settings.get("evals", ["knn", "linear_probe"])
    data = _flags({"data": settings.get("data")})
    if "knn" in evals:
        out = cell_dir / "knn.json"
        commands.append(("knn", ["eval/knn.py", "--run", run, *data, "--out", str(out), "--no-progress"], out))
    if "linear_probe" in evals:
        out = cell_dir / "linear_probe.json"
        commands.append(("linear_probe", ["eval/linear_probe.py", "--run", run, *data, "--classifier", "sgd",
                                          "--out", str(out), "--no-progress"], out))
    return commands


def speech_commands(cell: Cell, settings: dict, cell_dir: Path) -> list:
    run = _checkpoint(settings, cell)
    commands = []
    if run is None:
        run = str(cell_dir / "train")
        options = {**settings.get("train", {}), **cell.overrides, "loss": _loss(cell), "seed": cell.seed,
                   "out": run, "data": settings.get("fsc")}
        commands.append(("train", ["recipes/wav2vec2/train.py", *_flags(options)], None))
    for task, key in (("speaker_id", "voxceleb"), ("intent", "fsc")):
        if task in settings.get("evals", ["speaker_id", "intent"]):
            out_dir = cell_dir / "eval"
            argv = [f"eval/{task}.py", "--upstream", run, *_flags({"data": settings.get(key)}), "--out", str(out_dir),
                    "--seed", str(cell.seed)]
            commands.append((task, argv, out_dir / f"{task}.json"))
    return commands


def image_text_commands(cell: Cell, settings: dict, cell_dir: Path) -> list:
    checkpoint = _checkpoint(settings, cell)
    train = {**settings.get("train", {}), **cell.overrides}
    model = train.get("model", "contrastkit-tiny")
    commands = []
    if checkpoint is None:
        run = cell_dir / "train"
        steps = int(train.get("steps", 300))
        options = {**train, "loss": _loss(cell), "seed": cell.seed, "out-dir": str(run), "save-every": steps,
                   "eval-every": 0, "data": settings.get("data"), "zeroshot": settings.get("zeroshot")}
        argv = ["recipes/clip/train.py", *_flags(options), "--no-progress", *RESUME]
        commands.append(("train", argv, None))
        checkpoint = str(run / "checkpoints" / f"checkpoint_{steps}")
    out = cell_dir / "zeroshot"
    commands.append(("zeroshot", ["eval/zeroshot.py", "--model", model, "--checkpoint", checkpoint,
                                  *_flags({"data": settings.get("zeroshot")}), "--out-dir", str(out)],
                     out / "zeroshot.json"))
    return commands


def audio_text_commands(cell: Cell, settings: dict, cell_dir: Path) -> list:
    run = _checkpoint(settings, cell)
    commands = []
    if run is None:
        run = str(cell_dir / "train")
        steps = int({**settings.get("train", {}), **cell.overrides}.get("steps", 300))
        options = {**settings.get("train", {}), **cell.overrides, "loss": _loss(cell), "seed": cell.seed,
                   "out-dir": run, "save-every": steps, "eval-every": 0, "data": settings.get("fsc")}
        argv = ["recipes/clap/train.py", *_flags(options), "--no-progress", *RESUME]
        commands.append(("train", argv, None))
    if "zeroshot_intent" in settings.get("evals", ["zeroshot_intent"]):
        out = cell_dir / "zeroshot_intent.json"
        commands.append(("zeroshot_intent", ["eval/zeroshot_intent.py", "--model", run,
                                             *_flags({"data": settings.get("fsc")}), "--out", str(out)], out))
    return commands


COMMANDS = {"vision": vision_commands, "image_text": image_text_commands, "speech": speech_commands,
            "speech_fairseq2": speech_commands, "audio_text": audio_text_commands}

READERS = {
    "zeroshot": lambda r: {"zeroshot_top1": r["top1"]},
    "knn": lambda r: {"knn_top1": r["knn_top1"]},
    "linear_probe": lambda r: {"linear_probe_top1": r["sgd"]["test_top1"]},
    "speaker_id": lambda r: {"speaker_id_accuracy": r["test_accuracy"]},
    "intent": lambda r: {"intent_accuracy": r["test_accuracy"]},
    "zeroshot_intent": lambda r: {"zeroshot_intent_accuracy": r["accuracy"]},
}
