"""The DCL Fig. 3 / EqCo Fig. 3 sweep on the embedded shapes: kNN top-1 vs batch size and vs negatives.

    python recipes/vision/sweep.py --out-dir runs/vision-sweep          # the default grid, ~25 min on 2 CPU cores

Every run sees --samples images and is judged by weighted kNN and an L-BFGS linear probe; writes sweep.json, sweep.md (table), batch_size.png and negatives.png.
Re-running continues where it stopped (finished runs are kept).
"""

import argparse
from pathlib import Path

from contrastkit.vision.sweep import plot, run_sweep, summary_table, sweep_configs, table
from contrastkit.vision.train import VisionConfig


def ints(text):
    return [int(x) for x in text.split(",") if x]


def names(text):
    return [x for x in text.split(",") if x]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="runs/vision-sweep")
    parser.add_argument("--samples", type=int, default=4096, help="images seen per run (same for every batch size)")
    parser.add_argument("--batch-sizes", type=ints, default=[16, 32, 64, 128])
    parser.add_argument("--simclr-losses", type=names, default=["infonce", "dcl", "dclw"])
    parser.add_argument("--queue-sizes", type=ints, default=[32, 256, 2048])
    parser.add_argument("--moco-losses", type=names, default=["infonce", "eqco"])
    parser.add_argument("--moco-batch", type=int, default=64)
    parser.add_argument("--simo-losses", type=names, default=["infonce", "eqco"])
    parser.add_argument("--alpha", type=float, default=2048.0, help="EqCo's alpha (the largest queue by default)")
    parser.add_argument("--train-images", type=int, default=2000)
    parser.add_argument("--test-images", type=int, default=800)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--crop-min", type=float, default=0.5)
    parser.add_argument("--blur", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--seeds", type=ints, default=None, help="e.g. 0,1,2: every run once per seed, "
                        "mean ± 95 %% interval and paired verdicts in sweep.md (default: one run, seed 0)")
    args = parser.parse_args()

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = VisionConfig(samples=args.samples, train_images=args.train_images, test_images=args.test_images,
                        width=args.width, lr=args.lr, crop_min=args.crop_min, blur=args.blur, alpha=args.alpha,
                        temperature=args.temperature,
                        threads=1, progress=False, log_every=10)
    runs = sweep_configs(base, out, args.batch_sizes, args.simclr_losses, args.queue_sizes, args.moco_losses,
                         args.moco_batch, args.simo_losses, args.seeds)
    rows = run_sweep(runs, out)
    settings = {k: v for k, v in vars(args).items() if k != "out_dir"}
    (out / "sweep.md").write_text(f"Settings: {settings}\n\n" + table(rows) + "\n" + summary_table(rows))
    plot(rows, out, chance=1 / 8)
    print(table(rows))
