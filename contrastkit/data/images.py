"""Labelled image datasets for the vision recipe and evaluations: the embedded shapes, ImageFolder, HF on disk.

Every dataset here yields ``(image, label)`` with ``image`` a uint8 tensor [3, S, S] (resized so the
shorter side is S, then centre-cropped) and has ``classes``. Augmentation happens later, on these
tensors, so the same datasets serve training (augmented views) and evaluation (plain images).

>>> train = ShapesImages("train", size=32)       # 8 shapes as classes; colour, size, position, texture vary
>>> train = ImageFolderImages("/data/imagenet/train", size=224)
>>> data = load_images("/data/imagenet", "val", size=224)   # picks the format from what is on disk
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from contrastkit.data.shapes import SHAPES, render, sample_spec

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
SPLIT_SEEDS = {"train": 0, "test": 1}


def to_tensor(image: Image.Image, size: int) -> torch.Tensor:
    """RGB uint8 [3, size, size]: shorter side resized to ``size``, then centre-cropped."""
    image = image.convert("RGB")
    w, h = image.size
    scale = size / min(w, h)
    if (w, h) != (size, size):
        image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BICUBIC)
        w, h = image.size
        left, top = (w - size) // 2, (h - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


class ShapesImages(Dataset):
    """The embedded default: one coloured shape per image, the shape is the class (8 classes).

    Colour, size, position, rotation and background are nuisances drawn at random. Shapes are drawn 1.5
    times the captioned data's size and untextured (``shape_scale``, ``textures``): at 32 px the small
    textured shapes were a few pixels wide, and after SimCLR the linear probe fell below raw pixels
    (29.6 vs 34.4 %); with these it rises above them (42.8 vs 38.1 %, docs/evidence.md). ``free_pose``
    draws size, position and rotation continuously (render's ``free_pose``) instead of the captions' two
    sizes, five anchors and +-0.3 rad: with those, pixel kNN matched silhouettes of the same anchor and
    size almost like templates, a floor that real photos do not give. Deterministic: the
    split name and ``seed`` fix every image; train and test use disjoint seeds. Rendered in memory
    (about 0.3 ms per 32 x 32 image), nothing is downloaded or cached on disk.
    """

    def __init__(self, split: str = "train", size: int = 32, num_images: int | None = None, seed: int = 0,
                 shape_scale: float = 1.5, textures: tuple[str, ...] = ("plain",), free_pose: bool = True):
        if split not in SPLIT_SEEDS:
            raise ValueError(f"shapes: unknown split {split!r}; choose 'train' or 'test'")
        self.classes = list(SHAPES)
        count = num_images if num_images is not None else (4000 if split == "train" else 1000)
        if count < 1:
            raise ValueError(f"shapes: num_images must be >= 1, got {count}")
        base = 1_000_003 * (SPLIT_SEEDS[split] + 2 * seed)
        images, labels = [], []
        for i in range(count):
            rng = random.Random(base + i)
            label = i % len(SHAPES)  # balanced classes
            spec = sample_spec(rng, shapes=(SHAPES[label],))
            if spec.texture not in textures:
                spec = dataclasses.replace(spec, texture=textures[i % len(textures)])
            images.append(to_tensor(render(spec, size=size, seed=base + i, scale=shape_scale, free_pose=free_pose), size))
            labels.append(label)
        self.images = torch.stack(images)
        self.labels = torch.tensor(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], int(self.labels[index])


class ImageFolderImages(Dataset):
    """``root/<class>/<image>`` (torchvision's ImageFolder layout, e.g. ImageNet's train/ and val/).

    Files are checked once when the folder is scanned: an unreadable image is skipped with one
    warning that counts them (a few broken files in a big set should not stop a run); a class folder
    with no readable image, a missing root or a root with no class folders is an error.
    """

    def __init__(self, root: str | Path, size: int = 32, classes: list[str] | None = None, verify: bool = True):
        self.root, self.size = Path(root), size
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder {str(self.root)!r} does not exist or is not a directory")
        found = sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not found:
            raise ValueError(f"image folder {str(self.root)!r} has no class sub-folders (expected root/<class>/<image>)")
        self.classes = list(classes) if classes is not None else found
        missing = [c for c in self.classes if c not in found]
        if missing:
            raise ValueError(f"image folder {str(self.root)!r} lacks the class folders {missing}")
        self.samples: list[tuple[Path, int]] = []
        bad: list[Path] = []
        empty: list[str] = []
        for label, name in enumerate(self.classes):
            files = sorted(p for p in (self.root / name).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
            good = [p for p in files if not verify or _readable(p)]
            bad += sorted(set(files) - set(good))
            if not good:
                empty.append(name)
            self.samples += [(p, label) for p in good]
        self.skipped = len(bad)  # unreadable files left out (the recipe's last line says so)
        if empty:
            raise ValueError(f"image folder {str(self.root)!r}: class folder(s) {empty} contain no readable image "
                             f"(extensions {', '.join(IMAGE_EXTENSIONS)}); remove them or add images")
        if bad:
            shown = ", ".join(str(p.relative_to(self.root)) for p in bad[:5])
            warnings.warn(f"image folder {str(self.root)!r}: skipped {len(bad)} unreadable file(s) of "
                          f"{len(bad) + len(self.samples)} (e.g. {shown})", stacklevel=2)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        try:
            with Image.open(path) as image:
                return to_tensor(image, self.size), label
        except OSError as err:
            raise OSError(f"cannot read image {str(path)!r}: {err}") from None


def _readable(path: Path) -> bool:
    try:
        with Image.open(path) as image:
            image.verify()
        return True
    except Exception:  # PIL raises many types for a broken file
        return False


class HFImages(Dataset):
    """A Hugging Face ``datasets`` image dataset saved with ``save_to_disk`` (an ``image`` and a ``label`` column)."""

    def __init__(self, path: str | Path, split: str | None = None, size: int = 32, image_column: str = "image",
                 label_column: str = "label"):
        from datasets import DatasetDict, load_from_disk

        if not Path(path).exists():
            raise FileNotFoundError(f"Hugging Face dataset path {str(path)!r} does not exist")
        data = load_from_disk(str(path))
        if isinstance(data, DatasetDict):
            if split not in data:
                raise ValueError(f"Hugging Face dataset {str(path)!r} has splits {list(data)}, not {split!r}")
            data = data[split]
        for column in (image_column, label_column):
            if column not in data.column_names:
                raise ValueError(f"Hugging Face dataset {str(path)!r} has no column {column!r} "
                                 f"(columns: {data.column_names})")
        self.data, self.size, self.image_column, self.label_column = data, size, image_column, label_column
        feature = data.features[label_column]
        self.classes = list(feature.names) if hasattr(feature, "names") else sorted(set(data[label_column]))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        row = self.data[index]
        image = row[self.image_column]
        if not isinstance(image, Image.Image):
            raise TypeError(f"row {index}: column {self.image_column!r} holds {type(image).__name__}, not an image")
        return to_tensor(image, self.size), int(row[self.label_column])


def load_images(data: str | None, split: str, size: int = 32, num_images: int | None = None,
                classes: list[str] | None = None) -> Dataset:
    """The ``split`` ('train' or 'test') of ``data``: None or 'shapes' for the embedded default, a folder
    with ``train/`` and ``val/`` (or ``test/``) ImageFolder sub-folders, or a DatasetDict saved with
    ``save_to_disk`` (splits train and test/validation)."""
    if data in (None, "shapes"):
        return ShapesImages(split, size=size, num_images=num_images)
    root = Path(data)
    if not root.exists():
        raise FileNotFoundError(f"dataset path {data!r} does not exist")
    if (root / "dataset_dict.json").exists():
        from datasets import load_from_disk

        available = list(load_from_disk(str(root)))
        names = ["train"] if split == "train" else ["test", "validation", "val"]
        chosen = next((n for n in names if n in available), None)
        if chosen is None:
            raise ValueError(f"Hugging Face dataset {data!r} has splits {available}; need one of {names}")
        return HFImages(root, chosen, size=size)
    names = ["train"] if split == "train" else ["val", "test", "validation"]
    for name in names:
        if (root / name).is_dir():
            return ImageFolderImages(root / name, size=size, classes=classes)
    raise FileNotFoundError(f"dataset folder {data!r} has no {' or '.join(n + '/' for n in names)} sub-folder "
                            "(expected ImageFolder layout root/train/<class>/<image>, root/val/<class>/<image>)")
