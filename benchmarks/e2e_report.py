"""The table of benchmarks/gpu_e2e.sh: one row per entry point from the harness's JSON files
(benchmarks/e2e_probe.py) and each stage's exit status, and the resume check of the main job.

    python benchmarks/e2e_report.py compare RUN/checkpoint_200 RESUMED/checkpoint_200 --out resume.json
    python benchmarks/e2e_report.py write RUN_DIR --out docs/gpu/<device>/e2e.md --command "..." --commit abc123
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# stage name -> (entry point, the ecosystem's InfoNCE beside it), in the table's order
ENTRY_POINTS = {
    "clip": ("`accelerate launch recipes/clip/train.py` (main job)", "open_clip ClipLoss"),
    "vision_simclr": ("recipes/vision SimCLR", "contrastkit InfoNCE"),
    "vision_moco": ("recipes/vision MoCo (`backend=triton`)", "contrastkit InfoNCE"),
    "wav2vec2": ("recipes/wav2vec2 (Hugging Face backend)", "Wav2Vec2ForPreTraining's"),
    "clap": ("recipes/clap", "transformers clip_loss"),
    "open_clip": ("`python -m contrastkit.adapters.open_clip` (open_clip_train)", "open_clip ClipLoss"),
    "run_clip": ("transformers run_clip.py + one import", "transformers clip_loss"),
    "run_wav2vec2": ("transformers wav2vec 2.0 pre-training + one import", "Wav2Vec2ForPreTraining's"),
    "st": ("SentenceTransformerTrainer + MultipleNegativesLoss", "MNRL"),
    "st_cached": ("SentenceTransformerTrainer + CachedMultipleNegativesLoss", "MNRL"),
}


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


def _ms(x) -> str:
    return "" if x is None else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def _share(part, step) -> str:
    return "" if part is None or not step else f"{_ms(part)} ({100 * part / step:.0f} %)"


def rows(run: Path) -> list[dict]:
    out = []
    for name, (entry, reference) in ENTRY_POINTS.items():
        status = run / f"{name}.status"
        if not status.exists():
            continue
        rc = int(status.read_text().strip() or 1)
        probe = run / f"{name}.json"
        result = json.loads(probe.read_text()) if probe.exists() else {}
        out.append({"stage": name, **result, "entry": entry, "reference": reference, "rc": rc})
    return out


def write(run: Path, out: Path, command: str, commit: str) -> tuple[bool, bool]:
    """e2e.md and e2e.json beside it; (every stage ran, every stage learned and the resume matched)."""
    table = rows(run)
    resume = json.loads((run / "resume.json").read_text()) if (run / "resume.json").exists() else None
    device = next((r.get("device_name") or r.get("device") for r in table if r.get("device")), "unknown")
    lines = [f"# End-to-end on {device}", "",
             f"Command: `{command}`", "", f"Commit: {commit}", "",
             "Each entry point trains for a short run in bf16 as its own ecosystem does it (accelerate's "
             "`--mixed_precision bf16`, open_clip_train's `--precision amp_bf16`, the Trainer's `--bf16 --tf32 True`) "
             "with the objective DCL (benchmarks/gpu_e2e.sh). Learned: the mean loss of the last quarter of the "
             "objective's training calls is at least 5 % below the first quarter's (first -> last given). Step: the "
             "median interval between optimizer steps on the GPU's timeline (CUDA events), after the first fifth. "
             "DCL and InfoNCE: forward + backward of the loss alone, replayed on the last step's own features "
             "under the step's autocast, times the calls per step (CUDA events, median of 10), with the share of "
             "the step in brackets; InfoNCE is the ecosystem's own loss named in its column. Every objective call "
             "after the first 3, and every replay, ran under `torch.cuda.set_sync_debug_mode(\"error\")`: a host "
             "sync would have failed the stage. Peak: torch.cuda.max_memory_allocated of the run.", "",
             "| entry point | ran | learned (first -> last) | step ms | DCL ms (share) | InfoNCE ms (share) | InfoNCE of | peak MiB |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    all_ran, all_learned = bool(table), True
    for r in table:
        ran = r["rc"] == 0 and r.get("calls", 0) > 0
        learned = r.get("learned")
        all_ran, all_learned = all_ran and ran, all_learned and bool(learned)
        learn = "" if learned is None else f"{'yes' if learned else 'NO'} ({r['loss_first']:.3g} -> {r['loss_last']:.3g})"
        ran_text = "yes" if ran else f"NO (exit {r['rc']})"
        lines.append(f"| {r['entry']} | {ran_text} | {learn} | {_ms(r.get('step_ms'))} | "
                     f"{_share(r.get('objective_ms'), r.get('step_ms'))} | {_share(r.get('infonce_ms'), r.get('step_ms'))} | "
                     f"{r['reference']} | {_ms(r.get('peak_memory_mib'))} |")
    if resume is not None:
        same = "bit-identical" if resume["bit_identical"] else f"max |difference| {resume['max_abs_diff']:.3g}"
        all_learned = all_learned and resume["bit_identical"]
        lines += ["", f"Resume (main job): killed after its half-way checkpoint and continued with `--resume`, the final "
                      f"weights against the uninterrupted run's: {same} ({resume['tensors']} tensors)."]
    lines += ["", "Logs: e2e-logs/ beside this file (one per entry point)."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"rows": table, "resume": resume, "command": command,
                                                    "commit": commit}, indent=1) + "\n")
    return all_ran, all_learned


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
    w.add_argument("--command", default="bash benchmarks/gpu_e2e.sh")
    w.add_argument("--commit", default="unknown")
    w.add_argument("--require-learned", action="store_true",
                   help="exit 1 unless every stage learned and the resume matched too (the GPU run's sizes)")
    a = p.parse_args(argv)
    if a.command == "compare":
        a.out.write_text(json.dumps(compare(a.a, a.b)) + "\n")
    else:
        ran, learned = write(a.run, a.out, a.command, a.commit)
        print(a.out.read_text())
        raise SystemExit(0 if ran and (learned or not a.require_learned) else 1)


if __name__ == "__main__":
    main()
