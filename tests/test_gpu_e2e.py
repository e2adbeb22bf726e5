"""The GPU scripts (tools/gpu/), proven on the CPU before a GPU machine is lent.

- The harness, once, as the GPU runs it: tools/gpu/plan.sh's two calls at --dry-run, their e2e steps narrowed
  to the runs that take every path of e2e.sh (HARNESS; its comment says where the others are checked) and
  check.sh's benchmark to JOBS. Call 1: the CUDA tests (collected, skipped) beside the baselines (here
  sentence-transformers on its own loss), then the DCL stages (the main job, with the ecosystem's InfoNCE
  replayed beside, and on two processes, the shared-device launch, equal to one process); the report judges
  each by its criterion (tools/gpu/e2e_report.py, checked here on made-up runs too) and has the harness's
  timings. Call 2, on the same work folder: nothing run again, the same report, the profile, the model's rates
  and the benchmark's tables (every job's command read by the benchmark's own parser: every method it names
  known). A later e2e.sh call on that folder adds the main job's resume check (bit-identical).
- Every run's wiring, without training: E2E_LIST=1 writes each of the 23 runs' environment and command, and
  each is run here up to its entry point's real argument parser, through the harness's probe (its watch and
  E2E_IMPORT installed), and the accelerate launcher's options through accelerate's parser; the entry points
  themselves train in their own tests (tests/test_clip_train.py, test_vision_train.py, test_wav2vec2_recipe.py,
  test_clap.py, test_hf_clients.py, test_sentence_transformers.py, test_clip_adapter.py), and the probe sees
  each one's objective in test_probe_sees_each_objective_and_replays_each_reference.
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
# every path of the harness, run once through plan.sh's two calls: a recipe's DCL stage replayed beside its
# ecosystem's InfoNCE, with its half-way checkpoint for the resume check (clip), a baseline (untimed, side by side
# with the CUDA tests): a client without accelerate on its ecosystem's own loss (st-own), the two-process launch
# and its comparison with one process (clip_2proc). Where the other paths are checked: the untrained baselines
# (--steps 0): their commands in test_every_run_is_wired, the recipe's --steps 0 summary in tests/test_clip_train.py,
# the report's reading of it in test_recipe_evaluations_are_read_where_the_recipes_write_them, the probe around a
# run without a training call in test_probe_without_a_call_writes_its_record; st's DCL watch and replay (mnrl):
# test_probe_sees_each_objective_and_replays_each_reference.
HARNESS = ("clip", "clip_2proc", "st-own")
# check.sh's quick job run at N = 64 (the tables' machinery is one for every job): every job's command, its methods,
# dtype and --tf32, is read by benchmarks/losses.py's parser in test_every_benchmark_job_is_wired; the methods that
# run on the CPU, in float32 too, run in tests/test_benchmark_losses.py
JOBS = ("bfloat16-small",)


def _env(**extra) -> dict:
    bin_dir = str(Path(sys.executable).parent)  # this interpreter's environment, activated or not
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **extra}


def _script(name: str, *args, env=None, timeout=600):
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu" / name), *args], env=_env(**(env or {})), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def e2e_data(tmp_path_factory) -> Path:
    """--dry-run's inputs (tools/gpu/e2e_data.py --small), made once for this module's runs of the scripts, in
    this process (its models' libraries are the probe test's); the speech set is the tests' shared copy (the same
    set, generated once for the suite), which e2e_data.py finds made."""
    import e2e_data as data
    from contrastkit.data.speech import default_speech_data

    out = tmp_path_factory.mktemp("e2e-data")
    speech = default_speech_data(small=True)
    (out / "speech").mkdir()
    (out / "speech" / speech.name).symlink_to(speech)
    with torch.random.fork_rng():  # it seeds the models it makes
        data.main([str(out), "--small"])
    assert (out / "made.json").is_file()
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


def _in_a_child(fn, *args, timeout: float = 300):
    """fn(*args) in a forked child of this process: what it installs (the probe's watches, the one-import
    adapters' patches) and imports ends with it, and what this process has imported (the libraries e2e_data
    made its models with) it need not import again."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply_async(fn, args).get(timeout)


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
    runs = _in_a_child(parse_runs, work / "run")
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
    objective, sentence-transformers' columns under E2E_WATCH=mnrl) and replayed beside the ecosystem's InfoNCE
    (each of REFERENCES; HARNESS's clip replays open_clip's in training); the ecosystems' own losses seen where
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

    from contrastkit.adapters.sentence_transformers import MultipleNegativesLoss

    st = MultipleNegativesLoss(torch.nn.Module(), loss="dcl")  # st_train.py's; its forward calls this on the columns
    with monkeypatch.context() as patch:  # E2E_WATCH=mnrl, replayed beside sentence-transformers' MNRL
        result = _steps(_watched(patch, tmp_path, "mnrl", "mnrl"), lambda: st.compute_loss_from_embeddings([z1, z2]))
    assert result["calls"] == result["steps"] == 2 and len(result["top1"]) == 2, result
    assert result["objective_ms"] > 0 and result["infonce_ms"] > 0, result

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


def test_probe_without_a_call_writes_its_record(tmp_path):
    """The untrained baselines (--steps 0) train nothing under the probe: its record says so, and is written."""
    e2e_probe.Probe(tmp_path / "run.json", "none", warmup_calls=3).write()
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["calls"] == record["steps"] == 0 and record["top1"] == [] and "objective_ms" not in record, record


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

def _names(tgz: Path) -> set[str]:
    with tarfile.open(tgz) as tar:
        return set(tar.getnames())


def _results(plan: dict, call: str, done) -> dict:
    """What a call of plan.sh left, read at once (the next call rewrites the report): its archive's names, the
    report and the logs."""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    res = plan["results"]
    logs = {p.name: p.read_text() for p in [*res.glob("*.log"), *res.glob("*.xml")]}
    return {"names": _names(plan["out"] / f"gpu-call{call}.tgz"), "logs": logs,
            "report": json.loads((res / "e2e.json").read_text()), "md": (res / "e2e.md").read_text(),
            "statuses": sorted(p.stem for p in (res / "e2e-runs").glob("*.status"))}


@pytest.fixture(scope="module")
def plan(e2e_data, tmp_path_factory) -> dict:
    """plan.sh's environment for this module's dry run: its e2e steps narrowed to HARNESS (STAGES), its
    benchmark to JOBS, its work folder (E2E_WORK) kept between the calls as the GPU machine keeps .e2e/."""
    root = tmp_path_factory.mktemp("plan")
    (root / "out").mkdir()
    env = {"OUT": str(root / "out"), "E2E_WORK": str(_work(e2e_data, root / "e2e")), "STAGES": " ".join(HARNESS),
           "JOBS": " ".join(JOBS)}
    return {"env": env, "out": root / "out", "results": root / "out" / "results" / "dry-run", "work": root / "e2e"}


@pytest.fixture(scope="module")
def call1(plan) -> dict:
    """plan.sh 1 --dry-run: the CUDA tests (collected, skipped) beside the baselines, then the DCL stages."""
    return _results(plan, "1", _script("plan.sh", "1", "--dry-run", env=plan["env"], timeout=900))


@pytest.fixture(scope="module")
def call2(plan, call1) -> dict:
    """plan.sh 2 --dry-run on call 1's work folder: the DCL stages left (none), the profile, the benchmark."""
    return _results(plan, "2", _script("plan.sh", "2", "--dry-run", env=plan["env"], timeout=600))


def test_plan_call_1_runs_each_path_of_the_harness(call1):
    """Call 1 packs the CUDA tests' results (junit, the log) and the e2e report and runs. HARNESS's runs exit 0
    with the objective seen in training: the main job's DCL calls (one or more a step) with the step and replay
    timings and open_clip's ClipLoss timed beside, and the recipe's evaluation from its summary; the ecosystem's
    own loss watched in its own run, a baseline run beside the CUDA tests (sentence-transformers' MNRL: calls,
    top-1 and chance each, no replay); on two CPU processes (gloo, the harness's shared-device launch) the main
    job's first steps' loss equal to one process's, as the report says.
    No resume check in the plan (E2E_RESUME=0: test_a_later_call_adds_the_resume_check)."""
    assert {"dry-run/e2e.md", "dry-run/e2e.json", "dry-run/e2e-runs/st-own.json", "dry-run/e2e-runs/clip.json",
            "dry-run/plan-call1.log", "dry-run/tests-cuda.xml", "dry-run/tests-cuda.log"} <= call1["names"]
    logs = call1["logs"]
    assert "<testsuite" in logs["tests-cuda.xml"] and "skipped" in logs["tests-cuda.log"], logs["tests-cuda.log"]
    assert _started(logs["e2e-baselines.log"]) == ["st-own"], logs["e2e-baselines.log"]
    assert _started(logs["e2e-dcl.log"]) == ["clip", "clip_2proc"], logs["e2e-dcl.log"][-3000:]  # no resume
    report = call1["report"]
    rows = {r["stage"]: r for r in report["rows"]}
    assert list(rows) == ["clip", "clip_2proc", "st"], list(rows)
    for name in ("clip", "clip_2proc"):
        dcl = rows[name]["dcl"]["probe"]
        assert rows[name]["dcl"]["rc"] == 0 and dcl["calls"] >= dcl["steps"] > 0, (name, rows[name]["dcl"])
        assert len(dcl["top1"]) == len(dcl["chance"]) == dcl["calls"], name
        assert rows[name]["dcl_judged"]["trained"] is not None, rows[name]  # the recipe's evaluation, its summary's
    clip = rows["clip"]["dcl"]["probe"]  # clip_2proc's objective gathers: no replay on one process
    assert clip["step_ms"] > 0 and clip["objective_ms"] > 0 and clip["infonce_ms"] > 0, clip
    own = rows["st"]["own"]["probe"]
    assert rows["st"]["dcl"] is None and rows["st"]["own"]["rc"] == 0 and own["calls"] >= own["steps"] > 0, rows["st"]
    assert len(own["top1"]) == len(own["chance"]) == own["calls"] and "objective_ms" not in own, own
    assert rows["clip"]["own"] is None  # not selected
    assert report["untrained"] == {"clip-untrained": None, "vision-untrained": None} and report["resume"] is None
    pair = report["two_processes"]
    assert pair["processes"] == 2 and pair["equal"], pair
    assert "Two processes (main job, 2 processes" in call1["md"], call1["md"]
    assert call1["statuses"] == sorted(HARNESS), call1["statuses"]


def test_plan_call_2_keeps_call_1s_runs_and_runs_the_benchmark(plan, call1, call2):
    """Call 2 on the same work folder (E2E_KEEP, E2E_SKIP_DONE): no run started again and the same report; then
    the profile, the model's rates and predictions (measured on the CPU), and check.sh's quick plan narrowed to
    JOBS at N = 64, each writing its table, the CUDA-only methods named and skipped (a misspelt one fails here,
    not in a lease); the archive holds call 1's results too, as on a machine that stayed warm."""
    logs = call2["logs"]
    assert "== e2e.sh (dry)" in logs["e2e-call2.log"] and _started(logs["e2e-call2.log"]) == [], logs["e2e-call2.log"]
    assert call2["report"] == call1["report"], (call2["report"], call1["report"])
    assert {"dry-run/e2e.json", "dry-run/plan-call1.log", "dry-run/plan-call2.log", "dry-run/tests-cuda.xml",
            "dry-run/profile/profile.md", "dry-run/perf_model.md",
            *(f"dry-run/{job}/losses.json" for job in JOBS)} <= call2["names"], sorted(call2["names"])
    tables = sorted(p.parent.name for p in plan["results"].rglob("losses.json"))
    assert tables == sorted(JOBS), tables
    assert "skipped CUDA only" in logs["bench.log"], logs["bench.log"]
    model = (plan["results"] / "perf_model.md").read_text()  # the model from the rates measured (on the CPU)
    assert "Rates, measured on cpu" in model and "### Predicted: image-text" in model


def test_a_later_call_adds_the_resume_check(plan, call2):
    """e2e.sh on the plan's kept work folder with the main job selected (E2E_KEEP, E2E_SKIP_DONE): the main
    job, done, is not run again; its resume from the half-way checkpoint is, bit-identical, and the report says
    so beside the runs before."""
    env = {"E2E_WORK": str(plan["work"]), "STAGES": "clip", "E2E_KEEP": "1", "E2E_SKIP_DONE": "1"}
    done = _script("e2e.sh", "--dry-run", env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "== clip --resume from checkpoint_" in done.stdout and _started(done.stdout) == ["clip"], done.stdout
    report = json.loads((plan["work"] / "report" / "e2e.json").read_text())
    assert report["resume"]["bit_identical"], report["resume"]
    assert report["rows"] == call2["report"]["rows"] and report["two_processes"] == call2["report"]["two_processes"]
    md = (plan["work"] / "report" / "e2e.md").read_text()
    assert "Resume (main job)" in md and "bit-identical" in md, md


def test_every_benchmark_job_is_wired(tmp_path):
    """Each job of check.sh's quick plan (JOBS unset), as check.sh --dry-run starts it, recorded by a stand-in
    for python and read by benchmarks/losses.py's own parser: every method it names is known (a misspelt one fails
    here, not in a lease) and --tf32 only with float32; the rates step first. The jobs run in the plan's test."""
    import argparse
    import importlib.util
    from unittest import mock

    calls, shim = tmp_path / "calls", tmp_path / "python"
    shim.write_text('#!/usr/bin/env bash\nprintf "%s\\t" "$@" >> "$CALLS"; echo >> "$CALLS"\n')
    shim.chmod(0o755)
    done = _script("check.sh", "--dry-run", env={"GPU_OUT": str(tmp_path / "out"), "TESTS": "0", "PYTHON": str(shim),
                                                 "CALLS": str(calls)}, timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    argvs = [line.split("\t")[:-1] for line in calls.read_text().splitlines()]
    assert argvs[0][:2] == ["tools/perf/perf_model.py", "--measure-rates"], argvs[0]
    jobs = [a for a in argvs if a[0] == "benchmarks/losses.py"]
    assert [Path(_arg(a, "--out")).name for a in jobs] == ["bfloat16-small", "bfloat16", "float32-tf32",
                                                           "image-text-1m"], jobs
    spec = importlib.util.spec_from_file_location("bench_losses", ROOT / "benchmarks" / "losses.py")
    losses = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(losses)
    real_parse = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(real_parse(self, args, namespace))

    for argv in jobs:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), pytest.raises(_Parsed) as parsed:
            losses.main(argv[1:])
        ns = parsed.value.args[0]
        assert set(ns.methods) <= {*losses.METHODS, *losses.GPU_METHODS}, (argv, set(ns.methods) - {
            *losses.METHODS, *losses.GPU_METHODS})
        assert ns.device == "cpu" and ns.sizes == [64] and (ns.dtype == "float32" or not ns.tf32), argv


@pytest.mark.quick
def test_unknown_job_is_one_error_line(tmp_path):
    """check.sh's JOBS outside its quick plan's: one error line, before anything runs."""
    bad = _script("check.sh", "--dry-run", env={"GPU_OUT": str(tmp_path / "bad"), "JOBS": "bfloat16 bf16"},
                  timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown job 'bf16' in JOBS"), bad.stderr
