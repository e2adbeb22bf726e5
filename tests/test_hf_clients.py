"""transformers' own example scripts, unchanged (tests/clients/, where they come from is in its README),
trained with DCL after contrastkit's one import on 1 CPU process and on 2 (gloo; run_clip.py under `accelerate
launch`, the wav2vec 2.0 script on ranks forked from the test's process):
run_clip.py (the Trainer) on a tiny dual encoder and run_wav2vec2_pretraining_no_trainer.py (an accelerate
loop) on a tiny wav2vec 2.0, each on tiny local data made here. Nothing is downloaded. The one-process runs
run the same runner (the one import, then the script as __main__) in the test's own process, in the
environment `accelerate launch --cpu` gives it: a process's start-up (torch, transformers, accelerate) spared
per run; `accelerate launch` is run_clip.py's two-process test's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_tiny
from launch import accelerate_launch, run_here, run_ranks
from contrastkit.adapters import hf_clip

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ROOT / "tests" / "clients"
RUN_CLIP = CLIENTS / "run_clip.py"
RUN_WAV2VEC2 = CLIENTS / "run_wav2vec2_pretraining_no_trainer.py"


def _launch(tmp_path, script, args, processes, one_import, forked=False, **env):
    """A runner that makes the one import (``contrastkit.adapters.<one_import>``, none if None) and then runs
    the unchanged script as __main__; after it, each process writes its accelerate state and the objective in
    force to a file of its own (printed lines of two processes can interleave). Several processes: `accelerate
    launch` of the runner, or with ``forked`` gloo ranks forked from this process (launch.run_ranks). One: the runner in this process (launch.run_here) with the variables that
    `accelerate launch --cpu` sets, the one import made afresh and its patch undone after, transformers' and
    datasets' log levels (which the scripts set) put back. Returns (stdout + stderr, the processes' states)."""
    runner = tmp_path / f"runner_{one_import}_{processes}.py"
    state_file = f"state_{one_import}_{processes}_{{}}.json"
    lines = ["import json", "import runpy", ""]
    if one_import:
        lines.append(f"import contrastkit.adapters.{one_import} as one_import  # noqa: F401  (the one line)")
    else:
        lines.append("one_import = None")
    lines += ["", f"runpy.run_path({str(script)!r}, run_name='__main__')", "",
              "from accelerate import PartialState  # noqa: E402", "",
              "state = PartialState()",
              f"with open({state_file!r}.format(state.process_index), 'w') as f:",
              "    json.dump({'rank': state.process_index, 'processes': state.num_processes, "
              "'backend': state.backend, 'loss': one_import and one_import.PATCH.objective.name}, f)",
              # the wav2vec 2.0 script ends without end_training() (it only calls it with tracking): left to
              # interpreter exit, a gloo process aborted about one run in seven ("terminate called without an
              # active exception", after its state file); our recipes end with accelerator.end_training()
              "state.destroy_process_group()"]
    runner.write_text("\n".join(lines) + "\n")
    offline = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    if processes == 1:
        proc = _here(tmp_path, runner, args, one_import, **env)
    elif forked:
        ranks = run_ranks(runner, args, processes, cwd=tmp_path, timeout=600, **offline, **env)
        proc = subprocess.CompletedProcess(runner, max(abs(r.returncode) for r in ranks),
                                          "\n".join(r.stdout for r in ranks), "")
    else:
        command, env = accelerate_launch(processes, PYTHONPATH=str(ROOT), **offline, **env)
        proc = subprocess.run([*command, str(runner), *args], env=env, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    states = [json.loads(path.read_text()) for path in sorted(tmp_path.glob(state_file.format("*")))]
    assert [s["rank"] for s in states] == list(range(processes)), log[-3000:]
    assert all(s["processes"] == processes for s in states), states
    if processes > 1:
        assert all(s["backend"] == "gloo" for s in states), states
    return log, states


def _here(tmp_path, runner, args, one_import, **env):
    """The runner in this process, as `accelerate launch --cpu` would start it (its variables, the offline ones
    conftest sets)."""
    import datasets
    import transformers

    name = f"contrastkit.adapters.{one_import}"
    levels = transformers.utils.logging.get_verbosity(), datasets.utils.logging.get_verbosity()
    sys.modules.pop(name, None)  # the runner's import makes the patch, as in a process of its own
    try:
        return run_here(runner, args, cwd=tmp_path, ACCELERATE_USE_CPU="True", ACCELERATE_MIXED_PRECISION="no",
                        ACCELERATE_DYNAMO_BACKEND="NO", WANDB_MODE="disabled", **env)
    finally:
        module = sys.modules.pop(name, None)
        if module is not None:
            module.PATCH.undo()
        transformers.utils.logging.set_verbosity(levels[0])
        datasets.utils.logging.set_verbosity(levels[1])


# ----------------------------------------------------------------------------- run_clip.py (Trainer)

MAX_LENGTH = 12
CLIP_STEPS = 60


@pytest.fixture(scope="module")
def clip_data(tmp_path_factory):
    """The embedded image-text set (16 pairs) as run_clip.py's --train_file (json lines: image path and
    caption), and a tiny dual encoder saved locally."""
    import csv

    from contrastkit.data.image_text import make_shapes_clip

    root = tmp_path_factory.mktemp("run_clip")
    data = make_shapes_clip(root, num_train=16, num_zeroshot_per_class=1, size=32, progress=False)
    with open(data / "train.csv", newline="") as f:
        rows = [{"image_path": r["filepath"], "caption": r["title"]} for r in csv.DictReader(f, delimiter="\t")]
    train = root / "train.json"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train, rows, hf_tiny.dual_encoder_dir(root / "model", [r["caption"] for r in rows])


def _run_clip(tmp_path, train, model_dir, processes, **env):
    """run_clip.py with the one import; every step's batch is the whole set (16 pairs, 16 / processes on
    each process). Returns the losses the Trainer logged, one a step."""
    out = tmp_path / f"out{processes}"
    args = ["--model_name_or_path", str(model_dir), "--train_file", str(train), "--output_dir", str(out),
            "--do_train", "--remove_unused_columns", "False", "--max_seq_length", str(MAX_LENGTH),
            "--per_device_train_batch_size", str(16 // processes), "--max_steps", str(CLIP_STEPS),
            "--learning_rate", "3e-3", "--logging_steps", "1", "--save_strategy", "no", "--seed", "0",
            "--dataloader_num_workers", "0", "--disable_tqdm", "True", "--report_to", "none"]
    _, states = _launch(tmp_path, RUN_CLIP, args, processes, "hf_clip_dcl", **env)
    assert all(s["loss"] == "dcl" for s in states)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def _first_batch_loss(model_dir, rows, loss):
    """The loss of the untrained model on the whole set (run_clip's batch: all 16 pairs), preprocessed by
    run_clip.py's own Transform and collate_fn."""
    import importlib.util

    from torchvision.io import ImageReadMode, read_image
    from transformers import AutoImageProcessor, AutoTokenizer, VisionTextDualEncoderModel

    spec = importlib.util.spec_from_file_location("run_clip_client", RUN_CLIP)
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    model = VisionTextDualEncoderModel.from_pretrained(model_dir).train()
    tokenizer, processor = AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir)
    transform = client.Transform(model.config.vision_config.image_size, processor.image_mean, processor.image_std)
    examples = [{"pixel_values": transform(read_image(r["image_path"], mode=ImageReadMode.RGB)),
                 **tokenizer(r["caption"], max_length=MAX_LENGTH, padding="max_length", truncation=True)}
                for r in rows]
    with torch.no_grad(), hf_clip.patch(model, loss=loss):
        return float(model(**client.collate_fn(examples)).loss)


@pytest.fixture(scope="module")
def one_process_losses(clip_data, tmp_path_factory):
    train, _, model_dir = clip_data
    return _run_clip(tmp_path_factory.mktemp("one"), train, model_dir, processes=1)


def test_run_clip_trains_with_dcl_after_one_import(clip_data, one_process_losses):
    """run_clip.py, unchanged, plus the one import, 1 process: its first logged loss is DCL's on the
    untrained model (each step's batch is the whole set), not the model's own InfoNCE, and 60 steps bring
    the loss at least 0.8 nat below the untrained model's (2.72 -> 1.63 when measured; chance, log 15, is
    2.71)."""
    _, rows, model_dir = clip_data
    losses = one_process_losses
    dcl, infonce = _first_batch_loss(model_dir, rows, "dcl"), _first_batch_loss(model_dir, rows, "infonce")
    assert losses[0] == pytest.approx(dcl, abs=2e-4) and abs(dcl - infonce) > 1e-2
    assert losses[-1] < losses[0] - 0.8, losses


def test_run_clip_two_processes_with_gathering_equal_one(clip_data, one_process_losses, tmp_path):
    """2 gloo processes of 8 pairs each with CONTRASTKIT_GATHER=1: the loss the Trainer logs (mean over the
    processes) is the 1-process loss of all 16 pairs at each of the first 10 steps (so the updates agree
    too; all 60 agreed to 1e-3 when measured), and it trains."""
    train, _, model_dir = clip_data
    losses = _run_clip(tmp_path, train, model_dir, processes=2, CONTRASTKIT_GATHER="1")
    assert losses[:10] == pytest.approx(one_process_losses[:10], abs=2e-3)
    assert losses[-1] < losses[0] - 0.8, losses


# ----------------------------------------------------------------------------- wav2vec 2.0 pre-training

W2V_CLIPS, W2V_NEGATIVES = 24, 20


@pytest.fixture(scope="module")
def speech_data(tmp_path_factory):
    """24 one-second 16 kHz clips, each four 250 ms tones of random pitch (learnable: a masked frame's tone
    is its neighbours'; the other tones of the clip are the distractors), as a local audio folder that the
    script's load_dataset(--dataset_name, config "default") reads; a tiny wav2vec 2.0 configuration (the
    stable-layer-norm form the script requires) and its feature extractor."""
    import soundfile
    from transformers import Wav2Vec2FeatureExtractor

    from contrastkit.speech.models import hf_config

    root = tmp_path_factory.mktemp("wav2vec2")
    (root / "audio").mkdir()
    rng = np.random.default_rng(0)
    t = np.arange(4000) / 16_000
    for i in range(W2V_CLIPS):
        wave = np.concatenate([np.sin(2 * np.pi * rng.uniform(200, 3000) * t + rng.uniform(0, 2 * np.pi))
                               for _ in range(4)])
        wave = 0.5 * wave + 0.01 * rng.standard_normal(wave.size)
        soundfile.write(str(root / "audio" / f"clip{i:02d}.wav"), wave.astype(np.float32), 16_000)
    config = hf_config(feat_extract_norm="layer", do_stable_layer_norm=True, num_negatives=W2V_NEGATIVES)
    config.save_pretrained(root / "model")
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16_000, padding_value=0.0, do_normalize=True,
                             return_attention_mask=True).save_pretrained(root / "model")
    return root


def _run_wav2vec2(tmp_path, data, processes, steps, one_import="hf_wav2vec2_dcl"):
    """run_wav2vec2_pretraining_no_trainer.py on the 20 training clips (4 held out, its validation split),
    4 clips a step in all; the logged lines it prints, as dicts (its losses are per masked frame)."""
    args = ["--dataset_name", str(data / "audio"), "--dataset_config_names", "default", "--dataset_split_names",
            "train", "--model_name_or_path", str(data / "model"), "--validation_split_percentage", "20",
            "--min_duration_in_seconds", "0.5", "--max_duration_in_seconds", "1.0",
            "--per_device_train_batch_size", str(4 // processes), "--max_train_steps", str(steps),
            "--learning_rate", "1e-3", "--logging_steps", "1", "--seed", "0"]
    log, states = _launch(tmp_path, RUN_WAV2VEC2, args, processes, one_import, forked=True)
    assert all(s["loss"] == ("dcl" if one_import else None) for s in states)
    logs = [{k.strip(): float(v) for k, v in re.findall(r"\| ([^:|]+): ([-+.e0-9]+)", line)}
            for line in log.splitlines() if "| constrast_loss:" in line]
    assert len(logs) == steps, log[-3000:]
    return logs


def _dropped(logs):
    """The mean contrastive loss (per masked frame) of the last 10 steps is at least 0.25 below the
    untrained model's, the first step's (measured drops: 0.34 and 0.39 with transformers 5.24 on 1 and 2
    processes, 0.29 with 4.57.6 on 1). The loss falls to chance, log K = 3.0 for K = 20 distractors, in
    about 5 steps, and below it after about 60: 2.66 after 100 steps with 1 process, when measured."""
    first, last = logs[0]["constrast_loss"], sum(x["constrast_loss"] for x in logs[-10:]) / 10
    assert last < first - 0.25, [x["constrast_loss"] for x in logs]


def test_wav2vec2_example_trains_with_dcl_after_one_import(speech_data, tmp_path):
    """The script alone (the model's own InfoNCE) and with the one import, 1 process, same seed: the same
    first batch, masks, distractors and codes (equal diversity loss), and DCL's contrastive loss is below
    InfoNCE's (DCL leaves the positive out of the denominator; measured: InfoNCE 3.333 and DCL 3.278 on the
    first step). That 60 steps with the import lower the loss is the two-process test's (below)."""
    plain = _run_wav2vec2(tmp_path, speech_data, processes=1, steps=1, one_import=None)
    dcl = _run_wav2vec2(tmp_path, speech_data, processes=1, steps=1)
    assert dcl[0]["div_loss"] == pytest.approx(plain[0]["div_loss"], rel=1e-3)
    assert dcl[0]["constrast_loss"] < plain[0]["constrast_loss"] - 0.02, (dcl[0], plain[0])


def test_wav2vec2_example_two_processes(speech_data, tmp_path):
    """2 gloo processes of 2 clips each, the one import in both: DCL in force on each, and 60 steps lower
    the loss (measured: 3.347 -> 2.961 over the last 10 steps)."""
    _dropped(_run_wav2vec2(tmp_path, speech_data, processes=2, steps=60))
