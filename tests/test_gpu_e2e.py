"""The GPU scripts, proven on the CPU before a GPU machine is lent. tools/gpu/e2e.sh's --dry-run runs
every entry point (recipes, open_clip_train, transformers' scripts, SentenceTransformerTrainer) under the
harness at tiny sizes, with DCL and with the ecosystem's own loss, the recipes' untrained baselines and the main
job on two processes; the report judges each by its criterion (tools/gpu/e2e_report.py, checked here on made-up
runs) and has the harness's timings; tools/gpu/check.sh's --dry-run runs its quick plan's jobs at N = 64
(every method it names is known) and saves the CUDA tests' results; tools/gpu/plan.sh's two calls pack
their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))

import e2e_probe  # noqa: E402
import e2e_report  # noqa: E402

OWN = [name for name, stage in e2e_report.STAGES.items() if stage.own]
RUNS = [*e2e_report.STAGES, *e2e_report.UNTRAINED_RUNS, *(f"{name}-own" for name in OWN)]


def _script(name: str, *args, env=None, timeout=600):
    bin_dir = str(Path(sys.executable).parent)  # this interpreter's environment, activated or not
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **(env or {})}
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu" / name), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_dry_run_runs_every_entry_point(tmp_path):
    """Every run exits 0 with its objective seen in training: DCL's calls (one or more a step) with the step and
    replay timings and the ecosystem's InfoNCE timed beside, the ecosystem's own loss watched in its own run
    (calls, top-1 and chance each), the recipes' evaluations in their summaries (the untrained runs' too); the
    main job's resume from its half-way checkpoint bit-identical, and on two CPU processes (gloo, the harness's
    shared-device launch) its first steps' loss equal to one process's."""
    done = _script("e2e.sh", "--dry-run", env={"E2E_WORK": str(tmp_path / "e2e")}, timeout=3600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "e2e" / "report" / "e2e.json").read_text())
    rows = {r["stage"]: r for r in report["rows"]}
    assert list(rows) == list(e2e_report.STAGES)
    for name, r in rows.items():
        dcl = r["dcl"]["probe"]
        assert r["dcl"]["rc"] == 0 and dcl["calls"] >= dcl["steps"] > 0, (name, r["dcl"])
        assert len(dcl["top1"]) == len(dcl["chance"]) == dcl["calls"], name
        if name != "clip_2proc":  # its objective gathers: no replay on one process
            assert dcl["step_ms"] > 0 and dcl["objective_ms"] > 0 and dcl["infonce_ms"] > 0, (name, dcl)
            own = r["own"]["probe"]
            assert r["own"]["rc"] == 0 and own["calls"] >= own["steps"] > 0, (name, r["own"])
            assert len(own["top1"]) == own["calls"] and "objective_ms" not in own, name
        criterion = e2e_report.CRITERIA[e2e_report.STAGES[name].criterion]
        if criterion.read is not e2e_report.CRITERIA["top1"].read:  # a recipe's evaluation, and its baseline
            assert None not in (r["dcl_judged"]["untrained"], r["dcl_judged"]["trained"]), (name, r["dcl_judged"])
    for name in e2e_report.UNTRAINED_RUNS:
        assert report["untrained"][name]["rc"] == 0 and report["untrained"][name]["summary"], name
    assert report["resume"]["bit_identical"], report["resume"]
    pair = report["two_processes"]
    assert pair["processes"] == 2 and pair["equal"], pair
    assert sorted(p.stem for p in (tmp_path / "e2e" / "report" / "e2e-runs").glob("*.status")) == sorted(RUNS)


def test_budget_spent_runs_nothing_and_still_reports(tmp_path):
    """E2E_BUDGET: past it no run starts (each one says so) and the report is still written (empty, exit 1:
    nothing ran), so a device call that does more keeps its time."""
    done = _script("e2e.sh", "--dry-run", env={"E2E_WORK": str(tmp_path / "e2e"), "E2E_BUDGET": "0"}, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("not run (E2E_BUDGET=0 s spent)") == len(RUNS), done.stdout
    assert (tmp_path / "e2e" / "report" / "e2e.md").exists()


@pytest.mark.quick
def test_unknown_stage_is_one_error_line(tmp_path):
    done = _script("e2e.sh", "--dry-run", env={"STAGES": "clip clip_own"}, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: unknown run 'clip_own'"), done.stderr


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


# ---------------------------------------------------------------------- the criteria, on made-up runs

def _run(run: Path, name: str, rc: int = 0, probe: dict | None = None, summary: dict | None = None, rank1=None):
    (run / f"{name}.status").write_text(f"{rc}\n")
    (run / f"{name}.json").write_text(json.dumps({"calls": 8, "steps": 8, "device": "cpu", **(probe or {})}))
    if summary is not None:
        (run / f"{name}.summary.json").write_text(json.dumps(summary))
    if rank1 is not None:
        (run / f"{name}.rank1.json").write_text(json.dumps(rank1))


def _learned(run: Path, tmp_path: Path) -> dict:
    e2e_report.write(run, tmp_path / "report" / "e2e.md", "test", "abc")
    report = json.loads((tmp_path / "report" / "e2e.json").read_text())
    return {r["stage"]: (r["dcl_judged"] and r["dcl_judged"]["learned"], r["own_judged"] and r["own_judged"]["learned"])
            for r in report["rows"]}


def test_criteria_read_learning_not_a_falling_loss(tmp_path):
    """Each criterion compares the trained value with the untrained one by its margin: a loss that falls while
    the top-1 stays at chance (wav2vec 2.0's collapsing codebook) is not learning; a recipe's evaluation above its
    untrained run's by the margin is, below it is not; a run without its untrained baseline, or that failed, is not."""
    run = tmp_path / "run"
    run.mkdir()
    margin = e2e_report.CRITERIA["top1"].margin
    chance = {"chance_untrained": 0.05, "chance_trained": 0.3}  # fewer valid distractors: chance rose
    _run(run, "run_wav2vec2", probe={"loss_first": 3.0, "loss_last": 1.2, "top1_untrained": 0.05,
                                     "top1_trained": 0.3 + margin / 2, **chance})
    _run(run, "run_wav2vec2-own", probe={"top1_untrained": 0.05, "top1_trained": 0.3 + 2 * margin, **chance})
    knn = e2e_report.CRITERIA["knn"].margin
    _run(run, "vision-untrained", summary={"knn_top1": 0.25})
    _run(run, "vision_moco", summary={"knn_top1": 0.25 + 2 * knn})
    _run(run, "vision_moco-own", summary={"knn_top1": 0.25 + knn / 2})
    _run(run, "vision_simclr", summary={"knn_top1": 0.5}, rc=1)
    _run(run, "clip", summary={"zeroshot_top1": 0.4})  # no clip-untrained run
    assert _learned(run, tmp_path) == {"clip": (False, None), "vision_simclr": (False, None),
                                       "vision_moco": (True, False), "run_wav2vec2": (False, True)}
    md = (tmp_path / "report" / "e2e.md").read_text()
    assert "| recipes/vision MoCo (`backend=triton`) | knn | 0.250 | 0.290 |" in md, md
    assert "NO (exit 1) / not run" in md


def test_recipe_evaluations_are_read_where_the_recipes_write_them(tmp_path):
    """wav2vec 2.0: held-out accuracy above each model's own chance; CLAP: the summary's trained and untrained
    zero-shot intent accuracy; the main job: zero-shot top-1 against its --steps 0 run's."""
    run = tmp_path / "run"
    run.mkdir()
    pretext = {"trained": {"accuracy": 0.30, "chance": 0.10}, "untrained": {"accuracy": 0.06, "chance": 0.05}}
    _run(run, "wav2vec2", summary={"pretext": pretext})
    collapsed = {"trained": {"accuracy": 0.30, "chance": 0.29}, "untrained": {"accuracy": 0.06, "chance": 0.05}}
    _run(run, "wav2vec2-own", summary={"pretext": collapsed})
    _run(run, "clap", summary={"zeroshot_intent": {"accuracy": 0.5}, "zeroshot_intent_untrained": {"accuracy": 0.1}})
    _run(run, "clip-untrained", summary={"zeroshot_top1": 0.12})
    _run(run, "clip", summary={"zeroshot_top1": 0.30})
    _run(run, "clip-own", summary={"zeroshot_top1": 0.13})
    assert _learned(run, tmp_path) == {"clip": (True, False), "wav2vec2": (True, False), "clap": (True, None)}


def test_two_processes_against_one(tmp_path):
    """The two-process run's loss, the mean of its processes' call by call, against the one-process run's in
    the first steps: equal within float32's tolerance on the CPU, not when a step differs."""
    run = tmp_path / "run"
    run.mkdir()
    one = [4.0, 3.9, 3.8, 3.7, 3.6, 3.0]
    _run(run, "clip", probe={"losses": one})
    _run(run, "clip_2proc", probe={"losses": [x - 0.1 for x in one], "host_syncs": 0},
         rank1={"losses": [x + 0.1 for x in one]})
    pair = e2e_report.two_processes(e2e_report.run_of(run, "clip"), e2e_report.run_of(run, "clip_2proc"))
    assert pair["processes"] == 2 and pair["max_rel_diff"] < 1e-12 and pair["equal"]
    _run(run, "clip_2proc", probe={"losses": [x - 0.1 for x in one]}, rank1={"losses": [x + 0.11 for x in one]})
    pair = e2e_report.two_processes(e2e_report.run_of(run, "clip"), e2e_report.run_of(run, "clip_2proc"))
    assert not pair["equal"] and pair["max_rel_diff"] > e2e_report.EQUAL_TOLERANCE["cpu"]


# ---------------------------------------------------------------------- the harness's top-1

def test_top1_of_pairs_logits_and_frames():
    """Pairs: row i's positive is row i of the other side (cosine: scale does not matter); logits: the diagonal;
    frames: the target above every valid distractor, chance the mean of 1 / (1 + valid), frames without a valid
    distractor or outside the mask left out."""
    a = torch.eye(4)
    hits, chance = e2e_probe._pairs(a, 3 * a)
    assert hits.item() == 1.0 and chance.item() == 0.25
    hits, _ = e2e_probe._pairs(a, a[[1, 0, 2, 3]])  # rows 0 and 1 swapped: half right
    assert hits.item() == 0.5
    hits, chance = e2e_probe._diagonal(torch.tensor([[2.0, 1.0, 0.0], [3.0, 1.0, 0.0]]))
    assert hits.item() == 0.5 and chance.item() == pytest.approx(1 / 3)
    pos = torch.tensor([0.9, 0.1, 0.5, 0.7])
    neg = torch.tensor([[0.5, 0.95], [0.0, 0.2], [0.9, 0.9], [0.1, 0.2]])
    valid = torch.tensor([[True, False], [True, True], [False, False], [True, True]])
    hits, chance = e2e_probe._frames(pos, neg, valid)  # frame 2 has no valid distractor
    assert hits.item() == pytest.approx(2 / 3) and chance.item() == pytest.approx((1 / 2 + 1 / 3 + 1 / 3) / 3)
    hits, chance = e2e_probe._frames(pos, neg, valid, frames=torch.tensor([1, 1, 1, 0]))
    assert hits.item() == pytest.approx(1 / 2) and chance.item() == pytest.approx((1 / 2 + 1 / 3) / 2)


# ---------------------------------------------------------------------- gpu_check.sh and the plan

@pytest.mark.slow
def test_plan_dry_run_packs_each_calls_results(tmp_path):
    """gpu_plan.sh's two calls on the CPU (a few runs of gpu_e2e.sh): call 1 packs the CUDA tests' results, the
    baselines' and the DCL stages' report and runs; call 2, on the same work folder, the stage call 1 left
    (none: it runs nothing again), the report over both, the profile and gpu_check.sh's benchmark: each job of
    its quick plan (bf16 at the issue's sizes, float32 with TF32, image-text at a million pairs, here all at
    N = 64) writes its table, and the CUDA-only methods are named and skipped, so a misspelt one fails here,
    not in a lease."""
    env = {"OUT": str(tmp_path / "out"), "E2E_WORK": str(tmp_path / "e2e"), "STAGES": "clip clip-untrained clip-own"}
    (tmp_path / "out").mkdir()
    for call in ("1", "2"):
        done = _script("plan.sh", call, "--dry-run", env=env, timeout=1800)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        with tarfile.open(tmp_path / "out" / f"gpu-call{call}.tgz") as tar:
            names = set(tar.getnames())
        assert {"dry-run/e2e.md", "dry-run/e2e.json", "dry-run/e2e-runs/clip.json", f"dry-run/plan-call{call}.log",
                "dry-run/tests-cuda.xml", "dry-run/tests-cuda.log"} <= names, sorted(names)
    assert "dry-run/bfloat16-small/losses.json" in names, sorted(names)
    log = (tmp_path / "out" / "results" / "dry-run" / "e2e-call2.log").read_text()
    assert "== clip:" not in log  # call 1's stage is not run again
    report = json.loads((tmp_path / "out" / "results" / "dry-run" / "e2e.json").read_text())
    assert report["rows"][0]["dcl"]["rc"] == 0 and report["rows"][0]["own"]["rc"] == 0
    results = tmp_path / "out" / "results" / "dry-run"
    tables = sorted(p.parent.name for p in results.rglob("losses.json"))
    assert tables == ["bfloat16", "bfloat16-small", "float32-tf32", "image-text-1m"], tables
    assert (results / "bench.log").read_text().count("skipped CUDA only") >= 10
    model = (results / "perf_model.md").read_text()  # the model from the rates measured (on the CPU)
    assert "Rates, measured on cpu" in model and "### Predicted: image-text" in model
    assert "<testsuite" in (results / "tests-cuda.xml").read_text()
    assert "skipped" in (results / "tests-cuda.log").read_text()
    assert (results / "profile" / "profile.md").exists()
