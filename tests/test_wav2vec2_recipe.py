"""The wav2vec 2.0 recipe trains both backends for a few steps, resumes exactly, runs on 2 processes (gloo ranks),
and the evaluations run on its checkpoints: on tiny copies of the FSC and VoxCeleb1 layouts built from the
embedded data (24 training and 8 held-out utterances: a run loads and evaluates on a ninth of the 216 and 72 of
the tests' subset, its main cost at 4 steps), made once; the learning test trains on the subset."""

from __future__ import annotations

import dataclasses
import json
import runpy
import shutil
from pathlib import Path

import pytest
import torch
from environments import needs_fairseq2, skip_without_fairseq2
from launch import run_ranks
from speech_copies import tiny_copies

from contrastkit.data import speech
from contrastkit.evaluation import superb
from contrastkit.speech.pretrain import PretrainConfig, pretrain

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(fsc, vox): the tiny copies (tests/speech_copies.py), made once for the module's tests."""
    return tiny_copies(tmp_path_factory.mktemp("speech"))


def _cfg(tmp_path, backend, data, **kw):
    return PretrainConfig(backend=backend, loss="dcl", out_dir=str(tmp_path / backend), data=str(data), steps=4, batch_size=4,
                          max_seconds=1.0, save_every=2, log_every=1, **kw)


def _weights(run: Path):
    from safetensors.torch import load_file

    up = run / "upstream"
    if (up / "fairseq2_wav2vec2.safetensors").is_file():
        return load_file(str(up / "fairseq2_wav2vec2.safetensors"))
    return load_file(str(up / "model.safetensors"))


@pytest.mark.parametrize("backend", ["hf", pytest.param("fairseq2", marks=needs_fairseq2)])
def test_recipe_trains_and_resumes_exactly(tmp_path, backend, tiny):
    """Trained, stopped after step 3 and resumed equals trained straight, with the held-out pretext evaluation
    every 2 steps (--eval-every) on the way."""
    straight = _cfg(tmp_path / "a", backend, tiny[0], eval_every=2)
    summary = pretrain(straight)
    assert summary["steps"] == 4 and summary["loss"] == "dcl"
    run = Path(straight.out_dir)
    assert (run / "metrics.png").is_file() and (run / "summary.json").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_4"]

    interrupted = _cfg(tmp_path / "b", backend, tiny[0], eval_every=2)
    pretrain(interrupted, stop_at=3)  # dies after step 3; the last checkpoint is step 2
    shutil.rmtree(Path(interrupted.out_dir) / "upstream", ignore_errors=True)
    pretrain(interrupted)  # resumes from step 2
    a, b = _weights(run), _weights(Path(interrupted.out_dir))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    records = [json.loads(line) for line in (Path(interrupted.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "heldout_accuracy" in r] == [2, 4]
    assert records == [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# Held-out pretext accuracy (fraction of masked frames whose quantised target outscores its 20
# distractors) of a DCL run on the small subset of the embedded default (HF, the default lr and warm-up,
# 400 steps instead of 800, batch 4 instead of 8) minus that of the same model at initialisation, on the
# subset's 72 FSC-valid utterances: +0.145, +0.121, +0.198, +0.143 for seeds 0-3 (seed 0: trained 0.213,
# untrained 0.068; chance 1/21 = 0.048), 25-27 s each on one thread. At batch 8 (seed 0) +0.156 to +0.173 in
# twice the time; at batch 8 a run of 280 steps gained +0.061 only (it leaves the plateau after step ~180),
# and a higher lr (8e-3, 1.2e-2 at 250 steps) never left it. The margin is two thirds of the smallest gain.
# Fewer steps fail the margin (issue 62, batch 4): 300 steps gained +0.065 and +0.009 (seeds 0, 1), 250 steps
# +0.046 (seed 0); seed 0's 400-step run is still at 0.063 after step 150 and at 0.114 after step 200. Crops of
# 1 s instead of 2 at 400 steps gained +0.076 and +0.120 (seeds 0, 1) at no saving in CPU time (the subset's
# utterances are 0.8-2.0 s, median 1.1 s: a batch's crop is its shortest one, about 1 s).
# Nor did a cheaper schedule reach the margin (batch 4 unless stated; gains for seeds 0, 1): 200 steps -0.008,
# +0.021; with lr 8e-3 -0.005, +0.006; gumbel 1 -> 0.5 -0.009, +0.006; both -0.008, +0.001. 250 steps with lr 8e-3
# -0.010, +0.025; lr 2e-3 +0.004 (seed 0); warm-up 2 % -0.007, +0.094; gumbel 0.5 -> 0.5 -0.003, +0.002; gumbel
# 2 -> 0.1 +0.017, +0.010; loss temperature 0.2 -0.009, +0.036; 0.05 -0.009, +0.011. 300 steps (seed 0) with lr
# 6e-3 +0.023, 3e-3 +0.050, warm-up 2 % -0.011, gumbel 2 -> 0.1 +0.055. Batch 2 (two thirds of a step's CPU) at
# 400 steps -0.004, +0.170, +0.070 (seeds 0-2), at 300 -0.010 (seed 0). A step costs about 0.046 CPU-s on one
# thread, 18 of the test's 27.6 CPU-s (the rest: the data, two pretext evaluations of 72 utterances, imports).
PRETEXT_MARGIN = 0.08
SMALL_STEPS, SMALL_BATCH = 400, 4


@pytest.mark.slow
def test_pretraining_beats_untrained_on_heldout_pretext(tmp_path):
    """A learning test at small scale: the recipe with its default schedule (HF, DCL, lr, warm-up; half the
    default steps and half its batch, on the tests' subset of the embedded data) predicts the masked frames'
    quantised targets of held-out speakers better than its untrained self (same seed), and leaves the plateau
    where every candidate scores the same (InfoNCE ln 21 per frame)."""
    fsc = speech.default_speech_data(small=True) / "fsc"
    cfg = PretrainConfig(backend="hf", loss="dcl", out_dir=str(tmp_path / "small"), data=str(fsc),
                         steps=SMALL_STEPS, batch_size=SMALL_BATCH, save_every=10_000)
    summary = pretrain(cfg)
    pretext = summary["pretext"]
    trained, untrained = pretext["trained"], pretext["untrained"]
    assert trained["frames"] == untrained["frames"] > 1000 and trained["utterances"] == 72
    chance = untrained["chance"]
    assert abs(chance - 1 / 21) < 0.005 and untrained["accuracy"] < 2 * chance  # untrained: near chance
    assert trained["accuracy"] - untrained["accuracy"] > PRETEXT_MARGIN, pretext
    assert trained["infonce_per_frame"] < torch.log(torch.tensor(21.0)).item() - 0.1, pretext
    last = json.loads((Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == cfg.steps and last["heldout_accuracy"] == trained["accuracy"]


def _pretrained(tmp_path, backend, fsc):
    cfg = _cfg(tmp_path, backend, fsc)
    cfg.steps, cfg.save_every = 2, 2
    pretrain(cfg)
    return Path(cfg.out_dir)


def test_eval_scripts_run_on_the_checkpoints(tmp_path, capsys, tiny):
    """eval/speaker_id.py and eval/intent.py through their main(argv), in this process (their command lines and
    reports; --help and the one-line errors through __main__ are tests/test_cli.py's), on a recipe run and on
    its export; the intent task's feature cache gives the same result."""
    fsc, vox = tiny
    run = _pretrained(tmp_path, "hf", fsc)
    speaker_id = runpy.run_path(str(ROOT / "eval" / "speaker_id.py"))["main"]
    speaker_id(["--upstream", str(run), "--data", str(vox), "--epochs", "3"])
    assert "speaker_id test accuracy" in capsys.readouterr().out
    report = json.loads((run / "eval" / "speaker_id.json").read_text())
    assert report["classes"] == {"speaker": 3} and report["utterances"] == {"train": 12, "dev": 6, "test": 6}
    assert (run / "eval" / "speaker_id.png").is_file()
    intent = runpy.run_path(str(ROOT / "eval" / "intent.py"))["main"]  # on the export, the upstream folder itself
    hf_intent = intent(["--upstream", str(run / "upstream"), "--data", str(fsc), "--epochs", "2"])
    assert hf_intent["backend"] == "hf"
    # cache=True (the comparison's two tasks on one upstream): each file's features computed once, same result
    cached = superb.Upstream(run, cache=True)
    forward, calls = cached.hidden_states, []
    cached.hidden_states = lambda wave: calls.append(1) or forward(wave)
    first = superb.intent(cached, fsc, superb.DownstreamConfig(epochs=2))
    again = superb.intent(cached, fsc, superb.DownstreamConfig(epochs=2))
    assert len(calls) == sum(first["utterances"].values()) == len(cached.pooled)
    assert first["test_accuracy"] == again["test_accuracy"] == hf_intent["test_accuracy"]
    with pytest.raises(ValueError, match="neither a Hugging Face model folder"):
        superb.Upstream(tmp_path)


@pytest.mark.legacy
@skip_without_fairseq2
def test_intent_runs_on_a_fairseq2_checkpoint(tmp_path, tiny):
    """The evaluations take the fairseq2 backend's export too (in-process: the script is a thin wrapper)."""
    fsc, _ = tiny
    result = superb.intent(_pretrained(tmp_path, "fairseq2", fsc), fsc, superb.DownstreamConfig(epochs=3))
    assert result["backend"] == "fairseq2" and set(result["classes"]) == {"action", "object", "location"}
    assert 0.0 <= result["test_accuracy"] <= 1.0 and len(result["layer_weights"]) == 3


def test_recipe_on_two_processes(tmp_path, tiny):
    """2 gloo ranks forked from this process (launch.run_ranks): trains, checkpoints and exports."""
    out = tmp_path / "ddp"
    ranks = run_ranks(ROOT / "recipes" / "wav2vec2" / "train.py",
                      ["--steps", "2", "--batch-size", "2", "--save-every", "2", "--log-every", "1", "--out", out,
                       "--data", tiny[0]])
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stdout[-3000:] + ranks[1].stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["final_loss_per_frame"] > 0
    assert (out / "checkpoints" / "checkpoint_2").is_dir() and (out / "upstream" / "model.safetensors").is_file()


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["hf", pytest.param("fairseq2", marks=needs_fairseq2)])
def test_zero_steps_exports_the_initial_model(tmp_path, backend, tiny):
    """--steps 0 is the untrained baseline (the suite's 'untrained' row): the exported upstream is the model
    at initialisation, weight for weight, and compare.py's untrained upstream is that same model."""
    from contrastkit.speech.pretrain import build_model, export_upstream

    cfg = dataclasses.replace(_cfg(tmp_path, backend, tiny[0], seed=3), steps=0)
    summary = pretrain(cfg)
    assert summary["steps"] == 0 and summary["pretext"]["accuracy_gain"] == 0.0
    export_upstream(build_model(cfg), cfg, tmp_path / "init" / "upstream")
    exported, init = _weights(Path(cfg.out_dir)), _weights(tmp_path / "init")
    assert exported.keys() == init.keys()
    for k in init:
        assert torch.equal(exported[k], init[k]), k
