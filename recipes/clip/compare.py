"""InfoNCE vs DCL vs DCLW at small batch sizes on the embedded shapes data: zero-shot top-1 against batch size.

    python recipes/clip/compare.py                      # batch 8, 16, 32, 64; 8192 pairs per run; 1 seed
    python recipes/clip/compare.py --seeds 0 1 --jobs 2 --out-dir runs/clip-compare

Writes results.json, results.md (table) and results.png (plot) to --out-dir; finished runs are reused.
"""

from contrastkit.cli import parse
from contrastkit.clip.compare import CompareArgs, compare
from contrastkit.clip.train import ClipTrainConfig


def main(argv=None):
    args = parse(CompareArgs, description=__doc__, argv=argv)
    base = ClipTrainConfig(model=args.model, lr=args.lr, data_dir=args.data_dir)
    compare(args.out_dir, losses=args.losses, batch_sizes=args.batch_sizes, seeds=args.seeds, samples=args.samples,
            jobs=args.jobs, base=base)
    print(open(f"{args.out_dir}/results.md").read())


if __name__ == "__main__":
    main()
