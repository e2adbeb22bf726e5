"""Faults in runs (issue 29, items 3-5): a diverging run stops with one ``error:`` line and leaves only
finite checkpoints; --resume with nothing to resume from, a damaged checkpoint, a changed setting the
checkpoint fixes and a save that fails (a file-size limit standing in for a full disk) each end in one line
naming the path, the cause and the newest good checkpoint; a new --lr is applied on resume and recorded.
Issue 42: a second run into a locked --out-dir is one line naming the holder; a stale lock is taken over."""

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contrastkit.cli import RunError
from launch import Forked
from test_cli import run_script

ROOT = Path(__file__).resolve().parents[1]
VISION = ["--train-images", "64", "--test-images", "32", "--batch-size", "8", "--width", "8", "--proj-hidden", "32",
          "--proj-dim", "16", "--threads", "1", "--no-progress", "--log-every", "1", "--knn-k", "5",
          "--method", "simclr", "--loss", "dcl", "--checkpoint-every", "1", "--warmup-steps", "1"]


def vision(out_dir, *extra, capsys, monkeypatch):
    return run_script("recipes/vision/train.py", [*VISION, "--out-dir", str(out_dir), *extra], capsys, monkeypatch)


def one_line(err: str) -> str:
    """The error line of stderr, which must hold nothing else but library warnings."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def finite_checkpoints(out_dir) -> list[str]:
    names = []
    for folder in sorted((Path(out_dir) / "checkpoints").iterdir()):
        for name, tensor in load_file(str(folder / "model.safetensors")).items():
            assert torch.isfinite(tensor).all(), (folder.name, name)
        names.append(folder.name)
    return names


@pytest.mark.quick
def test_a_diverging_vision_run_stops_with_one_line(tmp_path, capsys, monkeypatch):
    code, _, err = vision(tmp_path, "--steps", "6", "--lr", "1e30", capsys=capsys, monkeypatch=monkeypatch)
    line = one_line(err)
    assert code == 1 and line.startswith("error: step 3: the features became non-finite"), line  # step 1: lr 0
    assert f"last good checkpoint is {tmp_path / 'checkpoints' / 'checkpoint_2'}" in line and "lower --lr" in line
    assert finite_checkpoints(tmp_path) == ["checkpoint_1", "checkpoint_2"]


@pytest.fixture(scope="module")
def clip_data(tmp_path_factory):
    from contrastkit.data.image_text import make_shapes_clip

    d = tmp_path_factory.mktemp("clipdata")
    make_shapes_clip(d, num_train=64, num_zeroshot_per_class=4, progress=False)
    return d


def test_a_diverging_clip_run_stops_with_one_line(clip_data, tmp_path, capsys, monkeypatch):
    """The issue's own case, recipes/clip/train.py --lr 100: no traceback, no non-finite checkpoint."""
    argv = ["--data-dir", str(clip_data), "--num-train", "64", "--zeroshot-per-class", "4", "--batch-size", "8",
            "--steps", "8", "--warmup", "1", "--log-every", "4", "--eval-every", "0", "--save-every", "2",
            "--no-progress", "--out-dir", str(tmp_path), "--lr", "100", "--keep-checkpoints", "5"]
    code, _, err = run_script("recipes/clip/train.py", argv, capsys, monkeypatch)
    line = one_line(err)
    assert code == 1 and "became non-finite" in line and "last good checkpoint is" in line, line
    step = int(line.split("step ")[1].split(":")[0])
    saved = finite_checkpoints(tmp_path)
    assert saved == [f"checkpoint_{s}" for s in range(2, step, 2)] and saved[-1] in line


def test_a_diverging_speech_run_stops(tmp_path, one_thread):
    from contrastkit.data.speech import default_speech_data
    from contrastkit.speech.pretrain import PretrainConfig, pretrain

    cfg = PretrainConfig(backend="hf", loss="dcl", out_dir=str(tmp_path), steps=4, batch_size=4, max_seconds=1.0,
                         data=str(default_speech_data(small=True) / "fsc"),
                         save_every=1, log_every=1, lr=1e30, warmup=0.0, pretext_eval=False)
    with pytest.raises(RunError, match="step [23]: the .* became non-finite") as caught:
        pretrain(cfg)
    saved = finite_checkpoints(tmp_path)
    assert saved and saved[-1] in str(caught.value)


@pytest.mark.quick
def test_resume_faults_are_one_line(tmp_path, capsys, monkeypatch):
    code, _, err = vision(tmp_path / "empty", "--steps", "3", "--resume", capsys=capsys, monkeypatch=monkeypatch)
    assert code == 2 and "--resume: no complete checkpoint under" in one_line(err)

    run = tmp_path / "run"
    code, _, err = vision(run, "--steps", "3", capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0, err
    code, _, err = vision(run, "--steps", "3", "--resume", "--loss", "infonce", capsys=capsys, monkeypatch=monkeypatch)
    line = one_line(err)
    assert code == 2 and "was trained with --loss dcl, this command asks for infonce" in line, line

    newest, older = run / "checkpoints" / "checkpoint_3", run / "checkpoints" / "checkpoint_2"
    model = newest / "model.safetensors"
    model.write_bytes(model.read_bytes()[:1000])  # truncated (a disk that filled, a copy cut short)
    code, _, err = vision(run, "--steps", "3", "--resume", capsys=capsys, monkeypatch=monkeypatch)
    line = one_line(err)
    assert code == 1 and f"checkpoint {newest} cannot be read (model.safetensors has 1000 bytes" in line, line
    assert f"newest good checkpoint is {older}" in line

    (newest / "COMPLETE").write_text("3\n")  # a marker without sizes (older versions): the reader's own error
    code, _, err = vision(run, "--steps", "3", "--resume", capsys=capsys, monkeypatch=monkeypatch)
    line = one_line(err)
    assert code == 1 and f"checkpoint {newest} cannot be read (" in line and str(older) in line, line


def test_a_failed_save_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
    """Files may not grow past 150 kB (RLIMIT_FSIZE): the optimizer state (233 kB) cannot be written, as on
    a full disk."""
    from contrastkit.data.images import load_images

    load_images(None, "train", 32, 64)  # the embedded data is generated (and cached) here, not under the limit

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "recipes/vision/train.py"), *VISION, "--steps", "2",
                           "--out-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit, cwd=ROOT)
    line = one_line(done.stderr)
    assert done.returncode == 1 and f"could not write checkpoint {tmp_path / 'checkpoints' / 'checkpoint_1'} (" in line
    assert "the disk is full, or a quota or file-size limit was hit" in line and "MiB free" in line, line
    assert "the newest good checkpoint is none" in line
    assert not (tmp_path / "checkpoints" / "checkpoint_1").exists()


def test_resume_applies_a_new_learning_rate_and_records_it(tmp_path):
    from contrastkit.vision.train import VisionConfig, train

    tiny = dict(train_images=64, test_images=32, batch_size=8, width=8, proj_hidden=32, proj_dim=16, threads=1,
                progress=False, log_every=1, knn_k=5, loss="dcl", steps=4, warmup=1, save_every=2,
                lr=1e-3)
    train(VisionConfig(out_dir=str(tmp_path / "a"), **tiny))
    train(VisionConfig(out_dir=str(tmp_path / "b"), **tiny))
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "checkpoint_4")  # as if stopped after step 2
    summary = train(VisionConfig(out_dir=str(tmp_path / "b"), resume=True, **{**tiny, "lr": 5e-2}))

    def lrs(run):
        return {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
                if "lr" in r}

    a, b = lrs("a"), lrs("b")
    assert b[1] == a[1] and b[2] == a[2]  # the steps before the resume ran at the old peak
    for step in (3, 4):
        assert b[step] == pytest.approx(50 * a[step], rel=1e-9)  # the same schedule, at the new peak
    assert summary["config"]["lr"] == 5e-2
    assert summary["resumes"] == [{"step": 2, "checkpoint": str(tmp_path / "b" / "checkpoints" / "checkpoint_2"),
                                   "changed": {"lr": {"was": 1e-3, "now": 5e-2}}}]


def test_clip_resume_applies_a_new_learning_rate(clip_data, tmp_path, capsys, monkeypatch):
    """The same in the CLIP recipe, from its command line: the change is said and recorded."""
    argv = ["--data-dir", str(clip_data), "--num-train", "64", "--zeroshot-per-class", "4", "--batch-size", "8",
            "--steps", "4", "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--save-every", "2",
            "--no-progress", "--lr", "1e-3"]
    for run in ("a", "b"):
        code = run_script("recipes/clip/train.py", [*argv, "--out-dir", str(tmp_path / run)], capsys, monkeypatch)[0]
        assert code == 0
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "checkpoint_4")
    code, out, err = run_script("recipes/clip/train.py", [*argv, "--out-dir", str(tmp_path / "b"), "--resume",
                                                         "--lr", "5e-2"], capsys, monkeypatch)
    assert code == 0 and "--resume: --lr 0.05 (the checkpoint's run had 0.001), applied from step 2" in out + err

    def lrs(run):
        return {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
                if "lr" in r}

    a, b = lrs("a"), lrs("b")
    assert b[2] == a[2] and b[3] == pytest.approx(50 * a[3], rel=1e-9) and b[4] == pytest.approx(50 * a[4], rel=1e-9)
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["config"]["lr"] == 5e-2 and summary["resumes"][0]["changed"] == {"lr": {"was": 1e-3, "now": 5e-2}}


def write_lock(out_dir: Path, **holder) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "LOCK").write_text(json.dumps({"started": "2026-11-26T09:00:00+00:00", "token": "theirs", **holder}))
    return out_dir / "LOCK"


def test_a_second_run_into_a_locked_out_dir_is_one_line_and_touches_nothing(tmp_path, capsys, monkeypatch):
    """Run A (a process of its own, forked from this one: launch.Forked) stalls in step 2, holding out_dir/LOCK; run B into the same out_dir ends in one
    error line naming A (this host, its pid, its start), exit status 2, with --resume auto too (A is alive);
    A then finishes with its checkpoints, and its lock goes with it."""
    hold = tmp_path / "hold"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOLD_AT": "step:2", "HOLD_FILE": str(hold)}
    script = [str(ROOT / "tests/scripts/signalled_run.py"), str(ROOT / "recipes/vision/train.py")]
    a = Forked(script[0], [*script[1:], *VISION, "--steps", "4", "--out-dir", tmp_path / "run"], env, cwd=ROOT)
    deadline = time.time() + 240
    while not Path(f"{hold}.held.0").exists():
        assert a.poll() is None and time.time() < deadline, a.communicate()
        time.sleep(0.05)
    for extra in ([], ["--resume", "auto"]):
        code, _, err = vision(tmp_path / "run", "--steps", "4", *extra, capsys=capsys, monkeypatch=monkeypatch)
        line = one_line(err)
        holder = json.loads((tmp_path / "run" / "LOCK").read_text())
        assert holder["pid"] == a.pid and holder["host"] == socket.gethostname()
        assert code == 2 and line.startswith(f"error: --out-dir {tmp_path / 'run'} is in use by another run: process "
                                             f"{a.pid} on this host, started {holder['started']} holds "
                                             f"{tmp_path / 'run' / 'LOCK'}"), line
        assert "let that run finish, stop it, or give another --out-dir" in line
    hold.write_text("go")
    out, _ = a.communicate(timeout=240)
    assert a.returncode == 0, out[-3000:]
    assert finite_checkpoints(tmp_path / "run") == ["checkpoint_3", "checkpoint_4"]
    assert not (tmp_path / "run" / "LOCK").exists()


def test_a_stale_lock_is_taken_over_and_another_hosts_is_reported(tmp_path, capsys, monkeypatch):
    """A lock whose process on this host has ended is taken over (said in one line). One from another host is
    reported (exit 2): this host cannot see that process; --resume auto takes it over once its heartbeat has
    stopped for three beats (CONTRASTKIT_LOCK_BEAT, shortened here), and not while it goes on."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    write_lock(tmp_path / "a", host=socket.gethostname(), boot=boot, pid=int(ended.stdout))
    code, out, err = vision(tmp_path / "a", "--steps", "2", capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0, err[-3000:]
    assert (f"{tmp_path / 'a' / 'LOCK'}: took over the lock of process {int(ended.stdout)} on this host, started "
            "2026-11-26T09:00:00+00:00: its process has ended") in out
    assert not (tmp_path / "a" / "LOCK").exists()

    monkeypatch.setenv("CONTRASTKIT_LOCK_BEAT", "0.1")
    lock = write_lock(tmp_path / "b", host="gpu-node-17", pid=4242, slurm_job="777")
    code, _, err = vision(tmp_path / "b", "--steps", "2", capsys=capsys, monkeypatch=monkeypatch)
    line = one_line(err)
    assert code == 2 and "is in use by another run: process 4242 on host gpu-node-17, SLURM job 777, started" in line
    assert f"if that run has ended (its machine was lost), remove {lock}, or start with --resume auto" in line

    stop = threading.Event()

    def beat():  # the other host's run, alive
        while not stop.wait(0.05):
            os.utime(lock)

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        code, _, err = vision(tmp_path / "b", "--steps", "2", "--resume", "auto", capsys=capsys,
                              monkeypatch=monkeypatch)
    finally:
        stop.set()
        beating.join()
    assert code == 2 and "and its heartbeat goes on" in one_line(err)

    code, out, err = vision(tmp_path / "b", "--steps", "2", "--resume", "auto", capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0, err[-3000:]
    assert "took over the lock of process 4242 on host gpu-node-17, SLURM job 777" in out
    assert "no heartbeat for 0.3 s" in out and not lock.exists()


@pytest.mark.parametrize("recipe", ["vision", "clip"])
def test_out_of_memory_in_the_loss_is_one_line_with_what_lowers_it(recipe, clip_data, tmp_path, capsys, monkeypatch):
    """A device out of memory (torch.OutOfMemoryError, simulated) in the loss of step 3: one error line with the
    step, the batch each process holds, the newest complete checkpoint and what lowers the memory; a resume
    with a smaller loss block (the same objective) is allowed, said, and carries on."""
    from contrastkit.losses.base import ContrastiveLoss

    entry = "forward" if recipe == "vision" else "cross_modal"  # the CLIP adapter's call of the loss
    calls, original = [0], getattr(ContrastiveLoss, entry)

    def loss(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                         "of 79.19 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this "
                                         "process has 77.98 GiB memory in use.")
        return original(self, *args, **kwargs)

    if recipe == "vision":
        script, argv = "recipes/vision/train.py", [*VISION, "--steps", "4", "--out-dir", str(tmp_path)]
    else:
        script = "recipes/clip/train.py"
        argv = ["--data-dir", str(clip_data), "--num-train", "64", "--zeroshot-per-class", "4", "--batch-size", "8",
                "--steps", "4", "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--save-every", "1",
                "--no-progress", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(ContrastiveLoss, entry, loss)
    code, _, err = run_script(script, argv, capsys, monkeypatch)
    line = one_line(err)
    assert code == 1 and line.startswith("error: step 3: out of memory on the device with 8 samples per process "
                                         "(--batch-size 8) (CUDA out of memory. Tried to allocate 20.00 GiB); the "
                                         "run stopped."), line
    assert f"The newest complete checkpoint is {tmp_path / 'checkpoints' / 'checkpoint_2'}." in line
    assert ("resume from it (the same command with --resume auto) with a smaller block of the loss, --loss-option "
            "chunk_size=N (anchors per block; the same objective) or bf16 (accelerate launch --mixed_precision bf16)"
            "; or start a new run in another --out-dir (the checkpoint fixes it) with a smaller --batch-size") in line

    monkeypatch.setattr(ContrastiveLoss, entry, original)
    code, out, err = run_script(script, [*argv, "--resume", "auto", "--loss-option", "chunk_size=4"], capsys,
                                monkeypatch)
    assert code == 0, err[-3000:]
    assert "--resume: --loss-option chunk_size=4 (the checkpoint's run had unset), applied from step 2" in out + err


def last_line(out: str) -> str:
    return [line for line in out.splitlines() if line.strip()][-1]


def test_the_last_line_says_what_the_run_skipped(clip_data, tmp_path, capsys, monkeypatch):
    """A corrupt image in the CLIP recipe's data, an unreadable file in the vision recipe's image folder and in the
    wav2vec 2.0 recipe's audio folder: each run goes on, and its last line says what it skipped (before, only
    summary.json counted the first, and a warning at start-up the others)."""
    from PIL import Image

    root = next(p for p in clip_data.iterdir() if (p / "train.csv").is_file())
    rows = (root / "train.csv").read_text().splitlines()
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    rows[3] = f"{broken}\ta broken image"
    (tmp_path / "pairs.tsv").write_text("\n".join(rows[:17]) + "\n")  # 16 pairs: both steps read every one
    code, out, err = run_script("recipes/clip/train.py", [
        "--data", str(tmp_path / "pairs.tsv"), "--zeroshot", str(root / "zeroshot"), "--batch-size", "8", "--steps",
        "2", "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--save-every", "0", "--no-progress",
        "--out-dir", str(tmp_path / "clip")], capsys, monkeypatch)
    assert code == 0, err[-3000:]
    assert last_line(out).startswith("zero-shot top-1") and last_line(out).endswith(
        "; skipped 1 unusable sample(s): an image that did not decode, or no image or caption (each replaced by the "
        "next; summary.json's bad_samples)"), out

    for split, count in (("train", 8), ("val", 4)):
        for c, colour in enumerate(("red", "blue")):
            folder = tmp_path / "images" / split / colour
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (32, 32), (255 * (c == 0), i * 20, 255 * (c == 1))).save(folder / f"{i}.png")
    (tmp_path / "images" / "train" / "red" / "bad.png").write_bytes(b"not a png")
    with pytest.warns(UserWarning, match="skipped 1 unreadable file"):  # at start-up, as before
        code, out, err = vision(tmp_path / "vision", "--data", str(tmp_path / "images"), "--steps", "2",
                                capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0, err[-3000:]
    assert last_line(out) == ("skipped 1 unreadable image file(s) of the image folders (the warning above names "
                              "some; summary.json's skipped_images)"), out

    from contrastkit.data.speech import default_speech_data

    audio = tmp_path / "audio"
    audio.mkdir()
    for wav in sorted((default_speech_data(small=True) / "fsc" / "wavs").rglob("*.wav"))[:40]:
        (audio / wav.name).write_bytes(wav.read_bytes())
    (audio / "broken.wav").write_bytes(b"RIFF not audio")
    with pytest.warns(UserWarning, match="skipped 1 of 41 audio files"):
        code, out, err = run_script("recipes/wav2vec2/train.py", [
            "--data", str(audio), "--steps", "2", "--batch-size", "4", "--max-seconds", "1", "--save-every", "2",
            "--log-every", "1", "--no-pretext-eval", "--out-dir", str(tmp_path / "speech")], capsys, monkeypatch)
    assert code == 0, err[-3000:]
    assert last_line(out) == ("skipped 1 audio file(s) that could not be read (the warning above names one; "
                              "summary.json's skipped_audio)"), out
