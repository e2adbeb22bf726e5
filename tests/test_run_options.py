"""The recipes' common fields (steps, lr, warm-up, log/eval/save intervals, seed, progress) are written once, in
training.RunOptions; each recipe keeps its defaults (its ``DEFAULTS``), and every flag and --config key the recipes
had before still works: an earlier name is an alias of the one field, on the command line, in a --config file
and in a checkpoint's saved config. Two names of one option with different values are one ``error:`` line."""

import ast
import dataclasses
import inspect
import json
import textwrap
from types import SimpleNamespace

import pytest
import torch
import yaml
from test_cli import run_script

from contrastkit.cli import parse
from contrastkit.clip.train import ClipTrainConfig
from contrastkit.speech.clap import ClapTrainConfig
from contrastkit.speech.pretrain import PretrainConfig
from contrastkit.training import RUN_CONFIG, Checkpoints, RunOptions
from contrastkit.vision.train import VisionConfig, load_backbone
from contrastkit.vision.models import build_backbone

pytestmark = pytest.mark.quick

RECIPES = {"clip": ClipTrainConfig, "clap": ClapTrainConfig, "vision": VisionConfig, "wav2vec2": PretrainConfig}
COMMON = ("steps", "lr", "warmup", "log_every", "eval_every", "save_every", "seed", "progress")

# Every long option of each recipe before the common fields moved into RunOptions (the parser's, one spelling).
BEFORE = {
    "clip": "batch-size caption-key csv-separator data data-dir dataset-resampled ddp-timeout eval-every img-key "
            "keep-checkpoints log-every loss loss-option loss-options lr max-bad-fraction model no-dataset-resampled "
            "no-progress no-requeue-on-signal no-resume no-save-on-each-node no-verify-images num-train out-dir "
            "progress report-to requeue-on-signal requeue-signal resume save-every save-on-each-node seed "
            "shuffle-buffer steps train-num-samples verify-images warmup weight-decay workers zeroshot "
            "zeroshot-per-class",
    "clap": "batch-size caption data data-dir ddp-timeout directions eval-every keep-checkpoints log-every loss "
            "loss-option loss-options lr max-seconds no-progress no-requeue-on-signal no-resume no-save-on-each-node "
            "out-dir progress report-to requeue-on-signal requeue-signal resume save-every save-on-each-node seed "
            "speed steps warmup weight-decay width",
    "vision": "alpha backbone batch-size blur checkpoint-every crop-min data ddp-timeout epochs eval-every grayscale "
              "hue image-size keep-checkpoints knn-k knn-temperature lam log-every loss loss-option loss-options lr "
              "method momentum no-blur no-progress no-requeue-on-signal no-resume no-save-on-each-node "
              "no-small-images optimizer out-dir progress proj-dim proj-hidden queue-size report-to "
              "requeue-on-signal requeue-signal resume rho samples save-on-each-node seed sigma small-images steps "
              "temperature test-images threads train-images views warmup-steps weight-decay width workers",
    "wav2vec2": "backend batch-size conformer data ddp-timeout gumbel keep-checkpoints log-every loss loss-option "
                "loss-options lr max-seconds no-conformer no-pretext-eval no-requeue-on-signal no-resume "
                "no-save-on-each-node out out-dir pretext-eval report-to requeue-on-signal requeue-signal resume "
                "save-every save-on-each-node seed steps temperature warmup",
}

# The defaults each recipe had (warm-up in steps of its default run; vision: steps from --epochs).
DEFAULTS = {
    "clip": dict(steps=300, lr=1e-3, warmup=30, log_every=10, eval_every=100, save_every=100, seed=0, resume=False),
    "clap": dict(steps=300, lr=1e-3, warmup=30, log_every=10, eval_every=100, save_every=100, seed=0, resume=False),
    "vision": dict(steps=None, lr=4e-3, warmup=10, log_every=10, eval_every=0, save_every=0, seed=0, resume=False),
    "wav2vec2": dict(steps=800, lr=4e-3, warmup=64, log_every=10, eval_every=0, save_every=100, seed=0,
                     resume="auto"),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_common_field_is_written_once_in_run_options(recipe):
    """No recipe config writes a field of RunOptions again, nor keeps one under an earlier name: it inherits
    the one definition (help, aliases), and only its DEFAULTS change a default."""
    config = RECIPES[recipe]
    run_fields = {f.name: f for f in dataclasses.fields(RunOptions)}
    assert set(COMMON) <= set(run_fields)
    body = ast.parse(textwrap.dedent(inspect.getsource(config))).body[0].body
    written = {node.target.id for node in body if isinstance(node, ast.AnnAssign)}
    assert not written & set(run_fields), f"{config.__name__} writes {sorted(written & set(run_fields))} again"
    assert not written & {"warmup_steps", "checkpoint_every"}
    fields = {f.name: f for f in dataclasses.fields(config)}
    for name, common in run_fields.items():
        assert dict(fields[name].metadata) == dict(common.metadata), name
        assert fields[name].default == getattr(config, "DEFAULTS", {}).get(name, common.default), name


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_keeps_its_defaults(recipe):
    cfg = RECIPES[recipe]()
    expected = DEFAULTS[recipe]
    got = {name: getattr(cfg, name) for name in expected}
    got["warmup"] = cfg.warmup_for(cfg.steps or 0) if cfg.warmup < 1 else cfg.warmup
    assert got == expected
    assert cfg.progress is True


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_lists_every_flag_the_recipe_had(recipe, capsys, monkeypatch):
    code, out, _ = run_script(f"recipes/{recipe}/train.py", ["--help"], capsys, monkeypatch)
    assert code == 0
    shown = {word.strip(",[]") for word in out.split("options:", 1)[1].split() if word.startswith("--")}
    missing = [flag for flag in BEFORE[recipe].split() if f"--{flag}" not in shown]
    assert not missing, missing
    if recipe == "vision":  # the earlier names, said beside the one option
        assert "--warmup N|FRACTION, --warmup-steps N|FRACTION" in out
        assert "--save-every SAVE_EVERY, --checkpoint-every SAVE_EVERY" in out


# (recipe, argv with an earlier name, field, value): each maps to the one field
OLD_NAMES = [
    ("vision", ["--warmup-steps", "5"], "warmup", 5),
    ("vision", ["--warmup_steps", "5"], "warmup", 5),
    ("vision", ["--checkpoint-every", "3"], "save_every", 3),
    ("vision", ["--checkpoint_every", "3"], "save_every", 3),
    ("vision", ["--warmup", "0.5"], "warmup", 0.5),  # the new name, in the vision recipe too
    ("clip", ["--warmup", "20", "--save-every", "50"], "save_every", 50),
    ("clip", ["--checkpoint-every", "50"], "save_every", 50),
    ("wav2vec2", ["--warmup", "0.25"], "warmup", 0.25),
    ("wav2vec2", ["--out", "somewhere"], "out_dir", "somewhere"),
]


@pytest.mark.parametrize("recipe,argv,field,value", OLD_NAMES, ids=[f"{r}:{' '.join(a)}" for r, a, _, _ in OLD_NAMES])
def test_an_earlier_flag_sets_the_one_field(recipe, argv, field, value):
    assert getattr(parse(RECIPES[recipe], argv=argv), field) == value


def test_config_file_keys_before_and_after(tmp_path):
    """Every key a recipe's --config file could hold still loads (earlier names under the one field)."""
    for recipe, config in RECIPES.items():
        defaults = dataclasses.asdict(parse(config, argv=[]))
        keys = {flag.replace("-", "_") for flag in BEFORE[recipe].split() if not flag.startswith("no-")}
        names = {"warmup_steps": "warmup", "checkpoint_every": "save_every", "loss_option": "loss_options",
                 "out": "out_dir"}
        values = {key: defaults[names.get(key, key)] for key in keys}
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        (tmp_path / f"{recipe}.yaml").write_text(yaml.safe_dump(values))
        assert dataclasses.asdict(parse(config, argv=["--config", str(tmp_path / f"{recipe}.yaml")])) == defaults
    (tmp_path / "old.yaml").write_text("warmup-steps: 7\ncheckpoint_every: 4\n")
    cfg = parse(VisionConfig, argv=["--config", str(tmp_path / "old.yaml")])
    assert (cfg.warmup, cfg.save_every) == (7, 4)
    cfg = parse(VisionConfig, argv=["--config", str(tmp_path / "old.yaml"), "--warmup", "2"])  # the command line wins
    assert cfg.warmup == 2


# (script, argv, file content or None): two names of one option with different values
CONFLICTS = [
    ("recipes/vision/train.py", ["--warmup", "5", "--warmup-steps", "7"], None),
    ("recipes/vision/train.py", ["--checkpoint-every", "2", "--save_every", "3"], None),
    ("recipes/clip/train.py", ["--save-every", "2", "--checkpoint-every", "3"], None),
    ("recipes/wav2vec2/train.py", ["--out", "a", "--out-dir", "b"], None),
    ("recipes/vision/train.py", ["--config", "{file}"], "warmup: 5\nwarmup_steps: 7\n"),
]


@pytest.mark.parametrize("script,argv,text", CONFLICTS, ids=[" ".join(a) + (f" {t!r}" if t else "")
                                                            for _, a, t in CONFLICTS])
def test_two_names_of_one_option_disagreeing_is_one_error_line(script, argv, text, tmp_path, capsys, monkeypatch):
    if text:
        (tmp_path / "run.yaml").write_text(text)
    # --batch-size 0 is refused after parsing: where the conflict went unseen the test fails at once, not after a run
    argv = [a.format(file=tmp_path / "run.yaml") for a in argv] + ["--batch-size", "0"]
    monkeypatch.chdir(tmp_path)
    code, out, err = run_script(script, argv, capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "one option" in lines[0] and "Traceback" not in out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["run.yaml"] if text else [])


def test_two_names_agreeing_or_one_name_twice_is_no_error():
    assert parse(VisionConfig, argv=["--warmup", "5", "--warmup-steps", "5"]).warmup == 5
    assert parse(VisionConfig, argv=["--warmup-steps", "5", "--warmup_steps", "6"]).warmup == 6  # one name: the last


def test_warmup_is_steps_or_a_fraction_of_them():
    assert ClipTrainConfig(warmup=30).warmup_for(300) == 30
    assert ClipTrainConfig(warmup=0.1).warmup_for(300) == 30
    assert PretrainConfig(warmup=0.08).warmup_for(30) == 2  # rounded down, as the wav2vec 2.0 recipe did
    assert PretrainConfig(warmup=40).warmup_for(800) == 40  # steps in the wav2vec 2.0 recipe too
    assert VisionConfig(warmup=0).warmup_for(100) == 0
    for bad in ("2.5", "-1"):
        with pytest.raises(SystemExit) as stop:
            parse(ClipTrainConfig, argv=["--warmup", bad])
        assert stop.value.code == 2


def test_a_checkpoint_saved_before_the_rename_compares_under_the_new_names(tmp_path):
    """A vision checkpoint's run_config.json (and config.json) from before has warmup_steps and checkpoint_every:
    a resume compares them as warmup and save_every, and load_backbone reads the run."""
    old = {**dataclasses.asdict(VisionConfig(out_dir=str(tmp_path))), "warmup_steps": 10, "checkpoint_every": 0}
    del old["warmup"], old["save_every"]
    path = tmp_path / "checkpoints" / "checkpoint_4"
    path.mkdir(parents=True)
    (path / RUN_CONFIG).write_text(json.dumps(old))
    accelerator = SimpleNamespace(project_configuration=SimpleNamespace(save_on_each_node=False),
                                  is_main_process=True, is_local_main_process=True)

    def changes(**now):
        config = dataclasses.asdict(VisionConfig(out_dir=str(tmp_path), **now))
        return Checkpoints(accelerator, tmp_path, 2, config, VisionConfig.FIXED)._changes(path)

    assert changes() == {}
    assert changes(warmup=3, save_every=2) == {"warmup": (10, 3), "save_every": (0, 2)}
    (tmp_path / "config.json").write_text(json.dumps(old))
    backbone, _ = build_backbone("small_cnn", True, 32)
    torch.save(backbone.state_dict(), tmp_path / "backbone.pt")
    _, cfg = load_backbone(tmp_path)
    assert (cfg.warmup, cfg.save_every) == (10, 0)


@pytest.mark.parametrize("backend", [None, "gloo"])
def test_ddp_backend_is_the_process_groups(backend, monkeypatch, tmp_path):
    """--ddp-backend gloo (several processes sharing one GPU, which NCCL refuses) is the backend make_accelerator
    gives accelerate's process group options; without it, none is given (accelerate's choice: NCCL on GPUs)."""
    import accelerate

    from contrastkit.training import make_accelerator

    seen = {}

    class Stop(Exception):
        pass

    def accelerator(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(accelerate, "Accelerator", accelerator)
    cfg = parse(ClipTrainConfig, argv=[] if backend is None else ["--ddp-backend", backend])
    with pytest.raises(Stop):
        make_accelerator(tmp_path, cfg)
    (handler,) = seen["kwargs_handlers"]
    assert handler.to_kwargs().get("backend") == backend
    assert handler.to_kwargs()["timeout"].total_seconds() == cfg.ddp_timeout
