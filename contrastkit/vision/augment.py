"""SimCLR augmentations (DCL paper, appendix A.4) and the multi-view dataset and batches the recipe trains on.

Randomness is a function of (seed, epoch, sample index): each sample's views are drawn from their own
seeded generator, and the batch order from a per-epoch permutation. So a run on P processes sees
exactly the global batches and views of a one-process run, and a resumed run continues the same
sequence (the data position is just the step).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def simclr_augment(size: int, crop_min: float = 0.08, strength: float = 1.0, blur: bool = True, hue: float = 0.2,
                   grayscale: float = 0.2) -> v2.Compose:
    """DCL appendix A.4 (SimCLR's recipe) on uint8 [3, H, W] tensors: RandomResizedCrop with scale
    [crop_min, 1] (paper 0.08), horizontal flip, colour jitter (0.8, 0.8, 0.8, ``hue``) x strength with
    p 0.8 (paper hue 0.2; hue is capped at 0.5, a full turn), grayscale with p ``grayscale`` (paper 0.2),
    Gaussian blur with sigma in [0.1, 2.0] (p 0.5, kernel ~10% of the image side, as SimCLR scales it;
    at 32 px that is 3 px)."""
    s = strength
    steps = [
        v2.RandomResizedCrop(size, scale=(crop_min, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, min(0.5, hue * s))], p=0.8),
        v2.RandomGrayscale(p=grayscale),
    ]
    if blur:
        kernel = max(3, int(0.1 * size) // 2 * 2 + 1)
        steps.append(v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5))
    return v2.Compose([*steps, v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def plain_transform() -> v2.Compose:
    """Evaluation: no augmentation, the same scaling and normalisation as training."""
    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0])


class MultiViewDataset(Dataset):
    """Wraps a labelled image dataset; item ``(epoch, index)`` gives ([V, 3, S, S] views, label, index)."""

    def __init__(self, images: Dataset, transform, views: int = 2, seed: int = 0):
        self.images, self.transform, self.views, self.seed = images, transform, views, seed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, item):
        epoch, index = item
        image, label = self.images[index]
        with torch.random.fork_rng(devices=[]):  # the CPU generator alone: CUDA's stream stays the model's
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            views = torch.stack([self.transform(image) for _ in range(self.views)])
        return views, label, index
