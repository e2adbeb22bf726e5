"""Linear probe on a vision recipe run's frozen backbone: SGD with step decay (SSL protocol) and/or L-BFGS
logistic regression (CLIP's).

    python eval/linear_probe.py --run runs/vision                       # both classifiers, the run's data
    python eval/linear_probe.py --run runs/vision --data /data/imagenet --image-size 224 --classifier sgd

Writes linear_probe.json and linear_probe.png (the SGD training loss) next to --out.
"""

import json
from pathlib import Path

from contrastkit.cli import parse
from contrastkit.evaluation.linear_probe import ProbeArgs, linear_probe_sgd, logistic_regression_lbfgs
from contrastkit.vision.train import frozen_features, load_backbone


def main(argv=None):
    args = parse(ProbeArgs, description=__doc__, argv=argv)
    backbone, cfg = load_backbone(args.run, args.checkpoint, args.device)
    (train_x, train_y), (test_x, test_y), classes = frozen_features(backbone, cfg, args.data, args.image_size,
                                                                    progress=args.progress)
    report = {"run": args.run, "data": args.data or cfg.data or "shapes", "train_size": len(train_y),
              "test_size": len(test_y), "classes": len(classes), "feature_dim": train_x.shape[1]}
    if args.classifier in ("sgd", "both"):
        report["sgd"] = linear_probe_sgd(train_x, train_y, test_x, test_y, epochs=args.epochs, lr=args.lr,
                                         batch_size=args.batch_size, weight_decay=args.weight_decay,
                                         num_classes=len(classes), progress=args.progress)
    if args.classifier in ("lbfgs", "both"):
        report["lbfgs"] = logistic_regression_lbfgs(train_x, train_y, test_x, test_y,
                                                    weight_decay=args.lbfgs_weight_decay, num_classes=len(classes))
    out = Path(args.out or Path(args.run) / "linear_probe.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    if "sgd" in report:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        history = report["sgd"]["history"]
        fig, ax = plt.subplots(figsize=(4.5, 3.4))
        ax.plot([h["epoch"] for h in history], [h["train_loss"] for h in history])
        ax.set_xlabel("epoch")
        ax.set_ylabel("train cross-entropy")
        ax.set_title(f"linear probe (SGD): test top-1 {report['sgd']['test_top1']:.3f}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
        plt.close(fig)
    print(json.dumps({k: report[k]["test_top1"] for k in ("sgd", "lbfgs") if k in report}))
    return report


if __name__ == "__main__":
    main()
