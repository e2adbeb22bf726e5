"""The GPU scripts (tools/gpu/), proven on the CPU before a GPU machine is lent.

- The harness, once: tools/gpu/e2e.sh's --dry-run on the runs that take every path of it (HARNESS): a recipe
  stage with its untrained baseline and its --resume check (bit-identical), the main job on two processes (the
  shared-device launch, equal to one process), a client stage (SentenceTransformerTrainer) with DCL and with the
  ecosystem's own loss; the report judges each by its criterion (tools/gpu/e2e_report.py, checked here on
  made-up runs too) and has the harness's timings.
- Every run's wiring, without training: E2E_LIST=1 writes each of the 23 runs' environment and command, and
  each is run here up to its entry point's real argument parser, through the harness's probe (its watch and
  E2E_IMPORT installed), and the accelerate launcher's options through accelerate's parser; the entry points
  themselves train in their own tests (tests/test_clip_train.py, test_vision_train.py, test_wav2vec2_recipe.py,
  test_clap.py, test_hf_clients.py, test_sentence_transformers.py, test_clip_adapter.py).
- tools/gpu/check.sh's --dry-run runs its quick plan's jobs at N = 64 (every method it names is known);
  tools/gpu/plan.sh's two calls pack their results (the e2e and check steps narrowed to a run and a job).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))

import e2e_probe  # noqa: E402
import e2e_report  # noqa: E402

OWN = [name for name, stage in e2e_report.STAGES.items() if stage.own]
RUNS = [*e2e_report.STAGES, *e2e_report.UNTRAINED_RUNS, *(f"{name}-own" for name in OWN)]
PROBE = "tools/gpu/e2e_probe.py"
# every path of the harness: the resume check and the untrained baseline (clip), the two-process launch and its
# comparison with one process (clip_2proc), a client without accelerate, with DCL and with its own loss (st)
HARNESS = ("clip", "clip_2proc", "clip-untrained", "st", "st-own")


def _env(**extra) -> dict:
    bin_dir = str(Path(sys.executable).parent)  # this interpreter's environment, activated or not
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **extra}


def _script(name: str, *args, env=None, timeout=600):
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu" / name), *args], env=_env(**(env or {})), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def e2e_data(tmp_path_factory) -> Path:
    """--dry-run's inputs (tools/gpu/e2e_data.py --small), made once for this module's runs of the scripts."""
    out = tmp_path_factory.mktemp("e2e-data")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "e2e_data.py"), str(out), "--small"],
                          env=_env(PYTHONPATH=str(ROOT)), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _started(log: str) -> list[str]:
    """The runs e2e.sh started, by its lines "== NAME: exit ..." and "== clip --resume from ..."."""
    return re.findall(r"^== (\S+)(?:: exit | --resume)", log, flags=re.M)


def _work(data: Path, folder: Path) -> Path:
    """A work folder (E2E_WORK) whose inputs are links to the module's: e2e_data.py finds each part made."""
    folder.mkdir(parents=True)
    for part in data.iterdir():
        (folder / part.name).symlink_to(part)
    return folder


def test_dry_run_tests_the_harness_once(e2e_data, tmp_path):
    """HARNESS's runs exit 0 with the objective seen in training: DCL's calls (one or more a step) with the step
    and replay timings and the ecosystem's InfoNCE timed beside (one process), the ecosystem's own loss watched
    in its own run (calls, top-1 and chance each), the recipe's evaluation in its summary and its untrained run's;
    the main job's resume from its half-way checkpoint bit-identical, and on two CPU processes (gloo, the
    harness's shared-device launch) its first steps' loss equal to one process's; the report says both."""
    work = _work(e2e_data, tmp_path / "e2e")
    done = _script("e2e.sh", "--dry-run", env={"E2E_WORK": str(work), "STAGES": " ".join(HARNESS)}, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((work / "report" / "e2e.json").read_text())
    rows = {r["stage"]: r for r in report["rows"]}
    assert list(rows) == ["clip", "clip_2proc", "st"], list(rows)
    for name, r in rows.items():
        dcl = r["dcl"]["probe"]
        assert r["dcl"]["rc"] == 0 and dcl["calls"] >= dcl["steps"] > 0, (name, r["dcl"])
        assert len(dcl["top1"]) == len(dcl["chance"]) == dcl["calls"], name
        if name != "clip_2proc":  # its objective gathers: no replay on one process
            assert dcl["step_ms"] > 0 and dcl["objective_ms"] > 0 and dcl["infonce_ms"] > 0, (name, dcl)
    own = rows["st"]["own"]["probe"]
    assert rows["st"]["own"]["rc"] == 0 and own["calls"] >= own["steps"] > 0, rows["st"]["own"]
    assert len(own["top1"]) == own["calls"] and "objective_ms" not in own
    assert rows["clip"]["own"] is None  # not selected
    for name in ("clip", "clip_2proc"):  # the recipe's evaluation, and its baseline's (clip-untrained)
        assert None not in (rows[name]["dcl_judged"]["untrained"], rows[name]["dcl_judged"]["trained"]), rows[name]
    assert report["untrained"]["clip-untrained"]["rc"] == 0 and report["untrained"]["clip-untrained"]["summary"]
    assert report["untrained"]["vision-untrained"] is None
    assert report["resume"]["bit_identical"], report["resume"]
    pair = report["two_processes"]
    assert pair["processes"] == 2 and pair["equal"], pair
    md = (work / "report" / "e2e.md").read_text()
    assert "Resume (main job)" in md and "bit-identical" in md and "Two processes (main job, 2 processes" in md, md
    assert sorted(p.stem for p in (work / "report" / "e2e-runs").glob("*.status")) == sorted(HARNESS)
    # a second device call on the same work folder (E2E_KEEP, E2E_SKIP_DONE): nothing run again, the same report
    again = _script("e2e.sh", "--dry-run", env={"E2E_WORK": str(work), "STAGES": " ".join(HARNESS), "E2E_KEEP": "1",
                                                "E2E_SKIP_DONE": "1"}, timeout=120)
    assert again.returncode == 0 and _started(again.stdout) == [], again.stdout[-3000:]
    kept = json.loads((work / "report" / "e2e.json").read_text())
    assert [r["stage"] for r in kept["rows"]] == list(rows) and kept["resume"] == report["resume"], kept


# ---------------------------------------------------------------------- every run's wiring, without training

class _Parsed(Exception):
    pass


def _run_to_parser(argv: list[str], env: dict) -> str | None:
    """Run the script ``argv[0]`` (the probe, which runs the entry point) in this process until the entry point
    has parsed its arguments with its real parser (argparse, HfArgumentParser); None, or what went wrong."""
    import argparse
    import contextlib
    import io
    import runpy
    from unittest import mock

    import transformers

    hf = transformers.HfArgumentParser
    real_parse, real_hf = argparse.ArgumentParser.parse_args, hf.parse_args_into_dataclasses

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(real_parse(self, args, namespace))

    def parse_into_dataclasses(self, *a, **k):
        raise _Parsed(real_hf(self, *a, **k))

    err = io.StringIO()
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
                mock.patch.object(hf, "parse_args_into_dataclasses", parse_into_dataclasses), \
                mock.patch.object(sys, "argv", list(argv)), mock.patch.dict(os.environ, env), \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            runpy.run_path(argv[0], run_name="__main__")
    except _Parsed:
        return None
    except SystemExit as e:
        return f"exit {e.code}: {err.getvalue().strip()[-600:]}"
    except Exception as e:  # noqa: BLE001  (what the run would have met)
        return f"{type(e).__name__}: {e}"
    return "ended without parsing its arguments"


def parse_runs(run: Path) -> dict:
    """{name: {env, launch, argv, error}} for each NAME.cmd of an E2E_LIST run folder: the launcher's options
    through accelerate's parser, then the command run here up to its entry point's parser (cwd: the repo)."""
    from accelerate.commands.launch import launch_command_parser

    os.chdir(ROOT)
    found = {}
    for path in sorted(run.glob("*.cmd")):
        words = path.read_bytes().decode().split("\0")[:-1]
        split = words.index("--")
        env = dict(w.split("=", 1) for w in words[:split])
        command, launch, error = words[split + 1:], None, None
        argv = command[1:]  # python SCRIPT ARGS...
        if command[1:3] == ["-m", "accelerate.commands.launch"]:  # python -m accelerate.commands.launch ...
            try:
                ns = launch_command_parser().parse_args(command[3:])
            except SystemExit as e:
                error = f"accelerate launch: exit {e.code}"
            else:
                launch = {k: getattr(ns, k) for k in ("cpu", "multi_gpu", "num_processes", "num_machines",
                                                      "mixed_precision", "main_process_port")}
                argv = [ns.training_script, *ns.training_script_args]
        if error is None:
            error = _run_to_parser(argv, env)
        found[path.stem] = {"env": env, "launch": launch, "argv": argv, "python": command[0], "error": error}
    return found


def _arg(argv: list[str], flag: str):
    """The value of the last ``flag`` in argv (as argparse reads it), or None."""
    at = [i for i, a in enumerate(argv) if a == flag]
    return argv[at[-1] + 1] if at else None


def test_every_run_is_wired(e2e_data, tmp_path):
    """Each of the 23 runs (and the resume check) as the harness would start it: the launcher's options valid
    (one process, or two for clip_2proc), the harness's probe around the right entry point (its E2E_REFERENCE,
    E2E_WATCH and E2E_SYNC among the probe's, its E2E_IMPORT importable, its watch installed), and the entry
    point's flags accepted by its own parser. NAME-own is NAME's entry point with the ecosystem's own loss; the
    untrained runs are the recipes' --steps 0; the resume check continues the main job's run."""
    work = _work(e2e_data, tmp_path / "e2e")
    done = _script("e2e.sh", "--dry-run", env={"E2E_WORK": str(work), "E2E_LIST": "1"}, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not (work / "report" / "e2e.md").exists() and not list((work / "run").glob("*.status"))  # nothing ran
    check = subprocess.run([sys.executable, __file__, "--parse", str(work / "run")], cwd=ROOT,
                           env=_env(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                                    TRANSFORMERS_OFFLINE="1"),
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    runs = json.loads(check.stdout.splitlines()[-1])
    assert sorted(runs) == sorted([*RUNS, "clip_resume"]), sorted(runs)
    errors = {name: r["error"] for name, r in runs.items() if r["error"]}
    assert not errors, errors
    for name, r in runs.items():
        env, argv = r["env"], r["argv"]
        assert r["python"] == sys.executable, (name, r["python"])
        if r["launch"] is not None:  # the GPU's launch on the CPU: one process, or two sharing the device
            assert r["launch"]["num_machines"] == 1 and r["launch"]["mixed_precision"] == "no", (name, r["launch"])
            assert r["launch"]["num_processes"] == (2 if name == "clip_2proc" else 1), (name, r["launch"])
        if name == "clip_resume":
            continue
        assert argv[0] == PROBE, (name, argv)
        dcl = name in e2e_report.STAGES
        reference = env.get("E2E_REFERENCE")
        if dcl:  # contrastkit's objective watched
            assert env.get("E2E_WATCH", "core") in ("core", "mnrl"), (name, env)
        if dcl and name != "clip_2proc":  # the DCL runs' objective replayed beside the ecosystem's InfoNCE
            assert reference in e2e_probe.REFERENCES, (name, env)
        else:
            assert reference == "none", (name, env)
    entry = {name: r["argv"][1:] for name, r in runs.items() if name != "clip_resume"}
    for name in OWN:  # the same entry point, with the ecosystem's own loss
        dcl, own, own_env = entry[name], entry[f"{name}-own"], runs[f"{name}-own"]["env"]
        if _arg(dcl, "--loss") is not None and dcl[0] != "-m":  # a recipe, or st_train.py: --loss
            assert own[0] == dcl[0] and _arg(dcl, "--loss") == "dcl", (name, dcl, own)
            assert _arg(own, "--loss") == ("mnrl" if name.startswith("st") else "infonce"), (name, own)
        elif dcl[0] == "-m":  # open_clip_train through the adapter, and alone
            assert dcl[1] == "contrastkit.adapters.open_clip" and own[1] == "open_clip_train.main", (dcl, own)
        else:  # transformers' scripts: the one import, and without it
            assert own[0] == dcl[0] and runs[name]["env"]["E2E_IMPORT"].startswith("contrastkit.adapters."), name
            assert "E2E_IMPORT" not in own_env, (name, own_env)
        if not entry[name][0].startswith("recipes/"):  # the ecosystem's own loss is watched, not contrastkit's
            assert own_env.get("E2E_WATCH") in e2e_probe.WATCHES and own_env["E2E_WATCH"] != "core", (name, own_env)
    clip = entry["clip"]
    for name in ("clip-untrained", "clip-own"):
        assert entry[name][0] == clip[0] and _arg(entry[name], "--out-dir") != _arg(clip, "--out-dir"), name
    assert _arg(entry["clip-untrained"], "--steps") == "0" and _arg(entry["vision-untrained"], "--steps") == "0"
    assert entry["vision-untrained"][0] == entry["vision_simclr"][0]
    pair = runs["clip_2proc"]
    assert pair["env"]["E2E_SHARED_GPU"] == "1" and pair["env"]["E2E_SYNC"] == "warn"
    assert _arg(entry["clip_2proc"], "--ddp-backend") == "gloo" and _arg(entry["clip_2proc"], "--steps") == _arg(
        clip, "--steps")
    resume = runs["clip_resume"]["argv"]  # the main job's command (no probe), on its own folder, --resume
    assert resume[-1] == "--resume" and resume[0] == clip[0], resume
    assert [a for a in resume[:-1] if a != _arg(resume, "--out-dir")] == [
        a for a in clip if a != _arg(clip, "--out-dir")], (resume, clip)
    assert _arg(clip, "--save-every") == str(int(_arg(clip, "--steps")) // 2)  # the half-way checkpoint
    assert runs["vision_moco"]["env"].get("TRITON_INTERPRET") == "1"  # MoCo's kernels under the interpreter
    assert "backend=triton" in entry["vision_moco"] and "backend=triton" in entry["vision_moco-own"]


def test_budget_spent_runs_nothing_and_still_reports(e2e_data, tmp_path):
    """E2E_BUDGET: past it no run starts (each one says so) and the report is still written (empty, exit 1:
    nothing ran), so a device call that does more keeps its time."""
    work = _work(e2e_data, tmp_path / "e2e")
    done = _script("e2e.sh", "--dry-run", env={"E2E_WORK": str(work), "E2E_BUDGET": "0"}, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("not run (E2E_BUDGET=0 s spent)") == len(RUNS), done.stdout
    assert (work / "report" / "e2e.md").exists()


@pytest.mark.quick
def test_unknown_stage_is_one_error_line(tmp_path):
    done = _script("e2e.sh", "--dry-run", env={"STAGES": "clip clip_own"}, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: unknown run 'clip_own'"), done.stderr


@pytest.mark.quick
def test_compare_names_a_difference(tmp_path):
    """The resume check reads two checkpoints' weights: equal ones are bit-identical, a changed entry is not,
    with its difference."""
    from safetensors.torch import save_file

    weights = {"w": torch.randn(3, 4), "b": torch.zeros(2)}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        save_file(weights, str(tmp_path / name / "model.safetensors"))
    assert e2e_report.compare(tmp_path / "a", tmp_path / "b")["bit_identical"]
    save_file({**weights, "b": torch.tensor([0.0, 0.25])}, str(tmp_path / "b" / "model.safetensors"))
    result = e2e_report.compare(tmp_path / "a", tmp_path / "b")
    assert not result["bit_identical"] and result["max_abs_diff"] == 0.25


# ---------------------------------------------------------------------- the criteria, on made-up runs

def _run(run: Path, name: str, rc: int = 0, probe: dict | None = None, summary: dict | None = None, rank1=None):
    (run / f"{name}.status").write_text(f"{rc}\n")
    (run / f"{name}.json").write_text(json.dumps({"calls": 8, "steps": 8, "device": "cpu", **(probe or {})}))
    if summary is not None:
        (run / f"{name}.summary.json").write_text(json.dumps(summary))
    if rank1 is not None:
        (run / f"{name}.rank1.json").write_text(json.dumps(rank1))


def _learned(run: Path, tmp_path: Path) -> dict:
    e2e_report.write(run, tmp_path / "report" / "e2e.md", "test", "abc")
    report = json.loads((tmp_path / "report" / "e2e.json").read_text())
    return {r["stage"]: (r["dcl_judged"] and r["dcl_judged"]["learned"], r["own_judged"] and r["own_judged"]["learned"])
            for r in report["rows"]}


def test_criteria_read_learning_not_a_falling_loss(tmp_path):
    """Each criterion compares the trained value with the untrained one by its margin: a loss that falls while
    the top-1 stays at chance (wav2vec 2.0's collapsing codebook) is not learning; a recipe's evaluation above its
    untrained run's by the margin is, below it is not; a run without its untrained baseline, or that failed, is not."""
    run = tmp_path / "run"
    run.mkdir()
    margin = e2e_report.CRITERIA["top1"].margin
    chance = {"chance_untrained": 0.05, "chance_trained": 0.3}  # fewer valid distractors: chance rose
    _run(run, "run_wav2vec2", probe={"loss_first": 3.0, "loss_last": 1.2, "top1_untrained": 0.05,
                                     "top1_trained": 0.3 + margin / 2, **chance})
    _run(run, "run_wav2vec2-own", probe={"top1_untrained": 0.05, "top1_trained": 0.3 + 2 * margin, **chance})
    knn = e2e_report.CRITERIA["knn"].margin
    _run(run, "vision-untrained", summary={"knn_top1": 0.25})
    _run(run, "vision_moco", summary={"knn_top1": 0.25 + 2 * knn})
    _run(run, "vision_moco-own", summary={"knn_top1": 0.25 + knn / 2})
    _run(run, "vision_simclr", summary={"knn_top1": 0.5}, rc=1)
    _run(run, "clip", summary={"zeroshot_top1": 0.4})  # no clip-untrained run
    assert _learned(run, tmp_path) == {"clip": (False, None), "vision_simclr": (False, None),
                                       "vision_moco": (True, False), "run_wav2vec2": (False, True)}
    md = (tmp_path / "report" / "e2e.md").read_text()
    assert "| recipes/vision MoCo (`backend=triton`) | knn | 0.250 | 0.290 |" in md, md
    assert "NO (exit 1) / not run" in md


def test_recipe_evaluations_are_read_where_the_recipes_write_them(tmp_path):
    """wav2vec 2.0: held-out accuracy above each model's own chance; CLAP: the summary's trained and untrained
    zero-shot intent accuracy; the main job: zero-shot top-1 against its --steps 0 run's."""
    run = tmp_path / "run"
    run.mkdir()
    pretext = {"trained": {"accuracy": 0.30, "chance": 0.10}, "untrained": {"accuracy": 0.06, "chance": 0.05}}
    _run(run, "wav2vec2", summary={"pretext": pretext})
    collapsed = {"trained": {"accuracy": 0.30, "chance": 0.29}, "untrained": {"accuracy": 0.06, "chance": 0.05}}
    _run(run, "wav2vec2-own", summary={"pretext": collapsed})
    _run(run, "clap", summary={"zeroshot_intent": {"accuracy": 0.5}, "zeroshot_intent_untrained": {"accuracy": 0.1}})
    _run(run, "clip-untrained", summary={"zeroshot_top1": 0.12})
    _run(run, "clip", summary={"zeroshot_top1": 0.30})
    _run(run, "clip-own", summary={"zeroshot_top1": 0.13})
    assert _learned(run, tmp_path) == {"clip": (True, False), "wav2vec2": (True, False), "clap": (True, None)}


def test_two_processes_against_one(tmp_path):
    """The two-process run's loss, the mean of its processes' call by call, against the one-process run's in
    the first steps: equal within float32's tolerance on the CPU, not when a step differs."""
    run = tmp_path / "run"
    run.mkdir()
    one = [4.0, 3.9, 3.8, 3.7, 3.6, 3.0]
    _run(run, "clip", probe={"losses": one})
    _run(run, "clip_2proc", probe={"losses": [x - 0.1 for x in one], "host_syncs": 0},
         rank1={"losses": [x + 0.1 for x in one]})
    pair = e2e_report.two_processes(e2e_report.run_of(run, "clip"), e2e_report.run_of(run, "clip_2proc"))
    assert pair["processes"] == 2 and pair["max_rel_diff"] < 1e-12 and pair["equal"]
    _run(run, "clip_2proc", probe={"losses": [x - 0.1 for x in one]}, rank1={"losses": [x + 0.11 for x in one]})
    pair = e2e_report.two_processes(e2e_report.run_of(run, "clip"), e2e_report.run_of(run, "clip_2proc"))
    assert not pair["equal"] and pair["max_rel_diff"] > e2e_report.EQUAL_TOLERANCE["cpu"]


# ---------------------------------------------------------------------- the probe on each ecosystem's objective

def _watched(monkeypatch, tmp_path, watch: str, reference: str = "none") -> e2e_probe.Probe:
    """A probe with E2E_WATCH=watch's functions wrapped as the harness wraps them (undone after the test)."""
    probe = e2e_probe.Probe(tmp_path / f"{watch}.json", reference, warmup_calls=3)
    for owner, name, score in e2e_probe._watches(watch):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # put back at the end
        probe.watch(owner, name, score)
    return probe


def _steps(probe: e2e_probe.Probe, call, steps: int = 2) -> dict:
    for _ in range(steps):
        e2e_probe._loss_of(call()).backward()
        probe.mark_step()
    return probe.summary()


def test_probe_sees_each_objective_and_replays_each_reference(monkeypatch, tmp_path):
    """What the harness's runs beyond HARNESS's depend on, at the call each entry point makes: contrastkit's
    objective seen (two views, MoCo's query/key, image-text, wav2vec 2.0's frames, the Hugging Face dual encoders'
    objective) and replayed beside the ecosystem's InfoNCE (REFERENCES but mnrl, which HARNESS's st replays);
    the ecosystems' own losses seen where
    they are computed (open_clip's ClipLoss called with keywords as open_clip_train calls it, transformers'
    CLIP loss inside CLIPModel's forward, Wav2Vec2ForPreTraining's forward with its masked frames)."""
    from contrastkit.losses import build_loss
    from contrastkit.losses.frames import FrameObjective

    torch.manual_seed(0)
    leaf = lambda *shape: torch.randn(*shape, requires_grad=True)  # noqa: E731
    z1, z2, queue, scale = leaf(8, 16), leaf(8, 16), torch.randn(12, 16), torch.tensor(10.0, requires_grad=True)
    pos, neg, valid = leaf(10), leaf(10, 4), torch.rand(10, 4) > 0.3
    from types import SimpleNamespace

    from contrastkit.adapters import hf_clip

    dcl = build_loss("dcl")
    model = SimpleNamespace(logit_scale=scale, logit_scale_t=scale, logit_scale_a=scale)  # the scales' holders
    clip_family, clap_family = hf_clip.Family("m", "CLIPModel"), hf_clip.Family("m", "ClapModel", other="audio_embeds")
    calls = {"contrastkit": [lambda: dcl(z1, z2), lambda: dcl.query_key(z1, z2, queue)],  # SimCLR, MoCo
             "openclip": [lambda: dcl.cross_modal(z1, z2, logit_scale=scale)],  # the main job, open_clip's adapter
             "hf_wav2vec2": [lambda: FrameObjective("dcl").summed(pos, neg, valid, model_temperature=0.1)],
             "hf_clip": [lambda: hf_clip.ClipObjective("dcl")(model, clip_family, z1, z2),  # run_clip.py + the import
                         lambda: hf_clip.ClipObjective("dcl")(model, clap_family, z1, z2)]}  # the CLAP recipe
    for reference, made in calls.items():
        for call in made:
            with monkeypatch.context() as patch:
                result = _steps(_watched(patch, tmp_path, "core", reference), call)
            assert result["calls"] == result["steps"] == 2 and len(result["top1"]) == 2, (reference, result)
            assert result["objective_ms"] > 0 and result["infonce_ms"] > 0, (reference, result)

    from open_clip.loss import ClipLoss

    with monkeypatch.context() as patch:
        probe = _watched(patch, tmp_path, "openclip")
        result = _steps(probe, lambda: ClipLoss()(image_features=z1, text_features=z2, logit_scale=scale))
    assert result["calls"] == 2 and len(result["top1"]) == 2 and "objective_ms" not in result, result

    import transformers as T

    common = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    clip = T.CLIPModel(T.CLIPConfig(text_config=dict(common, vocab_size=20, max_position_embeddings=8),
                                    vision_config=dict(common, image_size=8, patch_size=4), projection_dim=8))
    ids, pixels = torch.randint(0, 20, (4, 6)), torch.randn(4, 3, 8, 8)
    with monkeypatch.context() as patch:
        probe = _watched(patch, tmp_path, "hf_clip")
        result = _steps(probe, lambda: clip(input_ids=ids, pixel_values=pixels, return_loss=True))
    assert result["calls"] == 2 and len(result["top1"]) == 2 and result["chance"][0] == 0.25, result

    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices, _sample_negative_indices

    from contrastkit.speech.models import hf_config

    model = T.Wav2Vec2ForPreTraining(hf_config())
    audio = torch.randn(2, 4000)
    frames = int(model._get_feat_extract_output_lengths(4000))
    mask = _compute_mask_indices((2, frames), mask_prob=0.5, mask_length=2, min_masks=2)
    negatives = _sample_negative_indices((2, frames), model.config.num_negatives, mask_time_indices=mask)
    kwargs = dict(mask_time_indices=torch.tensor(mask), sampled_negative_indices=torch.tensor(negatives))
    with monkeypatch.context() as patch:
        probe = _watched(patch, tmp_path, "hf_wav2vec2")
        result = _steps(probe, lambda: model(audio, **kwargs))
    assert result["calls"] == 2 and len(result["top1"]) == 2 and 0 < result["chance"][0] < 1, result


# ---------------------------------------------------------------------- the harness's top-1

def test_top1_of_pairs_logits_and_frames():
    """Pairs: row i's positive is row i of the other side (cosine: scale does not matter); logits: the diagonal;
    frames: the target above every valid distractor, chance the mean of 1 / (1 + valid), frames without a valid
    distractor or outside the mask left out."""
    a = torch.eye(4)
    hits, chance = e2e_probe._pairs(a, 3 * a)
    assert hits.item() == 1.0 and chance.item() == 0.25
    hits, _ = e2e_probe._pairs(a, a[[1, 0, 2, 3]])  # rows 0 and 1 swapped: half right
    assert hits.item() == 0.5
    hits, chance = e2e_probe._diagonal(torch.tensor([[2.0, 1.0, 0.0], [3.0, 1.0, 0.0]]))
    assert hits.item() == 0.5 and chance.item() == pytest.approx(1 / 3)
    pos = torch.tensor([0.9, 0.1, 0.5, 0.7])
    neg = torch.tensor([[0.5, 0.95], [0.0, 0.2], [0.9, 0.9], [0.1, 0.2]])
    valid = torch.tensor([[True, False], [True, True], [False, False], [True, True]])
    hits, chance = e2e_probe._frames(pos, neg, valid)  # frame 2 has no valid distractor
    assert hits.item() == pytest.approx(2 / 3) and chance.item() == pytest.approx((1 / 2 + 1 / 3 + 1 / 3) / 3)
    hits, chance = e2e_probe._frames(pos, neg, valid, frames=torch.tensor([1, 1, 1, 0]))
    assert hits.item() == pytest.approx(1 / 2) and chance.item() == pytest.approx((1 / 2 + 1 / 3) / 2)


# ---------------------------------------------------------------------- check.sh and the plan

def test_check_dry_run_runs_each_quick_job(tmp_path):
    """check.sh's benchmark on the CPU: the model's rates measured and its predictions from them, then each job
    of its quick plan (bf16 at the issue's sizes, float32 with TF32, image-text at a million pairs, here all at
    N = 64; bf16 at the small sizes in the plan's test) writes its table, and the CUDA-only methods are named
    and skipped, so a misspelt one fails here, not in a lease; JOBS outside the quick plan's is one error line."""
    out = tmp_path / "dry-run"
    jobs = "bfloat16 float32-tf32 image-text-1m"  # and bfloat16-small: the plan's test below
    done = _script("check.sh", "--dry-run", env={"GPU_OUT": str(out), "TESTS": "0", "JOBS": jobs}, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    tables = sorted(p.parent.name for p in out.rglob("losses.json"))
    assert tables == sorted(jobs.split()), tables
    assert (done.stdout + done.stderr).count("skipped CUDA only") >= 10, done.stdout
    model = (out / "perf_model.md").read_text()  # the model from the rates measured (on the CPU)
    assert "Rates, measured on cpu" in model and "### Predicted: image-text" in model
    bad = _script("check.sh", "--dry-run", env={"GPU_OUT": str(tmp_path / "bad"), "JOBS": "bfloat16 bf16"},
                  timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown job 'bf16' in JOBS"), bad.stderr


def test_plan_dry_run_packs_each_calls_results(e2e_data, tmp_path):
    """plan.sh's two calls on the CPU, the e2e step narrowed to one run (STAGES: a baseline; the harness's own
    paths, E2E_KEEP and E2E_SKIP_DONE among them, are the test above's) and the benchmark to one job (JOBS; the
    others: the test above): call 1 packs the CUDA tests' results and the report and runs of the baselines and
    the DCL stages; call 2, on the same work folder, the report over both calls, the profile, the model's rates
    and the benchmark's table."""
    env = {"OUT": str(tmp_path / "out"), "E2E_WORK": str(_work(e2e_data, tmp_path / "e2e")), "STAGES": "st-own",
           "JOBS": "bfloat16-small"}
    (tmp_path / "out").mkdir()
    for call in ("1", "2"):
        done = _script("plan.sh", call, "--dry-run", env=env, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        with tarfile.open(tmp_path / "out" / f"gpu-call{call}.tgz") as tar:
            names = set(tar.getnames())
        assert {"dry-run/e2e.md", "dry-run/e2e.json", "dry-run/e2e-runs/st-own.json", f"dry-run/plan-call{call}.log",
                "dry-run/tests-cuda.xml", "dry-run/tests-cuda.log"} <= names, sorted(names)
    assert "dry-run/bfloat16-small/losses.json" in names, sorted(names)
    results = tmp_path / "out" / "results" / "dry-run"
    assert _started((results / "e2e-baselines.log").read_text()) == ["st-own"]  # call 1's baselines step
    for log in ("e2e-dcl.log", "e2e-call2.log"):  # the DCL steps: run, nothing selected
        text = (results / log).read_text()
        assert "== e2e.sh (dry)" in text and _started(text) == [], text[-2000:]
    report = json.loads((results / "e2e.json").read_text())
    assert [r["stage"] for r in report["rows"]] == ["st"] and report["rows"][0]["dcl"] is None
    assert report["rows"][0]["own"]["rc"] == 0
    tables = sorted(p.parent.name for p in results.rglob("losses.json"))
    assert tables == ["bfloat16-small"], tables
    assert "skipped CUDA only" in (results / "bench.log").read_text()
    model = (results / "perf_model.md").read_text()  # the model from the rates measured (on the CPU)
    assert "Rates, measured on cpu" in model and "### Predicted: image-text" in model
    assert "<testsuite" in (results / "tests-cuda.xml").read_text()
    assert "skipped" in (results / "tests-cuda.log").read_text()
    assert (results / "profile" / "profile.md").exists()


if __name__ == "__main__":  # test_every_run_is_wired's subprocess: --parse RUN_DIR
    print(json.dumps(parse_runs(Path(sys.argv[sys.argv.index("--parse") + 1]))))
