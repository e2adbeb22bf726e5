"""Image-text data for CLIP: the embedded default and loaders for the user's own data.

- ``make_shapes_clip(root)``: the embedded default, generated deterministically on first use from
  ``contrastkit.data.shapes``: ``train.csv`` in open_clip's CSV format (tab-separated ``filepath`` and
  ``title``) over ``train/*.png``, and a held-out zero-shot split in ImageNet layout
  (``zeroshot/<class>/*.png``) with ``zeroshot/classes.json`` giving its prompt templates.
- ``ImageTextCsv``: open_clip's CSV format (any separator and column names).
- ``ImageTextFolder``: a Hugging Face datasets image folder (images + metadata.csv/jsonl with a caption
  column).
- ``load_image_text(path, ...)``: picks one of the two from the path.

Images are opened when a batch needs them, not before the first step (a pass over CC3M's 3M files takes
minutes from the page cache, hours from network storage). An unreadable one is replaced by the next
readable row (the step's batch keeps its size, and the replacement depends on the row alone, so a resumed
run loads the same) and counted in ``dataset.bad``; once more than ``max_bad_fraction`` of the images
loaded are unreadable it is a ``DataError``. ``verify=True`` keeps the earlier behaviour for small sets:
every image opened up front, the unreadable ones dropped with a warning that counts them, or an error
above ``max_bad_fraction``.
"""

from __future__ import annotations

import csv
import io
import json
import multiprocessing
import os
import random
import shutil
import warnings
from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset

from contrastkit.data.shards import DataError
from contrastkit.data.shapes import COLORS, POSITIONS, SHAPES, SIZES, render, sample_spec

SHAPES_CLIP_VERSION = 2
# Zero-shot prompts in the captions' own grammar, each naming at most one other attribute.
TEMPLATES = ("a {}", *(f"a {size} {{}}" for size in SIZES), "a striped {}", "a dotted {}",
             *(f"a {color} {{}}" for color in COLORS), *(f"a {{}} in the {position}" for position in POSITIONS))


def partial_caption(spec, rng: random.Random) -> str:
    """The spec's caption with each attribute but the shape kept with probability 1/2, e.g. 'a red star'.

    With every attribute always named, colour, size and position alone tell almost all pairs of a batch
    apart and the shape (the zero-shot class) is barely learned; shorter captions make it matter.
    """
    words = [spec.size, spec.texture if spec.texture != "plain" else "", spec.color]
    text = " ".join(["a", *(w for w in words if w and rng.random() < 0.5), spec.shape])
    return text + (f" in the {spec.position}" if rng.random() < 0.5 else "")


def default_cache_dir() -> Path:
    """``$CONTRASTKIT_CACHE`` or ``~/.cache/contrastkit``: where embedded data is generated."""
    return Path(os.environ.get("CONTRASTKIT_CACHE", Path.home() / ".cache" / "contrastkit"))


def make_shapes_clip(root: str | Path | None = None, *, num_train: int = 4096, num_zeroshot_per_class: int = 50,
                     size: int = 64, seed: int = 0, progress: bool = True) -> Path:
    """Generate (once) the embedded image-text set under ``root`` and return its folder.

    Train and zero-shot images come from disjoint seeds. A ``done`` marker makes a re-run a no-op; the set
    is written to a temporary folder and renamed, so an interrupted run leaves nothing half-written.
    """
    name = f"shapes-clip-v{SHAPES_CLIP_VERSION}-n{num_train}-z{num_zeroshot_per_class}-s{size}-seed{seed}"
    out = Path(root if root is not None else default_cache_dir()) / name
    if (out / "done").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "train").mkdir(parents=True)
    jobs = [("train", i) for i in range(num_train)]
    jobs += [(shape, j) for shape in SHAPES for j in range(num_zeroshot_per_class)]
    rows = []
    from tqdm import tqdm

    for k, (split, j) in enumerate(tqdm(jobs, desc=f"generating {name}", disable=not progress)):
        image_seed = seed * 1_000_003 + k
        rng = random.Random(image_seed)
        spec = sample_spec(rng) if split == "train" else sample_spec(rng, shapes=(split,))
        image = render(spec, size=size, seed=image_seed)
        if split == "train":
            path = tmp / "train" / f"{j:06d}.png"
            rows.append((f"train/{j:06d}.png", partial_caption(spec, rng)))
        else:
            path = tmp / "zeroshot" / split / f"{j:04d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
    with open(tmp / "train.csv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title"])
        for rel, text in rows:
            writer.writerow([str(out / rel), text])  # absolute, as open_clip_train reads them
    (tmp / "zeroshot" / "classes.json").write_text(json.dumps({"templates": list(TEMPLATES)}, indent=1))
    (tmp / "done").write_text("ok\n")
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "done").exists():
            raise
    return out


def _file(source):
    """A path, or the bytes of an image (Hugging Face datasets keeps some images as bytes)."""
    return io.BytesIO(source) if isinstance(source, bytes) else source


def _check_images(sources: list, describe, max_bad_fraction: float, what: str) -> list[int]:
    """Indices of the sources whose image opens; a warning with the count of those that do not."""
    good, bad = [], []
    for i, src in enumerate(sources):
        try:
            with Image.open(_file(src)) as im:
                im.verify()
            good.append(i)
        except Exception as err:  # PIL raises many types for a bad file
            bad.append((describe(i), err))
    if bad:
        message = (f"{what}: {len(bad)} of {len(sources)} images are unreadable, e.g. {bad[0][0]} "
                   f"({type(bad[0][1]).__name__}: {bad[0][1]})")
        if len(bad) > max_bad_fraction * len(sources):
            raise ValueError(message + f"; more than {max_bad_fraction:.0%} of the set, so this is an error")
        warnings.warn(message + "; skipping them", stacklevel=3)
    return good


class _ImageText(Dataset):
    """(image tensor, token ids) pairs from image sources and captions; an unreadable image is replaced by the
    next readable row and counted in ``bad`` (shared with the loader workers), ``loaded`` counts them all."""

    def __init__(self, sources: list, captions: list[str], names: list[str], transform, tokenizer, *,
                 what: str = "", max_bad_fraction: float = 0.1):
        self.sources, self.captions, self.names = sources, captions, names
        self.transform, self.tokenizer = transform, tokenizer
        self.what, self.max_bad_fraction = what, max_bad_fraction
        self.loaded, self.bad = multiprocessing.Value("q", 0), multiprocessing.Value("q", 0)
        self.last_bad = multiprocessing.Value("q", -1)

    def __len__(self) -> int:
        return len(self.captions)

    def _open(self, i: int):
        try:
            with Image.open(_file(self.sources[i])) as im:
                image = im.convert("RGB")
        except Exception:  # PIL raises many types for a bad file
            image = None
            with self.bad.get_lock():
                self.bad.value += 1
                self.last_bad.value = i
        with self.loaded.get_lock():
            self.loaded.value += 1
            loaded, bad = self.loaded.value, self.bad.value
        if bad > self.max_bad_fraction * loaded and loaded >= min(len(self), 100):
            raise DataError(f"{self.what}: {bad} of the {loaded} images loaded so far are unreadable, e.g. "
                            f"{self.names[self.last_bad.value]}; more than {self.max_bad_fraction:.0%}")
        return image

    def __getitem__(self, i):
        for j in range(i, i + len(self)):
            image = self._open(j % len(self))
            if image is not None:
                break
        else:
            raise DataError(f"{self.what}: no image of the set can be read")
        i = j % len(self)
        image = self.transform(image) if self.transform is not None else image
        text = self.tokenizer([self.captions[i]])[0] if self.tokenizer is not None else self.captions[i]
        return image, text


class ImageTextCsv(_ImageText):
    """open_clip's CSV format: one row per pair, an image path column and a caption column.

    Relative image paths are read relative to the CSV file's folder.
    """

    def __init__(self, path: str | Path, transform=None, tokenizer=None, *, img_key: str = "filepath",
                 caption_key: str = "title", sep: str = "\t", max_bad_fraction: float = 0.1, verify: bool = False):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"image-text CSV not found: {path}")
        with open(path, newline="") as f:
            reader = csv.DictReader(f, delimiter=sep)
            columns = reader.fieldnames or []
            for key, what in ((img_key, "image path"), (caption_key, "caption")):
                if key not in columns:
                    raise KeyError(f"{path}: no {what} column {key!r}; the columns are {columns} "
                                   f"(separator {sep!r})")
            rows = [(r[img_key], r[caption_key]) for r in reader]
        if not rows:
            raise ValueError(f"{path}: no rows")
        files = [p if os.path.isabs(p) else str(path.parent / p) for p, _ in rows]
        keep = _check_images(files, lambda i: files[i], max_bad_fraction, str(path)) if verify else range(len(rows))
        super().__init__([files[i] for i in keep], [rows[i][1] for i in keep], [files[i] for i in keep],
                         transform, tokenizer, what=str(path), max_bad_fraction=max_bad_fraction)


class ImageTextFolder(_ImageText):
    """A Hugging Face datasets image folder: images with a metadata.csv or metadata.jsonl that has a
    ``file_name`` column and a caption column (``caption_key``)."""

    def __init__(self, path: str | Path, transform=None, tokenizer=None, *, caption_key: str = "text",
                 split: str = "train", max_bad_fraction: float = 0.1, verify: bool = False):
        from datasets import Image as HFImage
        from datasets import load_dataset

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"image folder not found: {path}")
        if not any((path / m).exists() for m in ("metadata.csv", "metadata.jsonl")) and not any(path.glob("*/metadata.*")):
            raise FileNotFoundError(f"{path}: an image folder with captions needs metadata.csv or metadata.jsonl "
                                    "(columns file_name and the caption)")
        ds = load_dataset("imagefolder", data_dir=str(path), split=split)
        if caption_key not in ds.column_names:
            raise KeyError(f"{path}: no caption column {caption_key!r}; the columns are {ds.column_names}")
        ds = ds.cast_column("image", HFImage(decode=False))
        images = ds["image"]
        sources = [im["bytes"] if im.get("bytes") else im["path"] for im in images]
        names = [im.get("path") or f"{path}[{i}]" for i, im in enumerate(images)]
        keep = (_check_images(sources, lambda i: names[i], max_bad_fraction, str(path)) if verify
                else range(len(ds)))
        captions = ds[caption_key]
        super().__init__([sources[i] for i in keep], [captions[i] for i in keep], [names[i] for i in keep],
                         transform, tokenizer, what=str(path), max_bad_fraction=max_bad_fraction)


def load_image_text(path: str | Path, transform=None, tokenizer=None, *, caption_key: str | None = None,
                    img_key: str = "filepath", sep: str | None = None, max_bad_fraction: float = 0.1,
                    verify: bool = False) -> _ImageText:
    """A CSV/TSV file (open_clip's format) or a Hugging Face image folder with captions, from ``path``;
    ``verify``: open every image now (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data path does not exist: {path}")
    if path.is_dir():
        return ImageTextFolder(path, transform, tokenizer, caption_key=caption_key or "text",
                               max_bad_fraction=max_bad_fraction, verify=verify)
    if sep is None:
        sep = "," if path.suffix.lower() == ".csv" and "\t" not in path.open().readline() else "\t"
    return ImageTextCsv(path, transform, tokenizer, img_key=img_key, caption_key=caption_key or "title", sep=sep,
                        max_bad_fraction=max_bad_fraction, verify=verify)
