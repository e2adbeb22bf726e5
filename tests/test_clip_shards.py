"""The CLIP recipe on webdataset shards in img2dataset's layout: every sample once per epoch across
processes and loader workers, exact resume from a checkpoint, bad samples skipped and counted (too many: one
error line naming the shard), '::' mixing, and 2 processes x 2 workers learn."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("open_clip")
pytest.importorskip("webdataset")

from launch import run_ranks  # noqa: E402
from PIL import Image  # noqa: E402

from contrastkit.cli import parse  # noqa: E402
from contrastkit.clip.train import ClipTrainConfig  # noqa: E402
from contrastkit.data.shards import (Position, ShardStream, plan_epochs, shard_urls,  # noqa: E402
                                     write_img2dataset_shards)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread, as under pytest-xdist: on the shared 2-core machine two threads only wait for each
    other (the in-process training runs)."""


def _pairs(n, start=0, corrupt=()):
    """Small distinct images captioned by their index; the indices in ``corrupt`` get bytes that are no image."""
    for i in range(start, start + n):
        image = Image.new("RGB", (8, 8), ((i * 37) % 256, (i * 11) % 256, (i * 3) % 256))
        yield (b"not a jpeg" if i in corrupt else image), f"pair {i}"


def _to_tensor(image):
    from torchvision.transforms.functional import pil_to_tensor

    return pil_to_tensor(image)


def _epoch_captions(urls, *, world, workers, batch, steps, per_epoch=None, start=0, rank_positions=None,
                    resampled=False):
    """Each process's batches of steps [start, steps) through a real DataLoader with ``workers`` workers."""
    out = []
    for rank in range(world):
        stream = ShardStream(urls, _to_tensor, None, local_batch=batch // world, steps_per_epoch=per_epoch or steps,
                             start=start,
                             stop=steps, rank=rank, world=world, workers=workers, seed=5,
                             positions=(rank_positions or {}).get(rank), resampled=resampled)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
        out.append([(captions, where.tolist()) for _, captions, where in loader])
    return out


@pytest.mark.quick
def test_every_sample_once_per_epoch_across_processes_and_workers(tmp_path):
    write_img2dataset_shards(tmp_path, _pairs(128), per_shard=16)  # 8 shards
    urls, samples, steps = plan_epochs(str(tmp_path), 16, world=2, workers=2)
    assert (len(urls), samples, steps) == (8, 128, 8)
    runs = _epoch_captions(urls, world=2, workers=2, batch=16, steps=steps)
    seen = [c for rank in runs for captions, _ in rank for c in captions]
    assert sorted(seen) == sorted(f"pair {i}" for i in range(128))  # each key exactly once
    assert all(len(rank) == steps for rank in runs)
    # the DataLoader takes its workers in turn: step s comes from worker role s mod 2
    assert [where[0] for _, where in runs[0]] == [0, 1] * 4
    # a different epoch permutes the shards and reshuffles: another order, the same samples
    again = _epoch_captions(urls, world=2, workers=2, batch=16, steps=2 * steps, per_epoch=steps)
    assert sorted(c for rank in again for captions, _ in rank[steps:] for c in captions) == sorted(seen)
    assert {c for b, _ in again[0][steps:] for c in b} != {c for b, _ in runs[0] for c in b}  # other shards


def test_resumed_stream_skips_what_was_taken_and_counts_bad_samples(tmp_path):
    write_img2dataset_shards(tmp_path, _pairs(64, corrupt={3, 40}), per_shard=16)
    urls = shard_urls(str(tmp_path))
    full = _epoch_captions(urls, world=1, workers=2, batch=8, steps=10, per_epoch=8)[0]
    last = {where[0]: where for _, where in full}
    assert sum(where[3] for where in last.values()) >= 2  # both undecodable images skipped and counted
    assert all(len(c) == 8 and "pair 3" not in c and "pair 40" not in c for c, _ in full)
    # resume at step 5 (an odd step: the loader's worker 0 now plays role 1) from the positions after step 4
    positions = {where[0]: Position(*where[1:]) for _, where in full[:5]}
    resumed = _epoch_captions(urls, world=1, workers=2, batch=8, steps=10, per_epoch=8, start=5,
                              rank_positions={0: positions})[0]
    assert resumed == full[5:]


def test_two_shard_sets_mix_with_double_colon(tmp_path):
    write_img2dataset_shards(tmp_path / "a", _pairs(32), per_shard=16)
    write_img2dataset_shards(tmp_path / "b", _pairs(32, start=1000), per_shard=16)
    data = f"{tmp_path}/a/{{00000..00001}}.tar::{tmp_path}/b/{{00000..00001}}.tar"
    urls, samples, steps = plan_epochs(data, 8, world=1, workers=2)
    assert len(urls) == 4 and samples == 64 and steps == 8
    seen = [c for captions, _ in _epoch_captions(urls, world=1, workers=2, batch=8, steps=steps)[0] for c in captions]
    assert sorted(seen) == sorted(f"pair {i}" for i in [*range(32), *range(1000, 1032)])


def test_resampled_mode_draws_shards_with_replacement_deterministically(tmp_path):
    write_img2dataset_shards(tmp_path, _pairs(32), per_shard=16)  # 2 shards for 4 readers: allowed resampled
    urls, _, steps = plan_epochs(str(tmp_path), 8, world=2, workers=2, resampled=True)
    first, again = (_epoch_captions(urls, world=2, workers=2, batch=8, steps=steps, resampled=True) for _ in "ab")
    assert first == again  # the draws follow the seed
    seen = [c for rank in first for captions, _ in rank for c in captions]
    assert len(seen) == 32 and set(seen) <= {f"pair {i}" for i in range(32)} and len(set(seen)) < 32  # repeats


@pytest.mark.quick
def test_shard_errors_are_one_line(tmp_path, monkeypatch, capsys):
    write_img2dataset_shards(tmp_path, _pairs(48), per_shard=16)  # 3 shards
    monkeypatch.setenv("WORLD_SIZE", "2")
    for data, message in [(f"{tmp_path}/{{00000..00002}}.tar", r"3 shards for 2 process\(es\) x 2 loader worker\(s\): "
                                                               r"need at least 4 shards"),
                          (f"{tmp_path}/{{00000..00004}}.tar", "2 of 5 shards .* do not exist, e.g. .*00003.tar")]:
        with pytest.raises(SystemExit) as exit_:
            parse(ClipTrainConfig, argv=["--data", data, "--workers", "2"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("error: --data: ") and len(err.splitlines()) == 1
        assert re.search(message, err), err
    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "00000_stats.json").unlink()
    with pytest.raises(ValueError, match="no img2dataset _stats.json .* give --train-num-samples"):
        plan_epochs(str(tmp_path), 8, world=1, workers=0)
    assert plan_epochs(str(tmp_path), 8, world=1, workers=0, num_samples=40)[1:] == (40, 5)


# ---------------------------------------------------------------------------- the recipe


def _recipe(*args, processes=2):
    """The CLIP recipe on ``processes`` gloo ranks forked from this process (launch.run_ranks), each ending 0."""
    ranks = run_ranks(ROOT / "recipes/clip/train.py", ["--no-progress", "--log-every", "1", "--eval-every", "0",
                                                       *args], processes, cwd=ROOT, timeout=600)
    assert [r.returncode for r in ranks] == [0] * processes, "\n".join(r.stdout[-3000:] for r in ranks)


def test_resume_after_a_checkpoint_ends_bit_identical_and_bad_samples_are_counted(tmp_path):
    """6 steps, into the second epoch (4 steps each), with 2 loader workers and 2 undecodable images; a run
    that has only checkpoint_3 (mid-epoch: an odd step, each worker role's position restored), resumed, ends
    with the weights of the uninterrupted run (10 steps of 8 per epoch, checkpoint_5, before: the same
    scenario at 15 steps' cost rather than 9)."""
    import shutil

    from safetensors.torch import load_file

    from contrastkit.clip.train import train

    write_img2dataset_shards(tmp_path / "shards", _pairs(64, corrupt={5, 45}), per_shard=16)

    def cfg(out, **kw):
        return ClipTrainConfig(data=str(tmp_path / "shards"), batch_size=16, steps=6, warmup=2, workers=2,
                               save_every=3, seed=3, log_every=1, eval_every=0, out_dir=str(tmp_path / out),
                               progress=False, **kw)

    straight = train(cfg("straight"))
    (tmp_path / "run/checkpoints").mkdir(parents=True)  # killed after step 3's checkpoint
    shutil.copytree(tmp_path / "straight/checkpoints/checkpoint_3", tmp_path / "run/checkpoints/checkpoint_3")
    resumed = train(cfg("run", resume=True))
    a = load_file(str(tmp_path / "straight/checkpoints/checkpoint_6/model.safetensors"))
    b = load_file(str(tmp_path / "run/checkpoints/checkpoint_6/model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    assert resumed["bad_samples"] == straight["bad_samples"] >= 2
    assert resumed["shards"] == 4 and resumed["train_pairs"] == 64 and resumed["steps_per_epoch"] == 4


def test_a_shard_with_too_many_bad_samples_ends_the_run_with_one_error_line(tmp_path, capsys):
    import runpy

    write_img2dataset_shards(tmp_path, _pairs(64, corrupt={17, 18, 19}), per_shard=16)  # 3 of 16 in 00001.tar
    main = runpy.run_path(str(ROOT / "recipes/clip/train.py"))["main"]
    with pytest.raises(SystemExit) as exit_:
        main(["--data", str(tmp_path), "--batch-size", "8", "--steps", "8", "--workers", "2", "--save-every", "0",
              "--eval-every", "0", "--no-progress", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_.value.code == 2 and "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and re.fullmatch(f"error: {tmp_path}/00001.tar: [23] of its 16 samples are unusable "
                                             r"\(no image, an image that does not decode, or no caption\): more "
                                             "than 10% of the shard", errors[0]), errors


@pytest.mark.slow
def test_two_processes_two_workers_learn(tmp_path):
    """2 processes x 2 loader workers, 60 steps of batch 32 on 512 shape-caption pairs in 16 shards: the
    held-out CLIP loss (InfoNCE over 4 batches of 32 unseen pairs) falls by at least 0.3 from the untrained
    model's (log 32 = 3.47). Measured at 60 steps, seeds 0-2: 3.62 -> 3.16, 3.55 -> 3.02, 3.80 -> 3.38 (falls of
    0.46, 0.53, 0.42: the margin is 72 % of the smallest); 80 steps, this test's before, fell 0.65 at seed 0 and
    40 steps 0.19, 0.13, 0.33 (too close). Without optimizer steps it does not move."""
    from accelerate.utils import set_seed
    from safetensors.torch import load_file

    from contrastkit.adapters.open_clip import build_clip_loss
    from contrastkit.adapters.open_clip import create_clip
    from contrastkit.data.image_text import make_shapes_clip

    root = make_shapes_clip(tmp_path / "data", num_train=640, num_zeroshot_per_class=1, progress=False)
    rows = list(csv.DictReader(open(root / "train.csv"), delimiter="\t"))
    pairs = [(Image.open(r["filepath"]), r["title"]) for r in rows]
    write_img2dataset_shards(tmp_path / "train", pairs[:512], per_shard=32)
    _recipe("--data", tmp_path / "train", "--batch-size", "32", "--steps", "60", "--warmup", "6", "--workers", "2",
            "--save-every", "60", "--zeroshot", root / "zeroshot", "--out-dir", tmp_path / "run")
    assert json.loads((tmp_path / "run/summary.json").read_text())["processes"] == 2

    set_seed(0)  # the recipe's initialisation, untrained
    model, preprocess, tokenizer = create_clip("contrastkit-tiny")
    loss_fn = build_clip_loss("infonce")

    def held_out_loss():
        losses = []
        with torch.no_grad():
            for i in range(512, 640, 32):
                images = torch.stack([preprocess(image) for image, _ in pairs[i:i + 32]])
                losses.append(loss_fn(**model(images, tokenizer([text for _, text in pairs[i:i + 32]]))).item())
        return sum(losses) / len(losses)

    model.eval()
    untrained = held_out_loss()
    model.load_state_dict(load_file(str(tmp_path / "run/checkpoints/checkpoint_60/model.safetensors")))
    trained = held_out_loss()
    assert trained <= untrained - 0.3, f"held-out loss trained {trained:.3f}, untrained {untrained:.3f}"


def _webdataset_has_eof_marker() -> bool:
    import inspect

    from webdataset.tariterators import tar_file_expander

    return "eof_value" in inspect.signature(tar_file_expander).parameters


@pytest.mark.xfail(_webdataset_has_eof_marker(), strict=True, raises=(AssertionError, KeyError),
                   reason="webdataset >= 0.2.96 ends each shard with an {} marker that open_clip_train 3.3's "
                          "group_by_keys_nothrow reads as a file (KeyError 'fname'; webdataset issue 384)")
def test_the_same_shards_train_with_open_clip_train_and_the_patch(tmp_path):
    """The guide's second command: open_clip_train's own webdataset loader with contrastkit's DCL, through the
    module's main(argv) as ``python -m contrastkit.adapters.open_clip`` calls it, in this process (its imports
    paid once; the loggers open_clip_train sets put back after: logging_kept); the module's ``__main__`` line runs
    as a process in test_clip_adapter's two-process run."""
    from launch import logging_kept

    from contrastkit.adapters.open_clip import main

    write_img2dataset_shards(tmp_path / "shards", _pairs(64), per_shard=16)
    args = ["--loss", "dcl", "--train-data", f"{tmp_path}/shards/{{00000..00003}}.tar", "--dataset-type",
            "webdataset", "--train-num-samples", "64", "--model", "contrastkit-tiny", "--batch-size", "16", "--epochs",
            "1", "--workers", "2", "--precision", "fp32", "--device", "cpu", "--lr", "1e-3", "--warmup", "1",
            "--log-every-n-steps", "1", "--name", "run", "--report-to", ""]
    # open_clip_train writes under ./logs
    with logging_kept(), pytest.MonkeyPatch.context() as m:
        m.chdir(tmp_path)
        assert main(args) in (0, None)
    log = (tmp_path / "logs/run/out.log").read_text()
    assert "contrastkit loss dcl replaces open_clip's ClipLoss" in log and log.count("Contrastive_loss") == 4
