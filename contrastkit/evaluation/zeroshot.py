"""Zero-shot classification of a CLIP model on an ImageNet-layout folder (``<root>/<class>/<image>``).

CLIP_benchmark's conventions: each class's text embedding is the mean of its normalised template
embeddings, normalised again (open_clip's ``build_zero_shot_classifier``); images are classified by
cosine similarity; reported are top-1, top-5 and the mean per-class recall (balanced accuracy).

Class names and templates come from, in order: a ``classes.json`` in the folder (``{"templates": [...],
"classnames": {folder: name}}``, as the embedded shapes set has); ImageNet's class names and the 80
OpenAI templates from open_clip's metadata when the folder holds the 1000 WordNet-id folders of ImageNet;
otherwise the folder names themselves with the template "a photo of a {}.".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from contrastkit.adapters.open_clip import check_model
from contrastkit.cli import arg, check_device, default_device, existing, positive

WNID = re.compile(r"n\d{8}")


def zeroshot_classes(root: str | Path) -> tuple[list[str], list[str], list[str]]:
    """(folder names in ImageFolder order, class names, templates) for the folder ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"zero-shot folder not found: {root}")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not folders:
        raise ValueError(f"{root}: no class folders (expected ImageNet layout, <root>/<class>/<image>)")
    meta = root / "classes.json"
    if meta.exists():
        spec = json.loads(meta.read_text())
        names = spec.get("classnames", {})
        return folders, [names.get(f, f) for f in folders], list(spec["templates"])
    if all(WNID.fullmatch(f) for f in folders):
        from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

        if len(folders) != len(IMAGENET_CLASSNAMES):
            raise ValueError(f"{root}: {len(folders)} WordNet-id folders, but ImageNet's class names need all "
                             f"{len(IMAGENET_CLASSNAMES)} (the sorted wnids give their order)")
        return folders, list(IMAGENET_CLASSNAMES), [t("{}") if callable(t) else t for t in OPENAI_IMAGENET_TEMPLATES]
    return folders, [f.replace("_", " ") for f in folders], ["a photo of a {}."]


def zeroshot_metrics(logits: torch.Tensor, targets: torch.Tensor, num_classes: int,
                     per_class: bool = False) -> dict:
    """top-1, top-5 (top-k with k = min(5, classes)) and mean per-class recall from logits [N, C];
    ``per_class`` adds the list of recalls (None for a class without images)."""
    k = min(5, num_classes)
    topk = logits.topk(k, dim=1).indices
    top1 = (topk[:, 0] == targets).float().mean().item()
    top5 = (topk == targets[:, None]).any(dim=1).float().mean().item()
    correct = (topk[:, 0] == targets).float()
    present = torch.bincount(targets, minlength=num_classes) > 0
    hits = torch.bincount(targets, weights=correct, minlength=num_classes)
    counts = torch.bincount(targets, minlength=num_classes)
    recalls = hits / counts.clamp(min=1)
    result = {"top1": top1, "top5": top5, "mean_per_class_recall": recalls[present].mean().item()}
    if per_class:
        result["per_class_recall"] = [r.item() if p else None for r, p in zip(recalls, present)]
    return result


@torch.no_grad()
def evaluate_zeroshot(model, tokenizer, preprocess, root: str | Path, *, batch_size: int = 256, device=None,
                      workers: int = 0, progress: bool = False, per_class: bool = False) -> dict:
    """Zero-shot metrics of an open_clip ``model`` on the folder ``root`` (see the module docstring);
    ``device`` defaults to the model's."""
    from open_clip import build_zero_shot_classifier
    from torchvision.datasets import ImageFolder
    from tqdm import tqdm

    device = torch.device(device) if device is not None else next(model.parameters()).device
    folders, classnames, templates = zeroshot_classes(root)
    dataset = ImageFolder(str(root), transform=preprocess)
    if len(dataset) == 0:
        raise ValueError(f"{root}: the class folders hold no images")
    was_training = model.training
    model.eval()
    try:
        classifier = build_zero_shot_classifier(model, tokenizer, classnames, templates, device=device)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                             pin_memory=device.type == "cuda")
        logits, targets = [], []
        for images, labels in tqdm(loader, desc="zero-shot", disable=not progress):
            features = model.encode_image(images.to(device, non_blocking=True), normalize=True)
            logits.append(features.float() @ classifier.float())
            targets.append(labels)
    finally:
        model.train(was_training)
    metrics = zeroshot_metrics(torch.cat(logits).cpu(), torch.cat(targets), len(classnames), per_class)
    if per_class:
        metrics["classnames"] = classnames
    return {**metrics, "num_images": len(dataset), "num_classes": len(classnames), "chance": 1.0 / len(classnames)}


def load_clip_checkpoint(model, path: str | Path) -> None:
    """Load weights into an open_clip model from an accelerate checkpoint folder (model.safetensors), a
    .safetensors file, or a torch file (open_clip_train's epoch_N.pt with "state_dict", DDP's "module."
    prefixes removed), read with ``weights_only=True`` as open_clip does: a file that would run code when
    unpickled is refused (ValueError). Missing or unexpected keys are an error naming them, except a SigLIP
    run's ``logit_bias`` for a model without one (zero-shot does not use it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except Exception as err:  # safetensors' own error type: a damaged or truncated file
            raise ValueError(f"{path}: not a readable safetensors file ({str(err).splitlines()[0]})") from None
    else:
        import pickle

        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise ValueError(f"{path}: {refused_pickle(err)}") from None
        state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict (or open_clip_train's checkpoint), got {type(state).__name__}")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    if getattr(model, "logit_bias", None) is None:
        # a SigLIP-trained checkpoint (--loss siglip): its logit bias shifts every image-text logit alike and
        # plays no part in zero-shot's argmax over cosine similarities, so a model built without one reads it
        state.pop("logit_bias", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} does not fit this model: missing {list(missing)[:5]}, unexpected "
                         f"{list(unexpected)[:5]} (is --model the config it was trained with?)")


def refused_pickle(err: Exception) -> str:
    """One line for torch.load(weights_only=True) refusing a file (it holds more than tensors and plain
    values, e.g. code to run) or failing to read it."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    why = next((line for line in lines if "global" in line.lower() and "weights_only" not in line),
               lines[0] if lines else type(err).__name__)
    return (f"not loaded: torch.load(weights_only=True) refused it ({why}); contrastkit never unpickles more "
            "than tensors and plain values from a file it is given")


def plot_per_class(result: dict, path: str | Path, max_classes: int = 60) -> Path:
    """A bar chart of the per-class recalls (the lowest ``max_classes`` when there are more)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [(r, c) for r, c in zip(result["per_class_recall"], result["classnames"]) if r is not None]
    pairs = sorted(pairs)[:max_classes] if len(pairs) > max_classes else pairs
    fig, ax = plt.subplots(figsize=(max(5.0, 0.3 * len(pairs) + 2), 3.6))
    ax.bar(range(len(pairs)), [r for r, _ in pairs])
    ax.set_xticks(range(len(pairs)), [c for _, c in pairs], rotation=60, ha="right", fontsize=8)
    ax.axhline(result["chance"], color="grey", ls="--", label="chance")
    ax.set_ylabel("recall")
    ax.set_title(f"zero-shot top-1 {result['top1']:.3f}, mean per-class recall {result['mean_per_class_recall']:.3f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


@dataclass
class ZeroShotArgs:
    """The command line of eval/zeroshot.py."""

    model: str = arg("contrastkit-tiny", "open_clip config name")
    checkpoint: str | None = arg(None, "accelerate checkpoint folder, model.safetensors, or open_clip_train .pt; "
                                       "none: random initialisation (a chance-level baseline)")
    data: str | None = arg(None, "ImageNet-layout folder (default: the embedded shapes zero-shot split)")
    data_dir: str | None = arg(None, "where the embedded data is generated (default ~/.cache/contrastkit)")
    batch_size: int = arg(256, "images per batch")
    workers: int = arg(0, "DataLoader worker processes")
    device: str = arg(default_device(), "where the model runs (cpu, cuda, cuda:1)")
    out_dir: str | None = arg(None, "report folder (default: beside the checkpoint, or runs/zeroshot)")

    def check(self) -> None:
        positive("batch_size", self.batch_size)
        positive("workers", self.workers, zero=True)
        existing("checkpoint", self.checkpoint, "checkpoint")
        existing("data", self.data, "zero-shot folder")
        check_device(self.device)
        check_model(self.model)
