"""Linear classifiers on frozen features: the SSL protocol (SGD, step decay) and CLIP's L-BFGS logistic regression.

Features are standardised with the training set's mean and standard deviation first (a fixed,
parameter-free batch norm, as MAE and others put before the linear head), so one learning rate suits
backbones whose features differ in scale.

>>> result = linear_probe_sgd(train_x, train_y, test_x, test_y, epochs=100)   # {"test_top1", ...}
>>> result = logistic_regression_lbfgs(train_x, train_y, test_x, test_y, weight_decay=1e-3)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import trange

from contrastkit.cli import arg, positive
from contrastkit.evaluation.knn import FrozenRunArgs


@dataclass
class ProbeArgs(FrozenRunArgs):
    """The command line of eval/linear_probe.py."""

    classifier: str = arg("both", "which linear classifier", choices=("sgd", "lbfgs", "both"))
    epochs: int = arg(100, "SGD epochs")
    lr: float = arg(0.1, "SGD learning rate")
    batch_size: int = arg(256, "SGD batch size")
    weight_decay: float = arg(0.0, "SGD weight decay")
    lbfgs_weight_decay: float = arg(1e-4, "L-BFGS weight decay")

    def check(self) -> None:
        for name in ("epochs", "lr", "batch_size"):
            positive(name, getattr(self, name))
        for name in ("weight_decay", "lbfgs_weight_decay"):
            positive(name, getattr(self, name), zero=True)
        super().check()


def _check(train_x, train_y, test_x, test_y):
    if train_x.dim() != 2 or test_x.dim() != 2 or train_x.shape[1] != test_x.shape[1]:
        raise ValueError(f"linear probe: features must be [N, D] and [M, D], got {tuple(train_x.shape)} and "
                         f"{tuple(test_x.shape)}")
    if train_y.shape != (train_x.shape[0],) or test_y.shape != (test_x.shape[0],):
        raise ValueError(f"linear probe: labels {tuple(train_y.shape)} / {tuple(test_y.shape)} do not match "
                         f"features {tuple(train_x.shape)} / {tuple(test_x.shape)}")
    if not (torch.isfinite(train_x).all() and torch.isfinite(test_x).all()):
        raise ValueError("linear probe: features have non-finite values")


def standardize(train_x: torch.Tensor, test_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = train_x.mean(0), train_x.std(0).clamp_min(1e-6)
    return (train_x - mean) / std, (test_x - mean) / std


def _accuracy(weight, bias, x, y) -> float:
    return ((x @ weight.T + bias).argmax(1) == y).float().mean().item()


def linear_probe_sgd(train_x, train_y, test_x, test_y, *, epochs: int = 100, lr: float = 0.1,
                     batch_size: int = 256, momentum: float = 0.9, weight_decay: float = 0.0,
                     milestones: tuple[float, float] = (0.6, 0.8), num_classes: int | None = None, seed: int = 0,
                     progress: bool = False) -> dict:
    """The SSL linear-evaluation protocol (DCL appendix: SGD, momentum 0.9, no weight decay, learning rate
    divided by 10 at 60% and 80% of the epochs), full-precision, on standardised features."""
    _check(train_x, train_y, test_x, test_y)
    train_x, test_x = standardize(train_x.float(), test_x.float())
    num_classes = num_classes or int(max(train_y.max(), test_y.max())) + 1
    generator = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(train_x.shape[1], num_classes)
    with torch.no_grad():
        layer.weight.normal_(0, 0.01, generator=generator)
        layer.bias.zero_()
    optimizer = torch.optim.SGD(layer.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    steps = [int(m * epochs) for m in milestones]
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=steps, gamma=0.1)
    history = []
    for epoch in trange(epochs, desc="linear probe", disable=not progress, leave=False):
        order = torch.randperm(len(train_y), generator=generator)
        total = 0.0
        for idx in order.split(batch_size):
            loss = F.cross_entropy(layer(train_x[idx]), train_y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        schedule.step()
        history.append({"epoch": epoch + 1, "train_loss": total / len(train_y)})
    with torch.no_grad():
        return {"train_top1": _accuracy(layer.weight, layer.bias, train_x, train_y),
                "test_top1": _accuracy(layer.weight, layer.bias, test_x, test_y), "history": history}


def logistic_regression_lbfgs(train_x, train_y, test_x, test_y, *, weight_decay: float = 1e-4, max_iter: int = 1000,
                              num_classes: int | None = None) -> dict:
    """Multinomial logistic regression with an L2 penalty, fitted full-batch by L-BFGS (CLIP's linear probe;
    CLIP sweeps the penalty on a validation split, ``weight_decay`` here is one point of that sweep)."""
    _check(train_x, train_y, test_x, test_y)
    train_x, test_x = standardize(train_x.double(), test_x.double())
    num_classes = num_classes or int(max(train_y.max(), test_y.max())) + 1
    weight = torch.zeros(num_classes, train_x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=max_iter, tolerance_grad=1e-9,
                                  tolerance_change=1e-12, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(train_x @ weight.T + bias, train_y) + 0.5 * weight_decay * (weight * weight).sum()
        loss.backward()
        return loss

    final = optimizer.step(closure)
    with torch.no_grad():
        return {"train_top1": _accuracy(weight, bias, train_x, train_y),
                "test_top1": _accuracy(weight, bias, test_x, test_y), "final_loss": float(final),
                "weight_decay": weight_decay}
