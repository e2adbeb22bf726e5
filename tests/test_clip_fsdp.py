"""The CLIP recipe under FSDP2 (``fully_shard``). accelerate 1.15 shards with FSDP on GPUs only (on the CPU
``--use_fsdp`` gives DDP, and the recipe now refuses such a launch), so the launch itself is compared with
the DDP launch where two GPUs are; on the CPU, torch's own ``fully_shard`` on gloo shards the recipe's model
and loss: the loss, the gradients and the zero-shot evaluation equal the unsharded model's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("open_clip")
pytest.importorskip("accelerate")

from accelerate.utils import DistributedType  # noqa: E402

from contrastkit.adapters.open_clip import build_clip_loss  # noqa: E402
from contrastkit.adapters.open_clip import DEFAULT_MODEL, create_clip  # noqa: E402
from contrastkit.data.image_text import load_image_text, make_shapes_clip  # noqa: E402
from contrastkit.evaluation.zeroshot import evaluate_zeroshot  # noqa: E402
from contrastkit.cli import RunError  # noqa: E402
from contrastkit.training import check_launch  # noqa: E402
from launch import accelerate_launch, end_process_group, fork_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--loss", "dclw", "--num-train", "64", "--zeroshot-per-class", "4", "--batch-size", "8", "--steps", "3",
        "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--save-every", "0", "--no-progress"]


@pytest.fixture(scope="module")
def shapes(data_dir):
    """The embedded set's own folder (train.csv, zeroshot/)."""
    return make_shapes_clip(data_dir, num_train=64, num_zeroshot_per_class=4, progress=False)


@pytest.mark.quick
def test_check_launch_refuses_a_run_other_than_launched(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(RunError, match=r"launched as 2 processes .* set up 1 .*ACCELERATE_USE_CPU=1"):
        check_launch(SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO))
    check_launch(SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RunError, match="launched with FSDP .* set up MULTI_CPU: .* GPUs only"):
        check_launch(SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU))
    check_launch(SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP))


def _launch_recipe(tmp_path, data_dir, name, fsdp, processes=2, **env):
    launch, env = accelerate_launch(processes, **env)
    if fsdp:  # the FSDP2 launch: --use_fsdp replaces --multi_gpu
        launch = [a for a in launch if a != "--multi_gpu"] + ["--use_fsdp", "--fsdp_version", "2"]
    out = tmp_path / name
    return subprocess.run([*launch, "recipes/clip/train.py", *ARGS, "--data-dir", str(data_dir), "--out-dir",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU accelerate shards with FSDP")
def test_fsdp_launch_on_the_cpu_fails_clearly(data_dir, tmp_path):
    """`accelerate launch --use_fsdp --fsdp_version 2` on 2 CPU processes: accelerate 1.15 would set up DDP
    (MULTI_CPU) without a word; the recipe stops with the reason instead."""
    done, _ = _launch_recipe(tmp_path, data_dir, "fsdp", fsdp=True)
    assert done.returncode != 0
    assert "launched with FSDP (accelerate launch --use_fsdp) but accelerate set up MULTI_CPU" in done.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="accelerate 1.15 shards with FSDP on GPUs only (on the CPU --use_fsdp gives DDP); "
                           "2 GPUs needed. torch's fully_shard on the CPU: test_fully_shard_equals_unsharded")
def test_fsdp2_launch_equals_ddp_launch(data_dir, tmp_path):
    """The recipe launched with FSDP2 and with DDP on 2 GPUs: the same loss at every step (so the same
    updates), and the zero-shot evaluation runs on the sharded model."""
    losses = {}
    for name, fsdp in (("ddp", False), ("fsdp2", True)):
        done, out = _launch_recipe(tmp_path, data_dir, name, fsdp, ACCELERATE_USE_CPU="0")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        assert "zero-shot top-1" in done.stdout
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if "loss" in r]
    assert len(losses["ddp"]) == 3
    assert losses["fsdp2"] == pytest.approx(losses["ddp"], rel=1e-4)


# ----------------------------------------------------------------------------- torch's fully_shard on gloo


def _batch(data_dir, n=8):
    model, preprocess, tokenizer = create_clip(DEFAULT_MODEL, nonscalar_logit_scale=True)
    data = load_image_text(Path(data_dir) / "train.csv", preprocess, tokenizer)
    images, texts = zip(*(data[i] for i in range(n)))
    return torch.stack(images), torch.stack(texts)


def _loss_and_grads(model, images, texts, rank=0, world=1):
    loss_fn = build_clip_loss("dclw", local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
    loss = loss_fn(**model(images, texts))
    loss.backward()
    full = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for k, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), full


def _worker(rank, world, init_file, data_dir, out_dir):
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = create_clip(DEFAULT_MODEL, nonscalar_logit_scale=True)[0]
    fully_shard(model)  # the root alone, as accelerate's default (NO_WRAP) does
    images, texts = _batch(data_dir)
    half = len(images) // world
    loss, grads = _loss_and_grads(model, images[rank * half:(rank + 1) * half],
                                  texts[rank * half:(rank + 1) * half], rank, world)
    _, preprocess, tokenizer = create_clip(DEFAULT_MODEL, nonscalar_logit_scale=True)
    model.unshard()  # as the recipe's evaluation does
    zero_shot = evaluate_zeroshot(model, tokenizer, preprocess, Path(data_dir) / "zeroshot", device="cpu")
    model.reshard()
    torch.save({"loss": loss, "grads": grads, "top1": zero_shot["top1"]}, Path(out_dir) / f"rank{rank}.pt")
    end_process_group()


def test_fully_shard_equals_unsharded(shapes, tmp_path):
    """The recipe's model (logit scale [1], as the recipe makes it under FSDP2) sharded over 2 gloo
    processes by fully_shard, 4 pairs each, with the recipe's loss (local, gathered with gradient): each
    process's loss is the one-process loss of all 8 pairs, the gradients (reduced by FSDP2, gathered back)
    are the one-process gradients, and the zero-shot evaluation of the unsharded model is the same."""
    fork_ranks(_worker, (2, str(tmp_path / "init"), str(shapes), str(tmp_path)))
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.manual_seed(0)
    model = create_clip(DEFAULT_MODEL, nonscalar_logit_scale=True)[0]
    images, texts = _batch(shapes)
    loss, grads = _loss_and_grads(model, images, texts)
    _, preprocess, tokenizer = create_clip(DEFAULT_MODEL, nonscalar_logit_scale=True)
    top1 = evaluate_zeroshot(model, tokenizer, preprocess, shapes / "zeroshot", device="cpu")["top1"]
    assert sum(part["loss"] for part in parts) / 2 == pytest.approx(loss, rel=1e-5)  # as the recipe logs it
    for part in parts:
        assert part["grads"].keys() == grads.keys()
        for key, g in grads.items():
            torch.testing.assert_close(part["grads"][key], g, rtol=1e-4, atol=1e-5)  # float32 sums
        assert part["top1"] == top1
