"""The cross-domain suite on a tiny vision config: report, resumption, agreement with the eval scripts
run by hand, and a missing data path skipping its domain."""

from __future__ import annotations

import contextlib
import copy
import json
import runpy
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from contrastkit.suite import ROOT, load_config, markdown, plan, run_suite
from environments import needs_fairseq2

TINY_VISION = {"train": {"method": "simclr", "batch-size": 16, "steps": 3, "train-images": 120, "test-images": 60,
                         "threads": 1}, "evals": ["knn", "linear_probe"]}


def _config(tmp_path, **extra):
    config = load_config(None)
    config.update(output_dir=str(tmp_path / "suite"), objectives=["dcl"], seeds=[0], sweep={})
    config["domains"] = {"vision": {**config["domains"]["vision"], **TINY_VISION}}
    config.update(extra)
    return config


def _commands_in_process(monkeypatch, real=lambda argv: False):
    """The suite's commands run in this process (each script as __main__ with its argv, its output in the cell's
    log) rather than as processes, but those for which ``real(argv)`` holds and those of another interpreter
    (the fairseq2 column's second environment): the tests of the suite's bookkeeping pay no interpreter
    start-up per command."""
    from contrastkit import suite

    process = suite._run

    def run(argv, log_path):
        if argv[0] != sys.executable or real(argv):
            return process(argv, log_path)
        with log_path.open("a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), \
                monkeypatch.context() as m:
            log.write("$ " + shlex.join(argv) + "\n")
            m.chdir(ROOT)
            m.setattr(sys, "argv", argv[1:])
            try:
                runpy.run_path(str(ROOT / argv[1]), run_name="__main__")
            except SystemExit as stop:
                if stop.code not in (0, None):
                    raise RuntimeError(f"command failed ({stop.code}): {shlex.join(argv)}") from None

    monkeypatch.setattr(suite, "_run", run)


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory):
    """The tiny vision suite (an untrained and a DCL cell: training, kNN, linear probe), its DCL training
    command a real process (the suite's own way to run a command, suite._run, as a user's run takes it), the
    other five in this process."""
    tmp_path = tmp_path_factory.mktemp("suite")
    config = _config(tmp_path)
    with pytest.MonkeyPatch.context() as m:
        _commands_in_process(m, real=lambda argv: argv[1].endswith("train.py") and "--steps 0" not in shlex.join(argv))
        return config, run_suite(config, progress=False)


@pytest.fixture
def cells_in_process(monkeypatch):
    """The suite's commands in this process (_commands_in_process); commands as real processes run in tiny_suite
    (one) and the fairseq2 column (the second environment's interpreter, which stays a process here too)."""
    _commands_in_process(monkeypatch)


def test_report_has_every_number_and_its_settings(tiny_suite):
    config, report = tiny_suite
    row = report["table"]["dcl"]
    assert set(row) == {"image linear probe", "image kNN"} == set(report["table"]["untrained"])
    assert 0.0 <= row["image kNN"]["mean"] <= 1.0 and row["image kNN"]["n"] == 1
    cells = {c["objective"]: c for c in report["cells"]}
    assert list(cells) == ["untrained", "dcl"]
    assert cells["dcl"]["settings"]["steps"] == 3 and cells["untrained"]["settings"]["steps"] == 0
    assert "--steps 0" in cells["untrained"]["commands"][0]
    assert [v["text"].split(" = ")[0] for v in report["verdicts"]] == [
        "column image linear probe: dcl - untrained", "column image kNN: dcl - untrained"]
    base = Path(config["output_dir"])
    assert json.loads((base / "report.json").read_text())["table"] == json.loads(json.dumps(report["table"]))
    assert "| dcl |" in (base / "report.md").read_text()
    assert (base / "report_domains.png").stat().st_size > 0


def test_numbers_agree_with_the_eval_scripts_run_by_hand(tiny_suite, tmp_path):
    config, report = tiny_suite
    (cell,) = [c for c in report["cells"] if c["objective"] == "dcl"]
    run = cell["commands"][0].split("--out-dir ")[1].split()[0]
    by_hand = {script: runpy.run_path(str(ROOT / "eval" / script))["main"] for script in ("knn.py", "linear_probe.py")}
    by_hand["knn.py"](["--run", run, "--out", str(tmp_path / "knn.json"), "--no-progress"])
    assert json.loads((tmp_path / "knn.json").read_text())["knn_top1"] == report["table"]["dcl"]["image kNN"]["mean"]
    epochs = config["domains"]["vision"]["eval_options"]["linear_probe"]["epochs"]  # the suite's own setting
    by_hand["linear_probe.py"](["--run", run, "--classifier", "sgd", "--epochs", str(epochs), "--out",
                                str(tmp_path / "lp.json"), "--no-progress"])
    probe = json.loads((tmp_path / "lp.json").read_text())["sgd"]["test_top1"]
    assert probe == report["table"]["dcl"]["image linear probe"]["mean"]


def test_finished_cells_are_not_redone(tiny_suite):
    config, report = tiny_suite
    log = Path(config["output_dir"]) / "cells" / "vision" / "dcl" / "seed0" / "log.txt"
    before = log.read_text()
    again = run_suite(config, progress=False)
    assert log.read_text() == before
    assert again["table"] == report["table"]


def test_a_moved_suite_keeps_its_cells_and_a_changed_setting_runs_the_cell_again(cells_in_process, tiny_suite, tmp_path):
    config, report = tiny_suite
    moved = tmp_path / "moved"
    shutil.copytree(config["output_dir"], moved)
    cells_dir = moved / "cells" / "vision"
    logs = {o: (cells_dir / o / "seed0" / "log.txt").read_text() for o in ("untrained", "dcl")}
    same = {**config, "output_dir": str(moved)}
    assert run_suite(same, progress=False)["table"] == report["table"]
    assert {o: (cells_dir / o / "seed0" / "log.txt").read_text() for o in logs} == logs

    changed = copy.deepcopy(same)
    changed["domains"]["vision"]["train"]["steps"] = 4
    cells = {c["objective"]: c for c in run_suite(changed, progress=False)["cells"]}
    assert cells["dcl"]["settings"]["steps"] == 4 and "--steps 4 " in cells["dcl"]["commands"][0]
    dcl_log = (cells_dir / "dcl" / "seed0" / "log.txt").read_text()
    assert "--steps 4 " in dcl_log and "--steps 3 " not in dcl_log  # run from scratch, not resumed
    assert (cells_dir / "untrained" / "seed0" / "log.txt").read_text() == logs["untrained"]  # --steps 0 either way


def test_a_cell_killed_before_its_result_continues_its_run_under_the_same_recorded_commands(cells_in_process, tiny_suite, tmp_path):
    """Every training command carries ``--resume auto``: the commands a cell records are the same whether it
    ran at once or was picked up after a kill, and the picked-up run continues rather than training again."""
    config, report = tiny_suite
    moved = tmp_path / "moved"
    shutil.copytree(config["output_dir"], moved)
    cell_dir = moved / "cells" / "vision" / "dcl" / "seed0"
    first = json.loads((cell_dir / "cell.json").read_text())
    assert all("--resume auto" in c for c in first["commands"] if "train.py" in c)
    (cell_dir / "cell.json").unlink()  # killed after training, before the evaluations wrote the cell
    again = {c["objective"]: c for c in run_suite({**config, "output_dir": str(moved)}, progress=False)["cells"]}
    assert again["dcl"]["commands"] == [c.replace(config["output_dir"], str(moved)) for c in first["commands"]]
    assert again["dcl"]["metrics"] == first["metrics"]
    summary = json.loads((cell_dir / "train" / "summary.json").read_text())
    assert [r["step"] for r in summary["resumes"]] == [TINY_VISION["train"]["steps"]]


def test_missing_data_path_skips_the_domain_with_a_clear_line(tmp_path):
    config = _config(tmp_path)
    config["domains"]["vision"]["data"] = str(tmp_path / "no-such-imagenet")
    report = run_suite(config, progress=False)
    assert "vision" in report["skipped"] and "does not exist" in report["skipped"]["vision"]
    assert "**skipped** vision: data path" in markdown(report)
    assert report["cells"] == []


@pytest.mark.quick
def test_config_files_and_plan(tmp_path):
    path = tmp_path / "suite.yaml"
    path.write_text("objectives: [infonce, dcl]\nseeds: [0, 1, 2]\ndomains:\n  speech: {evals: [intent]}\n"
                    "sweep: {domain: vision}\n")
    config = load_config(path)
    assert list(config["domains"]) == ["speech"] and config["domains"]["speech"]["evals"] == ["intent"]
    cells = plan(config)  # the sweep's domain is not in this suite
    assert [(c.objective, c.seed) for c in cells] == [(o, s) for o in ("untrained", "infonce", "dcl")
                                                      for s in (0, 1, 2)]
    assert all(c.overrides == ({"steps": 0} if c.objective == "untrained" else {}) for c in cells)
    config["baseline"] = False
    assert len(plan(config)) == 6
    bad = tmp_path / "bad.yaml"
    bad.write_text("domains:\n  audio: {}\n")
    with pytest.raises(ValueError, match="unknown domains \\['audio'\\]"):
        load_config(bad)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.toml")


def test_example_config_loads_and_skips_missing_paths(tmp_path):
    config = load_config(ROOT / "eval" / "suite_example.yaml")
    config["output_dir"] = str(tmp_path / "out")
    assert set(config["domains"]) == {"vision", "image_text", "speech", "speech_fairseq2", "audio_text"}
    report = run_suite(config, progress=False)  # none of the example's /data paths exist here
    assert set(report["skipped"]) == {"vision", "image_text", "speech", "speech_fairseq2", "audio_text"}
    assert report["cells"] == []


@pytest.mark.quick
def test_report_gives_intervals_and_paired_verdicts():
    from contrastkit.suite import build_report

    config = load_config(None)
    config.update(objectives=["infonce", "dcl"], seeds=[0, 1, 2])
    config["domains"] = {"vision": config["domains"]["vision"]}
    knn = {("infonce", 0): 0.30, ("infonce", 1): 0.32, ("infonce", 2): 0.31,
           ("dcl", 0): 0.40, ("dcl", 1): 0.41, ("dcl", 2): 0.42,
           ("untrained", 0): 0.20, ("untrained", 1): 0.22, ("untrained", 2): 0.19}
    results = [{"domain": "vision", "objective": o, "seed": s, "variant": "", "metrics": {"knn_top1": v}}
               for (o, s), v in knn.items()]
    report = build_report(config, results, {}, {})
    assert report["table"]["infonce"]["image kNN"]["half_width"] == pytest.approx(4.303 * 0.01 / 3**0.5)
    text = markdown(report)
    assert "| objective | image kNN |" in text  # only the columns that hold a number
    assert "| infonce | 31.0 ± 2.5 (n=3) |" in text
    assert text.index("| untrained |") < text.index("| infonce |")
    # dcl - infonce per seed: +10, +9, +11 points; dcl - untrained: +20, +19, +23 (sd 2.08)
    assert "- column image kNN: dcl - infonce = +10.0 ± 2.5 (95 % CI, 3 seeds): resolved" in text
    assert "- column image kNN: dcl - untrained = +20.7 ± 5.2 (95 % CI, 3 seeds): resolved" in text
    assert "- column image kNN: infonce - untrained = " in text and "untrained - infonce" not in text
    assert "docs/evidence.md" in text


def test_a_report_written_over_an_older_one_keeps_nothing_it_does_not_make(tmp_path):
    """A suite run again with fewer domains in the same folder: the earlier run's sweep plot is removed, and a
    table without papers' numbers gets no empty section for them."""
    from contrastkit.suite import build_report, write_report

    config = load_config(None)
    config.update(objectives=["dcl"], seeds=[0, 1])
    config["domains"] = {"audio_text": config["domains"]["audio_text"]}
    results = [{"domain": "audio_text", "objective": o, "seed": s, "variant": "",
                "metrics": {"zeroshot_intent_accuracy": 0.1 + 0.05 * s + (0.1 if o == "dcl" else 0)}}
               for o in ("untrained", "dcl") for s in (0, 1)]
    report = build_report(config, results, {}, {})
    (tmp_path / "report_batch_size.png").write_bytes(b"an earlier run's sweep")
    write_report(report, tmp_path)
    assert not (tmp_path / "report_batch_size.png").exists()
    assert (tmp_path / "report_domains.png").stat().st_size > 0
    assert report["references"] == [] and "Papers' numbers" not in (tmp_path / "report.md").read_text()


def test_audio_text_column_from_the_clap_recipe_and_its_eval(cells_in_process, tmp_path):
    """A tiny audio-text cell: the CLAP recipe, then eval/zeroshot_intent.py, its accuracy in the column (and
    equal to the recipe's own)."""
    config = _config(tmp_path)
    from contrastkit.data.speech import default_speech_data

    config["domains"] = {"audio_text": {**load_config(None)["domains"]["audio_text"],
                                        "fsc": str(default_speech_data(small=True) / "fsc"),
                                        "train": {"steps": 2, "width": 16, "warmup": 1, "log-every": 1}}}
    report = run_suite(config, progress=False)
    assert not report["failures"], report["failures"]
    stat = report["table"]["dcl"]["audio-text zero-shot intent"]
    untrained, cell = report["cells"]  # the untrained row's cell first: --steps 0
    assert untrained["objective"] == "untrained" and "--steps 0" in untrained["commands"][0]
    assert stat["values"] == [cell["metrics"]["zeroshot_intent_accuracy"]] and 0.0 <= stat["mean"] <= 1.0
    assert [c.split()[0] for c in cell["commands"]] == ["recipes/clap/train.py", "eval/zeroshot_intent.py"]
    assert "audio-text zero-shot intent" in markdown(report)
    # the eval script on the saved model gives the recipe's own number
    summary = json.loads((Path(config["output_dir"]) / "cells" / cell["domain"] / "dcl" / "seed0" / "train" /
                          "summary.json").read_text())
    assert summary["zeroshot_intent"]["accuracy"] == pytest.approx(stat["mean"], abs=1e-9)


def test_missing_interpreter_skips_the_domain_with_a_clear_line(tmp_path):
    config = _config(tmp_path)
    config["domains"] = {"speech_fairseq2": {**load_config(None)["domains"]["speech_fairseq2"],
                                             "python": "no-such-venv/bin/python"}}
    report = run_suite(config, progress=False)
    assert "python no-such-venv/bin/python does not exist" in report["skipped"]["speech_fairseq2"]
    assert "bash setup.sh --legacy-only" in markdown(report) and report["cells"] == []


def _speech_suite(tmp_path, domain):
    """On tiny copies of the FSC and VoxCeleb1 layouts (speech_copies, FSC's at 12 train, 4 valid and 4 test
    utterances: not the tests' subset's 360, nor the copies' usual 40, whose features through each cell's upstream
    were most of the work beside the processes' start-up), one training step."""
    from speech_copies import tiny_copies

    fsc, vox = tiny_copies(tmp_path / "data", fsc_sizes=(12, 4, 4))
    config = _config(tmp_path)
    config["domains"] = {domain: {**load_config(None)["domains"][domain], "fsc": str(fsc),
                                  "voxceleb": str(vox), "evals": ["intent"],
                                  "eval_options": {"intent": {"epochs": 2}}}}
    config["domains"][domain]["train"] = {**config["domains"][domain]["train"], "steps": 1, "batch-size": 4,
                                          "max-seconds": 1.0, "no-pretext-eval": True}
    report = run_suite(config, progress=False)
    assert not report["failures"], report["failures"]
    return report


@pytest.mark.parametrize("domain", ["speech", pytest.param("speech_fairseq2", marks=needs_fairseq2)])
def test_speech_columns_with_the_untrained_row(request, tmp_path, domain):
    """A tiny speech suite per backend (fairseq2's cells run by the second environment's interpreter, as processes,
    tested in that environment's tier: the suite's driver is the same code in both, and the main tier ran those
    processes a second time for 25 s; the current stack's in this process), intent only (speaker ID runs the
    same way): the untrained row from --steps 0, the trained row, the paired verdict."""
    if domain == "speech":
        request.getfixturevalue("cells_in_process")
    report = _speech_suite(tmp_path, domain)
    suffix = " (fairseq2)" if domain == "speech_fairseq2" else ""
    for row in ("untrained", "dcl"):
        assert set(report["table"][row]) == {"intent" + suffix}
    cells = {c["objective"]: c for c in report["cells"]}
    assert "--steps 0" in cells["untrained"]["commands"][0] and "--steps 1" in cells["dcl"]["commands"][0]
    if suffix:
        assert all(c.startswith(".venv-legacy/bin/python ") for c in cells["dcl"]["commands"])
        assert "--backend fairseq2" in cells["dcl"]["commands"][0]
    assert [v["text"].split(" = ")[0] for v in report["verdicts"]] == [f"column intent{suffix}: dcl - untrained"]


def test_siglip_is_an_image_text_baseline_compared_with_every_objective(tmp_path):
    """siglip (open_clip's SigLipLoss through the CLIP recipe's --loss siglip) is planned in image_text only,
    its cells run the recipe with --loss siglip and the unchanged zero-shot eval, and the verdicts pair every
    trained objective with it (InfoNCE included), as they do with InfoNCE."""
    from contrastkit.cli import parse
    from contrastkit.suite import SuiteArgs, build_report

    args = parse(SuiteArgs, argv=["--objectives", "infonce", "dcl", "siglip", "--domains", "vision", "image_text",
                                  "--seeds", "0", "1", "2"], config_flag=False)
    config = args.resolve()
    cells = plan(config)
    assert {c.domain for c in cells if c.objective == "siglip"} == {"image_text"}
    assert [c.objective for c in cells if c.variant] == ["infonce", "dcl"] * 2  # the vision sweep: none either
    (cell,) = [c for c in cells if c.objective == "siglip" and c.seed == 0]
    from contrastkit.suite import image_text_commands

    (_, train, _), (_, zeroshot, _) = image_text_commands(cell, config["domains"]["image_text"], tmp_path)
    assert train[train.index("--loss") + 1] == "siglip"
    assert zeroshot[0] == "eval/zeroshot.py" and "--loss" not in zeroshot

    config["domains"] = {"image_text": config["domains"]["image_text"]}
    top1 = {"untrained": (0.10, 0.14, 0.14), "infonce": (0.36, 0.26, 0.26), "dcl": (0.40, 0.28, 0.28),
            "siglip": (0.30, 0.25, 0.20)}
    results = [{"domain": "image_text", "objective": o, "seed": s, "variant": "", "metrics": {"zeroshot_top1": v}}
               for o, values in top1.items() for s, v in enumerate(values)]
    report = build_report(config, results, {}, {})
    names = [v["text"].split(": ")[1].split(" = ")[0] for v in report["verdicts"]]
    assert names == ["infonce - untrained", "dcl - untrained", "siglip - untrained", "dcl - infonce",
                     "infonce - siglip", "dcl - siglip"]
    text = markdown(report)
    # infonce - siglip per seed: +6, +1, +6 points (sd 2.89); dcl - siglip: +10, +3, +8
    assert "- column image zero-shot top-1: infonce - siglip = +4.3 ± 7.2 (95 % CI, 3 seeds): not resolved" in text
    assert "then against InfoNCE, then against siglip" in text
    assert "- siglip: a baseline (another library's loss), trained in image_text only" in text


def test_reuse_takes_an_earlier_reports_cells_where_the_commands_match(cells_in_process, tiny_suite, tmp_path):
    """--reuse report.json: a cell of the earlier report with this cell's commands is not run again (no log),
    its cell.json is written marked with its source, and the report says so; a cell whose settings differ runs."""
    from contrastkit.suite import load_reused

    config, report = tiny_suite
    reuse = load_reused(Path(config["output_dir"]) / "report.json")
    again = run_suite({**config, "output_dir": str(tmp_path / "new")}, progress=False, reuse=reuse)
    assert again["table"] == report["table"]
    assert not list((tmp_path / "new").rglob("log.txt"))
    assert all(c["reused_from"].endswith("report.json") for c in again["cells"])
    assert "2 cells taken from " in markdown(again)

    changed = copy.deepcopy(config)
    changed.update(output_dir=str(tmp_path / "changed"))
    changed["domains"]["vision"]["train"]["steps"] = 4
    cells = {c["objective"]: c for c in run_suite(changed, progress=False, reuse=reuse)["cells"]}
    assert "reused_from" in cells["untrained"] and "reused_from" not in cells["dcl"]  # --steps 0 either way
    assert (tmp_path / "changed" / "cells" / "vision" / "dcl" / "seed0" / "log.txt").exists()
    with pytest.raises(FileNotFoundError, match="--reuse: .* does not exist"):
        load_reused(tmp_path / "nope.json")
