"""What a vision run must beat: kNN and a linear probe on raw pixels and on a random-init backbone.

A trained backbone is worth something only if its frozen features classify better than the pixels
themselves and better than the same architecture untrained (a random conv net is already a decent
feature extractor). ``frozen_scores`` gives kNN top-1 and L-BFGS probe top-1 of any backbone;
``baselines`` gives both for raw pixels and for the run's backbone at initialisation (same seed).

>>> scores = frozen_scores(load_backbone("runs/vision")[0], cfg)     # {"knn_top1": ..., "probe_top1": ...}
>>> base = baselines(cfg)                                            # {"pixels": {...}, "random_init": {...}}
"""

from __future__ import annotations

import torch
from torch import nn

from contrastkit.evaluation.knn import knn_accuracy
from contrastkit.evaluation.linear_probe import logistic_regression_lbfgs
from contrastkit.vision.models import build_backbone


def scores_of_features(train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor],
                       num_classes: int, knn_k: int = 200, knn_temperature: float = 0.1) -> dict:
    """kNN top-1 (weighted, cosine) and L-BFGS logistic-regression probe top-1 on frozen features."""
    knn = knn_accuracy(*train, *test, k=knn_k, temperature=knn_temperature, num_classes=num_classes)
    probe = logistic_regression_lbfgs(*train, *test, num_classes=num_classes)["test_top1"]
    return {"knn_top1": knn, "probe_top1": probe}


def frozen_scores(backbone: nn.Module, cfg, progress: bool = False) -> dict:
    """kNN and probe top-1 of ``backbone`` (frozen, eval mode) on the train / test splits of ``cfg``'s data."""
    from contrastkit.vision.train import frozen_features

    train, test, classes = frozen_features(backbone, cfg, progress=progress)
    return scores_of_features(train, test, len(classes), cfg.knn_k, cfg.knn_temperature)


def initial_backbone(cfg) -> nn.Module:
    """The backbone of ``cfg`` at its initialisation under ``cfg.seed``, in eval mode (batch norm with its
    initial running statistics): the weights a run of ``cfg`` starts from (``--steps 0`` saves the same)."""
    torch.manual_seed(cfg.seed)
    return build_backbone(cfg.backbone, cfg.small_images, cfg.width)[0].eval()


def baselines(cfg, progress: bool = False) -> dict:
    """Scores of raw pixels (the normalised image, flattened) and of ``initial_backbone(cfg)``."""
    return {"pixels": frozen_scores(nn.Flatten(), cfg, progress),
            "random_init": frozen_scores(initial_backbone(cfg), cfg, progress)}
