"""all-MiniLM-L6-v2 fine-tuned with each objective through SentenceTransformerTrainer: retrieval before and after.

    nice -n 10 python benchmarks/sentence_transformers_retrieval.py --out-dir docs/sentence_transformers

Writes results.json (every run) and results.md (mean ± 95 % interval over seeds; paired verdicts against
InfoNCE at each batch size) to --out-dir. One thread; 20-30 s a run on a quiet core of the project's CPU
(36 runs by default).
"""

import argparse
import json
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from contrastkit.adapters.sentence_transformers import ST_LOSSES
from contrastkit.evaluation.text_retrieval import run, table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="runs/sentence-transformers")
    p.add_argument("--objectives", nargs="+", default=list(ST_LOSSES), choices=ST_LOSSES)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 32])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--num-train", type=int, default=256, help="training pairs (one epoch)")
    p.add_argument("--num-test", type=int, default=512, help="held-out queries, each against all their documents")
    p.add_argument("--lr", type=float, default=2e-5)
    args = p.parse_args(argv)
    for name in ("batch_sizes", "num_train", "num_test"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 2:
            p.error(f"--{name.replace('_', '-')} must be at least 2")
    if not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr}")
    if "infonce" not in args.objectives:
        p.error("--objectives must include infonce (the reference of the verdicts)")
    if args.num_train + args.num_test > 4480:
        p.error("--num-train + --num-test must be at most 4480 (the paraphrase set's items)")

    torch.set_num_threads(1)
    result = run(args.objectives, args.batch_sizes, args.seeds, num_train=args.num_train, num_test=args.num_test,
                 lr=args.lr, log=lambda s: print(s, flush=True))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    result.update(commit=commit, command=command, machine=f"{platform.processor() or platform.machine()}, 1 thread")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    header = f"Made by `{command}` at commit {commit} ({result['machine']}).\n\n"
    (out / "results.md").write_text(header + table(result))
    print(table(result))


if __name__ == "__main__":
    main()
