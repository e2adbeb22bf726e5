"""Zero-shot evaluation: CLIP_benchmark metrics on known answers, and where class names come from."""

from __future__ import annotations

import json

import pytest
import torch

from contrastkit.evaluation.zeroshot import zeroshot_classes, zeroshot_metrics

pytestmark = pytest.mark.quick


def test_metrics_known_answers():
    # 3 classes; targets 0,0,0,1 and 2. Predictions (top-1): 0,1,0,1,2 -> top-1 4/5.
    logits = torch.tensor([[3., 2, 1], [1, 3, 2], [3, 1, 2], [0, 3, 1], [0, 1, 2]])
    targets = torch.tensor([0, 0, 0, 1, 2])
    m = zeroshot_metrics(logits, targets, 3, per_class=True)
    assert m["top1"] == pytest.approx(0.8)
    assert m["top5"] == pytest.approx(1.0)  # k = min(5, classes) = 3
    assert m["per_class_recall"] == pytest.approx([2 / 3, 1.0, 1.0])
    assert m["mean_per_class_recall"] == pytest.approx((2 / 3 + 1 + 1) / 3)
    # A class with no images does not count towards the mean recall.
    m = zeroshot_metrics(logits[:4], targets[:4], 3, per_class=True)
    assert m["per_class_recall"][2] is None and m["mean_per_class_recall"] == pytest.approx((2 / 3 + 1) / 2)


def test_class_names_imagenet_synthetic_and_plain(tmp_path):
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    imagenet = tmp_path / "val"
    for i in range(1000):
        (imagenet / f"n{i:08d}").mkdir(parents=True)
    folders, names, templates = zeroshot_classes(imagenet)
    assert names == list(IMAGENET_CLASSNAMES) and len(templates) == 80 and "{}" in templates[0]
    partial = tmp_path / "partial"
    (partial / "n01440764").mkdir(parents=True)
    with pytest.raises(ValueError, match="1 WordNet-id folders, but ImageNet's class names need all 1000"):
        zeroshot_classes(partial)
    own = tmp_path / "own"
    for name in ("star", "circle"):
        (own / name).mkdir(parents=True)
    (own / "classes.json").write_text(json.dumps({"templates": ["a {}."], "classnames": {"star": "big star"}}))
    assert zeroshot_classes(own) == (["circle", "star"], ["circle", "big star"], ["a {}."])
    (own / "classes.json").unlink()
    assert zeroshot_classes(own)[2] == ["a photo of a {}."]
    with pytest.raises(FileNotFoundError, match="zero-shot folder not found"):
        zeroshot_classes(tmp_path / "missing")
