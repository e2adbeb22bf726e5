"""The DCL Fig. 3 / EqCo Fig. 3 sweep on the embedded shapes: kNN top-1 vs batch size and vs negatives.

    python recipes/vision/sweep.py --out-dir runs/vision-sweep          # the default grid, ~25 min on 2 CPU cores
    python recipes/vision/sweep.py --batch-sizes 16 64 --simclr-losses infonce dcl --queue-sizes 256

Every run sees --samples images and is judged by weighted kNN and an L-BFGS linear probe; writes sweep.json,
sweep.md (table), batch_size.png and negatives.png. Re-running continues where it stopped (finished runs are kept).
"""

from dataclasses import asdict
from pathlib import Path

from contrastkit.cli import parse
from contrastkit.vision.sweep import SweepArgs, plot, run_sweep, summary_table, sweep_configs, table
from contrastkit.vision.train import VisionConfig


def main(argv=None):
    args = parse(SweepArgs, description=__doc__, argv=argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = VisionConfig(samples=args.samples, train_images=args.train_images, test_images=args.test_images,
                        width=args.width, lr=args.lr, crop_min=args.crop_min, blur=args.blur, alpha=args.alpha,
                        temperature=args.temperature, seed=args.seed, threads=1, progress=False, log_every=10)
    runs = sweep_configs(base, out, args.batch_sizes, args.simclr_losses, args.queue_sizes, args.moco_losses,
                         args.moco_batch, args.simo_losses, args.seeds)
    rows = run_sweep(runs, out)
    settings = {k: v for k, v in asdict(args).items() if k != "out_dir"}
    (out / "sweep.md").write_text(f"Settings: {settings}\n\n" + table(rows) + "\n" + summary_table(rows))
    plot(rows, out, chance=1 / 8)
    print(table(rows))


if __name__ == "__main__":
    main()
