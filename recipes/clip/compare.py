"""InfoNCE vs DCL vs DCLW at small batch sizes on the embedded shapes data: zero-shot top-1 against batch size.

    python recipes/clip/compare.py                      # batch 8, 16, 32, 64; 8192 pairs per run; 1 seed
    python recipes/clip/compare.py --seeds 0 1 --jobs 2 --out-dir runs/clip-compare

Writes results.json, results.md (table) and results.png (plot) to --out-dir; finished runs are reused.
"""

import argparse

from contrastkit.clip_compare import compare
from contrastkit.clip_train import ClipTrainConfig


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--losses", nargs="+", default=["infonce", "dcl", "dclw"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 16, 32, 64])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--samples", type=int, default=8192, help="training pairs per run (steps = samples / batch)")
    p.add_argument("--lr", type=float, default=ClipTrainConfig.lr)
    p.add_argument("--model", default=ClipTrainConfig.model)
    p.add_argument("--data-dir", help="where the embedded data is generated (default ~/.cache/contrastkit)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (each gets 2 / jobs threads)")
    p.add_argument("--out-dir", default="runs/clip-compare")
    args = p.parse_args(argv)
    base = ClipTrainConfig(model=args.model, lr=args.lr, data_dir=args.data_dir)
    compare(args.out_dir, losses=args.losses, batch_sizes=args.batch_sizes, seeds=args.seeds, samples=args.samples,
            jobs=args.jobs, base=base)
    print(open(f"{args.out_dir}/results.md").read())


if __name__ == "__main__":
    main()
