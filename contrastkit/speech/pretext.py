"""Held-out measure of the wav2vec 2.0 pretext task: the validation numbers wav2vec 2.0 itself reports.

fairseq's wav2vec 2.0 criterion logs ``accuracy``: over the masked frames, the fraction whose positive
(the frame's quantised target) scores highest among itself and its sampled distractors. This module
computes it, and the held-out contrastive loss, on utterances the model was not trained on:

>>> from contrastkit.speech.pretext import evaluate_pretext
>>> report = evaluate_pretext(model, waves, cfg)   # cfg: PretrainConfig (backend, seed, max_seconds, loss)
>>> report["accuracy"], report["chance"], report["infonce_per_frame"]

The masks and distractors are drawn as in training (HF: ``models.hf_mask_and_negatives``; fairseq2: the
model's own masker and distractor sampler), from a fixed seed per utterance, so two models are scored
on the same frames against distractors at the same positions. The model is put in eval mode (no
dropout; both quantisers pick the argmax code instead of a gumbel sample) and restored afterwards; the
global RNGs are left as they were.

Caveat: the quantiser is learned too, so a trained and an untrained model are scored against
different targets (their own codebooks). Chance is what a scorer with random scores would get on the
same frames: the mean over frames of 1 / (1 + number of valid distractors), a distractor equal to the
target being invalid (masked out, as both frameworks do). With K = 20 distractors and no collisions it
is 1/21 = 0.048; a collapsed codebook leaves fewer valid distractors and raises it (it is reported
with the accuracy). Frames whose distractors all equal the target are left out (as the losses do) and
counted in ``dropped_frames``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from contrastkit.adapters import patching
from contrastkit.data import speech as data
from contrastkit.losses import functional
from contrastkit.speech import models
from contrastkit.losses.dense import score_loss
from contrastkit.losses.frames import FrameObjective


def _crop(wave: torch.Tensor, max_seconds: float) -> torch.Tensor:
    """The centre ``max_seconds`` of an utterance (all of a shorter one), normalised as in training."""
    length = min(len(wave), int(max_seconds * data.SAMPLE_RATE))
    start = (len(wave) - length) // 2
    w = wave[start:start + length]
    return (w - w.mean()) / (w.std() + 1e-7)


def _scores(model, backend: str, batch: torch.Tensor, seed: int, index: int):
    """(pos [M], neg [M, K], valid [M, K], model temperature) of one utterance's masked frames."""
    if backend == "hf":
        from contrastkit.adapters.hf_wav2vec2 import contrastive_scores

        mask, negatives = models.hf_mask_and_negatives(model, batch.shape[0], batch.shape[1],
                                                       np.random.default_rng([seed, index, 7]))
        out = model(batch, mask_time_indices=mask.to(batch.device),
                    sampled_negative_indices=negatives.to(batch.device))
        pos, neg, valid = contrastive_scores(out.projected_states, out.projected_quantized_states,
                                             negatives.to(batch.device), mask.to(batch.device))
        return pos, neg, valid, float(model.config.contrastive_logits_temperature)
    if backend == "fairseq2":
        from fairseq2.nn import BatchLayout

        from contrastkit.adapters.fairseq2_wav2vec2 import frame_scores

        torch.manual_seed(seed * 1_000_003 + index)  # fairseq2's masker and distractor sampler
        _, out = model(batch, BatchLayout.of(batch))
        pos, neg, valid = frame_scores(out.logits, model.logit_temp)
        return pos, neg, valid, float(model.logit_temp)
    raise ValueError(f"unknown backend {backend!r}; choose hf or fairseq2")


@torch.no_grad()
def evaluate_pretext(model, waves: list[torch.Tensor], cfg, *, seed: int | None = None,
                     objective: FrameObjective | None = None) -> dict:
    """wav2vec 2.0's pretext accuracy and contrastive loss on ``waves`` (held-out utterances).

    model: the backend's pre-training model (HF ``Wav2Vec2ForPreTraining``/Conformer, fairseq2
    ``Wav2Vec2Model``; a DDP/accelerate wrapper is unwrapped). cfg: anything with ``backend``,
    ``max_seconds`` and ``seed`` (a PretrainConfig). seed: the masks' and distractors' seed (default
    cfg.seed). objective: the loss to report besides InfoNCE (default: the model's patched objective).

    Returns accuracy (positive strictly above every valid distractor), chance (see the module doc),
    infonce_per_frame (cross entropy over [positive, valid distractors] at the model's temperature, what
    fairseq validates with), loss_per_frame (the objective's), frames, dropped_frames,
    mean_valid_distractors and utterances.
    """
    model = patching.unwrap(model)
    backend = cfg.backend
    seed = cfg.seed if seed is None else seed
    objective = objective or patching.active_objective(model)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    pos_all, neg_all, valid_all = [], [], []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for i, wave in enumerate(waves):
                batch = _crop(wave, cfg.max_seconds)[None].to(device)
                pos, neg, valid, temperature = _scores(model, backend, batch, seed, i)
                pos_all.append(pos.float().cpu())
                neg_all.append(neg.float().cpu())
                valid_all.append(valid.cpu())
    finally:
        model.train(was_training)
    pos, neg, valid = torch.cat(pos_all), torch.cat(neg_all), torch.cat(valid_all)
    keep = valid.any(dim=1)
    dropped = int((~keep).sum())
    pos, neg, valid = pos[keep], neg[keep], valid[keep]
    report = {"utterances": len(waves), "frames": int(pos.shape[0]), "dropped_frames": dropped,
              "temperature": temperature}
    if pos.shape[0] == 0:
        return {**report, "accuracy": math.nan, "chance": math.nan, "infonce_per_frame": math.nan,
                "loss_per_frame": math.nan, "mean_valid_distractors": 0.0}
    best_negative = neg.masked_fill(~valid, -math.inf).max(dim=1).values
    n_valid = valid.sum(dim=1).float()
    infonce = functional.infonce(pos, neg, temperature=temperature, neg_mask=valid)
    report.update(accuracy=float((pos > best_negative).float().mean()),
                  chance=float((1.0 / (1.0 + n_valid)).mean()),
                  infonce_per_frame=float(infonce.mean()),
                  mean_valid_distractors=float(n_valid.mean()))
    if objective is not None:
        # the objective's formula on this process's frames only (no collective: DCLW's weights are over these)
        loss_fn = objective.objective(temperature)
        per_frame = score_loss(pos, neg, valid, loss_fn.default_logit_scale(), terms=loss_fn.logit_terms,
                               num_neg=n_valid.clamp_min(1.0), with_mean=loss_fn.needs_mean)
        report["loss"] = objective.name
        report["loss_per_frame"] = float(per_frame.mean())
    return report
