"""The vision recipe's training loop: SimCLR / MoCo v2 / SiMo with any objective, under accelerate.

``--batch-size`` is the global batch: each of P processes takes B / P rows of every global batch, the
losses gather negatives from every process with gradient and batch norm takes global statistics, so P
processes train the same model as one (up to float summation order). The learning rate (linear
warm-up, cosine decay) and the momentum (cosine from ``momentum`` to 1) are functions of the step, and
the step fixes the data position, so a checkpoint (model with momentum encoder, queue and UniGrad's
correlation; optimizer; RNG; step) resumes the run exactly. A loss or gradient that becomes non-finite stops
the run with one line (training.Divergence); --resume with a new --lr applies it, with a new model, objective
or batch refuses. ``--labels``: the images' class labels go to the loss (gathered with the features), for
supervised contrastive learning (``--same-label positive``: SupCon's L_out with InfoNCE) or to take
same-class images out of the negatives (``mask``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from contrastkit.data.images import load_images
from contrastkit.cli import arg, existing, positive, renamed
from contrastkit.evaluation.knn import extract_features, knn_accuracy
from contrastkit.losses import available_losses, build_loss, objective_options
from contrastkit.losses.base import NonFiniteError
from contrastkit.training import (Checkpoints, Divergence, MetricsLog, RunOptions, StepBatches, StepBoundary,
                                  TrainState, grad_norm, guarded, latest_checkpoint, lr_schedule, make_accelerator,
                                  quiet_worker, start_trackers)
from contrastkit.vision.augment import MultiViewDataset, plain_transform, simclr_augment
from contrastkit.vision.methods import METHODS, ContrastiveModel, check_setup, cosine_momentum
from contrastkit.vision.models import BACKBONES, build_backbone, projection_head, use_torch_sync_batchnorm


@dataclass
class VisionConfig(RunOptions):
    # What a checkpoint fixes: --resume refuses a change to one of these (training.Checkpoints).
    FIXED = ("method", "loss", "loss_options", "data", "image_size", "train_images", "backbone", "width",
             "small_images", "proj_hidden", "proj_dim", "views", "batch_size", "optimizer", "queue_size",
             "weight_decay", "temperature", "alpha", "sigma", "lam", "rho", "seed", "labels", "same_label")
    # Where this recipe's defaults differ from RunOptions': steps from --samples or --epochs by default; 4e-3, as
    # 1e-3 left the short default below raw pixels (docs/evidence.md); kNN and a checkpoint at the end only.
    DEFAULTS = {"steps": None, "lr": 4e-3, "warmup": 10, "eval_every": 0, "save_every": 0}

    method: str = arg("simclr", "training method", choices=METHODS)
    loss: str = arg("infonce", "the objective", choices=available_losses())
    labels: bool = arg(False, "use the images' class labels: supervised contrastive (SupCon) with --same-label "
                              "positive, false negatives left out with mask (not unigrad)")
    same_label: str = arg("positive", "with --labels: images of the anchor's class are its positives (positive) "
                                      "or leave its negatives (mask)", choices=("positive", "mask"))
    loss_options: dict = arg(help="extra loss option, e.g. chunk_size=512 (typed: int, float, bool or str)",
                             factory=dict, aliases=["--loss-option"])
    out_dir: str = arg("runs/vision", "output folder")
    data: str | None = arg(None, "ImageFolder root or a saved HF DatasetDict (default: the embedded shapes)")
    image_size: int = arg(32, "image side in pixels")
    train_images: int | None = arg(None, "embedded data only: training images (default 4000)")
    test_images: int | None = arg(None, "embedded data only: test images (default 1000)")
    backbone: str = arg("small_cnn", "backbone", choices=BACKBONES)
    width: int = arg(32, "small_cnn only: channel width")
    small_images: bool = arg(True, "ResNet stem for small images")
    proj_hidden: int = arg(512, "projection head hidden width")
    proj_dim: int = arg(128, "projection head output width")
    views: int = arg(2, "views per image")
    batch_size: int = arg(64, "global batch, over all processes")
    samples: int | None = arg(None, "alternative to --steps: steps = samples // batch_size")
    epochs: int = arg(10, "used when neither --steps nor --samples is given (kNN still rose from 5 to 10: docs/evidence.md)")
    optimizer: str = arg("adamw", "optimizer", choices=("adamw", "sgd"))
    weight_decay: float = arg(1e-4, "weight decay")
    momentum: float = arg(0.99, "momentum encoder: start of the cosine schedule to 1")
    queue_size: int | None = arg(None, "moco only: keys in the queue")
    temperature: float = arg(0.1, "temperature (all but cacr, unigrad)")
    alpha: float = arg(256.0, "eqco's alpha")
    sigma: float = arg(0.5, "dclw's sigma")
    lam: float = arg(100.0, "unigrad's lambda")
    rho: float = arg(0.99, "unigrad's rho")
    crop_min: float = arg(0.3, "smallest random-resized-crop scale (the DCL appendix uses 0.08; on 32 px shapes such crops often miss the shape)")
    blur: bool = arg(True, "Gaussian blur in the augmentation")
    hue: float = arg(0.5, "colour jitter's hue (SimCLR 0.2; 0.5, any hue, keeps the shapes' colour from ruling kNN)")
    grayscale: float = arg(0.5, "grayscale probability (SimCLR 0.2; 0.5 on the shapes, for the same reason)")
    threads: int | None = arg(None, "torch intra-op threads; 1 is much faster on small images and busy CPUs")
    workers: int = arg(0, "DataLoader worker processes")
    knn_k: int = arg(200, "kNN neighbours")
    knn_temperature: float = arg(0.1, "kNN vote temperature")

    def check(self) -> None:
        """Raise ValueError / FileNotFoundError for a value that cannot work, before any training."""
        for name in ("image_size", "width", "proj_hidden", "proj_dim", "batch_size", "samples", "epochs",
                     "temperature", "knn_k", "threads", "train_images", "test_images"):
            positive(name, getattr(self, name))
        for name in ("weight_decay", "workers", "hue", "grayscale"):
            positive(name, getattr(self, name), zero=True)
        existing("data", self.data, "image data")
        self.check_run()
        check_setup(self.method, self.loss, self.batch_size, self.views, self.queue_size, self.labels)
        build_loss(self.loss, **self.loss_kwargs())  # an unknown loss option

    def loss_kwargs(self) -> dict:
        labelled = {"same_label": self.same_label} if self.labels else {}
        return {**objective_options(self.loss, temperature=self.temperature, alpha=self.alpha, sigma=self.sigma,
                                    lam=self.lam, rho=self.rho, gather_distributed=True, **labelled),
                **self.loss_options}

    def total_steps(self, num_images: int) -> int:
        if self.steps is not None and self.samples is not None:
            raise ValueError("give --steps or --samples, not both")
        if self.steps is not None:
            steps = self.steps
        else:
            samples = self.samples if self.samples is not None else self.epochs * num_images
            steps = samples // self.batch_size
        if steps < 1 and self.steps != 0:  # --steps 0: the untrained baseline, saved as a run
            raise ValueError(f"the run would take {steps} steps; raise --steps or --samples")
        return steps


def build_model(cfg: VisionConfig) -> ContrastiveModel:
    backbone, dim = build_backbone(cfg.backbone, cfg.small_images, cfg.width)
    head = projection_head(dim, cfg.proj_hidden, cfg.proj_dim)
    return ContrastiveModel(cfg.method, cfg.loss, backbone, head, views=cfg.views, queue_size=cfg.queue_size,
                            loss_kwargs=cfg.loss_kwargs(), labels=cfg.labels)


def knn_eval(backbone, train_images, test_images, cfg: VisionConfig) -> float:
    transform = plain_transform()
    train = extract_features(backbone, train_images, transform, progress=cfg.progress, desc="kNN bank")
    test = extract_features(backbone, test_images, transform, progress=cfg.progress, desc="kNN test")
    return knn_accuracy(*train, *test, k=cfg.knn_k, temperature=cfg.knn_temperature,
                        num_classes=len(train_images.classes))


@guarded
def train(cfg: VisionConfig) -> dict:
    """Train, log, checkpoint and kNN-evaluate; returns the summary (also written to summary.json)."""
    from accelerate.utils import set_seed

    cfg.check()
    out = Path(cfg.out_dir)
    accelerator = make_accelerator(out, cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    if cfg.batch_size % world:
        raise ValueError(f"--batch-size {cfg.batch_size} (global) must be divisible by the {world} processes")

    set_seed(cfg.seed)
    train_images = load_images(cfg.data, "train", cfg.image_size, cfg.train_images)
    total = cfg.total_steps(len(train_images))
    test_images = load_images(cfg.data, "test", cfg.image_size, cfg.test_images,
                              classes=getattr(train_images, "classes", None))
    model = use_torch_sync_batchnorm(build_model(cfg), device)
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    scheduler = lr_schedule(optimizer, "cosine", cfg.warmup_for(total), total)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(scheduler, state)  # not prepared: it counts global steps

    checkpoints = Checkpoints(accelerator, out, cfg.keep_checkpoints, asdict(cfg), VisionConfig.FIXED)
    resumed = checkpoints.resume(state, optimizer, scheduler, cfg.resume)
    divergence = Divergence(accelerator, out)
    boundary = StepBoundary(accelerator, cfg, checkpoints, state, total, divergence, model)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    log = MetricsLog(out, enabled=accelerator.is_main_process, resume_step=state.step if resumed else None,
                     accelerator=accelerator)
    start_trackers(accelerator, f"{cfg.method}-{cfg.loss}", asdict(cfg))

    # Our sampler already shards the global batch, so the loader is not prepared (accelerate would shard again).
    batches = StepBatches(len(train_images), cfg.batch_size, rank, world, cfg.seed, state.step, total, tag_epoch=True)
    views = MultiViewDataset(train_images, simclr_augment(cfg.image_size, cfg.crop_min, blur=cfg.blur, hue=cfg.hue,
                                                            grayscale=cfg.grayscale),
                             cfg.views, cfg.seed)
    loader = DataLoader(views, batch_sampler=batches, num_workers=cfg.workers, pin_memory=device.type == "cuda",
                        worker_init_fn=quiet_worker)
    core = accelerator.unwrap_model(model)
    knn = None
    started = time.time()
    bar = tqdm(total=total, initial=state.step, desc=f"{cfg.method}/{cfg.loss}",
               disable=not (cfg.progress and accelerator.is_main_process))
    model.train()
    for x, y, _ in loader:
        try:
            outputs = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True) if cfg.labels else None)
        except NonFiniteError as err:  # CPU: the loss core names the input that went non-finite
            raise divergence.from_loss(err, state.step + 1) from err
        accelerator.backward(outputs["loss"])
        divergence.watch(state.step + 1, loss=outputs["loss"], gradient_norm=grad_norm(model.parameters()))
        if device.type == "cpu":  # host reads are free there: stop before a bad update
            divergence.check(state.step + 1)
        optimizer.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        momentum = cosine_momentum(state.step, total, cfg.momentum)
        core.momentum_update(momentum)
        state.step += 1
        bar.update(1)

        if state.step % cfg.log_every == 0 or state.step == total or state.step <= 3:
            divergence.check(state.step)
            values = {k: accelerator.reduce(v.detach().float(), "mean").item() for k, v in outputs.items()}
            log.log(state.step, **values, lr=lr, momentum=momentum if core.has_momentum else None)
            bar.set_postfix(loss=f"{values['loss']:.4f}")
        if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < total:
            if accelerator.is_main_process:
                knn = knn_eval(core.backbone, train_images, test_images, cfg)
                log.log(state.step, knn_top1=knn)
            accelerator.wait_for_everyone()
        if cfg.save_every and state.step % cfg.save_every == 0 and state.step < total:
            divergence.check(state.step, model)
            checkpoints.save(state.step)
        boundary()  # a stop signal: a checkpoint of this step, then exit status 75
    bar.close()
    seconds = time.time() - started

    divergence.check(state.step, model)
    checkpoints.save(state.step)
    summary = {}
    if accelerator.is_main_process:
        knn = knn_eval(core.backbone, train_images, test_images, cfg)
        log.log(state.step, knn_top1=knn)
        torch.save(core.backbone.state_dict(), out / "backbone.pt")
        log.plot(["loss", "pos_term", "neg_term", "npc_multiplier", "attraction", "repulsion", "knn_top1"],
                 title=f"{cfg.method} + {cfg.loss}, batch {cfg.batch_size}")
        losses = [r["loss"] for r in log.records() if "loss" in r]  # none with --steps 0
        summary = {"method": cfg.method, "loss": cfg.loss, "batch_size": cfg.batch_size, "queue_size": cfg.queue_size,
                   "steps": state.step, "samples_seen": state.step * cfg.batch_size, "processes": world,
                   "final_loss": losses[-1] if losses else None, "knn_top1": knn, "knn_k": cfg.knn_k,
                   "train_seconds": seconds, "config": asdict(cfg), "resumes": state.resumes,
                   "skipped_images": getattr(train_images, "skipped", 0) + getattr(test_images, "skipped", 0)}
        log.summary(summary)
        accelerator.print(json.dumps(summary))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def load_backbone(run_dir: str | Path, checkpoint: str | Path | None = None, device: str | torch.device = "cpu"):
    """(backbone in eval mode on ``device``, VisionConfig) of a recipe run: its ``backbone.pt`` (written at the
    end), or the online backbone of ``checkpoint`` (a ``checkpoints/checkpoint_<step>`` folder), or of its newest
    complete checkpoint."""
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a vision recipe run (no config.json)")
    cfg = VisionConfig(**renamed(json.loads((run_dir / "config.json").read_text()), VisionConfig))
    backbone, _ = build_backbone(cfg.backbone, cfg.small_images, cfg.width)
    if checkpoint is None and (run_dir / "backbone.pt").exists():
        state = torch.load(run_dir / "backbone.pt", map_location=device, weights_only=True)
    else:
        folder = Path(checkpoint) if checkpoint is not None else latest_checkpoint(run_dir)
        if folder is None or not (folder / "model.safetensors").exists():
            raise FileNotFoundError(f"no checkpoint with model.safetensors found for {str(run_dir)!r}")
        state = {k[len("backbone."):]: v for k, v in load_file(str(folder / "model.safetensors"), str(device)).items()
                 if k.startswith("backbone.")}
    backbone.load_state_dict(state)
    return backbone.to(device).eval(), cfg


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
