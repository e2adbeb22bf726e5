"""CLIP training with a contrastkit objective: an accelerate loop over an open_clip model.

``recipes/clip/train.py`` parses arguments into a ``ClipTrainConfig`` and calls ``train``. The loop:
global batches in a fixed order derived from (seed, epoch), split across processes; the loss is the
open_clip adapter's with local_loss and gather_with_grad, so P processes equal one process on the global
batch; AdamW with warmup + cosine; the CLIP logit scale clamped to ln(100) as open_clip does; zero-shot
evaluation on a held-out ImageNet-layout folder; metrics JSONL, a plot and a summary JSON; accelerate
checkpoints that hold the step (the data position follows from it), so a resumed run continues exactly.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "clip_configs"
DEFAULT_MODEL = "contrastkit-tiny"


@dataclass
class ClipTrainConfig:
    loss: str = "dcl"
    loss_options: dict = field(default_factory=dict)
    model: str = DEFAULT_MODEL
    data: str | None = None            # CSV/TSV (open_clip format) or HF image folder; None: embedded shapes
    data_dir: str | None = None        # where the embedded data is generated (default ~/.cache/contrastkit)
    num_train: int = 4096              # embedded data: training pairs
    zeroshot_per_class: int = 50       # embedded data: held-out images per class
    img_key: str = "filepath"
    caption_key: str | None = None     # default "title" (CSV) or "text" (image folder)
    csv_separator: str | None = None
    zeroshot: str | None = None        # ImageNet-layout folder; default: the embedded held-out split
    out_dir: str = "runs/clip"
    batch_size: int = 64               # global, over all processes
    steps: int = 300
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: int = 30
    log_every: int = 10
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0
    workers: int = 0
    resume: bool = False
    progress: bool = True


def register_configs() -> None:
    """Make the model configs that ship with contrastkit (e.g. contrastkit-tiny) known to open_clip."""
    import open_clip

    if DEFAULT_MODEL not in open_clip.list_models():
        open_clip.add_model_config(CONFIG_DIR)


def create_clip(name: str):
    """(model, preprocess, tokenizer) for an open_clip config name, randomly initialised (no download)."""
    import open_clip

    register_configs()
    if name not in open_clip.list_models():
        known = open_clip.list_models()
        raise ValueError(f"unknown open_clip model config {name!r}; e.g. {', '.join(known[:8])}, ... "
                         f"({len(known)} known, see open_clip.list_models())")
    model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None, output_dict=True)
    return model, preprocess, open_clip.get_tokenizer(name)


class StepBatches(torch.utils.data.Sampler):
    """This process's share of the global batch of every step from ``start``: epoch e is a permutation
    seeded by (seed, e), cut into global batches (the last partial one dropped), each split in P slices."""

    def __init__(self, n: int, batch_size: int, rank: int, world: int, seed: int, start: int, stop: int):
        if batch_size % world:
            raise ValueError(f"batch size {batch_size} must be divisible by the number of processes {world}")
        if n < batch_size:
            raise ValueError(f"the dataset has {n} pairs, fewer than one batch of {batch_size}")
        self.n, self.batch, self.rank, self.world = n, batch_size, rank, world
        self.seed, self.start, self.stop = seed, start, stop
        self.per_epoch = n // batch_size

    def __len__(self):
        return self.stop - self.start

    def __iter__(self):
        local = self.batch // self.world
        epoch, perm = None, None
        for step in range(self.start, self.stop):
            if step // self.per_epoch != epoch:
                epoch = step // self.per_epoch
                perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            j = (step % self.per_epoch) * self.batch + self.rank * local
            yield perm[j:j + local].tolist()


def cosine_with_warmup(optimizer, warmup: int, total: int):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(cfg: ClipTrainConfig) -> dict:
    """Train, evaluate zero-shot, write metrics/plot/summary under cfg.out_dir; returns the summary."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm import tqdm

    from contrastkit.adapters.open_clip import build_clip_loss
    from contrastkit.data.image_text import load_image_text, make_shapes_clip
    from contrastkit.evaluation.zeroshot import evaluate_zeroshot
    from contrastkit.training import MetricsLog, TrainState, latest_checkpoint, save_checkpoint

    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    out_dir = Path(cfg.out_dir)

    # Everything that can fail on bad input fails here, before any training.
    loss_fn = build_clip_loss(cfg.loss, local_loss=True, gather_with_grad=True, rank=rank, world_size=world,
                              **cfg.loss_options)
    set_seed(cfg.seed)
    model, preprocess, tokenizer = create_clip(cfg.model)
    zeroshot = cfg.zeroshot
    if cfg.data is None:
        with accelerator.main_process_first():
            root = make_shapes_clip(cfg.data_dir, num_train=cfg.num_train, num_zeroshot_per_class=cfg.zeroshot_per_class,
                                    progress=cfg.progress and main)
        data_path = root / "train.csv"
        zeroshot = zeroshot or str(root / "zeroshot")
    else:
        data_path = Path(cfg.data)
    dataset = load_image_text(data_path, preprocess, tokenizer, caption_key=cfg.caption_key, img_key=cfg.img_key,
                              sep=cfg.csv_separator)

    # fused: one kernel for all parameters (on a CPU about 8x faster than the default for this model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    scheduler = cosine_with_warmup(optimizer, cfg.warmup, cfg.steps)
    state = TrainState()
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler is not prepared: accelerate would step it once per process; it counts global steps.
    accelerator.register_for_checkpointing(scheduler, state)
    if cfg.resume:
        checkpoint = latest_checkpoint(out_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {out_dir / 'checkpoints'}")
        accelerator.load_state(str(checkpoint))
    log = MetricsLog(out_dir, enabled=main, resume_step=state.step if cfg.resume else None)
    raw = accelerator.unwrap_model(model)

    def zero_shot():
        result = None
        if zeroshot and main:
            result = evaluate_zeroshot(raw, tokenizer, preprocess, zeroshot, device=accelerator.device)
        accelerator.wait_for_everyone()
        return result

    sampler = StepBatches(len(dataset), cfg.batch_size, rank, world, cfg.seed, state.step, cfg.steps)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.workers)
    bar = tqdm(total=cfg.steps, initial=state.step, desc=f"clip {cfg.loss}", disable=not (main and cfg.progress))
    started = time.time()
    model.train()
    for images, texts in loader:
        out = model(images.to(accelerator.device), texts.to(accelerator.device))
        loss = loss_fn(**out)
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            raw.logit_scale.clamp_(0, math.log(100))
        state.step += 1
        bar.update(1)
        if state.step % cfg.log_every == 0 or state.step == cfg.steps:
            # The global loss is the mean of the processes' local losses (equal local batches).
            global_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
            log.log(state.step, loss=global_loss, logit_scale=raw.logit_scale.exp().item(),
                    lr=scheduler.get_last_lr()[0])
            bar.set_postfix(loss=f"{global_loss:.3f}")
        if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < cfg.steps:
            result = zero_shot()
            if result:
                log.log(state.step, **{f"zeroshot_{k}": v for k, v in result.items() if k in ("top1", "top5")})
                bar.write(f"step {state.step}: zero-shot top-1 {result['top1']:.3f}")
        if cfg.save_every and state.step % cfg.save_every == 0:
            save_checkpoint(accelerator, out_dir, state.step)
    bar.close()
    last = zero_shot()
    summary = {"loss_name": cfg.loss, "model": cfg.model, "steps": state.step, "batch_size": cfg.batch_size,
               "processes": world, "train_pairs": len(dataset), "data": str(data_path), "zeroshot_data": zeroshot,
               "train_seconds": round(time.time() - started, 1), "config": asdict(cfg)}
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
