"""The vision recipe's training loop: SimCLR / MoCo v2 / SiMo with any objective, under accelerate.

``--batch-size`` is the global batch: each of P processes takes B / P rows of every global batch, the
losses gather negatives from every process with gradient and batch norm takes global statistics, so P
processes train the same model as one (up to float summation order). The learning rate (linear
warm-up, cosine decay) and the momentum (cosine from ``momentum`` to 1) are functions of the step, and
the step fixes the data position, so a checkpoint (model with momentum encoder, queue and UniGrad's
correlation; optimizer; RNG; step) resumes the run exactly.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from typing import get_type_hints
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from contrastkit.data.images import load_images
from contrastkit.evaluation.knn import extract_features, knn_accuracy
from contrastkit.training import MetricsLog, TrainState, latest_checkpoint, save_checkpoint
from contrastkit.vision.augment import MultiViewDataset, ShardedBatches, plain_transform, simclr_augment
from contrastkit.vision.methods import ContrastiveModel, check_setup, cosine_momentum, loss_options
from contrastkit.vision.models import build_backbone, projection_head


@dataclass
class VisionConfig:
    method: str = "simclr"
    loss: str = "infonce"
    out_dir: str = "runs/vision"
    data: str | None = None  # None: the embedded shapes; else an ImageFolder root or a saved HF DatasetDict
    image_size: int = 32
    train_images: int | None = None  # embedded data only (default 4000 train, 1000 test)
    test_images: int | None = None
    backbone: str = "small_cnn"
    width: int = 32  # small_cnn only
    small_images: bool = True  # ResNet stem for small images
    proj_hidden: int = 512
    proj_dim: int = 128
    views: int = 2
    batch_size: int = 64  # global
    steps: int | None = None
    samples: int | None = None  # alternative to steps: steps = samples // batch_size
    epochs: int = 5  # used when neither steps nor samples is given
    optimizer: str = "adamw"
    lr: float = 4e-3  # 1e-3 left the short default below raw pixels on the probe (docs/evidence.md)
    weight_decay: float = 1e-4
    warmup_steps: int = 10
    momentum: float = 0.99  # momentum encoder, start of the cosine schedule
    queue_size: int | None = None
    temperature: float = 0.1
    alpha: float = 256.0
    sigma: float = 0.5
    lam: float = 100.0
    rho: float = 0.99
    crop_min: float = 0.3  # DCL appendix A.4 uses 0.08; on 32 px shapes such crops often miss the shape
    blur: bool = True
    seed: int = 0
    threads: int | None = None  # torch intra-op threads; 1 is much faster on small images and busy CPUs
    workers: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0: kNN only at the end
    knn_k: int = 200
    knn_temperature: float = 0.1
    checkpoint_every: int = 0  # 0: only at the end
    resume: bool = False
    progress: bool = True

    def total_steps(self, num_images: int) -> int:
        if self.steps is not None and self.samples is not None:
            raise ValueError("give --steps or --samples, not both")
        if self.steps is not None:
            steps = self.steps
        else:
            samples = self.samples if self.samples is not None else self.epochs * num_images
            steps = samples // self.batch_size
        if steps < 1:
            raise ValueError(f"the run would take {steps} steps; raise --steps or --samples")
        return steps


def config_parser(description: str):
    """An argparse parser with one ``--flag`` per VisionConfig field (booleans as --x / --no-x)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    hints = get_type_hints(VisionConfig)
    for f in fields(VisionConfig):
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            base = next((t for t in (int, float, str) if t in getattr(kind, "__args__", (kind,))), str)
            parser.add_argument(flag, type=base, default=f.default)
    return parser


def build_model(cfg: VisionConfig) -> ContrastiveModel:
    backbone, dim = build_backbone(cfg.backbone, cfg.small_images, cfg.width)
    head = projection_head(dim, cfg.proj_hidden, cfg.proj_dim)
    return ContrastiveModel(cfg.method, cfg.loss, backbone, head, views=cfg.views, queue_size=cfg.queue_size,
                            loss_kwargs=loss_options(cfg.loss, cfg.temperature, cfg.alpha, cfg.sigma, cfg.lam, cfg.rho))


def learning_rate(cfg: VisionConfig, step: int, total: int) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to 0 at ``total``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def knn_eval(backbone, train_images, test_images, cfg: VisionConfig) -> float:
    transform = plain_transform()
    train = extract_features(backbone, train_images, transform, progress=cfg.progress, desc="kNN bank")
    test = extract_features(backbone, test_images, transform, progress=cfg.progress, desc="kNN test")
    return knn_accuracy(*train, *test, k=cfg.knn_k, temperature=cfg.knn_temperature,
                        num_classes=len(train_images.classes))


def train(cfg: VisionConfig) -> dict:
    """Train, log, checkpoint and kNN-evaluate; returns the summary (also written to summary.json)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = accelerator.process_index, accelerator.num_processes
    if int(os.environ.get("WORLD_SIZE", "1")) != world:
        raise RuntimeError(f"launched as {os.environ['WORLD_SIZE']} processes but accelerate set up {world}: on a CPU "
                           "launch with ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N "
                           "(accelerate's --cpu flag alone starts one process)")
    check_setup(cfg.method, cfg.loss, cfg.batch_size, cfg.views, cfg.queue_size)
    if cfg.batch_size % world:
        raise ValueError(f"--batch-size {cfg.batch_size} (global) must be divisible by the {world} processes")
    out = Path(cfg.out_dir)

    set_seed(cfg.seed)
    train_images = load_images(cfg.data, "train", cfg.image_size, cfg.train_images)
    total = cfg.total_steps(len(train_images))
    test_images = load_images(cfg.data, "test", cfg.image_size, cfg.test_images,
                              classes=getattr(train_images, "classes", None))
    model = build_model(cfg)
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    elif cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    else:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose adamw or sgd")
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(state)

    resumed = latest_checkpoint(out) if cfg.resume else None
    if resumed is not None:
        accelerator.load_state(str(resumed))
        accelerator.print(f"resumed from {resumed} at step {state.step}")
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    log = MetricsLog(out, enabled=accelerator.is_main_process, resume_step=state.step if resumed else None)

    batches = ShardedBatches(len(train_images), cfg.batch_size, rank, world, cfg.seed, state.step, total)
    views = MultiViewDataset(train_images, simclr_augment(cfg.image_size, cfg.crop_min, blur=cfg.blur),
                             cfg.views, cfg.seed)
    loader = DataLoader(views, batch_sampler=batches, num_workers=cfg.workers)
    core = accelerator.unwrap_model(model)
    knn = None
    started = time.time()
    bar = tqdm(total=total, initial=state.step, desc=f"{cfg.method}/{cfg.loss}",
               disable=not (cfg.progress and accelerator.is_main_process))
    model.train()
    for x, _, _ in loader:
        lr = learning_rate(cfg, state.step, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        outputs = model(x)
        accelerator.backward(outputs["loss"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        momentum = cosine_momentum(state.step, total, cfg.momentum)
        core.momentum_update(momentum)
        state.step += 1
        bar.update(1)

        if state.step % cfg.log_every == 0 or state.step == total or state.step <= 3:
            values = {k: accelerator.reduce(v.detach().float(), "mean").item() for k, v in outputs.items()}
            log.log(state.step, **values, lr=lr, momentum=momentum if core.has_momentum else None)
            bar.set_postfix(loss=f"{values['loss']:.4f}")
        if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < total:
            if accelerator.is_main_process:
                knn = knn_eval(core.backbone, train_images, test_images, cfg)
                log.log(state.step, knn_top1=knn)
            accelerator.wait_for_everyone()
        if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < total:
            save_checkpoint(accelerator, out, state.step)
    bar.close()
    seconds = time.time() - started

    save_checkpoint(accelerator, out, state.step)
    summary = {}
    if accelerator.is_main_process:
        knn = knn_eval(core.backbone, train_images, test_images, cfg)
        log.log(state.step, knn_top1=knn)
        torch.save(core.backbone.state_dict(), out / "backbone.pt")
        log.plot(["loss", "pos_term", "neg_term", "npc_multiplier", "attraction", "repulsion", "knn_top1"],
                 title=f"{cfg.method} + {cfg.loss}, batch {cfg.batch_size}")
        last = [r for r in log.records() if "loss" in r][-1]
        summary = {"method": cfg.method, "loss": cfg.loss, "batch_size": cfg.batch_size, "queue_size": cfg.queue_size,
                   "steps": state.step, "samples_seen": state.step * cfg.batch_size, "processes": world,
                   "final_loss": last["loss"], "knn_top1": knn, "knn_k": cfg.knn_k, "train_seconds": seconds}
        log.summary(summary)
        accelerator.print(json.dumps(summary))
    accelerator.wait_for_everyone()
    return summary


def load_backbone(run_dir: str | Path, checkpoint: str | Path | None = None):
    """(backbone in eval mode, VisionConfig) of a recipe run: its ``backbone.pt`` (written at the end), or the
    online backbone of ``checkpoint`` (a ``checkpoints/step_<n>`` folder), or of its newest checkpoint."""
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a vision recipe run (no config.json)")
    cfg = VisionConfig(**json.loads((run_dir / "config.json").read_text()))
    backbone, _ = build_backbone(cfg.backbone, cfg.small_images, cfg.width)
    if checkpoint is None and (run_dir / "backbone.pt").exists():
        state = torch.load(run_dir / "backbone.pt", map_location="cpu", weights_only=True)
    else:
        folder = Path(checkpoint) if checkpoint is not None else latest_checkpoint(run_dir)
        if folder is None or not (folder / "model.safetensors").exists():
            raise FileNotFoundError(f"no checkpoint with model.safetensors found for {str(run_dir)!r}")
        state = {k[len("backbone."):]: v for k, v in load_file(str(folder / "model.safetensors")).items()
                 if k.startswith("backbone.")}
    backbone.load_state_dict(state)
    return backbone.eval(), cfg


def frozen_features(backbone, cfg: VisionConfig, data: str | None = None, image_size: int | None = None,
                    progress: bool = True):
    """Features of the train and test splits of ``data`` (default: the run's own data) through ``backbone``."""
    size = image_size or cfg.image_size
    data = data if data is not None else cfg.data
    same = data == cfg.data
    train_images = load_images(data, "train", size, cfg.train_images if same else None)
    test_images = load_images(data, "test", size, cfg.test_images if same else None,
                              classes=getattr(train_images, "classes", None))
    train = extract_features(backbone, train_images, plain_transform(), progress=progress, desc="train features")
    test = extract_features(backbone, test_images, plain_transform(), progress=progress, desc="test features")
    return train, test, list(train_images.classes)
