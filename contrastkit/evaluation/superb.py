"""SUPERB-style downstream evaluation of a frozen wav2vec 2.0 upstream: speaker identification
(VoxCeleb1) and intent classification (Fluent Speech Commands).

The protocol of the DCL paper's speech results (appendix, Table 7) and SUPERB (Yang et al., 2021): the
upstream is frozen; the downstream is a learnable softmax-weighted sum of all hidden layers, a linear
projection, mean pooling over frames and a linear classifier (for intent, one per slot: action,
object, location; an utterance is right only when all three are), trained with Adam on the train split;
the epoch with the best dev accuracy is the one tested.

Upstreams load from: a recipe run folder (``<run>/upstream``), a Hugging Face wav2vec 2.0 folder
(``save_pretrained``; pre-training or plain models, Conformer too), or a fairseq2 export as
``contrastkit.speech.pretrain.export_upstream`` writes it (``fairseq2_wav2vec2.safetensors`` and its config,
``fairseq2_wav2vec2.json``; older versions' ``fairseq2_wav2vec2.pt`` loads with ``weights_only=True``).
Nothing is unpickled beyond tensors and plain values: a file built to run code is refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from contrastkit.cli import (arg, check_device, default_device, existing, held_back, one_line_errors, parse,
                             positive)
from contrastkit.data import speech as data


# ----------------------------------------------------------------------------- upstream


def _hf_encoder(path: Path):
    """The encoder of a Hugging Face upstream (AutoModel: Wav2Vec2Model of the recipe's Wav2Vec2ForPreTraining).
    Leaving the checkpoint's heads out is the point, so transformers' load report, which lists them, is shown
    only where it says more: encoder weights missing from the checkpoint, or of another shape."""
    from transformers import AutoModel

    logger = logging.getLogger("transformers.modeling_utils")
    with held_back(logger, lambda message: "LOAD REPORT" in message) as reports:
        model, info = AutoModel.from_pretrained(str(path), output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        for record in reports:
            logger.handle(record)
    return model


class Upstream:
    """A frozen upstream on ``device`` (default: cuda when visible): ``hidden_states(wave [T]) -> [L + 1, frames,
    dim]`` (input of layer 1 .. output of L). cache=True keeps each file's per-layer frame means, so two tasks
    on one upstream (the embedded default's two layouts hard-link the same files) compute them once."""

    def __init__(self, path: str | Path, device: str | torch.device | None = None, cache: bool = False):
        path = Path(path)
        self.device = torch.device(device or default_device())
        # (st_dev, st_ino) of a file -> its [L + 1, dim] frame means; None: no cache
        self.pooled: dict[tuple[int, int], torch.Tensor] | None = {} if cache else None
        if (path / "upstream").is_dir():
            path = path / "upstream"
        if not path.exists():
            raise FileNotFoundError(f"upstream {path} not found")
        self.path = path
        f2 = path if path.is_file() else next((path / f"{FAIRSEQ2_EXPORT}{ext}" for ext in (".json", ".pt")
                                               if (path / f"{FAIRSEQ2_EXPORT}{ext}").is_file()), None)
        if f2 is not None:
            try:
                self.backend, self.model = "fairseq2", _load_fairseq2(f2)
            except ImportError as err:
                raise ValueError(f"{f2}: a fairseq2 export, and loading it needs fairseq2 ({err}): run it in the "
                                 "environment with fairseq2 0.8.1") from None
        elif (path / "config.json").is_file():
            self.backend, self.model = "hf", _hf_encoder(path)
        else:
            raise ValueError(f"{path}: neither a Hugging Face model folder (config.json) nor a fairseq2 export "
                             "(fairseq2_wav2vec2.pt) nor a recipe run folder (upstream/)")
        self.model.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def hidden_states(self, wave: torch.Tensor) -> torch.Tensor:
        wave = wave.to(self.device)
        x = ((wave - wave.mean()) / (wave.std() + 1e-7))[None]
        if self.backend == "hf":
            return torch.stack(self.model(x, output_hidden_states=True).hidden_states)[:, 0]
        from fairseq2.nn import BatchLayout

        layout = BatchLayout.of(x)
        seqs, layout = self.model.encoder_frontend(x, layout)
        layers = [seqs]
        handle = self.model.encoder.register_layer_hook(lambda i, out, lay, n: layers.append(out) or True)
        try:
            self.model.encoder(seqs, layout)
        finally:
            handle.remove()
        return torch.stack(layers)[:, 0]


FAIRSEQ2_EXPORT = "fairseq2_wav2vec2"


def _load_fairseq2(path: Path):
    """A fairseq2 export: ``<name>.json`` (or ``.safetensors``) and its twin, or an older version's ``.pt``."""
    if path.suffix in (".json", ".safetensors"):
        from safetensors.torch import load_file

        config_file, weights = path.with_suffix(".json"), path.with_suffix(".safetensors")
        try:
            config, state = json.loads(config_file.read_text()), load_file(str(weights))
        except Exception as err:  # missing twin, not JSON, not safetensors
            raise ValueError(f"{path}: not a fairseq2 export ({config_file.name} and {weights.name}): "
                             f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
        from fairseq2.models.transformer import TransformerNormOrder

        config["encoder_config"]["norm_order"] = TransformerNormOrder[config["encoder_config"]["norm_order"]]
        saved = {"config": config, "state_dict": state}
    else:
        saved = _load_old_fairseq2(path)
    from fairseq2.models.wav2vec2 import Wav2Vec2Config, Wav2Vec2EncoderConfig, create_wav2vec2_model

    from contrastkit.adapters.fairseq2_wav2vec2 import eager_quantizer

    if not isinstance(saved, dict) or {"config", "state_dict"} - set(saved):
        raise ValueError(f"{path}: expected a dict with 'config' and 'state_dict' (contrastkit's fairseq2 export)")
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["config"].items()}
    encoder = dict(config["encoder_config"])
    encoder["feature_extractor_layer_descs"] = [tuple(d) for d in encoder["feature_extractor_layer_descs"]]
    config["encoder_config"] = Wav2Vec2EncoderConfig(**encoder)
    model = create_wav2vec2_model(Wav2Vec2Config(**config))
    model.load_state_dict(saved["state_dict"])
    if not torch.cuda.is_available():
        eager_quantizer(model)
    return model


def _load_old_fairseq2(path: Path) -> dict:
    """An older contrastkit's ``fairseq2_wav2vec2.pt``: tensors, plain values and fairseq2's norm-order enum;
    ``weights_only=True`` refuses anything else (a file built to run code when unpickled)."""
    import pickle

    from contrastkit.evaluation.zeroshot import refused_pickle

    try:
        from fairseq2.models.transformer import TransformerNormOrder
    except ImportError:  # then the file is refused for the enum, or for whatever else it holds
        TransformerNormOrder = None
    try:
        with torch.serialization.safe_globals([TransformerNormOrder] if TransformerNormOrder else []):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise ValueError(f"{path}: {refused_pickle(err)}") from None


# ----------------------------------------------------------------------------- downstream


class Downstream(nn.Module):
    """Softmax-weighted sum of layers -> linear -> mean pooling -> one linear classifier per task.

    The weighted sum and the projection are affine, so they commute with the mean over frames: the model
    takes each utterance's per-layer frame means [B, L, D] and computes exactly what it would on the frames,
    while the features kept in memory do not grow with the frames."""

    def __init__(self, num_layers: int, dim: int, classes: dict[str, int], proj: int = 128):
        super().__init__()
        self.layer_logits = nn.Parameter(torch.zeros(num_layers))
        self.proj = nn.Linear(dim, proj)
        self.heads = nn.ModuleDict({k: nn.Linear(proj, n) for k, n in classes.items()})

    def forward(self, pooled: torch.Tensor) -> dict[str, torch.Tensor]:
        # pooled [B, L, D]: each layer's mean over the utterance's frames
        x = self.proj(torch.einsum("l,bld->bd", torch.softmax(self.layer_logits, 0), pooled))
        return {k: head(x) for k, head in self.heads.items()}


@dataclasses.dataclass
class DownstreamConfig:
    epochs: int = 150
    batch_size: int = 32
    lr: float = 1e-3
    proj: int = 128
    seed: int = 0


def _features(upstream: Upstream, records: list[dict], desc: str) -> tuple[torch.Tensor, list[dict]]:
    """Per utterance, each layer's mean over its frames: [utterances, L + 1, D] (float32, CPU)."""
    from tqdm import tqdm

    def key(record):
        try:
            stat = Path(record["path"]).stat()
        except OSError:
            return None  # load_waveforms reports it
        return stat.st_dev, stat.st_ino

    cache = {} if upstream.pooled is None else upstream.pooled
    todo = [r for r in records if key(r) not in cache]
    if todo:
        waves, kept = data.load_waveforms(todo)
        for r, w in zip(kept, tqdm(waves, desc=desc, leave=False)):
            cache[key(r)] = upstream.hidden_states(w).float().mean(1).cpu()
    kept = [r for r in records if key(r) in cache]
    return torch.stack([cache[key(r)] for r in kept]), kept


def _labels(records: list[dict], tasks: list[str], vocab: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Class indices per task; a label the train split never had is -1 (never predicted right)."""
    index = {t: {v: i for i, v in enumerate(vocab[t])} for t in tasks}
    return {t: torch.tensor([index[t].get(r[t], -1) for r in records]) for t in tasks}


def _accuracy(model: Downstream, feats, labels, batch_size: int) -> float:
    model.eval()
    right = torch.ones(len(feats), dtype=torch.bool)
    with torch.no_grad():
        for s in range(0, len(feats), batch_size):
            logits = model(feats[s:s + batch_size])
            for t, y in labels.items():
                right[s:s + batch_size] &= logits[t].argmax(-1) == y[s:s + batch_size]
    return float(right.float().mean())


def run_downstream(upstream: Upstream, splits: dict[str, list[dict]], tasks: list[str], cfg: DownstreamConfig,
                   name: str) -> dict:
    """Train on splits["train"], pick the epoch by splits["dev"] accuracy, report splits["test"] accuracy."""
    feats = {s: _features(upstream, recs, f"{name}: upstream features ({s})") for s, recs in splits.items()}
    vocab = {t: sorted({r[t] for r in feats["train"][1]}) for t in tasks}
    if any(len(v) < 2 for v in vocab.values()):
        raise ValueError(f"{name}: the train split needs at least 2 classes per task, got "
                         f"{ {t: len(v) for t, v in vocab.items()} }")
    tensors = {s: (f, _labels(recs, tasks, vocab)) for s, (f, recs) in feats.items()}
    _, num_layers, dim = feats["train"][0].shape
    torch.manual_seed(cfg.seed)
    model = Downstream(num_layers, dim, {t: len(v) for t, v in vocab.items()}, cfg.proj)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    x, y = tensors["train"]
    rng = np.random.default_rng(cfg.seed)
    history, best = [], (-1.0, None)
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        order = torch.from_numpy(rng.permutation(len(x)))
        for s in range(0, len(order), cfg.batch_size):
            idx = order[s:s + cfg.batch_size]
            logits = model(x[idx])
            loss = sum(F.cross_entropy(logits[t], y[t][idx]) for t in tasks)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        dev = _accuracy(model, *tensors["dev"], cfg.batch_size)
        history.append({"epoch": epoch, "train_loss": float(loss.detach()), "dev_accuracy": dev})
        if dev > best[0]:
            best = (dev, {k: v.clone() for k, v in model.state_dict().items()}, epoch)
    model.load_state_dict(best[1])
    return {"task": name, "upstream": str(upstream.path), "backend": upstream.backend,
            "test_accuracy": _accuracy(model, *tensors["test"], cfg.batch_size), "dev_accuracy": best[0],
            "best_epoch": best[2], "classes": {t: len(v) for t, v in vocab.items()},
            "utterances": {s: len(t[0]) for s, t in tensors.items()},
            "layer_weights": torch.softmax(model.layer_logits.detach(), 0).tolist(),
            "config": dataclasses.asdict(cfg), "history": history}


def _upstream(upstream, device) -> Upstream:
    return upstream if isinstance(upstream, Upstream) else Upstream(upstream, device)


def speaker_id(upstream: str | Path | Upstream, data_root: str | Path | None = None,
               cfg: DownstreamConfig | None = None, device: str | None = None) -> dict:
    """VoxCeleb1 speaker identification accuracy (iden_split.txt: 1 train, 2 dev, 3 test)."""
    root = Path(data_root) if data_root else data.default_speech_data() / "voxceleb1"
    splits = {s: data.read_voxceleb_iden(root, s) for s in ("train", "dev", "test")}
    return run_downstream(_upstream(upstream, device), splits, ["speaker"], cfg or DownstreamConfig(), "speaker_id")


def intent(upstream: str | Path | Upstream, data_root: str | Path | None = None, cfg: DownstreamConfig | None = None,
           device: str | None = None) -> dict:
    """Fluent Speech Commands intent accuracy (right only when action, object and location all are)."""
    root = Path(data_root) if data_root else data.default_speech_data() / "fsc"
    splits = {"train": data.read_fsc(root, "train"), "dev": data.read_fsc(root, "valid"),
              "test": data.read_fsc(root, "test")}
    return run_downstream(_upstream(upstream, device), splits, ["action", "object", "location"],
                          cfg or DownstreamConfig(), "intent")


def write_report(result: dict, out_dir: str | Path) -> Path:
    """``<task>.json`` and ``<task>.png`` (dev accuracy by epoch, learned layer weights) in out_dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result['task']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot([h["epoch"] for h in result["history"]], [h["dev_accuracy"] for h in result["history"]])
    a.set_xlabel("epoch")
    a.set_title(f"{result['task']}: dev accuracy (test {result['test_accuracy']:.3f})")
    a.grid(alpha=0.3)
    b.bar(range(len(result["layer_weights"])), result["layer_weights"])
    b.set_xlabel("layer (0 = CNN features)")
    b.set_title("learned layer weights")
    fig.tight_layout()
    fig.savefig(out_dir / f"{result['task']}.png", dpi=120)
    plt.close(fig)
    return path


@dataclasses.dataclass
class SuperbArgs:
    """The command line of eval/speaker_id.py and eval/intent.py."""

    upstream: str = arg(help="recipe run folder, HF model folder or fairseq2 export")
    data: str | None = arg(None, "dataset root (default: the embedded spoken commands)")
    out: str | None = arg(None, "report folder (default: <upstream>/eval)")
    epochs: int = arg(DownstreamConfig.epochs, "downstream training epochs")
    batch_size: int = arg(DownstreamConfig.batch_size, "downstream batch size")
    lr: float = arg(DownstreamConfig.lr, "downstream learning rate (Adam)")
    seed: int = arg(0, "random seed")
    device: str = arg(default_device(), "where the upstream runs (cpu, cuda, cuda:1)")

    def check(self) -> None:
        for name in ("epochs", "batch_size", "lr"):
            positive(name, getattr(self, name))
        existing("upstream", self.upstream, "upstream")
        existing("data", self.data, "dataset root")
        check_device(self.device)


def main(task: str, description: str, argv: list[str] | None = None) -> dict:
    """The command line of eval/speaker_id.py and eval/intent.py: one frozen upstream, one task."""
    a = parse(SuperbArgs, description=description, argv=argv)
    run = {"speaker_id": speaker_id, "intent": intent}[task]
    with one_line_errors(ValueError, FileNotFoundError, ImportError):  # an upstream that is not one
        upstream = Upstream(a.upstream, a.device)
    result = run(upstream, a.data, DownstreamConfig(epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, seed=a.seed))
    path = write_report(result, a.out or f"{a.upstream.rstrip('/')}/eval")
    print(f"{task} test accuracy {result['test_accuracy']:.4f} (dev {result['dev_accuracy']:.4f}, "
          f"epoch {result['best_epoch']}) -> {path}")
    return result
