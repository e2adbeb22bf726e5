"""The CLAP recipe (recipes/clap/train.py): it learns (zero-shot intent accuracy from text prompts beats the
untrained model, and the eval script gives the recipe's number), it resumes bit-identically, and bad input
ends in one error line with exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from contrastkit.cli import parse
from contrastkit.speech.clap import ClapTrainConfig, intent_prompt, step_batch, train

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
# The learning check: 120 steps of a width-32 model at lr 3e-3 (about 20 s of one idle core) on the tests' subset of
# the spoken commands (speech_commands_v4-small). Measured (seeds 0-3): untrained 0.083 in every seed, trained
# 0.181-0.264 on the 72 test clips (chance 1/12); gain 0.097-0.181, mean 0.146. The margin, 0.04 (3 clips), is under
# every measured gain; without training the gain is 0.
LEARN, LEARN_OPTIONS, MARGIN = 120, dict(width=32, lr=3e-3, warmup=10), 0.04
TINY = dict(width=16, batch_size=12, steps=4, warmup=1, log_every=1, eval_every=0, save_every=2, progress=False)


def _fsc() -> str:
    """The tests' subset of the embedded spoken commands (12 intents, 360 clips; tests/test_speech_data.py)."""
    from contrastkit.data.speech import default_speech_data

    return str(default_speech_data(small=True) / "fsc")


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_recipe_learns_zero_shot_intent(tmp_path):
    """LEARN steps with the recipe's defaults otherwise: zero-shot intent accuracy on the test split (speakers
    unseen in training) against the same model untrained. (That eval/zeroshot_intent.py gives the recipe's
    number on the saved model: tests/test_suite.py, whose audio-text cell runs both.)"""
    out = tmp_path / "run"
    summary = train(ClapTrainConfig(loss="dcl", steps=LEARN, eval_every=0, save_every=0, progress=False,
                                    out_dir=str(out), data=_fsc(), **LEARN_OPTIONS))
    trained, untrained = summary["zeroshot_intent"], summary["zeroshot_intent_untrained"]
    assert trained["num_intents"] == 12 and trained["chance"] == pytest.approx(1 / 12)
    assert trained["accuracy"] >= untrained["accuracy"] + MARGIN, (untrained, trained)
    assert (out / "metrics.png").is_file() and (out / "model" / "config.json").is_file()


def test_resume_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(ClapTrainConfig(out_dir=str(straight), data=_fsc(), **TINY))
    (resumed / "checkpoints").mkdir(parents=True)  # killed after step 2: its checkpoint and log survive
    shutil.copytree(straight / "checkpoints" / "checkpoint_2", resumed / "checkpoints" / "checkpoint_2")
    shutil.copy(straight / "metrics.jsonl", resumed / "metrics.jsonl")
    summary = train(ClapTrainConfig(out_dir=str(resumed), resume=True, data=_fsc(), **TINY))
    assert summary["resumes"] and summary["steps"] == 4
    a, b = (load_file(str(run / "checkpoints" / "checkpoint_4" / "model.safetensors")) for run in (straight, resumed))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _losses(straight) == _losses(resumed) and len(_losses(straight)) == 4


@pytest.mark.quick
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


@pytest.mark.quick
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


def test_bad_data_found_while_running_is_one_line(tmp_path, capsys):
    """The recipe script itself (run in this process): data found bad once read is one line, exit 2."""
    import runpy

    main = runpy.run_path(str(ROOT / "recipes" / "clap" / "train.py"))["main"]
    (tmp_path / "fsc").mkdir()
    for argv, message in ((["--data", str(tmp_path / "fsc")], "train_data.csv not found"),
                          (["--batch-size", "13", "--data", _fsc()], "a batch holds different intents, and")):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--out-dir", str(tmp_path / "run"), "--no-progress"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, err
        assert err.count("\n") == 1 and err.startswith("error: "), err


@pytest.mark.quick
def test_comparison_table_verdicts_and_plot(tmp_path):
    from contrastkit.speech.clap_compare import ClapCompareArgs, write_comparison

    accuracies = {"untrained": (0.08, 0.10, 0.09), "infonce": (0.30, 0.32, 0.31), "dcl": (0.33, 0.34, 0.36)}
    rows = [{"model": m, "seed": s, "accuracy": a} for m, values in accuracies.items() for s, a in enumerate(values)]
    results = write_comparison(rows, tmp_path, ClapCompareArgs(seeds=[0, 1, 2]), 1 / 12, 72, "`python x` at commit abc")
    text = (tmp_path / "results.md").read_text()
    assert "| infonce | 31.0 ± 2.5 | 30.0, 32.0, 31.0 |" in text  # t_{0.975, 2} = 4.303, sd 1 point
    assert "- infonce - untrained = +22.0 ± 0.0 (95 % CI, 3 seeds): resolved" in text
    assert "- dcl - infonce = +3.3 ± 3.8 (95 % CI, 3 seeds): not resolved" in text  # differences 3, 2, 5
    assert "Made by `python x` at commit abc." in text and (tmp_path / "results.png").stat().st_size > 0
    assert [v["a"] + "-" + v["b"] for v in results["verdicts"]] == ["infonce-untrained", "dcl-untrained", "dcl-infonce"]


def test_compare_script_writes_and_prints_its_results_dir(tmp_path, capsys):
    """recipes/clap/compare.py end to end (2 steps, one seed) with --results-dir apart from --out-dir: the
    table goes there and is printed (it once read it from --out-dir and ended in a traceback)."""
    import runpy

    argv = ["compare.py", "--losses", "dcl", "--seeds", "0", "--steps", "2", "--data", _fsc(), "--out-dir",
            str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", argv)
        runpy.run_path(str(ROOT / "recipes" / "clap" / "compare.py"), run_name="__main__")
    table = (tmp_path / "results" / "results.md").read_text()
    assert "| dcl |" in table and table.strip() in capsys.readouterr().out
    assert not (tmp_path / "runs" / "results.md").exists()


@pytest.mark.quick
def test_eval_script_bad_model_folder_is_one_line(tmp_path, capsys):
    from contrastkit.speech.clap import ZeroShotIntentArgs

    for model, message in ((tmp_path / "none", "does not exist"), (tmp_path, "no config.json")):
        with pytest.raises(SystemExit) as exit_:
            parse(ZeroShotIntentArgs, argv=["--model", str(model), "--device", "cpu"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err
