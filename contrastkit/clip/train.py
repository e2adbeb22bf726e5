"""CLIP training with a contrastkit objective: an accelerate loop over an open_clip model.

``recipes/clip/train.py`` parses arguments into a ``ClipTrainConfig`` and calls ``train``. The loop:
global batches in a fixed order derived from (seed, epoch), split across processes (webdataset shards are
streamed instead, in an order fixed the same way: ``contrastkit.data.shards``); the loss is the
open_clip adapter's with local_loss and gather_with_grad, so P processes equal one process on the global
batch; AdamW with warmup + cosine; the CLIP logit scale clamped to ln(100) as open_clip does; zero-shot
evaluation on a held-out ImageNet-layout folder; metrics JSONL, a plot, a summary JSON and the trackers of
``--report-to``; accelerate checkpoints that hold the step (the data position follows from it), so a
resumed run continues exactly. ``--loss siglip`` is the baseline: open_clip's own SigLipLoss, and the model
gets open_clip_train's --siglip initialisation (logit scale ln 10, a learnable logit bias at -10); the
optimizer, schedule, clamp and evaluation are the same as for every other loss. A loss, logit scale or gradient that becomes non-finite stops the run with
one line (training.Divergence); --resume with a new --lr applies it, with a new model, loss or batch refuses.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from contrastkit.adapters.open_clip import (CLIP_LOSSES, DEFAULT_MODEL, SIGLIP, SIGLIP_MODEL_OPTIONS, build_clip_loss,
                                            build_siglip_loss, check_model, create_clip)
from contrastkit.cli import arg, existing, positive
from contrastkit.data.shards import IMAGE_KEYS, ShardPositions, ShardStream, is_shards, plan_epochs
from contrastkit.training import RunOptions, guarded

RECIPE_LOSSES = (*CLIP_LOSSES, SIGLIP)  # contrastkit's objectives, then open_clip's SigLIP as a baseline


@dataclass
class ClipTrainConfig(RunOptions):
    # What a checkpoint fixes: --resume refuses a change to one of these (training.Checkpoints).
    FIXED = ("loss", "loss_options", "model", "data", "num_train", "img_key", "caption_key", "csv_separator",
             "batch_size", "weight_decay", "seed")

    loss: str = arg("dcl", "the objective (siglip: open_clip's SigLipLoss with its bias, a baseline)",
                    choices=RECIPE_LOSSES)
    loss_options: dict = arg(help="a loss option, e.g. sigma=0.5 (dclw), alpha=256 (eqco), chunk_size=512, "
                                  "dist_impl=gather (siglip)",
                             factory=dict, aliases=["--loss-option"])
    model: str = arg(DEFAULT_MODEL, "any open_clip config name (random initialisation, nothing downloaded)")
    data: str | None = arg(None, "webdataset shards as img2dataset writes them ('/data/{00000..00331}.tar', "
                                 "'::' joining several sets, or their folder), an open_clip CSV/TSV (filepath, "
                                 "title) or a Hugging Face image folder with captions; default: the embedded data")
    data_dir: str | None = arg(None, "where the embedded data is generated (default ~/.cache/contrastkit)")
    num_train: int = arg(4096, "embedded data: training pairs")
    zeroshot_per_class: int = arg(50, "embedded data: held-out zero-shot images per class")
    img_key: str = arg("filepath", "CSV image path column (shards: the image extensions, default jpg;jpeg;png;webp)")
    caption_key: str | None = arg(None, "caption column (default: title for CSV, text for an image folder, "
                                        "txt for shards)")
    train_num_samples: int | None = arg(None, "shards: samples in an epoch (default: the count in img2dataset's "
                                              "_stats.json files)")
    dataset_resampled: bool = arg(False, "shards: draw shards with replacement (open_clip's --dataset-resampled)")
    shuffle_buffer: int = arg(5000, "shards: samples in each loader worker's shuffle buffer")
    max_bad_fraction: float = arg(0.1, "fraction of a shard (or of the images loaded from a CSV/folder) that may "
                                       "be unusable (skipped and counted) before it is an error")
    verify_images: bool = arg(False, "CSV/folder: open every image before the first step and drop the unreadable "
                                     "ones (small sets); default: skip and count them when loaded")
    csv_separator: str | None = arg(None, "CSV separator (default: tab, or comma for a .csv without tabs)")
    zeroshot: str | None = arg(None, "ImageNet-layout folder for zero-shot evaluation "
                                     "(default: the embedded held-out split)")
    out_dir: str | None = arg(None, "output folder (default runs/clip-<loss>)")
    batch_size: int = arg(64, "global batch, over all processes")
    weight_decay: float = arg(0.1, "AdamW weight decay")
    workers: int = arg(0, "DataLoader worker processes")

    def __post_init__(self):
        if self.out_dir is None:
            self.out_dir = f"runs/clip-{self.loss}"

    def check(self) -> None:
        """Raise ValueError / FileNotFoundError for a value that cannot work, before any training."""
        for name in ("batch_size", "num_train", "zeroshot_per_class"):
            positive(name, getattr(self, name))
        for name in ("weight_decay", "workers", "max_bad_fraction"):
            positive(name, getattr(self, name), zero=True)
        positive("shuffle_buffer", self.shuffle_buffer)
        positive("train_num_samples", self.train_num_samples)
        if is_shards(self.data):  # the processes as accelerate launch sets them
            plan_epochs(self.data, self.batch_size, int(os.environ.get("WORLD_SIZE", 1)), self.workers,
                        num_samples=self.train_num_samples, resampled=self.dataset_resampled)
        else:
            existing("data", self.data, "training data")
        existing("zeroshot", self.zeroshot, "zero-shot folder")
        self.check_run()
        check_model(self.model)
        make_loss(self.loss, self.loss_options)  # unknown loss or option


def make_loss(name: str, options: dict, rank: int = 0, world_size: int = 1):
    """The recipe's loss: contrastkit's through the open_clip adapter (each process's anchors against every
    process's features, with gradient), or open_clip's SigLipLoss for ``siglip``."""
    if name == SIGLIP:
        return build_siglip_loss(rank=rank, world_size=world_size, **options)
    return build_clip_loss(name, local_loss=True, gather_with_grad=True, rank=rank, world_size=world_size, **options)


@guarded
def train(cfg: ClipTrainConfig) -> dict:
    """Train, evaluate zero-shot, write metrics/plot/summary under cfg.out_dir; returns the summary."""
    from accelerate.utils import set_seed
    from tqdm import tqdm

    from contrastkit.data.image_text import load_image_text, make_shapes_clip
    from contrastkit.evaluation.zeroshot import evaluate_zeroshot
    from contrastkit.losses.base import NonFiniteError
    from contrastkit.training import (Checkpoints, Divergence, MetricsLog, StepBatches, StepBoundary, TrainState,
                                      grad_norm, lr_schedule, make_accelerator, quiet_worker, start_trackers)

    cfg.check()  # everything that can fail on bad input fails here, before any training
    out_dir = Path(cfg.out_dir)
    accelerator = make_accelerator(out_dir, cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    device = accelerator.device
    loss_fn = make_loss(cfg.loss, cfg.loss_options, rank, world)
    set_seed(cfg.seed)
    sharded = getattr(accelerator, "is_fsdp2", False)
    # fully_shard takes no scalar parameter: under FSDP2 the logit scale (and bias) are open_clip's 1-element ones
    model_options = {"nonscalar_logit_scale": True} if sharded else {}
    if cfg.loss == SIGLIP:  # no random draw: the towers are initialised as for every other loss of the same seed
        model_options.update(SIGLIP_MODEL_OPTIONS)
    model, preprocess, tokenizer = create_clip(cfg.model, **model_options)
    zeroshot = cfg.zeroshot
    if cfg.data is None:
        with accelerator.main_process_first():
            root = make_shapes_clip(cfg.data_dir, num_train=cfg.num_train,
                                    num_zeroshot_per_class=cfg.zeroshot_per_class, progress=cfg.progress and main)
        data_path = root / "train.csv"
        zeroshot = zeroshot or str(root / "zeroshot")
    else:
        data_path = cfg.data if is_shards(cfg.data) else Path(cfg.data)
    if is_shards(data_path):
        urls, epoch_samples, steps_per_epoch = plan_epochs(data_path, cfg.batch_size, world, cfg.workers,
                                                           num_samples=cfg.train_num_samples,
                                                           resampled=cfg.dataset_resampled)
    else:
        dataset = load_image_text(data_path, preprocess, tokenizer, caption_key=cfg.caption_key,
                                  img_key=cfg.img_key, sep=cfg.csv_separator, max_bad_fraction=cfg.max_bad_fraction,
                                  verify=cfg.verify_images)
        epoch_samples = len(dataset)

    def bad_samples() -> int:  # unusable samples skipped so far, all processes
        mine = positions.bad if positions is not None else dataset.bad.value
        return int(accelerator.reduce(torch.tensor(mine, device=device), "sum"))

    # fused: one kernel for all parameters (on a CPU about 8x faster than the default for this model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    scheduler = lr_schedule(optimizer, "cosine", cfg.warmup_for(cfg.steps), cfg.steps)
    state = TrainState()
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler is not prepared: accelerate would step it once per process; it counts global steps.
    accelerator.register_for_checkpointing(scheduler, state)
    positions = ShardPositions(accelerator, cfg.workers) if is_shards(data_path) else None  # saved with the state
    checkpoints = Checkpoints(accelerator, out_dir, cfg.keep_checkpoints, asdict(cfg), ClipTrainConfig.FIXED)
    resumed = checkpoints.resume(state, optimizer, scheduler, cfg.resume)
    divergence = Divergence(accelerator, out_dir)
    boundary = StepBoundary(accelerator, cfg, checkpoints, state, cfg.steps, divergence, model)
    log = MetricsLog(out_dir, enabled=main, resume_step=state.step if resumed else None, accelerator=accelerator)
    start_trackers(accelerator, f"clip-{cfg.loss}", asdict(cfg))
    raw = accelerator.unwrap_model(model)

    def zero_shot():
        result = None
        if zeroshot and sharded:  # FSDP2: every process gathers the model and evaluates (main's result kept)
            raw.unshard()
            result = evaluate_zeroshot(raw, tokenizer, preprocess, zeroshot, device=device)
            raw.reshard()
            result = result if main else None
        elif zeroshot and main:
            result = evaluate_zeroshot(raw, tokenizer, preprocess, zeroshot, device=device)
        accelerator.wait_for_everyone()
        return result

    # Our sampler (or stream) already shards the global batch, so the loader is not prepared (accelerate would
    # shard again).
    if positions is None:
        sampler = StepBatches(len(dataset), cfg.batch_size, rank, world, cfg.seed, state.step, cfg.steps)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.workers,
                                             pin_memory=device.type == "cuda", worker_init_fn=quiet_worker)
    else:
        image_keys = IMAGE_KEYS if cfg.img_key == "filepath" else cfg.img_key.split(";")
        stream = ShardStream(urls, preprocess, tokenizer, local_batch=cfg.batch_size // world,
                             steps_per_epoch=steps_per_epoch, start=state.step, stop=cfg.steps, rank=rank,
                             world=world, workers=cfg.workers, seed=cfg.seed, resampled=cfg.dataset_resampled,
                             shuffle_buffer=cfg.shuffle_buffer, image_keys=image_keys,
                             caption_key=cfg.caption_key or "txt", max_bad_fraction=cfg.max_bad_fraction,
                             positions=positions.latest)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=cfg.workers,
                                             pin_memory=device.type == "cuda", worker_init_fn=quiet_worker)
    bar = tqdm(total=cfg.steps, initial=state.step, desc=f"clip {cfg.loss}", disable=not (main and cfg.progress))
    started = time.time()
    model.train()
    for images, texts, *where in loader:
        if positions is not None:
            positions.update(where[0])
        out = model(images.to(device, non_blocking=True), texts.to(device, non_blocking=True))
        try:
            loss = loss_fn(**out)
        except NonFiniteError as err:  # CPU: the loss core names the input that went non-finite
            raise divergence.from_loss(err, state.step + 1) from err
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        divergence.watch(state.step + 1, loss=loss, logit_scale=out["logit_scale"],
                         gradient_norm=grad_norm(model.parameters()))
        if device.type == "cpu":  # host reads are free there: stop before a bad update
            divergence.check(state.step + 1)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            raw.logit_scale.clamp_(0, math.log(100))
        state.step += 1
        bar.update(1)
        if state.step % cfg.log_every == 0 or state.step == cfg.steps:
            divergence.check(state.step)
            # The global loss is the mean of the processes' local losses (equal local batches).
            global_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
            scale = raw.logit_scale.full_tensor() if sharded else raw.logit_scale  # FSDP2: a DTensor
            extra = {}
            if getattr(raw, "logit_bias", None) is not None:  # siglip
                bias = raw.logit_bias.full_tensor() if sharded else raw.logit_bias
                extra["logit_bias"] = bias.item()
            log.log(state.step, loss=global_loss, logit_scale=scale.exp().item(), **extra,
                    lr=scheduler.get_last_lr()[0], bad_samples=bad_samples())
            bar.set_postfix(loss=f"{global_loss:.3f}")
        if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < cfg.steps:
            result = zero_shot()
            if result:
                log.log(state.step, **{f"zeroshot_{k}": v for k, v in result.items() if k in ("top1", "top5")})
                bar.write(f"step {state.step}: zero-shot top-1 {result['top1']:.3f}")
        if cfg.save_every and state.step % cfg.save_every == 0:
            divergence.check(state.step, model)
            checkpoints.save(state.step)
        boundary()  # a stop signal: a checkpoint of this step, then exit status 75
    if cfg.steps == 0:  # the untrained baseline: its initial model as checkpoint_0
        checkpoints.save(0)
    bar.close()
    last = zero_shot()
    summary = {"loss_name": cfg.loss, "model": cfg.model, "steps": state.step, "batch_size": cfg.batch_size,
               "processes": world, "train_pairs": epoch_samples, "data": str(data_path), "zeroshot_data": zeroshot,
               "train_seconds": round(time.time() - started, 1), "config": asdict(cfg),
               "resumes": state.resumes}
    summary["bad_samples"] = bad_samples()
    if positions is not None:
        summary.update(shards=len(urls), steps_per_epoch=steps_per_epoch)
    if last:
        log.log(state.step, **{f"zeroshot_{k}": v for k, v in last.items() if k in ("top1", "top5")})
        summary.update({f"zeroshot_{k}": v for k, v in last.items()})
    if main:
        records = [r for r in log.records() if "loss" in r]
        summary["final_loss"] = records[-1]["loss"] if records else None
        log.plot(["loss", "zeroshot_top1", "logit_scale"], title=f"CLIP {cfg.model}, loss {cfg.loss}")
        log.summary(summary)
    accelerator.end_training()
    return summary
