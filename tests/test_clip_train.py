"""The CLIP recipe: exact resume, 2 accelerate processes equal 1, the eval script reproduces the
recipe's zero-shot numbers, and bad input fails clearly (or warns and goes on)."""

from __future__ import annotations

import json
import math
import runpy
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("open_clip")
pytest.importorskip("accelerate")

from contrastkit.adapters.open_clip import create_clip  # noqa: E402
from contrastkit.clip.train import ClipTrainConfig, train  # noqa: E402
from contrastkit.training import StepBatches  # noqa: E402
from contrastkit.data.image_text import make_shapes_clip  # noqa: E402
from launch import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("clipdata")
    make_shapes_clip(d, num_train=64, num_zeroshot_per_class=4, progress=False)
    return d


def _cfg(out, data_dir, **kw):
    values = dict(loss="dcl", data_dir=str(data_dir), num_train=64, zeroshot_per_class=4, batch_size=8, steps=6,
                  warmup=2, log_every=1, eval_every=3, save_every=3, out_dir=str(out), progress=False)
    values.update(kw)
    return ClipTrainConfig(**values)


def _state(checkpoint: Path):
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors")), torch.load(checkpoint / "optimizer.bin",
                                                                        weights_only=False)


def _losses(out: Path):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.parametrize("loss", [pytest.param("dcl", marks=pytest.mark.quick), "siglip"])
def test_resume_continues_to_the_same_state(data_dir, tmp_path, loss):
    """Also for siglip (open_clip's SigLipLoss): its logit bias is in the checkpoint, resumed like every weight,
    and the eval script reads the checkpoint into a model built without a bias. The dcl run is in the quick tier
    (6-9 s): the only test there that catches a resumed sampler starting over or an optimizer left out of the
    checkpoints (tools/bugs.py)."""
    straight = tmp_path / "straight"
    summary = train(_cfg(straight, data_dir, loss=loss))
    assert summary["steps"] == 6 and 0.0 <= summary["zeroshot_top1"] <= 1.0
    assert (straight / "metrics.png").exists() and (straight / "summary.json").exists()

    # Interrupted after step 3: only that checkpoint (and the log written so far, with later lines) survive.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint_3", resumed / "checkpoints" / "checkpoint_3")
    shutil.copy(straight / "metrics.jsonl", resumed / "metrics.jsonl")
    train(_cfg(resumed, data_dir, loss=loss, resume=True))

    model_a, opt_a = _state(straight / "checkpoints" / "checkpoint_6")
    model_b, opt_b = _state(resumed / "checkpoints" / "checkpoint_6")
    assert model_a.keys() == model_b.keys() and ("logit_bias" in model_a) == (loss == "siglip")
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    for key, value in opt_a["state"].items():
        for name in value:
            assert torch.equal(value[name], opt_b["state"][key][name]), (key, name)
    assert _losses(straight) == _losses(resumed) and len(_losses(straight)) == 6

    # The eval script on the final checkpoint gives the recipe's own zero-shot numbers.
    checkpoint = straight / "checkpoints" / "checkpoint_6"
    zeroshot_main = runpy.run_path(str(ROOT / "eval" / "zeroshot.py"))["main"]  # the script, in this process
    zeroshot_main(["--checkpoint", str(checkpoint), "--data", str(Path(summary["zeroshot_data"])), "--out-dir",
                   str(tmp_path / "eval")])
    result = json.loads((tmp_path / "eval" / "zeroshot.json").read_text())
    assert result["top1"] == pytest.approx(summary["zeroshot_top1"], abs=1e-6)
    assert (tmp_path / "eval" / "zeroshot.png").exists() and len(result["per_class_recall"]) == 8


@pytest.mark.parametrize("loss", ["dclw", "siglip"])
def test_two_processes_equal_one(data_dir, tmp_path, loss):
    """siglip: open_clip's SigLipLoss exchanges the texts between neighbouring processes (its default 'bidir').
    3 steps: the warm-up's first update has lr 0, so step 3's loss is the first that follows a real update. The
    two gloo ranks are forked from this process (launch.run_ranks); `accelerate launch` itself is
    test_recipe_runs.py's and test_first_run.py's."""
    args = ["--loss", loss, "--data-dir", str(data_dir), "--num-train", "64", "--zeroshot-per-class", "4",
            "--batch-size", "8", "--steps", "3",
            "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--save-every", "0", "--no-progress"]
    ranks = run_ranks(ROOT / "recipes/clip/train.py", [*args, "--out-dir", tmp_path / "two"], cwd=ROOT)
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stdout[-3000:] + ranks[1].stdout[-3000:]
    assert "zero-shot top-1" in ranks[0].stdout
    train(_cfg(tmp_path / "one", data_dir, loss=loss, steps=3, warmup=1, eval_every=0, save_every=0))
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(two) == len(one) == 3
    assert two == pytest.approx(one, rel=1e-5)  # step 3's follows step 2's update: same gradients


@pytest.mark.quick
def test_step_batches_split_each_global_batch_and_cover_the_epoch():
    one = list(StepBatches(20, 8, 0, 1, seed=3, start=0, stop=4))
    two = [list(StepBatches(20, 8, r, 2, seed=3, start=0, stop=4)) for r in range(2)]
    assert [a + b for a, b in zip(*two)] == one
    assert sorted(one[0] + one[1]) == sorted(set(one[0] + one[1]))  # an epoch has no repeats
    assert list(StepBatches(20, 8, 0, 1, seed=3, start=2, stop=4)) == one[2:]  # resume mid-run
    with pytest.raises(ValueError, match="divisible by the number of processes 3"):
        StepBatches(20, 8, 0, 3, seed=0, start=0, stop=1)


# ---------------------------------------------------------------------------- bad input


def _csv(tmp_path, n=20, corrupt=0, header="filepath\ttitle"):
    from contrastkit.data.shapes import SHAPES, ShapeSpec, caption, render

    lines = [header]
    for i in range(n):
        spec = ShapeSpec(SHAPES[i % 8], "red", "large", "center", "plain")
        path = tmp_path / f"img{i}.png"
        if i < corrupt:
            path.write_bytes(b"not an image")
        else:
            render(spec, size=32, seed=i).save(path)
        lines.append(f"{path.name}\t{caption(spec)}")
    (tmp_path / "pairs.tsv").write_text("\n".join(lines) + "\n")
    return tmp_path / "pairs.tsv"


@pytest.mark.quick
def test_missing_data_path_and_columns(tmp_path):
    from contrastkit.data.image_text import load_image_text

    with pytest.raises(FileNotFoundError, match="data path does not exist"):
        load_image_text(tmp_path / "nope.tsv")
    path = _csv(tmp_path, n=4, header="filepath\tcaption")
    with pytest.raises(KeyError, match="no caption column 'title'; the columns are \\['filepath', 'caption'\\]"):
        load_image_text(path)
    assert len(load_image_text(path, caption_key="caption")) == 4
    with pytest.raises(FileNotFoundError, match="--data: training data .* does not exist"):
        train(ClipTrainConfig(data=str(tmp_path / "missing"), out_dir=str(tmp_path / "o"), progress=False))


def test_unreadable_images_are_replaced_and_counted_when_loaded_or_fail_when_too_many(tmp_path):
    import warnings

    from contrastkit.data.image_text import load_image_text
    from contrastkit.data.shards import DataError

    (tmp_path / "few").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is opened up front
        dataset = load_image_text(_csv(tmp_path / "few", n=20, corrupt=1))
    assert len(dataset) == 20 and dataset.loaded.value == 0
    assert dataset[0] == dataset[1] and dataset.bad.value == 1  # row 0 is unreadable: the next row stands in
    (tmp_path / "many").mkdir()
    dataset = load_image_text(_csv(tmp_path / "many", n=20, corrupt=5))
    with pytest.raises(DataError, match=r"many/pairs.tsv: \d+ of the \d+ images loaded so far are unreadable, "
                                        r"e.g. .*img\d.png; more than 10%"):
        [dataset[i] for i in range(20)]


def test_verify_images_opens_every_image_up_front(tmp_path):
    from contrastkit.data.image_text import load_image_text

    (tmp_path / "few").mkdir()
    with pytest.warns(UserWarning, match="1 of 20 images are unreadable.*img0.png.*skipping them"):
        dataset = load_image_text(_csv(tmp_path / "few", n=20, corrupt=1), verify=True)
    assert len(dataset) == 19
    (tmp_path / "many").mkdir()
    with pytest.raises(ValueError, match="5 of 20 images are unreadable.*more than 10%"):
        load_image_text(_csv(tmp_path / "many", n=20, corrupt=5), verify=True)


def test_training_on_user_csv_goes_on_past_an_unreadable_image(tmp_path):
    path = _csv(tmp_path, n=20, corrupt=1)
    summary = train(ClipTrainConfig(data=str(path), out_dir=str(tmp_path / "run"), batch_size=10, steps=2,
                                    warmup=1, log_every=1, eval_every=0, save_every=0, progress=False))
    assert summary["steps"] == 2 and summary["train_pairs"] == 20 and "zeroshot_top1" not in summary
    assert summary["bad_samples"] == 1  # the epoch's 2 steps load each row once
    with pytest.warns(UserWarning, match="1 of 20 images are unreadable"):
        summary = train(ClipTrainConfig(data=str(path), out_dir=str(tmp_path / "verified"), batch_size=8, steps=2,
                                        warmup=1, log_every=1, eval_every=0, save_every=0, progress=False,
                                        verify_images=True))
    assert summary["train_pairs"] == 19 and summary["bad_samples"] == 0


@pytest.mark.quick
def test_unknown_model_and_loss(tmp_path):
    with pytest.raises(ValueError, match="unknown open_clip model config 'ViT-Nope'"):
        create_clip("ViT-Nope")
    with pytest.raises(ValueError, match="unknown loss 'nce'"):
        train(ClipTrainConfig(loss="nce", out_dir=str(tmp_path), progress=False))


def test_hf_image_folder_with_captions(tmp_path):
    from contrastkit.data.image_text import load_image_text

    folder = tmp_path / "folder"
    folder.mkdir()
    _csv(folder, n=6)
    rows = (folder / "pairs.tsv").read_text().splitlines()[1:]
    (folder / "pairs.tsv").unlink()
    (folder / "metadata.csv").write_text("file_name,text\n" + "".join(f"{r.split(chr(9))[0]},{r.split(chr(9))[1]}\n"
                                                                    for r in rows))
    model, preprocess, tokenizer = create_clip("contrastkit-tiny")
    dataset = load_image_text(folder, preprocess, tokenizer)
    image, tokens = dataset[0]
    assert len(dataset) == 6 and image.shape == (3, 32, 32) and tokens.shape == (16,)
    with pytest.raises(KeyError, match="no caption column 'caption'"):
        load_image_text(folder, caption_key="caption")


def test_default_run_learns(tmp_path):
    """The main job's default (batch 64 on the embedded 4096 pairs, DCL), cut to 120 steps, beats the same model
    untrained on zero-shot top-1 (8 classes, 400 held-out images; chance 0.125) by 0.05. Measured at 120 steps,
    seeds 0-2: 0.222, 0.240, 0.235 against 0.108, 0.138, 0.142 untrained (gains 0.114, 0.102, 0.093; the margin is
    about half the smallest, and 2.8 standard errors of a 400-image accuracy); the full 300 steps reach 0.40 at
    seed 0. Without optimizer steps it stays at the untrained value and fails (80 steps gained 0.070, 0.052, 0.050:
    too close to the margin). The data is the main job's own, generated once where the recipe keeps it (the
    default cache, as the speech tests' embedded data): generating 4496 images per run was a third of the test."""
    from accelerate.utils import set_seed

    from contrastkit.evaluation.zeroshot import evaluate_zeroshot

    cfg = ClipTrainConfig(loss="dcl", out_dir=str(tmp_path / "run"), steps=120, eval_every=0, save_every=0,
                          progress=False)
    root = make_shapes_clip(cfg.data_dir, num_train=cfg.num_train, num_zeroshot_per_class=cfg.zeroshot_per_class,
                            progress=False)
    set_seed(cfg.seed)  # the recipe's initialisation, untrained
    model, preprocess, tokenizer = create_clip(cfg.model)
    untrained = evaluate_zeroshot(model, tokenizer, preprocess, root / "zeroshot")["top1"]
    trained = train(cfg)["zeroshot_top1"]
    assert trained >= untrained + 0.05, f"trained {trained:.3f}, untrained {untrained:.3f}"


def test_siglip_is_open_clips_loss_on_open_clips_initialisation_and_its_loss_falls(data_dir, tmp_path):
    """--loss siglip: open_clip's own SigLipLoss; the model as open_clip_train builds it under --siglip (3.3's
    main.py: init_logit_scale ln 10, init_logit_bias -10), every other weight as the same seed's InfoNCE model
    (so the suite's untrained row is SigLIP's too). In 6 steps of 8 pairs its loss falls from 9.2 to 3.0
    (seed 0); the test asks for below half the first step's (with lr 0 it stays at 9.2)."""
    from open_clip.loss import SigLipLoss
    from safetensors.torch import load_file

    from contrastkit.clip.train import make_loss

    assert type(make_loss("siglip", {})) is SigLipLoss
    with pytest.raises(ValueError, match="siglip .* takes only the option dist_impl"):
        make_loss("siglip", {"sigma": 0.5})
    train(_cfg(tmp_path / "s0", data_dir, loss="siglip", steps=0, eval_every=0, save_every=0))
    train(_cfg(tmp_path / "i0", data_dir, loss="infonce", steps=0, eval_every=0, save_every=0))
    siglip = load_file(str(tmp_path / "s0" / "checkpoints" / "checkpoint_0" / "model.safetensors"))
    infonce = load_file(str(tmp_path / "i0" / "checkpoints" / "checkpoint_0" / "model.safetensors"))
    assert siglip["logit_scale"].item() == pytest.approx(math.log(10)) and siglip["logit_bias"].item() == -10.0
    assert infonce["logit_scale"].item() == pytest.approx(math.log(1 / 0.07)) and "logit_bias" not in infonce
    for name, value in infonce.items():
        if name != "logit_scale":
            assert torch.equal(siglip[name], value), name

    train(_cfg(tmp_path / "s6", data_dir, loss="siglip", eval_every=0, save_every=0))
    records = [json.loads(line) for line in (tmp_path / "s6" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
    assert -10.0 < records[-1]["logit_bias"] < -9.9  # learnt, slowly (Adam: about lr a step), and logged


@pytest.mark.quick
def test_zero_steps_saves_the_initial_model(data_dir, tmp_path):
    """--steps 0 (the suite's untrained row): checkpoint_0 holds the model as created from the seed, and the
    run still reports its zero-shot accuracy."""
    from accelerate.utils import set_seed
    from safetensors.torch import load_file

    summary = train(_cfg(tmp_path, data_dir, steps=0, eval_every=0, save_every=0, seed=5))
    assert summary["steps"] == 0 and summary["final_loss"] is None and 0.0 <= summary["zeroshot_top1"] <= 1.0
    saved = load_file(str(tmp_path / "checkpoints" / "checkpoint_0" / "model.safetensors"))
    set_seed(5)
    initial = create_clip("contrastkit-tiny")[0].state_dict()
    assert saved.keys() == initial.keys()
    for name, value in initial.items():
        assert torch.equal(saved[name], value), name
