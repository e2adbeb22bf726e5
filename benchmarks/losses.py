"""Speed and peak memory of the loss kernels, against peers and the matrix-product floor, in one run.

    python benchmarks/losses.py                                   # N 256..8192, D 128 and 512 (~10-15 min, 2 cores)
    python benchmarks/losses.py --sizes 256,1024,4096,16384,65536 --dims 128,512 --repeats 3
    python benchmarks/losses.py --methods infonce,clip,floor --sizes 65536 --dims 256 --repeats 1

Forward + backward of the loss on random features, for every method:

- two views (N samples, 2N anchors, a [2N, 2N] matrix): contrastkit infonce, dcl, dclw, eqco, cacr
  (automatic path), infonce-dense (chunk_size=0), lightly's NTXentLoss, DCLLoss, DCLWLoss;
- image-text (N pairs, an [N, N] matrix, learnable logit scale): contrastkit cross_modal (clip,
  clip-dcl) and open_clip's ClipLoss (features normalised first, as the CLIP model does);
- floor-2v / floor-clip: the matrix products every one of them must do for that matrix (forward 1,
  backward 2: S = A B^T, S B, S^T A), timed in the same run, the faster of whole and row blocks.

Time: the best of --repeats calls after one warm-up call (--repeats 0: one call, no warm-up, for the
largest sizes). Memory: each (method, D) runs in a fresh
subprocess, sizes in increasing order, with glibc told to hand large blocks back to the system at
once (MALLOC_MMAP_THRESHOLD_, so freed memory leaves the resident set); the peak extra memory is the
process's peak resident set (VmHWM, reset through /proc/self/clear_refs just before the timed calls)
minus its resident set at that moment (inputs and gradient buffers already allocated), so it counts
every allocation of the call, torch's included (tracemalloc would miss them). On CUDA,
torch.cuda.max_memory_allocated minus the baseline. A method that holds the whole matrix and whose
memory (extrapolated quadratically from its last size, at least 4 float32 copies of the matrix) would
exceed --mem-limit-gib is not run and reported as OOM; so are the sizes a subprocess did not reach
because it died.

Writes out/losses.json, out/losses.md (the tables) and out/losses.png (time and memory against N).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TWO_VIEW = {"infonce", "dcl", "dclw", "eqco", "cacr", "infonce-dense", "lightly-ntxent", "lightly-dcl",
            "lightly-dclw", "floor-2v"}
IMAGE_TEXT = {"clip", "clip-dcl", "openclip", "floor-clip"}
METHODS = ["floor-2v", "infonce", "dcl", "dclw", "eqco", "cacr", "infonce-dense", "lightly-ntxent", "lightly-dcl",
           "lightly-dclw", "floor-clip", "clip", "clip-dcl", "openclip"]
# Methods that hold the whole matrix (and its gradient): skipped where that would not fit.
QUADRATIC = {"infonce-dense", "lightly-ntxent", "lightly-dcl", "lightly-dclw", "openclip"}
# contrastkit method -> the peer it is compared with
PEERS = {"infonce": "lightly-ntxent", "dcl": "lightly-dcl", "dclw": "lightly-dclw", "clip": "openclip",
         "clip-dcl": "openclip"}
GIB = 2**30


# ----------------------------------------------------------------------------- one measurement (subprocess)


def _step(method: str, n: int, d: int, device: str):
    """A closure doing one forward + backward of ``method`` at batch n, dimension d."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(0)
    if method.startswith("floor"):
        rows = 2 * n if method == "floor-2v" else n
        a, b = (torch.randn(rows, d, generator=g).to(device) for _ in range(2))
        return _floor(a, b)
    x, y = (torch.randn(n, d, generator=g).to(device).requires_grad_() for _ in range(2))
    if method in IMAGE_TEXT:
        scale = torch.tensor(1 / 0.07, device=device, requires_grad=True)
        if method == "openclip":
            from open_clip.loss import ClipLoss

            clip_loss = ClipLoss()
            return lambda: clip_loss(F.normalize(x, dim=-1), F.normalize(y, dim=-1), scale).backward()
        from contrastkit.losses import build_loss

        loss_fn = build_loss("infonce" if method == "clip" else "dcl")
        return lambda: loss_fn.cross_modal(x, y, logit_scale=scale).backward()
    if method.startswith("lightly"):
        from lightly.loss import DCLLoss, DCLWLoss, NTXentLoss

        loss_fn = {"lightly-ntxent": NTXentLoss(temperature=0.1), "lightly-dcl": DCLLoss(temperature=0.1),
                   "lightly-dclw": DCLWLoss(temperature=0.1, sigma=0.5)}[method]
    else:
        from contrastkit.losses import build_loss

        name, _, dense = method.partition("-")
        loss_fn = build_loss(name, **({"chunk_size": 0} if dense else {}))
    return lambda: loss_fn(x, y).backward()


def _floor(a, b):
    """The products a loss on S = a b^T must do (S, S b, S^T a): whole, or in row blocks that stay in
    cache (whichever the caller finds faster); the whole form only while S takes under 1 GiB."""
    import torch

    from contrastkit.losses.base import BLOCK_ELEMENTS

    rows = max(1, BLOCK_ELEMENTS // b.shape[0])

    def blocks():
        da, db = torch.empty_like(a), torch.zeros_like(b)
        for r0 in range(0, a.shape[0], rows):
            s = a[r0 : r0 + rows] @ b.T
            torch.mm(s, b, out=da[r0 : r0 + rows])
            db.addmm_(s.T, a[r0 : r0 + rows])

    def whole():
        s = a @ b.T
        return s @ b, s.T @ a

    return [blocks, whole] if a.shape[0] * b.shape[0] * 4 < GIB else [blocks]


def _rss() -> tuple[int, int]:
    """(current, peak) resident set of this process in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def worker(method: str, sizes: list[int], d: int, args) -> None:
    """Measure one method at increasing sizes; one JSON line per size."""
    import gc

    import torch

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    last = None
    for n in sizes:
        rows = 2 * n if method in TWO_VIEW else n
        estimate = max(4 * rows * rows * 4, last["peak_extra_bytes"] * (n / last["n"]) ** 2 if last else 0.0)
        if method in QUADRATIC and estimate > args.mem_limit_gib * GIB:
            print(json.dumps({"n": n, "status": "OOM", "note": f"needs ~{estimate / GIB:.0f} GiB (extrapolated)"}),
                  flush=True)
            continue
        autocast = torch.autocast(args.device.split(":")[0], dtype=getattr(torch, args.dtype),
                                  enabled=args.dtype != "float32")
        steps = _step(method, n, d, args.device)
        steps = steps if isinstance(steps, list) else [steps]
        best, peak = float("inf"), 0
        for step in steps:
            if args.repeats > 0:
                with autocast:
                    step()  # warm-up: lazy initialisation, gradient buffers
                sync()
            gc.collect()
            if cuda:
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            else:
                Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
                base = _rss()[0]
            for _ in range(max(1, args.repeats)):
                start = time.perf_counter()
                with autocast:
                    step()
                sync()
                best = min(best, time.perf_counter() - start)
            peak = max(peak, (torch.cuda.max_memory_allocated() if cuda else _rss()[1]) - base)
        del steps, step
        gc.collect()
        last = {"n": n, "status": "ok", "time_s": best, "peak_extra_bytes": peak, "load_avg_1min": os.getloadavg()[0]}
        print(json.dumps(last), flush=True)


# ----------------------------------------------------------------------------- the driver


def measure(method, d, args) -> list[dict]:
    """Run one method at every size in a fresh subprocess; sizes it did not reach are reported."""
    cmd = [sys.executable, __file__, "--worker", method, str(d), "--sizes", ",".join(map(str, args.sizes)),
           "--repeats", str(args.repeats), "--device", args.device, "--dtype", args.dtype,
           "--mem-limit-gib", str(args.mem_limit_gib)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    done = {}
    for line in proc.stdout:
        if line.startswith("{"):
            record = json.loads(line)
            done[record["n"]] = record
            yield {"method": method, "d": d, **record}
    err = proc.stderr.read().strip().splitlines()
    code = proc.wait()
    for n in args.sizes:
        if n not in done:
            why = "OOM" if code in (-9, 137) or any("memory" in e.lower() for e in err[-3:]) else "failed"
            yield {"method": method, "d": d, "n": n, "status": why, "note": (err[-1] if err else f"exit {code}")[:120]}


def run(args) -> list[dict]:
    from tqdm import tqdm

    records = []
    with tqdm(total=len(args.dims) * len(args.methods) * len(args.sizes), desc="losses", unit="run") as bar:
        for d in args.dims:
            for method in args.methods:
                for record in measure(method, d, args):
                    record.update(setting="two-view" if method in TWO_VIEW else "image-text", device=args.device,
                                  dtype=args.dtype)
                    records.append(record)
                    tqdm.write(_line(record))
                    bar.update()
    _ratios(records)
    return records


def _ratios(records):
    """Each contrastkit method's time over its peer's and over the floor of the same matrix."""
    by_key = {(r["method"], r["n"], r["d"]): r for r in records if r["status"] == "ok"}
    for r in records:
        if r["status"] != "ok" or r["method"].startswith("floor"):
            continue
        floor = by_key.get(("floor-2v" if r["setting"] == "two-view" else "floor-clip", r["n"], r["d"]))
        if floor:
            r["vs_floor"] = r["time_s"] / floor["time_s"]
        peer = PEERS.get(r["method"])
        if peer and (peer, r["n"], r["d"]) in by_key:
            r["vs_peer"] = r["time_s"] / by_key[peer, r["n"], r["d"]]["time_s"]
            r["peer"] = peer


def _line(r) -> str:
    if r["status"] != "ok":
        return f"{r['method']:>15} N={r['n']:<6} D={r['d']:<4} {r['status']} {r.get('note', '')}"
    extra = "".join(f" {k}={r[k]:.2f}" for k in ("vs_floor", "vs_peer") if k in r)
    return (f"{r['method']:>15} N={r['n']:<6} D={r['d']:<4} {r['time_s'] * 1e3:10.1f} ms "
            f"{r['peak_extra_bytes'] / 2**20:10.1f} MiB{extra}")


def markdown(records) -> str:
    lines = ["| setting | method | N | D | time (ms) | peak extra (MiB) | / floor | / peer |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(records, key=lambda r: (r["d"], r["setting"], r["n"], METHODS.index(r["method"]))):
        if r["status"] != "ok":
            lines.append(f"| {r['setting']} | {r['method']} | {r['n']} | {r['d']} | {r['status']} "
                         f"{r.get('note', '')} | | | |")
            continue
        peer = f"{r['vs_peer']:.2f} ({r['peer']})" if "vs_peer" in r else ""
        floor = f"{r['vs_floor']:.2f}" if "vs_floor" in r else ""
        lines.append(f"| {r['setting']} | {r['method']} | {r['n']} | {r['d']} | {r['time_s'] * 1e3:.1f} | "
                     f"{r['peak_extra_bytes'] / 2**20:.1f} | {floor} | {peer} |")
    return "\n".join(lines) + "\n"


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["d"] for r in records})
    fig, axes = plt.subplots(2, len(dims), figsize=(6 * len(dims), 8), squeeze=False)
    for col, d in enumerate(dims):
        for i, method in enumerate(METHODS):
            ok = sorted((r for r in records if r["method"] == method and r["d"] == d and r["status"] == "ok"),
                        key=lambda r: r["n"])
            if not ok:
                continue
            style = "--" if method.startswith(("lightly", "openclip")) else ":" if method.startswith("floor") else "-"
            ns = [r["n"] for r in ok]
            color = plt.cm.tab20(i)
            axes[0, col].plot(ns, [r["time_s"] for r in ok], style, marker="o", color=color, label=method)
            axes[1, col].plot(ns, [r["peak_extra_bytes"] / 2**20 for r in ok], style, marker="o", color=color,
                              label=method)
        for row, label in enumerate(["forward+backward time (s)", "peak extra memory (MiB)"]):
            ax = axes[row, col]
            ax.set(xscale="log", yscale="log", xlabel="N", ylabel=label, title=f"D = {d}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0, -1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--sizes", type=ints, default=[256, 1024, 4096, 8192])
    parser.add_argument("--dims", type=ints, default=[128, 512])
    parser.add_argument("--methods", type=lambda s: s.split(","), default=METHODS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="autocast dtype (contrastkit computes its scores in float32 regardless)")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for the runs (0: torch's default)")
    parser.add_argument("--mem-limit-gib", type=float, default=8.0)
    parser.add_argument("--out", default="runs/bench-losses")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.sizes, int(args.worker[1]), args)
        return
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = run(args)
    (out / "losses.json").write_text(json.dumps(records, indent=1))
    table = markdown(records)
    (out / "losses.md").write_text(table)
    plot(records, out / "losses.png")
    print(table)
    print(f"wrote {out / 'losses.json'}, {out / 'losses.md'}, {out / 'losses.png'}")


if __name__ == "__main__":
    main()
