"""CPU time of the automatic loss path, one source tree against another, on a shared machine.

    git archive <base commit> | tar -x -C /tmp/base
    python tools/perf/cpu_ab.py /tmp/base .            # base tree, then this one, 4 rounds

Forward + backward of a few objectives and settings (float32, the eager CPU path) in a subprocess per tree
(PYTHONPATH set to it), the trees alternated for --rounds rounds. Each step's time is process time (CPU
seconds of all threads: much less sensitive than wall time to other jobs on the machine), the minimum over
--repeats steps and then over the rounds. Prints a markdown table: base, new, new / base.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CONFIGS = [("infonce", "two_views", 4096, 128), ("cacr", "two_views", 4096, 128), ("dcl", "two_views", 2048, 512),
           ("infonce", "image_text", 4096, 128), ("cacr", "image_text", 4096, 128)]


def worker(repeats: int) -> dict[str, float]:
    import torch

    from contrastkit.losses import build_loss

    torch.manual_seed(0)
    out = {}
    for name, setting, n, d in CONFIGS:
        fn = build_loss(name)
        z = [torch.randn(n, d, requires_grad=True) for _ in range(2)]
        scale = torch.tensor(14.0, requires_grad=True)

        def step():
            (fn.cross_modal(*z, logit_scale=scale) if setting == "image_text" else fn(*z)).backward()

        step()  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t = time.process_time()
            step()
            best = min(best, time.process_time() - t)
        out[f"{name} {setting} N={n} D={d}"] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.repeats)))
        return
    best: dict[str, dict[str, float]] = {"base": {}, "new": {}}
    for _ in range(args.rounds):
        for side in ("base", "new"):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(getattr(args, side))}
            run = subprocess.run([sys.executable, __file__, args.base, args.new, "--worker", "--repeats",
                                  str(args.repeats)], env=env, capture_output=True, text=True, check=True)
            for key, value in json.loads(run.stdout.strip().splitlines()[-1]).items():
                best[side][key] = min(best[side].get(key, float("inf")), value)
    print("| objective, setting, size | base ms | new ms | new / base |\n|---|---|---|---|")
    for key, base in best["base"].items():
        new = best["new"][key]
        print(f"| {key} | {base * 1000:.0f} | {new * 1000:.0f} | {new / base:.2f} |")


if __name__ == "__main__":
    main()
