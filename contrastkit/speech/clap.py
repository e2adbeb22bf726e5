"""Audio-text contrastive training: a tiny Hugging Face ClapModel on spoken commands with any contrastkit
objective, and zero-shot intent classification from text prompts.

``recipes/clap/train.py`` parses a ``ClapTrainConfig`` and calls ``train``. The model is built locally
(``clap_config``: a small HTSAT audio encoder and a one-layer text encoder, random weights), with its own
``ClapFeatureExtractor`` (log-mel, 16 kHz) and a word-level tokenizer over the run's texts
(``word_tokenizer``): nothing is downloaded. Its loss is replaced by ``hf_clip.patch`` (the objective on
the model's embeddings and learnable scales), by default with ``directions="both"``: audio clips against
texts and texts against clips, what zero-shot classification of a clip uses (``--directions model``
keeps Hugging Face's texts-only anchors, with which ``infonce`` is ClapModel's own loss).

Data: the Fluent Speech Commands layout (the embedded spoken commands by default, or a real FSC root).
Each clip's caption is, by ``--caption``: its ``transcript``; its ``intent`` description written from the
labels (``intent_prompt``: "activate lights", "decrease heat in the washroom"); or ``mix`` (default), one
of the two at random per step. The zero-shot classifier's prompts are those intent descriptions, one per
intent, so a model trained on transcripts alone must carry the label words over from the transcripts'
(a tiny text encoder trained from scratch has no other source), and ``mix`` teaches the label vocabulary
while keeping the many phrasings of a real FSC intent in training.

Each step's global batch holds ``batch_size`` different intents (one clip each, with a random crop of at
most ``max_seconds``), drawn from a generator seeded by (seed, step): a batch has no second clip of an
anchor's intent counted as its negative, and the step alone fixes the data, so a resumed run continues
exactly. The evaluation (``zeroshot_intent``): each test clip (FSC test split, speakers unseen in training)
is given the intent whose prompt embedding is nearest its audio embedding; top-1 accuracy, against the
same model at initialisation (same seed) in the summary.
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from contrastkit.adapters.hf_clip import CLIP_LOSSES, ClipObjective
from contrastkit.cli import arg, check_device, default_device, existing, positive
from contrastkit.training import RunOptions, guarded

CAPTIONS = ("mix", "transcript", "intent")
SPECIALS = ("[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]")  # [PAD] = 1: the CLAP text model's pad_token_id
SAMPLE_RATE = 16_000


@dataclass
class ClapTrainConfig(RunOptions):
    # What a checkpoint fixes: --resume refuses a change to one of these (training.Checkpoints).
    FIXED = ("loss", "loss_options", "directions", "data", "caption", "width", "batch_size", "max_seconds", "speed",
             "weight_decay", "seed")

    loss: str = arg("dcl", "the objective", choices=CLIP_LOSSES)
    loss_options: dict = arg(help="a loss option, e.g. sigma=0.5 (dclw), alpha=256 (eqco), temperature=0.1 (a "
                                  "fixed one instead of the model's learnable scale)",
                             factory=dict, aliases=["--loss-option"])
    directions: str = arg("both", "anchors of the loss: audio clips and texts (as CLIP and LAION-CLAP train), or "
                                  "'model': texts in both halves, as Hugging Face's ClapModel loss",
                          choices=("both", "model"))
    data: str | None = arg(None, "Fluent Speech Commands root (data/*_data.csv, wavs/); default: the embedded "
                                 "spoken commands")
    data_dir: str | None = arg(None, "where the embedded data is generated (default ~/.cache/contrastkit)")
    caption: str = arg("mix", "each clip's text: its transcript, its intent description, or either at random",
                       choices=CAPTIONS)
    out_dir: str | None = arg(None, "output folder (default runs/clap-<loss>)")
    width: int = arg(64, "hidden size of the audio encoder's last stage and of the text encoder")
    batch_size: int = arg(12, "global batch: clips of different intents (at most the number of intents)")
    max_seconds: float = arg(2.0, "longest audio crop, in seconds (shorter clips are repeated to it)")
    speed: float = arg(0.0, "speed perturbation in training: each clip played at a random rate in [1 - s, 1 + s]")
    weight_decay: float = arg(0.1, "AdamW weight decay")

    def __post_init__(self):
        if self.out_dir is None:
            self.out_dir = f"runs/clap-{self.loss}"

    def check(self) -> None:
        """Raise ValueError / FileNotFoundError for a value that cannot work, before any training."""
        positive("max_seconds", self.max_seconds)
        positive("weight_decay", self.weight_decay, zero=True)
        if not 0 <= self.speed < 1:
            raise ValueError(f"--speed must be in [0, 1), got {self.speed}")
        if self.batch_size < 2:
            raise ValueError(f"--batch-size must be >= 2 (a pair needs negatives), got {self.batch_size}")
        if self.width < 8 or self.width % 8:
            raise ValueError(f"--width must be a multiple of 8 (>= 8), got {self.width}")
        existing("data", self.data, "Fluent Speech Commands root")
        self.check_run()
        ClipObjective(self.loss, directions=self.directions, **self.loss_options)  # an unknown loss or option


# ----------------------------------------------------------------------------- texts


def intent_prompt(row: dict) -> str:
    """The intent of an FSC row written from its labels: "activate lights", "decrease heat in the washroom"."""
    text = f"{row['action']} {row['object']}"
    return (text if row["location"] == "none" else f"{text} in the {row['location']}").lower()


def words(text: str) -> list[str]:
    """The words a BERT tokenizer splits ``text`` into (lower-cased, punctuation apart)."""
    return re.findall(r"\w+|[^\w\s]", text.lower())


def word_tokenizer(root: str | Path, texts: list[str], specials: tuple[str, ...] = SPECIALS):
    """A BERT word-piece tokenizer whose vocabulary is the texts' words, written to root/vocab.txt (a tiny
    model's own vocabulary, built locally). transformers 5 names the vocabulary argument ``vocab``
    (4.x: ``vocab_file``; 5.x takes an unknown ``vocab_file`` silently and tokenizes every word as [UNK])."""
    import transformers as T

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    vocabulary = sorted({w for t in texts for w in words(t)})
    (root / "vocab.txt").write_text("\n".join([*specials, *vocabulary]) + "\n")
    name = "vocab" if int(T.__version__.split(".")[0]) >= 5 else "vocab_file"
    tokenizer = T.BertTokenizerFast(**{name: str(root / "vocab.txt")})
    if len(tokenizer) != len(specials) + len(vocabulary):
        raise RuntimeError("the tokenizer did not read its vocabulary file")
    return tokenizer


# ----------------------------------------------------------------------------- model


def clap_config(vocab_size: int, width: int = 64):
    """A small ClapConfig: HTSAT on a 32-bin log-mel of at most 128 frames (``feature_extractor``), folded
    into a 64 x 64 image (4 x 4 patches, two Swin stages of window 4), and a one-layer text encoder, both
    ``width`` wide, 32-d joint space, no dropout."""
    from transformers import ClapConfig

    audio = dict(spec_size=64, num_mel_bins=32, window_size=4, patch_size=4, patch_stride=(4, 4), hidden_size=width,
                 patch_embeds_hidden_size=width // 2, depths=[1, 1], num_attention_heads=[2, 4], enable_fusion=False,
                 projection_dim=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    text = dict(vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=64, pad_token_id=1, projection_dim=32,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ClapConfig(text_config=text, audio_config=audio, projection_dim=32)


def feature_extractor(max_seconds: float = 2.0):
    """CLAP's own log-mel front end at 16 kHz, sized for ``clap_config``: 32 mel bins, a hop that gives at
    most 128 frames (the audio encoder's 64 x 2 time steps) for ``max_seconds``."""
    from transformers import ClapFeatureExtractor

    hop = 2 ** math.ceil(math.log2(max_seconds * SAMPLE_RATE / 127))
    return ClapFeatureExtractor(feature_size=32, sampling_rate=SAMPLE_RATE, hop_length=hop, fft_window_size=4 * hop,
                                max_length_s=max_seconds, frequency_min=50, frequency_max=8000, padding="repeatpad",
                                truncation="rand_trunc")


def crop(wave: torch.Tensor, length: int, generator: np.random.Generator | None) -> np.ndarray:
    """At most ``length`` samples of ``wave``: a random window (``generator``) or the centre one (None)."""
    if wave.shape[0] <= length:
        return wave.numpy()
    extra = wave.shape[0] - length
    start = int(generator.integers(0, extra + 1)) if generator is not None else extra // 2
    return wave[start:start + length].numpy()


def perturb_speed(wave: torch.Tensor, factor: float) -> torch.Tensor:
    """``wave`` played ``factor`` times faster (tempo and pitch together, linear interpolation): speech
    recipes' speed perturbation, which makes new voices from a few."""
    length = max(2, round(wave.shape[0] / factor))
    return torch.from_numpy(np.interp(np.linspace(0, wave.shape[0] - 1, length), np.arange(wave.shape[0]),
                                      wave.numpy()).astype(np.float32))


def audio_features(rows: list[dict], features, generator: np.random.Generator | None = None, speed: float = 0.0,
                   cache: dict | None = None) -> torch.Tensor:
    """input_features [N, 1, T, mels] of the rows' clips. With a ``generator`` (training): each clip's speed
    perturbed by a factor in [1 - speed, 1 + speed] and a random crop; without (evaluation): the centre crop.
    Cropped here, so that the feature extractor's own unseeded random truncation never runs. ``cache``
    (path -> features) keeps the features that no random draw changed (no perturbation, no crop needed):
    the extractor's STFT costs more than the tiny model's step."""
    from contrastkit.data.speech import load_audio

    length = int(features.nb_max_samples)
    perturb = generator is not None and speed > 0
    out = []
    for r in rows:
        if cache is not None and r["path"] in cache:
            out.append(cache[r["path"]])
            continue
        wave = load_audio(r["path"])
        if perturb:
            wave = perturb_speed(wave, float(generator.uniform(1 - speed, 1 + speed)))
        fixed = not perturb and (generator is None or wave.shape[0] <= length)
        x = features([crop(wave, length, generator)], sampling_rate=SAMPLE_RATE, max_length=length,
                     return_tensors="pt").input_features[0]
        if cache is not None and fixed:
            cache[r["path"]] = x
        out.append(x)
    return torch.stack(out)


# ----------------------------------------------------------------------------- data


def fsc_splits(data: str | None, data_dir: str | None = None) -> tuple[Path, list[dict], list[dict]]:
    """(FSC root, train rows, test rows): the user's root ``data`` or the embedded spoken commands."""
    from contrastkit.data.speech import default_speech_data, read_fsc

    root = Path(data) if data else default_speech_data(data_dir) / "fsc"
    train, test = read_fsc(root, "train"), read_fsc(root, "test")
    unseen = sorted({r["intent"] for r in test} - {r["intent"] for r in train})
    if unseen:
        raise ValueError(f"{root}: the test split has intents the train split lacks: {unseen[:3]}")
    return root, train, test


def step_batch(by_intent: dict[str, list[dict]], batch_size: int, caption: str, seed: int, step: int):
    """The global batch of ``step``: ``batch_size`` different intents, a random clip of each, its caption
    and a generator for the crops, all from (seed, step)."""
    rng = np.random.default_rng([seed, step])
    intents = sorted(by_intent)
    chosen = rng.permutation(len(intents))[:batch_size]
    rows = [by_intent[intents[i]][int(rng.integers(len(by_intent[intents[i]])))] for i in chosen]
    texts = [r["transcription"] if caption == "transcript" or (caption == "mix" and rng.random() < 0.5)
             else intent_prompt(r) for r in rows]
    return rows, texts, rng


# ----------------------------------------------------------------------------- evaluation


def intent_prompts(rows: list[dict]) -> dict[str, str]:
    """One prompt per intent of ``rows``: intent -> ``intent_prompt``."""
    return {r["intent"]: intent_prompt(r) for r in rows}


@dataclass
class ZeroShotIntentArgs:
    """The command line of eval/zeroshot_intent.py."""

    model: str = arg(help="a model folder: the CLAP recipe's OUT/model (or OUT), ClapModel.from_pretrained with "
                          "its tokenizer and feature extractor")
    data: str | None = arg(None, "Fluent Speech Commands root (default: the embedded spoken commands)")
    data_dir: str | None = arg(None, "where the embedded data is generated (default ~/.cache/contrastkit)")
    out: str | None = arg(None, "output JSON (default <model>/zeroshot_intent.json)")
    device: str = arg(default_device(), "device")
    batch_size: int = arg(64, "clips per forward pass")

    def __post_init__(self):
        if (Path(self.model) / "model" / "config.json").is_file():  # the run's folder
            self.model = str(Path(self.model) / "model")

    def check(self) -> None:
        positive("batch_size", self.batch_size)
        existing("model", self.model, "model folder")
        existing("data", self.data, "Fluent Speech Commands root")
        if not (Path(self.model) / "config.json").is_file():
            raise FileNotFoundError(f"--model {self.model}: no config.json (give the recipe's OUT/model folder)")
        check_device(self.device)


def evaluate_saved(args: ZeroShotIntentArgs) -> dict:
    """Zero-shot intent accuracy of a saved model on the FSC test split, with the train split's intents as the
    classes (as the recipe evaluates); written to ``args.out``."""
    import json

    from transformers import AutoTokenizer, ClapFeatureExtractor, ClapModel

    try:
        model = ClapModel.from_pretrained(args.model)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model {args.model}: not a saved ClapModel ({str(err).splitlines()[0]})") from None
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    features = ClapFeatureExtractor.from_pretrained(args.model)
    root, train_rows, test_rows = fsc_splits(args.data, args.data_dir)
    result = zeroshot_intent(model.to(args.device), tokenizer, features, test_rows, intent_prompts(train_rows),
                             batch_size=args.batch_size)
    result.update(model=args.model, data=str(root))
    out = Path(args.out or Path(args.model) / "zeroshot_intent.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result



@torch.no_grad()
def zeroshot_intent(model, tokenizer, features, rows: list[dict], prompts: dict[str, str], *, batch_size: int = 64,
                    device=None, cache: dict | None = None) -> dict:
    """Zero-shot intent classification: each clip gets the intent whose prompt (``prompts``: intent ->
    text, one per intent) embeds nearest its audio (cosine). Top-1 accuracy, top-5 and mean per-class recall
    (evaluation.zeroshot.zeroshot_metrics), the chance level, and the counts."""
    from contrastkit.evaluation.zeroshot import zeroshot_metrics

    device = torch.device(device) if device is not None else next(model.parameters()).device
    intents = sorted(prompts)
    was_training = model.training
    model.eval()
    try:
        text = tokenizer([prompts[i] for i in intents], padding=True, return_token_type_ids=False,
                         return_tensors="pt").to(device)
        classes = torch.nn.functional.normalize(_pooled(model.get_text_features(**text)), dim=-1)
        logits = []
        for start in range(0, len(rows), batch_size):
            audio = audio_features(rows[start:start + batch_size], features, cache=cache).to(device)
            embeds = _pooled(model.get_audio_features(input_features=audio))
            logits.append(torch.nn.functional.normalize(embeds, dim=-1) @ classes.T)
    finally:
        model.train(was_training)
    targets = torch.tensor([intents.index(r["intent"]) for r in rows])
    metrics = zeroshot_metrics(torch.cat(logits).float().cpu(), targets, len(intents))
    return {**metrics, "accuracy": metrics["top1"], "num_clips": len(rows), "num_intents": len(intents),
            "chance": 1.0 / len(intents)}


def _pooled(output):
    """get_*_features returns the projected tensor (transformers 4.x) or an output whose pooler is it (5.x)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


# ----------------------------------------------------------------------------- training


@guarded
def train(cfg: ClapTrainConfig) -> dict:
    """Train, evaluate zero-shot intent (trained and at initialisation), write metrics/plot/summary and the
    final model (``out_dir/model``: ClapModel.from_pretrained, with its tokenizer and feature extractor)."""
    from accelerate.utils import set_seed
    from tqdm import tqdm
    from transformers import ClapModel

    from contrastkit.adapters import hf_clip
    from contrastkit.losses.base import NonFiniteError
    from contrastkit.training import (Checkpoints, Divergence, MetricsLog, StepBoundary, TrainState, grad_norm,
                                      lr_schedule, make_accelerator, start_trackers)

    cfg.check()
    out_dir = Path(cfg.out_dir)
    accelerator = make_accelerator(out_dir, cfg)
    rank, world, main, device = (accelerator.process_index, accelerator.num_processes, accelerator.is_main_process,
                                 accelerator.device)
    with accelerator.main_process_first():
        root, train_rows, test_rows = fsc_splits(cfg.data, cfg.data_dir)
    by_intent: dict[str, list[dict]] = {}
    for r in train_rows:
        by_intent.setdefault(r["intent"], []).append(r)
    if cfg.batch_size > len(by_intent):
        raise ValueError(f"--batch-size {cfg.batch_size}: a batch holds different intents, and {root} has "
                         f"{len(by_intent)}")
    if cfg.batch_size % world:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes {world}")
    prompts = intent_prompts(train_rows)
    texts = [r["transcription"] for r in train_rows] + list(prompts.values())
    with tempfile.TemporaryDirectory() as vocab:  # saved with the model at the end
        tokenizer = word_tokenizer(vocab, texts)
    features = feature_extractor(cfg.max_seconds)

    set_seed(cfg.seed)
    model = ClapModel(clap_config(len(tokenizer), cfg.width))
    test_cache, train_cache = {}, {}
    untrained = zeroshot_intent(model, tokenizer, features, test_rows, prompts, cache=test_cache) if main else None
    model.to(device)
    hf_clip.patch(model, loss=cfg.loss, gather_with_grad=world > 1, directions=cfg.directions, **cfg.loss_options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = lr_schedule(optimizer, "cosine", cfg.warmup_for(cfg.steps), cfg.steps)
    state = TrainState()
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler, state)  # not prepared: it counts global steps
    checkpoints = Checkpoints(accelerator, out_dir, cfg.keep_checkpoints, asdict(cfg), ClapTrainConfig.FIXED)
    resumed = checkpoints.resume(state, optimizer, scheduler, cfg.resume)
    divergence = Divergence(accelerator, out_dir)
    boundary = StepBoundary(accelerator, cfg, checkpoints, state, cfg.steps, divergence, model)
    log = MetricsLog(out_dir, enabled=main, resume_step=state.step if resumed else None, accelerator=accelerator)
    start_trackers(accelerator, f"clap-{cfg.loss}", asdict(cfg))
    raw = accelerator.unwrap_model(model)

    def evaluate():
        result = (zeroshot_intent(raw, tokenizer, features, test_rows, prompts, device=device, cache=test_cache)
                  if main else None)
        accelerator.wait_for_everyone()
        return result

    local = cfg.batch_size // world
    bar = tqdm(total=cfg.steps, initial=state.step, desc=f"clap {cfg.loss}", disable=not (main and cfg.progress))
    started = time.time()
    model.train()
    while state.step < cfg.steps:
        rows, captions, rng = step_batch(by_intent, cfg.batch_size, cfg.caption, cfg.seed, state.step)
        audio = audio_features(rows, features, rng, cfg.speed, train_cache)[rank * local:(rank + 1) * local]
        text = tokenizer(captions, padding=True, return_token_type_ids=False, return_tensors="pt")
        mine = {k: v[rank * local:(rank + 1) * local].to(device) for k, v in text.items()}
        try:
            loss = model(**mine, input_features=audio.to(device), return_loss=True).loss
        except NonFiniteError as err:  # CPU: the loss core names the input that went non-finite
            raise divergence.from_loss(err, state.step + 1) from err
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        divergence.watch(state.step + 1, loss=loss, logit_scale=raw.logit_scale_a.detach(),
                         gradient_norm=grad_norm(model.parameters()))
        if device.type == "cpu":  # host reads are free there: stop before a bad update
            divergence.check(state.step + 1)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():  # as CLAP and CLIP train: the scale at most 100
            raw.logit_scale_a.clamp_(0, math.log(100))
            raw.logit_scale_t.clamp_(0, math.log(100))
        state.step += 1
        bar.update(1)
        if state.step % cfg.log_every == 0 or state.step == cfg.steps:
            divergence.check(state.step)
            global_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
            log.log(state.step, loss=global_loss, logit_scale=raw.logit_scale_a.exp().item(),
                    lr=scheduler.get_last_lr()[0])
            bar.set_postfix(loss=f"{global_loss:.3f}")
        if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < cfg.steps:
            result = evaluate()
            if result:
                log.log(state.step, zeroshot_intent=result["accuracy"])
                bar.write(f"step {state.step}: zero-shot intent accuracy {result['accuracy']:.3f}")
        if cfg.save_every and state.step % cfg.save_every == 0:
            divergence.check(state.step, model)
            checkpoints.save(state.step)
        boundary()  # a stop signal: a checkpoint of this step, then exit status 75
    bar.close()
    last = evaluate()
    summary = {"loss_name": cfg.loss, "steps": state.step, "batch_size": cfg.batch_size, "processes": world,
               "data": str(root), "train_clips": len(train_rows), "intents": len(prompts), "prompts": prompts,
               "train_seconds": round(time.time() - started, 1), "config": asdict(cfg), "resumes": state.resumes}
    if main:
        log.log(state.step, zeroshot_intent=last["accuracy"])
        records = [r for r in log.records() if "loss" in r]
        summary.update(final_loss=records[-1]["loss"] if records else None,
                       zeroshot_intent=last, zeroshot_intent_untrained=untrained)
        log.plot(["loss", "zeroshot_intent", "logit_scale"], title=f"CLAP on spoken commands, loss {cfg.loss}")
        log.summary(summary)
        hf_clip.unpatch(raw)
        raw.save_pretrained(out_dir / "model")
        tokenizer.save_pretrained(out_dir / "model")
        features.save_pretrained(out_dir / "model")
    accelerator.end_training()
    return summary
