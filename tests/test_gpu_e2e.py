"""The GPU scripts, proven on the CPU before a GPU machine is lent. benchmarks/gpu_e2e.sh's --dry-run runs
every entry point (recipes, open_clip_train, transformers' scripts, SentenceTransformerTrainer) under the
harness at tiny sizes, and the report has a row per entry point with the harness's timings;
benchmarks/gpu_check.sh's --dry-run runs its quick plan's jobs at N = 64 (every method it names is known)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e_report  # noqa: E402


@pytest.mark.slow
def test_dry_run_runs_every_entry_point(tmp_path):
    """Every stage exits 0 with the objective seen in training (its calls, one or more a step), the step
    and replay timings present, the ecosystem's InfoNCE timed beside DCL, and the main job's resume from
    its half-way checkpoint bit-identical to the uninterrupted run on the CPU."""
    env = {**os.environ, "E2E_WORK": str(tmp_path / "e2e"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_e2e.sh"), "--dry-run"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "e2e" / "report" / "e2e.json").read_text())
    rows = {r["stage"]: r for r in report["rows"]}
    assert list(rows) == list(e2e_report.ENTRY_POINTS)
    for name, r in rows.items():
        assert r["rc"] == 0 and r["calls"] >= r["steps"] > 0, (name, r)
        assert r["step_ms"] > 0 and r["objective_ms"] > 0 and r["infonce_ms"] > 0, (name, r)
    assert report["resume"]["bit_identical"], report["resume"]
    md = (tmp_path / "e2e" / "report" / "e2e.md").read_text()
    assert md.count("| yes |") == len(rows)


def test_budget_spent_runs_no_stage_and_still_reports(tmp_path):
    """E2E_BUDGET: past it no stage starts (each one says so) and the report is still written (empty, exit 1:
    nothing ran), so a device call that runs gpu_check.sh after it keeps its time."""
    env = {**os.environ, "E2E_WORK": str(tmp_path / "e2e"), "E2E_BUDGET": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_e2e.sh"), "--dry-run"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("not run (E2E_BUDGET=0 s spent)") == len(e2e_report.ENTRY_POINTS), done.stdout
    assert (tmp_path / "e2e" / "report" / "e2e.md").exists()


@pytest.mark.quick
def test_compare_names_a_difference(tmp_path):
    """The resume check reads two checkpoints' weights: equal ones are bit-identical, a changed entry is not,
    with its difference."""
    from safetensors.torch import save_file

    weights = {"w": torch.randn(3, 4), "b": torch.zeros(2)}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        save_file(weights, str(tmp_path / name / "model.safetensors"))
    assert e2e_report.compare(tmp_path / "a", tmp_path / "b")["bit_identical"]
    save_file({**weights, "b": torch.tensor([0.0, 0.25])}, str(tmp_path / "b" / "model.safetensors"))
    result = e2e_report.compare(tmp_path / "a", tmp_path / "b")
    assert not result["bit_identical"] and result["max_abs_diff"] == 0.25


@pytest.mark.slow
def test_gpu_check_quick_plan_dry_run(tmp_path):
    """gpu_check.sh's default plan on the CPU: each job (bf16 at the issue's sizes, float32 with TF32, image-text
    at a million pairs, here all at N = 64) runs and writes its table; the CUDA-only methods are named and
    skipped, so a misspelt one fails here, not in a lease."""
    env = {**os.environ, "TESTS": "0", "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tables = sorted(p.parent.name for p in tmp_path.rglob("losses.json"))
    assert tables == ["bfloat16", "bfloat16-small", "float32-tf32", "image-text-1m"], tables
    assert done.stdout.count("skipped CUDA only") >= 10
    model = next(tmp_path.rglob("perf_model.md")).read_text()  # the model from the rates measured (on the CPU)
    assert "Rates, measured on cpu" in model and "### Predicted: image-text" in model
