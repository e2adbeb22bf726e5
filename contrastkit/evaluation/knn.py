"""Weighted kNN classification on frozen features (InstDisc / DCL's kNN monitor).

Each test feature votes with its k nearest training features by cosine similarity, a neighbour of
class c adding exp(s / T) to class c; the class with the largest vote wins. Defaults k 200, T 0.1.

>>> feats, labels = extract_features(backbone, train_images)
>>> acc = knn_accuracy(feats, labels, test_feats, test_labels, k=200, temperature=0.1)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from contrastkit.cli import arg, check_device, default_device, existing, positive


@dataclass
class FrozenRunArgs:
    """What eval/knn.py and eval/linear_probe.py share: a vision recipe run and the data to judge it on."""

    run: str = arg(help="output folder of recipes/vision/train.py")
    checkpoint: str | None = arg(None, "a checkpoints/checkpoint_<step> folder (default: the final backbone)")
    data: str | None = arg(None, "ImageFolder root or saved HF DatasetDict (default: the run's)")
    image_size: int | None = arg(None, "image side (default: the run's)")
    device: str = arg(default_device(), "where the backbone runs (cpu, cuda, cuda:1)")
    out: str | None = arg(None, "report path (default: inside --run)")
    progress: bool = arg(True, "show progress bars")

    def check(self) -> None:
        existing("run", self.run, "run folder")
        if not (Path(self.run) / "config.json").is_file():
            raise FileNotFoundError(f"--run {self.run!r} is not a vision recipe run (no config.json)")
        existing("checkpoint", self.checkpoint, "checkpoint")
        existing("data", self.data, "image data")
        positive("image_size", self.image_size)
        check_device(self.device)


@dataclass
class KnnArgs(FrozenRunArgs):
    """The command line of eval/knn.py."""

    k: int = arg(200, "neighbours that vote")
    temperature: float = arg(0.1, "vote temperature: a neighbour adds exp(s / T)")

    def check(self) -> None:
        positive("k", self.k)
        positive("temperature", self.temperature)
        super().check()


@torch.no_grad()
def extract_features(encoder: nn.Module, images: Dataset, transform=None, batch_size: int = 256,
                     progress: bool = False, desc: str = "features") -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, D] float32, labels [N]) of ``encoder`` in eval mode (its mode is restored after)."""
    was_training = encoder.training
    encoder.eval()
    device = next(encoder.parameters(), torch.empty(0)).device  # a parameter-free encoder (raw pixels): CPU
    feats, labels = [], []
    try:
        for x, y in tqdm(DataLoader(images, batch_size=batch_size), desc=desc, disable=not progress, leave=False):
            x = transform(x) if transform is not None else x
            feats.append(encoder(x.to(device)).float().flatten(1).cpu())
            labels.append(torch.as_tensor(y))
    finally:
        encoder.train(was_training)
    return torch.cat(feats), torch.cat(labels)


@torch.no_grad()
def knn_predict(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor, *, k: int = 200,
                temperature: float = 0.1, num_classes: int | None = None, chunk: int = 1024) -> torch.Tensor:
    """Predicted class of each test feature [M]; k is capped at the number of training features."""
    if train_feats.dim() != 2 or test_feats.dim() != 2 or train_feats.shape[1] != test_feats.shape[1]:
        raise ValueError(f"knn: features must be [N, D] and [M, D], got {tuple(train_feats.shape)} and "
                         f"{tuple(test_feats.shape)}")
    if train_labels.shape != (train_feats.shape[0],):
        raise ValueError(f"knn: {train_feats.shape[0]} training features but labels of shape "
                         f"{tuple(train_labels.shape)}")
    if k < 1 or temperature <= 0:
        raise ValueError(f"knn: need k >= 1 and temperature > 0, got k={k}, temperature={temperature}")
    num_classes = num_classes or int(train_labels.max()) + 1
    k = min(k, train_feats.shape[0])
    bank = F.normalize(train_feats.float(), dim=1)
    labels = train_labels.to(bank.device)  # votes are built on the features' device (CUDA features stay there)
    preds = []
    for part in F.normalize(test_feats.float().to(bank.device), dim=1).split(chunk):
        sims, idx = (part @ bank.T).topk(k, dim=1)
        votes = part.new_zeros(part.shape[0], num_classes).scatter_add_(1, labels[idx], (sims / temperature).exp())
        preds.append(votes.argmax(1))
    return torch.cat(preds)


def knn_accuracy(train_feats, train_labels, test_feats, test_labels, **options) -> float:
    """Top-1 accuracy of ``knn_predict`` on the test features."""
    predicted = knn_predict(train_feats, train_labels, test_feats, **options)
    return (predicted == test_labels.to(predicted.device)).float().mean().item()
