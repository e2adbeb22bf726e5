"""A preempted job loses nothing (issue 42): SIGTERM or the --requeue-signal, sent to every process of a run or to
one, stops every process at the same step boundary with a complete checkpoint of that step, one line naming it
and exit status 75; the same command with --resume auto then ends with the uninterrupted run's weights and
optimizer state bit for bit. A signal during a checkpoint write lets the write finish; more signals while
stopping change nothing. Real processes and real signals, on the CPU (the main job: the CLIP recipe), forked from
the test's process (launch.Forked: their imports paid once) but under `accelerate launch`, whose launcher's part is
the subject; the one-process runs that no signal reaches (the uninterrupted run, the resumes) run in the test's
process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contrastkit.training import COMPLETE, RUN_CONFIG, STOPPED, latest_checkpoint
from launch import Forked, accelerate_launch, rank_environments, run_here

ROOT = Path(__file__).resolve().parents[1]
SIGNALLED = str(ROOT / "tests/scripts/signalled_run.py")
CLIP = str(ROOT / "recipes/clip/train.py")
LINE = "stopped on {signal} at step {step}: checkpoint {path} is complete; exit status 75"


def clip_argv(data_dir, out, *extra) -> list[str]:
    """The main job, tiny: 6 steps, a checkpoint every 3 (a lost peer: an error within 120 s, not 30 minutes)."""
    return ["--data-dir", str(data_dir), "--num-train", "64", "--zeroshot-per-class", "4", "--batch-size", "8",
            "--steps", "6", "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--save-every", "3",
            "--no-progress", "--ddp-timeout", "120", "--out-dir", str(out), *extra]


def start(argv, env=None, **extra_env) -> Forked:
    """The signalled main job in a process of its own, forked from this one (launch.Forked: real signals, the
    imports already paid)."""
    env = {**(env or {**os.environ, "OMP_NUM_THREADS": "1"}), "PYTHONPATH": str(ROOT), **extra_env}
    return Forked(SIGNALLED, [CLIP, *argv], env, cwd=ROOT)


def finish(process, timeout: float = 300) -> tuple[int, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out + err


def run(argv, **env) -> tuple[int, str]:
    """The main job's command: signalled (``env``: SIGNAL_AT, ...), a process of its own; an uninterrupted run or
    a resume, which no signal reaches, in this process (launch.run_here, no start-up paid)."""
    if not env:
        done = run_here(CLIP, argv, cwd=ROOT)
        return done.returncode, done.stdout + done.stderr
    return finish(start(argv, **env))


def signal_when_held(processes, hold: Path, targets, signum=signal.SIGTERM, timeout: float = 240) -> None:
    """Wait until every process stalls inside optimizer step HOLD_AT (signalled_run.py), send ``signum`` to the
    ``targets`` (indices into ``processes``), then let them go on."""
    deadline = time.time() + timeout
    while not all(Path(f"{hold}.held.{r}").exists() for r in range(len(processes))):
        dead = [p.returncode for p in processes if p.poll() is not None]
        assert not dead and time.time() < deadline, [finish(p)[1][-3000:] for p in processes]
        time.sleep(0.05)
    for i in targets:
        processes[i].send_signal(signum)
    time.sleep(0.3)  # delivered (the handler runs at once: the process is in Python, sleeping)
    hold.write_text("go")


def assert_same_state(a: Path, b: Path) -> None:
    """The newest checkpoints of two runs hold the same weights and optimizer state, bit for bit."""
    ca, cb = latest_checkpoint(a), latest_checkpoint(b)
    assert ca.name == cb.name, (ca, cb)
    wa, wb = load_file(str(ca / "model.safetensors")), load_file(str(cb / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=0, msg=name)
    oa = torch.load(ca / "optimizer.bin", weights_only=False)["state"]
    ob = torch.load(cb / "optimizer.bin", weights_only=False)["state"]
    for key in oa:
        for name in oa[key]:
            assert torch.equal(oa[key][name], ob[key][name]), (key, name)


def logged_steps(out: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def complete(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").is_file())


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    """The uninterrupted one-process run."""
    out = tmp_path_factory.mktemp("straight")
    code, text = run(clip_argv(data_dir, out))
    assert code == 0, text[-3000:]
    return out


def test_sigterm_between_checkpoints_stops_there_and_the_requeued_command_carries_on(straight, data_dir, tmp_path):
    """SIGTERM from outside during step 5 (checkpoints at 3 and 6): checkpoint_5, complete, exit status 75; the
    same command with --resume auto ends bit-identical to the uninterrupted run."""
    out, hold = tmp_path / "run", tmp_path / "hold"
    argv = clip_argv(data_dir, out, "--resume", "auto")
    process = start(argv, HOLD_AT="step:5", HOLD_FILE=str(hold))
    signal_when_held([process], hold, [0])
    code, text = finish(process)
    assert code == STOPPED == 75, text[-3000:]
    assert LINE.format(signal="SIGTERM", step=5, path=out / "checkpoints" / "checkpoint_5") in text, text[-3000:]
    assert "Traceback" not in text and "error:" not in text
    assert complete(out) == ["checkpoint_3", "checkpoint_5"] and logged_steps(out) == [1, 2, 3, 4, 5]

    code, text = run(argv)
    assert code == 0, text[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'checkpoint_5'}" in text
    assert_same_state(straight, out)
    assert logged_steps(out) == [1, 2, 3, 4, 5, 6]


def test_a_signal_during_a_checkpoint_write_finishes_it_and_more_signals_change_nothing(straight, data_dir, tmp_path):
    """SIGTERM then SIGUSR1 while checkpoint_3 is written (between its model file and the rest): the write
    finishes, COMPLETE, and the run stops there. Resumed, SIGTERM in step 5, and SIGTERM and SIGUSR1 again while
    the stop's own checkpoint_5 is written: it too finishes and loads; the next resume ends bit-identical."""
    out = tmp_path / "run"
    argv = clip_argv(data_dir, out, "--resume", "auto")
    code, text = run(argv, SIGNAL_AT="save:3:TERM,save:3:USR1")
    assert code == STOPPED, text[-3000:]
    assert LINE.format(signal="SIGTERM", step=3, path=out / "checkpoints" / "checkpoint_3") in text
    assert complete(out) == ["checkpoint_3"]

    code, text = run(argv, SIGNAL_AT="step:2:TERM,save:5:TERM,save:5:USR1")  # this process's 2nd step: step 5
    assert code == STOPPED, text[-3000:]
    assert LINE.format(signal="SIGTERM", step=5, path=out / "checkpoints" / "checkpoint_5") in text
    assert complete(out) == ["checkpoint_3", "checkpoint_5"] and text.count("stopped on") == 1

    code, text = run(argv)
    assert code == 0 and f"resumed from {out / 'checkpoints' / 'checkpoint_5'}" in text, text[-3000:]
    assert_same_state(straight, out)


def test_usr1_with_requeue_signal_and_requeue_on_signal_requeues_the_slurm_job(data_dir, tmp_path):
    """SIGUSR1 (--requeue-signal USR1, as sbatch --signal=USR1@90 sends it) stops the run as SIGTERM does, and
    with --requeue-on-signal in a SLURM job the first process runs scontrol requeue <job> before it exits (a
    stand-in scontrol on PATH records its arguments)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol.txt"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n")
    (bin_dir / "scontrol").chmod(0o755)
    out = tmp_path / "run"
    code, text = run(clip_argv(data_dir, out, "--requeue-signal", "USR1", "--requeue-on-signal"),
                     SIGNAL_AT="step:2:USR1", SLURM_JOB_ID="4242", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert code == STOPPED, text[-3000:]
    line = LINE.format(signal="SIGUSR1", step=2, path=out / "checkpoints" / "checkpoint_2")
    assert f"{line} (stopped to be requeued" in text and "SLURM job 4242 requeued (scontrol requeue 4242)" in text
    assert record.read_text() == "requeue 4242\n"
    assert complete(out) == ["checkpoint_2"]


@pytest.fixture(scope="module")
def straight_two(data_dir, tmp_path_factory):
    """The uninterrupted run on two processes."""
    out = tmp_path_factory.mktemp("straight_two")
    processes = [start(clip_argv(data_dir, out), env) for env in rank_environments(2)]
    for p in processes:
        code, text = finish(p)
        assert code == 0, text[-3000:]
    return out


def _loaded(path: Path):
    """A checkpoint file's content: safetensors' tensors, or what torch.save wrote (accelerate's optimizer,
    scheduler, RNG states and registered objects; two saves of one state differ in their bytes, as torch.save
    writes a serialization id of its own each time)."""
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, weights_only=False)


def _equal(a, b) -> bool:
    """Equal to the bit: tensors and arrays by value and dtype, containers item by item."""
    import numpy as np

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Two checkpoints hold one state: the same files, each one's content equal (weights, optimizer, scheduler,
    every process's RNG states, the run's step), but the run's config, which names its folder, and the COMPLETE
    marker, which gives that file's size."""
    names = sorted(f.name for f in a.iterdir())
    assert names == sorted(f.name for f in b.iterdir()), (names, sorted(f.name for f in b.iterdir()))
    for name in names:
        if name not in (RUN_CONFIG, COMPLETE):
            assert _equal(_loaded(a / name), _loaded(b / name)), name


def test_two_processes_stop_at_the_same_step_and_carry_on(straight_two, data_dir, tmp_path):
    """Two processes started as srun starts a job's tasks; SIGTERM while both stall in step 4, sent to both (as
    SLURM signals a job) and, in a second run, to process 1 alone (a lost task): in each both stop after step 5
    (the agreement is read one boundary after it starts) with checkpoint_5 and exit status 75, the two runs'
    checkpoint_5 the same state; --resume auto on two processes (from the lost task's run) ends bit-identical to
    the uninterrupted two-process run. One resume for the two stops: each is two processes' start-up."""
    outs = {}
    for name, targets in (("every-process", (0, 1)), ("one-process", (1,))):
        out, hold = tmp_path / name, tmp_path / f"{name}.hold"
        argv = clip_argv(data_dir, out, "--resume", "auto")
        processes = [start(argv, env) for env in rank_environments(2, HOLD_AT="step:4", HOLD_FILE=str(hold))]
        signal_when_held(processes, hold, targets)
        results = [finish(p) for p in processes]
        assert [code for code, _ in results] == [STOPPED, STOPPED], (name, [text[-3000:] for _, text in results])
        assert LINE.format(signal="SIGTERM", step=5, path=out / "checkpoints" / "checkpoint_5") in results[0][1]
        assert complete(out) == ["checkpoint_3", "checkpoint_5"], name
        outs[name] = out
    assert_same_checkpoint(*(out / "checkpoints" / "checkpoint_5" for out in outs.values()))

    processes = [start(clip_argv(data_dir, outs["one-process"], "--resume", "auto"), env)
                 for env in rank_environments(2)]
    for p in processes:
        code, text = finish(p)
        assert code == 0, text[-3000:]
    assert_same_state(straight_two, outs["one-process"])


def test_under_accelerate_launch_the_launcher_forwards_the_signal(data_dir, tmp_path):
    """The docs' SLURM example: one `accelerate launch` per machine, SIGUSR1 to the launcher and its workers
    (SLURM signals every process of the job step). With SIGUSR1 among torchrun's PET_SIGNALS_TO_HANDLE the
    launcher passes it on and waits for the workers, which stop with a complete checkpoint (without it the
    launcher dies of the signal at once, taking the job step with it under SLURM)."""
    out, hold = tmp_path / "run", tmp_path / "hold"
    command, env = accelerate_launch(2, PYTHONPATH=str(ROOT), HOLD_AT="step:4", HOLD_FILE=str(hold),
                                     PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    launcher = subprocess.Popen([*command, SIGNALLED, CLIP, *clip_argv(data_dir, out)], env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not all(Path(f"{hold}.held.{r}").exists() for r in range(2)):
        assert launcher.poll() is None and time.time() < deadline, finish(launcher)[1][-3000:]
        time.sleep(0.05)
    for pid in [launcher.pid, *(int(Path(f"{hold}.held.{r}").read_text()) for r in range(2))]:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.3)
    hold.write_text("go")
    code, text = finish(launcher)
    assert code != 0 and code != -signal.SIGUSR1, text[-3000:]  # torchrun's own status: 1 after a signal
    assert LINE.format(signal="SIGUSR1", step=5, path=out / "checkpoints" / "checkpoint_5") in text, text[-3000:]
    assert complete(out) == ["checkpoint_3", "checkpoint_5"]


@pytest.fixture(scope="module")
def fsc(tmp_path_factory) -> str:
    """The tiny FSC copy (tests/speech_copies.py: 24 training utterances), made once: the speech recipes' runs
    stop at step 2, so what they cost is their set-up, most of it loading (CLAP: featurising) their data."""
    from speech_copies import tiny_copies

    return str(tiny_copies(tmp_path_factory.mktemp("speech"))[0])


def _recipe(name: str, out: Path, data_dir: Path, fsc: str):
    """(train, config) of a tiny run of each recipe: 4 steps, no periodic checkpoint before the end (CLAP: batches
    of 4, a batch holding different intents, of the copy's 5)."""
    if name == "clip":
        from contrastkit.clip.train import ClipTrainConfig, train

        return train, ClipTrainConfig(data_dir=str(data_dir), num_train=64, zeroshot_per_class=4, batch_size=8, steps=4,
                                      warmup=1, log_every=1, eval_every=0, save_every=0, progress=False,
                                      out_dir=str(out))
    if name == "vision":
        from contrastkit.vision.train import VisionConfig, train

        return train, VisionConfig(train_images=64, test_images=32, batch_size=8, width=8, proj_hidden=32, proj_dim=16,
                                   threads=1, progress=False, log_every=1, knn_k=5, loss="dcl", steps=4,
                                   warmup=1, out_dir=str(out))
    if name == "wav2vec2":
        from contrastkit.speech.pretrain import PretrainConfig, pretrain

        return pretrain, PretrainConfig(backend="hf", loss="dcl", steps=4, batch_size=4, max_seconds=1.0,
                                        save_every=100, log_every=1, pretext_eval=False, data=fsc, out_dir=str(out))
    from contrastkit.speech.clap import ClapTrainConfig, train

    return train, ClapTrainConfig(width=16, batch_size=4, steps=4, warmup=1, log_every=1, eval_every=0, save_every=0,
                                  progress=False, data=fsc, out_dir=str(out))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("recipe", ["clip", "vision", "wav2vec2", "clap"])
def test_every_recipe_stops_at_the_step_boundary(recipe, data_dir, fsc, tmp_path, monkeypatch, capsys):
    """Each recipe's loop, in this process: SIGTERM inside step 2 ends train() with Stopped (exit status 75) at
    step 2 with checkpoint_2 complete, and the handler that was there before the run is back afterwards."""
    from contrastkit.training import Stopped

    before = []
    previous = signal.signal(signal.SIGTERM, lambda *args: before.append("reached the test's own handler"))
    original, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    train, cfg = _recipe(recipe, tmp_path / "run", data_dir, fsc)
    try:
        with pytest.raises(Stopped) as stopped:
            train(cfg)
        handler = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not before and stopped.value.code == 75 and stopped.value.step == 2
    assert complete(tmp_path / "run") == ["checkpoint_2"]
    assert LINE.format(signal="SIGTERM", step=2, path=tmp_path / "run" / "checkpoints" / "checkpoint_2") in \
        capsys.readouterr().out
    assert handler is not None and handler.__name__ == "<lambda>"  # the test's own, put back


def test_sigterm_to_the_whole_process_group_spares_the_dataloader_workers(tmp_path):
    """SLURM signals every process of a job, DataLoader workers too (here: SIGTERM to the run's process group):
    the workers live on (torch's own would die, and their loader end the run with a traceback), the run stops
    with its checkpoint and exit status 75, and its workers end with it."""
    from test_recipe_runs import TINY

    out, hold = tmp_path / "run", tmp_path / "hold"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HOLD_AT": "step:3", "HOLD_FILE": str(hold)}
    process = Forked(SIGNALLED, [ROOT / "recipes/vision/train.py", *TINY, "--workers", "2", "--out-dir", out], env,
                     cwd=ROOT, new_session=True)
    deadline = time.time() + 240
    while not Path(f"{hold}.held.0").exists():
        assert process.poll() is None and time.time() < deadline, finish(process)[1][-3000:]
        time.sleep(0.05)
    workers = [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
    assert len(workers) == 2
    os.killpg(process.pid, signal.SIGTERM)
    time.sleep(0.3)
    hold.write_text("go")
    code, text = finish(process, timeout=120)
    assert code == STOPPED, text[-3000:]
    assert "Traceback" not in text
    assert LINE.format(signal="SIGTERM", step=3, path=out / "checkpoints" / "checkpoint_3") in text
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
