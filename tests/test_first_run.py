"""A newcomer's first minutes: set-up leaves accelerate configured where accelerate looks (and keeps a config
the user has), and the README's main job then prints nothing of its own choosing before its first progress bar:
no launcher defaults, no library warning about what the recipe did on purpose; a mistyped value ends a fresh
process with one line. Fresh interpreters and a real launcher, so not in the quick tier (test_cli.py checks the
same command lines in-process there)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r"\[\d\d:\d\d[<,]")  # tqdm's elapsed time: "[00:00<?, ?it/s]", "[00:01, 3.2it/s]"


def fresh_env(home: Path, **env) -> dict:
    """A new user's shell after `source .venv/bin/activate`: an empty home (no accelerate config, no data
    generated yet), this environment's programs first on PATH, contrastkit from this tree, ``env`` on top."""
    home.mkdir(parents=True, exist_ok=True)
    return {"HOME": str(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **env}


def configure(env: dict) -> str:
    """setup.sh's accelerate step, as set-up runs it; its output."""
    done = subprocess.run(["bash", str(ROOT / "setup.sh"), "--accelerate-config"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def lines_before_progress(command: list[str], cwd: Path, env: dict, timeout: float = 300) -> list[str]:
    """The non-empty lines ``command`` writes (stdout and stderr merged) before its first progress bar; the
    process is stopped there. Fails if it ends or the time runs out first."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own group: the launcher and the training process end
    text, deadline = "", time.monotonic() + timeout
    try:
        while not PROGRESS.search(text):
            ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(proc.stdout.fileno(), 65536) if ready else b""
            if not chunk:
                pytest.fail(f"no progress bar ({'ended' if ready else 'timed out'}); it wrote:\n{text[-3000:]}")
            text += chunk.decode(errors="replace")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    before = re.split(r"[\r\n]", PROGRESS.split(text)[0])[:-1]  # tqdm starts its line with \r
    return [line for line in before if line.strip()]


def test_main_job_prints_nothing_before_its_progress_bar(tmp_path):
    """README's main job, `accelerate launch recipes/clip/train.py --loss dcl`, after set-up in a fresh home:
    its first line is its progress bar (here the embedded data's generation, where it is stopped)."""
    env = fresh_env(tmp_path / "home")
    configure(env)
    command = ["accelerate", "launch", str(ROOT / "recipes/clip/train.py"), "--loss", "dcl"]
    before = lines_before_progress(command, tmp_path, env)
    assert before == [], "lines before the progress bar that the user did not cause:\n" + "\n".join(before)


def test_config_is_accelerates_default_and_one_that_is_there_is_kept(tmp_path):
    """Set-up writes accelerate's default config where accelerate looks (here ~/.cache/huggingface; $HF_HOME or
    $XDG_CACHE_HOME/huggingface where set: accelerate's own lookup), never forcing the CPU; where the user has a
    config (here under $HF_HOME) it leaves that file as it is and writes nothing anywhere."""
    env = fresh_env(tmp_path / "home")
    path = tmp_path / "home/.cache/huggingface/accelerate/default_config.yaml"
    assert str(path) in configure(env)
    config = json.loads(path.read_text())
    assert config["use_cpu"] is False and config["num_processes"] >= 1 and config["compute_environment"] == "LOCAL_MACHINE"

    mine = tmp_path / "hf/accelerate/default_config.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text("compute_environment: LOCAL_MACHINE\nmixed_precision: bf16\n")
    path.unlink()
    assert "will not override" in configure({**env, "HF_HOME": str(tmp_path / "hf")})
    assert mine.read_text() == "compute_environment: LOCAL_MACHINE\nmixed_precision: bf16\n"
    assert not path.exists()


def test_a_real_process_exits_2_with_one_line(tmp_path):
    """Nothing a fresh interpreter's imports print (a library's warning) comes before or after the error."""
    done = subprocess.run([sys.executable, str(ROOT / "recipes/vision/train.py"), "--batch-size", "0"],
                          capture_output=True, text=True, env=fresh_env(tmp_path / "home"), cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --batch-size must be > 0, got 0"
