"""The one command line of every recipe and eval script (contrastkit.cli): help with defaults and choices,
typed loss options, YAML configs the command line overrides, and bad values refused with one
``error: ...`` line and exit status 2 before any work."""

import importlib.util
import logging
import os
import runpy
import sys
from pathlib import Path

import pytest

from contrastkit.cli import held_back, parse, typed_value
from contrastkit.clip.train import ClipTrainConfig
from contrastkit.vision.train import VisionConfig

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["recipes/clip/train.py", "recipes/clip/compare.py", "recipes/vision/train.py", "recipes/vision/sweep.py",
           "recipes/wav2vec2/train.py", "recipes/wav2vec2/compare.py", "eval/zeroshot.py", "eval/knn.py",
           "eval/linear_probe.py", "eval/speaker_id.py", "eval/intent.py", "eval/suite.py"]


def run_script(script, argv, capsys, monkeypatch):
    """Run ``script`` as __main__ in this process; (exit code, stdout, stderr). Any exception other than
    SystemExit propagates, so a traceback fails the test."""
    monkeypatch.setattr(sys, "argv", [script, *argv])
    code = 0
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_documents_every_option_with_its_default(script, capsys, monkeypatch):
    code, out, _ = run_script(script, ["--help"], capsys, monkeypatch)
    assert code == 0
    entries, current = [], None
    for line in out.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            current = [line]
            entries.append(current)
        elif current is not None:
            current.append(line)
    entries = [" ".join(" ".join(e).split()) for e in entries if not e[0].strip().startswith("-h")]
    offs = [e for e in entries if e.startswith("--no")]  # --no-x: "turn --x off", beside --x and its default
    assert all(" turn --" in e and "(default:" not in e for e in offs), offs
    entries = [e for e in entries if e not in offs]
    assert len(entries) >= 5
    for entry in entries:
        assert entry.count("(default") == 1, f"{script}: no default, or two, in {entry!r}"
        assert len(entry.split("(default")[0].split()) > 2, f"{script}: no help text in {entry!r}"
        names = [w.rstrip(",") for w in entry.split() if w.startswith("--")]
        assert not [n for n in names if "_" in n and n.replace("_", "-") in names], f"{script}: two spellings: {entry}"


def test_help_has_one_spelling_and_the_other_still_works():
    """--help shows --batch-size and --no-progress only; --batch_size and --no_progress are still accepted."""
    assert parse(VisionConfig, argv=["--batch_size", "16", "--no_progress"]).batch_size == 16
    assert parse(VisionConfig, argv=["--batch-size", "16", "--no-progress"]).progress is False


def test_help_lists_choices(capsys, monkeypatch):
    out = run_script("recipes/vision/train.py", ["--help"], capsys, monkeypatch)[1]
    assert "--loss {infonce,dcl,dclw,eqco,cacr,unigrad}" in out
    assert "--method {simclr,moco,simo}" in out and "--report-to {none,tensorboard,wandb,all}" in out
    out = run_script("recipes/wav2vec2/train.py", ["--help"], capsys, monkeypatch)[1]
    assert "--backend {hf,fairseq2}" in out


def missing(tmp):
    return str(tmp / "no-such-path")


# (script, argv, a fragment of the error line); tmp paths are filled in per test
BAD = [
    ("recipes/clip/train.py", ["--loss", "nope"], "invalid choice"),
    ("recipes/clip/train.py", ["--data", "{missing}"], "does not exist"),
    ("recipes/clip/train.py", ["--zeroshot", "{missing}"], "does not exist"),
    ("recipes/clip/train.py", ["--model", "ViT-Nope"], "unknown open_clip model config"),
    ("recipes/clip/train.py", ["--batch-size", "0"], "--batch-size must be > 0"),
    ("recipes/clip/train.py", ["--lr", "-1"], "--lr must be > 0"),
    ("recipes/clip/train.py", ["--steps", "abc"], "invalid int value"),
    ("recipes/clip/train.py", ["--loss-option", "bogus=1"], "bogus"),
    ("recipes/clip/train.py", ["--loss-option", "sigma"], "KEY=VALUE"),
    ("recipes/clip/train.py", ["--report-to", "mlflow"], "invalid choice"),
    ("recipes/clip/train.py", ["--config", "{missing}"], "--config"),
    ("recipes/clip/train.py", ["--no-such-flag"], "unrecognized arguments"),
    ("recipes/clip/compare.py", ["--losses", "infonce", "nope"], "invalid choice"),
    ("recipes/clip/compare.py", ["--batch-sizes", "0"], "must be > 0"),
    ("recipes/clip/compare.py", ["--jobs", "0"], "--jobs must be > 0"),
    ("recipes/vision/train.py", ["--loss", "nope"], "invalid choice"),
    ("recipes/vision/train.py", ["--method", "byol"], "invalid choice"),
    ("recipes/vision/train.py", ["--backbone", "vgg"], "invalid choice"),
    ("recipes/vision/train.py", ["--data", "{missing}"], "does not exist"),
    ("recipes/vision/train.py", ["--batch-size", "0"], "--batch-size must be > 0"),
    ("recipes/vision/train.py", ["--lr", "-0.1"], "--lr must be > 0"),
    ("recipes/vision/train.py", ["--method", "moco"], "moco needs a queue"),
    ("recipes/vision/train.py", ["--loss-option", "chunk_sise=8"], "chunk_sise"),
    ("recipes/vision/train.py", ["--optimizer", "lamb"], "invalid choice"),
    ("recipes/vision/sweep.py", ["--batch-sizes", "16", "-4"], "must be > 0"),
    ("recipes/vision/sweep.py", ["--simclr-losses", "nope"], "invalid choice"),
    ("recipes/wav2vec2/train.py", ["--backend", "espnet"], "invalid choice"),
    ("recipes/wav2vec2/train.py", ["--loss", "unigrad"], "invalid choice"),
    ("recipes/wav2vec2/train.py", ["--data", "{missing}"], "does not exist"),
    ("recipes/wav2vec2/train.py", ["--batch-size", "0"], "--batch-size must be > 0"),
    ("recipes/wav2vec2/train.py", ["--lr", "-1"], "--lr must be > 0"),
    ("recipes/wav2vec2/train.py", ["--warmup", "2.5"], "--warmup"),
    ("recipes/wav2vec2/train.py", ["--conformer", "--backend", "fairseq2"], "--conformer"),
    ("recipes/wav2vec2/compare.py", ["--losses", "nope"], "invalid choice"),
    ("recipes/wav2vec2/compare.py", ["--steps", "0"], "--steps must be > 0"),
    ("eval/zeroshot.py", ["--model", "ViT-Nope"], "unknown open_clip model config"),
    ("eval/zeroshot.py", ["--checkpoint", "{missing}"], "does not exist"),
    ("eval/zeroshot.py", ["--data", "{missing}"], "does not exist"),
    ("eval/zeroshot.py", ["--batch-size", "0"], "--batch-size must be > 0"),
    ("eval/zeroshot.py", ["--device", "cuda"] if not os.environ.get("CUDA_VISIBLE_DEVICES") else ["--device", "tpu"],
     "--device"),
    ("eval/knn.py", [], "required"),
    ("eval/knn.py", ["--run", "{missing}"], "does not exist"),
    ("eval/knn.py", ["--run", "{tmp}"], "not a vision recipe run"),
    ("eval/knn.py", ["--run", "{tmp}", "--k", "0"], "--k must be > 0"),
    ("eval/linear_probe.py", ["--run", "{tmp}", "--classifier", "svm"], "invalid choice"),
    ("eval/linear_probe.py", ["--run", "{tmp}", "--epochs", "0"], "--epochs must be > 0"),
    ("eval/speaker_id.py", ["--upstream", "{missing}"], "does not exist"),
    ("eval/intent.py", ["--upstream", "{tmp}", "--epochs", "-3"], "--epochs must be > 0"),
    ("eval/suite.py", ["--domains", "audio"], "invalid choice"),
    ("eval/suite.py", ["--config", "{missing}"], "does not exist"),
    ("eval/suite.py", ["--objectives", "nope"], "invalid choice"),
]
if importlib.util.find_spec("wandb") is None:  # a user's optional install, not in the pinned environment
    BAD.append(("recipes/vision/train.py", ["--report-to", "wandb"], "needs the wandb package: pip install wandb"))
if importlib.util.find_spec("fairseq2") is None:  # the current stack: fairseq2 lives in the second environment
    BAD.append(("recipes/wav2vec2/train.py", ["--backend", "fairseq2"], "second environment"))


@pytest.mark.parametrize("script,argv,fragment", BAD, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_bad_value_is_one_error_line_and_exit_2(script, argv, fragment, tmp_path, capsys, monkeypatch):
    argv = [a.format(missing=missing(tmp_path), tmp=str(tmp_path)) for a in argv]
    monkeypatch.chdir(tmp_path)  # nothing may be written: a run would leave runs/ here
    code, out, err = run_script(script, argv, capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err + out
    assert list(tmp_path.iterdir()) == [], "work started before the error"


def test_loss_options_are_typed():
    assert [typed_value(v) for v in ("512", "0.5", "1e-3", "true", "False", "blockwise")] == [
        512, 0.5, 1e-3, True, False, "blockwise"]
    cfg = parse(VisionConfig, argv=["--loss", "dcl", "--loss-option", "chunk_size=512", "--loss-option",
                                    "normalize=false", "--loss-option", "backend=torch"])
    assert cfg.loss_options == {"chunk_size": 512, "normalize": False, "backend": "torch"}
    assert type(cfg.loss_options["chunk_size"]) is int
    assert cfg.loss_kwargs()["chunk_size"] == 512 and cfg.loss_kwargs()["temperature"] == 0.1


def test_yaml_config_is_overridden_by_the_command_line(tmp_path):
    (tmp_path / "run.yaml").write_text("loss: dclw\nlr: 5.0e-4\nbatch-size: 32\nprogress: false\n"
                                       "loss_options: {sigma: 0.25, chunk_size: 64}\n")
    cfg = parse(ClipTrainConfig, argv=["--config", str(tmp_path / "run.yaml"), "--lr", "0.002",
                                       "--loss-option", "chunk_size=128"])
    assert (cfg.loss, cfg.lr, cfg.batch_size, cfg.progress) == ("dclw", 0.002, 32, False)
    assert cfg.loss_options == {"sigma": 0.25, "chunk_size": 128}
    assert cfg.out_dir == "runs/clip-dclw"
    (tmp_path / "bad.yaml").write_text("loss: nope\n")
    with pytest.raises(SystemExit) as stop:
        parse(ClipTrainConfig, argv=["--config", str(tmp_path / "bad.yaml")])
    assert stop.value.code == 2
    (tmp_path / "typo.yaml").write_text("learning_rate: 0.1\n")
    with pytest.raises(SystemExit):
        parse(ClipTrainConfig, argv=["--config", str(tmp_path / "typo.yaml")])


def test_held_back_holds_only_the_matching_records_and_only_inside(caplog):
    """What a script leaves unshown on purpose (create_clip: open_clip's from-scratch warning) is that message
    alone, in that block alone: every other record passes."""
    logger = logging.getLogger("contrastkit.test_cli")
    with held_back(logger, lambda message: message == "on purpose") as held:
        logger.warning("on purpose")
        logger.warning("something else")
    logger.warning("on purpose")
    assert caplog.messages == ["something else", "on purpose"]
    assert [record.getMessage() for record in held] == ["on purpose"]
