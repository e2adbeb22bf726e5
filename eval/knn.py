"""Weighted kNN accuracy of a vision recipe run's frozen backbone (default k 200, temperature 0.1).

    python eval/knn.py --run runs/vision                      # the run's own data (embedded shapes by default)
    python eval/knn.py --run runs/vision --data /data/imagenet --image-size 224   # ImageFolder train/ and val/

Writes knn.json (accuracy at --k and at a range of k) and knn.png (accuracy against k) next to --out.
"""

import json
from pathlib import Path

from contrastkit.cli import parse
from contrastkit.evaluation.knn import KnnArgs, knn_accuracy
from contrastkit.vision.train import frozen_features, load_backbone


def main(argv=None):
    args = parse(KnnArgs, description=__doc__, argv=argv)
    backbone, cfg = load_backbone(args.run, args.checkpoint, args.device)
    train, test, classes = frozen_features(backbone, cfg, args.data, args.image_size, progress=args.progress)
    ks = sorted({1, 5, 20, 50, 100, 200, args.k})
    curve = {k: knn_accuracy(*train, *test, k=k, temperature=args.temperature, num_classes=len(classes)) for k in ks}
    report = {"run": args.run, "data": args.data or cfg.data or "shapes", "k": args.k,
              "temperature": args.temperature, "knn_top1": curve[args.k], "top1_by_k": curve,
              "train_size": len(train[1]), "test_size": len(test[1]), "classes": len(classes)}
    out = Path(args.out or Path(args.run) / "knn.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    ax.plot(ks, [curve[k] for k in ks], marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("k")
    ax.set_ylabel("top-1")
    ax.set_title(f"weighted kNN, T={args.temperature}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    print(json.dumps({"knn_top1": report["knn_top1"], "k": args.k}))
    return report


if __name__ == "__main__":
    main()
