"""The CLAP recipe (recipes/clap/train.py): it learns (zero-shot intent accuracy from text prompts beats the
untrained model, and the eval script gives the recipe's number), it resumes bit-identically, and bad input
ends in one error line with exit status 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contrastkit.cli import parse
from contrastkit.speech.clap import ClapTrainConfig, intent_prompt, step_batch, train

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
TINY = dict(width=16, batch_size=12, steps=4, warmup=1, log_every=1, eval_every=0, save_every=2, progress=False)


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_recipe_learns_zero_shot_intent_and_the_eval_script_agrees(tmp_path):
    """LEARN steps with the recipe's defaults otherwise: zero-shot intent accuracy on the test split (speakers
    unseen in training) against the same model untrained."""
    out = tmp_path / "run"
    summary = train(ClapTrainConfig(loss="dcl", steps=LEARN, eval_every=0, save_every=0, progress=False,
                                    out_dir=str(out), **LEARN_OPTIONS))
    trained, untrained = summary["zeroshot_intent"], summary["zeroshot_intent_untrained"]
    assert trained["num_intents"] == 12 and trained["chance"] == pytest.approx(1 / 12)
    assert trained["accuracy"] >= untrained["accuracy"] + MARGIN, (untrained, trained)
    assert (out / "metrics.png").is_file() and (out / "model" / "config.json").is_file()
    done = subprocess.run([sys.executable, "eval/zeroshot_intent.py", "--model", str(out), "--out",
                           str(tmp_path / "zs.json"), "--device", "cpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "zs.json").read_text())["accuracy"] == pytest.approx(trained["accuracy"], abs=1e-9)
    assert "zero-shot intent accuracy" in done.stdout


def test_resume_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(ClapTrainConfig(out_dir=str(straight), **TINY))
    (resumed / "checkpoints").mkdir(parents=True)  # killed after step 2: its checkpoint and log survive
    shutil.copytree(straight / "checkpoints" / "checkpoint_2", resumed / "checkpoints" / "checkpoint_2")
    shutil.copy(straight / "metrics.jsonl", resumed / "metrics.jsonl")
    summary = train(ClapTrainConfig(out_dir=str(resumed), resume=True, **TINY))
    assert summary["resumes"] and summary["steps"] == 4
    a, b = (load_file(str(run / "checkpoints" / "checkpoint_4" / "model.safetensors")) for run in (straight, resumed))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _losses(straight) == _losses(resumed) and len(_losses(straight)) == 4


def test_batches_hold_different_intents_and_follow_from_the_step():
    rows = [{"intent": f"i{k}", "transcription": f"say {k}", "action": "bring", "object": f"o{k}",
             "location": "none" if k % 2 else "kitchen", "path": f"{k}-{j}.wav"} for k in range(5) for j in range(3)]
    by_intent = {}
    for r in rows:
        by_intent.setdefault(r["intent"], []).append(r)
    batch, texts, _ = step_batch(by_intent, 4, "mix", seed=0, step=7)
    assert len({r["intent"] for r in batch}) == 4
    assert all(t in (r["transcription"], intent_prompt(r)) for r, t in zip(batch, texts))
    again, texts_again, _ = step_batch(by_intent, 4, "mix", seed=0, step=7)
    assert again == batch and texts_again == texts
    assert step_batch(by_intent, 4, "mix", seed=0, step=8)[0] != batch
    assert intent_prompt(rows[0]) == "bring o0 in the kitchen" and intent_prompt(rows[3]) == "bring o1"


@pytest.mark.parametrize("argv,message", [
    (["--width", "12"], "--width must be a multiple of 8"),
    (["--batch-size", "1"], "--batch-size must be >= 2"),
    (["--loss", "unigrad"], "invalid choice"),
    (["--loss-option", "sigma=0.5"], "sigma"),
    (["--speed", "1.5"], "--speed must be in [0, 1)"),
    (["--data", "/no/such/fsc"], "--data: Fluent Speech Commands root '/no/such/fsc' does not exist"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(ClapTrainConfig, argv=argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_bad_data_found_while_running_is_one_line(tmp_path):
    (tmp_path / "fsc").mkdir()
    for argv, message in ((["--data", str(tmp_path / "fsc")], "train_data.csv not found"),
                          (["--batch-size", "13"], "a batch holds different intents, and")):
        done = subprocess.run([sys.executable, "recipes/clap/train.py", *argv, "--out-dir", str(tmp_path / "run"),
                               "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr[-2000:]
