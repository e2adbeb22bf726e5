"""Recipes as a user runs them: killed by SIGKILL (during a step, during a checkpoint write) and resumed,
they end with the parameters of an uninterrupted run; --report-to tensorboard writes event files. The killed
one-process runs are processes of their own (forked from the test's), the killed two-process run `accelerate
launch`; the other one-process runs (the uninterrupted one, the resumes, tensorboard's) run the same command in the test's
process."""

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contrastkit.training import latest_checkpoint
from launch import accelerate_launch, run_forked, run_here, run_ranks

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--train-images", "64", "--test-images", "32", "--batch-size", "8", "--width", "8", "--proj-hidden", "32",
        "--proj-dim", "16", "--threads", "1", "--no-progress", "--log-every", "1", "--steps", "6", "--knn-k", "5",
        "--method", "simclr", "--loss", "dcl", "--checkpoint-every", "1"]


def run(out_dir, *extra, kill_at=None):
    """The vision recipe's command; with kill_at, a process of its own (forked from this one: launch.run_forked)
    that is SIGKILLed there (tests/scripts/killed_run.py); without, in this process (launch.run_here: the
    uninterrupted and the resumed runs, whose process is not what they test)."""
    argv = [str(ROOT / "recipes/vision/train.py"), *TINY, "--out-dir", str(out_dir), *extra]
    if not kill_at:
        return run_here(argv[0], argv[1:], cwd=ROOT)
    return run_forked(ROOT / "tests/scripts/killed_run.py", argv, cwd=ROOT, PYTHONPATH=ROOT, KILL_AT=kill_at)


def final_weights(out_dir):
    return load_file(str(latest_checkpoint(out_dir) / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    done = run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("kill_at", ["step:4", "save:4"])
def test_sigkill_then_resume_reaches_the_uninterrupted_parameters(straight, tmp_path, kill_at):
    killed = run(tmp_path, kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    if kill_at.startswith("save"):
        assert "checkpoint_4" in names and not (tmp_path / "checkpoints/checkpoint_4/COMPLETE").exists()
    assert latest_checkpoint(tmp_path).name == "checkpoint_3"  # never the half-written one
    resumed = run(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr and "checkpoint_3" in resumed.stdout + resumed.stderr
    a, b = final_weights(straight), final_weights(tmp_path)
    assert latest_checkpoint(tmp_path).name == "checkpoint_6" and a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2  # --keep-checkpoints 2 (the default)


def test_keep_one_killed_during_the_second_save_resumes_from_the_first(straight, tmp_path):
    """--keep-checkpoints 1: the old checkpoint is removed only once the new one is complete, so a run killed
    while writing checkpoint_2 still has checkpoint_1 (accelerate's total_limit had deleted it first)."""
    killed = run(tmp_path, "--keep-checkpoints", "1", kill_at="save:2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert latest_checkpoint(tmp_path).name == "checkpoint_1"
    resumed = run(tmp_path, "--keep-checkpoints", "1", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / 'checkpoint_1'}" in resumed.stdout + resumed.stderr
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["checkpoint_6"]
    a, b = final_weights(straight), final_weights(tmp_path)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def launch_killed(out_dir, rank: int) -> subprocess.CompletedProcess:
    """The vision recipe on 2 CPU processes (gloo) under accelerate launch, process ``rank`` SIGKILLed inside
    optimizer step 4."""
    command, env = accelerate_launch(2, PYTHONPATH=str(ROOT), KILL_AT="step:4", KILL_RANK=str(rank))
    return subprocess.run([*command, str(ROOT / "tests/scripts/killed_run.py"), str(ROOT / "recipes/vision/train.py"),
                           *TINY, "--out-dir", str(out_dir)], env=env, capture_output=True, text=True, timeout=240,
                          cwd=ROOT)


@pytest.mark.slow
def test_two_processes_one_killed_end_by_themselves_and_resume_exactly(tmp_path):
    """Rank 1 SIGKILLed mid-step under accelerate launch: the launcher ends the run (no hang: the timeout would
    fail the test), and --resume on 2 processes reaches the uninterrupted 2-process run's weights bit for bit (the
    uninterrupted run and the resume, which are not about the launcher, on ranks forked from this process)."""
    def ranks(out_dir, *extra):
        done = run_ranks(ROOT / "recipes/vision/train.py", [*TINY, "--out-dir", out_dir, *extra], cwd=ROOT)
        assert [r.returncode for r in done] == [0, 0], done[0].stdout[-3000:] + done[1].stdout[-3000:]

    ranks(tmp_path / "straight")
    killed = launch_killed(tmp_path / "killed", 1)
    assert killed.returncode != 0
    assert latest_checkpoint(tmp_path / "killed").name == "checkpoint_3"
    ranks(tmp_path / "killed", "--resume")
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_report_to_tensorboard_writes_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    done = run(tmp_path, "--report-to", "tensorboard", "--steps", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    events = list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert events, sorted(str(p) for p in tmp_path.rglob("*"))
    logged = {}
    for path in events:
        acc = EventAccumulator(str(path.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            logged[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    jsonl = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "loss" in r}
    assert set(logged["loss"]) == {1, 2, 3}
    for step, value in jsonl.items():
        assert logged["loss"][step] == pytest.approx(value, rel=1e-6)
    assert "knn_top1" in logged
