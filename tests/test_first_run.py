"""A newcomer's first minutes: set-up leaves accelerate configured where accelerate looks (and keeps a config
the user has), and the README's main job then prints nothing of its own choosing before its first progress bar:
no launcher defaults, no library warning about what the recipe did on purpose."""

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


def accelerate_looks_at(env: dict) -> Path:
    """The config file accelerate launch reads in ``env``, as accelerate itself works it out."""
    code = "from accelerate.commands.config import default_config_file; print(default_config_file)"
    return Path(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                               check=True).stdout.strip())


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


@pytest.mark.parametrize("where", ["HOME", "XDG_CACHE_HOME", "HF_HOME"])
def test_config_goes_where_accelerate_looks_and_an_existing_one_is_kept(tmp_path, where):
    """Set-up writes accelerate's default config (use_cpu false: the CPU all the same where there is no GPU)
    into the file accelerate launch reads, by accelerate's own lookup; run again, or with a config the user
    made, it leaves the file as it is."""
    folder = {"HOME": {}, "XDG_CACHE_HOME": {"XDG_CACHE_HOME": str(tmp_path / "xdg")},
              "HF_HOME": {"HF_HOME": str(tmp_path / "hf")}}[where]
    env = fresh_env(tmp_path / "home", **folder)
    path = accelerate_looks_at(env)
    assert path.is_relative_to(tmp_path) and not path.exists()
    assert str(path) in configure(env)
    config = json.loads(path.read_text())
    assert config["use_cpu"] is False and config["num_processes"] >= 1 and config["compute_environment"] == "LOCAL_MACHINE"

    path.write_text("compute_environment: LOCAL_MACHINE\nmixed_precision: bf16\n")  # the user's own
    assert "will not override" in configure(env)
    assert path.read_text() == "compute_environment: LOCAL_MACHINE\nmixed_precision: bf16\n"
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [path]  # and nothing written elsewhere
