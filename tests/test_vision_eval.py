"""kNN and linear probes give the known answers; the eval scripts run on a recipe run; bad image data fails clearly."""

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

from contrastkit.data.images import ImageFolderImages, ShapesImages, load_images
from contrastkit.evaluation.knn import extract_features, knn_accuracy, knn_predict
from contrastkit.evaluation.linear_probe import linear_probe_sgd, logistic_regression_lbfgs
from contrastkit.vision.train import VisionConfig, train

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]


def clusters(n_per_class, num_classes=4, dim=16, noise=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.eye(dim)[:num_classes] * 3
    y = torch.arange(num_classes).repeat_interleave(n_per_class)
    return centers[y] + noise * torch.randn(len(y), dim, generator=g), y


def test_knn_weighted_vote_by_hand():
    bank = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.2, 1.0]])
    labels = torch.tensor([0, 0, 1, 1, 1])
    query = torch.tensor([[1.0, 0.05], [0.05, 1.0], [1.0, 0.9]])
    # k = 2: the two nearest of each query decide.
    assert knn_predict(bank, labels, query, k=2, temperature=0.1).tolist() == [0, 1, 0]
    # k = 5 with the diagonal query: 3 neighbours of class 1 outvote 2 of class 0 at a high temperature ...
    assert knn_predict(bank, labels, query[2:], k=5, temperature=100.0).tolist() == [1]
    # ... and the weights computed by hand say the same at T = 0.1.
    sims = torch.nn.functional.normalize(query[2:], dim=1) @ torch.nn.functional.normalize(bank, dim=1).T
    votes = torch.zeros(2).index_add_(0, labels, (sims[0] / 0.1).exp())
    assert knn_predict(bank, labels, query[2:], k=5, temperature=0.1).item() == int(votes.argmax())


def test_knn_and_probes_separate_clusters_and_not_noise():
    train_x, train_y = clusters(50)
    test_x, test_y = clusters(20, seed=1)
    assert knn_accuracy(train_x, train_y, test_x, test_y, k=200, temperature=0.1) == 1.0
    assert linear_probe_sgd(train_x, train_y, test_x, test_y, epochs=20)["test_top1"] == 1.0
    assert logistic_regression_lbfgs(train_x, train_y, test_x, test_y)["test_top1"] == 1.0
    # Random labels: nothing to learn, test accuracy near chance (1/4).
    g = torch.Generator().manual_seed(2)
    noise_train, noise_test = torch.randn(400, 16, generator=g), torch.randn(400, 16, generator=g)
    random_train, random_test = torch.randint(0, 4, (400,), generator=g), torch.randint(0, 4, (400,), generator=g)
    assert knn_accuracy(noise_train, random_train, noise_test, random_test, k=20) < 0.35
    assert linear_probe_sgd(noise_train, random_train, noise_test, random_test, epochs=10)["test_top1"] < 0.35
    assert logistic_regression_lbfgs(noise_train, random_train, noise_test, random_test)["test_top1"] < 0.35


def test_linear_probe_needs_a_linear_direction_that_knn_also_sees():
    # Class = sign of feature 0, the other 31 features are larger noise: linear is exact, kNN is not.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 32, generator=g) * torch.cat([torch.tensor([1.0]), torch.full((31,), 3.0)])
    x[:, 0] += torch.where(x[:, 0] > 0, 1.0, -1.0)
    y = (x[:, 0] > 0).long()
    assert logistic_regression_lbfgs(x[:400], y[:400], x[400:], y[400:])["test_top1"] > 0.97
    assert linear_probe_sgd(x[:400], y[:400], x[400:], y[400:], epochs=30)["test_top1"] > 0.97


def test_bad_feature_shapes():
    with pytest.raises(ValueError, match="features must be"):
        knn_predict(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), torch.randn(2, 5))
    with pytest.raises(ValueError, match="labels"):
        linear_probe_sgd(torch.randn(4, 3), torch.zeros(5, dtype=torch.long), torch.randn(2, 3),
                         torch.zeros(2, dtype=torch.long))


def test_extract_features_uses_eval_mode_and_restores_it():
    from contrastkit.vision.models import build_backbone

    backbone, dim = build_backbone("small_cnn", width=4)
    images = ShapesImages("test", size=16, num_images=10)
    backbone.train()
    feats, labels = extract_features(backbone, images, lambda x: x.float() / 255, batch_size=4)
    assert feats.shape == (10, dim) and labels.tolist() == images.labels.tolist() and backbone.training
    again, _ = extract_features(backbone, images, lambda x: x.float() / 255, batch_size=10)
    torch.testing.assert_close(feats, again)  # batch composition does not matter: eval-mode batch norm


def test_eval_scripts_on_a_recipe_run(tmp_path):
    run = tmp_path / "run"
    train(VisionConfig(method="simclr", loss="dcl", out_dir=str(run), train_images=64, test_images=32, batch_size=16,
                       steps=2, width=8, proj_hidden=32, proj_dim=16, threads=1, progress=False))
    sys.path.insert(0, str(ROOT / "eval"))
    try:
        import knn as knn_script
        import linear_probe as probe_script
    finally:
        sys.path.pop(0)
    report = knn_script.main(["--run", str(run), "--k", "10", "--no-progress"])
    assert 0 <= report["knn_top1"] <= 1 and report["train_size"] == 64 and report["test_size"] == 32
    assert (run / "knn.png").exists()
    probe = probe_script.main(["--run", str(run), "--epochs", "3", "--no-progress"])
    assert {"sgd", "lbfgs"} <= set(probe) and (run / "linear_probe.png").exists()
    assert json.loads((run / "linear_probe.json").read_text())["feature_dim"] == 64
    # The same run's checkpoint gives the same kNN answer as its final backbone.
    from_ckpt = knn_script.main(["--run", str(run), "--k", "10", "--no-progress", "--out", str(tmp_path / "c.json"),
                                 "--checkpoint", str(run / "checkpoints" / "checkpoint_2")])
    assert from_ckpt["knn_top1"] == report["knn_top1"]
    # The same backbone judged on other data: an ImageFolder with train/ and val/.
    write_folder(tmp_path / "folder" / "train", ["a", "b", "c"], per_class=4)
    write_folder(tmp_path / "folder" / "val", ["a", "b", "c"], per_class=2)
    other = knn_script.main(["--run", str(run), "--data", str(tmp_path / "folder"), "--image-size", "16", "--k", "3",
                             "--no-progress", "--out", str(tmp_path / "folder.json")])
    assert other["classes"] == 3 and other["train_size"] == 12 and other["test_size"] == 6


def write_folder(root, classes, per_class=2, size=12):
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.new("RGB", (size + i, size), (40 * c, 20 * i, 100)).save(root / name / f"{i}.png")


def test_recipe_trains_on_an_image_folder_with_a_broken_file(tmp_path):
    write_folder(tmp_path / "data" / "train", ["cat", "dog"], per_class=4, size=20)
    write_folder(tmp_path / "data" / "val", ["cat", "dog"], per_class=2, size=20)
    (tmp_path / "data" / "train" / "dog" / "broken.jpg").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match=r"skipped 1 unreadable file\(s\) of 9"):
        summary = train(VisionConfig(method="simo", loss="dcl", data=str(tmp_path / "data"), image_size=16,
                                     out_dir=str(tmp_path / "run"), batch_size=4, steps=2, width=4, proj_hidden=16,
                                     proj_dim=8, threads=1, progress=False))
    assert summary["steps"] == 2 and 0 <= summary["knn_top1"] <= 1
    with pytest.raises(FileNotFoundError, match="--data: image data .* does not exist"):
        train(VisionConfig(data=str(tmp_path / "missing"), out_dir=str(tmp_path / "run2"), steps=1, progress=False))


def test_image_folder_reads_and_resizes(tmp_path):
    write_folder(tmp_path / "data" / "train", ["cat", "dog"])
    write_folder(tmp_path / "data" / "val", ["cat", "dog"], per_class=1)
    train_set = load_images(str(tmp_path / "data"), "train", size=8)
    test_set = load_images(str(tmp_path / "data"), "test", size=8)
    assert train_set.classes == ["cat", "dog"] and len(train_set) == 4 and len(test_set) == 2
    image, label = train_set[3]
    assert image.shape == (3, 8, 8) and image.dtype == torch.uint8 and label == 1


def test_image_folder_skips_unreadable_files_with_a_count(tmp_path):
    write_folder(tmp_path, ["cat", "dog"], per_class=3)
    (tmp_path / "cat" / "broken.jpg").write_bytes(b"not an image at all")
    (tmp_path / "dog" / "truncated.png").write_bytes((tmp_path / "dog" / "0.png").read_bytes()[:30])
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable file\(s\) of 8"):
        data = ImageFolderImages(tmp_path, size=8)
    assert len(data) == 6


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolderImages(tmp_path / "nope")
    with pytest.raises(ValueError, match="no class sub-folders"):
        ImageFolderImages(tmp_path)
    write_folder(tmp_path, ["cat"])
    (tmp_path / "dog").mkdir()
    with pytest.raises(ValueError, match=r"class folder\(s\) \['dog'\] contain no readable image"):
        ImageFolderImages(tmp_path)
    (tmp_path / "dog" / "bad.jpg").write_bytes(b"\x00" * 10)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="'dog'"):
        warnings.simplefilter("ignore")
        ImageFolderImages(tmp_path)
    with pytest.raises(FileNotFoundError, match="no train/ sub-folder"):
        load_images(str(tmp_path), "train")


def test_hf_dataset_on_disk(tmp_path):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image as HFImage

    features = Features({"image": HFImage(), "label": ClassLabel(names=["a", "b"])})
    rows = {"image": [Image.new("RGB", (10, 14), (i * 60, 0, 0)) for i in range(4)], "label": [0, 1, 0, 1]}
    DatasetDict({"train": Dataset.from_dict(rows, features=features),
                 "test": Dataset.from_dict(rows, features=features)}).save_to_disk(str(tmp_path / "hf"))
    data = load_images(str(tmp_path / "hf"), "test", size=8)
    assert data.classes == ["a", "b"] and data[1][0].shape == (3, 8, 8) and data[1][1] == 1
    DatasetDict({"train": Dataset.from_dict({"img": rows["image"]})}).save_to_disk(str(tmp_path / "nolabel"))
    with pytest.raises(ValueError, match="splits \\['train'\\]; need one of"):
        load_images(str(tmp_path / "nolabel"), "test")
    with pytest.raises(ValueError, match="no column 'image'"):
        load_images(str(tmp_path / "nolabel"), "train")


def test_shapes_are_deterministic_balanced_and_split():
    a, b = ShapesImages("train", size=16, num_images=16), ShapesImages("train", size=16, num_images=16)
    test = ShapesImages("test", size=16, num_images=16)
    assert torch.equal(a.images, b.images) and not torch.equal(a.images, test.images)
    assert torch.bincount(a.labels).tolist() == [2] * 8
    with pytest.raises(ValueError, match="unknown split"):
        ShapesImages("val")
