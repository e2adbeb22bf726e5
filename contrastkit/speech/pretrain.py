"""wav2vec 2.0 pre-training with accelerate, for both backends (Hugging Face, fairseq2), any objective.

Follows the wav2vec 2.0 recipe at a small scale: utterances of a batch cropped at random to the
shortest one (no padding), normalised to zero mean and unit variance; masks of ``mask_time_length``
frames started with probability ``mask_time_prob``, distractors from the masked frames of the same
utterance; gumbel temperature max_temp * decay^update floored at min_temp (2, 0.5; by default the decay
reaches the floor at 80% of the run); AdamW with linear warm-up then linear decay; the summed loss
divided by the number of masked frames over all processes.

The defaults (800 steps of 8 utterances, peak lr 4e-3, on both backends) were found by measurement on
the embedded default (docs/evidence.md, section 4): the earlier default (400 steps at 1e-3) stays on the
plateau where every candidate scores the same (contrastive loss ln K per frame, accuracy at chance) on
its 40 voices in reverberant rooms; at 800 steps, 2e-3 and 4e-3 leave it on both backends, 4e-3 sooner.

At the end, the pretext task is measured on held-out utterances (speech/pretext.py: wav2vec 2.0's own
validation accuracy and contrastive loss), for the trained model and for the same model at
initialisation (same seed), in the summary's ``pretext`` and the last metrics record; with ``--eval-every N``
also the trained model's every N steps, in the metrics.

Resume is exact: every random draw of a step (data order, crops, masks, distractors, gumbel noise) is
seeded from (seed, step, rank), and accelerate's checkpoint holds model, optimizer, scheduler and the
registered ``TrainState`` (step). A loss or gradient that becomes non-finite stops the run with one line
(training.Divergence); a resume with a new --lr applies it, with a new model, objective or batch refuses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import torch

from contrastkit.cli import arg, existing, positive
from contrastkit.data import speech as data
from contrastkit.losses import build_loss
from contrastkit.speech import models
from contrastkit.speech.pretext import evaluate_pretext
from contrastkit.training import RunOptions, guarded


BACKENDS = ("hf", "fairseq2")
SPEECH_LOSSES = ("infonce", "dcl", "dclw", "eqco", "cacr")


@dataclasses.dataclass
class PretrainConfig(RunOptions):
    # What a checkpoint fixes: a resume refuses a change to one of these (training.Checkpoints).
    FIXED = ("backend", "loss", "temperature", "loss_options", "data", "batch_size", "gumbel", "conformer", "seed")
    GLOBAL_BATCH = False  # --batch-size is per process here (training.out_of_memory)
    # Where this recipe's defaults differ from RunOptions' (module doc: 800 steps at 4e-3 were measured); a warm-up
    # of 8 % of the steps; a held-out pretext evaluation at the end only; a requeued command carries on by default.
    DEFAULTS = {"steps": 800, "lr": 4e-3, "warmup": 0.08, "eval_every": 0, "resume": "auto"}

    backend: str = arg("hf", "wav2vec 2.0 implementation", choices=BACKENDS)
    loss: str = arg("dcl", "the objective", choices=SPEECH_LOSSES)
    temperature: float | None = arg(None, "loss temperature (default: the model's, 0.1)")
    loss_options: dict = arg(help="extra loss option, e.g. chunk_size=512 (typed: int, float, bool or str)",
                             factory=dict, aliases=["--loss-option"])
    data: str | None = arg(None, "FSC root, VoxCeleb1 root or a folder of audio files (default: embedded)")
    out_dir: str | None = arg(None, "output folder (default: runs/wav2vec2-<backend>-<loss>)", aliases=["--out"])
    batch_size: int = arg(8, "utterances per process")
    max_seconds: float = arg(2.0, "longest crop, in seconds")
    gumbel: tuple[float, float] = arg((2.0, 0.5), "gumbel temperature: start and floor")
    conformer: bool = arg(False, "HF only: Wav2Vec2ConformerForPreTraining")
    pretext_eval: bool = arg(True, "at the end, held-out pretext accuracy of the trained and the untrained model, "
                                   "and of the trained one every --eval-every steps (--no-pretext-eval skips it)")

    def __post_init__(self):
        if self.out_dir is None:
            self.out_dir = f"runs/wav2vec2-{self.backend}-{self.loss}"
        self.gumbel = tuple(self.gumbel)

    def check(self) -> None:
        """Raise ValueError / FileNotFoundError for a value that cannot work, before any training."""
        for name in ("batch_size", "max_seconds", "temperature"):
            positive(name, getattr(self, name))
        if not self.gumbel[0] >= self.gumbel[1] > 0:
            raise ValueError(f"--gumbel takes start >= floor > 0, got {self.gumbel}")
        if self.conformer and self.backend != "hf":
            raise ValueError("--conformer needs --backend hf")
        if self.backend == "fairseq2" and importlib.util.find_spec("fairseq2") is None:
            raise ValueError("--backend fairseq2 needs fairseq2 0.8.1, which pins torch 2.9.1: run it in the second "
                             "environment (bash setup.sh --with-legacy, then .venv-legacy/bin/python ...)")
        existing("data", self.data, "audio data")
        self.check_run()
        build_loss(self.loss, **self.loss_options)  # an unknown loss option


def _layout_records(path: str | None, fsc_split: str, voxceleb_split: str) -> list[dict] | None:
    """Records of a known layout: the embedded default or an FSC root (its ``fsc_split``), a VoxCeleb1
    root (its ``voxceleb_split``); None for anything else."""
    if path is None:
        return data.read_fsc(data.default_speech_data() / "fsc", fsc_split)
    root = Path(path)
    if (root / "data" / f"{fsc_split}_data.csv").is_file():
        return data.read_fsc(root, fsc_split)
    if (root / "iden_split.txt").is_file() or (root / "meta" / "iden_split.txt").is_file():
        return data.read_voxceleb_iden(root, voxceleb_split)
    return None


def pretraining_records(path: str | None) -> list[dict]:
    """The audio to pre-train on: FSC train split, VoxCeleb1 train split, or every audio file under a folder."""
    records = _layout_records(path, "train", "train")
    if records is not None:
        return records
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"pre-training data {root} not found")
    files = sorted(p for ext in ("wav", "flac", "ogg") for p in root.rglob(f"*.{ext}"))
    if not files:
        raise ValueError(f"no audio files (.wav, .flac, .ogg) under {root}")
    return [{"path": str(p)} for p in files]


def heldout_records(path: str | None) -> list[dict]:
    """Utterances not trained on, for the pretext evaluation: FSC valid split (speakers disjoint from
    train), VoxCeleb1 dev split (same speakers, other sentences); a plain folder of audio has none ([])."""
    return _layout_records(path, "valid", "dev") or []


def gumbel_decay(cfg: PretrainConfig) -> float:
    """Per-update decay reaching the floor at 80% of the run (wav2vec 2.0: 0.999995 over 400k updates)."""
    max_t, min_t = cfg.gumbel
    return (min_t / max_t) ** (1.0 / max(1, int(0.8 * cfg.steps)))


def loss_kwargs(cfg: PretrainConfig) -> dict:
    return {**({} if cfg.temperature is None else {"temperature": cfg.temperature}), **cfg.loss_options}


def build_model(cfg: PretrainConfig):
    if cfg.backend == "hf":
        from contrastkit.adapters import hf_wav2vec2

        model = models.hf_model(cfg.conformer, seed=cfg.seed)
        hf_wav2vec2.patch(model, loss=cfg.loss, **loss_kwargs(cfg))
        return model
    if cfg.backend == "fairseq2":
        from contrastkit.adapters import fairseq2_wav2vec2

        model = models.fairseq2_model(seed=cfg.seed,
                                      codebook_sampling_temperature=(*cfg.gumbel, gumbel_decay(cfg)))
        fairseq2_wav2vec2.patch(model, loss=cfg.loss, **loss_kwargs(cfg))
        return model
    raise ValueError(f"unknown backend {cfg.backend!r}; choose hf or fairseq2")


def make_batch(waves: list[torch.Tensor], cfg: PretrainConfig, step: int, rank: int, world: int) -> torch.Tensor:
    """This process's batch of step ``step``: the global batch is drawn from a per-epoch permutation,
    each process takes its slice; crops to the shortest utterance (at most max_seconds), normalised."""
    global_batch = cfg.batch_size * world
    per_epoch = max(1, len(waves) // global_batch)
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([cfg.seed, epoch]).permutation(len(waves))
    picked = order[index * global_batch:(index + 1) * global_batch][rank * cfg.batch_size:(rank + 1) * cfg.batch_size]
    rng = np.random.default_rng([cfg.seed, step, rank, 1])
    length = min(min(len(waves[i]) for i in picked), int(cfg.max_seconds * data.SAMPLE_RATE))
    crops = []
    for i in picked:
        start = int(rng.integers(0, len(waves[i]) - length + 1))
        w = waves[i][start:start + length]
        crops.append((w - w.mean()) / (w.std() + 1e-7))
    return torch.stack(crops)


def forward_loss(model, batch: torch.Tensor, cfg: PretrainConfig, step: int, rank: int):
    """(summed loss, its parts as floats, number of masked frames) for one batch."""
    unwrapped = getattr(model, "module", model)
    if cfg.backend == "hf":
        unwrapped.set_gumbel_temperature(models.gumbel_temperature(step, *cfg.gumbel, gumbel_decay(cfg)))
        mask, negatives = models.hf_mask_and_negatives(unwrapped, batch.shape[0], batch.shape[1],
                                                       np.random.default_rng([cfg.seed, step, rank, 2]))
        out = model(batch, mask_time_indices=mask.to(batch.device),
                    sampled_negative_indices=negatives.to(batch.device))
        parts = {"contrastive": out.contrastive_loss, "diversity": out.diversity_loss,
                 "perplexity": out.codevector_perplexity}
        return out.loss, parts, int(mask.sum())
    from fairseq2.nn import BatchLayout

    loss, out = model(batch, BatchLayout.of(batch))
    parts = {"contrastive": loss.contrastive, "diversity": loss.diversity,
             "perplexity": out.quantizer_output.prob_perplexity}
    return loss.aggregate, parts, int(out.num_targets)


@guarded
def pretrain(cfg: PretrainConfig, resume: bool | str | None = None, stop_at: int | None = None) -> dict:
    """Train, checkpoint, export the upstream to ``out_dir/upstream``; returns the summary.

    resume: default cfg.resume. stop_at: leave after that step, as an interrupted run would (the tests
    resume from there).
    """
    from tqdm import tqdm

    from contrastkit.losses.base import NonFiniteError
    from contrastkit.training import (Checkpoints, Divergence, MetricsLog, StepBoundary, TrainState, lr_schedule,
                                      make_accelerator, start_trackers)

    cfg.check()
    out_dir = Path(cfg.out_dir)
    accelerator = make_accelerator(out_dir, cfg, cpu=not torch.cuda.is_available())
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    utterances = pretraining_records(cfg.data)
    waves, kept = data.load_waveforms(utterances)
    if len(waves) < cfg.batch_size * world:
        raise ValueError(f"{len(waves)} utterances cannot fill a batch of {cfg.batch_size} x {world} processes")

    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    scheduler = lr_schedule(optimizer, "linear", max(1, cfg.warmup_for(cfg.steps)), cfg.steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(scheduler, state)  # not prepared: it counts global steps

    checkpoints = Checkpoints(accelerator, out_dir, cfg.keep_checkpoints, dataclasses.asdict(cfg), PretrainConfig.FIXED)
    checkpoint = checkpoints.resume(state, optimizer, scheduler, cfg.resume if resume is None else resume)
    divergence = Divergence(accelerator, out_dir)
    boundary = StepBoundary(accelerator, cfg, checkpoints, state, cfg.steps, divergence, model)
    log = MetricsLog(out_dir, enabled=accelerator.is_main_process,
                     resume_step=state.step if checkpoint is not None else None, accelerator=accelerator)
    if accelerator.is_main_process:
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    start_trackers(accelerator, f"wav2vec2-{cfg.backend}-{cfg.loss}", dataclasses.asdict(cfg))

    heldout = (data.load_waveforms(heldout_records(cfg.data))[0]
               if cfg.pretext_eval and accelerator.is_main_process else [])
    pretext = None

    model.train()
    bar = tqdm(total=cfg.steps, initial=state.step, desc=f"wav2vec2 {cfg.backend} {cfg.loss}",
               disable=not (cfg.progress and accelerator.is_local_main_process))
    while state.step < cfg.steps:
        step = state.step
        torch.manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)  # gumbel noise, fairseq2's masks
        batch = make_batch(waves, cfg, step, rank, world).to(device, non_blocking=True)
        try:
            loss, parts, masked = forward_loss(model, batch, cfg, step, rank)
        except NonFiniteError as err:  # CPU: the loss core names the input that went non-finite
            raise divergence.from_loss(err, step + 1) from err
        total_masked = accelerator.reduce(torch.tensor(float(masked), device=device), "sum")
        # DDP averages gradients over processes: scale so the result is the global sum / global count
        accelerator.backward(loss * world / total_masked.clamp(min=1.0))
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), 10.0)
        divergence.watch(step + 1, loss=loss, gradient_norm=grad_norm)
        if device.type == "cpu":  # host reads are free there: stop before a bad update
            divergence.check(step + 1)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state.step += 1
        bar.update(1)
        evaluate = state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0)
        pretext = evaluate_pretext(accelerator.unwrap_model(model), heldout, cfg) if heldout and evaluate else None
        measured = {} if pretext is None else {"heldout_accuracy": pretext["accuracy"],
                                               "heldout_infonce": pretext["infonce_per_frame"],
                                               "heldout_loss": pretext.get("loss_per_frame")}
        if state.step % cfg.log_every == 0 or state.step == cfg.steps:
            divergence.check(state.step)
            values = {k: float(v.detach()) / (masked if k != "perplexity" else 1) for k, v in parts.items()}
            values = {("contrastive_per_frame" if k == "contrastive" else "diversity_per_frame" if k == "diversity"
                       else k): v for k, v in values.items()}
            log.log(state.step, loss=float(loss.detach()) / max(masked, 1), lr=scheduler.get_last_lr()[0],
                    grad_norm=float(grad_norm), **values, **measured)
            bar.set_postfix(loss=f"{float(loss.detach()) / max(masked, 1):.3f}")
        elif measured:
            log.log(state.step, **measured)
        if (cfg.save_every and state.step % cfg.save_every == 0) or state.step == cfg.steps:
            divergence.check(state.step, model)
            checkpoints.save(state.step)
        boundary()  # a stop signal: a checkpoint of this step, then exit status 75
        if stop_at is not None and state.step >= stop_at:
            bar.close()
            accelerator.end_training()
            return {}
    bar.close()

    summary = {}
    if accelerator.is_main_process:
        export_upstream(accelerator.unwrap_model(model), cfg, out_dir / "upstream")
        records = log.records()
        summary = {"backend": cfg.backend, "loss": cfg.loss, "steps": cfg.steps, "processes": world,
                   "final_loss_per_frame": records[-1]["loss"] if records else math.nan,
                   "upstream": str(out_dir / "upstream"), "config": dataclasses.asdict(cfg),
                   "resumes": state.resumes, "skipped_audio": len(utterances) - len(kept)}
        if heldout:
            summary["pretext"] = pretext_comparison(accelerator.unwrap_model(model), heldout, cfg, trained=pretext)
        log.plot(["loss", "contrastive_per_frame", "perplexity", "lr"], title=f"wav2vec 2.0 {cfg.backend} {cfg.loss}")
        log.summary(summary)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def pretext_comparison(model, heldout: list[torch.Tensor], cfg: PretrainConfig, trained: dict | None = None) -> dict:
    """Held-out pretext accuracy / loss of ``model`` and of the same model at initialisation (a fresh
    ``build_model(cfg)``, same seed), scored on the same frames; ``trained``: the model's, if already measured.

    Each model scores against its own codebook (the quantiser is learned): see speech/pretext.py.
    """
    if trained is None:
        trained = evaluate_pretext(model, heldout, cfg)
    if cfg.steps == 0:  # --steps 0: the model is the untrained one
        untrained = trained
    else:
        with torch.random.fork_rng(devices=[]):
            untrained = evaluate_pretext(build_model(cfg).to(next(model.parameters()).device), heldout, cfg)
    return {"heldout": (cfg.data or "embedded default") + f" ({len(heldout)} held-out utterances)",
            "trained": trained, "untrained": untrained,
            "accuracy_gain": trained["accuracy"] - untrained["accuracy"],
            "chance": {"trained": trained["chance"], "untrained": untrained["chance"]}}


def export_upstream(model, cfg: PretrainConfig, path: Path) -> None:
    """HF: ``save_pretrained`` (loads with Wav2Vec2Model.from_pretrained); fairseq2: the state dict as
    ``fairseq2_wav2vec2.safetensors`` and the config as ``fairseq2_wav2vec2.json`` (no pickle to trust)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    if cfg.backend == "hf":
        model.save_pretrained(str(path))
    else:
        config = dataclasses.asdict(models.fairseq2_config(codebook_sampling_temperature=(*cfg.gumbel,
                                                                                          gumbel_decay(cfg))))
        (path / "fairseq2_wav2vec2.json").write_text(json.dumps(config, default=lambda enum: enum.name, indent=2))
        weights = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(weights, str(path / "fairseq2_wav2vec2.safetensors"))
    (path / "contrastkit.json").write_text(json.dumps({"backend": cfg.backend, "loss": cfg.loss}) + "\n")
