"""The tables of tools/gpu/e2e.sh: whether each entry point learned, read by the criterion that says what
learning means there, with contrastkit's objective (DCL) and with the ecosystem's own loss, beside the untrained
baseline; each DCL run's timings (tools/gpu/e2e_probe.py); the main job's resume check and its two-process run.

    python tools/gpu/e2e_report.py compare RUN/checkpoint_200 RESUMED/checkpoint_200 --out resume.json
    python tools/gpu/e2e_report.py write RUN_DIR --out docs/gpu/<device>/e2e.md --command "..." --commit abc123

RUN_DIR holds, per run NAME (a stage; NAME-own: the same entry point with its ecosystem's own loss;
clip-untrained, vision-untrained: a recipe's --steps 0 run, the untrained model through its evaluation):
NAME.status (the exit status), NAME.json (the harness's; NAME.rankR.json from process R of several) and
NAME.summary.json (a recipe's summary.json).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Stage:
    entry: str  # the entry point, as the tables name it
    own: str  # the ecosystem's own loss: what NAME-own trains with
    replayed: str  # the ecosystem's InfoNCE that the harness times beside DCL on the DCL run's features
    criterion: str  # a key of CRITERIA
    untrained: str = ""  # the run whose evaluation is the untrained baseline, where the criterion needs one


RECIPE_OWN = "InfoNCE (`--loss infonce`)"
STAGES = {  # in the tables' order
    "clip": Stage("`accelerate launch recipes/clip/train.py` (main job)", RECIPE_OWN, "open_clip ClipLoss", "zeroshot",
                  "clip-untrained"),
    "clip_2proc": Stage("the main job, 2 processes sharing the GPU (`--ddp-backend gloo`)", "", "", "zeroshot",
                        "clip-untrained"),
    "vision_simclr": Stage("recipes/vision SimCLR", RECIPE_OWN, "contrastkit InfoNCE", "knn", "vision-untrained"),
    "vision_moco": Stage("recipes/vision MoCo (`backend=triton`)", RECIPE_OWN, "contrastkit InfoNCE", "knn",
                         "vision-untrained"),
    "wav2vec2": Stage("recipes/wav2vec2 (Hugging Face backend)", RECIPE_OWN, "Wav2Vec2ForPreTraining's", "pretext"),
    "clap": Stage("recipes/clap", RECIPE_OWN, "transformers clip_loss", "intent"),
    "open_clip": Stage("`python -m contrastkit.adapters.open_clip` (open_clip_train)",
                       "open_clip_train's ClipLoss (`python -m open_clip_train.main`)", "open_clip ClipLoss", "top1"),
    "run_clip": Stage("transformers run_clip.py + one import", "the model's own loss (no import)",
                      "transformers clip_loss", "top1"),
    "run_wav2vec2": Stage("transformers wav2vec 2.0 pre-training + one import", "the model's own loss (no import)",
                          "Wav2Vec2ForPreTraining's", "top1"),
    "st": Stage("SentenceTransformerTrainer + MultipleNegativesLoss", "MultipleNegativesRankingLoss", "MNRL", "top1"),
    "st_cached": Stage("SentenceTransformerTrainer + CachedMultipleNegativesLoss",
                       "CachedMultipleNegativesRankingLoss", "MNRL", "top1"),
}
UNTRAINED_RUNS = ("clip-untrained", "vision-untrained")


@dataclass(frozen=True)
class Criterion:
    text: str  # what is measured, for the report
    margin: float  # learned: the trained value at least this much above the untrained one
    read: Callable  # (harness JSON, recipe summary, untrained run's summary) -> (untrained, trained); None: missing


def _get(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def _above_chance(d: dict | None, top1: str, chance: str):
    return None if _get(d, top1) is None or _get(d, chance) is None else d[top1] - d[chance]


CRITERIA = {
    "zeroshot": Criterion("zero-shot top-1 on the held-out shapes (the recipe's evaluation), against the same model "
                          "at initialisation (`--steps 0`)", 0.05,
                          lambda p, s, u: (_get(u, "zeroshot_top1"), _get(s, "zeroshot_top1"))),
    "knn": Criterion("kNN top-1 of the backbone on the held-out images (the recipe's evaluation), against the "
                     "backbone at initialisation (`--steps 0`)", 0.02,
                     lambda p, s, u: (_get(u, "knn_top1"), _get(s, "knn_top1"))),
    "pretext": Criterion("held-out pretext accuracy minus its chance, 1 / (1 + valid distractors) (the recipe's "
                         "evaluation; the same model at initialisation scored on the same frames)", 0.05,
                         lambda p, s, u: (_above_chance(_get(s, "pretext", "untrained"), "accuracy", "chance"),
                                          _above_chance(_get(s, "pretext", "trained"), "accuracy", "chance"))),
    "intent": Criterion("zero-shot intent accuracy on unseen speakers (the recipe's evaluation, the model "
                        "before its first step beside)", 0.05,
                        lambda p, s, u: (_get(s, "zeroshot_intent_untrained", "accuracy"),
                                         _get(s, "zeroshot_intent", "accuracy"))),
    "top1": Criterion("top-1 in training minus chance (harness: the share of anchors whose positive outscores every "
                      "candidate of the loss; untrained: the first 3 calls, trained: the last quarter)", 0.05,
                      lambda p, s, u: (_above_chance(p, "top1_untrained", "chance_untrained"),
                                       _above_chance(p, "top1_trained", "chance_trained"))),
}
EQUAL_STEPS = 5  # the two-process run's first steps, compared with the one-process run's
EQUAL_TOLERANCE = {"cuda": 0.02, "cpu": 1e-3}  # relative: bf16 (8 bits of mantissa) on the GPU, float32 on the CPU


def compare(a: Path, b: Path) -> dict:
    """The largest absolute difference between the model weights of two checkpoint folders (accelerate's
    model.safetensors), and whether they are bit-identical."""
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if wa.keys() != wb.keys():
        raise SystemExit(f"error: {a} and {b} hold different tensors")
    diff = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
    return {"max_abs_diff": diff, "bit_identical": all(bool((wa[k] == wb[k]).all()) for k in wa),
            "tensors": len(wa)}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def run_of(run: Path, name: str) -> dict | None:
    """One run's record: exit status, harness JSON (the losses of several processes averaged call by call: the
    global loss), recipe summary; None where it did not run."""
    status = run / f"{name}.status"
    if not status.exists():
        return None
    probe = _load(run / f"{name}.json") or {}
    ranks = [_load(p) for p in sorted(run.glob(f"{name}.rank*.json"))]
    if ranks and probe.get("losses"):
        series = [probe["losses"]] + [r["losses"] for r in ranks]
        probe["losses"] = [sum(c) / len(c) for c in zip(*series)]
        probe["processes"] = len(series)
    rc = int(status.read_text().strip() or 1)
    return {"rc": rc, "probe": probe, "summary": _load(run / f"{name}.summary.json"),
            "ran": rc == 0 and probe.get("calls", 0) > 0}


def judge(stage: Stage, record: dict | None, untrained: dict | None) -> dict | None:
    """(untrained, trained, learned) of one run by its stage's criterion."""
    if record is None:
        return None
    criterion = CRITERIA[stage.criterion]
    before, after = criterion.read(record["probe"], record["summary"], untrained and untrained["summary"])
    learned = record["ran"] and before is not None and after is not None and after >= before + criterion.margin
    return {"untrained": before, "trained": after, "learned": bool(learned), "rc": record["rc"]}


def two_processes(one: dict | None, two: dict | None) -> dict | None:
    """The two-process run's loss in its first EQUAL_STEPS steps (the processes' mean) against the one-process
    run's on the same global batches: the largest relative difference, and whether it is within the precision's
    error; the host syncs its objective raised (the harness's warn mode)."""
    if not (one and two and one["ran"] and two["ran"]):
        return None
    a, b = one["probe"]["losses"][:EQUAL_STEPS], two["probe"]["losses"][:EQUAL_STEPS]
    diff = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
    device = two["probe"].get("device", "cpu")
    return {"max_rel_diff": diff, "equal": diff <= EQUAL_TOLERANCE[device], "tolerance": EQUAL_TOLERANCE[device],
            "processes": two["probe"].get("processes", 1), "host_syncs": two["probe"].get("host_syncs"),
            "first_sync": two["probe"].get("first_sync"), "one": a, "two": b}


def _value(x) -> str:
    return "" if x is None else f"{x:.3f}"


def _verdict(j: dict | None) -> str:
    if j is None:
        return "not run"
    if j["rc"] != 0:
        return f"NO (exit {j['rc']})"
    return "yes" if j["learned"] else "NO"


def _ms(x) -> str:
    return "" if x is None else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def _share(part, step) -> str:
    return "" if part is None or not step else f"{_ms(part)} ({100 * part / step:.0f} %)"


def write(run: Path, out: Path, command: str, commit: str) -> tuple[bool, bool]:
    """e2e.md and e2e.json beside it; (every DCL stage that was started ran, every run learned, the resume was
    bit-identical and the two processes equal to one)."""
    untrained = {name: run_of(run, name) for name in UNTRAINED_RUNS}
    rows = []
    for name, stage in STAGES.items():
        dcl, own = run_of(run, name), run_of(run, f"{name}-own")
        if dcl is None and own is None:
            continue
        base = untrained.get(stage.untrained)
        rows.append({"stage": name, "dcl": dcl, "own": own, "dcl_judged": judge(stage, dcl, base),
                     "own_judged": judge(stage, own, base)})
    resume = _load(run / "resume.json")
    pair = two_processes(run_of(run, "clip"), run_of(run, "clip_2proc"))
    device = next((r["dcl"]["probe"].get("device_name") or r["dcl"]["probe"].get("device")
                   for r in rows if r["dcl"] and r["dcl"]["probe"].get("device")), "unknown")
    lines = [f"# End-to-end on {device}", "", f"Command: `{command}`", "", f"Commit: {commit}", "",
             "Each entry point trains for a short run as its own ecosystem does it (on the GPU in bf16: accelerate's "
             "`--mixed_precision bf16`, open_clip_train's `--precision amp_bf16`, the Trainer's `--bf16 --tf32 True`; "
             "tools/gpu/e2e.sh has the settings), once with DCL and once with the ecosystem's own loss. "
             "Learned: the criterion of the entry point, trained against untrained, by at least its margin:", ""]
    lines += [f"- {key} (margin {c.margin:g}): {c.text}" for key, c in CRITERIA.items()]
    lines += ["", "| entry point | criterion | untrained | DCL | own loss | own | learned: DCL / own |",
              "|---|---|---:|---:|---|---:|---|"]
    ok = bool(rows)
    for r in rows:
        stage, d, o = STAGES[r["stage"]], r["dcl_judged"], r["own_judged"]
        first = d or o
        lines.append(f"| {stage.entry} | {stage.criterion} | {_value(first['untrained'])} | "
                     f"{_value(d and d['trained'])} | {stage.own or '-'} | {_value(o and o['trained'])} | "
                     f"{_verdict(d)} / {_verdict(o) if stage.own else '-'} |")
        ok = ok and all(j is None or j["learned"] for j in (d, o))
    timed = [r for r in rows if r["dcl"] and r["dcl"]["probe"].get("objective_ms") is not None]
    all_ran = all(r["dcl"] is None or r["dcl"]["ran"] for r in rows) and bool(rows)
    if timed:
        lines += ["", "Timings of the DCL runs (on a GPU each alone there). Step: the median interval between "
                      "optimizer steps on the GPU's timeline (CUDA events), after the first fifth. DCL and InfoNCE: "
                      "forward + backward of the loss alone, replayed on the last step's own features under the step's "
                      "autocast, times the calls per step (CUDA events, median of 10), with the share of the step in "
                      "brackets; InfoNCE is the ecosystem's own loss named in its column. Every objective call after "
                      "the first 3, and every replay, ran under `torch.cuda.set_sync_debug_mode(\"error\")`: a host "
                      "sync would have failed the stage. Peak: torch.cuda.max_memory_allocated of the run. Loss: "
                      "the mean of the first and of the last quarter of the objective's calls.", "",
                  "| entry point | loss first -> last | step ms | DCL ms (share) | InfoNCE ms (share) | InfoNCE of | peak MiB |",
                  "|---|---|---:|---:|---:|---|---:|"]
        for r in timed:
            p, stage = r["dcl"]["probe"], STAGES[r["stage"]]
            loss = f"{p['loss_first']:.3g} -> {p['loss_last']:.3g}" if "loss_first" in p else ""
            lines.append(f"| {stage.entry} | {loss} | {_ms(p.get('step_ms'))} | "
                         f"{_share(p.get('objective_ms'), p.get('step_ms'))} | "
                         f"{_share(p.get('infonce_ms'), p.get('step_ms'))} | {stage.replayed} | "
                         f"{_ms(p.get('peak_memory_mib'))} |")
    if resume is not None:
        same = "bit-identical" if resume["bit_identical"] else f"max |difference| {resume['max_abs_diff']:.3g}"
        ok = ok and resume["bit_identical"]
        lines += ["", f"Resume (main job): killed after its half-way checkpoint and continued with `--resume`, the final "
                      f"weights against the uninterrupted run's: {same} ({resume['tensors']} tensors)."]
    if pair is not None:
        syncs = ("" if pair["host_syncs"] is None else
                 f"; host syncs raised in the objective's calls (sync debug mode \"warn\"): {pair['host_syncs']}"
                 + (f" (the first: {pair['first_sync']})" if pair["first_sync"] else ""))
        ok = ok and pair["equal"]
        lines += ["", f"Two processes (main job, {pair['processes']} processes, global batch as the one-process run's): "
                      f"the loss of the first {EQUAL_STEPS} steps (the processes' mean) against the one-process run's, "
                      f"largest relative difference {pair['max_rel_diff']:.2g} "
                      f"({'within' if pair['equal'] else 'OVER'} {pair['tolerance']:g}){syncs}."]
    lines += ["", "Logs: e2e-logs/ beside this file (one per run); the harness's JSON and the recipes' summaries: "
                  "e2e-runs/."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "untrained": untrained, "resume": resume,
                                                    "two_processes": pair, "command": command, "commit": commit},
                                                   indent=1) + "\n")
    return all_ran, ok


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="two checkpoints' weights")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--out", type=Path, required=True)
    w = sub.add_parser("write", help="e2e.md from a run folder")
    w.add_argument("run", type=Path)
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--command", default="bash tools/gpu/e2e.sh")
    w.add_argument("--commit", default="unknown")
    w.add_argument("--require-learned", action="store_true",
                   help="exit 1 unless every run learned, the resume matched and two processes equalled one too")
    a = p.parse_args(argv)
    if a.command == "compare":
        a.out.write_text(json.dumps(compare(a.a, a.b)) + "\n")
    else:
        ran, learned = write(a.run, a.out, a.command, a.commit)
        print(a.out.read_text())
        raise SystemExit(0 if ran and (learned or not a.require_learned) else 1)


if __name__ == "__main__":
    main()
