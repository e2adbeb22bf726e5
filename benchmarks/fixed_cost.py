"""The loss's fixed cost per call against the ecosystems' own InfoNCE (issue 54): operators and host time.

    python benchmarks/fixed_cost.py                          # N = 64, 256, 1024, 4096, D = 512, one thread
    python benchmarks/fixed_cost.py --sizes 64 --out runs/fixed-cost.md

At the batch sizes people train with per device a call's time is the host's: a fixed cost per operator
launched (on a GPU ~30 us each, docs/performance.md). So for every objective (infonce, dcl, dclw, eqco, cacr) in
both settings it counts what one forward + backward launches and times it, beside the peer in the same process:
open_clip's ClipLoss for image-text (features normalised first, as open_clip's model does; a learnable logit
scale), lightly's NTXentLoss for two views. Columns:

- ops: aten operators of the call at every level (torch.profiler), and top: those called by no other aten
  operator (what Python and autograd launch);
- device top: the same count on the path of CUDA (backend "auto" as it decides there, host checks off: no value
  read on the host), as tests/losses/test_dense.py holds it;
- ms: the median single-thread CPU time of a call; / peer: the median over rounds of the call's time divided
  by the peer's in the same round, with a 95 % bootstrap interval of that median. Rounds interleave every
  method (the order rotated), so the machine's load falls on all alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch 2.14's profiler prints two USDT lines per profile below 6

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from losses import _step  # noqa: E402  (benchmarks/losses.py: the same calls, the same peers)

OBJECTIVES = ["infonce", "dcl", "dclw", "eqco", "cacr"]
PEERS = {"image-text": "openclip", "two views": "lightly-ntxent"}


def methods(setting: str) -> dict[str, str]:
    """objective (or the peer) -> the method name of benchmarks/losses.py."""
    if setting == "image-text":
        return {**{o: "clip" if o == "infonce" else f"clip-{o}" for o in OBJECTIVES}, "peer": PEERS[setting]}
    return {**{o: o for o in OBJECTIVES}, "peer": PEERS[setting]}


def _aten_events(call) -> list:
    from torch.profiler import ProfilerActivity, profile

    call()  # warm: lazily made constants (a layout, labels) are not the steady state
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return [e for e in prof.events() if e.name.startswith("aten::")]


def operators(call) -> tuple[int, int]:
    """(aten operators at every level, top-level ones) of one call (forward + backward)."""
    events = _aten_events(call)
    top = 0
    for e in events:
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        top += parent is None
    return len(events), top


@contextlib.contextmanager
def device_path():
    """contrastkit's calls take the path of CUDA on the CPU: "auto" decides as on CUDA, and no value is read on
    the host (as tests/conftest.py's device_path fixture)."""
    import contrastkit.losses.plan as plan

    saved = plan.choose_backend, {}
    original, checks = plan.choose_backend, plan.host_checks_allowed
    plan.choose_backend = lambda requested, chunk, device="cpu", *args: original(requested, chunk, "cuda", *args)
    for name, module in list(sys.modules.items()):
        if name.startswith("contrastkit") and getattr(module, "host_checks_allowed", None) is checks:
            saved[1][module] = module.host_checks_allowed
            module.host_checks_allowed = lambda x: False
    try:
        yield
    finally:
        plan.choose_backend = saved[0]
        for module, fn in saved[1].items():
            module.host_checks_allowed = fn


def _time(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _median_interval(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """(median, 2.5 and 97.5 percentiles of the bootstrapped median)."""
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(1000))
    return statistics.median(values), boots[25], boots[974]


def measure(setting: str, n: int, d: int, rounds: int) -> list[dict]:
    args = argparse.Namespace(device="cpu", dtype="float32")
    calls = {name: next(iter(_step(method, n, d, args).values())) for name, method in methods(setting).items()}
    rows = {name: {"setting": setting, "n": n, "objective": name} for name in calls}
    for name, call in calls.items():
        rows[name]["ops"], rows[name]["top"] = operators(call)
        with device_path():
            rows[name]["device_top"] = operators(call)[1]
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:
            times[name].append(_time(calls[name]))
    for name, t in times.items():
        ratios = [a / b for a, b in zip(t, times["peer"])]
        rows[name].update(ms=1e3 * statistics.median(t), ratio=_median_interval(ratios))
    return list(rows.values())


def table(records: list[dict]) -> str:
    lines = ["| setting | N | objective | ops | top | device top | ms | / peer (95 % interval) |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in records:
        name = PEERS[r["setting"]] if r["objective"] == "peer" else r["objective"]
        ratio = "" if r["objective"] == "peer" else "{:.2f} ({:.2f}-{:.2f})".format(*r["ratio"])
        lines.append(f"| {r['setting']} | {r['n']} | {name} | {r['ops']} | {r['top']} | {r['device_top']} | "
                     f"{r['ms']:.3g} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024, 4096])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=20.0, help="timing budget per size and setting")
    parser.add_argument("--settings", type=lambda s: s.split(","), default=list(PEERS))
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    bad = set(args.settings) - set(PEERS)
    if bad:
        parser.error(f"--settings: unknown {', '.join(sorted(bad))} (choose from {', '.join(PEERS)})")
    torch.set_num_threads(1)
    records = []
    for n in args.sizes:
        for setting in args.settings:
            probe = next(iter(_step(methods(setting)["dcl"], n, args.dim,
                                    argparse.Namespace(device="cpu", dtype="float32")).values()))
            probe()
            rounds = max(3, min(60, int(args.seconds / (len(OBJECTIVES) + 1) / max(_time(probe), 1e-4))))
            records += measure(setting, n, args.dim, rounds)
            print(table([r for r in records if r["n"] == n and r["setting"] == setting]), flush=True)
    text = (f"torch {torch.__version__}, one thread, D = {args.dim}, forward + backward\n\n" + table(records) + "\n")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
